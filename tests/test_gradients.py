"""Gradients of dispatch / combine (custom_vjp) on virtual CPU devices.

* jax.test_util.check_grads (order 1, reverse mode) of dispatch -> ragged_dot -> combine;
* gradients against autodiff of a naive dense MoE (no EP, no shard_map), with and without drops;
* the VJPs of dispatch and of combine alone against the NumPy model;
* FP8 dispatch is forward-only.
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
    lower_cuda_here,
    make_cfg,
    model_for,
    parametrize_slow_tail,
    per_rank,
    random_routing,
    random_tokens,
    to_numpy,
)
from jax.test_util import check_grads

import jax_ep

E, K, H, HO, T = 8, 2, 16, 8, 4
CFG = make_cfg(num_experts=E, num_topk=K, hidden=H, max_tokens_per_rank=T)


def _moe_per_rank(cfg, compute_dtype=None):
    def f(x, idx, w, expert_w):
        d = jax_ep.dispatch(x, idx, w, cfg)
        rows = d.x if compute_dtype is None else d.x.astype(compute_dtype)
        ew = expert_w if compute_dtype is None else expert_w.astype(compute_dtype)
        y = jax.lax.ragged_dot(rows, ew, d.group_sizes, precision=jax.lax.Precision.HIGHEST)
        return jax_ep.combine(y, d.handle, cfg)

    return f


@functools.cache
def moe_fn(ep_size, cfg, compute_dtype=None):
    return per_rank(_moe_per_rank(cfg, compute_dtype), ep_size)


@functools.cache
def moe_grad_fn(ep_size, cfg, compute_dtype=None):
    """grad of sum(out * g) w.r.t. (x, topk_weights, expert weights), over the EP ops."""
    f = per_rank(_moe_per_rank(cfg, compute_dtype), ep_size, jit=False)

    def loss(x, w, expert_w, idx, g):
        return jnp.sum(f(x, idx, w, expert_w).astype(jnp.float32) * g)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def dense_moe_jax(x, w, expert_w, idx, mask):
    """Naive dense MoE, no EP: out[r, t] = sum_k mask * w * x[r, t] @ W[idx]. idx sanitised to >= 0."""
    per_slot = jnp.einsum("rth,rtkho->rtko", x, expert_w[idx], precision=jax.lax.Precision.HIGHEST)
    return jnp.sum(per_slot * (w * mask)[..., None], axis=2)


@jax.jit
def dense_grad(x, w, expert_w, idx, mask, g):
    return jax.grad(lambda *a: jnp.sum(dense_moe_jax(*a, idx, mask) * g), argnums=(0, 1, 2))(x, w, expert_w)


def _inputs(rng, ep_size, routing=random_routing):
    x, idx, w = random_tokens(rng, ep_size, T, CFG, routing=routing)
    expert_w = (rng.standard_normal((E, H, HO)) / np.sqrt(H)).astype(np.float32)
    g = rng.standard_normal((ep_size, T, HO)).astype(np.float32)
    return x, w, idx, expert_w, g


def _compare_with_dense(cfg, ep_size, x, w, idx, expert_w, g, rtol=1e-5, compute_dtype=None):
    local = E // ep_size
    dx, dw, dew = to_numpy(moe_grad_fn(ep_size, cfg, compute_dtype)(
        x, w, expert_w.reshape(ep_size, local, H, HO), idx, g))
    m = model_for(cfg, x, idx, w)
    mask = m.kept.astype(np.float32)
    want = to_numpy(dense_grad(x, w, expert_w, np.maximum(m.sanitized, 0).astype(np.int32), mask, g))
    assert_close_f(dx, want[0], rtol, "d x")
    assert_close_f(dw, want[1], rtol, "d topk_weights")
    assert_close_f(dew.reshape(E, H, HO), want[2], rtol, "d expert weights")
    # slots without a row (unused, out of range, repeated, dropped) get exactly zero gradient
    assert (dw[~m.kept] == 0).all()
    return m, dx, dw, dew


# ---- check_grads -------------------------------------------------------------------------------------
@parametrize_slow_tail("ep_size", [1, 2, 4], fast=(1,))
def test_check_grads_moe(ep_size):
    rng = np.random.default_rng(300 + ep_size)
    x, w, idx, expert_w, _ = _inputs(rng, ep_size)
    fn = moe_fn(ep_size, CFG)
    ew = expert_w.reshape(ep_size, E // ep_size, H, HO)
    check_grads(lambda x, w, ew: fn(x, idx, w, ew), (x, w, ew), order=1, modes=["rev"],
                atol=1e-2, rtol=1e-2, eps=1e-3)


def test_check_grads_moe_with_drops_and_alignment():
    ep_size = 2
    cfg = CFG.replace(capacity=4, expert_alignment=2)
    rng = np.random.default_rng(311)
    x, w, idx, expert_w, _ = _inputs(rng, ep_size)
    idx[:, :, 0] = 0  # every token picks expert 0: 8 rows for a capacity of 4
    m = model_for(cfg, x, idx, w)
    assert sum(r.num_dropped for r in m.ranks) > 0
    fn = moe_fn(ep_size, cfg)
    ew = expert_w.reshape(ep_size, E // ep_size, H, HO)
    check_grads(lambda x, w, ew: fn(x, idx, w, ew), (x, w, ew), order=1, modes=["rev"],
                atol=1e-2, rtol=1e-2, eps=1e-3)


@pytest.mark.parametrize("ep_size", [1, 2])
def test_second_order_gradients_match_dense(ep_size):
    """Reverse over reverse through dispatch, the expert GEMM and the weighted combine equals the dense
    MoE's: the gradient in (x, topk_weights) of <d x, u> + <d topk_weights, v>. Found by a review
    (2026-12-05): the reference backend's combine backward computes d topk_weights as a row dot product
    whose products pass a bit cast (the kernels' order, no FMA), which JAX does not differentiate: every
    term through d topk_weights was exactly 0, silently."""
    rng = np.random.default_rng(int(np.random.default_rng().integers(1 << 30)))
    x, w, idx, expert_w, g = _inputs(rng, ep_size)
    f = per_rank(_moe_per_rank(CFG), ep_size, jit=False)
    ew = expert_w.reshape(ep_size, E // ep_size, H, HO)
    m = model_for(CFG, x, idx, w)
    mask = m.kept.astype(np.float32)
    clean = np.maximum(m.sanitized, 0).astype(np.int32)
    u, v = rng.standard_normal(x.shape).astype(np.float32), rng.standard_normal(w.shape).astype(np.float32)

    def second(out):
        def inner(x, w):
            dx, dw = jax.grad(lambda x, w: jnp.sum(out(x, w) * g), argnums=(0, 1))(x, w)
            return jnp.sum(dx * u) + jnp.sum(dw * v * mask)   # unused / dropped slots: no pair to compare
        return to_numpy(jax.jit(jax.grad(inner, argnums=(0, 1)))(x, w))

    got = second(lambda x, w: f(x, idx, w, ew))
    want = second(lambda x, w: dense_moe_jax(x, w, expert_w, clean, mask))
    assert np.abs(want[1]).max() > 0 and np.abs(want[0]).max() > 0
    assert_close_f(got[0], want[0], 1e-4, "second order, x")
    assert_close_f(got[1] * mask, want[1] * mask, 1e-4, "second order, topk_weights")


# ---- against a dense implementation ---------------------------------------------------------------
@parametrize_slow_tail("ep_size", [1, 2, 4], fast=(1,))
def test_grads_match_dense(ep_size):
    rng = np.random.default_rng(320 + ep_size)
    for _ in range(2):
        x, w, idx, expert_w, g = _inputs(rng, ep_size)
        m, *_ = _compare_with_dense(CFG, ep_size, x, w, idx, expert_w, g)
        assert (m.sanitized == -1).any() and m.kept.any()


def _to_expert_zero(rng, ep_size, tokens, topk, num_experts):
    """Slot 0 of every token picks expert 0 (overflowing small capacities), the rest random/-1."""
    idx = random_routing(rng, ep_size, tokens, topk, num_experts, p_out_of_range=0.0, p_repeat=0.0)
    idx[:, :, 0] = 0
    idx[:, :, 1:] = np.where(idx[:, :, 1:] == 0, -1, idx[:, :, 1:])
    idx[:, -1, 1:] = -1  # the last token of each rank picks expert 0 only
    return idx


@parametrize_slow_tail("ep_size", [2, 4])
def test_grads_with_capacity_drops(ep_size):
    cfg = CFG.replace(capacity=6, expert_alignment=2)
    rng = np.random.default_rng(330 + ep_size)
    x, w, idx, expert_w, g = _inputs(rng, ep_size, routing=_to_expert_zero)
    m, dx, dw, dew = _compare_with_dense(cfg, ep_size, x, w, idx, expert_w, g)
    assert sum(r.num_dropped for r in m.ranks) > 0
    dropped = [(s, t, k) for r in m.ranks for s, t, k, _ in r.dropped]
    assert dropped
    for s, t, k in dropped:
        assert dw[s, t, k] == 0
    # a token all of whose slots were dropped or unused gets no gradient at all
    none_kept = ~m.kept.any(axis=2)
    assert none_kept.any()
    assert (dx[none_kept] == 0).all()


def test_grads_bf16_dispatch_match_dense():
    ep_size = 2
    cfg = CFG.replace(dispatch_dtype="bfloat16")
    rng = np.random.default_rng(340)
    x, w, idx, expert_w, g = _inputs(rng, ep_size)
    _compare_with_dense(cfg, ep_size, x, w, idx, expert_w, g, rtol=3e-2, compute_dtype=jnp.bfloat16)


def test_grads_x64_inputs():
    """With jax_enable_x64 on, float64 tokens and expert weights go through (weights stay float32)."""
    ep_size = 2
    rng = np.random.default_rng(350)
    x, w, idx, expert_w, g = _inputs(rng, ep_size)
    with jax.enable_x64(True):
        x64, ew64 = x.astype(np.float64), expert_w.astype(np.float64)
        out = np.asarray(moe_fn(ep_size, CFG)(x64, idx, w, ew64.reshape(ep_size, E // ep_size, H, HO)))
        assert out.dtype == np.float64
        assert_close_f(out, nm.dense_moe(x, idx, w, expert_w, E), 1e-5, "x64 forward")
        m, dx, dw, dew = _compare_with_dense(CFG, ep_size, x64, w, idx, ew64, g)
        assert dx.dtype == np.float64 and dw.dtype == np.float32 and dew.dtype == np.float64


# ---- VJPs of the ops alone ------------------------------------------------------------------------------
@functools.cache
def dispatch_vjp_fn(ep_size, cfg):
    f = per_rank(lambda x, idx, w: jax_ep.dispatch(x, idx, w, cfg), ep_size, jit=False)

    def loss(x, w, idx, ct_rows, ct_rw, ct_hrw):
        d = f(x, idx, w)
        return (jnp.sum(d.x.astype(jnp.float32) * ct_rows) + jnp.sum(d.row_weights * ct_rw)
                + jnp.sum(d.handle.row_weights * ct_hrw))

    return jax.jit(jax.grad(loss, argnums=(0, 1)))


@pytest.mark.parametrize("ep_size", [1, 4])
def test_dispatch_vjp_alone(ep_size):
    """d x[s, t] = sum of the cotangents of token (s, t)'s rows; d w[s, t, k] = cotangent of the row
    weight of that slot's row (from d.row_weights and from handle.row_weights alike)."""
    cfg = CFG.replace(capacity=8) if ep_size == 4 else CFG
    rng = np.random.default_rng(360 + ep_size)
    x, w, idx, _, _ = _inputs(rng, ep_size, routing=_to_expert_zero if ep_size == 4 else random_routing)
    m = model_for(cfg, x, idx, w)
    ct_rows = rng.standard_normal((ep_size, m.capacity, H)).astype(np.float32)
    ct_rw = rng.standard_normal((ep_size, m.capacity)).astype(np.float32)
    ct_hrw = rng.standard_normal((ep_size, m.capacity)).astype(np.float32)
    dx, dw = to_numpy(dispatch_vjp_fn(ep_size, cfg)(x, w, idx, ct_rows, ct_rw, ct_hrw))
    want_dx = np.zeros((ep_size, T, H))
    want_dw = np.zeros((ep_size, T, K), np.float32)
    for d, rd in enumerate(m.ranks):
        for j, n in enumerate(rd.src):
            if n >= 0:
                want_dx[n // T, n % T] += ct_rows[d, j]
        for n, k in zip(*np.nonzero(rd.token_rows >= 0), strict=True):
            want_dw[n // T, n % T, k] = ct_rw[d, rd.token_rows[n, k]] + ct_hrw[d, rd.token_rows[n, k]]
    assert_close_f(dx, want_dx, 1e-6, "d x")
    assert_bits_equal(dw, want_dw, "d topk_weights")
    if ep_size == 4:
        assert sum(r.num_dropped for r in m.ranks) > 0


@functools.cache
def combine_vjp_fn(ep_size, cfg):
    def f(x, idx, w, y, rw, g):
        d = jax_ep.dispatch(x, idx, w, cfg)
        out, vjp = jax.vjp(lambda y, rw: jax_ep.combine(y, d.handle._replace(row_weights=rw), cfg), y, rw)
        return out, vjp(g)

    return per_rank(f, ep_size)


@pytest.mark.parametrize("ep_size", [2, 4])
def test_combine_vjp_alone(ep_size):
    """d y[row] = row_weight * g[token of row]; d row_weight[row] = <y[row], g[token of row]>; empty
    (and dropped) rows get zero."""
    cfg = CFG.replace(capacity=8, expert_alignment=2) if ep_size == 4 else CFG
    rng = np.random.default_rng(370 + ep_size)
    x, w, idx, _, g = _inputs(rng, ep_size)
    g = rng.standard_normal((ep_size, T, H)).astype(np.float32)
    m = model_for(cfg, x, idx, w)
    y = rng.standard_normal((ep_size, m.capacity, H)).astype(np.float32)
    rw = rng.standard_normal((ep_size, m.capacity)).astype(np.float32)
    out, (dy, drw) = to_numpy(combine_vjp_fn(ep_size, cfg)(x, idx, w, y, rw, g))
    assert_close_f(out, nm.combine(y, m, row_weights=rw), 1e-5, "combine with overridden weights")
    want_dy = np.zeros_like(y)
    want_drw = np.zeros(rw.shape)
    for d, rd in enumerate(m.ranks):
        for j, n in enumerate(rd.src):
            if n >= 0:
                gt = g[n // T, n % T]
                want_dy[d, j] = gt * rw[d, j]
                want_drw[d, j] = np.dot(y[d, j].astype(np.float64), gt)
    np.testing.assert_array_equal(dy, want_dy, "d y")  # one f32 product per element: exact (+-0 alike)
    assert_close_f(drw, want_drw, 1e-5, "d row_weights")
    assert (drw[np.array([r.src for r in m.ranks]) < 0] == 0).all()


@functools.cache
def combine_bwd_fn(ep_size, cfg, masked, empty_rows_zero=False):
    """(x, idx, w, y, rw, g, mask) -> (d y, d row_weights) of combine over an unmasked dispatch's
    handle with row_weights rw, the mask given to combine only (masked)."""
    def f(x, idx, w, y, rw, g, mask):
        d = jax_ep.dispatch(x, idx, w, cfg)
        _, vjp = jax.vjp(lambda y, rw: jax_ep.combine(y, d.handle._replace(row_weights=rw), cfg,
                                                      rank_mask=mask if masked else None,
                                                      empty_rows_zero=empty_rows_zero), y, rw)
        return vjp(g)

    return per_rank(f, ep_size)


@pytest.mark.parametrize("ep_size, y_dtype, hidden, mask", [
    (2, ml_dtypes.bfloat16, 264, None), (4, np.float32, 520, None), (4, ml_dtypes.bfloat16, 72, (1, 0, 1, 1)),
    (2, np.float32, 256, (0, 1))])
def test_combine_backward_bits_in_documented_order(ep_size, y_dtype, hidden, mask):
    """combine's backward bit for bit (docs/api.md, "Gradients"): d row_weights[row] = the float32 dot
    product of y's row as stored and its token's cotangent in the documented order (NumPy:
    numpy_model.dot_exact), d y = w * g rounded once to y's dtype; rows with no token of a source
    linked to the rank (empty rows; with combine's mask after an unmasked dispatch, the masked
    sources' rows) get +0.0 in both although y holds NaN there. Row weights of both signs."""
    cfg = make_cfg(num_experts=E, num_topk=K, hidden=hidden, max_tokens_per_rank=T, capacity=12,
                   expert_alignment=2)
    rng = np.random.default_rng(400 + ep_size + hidden)
    x, idx, w = random_tokens(rng, ep_size, T, cfg)
    m = model_for(cfg, x, idx, w)
    src = np.array([r.src for r in m.ranks])                       # [R, C]
    active = np.ones(ep_size, bool) if mask is None else np.asarray(mask, bool)
    source = np.maximum(src, 0) // T
    linked = np.where(active[:, None], active[None, :], np.eye(ep_size, dtype=bool))  # [rank, source]
    live = (src >= 0) & np.take_along_axis(linked, source, axis=1)
    y = rng.standard_normal((ep_size, cfg.resolved_capacity(ep_size), hidden)).astype(np.float32)
    y = np.where(live[..., None], y, np.nan).astype(y_dtype)
    rw = rng.standard_normal(src.shape).astype(np.float32)
    g = rng.standard_normal((ep_size, T, hidden)).astype(np.float32).astype(y_dtype)
    mask_arg = np.tile(active, (ep_size, 1))
    dy, drw = to_numpy(combine_bwd_fn(ep_size, cfg, mask is not None)(x, idx, w, y, rw, g, mask_arg))
    want_dy, want_drw = np.zeros(y.shape, y_dtype), np.zeros(rw.shape, np.float32)
    for d, j in zip(*np.nonzero(live), strict=True):
        gt = g[src[d, j] // T, src[d, j] % T].astype(np.float32)
        want_dy[d, j] = (gt * rw[d, j]).astype(y_dtype)
        want_drw[d, j] = nm.dot_exact(y[d, j].astype(np.float32), gt)
    assert live.any() and (~live & (src >= 0)).any() == (mask is not None)
    assert_bits_equal(dy, want_dy, "d y")
    assert_bits_equal(drw, want_drw, "d row_weights")


@pytest.mark.parametrize("mask", [None, (1, 0, 1, 1)])
def test_combine_empty_rows_zero_takes_those_rows_of_d_y_from_y(mask):
    """combine(..., empty_rows_zero=True): d y of the rows that hold no token (src_index -1) is y's own
    row (what the CUDA kernel leaves in y's buffer, aliased as d y); every other row as without it (a
    masked source's rows +0.0, token rows w * g) and d row_weights unchanged. With y zero there, as
    the caller states, d y equals the default's bit for bit."""
    ep_size = 4
    cfg = make_cfg(num_experts=E, num_topk=K, hidden=72, max_tokens_per_rank=T, capacity=12,
                   expert_alignment=2)
    rng = np.random.default_rng(410)
    x, idx, w = random_tokens(rng, ep_size, T, cfg)
    src = np.array([r.src for r in model_for(cfg, x, idx, w).ranks])        # [R, C]
    y = rng.standard_normal((ep_size, cfg.resolved_capacity(ep_size), 72)).astype(ml_dtypes.bfloat16)
    rw = rng.standard_normal(src.shape).astype(np.float32)
    g = rng.standard_normal((ep_size, T, 72)).astype(ml_dtypes.bfloat16)
    active = np.ones(ep_size, bool) if mask is None else np.asarray(mask, bool)
    args = (x, idx, w, y, rw, g, np.tile(active, (ep_size, 1)))
    dy0, drw0 = to_numpy(combine_bwd_fn(ep_size, cfg, mask is not None)(*args))
    dy1, drw1 = to_numpy(combine_bwd_fn(ep_size, cfg, mask is not None, True)(*args))
    empty = src < 0
    assert empty.any() and (~empty).any()
    assert_bits_equal(dy1[empty], y[empty], "d y of the rows with no token: y's")
    assert_bits_equal(dy1[~empty], dy0[~empty], "d y of the other rows")
    assert_bits_equal(drw1, drw0, "d row_weights")
    y0 = np.where(empty[..., None], 0, y).astype(y.dtype)
    args = (x, idx, w, y0, rw, g, np.tile(active, (ep_size, 1)))
    assert_bits_equal(to_numpy(combine_bwd_fn(ep_size, cfg, mask is not None, True)(*args))[0],
                      to_numpy(combine_bwd_fn(ep_size, cfg, mask is not None)(*args))[0], "d y, y zero there")
    with pytest.raises(jax_ep.EPTypeError, match="empty_rows_zero must be a bool, got 1"):
        jax_ep.combine(jnp.zeros((4, 8)), None, cfg, empty_rows_zero=1)


@pytest.mark.parametrize("weighted", [True, False])
def test_combines_backward_in_place_asks_for_the_in_place_forms(monkeypatch, weighted):
    """combine(..., empty_rows_zero=True)'s backward takes the in-place forms' implementations
    (``broadcast_in_place`` / ``combine_bwd_in_place``: auto-table entries of their own), without it the
    plain ops; both run the same backend function."""
    from jax_ep import ops

    asked, real = [], ops.implementation
    monkeypatch.setattr(ops, "implementation",
                        lambda op, cfg, dtype=None: asked.append(op) or real(op, cfg, dtype))
    ep_size = 2
    cfg = make_cfg(num_experts=E, num_topk=K, hidden=40, max_tokens_per_rank=T, capacity=12,
                   expert_alignment=2)
    rng = np.random.default_rng(420 + weighted)
    x, idx, w = random_tokens(rng, ep_size, T, cfg)
    y = rng.standard_normal((ep_size, cfg.resolved_capacity(ep_size), 40)).astype(np.float32)
    g = rng.standard_normal((ep_size, T, 40)).astype(np.float32)
    plain = "combine_bwd" if weighted else "broadcast"
    for in_place in (False, True):
        asked.clear()

        def f(x, idx, w, y, g, in_place=in_place):
            handle = jax_ep.dispatch(x, idx, w, cfg).handle
            return jax.vjp(lambda y: jax_ep.combine(y, handle, cfg, empty_rows_zero=in_place,
                                                    weighted=weighted), y)[1](g)

        per_rank(f, ep_size)(x, idx, w, y, g)
        backward = [op for op in asked if op.startswith(plain)]
        assert backward == [f"{plain}_in_place" if in_place else plain], asked


@functools.cache
def unweighted_combine_fn(ep_size, cfg, masked, empty_rows_zero):
    """(x, idx, w, y, rw, g, mask) -> (combine(weighted=False) and the weighted one with unit weights,
    d y, d row_weights) over an unmasked dispatch's handle with row_weights rw (mask: combine's only)."""
    def f(x, idx, w, y, rw, g, mask):
        d = jax_ep.dispatch(x, idx, w, cfg)
        handle = d.handle._replace(row_weights=rw)
        mask = mask if masked else None
        out, vjp = jax.vjp(lambda y, rw: jax_ep.combine(y, d.handle._replace(row_weights=rw), cfg,
                                                        rank_mask=mask, empty_rows_zero=empty_rows_zero,
                                                        weighted=False), y, rw)
        ones = jax_ep.combine(y, handle._replace(row_weights=jnp.ones_like(rw)), cfg, rank_mask=mask)
        return (out, ones, *vjp(g))

    return per_rank(f, ep_size)


@pytest.mark.parametrize("empty_rows_zero", [False, True], ids=["zeroed", "in_y"])
@pytest.mark.parametrize("ep_size, y_dtype, mask", [(2, ml_dtypes.bfloat16, None), (4, np.float32, None),
                                                     (4, ml_dtypes.bfloat16, (1, 0, 1, 1))])
def test_unweighted_combine_sums_the_rows_and_its_backward_is_their_broadcast(ep_size, y_dtype, mask,
                                                                              empty_rows_zero):
    """combine(weighted=False) (the gate weights applied in the experts): the output is the weighted
    combine's with unit weights, bit for bit, whatever handle.row_weights holds; d y is the broadcast
    of g: each token's g on its live rows, +0.0 on a masked source's rows and on the rows with no token
    (or, with empty_rows_zero, y's there, NaN here); row_weights get a zero gradient."""
    cfg = make_cfg(num_experts=E, num_topk=K, hidden=72, max_tokens_per_rank=T, capacity=12,
                   expert_alignment=2)
    rng = np.random.default_rng(420 + ep_size)
    x, idx, w = random_tokens(rng, ep_size, T, cfg)
    src = np.array([r.src for r in model_for(cfg, x, idx, w).ranks])        # [R, C]
    active = np.ones(ep_size, bool) if mask is None else np.asarray(mask, bool)
    linked = np.where(active[:, None], active[None, :], np.eye(ep_size, dtype=bool))
    live = (src >= 0) & np.take_along_axis(linked, np.maximum(src, 0) // T, axis=1)
    y = rng.standard_normal((ep_size, cfg.resolved_capacity(ep_size), 72)).astype(np.float32)
    y = np.where((src >= 0)[..., None], y, np.nan).astype(y_dtype)
    rw = rng.standard_normal(src.shape).astype(np.float32)
    g = rng.standard_normal((ep_size, T, 72)).astype(y_dtype)
    args = (x, idx, w, y, rw, g, np.tile(active, (ep_size, 1)))
    fn = unweighted_combine_fn(ep_size, cfg, mask is not None, empty_rows_zero)
    out, ones, dy, drw = to_numpy(fn(*args))
    assert_bits_equal(out, ones, "the unit-weight combine")
    want = np.zeros(y.shape, y_dtype)
    for d, j in zip(*np.nonzero(live), strict=True):
        want[d, j] = g[src[d, j] // T, src[d, j] % T]
    if empty_rows_zero:
        want[src < 0] = y[src < 0]
    assert live.any() and (src < 0).any() and (~live & (src >= 0)).any() == (mask is not None)
    assert_bits_equal(dy, want, "d y")
    assert not np.any(drw), "d row_weights"
    with pytest.raises(jax_ep.EPTypeError, match="weighted must be a bool, got 0"):
        jax_ep.combine(jnp.zeros((4, 8)), None, cfg, weighted=0)


def _backward_calls(cfg, ep_size=2, empty_rows_zero=False, weighted=True, width=None) -> dict:
    """{custom call target: [its lines]} of jax.grad through combine (over a reference dispatch);
    ``width``: the rows' (cfg.hidden by default)."""
    ref = cfg.replace(backend="reference")

    def body(x, idx, w, y):
        d = jax_ep.dispatch(x, idx, w, ref)
        return jax.grad(lambda y, rw: jnp.sum(jax_ep.combine(
            y, d.handle._replace(row_weights=rw), cfg, empty_rows_zero=empty_rows_zero, weighted=weighted
        ).astype(jnp.float32) ** 2), argnums=(0, 1))(y, d.row_weights)

    rng = np.random.default_rng(5)
    x, idx, w = random_tokens(rng, ep_size, T, cfg)
    y = jnp.ones((ep_size, cfg.resolved_capacity(ep_size), width or cfg.hidden), jnp.bfloat16)
    text = per_rank(body, ep_size).lower(x, idx, w, y).as_text()
    calls = {}
    for line in text.splitlines():
        if "stablehlo.custom_call @jax_ep" in line:
            calls.setdefault(line.split("@")[1].split("(")[0], []).append(line)
    return calls


@pytest.mark.parametrize("weighted", [True, False])
def test_cuda_combine_takes_rows_of_any_width(monkeypatch, weighted):
    """combine's rows y [C, H'] may have any width (the docs' expert outputs): on the cuda backend they
    are widened with zero columns to the kernels' 8 and cut back, in combine, combine_bwd and broadcast
    (found by a review, 2026-12-05: the width went to the kernels as it was, which refuse a width not a
    multiple of 8 when XLA instantiates the call; unsupported() checks cfg.hidden, x's width)."""
    lower_cuda_here(monkeypatch, stub_extension=False)
    cfg = make_cfg(num_experts=E, num_topk=K, hidden=H, max_tokens_per_rank=T, backend="cuda")
    calls = _backward_calls(cfg, weighted=weighted, width=13)
    backward = "jax_ep_combine_bwd" if weighted else "jax_ep_broadcast"
    assert set(calls) == {"jax_ep_combine", backward}, calls
    capacity = cfg.resolved_capacity(2)
    for name, lines in calls.items():
        [line] = lines
        assert "hidden = 16 " in line and "row_bytes = 32 " in line and "x13x" not in line, (name, line)
    assert f"(tensor<{capacity}x16xbf16>" in calls["jax_ep_combine"][0]


def test_cuda_combine_backward_is_one_fused_call(monkeypatch):
    """backend='cuda': combine's backward is one jax_ep_combine_bwd call (g, y, the handle; results
    d y [C, H] of y's dtype and d row_weights [C] float32) with broadcast's knobs, no broadcast;
    'auto' where the table does not take combine_bwd's kernel runs the whole reference backward: no
    broadcast kernel even where the table takes that one (here faked as measured faster), since XLA
    fuses the reference's broadcast into the rows' products."""
    from jax_ep import auto_table

    lower_cuda_here(monkeypatch, stub_extension=True)
    cfg = make_cfg(num_experts=E, num_topk=K, hidden=H, max_tokens_per_rank=T, backend="cuda")
    calls = _backward_calls(cfg)
    assert set(calls) == {"jax_ep_combine", "jax_ep_combine_bwd"}, calls
    [line] = calls["jax_ep_combine_bwd"]
    capacity = cfg.resolved_capacity(2)
    assert f"capacity = {capacity} " in line and f"send_warps = {cfg.kernel.broadcast_send_warps} " in line
    assert f"-> (tensor<{capacity}x{H}xbf16>, tensor<{capacity}xf32>)" in line, line
    assert "output_operand_aliases" not in line, line
    # empty_rows_zero: d y is written into y's buffer (operand 1 aliased to result 0; the kernel sees
    # one buffer and works in place), the attributes as without it
    [aliased] = _backward_calls(cfg, empty_rows_zero=True)["jax_ep_combine_bwd"]
    attributes = [text.split("mhlo.backend_config")[1].split("}")[0] for text in (line, aliased)]
    assert attributes[0] == attributes[1], attributes
    assert "output_operand_aliases = [#stablehlo.output_operand_alias<output_tuple_indices = [0], " \
           "operand_index = 1, operand_tuple_indices = []>]" in aliased, aliased

    # weighted=False: the backward is one jax_ep_broadcast call; with empty_rows_zero it writes into y's
    # buffer (operand 4, `into`, aliased to the result), else `into` is [0, H]
    for in_y in (False, True):
        [line] = _backward_calls(cfg, empty_rows_zero=in_y, weighted=False)["jax_ep_broadcast"]
        assert f"-> tensor<{capacity}x{H}xbf16>" in line, line
        assert (f"tensor<{capacity}x{H}xbf16>, tensor<" if in_y else f"tensor<0x{H}xbf16>") in line, line
        assert ("output_operand_aliases = [#stablehlo.output_operand_alias<output_tuple_indices = [], "
                "operand_index = 4, operand_tuple_indices = []>]" in line) == in_y, line
    assert set(_backward_calls(cfg, weighted=False)) == {"jax_ep_combine", "jax_ep_broadcast"}

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(auto_table, "kernel_faster", lambda op, layout, tokens, ep, *_: op != "combine_bwd")
    assert set(_backward_calls(cfg.replace(backend="auto"))) == {"jax_ep_combine"}
    monkeypatch.setattr(auto_table, "kernel_faster", lambda op, layout, tokens, ep, *_: True)
    assert set(_backward_calls(cfg.replace(backend="auto"))) == {"jax_ep_combine", "jax_ep_combine_bwd"}


# ---- FP8 -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["expert_major", "rank_major"])
def test_inputs_replicated_over_the_ep_axis_get_their_gradient_summed_over_it(layout):
    """x, topk_idx and topk_weights replicated over the EP axis (every rank dispatches the same tokens):
    their gradient is the sum over ranks of the gradients the ranks' copies get passed sharded (before
    2026-12-05 the backward's cotangents came back varying over the axis and JAX refused them)."""
    from helpers import mesh
    from jax.sharding import PartitionSpec as P

    ep_size = 4
    rng = np.random.default_rng(421)
    x, w, idx, expert_w, g = _inputs(rng, ep_size)
    x, w, idx = x[0], w[0], idx[0]
    local = E // ep_size
    expert_w = expert_w.reshape(ep_size, local, H, HO)

    def rank_loss(x, idx, w, ew, g):
        if layout == "expert_major":
            d = jax_ep.dispatch(x, idx, w, CFG)
            y = jax.lax.ragged_dot(d.x, ew, d.group_sizes, precision=jax.lax.Precision.HIGHEST)
            out = jax_ep.combine(y, d.handle, CFG)
        else:
            d = jax_ep.dispatch_rank_major(x, idx, w, CFG)
            per_slot = jnp.einsum("rh,rkho->rko", d.x, ew[jnp.maximum(d.topk_idx, 0)],
                                  precision=jax.lax.Precision.HIGHEST)
            y = jnp.sum(jnp.where(d.topk_idx[..., None] >= 0, d.topk_weights[..., None] * per_slot, 0.0), 1)
            out = jax_ep.combine_rank_major(y, d.handle, CFG)
        return jnp.sum(out * g)[None]

    def total(specs):
        f = jax.shard_map(lambda x, idx, w, ew, g: rank_loss(x, idx, w, ew[0], g[0]), mesh=mesh(ep_size),
                          in_specs=specs, out_specs=P("ep"))
        return jax.jit(jax.grad(lambda x, w, *a: jnp.sum(f(x, a[0], w, *a[1:])), argnums=(0, 1)))

    replicated = total((P(), P(), P(), P("ep"), P("ep")))(x, w, idx, expert_w, g)
    tiled = [np.repeat(a[None], ep_size, 0) for a in (x, w, idx)]
    sharded = total((P("ep"),) * 5)(tiled[0].reshape(-1, H), tiled[1].reshape(-1, K),
                                      tiled[2].reshape(-1, K), expert_w, g)
    for got, want, what in zip(replicated, sharded, ("d x", "d topk_weights"), strict=True):
        want = np.asarray(want).reshape(ep_size, T, -1).sum(0)
        assert np.abs(want).max() > 0
        assert_close_f(np.asarray(got), want, 1e-5, what)


@pytest.mark.parametrize("layout", ["expert_major", "rank_major"])
def test_zero_tokens_per_rank_with_a_rank_mask_differentiate(layout):
    """T = 0 (a supported size) under a rank mask: the gradients come out, empty, instead of JAX refusing
    cotangents typed unlike their primals (zero-size values are constants to JAX)."""
    ep_size = 4
    cfg = CFG   # at most T tokens per rank, none passed
    mask = jnp.asarray([1, 0, 1, 1], jnp.int32)

    def loss(x, w, idx):
        if layout == "expert_major":
            d = jax_ep.dispatch(x, idx, w, cfg, rank_mask=mask)
            out = jax_ep.combine(d.x * 2.0, d.handle, cfg, rank_mask=mask)
        else:
            d = jax_ep.dispatch_rank_major(x, idx, w, cfg, rank_mask=mask)
            y = d.x * jnp.sum(d.topk_weights, axis=1, keepdims=True)
            out = jax_ep.combine_rank_major(y, d.handle, cfg, rank_mask=mask)
        return jnp.sum(out)[None]

    f = per_rank(loss, ep_size, jit=False)
    x = jnp.zeros((ep_size, 0, H), jnp.float32)
    w, idx = jnp.zeros((ep_size, 0, K), jnp.float32), jnp.zeros((ep_size, 0, K), jnp.int32)
    dx, dw = jax.jit(jax.grad(lambda x, w: jnp.sum(f(x, w, idx)), argnums=(0, 1)))(x, w)
    assert dx.shape == (ep_size, 0, H) and dw.shape == (ep_size, 0, K)


def test_fp8_dispatch_backward_not_implemented():
    ep_size = 2
    cfg = make_cfg(num_experts=E, num_topk=K, hidden=128, max_tokens_per_rank=T,
                   dispatch_dtype="float8_e4m3fn")
    rng = np.random.default_rng(380)
    x, idx, w = random_tokens(rng, ep_size, T, cfg)

    def per(x, idx, w):
        d = jax_ep.dispatch(x, idx, w, cfg)
        return jax_ep.dequantize_fp8(d.x, d.scales) * d.row_weights[:, None]

    f = per_rank(per, ep_size, jit=False)
    fwd = np.asarray(jax.jit(f)(x, idx, w))  # the forward pass works
    assert np.isfinite(fwd).all() and (fwd != 0).any()
    with pytest.raises(NotImplementedError, match=r"float8_e4m3fn.*forward-only.*use "
                                                  r"jax_ep.ops.dispatch_straight_through"):
        jax.jit(jax.grad(lambda x: jnp.sum(f(x, idx, w))))(x)
    with pytest.raises(NotImplementedError, match=r"float8_e4m3fn"):
        jax.jit(jax.grad(lambda w: jnp.sum(f(x, idx, w))))(w)


def test_fp8_dispatch_straight_through_takes_the_rows_gradient_as_the_bf16_dispatch():
    """jax_ep.ops.dispatch_straight_through (what the MoE layer's FP8 wire runs): the FP8 dispatch's rows
    dequantised, differentiable. For a loss whose row cotangent does not depend on the rows (linear in
    them), d x is the bf16 dispatch's bit for bit (the same combine of the same row cotangents), d w
    within FP8's rounding of it (its rows are the quantised ones); a bf16 cfg is refused by name."""
    ep_size = 2
    fp8 = make_cfg(num_experts=E, num_topk=K, hidden=128, max_tokens_per_rank=T,
                   dispatch_dtype="float8_e4m3fn")
    bf16 = fp8.replace(dispatch_dtype="bfloat16")
    rng = np.random.default_rng(381)
    x, idx, w = random_tokens(rng, ep_size, T, fp8)
    x = x.astype(jnp.bfloat16)
    c = jnp.cos(jnp.arange(128, dtype=jnp.float32))

    def loss_fp8(x, idx, w):
        d, rows = jax_ep.ops.dispatch_straight_through(x, idx, w, fp8)
        return jnp.sum(rows.astype(jnp.float32) * c * d.row_weights[:, None])[None]

    def loss_bf16(x, idx, w):
        d = jax_ep.dispatch(x, idx, w, bf16)
        return jnp.sum(d.x.astype(jnp.float32) * c * d.row_weights[:, None])[None]

    def grads(loss):
        f = per_rank(loss, ep_size, jit=False)
        return jax.jit(jax.grad(lambda x, w: jnp.sum(f(x, idx, w)), argnums=(0, 1)))(x, w)

    (dx8, dw8), (dx16, dw16) = grads(loss_fp8), grads(loss_bf16)
    assert np.abs(np.asarray(dx8, np.float32)).max() > 0
    np.testing.assert_array_equal(np.asarray(dx8, np.float32), np.asarray(dx16, np.float32))
    np.testing.assert_allclose(np.asarray(dw8), np.asarray(dw16), rtol=0.1, atol=0.1 * np.abs(dw16).max())
    assert not np.array_equal(np.asarray(dw8), np.asarray(dw16))     # really the FP8 rows
    with pytest.raises(ValueError, match="dispatch_straight_through: cfg.dispatch_dtype must be "
                                         "'float8_e4m3fn', got 'bfloat16'"):
        per_rank(lambda x, idx, w: jax_ep.ops.dispatch_straight_through(x, idx, w, bf16)[1], ep_size,
                 jit=False)(x, idx, w)


def test_bf16_rows_cotangent_dtype():
    """The gradient w.r.t. x has x's dtype even when rows travel as bfloat16."""
    ep_size = 2
    cfg = CFG.replace(dispatch_dtype="bfloat16")
    rng = np.random.default_rng(390)
    x, idx, w = random_tokens(rng, ep_size, T, cfg)
    f = per_rank(lambda x, idx, w: jax_ep.dispatch(x, idx, w, cfg).x, ep_size, jit=False)
    dx = np.asarray(jax.jit(jax.grad(lambda x: jnp.sum(f(x, idx, w).astype(jnp.float32))))(x))
    assert dx.dtype == np.float32
    m = model_for(cfg, x, idx, w)
    # each token's gradient = number of rows it has (ones are exact in bf16)
    np.testing.assert_array_equal(dx, np.broadcast_to(m.kept.sum(axis=2)[..., None], dx.shape))
    assert m.ranks[0].rows.dtype == ml_dtypes.bfloat16


@pytest.mark.parametrize("layout", ["expert_major", "rank_major"])
def test_inputs_invariant_over_the_mesh_get_summed_cotangents(layout):
    """x and y replicated over the EP axis (in_specs P()), as one primitive's operands would be: their
    gradient is the sum over the ranks of each rank's, the same as with per-rank copies of them summed
    afterwards (before: the combine's custom_vjp returned a rank-varying d y for an invariant y, which
    JAX refuses: "the manual axis types do not match")."""
    from helpers import mesh as make_mesh
    from jax.sharding import PartitionSpec as P

    ep = 2
    rng = np.random.default_rng(611)
    x = rng.standard_normal((T, H)).astype(np.float32)
    idx = random_routing(rng, ep, T, K, E)
    w = rng.random((ep, T, K)).astype(np.float32)
    ct = rng.standard_normal((ep, T, H)).astype(np.float32)
    rows = ep * T if layout == "rank_major" else CFG.resolved_capacity(ep)
    y = rng.standard_normal((rows, H)).astype(np.float32)
    dispatch, combine = ((jax_ep.dispatch_rank_major, jax_ep.combine_rank_major) if layout == "rank_major"
                         else (jax_ep.dispatch, jax_ep.combine))

    def loss(x, y, idx, w, ct):
        d = dispatch(x, idx, w, CFG)
        return jnp.sum(combine(y + d.x, d.handle, CFG) * ct)

    def per_rank_grads(x, y, idx, w, ct):  # per_rank passes each rank's slice
        return jax.grad(loss, argnums=(0, 1))(x, y, idx, w, ct)

    m = make_mesh(ep)
    def invariant_grads(x, y, idx, w, ct):
        return jax.grad(loss, argnums=(0, 1))(x, y, idx[0], w[0], ct[0])

    invariant = jax.jit(jax.shard_map(invariant_grads, mesh=m, in_specs=(P(), P(), P("ep"), P("ep"), P("ep")),
                                      out_specs=P()))
    got = to_numpy(invariant(x, y, idx, w, ct))
    copies = to_numpy(per_rank(per_rank_grads, ep)(np.stack([x] * ep), np.stack([y] * ep), idx, w, ct))
    for name, g, c in zip(("d x", "d y"), got, copies, strict=True):
        assert_close_f(g, c.sum(0), 1e-5, name)
        assert np.abs(c[0] - c[1]).max() > 0, f"{name}: the ranks' cotangents should differ"
