"""One strategy object per serving mode, chosen once at load; `handle()` delegates to it.

- default (TorchServe's batching): handlers/edge/modes/default_mode.py
- continuous (`continuousBatching: true`, the shipped default): handlers/edge/modes/continuous_mode.py
- async (`asyncCommunication: true`): handlers/edge/modes/async_mode.py
The two scheduler modes share tsbatch's scheduler and lanes: handlers/edge/modes/scheduled.py.
"""
from __future__ import annotations

from tsbatch.handlers.core.errors import ConfigError


def serving_mode(yaml_config: dict) -> str:
    """"async", "continuous" or "default", from the frontend keys of model-config.yaml."""
    if yaml_config.get("asyncCommunication") is True and yaml_config.get("continuousBatching") is True:
        raise ConfigError("model-config.yaml sets both asyncCommunication and continuousBatching: TorchServe "
                          "cannot do both; keep continuousBatching (tsbatch's default) or asyncCommunication")
    if yaml_config.get("asyncCommunication") is True:
        return "async"
    if yaml_config.get("continuousBatching") is True:
        return "continuous"
    return "default"


def make_mode(name: str, worker, lanes):
    """The mode object for `name` (lanes: [(buckets, threads)] for the scheduler modes)."""
    if name == "default":
        from tsbatch.handlers.edge.modes.default_mode import DefaultMode

        return DefaultMode(worker)
    if name == "continuous":
        from tsbatch.handlers.edge.modes.continuous_mode import ContinuousMode

        return ContinuousMode(worker, lanes)
    from tsbatch.handlers.edge.modes.async_mode import AsyncMode

    return AsyncMode(worker, lanes)
