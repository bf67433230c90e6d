"""Build a TorchServe .mar from a local Hugging Face model directory.

The archive holds the handler entry file at its root, tsbatch's `handlers/` and `warmup/` packages
under `tsbatch/` (the names they have when tsbatch is installed), the model's files under `model/`,
and model-config.yaml. Nothing is fetched from a hub.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import yaml

from tsbatch.archiver.properties import dump_model_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout, or site-packages/tsbatch
PACKAGES = ("handlers", "warmup")  # what runs inside a worker, shipped whole (subpackages too) as tsbatch.*
ENTRY = os.path.join("handlers", "models", "encoder_handler.py")
GENERATION_ENTRY = os.path.join("handlers", "models", "causal_lm_handler.py")  # task: generation
BUILT_IN = (ENTRY, GENERATION_ENTRY)  # the entry files shipped from the archive's own copy of tsbatch
CAUSAL_LM_SUFFIXES = ("ForCausalLM", "LMHeadModel")  # transformers' names of causal-LM classes
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "tokenizer.model", "spiece.model", "vocab.json")


class ArchiveError(Exception):
    """The input cannot be archived; the message says how to fix it."""


@dataclass(frozen=True)
class ArchiveSpec:
    model_dir: str
    name: str
    model_config: Mapping[str, Any]
    export_path: str
    config_header: str = ""
    extra_files: Mapping[str, str] | None = None  # archive name -> local path (e.g. the profile)
    config_text: str = ""  # model-config.yaml as written (with tune's reasons); empty: dump model_config
    handler: str = ENTRY  # the handler entry file: relative to the repo (benchmark controls), or a team's own (absolute)


PICKLED = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


def entry_for(task: str | None) -> str:
    """The built-in handler entry file that serves a task: the generation handler, or the encoder."""
    return GENERATION_ENTRY if task == "generation" else ENTRY


def check_model_dir(model_dir: str, hugging_face: bool = True, causal_lm: bool = False) -> list[str]:
    """The model's files to ship; refuse what cannot serve or would escape the archive. A Hugging
    Face directory (the built-in encoder) needs config.json, a tokenizer and safetensors weights;
    the generation handler's (`causal_lm`) also a causal LM's architecture in config.json; a team's
    own model only safetensors for weights (pickles run code when loaded)."""
    if not os.path.isdir(model_dir):
        raise ArchiveError(f"model directory {model_dir!r} does not exist: pass MODEL_DIR=<local model dir>")
    names = sorted(os.listdir(model_dir))
    if not hugging_face:
        pickled = [n for n in names if n.endswith(PICKLED)]
        if pickled:
            raise ArchiveError(f"{model_dir} holds pickled weights ({', '.join(pickled)}): loading a pickle runs "
                               "code; save the weights as .safetensors")
        for name in names:
            if name.endswith(".safetensors"):
                check_safetensors(os.path.join(model_dir, name))
        return _shipped(model_dir, names)
    if "config.json" not in names:
        raise ArchiveError(f"{model_dir} has no config.json: is it a Hugging Face model directory?")
    if not any(n in names for n in TOKENIZER_FILES):
        raise ArchiveError(f"{model_dir} has no tokenizer (one of {', '.join(TOKENIZER_FILES)})")
    if not any(n.endswith(".safetensors") for n in names):
        raise ArchiveError(
            f"{model_dir} has no .safetensors weights: tsbatch loads only safetensors "
            "(convert with model.save_pretrained(dir, safe_serialization=True))"
        )
    check_config_json(os.path.join(model_dir, "config.json"), causal_lm)
    for name in names:
        if name.endswith(".safetensors"):
            check_safetensors(os.path.join(model_dir, name))
    return _shipped(model_dir, names)


def _shipped(model_dir: str, names: list[str]) -> list[str]:
    """The directory's regular files; links and anything resolving outside it are refused."""
    real_root = os.path.realpath(model_dir)
    files = []
    for name in names:
        path = os.path.join(model_dir, name)
        if name.startswith(".") or os.path.isdir(path):
            continue
        if os.path.islink(path) or ".." in name.split(os.sep):
            raise ArchiveError(f"{path} is a symbolic link: copy the real file into the model directory")
        if os.path.dirname(os.path.realpath(path)) != real_root:
            raise ArchiveError(f"{path} resolves outside the model directory")
        files.append(name)
    return files


def check_config_json(path: str, causal_lm: bool = False) -> None:
    """config.json must be a JSON object: the first thing transformers reads. For the generation
    handler it must name a causal LM's class (`architectures`, which save_pretrained writes): an
    encoder's weights would load with a random language-model head and answer noise."""
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (ValueError, UnicodeDecodeError) as error:
        raise ArchiveError(f"{path} is not valid JSON ({error}): the model cannot load") from None
    if not isinstance(config, dict):
        raise ArchiveError(f"{path} must hold a JSON object, got {type(config).__name__}: the model cannot load")
    if causal_lm:
        check_causal_lm(path, config)


