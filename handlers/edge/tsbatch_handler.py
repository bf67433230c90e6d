"""The handler every tsbatch model is served by: subclass it and return your Model (handlers/api.py).

`initialize` loads the model (`load_model`), warms every shape before READY and picks the serving
mode once (handlers/edge/modes/); `handle` delegates to it. Every mode runs the same stages
(handlers/edge/stages.py: prepare -> bucket -> batch -> forward with isolation -> answer) and never
raises on input: every request gets a result or its own JSON error and status. The built-in
EncoderHandler (handlers/models/encoder_handler.py) is one such subclass; TorchServe instantiates
the one class defined in the handler file it was given.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from dataclasses import replace
from typing import Callable

from tsbatch.handlers.api import Model, device_type
from tsbatch.handlers.core.buckets import Bucket
from tsbatch.handlers.core.isolate import Isolator
from tsbatch.handlers.core.policy import lane_threads, split_lanes
from tsbatch.handlers.edge import backend_socket, call_lines, frontend_warmup
from tsbatch.handlers.edge.config import HandlerConfig
from tsbatch.handlers.edge.metrics import Metrics
from tsbatch.handlers.edge.modes import make_mode, serving_mode
from tsbatch.handlers.edge.siblings import READY_MARGIN_S, Siblings, fit_threads, usable_cores
from tsbatch.handlers.runtime.memory import OOM_CAPS_FILE, apply_budget, load_caps
from tsbatch.handlers.runtime.worker import Worker

logger = logging.getLogger(__name__)

# Python hands the GIL to a waiting thread after this long (its default: 5 ms). A lane's pass
# gives the GIL up around every torch op and must get it back for the next one; with TorchServe's
# protocol loop and the other lane holding it in pure Python, the default let a short pass wait up
# to 5 ms at an op (measured: docs/experiments.md, "GIL switch interval").
LANE_SWITCH_INTERVAL_S = 0.0005


class TsbatchHandler:
    """Serves one model; configured by the `handler:` section of model-config.yaml."""

    def __init__(self):
        self.initialized = False
        self.worker: Worker | None = None
        self.mode = None  # handlers/edge/modes: one object per serving mode, chosen at load

    def load_model(self, model_path: str, config: HandlerConfig, gpu_id: int | None) -> Model:
        """Your model, loaded from `model_path` (the archive's model directory) on the GPU
        TorchServe assigned (`gpu_id`, None on CPU). Raise ConfigError for what is misconfigured."""
        raise NotImplementedError("subclass TsbatchHandler and return your Model from load_model()")

    def initialize(self, context) -> None:
        backend_socket.buffer_reads()  # TorchServe reads each field of a call with its own recv
        call_lines.quiet_calls(getattr(context, "metrics", None))  # and prints two lines per call
        if serving_mode(context.model_yaml_config or {}) == "default":
            self._initialize(context)  # its passes run on this thread, on the team warmup made
        else:
            _on_thread_that_ends(lambda: self._initialize(context))

    def _initialize(self, context) -> None:
        started = time.monotonic()
        yaml_config = context.model_yaml_config or {}
        model_dir = context.system_properties.get("model_dir")
        config = HandlerConfig.from_yaml(yaml_config.get("handler"), yaml_config.get("model"))
        # joined first: siblings see this worker long before it polls (continuous mode), and
        # workers of one model share the cores
        siblings = Siblings(model_dir).join()
        config = _fit_threads(config, yaml_config, siblings)
        gpu_id = context.system_properties.get("gpu_id")
        model = self.load_model(os.path.join(model_dir, config.model_dir), config,
                                int(gpu_id) if isinstance(gpu_id, (int, str)) and str(gpu_id).isdigit() else None)
        metrics = Metrics(getattr(context, "metrics", None), context.model_name, _gpu_sampler(model))
        _apply_memory_budget(config, model)
        # caps learned from out of memory by this model's workers so far (handlers/runtime/memory.py)
        caps_file = os.path.join(model_dir, OOM_CAPS_FILE)
        known = load_caps(caps_file)
        timeout = yaml_config.get("responseTimeout")
        self.worker = w = Worker(
            config, model, config.edges_for(model.max_length), metrics, siblings,
            caps={b: c for b, c in known.items() if c > 0}, caps_file=caps_file,
            unfit={bucket for bucket, cap in known.items() if cap == 0},
            batch_size=int(context.system_properties.get("batch_size") or 1),
            response_timeout=timeout if isinstance(timeout, int) and timeout > 1 else 120)
        mode = serving_mode(yaml_config)
        lanes = self._lanes() if mode != "default" else None
        if lanes:  # before warmup, so the profile is measured as passes will run
            sys.setswitchinterval(LANE_SWITCH_INTERVAL_S)
        if config.warmup:
            from tsbatch.handlers.runtime.warming import warm_up

            profile = warm_up(model, config, [e for e in w.edges if e not in w.unfit], w.batch_sizes, lanes,
                              context.model_name, model_dir, yaml_config.get("startupTimeout", 120), self._free_memory,
                              w.forward)
            w.warmed(profile)
            if profile.oom_caps:
                logger.warning("tsbatch warmup: batch caps learned from out of memory (bucket: largest batch that "
                               "fits; 0: none, those requests get 507): %s", profile.oom_caps)
            metrics.warmup(profile)
        for bucket in w.edges:  # every bucket's cap, learned from out of memory or not
            metrics.cap(bucket, 0 if bucket in w.unfit else w.cap_for(bucket))
        self.mode = make_mode(mode, w, lanes)  # its lanes, if any, warm on their own threads first
        model.ready()
        siblings.ready()  # from now on this worker polls for requests between calls
        if siblings.others(fresh=True):  # until they see it, siblings may still return calls part-answered
            time.sleep(READY_MARGIN_S)
        if config.fault_injection.enabled:
            logger.warning("fault injection is ON: %s", config.fault_injection)
        logger.info("tsbatch loaded %s mode=%s buckets=%s max_batch_tokens=%d %s in %.1fs",
                    type(model).__name__, mode, list(w.edges), config.max_batch_tokens, model.describe(),
                    time.monotonic() - started)
        if config.frontend_warmup:  # queued in the frontend until READY: pays its first-request costs
            frontend_warmup.send(config.frontend_warmup, context.model_name)
        self.initialized = True

    def handle(self, data: list, context):
        self.worker.metrics.handler_call()
        return self.mode.handle(data, context)  # async mode returns a coroutine: TorchServe awaits it

    def close(self) -> None:
        """Stop the mode's lane threads and leave the siblings' registry (tests, `tsbatch profile`;
        TorchServe ends a worker by ending its process)."""
        if self.mode is not None:
            self.mode.close()
            self.mode = None
        if self.worker is not None:
            self.worker.siblings.leave()

    # -- what tests, the bench and the archiver read
    @property
    def config(self) -> HandlerConfig:
        return self.worker.config

    @property
    def model(self) -> Model:
        return self.worker.model

    @property
    def edges(self) -> tuple[Bucket, ...]:
        return self.worker.edges

    @property
    def profile(self):
        return self.worker.profile

    @property
    def isolator(self) -> Isolator:
        return self.worker.isolator

    @property
    def siblings(self) -> Siblings:
        return self.worker.siblings

    def cap_for(self, bucket: Bucket) -> int:
        return self.worker.cap_for(bucket)

    # -- the worker's edges: lanes, timing, memory
    def _lanes(self) -> list[tuple[tuple[int, ...], int]]:
        """The scheduler modes' lanes (buckets each serves) and the intra-op threads each one gets:
        a share of the worker's, so two lanes busy at once never oversubscribe the cores (OpenMP
        teams that outnumber the cores spin against each other: warmup of 3 workers x 2 lanes x
        2 threads on 2 cores ran 5x slower than with 1 thread a lane)."""
        lanes = split_lanes(self.worker.edges, self.worker.config.long_lane_from)
        threads = lane_threads(self.worker.model.describe().get("torch_threads") or usable_cores(), len(lanes))
        return [(lane, threads) for lane in lanes]

    def _free_memory(self, shape, error) -> None:
        """After out of memory: give cached device memory back so the next shapes start clean."""
        if device_type(self.worker.model) == "cuda":
            import torch

            torch.cuda.empty_cache()


def _on_thread_that_ends(load: Callable[[], None]) -> None:
    """Run `load` (the model's loading and warmup, on the worker's threads) on a thread that
    ends after it, and raise what it raised. In the scheduled modes lanes run every pass; a
    multi-threaded pass on TorchServe's thread would leave it an OpenMP team that outlives it, and
    with a second team in the process (a lane borrowing the cores) GNU OpenMP's workers sleep
    between parallel regions: the lane's two-thread passes ran at their one-thread speed
    (bench/results/omp-pools.md)."""
    failed: list[BaseException] = []

    def run() -> None:
        try:
            load()
        except BaseException as error:  # noqa: BLE001 - raised again on TorchServe's thread
            failed.append(error)

    thread = threading.Thread(target=run, name="tsbatch-load")
    thread.start()
    thread.join()
    if failed:
        raise failed[0]


def _fit_threads(config: HandlerConfig, yaml_config: dict, siblings: Siblings) -> HandlerConfig:
    """Never more intra-op threads than this worker's share of the cores (handlers/edge/siblings.py)."""
    planned = yaml_config.get("minWorkers")
    workers = max(1 + siblings.others(fresh=True), planned if isinstance(planned, int) else 1)
    threads, why = fit_threads(config.torch_threads, usable_cores(), workers)
    if why:
        logger.warning("tsbatch threads: %s", why)
    return replace(config, torch_threads=threads)


def _device_index(model: Model) -> int:
    index = getattr(model.device, "index", None)
    if index is None and ":" in str(model.device):
        index = int(str(model.device).split(":")[1])
    return index or 0


def _apply_memory_budget(config: HandlerConfig, model: Model) -> None:
    if config.memory_budget is None:
        return
    if device_type(model) != "cuda":
        logger.warning("tsbatch: handler.memory_budget=%s is not enforced on %s: torch has no per-process "
                       "limit for host memory (out of memory still lowers caps, never fails the load)",
                       config.memory_budget, device_type(model))
        return
    import torch

    logger.info("tsbatch memory budget: %s", apply_budget(config.memory_budget, torch.cuda, _device_index(model)))


def _gpu_sampler(model: Model):
    if device_type(model) != "cuda":
        return None
    from tsbatch.handlers.edge.metrics import nvml_sampler

    return nvml_sampler([_device_index(model)])
