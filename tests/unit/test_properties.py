"""tsbatch.archiver.properties: the generated config.properties is safe by default; model-config.yaml merges."""
from __future__ import annotations

import os
import re
from urllib.parse import urlsplit

import pytest
import yaml

from tsbatch.archiver.properties import (
    CONFIGS,
    FRONTEND_JIT,
    LOOPBACK,
    ServerSettings,
    dump_model_config,
    model_config,
    read_properties,
    render_properties,
)
from tsbatch.handlers.edge.config import HandlerConfig

pytestmark = pytest.mark.unit

ADDRESSES = ("inference_address", "management_address", "metrics_address")


@pytest.fixture
def store(tmp_path) -> str:
    path = tmp_path / "model_store"
    path.mkdir()
    return str(path)


def render(store: str, **overrides) -> dict[str, str]:
    settings = ServerSettings(model_store=store, load_models=("minilm.mar",), **overrides)
    return read_properties(render_properties(settings))


# -- config.properties: safe defaults ---------------------------------------------------------

def test_every_address_is_loopback(store):
    values = render(store)
    assert LOOPBACK == "127.0.0.1"
    ports = []
    for key in ADDRESSES:
        url = urlsplit(values[key])
        assert url.scheme == "http"
        assert url.hostname == "127.0.0.1", (key, values[key])
        ports.append(url.port)
    assert ports == [8080, 8081, 8082]


def test_ports_are_configurable_and_stay_on_loopback(store):
    values = render(store, inference_port=9080, management_port=9081, metrics_port=9082)
    assert [values[key] for key in ADDRESSES] == [
        "http://127.0.0.1:9080",
        "http://127.0.0.1:9081",
        "http://127.0.0.1:9082",
    ]


def test_allowed_urls_is_only_the_model_store(store):
    values = render(store)
    allowed = values["allowed_urls"]
    assert "," not in allowed  # a single pattern
    assert allowed == "file://" + re.escape(store) + r"/(?!\.\.$)[^/]+"
    pattern = re.compile(allowed)
    assert pattern.fullmatch(f"file://{store}/minilm.mar")
    for url in (
        f"file://{store}/sub/other.mar",  # only files directly in the store
        f"file://{store}/../evil.mar",
        f"file://{store}/..",
        f"file://{store}",  # the folder itself is no archive
        f"file://{store}-evil/minilm.mar",  # a sibling that shares the prefix
        f"file://{os.path.dirname(store)}/minilm.mar",
        "file:///etc/passwd",
        "https://example.com/minilm.mar",
        f"http://{store}/minilm.mar",
    ):
        assert not pattern.fullmatch(url), url


def test_model_store_is_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    values = read_properties(render_properties(ServerSettings(model_store="store", load_models=())))
    assert values["model_store"] == str(tmp_path / "store")
    assert values["allowed_urls"].startswith("file://" + re.escape(str(tmp_path / "store")))


@pytest.mark.parametrize(
    "load_models, expected",
    [(("minilm.mar",), "minilm.mar"), (("a.mar", "b.mar"), "a.mar,b.mar"), ((), "")],
)
def test_load_models(store, load_models, expected):
    values = read_properties(render_properties(ServerSettings(model_store=store, load_models=load_models)))
    assert values["load_models"] == expected
    assert values["model_store"] == store


def test_safe_defaults(store):
    values = render(store)
    assert values["enable_model_api"] == "false"
    assert values["disable_token_authorization"] == "true"
    assert values["max_request_size"] == str(1 << 20)
    assert values["max_response_size"] == "6553500"
    assert values["metrics_mode"] == "prometheus"
    assert values["install_py_dep_per_model"] == "false"


@pytest.mark.parametrize(
    "token_auth, disabled, word",
    [(False, "true", "off"), (True, "false", "on")],
)
def test_token_authorization(store, token_auth, disabled, word):
    text = render_properties(
        ServerSettings(model_store=store, load_models=("m.mar",), token_auth=token_auth))
    assert read_properties(text)["disable_token_authorization"] == disabled
    assert f"Why token authorization is {word}:" in text


@pytest.mark.parametrize("enabled, expected", [(False, "false"), (True, "true")])
def test_enable_model_api(store, enabled, expected):
    assert render(store, enable_model_api=enabled)["enable_model_api"] == expected


@pytest.mark.parametrize("size", [1, 2048, 50 * 1024 * 1024])
def test_max_request_size(store, size):
    assert render(store, max_request_size=size)["max_request_size"] == str(size)


def test_every_placeholder_is_filled(store):
    text = render_properties(ServerSettings(model_store=store, load_models=("m.mar",)))
    assert "$" not in text.replace("$)", "")  # the allowed_urls pattern has one, as a regex anchor
    expected = {
        *ADDRESSES, "model_store", "load_models", "allowed_urls", "enable_model_api",
        "disable_token_authorization", "max_request_size", "max_response_size", "metrics_mode",
        "install_py_dep_per_model", "grpc_inference_address", "grpc_inference_port",
        "grpc_management_address", "grpc_management_port", "vmargs",
    }
    assert set(read_properties(text)) == expected


def test_grpc_listeners_are_loopback_on_their_own_ports(store):
    values = read_properties(render_properties(ServerSettings(
        model_store=store, load_models=("m.mar",), grpc_inference_port=17070, grpc_management_port=17071)))
    assert values["grpc_inference_address"] == values["grpc_management_address"] == "127.0.0.1"
    assert (values["grpc_inference_port"], values["grpc_management_port"]) == ("17070", "17071")


def test_metrics_config_is_installed_and_named(tmp_path):
    from tsbatch.archiver.properties import install_metrics_config

    path = install_metrics_config(str(tmp_path / "store"))
    values = read_properties(render_properties(ServerSettings(
        model_store=str(tmp_path / "store"), load_models=("m.mar",), metrics_config=path)))
    assert values["metrics_config"] == path and os.path.exists(path)


