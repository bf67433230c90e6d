"""The packaging pipeline behind the CLI: profile on this machine (or take a profile from the
target), tune, and build the .mar with its model-config.yaml and a config.properties.

The CLI maps its flags to these functions and prints; nothing here prints. Profiling is the
only step that loads torch (archiver.measure, imported when a profile is taken).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping

import yaml

from tsbatch.archiver import kserve
from tsbatch.archiver.package import ArchiveError, ArchiveSpec, build_archive, check_model_dir, entry_for
from tsbatch.archiver.properties import (
    LOOPBACK,
    ServerSettings,
    install_metrics_config,
    install_log_config,
    model_config,
    render_properties,
    render_yaml,
)
from tsbatch.archiver.tune import Machine, TuneError, Tuning, frontend_keys, plan_workers, tune
from tsbatch.archiver.tune_generation import (BUCKET_TUNING, DEFAULT_TPOT_MS, DEFAULT_TTFT_MS, MODE,
                                              GenerationTuning, plan_generation, threads_per_worker)
from tsbatch.archiver.simulate import Overheads
from tsbatch.archiver.tune_sim import search
from tsbatch.handlers.core.errors import ConfigError
from tsbatch.handlers.edge.config import FrontendConfig, HandlerConfig, check_handler
from tsbatch.handlers.edge.generation_api import TASK as GENERATION
from tsbatch.warmup.generation_profile import GENERATION_PROFILE_FILE, GenerationProfile
from tsbatch.warmup.profile import PROFILE_FILE, LatencyProfile

Progress = Callable[[str], None]
PROFILE_STARTUP_TIMEOUT = 3600  # profiling has no TorchServe to time out; keep warmup's warning quiet


@dataclass(frozen=True)
class Request:
    """What to build: the model, the handler settings the user gave, and how to tune."""

    model_dir: str
    name: str
    section: Mapping[str, Any]  # the handler: section before tuning (task, device, --handler-config)
    target_ms: float
    cores: int | None = None  # the target machine's, when not this one's
    gpus: int | None = None
    overrides: Mapping[str, Any] = field(default_factory=dict)  # frontend keys from the command line
    mode: str = "continuous"  # how requests reach tsbatch's scheduler: "continuous" or "async"
    handler_file: str | None = None  # a team's own handler (absolute path); None: the built-in encoder
    extra_files: tuple[str, ...] = ()  # what that handler imports, placed beside it (absolute paths)
    model_section: Mapping[str, Any] = field(default_factory=dict)  # model-config.yaml's model:, for that handler's model
    workload: str | None = None  # what tune simulates candidates on (archiver/tune_sim.py); None: analytic only
    overheads: str | None = None  # a bench/overheads.py report of the serving machine; None: the simulator's defaults
    ttft_ms: float = DEFAULT_TTFT_MS  # --task generation: the time-to-first-token target token_budget is tuned for
    tpot_ms: float = DEFAULT_TPOT_MS  # and the time-per-output-token target max_running is tuned for

    def shipped(self) -> dict[str, str]:
        """Archive-root name -> local path of the team's extra files."""
        return {os.path.basename(path.rstrip(os.sep)): path for path in self.extra_files}


@dataclass(frozen=True)
class Built:
    """What a command wrote (paths) and the model config it wrote."""

    properties: str
    config: dict
    mar: str | None = None
    config_path: str | None = None  # model-config.yaml when written outside an archive (`tune`)
    tuning: Tuning | None = None
    profile_path: str | None = None
    manifest: str | None = None


