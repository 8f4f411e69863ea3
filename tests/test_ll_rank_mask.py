"""Rank masking in the low-latency ops on the reference path (issue 15 item 1): ``ll_dispatch(...,
rank_mask=)``, ``ll_combine(..., rank_mask=)`` and their two-phase forms, against the NumPy model
(tests/numpy_model.py: a masked rank sends and receives nothing; pairs to or of it are dropped and
counted; combine adds +0.0 for them), on random routings and random masks (a rank masking itself
included). The CUDA kernels are checked against the same reference on the CPU kernel emulator
(tools/kernel_emulator/ll_run.py, tests/test_kernel_emulator.py).
"""

from __future__ import annotations

import functools

import jax
import ml_dtypes
import numpy as np
import numpy_model as nm
import pytest
from helpers import (
    assert_bits_equal,
    lower_cuda_here,
    make_cfg,
    parametrize_slow_tail,
    per_rank,
    random_inputs,
    random_routing,
    to_numpy,
)

import jax_ep

E, K, H, TMAX = 8, 3, 256, 16
BF16 = make_cfg(num_experts=E, num_topk=K, hidden=H, max_tokens_per_rank=TMAX, dispatch_dtype="bfloat16",
                backend="reference")
CFGS = {"bfloat16": BF16, "float8_e4m3fn": BF16.replace(dispatch_dtype="float8_e4m3fn")}


@functools.cache
def masked_fn(ep_size, cfg, two_phase):
    """(x, idx, w, y, dispatch mask [R, R], combine mask [R, R]) -> (LLDispatched, combine) per rank
    (each rank gets its copy of the masks: row r)."""

    def f(x, idx, w, y, dmask, cmask):
        if two_phase:
            d = jax_ep.ll_dispatch_recv(jax_ep.ll_dispatch_send(x, idx, w, cfg, rank_mask=dmask), cfg)
            out = jax_ep.ll_combine_recv(jax_ep.ll_combine_send(y, d.handle, cfg, rank_mask=cmask), cfg)
        else:
            d = jax_ep.ll_dispatch(x, idx, w, cfg, rank_mask=dmask)
            out = jax_ep.ll_combine(y, d.handle, cfg, rank_mask=cmask)
        return d, out

    return per_rank(f, ep_size)


def inputs(rng, ep_size, tokens, dtype):
    x, w = random_inputs(rng, ep_size, tokens, H, K)
    return x.astype(ml_dtypes.bfloat16), random_routing(rng, ep_size, tokens, K, E), w


