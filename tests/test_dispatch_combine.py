"""dispatch / combine on 1, 2, 4 and 8 virtual CPU devices against the NumPy model (tests/numpy_model.py).

Every test draws its data from a fresh np.random.default_rng(seed). Jitted functions are cached per
(EP size, config) so parametrisations that share a configuration share one compilation.
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
    assert_close_f,
    assert_dispatch_matches,
    make_cfg,
    model_for,
    parametrize_slow_tail,
    per_rank,
    random_inputs,
    random_routing,
    random_tokens,
    to_numpy,
)

import jax_ep

E, K, H, TMAX = 8, 3, 32, 6
BASE = make_cfg(num_experts=E, num_topk=K, hidden=H, max_tokens_per_rank=TMAX)
EP_SIZES = [1, 2, 4, 8]


@functools.cache
def dispatch_combine_fn(ep_size, cfg):
    """(x, idx, w, y) -> (Dispatched, combine(y)) per rank, jitted over global [R, ...] arrays."""

    def f(x, idx, w, y):
        d = jax_ep.dispatch(x, idx, w, cfg)
        return d, jax_ep.combine(y, d.handle, cfg)

    return per_rank(f, ep_size)


@functools.cache
def moe_fn(ep_size, cfg):
    """dispatch -> ragged_dot with this rank's expert weights -> combine."""

    def f(x, idx, w, expert_w):
        d = jax_ep.dispatch(x, idx, w, cfg)
        y = jax.lax.ragged_dot(d.x, expert_w, d.group_sizes, precision=jax.lax.Precision.HIGHEST)
        return jax_ep.combine(y, d.handle, cfg), d.num_dropped

    return per_rank(f, ep_size)


def run(cfg, ep_size, x, idx, w, rng, y_dtype=np.float32):
    """Dispatch + combine of random y; returns (dispatched, combined, model, y)."""
    m = model_for(cfg, x, idx, w)
    out_h = m.ranks[0].rows.shape[1]
    y = rng.standard_normal((ep_size, m.capacity, out_h)).astype(y_dtype)
    d, c = to_numpy(dispatch_combine_fn(ep_size, cfg)(x, idx, w, y))
    return d, c, m, y


def check_all(cfg, ep_size, x, idx, w, rng):
    d, c, m, y = run(cfg, ep_size, x, idx, w, rng)
    assert_dispatch_matches(d, m, ep_size)
    assert c.shape == x.shape[:2] + (y.shape[2],) and c.dtype == np.float32
    assert_close_f(c, nm.combine(y, m), 1e-5, "combine")
    return d, c, m, y


# ---- random routings ------------------------------------------------------------------------------
@parametrize_slow_tail("ep_size", EP_SIZES, fast=(2,))
def test_dispatch_combine_random_routing(ep_size):
    rng = np.random.default_rng(100 + ep_size)
    saw = {"unused": False, "out_of_range": False, "repeat": False}
    for _ in range(3):
        x, idx, w = random_tokens(rng, ep_size, TMAX, BASE)
        d, c, m, y = check_all(BASE, ep_size, x, idx, w, rng)
        san = m.sanitized
        saw["unused"] |= bool((idx == -1).any())
        saw["out_of_range"] |= bool(((idx >= E) | (idx < -1)).any())
        saw["repeat"] |= bool(((san == -1) & (idx >= 0) & (idx < E)).any())
        # Default capacity is the worst case: nothing may be dropped, every valid slot has a row.
        assert (d.num_dropped == 0).all()
        np.testing.assert_array_equal(m.kept, san >= 0)
        assert d.group_sizes.sum() == (san >= 0).sum()
    assert all(saw.values()), saw


PATTERNS = ["one_expert", "same_expert_every_slot", "all_unused", "all_out_of_range", "one_rank"]