def config_sections(task: str | None, device: str | None = None,
                    handler_config: str | None = None) -> tuple[dict, dict]:
    """The handler: and model: sections from the flags and a YAML file (the file wins), validated.
    The file holds handler keys, or model-config.yaml's `handler:` and `model:` sections."""
    section: dict[str, Any] = {"task": task} if task else {}
    if device:
        section["device"] = device
    model: dict[str, Any] = {}
    if handler_config:
        with open(handler_config) as f:
            extra = yaml.safe_load(f)
        if extra is not None and not isinstance(extra, Mapping):
            raise ConfigError(f"{handler_config} must hold a mapping of handler settings, got {extra!r}")
        extra = dict(extra or {})
        if set(extra) & set(FrontendConfig.SECTIONS):
            outside = sorted(map(str, set(extra) - set(FrontendConfig.SECTIONS)))
            if outside:
                raise ConfigError(f"{handler_config} has handler: or model: sections and keys outside them {outside}: "
                                  "put handler keys under handler:")
            for name in FrontendConfig.SECTIONS:
                if extra.get(name) is not None and not isinstance(extra[name], Mapping):
                    raise ConfigError(f"{handler_config}: {name}: must be a mapping, got {extra[name]!r}")
            model = dict(extra.get("model") or {})
            extra = dict(extra.get("handler") or {})
        section.update(extra)
    check_handler(section, model)
    return section, model


def load_profile(path: str) -> LatencyProfile:
    if is_generation_profile(path):
        raise TuneError(f"{path} is a generation profile: tune it with --task generation (or leave --task out)")
    try:
        return LatencyProfile.load(path)
    except (ValueError, TypeError, KeyError, AttributeError) as error:
        raise TuneError(f"{path} is not a latency profile written by `tsbatch profile`: {error}") from None


def load_generation_profile(path: str) -> GenerationProfile:
    try:
        return GenerationProfile.load(path)
    except (ValueError, TypeError, KeyError, AttributeError) as error:
        raise TuneError(f"{path} is not a generation profile written by `tsbatch profile --task generation`: "
                        f"{error}") from None


def is_generation_profile(path: str) -> bool:
    """The file is a generation profile (its "kind"), so `tsbatch tune --profile` needs no --task."""
    import json

    try:
        with open(path) as f:
            data = json.load(f)
    except ValueError:
        return False
    return isinstance(data, dict) and data.get("kind") == GENERATION


def this_machine() -> Machine:
    from tsbatch.archiver.measure import available_cores, gpu_count

    return Machine(available_cores(), gpu_count())


def profile_here(model_dir: str, name: str, section: Mapping[str, Any], mode: str = "continuous",
                 progress: Progress = lambda _: None, handler_file: str | None = None,
                 extra_files: Mapping[str, str] | None = None,
                 model_section: Mapping[str, Any] | None = None) -> LatencyProfile | GenerationProfile:
    """Load and warm the handler in this process with the threads tune will give each worker here:
    a LatencyProfile, or a GenerationProfile for `task: generation` (in async mode, its only one)."""
    generation = section.get("task") == GENERATION
    check_model_dir(model_dir, hugging_face=handler_file is None, causal_lm=generation)  # before torch loads
    from tsbatch.archiver.measure import profile_model

    machine = this_machine()
    device = section.get("device", "auto")
    use_gpu = str(device).startswith("cuda") or (device == "auto" and machine.gpus > 0)
    handler = dict(section)
    handler["warmup"] = handler.get("warmup", True)
    handler.pop("frontend_warmup", None)  # no TorchServe here to send it to
    if generation:
        mode = MODE
    if "torch_threads" not in handler:
        handler["torch_threads"] = (threads_per_worker(machine, use_gpu) if generation
                                    else plan_workers(machine, use_gpu)[1].value)
    progress(f"profiling {model_dir} on {machine.cores} cores, {machine.gpus} GPU(s), "
             f"{handler['torch_threads']} torch threads per worker")
    yaml_config = {"handler": handler, "startupTimeout": PROFILE_STARTUP_TIMEOUT,  # the mode decides the lanes' threads
                   "continuousBatching": mode == "continuous", "asyncCommunication": mode == "async"}
    if model_section:
        yaml_config["model"] = dict(model_section)
    return profile_model(model_dir, name, yaml_config, progress, handler_file, extra_files)


