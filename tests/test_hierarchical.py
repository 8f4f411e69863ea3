"""Hierarchical (multi-node) dispatch / combine (jax_ep.hierarchical) on CPU virtual devices: meshes
(node, local) of 2 x 4, 4 x 2 and 2 x 1.

Checked against an independent NumPy model of the two stages (rows, handle, counts: exact), the
documented rounding of combine_hierarchical (bit for bit), the flat EP dispatch / combine over the same
N*L GPUs (counts equal, results within the documented bound), and the MoE layer's flat path (output and
gradients)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import numpy_model as nm
import pytest
from flax import nnx
from helpers import lower_cuda_here, parametrize_slow_tail, require_devices
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import hierarchical, moe
from jax_ep.gating import RouterConfig, route
from jax_ep.hierarchical import fp8_packed_width

MESHES = [(2, 4), (4, 2), (2, 1)]
T, K, H = 5, 3, 16
GROUP = ("node", "local")


def mesh2d(nodes: int, local: int) -> Mesh:
    require_devices(nodes * local)
    return Mesh(np.array(jax.devices()[:nodes * local]).reshape(nodes, local), GROUP)


def run(fn, nodes: int, local: int, *args):
    """fn(per-GPU args) -> per-GPU pytree, over global [N*L, ...] arrays (GPU (n, l) = row n*L + l)."""
    spec = P(GROUP)

    def body(*a):
        return jax.tree.map(lambda v: v[None], fn(*(v[0] for v in a)))

    f = jax.shard_map(body, mesh=mesh2d(nodes, local), in_specs=(spec,) * len(args), out_specs=spec)
    return jax.tree.map(np.asarray, jax.jit(f)(*args))


def run_flat(fn, ranks: int, *args):
    require_devices(ranks)
    mesh = Mesh(np.array(jax.devices()[:ranks]), ("ep",))

    def body(*a):
        return jax.tree.map(lambda v: v[None], fn(*(v[0] for v in a)))

    return jax.tree.map(np.asarray, jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * len(args),
                                                           out_specs=P("ep")))(*args))


def random_inputs(rng, ranks: int, experts: int, dtype=jnp.float32, messy: bool = True):
    """Tokens, ids (distinct per token, plus unused, out-of-range and repeated slots) and weights."""
    x = rng.standard_normal((ranks, T, H)).astype(np.float32)
    idx = np.stack([rng.choice(experts, K, replace=False) for _ in range(ranks * T)]).reshape(ranks, T, K)
    if messy:
        idx[0, 0, 1] = -1
        idx[0, 1, 2] = experts + 3          # out of range: unused
        idx[-1, 2, 2] = idx[-1, 2, 0]       # repeat: unused
    w = rng.random((ranks, T, K)).astype(np.float32) + 0.1
    return jnp.asarray(x, dtype), jnp.asarray(idx, jnp.int32), jnp.asarray(w)


def sanitize(idx: np.ndarray, experts: int) -> np.ndarray:
    out = np.full(idx.shape, -1, np.int64)
    for pos in np.ndindex(idx.shape[:-1]):
        seen = set()
        for k, e in enumerate(idx[pos]):
            if 0 <= e < experts and e not in seen:
                seen.add(int(e))
                out[pos + (k,)] = e
    return out


def model(x, idx, w, nodes, local, experts, capacity, align):
    """The two stages in NumPy, per GPU g = n*L + l. Stage 1: GPU (n, l) holds, in (source node, token)
    order, one row per token of GPUs (s, l) that picked an expert of node n. Stage 2: the expert-major
    rows of GPU (n, l)'s experts from the stage-1 rows of GPUs (n, l_src), ordered by (l_src, stage-1
    row); a row at position >= capacity is dropped."""
    x, w = np.asarray(x), np.asarray(w)
    idx = sanitize(np.asarray(idx), experts)
    per_node, per_gpu = experts // nodes, experts // (nodes * local)
    stage1 = {}   # (n, l) -> list of (s, t)
    for n in range(nodes):
        for l_ in range(local):
            stage1[n, l_] = [(s, t) for s in range(nodes) for t in range(T)
                             if any(e >= 0 and e // per_node == n for e in idx[s * local + l_, t])]
    out = []
    for n in range(nodes):
        for l_ in range(local):
            rows = np.zeros((capacity, H), x.dtype)
            src = np.full(capacity, -1, np.int32)
            weights = np.zeros(capacity, np.float32)
            sizes, counts, dropped, offset = [], [], 0, 0
            for le in range(per_gpu):
                expert = n * per_node + l_ * per_gpu + le
                entries = [(ls, i, s, t, k) for ls in range(local) for i, (s, t) in enumerate(stage1[n, ls])
                           for k in range(K) if idx[s * local + ls, t, k] == expert]
                kept = 0
                for j, (ls, i, s, t, k) in enumerate(entries):
                    pos = offset + j
                    if pos >= capacity:
                        dropped += 1
                        continue
                    kept += 1
                    rows[pos] = x[s * local + ls, t]
                    src[pos] = ls * nodes * T + i
                    weights[pos] = w[s * local + ls, t, k]
                counts.append(kept)
                sizes.append(-(-kept // align) * align)
                offset = min(offset + -(-len(entries) // align) * align, capacity)
            stage1_src = np.full(nodes * T, -1, np.int32)
            stage1_src[:len(stage1[n, l_])] = [s * T + t for s, t in stage1[n, l_]]
            per_source = np.array([sum(s == src_node for s, _ in stage1[n, l_]) for src_node in range(nodes)])
            out.append(dict(rows=rows, src=src, weights=weights, group_sizes=np.array(sizes),
                            expert_counts=np.array(counts), num_dropped=dropped, stage1_src=stage1_src,
                            num_tokens_per_node=per_source))
    return out


def hier_cfg(nodes, local, **kw):
    kw = {"backend": "reference", "hidden": H, **kw}
    return jax_ep.EPConfig(8 * nodes * local // (2 if local > 1 else 1), K, max_tokens_per_rank=T,
                           axis_name="local", **kw)


@parametrize_slow_tail("nodes,local", MESHES)
@parametrize_slow_tail("capacity,align", [(None, 1), (None, 4), ("tight", 2)], fast=(2,))
def test_rows_match_the_two_stage_model(nodes, local, capacity, align):
    rng = np.random.default_rng(nodes * 10 + local + align)
    cfg = hier_cfg(nodes, local, expert_alignment=align)
    ranks, experts = nodes * local, cfg.num_experts
    if capacity == "tight":   # about half the rows fit: every GPU drops some
        capacity = -(-(T * ranks * K) // (2 * ranks) // align) * align
    cfg = cfg.replace(capacity=capacity)
    x, idx, w = random_inputs(rng, ranks, experts)

    def f(x, i, w):
        d = jax_ep.dispatch_hierarchical(x, i, w, cfg, "node")
        return d, d.row_weights

    d, row_weights = run(f, nodes, local, x, idx, w)
    cap = cfg.resolved_capacity(ranks)
    assert d.x.shape == (ranks, cap, H)
    # the same worst case as a flat dispatch over N*L ranks
    assert cap == cfg.replace(axis_name="ep").resolved_capacity(ranks)
    want = model(x, idx, w, nodes, local, experts, cap, align)
    for g, m in enumerate(want):
        np.testing.assert_array_equal(d.handle.local.src_index[g], m["src"], err_msg=f"GPU {g} src_index")
        np.testing.assert_array_equal(d.x[g], m["rows"], err_msg=f"GPU {g} rows")
        np.testing.assert_array_equal(row_weights[g], m["weights"], err_msg=f"GPU {g} row weights")
        np.testing.assert_array_equal(d.group_sizes[g], m["group_sizes"])
        np.testing.assert_array_equal(d.expert_counts[g], m["expert_counts"])
        assert int(d.num_dropped[g]) == m["num_dropped"], g
        np.testing.assert_array_equal(d.handle.node.src_index[g], m["stage1_src"], err_msg=f"GPU {g} stage 1")
        np.testing.assert_array_equal(d.num_tokens_per_node[g], m["num_tokens_per_node"])
    if capacity is not None:
        assert d.num_dropped.sum() > 0

    # counts equal the flat dispatch's over the same N*L ranks, GPU for GPU (the same pairs land there)
    flat_cfg = cfg.replace(axis_name="ep")
    flat = run_flat(lambda x, i, w: jax_ep.dispatch(x, i, w, flat_cfg), ranks, x, idx, w)
    np.testing.assert_array_equal(d.group_sizes, flat.group_sizes)
    np.testing.assert_array_equal(d.expert_counts, flat.expert_counts)
    np.testing.assert_array_equal(d.num_dropped, flat.num_dropped)


def emulate_combine(y, d, nodes, local):
    """combine_hierarchical's documented rounding in NumPy, from the dispatch's handle: per (token,
    GPU) the float32 sum in slot order rounded to y's dtype; per (token, node) the float32 sum over the
    node's GPUs in local order, rounded; per token the float32 sum over nodes in node order, rounded."""
    y = np.asarray(y)
    dtype, yf = y.dtype, y.astype(np.float32)
    stage1_rows = nodes * T
    out = np.zeros((nodes * local, T, y.shape[2]), dtype)
    # partial[(n, ls)][i]: row i of GPU (n, ls)'s stage-1 buffer, reduced over its node's GPUs
    per_node_row = {}
    for n in range(nodes):
        for ls in range(local):
            for i in range(stage1_rows):
                total = np.zeros(y.shape[2], np.float32)
                for ld in range(local):
                    g = n * local + ld
                    rows = d.handle.local.token_rows[g, ls * stage1_rows + i]
                    partial = np.zeros(y.shape[2], np.float32)
                    for k in range(rows.shape[0]):   # stage 2's slots: min(K, E / N)
                        if rows[k] >= 0:
                            weight = d.handle.local.row_weights[g, rows[k]]
                            term = (yf[g, rows[k]] * weight).astype(np.float32)
                            partial = (partial + term).astype(np.float32)
                    total = (total + partial.astype(dtype).astype(np.float32)).astype(np.float32)
                per_node_row[n, ls, i] = total.astype(dtype).astype(np.float32)
    for s in range(nodes):
        for ls in range(local):
            total = np.zeros((T, y.shape[2]), np.float32)
            for n in range(nodes):
                src = d.handle.node.src_index[n * local + ls]
                add = np.zeros((T, y.shape[2]), np.float32)
                for i, slot in enumerate(src):
                    if slot >= 0 and slot // T == s:
                        add[slot % T] = per_node_row[n, ls, i]
                total = (total + add).astype(np.float32)
            out[s * local + ls] = total.astype(dtype)
    return out


