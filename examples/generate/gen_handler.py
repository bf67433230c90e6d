"""TorchServe handler for text generation: the one class this file defines.

`tsbatch archive --handler examples/generate/gen_handler.py --extra-files examples/generate/gen_model.py
--handler-config examples/generate/handler.yaml --model-dir DIR --name gen` packages it with tsbatch.
The largest edges of handler.buckets are the longest prompt and the most new tokens served.
"""
from __future__ import annotations

from tsbatch.handlers.tsbatch_handler import TsbatchHandler


class GenerationHandler(TsbatchHandler):
    def load_model(self, model_path, config, gpu_id):
        from gen_model import GenerationModel  # shipped beside this file (--extra-files)

        device = f"cuda:{gpu_id}" if gpu_id is not None and config.device != "cpu" else "cpu"
        limits = [edges[-1] for edges in config.buckets] if config.buckets else (128, 256)
        return GenerationModel(model_path, device, *limits)
