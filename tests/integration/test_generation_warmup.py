"""Generation warmup on a tiny random causal LM: every prefill shape and decode batch size the
engine forms runs before the handler is loaded, the profile says what each cost and is kept in
the model directory, and out of memory at a shape lowers what the engine forms instead of failing
the load."""
from __future__ import annotations

import logging
import os

import pytest
import torch

from tsbatch.handlers.core.errors import OutOfMemory
from tsbatch.handlers.core.generation_policy import GenerationRequest, GenerationSettings, Status
from tsbatch.handlers.models.generation_runner import GenerationRunner
from tsbatch.handlers.runtime.generation_warming import formable, warm_up_generation
from tsbatch.warmup.generation_profile import (GENERATION_PROFILE_FILE, GenerationProfile, decode_shapes,
                                               prefill_edges, prefill_shapes)
from tests.integration.test_generation_engine import alone, make_lm
from tests.support import make_context

pytestmark = pytest.mark.integration

SECTION = {"task": "generation", "token_budget": 64, "max_running": 3, "warmup_repeats": 2, "warmup_max_repeats": 4}


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return make_lm(str(tmp_path_factory.mktemp("gen") / "model"))


@pytest.fixture(scope="module")
def runner(lm_dir):
    return GenerationRunner(lm_dir)


def archive(tmp_path, lm_dir) -> str:
    """An extracted archive as TorchServe leaves it: the model under model/."""
    root = tmp_path / "archive"
    root.mkdir()
    os.symlink(lm_dir, root / "model")
    return str(root)


