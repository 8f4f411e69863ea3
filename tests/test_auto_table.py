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
    path.write_text(json.dumps({"ops": {
        "dispatch": {"expert_major": {"min_tokens": {"1": 0, "2": 512, "8": 4096}}},
        "combine": {"expert_major": {"min_tokens": {"2": None}}},
        "broadcast": {"expert_major": {"min_tokens": {"1": 128}}}}}))
    monkeypatch.setattr(auto_table, "TABLE_FILE", path)
    auto_table.table.cache_clear()
    try:
        assert not auto_table.kernel_faster("dispatch", "expert_major", 256, 2)
        assert auto_table.kernel_faster("dispatch", "expert_major", 512, 2)
        assert auto_table.kernel_faster("dispatch", "expert_major", 128, 1)       # EP1's own row
        assert auto_table.kernel_faster("dispatch", "expert_major", 512, 4)       # EP2's: the largest below
        assert not auto_table.kernel_faster("dispatch", "expert_major", 2048, 8)  # EP8's own
        assert not auto_table.kernel_faster("dispatch", "expert_major", 2048, 16)  # EP8's
        assert not auto_table.kernel_faster("combine", "expert_major", 8192, 2)
        assert not auto_table.kernel_faster("combine", "expert_major", 8192, 1)   # no EP1 row
        assert auto_table.kernel_faster("broadcast", "expert_major", 128, 1)
        assert not auto_table.kernel_faster("broadcast", "expert_major", 8192, 2)  # EP1 never stands in
        assert not auto_table.kernel_faster("slot_values", "expert_major", 8192, 2)  # not measured
        with pytest.raises(ValueError, match="layout must be one of"):
            auto_table.kernel_faster("dispatch", "token_major", 512, 2)
    finally:
        auto_table.table.cache_clear()


def test_in_place_forms_take_their_own_entry_and_their_plain_ops_where_it_has_none(monkeypatch, tmp_path):
    """The MoE layer's in-place backward (broadcast_in_place, combine_bwd_in_place) runs its plain op's
    backend function; 'auto' takes the form's own decision where the table has one for the EP size, the
    plain op's where it has none (measured at EP1 only: the plain op's at EP2 and EP4)."""
    assert OPS["broadcast_in_place"].function == "broadcast" and OPS["broadcast"].function == "broadcast"
    assert OPS["combine_bwd_in_place"].function == "combine_bwd"
    path = tmp_path / "auto_table.json"
    path.write_text(json.dumps({"ops": {
        "broadcast": {"expert_major": {"min_tokens": {"1": 2048, "2": 4096}}},
        "broadcast_in_place": {"expert_major": {"min_tokens": {"1": 512}}},
        "combine_bwd": {"expert_major": {"min_tokens": {"2": 2048}}},
        "combine_bwd_in_place": {"expert_major": {"min_tokens": {"2": None}}}}}))
    monkeypatch.setattr(auto_table, "TABLE_FILE", path)
    auto_table.table.cache_clear()
    try:
        faster, by = auto_table.kernel_faster, auto_table.decided_by
        assert faster("broadcast_in_place", "expert_major", 512, 1)             # its own, below broadcast's
        assert not faster("broadcast_in_place", "expert_major", 256, 1)
        assert by("broadcast_in_place", "expert_major", 1) == "broadcast_in_place"
        assert not faster("broadcast_in_place", "expert_major", 2048, 2)        # broadcast's EP2: 4096
        assert faster("broadcast_in_place", "expert_major", 4096, 2) and faster("broadcast_in_place",
                                                                                 "expert_major", 4096, 4)
        assert by("broadcast_in_place", "expert_major", 4) == "broadcast"
        assert not faster("combine_bwd_in_place", "expert_major", 8192, 2)      # its own: never
        assert not faster("combine_bwd_in_place", "expert_major", 8192, 8)      # EP2's own stands for EP8
        assert by("combine_bwd_in_place", "expert_major", 8) == "combine_bwd_in_place"
        assert by("combine_bwd_in_place", "expert_major", 1) == "combine_bwd"   # neither has EP1
        assert not faster("combine_bwd_in_place", "expert_major", 8192, 1)
        assert faster("combine_bwd", "expert_major", 2048, 2)
        assert by("dispatch", "expert_major", 2) == "dispatch"                  # no entry, no form: itself
    finally:
        auto_table.table.cache_clear()


def _scratch_table(monkeypatch, tmp_path, ops):
    path = tmp_path / "auto_table.json"
    path.write_text(json.dumps({"ops": {op: {"expert_major": {"min_tokens": d}} for op, d in ops.items()}}))
    monkeypatch.setattr(auto_table, "TABLE_FILE", path)
    auto_table.table.cache_clear()


