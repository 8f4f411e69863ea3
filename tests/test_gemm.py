"""grouped_matmul on CPU: lax.ragged_dot semantics (padding rows, empty groups), gradients, argument
errors, the implementation choice, and the Hopper kernel's tile schedule and forward kernel run in
Mosaic GPU's interpret mode (the GPU tests cover the compiled kernels and the transposed passes)."""

import argparse
import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import parametrize_slow_tail

from jax_ep import gemm_mgpu as mgpu
from jax_ep.gemm import explain, grouped_matmul


def dense_reference(x, w, sizes):
    """out[r] = x[r] @ w[group of r], zero past the groups (float64, NumPy)."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    out = np.zeros((x.shape[0], w.shape[2]))
    start = 0
    for g, size in enumerate(np.asarray(sizes)):
        end = min(start + int(size), x.shape[0])
        out[start:end] = x[start:end] @ w[g]
        start = end
    return out


def random_sizes(rng, groups, total):
    """Random group sizes with zeros, summing to `total`."""
    cuts = np.sort(rng.integers(0, total + 1, groups - 1))
    sizes = np.diff(np.concatenate([[0], cuts, [total]])).astype(np.int32)
    sizes[rng.random(groups) < 0.3] = 0
    return sizes


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_forward_and_gradients_match_dense(seed):
    rng = np.random.default_rng(seed)
    m, k, n, g = 40, 12, 10, 5
    sizes = random_sizes(rng, g, int(rng.integers(1, m)))        # rows past the sum are padding
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((g, k, n)), jnp.float32)
    dy = rng.standard_normal((m, n))
    out = grouped_matmul(x, w, jnp.asarray(sizes))
    np.testing.assert_allclose(out, dense_reference(x, w, sizes), rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(out)[sizes.sum():] == 0)

    dx, dw = jax.grad(lambda x, w: jnp.sum(grouped_matmul(x, w, jnp.asarray(sizes)) * dy), (0, 1))(x, w)
    rows = np.repeat(np.arange(g), sizes)                          # group of each real row
    total = sizes.sum()
    xs, ws = np.asarray(x, np.float64), np.asarray(w, np.float64)
    expected_dx = np.zeros((m, k))
    expected_dx[:total] = np.einsum("rn,rkn->rk", dy[:total], ws[rows])
    expected_dw = np.zeros((g, k, n))
    np.add.at(expected_dw, rows, np.einsum("rk,rn->rkn", xs[:total], dy[:total]))
    np.testing.assert_allclose(dx, expected_dx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, expected_dw, rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(dw)[sizes == 0] == 0)                # empty groups get zero gradients


def test_argument_errors_name_the_argument():
    x, w, gs = jnp.ones((8, 4)), jnp.ones((2, 4, 3)), jnp.array([4, 4], jnp.int32)
    with pytest.raises(ValueError, match="x must be 2-D"):
        grouped_matmul(x[None], w, gs)
    with pytest.raises(ValueError, match="w must be 3-D"):
        grouped_matmul(x, w[0], gs)
    with pytest.raises(ValueError, match="x has K=4 but w has K=5"):
        grouped_matmul(x, jnp.ones((2, 5, 3)), gs)
    with pytest.raises(ValueError, match=r"group_sizes must have shape \(2,\)"):
        grouped_matmul(x, w, jnp.array([8], jnp.int32))
    with pytest.raises(ValueError, match="group_sizes must be integer"):
        grouped_matmul(x, w, jnp.array([4.0, 4.0]))
    with pytest.raises(ValueError, match="backend must be one of"):
        grouped_matmul(x, w, gs, backend="cublas")
    # every entry point checks the backend name (an unknown one planned as "auto" before 2026-12-05)
    from jax_ep.gemm import preferred_alignment, weight_gradient

    for call in (lambda: explain(x, w, backend="cublas"), lambda: preferred_alignment(x, w, backend="cublas"),
                 lambda: weight_gradient(x, jnp.ones((8, 3)), gs, backend="cublas")):
        with pytest.raises(ValueError, match="backend must be one of .*got 'cublas'"):
            call()
    with pytest.raises(ValueError, match="x has K=4 but w has K=5"):
        explain(x, jnp.ones((2, 5, 3)))


def test_mixed_dtypes_follow_ragged_dot():
    """x bfloat16 and w float32: the output in the promoted dtype and w's gradient at float32 precision,
    as lax.ragged_dot's (before 2026-12-05 d y was rounded to bfloat16 first)."""
    k = jax.random.split(jax.random.key(5), 3)
    x = jax.random.normal(k[0], (24, 16), jnp.bfloat16)
    w = jax.random.normal(k[1], (3, 16, 8), jnp.float32)
    gs = jnp.array([10, 0, 9], jnp.int32)
    g = jax.random.normal(k[2], (24, 8), jnp.float32)
    assert grouped_matmul(x, w, gs).dtype == jax.lax.ragged_dot(x, w, gs).dtype == jnp.float32

    def grads(f):
        return jax.grad(lambda x, w: jnp.sum(f(x, w, gs) * g), argnums=(0, 1))(x, w)

    got, want = grads(grouped_matmul), grads(jax.lax.ragged_dot)
    assert got[0].dtype == want[0].dtype and got[1].dtype == want[1].dtype
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32), rtol=1e-2)


