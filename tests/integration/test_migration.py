"""The migration guide's claim, checked: examples/migration/before_handler.py (a TorchServe
BaseHandler) and its tsbatch port (examples/conv1d) answer the same batch alike, and where the
BaseHandler fails the whole batch for one bad request, the port fails that request alone."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil

import pytest

from tsbatch.archiver.measure import handler_class
from tests.support import call, example_maker, make_context

pytestmark = pytest.mark.integration

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONV = os.path.join(REPO, "examples", "conv1d")
BEFORE = os.path.join(REPO, "examples", "migration", "before_handler.py")


@pytest.fixture(scope="module")
def handlers(tmp_path_factory):
    root = tmp_path_factory.mktemp("migration")
    model_dir = example_maker(CONV)(str(root / "model"), max_length=64)
    archive = root / "archive"  # laid out as the .mar both would ship in: model/ and conv_model.py
    shutil.copytree(model_dir, archive / "model")
    shutil.copy(os.path.join(CONV, "conv_model.py"), archive / "conv_model.py")
    spec = importlib.util.spec_from_file_location("before_handler", BEFORE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    before = module.ConvBaseHandler()
    before.initialize(make_context(str(archive), {}))
    after = handler_class(os.path.join(CONV, "conv_handler.py"))()
    after.initialize(make_context(str(archive), {"buckets": [8, 32, 64], "warmup": False}))
    yield before, after, str(archive)
    after.close()


def body(values) -> bytes:
    return json.dumps({"values": values}).encode()


def test_the_port_answers_what_the_base_handler_answers(handlers):
    before, after, archive = handlers
    signals = [[0.1, 0.9, 0.3], [float(i % 5) for i in range(30)], [2.0] * 9, [float(i % 3) for i in range(60)]]
    old = call(before, make_context(archive, {}), [body(s) for s in signals], "application/json")
    new = call(after, make_context(archive, {}), [body(s) for s in signals], "application/json")
    for was, now in zip((r.body for r in old), new):
        assert now.status == 200 and now.body["label"] == was["label"] and now.body["length"] == was["length"]
        assert all(abs(now.body["scores"][k] - was["scores"][k]) < 1e-5 for k in was["scores"])


def test_one_bad_request_fails_the_base_handlers_batch_but_only_itself_after_the_port(handlers):
    before, after, archive = handlers
    batch = [body([0.5, 0.2]), b'{"values": "oops"}', body([1.0] * 12)]
    with pytest.raises(ValueError):  # TorchServe answers every request of this batch 503
        call(before, make_context(archive, {}), batch, "application/json")
    replies = call(after, make_context(archive, {}), batch, "application/json")
    assert [r.status for r in replies] == [200, 400, 200]
    assert "values" in replies[1].body["error"]
