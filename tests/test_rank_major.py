"""Rank-major mode (issue 12 item 2): dispatch_rank_major / combine_rank_major on 1, 2 and 4 virtual
CPU devices against the NumPy model (tests/numpy_model.py), their gradients against jax.grad of a dense
MoE, jit + shard_map, and the argument checks.

Every test draws its data from a fresh np.random.default_rng(seed).
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
    AXIS,
    STUB_LIMITS,
    assert_bits_equal,
    assert_close_f,
    make_cfg,
    mesh,
    parametrize_slow_tail,
    per_rank,
    random_tokens,
    to_numpy,
)
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import ops, reference

E, K, H, HO, T = 8, 3, 32, 8, 6
BASE = make_cfg(num_experts=E, num_topk=K, hidden=H, max_tokens_per_rank=T)
EP_SIZES = [1, 2, 4]


@functools.cache
def roundtrip_fn(ep_size, cfg, jit=True):
    """(x, idx, w, y) -> (RankMajorDispatched, combine_rank_major(y), combine_rank_major(rows))."""

    def f(x, idx, w, y):
        d = jax_ep.dispatch_rank_major(x, idx, w, cfg)
        back = jax_ep.combine_rank_major(d.x.astype(jnp.float32), d.handle, cfg)
        return d, jax_ep.combine_rank_major(y, d.handle, cfg), back

    return per_rank(f, ep_size, jit=jit)


def model_of(cfg, x, idx, w):
    return nm.dispatch_rank_major(x, idx, w, num_experts=cfg.num_experts, dispatch_dtype=cfg.dispatch_dtype)


def assert_matches(d, model, ep_size):
    n = ep_size * d.handle.is_token_in_rank.shape[1]
    assert d.x.shape[1] == n
    for r, m in enumerate(model):
        assert_bits_equal(d.x[r], m.rows, f"rank {r} rows")
        if m.scales is None:
            assert d.scales is None
        else:
            assert_bits_equal(d.scales[r], m.scales, f"rank {r} scales")
        assert_bits_equal(d.topk_idx[r], m.topk_idx, f"rank {r} topk_idx")
        assert_bits_equal(d.topk_weights[r], m.topk_weights, f"rank {r} topk_weights")
        assert_bits_equal(d.num_tokens_per_rank[r], m.num_tokens_per_rank, f"rank {r} num_tokens_per_rank")
        assert_bits_equal(d.num_tokens_per_expert[r], m.num_tokens_per_expert,
                          f"rank {r} num_tokens_per_expert")
        assert_bits_equal(d.handle.src_index[r], m.src, f"rank {r} handle.src_index")
        assert_bits_equal(d.handle.is_token_in_rank[r], m.is_token_in_rank, f"rank {r} is_token_in_rank")


def rank_order_sum(y, model, dtype):
    """The documented combine, bit for bit: per token, float32 sum in rank order (+0.0 for a rank the
    token did not go to), rounded once to dtype."""
    ep_size = len(model)
    tokens = y.shape[1] // ep_size
    parts = np.zeros((ep_size, ep_size, tokens, y.shape[2]), np.float32)  # [dest, src, t, h]
    for d, m in enumerate(model):
        for row, n in enumerate(m.src):
            if n >= 0:
                parts[d, n // tokens, n % tokens] = y[d, row].astype(np.float32)
    total = parts[0]
    for d in range(1, ep_size):
        total = (total + parts[d]).astype(np.float32)
    return total.astype(dtype)


def poison_empty_rows(y, model):
    y = y.copy()
    for d, m in enumerate(model):
        y[d, m.src < 0] = np.nan
    return y


@parametrize_slow_tail("dispatch_dtype", [None, "bfloat16"])
@parametrize_slow_tail("ep_size", EP_SIZES, fast=(1,))
def test_random_routing(ep_size, dispatch_dtype):
    cfg = BASE.replace(dispatch_dtype=dispatch_dtype)
    rng = np.random.default_rng(300 + ep_size + (dispatch_dtype is None))
    saw = {"unused": False, "out_of_range": False, "repeat": False, "empty_rows": False}
    for y_dtype in (np.float32, ml_dtypes.bfloat16, np.float32):
        x, idx, w = random_tokens(rng, ep_size, T, cfg)
        model = model_of(cfg, x, idx, w)
        y = rng.standard_normal((ep_size, ep_size * T, HO)).astype(y_dtype)
        y = poison_empty_rows(y, model)
        d, c, back = to_numpy(roundtrip_fn(ep_size, cfg)(x, idx, w, y))
        assert_matches(d, model, ep_size)
        # combine: the documented sum, bit for bit; the poisoned empty rows never reach it
        assert c.dtype == y.dtype and c.shape == (ep_size, T, HO)
        assert_bits_equal(c, rank_order_sum(y, model, y.dtype), "combine_rank_major")
        assert_close_f(c, nm.combine_rank_major(y, model), 1e-2 if y_dtype != np.float32 else 1e-6)
        # the round trip: each token times the number of ranks it went to
        ranks_hit = np.stack([m.is_token_in_rank.sum(axis=1) for m in model]).astype(np.float32)
        sent = np.stack([nm.payload_of(x[r], dispatch_dtype)[0] for r in range(ep_size)]).astype(np.float32)
        assert_close_f(back, sent * ranks_hit[..., None], 1e-6, "round trip")
        san = nm.sanitize(idx, E)
        saw["unused"] |= bool((idx == -1).any())
        saw["out_of_range"] |= bool(((idx >= E) | (idx < -1)).any())
        saw["repeat"] |= bool(((san == -1) & (idx >= 0) & (idx < E)).any())
        saw["empty_rows"] |= bool((d.handle.src_index < 0).any())
        # every valid (token, slot) appears in exactly one row, with its weight
        assert (d.topk_idx >= 0).sum() == (san >= 0).sum()
        assert d.num_tokens_per_expert.sum() == (san >= 0).sum()
    if ep_size == 1:  # every token usually keeps a valid slot: empty rows come from test_patterns
        saw.pop("empty_rows")
    assert all(saw.values()), saw


@pytest.mark.parametrize("ep_size", [2, 4])
def test_fp8(ep_size):
    cfg = BASE.replace(hidden=256, dispatch_dtype="float8_e4m3fn")
    rng = np.random.default_rng(40 + ep_size)
    x, idx, w = random_tokens(rng, ep_size, T, cfg)
    y = rng.standard_normal((ep_size, ep_size * T, HO)).astype(np.float32)
    d, _, _ = to_numpy(roundtrip_fn(ep_size, cfg)(x, idx, w, y))
    assert d.x.dtype == ml_dtypes.float8_e4m3fn and d.scales.shape == (ep_size, ep_size * T, 2)
    assert_matches(d, model_of(cfg, x, idx, w), ep_size)


@pytest.mark.parametrize("ep_size", [2, 4])
def test_patterns(ep_size):
    """All unused, all out of range, every token on one rank, the same expert in every slot."""
    rng = np.random.default_rng(50 + ep_size)
    x, _, w = random_tokens(rng, ep_size, T, BASE)
    local = E // ep_size
    patterns = [np.full((ep_size, T, K), -1), np.full((ep_size, T, K), E + 5), np.full((ep_size, T, K), 3),
                np.broadcast_to((ep_size - 1) * local + np.arange(K) % local, (ep_size, T, K))]
    for idx in patterns:
        idx = np.ascontiguousarray(idx, np.int32)
        model = model_of(BASE, x, idx, w)
        y = poison_empty_rows(rng.standard_normal((ep_size, ep_size * T, HO)).astype(np.float32), model)
        d, c, _ = to_numpy(roundtrip_fn(ep_size, BASE)(x, idx, w, y))
        assert_matches(d, model, ep_size)
        assert_bits_equal(c, rank_order_sum(y, model, np.float32), "combine_rank_major")


@pytest.mark.slow
def test_without_jit_and_fewer_tokens():
    """Eager shard_map, and T below max_tokens_per_rank (the buffer has R*T rows for this call's T)."""
    ep_size, tokens = 2, 4
    rng = np.random.default_rng(9)
    x, idx, w = random_tokens(rng, ep_size, tokens, BASE)
    model = model_of(BASE, x, idx, w)
    y = poison_empty_rows(rng.standard_normal((ep_size, ep_size * tokens, HO)).astype(np.float32), model)
    d, c, _ = to_numpy(roundtrip_fn(ep_size, BASE, jit=False)(x, idx, w, y))
    assert d.x.shape == (ep_size, ep_size * tokens, H)
    assert_matches(d, model, ep_size)
    assert_bits_equal(c, rank_order_sum(y, model, np.float32), "combine_rank_major")


# ---- gradients ------------------------------------------------------------------------------------
def _expert_kernel(rows, ids, weights, expert_w):
    """What a user's rank-major expert kernel computes: y_row = sum_k w_k * rows @ W_local[id_k]."""
    local = expert_w.shape[0]
    coef = jnp.sum(jax.nn.one_hot(ids, local, dtype=jnp.float32) * weights[..., None], axis=1)  # [N, E_l]
    per_expert = jnp.einsum("nh,eho->neo", rows, expert_w, precision=jax.lax.Precision.HIGHEST)
    return jnp.sum(per_expert * coef[..., None], axis=1)


@functools.cache
def moe_grad_fn(ep_size, cfg):
    def f(x, idx, w, expert_w):
        d = jax_ep.dispatch_rank_major(x, idx, w, cfg)
        y = _expert_kernel(d.x, d.topk_idx, d.topk_weights, expert_w)
        return jax_ep.combine_rank_major(y, d.handle, cfg)

    fn = per_rank(f, ep_size, jit=False)

    def loss(x, w, expert_w, idx, g):
        return jnp.sum(fn(x, idx, w, expert_w) * g)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


@jax.jit
def dense_grad(x, w, expert_w, idx, g):
    """jax.grad of the dense MoE (no EP): out[r, t] = sum_k [idx valid] w * x[r, t] @ W[idx]."""
    mask = idx >= 0
    def loss(x, w, expert_w):
        per_slot = jnp.einsum("rth,rtkho->rtko", x, expert_w[jnp.maximum(idx, 0)],
                              precision=jax.lax.Precision.HIGHEST)
        return jnp.sum(jnp.sum(per_slot * (w * mask)[..., None], axis=2) * g)
    return jax.grad(loss, argnums=(0, 1, 2))(x, w, expert_w)


@parametrize_slow_tail("ep_size", EP_SIZES, fast=(1,))
def test_gradients_vs_dense(ep_size):
    rng = np.random.default_rng(600 + ep_size)
    for _ in range(2):
        x, idx, w = random_tokens(rng, ep_size, T, BASE)
        expert_w = (rng.standard_normal((E, H, HO)) / np.sqrt(H)).astype(np.float32)
        g = rng.standard_normal((ep_size, T, HO)).astype(np.float32)
        sharded_w = expert_w.reshape(ep_size, E // ep_size, H, HO)
        dx, dw, dew = to_numpy(moe_grad_fn(ep_size, BASE)(x, w, sharded_w, idx, g))
        san = nm.sanitize(idx, E).astype(np.int32)
        want = to_numpy(dense_grad(x, w, expert_w, san, g))
        assert_close_f(dx, want[0], 1e-5, "d x")
        assert_close_f(dw, want[1], 1e-5, "d topk_weights")
        assert (dw[san < 0] == 0).all()
        assert_close_f(dew.reshape(E, H, HO), want[2], 1e-5, "d expert weights")


@functools.cache
def vjp_fn(ep_size, cfg):
    """The VJPs of dispatch_rank_major (rows and weights) and of combine_rank_major alone."""

    def f(x, idx, w, ct_rows, ct_w, g):
        def pulled(x, w):  # its gradient is the VJP of dispatch_rank_major at (ct_rows, ct_w)
            d = jax_ep.dispatch_rank_major(x, idx, w, cfg)
            return jnp.sum(d.x * ct_rows) + jnp.sum(d.topk_weights * ct_w)

        dx, dw = jax.grad(pulled, argnums=(0, 1))(x, w)
        handle = jax_ep.dispatch_rank_major(x, idx, w, cfg).handle
        y = ct_rows[:, :g.shape[1]] * 0  # per-rank expert outputs (varying over the EP axis)
        dy = jax.grad(lambda y: jnp.sum(jax_ep.combine_rank_major(y, handle, cfg) * g))(y)
        return dx, dw, dy

    return per_rank(f, ep_size)


@pytest.mark.parametrize("ep_size", [2, 4])
def test_vjps_against_model(ep_size):
    """d dispatch = combine of the row cotangents (NaN in empty rows and in slots of other ranks
    ignored) and the weight cotangents back to their slots; d combine = the token's cotangent on each
    of its rows, zero on empty rows."""
    rng = np.random.default_rng(700 + ep_size)
    x, idx, w = random_tokens(rng, ep_size, T, BASE)
    model = model_of(BASE, x, idx, w)
    n = ep_size * T
    ct_rows = poison_empty_rows(rng.standard_normal((ep_size, n, H)).astype(np.float32), model)
    ct_w = rng.standard_normal((ep_size, n, K)).astype(np.float32)
    for d, m in enumerate(model):
        ct_w[d][m.topk_idx < 0] = np.nan
    g = rng.standard_normal((ep_size, T, HO)).astype(np.float32)
    dx, dw, dy = to_numpy(vjp_fn(ep_size, BASE)(x, idx, w, ct_rows, ct_w, g))
    assert_close_f(dx, nm.combine_rank_major(ct_rows, model), 1e-6, "d x")
    want_dw = np.zeros((ep_size, T, K), np.float32)
    for d, m in enumerate(model):
        for row, src in enumerate(m.src):
            for k in range(K):
                if m.topk_idx[row, k] >= 0:
                    want_dw[src // T, src % T, k] = ct_w[d, row, k]
    assert_bits_equal(dw, want_dw, "d topk_weights")
    want_dy = np.zeros((ep_size, n, HO), np.float32)
    for d, m in enumerate(model):
        for row, src in enumerate(m.src):
            if src >= 0:
                want_dy[d, row] = g[src // T, src % T]
    assert_bits_equal(dy, want_dy, "d y")


@pytest.mark.slow
def test_fp8_is_forward_only():
    cfg = BASE.replace(hidden=128, dispatch_dtype="float8_e4m3fn")
    rng = np.random.default_rng(3)
    x, idx, w = random_tokens(rng, 2, T, cfg)

    def f(x, w):
        d = jax_ep.dispatch_rank_major(x, idx[0], w, cfg)
        return jnp.sum(d.topk_weights)

    fn = jax.shard_map(lambda x, w: jax.grad(f, argnums=(0, 1))(x[0], w[0]), mesh=mesh(2),
                       in_specs=(P(AXIS), P(AXIS)), out_specs=P(AXIS))
    with pytest.raises(NotImplementedError, match="forward-only"):
        fn(x, w)


# ---- backends and argument checks ----------------------------------------------------------------
def test_backends():
    """The rank-major ops have CUDA kernels (cuda_backend, same names); 'auto' takes them where the auto
    table's measured rank_major rows say so (both EP sizes measured), and the reference without a GPU."""
    from jax_ep import auto_table, cuda_backend

    for name in ("dispatch_rank_major", "combine_rank_major", "broadcast_rank_major"):
        op = ops.OPS[name]
        assert op.layout == "rank_major"
        assert callable(getattr(cuda_backend, name))
        assert set(auto_table.table()["ops"][name]["rank_major"]["min_tokens"]) == {"1", "2"}
        for tokens in (128, 4096):
            cfg = BASE.replace(backend="auto", max_tokens_per_rank=tokens)
            for dtype in ("bfloat16", "float8_e4m3fn"):   # decided per wire dtype
                wire = cfg.replace(hidden=128, dispatch_dtype=dtype)
                assert op.kernel_by_default(wire, 2) == auto_table.kernel_faster(
                    name, "rank_major", tokens, 2, dtype)
        assert op.implementation(BASE.replace(backend="auto"), 2) is getattr(reference, name)
        assert op.implementation(BASE.replace(backend="reference"), 2) is getattr(reference, name)


def test_cuda_backend_lowers_to_the_rank_major_targets(monkeypatch):
    """The CUDA functions trace on any machine (the FFI calls are only compiled on GPUs): each op is
    one custom call of its own target, combine / broadcast with one row per (token, rank) (num_topk 1)
    and a second result (the slot -> row table), capacity R*T for dispatch and broadcast."""
    from jax_ep import cuda_backend, runtime

    monkeypatch.setattr(runtime, "reserve", lambda n: None)
    monkeypatch.setattr(runtime, "register_targets", lambda: None)
    monkeypatch.setattr(runtime, "limits", lambda: dict(STUB_LIMITS))
    cfg = BASE.replace(backend="cuda", expert_alignment=8)

    def body(x, i, w, y, g):
        d = cuda_backend.dispatch_rank_major(x, i, w, cfg)
        return d, cuda_backend.combine_rank_major(y, d.handle, cfg), cuda_backend.broadcast_rank_major(
            g, d.handle, cfg)

    rng = np.random.default_rng(3)
    x, idx, w = random_tokens(rng, 2, T, BASE)
    y = jnp.zeros((2, 2 * T, HO), jnp.bfloat16)  # [R, ...] global arrays
    g = jnp.zeros((2, T, HO), jnp.float32)
    text = per_rank(body, 2).lower(x, idx, w, y, g).as_text()
    calls = {line.split("@")[1].split("(")[0]: line for line in text.splitlines()
             if "stablehlo.custom_call @jax_ep" in line}
    assert set(calls) == {"jax_ep_dispatch_rank_major", "jax_ep_combine_rank_major",
                          "jax_ep_broadcast_rank_major"}, calls
    assert "%" in calls["jax_ep_dispatch_rank_major"].split("=")[0] and ":8 =" in calls[
        "jax_ep_dispatch_rank_major"], "dispatch_rank_major has 8 results"
    for name in ("jax_ep_combine_rank_major", "jax_ep_broadcast_rank_major"):
        assert ":2 =" in calls[name] and "num_topk = 1 " in calls[name], calls[name]
    assert f"capacity = {2 * T} " in calls["jax_ep_dispatch_rank_major"]
    assert "alignment = 0 " in calls["jax_ep_dispatch_rank_major"]  # no expert segments here
    assert f"capacity = {2 * T} " in calls["jax_ep_broadcast_rank_major"]


def _combine_error(make_args, match, ep_size=2):
    rng = np.random.default_rng(2)
    x, idx, w = random_tokens(rng, ep_size, T, BASE)

    def f(x, i, w):
        d = jax_ep.dispatch_rank_major(x, i, w, BASE)
        y, handle = make_args(d, x, i, w)
        return jax_ep.combine_rank_major(y, handle, BASE)

    with pytest.raises(ValueError, match=match):
        per_rank(f, ep_size)(x, idx, w)


def test_combine_argument_errors():
    _combine_error(lambda d, x, i, w: (d.x[:-1], d.handle), r"y must have shape \[12, hidden\]")
    _combine_error(lambda d, x, i, w: (d.x.astype(jnp.float8_e4m3fn), d.handle), "y must be float32")
    _combine_error(lambda d, x, i, w: (d.x.astype(jnp.int32), d.handle), "y must be float32")
    _combine_error(lambda d, x, i, w: (jax_ep.dispatch(x, i, w, BASE).x[:12], jax_ep.dispatch(x, i, w, BASE)
                                       .handle), "must be the RankMajorHandle of dispatch_rank_major")
    _combine_error(lambda d, x, i, w: (d.x, d.handle._replace(src_index=d.handle.src_index[:-1])),
                   r"handle.src_index must be int32 \[12\]")


def test_dispatch_argument_errors():
    rng = np.random.default_rng(4)
    x, idx, w = random_tokens(rng, 2, T, BASE)
    cases = [
        (lambda x, i, w: (x[:, :-1], i, w), "dispatch_rank_major: x has hidden size 31"),
        (lambda x, i, w: (x, i.astype(jnp.int16), w), "dispatch_rank_major: topk_idx must be int32"),
        (lambda x, i, w: (x, i, w[:, :2]), r"dispatch_rank_major: topk_weights must have shape \(6, 3\)"),
    ]
    for change, match in cases:
        fn = per_rank(lambda x, i, w, change=change: jax_ep.dispatch_rank_major(*change(x, i, w), BASE), 2)
        with pytest.raises(ValueError, match=match):
            fn(x, idx, w)
    with pytest.raises(ValueError, match="must run inside shard_map"):
        jax_ep.dispatch_rank_major(x[0], idx[0], w[0], BASE)


def test_checked_mode_rejects_bad_ids():
    cfg = BASE.replace(checked=True)
    rng = np.random.default_rng(5)
    x, _, w = random_tokens(rng, 2, T, cfg)
    idx = np.zeros((2, T, K), np.int32) + np.arange(K, dtype=np.int32)
    idx[1, 2, 1] = 99
    fn = per_rank(lambda x, i, w: jax_ep.dispatch_rank_major(x, i, w, cfg).x, 2)
    with pytest.raises(jax_ep.EPValueError, match=r"dispatch_rank_major: topk_idx has 1 ids outside"):
        jax_ep.run_checked(fn, x, idx, w)


@pytest.mark.parametrize("dispatch_dtype", [None, "float8_e4m3fn"])
def test_output_types(dispatch_dtype):
    """The results have the types that jax_ep.types declares (the backends' contract), T = 0 too."""
    from jax_ep import types

    cfg = BASE.replace(hidden=128, dispatch_dtype=dispatch_dtype)
    ep_size = 2
    for tokens in (T, 0):
        rng = np.random.default_rng(tokens)
        if tokens:
            x, idx, w = random_tokens(rng, ep_size, tokens, cfg)
        else:
            x, idx, w = (np.zeros((ep_size, 0, cfg.hidden), np.float32), np.zeros((ep_size, 0, K), np.int32),
                         np.zeros((ep_size, 0, K), np.float32))
        y = rng.standard_normal((ep_size, ep_size * tokens, HO)).astype(np.float32)
        d, c, _ = to_numpy(roundtrip_fn(ep_size, cfg)(x, idx, w, y))
        want = types.rank_major_dispatch_types(tokens, np.float32, cfg, ep_size)
        got = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), d)
        assert got == want
        assert c.shape[1:] == types.rank_major_combine_types(y[0], want.handle).shape
        if tokens == 0:
            assert c.shape == (ep_size, 0, HO) and (d.num_tokens_per_rank == 0).all()
