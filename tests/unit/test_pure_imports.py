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
    "tsbatch.handlers.parse",
    "tsbatch.handlers.config",
    "tsbatch.handlers.buckets",
    "tsbatch.handlers.isolate",
    "tsbatch.handlers.entities",
    "tsbatch.handlers.errors",
    "tsbatch.handlers.policy",
    "tsbatch.handlers.cost",
    "tsbatch.handlers.reply",
    "tsbatch.handlers.lanes",
    "tsbatch.handlers.metrics",
    "tsbatch.handlers.siblings",
    "tsbatch.handlers.memory",
    "tsbatch.handlers.stages",
    "tsbatch.handlers.api",
    "tsbatch.handlers.tsbatch_handler",
    "tsbatch.handlers.encoder_handler",  # torch loads only when a model is loaded
    "tsbatch.handlers.worker",
    "tsbatch.handlers.warming",
    "tsbatch.handlers.socket_guard",
    "tsbatch.handlers.modes",
    "tsbatch.handlers.modes.default_mode",
    "tsbatch.handlers.modes.scheduled",
    "tsbatch.handlers.modes.continuous_mode",
    "tsbatch.handlers.modes.async_mode",
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