def test_explain_says_why_the_kernel_is_not_used():
    x = jax.ShapeDtypeStruct((128, 256), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((4, 256, 512), jnp.bfloat16)
    plans = explain(x, w)
    assert set(plans) == {"forward", "dx", "dw"}
    for plan in plans.values():
        assert plan.impl == "ragged_dot" and "not a GPU" in plan.reason
    assert explain(x, w, backend="ragged_dot")["forward"].reason == "backend='ragged_dot'"
    with pytest.raises(ValueError, match="backend='mosaic_gpu' cannot run the forward pass"):
        grouped_matmul(jnp.ones((8, 64)), jnp.ones((2, 64, 64)), jnp.array([4, 4], jnp.int32),
                       backend="mosaic_gpu")


@pytest.mark.parametrize("group_rows", [False, True], ids=["blocks", "group_rows"])
@pytest.mark.parametrize("block_m", [64, 128])
@pytest.mark.parametrize("sizes", [[70, 0, 130, 100], [0, 0, 0, 0], [64, 64, 64, 128], [300, 0, 0, 0],
                                   [1, 1, 1, 300], [500, 0, 0, 0], [64, 128, 64, 64]])
def test_tile_schedule_covers_every_row_once(sizes, block_m, group_rows):
    """Every row of the buffer is stored by exactly one tile of its group (the rows past the groups by
    the zero group's), each tile inside the buffer; with group_rows a group of s rows takes
    cdiv(s, block_m) tiles, never more than the fixed blocks give it."""
    m = 320
    schedule, num_tiles = mgpu.tile_schedule(jnp.asarray(sizes, jnp.int32), m, block_m, group_rows=group_rows)
    schedule, num_tiles = np.asarray(schedule), np.asarray(num_tiles)
    live = int(num_tiles[0])
    group, row0, start, size, first, count = schedule[:, :live]
    assert np.all(size > 0) and np.all(schedule[3, live:] == 0)
    assert np.all(row0 >= 0) and np.all(start + size <= block_m)
    # fixed blocks: the last may pass row m (TMA reads zeros there); group_rows keeps every tile inside
    assert np.all(row0 % block_m == 0) if not group_rows else np.all(row0 + block_m <= m)
    blocks = mgpu.tile_schedule(jnp.asarray(sizes, jnp.int32), m, block_m)[1][0]
    assert live <= int(blocks)
    if group_rows:           # cdiv(rows from the group's first row down to a swizzle atom, block_m)
        ends = np.minimum(np.cumsum(sizes), m)
        starts = np.concatenate([[0], ends])
        ends = np.concatenate([ends, [m]])
        from_atom = np.where(ends > starts, ends - starts // mgpu.ROW_ALIGN * mgpu.ROW_ALIGN, 0)
        assert live == int(np.sum(-(-from_atom // block_m)))
        assert np.all(row0 % mgpu.ROW_ALIGN == 0)
    # the group-major order (_row_tiles with GROUP_MAJOR) visits every (row tile, column tile) once,
    # each group's row tiles together for one column tile at a time
    grid_n = 3
    lin = np.arange(live * grid_n)
    f, c = first[lin // grid_n], count[lin // grid_n]
    mi, ni = f + (lin - f * grid_n) % c, (lin - f * grid_n) // c
    assert sorted(zip(mi.tolist(), ni.tolist(), strict=True)) == [(a, b) for a in range(live)
                                                                   for b in range(grid_n)]
    assert np.all(group[mi] == group[lin // grid_n]) and np.all(np.diff(group[mi]) >= 0)
    owner = np.full(m, -1)
    for gi, r, s, n in zip(group, row0, start, size, strict=True):
        rows = np.arange(r + s, r + s + n)
        assert np.all(owner[rows] == -1), "a row is covered twice"
        owner[rows] = gi
    ends = np.minimum(np.cumsum(sizes), m)
    expected = np.searchsorted(ends, np.arange(m), side="right")    # group of each row; len(sizes) = zero
    np.testing.assert_array_equal(owner, expected)


@pytest.mark.parametrize("sizes", [[70, 0, 130, 100], [0, 0, 0, 0], [64, 64, 64, 128], [1, 1, 1, 300]])
def test_tile_schedule_without_zero_tail_visits_only_the_groups(sizes):
    """zero_tail=False: the same tiles for the groups' rows, none for the rows past them (which the
    kernel then leaves unwritten)."""
    m, block_m = 320, 64
    gs = jnp.asarray(sizes, jnp.int32)
    full, full_tiles = (np.asarray(a) for a in mgpu.tile_schedule(gs, m, block_m))
    groups, tiles = (np.asarray(a) for a in mgpu.tile_schedule(gs, m, block_m, zero_tail=False))
    live, n = int(full_tiles[0]), int(tiles[0])
    in_groups = full[0, :live] < len(sizes)
    assert n == int(in_groups.sum()) and np.all(groups[0, :n] < len(sizes))
    np.testing.assert_array_equal(groups[:4, :n], full[:4, :live][:, in_groups])
    assert int(groups[3, :n].sum()) == min(sum(sizes), m)        # every row of the groups, once


def test_zero_tail_must_be_a_bool():
    with pytest.raises(ValueError, match="zero_tail must be a bool, got 0"):
        grouped_matmul(jnp.ones((8, 4)), jnp.ones((2, 4, 3)), jnp.array([4, 4], jnp.int32), zero_tail=0)


@pytest.mark.parametrize("group_rows", [0, 1], ids=["blocks", "group_rows"])
@pytest.mark.parametrize("order", [(1, 1), (mgpu.GROUP_MAJOR, 1)], ids=["strips", "group_major"])
@parametrize_slow_tail("sizes", [[70, 0, 130, 100], [0, 0, 0, 0], [320, 0, 0, 0], [5, 200, 3, 1]])
def test_kernel_interpret_mode(sizes, order, group_rows):
    """The compiled kernel's forward logic on CPU (Mosaic GPU interpret mode): ragged groups, empty
    groups, one huge group, in strips and group by group, its row tiles on the fixed blocks or from each
    group's first row (group_rows); padding rows hold NaN and must come out as exact zeros."""
    from jax._src.pallas.mosaic_gpu.interpret import params as interpret_params

    rng = np.random.default_rng(sum(sizes))
    m, k, n = 320, 128, 128
    sizes = np.asarray(sizes, np.int32)
    total = int(sizes.sum())
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float16).at[total:].set(jnp.nan)
    w = jnp.asarray(rng.standard_normal((4, k, n)) / np.sqrt(k), jnp.float16)
    config = mgpu.BlockConfig(64, 64, 64, 2, *order, group_rows=group_rows)
    ref = dense_reference(np.asarray(x)[:total], w, sizes)
    for zero_tail in (True, False):   # without it the rows past the groups are left as they are
        schedule, num_tiles = mgpu.tile_schedule(jnp.asarray(sizes), m, config.block_m, zero_tail,
                                                 bool(group_rows))
        out = np.asarray(mgpu.ragged_dot(x, w, schedule, num_tiles, config=config,
                                         interpret=interpret_params.InterpretGPUParams()), np.float64)
        np.testing.assert_allclose(out[:total], ref, rtol=2e-2, atol=2e-2)
        assert not zero_tail or np.all(out[total:] == 0)


def test_every_table_entry_is_a_form_its_kernel_takes():
    """gemm_configs.json: the bf16 passes' entries are BlockConfigs that tile their shape (the weight
    gradient's ones it takes); the FP8 passes' (forward_fp8, dx_fp8, dw_fp8) forms the FP8 kernels accept
    for their output width."""
    from jax_ep import gemm
    from jax_ep.gemm_fp8 import _dw_kernel_fits, fp8_kernel_form

    table = gemm._tuned()
    assert any(key[0] == "dw" for key in table)
    for (name, _m, k, n, _g), config in table.items():
        if name in gemm.PASSES:
            cfg = mgpu.BlockConfig(*config)
            assert (k if name == "dx" else n) % cfg.cta_n == 0, (name, k, n, config)
            if name == "dw":
                mgpu.check_weight_gradient_config(cfg)
        elif name in ("forward_fp8", "dx_fp8"):
            fp8_kernel_form(k if name == "dx_fp8" else n, tuple(config))
        else:
            assert name == "dw_fp8" and _dw_kernel_fits(k, n) and 3 <= len(config) <= 4, (name, config)


@pytest.mark.parametrize("name", ["forward", "dx", "dw"])
@pytest.mark.parametrize("k,n", [(64, 64), (192, 320), (7168, 4096), (1408, 4096), (4096, 2816)])
def test_block_configs_fit_the_shape(name, k, n):
    """Every configuration the op would launch (tuned or default) divides the shape it is used for."""
    from jax_ep.gemm import block_config

    cfg = block_config(name, 4096, k, n, 8)
    width = k if name == "dx" else n
    assert width % cfg.cta_n == 0 and cfg.block_k == 64 and cfg.grid_minor in (0, 1, mgpu.GROUP_MAJOR)
    assert name != "dw" or cfg.grid_minor != mgpu.GROUP_MAJOR     # dW tiles are one group each
    assert cfg.block_m & (cfg.block_m - 1) == 0 and cfg.ctas_per_sm in (1, 2)
    if name == "dw":
        assert k % cfg.block_m == 0


def test_kernel_path_types_per_rank_results_inside_shard_map(monkeypatch):
    """The kernel path inside shard_map, gradients included, with the custom calls' results typed as JAX
    types a kernel's (invariant): the forward kernel runs in interpret mode, the transposed passes are
    stood in for by host callbacks (interpret mode cannot run them). Before the results were typed per
    rank, combine's backward rejected the GEMM's output type on GPUs."""
    from jax._src.pallas.mosaic_gpu.interpret import params as interpret_params
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    import jax_ep
    from jax_ep import gemm

    kernel = mgpu.ragged_dot

    def forward(x, w, schedule, num_tiles, *, config, transpose_rhs=False, num_sms=None):
        w = jnp.swapaxes(w, 1, 2) if transpose_rhs else w
        return kernel(x, w, schedule, num_tiles, config=config, num_sms=num_sms,
                      interpret=interpret_params.InterpretGPUParams())

    def weight_grad(x, dy, sizes, *, config, num_sms=None):
        def host(x, dy, sizes):
            ends = np.cumsum(sizes)
            return np.stack([np.asarray(x[e - s:e], np.float32).T @ np.asarray(dy[e - s:e], np.float32)
                             for s, e in zip(sizes, ends, strict=True)]).astype(x.dtype)
        out = jax.ShapeDtypeStruct((sizes.shape[0], x.shape[1], dy.shape[1]), x.dtype)
        return jax.pure_callback(host, out, x, dy, sizes)

    monkeypatch.setattr(gemm, "_kernel_platform", lambda: "")
    monkeypatch.setattr(mgpu, "ragged_dot", forward)
    monkeypatch.setattr(mgpu, "transposed_ragged_dot", weight_grad)
    # One device: Mosaic GPU's interpret mode joins its devices at a threading.Barrier inside host
    # callbacks, which hangs wherever XLA runs the devices' programs one after another (it did in CI,
    # 2026-12-05). The types checked here are per axis name, so an axis of size 1 checks them as well.
    mesh = Mesh(np.array(jax.devices()[:1]), ("ep",))
    r, t, h, e, k = 1, 64, 64, 4, 2
    cfg = jax_ep.EPConfig(num_experts=e, num_topk=k, hidden=h, max_tokens_per_rank=t, backend="reference",
                          expert_alignment=64)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((r * t, h)), jnp.float16)
    idx = jnp.asarray(np.argsort(rng.random((r * t, e)), axis=1)[:, :k], jnp.int32)
    wts = jnp.asarray(rng.random((r * t, k)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((e, h, h)) / 8, jnp.float16)

    def run(backend):
        def body(x, idx, wts, w):
            d = jax_ep.dispatch(x, idx, wts, cfg)
            return jax_ep.combine(grouped_matmul(d.x, w, d.group_sizes, backend=backend), d.handle, cfg)
        f = jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
        loss = lambda x, w: jnp.sum(f(x, idx, wts, w).astype(jnp.float32) ** 2)  # noqa: E731
        return jax.jit(jax.value_and_grad(loss, (0, 1)))(x, w)

    assert gemm.explain(x, w)["dw"].impl == "mosaic_gpu"
    (got, (gx, gw)), (ref, (rx, rw)) = run("mosaic_gpu"), run("ragged_dot")
    np.testing.assert_allclose(float(got), float(ref), rtol=2e-2)
    np.testing.assert_allclose(np.asarray(gx, np.float32), np.asarray(rx, np.float32), rtol=5e-2, atol=5e-2)
    np.testing.assert_allclose(np.asarray(gw, np.float32), np.asarray(rw, np.float32), rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("fields,word", [((128, 128, 64, 3, 0, 4, 1, 3), "compute_wgs"),
                                         ((128, 128, 64, 3, 0, 4, 2, 2), "ctas_per_sm"),
                                         ((128, 128, 64, 1, 0, 4, 1, 2, 1), "mma_in_flight"),
                                         ((128, 128, 64, 3, 3, 4), "grid_minor"),
                                         ((128, 128, 64, 3, 0, 4, 1, 1, 0, 1), "ring"),
                                         ((128, 128, 64, 3, 0, 4, 1, 2, 0, 2), "ring"),
                                         ((128, 128, 64, 3, 0, 4, 1, 2, 0, 1, 0, 3), "out_chunks"),
                                         ((128, 128, 64, 3, 0, 4, 1, 1, 0, 0, 0, 2), "out_chunks")])
def test_block_config_refuses_what_no_kernel_runs(fields, word):
    from jax_ep.errors import EPValueError

    with pytest.raises(EPValueError, match=word):
        mgpu.BlockConfig(*fields)


@pytest.mark.parametrize("transpose_rhs", [False, True])
@pytest.mark.parametrize("config", [(128, 128, 64, 3, 0, 8, 1, 2, 0), (64, 128, 64, 4, 1, 2, 1, 2, 1),
                                    (64, 128, 64, 2, 0, 8, 1, 2, 1, 1), (128, 128, 64, 3, 0, 4, 1, 2, 0, 1),
                                    (128, 128, 64, 3, 0, 4, 1, 1, 0, 0, 1),
                                    (128, 128, 64, 3, 0, 4, 1, 2, 0, 1, 1),
                                    (64, 128, 64, 5, 0, 1, 1, 2, 1, 0, 1, 2)])
def test_warp_specialised_kernels_lower_for_hopper(config, transpose_rhs):
    """The warp-specialised kernels (a producer warpgroup + 2 consumers) trace and lower to a Mosaic GPU
    custom call for CUDA on this CPU machine: every pass (forward or dx, and dw) at each tile shape, and
    the one-consumer kernel (compute_wgs 1), each with row tiles from the groups' first rows too; the
    weight gradient without a WGMMA in flight where it runs a pipeline per tile (it refuses that).
    (Mosaic GPU's interpret mode does not run warp-specialised pipelines; the GPU tests run them.)"""
    cfg = mgpu.BlockConfig(*config)
    dw_cfg = cfg if cfg.ring else dataclasses.replace(cfg, mma_in_flight=0)
    m, k, n, g = 1024, 512, 768, 5
    x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((g, n, k) if transpose_rhs else (g, k, n), jnp.bfloat16)
    gs = jax.ShapeDtypeStruct((g,), jnp.int32)

    def passes(x, w, gs):
        sched, tiles = mgpu.config_schedule(gs, m, cfg)
        out = mgpu.ragged_dot(x, w, sched, tiles, config=cfg, transpose_rhs=transpose_rhs)
        return out, mgpu.transposed_ragged_dot(x, out, gs, config=dw_cfg)

    text = jax.jit(passes).trace(x, w, gs).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("mosaic_gpu") >= 2, text[:2000]


@pytest.mark.parametrize("chunks", [1, 2])
def test_weight_gradient_refuses_a_wgmma_in_flight_in_a_pipeline_per_tile(chunks):
    """The warp-specialised weight gradient with a pipeline per tile and mma_in_flight=1 raises, naming
    the ring that runs it (it gave wrong sums and faults on the GPU on random group sizes); with the ring
    it lowers."""
    from jax_ep.errors import EPValueError

    cfg = mgpu.BlockConfig(64, 128, 64, 4, 0, 1, 1, 2, 1, 0, 0, chunks)
    m, k, n, g = 1024, 512, 768, 5
    x, dy = jnp.zeros((m, k), jnp.bfloat16), jnp.zeros((m, n), jnp.bfloat16)
    gs = jnp.full((g,), 64, jnp.int32)
    with pytest.raises(EPValueError, match="mma_in_flight=1 needs ring=1"):
        mgpu.transposed_ragged_dot(x, dy, gs, config=cfg)
    ring = dataclasses.replace(cfg, ring=1)
    text = jax.jit(functools.partial(mgpu.transposed_ragged_dot, config=ring)).trace(x, dy, gs).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("wgs,ring", [(1, 0), (2, 0), (2, 1)])
def test_group_major_order_lowers_for_hopper_and_is_refused_by_the_weight_gradient(wgs, ring):
    """The group-major tile order (grid_minor GROUP_MAJOR) lowers for CUDA in the one-consumer and the
    warp-specialised forward; the weight gradient, whose tiles are one group each, refuses it by name."""
    from jax_ep.errors import EPValueError

    cfg = mgpu.BlockConfig(64, 128, 64, 4, mgpu.GROUP_MAJOR, 1, 1, wgs, 0, ring)
    m, k, n, g = 1024, 512, 768, 5
    x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((g, k, n), jnp.bfloat16)
    gs = jax.ShapeDtypeStruct((g,), jnp.int32)

    def forward(x, w, gs):
        sched, tiles = mgpu.config_schedule(gs, m, cfg)
        return mgpu.ragged_dot(x, w, sched, tiles, config=cfg)

    assert "mosaic_gpu" in jax.jit(forward).trace(x, w, gs).lower(lowering_platforms=("cuda",)).as_text()
    with pytest.raises(EPValueError, match="group-major order"):
        mgpu.transposed_ragged_dot(jnp.zeros((m, k), jnp.bfloat16), jnp.zeros((m, n), jnp.bfloat16),
                                   jnp.full((g,), 64, jnp.int32), config=cfg)


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_wide_warp_specialised_tile_fits_shared_memory(transpose_rhs):
    """tune_gemm's 64 x 512 CTA tile (two 64 x 256 consumers, 2 stages) lowers for CUDA within Hopper's
    shared memory; a third stage would not fit beside its output tiles (Mosaic GPU says so at lowering)."""
    m, k, n, g = 1024, 512, 1024, 5
    x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((g, n, k) if transpose_rhs else (g, k, n), jnp.bfloat16)
    gs = jax.ShapeDtypeStruct((g,), jnp.int32)

    def lower(stages):
        cfg = mgpu.BlockConfig(64, 256, 64, stages, 0, 8, 1, 2, 0)

        def forward(x, w, gs):
            sched, tiles = mgpu.config_schedule(gs, m, cfg)
            return mgpu.ragged_dot(x, w, sched, tiles, config=cfg, transpose_rhs=transpose_rhs)
        return jax.jit(forward).trace(x, w, gs).lower(lowering_platforms=("cuda",)).as_text()

    assert "mosaic_gpu" in lower(2)
    with pytest.raises(ValueError, match="exceeds available shared memory"):
        lower(3)


@pytest.mark.parametrize("transpose_rhs", [False, True])
@pytest.mark.parametrize("ring", [0, 1])
def test_output_in_halves_leaves_room_for_a_fourth_stage(ring, transpose_rhs):
    """out_chunks 2: each consumer's 128 x 128 output tile leaves through a 128 x 64 buffer, so a 128 x 256
    CTA tile fits a 4th K stage beside it (4 x 48 KB + 32 KB) in every pass, the weight gradient and the
    rows' forward / dx, pipelined per tile or in one ring; with whole-tile buffers the 4th stage does not
    fit (Mosaic GPU says so at lowering)."""
    m, k, n, g = 1024, 512, 1024, 5
    x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((g, n, k) if transpose_rhs else (g, k, n), jnp.bfloat16)
    gs = jax.ShapeDtypeStruct((g,), jnp.int32)

    def lower(chunks):
        cfg = mgpu.BlockConfig(128, 128, 64, 4, 0, 4, 1, 2, 0, ring, 0, chunks)

        def passes(x, w, gs):
            sched, tiles = mgpu.config_schedule(gs, m, cfg)
            out = mgpu.ragged_dot(x, w, sched, tiles, config=cfg, transpose_rhs=transpose_rhs)
            return out, mgpu.transposed_ragged_dot(x, out, gs, config=cfg)
        return jax.jit(passes).trace(x, w, gs).lower(lowering_platforms=("cuda",)).as_text()

    assert lower(2).count("mosaic_gpu") >= 2
    with pytest.raises(ValueError, match="exceeds available shared memory"):
        lower(1)


def test_tune_gemm_sweeps_both_kernel_kinds_and_reports_missing_peers():
    """tools/tune_gemm.py: --kernels picks the sweep, every configuration fits the shape it is tried on,
    and --compare's peer table runs here (grouped_matmul falls back to lax.ragged_dot on CPU) and says
    when tokamax is not installed."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "tools" / "tune_gemm.py"
    spec = importlib.util.spec_from_file_location("tune_gemm", path)
    tune = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tune)
    from jax_ep.gemm import block_config

    for (m, _, k, n, g, _) in tune.SHAPES["other"]:             # untuned: today's default comes first
        for name in ("forward", "dx", "dw"):
            cands = tune.default_candidates(name, m, k, n, g)
            assert cands[0] == block_config(name, m, k, n, g) and len(cands) >= 3
            assert all((k if name == "dx" else n) % c.cta_n == 0 for c in cands)
    for width in (2816, 4096, 7168):
        ws = list(tune.grid_for("forward", width, True, "ws"))
        classic = list(tune.grid_for("forward", width, True, "classic"))
        assert ws and all(c.compute_wgs == 2 and width % c.cta_n == 0 for c in ws)
        assert classic and all(c.compute_wgs == 1 and width % c.cta_n == 0 for c in classic)
        assert len(list(tune.grid_for("forward", width, True, "all"))) == len(ws) + len(classic)
    # the sweeps beside the table's entry: each a valid configuration that tiles its width
    shape = (73600, 7168, 4096, 128)
    ws64 = mgpu.BlockConfig(64, 128, 64, 4, mgpu.GROUP_MAJOR, 1, 1, 2, 0, 0, 1)
    ws128 = mgpu.BlockConfig(128, 128, 64, 3, mgpu.GROUP_MAJOR, 1, 1, 2, 0, 0, 1)
    for mode in tune.SWEEPS[3:]:
        for name, incumbent in (("forward", [ws64]), ("dx", [ws128]), ("dw", [])):
            width = 7168 if name == "dx" else 4096
            for c in tune.sweep_candidates(mode, name, incumbent, width, shape, True):
                assert isinstance(c, mgpu.BlockConfig) and width % c.cta_n == 0, (mode, name, c)
    assert tune.sweep_candidates("rows", "forward", [ws64], 4096, shape, True) == [
        dataclasses.replace(ws64, group_rows=1)]
    assert all(c.ring == 1 for c in tune.sweep_candidates("ring", "dw", [], 4096, shape, True))
    assert tune.sweep_candidates("rowtile", "dx", [ws128], 7168, shape, True) == [
        dataclasses.replace(ws128, block_m=64, max_concurrent_steps=4)]
    assert tune.sweep_candidates("rowtile", "dw", [ws128], 4096, shape, True) == []
    chunked = dataclasses.replace(ws64, out_chunks=2, max_concurrent_steps=5)
    assert tune.sweep_candidates("inflight", "forward", [chunked], 4096, shape, True) == [
        dataclasses.replace(chunked, mma_in_flight=1)]
    per_tile_dw = mgpu.BlockConfig(128, 128, 64, 3, 0, 4, 1, 2)     # the weight gradient refuses a WGMMA in
    assert tune.sweep_candidates("inflight", "dw", [per_tile_dw], 4096, shape, True) == []   # flight here
    assert tune.sweep_candidates("inflight", "dw", [dataclasses.replace(per_tile_dw, ring=1)], 4096, shape,
                                 True) == [dataclasses.replace(per_tile_dw, ring=1, mma_in_flight=1)]
    assert all(c.mma_in_flight == 0 or c.ring for c in tune.grid_for("dw", 4096, True, "ws"))
    with pytest.raises(SystemExit):
        tune.main(["--kernels", "ring,nonsense", "--shapes", "other"])
    rng = np.random.default_rng(0)
    m, real, k, n, g = 256, 192, 64, 128, 4
    gs = jnp.asarray([64, 0, 64, 64], jnp.int32)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((g, k, n)), jnp.bfloat16)
    dy = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
    rec = tune.compare_peers((m, real, k, n, g, 64), x, w, dy, gs, 2.0 * real * k * n)
    assert rec["jax_ep"]["fwd_ms"] > 0 and rec["jax_ep"]["vjp_ms"] > 0 and rec["jax_ep"]["rel_diff"] == 0
    assert rec["dense"]["fwd_tflops"] > 0
    # XLA's own ragged-dot lowerings: never taken on the CPU (no mark in its HLO), so reported, not timed
    for peer in tune.XLA_LOWERINGS:
        assert set(rec["passes"][peer]) == {"forward", "dx", "dw"}
        assert not any(v["taken"] or "ms" in v for v in rec["passes"][peer].values()), rec["passes"][peer]
    assert all(v["taken"] and v["ms"] > 0 and v["rel_diff"] == 0 for v in rec["passes"]["jax_ep"].values())
    # a lowering whose mark the HLO holds is timed and compared with jax_ep's pass
    taken = tune.time_xla_lowerings(x, w, dy, gs, 1.0, lowerings={"any_dot": ({}, None, "dot(")})
    assert all(v["taken"] and v["ms"] > 0 and v["rel_diff"] < 1e-2 for v in taken["any_dot"].values())
    x, w = jnp.pad(x, ((0, 0), (0, 64))), jnp.pad(w, ((0, 0), (0, 64), (0, 0)))   # FP8 blocks: K = 128
    fp8 = tune.time_fp8((m, real, 128, n, g, 64), x, w, dy, gs, 2.0 * real * 128 * n)
    assert fp8["forward_bf16"]["ms"] > 0                     # the FP8 kernel needs a Hopper GPU:
    kernels = [key for key in fp8 if key.startswith(("forward_fp8", "dx_fp8"))]
    from jax_ep.gemm_fp8 import KERNELS
    assert len(kernels) == 2 * len(KERNELS) and all("error" in fp8[key] for key in kernels)  # reported
    assert tune.fp8_table_entries(fp8, "cpu") == []           # nothing timed, nothing into the table
    timed = dict(fp8, **{run: {"ms": ms} for run, ms in (("forward_fp8_ws64_group_major", 2.0),
                                                           ("forward_fp8_ws64_group_major_ring", 1.5),
                                                           ("dx_fp8_ws64_strips", 3.0), ("dw_fp8", 9.0))})
    entries = {e["pass"]: e for e in tune.fp8_table_entries(timed, "H200")}
    assert entries["forward_fp8"]["config"] == [True, 64, 4, mgpu.GROUP_MAJOR, 1]
    assert entries["forward_fp8"]["ms"] == 1.5 and entries["dx_fp8"]["config"] == [True, 64, 4, 0]
    assert (entries["dw_fp8"]["k"], entries["dw_fp8"]["n"]) == (128, n)
    if importlib.util.find_spec("tokamax") is None:
        assert "tokamax" not in rec and "No module named 'tokamax'" in rec["tokamax_note"]


def test_gemm_ncu_programs_lower_for_hopper_in_the_printed_order():
    """tools/gemm_ncu.py (what GEMM_NCU=1 tools/gpu_check.sh profiles): its five programs — bf16 forward,
    dx, dW at the table's configurations, FP8 forward and dx — trace and lower to one Mosaic GPU kernel
    each, in the order --print-order gives (ncu's launches are mapped to kernels by it)."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "tools" / "gemm_ncu.py"
    spec = importlib.util.spec_from_file_location("gemm_ncu", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    runs = tool.programs(1024, 700, 256, 512, 4)
    assert tuple(name for name, _, _ in runs) == tool.ORDER
    for name, f, args in runs:
        text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("mosaic_gpu") >= 1, name


def test_tune_gemm_block_timing_reports_bf16_and_both_fp8_blocks(monkeypatch, capsys):
    """tools/tune_gemm.py --block (time_blocks): the bf16 expert block beside its dense-dot roofline and
    the FP8 block with its weights quantised in the step and beforehand (the layer's jax_ep_fp8_cached),
    each with its speed-up, on a CPU-sized block (lax.ragged_dot and the FP8 reference path here); with
    sustain_s every timing runs that long of calls first."""
    import importlib.util
    import pathlib

    from benchmarks import layer as bench_layer

    path = pathlib.Path(__file__).resolve().parents[1] / "tools" / "tune_gemm.py"
    spec = importlib.util.spec_from_file_location("tune_gemm", path)
    tune = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tune)
    monkeypatch.setitem(tune.BLOCKS, "tiny", (96, 256, 128, 4, 192))
    sustained = []
    real = bench_layer.best_of
    monkeypatch.setattr(bench_layer, "best_of", lambda fn, *a, **k: sustained.append(k["sustain_s"]) or
                        real(fn, *a, **k))
    [rec] = tune.time_blocks(["tiny"], fp8=True, sustain_s=0.01)
    # roofline, bf16 block, FP8 block, FP8 block cached: each called with the settings, then timed at each
    assert sustained == [(0.01,), 0.01] * 4
    assert rec["sustain_s"] == 0.01 and rec["roofline_ms"] > 0 and rec["block_ms"] > 0
    for key in ("fp8_block", "fp8_cached_block"):
        speedup = key.replace("block", "speedup")
        assert rec[f"{key}_ms"] > 0 and rec[speedup] == pytest.approx(rec["block_ms"] / rec[f"{key}_ms"])
    assert "fp8 cached block" in capsys.readouterr().out
    # several settings: each block compiled once and timed at each in turn, one record per setting
    sustained.clear()
    recs = tune.time_blocks(["tiny"], fp8=True, sustain_s=(0.0, 0.01))
    assert sustained == [(0.0, 0.01), 0.0, 0.01] * 4
    assert [r["sustain_s"] for r in recs] == [0.0, 0.01]
    assert all(r["block_ms"] > 0 and r["fp8_cached_speedup"] > 0 for r in recs)
    assert tune.sustain_settings("0,2") == (0.0, 2.0) and tune.sustain_settings("1.5") == (1.5,)
    for bad in ("0,-1", "nan", "2,"):
        with pytest.raises(argparse.ArgumentTypeError, match="seconds >= 0"):
            tune.sustain_settings(bad)


def test_fp8_bounds_variants_lower_for_cuda_and_restore_the_kernel():
    """tools/fp8_bounds.py: every variant of the FP8 kernel's K step (patched into gemm_mgpu while traced)
    lowers for CUDA here, forward and input gradient, each to a module of its own (not a trace cached from
    another variant), and gemm_mgpu is itself again afterwards; a variant name it does not know is
    refused."""
    import importlib.util
    import pathlib

    from jax_ep import gemm_mgpu

    path = pathlib.Path(__file__).resolve().parents[1] / "tools" / "fp8_bounds.py"
    spec = importlib.util.spec_from_file_location("fp8_bounds", path)
    bounds = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bounds)
    before = {n: getattr(gemm_mgpu, n) for n in ("_fp8_block_sum", "_promote", "_acc_zeros", "_write_tile",
                                                  "_k_ring")}
    records = bounds.main(["--lower-only", "--small", "--shapes", "gate_up"])
    assert [(r["pass_name"], r["variant"]) for r in records] == [
        (p, v) for p in ("forward", "dx") for v in bounds.VARIANTS]
    assert all("error" not in r for r in records), records
    for p in ("forward", "dx"):
        modules = [r["lowered_sha1"] for r in records if r["pass_name"] == p]
        assert len(set(modules)) == len(bounds.VARIANTS), modules
    assert {n: getattr(gemm_mgpu, n) for n in before} == before
    with pytest.raises(ValueError, match="variant must be one of"):
        with bounds.variant("nope"):
            pass
    assert {n: getattr(gemm_mgpu, n) for n in before} == before


def test_gemm_sm_limit_lowers_each_grid_as_a_program_of_its_own():
    """tools/gemm_sm_limit.py: each SM count (the persistent grid shrunk while traced) lowers for CUDA
    here to a module of its own, gemm_mgpu's grid size is itself again afterwards, and a count outside
    the GPU is refused."""
    import importlib.util
    import pathlib

    from jax_ep import gemm_mgpu

    path = pathlib.Path(__file__).resolve().parents[1] / "tools" / "gemm_sm_limit.py"
    spec = importlib.util.spec_from_file_location("gemm_sm_limit", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    before = gemm_mgpu._num_sms
    records = tool.main(["--lower-only", "--passes", "forward", "--free", "0,24"])
    assert [(r["shape"][2], r["sms"]) for r in records] == [(7168, 132), (7168, 108), (2048, 132),
                                                            (2048, 108)]
    for k in (7168, 2048):
        assert len({r["lowered_sha1"] for r in records if r["shape"][2] == k}) == 2
    assert gemm_mgpu._num_sms is before
    with pytest.raises(SystemExit):
        tool.main(["--lower-only", "--free", "132"])


def test_gemm_sm_limit_times_each_grid_burst_and_sustained_with_its_clock(monkeypatch):
    """tools/gemm_sm_limit.py --sustain 0,S: each grid is timed right after compiling and after S seconds of
    back-to-back calls, each timing with the SM clock NVML saw while it ran (a fake NVML and a jnp pass
    standing in for the Hopper kernel here); the record's ms is the last setting's."""
    import importlib.util
    import pathlib

    from helpers import FakeGPUs

    from benchmarks import clocks

    path = pathlib.Path(__file__).resolve().parents[1] / "tools" / "gemm_sm_limit.py"
    spec = importlib.util.spec_from_file_location("gemm_sm_limit", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    grids = []

    def fake_pass(name, cfg, x, w, dy, gs, num_sms=None):
        grids.append(num_sms)
        return x @ w[0]

    monkeypatch.setattr(tool.tune_gemm, "run_pass", fake_pass)
    with clocks.sampling(read=FakeGPUs(1410.0), period_s=0.0005):
        records = tool.run([(256, 192, 64, 128, 4, 64)], ["forward"], [0, 24], sustain_s=(0.0, 0.05))
    assert [r["sms"] for r in records] == [132, 108] and set(grids) == {132, 108}
    for r in records:
        assert [s["sustain_s"] for s in r["sustained"]] == [0.0, 0.05]
        assert r["ms"] == r["sustained"][-1]["ms"] > 0
        # every timing carries a clock: its samples, or the nearest one (a short window under load)
        assert all(s["clocks"]["sm_mhz"][0] == 1410.0
                   and (s["clocks"]["samples"] > 0 or "nearest_ms" in s["clocks"]) for s in r["sustained"])


def test_tune_gemm_sweep_times_each_config_at_each_sustain_setting_and_picks_by_the_last(monkeypatch,
                                                                                          tmp_path):
    """tools/tune_gemm.py --sustain 0,S: every swept configuration is timed right after compiling and after
    S seconds of back-to-back calls (one compiled kernel, both settings), the record keeps both, and the
    table takes the configuration fastest at the last (sustained) setting, not the fastest burst."""
    import importlib.util
    import json
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "tools" / "tune_gemm.py"
    spec = importlib.util.spec_from_file_location("tune_gemm", path)
    tune = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tune)
    burst = mgpu.BlockConfig(64, 128, 64, 5, mgpu.GROUP_MAJOR, 1, 1, 2, 0, 0, 1, 2)
    steady = mgpu.BlockConfig(128, 128, 64, 4, mgpu.GROUP_MAJOR, 1, 1, 2, 0, 0, 1, 2)
    times = {burst: (1.0e-3, 3.0e-3), steady: (2.0e-3, 2.5e-3)}   # seconds at sustain 0 / 0.5
    settings = []

    def fake_best_of(fn, *args, sustain_s=0.0):
        settings.append(sustain_s)
        return times[fn.__wrapped__.args[1]]

    monkeypatch.setitem(tune.SHAPES, "other", [(256, 192, 64, 256, 4, 64)])
    monkeypatch.setattr(tune, "dense_ceiling", lambda rng: 800.0)
    monkeypatch.setattr(tune, "sweep_candidates", lambda *a: [burst, steady])
    monkeypatch.setattr(tune, "run_pass", lambda name, cfg, x, w, dy, gs: x)
    monkeypatch.setattr(tune, "check", lambda *a: 0.0)
    monkeypatch.setattr(tune, "best_of", fake_best_of)
    out, report = tmp_path / "table.json", tmp_path / "report.json"
    tune.main(["--shapes", "other", "--passes", "forward", "--kernels", "defaults", "--sustain", "0,0.5",
               "--out", str(out), "--report", str(report)])
    assert settings == [(0.0, 0.5)] * 2
    [entry] = json.loads(out.read_text())["configs"]
    assert entry["config"] == list(steady.astuple()) and entry["ms"] == 2.5
    [line] = json.loads(report.read_text())
    assert line["sustain_s"] == [0.0, 0.5] and line["config"] == list(steady.astuple())
    assert line["sweep_ms"] == [[list(burst.astuple()), [1.0, 3.0]], [list(steady.astuple()), [2.0, 2.5]]]


def test_dw_num_sms_sizes_the_weight_gradient_grid_only(monkeypatch):
    """grouped_matmul(dw_num_sms=N): the weight gradient's kernel on N SMs (beside an exchange on the side
    stream, jax_ep.overlap.chain), the forward and dx kernels on num_sms: lowered for CUDA here, the
    forward alone is the default's, the gradient differs, and dw_num_sms=num_sms=N is num_sms=N's."""
    from jax_ep import gemm

    monkeypatch.setattr(gemm, "_kernel_platform", lambda: "")
    args = (jax.ShapeDtypeStruct((1024, 512), jnp.bfloat16),
            jax.ShapeDtypeStruct((5, 512, 768), jnp.bfloat16), jax.ShapeDtypeStruct((5,), jnp.int32))

    def lowered(grad, **sms):
        def loss(x, w, gs):
            return jnp.sum(grouped_matmul(x, w, gs, **sms).astype(jnp.float32))
        fn = jax.grad(loss, (0, 1)) if grad else loss
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()

    assert lowered(False, dw_num_sms=100) == lowered(False)
    assert lowered(True, dw_num_sms=100) != lowered(True)
    assert lowered(True, num_sms=100, dw_num_sms=100) == lowered(True, num_sms=100)
    with pytest.raises(ValueError, match="grouped_matmul: dw_num_sms must be None or a positive int, got 0"):
        grouped_matmul(jnp.zeros((64, 64), jnp.bfloat16), jnp.zeros((2, 64, 64), jnp.bfloat16),
                       jnp.array([32, 32], jnp.int32), dw_num_sms=0)


def test_num_sms_sizes_every_pass_grid_and_is_checked(monkeypatch):
    """grouped_matmul(num_sms=N): the forward, dx and dW kernels run persistent grids on N SMs (what
    MoE(gemm_num_sms=N) asks, leaving the rest to the EP exchanges on their own stream): lowered for CUDA
    here, the module with 100 differs from the one on every SM (132 here), a count above the GPU's SMs
    takes them all, and anything but None or a positive int is refused, naming the argument."""
    from jax_ep import gemm
    from jax_ep.errors import EPTypeError, EPValueError

    monkeypatch.setattr(gemm, "_kernel_platform", lambda: "")
    x = jax.ShapeDtypeStruct((1024, 512), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((5, 512, 768), jnp.bfloat16)
    gs = jax.ShapeDtypeStruct((5,), jnp.int32)

    def lowered(num_sms):
        def loss(x, w, gs):
            return jnp.sum(grouped_matmul(x, w, gs, num_sms=num_sms).astype(jnp.float32))
        return jax.jit(jax.grad(loss, (0, 1))).trace(x, w, gs).lower(lowering_platforms=("cuda",)).as_text()

    every = lowered(None)
    assert every.count("mosaic_gpu") >= 3, every[:2000]   # forward, dx, dW
    fewer = lowered(100)
    assert fewer != every and fewer.count("mosaic_gpu") == every.count("mosaic_gpu")
    assert lowered(500) == every
    assert mgpu._num_sms(100) == 100 and mgpu._num_sms(500) == mgpu._num_sms() == 132
    xs, ws = jnp.zeros((64, 64), jnp.bfloat16), jnp.zeros((2, 64, 64), jnp.bfloat16)
    for bad, error in ((0, EPValueError), (-3, EPValueError), (2.5, EPTypeError), (True, EPTypeError),
                       ("8", EPTypeError)):
        with pytest.raises(error, match=f"grouped_matmul: num_sms must be None or a positive int, "
                                        f"got {bad!r}"):
            grouped_matmul(xs, ws, jnp.array([32, 32], jnp.int32), num_sms=bad)


@pytest.mark.parametrize("m,kernel,fp8_kernel", [(96, True, True), (104, True, True), (8, True, True),
                                                 (4, True, True), (5, True, False), (1, True, False),
                                                 (100, False, False), (257, False, False), (0, False, False)])
def test_rows_the_hopper_kernels_cannot_tile_take_the_fallback(monkeypatch, m, kernel, fp8_kernel):
    """Above 8 rows, M not a multiple of 8 (the rows' TMA tiles), or for FP8 not a multiple of 4 (its row
    scales, M-minor in 16-byte strides), or no rows: the kernels cannot take them (Mosaic refused to build
    them: e.g. the layer's rows at EPOptions(capacity=100); M=0 raised 'math domain error'), so auto
    takes lax.ragged_dot / the FP8 reference for every pass and explain says why; lowered for CUDA
    here, with Hopper stood in for. The alignment the layer asks of dispatch does not depend on the rows
    it asks with (64: the layer asks with one row)."""
    from jax_ep import gemm, gemm_fp8

    monkeypatch.setattr(gemm, "_kernel_platform", lambda: "")
    monkeypatch.setattr(gemm_fp8, "_kernel_platform", lambda: "")
    x = jax.ShapeDtypeStruct((m, 256), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((2, 256, 256), jnp.bfloat16)
    gs = jax.ShapeDtypeStruct((2,), jnp.int32)
    plans = explain(x, w)
    assert [p.impl for p in plans.values()] == ["mosaic_gpu" if kernel else "ragged_dot"] * 3
    if not kernel:
        assert all(f"M={m} rows is not a multiple of 8" in p.reason or "no rows (M=0)" in p.reason
                   for p in plans.values()), plans
    assert gemm_fp8.fp8_backend(256, 256, m=m) == ("mosaic_gpu" if fp8_kernel else "reference")
    assert gemm.preferred_alignment(x, w) == gemm.ROW_ALIGNMENT
    # both build (the FP8 GEMM's bf16 weight gradient may be a kernel where its FP8 passes are not)
    for fn in (grouped_matmul, gemm_fp8.fp8_grouped_matmul):
        def loss(x, w, gs, fn=fn):
            return jnp.sum(fn(x, w, gs).astype(jnp.float32))
        text = jax.jit(jax.grad(loss, (0, 1))).trace(x, w, gs).lower(lowering_platforms=("cuda",)).as_text()
        if fn is grouped_matmul:
            assert ("mosaic_gpu" in text) == kernel


@pytest.mark.parametrize("layer_gemm", ["auto", "mosaic_gpu"])
def test_the_layer_asks_dispatch_for_the_kernels_alignment(monkeypatch, layer_gemm):
    """MoE asks preferred_alignment with a stand-in of one row: a rule on the rows turned the Hopper
    kernel's 64-row alignment into 1 (gemm="auto"), and made gemm="mosaic_gpu" raise on every call
    (found by the review of the rows rule, 2026-12-05). Traced with Hopper stood in for."""
    from flax import nnx
    from jax.sharding import Mesh

    from jax_ep import gemm, moe
    from jax_ep.gating import RouterConfig
    from jax_ep.moe import EPOptions, MoE

    monkeypatch.setattr(gemm, "_kernel_platform", lambda: "")
    asked = []
    monkeypatch.setattr(moe, "preferred_alignment",
                        lambda *a, **k: asked.append(gemm.preferred_alignment(*a, **k)) or asked[-1])
    mesh = Mesh(np.array(jax.devices()[:2]), ("ep",))
    layer = MoE(64, 128, RouterConfig(8, 2), rngs=nnx.Rngs(0), mesh=mesh, gemm=layer_gemm,
                ep=EPOptions(backend="reference"), dtype=jnp.bfloat16)
    nnx.eval_shape(lambda m, x: m(x, update_stats=False), layer, jnp.zeros((2, 8, 64), jnp.bfloat16))
    assert asked == [gemm.ROW_ALIGNMENT]


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.uint8, jnp.int16, jnp.int64])
def test_group_sizes_of_any_integer_dtype_give_the_int32_result(dtype):
    """lax.ragged_dot sums the sizes in their own dtype: int8 sizes [100, 100, 100] wrapped around and
    gave rows of the wrong groups (0.8 relative error); every entry point reads them as int32."""
    from jax_ep import gemm, gemm_fp8

    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((304, 128)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((3, 128, 128)), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((304, 128)), jnp.float32)
    sizes = np.array([100, 100, 100])
    with jax.enable_x64(dtype == jnp.int64):
        gs, gs32 = jnp.asarray(sizes, dtype), jnp.asarray(sizes, jnp.int32)
        np.testing.assert_allclose(grouped_matmul(x, w, gs), dense_reference(x, w, sizes), rtol=2e-5,
                                   atol=2e-4)
        assert np.array_equal(gemm.weight_gradient(x, dy, gs), gemm.weight_gradient(x, dy, gs32))
        assert np.array_equal(gemm_fp8.fp8_grouped_matmul(x, w, gs), gemm_fp8.fp8_grouped_matmul(x, w, gs32))


def test_negative_group_sizes_count_as_empty_groups():
    """A negative size: the kernels' tile schedule takes it as 0, lax.ragged_dot's running sum went back
    rows (the two backends differed on 10 rows); every backend now reads it as 0."""
    rng = np.random.default_rng(8)
    x = jnp.asarray(rng.standard_normal((64, 64)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((3, 64, 64)), jnp.float32)
    out = grouped_matmul(x, w, jnp.array([-5, 40, 10], jnp.int32))
    np.testing.assert_allclose(out, dense_reference(x, w, [0, 40, 10]), rtol=2e-5, atol=2e-4)


def test_every_gemm_entry_point_checks_num_sms_rows_and_group_sizes():
    """weight_gradient, grouped_matmul_fp8 and fp8_weight_gradient took num_sms=-1 (a grid of -1 SMs on
    a GPU) and failed deep in JAX on mismatched rows or group sizes, naming no argument."""
    from jax_ep import gemm, gemm_fp8
    from jax_ep.errors import EPValueError

    x, dy = jnp.ones((16, 128), jnp.bfloat16), jnp.ones((16, 128), jnp.bfloat16)
    gs = jnp.array([8, 8], jnp.int32)
    xq, xs = gemm_fp8.quantize_fp8(x)
    wq, ws = gemm_fp8.quantize_weight_blocks(jnp.ones((2, 128, 128), jnp.bfloat16))
    calls = {
        "weight_gradient": lambda **k: gemm.weight_gradient(**{"x": x, "dy": dy, "group_sizes": gs, **k}),
        "fp8_weight_gradient": lambda **k: gemm_fp8.fp8_weight_gradient(
            **{"x": x, "dy": dy, "group_sizes": gs, **k}),
        "grouped_matmul_fp8": lambda **k: gemm_fp8.grouped_matmul_fp8(
            xq, xs, wq, ws, **{"group_sizes": gs, **k}),
    }
    for op, call in calls.items():
        with pytest.raises(EPValueError, match=f"{op}: num_sms must be None or a positive int, got -1"):
            call(num_sms=-1)
        with pytest.raises(EPValueError, match=f"{op}: group_sizes must be integer, got dtype float32"):
            call(group_sizes=gs.astype(jnp.float32))
    with pytest.raises(EPValueError, match=r"grouped_matmul_fp8: group_sizes must have shape \(2,\)"):
        calls["grouped_matmul_fp8"](group_sizes=jnp.array([8, 4, 4], jnp.int32))
    with pytest.raises(EPValueError, match=r"weight_gradient: x \[M, K\] and dy \[M, N\] must be 2-D with "
                                           r"the same rows, got x \(16, 128\), dy \(12, 128\)"):
        gemm.weight_gradient(x, dy[:12], gs)


def test_tune_gemm_refuses_unknown_names_and_fails_on_a_wrong_result(monkeypatch, tmp_path, capsys):
    """tools/tune_gemm.py: --passes fwd was swept as the weight gradient and stored under 'fwd', --block
    with an unknown name raised a KeyError after the whole sweep, and a best config whose result was wrong
    was left out of the table but the run exited 0, so tools/gpu_check.sh said OK. Kernels stubbed here:
    a forward kernel that returns zeros."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "tools" / "tune_gemm.py"
    spec = importlib.util.spec_from_file_location("tune_gemm", path)
    tune = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tune)
    out = tmp_path / "table.json"
    for argv, word in ((["--passes", "fwd"], "--passes: unknown ['fwd']"),
                       (["--block", "deepseek"], "--block: unknown ['deepseek']")):
        with pytest.raises(SystemExit) as exc:
            tune.main(["--out", str(out), *argv])
        assert exc.value.code == 2 and word in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown pass 'fwd'"):
        tune.run_pass("fwd", None, None, None, None, None)
    monkeypatch.setitem(tune.SHAPES, "issue", [(256, 256, 128, 256, 2, 1)])
    monkeypatch.setattr(tune, "dense_ceiling", lambda rng: 1.0)
    monkeypatch.setattr(tune, "best_of", lambda f, *a, sustain_s=0.0, **k: (jax.block_until_ready(f(*a)),
                                                                             (1e-3,))[1])
    monkeypatch.setattr(tune.mgpu, "config_schedule", lambda gs, m, cfg: (None, 0))
    monkeypatch.setattr(tune.mgpu, "ragged_dot", lambda x, w, *a, **k: jnp.zeros((x.shape[0], w.shape[2]),
                                                                                  x.dtype))
    with pytest.raises(SystemExit) as exc:
        tune.main(["--shapes", "issue", "--passes", "forward", "--kernels", "classic", "--quick",
                   "--out", str(out)])
    assert "forward M=256 K=128 N=256 G=2" in str(exc.value.code) and "WRONG RESULT" in str(exc.value.code)
    assert json.loads(out.read_text())["configs"] == []