def check_causal_lm(path: str, config: dict) -> None:
    architectures = config.get("architectures")
    names = [a for a in architectures if isinstance(a, str)] if isinstance(architectures, list) else []
    if config.get("is_encoder_decoder") or not any(a.endswith(CAUSAL_LM_SUFFIXES) for a in names):
        found = f"architectures {names}" if names else "no architectures"
        raise ArchiveError(
            f"{path} names {found}{' (an encoder-decoder)' if config.get('is_encoder_decoder') else ''}: --task "
            "generation serves a causal language model, whose config.json names a class ending in "
            f"{' or '.join(CAUSAL_LM_SUFFIXES)} (as AutoModelForCausalLM.save_pretrained writes it); an encoder "
            "is served with --task embedding, sequence_classification or token_classification")


def check_safetensors(path: str) -> None:
    """A .safetensors file must have a readable header whose tensors lie inside the file (catches
    truncated and corrupt weights without loading them): 8-byte little-endian header size, then
    the JSON header, then the data."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if length < 2 or 8 + length > size:
            raise ArchiveError(f"{path} is not a safetensors file (bad header size): the weights are corrupt or truncated")
        try:
            header = json.loads(f.read(length).decode("utf-8"))
        except (ValueError, UnicodeDecodeError):
            raise ArchiveError(f"{path} has an unreadable safetensors header: the weights are corrupt") from None
    if not isinstance(header, dict):
        raise ArchiveError(f"{path} has an unreadable safetensors header: the weights are corrupt")
    data = size - 8 - length
    ends = []
    for key, tensor in header.items():
        if key == "__metadata__":
            continue
        offsets = tensor.get("data_offsets") if isinstance(tensor, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            raise ArchiveError(f"{path}: tensor {key!r} has no valid data_offsets: the weights are corrupt")
        ends.append(offsets[1])
    if not ends:
        raise ArchiveError(f"{path} holds no tensors: the weights are missing")
    if max(ends) > data:
        raise ArchiveError(f"{path} is truncated: its tensors need {max(ends)} bytes of data, the file has {data}")


def stage(spec: ArchiveSpec, workdir: str) -> tuple[str, str, str]:
    """Lay out what the archive holds; return (handler file, extra-files dir, config file)."""
    own = os.path.isabs(spec.handler)  # a team's own handler file
    files = check_model_dir(spec.model_dir, hugging_face=not own, causal_lm=spec.handler == GENERATION_ENTRY)
    extra = os.path.join(workdir, "extra")
    for package in PACKAGES:
        shutil.copytree(
            os.path.join(REPO, package), os.path.join(extra, "tsbatch", package),
            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
        )
    # A regular package, so the archive's own copy is imported even where another tsbatch is
    # installed (an installed tsbatch is a namespace package, which a regular one always wins over).
    with open(os.path.join(extra, "tsbatch", "__init__.py"), "w") as f:
        f.write('"""tsbatch as shipped inside this archive."""\n')
    model_out = os.path.join(extra, "model")
    os.makedirs(model_out)
    for name in files:
        shutil.copy2(os.path.join(spec.model_dir, name), os.path.join(model_out, name))
    for archive_name, local in (spec.extra_files or {}).items():
        if os.path.isdir(local):
            shutil.copytree(local, os.path.join(extra, archive_name),
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(local, os.path.join(extra, archive_name))
    config_path = os.path.join(workdir, "model-config.yaml")
    with open(config_path, "w") as f:
        f.write(_config_text(spec))
    if own:
        handler = spec.handler
    else:
        handler = (os.path.join(extra, "tsbatch", spec.handler) if spec.handler in BUILT_IN
                   else os.path.join(REPO, spec.handler))
    return handler, extra, config_path


def _config_text(spec: ArchiveSpec) -> str:
    """The text for model-config.yaml; a given text must say exactly what model_config says."""
    if not spec.config_text:
        return dump_model_config(spec.model_config, spec.config_header)
    if yaml.safe_load(spec.config_text) != dict(spec.model_config):
        raise ArchiveError("internal error: the commented model-config.yaml does not parse to the model config")
    return spec.config_text


def build_archive(spec: ArchiveSpec, progress: Callable[[str], None] = lambda _: None) -> str:
    """Write `export_path/NAME.mar` with torch-model-archiver and return its path."""
    os.makedirs(spec.export_path, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tsbatch-archive-") as workdir:
        progress(f"staging {spec.model_dir}")
        handler, extra, config = stage(spec, workdir)
        progress(f"writing {spec.name}.mar")
        cmd = [
            sys.executable, "-m", "model_archiver.model_packaging",
            "--model-name", spec.name, "--version", "1.0",
            "--handler", handler, "--extra-files", extra, "--config-file", config,
            "--export-path", spec.export_path, "--force",
        ]
        # torch-model-archiver stages every archive in TMPDIR/NAME: two builds of one name at once
        # (two checkouts' tests, a CI runner beside a developer) wrote into each other's folder
        scratch = os.path.join(workdir, "scratch")
        os.makedirs(scratch)
        done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TMPDIR": scratch})
        if done.returncode != 0:
            raise ArchiveError(f"torch-model-archiver failed: {done.stderr.strip() or done.stdout.strip()}")
    path = os.path.join(spec.export_path, f"{spec.name}.mar")
    if not os.path.exists(path):
        raise ArchiveError(f"torch-model-archiver wrote no {path}")
    return path