def machine_for(profile: LatencyProfile, cores: int | None, gpus: int | None) -> tuple[Machine, str]:
    """The machine to tune for: flags first, then what the profile recorded, then this machine."""
    env = profile.environment
    source = "from the command line"
    if cores is None:
        cores = env.get("cpu_count") if isinstance(env.get("cpu_count"), int) else None
        source = "as the profile recorded" if cores is not None else source
    if cores is None:
        from tsbatch.archiver.measure import available_cores

        cores, source = available_cores(), "this machine's (the profile does not record them)"
    if gpus is None:
        gpus = env.get("gpu_count") if isinstance(env.get("gpu_count"), int) else 0
    return Machine(cores, gpus), source


def tune_for(request: Request, profile: LatencyProfile, mode: str | None = None) -> tuple[Tuning, str]:
    machine, source = machine_for(profile, request.cores, request.gpus)
    config = HandlerConfig.from_yaml(request.section)
    mode = mode or request.mode
    tuning = tune(profile, request.target_ms, machine, config, mode, fixed=request.section.keys())
    if request.workload and mode == "continuous":  # the simulator models continuous mode's calls
        overheads = Overheads.from_report(request.overheads) if request.overheads else None
        tuning = search(tuning, profile, request.section, request.workload, overheads)
    return tuning, source


def tuned_config(request: Request, tuning: Tuning, header: str) -> tuple[dict, str]:
    """model-config.yaml as a dict and as commented text: tuned values, then command-line overrides."""
    handler = {**request.section, **tuning.handler_values()}
    frontend = {**tuning.frontend_values(), **request.overrides}
    raised_max = frontend["maxWorkers"] < frontend["minWorkers"]
    if raised_max:  # --workers above the tuned count: TorchServe needs maxWorkers >= minWorkers
        frontend["maxWorkers"] = frontend["minWorkers"]
    merged = model_config(handler, frontend, request.model_section)
    config = {k: v for k, v in merged.items() if k not in FrontendConfig.SECTIONS}
    config.update({k: merged[k] for k in FrontendConfig.SECTIONS if k in merged})  # sections last
    comments = tuning.comments()
    for key in request.overrides:
        tuned = tuning.frontend.get(key)
        comments[(key,)] = "set on the command line" + (f" (tune chose {tuned.value})" if tuned else "")
    if raised_max:
        comments[("maxWorkers",)] = "as many as minWorkers, which the command line set above the tuned count"
    return config, render_yaml(config, comments, header)


def profile_header(request: Request, tuning: Tuning, profile: LatencyProfile, source: str) -> str:
    """model-config.yaml's header for a configuration tuned from a latency profile."""
    env = profile.environment
    header = (f"model-config.yaml written by tsbatch, tuned for a p99 target of {request.target_ms:g} ms on "
              f"{tuning.machine.cores} cores and {tuning.machine.gpus} GPU(s) ({source}).\n"
              f"From the latency profile of {profile.model!r} ({env.get('device', '?')}, "
              f"{env.get('worker_torch_threads') or env.get('torch_threads', '?')} torch threads per worker, "
              f"{len(profile.shapes)} shapes), shipped as "
              f"{PROFILE_FILE} in this archive. Each tuned value has its reason on the line above it.")
    if tuning.simulated:
        header += (f"\nCandidates simulated on workload {tuning.workload!r} (capacity req/s within the target; short p99 ms "
                   f"at {tuning.reference_rate:g} req/s), the chosen first:\n" + "\n".join(simulated_lines(tuning)))
    return header


def simulated_lines(tuning: Tuning) -> list[str]:
    """One line per candidate the simulator served, the chosen one first."""
    rows = sorted(tuning.simulated, key=lambda c: c.name != tuning.chosen)
    return [f"  {c.name}: {c.capacity:g} req/s" + (f", short p99 {c.short_p99_ms:g} ms" if c.short_p99_ms is not None else "")
            + (f", {c.workers} workers" if c.workers > 1 else "") for c in rows]