def test_a_forms_decision_at_another_ep_size_does_not_override_the_plain_ops_at_this_one(monkeypatch,
                                                                                        tmp_path):
    """The order for a form: its own decision measured at the EP size, the plain op's measured there (a
    veto included), its own that stands in, the plain op's that stands in."""
    faster, by = auto_table.kernel_faster, auto_table.decided_by
    try:
        _scratch_table(monkeypatch, tmp_path, {"broadcast": {"2": 4096, "4": None},
                                               "broadcast_in_place": {"4": 512}})
        assert faster("broadcast_in_place", "expert_major", 512, 4)                # its own at EP4
        assert by("broadcast_in_place", "expert_major", 2) == "broadcast"           # the plain op's EP2 ...
        assert not faster("broadcast_in_place", "expert_major", 2048, 2)            # ... not its own EP4's
        assert faster("broadcast_in_place", "expert_major", 512, 8)                 # its own EP4's stands in
        _scratch_table(monkeypatch, tmp_path, {"broadcast": {"2": 512, "4": None},
                                               "broadcast_in_place": {"2": 512}})
        assert not faster("broadcast_in_place", "expert_major", 8192, 4)            # EP4 vetoed for both
        assert faster("broadcast_in_place", "expert_major", 512, 2)
    finally:
        auto_table.table.cache_clear()


def test_the_op_plans_a_form_by_its_own_row(monkeypatch, tmp_path):
    """Op.plan asks the table for the form's row, not its function's: with the in-place broadcast's kernel
    measured faster and the plain broadcast's not, 'auto' takes the kernel for the form only."""
    import jax

    from jax_ep import cuda_backend, runtime

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(runtime, "available", lambda: (True, ""))
    monkeypatch.setattr(cuda_backend, "unsupported", lambda *a: None)
    try:
        _scratch_table(monkeypatch, tmp_path, {"broadcast": {"2": None}, "broadcast_in_place": {"2": 0}})
        assert OPS["broadcast_in_place"].plan(_cfg(), 2).impl == "cuda"
        assert OPS["broadcast_in_place"].implementation(_cfg(), 2) is cuda_backend.broadcast
        plan = OPS["broadcast"].plan(_cfg(), 2)
        assert plan.impl == "reference" and "did not measure faster" in plan.reason
    finally:
        auto_table.table.cache_clear()


def test_writer_gives_the_in_place_forms_their_own_entry(tmp_path):
    from benchmarks import auto_table as writer

    path = tmp_path / "auto_table.json"
    ep1 = [_record("broadcast", "cuda", 512, 60.0, 1), _record("broadcast", "reference", 512, 40.0, 1),
           _record("broadcast_in_place", "cuda", 512, 30.0, 1),
           _record("broadcast_in_place", "reference", 512, 40.0, 1)]
    table = writer.write(ep1, path)
    assert table["ops"]["broadcast"]["expert_major"]["min_tokens"] == {"1": None}
    assert table["ops"]["broadcast_in_place"]["expert_major"]["min_tokens"] == {"1": 0}


@pytest.mark.parametrize("measured,ep_size,want", [
    ([1, 2], 1, 1), ([2], 1, None), ([2], 2, 2), ([2], 8, 2), ([2, 8], 4, 2), ([2, 8], 16, 8),
    ([4, 8], 2, 4), ([1], 2, None), ([], 2, None),
])
def test_decision_ep_size(measured, ep_size, want):
    assert auto_table.decision_ep_size(measured, ep_size) == want


def _record(op, backend, tokens, us, ep_size, **kw):
    return dict(dict(op=op, backend=backend, layout="expert_major", dtype="bfloat16", tokens_per_rank=tokens,
                     hidden=256, topk=2, num_experts=8, ep_size=ep_size, device_us=us,
                     device=f"{ep_size}x GPU", date="2026-11-24"), **kw)


def test_the_dispatch_ops_are_decided_per_wire_dtype(monkeypatch, tmp_path):
    """An op measured with bf16 and FP8 rows gets a decision per wire dtype (min_tokens_by_dtype), which
    a call of that dtype takes; others take the pooled one. Before 2026-12-05 one decision pooled both:
    the shipped table never took the FP8 rank-major dispatch on one GPU (1.6-2x faster than the reference
    from 512 tokens) because of one bf16 point 3% slower. A layer veto or preference applies to both."""
    from benchmarks import auto_table as writer

    path = tmp_path / "auto_table.json"
    fp8 = dict(dtype="float8_e4m3fn")
    ep1 = [_record("dispatch", "cuda", 512, 10.0, 1), _record("dispatch", "reference", 512, 20.0, 1),
           _record("dispatch", "cuda", 8192, 99.0, 1), _record("dispatch", "reference", 8192, 96.0, 1),
           _record("dispatch", "cuda", 512, 10.0, 1, **fp8),
           _record("dispatch", "reference", 512, 20.0, 1, **fp8),
           _record("dispatch", "cuda", 8192, 50.0, 1, **fp8),
           _record("dispatch", "reference", 8192, 100.0, 1, **fp8)]
    table = writer.write(ep1, path)
    entry = table["ops"]["dispatch"]["expert_major"]
    assert entry["min_tokens"] == {"1": None}
    assert entry["min_tokens_by_dtype"] == {"bfloat16": {"1": None}, "float8_e4m3fn": {"1": 0}}
    monkeypatch.setattr(auto_table, "TABLE_FILE", path)
    auto_table.table.cache_clear()
    try:
        assert auto_table.kernel_faster("dispatch", "expert_major", 8192, 1, "float8_e4m3fn")
        assert not auto_table.kernel_faster("dispatch", "expert_major", 8192, 1, "bfloat16")
        assert not auto_table.kernel_faster("dispatch", "expert_major", 8192, 1, "float32")   # pooled
        assert not auto_table.kernel_faster("dispatch", "expert_major", 8192, 1)
        cfg = _cfg().replace(max_tokens_per_rank=8192)
        assert OPS["dispatch"].kernel_by_default(cfg.replace(dispatch_dtype="float8_e4m3fn"), 1)
        assert not OPS["dispatch"].kernel_by_default(cfg, 1)
    finally:
        auto_table.table.cache_clear()
    layer = [dict(op="moe_layer", shape="mid", config=c, ep_size=1, step_ms=ms)
             for c, ms in (("ep_cuda", 7.0), ("ep_reference", 6.0))]
    table = writer.write(ep1, path, layer_records=layer)      # vetoed: every decision
    assert table["ops"]["dispatch"]["expert_major"]["min_tokens_by_dtype"]["float8_e4m3fn"] == {"1": None}
    assert writer.write([], path, rederive=True)["vetoed"]     # kept when the points are decided again


