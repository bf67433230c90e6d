"""Security checks: configs that let nobody in, weights never unpickled, archives nothing escapes.

TorchServe's ShellTorch history (CVE-2023-43654): a management API reachable from outside plus
an open allowed_urls let anyone register a model from any URL and run its code. tsbatch's
generated config.properties must keep every listener on loopback and every registration inside
the model store; tsbatch must load weights only from safetensors (a pickle is code); and an
archive must hold only the model directory's own regular files.
"""
from __future__ import annotations

import ipaddress
import os
import pickle
import re
import shutil
import zipfile
from urllib.parse import urlsplit

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tsbatch.archiver import kserve
from tsbatch.archiver.package import ArchiveError, ArchiveSpec, build_archive, check_model_dir, stage
from tsbatch.archiver.properties import ServerSettings, model_config, read_properties, render_properties
from tsbatch.handlers.edge.config import HandlerConfig
from tsbatch.handlers.models.encoder_handler import EncoderHandler
from tests.support import TOKENIZER_FILES, make_context

LISTENERS = {"inference_address", "management_address", "metrics_address",
             "grpc_inference_address", "grpc_management_address"}


def host(value: str) -> str:
    return urlsplit(value).hostname if "://" in value else value


def torchserve_pattern(allowed_urls: str) -> re.Pattern:
    """allowed_urls as TorchServe applies it: each comma-separated entry a Java regex, matched
    against the whole URL, case-insensitively (ArchiveUtils.validateURL)."""
    entries = allowed_urls.split(",")
    return re.compile("|".join(f"(?:{e})" for e in entries), re.IGNORECASE)


# -- config.properties --------------------------------------------------------------------------

ports = st.integers(1024, 65535)


@settings(max_examples=50, deadline=None)
@given(st.lists(ports, min_size=5, max_size=5, unique=True), st.booleans(), st.booleans(),
       st.integers(1, 64 << 20))
def test_every_listener_is_on_loopback_whatever_the_settings(tmp_path_factory, port_list, token_auth, model_api, size):
    store = str(tmp_path_factory.mktemp("store"))
    settings_ = ServerSettings(store, ("m.mar",), inference_port=port_list[0], management_port=port_list[1],
                               metrics_port=port_list[2], grpc_inference_port=port_list[3],
                               grpc_management_port=port_list[4], token_auth=token_auth,
                               enable_model_api=model_api, max_request_size=size)
    values = read_properties(render_properties(settings_))
    # every listener TorchServe opens is named (none left to TorchServe's own default), and loopback
    assert {key for key in values if key.endswith("_address")} == LISTENERS
    for key in LISTENERS:
        assert ipaddress.ip_address(host(values[key])).is_loopback, (key, values[key])
    assert values["max_request_size"] == str(size)


def test_the_defaults_keep_registration_and_installs_off_and_bodies_small(tmp_path):
    values = read_properties(render_properties(ServerSettings(str(tmp_path), ("m.mar",))))
    assert values["enable_model_api"] == "false"  # no register/unregister: no model from anywhere
    assert values["install_py_dep_per_model"] == "false"  # no pip install of an archive's requirements
    assert int(values["max_request_size"]) <= 1 << 20  # the e2e suite checks the 413 it causes


def test_allowed_urls_admits_only_archives_in_the_model_store(tmp_path):
    store = tmp_path / "model_store"
    store.mkdir()
    values = read_properties(render_properties(ServerSettings(str(store), ("m.mar",))))
    pattern = torchserve_pattern(values["allowed_urls"])
    assert pattern.fullmatch(f"file://{store}/m.mar")
    for url in ("https://example.com/m.mar", "http://127.0.0.1:9/m.mar", f"http://{store}/m.mar",
                "s3://bucket/m.mar", "ftp://example.com/m.mar", "file:///etc/passwd",
                f"file://{tmp_path}/m.mar", f"file://{store}-evil/m.mar", f"file://{store}", "m.mar"):
        assert not pattern.fullmatch(url), url


