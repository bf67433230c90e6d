"""What generation warmup lowers when a shape runs out of memory, and which shapes the lowered
settings still form (pure: no model)."""
from __future__ import annotations

import pytest

from tsbatch.handlers.core.errors import ConfigError
from tsbatch.handlers.core.generation_policy import GenerationSettings
from tsbatch.handlers.edge.generation_api import GenerationConfig
from tsbatch.handlers.runtime.generation_warming import formable, lowered
from tsbatch.warmup.generation_profile import prefill_edges, prefill_shapes
from tsbatch.warmup.plan import Shape

pytestmark = pytest.mark.unit

EDGES = prefill_edges(512)


def settings(**overrides) -> GenerationSettings:
    values = dict(token_budget=128, kv_bound=4096, max_running=8, queue_cap=8, prefill_edges=EDGES)
    values.update(overrides)
    return GenerationSettings(**values)


def test_every_planned_shape_is_formable_under_the_settings_it_was_planned_for():
    s = settings()
    assert all(formable("prefill", shape, s) for shape in prefill_shapes(EDGES, 8, 128))
    assert not formable("prefill", Shape(9, 8), s) and not formable("prefill", Shape(2, 96), s)
    assert formable("prefill", Shape(1, 512), s)  # one row alone may pass the budget


def test_a_prefill_of_several_rows_out_of_memory_lowers_the_budget_to_what_fitted():
    s = lowered("prefill", Shape(4, 24), settings())
    assert (s.token_budget, s.max_running, s.kv_bound) == (72, 8, 4096)
    assert not formable("prefill", Shape(4, 24), s) and formable("prefill", Shape(3, 24), s)
    tight = lowered("prefill", Shape(2, 8), settings())  # a budget of 8 seats at most 8
    assert (tight.token_budget, tight.max_running) == (8, 8)


def test_one_row_out_of_memory_bounds_the_kv_cache_below_its_edge_so_no_longer_ask_is_admitted():
    s = lowered("prefill", Shape(1, 96), settings())
    below = max(e for e in EDGES if e < 96)  # 80
    assert s.kv_bound == below and s.token_budget == 128
    assert formable("prefill", Shape(1, below), s) and not formable("prefill", Shape(1, 96), s)
    assert not formable("prefill", Shape(1, 128), s)


def test_a_decode_out_of_memory_learns_the_bound_down_as_the_policy_does_at_run_time():
    s = lowered("decode", Shape(4, 64), settings())
    assert s.kv_bound == int(4 * 65 * 0.9)
    assert formable("decode", Shape(3, 64), s) and not formable("decode", Shape(4, 64), s)
    assert not formable("decode", Shape(1, 511), s)
    assert lowered("decode", Shape(4, 64), s).kv_bound == s.kv_bound  # only ever down


def test_warmup_settings_are_checked_at_load():
    config = GenerationConfig.from_section({"task": "generation"})
    assert (config.warmup, config.warmup_repeats, config.warmup_max_repeats) == (True, 3, 6)
    with pytest.raises(ConfigError, match=r"warmup_max_repeats \(2\) must be at least warmup_repeats \(3\)"):
        GenerationConfig.from_section({"task": "generation", "warmup_max_repeats": 2})


def test_the_warming_module_loads_neither_torch_nor_torchserve_nor_the_edge():
    from tests.unit.test_pure_imports import imported_heavy_modules

    assert imported_heavy_modules("tsbatch.handlers.runtime.generation_warming", "tsbatch.warmup.generation_profile") == []