def test_writer_keeps_other_ep_sizes_and_vetoes_per_ep_size(tmp_path):
    from benchmarks import auto_table as writer

    path = tmp_path / "auto_table.json"
    ep2 = [_record("dispatch", "cuda", 128, 30.0, 2), _record("dispatch", "reference", 128, 20.0, 2),
           _record("dispatch", "cuda", 4096, 100.0, 2), _record("dispatch", "reference", 4096, 300.0, 2),
           _record("combine", "cuda", 4096, 100.0, 2), _record("combine", "reference", 4096, 90.0, 2)]
    table = writer.write(ep2, path)
    assert table["ops"]["dispatch"]["expert_major"]["min_tokens"] == {"2": 4096}
    assert table["ops"]["combine"]["expert_major"]["min_tokens"] == {"2": None}
    ep1 = [_record("dispatch", "cuda", 128, 10.0, 1), _record("dispatch", "reference", 128, 20.0, 1),
           _record("combine", "cuda", 128, 5.0, 1), _record("combine", "reference", 128, 9.0, 1)]
    layer = [dict(op="moe_layer", shape="mid", config=c, ep_size=1, step_ms=ms)
             for c, ms in (("ep_cuda", 7.0), ("ep_reference", 6.0))]
    table = writer.write(ep1, path, layer_records=layer)
    dispatch = table["ops"]["dispatch"]["expert_major"]
    assert dispatch["min_tokens"] == {"1": None, "2": 4096}          # EP1 vetoed by its layer step
    assert dispatch["min_tokens_ops"] == {"1": 0}
    assert set(table["vetoed"]) == {"1"} and "EP1" in table["vetoed"]["1"]
    assert {p["ep_size"] for p in dispatch["points"]} == {1, 2}
    assert table["measured_on"] == {"1": ["1x GPU (2026-11-24)"], "2": ["2x GPU (2026-11-24)"]}
    # an ops-only rerun says nothing of the step: the veto stays (before 2026-12-05 it went)
    table = writer.write(ep1, path)
    assert set(table["vetoed"]) == {"1"}
    assert table["ops"]["dispatch"]["expert_major"]["min_tokens"]["1"] is None
    # a layer run that measures the kernels' step no slower at EP1 lifts it
    faster = [dict(op="moe_layer", shape="mid", config=c, ep_size=1, step_ms=ms)
              for c, ms in (("ep_cuda", 5.9), ("ep_reference", 6.0))]
    table = writer.write(ep1, path, layer_records=faster)
    assert "vetoed" not in table and table["ops"]["dispatch"]["expert_major"]["min_tokens"]["1"] == 0
    table = writer.write(ep1, path, replace=True)                    # only this run's EP size
    assert table["ops"]["dispatch"]["expert_major"]["min_tokens"] == {"1": 0}


def test_writer_takes_the_layers_kernels_where_the_step_measured_them_faster(tmp_path, capsys):
    from benchmarks import auto_table as writer

    path = tmp_path / "auto_table.json"
    ops = [_record("slot_values", "cuda", 4096, 40.0, 2), _record("slot_values", "reference", 4096, 22.0, 2),
           _record("dispatch", "cuda", 4096, 100.0, 2), _record("dispatch", "reference", 4096, 300.0, 2),
           _record("dispatch_rank_major", "cuda", 4096, 90.0, 2),
           _record("dispatch_rank_major", "reference", 4096, 80.0, 2)]
    for r in ops[4:]:
        r["layout"] = "rank_major"

    def layer(cuda_ms, auto_ms, tokens=4096):
        return [dict(op="moe_layer", shape="deepseek", config=c, ep_size=2, step_ms=ms,
                     tokens_per_rank=tokens, device="2x GPU", date="2026-11-29")
                for c, ms in (("ep_cuda", cuda_ms), ("jax_ep", auto_ms))]

    table = writer.write(ops, path, layer_records=layer(21.7, 22.6))
    slot = table["ops"]["slot_values"]["expert_major"]
    assert slot["min_tokens"] == {"2": 4096} and slot["min_tokens_ops"] == {"2": None}
    assert table["ops"]["dispatch"]["expert_major"]["min_tokens"] == {"2": 0}        # already the kernel
    assert "min_tokens_ops" not in table["ops"]["dispatch"]["expert_major"]
    assert table["ops"]["dispatch_rank_major"]["rank_major"]["min_tokens"] == {"2": None}  # not a layer op
    assert "21.70 ms" in table["layer_prefers"]["2"]["why"] and table["layer_prefers"]["2"]["tokens"] == 4096
    # the preference makes jax_ep ep_cuda: a tie keeps it, and so do re-measured op times
    assert writer.write([], path, layer_records=layer(21.7, 21.8))["layer_prefers"]["2"]["tokens"] == 4096
    assert writer.write(ops, path)["ops"]["slot_values"]["expert_major"]["min_tokens"] == {"2": 4096}
    # the kernels measured slower than auto's choice: the ops' own decision again
    table = writer.write([], path, layer_records=layer(23.0, 22.0))
    assert "layer_prefers" not in table
    assert table["ops"]["slot_values"]["expert_major"]["min_tokens"] == {"2": None}
    # measured at 8192 tokens per rank: the kernel from there up only
    assert writer.write(ops, path, layer_records=layer(21.7, 22.6, tokens=8192))["ops"]["slot_values"][
        "expert_major"]["min_tokens"] == {"2": 8192}
    with pytest.raises(SystemExit):
        writer.main(["--replace", "--layer", str(path)])
    assert "--replace" in capsys.readouterr().err


