"""tsbatch handlers: what runs inside a TorchServe worker, in four layers.

- core/: the pure decisions (buckets, cost, policy, isolation, replies, errors, the generation
  policy); imports neither torch nor TorchServe, nor the other layers.
- runtime/: what executes around the model inside a worker: lane threads, the Worker record,
  warmup, memory caps, CUDA-graph bookkeeping, the generation engine's loop.
- edge/: the TorchServe edge: the handler class, request parsing and answers, model-config.yaml's
  classes, metrics, siblings, the serving modes (edge/modes/), the generation handler.
- models/: the built-in models: the encoder (and its .mar entry file) and the generation runner.
api.py is the public Model API that teams' models import (tsbatch.handlers.api).
"""
