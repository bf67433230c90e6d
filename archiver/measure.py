"""`tsbatch profile`: load the handler in this process exactly as a TorchServe worker would, let it
warm every shape, and keep the latency profile it measured, plus what the tuner needs to know
about this machine (cores, GPUs, load time, memory).

The torch edge of the archiver: torch, transformers and TorchServe's Python package load only
when a profile is taken, so `tsbatch --help`, `tune` and `archive --profile` stay light.
"""
from __future__ import annotations

import logging
import os
import resource
import shutil
import sys
import tempfile
import time
from typing import Any, Callable, Mapping

from tsbatch.warmup.generation_profile import GenerationProfile
from tsbatch.warmup.profile import LatencyProfile

# The loggers whose records carry warmup's progress (a `tsbatch_warmup` dict attribute).
PROGRESS_LOGGERS = ("tsbatch.warmup.run", "tsbatch.handlers.runtime.warming",
                    "tsbatch.handlers.runtime.generation_warming")
ERROR_CHARS = 600  # transformers' load errors can be pages long: the start says what broke


class ProfileError(Exception):
    """The model could not be loaded or warmed in the handler; the message says why."""


def available_cores() -> int:
    """Cores this process may use: CPU affinity (what a worker fits its threads to), then a
    cgroup v2 CPU quota (containers)."""
    from tsbatch.handlers.edge.siblings import usable_cores

    cores = usable_cores()
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, int(int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cores)


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def make_context(archive_dir: str, name: str, model_yaml_config: Mapping[str, Any]):
    """A real ts.context.Context shaped as TorchServe's worker builds it for an unpacked archive.
    No metrics store: the profile is the measurement, and the worker's metrics cache (what the
    handler's metrics are written for) exists only inside TorchServe; None turns them off."""
    from ts.context import Context

    return Context(name, archive_dir, {"model": {"modelName": name}}, 1, None, "0.12.0",
                   metrics=None, model_yaml_config=dict(model_yaml_config))


def progress_line(event: Mapping[str, Any]) -> str:
    """One line of `tsbatch profile` output for a warmup event (warmup/run.py, handlers/runtime/warming.py)."""
    kind = event.get("event")
    if kind == "shape":
        what = f"{event['kind']} " if "kind" in event else ""  # generation's: prefill or decode
        return (f"warmup shape {event['number']} of {event['of']}: {what}batch {event['batch']} x {event['bucket']} "
                f"tokens: first {event['first_ms']:.1f} ms, median {event['median_ms']:.1f} ms ({event['runs']} runs)")
    if kind == "estimate":
        return f"warmup: {event['shapes']} shapes, estimated {event['seconds']:.1f}s"
    if kind == "done":
        return f"warmup done in {event['seconds']:.1f}s"
    return f"warmup: {dict(event)}"


class _Forward(logging.Handler):
    """Hands warmup's progress events to the caller's callback (the CLI prints them); reads the
    record's `tsbatch_warmup` dict, never the message text."""

    def __init__(self, progress: Callable[[str], None]):
        super().__init__(logging.INFO)
        self.progress = progress

    def emit(self, record: logging.LogRecord) -> None:
        try:
            event = getattr(record, "tsbatch_warmup", None)
            if isinstance(event, Mapping):
                self.progress(progress_line(event))
        except Exception:  # noqa: BLE001 - progress output must never fail a profile
            self.handleError(record)