def test_shipped_table_names_known_ops():
    shipped = auto_table.table()
    for op, layouts in shipped.get("ops", {}).items():
        assert op in OPS, op
        for layout, entry in layouts.items():
            assert layout in auto_table.LAYOUTS
            for ep, decision in entry["min_tokens"].items():
                assert decision is None or decision >= 0
                from_points = auto_table.min_tokens([p for p in entry["points"] if str(p["ep_size"]) == ep])
                if ep in entry.get("min_tokens_ops", {}):  # overruled by the layer step
                    assert entry["min_tokens_ops"][ep] == from_points, (op, layout, ep)
                    if ep in shipped.get("vetoed", {}):
                        assert decision is None
                    else:
                        assert decision == shipped["layer_prefers"][ep]["tokens"], (op, layout, ep)
                else:
                    assert decision == from_points, (op, layout, ep)
    check_pull_section(shipped)


def check_pull_section(table: dict) -> None:
    """The pull section (once a multi-GPU run writes one): known knobs, decisions from their points,
    never from one GPU."""
    from benchmarks.auto_table import PULL_OPS

    for knob, entry in table.get("pull", {}).items():
        assert knob in PULL_OPS and entry["ops"] == list(PULL_OPS[knob]), knob
        for ep, by_sms in entry["min_tokens"].items():
            assert int(ep) >= 2, (knob, ep)
            for sms, decision in by_sms.items():
                mine = [dict(p, kernel_us=p["pull_us"], reference_us=p["push_us"]) for p in entry["points"]
                        if (str(p["ep_size"]), str(p["num_sms"])) == (ep, sms)]
                assert decision == auto_table.min_tokens(mine), (knob, ep, sms)


def test_why_taken_says_what_decided(monkeypatch, tmp_path):
    """explain's reason for a kernel 'auto' takes: from how many tokens, which entry and measured EP size
    decided, and whether the op alone or the layer step measured faster (found by a review, 2026-12-05:
    it said "measured faster at T tokens per rank on R GPUs" for EP sizes never measured, for a form
    decided by its plain op's entry, and for a kernel the layer step preferred though it lost alone)."""
    path = tmp_path / "auto_table.json"
    path.write_text(json.dumps({"ops": {
        "slot_values": {"expert_major": {"min_tokens": {"2": 4096}, "min_tokens_ops": {"2": None}}},
        "broadcast": {"expert_major": {"min_tokens": {"2": 2048}}},
        "dispatch": {"expert_major": {"min_tokens": {"1": 512, "2": 0}}},
        "dispatch_rank_major": {"rank_major": {  # decided per wire dtype; min_tokens_ops pooled
            "min_tokens": {"2": 4096}, "min_tokens_ops": {"2": None},
            "min_tokens_by_dtype": {"bfloat16": {"2": 0}, "float8_e4m3fn": {"2": 4096}}}}}}))
    monkeypatch.setattr(auto_table, "TABLE_FILE", path)
    auto_table.table.cache_clear()
    try:
        why = auto_table.why_taken
        assert why("slot_values", "expert_major", 4096, 8) == (
            "the auto table takes its kernel from 4096 tokens per rank (measured on 2 GPUs, standing in for "
            "8): the MoE layer's step measured faster with it, the op alone slower (layer_prefers)")
        assert why("broadcast_in_place", "expert_major", 4096, 2) == (
            "the auto table takes its kernel from 2048 tokens per rank (broadcast's entry, measured on 2 "
            "GPUs): the op measured faster than the reference")
        assert why("dispatch", "expert_major", 512, 1).endswith("(measured on 1 GPU): the op measured "
                                                                "faster than the reference")
        assert why("dispatch", "expert_major", 8, 2).startswith("the auto table takes its kernel at every "
                                                                "token count (measured on 2 GPUs)")
        # a decision per wire dtype: the pooled op-alone decision says nothing about it
        assert why("dispatch_rank_major", "rank_major", 1024, 2, "bfloat16").endswith(
            "(measured on 2 GPUs): it measured faster than the reference, alone or in the MoE layer's step")
    finally:
        auto_table.table.cache_clear()


