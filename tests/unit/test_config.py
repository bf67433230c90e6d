"""tsbatch.handlers.edge.config: the `handler:` section is validated once, and a bad field is named with its value."""
from __future__ import annotations

import dataclasses

import pytest
import yaml

from tsbatch.handlers.core.errors import ConfigError
from tsbatch.handlers.edge.config import DeviceType, FaultInjection, FrontendConfig, HandlerConfig, Task

pytestmark = pytest.mark.unit


def load(**section):
    return HandlerConfig.from_yaml({"task": "embedding", **section})


# -- defaults --------------------------------------------------------------------------------

def test_defaults():
    config = HandlerConfig.from_yaml({"task": "embedding"})
    assert config == HandlerConfig(
        task=Task.EMBEDDING,
        model_dir="model",
        truncation=True,
        max_length=None,
        buckets=None,
        max_batch_tokens=4096,
        max_batch_size=16,
        isolation_budget=16,
        device="auto",
        torch_threads=None,
        fault_injection=FaultInjection(),
    )
    assert config.fault_injection.enabled is False


@pytest.mark.parametrize("task", list(Task))
def test_every_task_by_its_value(task):
    assert HandlerConfig.from_yaml({"task": task.value}).task is task


def test_explicit_nulls_mean_defaults_for_optional_fields():
    config = load(max_length=None, buckets=None, torch_threads=None, fault_injection=None)
    assert config.max_length is None
    assert config.buckets is None
    assert config.torch_threads is None
    assert config.fault_injection == FaultInjection()


def test_every_field_set():
    config = HandlerConfig.from_yaml(
        yaml.safe_load(
            """
            task: token_classification
            model_dir: weights
            truncation: false
            max_length: 256
            buckets: [32, 64, 256]
            max_batch_tokens: 4096
            isolation_budget: 3
            device: "cuda:1"
            torch_threads: 4
            fault_injection:
              substring: BOOM
              oom_above_batch: 2
            """
        )
    )
    assert config == HandlerConfig(
        task=Task.TOKEN_CLASSIFICATION,
        model_dir="weights",
        truncation=False,
        max_length=256,
        buckets=(32, 64, 256),
        max_batch_tokens=4096,
        isolation_budget=3,
        device="cuda:1",
        torch_threads=4,
        fault_injection=FaultInjection(substring="BOOM", oom_above_batch=2),
    )


def test_config_is_frozen():
    config = load()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_batch_tokens = 1  # type: ignore[misc]


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:0", "cuda:7"])
def test_valid_devices(device):
    assert load(device=device).device == device


def test_buckets_from_a_tuple_are_kept_as_a_tuple():
    assert load(buckets=(16, 128)).buckets == (16, 128)
    assert load(buckets=[512]).buckets == (512,)


# -- missing task and unknown keys ----------------------------------------------------------

@pytest.mark.parametrize("section", [None, {}, {"model_dir": "model"}])
def test_task_is_optional_in_the_config_for_a_teams_own_model(section):
    """Only the built-in encoder needs a task (EncoderModel refuses to load without one)."""
    assert HandlerConfig.from_yaml(section).task is None


@pytest.mark.parametrize(
    "section, names",
    [
        ({"task": "embedding", "batch_size": 8}, ["batch_size"]),
        ({"task": "embedding", "max_len": 128, "bucket": [16]}, ["bucket", "max_len"]),
        ({"batchSize": 8}, ["batchSize"]),  # unknown keys are reported even before a missing task
    ],
)
def test_unknown_keys_are_named(section, names):
    with pytest.raises(ConfigError) as caught:
        HandlerConfig.from_yaml(section)
    message = str(caught.value)
    assert "unknown key" in message
    assert str(names) in message
    assert "docs/configuration.md lists the known keys" in message and len(message) < 400


def test_an_unknown_key_close_to_a_known_one_gets_a_suggestion():
    with pytest.raises(ConfigError) as caught:
        HandlerConfig.from_yaml({"task": "embedding", "max_len": 128, "bucket": [16], "zzz": 1})
    message = str(caught.value)
    assert "'bucket': did you mean 'buckets'?" in message and "'max_len': did you mean 'max_length'?" in message
    assert "'zzz': did" not in message


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