@pytest.mark.parametrize("render", ["properties", "kserve"])
def test_allowed_urls_refuses_urls_that_climb_out_of_the_store(tmp_path, render):
    if render == "properties":
        store = str(tmp_path / "model_store")
        values = read_properties(render_properties(ServerSettings(store, ("m.mar",))))
    else:
        store = kserve.MODEL_STORE
        values = read_properties(kserve.render_properties("m", model_config({})))
    pattern = torchserve_pattern(values["allowed_urls"])
    assert pattern.fullmatch(f"file://{store}/m.mar")
    for url in (f"file://{store}/../outside.mar", f"file://{store}/sub/../../../home/evil.mar"):
        assert not pattern.fullmatch(url), url


def test_kserve_export_keeps_management_and_grpc_on_loopback():
    values = read_properties(kserve.render_properties("m", model_config({})))
    for key in ("inference_address", "management_address", "grpc_inference_address", "grpc_management_address"):
        assert ipaddress.ip_address(host(values[key])).is_loopback, (key, values[key])
    assert values["enable_model_api"] == "false" and values["install_py_dep_per_model"] == "false"
    # metrics_address is 0.0.0.0 on purpose (Prometheus scrapes the pod); it serves no API that writes


# -- weights: safetensors only, a pickle is never loaded ----------------------------------------------

def _tiny_config():
    from transformers import BertConfig

    return BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                      intermediate_size=64, max_position_embeddings=128,
                      id2label={0: "NEGATIVE", 1: "POSITIVE"}, label2id={"NEGATIVE": 0, "POSITIVE": 1})


@pytest.fixture
def pickled_model(tmp_path, minilm_dir) -> str:
    """A valid model whose only weights are pytorch_model.bin (a pickle), as
    save_pretrained(safe_serialization=False) writes them."""
    import torch
    from transformers import AutoModelForSequenceClassification

    path = tmp_path / "pickled"
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(_tiny_config())
    model.save_pretrained(path, safe_serialization=False)
    if not (path / "pytorch_model.bin").exists():  # transformers 5 writes safetensors regardless
        for name in os.listdir(path):
            if name.endswith(".safetensors") or name.endswith(".safetensors.index.json"):
                os.remove(path / name)
        torch.save(model.state_dict(), path / "pytorch_model.bin")  # what 4.x writes for that flag
    for name in TOKENIZER_FILES:
        shutil.copy(os.path.join(minilm_dir, name), path / name)
    assert not any(n.endswith(".safetensors") for n in os.listdir(path))
    return str(path)


class Trap:
    """Unpickling this runs code: it creates a directory. A pickle is a program, not data."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def test_the_pickled_model_is_a_valid_model(pickled_model):
    """Control: the file itself loads when safetensors are not enforced, so a refusal below is
    the policy at work, not a broken file."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(pickled_model, local_files_only=True)
    assert model.config.num_labels == 2


def test_the_archiver_refuses_a_model_without_safetensors(pickled_model, tmp_path):
    with pytest.raises(ArchiveError, match="safetensors"):
        check_model_dir(pickled_model)
    with pytest.raises(ArchiveError, match="safetensors"):
        build_archive(ArchiveSpec(pickled_model, "pickled", model_config({"task": "sequence_classification"}),
                                  str(tmp_path / "store")))
    assert not os.path.exists(tmp_path / "store" / "pickled.mar")


def test_the_runner_refuses_pickled_weights(pickled_model):
    from tsbatch.handlers.models.encoder import EncoderModel

    with pytest.raises(OSError, match="safetensors"):
        EncoderModel(HandlerConfig.from_yaml({"task": "sequence_classification"}), pickled_model)
    context = make_context(pickled_model, {"task": "sequence_classification", "model_dir": pickled_model,
                                           "warmup": False})
    with pytest.raises(OSError, match="safetensors"):
        EncoderHandler().initialize(context)


def test_a_booby_trapped_pickle_is_never_unpickled(tmp_path, tiny_models):
    import torch
    from tsbatch.handlers.models.encoder import EncoderModel

    marker = str(tmp_path / "code-ran")
    # control: the trap fires whenever something unpickles it
    pickle.loads(pickle.dumps(Trap(marker)))
    assert os.path.isdir(marker)
    os.rmdir(marker)

    # beside real safetensors weights: ignored
    model_dir = str(tmp_path / "with-trap")
    shutil.copytree(tiny_models["sequence_classification"], model_dir)
    torch.save({"bert.embeddings.word_embeddings.weight": Trap(marker)}, os.path.join(model_dir, "pytorch_model.bin"))
    config = HandlerConfig.from_yaml({"task": "sequence_classification"})
    EncoderModel(config, model_dir)
    assert not os.path.exists(marker), "pytorch_model.bin was unpickled"

    # alone: refused, still never opened as a pickle
    for name in os.listdir(model_dir):
        if name.endswith(".safetensors"):
            os.remove(os.path.join(model_dir, name))
    with pytest.raises(OSError):
        EncoderModel(config, model_dir)
    assert not os.path.exists(marker), "pytorch_model.bin was unpickled"