def _profile_file(profile: LatencyProfile, directory: str, name: str) -> str:
    path = os.path.join(directory, f"{name}.{PROFILE_FILE}")
    os.makedirs(directory, exist_ok=True)
    profile.save(path)
    return path


def _obtain_profile(request: Request, profile_path: str | None, progress: Progress) -> LatencyProfile:
    if profile_path:
        check_model_dir(request.model_dir, hugging_face=request.handler_file is None)
        return load_profile(profile_path)
    return profile_here(request.model_dir, request.name, request.section, request.mode, progress,
                        request.handler_file, request.shipped(), request.model_section)


def is_generation(request: Request) -> bool:
    """The built-in generation handler serves this request's model (`--task generation`)."""
    return request.section.get("task") == GENERATION


def refuse_generation(request: Request, what: str) -> None:
    if is_generation(request):
        raise TuneError(f"{what} does not serve --task generation yet: its KServe layout serves the encoder's v1 and "
                        "v2 requests in continuous mode, and the generation handler serves its own in async mode "
                        "only; build it with tsbatch archive --task generation")


def generation_plan(request: Request, profile: GenerationProfile | None = None) -> tuple[GenerationTuning, str]:
    """The generation archive's settings for the target machine (flags first, then the profile's,
    else this one), tuned from the profile when there is one; and where the machine came from."""
    config = check_handler(request.section)
    if profile is not None:
        machine, source = machine_for(profile, request.cores, request.gpus)
    else:
        cores, gpus, source = request.cores, request.gpus, "from the command line"
        if cores is None or gpus is None:
            from tsbatch.archiver.measure import available_cores, gpu_count

            cores = available_cores() if cores is None else cores
            gpus = (gpu_count() if config.device == "auto" else 0) if gpus is None else gpus
            source = "this machine's" if request.cores is None else source
        machine = Machine(cores, gpus)
    tuning = plan_generation(machine, config, fixed=set(request.section) - {"task"}, ttft_ms=request.ttft_ms,
                             tpot_ms=request.tpot_ms, profile=profile)
    return tuning, source


def generation_header(tuning: GenerationTuning, profile: GenerationProfile | None = None, source: str = "",
                      kept: str = f"shipped as {GENERATION_PROFILE_FILE} in this archive") -> str:
    """model-config.yaml's header for the generation handler: what it was tuned from, or that it was not."""
    where = (f"model-config.yaml written by tsbatch for the built-in generation handler (task generation) on "
             f"{tuning.machine.cores} cores and {tuning.machine.gpus} GPU(s)" + (f" ({source})" if source else "")
             + ", served in TorchServe's async mode.\n")
    if profile is None:
        return where + f"Its values are {tuning.skipped}. Each value has its reason on the line above it."
    env = profile.environment
    return (where + f"token_budget and max_running tuned for a time to first token of {tuning.ttft_ms:g} ms and a time "
            f"per output token of {tuning.tpot_ms:g} ms from the generation profile of {profile.model!r} "
            f"({env.get('device', '?')}, {env.get('torch_threads', '?')} torch threads, {len(profile.prefill)} prefill "
            f"shapes, {len(profile.decode)} decode batch sizes), {kept}; "
            f"{BUCKET_TUNING}. Each value has its reason on the line above it.")