# -- each field's validation: the error names the field and the bad value -------------------

@pytest.mark.parametrize(
    "field, value, expected",
    [
        ("task", "embeddings", "handler.task must be one of"),
        ("task", "EMBEDDING", "handler.task must be one of"),
        ("task", 1, "handler.task must be one of"),
        ("task", None, "handler.task must be one of"),
        ("task", ["embedding"], "handler.task must be one of"),
        ("model_dir", 5, "handler.model_dir must be a string"),
        ("model_dir", None, "handler.model_dir must be a string"),
        ("model_dir", ["a"], "handler.model_dir must be a string"),
        ("truncation", "yes", "handler.truncation must be true or false"),
        ("truncation", 1, "handler.truncation must be true or false"),
        ("truncation", None, "handler.truncation must be true or false"),
        ("max_length", 0, "handler.max_length must be a positive integer"),
        ("max_length", -5, "handler.max_length must be a positive integer"),
        ("max_length", 1.5, "handler.max_length must be a positive integer"),
        ("max_length", 512.0, "handler.max_length must be a positive integer"),
        ("max_length", "512", "handler.max_length must be a positive integer"),
        ("max_length", True, "handler.max_length must be a positive integer"),
        ("max_batch_tokens", 0, "handler.max_batch_tokens must be a positive integer"),
        ("max_batch_tokens", -1, "handler.max_batch_tokens must be a positive integer"),
        ("max_batch_tokens", "16k", "handler.max_batch_tokens must be a positive integer"),
        ("max_batch_tokens", False, "handler.max_batch_tokens must be a positive integer"),
        ("max_batch_tokens", None, "handler.max_batch_tokens must be a positive integer"),
        ("isolation_budget", 0, "handler.isolation_budget must be a positive integer"),
        ("isolation_budget", 2.0, "handler.isolation_budget must be a positive integer"),
        ("isolation_budget", None, "handler.isolation_budget must be a positive integer"),
        ("device", "gpu", "handler.device must be auto, cpu or cuda[:N]"),
        ("device", "CUDA", "handler.device must be auto, cpu or cuda[:N]"),
        ("device", "mps", "handler.device must be auto, cpu or cuda[:N]"),
        ("device", "", "handler.device must be auto, cpu or cuda[:N]"),
        ("device", 0, "handler.device must be a string"),
        ("torch_threads", 0, "handler.torch_threads must be a positive integer"),
        ("torch_threads", "4", "handler.torch_threads must be a positive integer"),
        ("buckets", [], "handler.buckets must be a non-empty list"),
        ("buckets", 512, "handler.buckets must be a non-empty list"),
        ("buckets", "16,32", "handler.buckets must be a non-empty list"),
        ("buckets", {"a": 16}, "handler.buckets must be a non-empty list"),
        ("buckets", [16, 0], "handler.buckets[1] must be a positive integer"),
        ("buckets", [16.0], "handler.buckets[0] must be a positive integer"),
        ("buckets", [16, "32"], "handler.buckets[1] must be a positive integer"),
        ("buckets", [16, True], "handler.buckets[1] must be a positive integer"),
        ("fault_injection", "BOOM", "handler.fault_injection must be a mapping"),
        ("fault_injection", ["substring"], "handler.fault_injection must be a mapping"),
        ("fault_injection", True, "handler.fault_injection must be a mapping"),
    ],
)
def test_bad_field_names_the_field_and_the_value(field, value, expected):
    with pytest.raises(ConfigError) as caught:
        HandlerConfig.from_yaml({"task": "embedding", field: value})
    message = str(caught.value)
    assert expected in message
    if field != "buckets" or not isinstance(value, list) or value == []:
        assert f"got {value!r}" in message, message
    else:  # a bad element is named with its own index and value
        bad = next(v for v in value if isinstance(v, bool) or not isinstance(v, int) or v < 1)
        assert f"got {bad!r}" in message, message


