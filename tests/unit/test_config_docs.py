"""docs/configuration.md cannot drift: every config field is a documented, checked key, and the
file is exactly what the generator writes from the config classes now."""
from __future__ import annotations

import dataclasses
import os

import pytest
import yaml

from tsbatch.archiver import cli
from tsbatch.archiver.config_docs import render
from tsbatch.handlers.core.errors import ConfigError
from tsbatch.handlers.edge.config import (POSITIVE_INT, Check, FaultInjection, FrontendConfig, HandlerConfig, Setting,
                                          declared, keys_of, setting)
from tsbatch.handlers.edge.generation_api import GenerationConfig

pytestmark = pytest.mark.unit

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLASSES = (FrontendConfig, HandlerConfig, FaultInjection, GenerationConfig)
GENERATION_SECTION = "## `handler:` of the generation handler"  # the generation handler's keys, after the encoder's
FIELDS = [(cls, f, meta) for cls in CLASSES for f, meta in declared(cls)]
IDS = [f"{cls.__name__}.{f.name}" for cls, f, _ in FIELDS]


@pytest.mark.parametrize("cls, f, meta", FIELDS, ids=IDS)
def test_every_field_is_declared_with_documentation_and_a_check(cls, f, meta):
    assert isinstance(meta, Setting), f"{cls.__name__}.{f.name} has no setting(default, doc, check)"
    assert meta.doc.strip(), f"{cls.__name__}.{f.name} has no documentation"
    assert isinstance(meta.check, Check) and meta.check.kind.strip(), f"{cls.__name__}.{f.name} has no validation"
    assert meta.modes and set(meta.modes) <= {"default", "continuous", "async"}


class NoYamlValue:
    """What no YAML file holds: every check must refuse it."""

    def __repr__(self) -> str:
        return "<no YAML value>"


def reach(cls, name: str, value):
    """Set one key through the path a real model-config.yaml takes."""
    if cls is FrontendConfig:
        return FrontendConfig.from_yaml({name: value})
    if cls is FaultInjection:
        return HandlerConfig.from_yaml({"fault_injection": {name: value}})
    if cls is GenerationConfig:
        return FrontendConfig.from_yaml({"asyncCommunication": True, "continuousBatching": False,
                                         "handler": {"task": "generation", name: value}})
    if name == "model":
        return HandlerConfig.from_yaml({}, value)
    return HandlerConfig.from_yaml({name: value})


@pytest.mark.parametrize("cls, f, meta", FIELDS, ids=IDS)
def test_every_key_is_validated_when_read_naming_itself_and_what_it_got(cls, f, meta):
    label = {FaultInjection: "handler.fault_injection.", HandlerConfig: "handler.",
             GenerationConfig: "handler."}.get(cls, "model-config.yaml: ")
    label = "model" if f.name == "model" else label + f.name
    with pytest.raises(ConfigError) as caught:
        reach(cls, f.name, NoYamlValue())
    assert f"{label} must" in str(caught.value) and "got <no YAML value>" in str(caught.value)


def test_the_docs_file_is_what_the_generator_writes_now():
    with open(os.path.join(REPO, "docs", "configuration.md")) as f:
        written = f.read()
    assert written == render(), ("docs/configuration.md is stale: python -m tsbatch.archiver config-docs "
                                 "> docs/configuration.md")


def test_the_docs_list_every_key_once():
    encoder, generation = render().split(GENERATION_SECTION)
    for cls, f, meta in FIELDS:
        prefix = "fault_injection." if cls is FaultInjection else ""
        marker = "`model:` (" if f.name == "model" else f"| `{prefix}{f.name}` |"
        assert (generation if cls is GenerationConfig else encoder).count(marker) == 1, marker


def test_the_cli_prints_the_same_text(capsys):
    assert cli.main(["config-docs"]) == 0
    assert capsys.readouterr().out == render()


def test_the_frontend_defaults_are_the_templates_values():
    """The docs' default column for the top-level keys is configs/model-config.yaml's."""
    with open(os.path.join(REPO, "configs", "model-config.yaml")) as f:
        template = yaml.safe_load(f)
    defaults = dataclasses.asdict(FrontendConfig())
    assert {k: v for k, v in template.items() if k not in FrontendConfig.SECTIONS} == \
        {k: v for k, v in defaults.items() if v is not None}
    assert FrontendConfig.from_yaml(template) == FrontendConfig()


def test_a_field_declared_without_setting_is_refused_not_ignored():
    @dataclasses.dataclass(frozen=True)
    class Scratch:
        known: int = setting(1, "a key", POSITIVE_INT)
        forgotten: int = 2

    with pytest.raises(TypeError, match="Scratch.forgotten is not declared with setting"):
        keys_of(Scratch)
    undocumented = dataclasses.make_dataclass("Undocumented", [("quiet", int, setting(1, "", POSITIVE_INT))])
    with pytest.raises(TypeError, match="Undocumented.quiet"):
        keys_of(undocumented)
