"""tsbatch's built-in TorchServe handler: Hugging Face encoders (embedding, sequence and token
classification) from a local model directory.

TorchServe imports this file by its basename from the archive root, next to the `handlers/` and
`warmup/` packages, and instantiates its one class. Everything but loading the model is
TsbatchHandler's (handlers/edge/tsbatch_handler.py); the model is handlers/models/encoder.py's EncoderModel,
written against the same public API (handlers/api.py) as a team's own model.
"""
from __future__ import annotations

from tsbatch.handlers.api import Model
from tsbatch.handlers.edge.config import HandlerConfig
from tsbatch.handlers.edge.tsbatch_handler import TsbatchHandler


class EncoderHandler(TsbatchHandler):
    """Serves one encoder model; configured by the `handler:` section of model-config.yaml."""

    def load_model(self, model_path: str, config: HandlerConfig, gpu_id: int | None) -> Model:
        from tsbatch.handlers.models.encoder import EncoderModel  # torch stays at the edge, loaded only here

        return EncoderModel(config, model_path, gpu_id)