class Events(logging.Handler):
    """Keeps the tsbatch_warmup events the warmup logs (what `tsbatch profile` forwards)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.events: list[dict] = []

    def emit(self, record):
        if isinstance(getattr(record, "tsbatch_warmup", None), dict):
            self.events.append(record.tsbatch_warmup)


@pytest.fixture
def events():
    keep, log = Events(), logging.getLogger("tsbatch.handlers.runtime.generation_warming")
    level = log.level
    log.setLevel(logging.INFO)
    log.addHandler(keep)
    yield keep.events
    log.removeHandler(keep)
    log.setLevel(level)


def shapes(timings) -> list[tuple[int, int]]:
    return [(t.batch, t.bucket) for t in timings]


def test_the_handler_warms_exactly_the_planned_shapes_before_it_serves_and_keeps_the_profile(lm_dir, tmp_path, events):
    from tsbatch.handlers.edge.generation_handler import GenerationHandler

    root = archive(tmp_path, lm_dir)
    handler = GenerationHandler()
    handler.initialize(make_context(root, SECTION, batch_size=1))
    try:
        profile, runner = handler.profile, handler.runner
        edges = prefill_edges(runner.max_positions)
        assert shapes(profile.prefill) == [(s.batch, s.bucket) for s in prefill_shapes(edges, 3, 64)]
        assert shapes(profile.decode) == [(s.batch, s.bucket) for s in decode_shapes(3, runner.max_positions)]
        assert shapes(profile.decode) == [(r, c) for c in (64, 511) for r in (1, 2, 3)]
        assert all(2 <= t.runs <= 4 and t.median_ms > 0 and t.first_ms > 0 for t in profile.prefill + profile.decode)
        assert handler.engine.steps == 0  # warmup ran on the runner, not through the engine
        saved = GenerationProfile.load(os.path.join(root, GENERATION_PROFILE_FILE))
        assert saved == profile and profile.warmup_seconds > 0
        env = profile.environment
        assert env["task"] == "generation" and env["device"] == "cpu" and env["torch_threads"] == torch.get_num_threads()
        assert (env["token_budget"], env["max_running"], env["max_positions"]) == (64, 3, 512)
        assert env["kv_bytes_per_token"] == runner.kv_bytes_per_token and env["out_of_memory"] == []
        assert env["prefill_edges"] == list(edges) and "serving" not in env
        kinds = [e["event"] for e in events]
        assert kinds[0] == "estimate" and kinds[-1] == "done" and kinds.count("shape") == len(profile.prefill) + 6
        assert events[0]["shapes"] == len(profile.prefill) + 6 and events[0]["seconds"] > 0
        assert handler.engine.policy.settings.prefill_edges == edges  # the engine pads to the edges warmed
        prompt = runner.encode("A man is eating food.")  # and serves after warmup as alone
        seq = handler.engine.submit(GenerationRequest("r", tuple(prompt), 8, 0.0))
        while seq.status is not Status.FINISHED:
            threading_wait()
        assert seq.tokens == alone(runner, prompt, 8)
    finally:
        handler.close()


def threading_wait():
    import threading

    threading.Event().wait(0.01)


def test_warmup_off_measures_nothing(lm_dir, tmp_path):
    from tsbatch.handlers.edge.generation_handler import GenerationHandler

    root = archive(tmp_path, lm_dir)
    handler = GenerationHandler()
    handler.initialize(make_context(root, {**SECTION, "warmup": False}, batch_size=1))
    handler.close()
    assert handler.profile is None and not os.path.exists(os.path.join(root, GENERATION_PROFILE_FILE))


class Faulty:
    """The runner, but given shapes run out of memory as a device too small for them would."""

    def __init__(self, runner, prefill=(), decode=()):
        self.runner, self.bad_prefill, self.bad_decode = runner, set(prefill), set(decode)
        self.ran: list[tuple[str, int, int]] = []

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def prefill(self, contexts, pad_to=0):
        shape = (len(contexts), max(pad_to, max(len(c) for c in contexts)))
        self.ran.append(("prefill", *shape))
        if shape in self.bad_prefill:
            raise OutOfMemory(f"injected at prefill {shape}")
        return self.runner.prefill(contexts, pad_to)

    def decode(self, rows):
        shape = (len(rows), rows[0][1].length)
        self.ran.append(("decode", *shape))
        if shape in self.bad_decode:
            raise OutOfMemory(f"injected at decode {shape}")
        return self.runner.decode(rows)


def settings(runner, **overrides) -> GenerationSettings:
    values = dict(token_budget=64, kv_bound=4096, max_running=4, queue_cap=8,
                  prefill_edges=prefill_edges(runner.max_positions))
    values.update(overrides)
    return GenerationSettings(**values)


def test_out_of_memory_at_warmup_shapes_lowers_what_the_engine_forms_and_skips_what_it_no_longer_forms(
        runner, tmp_path, events):
    faulty = Faulty(runner, prefill={(4, 16), (1, 96)}, decode={(3, 64)})
    given = settings(runner)
    profile, serving = warm_up_generation(faulty, given, 1, 2, "m", str(tmp_path), 120)
    # (4, 16) ran out: the budget is what fitted, 3 x 16; (1, 96) did: nothing past edge 80 runs
    # (kv_bound 80); decode of 3 at context 64 did: learned below 3 x 65 by the policy's own rule
    assert (serving.token_budget, serving.max_running) == (48, 4)
    assert serving.kv_bound == 80
    assert profile.environment["out_of_memory"] == [{"kind": "prefill", "batch": 4, "bucket": 16},
                                                    {"kind": "prefill", "batch": 1, "bucket": 96}]
    # (3, 64) was never tried: kv_bound 80 holds one row of context 64, not three
    planned = prefill_shapes(given.prefill_edges, 4, 64)
    kept = [(s.batch, s.bucket) for s in planned if formable("prefill", s, serving)]
    assert set(kept) <= set(shapes(profile.prefill))
    assert (4, 16) not in shapes(profile.prefill) and (2, 32) not in shapes(profile.prefill)  # within 64, not 48
    assert max(t.bucket for t in profile.prefill) == 80 and (4, 8) in shapes(profile.prefill)
    assert shapes(profile.decode) == [(1, 64)]
    assert profile.environment["serving"] == {"token_budget": 48, "max_running": 4, "kv_bound": 80}
    assert [e["event"] for e in events].count("out_of_memory") == 2
    assert GenerationProfile.load(os.path.join(tmp_path, GENERATION_PROFILE_FILE)) == profile


def test_out_of_memory_at_a_decode_batch_learns_the_kv_bound_down(runner, tmp_path):
    faulty = Faulty(runner, decode={(3, 64)})
    profile, serving = warm_up_generation(faulty, settings(runner), 1, 2, "m", str(tmp_path), 120)
    assert serving.kv_bound == int(3 * 65 * 0.9) and (serving.token_budget, serving.max_running) == (64, 4)
    assert shapes(profile.decode) == [(1, 64), (2, 64)]  # 3 and 4 rows of 64, any of 511: past the bound
    assert profile.environment["out_of_memory"] == [{"kind": "decode", "batch": 3, "bucket": 64}]
    assert ("decode", 4, 64) not in faulty.ran and ("decode", 1, 511) not in faulty.ran


def test_out_of_memory_at_load_through_the_handler_still_loads_and_serves_as_alone(lm_dir, tmp_path, monkeypatch):
    """The model itself runs out (torch's error, raised in its forward) past 40 tokens fed a step."""
    from tsbatch.handlers.edge.generation_handler import GenerationHandler

    built = GenerationRunner.__init__

    def small_device(self, *args, **kwargs):
        built(self, *args, **kwargs)

        def before(module, args, kwargs):
            if kwargs["input_ids"].numel() > 40:
                raise torch.OutOfMemoryError("CPU out of memory (injected)")

        self.lm.register_forward_pre_hook(before, with_kwargs=True)

    monkeypatch.setattr(GenerationRunner, "__init__", small_device)
    root = archive(tmp_path, lm_dir)
    handler = GenerationHandler()
    handler.initialize(make_context(root, SECTION, batch_size=1))
    try:
        profile, policy = handler.profile, handler.engine.policy
        assert profile.environment["out_of_memory"] and all(t.batch * t.bucket <= 40 for t in profile.prefill)
        assert policy.settings.token_budget <= 40 and policy.kv_bound < 48
        prompt = handler.runner.encode("hello there")
        seq = handler.engine.submit(GenerationRequest("r", tuple(prompt), 6, 0.0))
        while seq.status is not Status.FINISHED:
            threading_wait()
        assert seq.tokens == alone(handler.runner, prompt, 6)
    finally:
        handler.close()