def test_log_config_is_installed_and_drops_only_the_per_call_lines(tmp_path):
    import xml.etree.ElementTree as ET

    from tsbatch.archiver.properties import install_log_config

    path = install_log_config(str(tmp_path / "store"))
    values = read_properties(render_properties(ServerSettings(
        model_store=str(tmp_path / "store"), load_models=("m.mar",), log_config=path)))
    assert values["vmargs"].split() == [f"-Dlog4j.configurationFile=file://{path}", *FRONTEND_JIT]
    loggers = {e.get("name"): e for e in ET.parse(path).getroot().iter("Logger")}
    dropped = loggers["org.pytorch.serve"].find("RegexFilter").get("regex")
    for line in ("result=[METRICS]tsbatch_batch_size.Count:4|#ModelName:m", "Looping backend response at: 1",
                 "Backend response time: 3"):
        assert re.match(dropped, line), line
    for line in ("Backend worker process died.", "Connecting to: /tmp/.ts.sock.9000", "Load model failed: m"):
        assert not re.match(dropped, line), line
    assert loggers["org.pytorch.serve"].get("level") == "info" and loggers["ACCESS_LOG"].get("level") == "info"


def test_the_frontend_jit_is_c1_only_unless_asked_otherwise(store):
    """The JIT flag rides on vmargs without a log config too; jvm_args=() (and no log config)
    leaves vmargs to TorchServe, whose launcher then passes its own."""
    values = read_properties(render_properties(ServerSettings(model_store=store, load_models=("m.mar",))))
    assert values["vmargs"].split() == ["-XX:TieredStopAtLevel=1"]
    bare = ServerSettings(model_store=store, load_models=("m.mar",), jvm_args=())
    assert "vmargs" not in read_properties(render_properties(bare))


# -- read_properties ---------------------------------------------------------------------------

@pytest.mark.parametrize(
    "text, expected",
    [
        ("a=1\nb=2", {"a": "1", "b": "2"}),
        ("# comment=1\n! also a comment=2\n\n   \nkey=value", {"key": "value"}),
        ("  spaced  =  padded value  ", {"spaced": "padded value"}),
        ("url=http://h:1/?x=y", {"url": "http://h:1/?x=y"}),  # only the first = splits
        ("flag", {"flag": ""}),
        ("a=1\na=2", {"a": "2"}),  # the last one wins
        ("", {}),
    ],
)
def test_read_properties(text, expected):
    assert read_properties(text) == expected


# -- model-config.yaml -------------------------------------------------------------------------

def template() -> dict:
    with open(os.path.join(CONFIGS, "model-config.yaml")) as f:
        return yaml.safe_load(f)


def test_model_config_without_overrides_is_the_template():
    assert model_config({}) == template()
    assert model_config({}, None) == template()
    assert model_config({})["handler"] == {"model_dir": "model"}  # the task comes from the CLI (--task), or none


def test_model_config_merges_handler_and_frontend_overrides():
    config = model_config(
        {"task": "token_classification", "max_length": 128, "buckets": [32, 128]},
        {"batchSize": 16, "maxBatchDelay": 20, "deviceType": "gpu"},
    )
    expected = template()
    expected.update(batchSize=16, maxBatchDelay=20, deviceType="gpu")
    expected["handler"] = {
        "task": "token_classification",  # overridden
        "model_dir": "model",  # kept from the template
        "max_length": 128,  # added
        "buckets": [32, 128],
    }
    assert config == expected
    assert config["minWorkers"] == template()["minWorkers"]
    HandlerConfig.from_yaml(config["handler"])  # and it is a valid handler section


def test_model_config_does_not_leak_between_calls():
    first = model_config({"isolation_budget": 2}, {"batchSize": 64})
    first["handler"]["model_dir"] = "mutated"
    second = model_config({})
    assert second == template()
    assert "isolation_budget" not in second["handler"]


def test_dump_model_config_round_trips_in_order():
    config = model_config({"max_batch_tokens": 4096}, {"batchSize": 4})
    text = dump_model_config(config, header="# generated by tsbatch")
    assert text.startswith("# generated by tsbatch\n")
    assert yaml.safe_load(text) == config
    keys = [line.split(":")[0] for line in text.splitlines() if line and not line.startswith((" ", "#"))]
    assert keys == list(config)
    assert not dump_model_config({"a": 1}).startswith("\n")


# -- known gap (see the report): TorchServe reads config.properties with java.util.Properties -----

def java_properties_value(value: str) -> str:
    """What java.util.Properties.load makes of a value: a backslash before other chars is dropped."""
    escapes = {"t": "\t", "n": "\n", "r": "\r", "f": "\f"}
    return re.sub(r"\\(u[0-9a-fA-F]{4}|.)",
                  lambda m: chr(int(m.group(1)[1:], 16)) if len(m.group(1)) == 5
                  else escapes.get(m.group(1), m.group(1)), value)


def test_allowed_urls_survives_java_properties_parsing(tmp_path):
    store = tmp_path / "my.store"
    store.mkdir()
    text = render_properties(ServerSettings(model_store=str(store), load_models=("minilm.mar",)))
    raw = next(line.split("=", 1)[1] for line in text.splitlines() if line.startswith("allowed_urls="))
    allowed = java_properties_value(raw)
    assert read_properties(text)["allowed_urls"] == allowed  # our reader agrees with Java's
    pattern = re.compile(allowed)
    assert pattern.fullmatch(f"file://{store}/minilm.mar")
    assert not pattern.fullmatch(f"file://{tmp_path}/myXstore/evil.mar")