def _pattern(name, ep_size, rng):
    idx = np.full((ep_size, TMAX, K), -1, np.int32)
    if name == "one_expert":            # every token picks the last expert in a random slot
        slot = rng.integers(0, K, size=(ep_size, TMAX))
        np.put_along_axis(idx, slot[..., None], E - 1, axis=2)
    elif name == "same_expert_every_slot":
        idx[:] = 3
    elif name == "all_out_of_range":
        idx = rng.choice(np.array([E, E + 1, -2, 10**6], np.int32), size=idx.shape)
    elif name == "one_rank":            # every token picks K distinct experts of the last rank
        local = E // ep_size
        for r, t in np.ndindex(ep_size, TMAX):
            pick = rng.permutation(local)[:K] + (ep_size - 1) * local
            idx[r, t, :len(pick)] = pick
    return idx.astype(np.int32)


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("ep_size", EP_SIZES)
def test_dispatch_combine_patterns(ep_size, pattern):
    rng = np.random.default_rng(7 * ep_size + PATTERNS.index(pattern))
    x, w = random_inputs(rng, ep_size, TMAX, H, K)
    idx = _pattern(pattern, ep_size, rng)
    d, c, m, y = check_all(BASE, ep_size, x, idx, w, rng)
    local = E // ep_size
    if pattern in ("all_unused", "all_out_of_range"):
        assert (d.group_sizes == 0).all() and (d.x == 0).all() and (d.handle.src_index == -1).all()
        assert (c == 0).all()
    elif pattern in ("one_expert", "same_expert_every_slot"):
        expert = E - 1 if pattern == "one_expert" else 3
        owner, le = divmod(expert, local)
        want = np.zeros((ep_size, local), np.int32)
        want[owner, le] = ep_size * TMAX
        np.testing.assert_array_equal(d.group_sizes, want)
        # rows of that expert: all tokens in (source rank, source token) order, each once
        np.testing.assert_array_equal(d.handle.src_index[owner, :ep_size * TMAX], np.arange(ep_size * TMAX))
        slot_w = np.where(idx == expert, w, 0).max(axis=2) if pattern == "one_expert" else w[:, :, 0]
        np.testing.assert_array_equal(d.row_weights[owner, :ep_size * TMAX], slot_w.reshape(-1))
    elif pattern == "one_rank":
        assert (d.group_sizes[:-1] == 0).all()
        assert d.group_sizes[-1].sum() == ep_size * TMAX * min(K, local)


@pytest.mark.parametrize("ep_size", [2, 8])
def test_repeated_calls_identical_bits(ep_size):
    rng = np.random.default_rng(5)
    x, idx, w = random_tokens(rng, ep_size, TMAX, BASE)
    m = model_for(BASE, x, idx, w)
    y = rng.standard_normal((ep_size, m.capacity, H)).astype(np.float32)
    fn = dispatch_combine_fn(ep_size, BASE)
    first = to_numpy(fn(x, idx, w, y))
    for _ in range(3):
        again = to_numpy(fn(x, idx, w, y))
        for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again), strict=True):
            assert_bits_equal(b, a, "repeated call")


