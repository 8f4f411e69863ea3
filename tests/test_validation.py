"""Argument validation: clear errors naming the argument and the bad value / shape / dtype.

Static checks raise while tracing (no compilation needed); checked mode (cfg.checked=True) raises when
the computation runs, with the count / bad value in the message.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import make_cfg, model_for, per_rank, random_inputs, random_routing, random_tokens, to_numpy

import jax_ep

E, K, H, T = 8, 3, 32, 6
CFG = make_cfg(num_experts=E, num_topk=K, hidden=H, max_tokens_per_rank=T)
R = 2


def _dispatch_fn(cfg, ep_size=R):
    return per_rank(lambda x, idx, w: jax_ep.dispatch(x, idx, w, cfg).x, ep_size)


def _good(rng, ep_size=R, tokens=T):
    return random_tokens(rng, ep_size, tokens, CFG)


# ---- dispatch: shapes and dtypes (trace time) ---------------------------------------------------------
@pytest.mark.parametrize("case,match", [
    ("x_1d", r"x must be 2-D.*\(32,\)"),
    ("x_3d", r"x must be 2-D.*\(6, 2, 16\)"),
    ("x_int", r"x must be floating point.*int32"),
    ("hidden", r"hidden size 16 but cfg\.hidden=32"),
    ("too_many_tokens", r"8 tokens.*max_tokens_per_rank=6"),
    ("idx_shape_k", r"topk_idx must have shape \(6, 3\).*got \(6, 4\)"),
    ("idx_shape_t", r"topk_idx must have shape \(6, 3\).*got \(5, 3\)"),
    ("idx_1d", r"topk_idx must have shape \(6, 3\).*got \(6,\)"),
    ("idx_float", r"topk_idx must be int32.*float32"),
    ("idx_uint8", r"topk_idx must be int32.*uint8"),
    ("w_shape", r"topk_weights must have shape \(6, 3\).*got \(6, 2\)"),
    ("w_float16", r"topk_weights must be float32.*float16"),
    ("w_bf16", r"topk_weights must be float32.*bfloat16"),
])
def test_dispatch_bad_arguments(case, match):
    rng = np.random.default_rng(400)
    x, idx, w = _good(rng)
    if case == "x_1d":
        x = x[:, 0, :]
    elif case == "x_3d":
        x = x.reshape(R, T, 2, H // 2)
    elif case == "x_int":
        x = x.astype(np.int32)
    elif case == "hidden":
        x = x[:, :, :16]
    elif case == "too_many_tokens":
        x, idx, w = _good(rng, tokens=8)
    elif case == "idx_shape_k":
        idx = np.concatenate([idx, idx[:, :, :1]], axis=2)
    elif case == "idx_shape_t":
        idx = idx[:, :5]
    elif case == "idx_1d":
        idx = idx[:, :, 0]
    elif case == "idx_float":
        idx = idx.astype(np.float32)
    elif case == "idx_uint8":
        idx = np.abs(idx).astype(np.uint8)
    elif case == "w_shape":
        w = w[:, :, :2]
    elif case == "w_float16":
        w = w.astype(np.float16)
    elif case == "w_bf16":
        w = w.astype(ml_dtypes.bfloat16)
    with pytest.raises(ValueError, match=match):
        _dispatch_fn(CFG)(x, idx, w)


@pytest.mark.parametrize("case,match", [
    ("idx_int64", r"topk_idx must be int32.*int64"),
    ("w_float64", r"topk_weights must be float32.*float64"),
])
def test_dispatch_64bit_dtypes_rejected(case, match):
    """With x64 enabled int64 ids / float64 weights reach the op and are rejected by name."""
    rng = np.random.default_rng(401)
    x, idx, w = _good(rng)
    with jax.enable_x64(True):
        if case == "idx_int64":
            idx = idx.astype(np.int64)
        else:
            w = w.astype(np.float64)
        with pytest.raises(ValueError, match=match):
            _dispatch_fn(CFG)(x, idx, w)


def test_num_experts_not_divisible_by_ep_size():
    cfg = CFG.replace(num_experts=6)
    rng = np.random.default_rng(402)
    x, idx, w = random_tokens(rng, 4, T, cfg)
    with pytest.raises(ValueError, match=r"num_experts=6 is not divisible by the EP size 4"):
        _dispatch_fn(cfg, 4)(x, idx, w)
    with pytest.raises(ValueError, match=r"num_experts=6 is not divisible by the EP size 4"):
        per_rank(lambda i: jax_ep.get_dispatch_layout(i, cfg), 4)(idx)


# ---- outside shard_map / wrong axis --------------------------------------------------------------------
def test_ops_outside_shard_map():
    rng = np.random.default_rng(403)
    x, idx, w = (a[0] for a in _good(rng))
    msg = r"must run inside shard_map over the mesh axis 'ep'"
    with pytest.raises(ValueError, match=r"jax_ep\.dispatch " + msg):
        jax_ep.dispatch(x, idx, w, CFG)
    with pytest.raises(ValueError, match=r"jax_ep\.dispatch " + msg):
        jax.jit(lambda x, i, w: jax_ep.dispatch(x, i, w, CFG))(x, idx, w)
    with pytest.raises(ValueError, match=r"jax_ep\.get_dispatch_layout " + msg):
        jax.jit(lambda i: jax_ep.get_dispatch_layout(i, CFG))(idx)
    c = CFG.resolved_capacity(1)
    handle = jax_ep.Handle(np.full(c, -1, np.int32), np.full((T, K), -1, np.int32), np.zeros((T, 1), bool),
                           np.zeros(c, np.float32))
    with pytest.raises(ValueError, match=r"jax_ep\.combine " + msg):
        jax.jit(lambda y: jax_ep.combine(y, handle, CFG))(np.ones((c, H), np.float32))


def test_wrong_axis_name():
    cfg = CFG.replace(axis_name="experts")
    rng = np.random.default_rng(404)
    x, idx, w = _good(rng)
    with pytest.raises(ValueError, match=r"mesh axis 'experts' \(cfg\.axis_name\)"):
        _dispatch_fn(cfg)(x, idx, w)


# ---- combine and layout arguments ---------------------------------------------------------------------
@pytest.mark.parametrize("bad_y,match", [
    (lambda y: y[:-1], r"y must have shape \[capacity=36, hidden\].*\(35, 32\)"),
    (lambda y: y[:, 0], r"y must have shape \[capacity=36, hidden\].*\(36,\)"),
    (lambda y: y.astype(jnp.int32), r"y must be float32/bfloat16/float16.*int32"),
    (lambda y: y.astype(jnp.float8_e4m3fn), r"y must be float32/bfloat16/float16.*float8_e4m3fn"),
], ids=["rows", "ndim", "int", "fp8"])
def test_combine_bad_y(bad_y, match):
    """bad_y turns the dispatched rows into a y that combine must reject."""
    x, idx, w = _good(np.random.default_rng(405))
    assert CFG.resolved_capacity(R) == 36

    def f(x, idx, w):
        d = jax_ep.dispatch(x, idx, w, CFG)
        return jax_ep.combine(bad_y(d.x), d.handle, CFG)

    with pytest.raises(ValueError, match=match):
        per_rank(f, R)(x, idx, w)


@pytest.mark.parametrize("case,match", [
    ("shape", r"topk_idx must have shape \[tokens, 3\].*\(6, 2\)"),
    ("dtype", r"topk_idx must be int32.*float32"),
    # as dispatch refuses them (found by a review, 2026-12-05: the layout took them)
    ("tokens", rf"topk_idx has {2 * T} tokens on this rank, more than cfg.max_tokens_per_rank={T}"),
])
def test_layout_bad_arguments(case, match):
    idx = random_routing(np.random.default_rng(406), R, T, K, E)
    idx = {"shape": idx[:, :, :2], "dtype": idx.astype(np.float32),
           "tokens": np.concatenate([idx, idx], axis=1)}[case]
    with pytest.raises(ValueError, match=match):
        per_rank(lambda i: jax_ep.get_dispatch_layout(i, CFG), R)(idx)


# ---- EPConfig --------------------------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [
    ("num_experts", 0), ("num_experts", -8), ("num_experts", 8.0), ("num_experts", True),
    ("num_experts", "8"),
    ("num_topk", 0), ("hidden", -1), ("max_tokens_per_rank", 0), ("expert_alignment", 0),
    ("hidden", None),
])
def test_epconfig_positive_ints(field, value):
    kw = dict(num_experts=E, num_topk=K, hidden=H, max_tokens_per_rank=T)
    kw[field] = value
    match = rf"EPConfig\.{field} must be a positive int, got {re.escape(repr(value))}"
    with pytest.raises(ValueError, match=match):
        jax_ep.EPConfig(**kw)


@pytest.mark.parametrize("field,value", [
    ("num_sms", 0), ("dispatch_send_warps", -1), ("combine_send_warps", 2.0), ("broadcast_send_warps", None),
])
def test_kernel_config_positive_ints(field, value):
    match = rf"KernelConfig\.{field} must be (None or )?a positive int, got {re.escape(repr(value))}"
    with pytest.raises(ValueError, match=match):
        jax_ep.KernelConfig(**{field: value})
    with pytest.raises(ValueError, match=r"KernelConfig\.bulk_copy must be a bool, got 1"):
        jax_ep.KernelConfig(bulk_copy=1)


def test_kernel_config_is_part_of_the_jit_cache_key():
    a = jax_ep.EPConfig(num_experts=E, num_topk=K, hidden=H, max_tokens_per_rank=T)
    b = a.replace(kernel=a.kernel.replace(num_sms=48))
    assert a != b and hash(a) != hash(b)
    assert a == a.replace(kernel=jax_ep.KernelConfig())
    with pytest.raises(ValueError, match="EPConfig.kernel must be a KernelConfig"):
        a.replace(kernel={"num_sms": 48})


@pytest.mark.parametrize("changes,match", [
    (dict(num_topk=9), r"num_topk=9 exceeds num_experts=8"),
    (dict(capacity=0), r"EPConfig\.capacity must be None or a positive int, got 0"),
    (dict(capacity=-4), r"EPConfig\.capacity must be None or a positive int, got -4"),
    (dict(capacity=16.0), r"EPConfig\.capacity must be None or a positive int, got 16\.0"),
    (dict(capacity=10, expert_alignment=4), r"capacity=10 must be a multiple of expert_alignment=4"),
    (dict(dispatch_dtype="float16"), r"dispatch_dtype must be one of .*got 'float16'"),
    (dict(dispatch_dtype="float8_e4m3fn"), r"float8_e4m3fn' needs hidden a multiple of 128 .*got hidden=32"),
    (dict(backend="tpu"), r"backend must be one of .*got 'tpu'"),
    (dict(axis_name=""), r"axis_name must be a non-empty str, got ''"),
    (dict(axis_name=None), r"axis_name must be a non-empty str, got None"),
])
def test_epconfig_bad_fields(changes, match):
    kw = dict(num_experts=E, num_topk=K, hidden=H, max_tokens_per_rank=T)
    kw.update(changes)
    with pytest.raises(ValueError, match=match):
        jax_ep.EPConfig(**kw)


def test_epconfig_is_static_and_hashable():
    a = jax_ep.EPConfig(num_experts=E, num_topk=K, hidden=H, max_tokens_per_rank=T)
    b = jax_ep.EPConfig(num_experts=E, num_topk=K, hidden=H, max_tokens_per_rank=T)
    assert a == b and hash(a) == hash(b) and a != a.replace(capacity=8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.num_experts = 16
    assert a.worst_case_capacity(2) == 2 * T * K
    assert a.replace(expert_alignment=4).worst_case_capacity(4) == 56  # 4*6*2 + 2*3 = 54, aligned to 4


# ---- checked mode (run time) -------------------------------------------------------------------------
CHECKED = CFG.replace(checked=True)


@functools.cache
def checked_fn(cfg, ep_size=R):
    def f(x, idx, w):
        d = jax_ep.dispatch(x, idx, w, cfg)
        return d.x, d.num_dropped, jax_ep.get_dispatch_layout(idx, cfg).num_tokens_per_expert

    return per_rank(f, ep_size)


def _run(fn, *args):
    return to_numpy(jax_ep.run_checked(fn, *args))


def _valid_idx(rng, ep_size=R):
    """-1 slots and repeated experts are valid in checked mode; out-of-range ids are not."""
    return random_routing(rng, ep_size, T, K, E, p_out_of_range=0.0, p_repeat=0.3)


def test_checked_mode_passes_on_valid_input():
    rng = np.random.default_rng(410)
    x, w = random_inputs(rng, R, T, H, K)
    idx = _valid_idx(rng)
    assert (idx == -1).any()
    rows, dropped, per_expert = _run(checked_fn(CHECKED), x, idx, w)
    unchecked_rows, _, _ = _run(checked_fn(CFG), x, idx, w)
    np.testing.assert_array_equal(rows, unchecked_rows)
    np.testing.assert_array_equal(rows, np.stack([r.rows for r in model_for(CFG, x, idx, w).ranks]))
    assert (dropped == 0).all()


def test_checked_mode_with_no_tokens_on_a_rank():
    """T = 0 tokens per rank in checked mode: empty rows and zero counts (the id check took an argmax of
    nothing before 2026-12-05)."""
    x = np.zeros((R, 0, H), np.float32)
    idx, w = np.zeros((R, 0, K), np.int32), np.zeros((R, 0, K), np.float32)
    rows, dropped, per_expert = _run(checked_fn(CHECKED), x, idx, w)
    assert rows.shape[0] == R and not rows[:, :0].size and (dropped == 0).all() and (per_expert == 0).all()


@pytest.mark.parametrize("bad,count", [(E, 1), (E + 3, 2), (-2, 1), (-(2**31), 3), (2**31 - 1, 1)])
def test_checked_mode_rejects_out_of_range_ids(bad, count):
    """Bad ids on every rank (each rank raises; see test_checked_mode_error_on_one_rank_only for the
    case where only some ranks see an error)."""
    rng = np.random.default_rng(411)
    x, w = random_inputs(rng, R, T, H, K)
    idx = _valid_idx(rng)
    for r in range(R):
        flat = idx[r].reshape(-1)
        flat[rng.choice(flat.size, size=count, replace=False)] = bad
        idx[r] = flat.reshape(T, K)
    # the count may be this rank's or the EP group's total
    with pytest.raises(jax_ep.EPValueError, match=rf"^jax_ep\.dispatch: topk_idx has {R * count} ids "
                                                  rf"outside \[-1, {E}\).*first bad value {bad}$"):
        _run(checked_fn(CHECKED), x, idx, w)


def test_checked_mode_rejects_out_of_range_ids_single_rank():
    rng = np.random.default_rng(415)
    x, w = random_inputs(rng, 1, T, H, K)
    idx = _valid_idx(rng, 1)
    idx[0, 3, 1] = -5
    with pytest.raises(jax_ep.EPValueError, match=r"topk_idx has 1 ids outside \[-1, 8\).*bad value -5"):
        _run(checked_fn(CHECKED, 1), x, idx, w)


def test_checked_layout_rejects_out_of_range_ids():
    idx = _valid_idx(np.random.default_rng(412))
    idx[:, 2, 0] = 100
    fn = per_rank(lambda i: jax_ep.get_dispatch_layout(i, CHECKED), R)
    np.testing.assert_array_equal(_run(fn, _valid_idx(np.random.default_rng(413))).num_tokens_per_rank.shape,
                                  (R, R))
    with pytest.raises(jax_ep.EPValueError, match=rf"^jax_ep\.get_dispatch_layout: topk_idx has {R} ids "
                                                  r"outside \[-1, 8\).*first bad value 100$"):
        _run(fn, idx)


def test_checked_mode_capacity_too_small():
    cfg = CHECKED.replace(capacity=4)
    rng = np.random.default_rng(414)
    x, w = random_inputs(rng, R, T, H, K)
    idx = np.full((R, T, K), -1, np.int32)
    idx[:, :, 0] = 0  # 12 rows for expert 0 on rank 0 and 12 for expert 4 on rank 1, capacity 4
    idx[:, :, 1] = 4
    assert [r.num_dropped for r in model_for(cfg, x, idx, w).ranks] == [8, 8]
    with pytest.raises(jax_ep.EPValueError, match=r"^jax_ep\.dispatch: EPConfig\.capacity=4 is too small: 16 "
                                                  r"rows dropped across the EP group; capacity needed: 12 .*"
                                                  r"set EPConfig\.capacity \(the MoE layer's "
                                                  r"EPOptions\.capacity\) to at least that"):
        _run(checked_fn(cfg), x, idx, w)
    # the same config passes when everything fits
    idx_ok = np.full((R, T, K), -1, np.int32)
    idx_ok[:, :2, 0] = 0
    idx_ok[:, :2, 1] = 4
    _, dropped, _ = _run(checked_fn(cfg), x, idx_ok, w)
    np.testing.assert_array_equal(dropped, [0, 0])


@pytest.mark.parametrize("align", [1, 4])
def test_checked_mode_names_the_capacity_needed(align):
    """The capacity in the message is the least one that drops nothing: the most rows a rank gets with
    unlimited capacity, each expert's count aligned (the sum of its group_sizes); it passes, one less
    (one alignment step less) fails."""
    rng = np.random.default_rng(416)
    x, w = random_inputs(rng, R, T, H, K)
    idx = _valid_idx(rng)
    idx[0, :, 0] = 1  # skew: rank 0's experts get more rows
    unlimited = model_for(CHECKED.replace(expert_alignment=align), x, idx, w)
    needed = max(int(np.sum(r.group_sizes)) for r in unlimited.ranks)
    cfg = CHECKED.replace(expert_alignment=align, capacity=needed - align)
    with pytest.raises(jax_ep.EPValueError, match=rf"capacity={needed - align} is too small: .*"
                                                  rf"capacity needed: {needed} .*expert_alignment={align}"):
        _run(checked_fn(cfg), x, idx, w)
    _, dropped, _ = _run(checked_fn(cfg.replace(capacity=needed)), x, idx, w)
    np.testing.assert_array_equal(dropped, [0, 0])


def test_checked_mode_names_the_capacity_needed_under_a_rank_mask():
    """With a rank mask the capacity needed counts only the pairs that reach a rank (active source,
    active destination): it passes, one less fails (before 2026-12-05 the masked pairs were counted)."""
    ep_size = 4
    rng = np.random.default_rng(418)
    x, w = random_inputs(rng, ep_size, T, H, K)
    idx = _valid_idx(rng, ep_size)
    idx[2, :, 0] = 0   # skew: more rows for rank 0's experts, some from a masked source
    idx[1, :, 1] = 1
    mask = np.array([1, 0, 1, 1], np.int32)

    def fn(cfg):
        return per_rank(lambda x, idx, w: jax_ep.dispatch(x, idx, w, cfg, rank_mask=jnp.asarray(mask)).x,
                        ep_size)

    def needed(cfg):
        try:
            _run(fn(cfg), x, idx, w)
        except jax_ep.EPValueError as e:
            return int(re.search(r"capacity needed: (\d+)", str(e)).group(1))
        return None

    big = CHECKED.replace(capacity=ep_size * T * K)
    assert needed(big) is None
    least = next(c for c in range(1, ep_size * T * K + 1) if needed(big.replace(capacity=c)) is None)
    assert needed(big.replace(capacity=least - 1)) == least
    assert needed(big.replace(capacity=1)) == least


@pytest.mark.parametrize("used", ["x", "group_sizes", "src_index", "combine"])
def test_checked_mode_check_runs_whatever_output_is_used(used):
    """The checks are tied to every output: using any one of them runs them (no dead-code removal)."""
    cfg = CHECKED.replace(capacity=4)
    rng = np.random.default_rng(417)
    x, w = random_inputs(rng, R, T, H, K)
    idx = np.full((R, T, K), -1, np.int32)
    idx[:, :, 0] = 0

    def f(x, i, w):
        d = jax_ep.dispatch(x, i, w, cfg)
        return {"x": d.x, "group_sizes": d.group_sizes, "src_index": d.handle.src_index,
                "combine": jax_ep.combine(d.x, d.handle, cfg) if used == "combine" else None}[used]

    with pytest.raises(jax_ep.EPValueError, match=r"capacity=4 is too small: 8 rows dropped"):
        _run(per_rank(f, R), x, idx, w)


def test_checked_straight_through_dispatch_checks_when_only_its_rows_are_used():
    """dispatch_straight_through's check of capacity drops was tied to its Dispatched only: a caller
    reading only the dequantised rows (as an FP8 GEMM does) ran no check, and the drops went unreported;
    its errors named 'dispatch'."""
    cfg = make_cfg(num_experts=E, num_topk=K, hidden=128, max_tokens_per_rank=T, checked=True, capacity=4,
                   dispatch_dtype="float8_e4m3fn")
    rng = np.random.default_rng(419)
    x, w = random_inputs(rng, R, T, 128, K)
    idx = np.full((R, T, K), -1, np.int32)
    idx[:, :, 0] = 0
    rows_only = per_rank(lambda x, i, w: jax_ep.ops.dispatch_straight_through(x, i, w, cfg)[1], R)
    with pytest.raises(jax_ep.EPValueError, match=r"jax_ep.dispatch_straight_through: EPConfig.capacity=4 "
                                                  r"is too small: 8 rows dropped"):
        _run(rows_only, x, idx, w)


def test_checked_ops_run_under_vmap_as_unchecked_ones_do():
    """The checks' callbacks had no vmap_method: jax.vmap of a checked dispatch / layout failed with
    JAX's NotImplementedError while the unchecked ops ran; each element is checked."""
    rng = np.random.default_rng(420)
    x, w = random_inputs(rng, R, T, H, K)
    idx = _valid_idx(rng)

    def batched(cfg):
        def f(x, i, w):
            two = lambda a: jnp.stack([a, a])
            return jax.vmap(lambda x, i, w: jax_ep.dispatch(x, i, w, cfg).x)(two(x), two(i), two(w))
        return per_rank(f, R)

    np.testing.assert_array_equal(_run(batched(CHECKED), x, idx, w), to_numpy(batched(CFG)(x, idx, w)))
    bad = idx.copy()
    bad[1, 0, 0] = E
    with pytest.raises(jax_ep.EPValueError, match=f"first bad value {E}"):
        _run(batched(CHECKED), x, bad, w)