@pytest.mark.parametrize(
    "edges",
    [
        [32, 16],
        [16, 16],
        [16, 32, 32, 64],
        [16, 64, 32],
        [512, 256, 128],
    ],
)
def test_buckets_must_be_strictly_increasing(edges):
    with pytest.raises(ConfigError) as caught:
        load(buckets=edges)
    message = str(caught.value)
    assert "handler.buckets must be strictly increasing" in message
    assert f"got {edges}" in message


@pytest.mark.parametrize("edges", [[16], [16, 17], [1, 2, 4, 8], [32, 64, 128, 256, 512]])
def test_strictly_increasing_buckets_are_accepted(edges):
    assert load(buckets=edges).buckets == tuple(edges)


# -- fault_injection ---------------------------------------------------------------------------

@pytest.mark.parametrize(
    "section, expected, enabled",
    [
        ({}, FaultInjection(), False),
        ({"substring": None, "oom_above_batch": None}, FaultInjection(), False),
        ({"substring": "BOOM"}, FaultInjection(substring="BOOM"), True),
        ({"oom_above_batch": 4}, FaultInjection(oom_above_batch=4), True),
        ({"substring": "X", "oom_above_batch": 1}, FaultInjection("X", 1), True),
    ],
)
def test_fault_injection_parsing(section, expected, enabled):
    fault = load(fault_injection=section).fault_injection
    assert fault == expected
    assert fault.enabled is enabled


def test_fault_injection_from_yaml_text():
    section = yaml.safe_load("task: embedding\nfault_injection:\n  substring: '__FAIL__'\n")
    assert HandlerConfig.from_yaml(section).fault_injection == FaultInjection(substring="__FAIL__")


@pytest.mark.parametrize(
    "fault, expected, bad",
    [
        ({"substring": ""}, "handler.fault_injection.substring must not be empty", None),
        ({"substring": 5}, "handler.fault_injection.substring must be a string", "5"),
        ({"oom_above_batch": 0}, "handler.fault_injection.oom_above_batch must be a positive integer", "0"),
        ({"oom_above_batch": "2"}, "handler.fault_injection.oom_above_batch must be a positive integer", "'2'"),
        ({"oom_above_batch": True}, "handler.fault_injection.oom_above_batch must be a positive integer", "True"),
        ({"substrings": "x"}, "handler.fault_injection: unknown key(s) ['substrings']", None),
        ({"substring": "x", "probability": 0.5}, "unknown key(s) ['probability']", None),
    ],
)
def test_bad_fault_injection_is_named(fault, expected, bad):
    with pytest.raises(ConfigError) as caught:
        load(fault_injection=fault)
    message = str(caught.value)
    assert expected in message
    if bad is not None:
        assert f"got {bad}" in message


def test_fault_injection_is_off_by_default():
    assert FaultInjection().enabled is False
    assert load().fault_injection.enabled is False


# -- scheduler fields (continuousBatching or asyncCommunication: true) ---------------------------

ASYNC_DEFAULTS = {
    "max_wait_ms": 2,
    "poll_ms": 5,
    "queue_cap": 64,
    "age_bound_ms": 250,
    "priority_aging_ms": 1000,
    "deadline_ms": 30000,
    "deadline_margin_ms": 50,
    "long_lane_from": 128,
}
ASYNC_POSITIVE_INTS = sorted(ASYNC_DEFAULTS)


def test_async_defaults():
    config = load()
    assert {name: getattr(config, name) for name in ASYNC_DEFAULTS} == ASYNC_DEFAULTS


@pytest.mark.parametrize("name", ASYNC_POSITIVE_INTS)
def test_async_fields_are_set(name):
    assert getattr(load(**{name: 7}), name) == 7


@pytest.mark.parametrize("value", [0, -1, 2.5, "10", True])
@pytest.mark.parametrize("name", ASYNC_POSITIVE_INTS)
def test_async_fields_must_be_positive_integers(name, value):
    with pytest.raises(ConfigError) as caught:
        load(**{name: value})
    assert f"handler.{name} must be a positive integer, got {value!r}" in str(caught.value)