@pytest.mark.parametrize("align", [1, 4])
@parametrize_slow_tail("ep_size", EP_SIZES, fast=(1,))
def test_rows_written_and_padding_zero(ep_size, align):
    """Checked against x itself, not the model: every row inside group_sizes holds its source token
    (or is a zero padding row with src -1 and weight 0); everything past the groups is empty."""
    cfg = BASE if align == 1 else BASE.replace(expert_alignment=align)
    rng = np.random.default_rng(11 + ep_size + align)
    x, idx, w = random_tokens(rng, ep_size, TMAX, cfg)
    assert (x != 0).all()
    d, c, m, y = check_all(cfg, ep_size, x, idx, w, rng)
    san = m.sanitized
    local = E // ep_size
    for r in range(ep_size):
        off = 0
        for le in range(local):
            gs, cnt = int(d.group_sizes[r, le]), int(d.expert_counts[r, le])
            assert gs % align == 0 and cnt <= gs < cnt + align
            expert = r * local + le
            want_src = [s * TMAX + t for s in range(ep_size) for t in range(TMAX) if expert in san[s, t]]
            np.testing.assert_array_equal(d.handle.src_index[r, off:off + cnt], want_src)
            for j in range(off, off + cnt):
                s, t = divmod(int(d.handle.src_index[r, j]), TMAX)
                assert_bits_equal(d.x[r, j], x[s, t], f"rank {r} row {j}")
                k = list(san[s, t]).index(expert)
                assert d.row_weights[r, j] == w[s, t, k]
                assert d.handle.token_rows[r, s * TMAX + t, k] == j
            pad = slice(off + cnt, off + gs)
            assert (d.x[r, pad] == 0).all() and (d.handle.src_index[r, pad] == -1).all()
            assert (d.row_weights[r, pad] == 0).all()
            off += gs
        assert (d.x[r, off:] == 0).all() and (d.handle.src_index[r, off:] == -1).all()
        assert (d.row_weights[r, off:] == 0).all()


# ---- capacity ---------------------------------------------------------------------------------------
def _skewed_routing(rng, ep_size, tokens, topk, num_experts):
    """Most tokens pick the first experts (so small capacities overflow), with some -1 slots."""
    p = np.linspace(3.0, 0.2, num_experts)
    p /= p.sum()
    idx = np.stack([np.stack([rng.choice(num_experts, size=topk, replace=False, p=p) for _ in range(tokens)])
                    for _ in range(ep_size)])
    idx = np.where(rng.random(idx.shape) < 0.1, -1, idx)
    return idx.astype(np.int32)


@pytest.mark.parametrize("align", [1, 2])
@parametrize_slow_tail("ep_size", [2, 4])
def test_capacity_drops_match_model(ep_size, align):
    capacity = 8  # worst case here is 36 (R=2) / 48 (R=4) rows
    cfg = BASE.replace(capacity=capacity, expert_alignment=align)
    rng = np.random.default_rng(21 + ep_size * align)
    total_dropped = 0
    for _ in range(3):
        x, idx, w = random_tokens(rng, ep_size, TMAX, cfg, routing=_skewed_routing)
        d, c, m, y = check_all(cfg, ep_size, x, idx, w, rng)
        assert d.x.shape[1] == capacity
        for r in range(ep_size):
            mr = m.ranks[r]
            assert d.num_dropped[r] == (mr.received - mr.expert_counts).sum() == len(mr.dropped)
            assert d.group_sizes[r].sum() <= capacity
        total_dropped += int(d.num_dropped.sum())
        # a dropped (token, expert) pair has no row anywhere (-2 on its expert's rank, -1 elsewhere)
        # and contributes nothing to combine
        for r in range(ep_size):
            for s, t, k, expert in m.ranks[r].dropped:
                assert not m.kept[s, t, k] and expert // (E // ep_size) == r
                want = np.where(np.arange(ep_size) == r, -2, -1)
                np.testing.assert_array_equal(d.handle.token_rows[:, s * TMAX + t, k], want)
    assert total_dropped > 0