@pytest.mark.parametrize("dtype", ["float8_e5m2", "float8_e4m3fnuz", "float4_e2m1fn"])
def test_combine_refuses_the_y_dtypes_it_names_no_kernel_for(dtype):
    """combine / combine_rank_major said 'float32/bfloat16/float16' but let every float but e4m3 through
    to the reference, which combined in it (the kernels refuse them)."""
    rng = np.random.default_rng(421)
    x, w = random_inputs(rng, R, T, H, K)
    idx = _valid_idx(rng)

    def f(x, i, w):
        d = jax_ep.dispatch(x, i, w, CFG)
        return jax_ep.combine(d.x.astype(dtype), d.handle, CFG)

    message = rf"combine: y must be float32/bfloat16/float16 \(float64 with x64\), got dtype {dtype}"
    with pytest.raises(jax_ep.EPValueError, match=message):
        per_rank(f, R)(x, idx, w)


def test_checked_mode_only_costs_when_on():
    """No callback, no extra op in the unchecked program; the checked one has the callbacks."""
    rng = np.random.default_rng(418)
    x, w = random_inputs(rng, R, T, H, K)
    idx = _valid_idx(rng)
    plain = str(jax.make_jaxpr(checked_fn(CFG))(x, idx, w))
    checked = str(jax.make_jaxpr(checked_fn(CHECKED))(x, idx, w))
    assert "callback" not in plain
    assert checked.count("pure_callback") >= 2