@parametrize_slow_tail("nodes,local", MESHES)
def test_identity_experts_give_the_weighted_sum(nodes, local):
    """dispatch -> identity experts -> combine: the gate-weighted sum of each token's kept slots, with
    the documented rounding (bit for bit), and within 3.1 * 2^-8 * sum_k |w_k x| of the flat combine
    (equal to it with one GPU per node)."""
    rng = np.random.default_rng(7 + nodes)
    cfg = hier_cfg(nodes, local, dispatch_dtype="bfloat16")
    ranks = nodes * local
    x, idx, w = random_inputs(rng, ranks, cfg.num_experts)

    def f(x, i, w):
        d = jax_ep.dispatch_hierarchical(x, i, w, cfg, "node")
        return d, jax_ep.combine_hierarchical(d.x, d.handle, cfg, "node")

    d, out = run(f, nodes, local, x, idx, w)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(out.view(np.uint16), emulate_combine(d.x, d, nodes, local).view(np.uint16))
    xb = np.asarray(x.astype(jnp.bfloat16)).astype(np.float64)
    used = sanitize(np.asarray(idx), cfg.num_experts) >= 0
    wk = np.where(used, np.asarray(w), 0.0)
    exact = xb * wk.sum(-1, keepdims=True)
    scale = np.abs(xb) * np.abs(wk).sum(-1, keepdims=True)
    bound = 3.1 * 2.0 ** -8 * scale
    assert np.all(np.abs(out.astype(np.float64) - exact) <= bound)

    flat_cfg = cfg.replace(axis_name="ep")

    def flat_fn(x, i, w):
        d = jax_ep.dispatch(x, i, w, flat_cfg)
        return jax_ep.combine(d.x, d.handle, flat_cfg)

    flat = run_flat(flat_fn, ranks, x, idx, w)
    diff = np.abs(out.astype(np.float64) - flat.astype(np.float64))
    assert np.all(diff <= bound)
    if local > 1:
        assert np.any(diff > 0), "the in-node rounding should show somewhere (else this test checks nothing)"
    else:
        np.testing.assert_array_equal(out.view(np.uint16), flat.view(np.uint16))


@parametrize_slow_tail("nodes,local", MESHES)
def test_gradients_match_the_flat_ops(nodes, local):
    """jax.grad through dispatch_hierarchical -> weighted experts -> combine_hierarchical (float32)
    against the flat ops over the same N*L ranks, in x and the gate weights."""
    rng = np.random.default_rng(11 + local)
    cfg = hier_cfg(nodes, local)
    x, idx, w = random_inputs(rng, nodes * local, cfg.num_experts)
    grad_h = assert_gradients_match_flat(cfg, nodes, local, x, idx, w, rng)
    # the gate weights of unused / repeated / out-of-range slots get no gradient
    unused = sanitize(np.asarray(idx), cfg.num_experts) < 0
    assert np.all(grad_h[1][unused] == 0)


def test_zero_tokens_per_gpu_differentiate():
    """T = 0 through both stages under jax.grad: empty gradients, not cotangents typed unlike their
    primals (before 2026-12-05 JAX refused d x: the zero-size rows are constants, typed invariant)."""
    nodes, local = 2, 2
    cfg = hier_cfg(nodes, local)
    ranks = nodes * local
    x = np.zeros((ranks, 0, H), np.float32)
    idx, w = np.zeros((ranks, 0, K), np.int32), np.zeros((ranks, 0, K), np.float32)

    def loss(x, w, idx):
        d = jax_ep.dispatch_hierarchical(x, idx, w, cfg, node_axis="node")
        return jnp.sum(jax_ep.combine_hierarchical(d.x * 2.0, d.handle, cfg, node_axis="node"))

    dx, dw = run(lambda x, i, w: jax.grad(loss, argnums=(0, 1))(x, w, i), nodes, local, x, idx, w)
    assert dx.shape == (ranks, 0, H) and dw.shape == (ranks, 0, K)


