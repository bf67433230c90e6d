"""Render config.properties and model-config.yaml from the templates in configs/.

Pure text in, text out, so tests and the CLI share one path and tests can read the output back.
"""
from __future__ import annotations

import copy
import os
import re
import string
from dataclasses import dataclass
from typing import Any, Mapping

import yaml

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
LOOPBACK = "127.0.0.1"

TOKEN_AUTH_OFF_REASON = (
    "every address is loopback-only and the registration API is off, so only processes on this "
    "host can reach TorchServe; turn it on (--token-auth) before exposing any port."
)
TOKEN_AUTH_ON_REASON = (
    "asked for with --token-auth: clients read keys from key_file.json in TorchServe's working "
    "directory and send 'Authorization: Bearer <key>'."
)


# The frontend JIT-compiles with C1 only. With both tiers (the JVM's default) C2's compiler threads
# run beside the passes for the first minute after a start: in a fresh server's first saturated 20 s
# the frontend took 0.45 of 2 cores against 0.26 (bench/results/frontend.md), and 0.39 against 0.15
# CPU seconds for the first five requests (first-request.md; their latency ratio was the same).
# Once compiled, C2's code costs ~0.35 ms less frontend CPU per request (docs/operations.md).
FRONTEND_JIT = ("-XX:TieredStopAtLevel=1",)
LOG_REASON = ("tsbatch's log4j2.xml leaves out TorchServe's lines per worker call (continuous mode calls a worker "
              "every few milliseconds while requests are in flight).")
JIT_REASON = ("C1 JIT only (-XX:TieredStopAtLevel=1): C2's compiler threads would take CPU from the model "
              "for the first minute after every start.")


@dataclass(frozen=True)
class ServerSettings:
    """What the generated config.properties sets; defaults are the safe ones."""

    model_store: str
    load_models: tuple[str, ...]
    host: str = LOOPBACK
    inference_port: int = 8080
    management_port: int = 8081
    metrics_port: int = 8082
    grpc_inference_port: int = 7070
    grpc_management_port: int = 7071
    token_auth: bool = False
    enable_model_api: bool = False
    max_request_size: int = 1 << 20
    max_response_size: int = 6553500
    metrics_config: str | None = None  # tsbatch's metrics yaml (install_metrics_config); None keeps TorchServe's
    log_config: str | None = None  # tsbatch's log4j2.xml (install_log_config); None keeps TorchServe's
    jvm_args: tuple[str, ...] = FRONTEND_JIT  # more of the frontend JVM's arguments (vmargs); () keeps the JVM's own
    tuned: tuple[tuple[str, str, str], ...] = ()  # (key, value, reason) chosen by archiver.tune


def render_properties(settings: ServerSettings) -> str:
    with open(os.path.join(CONFIGS, "config.properties")) as f:
        template = string.Template(f.read())
    store = os.path.abspath(settings.model_store)
    return template.substitute(
        host=settings.host,
        inference_port=settings.inference_port,
        management_port=settings.management_port,
        metrics_port=settings.metrics_port,
        grpc_inference_port=settings.grpc_inference_port,
        grpc_management_port=settings.grpc_management_port,
        model_store=store,
        load_models=",".join(settings.load_models),
        allowed_urls=_java_escape(allowed_urls_pattern(store)),
        enable_model_api=str(settings.enable_model_api).lower(),
        disable_token_authorization=str(not settings.token_auth).lower(),
        token_auth_word="on" if settings.token_auth else "off",
        token_auth_reason=TOKEN_AUTH_ON_REASON if settings.token_auth else TOKEN_AUTH_OFF_REASON,
        max_request_size=settings.max_request_size,
        max_response_size=settings.max_response_size,
        metrics_config_line=(f"metrics_config={os.path.abspath(settings.metrics_config)}"
                             if settings.metrics_config else "# metrics_config: TorchServe's default"),
        **_vmargs(settings),
    ) + render_tuned(settings.tuned)


def _vmargs(settings: ServerSettings) -> dict[str, str]:
    """The vmargs line (tsbatch's log4j2.xml and jvm_args), each part under its reason; a comment
    alone when both are left to TorchServe."""
    args = ([f"-Dlog4j.configurationFile=file://{os.path.abspath(settings.log_config)}"] if settings.log_config else [])
    args += list(settings.jvm_args)
    reasons = ([LOG_REASON] if settings.log_config else []) + ([JIT_REASON] if settings.jvm_args else [])
    if not args:
        return {"vmargs_lines": "# vmargs: TorchServe's default JVM arguments and log4j2.xml"}
    return {"vmargs_lines": "\n".join([f"# {reason}" for reason in reasons] + ["vmargs=" + " ".join(args)])}


