"""TorchServe handler for text generation: the one class this file defines.

`tsbatch archive --handler examples/generate/gen_handler.py --extra-files examples/generate/gen_model.py
--handler-config examples/generate/handler.yaml --model-dir DIR --name gen` packages it with tsbatch.
The model's limits come from its own `model:` section of model-config.yaml (handler.yaml's), which
reaches load_model as `config.model`; tsbatch's `handler:` keys stay tsbatch's.
"""
from __future__ import annotations

from tsbatch.handlers.core.errors import ConfigError
from tsbatch.handlers.edge.tsbatch_handler import TsbatchHandler

LIMITS = {"max_prompt_tokens": 128, "max_new_tokens": 256}  # the model: keys this model reads, with defaults


def limits(section) -> list[int]:
    """The longest prompt and the most new tokens served, from the model: section, checked."""
    unknown = sorted(map(str, set(section) - set(LIMITS)))
    if unknown:
        raise ConfigError(f"model: unknown key(s) {unknown}; the generation model reads {sorted(LIMITS)}")
    values = {**LIMITS, **section}
    for name in LIMITS:
        value = values[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"model.{name} must be a positive integer, got {value!r}")
    return [values[name] for name in LIMITS]


class GenerationHandler(TsbatchHandler):
    def load_model(self, model_path, config, gpu_id):
        from gen_model import GenerationModel  # shipped beside this file (--extra-files)

        device = f"cuda:{gpu_id}" if gpu_id is not None and config.device != "cpu" else "cpu"
        return GenerationModel(model_path, device, *limits(config.model))