def test_pull_lookup(monkeypatch, tmp_path):
    """Section "pull": per knob, EP size and SM count, from how many tokens per rank the kernels pull
    their rows; a call takes the nearest measured SM count at its EP size's decision, never on one GPU."""
    path = tmp_path / "auto_table.json"
    path.write_text(json.dumps({"ops": {}, "pull": {
        "dispatch_pull": {"min_tokens": {"4": {"24": 0, "131": 4096}, "2": {"24": None}}},
        "broadcast_pull": {"min_tokens": {"4": {"24": None, "131": None}}}}}))
    monkeypatch.setattr(auto_table, "TABLE_FILE", path)
    auto_table.table.cache_clear()
    try:
        faster = auto_table.pull_faster
        assert faster("dispatch_pull", 128, 4, 24) and faster("dispatch_pull", 128, 4, 16)
        assert not faster("dispatch_pull", 2048, 4, 131) and faster("dispatch_pull", 4096, 4, 131)
        assert not faster("dispatch_pull", 2048, 4, 100) and faster("dispatch_pull", 2048, 4, 60)  # nearest
        assert faster("dispatch_pull", 128, 8, 24)          # EP4's decision: the largest below
        assert not faster("dispatch_pull", 8192, 2, 24)     # EP2's own: never
        assert not faster("dispatch_pull", 8192, 1, 24)     # one GPU: nothing to pull
        assert not faster("broadcast_pull", 8192, 4, 24)
    finally:
        auto_table.table.cache_clear()
    path.write_text(json.dumps({"ops": {}}))               # the shipped table's state: no measurement
    auto_table.table.cache_clear()
    try:
        assert not auto_table.pull_faster("dispatch_pull", 8192, 4, 24)
    finally:
        auto_table.table.cache_clear()


def _pull_record(op, setting, us, ep_size=4, sms=24, tokens=4096, **kw):
    return _record(op, "cuda", tokens, us, ep_size, num_sms=sms, pull_setting=setting,
                   pull=setting == "pull", **kw)


def test_pull_writer_pairs_pushed_and_pulled_runs_on_separate_gpus(tmp_path):
    """benchmarks.auto_table from `--pull both` records: pushed and pulled cuda records pair per op,
    shape, EP size and SM count; MPS runs (shared_gpu) and EP1 never decide; broadcast is decided by
    its in-place form where the run has it; such records never pair with the reference; a later run
    keeps the other EP sizes' points."""
    from benchmarks import auto_table as writer

    path = tmp_path / "auto_table.json"
    records = [
        _pull_record("dispatch", "push", 500.0), _pull_record("dispatch", "pull", 450.0),
        _pull_record("dispatch", "push", 300.0, sms=131), _pull_record("dispatch", "pull", 320.0, sms=131),
        _pull_record("dispatch", "push", 300.0, tokens=512),
        _pull_record("dispatch", "pull", 310.0, tokens=512),
        _pull_record("broadcast", "push", 900.0), _pull_record("broadcast", "pull", 950.0),
        _pull_record("broadcast_in_place", "push", 500.0), _pull_record("broadcast_in_place", "pull", 460.0),
        _pull_record("dispatch", "push", 100.0, ep_size=2, shared_gpu=True),
        _pull_record("dispatch", "pull", 50.0, ep_size=2, shared_gpu=True),
        _pull_record("dispatch", "push", 100.0, ep_size=1), _pull_record("dispatch", "pull", 50.0, ep_size=1),
        _pull_record("combine", "push", 100.0), _pull_record("combine", "pull", 90.0),   # no knob of its own
        _record("dispatch", "reference", 4096, 900.0, 4),   # a pushed run is not the default: no pair
    ]
    table = writer.write(records, path)
    assert table["ops"] == {}
    dispatch = table["pull"]["dispatch_pull"]
    assert dispatch["min_tokens"] == {"4": {"24": 4096, "131": None}}
    assert {(p["ep_size"], p["num_sms"], p["tokens"]) for p in dispatch["points"]} == {
        (4, 24, 4096), (4, 131, 4096), (4, 24, 512)}
    assert table["pull"]["broadcast_pull"]["min_tokens"] == {"4": {"24": 0}}
    check_pull_section(table)
    broken = json.loads(json.dumps(table))
    broken["pull"]["dispatch_pull"]["min_tokens"]["4"]["24"] = 0
    with pytest.raises(AssertionError):
        check_pull_section(broken)
    assert [p["op"] for p in table["pull"]["broadcast_pull"]["points"]] == ["broadcast_in_place"]
    ep2 = [_pull_record("dispatch", "push", 400.0, ep_size=2),
           _pull_record("dispatch", "pull", 410.0, ep_size=2)]
    table = writer.write(ep2, path)
    assert table["pull"]["dispatch_pull"]["min_tokens"] == {"2": {"24": None}, "4": {"24": 4096, "131": None}}
    assert table["measured_on"]["2"] == ["2x GPU (2026-11-24)"]          # the pull points' devices
    backends = [_record("dispatch", "cuda", 4096, 100.0, 4), _record("dispatch", "reference", 4096, 300.0, 4)]
    writer.write(backends, path)
    table = writer.write(ep2, path, replace=True)          # replaces the pull section only
    assert table["pull"]["dispatch_pull"]["min_tokens"] == {"2": {"24": None}}
    assert table["ops"]["dispatch"]["expert_major"]["min_tokens"] == {"4": 0}
    table = writer.write(backends, path, replace=True)     # and the other way round
    assert table["pull"]["dispatch_pull"]["min_tokens"] == {"2": {"24": None}}
    # default runs (pull_setting auto) pair with the reference as before
    auto = [_record("dispatch", "cuda", 4096, 100.0, 4, pull_setting="auto", pull=True),
            _record("dispatch", "reference", 4096, 300.0, 4)]
    assert writer.write(auto, path)["ops"]["dispatch"]["expert_major"]["min_tokens"] == {"4": 0}
    with pytest.raises(ValueError, match="nothing to decide"):
        writer.write(records[10:14], path)