def _archive_generation(request: Request, out: str, settings: Mapping[str, Any], profile_path: str | None,
                        no_tune: bool, progress: Progress) -> Built:
    """A generation archive: the same build as the encoder's, its settings from tune_generation,
    tuned from a generation profile (measured here, or --profile) unless no_tune."""
    if request.handler_file:
        raise ArchiveError("--task generation is the built-in generation handler: leave out --handler, or leave out "
                           "--task to serve your own handler")
    if request.mode != MODE:
        raise TuneError(f"--mode {request.mode}: the generation handler serves in async mode only (leave --mode out)")
    check_model_dir(request.model_dir, causal_lm=True)  # before anything is staged
    profile = None
    if profile_path:
        profile = load_generation_profile(profile_path)
    elif not no_tune:
        profile = profile_here(request.model_dir, request.name, request.section, MODE, progress)
    tuning, source = generation_plan(request, profile)
    config, text = tuned_config(request, tuning, generation_header(tuning, profile, source))
    kept = None
    if profile is not None:
        kept = os.path.join(out, f"{request.name}.{GENERATION_PROFILE_FILE}")
        os.makedirs(out, exist_ok=True)
        profile.save(kept)
    mar = build_archive(_spec(request, config, out, text, kept, GENERATION_PROFILE_FILE), progress)
    properties = _write_properties(out, request, settings, tuning.property_entries())
    return Built(properties, config, mar, tuning=tuning, profile_path=kept)


def warming_the_frontend(request: Request, settings: Mapping[str, Any]) -> Request:
    """The request with handler.frontend_warmup set to the inference address config.properties
    names, so each worker sends its few warm requests through the frontend as it goes READY
    (handlers/edge/frontend_warmup.py); not where the user set it, nor with token authorization
    (the worker holds no key)."""
    if "frontend_warmup" in request.section or settings.get("token_auth"):
        return request
    port = settings.get("inference_port") or ServerSettings.inference_port
    return replace(request, section={**request.section, "frontend_warmup": f"http://{LOOPBACK}:{port}"})


def _write_properties(out: str, request: Request, settings: Mapping[str, Any], tuned=()) -> str:
    properties = os.path.join(out, "config.properties")
    _write(properties, render_properties(ServerSettings(model_store=out, load_models=(f"{request.name}.mar",),
                                                        metrics_config=install_metrics_config(out),
                                                        log_config=install_log_config(out), tuned=tuned, **settings)))
    return properties


def archive(request: Request, out: str, settings: Mapping[str, Any], profile_path: str | None = None,
            no_tune: bool = False, progress: Progress = lambda _: None) -> Built:
    """model_store/NAME.mar and model_store/config.properties, tuned unless no_tune. A generation
    model (`--task generation`) is tuned by tune_generation from a generation profile."""
    if is_generation(request):
        return _archive_generation(request, out, settings, profile_path, no_tune, progress)
    if no_tune:
        request = warming_the_frontend(request, settings)
        held = HandlerConfig.from_yaml(request.section).held
        config = model_config(request.section, {**frontend_keys(request.mode, held), **request.overrides},
                              request.model_section)
        mar = build_archive(_spec(request, config, out), progress)
        return Built(_write_properties(out, request, settings), config, mar)
    profile = _obtain_profile(request, profile_path, progress)
    tuning, source = tune_for(request, profile)
    request = warming_the_frontend(request, settings)
    config, text = tuned_config(request, tuning, profile_header(request, tuning, profile, source))
    kept = _profile_file(profile, out, request.name)
    mar = build_archive(_spec(request, config, out, text, kept), progress)
    properties = _write_properties(out, request, settings, tuning.property_entries())
    return Built(properties, config, mar, tuning=tuning, profile_path=kept)