def poisoned_y(rng, m: nm.LLModel, ep_size, tokens):
    """Random expert outputs, NaN in every slot the masked call did not fill (pairs to masked ranks
    included): none may reach combine."""
    y = rng.standard_normal((ep_size, E // ep_size, ep_size * tokens, H)).astype(np.float32)
    filled = np.stack([r.filled for r in m.ranks])
    return np.where(filled[..., None], y, np.nan).astype(ml_dtypes.bfloat16)


def run(ep_size, dtype, two_phase, x, idx, w, y, dmask, cmask):
    tile = lambda m: np.tile(np.asarray(m, np.int32), (ep_size, 1))  # noqa: E731
    return to_numpy(masked_fn(ep_size, CFGS[dtype], two_phase)(x, idx, w, y, tile(dmask), tile(cmask)))


def assert_matches(d, out, m: nm.LLModel, y, cmask, ep_size):
    for r in range(ep_size):
        mr = m.ranks[r]
        assert_bits_equal(d.counts[r], mr.counts, f"rank {r} counts")
        assert_bits_equal(d.handle.src_slot[r], mr.src_slot, f"rank {r} src_slot")
        assert_bits_equal(d.x[r][mr.filled], mr.x[mr.filled], f"rank {r} x")
        if mr.scales is not None:
            assert_bits_equal(d.scales[r][mr.filled], mr.scales[mr.filled], f"rank {r} scales")
        assert_bits_equal(d.handle.topk_weights[r], m.weights[r], f"rank {r} weights")
        assert_bits_equal(d.handle.dest_rank[r], m.dest_rank[r], f"rank {r} dest_rank")
        assert int(d.num_dropped[r]) == int(m.num_dropped[r]), f"rank {r} num_dropped"
        assert d.rank_mask[r].tolist() == m.active.astype(np.int32).tolist()
    assert np.isfinite(out.astype(np.float32)).all(), "a masked or unfilled slot leaked into combine"
    assert_bits_equal(out, nm.ll_combine(y, m, cmask), "ll_combine")


@parametrize_slow_tail("two_phase", [False, True])
@parametrize_slow_tail("ep_size,dtype", [(2, "bfloat16"), (4, "float8_e4m3fn"), (4, "bfloat16"),
                                           (8, "bfloat16")])
def test_ll_rank_mask_matches_model(ep_size, dtype, two_phase):
    rng = np.random.default_rng(ep_size * 10 + two_phase + (dtype == "bfloat16") * 100)
    masked_any = dropped_any = 0
    for _ in range(3):
        tokens = int(rng.integers(1, TMAX + 1))
        x, idx, w = inputs(rng, ep_size, tokens, dtype)
        mask = (rng.random(ep_size) < 0.6).astype(np.int32)
        m = nm.ll_dispatch(x, idx, w, num_experts=E, dispatch_dtype=dtype, rank_mask=mask)
        y = poisoned_y(rng, m, ep_size, tokens)
        d, out = run(ep_size, dtype, two_phase, x, idx, w, y, mask, mask)
        assert_matches(d, out, m, y, mask, ep_size)
        # every valid pair is either in a slot or counted as dropped: nothing vanishes
        valid = int((m.sanitized >= 0).sum())
        assert int(d.counts.sum()) + int(d.num_dropped.sum()) == valid
        masked_any += int((mask == 0).sum())
        dropped_any += int(d.num_dropped.sum())
    assert masked_any and dropped_any, "the draws masked nothing: the test would not see masking"


def test_ll_masked_rank_is_out_both_ways():
    """Rank 1 of 4 masked: it sends nothing (every other rank's counts from it are 0), receives
    nothing (its counts are 0, its src_slot empty), its own pairs are all dropped, its combine
    output is +0.0, and the others' rows to rank 1's experts are dropped and counted."""
    rng = np.random.default_rng(5)
    ep_size, tokens, local = 4, 12, E // 4
    x, idx, w = inputs(rng, ep_size, tokens, "bfloat16")
    idx[:, :, 0] = 1 * local  # every token picks an expert of rank 1 first
    mask = np.array([1, 0, 1, 1], np.int32)
    m = nm.ll_dispatch(x, idx, w, num_experts=E, dispatch_dtype="bfloat16", rank_mask=mask)
    y = poisoned_y(rng, m, ep_size, tokens)
    d, out = run(ep_size, "bfloat16", False, x, idx, w, y, mask, mask)
    assert_matches(d, out, m, y, mask, ep_size)
    assert (d.counts[:, :, 1] == 0).all() and (d.counts[1] == 0).all() and (d.handle.src_slot[1] == -1).all()
    assert int(d.num_dropped[1]) == int((nm.sanitize(idx, E)[1] >= 0).sum())
    for r in (0, 2, 3):
        assert int(d.num_dropped[r]) >= tokens  # slot 0 of every token went to rank 1
    assert (out[1].astype(np.float32) == 0).all() and not np.signbit(out[1].astype(np.float32)).any()


def test_ll_all_active_mask_is_no_mask():
    rng = np.random.default_rng(11)
    ep_size, tokens = 4, 9
    x, idx, w = inputs(rng, ep_size, tokens, "bfloat16")
    m = nm.ll_dispatch(x, idx, w, num_experts=E, dispatch_dtype="float8_e4m3fn")
    y = poisoned_y(rng, m, ep_size, tokens)
    cfg = CFGS["float8_e4m3fn"]

    def plain(x, idx, w, y):
        d = jax_ep.ll_dispatch(x, idx, w, cfg)
        return d, jax_ep.ll_combine(y, d.handle, cfg)

    want = to_numpy(per_rank(plain, ep_size)(x, idx, w, y))
    ones = np.ones(ep_size, np.int32)
    got = run(ep_size, "float8_e4m3fn", False, x, idx, w, y, ones, ones)
    # a masked dispatch's handle carries its mask (all ones here), an unmasked one's none
    np.testing.assert_array_equal(got[0].handle.rank_mask, np.ones((ep_size, ep_size), np.int32))
    assert want[0].handle.rank_mask is None
    got = (got[0]._replace(handle=got[0].handle._replace(rank_mask=None)), got[1])
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert_bits_equal(np.asarray(a), np.asarray(b), "all-active mask vs no mask")
    assert (want[0].num_dropped == 0).all() and (want[0].rank_mask == 1).all()


def test_ll_combine_masks_a_rank_the_dispatch_did_not():
    """A rank masked in combine only (it died after the dispatch): its slots add +0.0, it gets
    nothing back; the others are as without the mask."""
    rng = np.random.default_rng(3)
    ep_size, tokens = 4, 10
    x, idx, w = inputs(rng, ep_size, tokens, "bfloat16")
    ones = np.ones(ep_size, np.int32)
    cmask = np.array([1, 1, 0, 1], np.int32)
    m = nm.ll_dispatch(x, idx, w, num_experts=E, dispatch_dtype="bfloat16")
    y = poisoned_y(rng, m, ep_size, tokens)
    d, out = run(ep_size, "bfloat16", True, x, idx, w, y, ones, cmask)
    assert_matches(d, out, m, y, cmask, ep_size)
    _, unmasked = run(ep_size, "bfloat16", True, x, idx, w, y, ones, ones)
    assert not np.array_equal(out, unmasked), "rank 2 returned nothing the tokens needed: no effect seen"


@pytest.mark.parametrize("mask,match", [(np.ones(3, np.int32), r"rank_mask must have shape \[4\]"),
                                        (np.ones(4, np.float32), "rank_mask must be bool or integer")])
def test_ll_rank_mask_bad(mask, match):
    cfg = BF16

    def f(x, idx, w):
        return jax_ep.ll_dispatch(x, idx, w, cfg, rank_mask=mask)

    rng = np.random.default_rng(0)
    x, idx, w = inputs(rng, 4, 2, "bfloat16")
    with pytest.raises(ValueError, match=match):
        per_rank(f, 4)(x, idx, w)


def test_cuda_backend_lowers_the_mask_and_shrink(monkeypatch):
    """backend='cuda' traces on any machine (the FFI calls compile on GPUs only): the sending custom
    calls (ll_dispatch, ll_dispatch_send, ll_combine, ll_combine_send) take the mask as an int32 [R]
    operand before rank and group, ll_dispatch / ll_dispatch_recv return the call's ranks (int32
    [R]), the receiving combine calls take dest_rank [T, K], and EPConfig.shrink reaches the LL
    calls' attributes (shrink = 1)."""
    lower_cuda_here(monkeypatch, stub_extension=True)
    ep_size, tokens = 2, 5
    cfg = BF16.replace(backend="cuda", shrink=True)

    def body(x, idx, w, m):
        d = jax_ep.ll_dispatch(x, idx, w, cfg, rank_mask=m)
        out = jax_ep.ll_combine(d.x, d.handle, cfg, rank_mask=m)
        d2 = jax_ep.ll_dispatch_recv(jax_ep.ll_dispatch_send(x, idx, w, cfg, rank_mask=m), cfg)
        out2 = jax_ep.ll_combine_recv(jax_ep.ll_combine_send(d2.x, d2.handle, cfg, rank_mask=m), cfg)
        return out, out2, d.num_dropped, d2.rank_mask

    rng = np.random.default_rng(4)
    x, idx, w = inputs(rng, ep_size, tokens, "bfloat16")
    mask = np.tile(np.array([1, 0], np.int32), (ep_size, 1))
    text = per_rank(body, ep_size).lower(x, idx, w, mask).as_text()
    calls = {line.split("@")[1].split("(")[0]: line for line in text.splitlines()
             if "stablehlo.custom_call @jax_ep" in line}
    assert sorted(calls) == ["jax_ep_ll_combine", "jax_ep_ll_combine_recv", "jax_ep_ll_combine_send",
                             "jax_ep_ll_dispatch", "jax_ep_ll_dispatch_recv", "jax_ep_ll_dispatch_send"]
    group = f"tensor<{ep_size}xi32>, tensor<i32>, tensor<i32>"
    for name in ("jax_ep_ll_dispatch", "jax_ep_ll_dispatch_send", "jax_ep_ll_combine_send"):
        operands = calls[name].split(":")[-1].split("->")[0]
        assert operands.rstrip(" )").endswith(group), calls[name]
    assert calls["jax_ep_ll_combine"].split(":")[-1].split("->")[0].rstrip(" )").endswith(
        f"tensor<{tokens}x{K}xi32>, {group}"), calls["jax_ep_ll_combine"]
    assert calls["jax_ep_ll_combine_recv"].split(":")[-1].split("->")[0].rstrip(" )").endswith(
        f"tensor<{tokens}x{K}xi32>, tensor<i32>, tensor<i32>"), calls["jax_ep_ll_combine_recv"]
    for name in ("jax_ep_ll_dispatch", "jax_ep_ll_dispatch_recv"):  # active, then the handle's slots
        results = calls[name].split("->")[-1]
        slots = f"tensor<{tokens}x{K}xf32>, tensor<{tokens}x{K}xi32>, tensor<i32>"
        assert results.rstrip(" )").endswith(f"tensor<{ep_size}xi32>, {slots}"), calls[name]
    for line in calls.values():
        assert "shrink = 1" in line, line


def test_cuda_ll_combine_issues_no_call_without_tokens(monkeypatch):
    """T = 0 (on every rank: a static size): ll_combine, its send and its receive issue no custom call
    (XLA removes the receive, whose results are all empty, but not a send something else keeps, whose
    half would stay in flight); the dispatches still run (their counts are not empty)."""
    lower_cuda_here(monkeypatch, stub_extension=True)
    ep_size = 2
    cfg = BF16.replace(backend="cuda")

    def body(x, idx, w):
        d = jax_ep.ll_dispatch(x, idx, w, cfg)
        pending = jax_ep.ll_combine_send(d.x, d.handle, cfg)
        return jax_ep.ll_combine(d.x, d.handle, cfg), jax_ep.ll_combine_recv(pending, cfg), pending.token

    for tokens, combines in ((0, []), (3, ["jax_ep_ll_combine", "jax_ep_ll_combine_recv",
                                           "jax_ep_ll_combine_send"])):
        x = np.zeros((ep_size, tokens, H), ml_dtypes.bfloat16)
        idx, w = np.zeros((ep_size, tokens, K), np.int32), np.zeros((ep_size, tokens, K), np.float32)
        text = per_rank(body, ep_size).lower(x, idx, w).as_text()
        calls = sorted({line.split("@")[1].split("(")[0] for line in text.splitlines()
                        if "stablehlo.custom_call @jax_ep" in line})
        assert calls == sorted(["jax_ep_ll_dispatch", *combines]), (tokens, calls)


def test_cuda_ll_dispatch_is_only_its_custom_call(monkeypatch):
    """backend='cuda': the kernels write the handle's topk_weights, dest_rank and num_dropped, so
    ll_dispatch (fused, and send + recv) lowers to its custom calls and nothing that computes them
    (no select, reduce or compare: the sanitised routing, the keep mask and the dropped count), and
    the send hands its slots and count to the receive."""
    lower_cuda_here(monkeypatch, stub_extension=True)
    ep_size, tokens = 2, 5
    cfg = BF16.replace(backend="cuda")

    def body(x, idx, w):
        d = jax_ep.ll_dispatch(x, idx, w, cfg)
        d2 = jax_ep.ll_dispatch_recv(jax_ep.ll_dispatch_send(x, idx, w, cfg), cfg)
        return d.handle.topk_weights, d.handle.dest_rank, d.num_dropped, d2.handle.topk_weights, \
            d2.handle.dest_rank, d2.num_dropped

    rng = np.random.default_rng(5)
    x, idx, w = inputs(rng, ep_size, tokens, "bfloat16")
    text = per_rank(body, ep_size).lower(x, idx, w.astype(np.float32)).as_text()
    for op in ("stablehlo.select", "stablehlo.reduce", "stablehlo.compare"):
        assert op not in text, [line for line in text.splitlines() if op in line][:3]
    calls = {line.split("@")[1].split("(")[0]: line for line in text.splitlines()
             if "stablehlo.custom_call @jax_ep" in line}
    slots = f"tensor<{tokens}x{K}xf32>, tensor<{tokens}x{K}xi32>, tensor<i32>"
    assert calls["jax_ep_ll_dispatch_send"].split("->")[-1].rstrip(" )").endswith(slots)
    assert f"tensor<4xui32>, {slots}" in calls["jax_ep_ll_dispatch_recv"].split("->")[0]


def test_moe_decode_passes_the_mask_to_the_cuda_ops(monkeypatch):
    """MoE(decode=True) with set_rank_mask and backend='cuda': the layer's mask reaches
    cuda_backend.ll_dispatch and ll_combine (their rank_mask; how they lower it:
    test_cuda_backend_lowers_the_mask_and_shrink), and both lower."""
    from flax import nnx
    from jax.sharding import Mesh

    from jax_ep import cuda_backend
    from jax_ep.gating import RouterConfig
    from jax_ep.moe import EPOptions, MoE

    lower_cuda_here(monkeypatch, stub_extension=True)
    seen = {}

    def recording(name):
        op = getattr(cuda_backend, name)

        def record(*args, rank_mask=None, **kw):
            seen[name] = rank_mask
            return op(*args, rank_mask=rank_mask, **kw)

        return record

    for name in ("ll_dispatch", "ll_combine"):
        monkeypatch.setattr(cuda_backend, name, recording(name))
    ep_size = 2
    mesh = Mesh(np.array(jax.devices()[:ep_size]), ("ep",))
    layer = MoE(H, 24, RouterConfig(E, 2), rngs=nnx.Rngs(0), mesh=mesh, dtype="bfloat16",
                ep=EPOptions(backend="cuda"), decode=True)
    layer.set_rank_mask([True, False])
    graphdef, state = nnx.split(layer)
    x = jax.ShapeDtypeStruct((4 * ep_size, H), jax.numpy.bfloat16)
    text = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x)).lower(state, x).as_text()
    assert seen.keys() == {"ll_dispatch", "ll_combine"} and all(m is not None for m in seen.values())
    calls = [line for line in text.splitlines() if "stablehlo.custom_call @jax_ep_ll_" in line]
    assert len(calls) == 2, calls  # ll_dispatch and ll_combine, lowered with the mask operand