def _cfg(**kw):
    import jax_ep

    return jax_ep.EPConfig(num_experts=64, num_topk=8, hidden=1024, max_tokens_per_rank=4096,
                           axis_name="ep", **kw)


def test_explain_names_each_ops_choice_and_why_on_this_machine():
    """jax_ep.explain: every EP op, its implementation and the reason; here (no GPU) backend='auto'
    takes the reference for each op, naming the table where the kernel never measured faster and
    otherwise the platform; backend='reference' says so; misuse is refused by name."""
    import jax_ep

    plans = jax_ep.explain(_cfg(), 2)
    assert list(plans) == list(OPS)
    for name, plan in plans.items():
        assert plan.op == name and plan.impl == "reference"
        if OPS[name].kernel_by_default(_cfg(), 2):
            assert plan.reason == "backend='auto': the platform of the call is 'cpu', not 'gpu'"
        else:
            assert "did not measure faster" in plan.reason and "4096 tokens per rank on 2 GPUs" in plan.reason
    assert jax_ep.explain(_cfg(backend="reference"), 4, ops=["dispatch"]) == {
        "dispatch": jax_ep.ops.OpPlan("dispatch", "reference", "backend='reference'")}
    with pytest.raises(jax_ep.EPValueError, match=r"unknown ops \['dispatchh'\]"):
        jax_ep.explain(_cfg(), 2, ops=["dispatchh"])
    with pytest.raises(jax_ep.EPTypeError, match="cfg must be a jax_ep.EPConfig"):
        jax_ep.explain({"backend": "auto"}, 2)


def test_explain_is_the_choice_the_op_makes(monkeypatch):
    """On a machine where the kernels can run (platform, extension and table stood in for), explain
    and the op's implementation agree case by case: the kernel; the reference where the kernel does
    not support the sizes (the reason quoting why), where the extension is unavailable, or the table
    says the reference is faster; backend='cuda' raises where 'auto' would fall back."""
    import jax

    import jax_ep
    from jax_ep import cuda_backend, ops, reference, runtime

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(runtime, "available", lambda: (True, ""))
    monkeypatch.setattr(auto_table, "kernel_faster", lambda *a: True)
    monkeypatch.setattr(cuda_backend, "unsupported", lambda *a: None)
    cfg = _cfg()

    def agree(name, impl):
        plan = jax_ep.explain(cfg, 2, ops=[name])[name]
        chosen = OPS[name].implementation(cfg, 2, jax.numpy.bfloat16)
        assert plan.impl == impl and chosen is getattr(cuda_backend if impl == "cuda" else reference, name)
        return plan.reason

    assert "the auto table takes its kernel" in agree("dispatch", "cuda")
    assert "(measured on 2 GPUs): it measured faster than the reference, alone or in the MoE layer's step, " \
        "and it runs here" in agree("dispatch", "cuda")   # (the shipped dispatch is decided per wire dtype)
    monkeypatch.setattr(cuda_backend, "unsupported", lambda *a: "num_topk=8 exceeds 4")
    assert agree("dispatch", "reference").endswith("does not support this call: num_topk=8 exceeds 4")
    with pytest.raises(jax_ep.EPValueError, match="num_topk=8 exceeds 4"):
        ops.OPS["dispatch"].plan(_cfg(backend="cuda"), 2)
    monkeypatch.setattr(cuda_backend, "unsupported", lambda *a: None)
    monkeypatch.setattr(runtime, "available", lambda: (False, "the CUDA extension jax_ep._C is not built"))
    assert "unavailable: the CUDA extension jax_ep._C is not built" in agree("combine", "reference")
    monkeypatch.setattr(runtime, "available", lambda: (True, ""))
    monkeypatch.setattr(auto_table, "kernel_faster", lambda *a: False)
    assert "did not measure faster" in agree("combine_bwd", "reference")


def test_points_take_the_kernels_on_the_most_sms_and_refuse_duplicates():
    """Of cuda records at several SM counts (--num-sms) the one on the most SMs (the default) decides,
    whatever the file's order (before 2026-12-05 the last record won); a duplicate is an error."""
    from benchmarks import auto_table as writer

    ref = _record("dispatch", "reference", 4096, 300.0, 2)
    all_sms = _record("dispatch", "cuda", 4096, 200.0, 2, num_sms=132)
    few = _record("dispatch", "cuda", 4096, 500.0, 2, num_sms=24)
    for records in ([ref, all_sms, few], [few, all_sms, ref]):
        (point,) = writer.points_of(records)[("dispatch", "expert_major")]
        assert point["kernel_us"] == 200.0 and point["reference_us"] == 300.0
    with pytest.raises(ValueError, match="two cuda records .* on 132 SMs"):
        writer.points_of([ref, all_sms, dict(all_sms)])