def test_capacity_drop_order_by_hand():
    """R=2, E=4 (2 per rank), K=1, T=3. Rank 0 receives expert 0 from tokens (0,0),(0,2),(1,1) and
    expert 1 from (0,1),(1,0),(1,2). Capacity 4: expert 0 keeps its 3 rows, expert 1 keeps only its
    first row (0,1); (1,0) and (1,2) are dropped (the last expert's, last source rows first)."""
    cfg = make_cfg(num_experts=4, num_topk=1, hidden=4, max_tokens_per_rank=3, capacity=4)
    idx = np.array([[[0], [1], [0]], [[1], [0], [1]]], np.int32)
    x = np.arange(1, 25, dtype=np.float32).reshape(2, 3, 4)
    w = np.array([[[0.5], [0.25], [2.0]], [[4.0], [8.0], [16.0]]], np.float32)
    y = np.arange(1, 33, dtype=np.float32).reshape(2, 4, 4)
    d, c = to_numpy(dispatch_combine_fn(2, cfg)(x, idx, w, y))
    np.testing.assert_array_equal(d.handle.src_index[0], [0, 2, 4, 1])
    np.testing.assert_array_equal(d.group_sizes[0], [3, 1])
    np.testing.assert_array_equal(d.expert_counts[0], [3, 1])
    np.testing.assert_array_equal(d.num_dropped, [2, 0])
    np.testing.assert_array_equal(d.row_weights[0], [0.5, 2.0, 8.0, 0.25])
    np.testing.assert_array_equal(d.x[0], x.reshape(6, 4)[[0, 2, 4, 1]])
    np.testing.assert_array_equal(d.handle.token_rows[0, :, 0], [0, 3, 1, -2, 2, -2])
    assert (d.handle.token_rows[1] == -1).all()
    assert (d.handle.src_index[1] == -1).all() and (d.group_sizes[1] == 0).all()
    want = np.zeros((2, 3, 4), np.float32)
    want[0, 0], want[0, 1], want[0, 2], want[1, 1] = 0.5 * y[0, 0], 0.25 * y[0, 3], 2 * y[0, 1], 8 * y[0, 2]
    np.testing.assert_array_equal(c, want)

    # alignment 2: expert 1's segment starts at round_up(3, 2) = 4 = C, so all its rows drop
    cfg2 = cfg.replace(expert_alignment=2)
    d, c = to_numpy(dispatch_combine_fn(2, cfg2)(x, idx, w, y))
    np.testing.assert_array_equal(d.group_sizes[0], [4, 0])
    np.testing.assert_array_equal(d.expert_counts[0], [3, 0])
    np.testing.assert_array_equal(d.handle.src_index[0], [0, 2, 4, -1])
    np.testing.assert_array_equal(d.handle.token_rows[0, :, 0], [0, -2, 1, -2, 2, -2])
    np.testing.assert_array_equal(d.num_dropped, [3, 0])
    assert (d.x[0, 3] == 0).all() and d.row_weights[0, 3] == 0
    assert (c[0, 1] == 0).all() and (c[1, 0] == 0).all() and (c[1, 2] == 0).all()


# ---- alignment, short batches ----------------------------------------------------------------------
@pytest.mark.parametrize("ep_size", [1, 4, 8])
def test_expert_alignment(ep_size):
    cfg = BASE.replace(expert_alignment=4)
    rng = np.random.default_rng(31 + ep_size)
    x, idx, w = random_tokens(rng, ep_size, TMAX, cfg)
    d, c, m, y = check_all(cfg, ep_size, x, idx, w, rng)
    assert (d.group_sizes % 4 == 0).all()
    assert d.x.shape[1] == nm.worst_case_capacity(ep_size, TMAX, K, E, 4) and d.x.shape[1] % 4 == 0
    assert (d.num_dropped == 0).all()


@pytest.mark.parametrize("ep_size", [2, 4])
def test_fewer_tokens_than_max(ep_size):
    tokens = 4
    rng = np.random.default_rng(41 + ep_size)
    x, idx, w = random_tokens(rng, ep_size, tokens, BASE)
    d, c, m, y = check_all(BASE, ep_size, x, idx, w, rng)
    # capacity is sized for max_tokens_per_rank, the handle for the actual T
    assert d.x.shape[1] == nm.worst_case_capacity(ep_size, TMAX, K, E, 1)
    assert d.handle.token_rows.shape == (ep_size, ep_size * tokens, K)
    assert d.handle.is_token_in_rank.shape == (ep_size, tokens, ep_size)


