"""The pure modules stay pure: importing them loads neither torch nor TorchServe."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PURE = [
    # handlers/core/: every module there (test_every_core_module_is_checked)
    "tsbatch.handlers.core.buckets",
    "tsbatch.handlers.core.cost",
    "tsbatch.handlers.core.errors",
    "tsbatch.handlers.core.generation_policy",
    "tsbatch.handlers.core.isolate",
    "tsbatch.handlers.core.policy",
    "tsbatch.handlers.core.reply",
    # handlers/runtime/: the model (torch) comes in from the handler
    "tsbatch.handlers.runtime.graphs",
    "tsbatch.handlers.runtime.lanes",
    "tsbatch.handlers.runtime.memory",
    "tsbatch.handlers.runtime.warming",
    "tsbatch.handlers.runtime.worker",
    # handlers/edge/: TorchServe's modules are imported only inside the calls that need them
    "tsbatch.handlers.edge.config",
    "tsbatch.handlers.edge.envelopes",
    "tsbatch.handlers.edge.generation_api",
    "tsbatch.handlers.edge.generation_handler",  # torch loads in initialize()
    "tsbatch.handlers.edge.metrics",
    "tsbatch.handlers.edge.parse",
    "tsbatch.handlers.edge.siblings",
    "tsbatch.handlers.edge.backend_socket",
    "tsbatch.handlers.edge.stages",
    "tsbatch.handlers.edge.tsbatch_handler",
    "tsbatch.handlers.edge.modes",
    "tsbatch.handlers.edge.modes.default_mode",
    "tsbatch.handlers.edge.modes.scheduled",
    "tsbatch.handlers.edge.modes.continuous_mode",
    "tsbatch.handlers.edge.modes.async_mode",
    # handlers/models/
    "tsbatch.handlers.models.entities",
    "tsbatch.handlers.models.encoder_handler",  # torch loads only when a model is loaded
    "tsbatch.handlers.models.causal_lm_handler",  # the same
    "tsbatch.handlers.api",
    "tsbatch.warmup.plan",
    "tsbatch.warmup.run",
    "tsbatch.warmup.profile",
]
HEAVY = ["torch", "transformers", "ts"]  # ts is TorchServe's Python package

PROBE = """
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
print(json.dumps(sorted(m for m in sys.modules if any(m == h or m.startswith(h + ".") for h in {heavy!r}))))
"""


def imported_heavy_modules(*modules: str) -> list[str]:
    env = {**os.environ, "PYTHONPATH": REPO}
    done = subprocess.run(
        [sys.executable, "-c", PROBE.format(heavy=set(HEAVY)), *modules],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", PURE)
def test_pure_module_does_not_import_torch(module):
    assert imported_heavy_modules(module) == []


def test_all_pure_modules_together_do_not_import_torch():
    assert imported_heavy_modules(*PURE) == []


def test_every_core_module_is_checked():
    """handlers/core/ is the pure core by its folder: a module added there is checked here too."""
    core = sorted(n[:-3] for n in os.listdir(os.path.join(REPO, "handlers", "core")) if n.endswith(".py") and n != "__init__.py")
    assert [f"tsbatch.handlers.core.{n}" for n in core] == [m for m in PURE if m.startswith("tsbatch.handlers.core.")]


def test_the_probe_would_see_torch():
    """The check can fail: importing torch itself is seen (skipped where torch is not installed)."""
    if importlib.util.find_spec("torch") is None:  # find_spec does not import it here
        pytest.skip("torch is not installed")
    assert "torch" in imported_heavy_modules("torch")


def test_warmup_does_not_import_the_handler_package():
    """warmup/ is a library under the handler: the handler imports it, never the reverse."""
    env = {**os.environ, "PYTHONPATH": REPO}
    done = subprocess.run(
        [sys.executable, "-c", PROBE.format(heavy={"tsbatch.handlers"}), "tsbatch.warmup.plan", "tsbatch.warmup.run", "tsbatch.warmup.profile"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


def test_the_core_imports_no_other_layer():
    """handlers/core/ is under the other layers: runtime, edge, models and the API import it, never the reverse."""
    env = {**os.environ, "PYTHONPATH": REPO}
    layers = {"tsbatch.handlers.runtime", "tsbatch.handlers.edge", "tsbatch.handlers.models", "tsbatch.handlers.api"}
    core = [m for m in PURE if m.startswith("tsbatch.handlers.core.")]
    done = subprocess.run(
        [sys.executable, "-c", PROBE.format(heavy=layers), *core],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


def test_the_runtime_imports_no_edge():
    """handlers/runtime/ runs what the edge (the TorchServe handler, its modes) hands it: the edge
    imports the runtime, never the reverse (generation's engine imports its model runner)."""
    env = {**os.environ, "PYTHONPATH": REPO}
    runtime = sorted(f"tsbatch.handlers.runtime.{n[:-3]}" for n in os.listdir(os.path.join(REPO, "handlers", "runtime"))
                     if n.endswith(".py") and n != "__init__.py" and n != "generation_engine.py")
    done = subprocess.run(
        [sys.executable, "-c", PROBE.format(heavy={"tsbatch.handlers.edge"}), *runtime],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