def export_kserve(request: Request, out: str, storage_uri: str | None = None, profile_path: str | None = None,
                  no_tune: bool = False, bind: str = "127.0.0.1", progress: Progress = lambda _: None) -> Built:
    """OUT/config/config.properties, OUT/model-store/NAME.mar and OUT/inferenceservice.yaml."""
    refuse_generation(request, "tsbatch export")
    paths = kserve.layout(out, request.name)
    storage_uri = kserve.check_storage_uri(storage_uri or f"pvc://tsbatch-models/{kserve.k8s_name(request.name)}")
    store = os.path.dirname(paths.mar)
    kserve.check_store(paths)  # before spending a build on it
    # tsbatch reads KServe's request shapes itself (handlers/edge/envelopes.py), so the pod batches as
    # the shipped archive does: continuous mode, tsbatch's scheduler
    mode = frontend_keys("continuous")
    if no_tune:
        request = warming_the_frontend(request, {"inference_port": kserve.TS_PORT})  # the pod's TorchServe
        config = model_config(request.section, {**mode, **request.overrides}, request.model_section)
        mar = build_archive(_spec(request, config, store), progress)
        tuned, profile_file = (), None
        resources = kserve.resources_for(config.get("minWorkers", 1), 1, 0, None, tuned=False)
        tuning = None
    else:
        profile = _obtain_profile(request, profile_path, progress)
        tuning, source = tune_for(request, profile, mode="continuous")
        request = warming_the_frontend(request, {"inference_port": kserve.TS_PORT})
        config, text = tuned_config(request, tuning, profile_header(request, tuning, profile, source))
        profile_file = _profile_file(profile, out, request.name)
        mar = build_archive(_spec(request, config, store, text, profile_file), progress)
        tuned = tuning.property_entries()
        gpus = tuning.properties["number_of_gpu"].value
        resources = kserve.resources_for(config["minWorkers"], tuning.handler["torch_threads"].value, gpus,
                                         profile.environment.get("peak_rss_mb"))
    install_metrics_config(os.path.dirname(paths.properties))  # config/metrics.yaml, as the runtime mounts it
    written = kserve.write_layout(out, request.name,
                                  kserve.render_properties(request.name, config, tuned, bind=bind, metrics_config=True),
                                  kserve.inference_service(request.name, storage_uri, resources))
    return Built(written.properties, config, mar, tuning=tuning, profile_path=profile_file, manifest=written.manifest)


def _spec(request: Request, config: dict, store: str, text: str = "", profile_file: str | None = None,
          profile_name: str = PROFILE_FILE) -> ArchiveSpec:
    """What build_archive packs, the same for archive and export: the request's handler (a team's
    own, or the built-in encoder) with its extra files, the profile when there is one (as
    `profile_name`), and model-config.yaml once FrontendConfig has checked it."""
    FrontendConfig.from_yaml(config)
    extra = {**request.shipped(), **({profile_name: profile_file} if profile_file else {})}
    return ArchiveSpec(request.model_dir, request.name, config, store, extra_files=extra, config_text=text,
                       handler=request.handler_file or entry_for(request.section.get("task")))


def profile_to(request: Request, path: str,
               progress: Progress = lambda _: None) -> LatencyProfile | GenerationProfile:
    """`tsbatch profile`: take the profile here (a generation profile for --task generation) and
    write it to path."""
    if is_generation(request) and request.mode != MODE:
        raise TuneError(f"--mode {request.mode}: the generation handler serves in async mode only (leave --mode out)")
    profile = profile_here(request.model_dir, request.name, request.section, request.mode, progress,
                           request.handler_file, request.shipped(), request.model_section)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    profile.save(path)
    return profile


def tune_to(request: Request, profile_path: str, out: str, settings: Mapping[str, Any]) -> Built:
    """`tsbatch tune`: write OUT/model-config.yaml and OUT/config.properties from a profile."""
    if is_generation(request):
        profile = load_generation_profile(profile_path)
        tuning, source = generation_plan(request, profile)
        header = generation_header(tuning, profile, source, kept=f"read from {profile_path}")
        config, text = tuned_config(request, tuning, header)
    else:
        profile = load_profile(profile_path)
        tuning, source = tune_for(request, profile)
        request = warming_the_frontend(request, settings)
        config, text = tuned_config(request, tuning, profile_header(request, tuning, profile, source))
    os.makedirs(out, exist_ok=True)
    config_path = os.path.join(out, "model-config.yaml")
    _write(config_path, text)
    properties = os.path.join(out, "config.properties")
    _write(properties, render_properties(ServerSettings(model_store=out, load_models=(f"{request.name}.mar",),
                                                        tuned=tuning.property_entries(), **settings)))
    return Built(properties, config, config_path=config_path, tuning=tuning, profile_path=profile_path)


def _write(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)