# ---- dispatch dtypes --------------------------------------------------------------------------------
def _fp8_inputs(rng, ep_size, hidden):
    x, w = random_inputs(rng, ep_size, TMAX, hidden, K)
    x = x * rng.choice(np.array([1e-2, 1.0, 30.0, 1e3], np.float32), size=(ep_size, TMAX, 1))
    x[0, 0, :128] = 1e-6   # block amax below the 1e-4 clamp
    x[0, 1, 128:] = 0.0    # an all-zero block: scale 1e-4 / 448, q = 0
    x[-1, -1, 5] = 448.0 * 4  # a block whose amax sits on one channel
    return x.astype(np.float32), w


@parametrize_slow_tail("ep_size,x_dtype", [(1, "float32"), (2, "float32"), (4, "float32"), (2, "bfloat16")],
                       fast=(1, 3))
def test_fp8_dispatch(ep_size, x_dtype):
    hidden = 256
    cfg = make_cfg(num_experts=E, num_topk=K, hidden=hidden, max_tokens_per_rank=TMAX,
                   dispatch_dtype="float8_e4m3fn")
    rng = np.random.default_rng(51 + ep_size)
    x, w = _fp8_inputs(rng, ep_size, hidden)
    x = x.astype(ml_dtypes.bfloat16 if x_dtype == "bfloat16" else np.float32)
    idx = random_routing(rng, ep_size, TMAX, K, E)
    d, c, m, y = run(cfg, ep_size, x, idx, w, rng)
    assert d.x.dtype == ml_dtypes.float8_e4m3fn and d.scales.dtype == np.float32
    assert d.scales.shape == (ep_size, m.capacity, 2)
    assert_dispatch_matches(d, m, ep_size, scales_ulps=1)  # q bit-exact; scales: test_fp8_scales_exact
    # sanity of the model itself: dequantised rows are within e4m3 rounding (2^-4 relative) of x
    for r in range(ep_size):
        used = d.handle.src_index[r] >= 0
        deq = np.asarray(jax_ep.dequantize_fp8(d.x[r], d.scales[r]))
        src = x.astype(np.float32).reshape(ep_size * TMAX, hidden)[d.handle.src_index[r][used]]
        blocks_amax = np.repeat(np.maximum(np.abs(src.reshape(-1, 2, 128)).max(2), 1e-4), 128, axis=1)
        assert (np.abs(deq[used] - src) <= blocks_amax / 448 * 8 + np.abs(src) * 2**-4).all()
        assert (deq[~used] == 0).all()
    assert_close_f(c, nm.combine(y, m), 1e-5, "combine after fp8 dispatch")


@pytest.mark.parametrize("ep_size", [1, 2])
def test_fp8_scales_exact(ep_size):
    """Scales are max(amax, 1e-4) / 448 as documented: the correctly rounded float32 quotient."""
    hidden = 256
    cfg = make_cfg(num_experts=E, num_topk=K, hidden=hidden, max_tokens_per_rank=TMAX,
                   dispatch_dtype="float8_e4m3fn")
    rng = np.random.default_rng(57 + ep_size)
    x, w = _fp8_inputs(rng, ep_size, hidden)
    idx = random_routing(rng, ep_size, TMAX, K, E)
    d, c, m, y = run(cfg, ep_size, x, idx, w, rng)
    for r in range(ep_size):
        assert_bits_equal(d.scales[r], m.ranks[r].scales, f"rank {r} scales")