def test_ep_errors_passes_other_errors_through():
    with pytest.raises(ZeroDivisionError):
        with jax_ep.ep_errors():
            raise ZeroDivisionError
    err = jax.errors.JaxRuntimeError("INTERNAL: something else")
    with pytest.raises(jax.errors.JaxRuntimeError, match="something else"):
        with jax_ep.ep_errors():
            raise err
    assert issubclass(jax_ep.EPValueError, ValueError)


# An error seen by some ranks only must still surface as an exception, not hang the ranks that wait in
# the next collective (XLA:CPU aborts the whole process after 40 s). Run in subprocesses for that reason.
_ONE_RANK_SCRIPT = """
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import numpy as np, jax, jax_ep
from jax.sharding import Mesh, PartitionSpec as P
case, backend, mode = sys.argv[1:4]
cfg = jax_ep.EPConfig(num_experts=8, num_topk=2, hidden=16, max_tokens_per_rank=4, checked=True,
                      backend=backend, capacity=4 if case == "capacity" else None)
mesh = Mesh(np.array(jax.devices()[:2]), ("ep",))
def body(x, i, w):
    d = jax_ep.dispatch(x, i, w, cfg)
    return jax_ep.combine(d.x, d.handle, cfg)
f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 3, out_specs=P("ep")))
x = np.ones((8, 16), np.float32)
w = np.ones((8, 2), np.float32)
idx = np.tile(np.array([[0, 5]], np.int32), (8, 1))   # experts 0 (rank 0) and 5 (rank 1): 8 rows each
if case == "ids":
    idx[1, 1] = 99                                    # one bad id, on rank 0 only
else:
    idx[:, 1] = -1                                    # rank 0 drops 4 of its 8 rows, rank 1 gets none
if mode == "uncaught":
    jax_ep.run_checked(f, x, idx, w)
try:
    jax_ep.run_checked(f, x, idx, w)
    print("NO ERROR")
except jax_ep.EPValueError as e:
    print("RAISED", type(e).__name__, str(e).replace(chr(10), " "))
"""


