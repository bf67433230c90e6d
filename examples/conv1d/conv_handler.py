"""TorchServe handler for the 1-D conv net: all a team writes besides its model is this class.

`tsbatch archive --handler examples/conv1d/conv_handler.py --extra-files examples/conv1d/conv_model.py
--model-dir DIR --name conv` packages it with tsbatch, profiles and tunes it like the built-in one.
TorchServe instantiates the one class this file defines.
"""
from __future__ import annotations

from tsbatch.handlers.edge.tsbatch_handler import TsbatchHandler


class ConvHandler(TsbatchHandler):
    def load_model(self, model_path, config, gpu_id):
        from conv_model import ConvModel  # shipped beside this file (--extra-files)

        device = f"cuda:{gpu_id}" if gpu_id is not None and config.device != "cpu" else "cpu"
        return ConvModel(model_path, device)