def test_long_lane_can_be_switched_off_with_null():
    assert load(long_lane_from=None).long_lane_from is None


# -- regressions: bugs found by these tests and fixed

@pytest.mark.parametrize("device", ["cuda:", "cuda:x", "cuda:-1"])
def test_device_index_must_be_a_number(device):
    with pytest.raises(ConfigError):
        load(device=device)


@pytest.mark.parametrize("section", ["embedding", ["task", "embedding"], 5])
def test_non_mapping_section_is_a_config_error(section):
    with pytest.raises(ConfigError, match="handler"):
        HandlerConfig.from_yaml(section)


def test_unknown_non_string_keys_are_a_config_error():
    # YAML 1.1 reads an unquoted `on:` / `yes:` key as True and `1:` as an int.
    section = yaml.safe_load("task: embedding\non: 1\nbatch: 2\n")
    with pytest.raises(ConfigError, match="unknown key"):
        HandlerConfig.from_yaml(section)


# -- the model: section: the team's model's own, read-only, never rejected by tsbatch -------------

def test_the_model_section_reaches_the_config_read_only_and_any_key_is_kept():
    section = {"max_new_tokens": 64, "anything": {"nested": [1, 2]}, "batchSize": "not tsbatch's"}
    config = HandlerConfig.from_yaml({"max_batch_size": 4}, section)
    assert config.model == section and config.max_batch_size == 4
    with pytest.raises(TypeError):
        config.model["max_new_tokens"] = 1  # type: ignore[index]
    section["max_new_tokens"] = 1  # the caller's dict is copied, not shared
    assert config.model["max_new_tokens"] == 64
    assert dataclasses.replace(config, torch_threads=2).model == config.model


@pytest.mark.parametrize("model", [None, {}])
def test_no_model_section_is_an_empty_mapping(model):
    assert dict(HandlerConfig.from_yaml({}, model).model) == {} and dict(HandlerConfig().model) == {}


@pytest.mark.parametrize("model", [[1], "max_new_tokens: 8", 5])
def test_a_model_section_that_is_not_a_mapping_is_named(model):
    with pytest.raises(ConfigError, match=r"model must be a mapping of your model's own settings, got"):
        HandlerConfig.from_yaml({}, model)


def test_model_is_a_section_not_a_handler_key():
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['model'\]"):
        HandlerConfig.from_yaml({"model": {"max_new_tokens": 8}})


# -- the frontend keys tsbatch writes at the top of model-config.yaml ---------------------------

def test_frontend_keys_are_checked_and_strings_become_enums():
    config = FrontendConfig.from_yaml({"batchSize": 8, "deviceType": "gpu", "handler": {"task": "embedding"}})
    assert config.batchSize == 8 and config.deviceType is DeviceType.GPU


@pytest.mark.parametrize("config, words", [
    ({"batchSize": "8"}, "model-config.yaml: batchSize must be a positive integer, got '8'"),
    ({"maxBatchDelay": 0}, "model-config.yaml: maxBatchDelay must be a positive integer, got 0"),
    ({"continuousBatching": "true"}, "model-config.yaml: continuousBatching must be true or false, got 'true'"),
    ({"deviceType": "cuda"}, "model-config.yaml: deviceType must be one of ['cpu', 'gpu'], got 'cuda'"),
    ({"batchsize": 8}, "'batchsize': did you mean 'batchSize'?"),
    ({"asyncCommunication": True}, "sets both asyncCommunication and continuousBatching"),
    ({"minWorkers": 3, "maxWorkers": 2}, "maxWorkers (2) must be at least minWorkers (3)"),
    ({"handler": {"max_batch_size": 0}}, "handler.max_batch_size must be a positive integer, got 0"),
    ({"model": [1]}, "model must be a mapping"),
])
def test_a_bad_frontend_key_is_named(config, words):
    with pytest.raises(ConfigError) as caught:
        FrontendConfig.from_yaml(config)
    assert words in str(caught.value)