def test_writer_keeps_the_points_of_the_ops_and_dtypes_a_run_did_not_measure(tmp_path, capsys):
    """A run replaces only the (op, layout, wire dtype, EP size) it measured: a --rank-major run keeps
    the expert-major ops' EP2 decisions, an FP8-only run the bf16 ones (before 2026-12-05 both went).
    Two runs passed as two files are two runs: a point both measured (combine, timed in the first pass
    of each --dtypes split) is the later file's; a duplicate inside one file, or one file twice, is refused
    by name."""
    from benchmarks import auto_table as writer

    path = tmp_path / "auto_table.json"
    fp8 = dict(dtype="float8_e4m3fn")
    expert_major = [_record("dispatch", "cuda", 4096, 100.0, 2),
                    _record("dispatch", "reference", 4096, 300.0, 2),
                    _record("combine", "cuda", 4096, 100.0, 2),
                    _record("combine", "reference", 4096, 90.0, 2)]
    writer.write(expert_major, path)
    rank_major = [dict(_record("dispatch_rank_major", b, 4096, us, 2), layout="rank_major")
                  for b, us in (("cuda", 50.0), ("reference", 90.0))]
    table = writer.write(rank_major, path)
    assert table["ops"]["dispatch"]["expert_major"]["min_tokens"] == {"2": 0}
    assert table["ops"]["combine"]["expert_major"]["min_tokens"] == {"2": None}
    assert table["ops"]["dispatch_rank_major"]["rank_major"]["min_tokens"] == {"2": 0}
    # a bf16-only run then an FP8-only run of the same shape: each dtype keeps its decision
    fp8_run = [_record("dispatch", "cuda", 4096, 300.0, 2, **fp8),
               _record("dispatch", "reference", 4096, 200.0, 2, **fp8),
               _record("combine", "cuda", 4096, 80.0, 2), _record("combine", "reference", 4096, 90.0, 2)]
    dispatch = writer.write(fp8_run, path)["ops"]["dispatch"]["expert_major"]
    assert dispatch["min_tokens_by_dtype"] == {"bfloat16": {"2": 0}, "float8_e4m3fn": {"2": None}}
    # the two runs as two files, together: not refused; combine from the later file
    (tmp_path / "bf16.json").write_text(json.dumps(expert_major))
    (tmp_path / "fp8.json").write_text(json.dumps(fp8_run))
    fresh = tmp_path / "fresh.json"
    fresh.write_text("{}")      # not a copy of the shipped table
    writer.main([str(tmp_path / "bf16.json"), str(tmp_path / "fp8.json"), "--table", str(fresh)])
    assert "measured in " + str(tmp_path / "bf16.json") in capsys.readouterr().out
    table = json.loads(fresh.read_text())
    assert table["ops"]["combine"]["expert_major"]["min_tokens"]["2"] == 0      # fp8.json's 80 < 90
    assert table["ops"]["dispatch"]["expert_major"]["min_tokens_by_dtype"]["float8_e4m3fn"]["2"] is None
    with pytest.raises(SystemExit):
        writer.main([str(tmp_path / "bf16.json"), str(tmp_path / "bf16.json"), "--table", str(fresh)])
    assert "bf16.json given twice" in capsys.readouterr().err
    with pytest.raises(ValueError, match="twice.json: two cuda records"):
        writer.write({"twice.json": expert_major + expert_major[:1]}, path)


def test_replace_keeps_the_layers_preferences_as_it_keeps_its_vetoes(tmp_path):
    """--replace drops the table's op points, not the layer's word: a preference stays until a layer run
    measures the kernels slower, as a veto does (before 2026-12-05 --replace dropped the preferences)."""
    from benchmarks import auto_table as writer

    path = tmp_path / "auto_table.json"
    ops = [_record("slot_values", "cuda", 2048, 30.0, 4), _record("slot_values", "reference", 2048, 20.0, 4),
           _record("combine", "cuda", 2048, 30.0, 8), _record("combine", "reference", 2048, 20.0, 8)]
    layer = [dict(op="moe_layer", shape="mid", config=c, ep_size=ep, step_ms=ms, tokens_per_rank=2048)
             for ep, c, ms in ((4, "ep_cuda", 9.0), (4, "jax_ep", 10.0),
                               (8, "ep_cuda", 9.0), (8, "ep_reference", 8.0))]
    table = writer.write(ops, path, layer_records=layer)
    assert set(table["layer_prefers"]) == {"4"} and set(table["vetoed"]) == {"8"}
    table = writer.write(ops, path, replace=True)
    assert set(table["layer_prefers"]) == {"4"} and set(table["vetoed"]) == {"8"}
    assert table["ops"]["slot_values"]["expert_major"]["min_tokens"] == {"4": 2048}