def test_rematerialised_hierarchical_ops_keep_both_stages_by_name():
    """dispatch_hierarchical -> combine_hierarchical in a rematerialised loss that reads combine's output
    (the reference's all_to_alls counted in the compiled program): with no policy the backward runs both
    stages of each again; keeping jax_ep.remat.NAMES (both stages are named dispatches and combines)
    runs none again; the gradients are the plain step's."""
    from jax_ep import remat

    nodes, local = 2, 2
    rng = np.random.default_rng(13)
    cfg = hier_cfg(nodes, local)
    x, idx, w = random_inputs(rng, nodes * local, cfg.num_experts)

    def loss(x, i, w):
        d = jax_ep.dispatch_hierarchical(x, i, w, cfg, "node")
        out = jax_ep.combine_hierarchical(jnp.tanh(d.x), d.handle, cfg, "node")
        return jnp.sum(out * out)

    def program(policy):
        inner = loss if policy is None else jax.checkpoint(
            loss, policy=None if policy == "no_policy" else policy)

        def body(x, i, w):
            value, grads = jax.value_and_grad(inner, argnums=(0, 2))(x[0], i[0], w[0])
            return jax.tree.map(lambda v: v[None], (value, grads))
        spec = P(GROUP)
        step = jax.jit(jax.shard_map(body, mesh=mesh2d(nodes, local), in_specs=(spec,) * 3, out_specs=spec))
        return step(x, idx, w), step.lower(x, idx, w).compile().as_text().count(" all-to-all(")

    (plain, n_plain), (bare, n_bare), (kept, n_kept) = (program(p) for p in (None, "no_policy",
                                                                            remat.policy(save=remat.NAMES)))
    assert n_bare > n_plain and n_kept == n_plain, (n_plain, n_bare, n_kept)
    for got, want in zip(jax.tree.leaves(kept), jax.tree.leaves(plain), strict=True):
        assert np.any(np.asarray(want) != 0)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


def assert_gradients_match_flat(cfg, nodes, local, x, idx, w, rng):
    """jax.grad in x and the gate weights through dispatch_hierarchical -> a row-wise "expert" ->
    combine_hierarchical, against the flat ops over the same N*L ranks; returns the hierarchical ones."""
    ranks = nodes * local
    scale_rows = jnp.asarray(rng.standard_normal((ranks, H)), jnp.float32)

    def loss(dispatch_fn, combine_fn):
        def f(x, i, w, s):
            d = dispatch_fn(x, i, w)
            y = jnp.tanh(d.x * s)                         # a row-wise "expert"
            out = combine_fn(y, d.handle)
            return jnp.sum(out * out * s)
        return f

    hier = loss(lambda x, i, w: jax_ep.dispatch_hierarchical(x, i, w, cfg, "node"),
                lambda y, h: jax_ep.combine_hierarchical(y, h, cfg, "node"))
    flat_cfg = cfg.replace(axis_name="ep")
    flat = loss(lambda x, i, w: jax_ep.dispatch(x, i, w, flat_cfg),
                lambda y, h: jax_ep.combine(y, h, flat_cfg))
    grad_h = run(lambda *a: jax.grad(hier, argnums=(0, 2))(*a), nodes, local, x, idx, w, scale_rows)
    grad_f = run_flat(lambda *a: jax.grad(flat, argnums=(0, 2))(*a), ranks, x, idx, w, scale_rows)
    for got, want, name in zip(grad_h, grad_f, ("x", "topk_weights"), strict=True):
        assert np.any(want != 0), name
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max(), err_msg=name)
    return grad_h


