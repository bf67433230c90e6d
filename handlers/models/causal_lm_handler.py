"""tsbatch's built-in TorchServe handler for text generation: any local causal-LM directory with
safetensors weights (`tsbatch archive --task generation`).

TorchServe imports this file by its basename from the archive root and instantiates its one class,
as it does the encoder's (encoder_handler.py). Everything is GenerationHandler's
(handlers/edge/generation_handler.py): the one decode loop per worker (handlers/runtime/
generation_engine.py) over handlers/models/generation_runner.py, served in TorchServe's async mode.
"""
from __future__ import annotations

from tsbatch.handlers.edge.generation_handler import GenerationHandler


class CausalLMHandler(GenerationHandler):
    """Serves one causal LM; configured by the `handler:` section of model-config.yaml."""