def test_cli_refuses_unusable_record_files_by_name(tmp_path, capsys):
    """A missing or unreadable file, the layer's records given as op records, and records without a cuda
    and reference pair are parser errors naming the option and the file (before 2026-12-05: tracebacks),
    and leave no copy of the shipped table behind."""
    from benchmarks import auto_table as writer

    table = tmp_path / "copy.json"
    cuda_only = tmp_path / "cuda_only.json"
    cuda_only.write_text(json.dumps([_record("dispatch", "cuda", 128, 10.0, 1)]))
    layer = tmp_path / "layer.json"
    layer.write_text(json.dumps([dict(op="moe_layer", shape="small", config="jax_ep", ep_size=1,
                                      step_ms=2.0)]))
    broken = tmp_path / "broken.json"
    broken.write_text("[{")
    missing = tmp_path / "missing.json"
    for argv, message in (
            ([str(missing)], f"error: ops {missing}: [Errno 2] No such file or directory"),
            ([str(broken)], f"error: ops {broken}: Expecting property name"),
            ([str(layer)], f"error: ops {layer}: records without a backend"),
            (["--layer", str(missing)], f"error: --layer {missing}: [Errno 2]"),
            ([str(cuda_only)], f"error: ops {cuda_only}: no op has both a cuda and a reference record")):
        with pytest.raises(SystemExit) as exc:
            writer.main([*argv, "--table", str(table)])
        assert exc.value.code == 2, argv
        assert message in capsys.readouterr().err, argv
        assert not table.exists(), argv


def test_pull_writer_keeps_the_points_of_the_ops_and_sm_counts_a_run_did_not_measure(tmp_path, capsys):
    """Section "pull" as the backends' (found 2026-12-05: it kept old points only at EP sizes a run did
    not measure, so `--rank-major --pull both` dropped the expert-major dispatch's points there): a run
    replaces the (op, wire dtype, EP size, SM count) it measured; broadcast's in-place form decides over
    the plain op whichever run measured which; two files are two runs (a pair both measured is the later
    file's, printed), a duplicate inside one file is refused naming it."""
    from benchmarks import auto_table as writer

    path = tmp_path / "auto_table.json"
    expert_major = [_pull_record("dispatch", "push", 500.0, ep_size=2),
                    _pull_record("dispatch", "pull", 450.0, ep_size=2),
                    _pull_record("broadcast_in_place", "push", 500.0, ep_size=2),
                    _pull_record("broadcast_in_place", "pull", 460.0, ep_size=2)]
    writer.write(expert_major, path)
    rank_major = [_pull_record("dispatch_rank_major", s, us, ep_size=2, layout="rank_major")
                  for s, us in (("push", 300.0), ("pull", 400.0))]
    table = writer.write(rank_major, path)
    dispatch = table["pull"]["dispatch_pull"]
    assert sorted(p["op"] for p in dispatch["points"]) == ["dispatch", "dispatch_rank_major"]
    assert dispatch["min_tokens"] == {"2": {"24": None}}          # the rank-major form loses: one of two
    assert [p["op"] for p in table["pull"]["broadcast_pull"]["points"]] == ["broadcast_in_place"]
    # another SM count and another wire dtype keep the 24-SM bf16 points
    fp8_131 = [_pull_record("dispatch", s, us, ep_size=2, sms=131, dtype="float8_e4m3fn")
               for s, us in (("push", 200.0), ("pull", 190.0))]
    table = writer.write(fp8_131, path)
    assert table["pull"]["dispatch_pull"]["min_tokens"] == {"2": {"24": None, "131": 0}}
    assert len(table["pull"]["dispatch_pull"]["points"]) == 3
    # a later run of the plain broadcast alone: the table's in-place points still decide
    plain = [_pull_record("broadcast", s, us, ep_size=2) for s, us in (("push", 100.0), ("pull", 900.0))]
    table = writer.write(plain, path)
    assert [p["op"] for p in table["pull"]["broadcast_pull"]["points"]] == ["broadcast_in_place"]
    assert table["pull"]["broadcast_pull"]["min_tokens"] == {"2": {"24": 0}}
    check_pull_section(table)
    # two runs' files, together: not refused; the pair both measured is the later file's
    later = [_pull_record("dispatch", "push", 500.0, ep_size=2),
             _pull_record("dispatch", "pull", 550.0, ep_size=2)]
    (tmp_path / "first.json").write_text(json.dumps(expert_major))
    (tmp_path / "later.json").write_text(json.dumps(later + plain))
    fresh = tmp_path / "fresh.json"
    fresh.write_text("{}")      # not a copy of the shipped table
    writer.main([str(tmp_path / "first.json"), str(tmp_path / "later.json"), "--table", str(fresh)])
    assert (f"dispatch_pull dispatch bfloat16 EP2 24 SMs 4096 tokens per rank: measured in "
            f"{tmp_path / 'first.json'} and {tmp_path / 'later.json'}") in capsys.readouterr().out
    table = json.loads(fresh.read_text())
    assert [p["pull_us"] for p in table["pull"]["dispatch_pull"]["points"]] == [550.0]
    assert table["pull"]["dispatch_pull"]["min_tokens"] == {"2": {"24": None}}
    # the later file's plain broadcast gives way to the earlier one's in-place form
    assert [p["op"] for p in table["pull"]["broadcast_pull"]["points"]] == ["broadcast_in_place"]
    with pytest.raises(ValueError, match="twice.json: two push records .* in one run's records"):
        writer.write({"twice.json": later + later[:1]}, path)
    (tmp_path / "twice.json").write_text(json.dumps(later + later[:1]))
    with pytest.raises(SystemExit):
        writer.main([str(tmp_path / "twice.json"), "--table", str(fresh)])
    assert f"ops {tmp_path / 'twice.json'}: two push records" in capsys.readouterr().err