@pytest.mark.slow
@pytest.mark.parametrize("nodes,local", [(4, 2), (8, 1)])
def test_fewer_experts_per_node_than_topk(nodes, local):
    """8 experts over 4 or 8 nodes with top-3: a node has 2 or 1 experts, fewer than K, so stage 2 takes
    E / N slots per stage-1 row (at most that many are used). Rows, handle and counts as the two-stage
    model; combine with the documented rounding and within the bound of the flat combine; gradients as
    the flat ops'; FP8 rows as the flat FP8 dispatch's."""
    rng = np.random.default_rng(31 + nodes)
    cfg = jax_ep.EPConfig(8, K, H, T, axis_name="local", backend="reference", dispatch_dtype="bfloat16")
    ranks, experts = nodes * local, cfg.num_experts
    x, idx, w = random_inputs(rng, ranks, experts)

    def f(x, i, w):
        d = jax_ep.dispatch_hierarchical(x, i, w, cfg, "node")
        return d, d.row_weights, jax_ep.combine_hierarchical(d.x, d.handle, cfg, "node")

    d, row_weights, out = run(f, nodes, local, x, idx, w)
    assert d.handle.local.token_rows.shape[-1] == min(K, experts // nodes)
    want = model(x.astype(jnp.bfloat16), idx, w, nodes, local, experts, cfg.resolved_capacity(ranks), 1)
    for g, m in enumerate(want):
        np.testing.assert_array_equal(d.handle.local.src_index[g], m["src"], err_msg=f"GPU {g} src_index")
        np.testing.assert_array_equal(d.x[g].view(np.uint16), m["rows"].view(np.uint16), err_msg=f"GPU {g}")
        np.testing.assert_array_equal(row_weights[g], m["weights"], err_msg=f"GPU {g} row weights")
        np.testing.assert_array_equal(d.expert_counts[g], m["expert_counts"])
    np.testing.assert_array_equal(out.view(np.uint16), emulate_combine(d.x, d, nodes, local).view(np.uint16))
    flat_cfg = cfg.replace(axis_name="ep")

    def flat_fn(x, i, w):
        fd = jax_ep.dispatch(x, i, w, flat_cfg)
        return fd, jax_ep.combine(fd.x, fd.handle, flat_cfg)

    flat_d, flat = run_flat(flat_fn, ranks, x, idx, w)
    np.testing.assert_array_equal(d.expert_counts, flat_d.expert_counts)
    xb = np.asarray(x.astype(jnp.bfloat16)).astype(np.float64)
    wk = np.where(sanitize(np.asarray(idx), experts) >= 0, np.asarray(w), 0.0)
    bound = 3.1 * 2.0 ** -8 * np.abs(xb) * np.abs(wk).sum(-1, keepdims=True)
    assert np.all(np.abs(out.astype(np.float64) - flat.astype(np.float64)) <= bound)

    assert_gradients_match_flat(cfg.replace(dispatch_dtype=None), nodes, local, x, idx, w, rng)

    fp8 = cfg.replace(dispatch_dtype=FP8, hidden=128)
    x8 = jnp.asarray(fp8_tokens(rng, ranks, 128))
    hd = run(lambda x, i, w: jax_ep.dispatch_hierarchical(x, i, w, fp8, "node"), nodes, local, x8, idx, w)
    fd = run_flat(lambda x, i, w: jax_ep.dispatch(x, i, w, fp8.replace(axis_name="ep")), ranks, x8, idx, w)
    sources = row_sources(hd, nodes, local)
    flat_src = np.where(fd.handle.src_index >= 0, fd.handle.src_index, -1)
    for g in range(ranks):
        got = rows_by_pair(hd.x[g], hd.scales[g], hd.group_sizes[g], sources[g])
        assert got == rows_by_pair(fd.x[g], fd.scales[g], fd.group_sizes[g], flat_src[g]), f"GPU {g} FP8"


def test_checked_mode_and_drop_accounting():
    nodes, local = 2, 4
    rng = np.random.default_rng(5)
    cfg = hier_cfg(nodes, local, checked=True)
    ranks = nodes * local
    x, idx, w = random_inputs(rng, ranks, cfg.num_experts, messy=False)
    routed = int((np.asarray(idx) >= 0).sum())

    def f(cfg):
        def body(x, i, w):
            d = jax_ep.dispatch_hierarchical(x, i, w, cfg, "node")
            return d.expert_counts, d.num_dropped
        return body

    counts, dropped = jax_ep.run_checked(lambda: run(f(cfg), nodes, local, x, idx, w))
    assert counts.sum() == routed and dropped.sum() == 0
    # the capacity a flat dispatch needs is the one named: the same pairs land on each GPU
    flat_cfg = cfg.replace(axis_name="ep", checked=False, capacity=4)
    flat_dropped = run_flat(lambda x, i, w: jax_ep.dispatch(x, i, w, flat_cfg).num_dropped, ranks, x, idx, w)
    with pytest.raises(jax_ep.EPValueError) as e:
        jax_ep.run_checked(lambda: run(f(cfg.replace(capacity=4)), nodes, local, x, idx, w))
    needed = max(np.bincount(np.asarray(idx).reshape(-1) // (cfg.num_experts // ranks), minlength=ranks))
    assert (f"jax_ep.dispatch_hierarchical: EPConfig.capacity=4 is too small: {flat_dropped.sum()} rows "
            f"dropped across the EP group; capacity needed: {needed}") in str(e.value)
    counts, dropped = run(f(cfg.replace(capacity=4, checked=False)), nodes, local, x, idx, w)
    assert counts.sum() + dropped.sum() == routed and dropped.sum() == flat_dropped.sum()
    bad = idx.at[3, 1, 0].set(cfg.num_experts + 5)
    with pytest.raises(jax_ep.EPValueError, match=r"dispatch_hierarchical: topk_idx has 1 ids outside "
                                                  rf"\[-1, {cfg.num_experts}\).*first bad value "
                                                  rf"{cfg.num_experts + 5}"):
        jax_ep.run_checked(lambda: run(f(cfg), nodes, local, x, bad, w))
    # no tokens: nothing dropped, no error (the stage-2 count varied over the local axis only, and the
    # check's sum over both axes failed to trace before 2026-12-05)
    empty = (np.zeros((ranks, 0, H), np.float32), np.zeros((ranks, 0, K), np.int32),
             np.zeros((ranks, 0, K), np.float32))
    counts, dropped = jax_ep.run_checked(lambda: run(f(cfg), nodes, local, *empty))
    assert counts.sum() == 0 and dropped.sum() == 0


@parametrize_slow_tail("nodes,local", [(2, 4), (4, 2)])
def test_stage_one_sends_one_row_per_token_and_node(nodes, local):
    """Counted from the handle: each token sends one stage-1 row per node holding any of its experts,
    never more, so a node cap of 1 (gating's max_nodes_per_token) bounds it to one row; the flat
    dispatch would send one per rank."""
    rng = np.random.default_rng(3)
    ranks, experts = nodes * local, 4 * nodes * local
    cfg = jax_ep.EPConfig(experts, 4, H, T, axis_name="local", backend="reference")
    router = RouterConfig(experts, 4, ep_size=ranks, ranks_per_node=local, max_nodes_per_token=1)
    logits = jnp.asarray(rng.standard_normal((ranks, T, experts)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((ranks, T, H)), jnp.float32)
    for cap in (router, dataclasses.replace(router, max_nodes_per_token=None)):
        def f(x, logits, cap=cap):
            r = route(logits, cap)
            d = jax_ep.dispatch_hierarchical(x, r.topk_idx, r.topk_weights, cfg, "node")
            return d.handle.node.is_token_in_rank, d.num_tokens_per_node, r.topk_idx

        sent, received, idx = run(f, nodes, local, x, logits)
        want = np.array([[len({int(e) // (experts // nodes) for e in idx[g, t]}) for t in range(T)]
                         for g in range(ranks)])
        np.testing.assert_array_equal(sent.sum(-1), want)
        assert received.sum() == want.sum()   # what the GPUs received is what was sent
        if cap.max_nodes_per_token == 1:
            assert np.all(sent.sum(-1) == 1)
        else:
            assert np.any(sent.sum(-1) > 1)
            per_rank = np.array([[len({int(e) // (experts // ranks) for e in idx[g, t]}) for t in range(T)]
                                 for g in range(ranks)])
            assert per_rank.sum() > want.sum()  # fewer rows cross the network than a flat dispatch sends


def test_argument_errors():
    nodes, local = 2, 2
    rng = np.random.default_rng(0)
    cfg = hier_cfg(nodes, local)
    x, idx, w = random_inputs(rng, 4, cfg.num_experts)

    def call(cfg, node_axis="node"):
        return run(lambda x, i, w: jax_ep.dispatch_hierarchical(x, i, w, cfg, node_axis).x, nodes, local,
                   x, idx, w)

    with pytest.raises(ValueError, match="node_axis='local' must differ from cfg.axis_name 'local'"):
        call(cfg, "local")
    with pytest.raises(ValueError, match="node_axis='rack'"):
        call(cfg, "rack")
    with pytest.raises(ValueError, match="num_experts=6 is not divisible by the EP size 4"):
        call(cfg.replace(num_experts=6))
    with pytest.raises(ValueError, match=r"FP8 rows of hidden=100 cannot be packed for stage 2: hidden must "
                                         r"be a positive multiple of 128"):
        fp8_packed_width(100)
    with pytest.raises(ValueError, match="dispatch_hierarchical: x has hidden size 16 but cfg.hidden=32"):
        call(cfg.replace(hidden=32))
    with pytest.raises(TypeError, match="handle must be the HierarchicalHandle of dispatch_hierarchical "
                                        r".*got Handle \(the handle of another op: pass it to jax_ep"):
        run(lambda x, i, w: jax_ep.combine_hierarchical(
            x, jax_ep.dispatch_hierarchical(x, i, w, cfg, "node").handle.local, cfg, "node"),
            nodes, local, x, idx, w)
    # y is checked against the handle naming combine_hierarchical (it named the stage's combine)
    for bad_y, match in ((lambda d: d.x[1:], r"jax_ep.combine_hierarchical: y must have shape \[capacity="),
                         (lambda d: d.x.astype(jnp.int32), "jax_ep.combine_hierarchical: y must be float")):
        with pytest.raises(ValueError, match=match):
            run(lambda x, i, w, bad_y=bad_y: jax_ep.combine_hierarchical(
                bad_y(d := jax_ep.dispatch_hierarchical(x, i, w, cfg, "node")), d.handle, cfg, "node"),
                nodes, local, x, idx, w)
    # shrink mode (the kernels' rank masking) is not built for the composition: refused, not lowered,
    # wherever the kernels may run; the reference has no shrink mode and runs as ever
    with pytest.raises(NotImplementedError, match=r"dispatch_hierarchical: EPConfig\(shrink=True\)"):
        call(cfg.replace(shrink=True, backend="auto"))
    call(cfg.replace(shrink=True, backend="reference"))


# ---- FP8 ------------------------------------------------------------------------------------------
FP8 = "float8_e4m3fn"


def fp8_tokens(rng, ranks: int, hidden: int) -> np.ndarray:
    """[R, T, hidden] float32 tokens with the quantisation's edge cases: an all-zero block (scale
    1e-4 / 448), a block whose amax sits on one large channel, -0.0."""
    spread = rng.choice([0.01, 1.0, 30.0], (ranks, T, 1))
    x = (rng.standard_normal((ranks, T, hidden)) * spread).astype(np.float32)
    x[0, 1, :128] = 0.0
    x[-1, -1, 5] = 448.0 * 4
    x[0, 2, 7] = -0.0
    return x


def row_sources(d, nodes: int, local: int) -> np.ndarray:
    """[N*L, C] global source token (GPU g_src * T + t) of each expert-major row, -1 for empty rows, from
    both handles: row -> stage-2 slot l_src * N*T + i -> stage-1 row i of GPU (n, l_src) -> its source
    slot s * T + t -> GPU s * L + l_src."""
    src = d.handle.local.src_index
    out = np.full(src.shape, -1, np.int64)
    for g in range(nodes * local):
        n = g // local
        for r, slot in enumerate(src[g]):
            if slot < 0:
                continue
            l_src, i = divmod(int(slot), nodes * T)
            stage1 = int(d.handle.node.src_index[n * local + l_src, i])
            s, t = divmod(stage1, T)
            out[g, r] = (s * local + l_src) * T + t
    return out


def rows_by_pair(x, scales, group_sizes, sources) -> dict:
    """{(source token, local expert): (row bytes, scale bytes)} of one GPU's filled rows."""
    ends = np.cumsum(group_sizes)
    return {(int(src), int(np.searchsorted(ends, r, side="right"))):
            (x[r].view(np.uint8).tobytes(), scales[r].view(np.uint8).tobytes())
            for r, src in enumerate(sources) if src >= 0}


@parametrize_slow_tail("nodes,local", MESHES)
@parametrize_slow_tail("hidden,align", [(384, 4), (1024, 1)])
def test_fp8_rows_and_scales_are_the_flat_fp8_dispatch(nodes, local, hidden, align):
    """FP8 rows and scales bit for bit: each row is its source token's NumPy quantisation (per token,
    per 128 channels, amax / 448), the (token, expert) pairs on each GPU are the flat FP8 dispatch's
    with the same bytes, only their order differs; handles and counts are the bfloat16 path's; empty
    rows are zero. hidden 384 packs with 20 bytes of padding a row, 1024 with none."""
    rng = np.random.default_rng(100 + 10 * nodes + local + hidden)
    cfg = hier_cfg(nodes, local, hidden=hidden, expert_alignment=align, dispatch_dtype=FP8)
    ranks, experts = nodes * local, cfg.num_experts
    _, idx, w = random_inputs(rng, ranks, experts)           # messy: -1, out of range, a repeat
    x = jnp.asarray(fp8_tokens(rng, ranks, hidden))
    assert fp8_packed_width(hidden) * 4 - (hidden + hidden // 32) == (20 if hidden == 384 else 0)

    d = run(lambda x, i, w: jax_ep.dispatch_hierarchical(x, i, w, cfg, "node"), nodes, local, x, idx, w)
    cap = cfg.resolved_capacity(ranks)
    assert d.x.dtype == ml_dtypes.float8_e4m3fn and d.x.shape == (ranks, cap, hidden)
    assert d.scales.dtype == np.float32 and d.scales.shape == (ranks, cap, hidden // 128)

    # the same routing on a bfloat16 wire: handles and counts unchanged by FP8
    bf16 = run(lambda x, i, w: jax_ep.dispatch_hierarchical(x, i, w, cfg.replace(dispatch_dtype="bfloat16"),
                                                            "node"), nodes, local, x, idx, w)
    for a, b in zip(jax.tree.leaves((d.handle, d.group_sizes, d.expert_counts, d.num_dropped,
                                     d.num_tokens_per_node)),
                    jax.tree.leaves((bf16.handle, bf16.group_sizes, bf16.expert_counts, bf16.num_dropped,
                                     bf16.num_tokens_per_node)), strict=True):
        np.testing.assert_array_equal(a, b)

    q, s = nm.quantize_fp8(np.asarray(x).reshape(ranks * T, hidden))
    sources = row_sources(d, nodes, local)
    filled = sources >= 0
    assert filled.sum() == int((sanitize(np.asarray(idx), experts) >= 0).sum())
    np.testing.assert_array_equal(d.x[filled].view(np.uint8), q[sources[filled]].view(np.uint8))
    np.testing.assert_array_equal(d.scales[filled].view(np.uint32), s[sources[filled]].view(np.uint32))
    assert not d.x[~filled].view(np.uint8).any() and not d.scales[~filled].view(np.uint32).any()

    flat_cfg = cfg.replace(axis_name="ep")
    flat = run_flat(lambda x, i, w: jax_ep.dispatch(x, i, w, flat_cfg), ranks, x, idx, w)
    np.testing.assert_array_equal(d.group_sizes, flat.group_sizes)
    flat_src = np.where(flat.handle.src_index >= 0, flat.handle.src_index, -1)  # slot s * T + t, s global
    for g in range(ranks):
        got = rows_by_pair(d.x[g], d.scales[g], d.group_sizes[g], sources[g])
        want = rows_by_pair(flat.x[g], flat.scales[g], flat.group_sizes[g], flat_src[g])
        assert got == want, f"GPU {g}: FP8 rows / scales differ from the flat FP8 dispatch's"
    if local > 1:  # the row order is the hierarchical one (else this compares nothing order-dependent)
        assert any(not np.array_equal(sources[g][filled[g]], flat_src[g][flat_src[g] >= 0])
                   for g in range(ranks))


@parametrize_slow_tail("nodes,local", MESHES)
def test_fp8_then_combine(nodes, local):
    """combine_hierarchical after an FP8 dispatch, on bfloat16 expert outputs (the dequantised rows
    scaled per row): the documented rounding bit for bit; checked mode passes with no drops."""
    rng = np.random.default_rng(200 + nodes)
    hidden = 256
    cfg = hier_cfg(nodes, local, hidden=hidden, expert_alignment=2, dispatch_dtype=FP8, checked=True)
    ranks = nodes * local
    _, idx, w = random_inputs(rng, ranks, cfg.num_experts)
    idx = jnp.where(idx >= cfg.num_experts, -1, idx)         # checked mode: -1 and repeats only
    x = jnp.asarray(fp8_tokens(rng, ranks, hidden))

    def f(x, i, w):
        d = jax_ep.dispatch_hierarchical(x, i, w, cfg, "node")
        y = (jax_ep.dequantize_fp8(d.x, d.scales) * (1.0 + d.row_weights[:, None])).astype(jnp.bfloat16)
        return d, y, jax_ep.combine_hierarchical(y, d.handle, cfg, "node")

    d, y, out = jax_ep.run_checked(lambda: run(f, nodes, local, x, idx, w))
    assert out.dtype == jnp.bfloat16 and out.shape == (ranks, T, hidden)
    np.testing.assert_array_equal(out.view(np.uint16), emulate_combine(y, d, nodes, local).view(np.uint16))
    routed = sanitize(np.asarray(idx), cfg.num_experts) >= 0
    assert np.all((np.abs(out.astype(np.float32)).sum(-1) > 0) == routed.any(-1))


def test_fp8_is_forward_only():
    """jax.grad through an FP8 dispatch_hierarchical raises the flat FP8 dispatch's error, naming the
    op (in x and in the gate weights); the forward pass runs."""
    nodes, local, hidden = 2, 2, 128
    rng = np.random.default_rng(9)
    cfg = hier_cfg(nodes, local, hidden=hidden, dispatch_dtype=FP8)
    _, idx, w = random_inputs(rng, nodes * local, cfg.num_experts)
    x = jnp.asarray(fp8_tokens(rng, nodes * local, hidden))

    def per_gpu(x, i, w):
        d = jax_ep.dispatch_hierarchical(x, i, w, cfg, "node")
        # the rows by hand: differentiated, dequantize_fp8 raises its own error (q) before the op's
        return jnp.sum(d.x.astype(jnp.float32) * d.scales * d.row_weights[:, None])

    assert np.isfinite(run(per_gpu, nodes, local, x, idx, w)).all()
    for argnum in (0, 2):
        with pytest.raises(NotImplementedError, match=r"jax_ep: dispatch_hierarchical with "
                                                      r"dispatch_dtype='float8_e4m3fn' is forward-only"):
            run(lambda *a, argnum=argnum: jax.grad(per_gpu, argnums=argnum)(*a), nodes, local, x, idx, w)
    flat_cfg = cfg.replace(axis_name="ep")   # the flat op's error, for the same call
    with pytest.raises(NotImplementedError, match=r"jax_ep: dispatch with dispatch_dtype='float8_e4m3fn' is "
                                                  r"forward-only \(inference and prefill\); to train"):
        run_flat(lambda x, i, w: jax.grad(lambda x: jnp.sum(
            (lambda d: d.x.astype(jnp.float32) * d.scales)(jax_ep.dispatch(x, i, w, flat_cfg))))(x),
            nodes * local, x, idx, w)


def special_words(rng, n: int) -> np.ndarray:
    """n uint32 words, most of them what XLA could alter if it computed on them: NaNs with payloads
    (either sign, quiet and signalling), subnormals, infinities, -0.0; the rest random."""
    words = rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32)
    kind = rng.integers(0, 4, n)
    words = np.where(kind == 0, words | np.uint32(0x7F800000), words)    # NaN (or inf: zero payload)
    words = np.where(kind == 1, words & np.uint32(0x807FFFFF), words)    # subnormal (or +-0.0)
    words[:4] = [0x7F800001, 0xFF800000, 0x80000000, 0x7FC00001]
    return words


def test_stage_two_copies_every_bit_pattern():
    """The premise of the packed FP8 rows: a dispatch with dispatch_dtype None moves float32 rows
    without arithmetic, so NaN payloads, subnormals, infinities and -0.0 arrive unchanged; pack /
    unpack are inverse on arbitrary bytes; and the whole packed stage 2 (pack, dispatch, unpack)
    returns arbitrary FP8 bytes and scale words bit for bit."""
    rng = np.random.default_rng(4)
    ranks, tokens, width = 2, 16, 1024
    words = special_words(rng, ranks * tokens * width).reshape(ranks, tokens, width)
    x = jnp.asarray(words.view(np.float32))
    idx = jnp.asarray(np.tile([[0, 1]], (ranks, tokens, 1)).astype(np.int32))  # every token to both ranks
    w = jnp.ones((ranks, tokens, 2), jnp.float32)
    cfg = jax_ep.EPConfig(2, 2, width, tokens, backend="reference")
    d = run_flat(lambda x, i, w: jax_ep.dispatch(x, i, w, cfg), ranks, x, idx, w)
    for r in range(ranks):
        src = d.handle.src_index[r]
        assert (src >= 0).sum() == ranks * tokens
        np.testing.assert_array_equal(d.x[r][src >= 0].view(np.uint32),
                                      words.reshape(ranks * tokens, width)[src[src >= 0]])

    hidden = 384
    raw = rng.integers(0, 256, (ranks, tokens, hidden), dtype=np.uint8)
    scale_words = special_words(rng, ranks * tokens * 3).reshape(ranks, tokens, 3)
    q, s = raw.view(ml_dtypes.float8_e4m3fn), scale_words.view(np.float32)
    packed = hierarchical._pack_fp8_rows(jnp.asarray(q[0]), jnp.asarray(s[0]))
    assert packed.dtype == jnp.float32 and packed.shape == (tokens, fp8_packed_width(hidden)) == (tokens, 104)
    assert not np.asarray(packed).view(np.uint8)[:, hidden + 12:].any()   # 20 bytes of zero padding
    q2, s2 = hierarchical._unpack_fp8_rows(packed, hidden)
    np.testing.assert_array_equal(np.asarray(q2).view(np.uint8), raw[0])
    np.testing.assert_array_equal(np.asarray(s2).view(np.uint32), scale_words[0])

    local_cfg = jax_ep.EPConfig(2, 2, hidden, tokens, backend="reference", dispatch_dtype=FP8)

    def stage_two(q, s, i, w):
        d = jax_ep.dispatch(hierarchical._pack_fp8_rows(q, s), i, w, hierarchical._packed_config(local_cfg))
        return d.handle.src_index, *hierarchical._unpack_fp8_rows(d.x, hidden)

    src, q_got, s_got = run_flat(stage_two, ranks, jnp.asarray(q), jnp.asarray(s), idx, w)
    for r in range(ranks):
        filled = src[r] >= 0
        np.testing.assert_array_equal(q_got[r][filled].view(np.uint8),
                                      raw.reshape(-1, hidden)[src[r][filled]])
        np.testing.assert_array_equal(s_got[r][filled].view(np.uint32),
                                      scale_words.reshape(-1, 3)[src[r][filled]])


# ---- the MoE layer ---------------------------------------------------------------------------------
def layer_pair(nodes, local, hidden=H, ep=None, **kw):
    ranks = nodes * local
    require_devices(ranks)
    routing = RouterConfig(4 * ranks, 3, ranks_per_node=local, max_nodes_per_token=max(1, nodes - 1))
    flat_mesh = Mesh(np.array(jax.devices()[:ranks]), ("ep",))
    ep = moe.EPOptions(backend="reference") if ep is None else ep
    # the gate weights in combine on the flat layer too: what the hierarchical layer's "auto" resolves to
    flat = moe.MoE(hidden, 8, routing, rngs=nnx.Rngs(0), mesh=flat_mesh,
                   ep=dataclasses.replace(ep, gate_weights="combine"), **kw)
    hier = moe.MoE(hidden, 8, routing, rngs=nnx.Rngs(0), mesh=mesh2d(nodes, local), axis_name="local",
                   node_axis="node", ep=ep, **kw)
    return flat, hier


@parametrize_slow_tail("nodes,local", MESHES, fast=(1,))
def test_layer_matches_the_flat_layer(nodes, local):
    """MoE(node_axis=...) on the (node, local) mesh against the flat layer on the same GPUs and
    parameters (float32): output, loads, and gradients in x and every parameter, within float32
    rounding (the hierarchical combine rounds the in-node partial sums once more; ~1e-7 relative)."""
    flat, hier = layer_pair(nodes, local)
    ranks = nodes * local
    x = jax.random.normal(jax.random.key(nodes + 2 * local), (ranks * 2 * T, H), jnp.float32)

    def value_and_grads(layer, spec):
        xs = jax.device_put(x, NamedSharding(layer.mesh, spec))
        graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

        @jax.jit
        def step(params, x):
            def loss(params, x):
                out = nnx.merge(graphdef, params, rest)(x, update_stats=False)
                return jnp.sum(jnp.sin(out) * out), out
            return jax.grad(loss, argnums=(0, 1), has_aux=True)(params, x)

        (g_params, g_x), out = step(params, xs)
        nnx.jit(lambda m, x: m(x))(layer, xs)   # records the statistics (rows per expert)
        return (np.asarray(out), np.asarray(g_x), jax.tree.map(np.asarray, g_params),
                np.asarray(layer.last_load[...]))

    out_f, gx_f, gp_f, load_f = value_and_grads(flat, P("ep"))
    out_h, gx_h, gp_h, load_h = value_and_grads(hier, P(GROUP))
    close = lambda got, want, what: np.testing.assert_allclose(  # noqa: E731
        got, want, rtol=0, atol=1e-5 * np.abs(want).max(), err_msg=what)
    close(out_h, out_f, "output")
    close(gx_h, gx_f, "d x")
    for (path, got), (_, want) in zip(jax.tree_util.tree_leaves_with_path(gp_h),
                                      jax.tree_util.tree_leaves_with_path(gp_f), strict=True):
        close(got, want, jax.tree_util.keystr(path))
    np.testing.assert_array_equal(load_h, load_f)
    assert load_h.sum() == x.shape[0] * 3


def test_layer_without_a_mesh_sums_its_statistics_over_both_axes():
    """MoE(mesh=None, node_axis=...) inside the caller's shard_map over (node, local): batch_axes default to
    both EP axes (before 2026-12-05 the local one only: the loads counted one node's tokens), the loads
    equal the layer built with the mesh."""
    _, hier = layer_pair(2, 2)
    mesh = hier.mesh
    routing = hier.routing
    per_rank = moe.MoE(H, 8, routing, rngs=nnx.Rngs(0), axis_name="local", node_axis="node",
                       ep=moe.EPOptions(backend="reference"))
    assert per_rank.batch_axes == GROUP
    x = jax.random.normal(jax.random.key(7), (4 * 2 * T, H), jnp.float32)
    graphdef, params, rest = nnx.split(per_rank, nnx.Param, ...)
    specs = jax.tree.map(lambda _: P(), params)
    for name in ("w_gate_up", "w_down"):
        specs[name] = P(GROUP)

    def body(params, rest, x):
        layer = nnx.merge(graphdef, params, rest)
        out = layer(x)
        return out, nnx.state(layer, nnx.Not(nnx.Param))

    out, state = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, P(), P(GROUP)),
                                       out_specs=(P(GROUP), P())))(params, rest, x)
    out_h = nnx.jit(lambda m, x: m(x))(hier, jax.device_put(x, NamedSharding(mesh, P(GROUP))))
    np.testing.assert_allclose(np.asarray(out), np.asarray(out_h), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(state["last_load"][...]), np.asarray(hier.last_load[...]))
    assert int(np.asarray(state["last_load"][...]).sum()) == x.shape[0] * K


@pytest.mark.slow
@parametrize_slow_tail("nodes,local", [(2, 4), (2, 1)])
def test_layer_fp8_forward_matches_the_flat_fp8_layer(nodes, local):
    """MoE(node_axis=..., ep=EPOptions(dispatch_dtype=FP8)): the forward pass gives the flat FP8
    layer's output (the same dequantised rows reach the same experts; within float32 rounding of the
    in-node partial sums) and loads; jax.grad raises the FP8 forward-only error, where the flat layer
    trains with its FP8 wire (jax_ep.ops.dispatch_straight_through: finite gradients)."""
    hidden = 128
    flat, hier = layer_pair(nodes, local, hidden, moe.EPOptions(backend="reference", dispatch_dtype=FP8))
    ranks = nodes * local
    x = jax.random.normal(jax.random.key(5 + nodes + local), (ranks * 2 * T, hidden), jnp.float32)

    def forward(layer, spec):
        xs = jax.device_put(x, NamedSharding(layer.mesh, spec))
        out = nnx.jit(lambda m, x: m(x))(layer, xs)
        return np.asarray(out), np.asarray(layer.last_load[...])

    out_f, load_f = forward(flat, P("ep"))
    out_h, load_h = forward(hier, P(GROUP))
    assert np.abs(out_f).max() > 0
    np.testing.assert_allclose(out_h, out_f, rtol=0, atol=1e-5 * np.abs(out_f).max())
    np.testing.assert_array_equal(load_h, load_f)
    grad = nnx.jit(lambda m, x: jax.grad(lambda x: jnp.sum(m(x, update_stats=False)))(x))
    g_flat = np.asarray(grad(flat, jax.device_put(x, NamedSharding(flat.mesh, P("ep")))))
    assert np.isfinite(g_flat).all() and np.abs(g_flat).max() > 0
    with pytest.raises(NotImplementedError, match=r"dispatch_hierarchical with "
                                                  r"dispatch_dtype='float8_e4m3fn' is forward-only"):
        grad(hier, jax.device_put(x, NamedSharding(hier.mesh, P(GROUP))))


def test_layer_validates_the_node_layout():
    require_devices(8)
    mesh = mesh2d(2, 4)
    with pytest.raises(ValueError, match=r"routing.ranks_per_node=2, but with node_axis='node' a node is the "
                                         r"mesh axis 'local' of 4 ranks; set ranks_per_node=4"):
        moe.MoE(H, 8, RouterConfig(16, 2, ranks_per_node=2), rngs=nnx.Rngs(0), mesh=mesh,
                axis_name="local", node_axis="node")
    with pytest.raises(ValueError, match="node_axis='rack' is not an axis of the mesh"):
        moe.MoE(H, 8, RouterConfig(16, 2), rngs=nnx.Rngs(0), mesh=mesh, axis_name="local", node_axis="rack")
    with pytest.raises(ValueError, match="node_axis must be a mesh axis name other than axis_name='local'"):
        moe.MoE(H, 8, RouterConfig(16, 2), rngs=nnx.Rngs(0), mesh=mesh, axis_name="local", node_axis="local")
    with pytest.raises(NotImplementedError, match="no decode path"):
        moe.MoE(H, 8, RouterConfig(16, 2), rngs=nnx.Rngs(0), mesh=mesh, axis_name="local", node_axis="node",
                decode=True)
    layer = moe.MoE(H, 8, RouterConfig(16, 2), rngs=nnx.Rngs(0), mesh=mesh, axis_name="local",
                    node_axis="node")
    assert layer.mesh_ep_size == 8 and layer.ep_axes == GROUP
    assert layer.w_gate_up[...].sharding.spec[0] == GROUP   # experts over both axes, node-major
    with pytest.raises(NotImplementedError, match="rank masking"):
        layer.set_rank_mask(np.ones(8, bool))


@pytest.mark.parametrize("wire", [None, FP8])
def test_cuda_backend_lowers_each_stage_on_its_own_axis(monkeypatch, wire):
    """backend='cuda' traces on any machine: stage 1 is the rank-major custom calls over the node axis
    (num_ranks = N), stage 2 the expert-major ones over the local axis (num_ranks = L, T = N*T), each
    in its own directory slot; axis names that share a slot are refused. FP8: stage 1 carries FP8 rows
    and their scales (row_bytes H, scale_bytes 4 H/128), stage 2 the packed float32 rows
    (row_bytes 4 * fp8_packed_width(H), no scales)."""
    import zlib

    lower_cuda_here(monkeypatch, stub_extension=False)
    nodes, local = 2, 4
    hidden = H if wire is None else 256
    cfg = hier_cfg(nodes, local, backend="cuda", hidden=hidden, dispatch_dtype=wire)
    _, idx, w = random_inputs(np.random.default_rng(1), 8, cfg.num_experts)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((8, T, hidden)), jnp.bfloat16)
    spec = P(GROUP)

    def body(x, i, w):
        d = jax_ep.dispatch_hierarchical(x[0], i[0], w[0], cfg, "node")
        y = d.x if wire is None else jax_ep.dequantize_fp8(d.x, d.scales, jnp.bfloat16)
        return jax_ep.combine_hierarchical(y, d.handle, cfg, "node")[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh2d(nodes, local), in_specs=(spec,) * 3, out_specs=spec))
    text = f.lower(x, idx, w).as_text()
    calls = {}
    for line in text.splitlines():
        if "stablehlo.custom_call @jax_ep" in line:
            calls.setdefault(line.split("@")[1].split("(")[0], []).append(line)
    assert set(calls) == {"jax_ep_dispatch_rank_major", "jax_ep_dispatch", "jax_ep_combine",
                          "jax_ep_combine_rank_major"}, sorted(calls)
    slot = {a: zlib.crc32(a.encode()) % 4 for a in GROUP}
    for name, ranks, slot_of, tokens in (("jax_ep_dispatch_rank_major", nodes, slot["node"], T),
                                         ("jax_ep_combine_rank_major", nodes, slot["node"], T),
                                         ("jax_ep_dispatch", local, slot["local"], nodes * T),
                                         ("jax_ep_combine", local, slot["local"], nodes * T)):
        line = calls[name][0]
        assert f"num_ranks = {ranks} " in line and f"axis_slot = {slot_of} " in line, line
        if "dispatch" in name:
            assert f"num_tokens = {tokens} " in line, line
    bytes_of = {"jax_ep_dispatch_rank_major": (2 * hidden, 0), "jax_ep_dispatch": (2 * hidden, 0)}
    if wire == FP8:
        bytes_of = {"jax_ep_dispatch_rank_major": (hidden, 4 * hidden // 128),
                    "jax_ep_dispatch": (4 * fp8_packed_width(hidden), 0)}
    for name, (row_bytes, scale_bytes) in bytes_of.items():
        line = calls[name][0]
        assert f"row_bytes = {row_bytes} " in line and f"scale_bytes = {scale_bytes} " in line, line
    clash = next(f"a{i}" for i in range(100) if zlib.crc32(f"a{i}".encode()) % 4 == slot["local"])
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), (clash, "local"))

    def clashing(x, i, w):
        return jax_ep.dispatch_hierarchical(x[0], i[0], w[0], cfg, clash).x[None]

    with pytest.raises(ValueError, match=f"share the CUDA kernels' directory slot {slot['local']}"):
        jax.jit(jax.shard_map(clashing, mesh=mesh, in_specs=(P((clash, "local")),) * 3,
                              out_specs=P((clash, "local")))).lower(x, idx, w)


def test_node_hop_takes_cfg_transport_and_local_axis_loads_stores(monkeypatch):
    """backend='cuda', KernelConfig(transport='put') (test 3b's forcing, process model 2 simulated):
    the node hop's rank-major calls go over NVSHMEM puts (transport = 1), the local axis's expert-major
    calls over loads / stores (transport = 0), which alone they have."""
    from jax_ep import KernelConfig, runtime

    lower_cuda_here(monkeypatch, stub_extension=False)
    monkeypatch.setattr(runtime, "process_model", lambda: "process_per_gpu")
    monkeypatch.setattr(runtime, "unreachable_processes", lambda: [])
    nodes, local = 2, 4
    cfg = hier_cfg(nodes, local, backend="cuda").replace(kernel=KernelConfig(transport="put"))
    x, idx, w = random_inputs(np.random.default_rng(2), 8, cfg.num_experts, dtype=jnp.bfloat16)
    spec = P(GROUP)

    def body(x, i, w):
        d = jax_ep.dispatch_hierarchical(x[0], i[0], w[0], cfg, "node")
        return jax_ep.combine_hierarchical(d.x, d.handle, cfg, "node")[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh2d(nodes, local), in_specs=(spec,) * 3, out_specs=spec))
    seen = {}
    for line in f.lower(x, idx, w).as_text().splitlines():
        if "stablehlo.custom_call @jax_ep" in line:
            name = line.split("@")[1].split("(")[0]
            seen[name] = "transport = 1 " in line
            assert ("transport = 1 " in line) != ("transport = 0 " in line), line
    assert seen == {"jax_ep_dispatch_rank_major": True, "jax_ep_combine_rank_major": True,
                    "jax_ep_dispatch": False, "jax_ep_combine": False}, seen


def test_layer_in_token_chunks_matches_one_chunk():
    """EPOptions(chunks=2) on the hierarchical path (dispatch_hierarchical / combine_hierarchical per
    chunk): output and gradients of x and every parameter equal one chunk's."""
    nodes, local = 2, 2
    one = layer_pair(nodes, local)[1]
    two = layer_pair(nodes, local, ep=moe.EPOptions(backend="reference", chunks=2))[1]
    x = jax.device_put(jax.random.normal(jax.random.key(7), (nodes * local * 2 * T, H), jnp.float32),
                       NamedSharding(one.mesh, P(GROUP)))

    def value_and_grads(layer):
        graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

        def loss(params, x):
            out = nnx.merge(graphdef, params, rest)(x, update_stats=False)
            return jnp.sum(jnp.sin(out) * out), out
        (g_params, g_x), out = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))(params, x)
        return jax.tree.map(np.asarray, (out, g_x, g_params))

    want, got = value_and_grads(one), value_and_grads(two)
    assert np.abs(want[0]).max() > 0
    for (path, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(got),
                                 jax.tree_util.tree_leaves_with_path(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.abs(b).max(),
                                   err_msg=jax.tree_util.keystr(path))