@pytest.mark.parametrize("ep_size", [2, 4])
def test_bf16_dispatch_and_combine(ep_size):
    cfg = BASE.replace(dispatch_dtype="bfloat16")
    rng = np.random.default_rng(61 + ep_size)
    x, idx, w = random_tokens(rng, ep_size, TMAX, cfg)
    d, c, m, y = run(cfg, ep_size, x, idx, w, rng, y_dtype=ml_dtypes.bfloat16)
    assert d.x.dtype == ml_dtypes.bfloat16
    assert_dispatch_matches(d, m, ep_size)
    assert c.dtype == ml_dtypes.bfloat16
    assert_close_f(c, nm.combine(y, m), 2e-2, "bf16 combine vs exact")
    # documented order (float32 partial sums per (token, rank), rounded to bf16): within 1 bf16 ulp
    exact = nm.combine_exact(y, m).astype(np.float32)
    got = c.astype(np.float32)
    ulp = np.exp2(np.floor(np.log2(np.maximum(np.abs(exact), 1e-30))) - 7)
    assert (np.abs(got - exact) <= ulp).all()


def test_bf16_input_keeps_dtype():
    ep_size = 2
    rng = np.random.default_rng(71)
    x, idx, w = random_tokens(rng, ep_size, TMAX, BASE, dtype=ml_dtypes.bfloat16)
    d, c, m, y = run(BASE, ep_size, x, idx, w, rng, y_dtype=ml_dtypes.bfloat16)
    assert d.x.dtype == ml_dtypes.bfloat16
    assert_dispatch_matches(d, m, ep_size)
    assert_close_f(c, nm.combine(y, m), 2e-2, "bf16 combine")


# ---- the MoE pipeline ------------------------------------------------------------------------------
@parametrize_slow_tail("ep_size", EP_SIZES, fast=(2,))
def test_dispatch_ragged_dot_combine_equals_dense(ep_size):
    h_out = 16
    rng = np.random.default_rng(81 + ep_size)
    x, idx, w = random_tokens(rng, ep_size, TMAX, BASE)
    expert_w = (rng.standard_normal((E, H, h_out)) / np.sqrt(H)).astype(np.float32)
    local_w = expert_w.reshape(ep_size, E // ep_size, H, h_out)
    out, dropped = to_numpy(moe_fn(ep_size, BASE)(x, idx, w, local_w))
    assert (dropped == 0).all()
    assert out.shape == (ep_size, TMAX, h_out)
    assert_close_f(out, nm.dense_moe(x, idx, w, expert_w, E), 1e-5, "moe vs dense")


@pytest.mark.parametrize("ep_size", [4])
def test_dispatch_ragged_dot_combine_with_drops(ep_size):
    cfg = BASE.replace(capacity=8, expert_alignment=2)
    h_out = 16
    rng = np.random.default_rng(91)
    x, idx, w = random_tokens(rng, ep_size, TMAX, cfg, routing=_skewed_routing)
    expert_w = (rng.standard_normal((E, H, h_out)) / np.sqrt(H)).astype(np.float32)
    local_w = expert_w.reshape(ep_size, E // ep_size, H, h_out)
    out, dropped = to_numpy(moe_fn(ep_size, cfg)(x, idx, w, local_w))
    m = model_for(cfg, x, idx, w)
    assert dropped.sum() > 0
    np.testing.assert_array_equal(dropped, [r.num_dropped for r in m.ranks])
    assert_close_f(out, nm.dense_moe(x, idx, w, expert_w, E, kept=m.kept), 1e-5, "moe with drops")


def test_default_backend_on_cpu_matches_reference():
    """backend='auto' (the default) must fall back to the reference path on CPU, bit for bit."""
    ep_size = 2
    auto = jax_ep.EPConfig(num_experts=E, num_topk=K, hidden=H, max_tokens_per_rank=TMAX)
    assert auto.backend == "auto"
    rng = np.random.default_rng(101)
    x, idx, w = random_tokens(rng, ep_size, TMAX, auto)
    m = model_for(auto, x, idx, w)
    y = rng.standard_normal((ep_size, m.capacity, H)).astype(np.float32)
    d, c = to_numpy(dispatch_combine_fn(ep_size, auto)(x, idx, w, y))
    assert_dispatch_matches(d, m, ep_size)
    assert_close_f(c, nm.combine(y, m), 1e-5, "combine (auto backend)")