# -- archives: only the model directory's own regular files ---------------------------------------

@pytest.fixture
def model_copy(tmp_path, tiny_models) -> str:
    path = str(tmp_path / "model")
    shutil.copytree(tiny_models["sequence_classification"], path)
    return path


@pytest.fixture
def outside(tmp_path) -> str:
    path = tmp_path / "outside"
    path.mkdir()
    (path / "secret.txt").write_text("ssh-rsa AAAA... not for the archive")
    return str(path)


@pytest.mark.parametrize("name, target", [
    pytest.param("vocab_link.txt", "vocab.txt", id="symlink-to-a-file-inside"),
    pytest.param("secret.txt", "{outside}/secret.txt", id="symlink-to-a-file-outside"),
    pytest.param("notes.txt", "../outside/secret.txt", id="relative-symlink-with-dotdot"),
    pytest.param("tokenizer.json", "{outside}/secret.txt", id="a-needed-file-as-symlink-outside"),
])
def test_the_archiver_refuses_files_that_would_escape(model_copy, outside, name, target):
    link = os.path.join(model_copy, name)
    if os.path.lexists(link):
        os.remove(link)
    os.symlink(target.format(outside=outside), link)
    with pytest.raises(ArchiveError, match="symbolic link|outside"):
        check_model_dir(model_copy)


def test_a_symlinked_weights_file_outside_is_refused(model_copy, outside):
    weights = os.path.join(model_copy, "model.safetensors")
    shutil.move(weights, os.path.join(outside, "model.safetensors"))
    os.symlink(os.path.join(outside, "model.safetensors"), weights)
    with pytest.raises(ArchiveError, match="symbolic link|outside"):
        check_model_dir(model_copy)


def test_a_symlinked_directory_ships_nothing_from_outside(model_copy, outside, tmp_path):
    os.symlink(outside, os.path.join(model_copy, "extras"))
    os.symlink(os.path.join("..", "outside"), os.path.join(model_copy, "up"))
    files = check_model_dir(model_copy)
    assert not {"extras", "up"} & set(files)
    workdir = tmp_path / "stage"
    workdir.mkdir()
    spec = ArchiveSpec(model_copy, "m", model_config({"task": "sequence_classification"}), str(tmp_path / "store"))
    _handler, extra, _config = stage(spec, str(workdir))
    for root, dirs, names in os.walk(extra):
        for name in dirs + names:
            path = os.path.join(root, name)
            assert not os.path.islink(path), path
            assert os.path.realpath(path).startswith(os.path.realpath(str(workdir)) + os.sep), path
            if os.path.isfile(path):
                with open(path, "rb") as f:
                    assert b"not for the archive" not in f.read(), path


def test_a_built_archive_holds_only_relative_regular_files(model_copy, outside, tmp_path):
    os.symlink(outside, os.path.join(model_copy, "extras"))  # skipped, never followed
    mar = build_archive(ArchiveSpec(model_copy, "m", model_config({"task": "sequence_classification"}),
                                    str(tmp_path / "store")))
    with zipfile.ZipFile(mar) as archive:
        infos = archive.infolist()
        names = [i.filename for i in infos]
        for info in infos:
            parts = info.filename.split("/")
            assert not info.filename.startswith("/") and ".." not in parts, info.filename
            assert (info.external_attr >> 16) & 0o170000 != 0o120000, f"{info.filename} is a symlink"
        model_files = sorted(n.split("/", 1)[1] for n in names if n.startswith("model/") and not n.endswith("/"))
        assert model_files == sorted(check_model_dir(model_copy))
        assert not any(b"not for the archive" in archive.read(n) for n in names if not n.endswith("/"))
