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


@dataclass(frozen=True)
class ServerSettings:
    """What the generated config.properties sets; defaults are the safe ones."""

    model_store: str
    load_models: tuple[str, ...]
    host: str = LOOPBACK
    inference_port: int = 8080
    management_port: int = 8081
    metrics_port: int = 8082
    token_auth: bool = False
    enable_model_api: bool = False
    max_request_size: int = 1 << 20
    max_response_size: int = 6553500


def render_properties(settings: ServerSettings) -> str:
    with open(os.path.join(CONFIGS, "config.properties")) as f:
        template = string.Template(f.read())
    store = os.path.abspath(settings.model_store)
    return template.substitute(
        host=settings.host,
        inference_port=settings.inference_port,
        management_port=settings.management_port,
        metrics_port=settings.metrics_port,
        model_store=store,
        load_models=",".join(settings.load_models),
        allowed_urls=_java_escape("file://" + re.escape(store) + "/.*"),
        enable_model_api=str(settings.enable_model_api).lower(),
        disable_token_authorization=str(not settings.token_auth).lower(),
        token_auth_word="on" if settings.token_auth else "off",
        token_auth_reason=TOKEN_AUTH_ON_REASON if settings.token_auth else TOKEN_AUTH_OFF_REASON,
        max_request_size=settings.max_request_size,
        max_response_size=settings.max_response_size,
    )


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


def model_config(handler: Mapping[str, Any], frontend: Mapping[str, Any] | None = None) -> dict:
    """The model-config.yaml template with the handler section and frontend keys overridden."""
    with open(os.path.join(CONFIGS, "model-config.yaml")) as f:
        config = yaml.safe_load(f)
    config = copy.deepcopy(config)
    config.update(frontend or {})
    config["handler"] = {**config.get("handler", {}), **handler}
    return config


def dump_model_config(config: Mapping[str, Any], header: str = "") -> str:
    body = yaml.safe_dump(dict(config), sort_keys=False)
    return (header + "\n" if header else "") + body
