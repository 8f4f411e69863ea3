"""Low-latency (decode) mode: ll_dispatch / ll_combine on 1, 2 and 4 virtual CPU devices against the
NumPy model (tests/numpy_model.py, ``ll_dispatch`` / ``ll_combine``).

Every test draws fresh inputs from np.random.default_rng(seed): -1 slots, out-of-range ids and
repeated experts within a token (helpers.random_routing). Slots past counts[e, r] are unspecified by
the contract and are never compared; the expert outputs y given to ll_combine hold NaN there.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import numpy_model as nm
import pytest
from helpers import (
    assert_bits_equal,
    assert_close_f,
    make_cfg,
    parametrize_slow_tail,
    per_rank,
    random_inputs,
    random_routing,
    to_numpy,
)
from jax import lax

import jax_ep
from jax_ep import auto_table, ops

E, K, H, TMAX = 8, 3, 256, 64
BF16 = make_cfg(num_experts=E, num_topk=K, hidden=H, max_tokens_per_rank=TMAX, dispatch_dtype="bfloat16")
FP8 = BF16.replace(dispatch_dtype="float8_e4m3fn")
CFGS = {"bfloat16": BF16, "float8_e4m3fn": FP8}


@functools.cache
def ll_fn(ep_size, cfg):
    """(x, idx, w, y) -> (LLDispatched, ll_combine(y)) per rank, jitted over global [R, ...] arrays."""

    def f(x, idx, w, y):
        d = jax_ep.ll_dispatch(x, idx, w, cfg)
        return d, jax_ep.ll_combine(y, d.handle, cfg)

    return per_rank(f, ep_size)


@functools.cache
def identity_fn(ep_size, cfg):
    """ll_dispatch -> identity experts (the dispatched tokens as bfloat16) -> ll_combine."""

    def f(x, idx, w):
        d = jax_ep.ll_dispatch(x, idx, w, cfg)
        y = d.x.astype(jnp.bfloat16) if d.scales is None else jax_ep.dequantize_fp8(
            d.x.reshape(-1, cfg.hidden), d.scales.reshape(-1, cfg.num_scale_blocks),
            jnp.bfloat16).reshape(d.x.shape)
        return d, y, jax_ep.ll_combine(y, d.handle, cfg)

    return per_rank(f, ep_size)


def tokens_for(rng, ep_size, tokens, x_dtype=ml_dtypes.bfloat16, scale_tokens=False):
    x, w = random_inputs(rng, ep_size, tokens, H, K)
    if scale_tokens:  # FP8: blocks of very different magnitudes, one below the amax clamp
        x = x * rng.choice(np.array([1e-2, 1.0, 30.0, 1e3], np.float32), size=(ep_size, tokens, 1))
        x[0, 0, :128] = 1e-6
    return x.astype(x_dtype), random_routing(rng, ep_size, tokens, K, E), w


def poisoned_y(rng, m: nm.LLModel, ep_size, tokens):
    """Random bfloat16 expert outputs, NaN (and inf) in every unfilled slot."""
    y = rng.standard_normal((ep_size, E // ep_size, ep_size * tokens, H)).astype(np.float32)
    filled = np.stack([r.filled for r in m.ranks])
    y = np.where(filled[..., None], y, np.nan)
    if (~filled).any():
        d, e, slot = np.argwhere(~filled)[0]
        y[d, e, slot, :4] = np.inf
    return y.astype(ml_dtypes.bfloat16)


def assert_ll_matches(d, m: nm.LLModel, ep_size, tokens, cfg):
    local = E // ep_size
    assert d.x.shape == (ep_size, local, ep_size * tokens, H)
    assert d.x.dtype == np.dtype(cfg.dispatch_dtype and getattr(ml_dtypes, cfg.dispatch_dtype))
    assert d.counts.shape == (ep_size, local, ep_size) and d.counts.dtype == np.int32
    assert d.handle.src_slot.shape == (ep_size, local, ep_size * tokens)
    assert d.handle.topk_weights.shape == (ep_size, tokens, K)
    for r in range(ep_size):
        mr = m.ranks[r]
        assert_bits_equal(d.counts[r], mr.counts, f"rank {r} counts")
        assert_bits_equal(d.handle.src_slot[r], mr.src_slot, f"rank {r} handle.src_slot")
        assert_bits_equal(d.x[r][mr.filled], mr.x[mr.filled], f"rank {r} x (filled slots)")
        if mr.scales is None:
            assert d.scales is None
        else:
            assert d.scales.shape == (ep_size, local, ep_size * tokens, H // 128)
            assert_bits_equal(d.scales[r][mr.filled], mr.scales[mr.filled], f"rank {r} scales")
        assert_bits_equal(d.handle.topk_weights[r], m.weights[r], f"rank {r} handle.topk_weights")


# ---- against the model ------------------------------------------------------------------------------
CASES = [(ep_size, tokens, dtype) for ep_size in (1, 2, 4) for tokens in (1, TMAX)
         for dtype in ("bfloat16", "float8_e4m3fn")] + [(2, 7, "bfloat16"), (4, 13, "float8_e4m3fn")]


@parametrize_slow_tail("ep_size,tokens,dtype", CASES, fast=(13,))
def test_ll_matches_model(ep_size, tokens, dtype):
    cfg = CFGS[dtype]
    rng = np.random.default_rng(1000 + 10 * ep_size + tokens + (dtype == "bfloat16"))
    saw = {"unused": False, "out_of_range": False, "repeat": False}
    for x_dtype in (ml_dtypes.bfloat16, np.float32):  # float32 tokens are cast to the wire dtype
        x, idx, w = tokens_for(rng, ep_size, tokens, x_dtype, scale_tokens=dtype != "bfloat16")
        m = nm.ll_dispatch(x, idx, w, num_experts=E, dispatch_dtype=dtype)
        y = poisoned_y(rng, m, ep_size, tokens)
        d, c = to_numpy(ll_fn(ep_size, cfg)(x, idx, w, y))
        assert_ll_matches(d, m, ep_size, tokens, cfg)
        assert c.shape == (ep_size, tokens, H) and c.dtype == ml_dtypes.bfloat16
        assert np.isfinite(c.astype(np.float32)).all(), "a poisoned (unfilled) slot leaked into combine"
        assert_bits_equal(c, nm.ll_combine(y, m), "ll_combine")
        # no capacity, no drops: every valid (token, top-k slot) of every rank has a slot
        valid = int((m.sanitized >= 0).sum())
        assert int(d.counts.sum()) == valid == int((d.handle.src_slot >= 0).sum()) == len(m.placed)
        saw["unused"] |= bool((idx == -1).any())
        saw["out_of_range"] |= bool(((idx >= E) | (idx < -1)).any())
        saw["repeat"] |= bool(((m.sanitized == -1) & (idx >= 0) & (idx < E)).any())
    if tokens >= 7:
        assert all(saw.values()), saw


@parametrize_slow_tail("ep_size,dtype", [(1, "bfloat16"), (2, "bfloat16"), (2, "float8_e4m3fn"),
                                           (4, "bfloat16"), (4, "float8_e4m3fn")], fast=(1,))
def test_ll_identity_experts_give_weighted_sum(ep_size, dtype):
    """Experts that return their input: combine is the gate-weighted sum of each token's wire value."""
    cfg = CFGS[dtype]
    rng = np.random.default_rng(2000 + ep_size + 7 * (dtype == "bfloat16"))
    tokens = 24
    x, idx, w = tokens_for(rng, ep_size, tokens, np.float32, scale_tokens=dtype != "bfloat16")
    d, y, c = to_numpy(identity_fn(ep_size, cfg)(x, idx, w))
    m = nm.ll_dispatch(x, idx, w, num_experts=E, dispatch_dtype=dtype)
    assert_ll_matches(d, m, ep_size, tokens, cfg)
    # what each token became on the wire, as the expert sees it (bfloat16)
    if dtype == "bfloat16":
        wire = x.astype(ml_dtypes.bfloat16).astype(np.float64)
    else:
        wire = np.stack([nm.dequantize_fp8(*nm.quantize_fp8(x[s])).astype(ml_dtypes.bfloat16)
                         for s in range(ep_size)]).astype(np.float64)
    want = np.einsum("stk,sth->sth", m.weights.astype(np.float64), wire)
    assert_close_f(c, want, 2e-2, "identity experts vs weighted sum")
    assert_bits_equal(c, nm.ll_combine(y, m), "identity experts vs model")