def _run_scripts(modes):
    """{(case, mode): (returncode, stdout, stderr)}; None for the returncode when it hung."""
    import os
    import subprocess
    import sys
    import time

    from helpers import BACKEND

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [os.path.dirname(os.path.dirname(jax_ep.__file__)),
                                                    env.get("PYTHONPATH")] if p)
    procs = {(case, mode): subprocess.Popen(
        [sys.executable, "-c", _ONE_RANK_SCRIPT, case, BACKEND, mode], env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True) for case in ("ids", "capacity") for mode in modes}
    results = {}
    deadline = time.monotonic() + 120   # two jax start-ups on a loaded machine
    for key, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=max(deadline - time.monotonic(), 1))
            results[key] = (proc.returncode, out, err)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            results[key] = (None, "", "hung: the ranks without an error wait forever in the next all_to_all")
    return results


_EXPECT = {"ids": r"jax_ep\.dispatch: topk_idx has 1 ids outside \[-1, 8\).*first bad value 99",
           "capacity": r"jax_ep\.dispatch: EPConfig\.capacity=4 is too small: 4 rows dropped across the EP "
                       r"group; capacity needed: 8 "}


def test_checked_mode_error_on_one_rank_only():
    """Bad ids on rank 0 only / capacity overflow on rank 0 only, followed by combine: one EPValueError
    that `except jax_ep.EPValueError` catches, and nothing on stderr (no per-rank callback tracebacks,
    no atexit tracebacks)."""
    results = _run_scripts(["caught"])
    bad = [f"{case}: rc={rc}: {out[-600:]} / stderr: {err[-2000:]}"
           for (case, _), (rc, out, err) in results.items()
           if not (rc == 0 and re.search("RAISED EPValueError " + _EXPECT[case], out) and err.strip() == "")]
    assert not bad, "\n".join(bad)


def test_checked_mode_uncaught_error_is_one_short_traceback():
    """Uncaught, the error is Python's one traceback ending in `jax_ep.EPValueError: <message>`: no
    per-rank callback tracebacks, no JAX internals, no atexit tracebacks."""
    results = _run_scripts(["uncaught"])
    bad = []
    for (case, _), (rc, out, err) in results.items():
        lines = err.strip().splitlines()
        if not (rc == 1 and out == "" and err.count("Traceback") == 1 and len(lines) <= 12
                and re.fullmatch("jax_ep\\.EPValueError: " + _EXPECT[case] + ".*", lines[-1])
                and "atexit" not in err and "callback" not in err):
            bad.append(f"{case}: rc={rc}, {len(lines)} lines:\n{err[-3000:]}")
    assert not bad, "\n".join(bad)