def profile_model(model_dir: str, name: str, model_yaml_config: Mapping[str, Any],
                  progress: Callable[[str], None] = lambda _: None, handler_file: str | None = None,
                  extra_files: Mapping[str, str] | None = None) -> LatencyProfile | GenerationProfile:
    """Initialize the handler on `model_dir` with this model-config.yaml (its handler section must
    have warmup on) and return the profile, its environment completed with this machine's facts:
    a LatencyProfile from an encoder handler, a GenerationProfile from the generation handler
    (`task: generation` in the handler section)."""
    handler_section = model_yaml_config.get("handler") or {}
    if handler_section.get("warmup") is False:
        raise ProfileError("handler.warmup is false: the profile is what warmup measures, so it must stay on")
    root = tempfile.mkdtemp(prefix="tsbatch-profile-")
    forward = _Forward(progress)
    saved_levels = {}
    for logger_name in PROGRESS_LOGGERS:
        logger = logging.getLogger(logger_name)
        saved_levels[logger_name] = logger.level
        logger.setLevel(logging.INFO)
        logger.addHandler(forward)
    try:
        os.symlink(os.path.abspath(model_dir), os.path.join(root, "model"))
        if handler_file:  # laid out as the archive's root, which TorchServe puts on sys.path
            for archive_name, local in {**(extra_files or {}), os.path.basename(handler_file): handler_file}.items():
                os.symlink(os.path.abspath(local), os.path.join(root, archive_name))
            sys.path.insert(0, root)
            handler_file = os.path.join(root, os.path.basename(handler_file))
        context = make_context(root, name, model_yaml_config)
        started = time.perf_counter()
        handler = _initialize(context, model_dir, handler_file, handler_section.get("task"))
        total = time.perf_counter() - started
        profile = handler.profile
        warmed = profile is not None and (profile.prefill if isinstance(profile, GenerationProfile) else profile.shapes)
        if not warmed:
            raise ProfileError(f"the handler warmed no shapes for {model_dir}: check the handler configuration")
        profile.environment.update(
            load_seconds=round(max(0.0, total - profile.warmup_seconds), 3),
            worker_torch_threads=handler_section.get("torch_threads"),
            cpu_count=available_cores(),
            gpu_count=gpu_count(),
            peak_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            profiled_by="tsbatch profile",
        )
        handler.close()  # its lane threads end here
        return profile
    finally:
        for logger_name, level in saved_levels.items():
            logging.getLogger(logger_name).removeHandler(forward)
            logging.getLogger(logger_name).setLevel(level)
        if root in sys.path:
            sys.path.remove(root)
        shutil.rmtree(root, ignore_errors=True)


def handler_class(handler_file: str | None, task: str | None = None):
    """The handler TorchServe would instantiate: the one class a team's handler file defines (a
    TsbatchHandler subclass), or tsbatch's own for the task (CausalLMHandler for generation,
    EncoderHandler for the rest)."""
    if handler_file is None:
        from tsbatch.handlers.edge.generation_api import TASK as GENERATION

        if task == GENERATION:
            from tsbatch.handlers.models.causal_lm_handler import CausalLMHandler

            return CausalLMHandler
        from tsbatch.handlers.models.encoder_handler import EncoderHandler

        return EncoderHandler
    import importlib.util
    import inspect

    from tsbatch.handlers.edge.tsbatch_handler import TsbatchHandler

    module_name = os.path.splitext(os.path.basename(handler_file))[0]
    spec = importlib.util.spec_from_file_location(module_name, handler_file)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as error:  # noqa: BLE001 - whatever the team's file raises, say where
        raise ProfileError(f"{handler_file} failed to import: {type(error).__name__}: {error}") from error
    defined = [c for _, c in inspect.getmembers(module, inspect.isclass) if c.__module__ == module_name]
    if len(defined) != 1 or not issubclass(defined[0], TsbatchHandler):
        raise ProfileError(f"{handler_file} must define exactly one class, a subclass of "
                           f"tsbatch.handlers.edge.tsbatch_handler.TsbatchHandler (TorchServe instantiates the one class it "
                           f"finds); found {[c.__name__ for c in defined]}")
    return defined[0]


def _initialize(context, model_dir: str, handler_file: str | None = None, task: str | None = None):
    handler = handler_class(handler_file, task)()
    try:
        handler.initialize(context)
    except Exception as error:  # noqa: BLE001 - any model file can fail to load in its own way
        message = " ".join(f"{type(error).__name__}: {error}".split())
        if len(message) > ERROR_CHARS:
            message = message[:ERROR_CHARS] + " ..."
        raise ProfileError(f"the model in {model_dir} failed to load in the handler: {message}") from error
    return handler
