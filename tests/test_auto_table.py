"""The auto table: decisions derived from measured points, and lookups."""

import json

import pytest

from jax_ep import auto_table
from jax_ep.ops import OPS


def _points(rows):
    return [{"tokens": t, "kernel_us": k, "reference_us": r} for t, k, r in rows]


@pytest.mark.parametrize("rows,want", [
    ([(128, 10, 20), (4096, 100, 300)], 0),                       # faster everywhere
    ([(128, 30, 20), (512, 25, 30), (4096, 100, 300)], 512),      # loses at the smallest
    ([(128, 10, 20), (512, 40, 30), (4096, 100, 300)], 4096),     # a loss above 128 moves it up
    ([(128, 10, 20), (4096, 400, 300)], None),                    # loses at the largest
    ([(4096, 100, 300), (4096, 400, 300)], None),                 # one shape of two loses
    ([(128, 20, 20)], 0),                                         # a tie counts as a win
])
def test_min_tokens(rows, want):
    assert auto_table.min_tokens(_points(rows)) == want


def test_lookup(monkeypatch, tmp_path):
    path = tmp_path / "auto_table.json"
    path.write_text(json.dumps({"ops": {"dispatch": {"expert_major": {"min_tokens": 512}},
                                        "combine": {"expert_major": {"min_tokens": None}}}}))
    monkeypatch.setattr(auto_table, "TABLE_FILE", path)
    auto_table.table.cache_clear()
    try:
        assert not auto_table.kernel_faster("dispatch", "expert_major", 256)
        assert auto_table.kernel_faster("dispatch", "expert_major", 512)
        assert not auto_table.kernel_faster("combine", "expert_major", 8192)
        assert not auto_table.kernel_faster("broadcast", "expert_major", 8192)  # not measured
        with pytest.raises(ValueError, match="layout must be one of"):
            auto_table.kernel_faster("dispatch", "token_major", 512)
    finally:
        auto_table.table.cache_clear()


def test_shipped_table_names_known_ops():
    shipped = auto_table.table()
    for op, layouts in shipped.get("ops", {}).items():
        assert op in OPS, op
        for layout, entry in layouts.items():
            assert layout in auto_table.LAYOUTS
            assert entry["min_tokens"] is None or entry["min_tokens"] >= 0
            from_points = auto_table.min_tokens(entry["points"])
            if "min_tokens_ops" in entry:  # vetoed by the layer step
                assert "vetoed" in shipped and entry["min_tokens"] is None
                assert entry["min_tokens_ops"] == from_points, (op, layout)
            else:
                assert entry["min_tokens"] == from_points, (op, layout)

