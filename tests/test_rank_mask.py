"""Rank masking (issue 15 item 1): ``dispatch(..., rank_mask=)`` and ``combine(..., rank_mask=)``.

A masked rank sends and receives nothing (the CUDA kernels' semantics: a dead rank can be neither
waited for nor written to): its own tokens are not routed, it keeps no rows, and every pair that
goes nowhere counts in its source's num_dropped. Checked on the reference path against the NumPy
model under the same mask (bit for bit, combine in the documented summation order), against the
unmasked dispatch of the same routing without the masked ranks' tokens, against jax.grad of a dense
MoE without the masked ranks' tokens and experts, and all-active = no mask, bit for bit.
backend='cuda': the mask reaches the forward and backward custom calls as an int32 [R] operand
(lowering test); the kernels are checked bit for bit against the reference under masks on the
emulator (tests/test_kernel_emulator.py) and on GPUs (tests/gpu/test_rank_mask_gpu.py).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import numpy_model as nm
import pytest
from helpers import (
    assert_bits_equal,
    assert_dispatch_matches,
    lower_cuda_here,
    make_cfg,
    model_for,
    parametrize_slow_tail,
    per_rank,
    random_routing,
    random_tokens,
    to_numpy,
)

import jax_ep
from jax_ep import auto_table, ops, reference, routing
from jax_ep.types import NOT_ROUTED

E, K, H, HO, T = 8, 3, 16, 8, 6


def _cfg(**kw):
    kw.setdefault("backend", "reference")
    return make_cfg(num_experts=E, num_topk=K, hidden=H, max_tokens_per_rank=T, **kw)


def _without_dispatch_masks(tree):
    """tree with its handles' rank_mask (the dispatch's, kept for the ops of the handle) left out: a
    masked call's handle has it, an unmasked one's not."""
    from jax_ep.types import Handle, RankMajorHandle

    kinds = (Handle, RankMajorHandle)
    return jax.tree.map(lambda h: h._replace(rank_mask=None) if isinstance(h, kinds) else h, tree,
                        is_leaf=lambda h: isinstance(h, kinds))


def _assert_tree_bits_equal(got, want, what):
    got, want = _without_dispatch_masks(got), _without_dispatch_masks(want)
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


def _pairs(idx, ep_size):
    """[R_src, R_dst]: the valid (token, expert) pairs of each source rank to each destination rank."""
    clean = np.asarray(routing.sanitize_topk(jnp.asarray(idx.reshape(-1, K)), E)).reshape(ep_size, -1)
    out = np.zeros((ep_size, ep_size), np.int64)
    for s in range(ep_size):
        out[s] = np.bincount(clean[s][clean[s] >= 0] // (E // ep_size), minlength=ep_size)
    return out


MASKS = [(2, (False, True)), (4, (True, False, True, True)), (4, (False, True, False, True)),
         (4, (True, True, True, False))]


@parametrize_slow_tail("capacity", [None, 6], fast=(1,))
@parametrize_slow_tail("ep_size,mask", MASKS)
def test_masked_dispatch_matches_the_model_and_accounts_for_every_pair(ep_size, mask, capacity):
    rng = np.random.default_rng(100 + ep_size + sum(mask) + (capacity or 0))
    cfg = _cfg(capacity=capacity)
    x, idx, w = random_tokens(rng, ep_size, T, cfg)
    m = np.asarray(mask)
    got = to_numpy(_dispatch_fn(ep_size, cfg, True)(x, idx, w, _tiled(m, ep_size)))
    model = model_for(cfg, x, idx, w, rank_mask=m)
    assert_dispatch_matches(got, model, ep_size)

    pairs = _pairs(idx, ep_size)
    live = np.outer(m, m)  # source and destination active
    capacity_drops = np.array([len(r.dropped) for r in model.ranks])
    for r in range(ep_size):
        # a pair that goes nowhere counts at its source: all of a masked rank's, an active rank's
        # to masked ranks
        nowhere = pairs[r].sum() if not m[r] else pairs[r][~m].sum()
        assert int(got.num_dropped[r]) == capacity_drops[r] + nowhere, f"rank {r} num_dropped"
        if not m[r]:  # a masked rank: no rows, nothing routed here, not even its own tokens
            assert not np.any(got.group_sizes[r]) and not np.any(got.expert_counts[r])
            assert np.all(got.handle.src_index[r] < 0) and not np.any(got.handle.row_weights[r])
            assert np.all(got.handle.token_rows[r] == NOT_ROUTED)
            assert capacity_drops[r] == 0
            # its slots are NOT_ROUTED on every rank
            assert np.all(got.handle.token_rows[:, r * T:(r + 1) * T] == NOT_ROUTED)
    # over the group: kept + dropped = every routed pair (both ends active: kept or capacity-dropped)
    assert int(got.expert_counts.sum() + got.num_dropped.sum()) == pairs.sum()
    assert int(got.expert_counts.sum()) + capacity_drops.sum() == pairs[live].sum()
    # the source side (routing layout) does not depend on the mask
    plain = to_numpy(_dispatch_fn(ep_size, cfg, False)(x, idx, w))
    assert_bits_equal(got.handle.is_token_in_rank, plain.handle.is_token_in_rank, "is_token_in_rank")
    # the active ranks: those of the unmasked dispatch of the routing without the masked ranks' tokens
    quiet = to_numpy(_dispatch_fn(ep_size, cfg, False)(x, np.where(m[:, None, None], idx, -1), w))
    for r in np.flatnonzero(m):
        for name in ("x", "group_sizes", "expert_counts"):
            assert_bits_equal(getattr(got, name)[r], getattr(quiet, name)[r], f"{name} rank {r}")
        for name in ("src_index", "token_rows", "row_weights"):
            assert_bits_equal(getattr(got.handle, name)[r], getattr(quiet.handle, name)[r],
                              f"handle.{name} rank {r}")


def test_masked_pairs_counts_the_pairs_that_go_nowhere():
    """Also with an integer mask of values other than 1 (nonzero = active, as the ops take it; before
    2026-12-05 masked_pairs and reached_topk combined its bits: [2, 0, 6, 0] sent every pair nowhere)."""
    ep_size, mask = 4, (True, False, True, False)
    rng = np.random.default_rng(11)
    cfg = _cfg()
    x, idx, w = random_tokens(rng, ep_size, T, cfg)
    fn = per_rank(lambda i, m: routing.masked_pairs(i, cfg, m)[None], ep_size)
    reached = per_rank(lambda i, m: routing.reached_topk(i, cfg, m), ep_size)
    pairs = _pairs(idx, ep_size)
    m = np.asarray(mask)
    want = [pairs[r].sum() if not m[r] else pairs[r][~m].sum() for r in range(ep_size)]
    want_reached = np.asarray(reached(idx, _tiled(mask, ep_size)))
    for given in (mask, np.array([2, 0, 6, 0], np.int32)):
        got = np.asarray(fn(idx, _tiled(given, ep_size))).reshape(-1)
        np.testing.assert_array_equal(got, want, err_msg=f"mask {given}")
        np.testing.assert_array_equal(np.asarray(reached(idx, _tiled(given, ep_size))), want_reached,
                                      err_msg=f"mask {given}")
    assert min(want) > 0 and (want_reached == -1).sum() >= sum(want)


def _combine_fn(ep_size, cfg, masked_dispatch, masked_combine):
    def body(x, i, w, y, m):
        d = jax_ep.dispatch(x, i, w, cfg, rank_mask=m if masked_dispatch else None)
        return jax_ep.combine(y, d.handle, cfg, rank_mask=m if masked_combine else None)

    return per_rank(body, ep_size)


@parametrize_slow_tail("y_dtype", [np.float32, jnp.bfloat16])
@parametrize_slow_tail("ep_size,mask", MASKS, fast=(1,))
def test_masked_combine_matches_the_model(ep_size, mask, y_dtype):
    """combine under a masked dispatch, with and without combine's mask: the model's summation order
    over the masked handles, bit for bit (a masked rank's tokens come back zero)."""
    rng = np.random.default_rng(200 + ep_size + sum(mask))
    cfg = _cfg(capacity=8)
    x, idx, w = random_tokens(rng, ep_size, T, cfg)
    m = np.asarray(mask)
    C = cfg.resolved_capacity(ep_size)
    y = jnp.asarray(rng.standard_normal((ep_size, C, H)).astype(np.float32)).astype(y_dtype)
    want = nm.combine_exact(np.asarray(y), model_for(cfg, x, idx, w, rank_mask=m))
    for masked_combine in (True, False):
        got = to_numpy(_combine_fn(ep_size, cfg, True, masked_combine)(x, idx, w, y, _tiled(m, ep_size)))
        assert_bits_equal(got, want, f"combine, masked_combine={masked_combine}")
    assert not np.any(want[~m]) and np.any(want[m])


def test_combine_mask_takes_only_linked_partial_sums():
    """combine's rank_mask after an unmasked dispatch (a handle with rows everywhere): an active
    source sums the active ranks' partial sums only, a masked source only its own; the rows a rank
    ignores get a zero gradient."""
    ep_size, mask = 4, (True, False, True, False)
    rng = np.random.default_rng(7)
    cfg = _cfg()
    x, idx, w = random_tokens(rng, ep_size, T, cfg)
    m = np.asarray(mask)
    y = rng.standard_normal((ep_size, cfg.resolved_capacity(ep_size), H)).astype(np.float32)
    model = model_for(cfg, x, idx, w)
    got = to_numpy(_combine_fn(ep_size, cfg, False, True)(x, idx, w, y, _tiled(m, ep_size)))
    for s in range(ep_size):  # the model over y with every rank not linked to s zeroed
        linked = m & m[s] if m[s] else np.arange(ep_size) == s
        want = nm.combine_exact(np.where(linked[:, None, None], y, 0.0), model)[s]
        assert_bits_equal(got[s], want, f"source {s}")

    g = rng.standard_normal((ep_size, T, H)).astype(np.float32)

    def loss(y):
        body = _combine_fn(ep_size, cfg, False, True)
        return jnp.sum(body(x, idx, w, y, _tiled(m, ep_size)) * g)

    dy = np.asarray(jax.jit(jax.grad(loss))(jnp.asarray(y)))
    handle_rows = [model.ranks[d].src for d in range(ep_size)]
    for d in range(ep_size):
        srcs = handle_rows[d] // T
        # row j of rank d reaches source srcs[j] iff they are linked
        reaches = (handle_rows[d] >= 0) & ((m[d] & m[srcs]) | (srcs == d))
        assert not np.any(dy[d][~reaches]), f"rank {d}: a row nobody reads got a gradient"
        assert np.all(np.any(dy[d][reaches] != 0, axis=1)), f"rank {d}: a row read got no gradient"


def _dense_moe(x, idx, w, ew_all, active, ep_size):
    """No EP: out[t] = sum over valid slots of w * (x[t] @ W[e]), over the slots of tokens of active
    ranks to experts of active ranks (x, idx, w: [R * T, ...], rank-major)."""
    clean = routing.sanitize_topk(idx, E)
    source_active = jnp.repeat(active, x.shape[0] // ep_size)
    keep = (clean >= 0) & active[jnp.maximum(clean, 0) // (E // ep_size)] & source_active[:, None]
    per_expert = jnp.einsum("th,eho->teo", x, ew_all, precision=jax.lax.Precision.HIGHEST)
    picked = jnp.take_along_axis(per_expert, jnp.maximum(clean, 0)[:, :, None], axis=1)
    return jnp.sum(jnp.where(keep[:, :, None], w[:, :, None] * picked, 0.0), axis=1)


def _expert_weights(rng, ep_size):
    return rng.standard_normal((ep_size, E // ep_size, H, HO)).astype(np.float32)


@parametrize_slow_tail("ep_size,mask", MASKS)
def test_gradients_match_dense_moe_without_masked_ranks(ep_size, mask):
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
    m1 = np.asarray(mask)
    dx, dw = np.asarray(got[1][0]), np.asarray(got[1][1])
    clean = np.asarray(routing.sanitize_topk(jnp.asarray(idx.reshape(-1, K)), E)).reshape(ep_size, T, K)
    on_masked = (clean >= 0) & ~m1[np.maximum(clean, 0) // (E // ep_size)]
    assert not np.any(dw[on_masked]), "a slot to a masked rank got a gradient"
    assert not np.any(dw[~m1]) and not np.any(dx[~m1]), "a masked rank's tokens got a gradient"
    assert np.any(dx[m1]), "no active token got a gradient"
    assert not np.any(np.asarray(got[1][2])[~m1]), "a masked rank's experts got a gradient"


def _moe_per_rank(cfg):
    def f(x, i, w, ew, m):
        d = jax_ep.dispatch(x, i, w, cfg, rank_mask=m)
        y = jax.lax.ragged_dot(d.x, ew, d.group_sizes, precision=jax.lax.Precision.HIGHEST)
        return jax_ep.combine(y, d.handle, cfg, rank_mask=m)
    return f


@parametrize_slow_tail("ep_size", [2, 4])
@parametrize_slow_tail("mask_dtype", [np.bool_, np.int32])
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


def test_checked_mode_counts_only_capacity_drops():
    """Checked mode: pairs a mask sends nowhere (in num_dropped) are no error; capacity drops among
    the active ranks still are, and the message counts only those."""
    ep_size = 2
    rng = np.random.default_rng(5)
    cfg = _cfg(checked=True)
    x, idx, w = random_tokens(rng, ep_size, T, cfg, routing=functools.partial(
        random_routing, p_out_of_range=0.0))
    m = _tiled([True, False], ep_size)
    out = jax_ep.run_checked(_dispatch_fn(ep_size, cfg, True), x, idx, w, m)
    pairs = _pairs(idx, ep_size)
    np.testing.assert_array_equal(np.asarray(out.num_dropped), [pairs[0, 1], pairs[1].sum()])
    assert pairs[0, 1] > 0 and pairs[1].sum() > 0

    small = _cfg(checked=True, capacity=2)
    plain = to_numpy(_dispatch_fn(ep_size, _cfg(capacity=2), True)(x, idx, w, m))
    capacity_drops = int(plain.num_dropped.sum()) - int(pairs[0, 1] + pairs[1].sum())
    assert capacity_drops > 0
    with pytest.raises(Exception, match=f"capacity=2 is too small: {capacity_drops} rows dropped"):
        jax_ep.run_checked(_dispatch_fn(ep_size, small, True), x, idx, w, m)


def test_checked_mode_takes_the_mask_the_call_ran_with(monkeypatch):
    """Dispatched.rank_mask is the mask the call ran with: on 'cuda' the rank_mask argument AND NOT
    the persistent mask (shrink mode), which the caller does not pass. Checked mode counts the pairs
    to the ranks it ran without as masked, not as capacity drops. Simulated on the reference path: a
    dispatch that runs with rank 1 masked although the caller passed no mask."""
    ep_size = 2
    rng = np.random.default_rng(6)
    cfg = _cfg(checked=True)
    x, idx, w = random_tokens(rng, ep_size, T, cfg, routing=functools.partial(
        random_routing, p_out_of_range=0.0))
    real = reference.dispatch
    ran_with = jnp.array([True, False])
    monkeypatch.setattr(reference, "dispatch",
                        lambda x, i, w, cfg, rank_mask=None: real(x, i, w, cfg, ran_with))
    out = to_numpy(jax_ep.run_checked(_dispatch_fn(ep_size, cfg, False), x, idx, w))
    pairs = _pairs(idx, ep_size)
    np.testing.assert_array_equal(out.num_dropped, [pairs[0, 1], pairs[1].sum()])
    np.testing.assert_array_equal(out.rank_mask, [[1, 0], [1, 0]])
    assert pairs[0, 1] > 0


@pytest.mark.parametrize("op", ["dispatch", "combine", "dispatch_rank_major", "combine_rank_major"])
def test_checked_mode_refuses_a_mask_that_differs_between_ranks(op):
    """Checked mode: rank_mask must be the same on every rank. Before 2026-12-05 nothing checked it: the
    reference path sent pairs a peer did not take (gone silently), the kernels waited for different peers
    (found by a review). Each op checks its own mask argument: the others get the agreed one."""
    ep_size = 4
    rng = np.random.default_rng()
    cfg = _cfg(checked=True)
    x, idx, w = random_tokens(rng, ep_size, T, cfg, routing=functools.partial(
        random_routing, p_out_of_range=0.0))
    agreed = _tiled([True, True, False, True], ep_size)
    differ = agreed.copy()
    bad_rank = int(rng.integers(ep_size))
    flag = int(rng.integers(ep_size))
    differ[bad_rank, flag] = not differ[bad_rank, flag]   # one rank's view of one flag
    rank_major = op.endswith("rank_major")

    def body(x, i, w, m_dispatch, m_combine):
        dispatch = jax_ep.dispatch_rank_major if rank_major else jax_ep.dispatch
        combine = jax_ep.combine_rank_major if rank_major else jax_ep.combine
        d = dispatch(x, i, w, cfg, rank_mask=m_dispatch)
        y = jnp.ones(d.x.shape[:1] + (8,), jnp.float32) * rng.normal()
        return combine(y, d.handle, cfg, rank_mask=m_combine)

    fn = per_rank(body, ep_size)
    masks = (differ, agreed) if op.startswith("dispatch") else (agreed, differ)
    with pytest.raises(Exception, match=rf"jax_ep\.{op}: rank_mask differs between the ranks of the EP group"
                       rf".*ranks \[{flag}\]"):
        jax_ep.run_checked(fn, x, idx, w, *masks)
    jax_ep.run_checked(fn, x, idx, w, agreed, agreed)   # the same mask everywhere: no error


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

    # a handle whose mask was replaced (found by a review, 2026-12-05: a raw JAX broadcasting error, and
    # a float mask was taken)
    def run_handle(x, i, w):
        d = jax_ep.dispatch(x, i, w, cfg)
        return jax_ep.combine(d.x, d.handle._replace(rank_mask=jnp.asarray(bad)), cfg)

    in_handle = what.replace("rank_mask", "handle.rank_mask")
    with pytest.raises(jax_ep.EPValueError, match="combine: " + in_handle):
        per_rank(run_handle, ep_size)(x, idx, w)

    def run_rank_major(x, i, w):
        d = jax_ep.dispatch_rank_major(x, i, w, cfg)
        return jax_ep.combine_rank_major(d.x, d.handle._replace(rank_mask=jnp.asarray(bad)), cfg)

    with pytest.raises(jax_ep.EPValueError, match="combine_rank_major: " + in_handle):
        per_rank(run_rank_major, ep_size)(x, idx, w)


DATA_OPS = [name for name in ops.OPS if name != "layout"]  # every op but layout takes a rank mask
# the backend functions they run (the in-place forms run their plain op's)
DATA_FUNCTIONS = sorted({ops.OPS[name].function for name in DATA_OPS})


def test_auto_picks_as_without_a_mask(monkeypatch):
    """Every data op's kernel takes a mask (with the reference's masked semantics), so the mask plays
    no part in the choice: 'auto' takes the kernel where the auto table has a measured win, the
    reference where it has none."""
    from jax_ep import cuda_backend, runtime

    ep_size = 2
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(runtime, "available", lambda: (True, ""))
    monkeypatch.setattr("jax_ep.backends.platform", lambda: "gpu")  # a GPU mesh's call
    monkeypatch.setattr(cuda_backend, "unsupported", lambda *a: None)
    for name in DATA_OPS:
        function = ops.OPS[name].function
        for backend in (reference, cuda_backend):
            assert "rank_mask" in inspect.signature(getattr(backend, function)).parameters, (backend, name)
        for wins in (True, False):
            monkeypatch.setattr(auto_table, "kernel_faster", lambda op, layout, tokens, ep, dtype, w=wins: w)
            want = getattr(cuda_backend if wins else reference, function)
            assert ops.OPS[name].implementation(_cfg(backend="auto"), ep_size) is want, (name, wins)


def test_every_data_op_is_passed_its_rank_mask(monkeypatch):
    """The ops pass rank_mask= to every data op's implementation, forward and backward, None without
    a mask (one signature for every backend: jax_ep.backends.Functions); an unmasked dispatch's handle
    has none (LLHandle.rank_mask None, its pytree that of a handle built by hand)."""
    seen, depth = {}, [0]

    def spy(name, fn):
        def call(*args, **kwargs):
            if depth[0] == 0:  # the ops' calls, not the reference ops' calls of each other
                seen.setdefault(name, []).append(kwargs.get("rank_mask", "not passed"))
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
        return call

    for name in DATA_FUNCTIONS:
        monkeypatch.setattr(reference, name, spy(name, getattr(reference, name)))
    ep_size, cfg = 2, _cfg()
    x, idx, w = random_tokens(np.random.default_rng(7), ep_size, T, cfg)

    def loss(x, i, w):
        d = jax_ep.dispatch(x, i, w, cfg)
        r = jax_ep.dispatch_rank_major(x, i, w, cfg)
        return (jnp.sum(jax_ep.combine(d.x, d.handle, cfg))
                + jnp.sum(jax_ep.combine_rank_major(r.x, r.handle, cfg)))

    def decode(x, i, w):
        d = jax_ep.ll_dispatch(x.astype(jnp.bfloat16), i, w, cfg)
        return jax_ep.ll_combine(d.x, d.handle, cfg)

    fn = per_rank(loss, ep_size, jit=False)
    jax.make_jaxpr(jax.grad(lambda x, w: jnp.sum(fn(x, idx, w)), argnums=(0, 1)))(x, w)
    jax.make_jaxpr(per_rank(decode, ep_size, jit=False))(x, idx, w)
    # broadcast is combine's backward's transport: the ops call combine_bwd (the kernel or the whole
    # reference backward, which calls broadcast itself with the mask it was given)
    assert sorted(seen) == sorted(name for name in DATA_FUNCTIONS if name != "broadcast")
    assert all(mask is None for masks in seen.values() for mask in masks), seen


def test_auto_without_a_gpu_runs_the_reference():
    ep_size = 2
    rng = np.random.default_rng(1)
    x, idx, w = random_tokens(rng, ep_size, T, _cfg())
    m = _tiled([True, False], ep_size)
    got = to_numpy(_dispatch_fn(ep_size, _cfg(backend="auto"), True)(x, idx, w, m))
    _assert_tree_bits_equal(got, to_numpy(_dispatch_fn(ep_size, _cfg(), True)(x, idx, w, m)),
                            "auto = reference")


# ---- rank-major mode ------------------------------------------------------------------------------
def _rank_major_fn(ep_size, cfg):
    def body(x, i, w, y, m):
        d = jax_ep.dispatch_rank_major(x, i, w, cfg, rank_mask=m)
        return d, jax_ep.combine_rank_major(y, d.handle, cfg, rank_mask=m)

    return per_rank(body, ep_size)


@parametrize_slow_tail("ep_size,mask", MASKS)
def test_masked_rank_major_matches_the_model(ep_size, mask):
    """dispatch_rank_major under a mask: the NumPy model under it, every field bit for bit (rows only
    from active sources to active ranks; a masked rank has none); combine_rank_major: the float32
    rank-order sum over the linked ranks' rows, bit for bit, NaN in the empty rows never read."""
    from test_rank_major import assert_matches, poison_empty_rows, rank_order_sum

    rng = np.random.default_rng(500 + ep_size + sum(mask))
    cfg = _cfg()
    x, idx, w = random_tokens(rng, ep_size, T, cfg)
    m = np.asarray(mask)
    model = nm.dispatch_rank_major(x, idx, w, num_experts=E, rank_mask=m)
    y = poison_empty_rows(rng.standard_normal((ep_size, ep_size * T, H)).astype(np.float32), model)
    d, out = to_numpy(_rank_major_fn(ep_size, cfg)(x, idx, w, y, _tiled(m, ep_size)))
    assert_matches(d, model, ep_size)
    assert_bits_equal(out, rank_order_sum(y, model, np.float32), "combine_rank_major")
    pairs = _pairs(idx, ep_size)
    for r in range(ep_size):  # rows per source: tokens, not pairs; none unless both ends are active
        assert not np.any(d.num_tokens_per_rank[r][~m]) and (m[r] or not np.any(d.num_tokens_per_rank[r]))
        assert int(d.num_tokens_per_expert[r].sum()) == (pairs[m, r].sum() if m[r] else 0)
    assert not np.any(out[~m]) and np.any(out[m])


@parametrize_slow_tail("ep_size,mask", MASKS[:2])
def test_masked_rank_major_gradients_match_dense_moe(ep_size, mask):
    from test_rank_major import _expert_kernel

    rng = np.random.default_rng(600 + ep_size + sum(mask))
    cfg = _cfg()
    x, idx, w = random_tokens(rng, ep_size, T, cfg)
    ew, m = _expert_weights(rng, ep_size), _tiled(mask, ep_size)
    g = rng.standard_normal((ep_size, T, HO)).astype(np.float32)

    def f(x, i, w, ew, m):
        d = jax_ep.dispatch_rank_major(x, i, w, cfg, rank_mask=m)
        y = _expert_kernel(d.x, d.topk_idx, d.topk_weights, ew)
        return jax_ep.combine_rank_major(y, d.handle, cfg, rank_mask=m)

    fn = per_rank(f, ep_size, jit=False)

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
    m1 = np.asarray(mask)
    assert not np.any(np.asarray(got[1][0])[~m1]) and not np.any(np.asarray(got[1][1])[~m1])
    assert np.any(np.asarray(got[1][0])[m1])


def test_rank_major_all_active_mask_is_bit_identical_to_no_mask():
    ep_size = 4
    rng = np.random.default_rng(8)
    cfg = _cfg()
    x, idx, w = random_tokens(rng, ep_size, T, cfg)
    y = rng.standard_normal((ep_size, ep_size * T, H)).astype(np.float32)

    def plain(x, i, w, y):
        d = jax_ep.dispatch_rank_major(x, i, w, cfg)
        return d, jax_ep.combine_rank_major(y, d.handle, cfg)

    _assert_tree_bits_equal(
        to_numpy(_rank_major_fn(ep_size, cfg)(x, idx, w, y, _tiled(np.ones(ep_size, bool), ep_size))),
        to_numpy(per_rank(plain, ep_size)(x, idx, w, y)), "rank-major")


@pytest.mark.parametrize("shrink", [False, True])
def test_cuda_backend_lowers_the_mask_as_an_operand(monkeypatch, shrink):
    """backend='cuda' with a mask traces on any machine (the FFI calls compile on GPUs only): the
    forward and backward custom calls of dispatch / combine (dispatch, combine, combine_bwd,
    slot_values) and of the rank-major ops (dispatch_rank_major, combine_rank_major,
    broadcast_rank_major) each take the mask as an int32 [R] operand (traced: new values, same
    executable); dispatch returns the mask it ran with (int32 [R], last); EPConfig.shrink reaches
    every call's attributes (shrink mode of the throughput kernels)."""
    lower_cuda_here(monkeypatch, stub_extension=True)
    ep_size = 2
    cfg = _cfg(backend="cuda", dispatch_dtype="bfloat16", shrink=shrink)

    def loss(x, i, w, m):
        d = jax_ep.dispatch(x, i, w, cfg, rank_mask=m)
        out = jax_ep.combine(d.x, d.handle, cfg, rank_mask=m).astype(jnp.float32)
        rm = jax_ep.dispatch_rank_major(x, i, w, cfg, rank_mask=m)
        y = rm.x * jnp.sum(rm.topk_weights, axis=1, keepdims=True).astype(rm.x.dtype)
        back = jax_ep.combine_rank_major(y, rm.handle, cfg, rank_mask=m).astype(jnp.float32)
        return jnp.sum(out ** 2) + jnp.sum(back ** 2)

    def body(x, i, w, m):
        return jax.grad(loss, argnums=(0, 2))(x, i, w, m)

    rng = np.random.default_rng(4)
    x, idx, w = random_tokens(rng, ep_size, T, _cfg())
    text = per_rank(body, ep_size).lower(x.astype(jnp.bfloat16), idx, w,
                                         _tiled([True, False], ep_size)).as_text()
    calls = [line for line in text.splitlines() if "stablehlo.custom_call @jax_ep" in line]
    names = sorted(line.split("@")[1].split("(")[0] for line in calls)
    assert names == ["jax_ep_broadcast_rank_major", "jax_ep_combine", "jax_ep_combine",
                     "jax_ep_combine_bwd", "jax_ep_combine_rank_major", "jax_ep_combine_rank_major",
                     "jax_ep_combine_rank_major", "jax_ep_dispatch", "jax_ep_dispatch_rank_major",
                     "jax_ep_slot_values"], names
    for line in calls:  # operands ..., rank_mask, rank, group
        operand_types = line.split(":")[-1].split("->")[0]
        assert operand_types.rstrip(" )").endswith(
            f"tensor<{ep_size}xi32>, tensor<i32>, tensor<i32>"), line
        assert f"shrink = {int(shrink)} : i64" in line, line
        if "@jax_ep_dispatch(" in line:
            assert line.split("->")[-1].rstrip(" )").endswith(f"tensor<{ep_size}xi32>"), line


# ---- the MoE layer: set_rank_mask / clear_rank_mask ----------------------------------------------
def _layer(ep_size, seed=0):
    from flax import nnx
    from jax.sharding import Mesh

    from jax_ep.gating import RouterConfig
    from jax_ep.moe import EPOptions, MoE

    mesh = Mesh(np.array(jax.devices()[:ep_size]), ("ep",))
    return MoE(H, 24, RouterConfig(E, 2), rngs=nnx.Rngs(seed), mesh=mesh, ep=EPOptions(backend="auto"))


def _dense_layer(layer, tokens, active):
    """The layer without EP (tokens rank-major, as the layer shards them), the slots of masked
    ranks' tokens and of experts on masked ranks dropped (routing unchanged)."""
    from jax_ep import gating

    routing = gating.route(tokens @ layer.router[...], layer.routing, layer.expert_bias[...])
    gate, up = jnp.split(jnp.einsum("th,ehf->tef", tokens, layer.w_gate_up[...]), 2, axis=2)
    y = jnp.einsum("tef,efh->teh", jax.nn.silu(gate) * up, layer.w_down[...])
    picked = jnp.take_along_axis(y, routing.topk_idx[:, :, None], axis=1)
    source_active = jnp.repeat(active, tokens.shape[0] // active.shape[0])
    keep = active[routing.topk_idx // (E // active.shape[0])] & source_active[:, None]
    out = jnp.sum(jnp.where(keep[:, :, None], picked * routing.topk_weights[:, :, None], 0.0), axis=1)
    return out, int(np.sum(~np.asarray(keep)))


@pytest.mark.slow
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
    by_rank = got.reshape(ep_size, -1, H)
    assert not np.any(by_rank[~mask]) and np.any(by_rank[mask]), "masked ranks' tokens"
    assert int(layer.last_dropped[...]) == dropped > 0
    received = np.asarray(layer.last_slot_load[...]).reshape(ep_size, -1)
    assert not np.any(received[~mask]) and received.sum() + dropped == x.shape[0] * x.shape[1] * 2
    assert int(layer.last_load[...].sum()) == x.shape[0] * x.shape[1] * 2   # the router's picks, all of them

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
    decoded = np.asarray(layer(x, decode=True)).reshape(ep_size, -1, H)  # (tests/test_decode.py)
    assert not np.any(decoded[~mask]) and np.any(decoded[mask]), "decode: masked ranks' tokens"
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


def test_checkpoint_save_and_restore_refuse_a_rank_mask(tmp_path):
    """The mask is runtime fault state, never saved: save refuses a masked layer, and so does restore
    into one (before 2026-12-05 restore blamed the checkpoint: "'rank_mask' is in the model, not in the
    checkpoint")."""
    import jax_ep.checkpoint as ckpt

    layer = _layer(2)
    layer.set_rank_mask([True, False])
    with pytest.raises(ValueError, match=r"checkpoint.save: .*rank mask .*clear_rank_mask\(\) first"):
        ckpt.save(tmp_path / "ckpt", layer)
    layer.clear_rank_mask()
    ckpt.save(tmp_path / "ckpt", layer)
    layer.set_rank_mask([True, False])
    with pytest.raises(ValueError, match=r"checkpoint.restore: .*rank mask .*clear_rank_mask\(\) first"):
        ckpt.restore(tmp_path / "ckpt", layer)
    layer.clear_rank_mask()
    ckpt.restore(tmp_path / "ckpt", layer)


@pytest.mark.parametrize("flags, processes, hazard", [
    ("", 2, True),
    ("--xla_gpu_shard_autotuning=false", 2, False),
    ("--xla_foo=1 --xla_gpu_shard_autotuning=0", 4, False),
    ("--xla_gpu_shard_autotuning=false --xla_gpu_shard_autotuning=true", 2, True),  # the last one wins
    ("--xla_gpu_shard_autotuning", 2, True),
    ("", 1, False),
])
def test_shrink_over_processes_warns_of_sharded_autotuning(flags, processes, hazard):
    """Shrink mode over several processes with XLA's sharded autotuning on: a program compiled after a
    process died waits forever (seen on one H200, 2026-11-24), so the first shrink-mode op warns."""
    from jax_ep import cuda_backend

    why = cuda_backend.shard_autotuning_hazard(flags, processes)
    assert (why is not None) == hazard, why
    if why:
        assert "--xla_gpu_shard_autotuning=false" in why and "shrink=True" in why


@pytest.mark.parametrize("combine_mask", [None, [1, 1, 1, 1], [1, 1, 0, 1]])
@pytest.mark.parametrize("layout", ["expert_major", "rank_major", "low_latency", "low_latency_sent"])
def test_the_ops_of_a_handle_run_with_the_dispatchs_mask_too(monkeypatch, combine_mask, layout):
    """A masked dispatch's handle carries its mask and the ops of the handle AND theirs with it
    (ops.handle_mask), so no backend is asked to take partial sums from a rank the dispatch masked: on
    the CUDA kernels that rank's staging still held an earlier call's (kernel emulator, 2026-12-05). The
    reference's values are the same either way; what the backend receives is checked here (the spy
    writes the mask it got into row 0 of its output). The low-latency handle had no mask: ll_combine
    without the dispatch's waited on the GPU for the rank the dispatch masked (found by a review,
    2026-12-06)."""
    ep_size = 4
    cfg = _cfg()
    dispatch_mask = jnp.asarray([1, 0, 1, 1], jnp.int32)
    name = {"expert_major": "combine", "rank_major": "combine_rank_major", "low_latency": "ll_combine",
            "low_latency_sent": "ll_combine_recv"}[layout]
    real = getattr(reference, name)

    def written(out, rank_mask):
        got = jnp.full((ep_size,), -1) if rank_mask is None else rank_mask
        return jnp.zeros_like(out).at[0, :ep_size].set(got.astype(out.dtype))

    def spy(y, handle, cfg, rank_mask=None, **kw):
        return written(real(y, handle, cfg, rank_mask=rank_mask, **kw), rank_mask)

    def spy_recv(pending, cfg):   # the reference's pending keeps the send's mask
        return written(real(pending, cfg), pending.rank_mask)

    monkeypatch.setattr(reference, name, spy_recv if layout == "low_latency_sent" else spy)
    rng = np.random.default_rng(431)
    x, idx, w = random_tokens(rng, ep_size, T, cfg)
    mask = None if combine_mask is None else jnp.asarray(combine_mask, jnp.int32)

    def body(x, idx, w):
        if layout == "expert_major":
            d = jax_ep.dispatch(x, idx, w, cfg, rank_mask=dispatch_mask)
            return jax_ep.combine(d.x, d.handle, cfg, rank_mask=mask)
        if layout == "rank_major":
            d = jax_ep.dispatch_rank_major(x, idx, w, cfg, rank_mask=dispatch_mask)
            return jax_ep.combine_rank_major(d.x, d.handle, cfg, rank_mask=mask)
        if layout == "low_latency":
            d = jax_ep.ll_dispatch(x.astype(jnp.bfloat16), idx, w, cfg, rank_mask=dispatch_mask)
            return jax_ep.ll_combine(d.x, d.handle, cfg, rank_mask=mask)
        sent = jax_ep.ll_dispatch_send(x.astype(jnp.bfloat16), idx, w, cfg, rank_mask=dispatch_mask)
        d = jax_ep.ll_dispatch_recv(sent, cfg)
        return jax_ep.ll_combine_recv(jax_ep.ll_combine_send(d.x, d.handle, cfg, rank_mask=mask), cfg)

    got = np.asarray(per_rank(body, ep_size)(x, idx, w))[0, 0, :ep_size]
    want = np.asarray(dispatch_mask) & (1 if combine_mask is None else np.asarray(combine_mask))
    np.testing.assert_array_equal(got, want)
