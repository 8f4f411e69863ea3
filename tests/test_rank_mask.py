"""Rank masking on the reference path (issue 15 item 1): ``dispatch(..., rank_mask=)`` and
``combine(..., rank_mask=)``.

A masked rank is masked as a destination: it receives no rows, every (token, expert) pair routed to
it is dropped (its num_dropped, DROPPED in its handle), the sources ignore what it returns, and the
gradients of the masked slots are zero. Checked against the unmasked run (active ranks' results
unchanged, combine = the unmasked combine with the masked ranks' outputs zeroed), against jax.grad
of a dense MoE without the masked experts, and all-active = no mask, bit for bit. backend='cuda'
(the kernels leave a masked rank out of the call both ways): the mask reaches the forward and
backward custom calls as an int32 [R] operand (lowering test); the kernels themselves are checked on
the emulator (tests/test_kernel_emulator.py) and on GPUs (tests/gpu/test_rank_mask_gpu.py).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_bits_equal, make_cfg, per_rank, random_routing, random_tokens, to_numpy

import jax_ep
from jax_ep import ops, reference
from jax_ep.types import DROPPED

E, K, H, HO, T = 8, 3, 16, 8, 6


def _cfg(**kw):
    kw.setdefault("backend", "reference")
    return make_cfg(num_experts=E, num_topk=K, hidden=H, max_tokens_per_rank=T, **kw)


def _assert_tree_bits_equal(got, want, what):
    got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got_leaves) == len(want_leaves), what
    for i, (a, b) in enumerate(zip(got_leaves, want_leaves, strict=True)):
        assert_bits_equal(np.asarray(a), np.asarray(b), f"{what} leaf {i}")


def _tiled(mask, ep_size):
    """The same [R] mask on every rank (per_rank splits a leading rank axis)."""
    return np.broadcast_to(np.asarray(mask), (ep_size, ep_size)).copy()


@functools.cache
def _dispatch_fn(ep_size, cfg, masked):
    if masked:
        return per_rank(lambda x, i, w, m: jax_ep.dispatch(x, i, w, cfg, rank_mask=m), ep_size)
    return per_rank(lambda x, i, w: jax_ep.dispatch(x, i, w, cfg), ep_size)


def _routed_pairs(idx, ep_size):
    """Per destination rank, the valid (token, expert) pairs routed to it (sanitised ids)."""
    clean = np.asarray(reference.sanitize_topk(jnp.asarray(idx.reshape(-1, K)), E))
    ranks = clean[clean >= 0] // (E // ep_size)
    return np.bincount(ranks, minlength=ep_size)


MASKS = [(2, (False, True)), (4, (True, False, True, True)), (4, (False, True, False, True)),
         (4, (True, True, True, False))]


@pytest.mark.parametrize("ep_size,mask", MASKS)
def test_masked_rank_receives_nothing_and_counts_drops(ep_size, mask):
    rng = np.random.default_rng(100 + ep_size + sum(mask))
    cfg = _cfg()
    x, idx, w = random_tokens(rng, ep_size, T, cfg)
    m = np.asarray(mask)
    got = to_numpy(_dispatch_fn(ep_size, cfg, True)(x, idx, w, _tiled(m, ep_size)))
    ref = to_numpy(_dispatch_fn(ep_size, cfg, False)(x, idx, w))
    routed = _routed_pairs(idx, ep_size)
    for r in range(ep_size):
        if m[r]:  # an active rank: same bits as without the mask
            for name in ("x", "group_sizes", "expert_counts", "num_dropped"):
                assert_bits_equal(getattr(got, name)[r], getattr(ref, name)[r], f"{name} rank {r}")
            for name, a in got.handle._asdict().items():
                if name != "is_token_in_rank":
                    assert_bits_equal(a[r], getattr(ref.handle, name)[r], f"handle.{name} rank {r}")
        else:  # a masked rank: no rows, everything routed to it dropped
            assert not np.any(got.x[r]), f"rank {r} is masked but received rows"
            assert not np.any(got.group_sizes[r]) and not np.any(got.expert_counts[r])
            assert np.all(got.handle.src_index[r] < 0)
            assert not np.any(got.handle.row_weights[r])
            assert int(got.num_dropped[r]) == routed[r]
            was_routed = ref.handle.token_rows[r] >= 0
            assert np.all(got.handle.token_rows[r][was_routed] == DROPPED)
            assert np.all(got.handle.token_rows[r][~was_routed] == ref.handle.token_rows[r][~was_routed])
    # source side (layout): unchanged
    assert_bits_equal(got.handle.is_token_in_rank, ref.handle.is_token_in_rank, "is_token_in_rank")
    # kept + dropped = routed, over the group
    assert int(got.expert_counts.sum() + got.num_dropped.sum()) == routed.sum()
    assert int(got.num_dropped.sum()) == routed[~m].sum() + int(ref.num_dropped[m].sum())


@functools.cache
def _moe_fns(ep_size, cfg):
    def body(x, i, w, ew, m, masked_combine):
        d = jax_ep.dispatch(x, i, w, cfg, rank_mask=m)
        y = jax.lax.ragged_dot(d.x, ew, d.group_sizes, precision=jax.lax.Precision.HIGHEST)
        return jax_ep.combine(y, d.handle, cfg, rank_mask=m if masked_combine else None)

    def zeroed(x, i, w, ew, m):  # the unmasked run with the masked ranks' expert outputs zeroed
        d = jax_ep.dispatch(x, i, w, cfg)
        y = jax.lax.ragged_dot(d.x, ew, d.group_sizes, precision=jax.lax.Precision.HIGHEST)
        y = jnp.where(m[jax.lax.axis_index("ep")], y, 0.0)
        return jax_ep.combine(y, d.handle, cfg)

    return (per_rank(functools.partial(body, masked_combine=True), ep_size),
            per_rank(functools.partial(body, masked_combine=False), ep_size), per_rank(zeroed, ep_size))


def _expert_weights(rng, ep_size):
    return rng.standard_normal((ep_size, E // ep_size, H, HO)).astype(np.float32)


@pytest.mark.parametrize("ep_size,mask", MASKS)
def test_combine_excludes_masked_ranks(ep_size, mask):
    rng = np.random.default_rng(200 + ep_size + sum(mask))
    cfg = _cfg()
    x, idx, w = random_tokens(rng, ep_size, T, cfg)
    ew, m = _expert_weights(rng, ep_size), _tiled(mask, ep_size)
    masked, handle_only, zeroed = _moe_fns(ep_size, cfg)
    want = to_numpy(zeroed(x, idx, w, ew, m))
    assert_bits_equal(to_numpy(masked(x, idx, w, ew, m)), want, "combine with rank_mask")
    # the handle of a masked dispatch alone already excludes them (their slots are DROPPED)
    assert_bits_equal(to_numpy(handle_only(x, idx, w, ew, m)), want, "combine without rank_mask")


def test_combine_mask_ignores_what_masked_ranks_return():
    """combine's rank_mask: the sources ignore masked ranks' rows even when their handle holds rows
    (an unmasked dispatch), and the backward gives those rows a zero gradient."""
    ep_size, mask = 4, (True, False, True, False)
    rng = np.random.default_rng(7)
    cfg = _cfg()
    x, idx, w = random_tokens(rng, ep_size, T, cfg)
    ew, m = _expert_weights(rng, ep_size), _tiled(mask, ep_size)

    def f(x, i, w, ew, m, masked):
        d = jax_ep.dispatch(x, i, w, cfg)
        y = jax.lax.ragged_dot(d.x, ew, d.group_sizes, precision=jax.lax.Precision.HIGHEST)
        if masked:
            return jax_ep.combine(y, d.handle, cfg, rank_mask=m)
        return jax_ep.combine(jnp.where(m[jax.lax.axis_index("ep")], y, 0.0), d.handle, cfg)

    def loss(masked, ew):
        out = per_rank(functools.partial(f, masked=masked), ep_size, jit=False)(x, idx, w, ew, m)
        return jnp.sum(out * g)

    g = rng.standard_normal((ep_size, T, HO)).astype(np.float32)
    got_v, got_g = jax.jit(jax.value_and_grad(functools.partial(loss, True)))(ew)
    want_v, want_g = jax.jit(jax.value_and_grad(functools.partial(loss, False)))(ew)
    np.testing.assert_array_equal(np.asarray(got_v), np.asarray(want_v))
    assert_bits_equal(np.asarray(got_g), np.asarray(want_g), "d expert weights")
    assert not np.any(np.asarray(got_g)[~np.asarray(mask)])


def _dense_moe(x, idx, w, ew_all, active, ep_size):
    """No EP: out[t] = sum over valid slots of active experts of w * (x[t] @ W[e])."""
    clean = reference.sanitize_topk(idx, E)
    keep = (clean >= 0) & active[jnp.maximum(clean, 0) // (E // ep_size)]
    per_expert = jnp.einsum("th,eho->teo", x, ew_all, precision=jax.lax.Precision.HIGHEST)
    picked = jnp.take_along_axis(per_expert, jnp.maximum(clean, 0)[:, :, None], axis=1)
    return jnp.sum(jnp.where(keep[:, :, None], w[:, :, None] * picked, 0.0), axis=1)


@pytest.mark.parametrize("ep_size,mask", MASKS)
def test_gradients_match_dense_moe_without_masked_experts(ep_size, mask):
    rng = np.random.default_rng(300 + ep_size + sum(mask))
    cfg = _cfg()
    x, idx, w = random_tokens(rng, ep_size, T, cfg)
    ew, m = _expert_weights(rng, ep_size), _tiled(mask, ep_size)
    g = rng.standard_normal((ep_size, T, HO)).astype(np.float32)
    fn = per_rank(lambda x, i, w, ew, m: _moe_per_rank(cfg)(x, i, w, ew, m), ep_size, jit=False)

    def ep_loss(x, w, ew):
        return jnp.sum(fn(x, idx, w, ew, m) * g)

    def dense_loss(x, w, ew):
        out = _dense_moe(x.reshape(-1, H), jnp.asarray(idx).reshape(-1, K), w.reshape(-1, K),
                         ew.reshape(E, H, HO), jnp.asarray(mask), ep_size)
        return jnp.sum(out.reshape(ep_size, T, HO) * g)

    got = jax.jit(jax.value_and_grad(ep_loss, argnums=(0, 1, 2)))(x, w, ew)
    want = jax.jit(jax.value_and_grad(dense_loss, argnums=(0, 1, 2)))(x, w, ew)
    for name, a, b in zip(("loss", "dx", "dw", "d expert weights"), jax.tree.leaves(got),
                          jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5, err_msg=name)
    dw = np.asarray(got[1][1]).reshape(-1, K)
    clean = np.asarray(reference.sanitize_topk(jnp.asarray(idx.reshape(-1, K)), E))
    on_masked = (clean >= 0) & ~np.asarray(mask)[np.maximum(clean, 0) // (E // ep_size)]
    assert not np.any(dw[on_masked]), "a masked slot's gate weight got a gradient"
    assert not np.any(np.asarray(got[1][2])[~np.asarray(mask)]), "a masked rank's experts got a gradient"


def _moe_per_rank(cfg):
    def f(x, i, w, ew, m):
        d = jax_ep.dispatch(x, i, w, cfg, rank_mask=m)
        y = jax.lax.ragged_dot(d.x, ew, d.group_sizes, precision=jax.lax.Precision.HIGHEST)
        return jax_ep.combine(y, d.handle, cfg, rank_mask=m)
    return f


@pytest.mark.parametrize("ep_size", [2, 4])
@pytest.mark.parametrize("mask_dtype", [np.bool_, np.int32])
def test_all_active_mask_is_bit_identical_to_no_mask(ep_size, mask_dtype):
    rng = np.random.default_rng(400 + ep_size)
    cfg = _cfg(capacity=8)  # with capacity drops too
    x, idx, w = random_tokens(rng, ep_size, T, cfg)
    ew = _expert_weights(rng, ep_size)
    m = _tiled(np.ones(ep_size, mask_dtype), ep_size)
    _assert_tree_bits_equal(to_numpy(_dispatch_fn(ep_size, cfg, True)(x, idx, w, m)),
                            to_numpy(_dispatch_fn(ep_size, cfg, False)(x, idx, w)), "dispatch")
    g = rng.standard_normal((ep_size, T, HO)).astype(np.float32)

    def unmasked(x, i, w, ew, m):
        d = jax_ep.dispatch(x, i, w, cfg)
        y = jax.lax.ragged_dot(d.x, ew, d.group_sizes, precision=jax.lax.Precision.HIGHEST)
        return jax_ep.combine(y, d.handle, cfg)

    def grads(f):
        fn = per_rank(f, ep_size, jit=False)
        return jax.jit(jax.value_and_grad(lambda x, w, ew: jnp.sum(fn(x, idx, w, ew, m) * g),
                                          argnums=(0, 1, 2)))(x, w, ew)

    _assert_tree_bits_equal(grads(_moe_per_rank(cfg)), grads(unmasked), "loss and grads")


def test_checked_mode_does_not_count_masked_drops():
    ep_size = 2
    rng = np.random.default_rng(5)
    cfg = _cfg(checked=True)
    x, idx, w = random_tokens(rng, ep_size, T, cfg, routing=functools.partial(
        random_routing, p_out_of_range=0.0))
    out = jax_ep.run_checked(_dispatch_fn(ep_size, cfg, True), x, idx, w, _tiled([True, False], ep_size))
    assert int(np.asarray(out.num_dropped)[1]) == _routed_pairs(idx, ep_size)[1] > 0


@pytest.mark.parametrize("bad,what", [
    (np.ones(3, bool), r"rank_mask must have shape \[2\]"),
    (np.ones((2, 1), bool), r"rank_mask must have shape \[2\]"),
    (np.ones(2, np.float32), r"rank_mask must be bool or integer"),
])
def test_invalid_masks_name_the_argument(bad, what):
    ep_size = 2
    cfg = _cfg()
    rng = np.random.default_rng(0)
    x, idx, w = random_tokens(rng, ep_size, T, cfg)

    def run_dispatch(x, i, w):
        return jax_ep.dispatch(x, i, w, cfg, rank_mask=jnp.asarray(bad))

    with pytest.raises(ValueError, match="dispatch: " + what):
        per_rank(run_dispatch, ep_size)(x, idx, w)

    def run_combine(x, i, w):
        d = jax_ep.dispatch(x, i, w, cfg)
        return jax_ep.combine(d.x, d.handle, cfg, rank_mask=jnp.asarray(bad))

    with pytest.raises(ValueError, match="combine: " + what):
        per_rank(run_combine, ep_size)(x, idx, w)


def test_auto_takes_the_reference_and_cuda_takes_the_mask_kernels():
    """'auto' keeps the reference with a mask (the CUDA path leaves a masked rank's own tokens
    unrouted); 'cuda' runs the mask-taking kernels; ops without a mask operand refuse one."""
    from jax_ep import cuda_backend

    ep_size = 2
    rng = np.random.default_rng(1)
    x, idx, w = random_tokens(rng, ep_size, T, _cfg())
    m = _tiled([True, False], ep_size)
    for name in ops._MASK_KERNELS:
        assert ops.OPS[name].implementation(_cfg(backend="auto"), ep_size, masked=True) is getattr(
            reference, name)
        assert "rank_mask" in inspect.signature(getattr(cuda_backend, name)).parameters
    for name in ("ll_dispatch", "ll_combine", "dispatch_rank_major", "combine_rank_major"):
        with pytest.raises(NotImplementedError, match="takes no rank_mask"):
            ops.OPS[name].implementation(_cfg(backend="cuda"), ep_size, masked=True)
    got = to_numpy(_dispatch_fn(ep_size, _cfg(backend="auto"), True)(x, idx, w, m))
    _assert_tree_bits_equal(got, to_numpy(_dispatch_fn(ep_size, _cfg(), True)(x, idx, w, m)),
                            "auto = reference")


def test_cuda_backend_lowers_the_mask_as_an_operand(monkeypatch):
    """backend='cuda' with a mask traces on any machine (the FFI calls compile on GPUs only): the
    forward and backward custom calls of dispatch and combine (dispatch, combine, broadcast,
    slot_values) each take the mask as an int32 [R] operand (traced: new values, same executable),
    and without a mask an all-ones one."""
    from jax_ep import cuda_backend, runtime

    monkeypatch.setattr(runtime, "available", lambda: (True, ""))
    monkeypatch.setattr(runtime, "reserve", lambda n: None)
    monkeypatch.setattr(runtime, "register_targets", lambda: None)
    monkeypatch.setattr(runtime, "limits", lambda: {
        "max_topk": 32, "layout_max_topk": 64, "max_experts": 8192, "max_ranks": 32, "max_groups": 64,
        "directory_axes": 4, "data_warps": 16, "row_alignment": 8})
    monkeypatch.setattr(cuda_backend, "unsupported", lambda *a: None)
    ep_size = 2
    cfg = _cfg(backend="cuda", dispatch_dtype="bfloat16")

    def loss(x, i, w, m):
        d = jax_ep.dispatch(x, i, w, cfg, rank_mask=m)
        return jnp.sum(jax_ep.combine(d.x, d.handle, cfg, rank_mask=m).astype(jnp.float32) ** 2)

    def body(x, i, w, m):
        return jax.grad(loss, argnums=(0, 2))(x, i, w, m)

    rng = np.random.default_rng(4)
    x, idx, w = random_tokens(rng, ep_size, T, _cfg())
    text = per_rank(body, ep_size).lower(x.astype(jnp.bfloat16), idx, w,
                                         _tiled([True, False], ep_size)).as_text()
    calls = [line for line in text.splitlines() if "stablehlo.custom_call @jax_ep" in line]
    names = sorted(line.split("@")[1].split("(")[0] for line in calls)
    assert names == ["jax_ep_broadcast", "jax_ep_combine", "jax_ep_combine", "jax_ep_dispatch",
                     "jax_ep_slot_values"], names
    for line in calls:  # operands ..., rank_mask, rank, group
        operand_types = line.split(":")[-1].split("->")[0]
        assert operand_types.rstrip(" )").endswith(
            f"tensor<{ep_size}xi32>, tensor<i32>, tensor<i32>"), line


# ---- the MoE layer: set_rank_mask / clear_rank_mask ----------------------------------------------
def _layer(ep_size, seed=0):
    from flax import nnx
    from jax.sharding import Mesh

    from jax_ep.gating import RouterConfig
    from jax_ep.moe import EPOptions, MoE

    mesh = Mesh(np.array(jax.devices()[:ep_size]), ("ep",))
    return MoE(H, 24, RouterConfig(E, 2), rngs=nnx.Rngs(seed), mesh=mesh, ep=EPOptions(backend="auto"))


def _dense_layer(layer, tokens, active):
    """The layer without EP, the slots of experts on masked ranks dropped (routing unchanged)."""
    from jax_ep import gating

    routing = gating.route(tokens @ layer.router[...], layer.routing, layer.expert_bias[...])
    gate, up = jnp.split(jnp.einsum("th,ehf->tef", tokens, layer.w_gate_up[...]), 2, axis=2)
    y = jnp.einsum("tef,efh->teh", jax.nn.silu(gate) * up, layer.w_down[...])
    picked = jnp.take_along_axis(y, routing.topk_idx[:, :, None], axis=1)
    keep = active[routing.topk_idx // (E // active.shape[0])]
    out = jnp.sum(jnp.where(keep[:, :, None], picked * routing.topk_weights[:, :, None], 0.0), axis=1)
    return out, int(np.sum(~np.asarray(keep)))


def test_moe_layer_rank_mask():
    from flax import nnx

    ep_size = 4
    layer = _layer(ep_size)
    x = jnp.asarray(np.random.default_rng(9).standard_normal((8, 4, H)), jnp.float32)
    step = nnx.jit(lambda m, x: m(x))
    plain = np.asarray(step(layer, x))
    assert layer.rank_mask is None

    mask = np.array([True, False, True, False])
    layer.set_rank_mask(mask)
    np.testing.assert_array_equal(np.asarray(layer.rank_mask[...]), mask)
    got = np.asarray(step(layer, x))
    want, dropped = _dense_layer(layer, x.reshape(-1, H), jnp.asarray(mask))
    np.testing.assert_allclose(got.reshape(-1, H), np.asarray(want), rtol=2e-5, atol=2e-5)
    assert int(layer.last_dropped[...]) == dropped > 0
    load = np.asarray(layer.last_load[...]).reshape(ep_size, -1)
    assert not np.any(load[~mask]) and np.all(load.sum() + dropped == x.shape[0] * x.shape[1] * 2)

    # gradients flow (masked experts get none)
    def loss(m, x):
        return jnp.sum(m(x) ** 2)

    grads = nnx.jit(nnx.grad(loss))(layer, x)
    g = np.asarray(grads["w_down"][...]).reshape(ep_size, E // ep_size, -1)
    assert not np.any(g[~mask]) and np.any(g[mask])

    layer.set_rank_mask(np.ones(ep_size, np.int32))  # all active: same bits as no mask
    assert_bits_equal(np.asarray(step(layer, x)), plain, "all-active mask")
    layer.clear_rank_mask()
    assert layer.rank_mask is None
    assert_bits_equal(np.asarray(step(layer, x)), plain, "cleared mask")

    layer.set_rank_mask(mask)
    with pytest.raises(NotImplementedError, match="rank masking .* not for decode"):
        layer(x, decode=True)
    with pytest.raises(ValueError, match="set_rank_mask: mask has 2 flags"):
        layer.set_rank_mask([True, False])
    with pytest.raises(ValueError, match="set_rank_mask: mask must be a 1-D bool or integer"):
        layer.set_rank_mask(np.ones(ep_size, np.float32))
    on_cuda = _layer(2)
    on_cuda.ep = dataclasses.replace(on_cuda.ep, backend="cuda")
    on_cuda.set_rank_mask([True, False])
    if jax.default_backend() != "gpu":  # the mask is no reason to refuse 'cuda' any more
        with pytest.raises(RuntimeError, match="backend='cuda' is unavailable"):
            on_cuda(x)


def test_checkpoint_save_refuses_a_rank_mask(tmp_path):
    import jax_ep.checkpoint as ckpt

    layer = _layer(2)
    layer.set_rank_mask([True, False])
    with pytest.raises(ValueError, match=r"rank mask .*clear_rank_mask\(\) first"):
        ckpt.save(tmp_path / "ckpt", layer)
