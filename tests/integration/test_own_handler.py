"""A team's own handler and model (examples/conv1d) in the handler and the packaging pipeline:
profiled like the built-in one, answering with TorchServe's context, refused when malformed."""
from __future__ import annotations

import json
import os

import pytest

from tsbatch.archiver.measure import ProfileError, handler_class
from tsbatch.archiver.package import ArchiveError, check_model_dir
from tsbatch.archiver.pipeline import profile_here
from tests.support import call, example_maker, make_context

pytestmark = pytest.mark.integration

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(REPO, "examples", "conv1d")
HANDLER = os.path.join(EXAMPLE, "conv_handler.py")


@pytest.fixture(scope="module")
def conv_dir(tmp_path_factory):
    make = example_maker(EXAMPLE)
    return make(str(tmp_path_factory.mktemp("conv") / "model"), max_length=32)


def test_profile_warms_every_shape_of_a_teams_model(conv_dir):
    profile = profile_here(conv_dir, "conv", {"buckets": [8, 32], "max_batch_size": 4}, "continuous",
                           handler_file=HANDLER, extra_files={"conv_model.py": os.path.join(EXAMPLE, "conv_model.py")})
    assert {(s.batch, s.bucket) for s in profile.shapes} == {(b, e) for e in (8, 32) for b in (1, 2, 4)}
    assert profile.environment["model"] == "ConvNet"


def test_the_teams_handler_answers_each_request_alone_or_batched_alike(conv_dir):
    cls = handler_class(HANDLER)
    handler = cls()
    handler.initialize(make_context(conv_dir, {"model_dir": conv_dir, "buckets": [8, 32], "warmup": False}))
    signals = [[0.1, 0.2], [float(i) for i in range(20)], [1.0] * 8]
    payloads = [(json.dumps({"values": v}).encode(), "application/json") for v in signals]
    together = call(handler, make_context(conv_dir, {}), [p[0] for p in payloads], "application/json")
    for payload, batched in zip(payloads, together):
        [single] = call(handler, make_context(conv_dir, {}), [payload[0]], "application/json")
        assert batched.status == single.status == 200
        assert all(abs(batched.body["scores"][k] - single.body["scores"][k]) < 1e-5 for k in single.body["scores"])
    [bad] = call(handler, make_context(conv_dir, {}), [b'{"values": "none"}'], "application/json")
    assert bad.status == 400 and "values" in bad.body["error"]


def test_a_handler_file_must_define_one_tsbatch_handler(tmp_path):
    two = tmp_path / "two_handlers.py"
    two.write_text("from tsbatch.handlers.edge.tsbatch_handler import TsbatchHandler\n"
                   "class A(TsbatchHandler):\n    pass\nclass B(TsbatchHandler):\n    pass\n")
    with pytest.raises(ProfileError, match="exactly one class"):
        handler_class(str(two))
    broken = tmp_path / "broken_handler.py"
    broken.write_text("import no_such_module_anywhere\n")
    with pytest.raises(ProfileError, match="failed to import: ModuleNotFoundError"):
        handler_class(str(broken))


def test_a_teams_model_directory_may_not_ship_pickled_weights(tmp_path):
    (tmp_path / "weights.pt").write_bytes(b"\x80\x04pickle")
    with pytest.raises(ArchiveError, match="pickled weights"):
        check_model_dir(str(tmp_path), hugging_face=False)
    (tmp_path / "weights.pt").unlink()
    (tmp_path / "notes.txt").write_text("anything else ships as it is")
    assert check_model_dir(str(tmp_path), hugging_face=False) == ["notes.txt"]