TUNED_HEADER = ("# Chosen by `tsbatch tune` for this machine, each under its reason. Server-wide defaults: "
                "the model's model-config.yaml sets the same values and wins for it.")


def render_tuned(entries: tuple[tuple[str, str, str], ...], header: str = TUNED_HEADER) -> str:
    """key=value lines, each under a comment with its reason; nothing when nothing was tuned."""
    if not entries:
        return ""
    lines = [header]
    for key, value, reason in entries:
        lines += [f"# {_one_line(reason)}", f"{key}={_java_escape(str(value))}"]
    return "\n".join(lines) + "\n"


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def allowed_urls_pattern(store: str) -> str:
    """Only files directly in the model store: no sub-paths and no '..' (TorchServe 0.12 copies a
    matching URL into the store before it checks for '..')."""
    return "file://" + re.escape(store) + r"/(?!\.\.$)[^/]+"


def install_metrics_config(model_store: str) -> str:
    """Copy configs/metrics.yaml (TorchServe's own metrics plus tsbatch's) next to the archives."""
    import shutil

    os.makedirs(model_store, exist_ok=True)
    path = os.path.join(os.path.abspath(model_store), "metrics.yaml")
    shutil.copyfile(os.path.join(CONFIGS, "metrics.yaml"), path)
    return path


def install_log_config(model_store: str) -> str:
    """Copy configs/log4j2.xml (TorchServe's logging without its per-call lines) next to the archives."""
    import shutil

    os.makedirs(model_store, exist_ok=True)
    path = os.path.join(os.path.abspath(model_store), "log4j2.xml")
    shutil.copyfile(os.path.join(CONFIGS, "log4j2.xml"), path)
    return path


def _java_escape(value: str) -> str:
    """TorchServe reads config.properties with java.util.Properties, which eats one backslash."""
    return value.replace("\\", "\\\\")


def read_properties(text: str) -> dict[str, str]:
    """Parse config.properties text as java.util.Properties does for our keys: key=value lines,
    # and ! comments, and backslash escapes (a backslash keeps the character after it)."""
    values = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", "!")):
            continue
        key, _, value = line.partition("=")
        values[key.strip()] = re.sub(r"\\(.)", r"\1", value.strip())
    return values


def model_config(handler: Mapping[str, Any], frontend: Mapping[str, Any] | None = None,
                 model: Mapping[str, Any] | None = None) -> dict:
    """The model-config.yaml template with the handler section and frontend keys overridden, and
    a team model's own `model:` section when it has one."""
    with open(os.path.join(CONFIGS, "model-config.yaml")) as f:
        config = yaml.safe_load(f)
    config = copy.deepcopy(config)
    config.update(frontend or {})
    config["handler"] = {**config.get("handler", {}), **handler}
    if model:
        config["model"] = copy.deepcopy(dict(model))
    return config


def dump_model_config(config: Mapping[str, Any], header: str = "") -> str:
    body = yaml.safe_dump(dict(config), sort_keys=False)
    return (header + "\n" if header else "") + body


def render_yaml(config: Mapping[str, Any], comments: Mapping[tuple, str] | None = None, header: str = "") -> str:
    """YAML text of nested mappings with a `# reason` line above each key that has one.

    `comments` is keyed by the key's path, e.g. ("handler", "batch_caps", 16). PyYAML drops
    comments, so the block structure is written here and every value in flow style by PyYAML:
    yaml.safe_load of the text gives `config` back."""
    lines = [f"# {_one_line(line)}" for line in header.splitlines() if line.strip()]
    _emit(config, comments or {}, (), 0, lines)
    return "\n".join(lines) + "\n"


def _emit(mapping: Mapping[str, Any], comments: Mapping[tuple, str], path: tuple, depth: int, lines: list[str]) -> None:
    pad = "  " * depth
    for key, value in mapping.items():
        reason = comments.get(path + (key,))
        if reason:
            lines.append(f"{pad}# {_one_line(reason)}")
        if isinstance(value, Mapping) and value:
            lines.append(f"{pad}{_flow(key)}:")
            _emit(value, comments, path + (key,), depth + 1, lines)
        else:
            lines.append(f"{pad}{_flow(key)}: {_flow(value)}")


def _flow(value: Any) -> str:
    """One value in YAML flow style on one line (a one-item list, then its brackets removed)."""
    text = yaml.safe_dump([value], default_flow_style=True, width=1 << 30, allow_unicode=True).strip()
    return text[1:-1]