@pytest.mark.parametrize("two_phase", [False, True], ids=["one_call", "two_phase"])
@pytest.mark.parametrize("which", ["dispatch", "combine"])
def test_checked_mode_refuses_a_mask_that_differs_between_ranks(which, two_phase):
    """Checked mode: each low-latency op's rank_mask must be the same on every rank (nothing checked it
    before 2026-12-05; found by a review)."""
    ep_size, tokens = 4, 8
    rng = np.random.default_rng()
    x, idx, w = inputs(rng, ep_size, tokens, "bfloat16")
    idx = np.where((idx >= 0) & (idx < E), idx, -1).astype(np.int32)   # checked mode refuses the others
    y = rng.standard_normal((ep_size, E // ep_size, ep_size * tokens, H)).astype(ml_dtypes.bfloat16)
    agreed = np.tile(np.array([1, 0, 1, 1], np.int32), (ep_size, 1))
    differ = agreed.copy()
    flag = int(rng.integers(ep_size))
    differ[int(rng.integers(ep_size)), flag] ^= 1
    fn = masked_fn(ep_size, BF16.replace(checked=True), two_phase)
    masks = (differ, agreed) if which == "dispatch" else (agreed, differ)
    op = f"ll_{which}" + ("_send" if two_phase else "")
    with pytest.raises(Exception, match=rf"jax_ep\.{op}: rank_mask differs between the ranks of the EP "
                       rf"group.*ranks \[{flag}\]"):
        jax_ep.run_checked(fn, x, idx, w, y, *masks)
    jax_ep.run_checked(fn, x, idx, w, y, agreed, agreed)