def test_ll_poisoned_slots_never_leak():
    """Unfilled slots of y full of NaN give the same bits as unfilled slots full of zeros."""
    ep_size, tokens = 4, 16
    rng = np.random.default_rng(3000)
    x, idx, w = tokens_for(rng, ep_size, tokens)
    idx[:, :, 1:] = -1  # few filled slots: most of y is poison
    m = nm.ll_dispatch(x, idx, w, num_experts=E, dispatch_dtype="bfloat16")
    y = poisoned_y(rng, m, ep_size, tokens)
    clean = np.where(np.isfinite(y.astype(np.float32)), y, 0).astype(ml_dtypes.bfloat16)
    _, c_poison = to_numpy(ll_fn(ep_size, BF16)(x, idx, w, y))
    _, c_clean = to_numpy(ll_fn(ep_size, BF16)(x, idx, w, clean))
    assert np.isfinite(c_poison.astype(np.float32)).all()
    assert_bits_equal(c_poison, c_clean, "poisoned vs clean unfilled slots")


def test_ll_zero_weight_slot_is_skipped():
    """A valid id with gate weight 0 still gets its slot, but ll_combine skips it (weight 0 is the
    documented skip condition): a NaN expert output there never reaches the sum."""
    ep_size, tokens = 2, 4
    rng = np.random.default_rng(3100)
    x, _, w = tokens_for(rng, ep_size, tokens)
    idx = np.tile(np.array([0, 5, 2], np.int32), (ep_size, tokens, 1))
    w[:, :, 1] = 0.0
    w[1, 2, 2] = -0.0
    m = nm.ll_dispatch(x, idx, w, num_experts=E, dispatch_dtype="bfloat16")
    y = rng.standard_normal((ep_size, E // ep_size, ep_size * tokens, H)).astype(ml_dtypes.bfloat16)
    y[1, 1] = np.nan  # expert 5 (rank 1, local 1): every output NaN
    y[0, 2] = np.nan  # expert 2 (rank 0, local 2): only (1, 2, 2) has weight -0
    y[0, 2, 0 * tokens:1 * tokens] = 1.0
    y[0, 2, 1 * tokens:2 * tokens] = rng.standard_normal((tokens, H)).astype(ml_dtypes.bfloat16)
    y[0, 2, tokens + 2] = np.nan
    d, c = to_numpy(ll_fn(ep_size, BF16)(x, idx, w, y))
    assert (d.counts.sum(axis=(0, 1)) == [3 * tokens, 3 * tokens]).all()
    assert np.isfinite(c.astype(np.float32)).all()
    assert_bits_equal(c, nm.ll_combine(y, m), "ll_combine")


def test_ll_slots_by_hand():
    """R=2, E=4 (2 per rank), K=2, T=3. Rank 0 routes token 0 -> (1, 2), token 1 -> (-1, 1),
    token 2 -> (3, 3: a repeat, unused); rank 1 routes token 0 -> (0, 1), token 1 -> (9: out of
    range, 0), token 2 -> (2, -1)."""
    cfg = make_cfg(num_experts=4, num_topk=2, hidden=8, max_tokens_per_rank=4, dispatch_dtype="bfloat16")
    idx = np.array([[[1, 2], [-1, 1], [3, 3]], [[0, 1], [9, 0], [2, -1]]], np.int32)
    x = np.arange(1, 49, dtype=np.float32).reshape(2, 3, 8).astype(ml_dtypes.bfloat16)
    w = np.array([[[0.5, 0.25], [2.0, 4.0], [8.0, 16.0]], [[1.0, 3.0], [5.0, 7.0], [9.0, 11.0]]],
                 np.float32)
    y = np.full((2, 2, 6, 8), np.nan, np.float32)
    y[0, 0, 3:5] = [[1.0] * 8, [2.0] * 8]     # expert 0 from rank 1: tokens 0, 1
    y[0, 1, 0:2] = [[3.0] * 8, [4.0] * 8]     # expert 1 from rank 0: tokens 0, 1
    y[0, 1, 3] = 5.0                          # expert 1 from rank 1: token 0
    y[1, 0, 0] = 6.0                          # expert 2 from rank 0: token 0
    y[1, 0, 3] = 7.0                          # expert 2 from rank 1: token 2
    y[1, 1, 0] = 8.0                          # expert 3 from rank 0: token 2
    y = y.astype(ml_dtypes.bfloat16)
    d, c = to_numpy(ll_fn(2, cfg)(x, idx, w, y))
    np.testing.assert_array_equal(d.counts[0], [[0, 2], [2, 1]])   # [local expert, source rank]
    np.testing.assert_array_equal(d.counts[1], [[1, 1], [1, 0]])
    np.testing.assert_array_equal(d.handle.src_slot[0], [[-1, -1, -1, 0, 3, -1],
                                                         [0, 3, -1, 1, -1, -1]])
    np.testing.assert_array_equal(d.handle.src_slot[1], [[1, -1, -1, 4, -1, -1],
                                                         [4, -1, -1, -1, -1, -1]])
    np.testing.assert_array_equal(d.x[0, 1, :2], x[0, :2])
    np.testing.assert_array_equal(d.x[1, 0, 3], x[1, 2])
    np.testing.assert_array_equal(d.handle.topk_weights[0], [[0.5, 0.25], [0, 4.0], [8.0, 0]])
    np.testing.assert_array_equal(d.handle.topk_weights[1], [[1.0, 3.0], [0, 7.0], [9.0, 0]])
    want = np.array([[0.5 * 3 + 0.25 * 6, 4.0 * 4, 8.0 * 8], [1.0 + 3.0 * 5, 7.0 * 2, 9.0 * 7]])
    np.testing.assert_array_equal(c.astype(np.float32), np.repeat(want[..., None], 8, axis=2))


# ---- patterns, sizes ----------------------------------------------------------------------------------
@parametrize_slow_tail("ep_size", [2, 4])
def test_ll_all_unused_and_one_expert(ep_size):
    tokens = 8
    rng = np.random.default_rng(4000 + ep_size)
    x, _, w = tokens_for(rng, ep_size, tokens)
    y = np.full((ep_size, E // ep_size, ep_size * tokens, H), np.nan, ml_dtypes.bfloat16)
    unused = rng.choice(np.array([-1, E, -5], np.int32), size=(ep_size, tokens, K))
    d, c = to_numpy(ll_fn(ep_size, BF16)(x, unused, w, y))
    assert (d.counts == 0).all() and (d.handle.src_slot == -1).all() and (d.handle.topk_weights == 0).all()
    assert (c.astype(np.float32) == 0).all()
    one = np.full((ep_size, tokens, K), -1, np.int32)
    slot = rng.integers(0, K, size=(ep_size, tokens))
    np.put_along_axis(one, slot[..., None], E - 1, axis=2)  # every token picks the last expert
    d, _ = to_numpy(ll_fn(ep_size, BF16)(x, one, w, y))
    want = np.zeros((ep_size, E // ep_size, ep_size), np.int32)
    want[-1, -1, :] = tokens
    np.testing.assert_array_equal(d.counts, want)
    np.testing.assert_array_equal(d.handle.src_slot[-1, -1],
                                  (np.arange(tokens)[None] * K + slot).reshape(-1))
    assert_bits_equal(d.x[-1, -1], x.reshape(-1, H), "one expert: every token in order")


@pytest.mark.parametrize("checked", [False, True])
@pytest.mark.parametrize("ep_size", [1, 2])
def test_ll_zero_tokens(ep_size, checked):
    """T = 0 on every rank: empty outputs, also in checked mode (its id check took an argmax of
    nothing before 2026-12-05). The expert outputs are the dispatched rows. Two programs: in checked
    mode, one returning both the counts and combine's zero-size output fails in XLA's Shardy lowering
    ("expected ... produced by a xla.sdy.GlobalToLocalShape"), with every input zero-size; not jax_ep's."""
    cfg = FP8.replace(checked=checked)
    x = np.zeros((ep_size, 0, H), ml_dtypes.bfloat16)
    idx, w = np.zeros((ep_size, 0, K), np.int32), np.zeros((ep_size, 0, K), np.float32)

    def dispatched(x, idx, w):
        d = jax_ep.ll_dispatch(x, idx, w, cfg)
        return d.x, d.scales, d.counts

    def combined(x, idx, w):
        d = jax_ep.ll_dispatch(x, idx, w, cfg)
        return jax_ep.ll_combine(d.x.astype(jnp.bfloat16), d.handle, cfg)

    dx, scales, counts = to_numpy(jax_ep.run_checked(per_rank(dispatched, ep_size), x, idx, w))
    c = to_numpy(jax_ep.run_checked(per_rank(combined, ep_size), x, idx, w))
    assert dx.shape == (ep_size, E // ep_size, 0, H) and scales.shape == (ep_size, E // ep_size, 0, 2)
    assert (counts == 0).all()
    assert c.shape == (ep_size, 0, H) and c.dtype == ml_dtypes.bfloat16


def test_ll_bfloat16_tokens_with_default_dispatch_dtype():
    """dispatch_dtype=None keeps bfloat16 tokens as they are (a float32 x needs a wire dtype)."""
    cfg = BF16.replace(dispatch_dtype=None)
    ep_size, tokens = 2, 5
    rng = np.random.default_rng(4200)
    x, idx, w = tokens_for(rng, ep_size, tokens)
    m = nm.ll_dispatch(x, idx, w, num_experts=E, dispatch_dtype=None)
    y = poisoned_y(rng, m, ep_size, tokens)
    d, c = to_numpy(ll_fn(ep_size, cfg)(x, idx, w, y))
    assert d.x.dtype == ml_dtypes.bfloat16
    assert_ll_matches(d, m, ep_size, tokens, BF16)
    assert_bits_equal(c, nm.ll_combine(y, m), "ll_combine")


# ---- jit, repeated calls, backends -----------------------------------------------------------------
def test_ll_repeated_calls_identical_bits():
    ep_size, tokens = 4, 32
    rng = np.random.default_rng(5000)
    x, idx, w = tokens_for(rng, ep_size, tokens, np.float32)
    m = nm.ll_dispatch(x, idx, w, num_experts=E, dispatch_dtype="float8_e4m3fn")
    y = poisoned_y(rng, m, ep_size, tokens)
    fn = ll_fn(ep_size, FP8)
    first = to_numpy(fn(x, idx, w, y))
    for _ in range(3):
        again = to_numpy(fn(x, idx, w, y))
        for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again), strict=True):
            assert_bits_equal(b, a, "repeated call")


def test_ll_decode_steps_in_scan():
    """Repeated decode steps in a lax.scan (a token's output feeds the next step): the same as calling
    the step 5 times from Python."""
    ep_size, tokens, steps = 2, 8, 5
    cfg = BF16
    rng = np.random.default_rng(5100)
    x, idx, w = tokens_for(rng, ep_size, tokens)
    scale = rng.standard_normal((ep_size, E // ep_size, 1, H)).astype(np.float32)

    def step(x, idx, w, s):
        d = jax_ep.ll_dispatch(x, idx, w, cfg)
        y = (d.x.astype(jnp.float32) * s).astype(jnp.bfloat16)  # a per-expert "FFN"
        return jax_ep.ll_combine(y, d.handle, cfg)

    def scanned(x, idx, w, s):
        def body(x, _):
            out = step(x, idx, w, s)
            return out, out
        return jax.lax.scan(body, x, None, length=steps)[1]

    outs = np.asarray(per_rank(scanned, ep_size)(x, idx, w, scale))
    one = per_rank(step, ep_size)
    cur = x
    for i in range(steps):
        cur = np.asarray(one(cur, idx, w, scale))
        assert_bits_equal(outs[:, i], cur, f"scan step {i}")


def test_ll_auto_backend_on_cpu_is_the_reference(monkeypatch, tmp_path):
    """backend='auto' runs the reference on CPU, even with a table entry that turns the kernel on."""
    ep_size, tokens = 2, 6
    rng = np.random.default_rng(5200)
    x, idx, w = tokens_for(rng, ep_size, tokens)
    m = nm.ll_dispatch(x, idx, w, num_experts=E, dispatch_dtype="bfloat16")
    y = poisoned_y(rng, m, ep_size, tokens)
    want = to_numpy(ll_fn(ep_size, BF16.replace(backend="reference"))(x, idx, w, y))
    auto = BF16.replace(backend="auto")
    path = tmp_path / "auto_table.json"
    path.write_text('{"ops": {"ll_dispatch": {"fixed_slots": {"min_tokens": {"2": 0}}},'
                    ' "ll_combine": {"fixed_slots": {"min_tokens": {"2": 0}}}}}')
    monkeypatch.setattr(auto_table, "TABLE_FILE", path)
    auto_table.table.cache_clear()
    try:
        assert ops.OPS["ll_dispatch"].kernel_by_default(auto, ep_size)
        assert ops.OPS["ll_combine"].kernel_by_default(auto, ep_size)
        got = to_numpy(ll_fn.__wrapped__(ep_size, auto)(x, idx, w, y))  # traced under this table
    finally:
        auto_table.table.cache_clear()
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        assert_bits_equal(b, a, "auto vs reference")


def test_ll_cuda_backend_without_gpu_says_why():
    from jax_ep import cuda_backend

    cfg = BF16.replace(backend="cuda")
    rng = np.random.default_rng(5300)
    x, idx, w = tokens_for(rng, 2, 4)
    f = per_rank(lambda x, i, w: jax_ep.ll_dispatch(x, i, w, cfg).x, 2)
    if not hasattr(cuda_backend, "ll_dispatch"):
        with pytest.raises(NotImplementedError, match=r"ll_dispatch \(backend='cuda'\).*no CUDA kernel"):
            f(x, idx, w)
    elif jax.default_backend() != "gpu":
        with pytest.raises(RuntimeError, match="unavailable"):
            f(x, idx, w)


# ---- forward-only ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_ll_grad_raises_naming_the_op():
    ep_size, tokens = 2, 4
    rng = np.random.default_rng(6000)
    x, idx, w = tokens_for(rng, ep_size, tokens, np.float32)
    y = rng.standard_normal((ep_size, E // ep_size, ep_size * tokens, H)).astype(ml_dtypes.bfloat16)

    def disp(x, idx, w):
        d = jax_ep.ll_dispatch(x, idx, w, BF16)
        return jnp.sum(d.x.astype(jnp.float32)) + jnp.sum(d.handle.topk_weights)

    def comb(x, idx, w, y):
        d = jax_ep.ll_dispatch(x, idx, w, BF16)
        return jnp.sum(jax_ep.ll_combine(y, d.handle, BF16).astype(jnp.float32))

    f_disp = per_rank(disp, ep_size, jit=False)
    f_comb = per_rank(comb, ep_size, jit=False)
    assert np.isfinite(np.asarray(jax.jit(f_disp)(x, idx, w))).all()  # the forward pass works
    with pytest.raises(NotImplementedError, match=r"jax_ep\.ll_dispatch is forward-only"):
        jax.jit(jax.grad(lambda x: jnp.sum(f_disp(x, idx, w))))(x)
    with pytest.raises(NotImplementedError, match=r"jax_ep\.ll_dispatch is forward-only"):
        jax.grad(lambda w: jnp.sum(f_disp(x, idx, w)))(w)
    with pytest.raises(NotImplementedError, match=r"jax_ep\.ll_combine is forward-only"):
        jax.jit(jax.grad(lambda y: jnp.sum(f_comb(x, idx, w, y).astype(jnp.float32))))(
            y.astype(np.float32).astype(ml_dtypes.bfloat16))


# ---- validation ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("case,match", [
    ("x_float16", r"ll_dispatch: x must be bfloat16 or float32, got dtype float16"),
    ("f32_no_wire", r"ll_dispatch: tokens travel as bfloat16 or float8_e4m3fn.*float32.*None"),
    ("x_1d", r"ll_dispatch: x must be 2-D"),
    ("hidden", r"ll_dispatch: x has hidden size 128 but cfg\.hidden=256"),
    ("too_many_tokens", r"ll_dispatch: x has 65 tokens.*max_tokens_per_rank=64"),
    ("idx_dtype", r"ll_dispatch: topk_idx must be int32, got dtype uint8"),
    ("w_shape", r"ll_dispatch: topk_weights must have shape \(4, 3\).*\(4, 2\)"),
])
def test_ll_dispatch_bad_arguments(case, match):
    rng = np.random.default_rng(7000)
    cfg = BF16
    x, idx, w = tokens_for(rng, 2, 4)
    if case == "x_float16":
        x = x.astype(np.float16)
    elif case == "f32_no_wire":
        x, cfg = x.astype(np.float32), BF16.replace(dispatch_dtype=None)
    elif case == "x_1d":
        x = x[:, 0]
    elif case == "hidden":
        x = x[:, :, :128]
    elif case == "too_many_tokens":
        x, idx, w = tokens_for(rng, 2, TMAX + 1)
    elif case == "idx_dtype":
        idx = idx.astype(np.uint8)
    elif case == "w_shape":
        w = w[:, :, :2]
    f = per_rank(lambda x, i, w: jax_ep.ll_dispatch(x, i, w, cfg).x, 2)
    with pytest.raises(ValueError, match=match):
        f(x, idx, w)


@pytest.mark.parametrize("case,match", [
    ("y_float32", r"ll_combine: y must be bfloat16, got dtype float32"),
    ("y_shape", r"ll_combine: y must have shape \(4, 8, 256\) \(E_local, R\*T, cfg\.hidden\), "
                r"got \(4, 8, 128\)"),
    ("y_2d", r"ll_combine: y must have shape \(4, 8, 256\)"),
    ("weights_dtype", r"ll_combine: handle\.topk_weights must be float32"),
    ("src_slot_shape", r"ll_combine: handle\.src_slot must have shape \(4, 8\)"),
    ("not_a_handle", r"ll_combine: handle must be the LLHandle of ll_dispatch"),
])
def test_ll_combine_bad_arguments(case, match):
    rng = np.random.default_rng(7100)
    x, idx, w = tokens_for(rng, 2, 4)
    y = np.zeros((2, E // 2, 8, H), ml_dtypes.bfloat16)
    if case == "y_float32":
        y = y.astype(np.float32)
    elif case == "y_shape":
        y = y[..., :128]
    elif case == "y_2d":
        y = y.reshape(2, -1, H)

    def f(x, i, w, y):
        h = jax_ep.ll_dispatch(x, i, w, BF16).handle
        if case == "weights_dtype":
            h = h._replace(topk_weights=h.topk_weights.astype(jnp.bfloat16))
        elif case == "src_slot_shape":
            h = h._replace(src_slot=h.src_slot[:, :4])
        elif case == "not_a_handle":
            h = (h.src_slot, h.topk_weights)
        return jax_ep.ll_combine(y, h, BF16)

    with pytest.raises(ValueError, match=match):
        per_rank(f, 2)(x, idx, w, y)


def test_ll_checked_mode_rejects_bad_ids():
    cfg = BF16.replace(checked=True)
    rng = np.random.default_rng(7200)
    x, idx, w = tokens_for(rng, 2, 4)
    idx = np.clip(idx, -1, E - 1)
    idx[1, 2, 0] = E + 4
    f = per_rank(lambda x, i, w: jax_ep.ll_dispatch(x, i, w, cfg).counts, 2)
    good = np.clip(idx, -1, E - 1)
    counts = f(x, good, w)
    jax.block_until_ready(counts)
    jax.effects_barrier()
    assert int(np.asarray(counts).sum()) == int((nm.sanitize(good, E) >= 0).sum())
    with pytest.raises(Exception, match=r"topk_idx has 1 ids outside \[-1, 8\).*first bad value 12"):
        jax.block_until_ready(f(x, idx, w))
        jax.effects_barrier()


def test_ll_outside_shard_map():
    x, idx, w = tokens_for(np.random.default_rng(7300), 1, 2)
    with pytest.raises(ValueError, match=r"jax_ep\.ll_dispatch must run inside shard_map"):
        jax_ep.ll_dispatch(x[0], idx[0], w[0], BF16)


# ---- two-phase form: _send then _recv equals the fused op ---------------------------------------
@functools.cache
def two_phase_fn(ep_size, cfg, in_flight=1):
    """(x, idx, w, y) -> (LLDispatched, ll_combine(y)) per rank through the two-phase ops; with
    in_flight=2, two calls (the second on x * 2) are sent before either is received."""

    def f(x, idx, w, y):
        sends = [jax_ep.ll_dispatch_send(x * (i + 1), idx, w, cfg) for i in range(in_flight)]
        ds = [jax_ep.ll_dispatch_recv(p, cfg) for p in sends]
        combines = [jax_ep.ll_combine_send(y * (i + 1), d.handle, cfg) for i, d in enumerate(ds)]
        return ds, [jax_ep.ll_combine_recv(p, cfg) for p in combines]

    return per_rank(f, ep_size)


@parametrize_slow_tail("ep_size,dtype", [(1, "bfloat16"), (2, "float8_e4m3fn"), (4, "bfloat16")], fast=(1,))
def test_ll_two_phase_equals_fused(ep_size, dtype):
    cfg = CFGS[dtype]
    tokens = 9
    rng = np.random.default_rng(7000 + ep_size)
    x, idx, w = tokens_for(rng, ep_size, tokens, np.float32, scale_tokens=dtype != "bfloat16")
    m = nm.ll_dispatch(x, idx, w, num_experts=E, dispatch_dtype=dtype)
    y = poisoned_y(rng, m, ep_size, tokens)
    want_d, want_c = to_numpy(ll_fn(ep_size, cfg)(x, idx, w, y))
    (d,), (c,) = to_numpy(two_phase_fn(ep_size, cfg)(x, idx, w, y))
    assert_ll_matches(d, m, ep_size, tokens, cfg)
    for a, b in zip(jax.tree.leaves(d), jax.tree.leaves(want_d), strict=True):
        assert_bits_equal(a, b, "two-phase dispatch")
    assert_bits_equal(c, want_c, "two-phase combine")


def test_ll_two_calls_in_flight():
    """Two sends before either receive: each receive gets its own call's data."""
    ep_size, tokens, cfg = 2, 6, FP8
    rng = np.random.default_rng(7100)
    x, idx, w = tokens_for(rng, ep_size, tokens)
    m = nm.ll_dispatch(x, idx, w, num_experts=E, dispatch_dtype=cfg.dispatch_dtype)
    y = poisoned_y(rng, m, ep_size, tokens)
    ds, cs = to_numpy(two_phase_fn(ep_size, cfg, in_flight=2)(x, idx, w, y))
    for i in range(2):
        want_d, want_c = to_numpy(ll_fn(ep_size, cfg)((x.astype(np.float32) * (i + 1)).astype(x.dtype),
                                                      idx, w, y * (i + 1)))
        assert_bits_equal(ds[i].x, want_d.x, f"call {i} rows")
        assert_bits_equal(ds[i].scales, want_d.scales, f"call {i} scales")
        assert_bits_equal(cs[i], want_c, f"call {i} combine")


def test_ll_two_phase_pending_types_and_errors():
    ep_size, tokens, cfg = 2, 4, BF16
    rng = np.random.default_rng(7200)
    x, idx, w = tokens_for(rng, ep_size, tokens)

    def f(x, idx, w):
        p = jax_ep.ll_dispatch_send(x, idx, w, cfg)
        assert isinstance(p, jax_ep.LLDispatchPending)
        assert p.token.shape == (4,) and p.token.dtype == jnp.uint32
        assert p.topk_weights.shape == (tokens, K)
        d = jax_ep.ll_dispatch_recv(p, cfg)
        q = jax_ep.ll_combine_send(d.x, d.handle, cfg)
        assert isinstance(q, jax_ep.LLCombinePending)
        return jax_ep.ll_combine_recv(q, cfg)

    per_rank(f, ep_size)(x, idx, w)
    with pytest.raises(ValueError, match=r"ll_dispatch_recv: expected the LLDispatchPending"):
        per_rank(lambda x, idx, w: jax_ep.ll_dispatch_recv((x, idx), cfg).x, ep_size)(x, idx, w)
    with pytest.raises(ValueError, match=r"ll_combine_recv: expected the LLCombinePending"):
        per_rank(lambda x, idx, w: jax_ep.ll_combine_recv(
            jax_ep.ll_dispatch_send(x, idx, w, cfg), cfg), ep_size)(x, idx, w)
    with pytest.raises(ValueError, match=r"ll_combine_recv: pending.y is None"):
        per_rank(lambda x, idx, w: jax_ep.ll_combine_recv(jax_ep.LLCombinePending(
            jnp.zeros((4,), jnp.uint32), w, idx), cfg), ep_size)(x, idx, w)
    with pytest.raises(ValueError, match=r"ll_combine_recv: pending.backend=None names no backend"):
        per_rank(lambda x, idx, w: jax_ep.ll_combine_recv(jax_ep.LLCombinePending(
            jnp.zeros((4,), jnp.uint32), w, idx, y=x), cfg), ep_size)(x, idx, w)
    # a receive with another cfg than its send's (before 2026-12-05: the rows read as other experts', or
    # a bf16 receive of FP8 rows)
    for other, word in ((cfg.replace(num_experts=2 * cfg.num_experts), "num_experts"),
                        (cfg.replace(dispatch_dtype="float8_e4m3fn"), "dispatch_dtype")):
        with pytest.raises(ValueError, match=rf"ll_dispatch_recv: cfg differs from the _send's in {word}="):
            per_rank(lambda x, idx, w, other=other: jax_ep.ll_dispatch_recv(
                jax_ep.ll_dispatch_send(x, idx, w, cfg), other).x, ep_size)(x, idx, w)

    def combine_other(x, idx, w):
        d = jax_ep.ll_dispatch(x, idx, w, cfg)
        return jax_ep.ll_combine_recv(jax_ep.ll_combine_send(d.x, d.handle, cfg),
                                      cfg.replace(max_tokens_per_rank=2 * tokens))
    with pytest.raises(ValueError, match=r"ll_combine_recv: cfg differs .* in max_tokens_per_rank="):
        per_rank(combine_other, ep_size)(x, idx, w)
    checked = cfg.replace(checked=True)     # checks and kernel tuning may differ
    per_rank(lambda x, idx, w: jax_ep.ll_dispatch_recv(jax_ep.ll_dispatch_send(x, idx, w, cfg), checked).x,
             ep_size)(x, idx, w)

    def structures(x, idx, w):   # ... and keep the pending's pytree structure (a scan carry's)
        tuned = checked.replace(kernel=jax_ep.KernelConfig(num_sms=8))
        a, b = (jax_ep.ll_dispatch_send(x, idx, w, c) for c in (cfg, tuned))
        assert jax.tree.structure(a) == jax.tree.structure(b)
        return a.token
    per_rank(structures, ep_size)(x, idx, w)
    with pytest.raises(ValueError, match=r"ll_dispatch_send: x must be bfloat16 or float32"):
        per_rank(lambda x, idx, w: jax_ep.ll_dispatch_send(x.astype(jnp.float16), idx, w, cfg).token,
                 ep_size)(x, idx, w)
    with pytest.raises(ValueError, match=r"ll_dispatch_send must run inside shard_map"):
        jax_ep.ll_dispatch_send(jnp.asarray(x[0]), jnp.asarray(idx[0]), jnp.asarray(w[0]), cfg)


def test_ll_a_pending_received_twice_is_an_error_on_every_backend():
    """Receiving one pending value twice is an error at trace time on the reference backend too (the
    kernels make it one at run time on GPUs; found by a review, 2026-12-05: a program written on CPU
    failed only on GPUs). A pending received in each branch of lax.cond (one runs) is no error."""
    ep_size, tokens, cfg = 2, 4, BF16
    x, idx, w = tokens_for(np.random.default_rng(7300), ep_size, tokens)

    def twice(x, idx, w):
        p = jax_ep.ll_dispatch_send(x, idx, w, cfg)
        return jax_ep.ll_dispatch_recv(p, cfg).x + jax_ep.ll_dispatch_recv(p, cfg).x

    with pytest.raises(jax_ep.EPValueError, match=r"ll_dispatch_recv: this pending value was received "
                                                   r"already: receive each pending value exactly once"):
        per_rank(twice, ep_size)(x, idx, w)

    def combine_twice(x, idx, w):
        d = jax_ep.ll_dispatch(x, idx, w, cfg)
        q = jax_ep.ll_combine_send(d.x, d.handle, cfg)
        return jax_ep.ll_combine_recv(q, cfg) + jax_ep.ll_combine_recv(q, cfg)

    with pytest.raises(jax_ep.EPValueError, match=r"ll_combine_recv: this pending value was received"):
        per_rank(combine_twice, ep_size)(x, idx, w)

    def twice_after_a_side_region(x, idx, w):   # the ops' ordering passes the token on as a new value
        p = jax_ep.ll_dispatch_send(x, idx, w, cfg)
        z = jax_ep.overlap.region(lambda v: v * 2, x, side=True)
        return jax_ep.ll_dispatch_recv(p, cfg).x + jax_ep.ll_dispatch_recv(p, cfg).x + z.astype(x.dtype)

    with pytest.raises(jax_ep.EPValueError, match=r"ll_dispatch_recv: this pending value was received"):
        per_rank(twice_after_a_side_region, ep_size)(x, idx, w)

    def branches(x, idx, w):
        p = jax_ep.ll_dispatch_send(x, idx, w, cfg)
        return lax.cond(jnp.sum(w) > 0, lambda: jax_ep.ll_dispatch_recv(p, cfg).x,
                        lambda: 2 * jax_ep.ll_dispatch_recv(p, cfg).x)

    once = per_rank(lambda x, idx, w: jax_ep.ll_dispatch(x, idx, w, cfg).x, ep_size)(x, idx, w)
    assert_bits_equal(to_numpy(per_rank(branches, ep_size)(x, idx, w)), to_numpy(once), "cond's receive")


def test_ll_two_phase_grad_raises_naming_the_op():
    ep_size, tokens = 2, 4
    rng = np.random.default_rng(7300)
    x, idx, w = tokens_for(rng, ep_size, tokens, np.float32)

    def disp(x, idx, w):
        d = jax_ep.ll_dispatch_recv(jax_ep.ll_dispatch_send(x, idx, w, BF16), BF16)
        return jnp.sum(d.x.astype(jnp.float32))

    f = per_rank(disp, ep_size, jit=False)
    with pytest.raises(NotImplementedError, match=r"jax_ep\.ll_dispatch_(send|recv) is forward-only"):
        jax.jit(jax.grad(lambda x: jnp.sum(f(x, idx, w))))(x)
