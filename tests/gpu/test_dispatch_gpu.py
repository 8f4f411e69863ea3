"""The throughput dispatch / combine kernels (backend='cuda') against the reference path on 2 GPUs.

Bit-exact: dispatched rows (first sum(group_sizes) rows), FP8 scales, group_sizes, expert_counts,
row_weights, num_dropped and every handle field. Combine: within bf16 rounding (same summation
order; XLA may contract the reference's multiply-adds differently). FP8: the same bits as an
IEEE float32 NumPy quantisation. Gradients through dispatch -> ragged_dot -> combine, combine's fused
backward (d y, d row_weights) bit-exact against the reference, the Flax MoE
layer's training step, a 20-step lax.scan captured as CUDA graphs, and a rank that skips the call
(a timeout naming the op and the rank). Device memory is poisoned before each call.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from gpu_helpers import (
    EP_RANKS,
    GRAPH_OPTIONS,
    assert_captured,
    assert_side_results_read_after_join,
    ep_step_child,
    faults_of_child,
    handler_stats,
    needs_two_ranks,
    poison_device_memory,
    random_normal,
    scheduled_ep_calls,
)
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ep

pytestmark = pytest.mark.gpu

AXIS = "ep"
R = EP_RANKS


@pytest.fixture(scope="module")
def mesh(gpus):
    if len(gpus) < R:
        pytest.skip(f"needs {R} GPUs, have {len(gpus)}")
    return Mesh(np.array(gpus[:R]), (AXIS,))


def routing(rng, kind: str, n: int, topk: int, experts: int) -> np.ndarray:
    if kind == "distinct":
        return np.argsort(rng.random((n, experts)), axis=1)[:, :topk].astype(np.int32)
    if kind == "messy":  # -1 / out-of-range slots and repeated experts
        idx = rng.integers(0, experts, (n, topk))
        idx = np.where(rng.random((n, topk)) < 0.2, rng.choice([-1, -3, experts], (n, topk)), idx)
        if topk > 1:
            repeat = rng.random((n, topk)) < 0.15
            idx = np.where(repeat, np.take_along_axis(idx, rng.integers(0, topk, (n, topk)), 1), idx)
        return idx.astype(np.int32)
    if kind == "skewed":  # half of the tokens pick expert 0 first
        idx = np.argsort(rng.random((n, experts)), axis=1)[:, :topk].astype(np.int32)
        hot = rng.random(n) < 0.5
        idx = np.where(hot[:, None] & (idx == 0), experts - 1, idx)
        idx[:, 0] = np.where(hot, 0, idx[:, 0])
        return idx.astype(np.int32)
    raise ValueError(kind)


def inputs(rng, tokens, hidden, topk, experts, kind, x_dtype=jnp.bfloat16):
    n = R * tokens
    x = (rng.standard_normal((n, hidden)) * 2).astype(np.float32).astype(x_dtype)
    return x, routing(rng, kind, n, topk, experts), rng.random((n, topk)).astype(np.float32)


def _cfg(backend, **kw):
    return jax_ep.EPConfig(axis_name=AXIS, backend=backend, **kw)


def dispatch_combine_body(cfg):
    """The per-rank body of dispatch_combine_fn (the process-model-2 workers run it under vmap for
    their reference: gpu_helpers.reference_by_vmap)."""

    def body(x, idx, w, y):
        d = jax_ep.dispatch(x, idx, w, cfg)
        out = jax_ep.combine(y, d.handle, cfg)
        return jax.tree.map(lambda a: a[None], d), out

    return body


@functools.cache
def dispatch_combine_fn(mesh, cfg):
    """(x, idx, w, y) -> (Dispatched with a leading rank axis, combine(y) [R*T, H])."""
    return jax.jit(jax.shard_map(dispatch_combine_body(cfg), mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))


def put(mesh, *arrays):
    return [jax.device_put(a, NamedSharding(mesh, P(AXIS))) for a in arrays]


def to_np(tree):
    return jax.tree.map(np.asarray, tree)


def bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(np.uint8).reshape(*a.shape, a.itemsize) if a.dtype != np.bool_ else a


def assert_bits_equal(got, want, what):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype, (
        f"{what}: {got.dtype}{list(got.shape)} vs {want.dtype}{list(want.shape)}")
    diff = bits(got) != bits(want)
    if diff.ndim > got.ndim:
        diff = diff.any(-1)
    if diff.any():
        first = tuple(int(i) for i in np.argwhere(diff)[0])
        raise AssertionError(f"{what}: {int(diff.sum())} of {diff.size} differ; first at {first}: "
                             f"got {got[first]!r}, want {want[first]!r}")


def assert_dispatch_equal(got, want, what):
    for r in range(R):
        total = int(want.group_sizes[r].sum())
        w = f"{what} rank {r}"
        assert_bits_equal(got.group_sizes[r], want.group_sizes[r], f"{w} group_sizes")
        assert_bits_equal(got.x[r][:total], want.x[r][:total], f"{w} rows")
        if want.scales is not None:
            assert_bits_equal(got.scales[r][:total], want.scales[r][:total], f"{w} scales")
        for field in ("expert_counts", "row_weights", "num_dropped"):
            assert_bits_equal(getattr(got, field)[r], getattr(want, field)[r], f"{w} {field}")
        for field in ("src_index", "token_rows", "is_token_in_rank", "row_weights"):
            assert_bits_equal(getattr(got.handle, field)[r], getattr(want.handle, field)[r],
                              f"{w} handle.{field}")


def assert_combine_close(got, want, what, steps=1):
    """Within bf16 rounding: every element within `steps` bf16 steps of its row's largest value."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all(), f"{what}: non-finite values"
    scale = np.abs(want).max(axis=1, keepdims=True) + 1e-30
    err = np.abs(got - want) / scale
    exact = float(np.mean(got == want))
    print(f"{what}: {100 * exact:.3f}% bit-exact, max error {err.max():.3g} of the row max")
    assert err.max() <= steps * 2.0 ** -7, f"{what}: max error {err.max():.3g} of the row max"


# (tokens, hidden, topk, experts, routing, extra config)
CASES = {
    "h2048_k8": (256, 2048, 8, 64, "distinct", {}),
    "h4096_k6_messy_align8": (200, 4096, 6, 32, "messy", {"expert_alignment": 8}),
    "h7168_k8_e256": (512, 7168, 8, 256, "distinct", {}),
    "h2048_k1": (300, 2048, 1, 16, "distinct", {}),
    "h2048_k2_skewed_overflow": (256, 2048, 2, 8, "skewed", {"capacity": 192,
                                                             "expert_alignment": 4}),
    "f32_x_bf16_rows_k4": (128, 1024, 4, 16, "messy", {"dispatch_dtype": "bfloat16"}),
    # top-k above 8: prep's 16 register slots per token, then kMaxTopk's over two token tiles
    "h1024_k12_messy": (300, 1024, 12, 32, "messy", {}),
    "h512_k20_two_tiles": (1100, 512, 20, 64, "distinct", {}),
}


def test_auto_decides_by_the_platform_of_the_call(mesh):
    """backend='auto' asks the platform of the call (jax_ep.backends.platform: its mesh's devices):
    on the GPU mesh it takes dispatch's kernel where the auto table has it faster; the same program
    traced on a CPU mesh of this machine takes the reference, saying why."""
    from jax_ep import backends, ops

    cfg = _cfg("auto", num_experts=8, num_topk=2, hidden=256, max_tokens_per_rank=4096)
    seen = []

    def body(x):
        seen.append((backends.platform(), ops.OPS["dispatch"].plan(cfg, lax.axis_size(AXIS), x.dtype)))
        return x

    for devices in (mesh.devices.ravel(), np.array(jax.devices("cpu")[:1])):
        n = len(devices)
        f = jax.shard_map(body, mesh=Mesh(devices, (AXIS,)), in_specs=P(AXIS), out_specs=P(AXIS))
        jax.jit(f).lower(jax.ShapeDtypeStruct((n * 8, 256), jnp.bfloat16))
    (gpu_platform, gpu_plan), (cpu_platform, cpu_plan) = seen
    assert gpu_platform == "gpu" and cpu_platform == "cpu", seen
    faster = ops.OPS["dispatch"].kernel_by_default(cfg, R)
    assert gpu_plan.impl == ("cuda" if faster else "reference"), gpu_plan
    assert cpu_plan.impl == "reference", cpu_plan
    if ops.OPS["dispatch"].kernel_by_default(cfg, 1):
        assert cpu_plan.reason == "backend='auto': the platform of the call is 'cpu', not 'gpu'", cpu_plan


@pytest.mark.parametrize("case", list(CASES))
def test_dispatch_combine_match_reference(cuda_backend, mesh, case):
    check_dispatch_combine(mesh, case)


@pytest.mark.parametrize("case", ["h7168_k8_e256", "h2048_k2_skewed_overflow", "f32_x_bf16_rows_k4"])
def test_pulled_dispatch_matches_reference(cuda_backend, mesh, case):
    """KernelConfig(dispatch_pull=True): each rank stages a token once in its own buffer and each
    peer loads it from there; the rows and handle are the reference's as the pushed form's are (at
    EP1 there is no peer: the attribute and fingerprint path only)."""
    check_dispatch_combine(mesh, case, jax_ep.KernelConfig(dispatch_pull=True))


def check_dispatch_combine(mesh, case, kernel=None):
    """CASES[case]: dispatch and combine with the CUDA kernels (``kernel``: KernelConfig's defaults)
    against the reference, two calls of one compiled function on fresh data, poisoned memory."""
    tokens, hidden, topk, experts, kind, extra = CASES[case]
    x_dtype = jnp.float32 if case.startswith("f32") else jnp.bfloat16
    kw = dict(num_experts=experts, num_topk=topk, hidden=hidden, max_tokens_per_rank=tokens, **extra)
    cuda_fn = dispatch_combine_fn(mesh, _cfg("cuda", **kw, **({"kernel": kernel} if kernel else {})))
    ref_fn = dispatch_combine_fn(mesh, _cfg("reference", **kw))
    capacity = _cfg("cuda", **kw).resolved_capacity(R)
    rng = np.random.default_rng(list(CASES).index(case))
    for call in range(2):  # repeated calls of one compiled function, fresh data
        x, idx, w = inputs(rng, tokens, hidden, topk, experts, kind, x_dtype)
        y = random_normal(rng, (R * capacity, hidden), jnp.bfloat16)
        args = put(mesh, x, idx, w, y)
        want_d, want_out = to_np(ref_fn(*args))
        poison_device_memory(mesh.devices.flat, 256 << 20)
        got_d, got_out = to_np(cuda_fn(*args))
        assert_dispatch_equal(got_d, want_d, f"{case} call {call}")
        if "overflow" in case:
            assert want_d.num_dropped.sum() > 0, "the case should overflow the capacity"
        assert_combine_close(got_out, want_out, f"{case} call {call} combine")


def quantize_fp8_numpy(x: np.ndarray, min_amax: float = 1e-4):
    """jax_ep.fp8.quantize_fp8(x, min_amax) in IEEE float32 NumPy arithmetic and ml_dtypes' round to
    nearest even into e4m3 (the CUDA kernels' bits; the default floor is the wire's): (e4m3, scales)."""
    xf = np.asarray(x, np.float32).reshape(x.shape[0], x.shape[1] // 128, 128)
    amax = np.maximum(np.abs(xf).max(axis=2, initial=0), np.float32(min_amax))
    q = (xf * (np.float32(448.0) / amax)[:, :, None]).reshape(x.shape)
    return q.astype(ml_dtypes.float8_e4m3fn), (amax / np.float32(448.0)).astype(np.float32)


@pytest.mark.parametrize("x_dtype", [jnp.bfloat16, jnp.float32])
def test_fp8_dispatch_matches_quantisation(cuda_backend, mesh, x_dtype):
    tokens, hidden, topk, experts = 256, 7168, 8, 256
    kw = dict(num_experts=experts, num_topk=topk, hidden=hidden, max_tokens_per_rank=tokens,
              dispatch_dtype="float8_e4m3fn")
    cuda_fn = dispatch_combine_fn(mesh, _cfg("cuda", **kw))
    ref_fn = dispatch_combine_fn(mesh, _cfg("reference", **kw))
    capacity = _cfg("cuda", **kw).resolved_capacity(R)
    rng = np.random.default_rng(17)
    x, idx, w = inputs(rng, tokens, hidden, topk, experts, "messy", x_dtype)
    y = random_normal(rng, (R * capacity, hidden), jnp.bfloat16)
    args = put(mesh, x, idx, w, y)
    want_d, _ = to_np(ref_fn(*args))
    poison_device_memory(mesh.devices.flat, 256 << 20)
    got_d, _ = to_np(cuda_fn(*args))
    q_all, s_all = quantize_fp8_numpy(np.asarray(x))
    for r in range(R):
        total = int(got_d.group_sizes[r].sum())
        src = got_d.handle.src_index[r][:total]
        filled = src >= 0
        assert_bits_equal(got_d.x[r][:total][filled], q_all[src[filled]], f"rank {r} fp8 rows")
        assert_bits_equal(got_d.scales[r][:total][filled], s_all[src[filled]], f"rank {r} scales")
        assert not got_d.x[r][:total][~filled].astype(np.float32).any(), "padding rows not zero"
        assert not got_d.scales[r][:total][~filled].any(), "padding scales not zero"
        # the XLA reference on this GPU: same handle; rows equal where XLA divides exactly
        for field in ("src_index", "token_rows", "row_weights"):
            assert_bits_equal(getattr(got_d.handle, field)[r], getattr(want_d.handle, field)[r],
                              f"rank {r} {field}")
        same = np.mean(bits(got_d.x[r][:total]) == bits(want_d.x[r][:total]))
        print(f"rank {r}: {100 * same:.4f}% of fp8 bytes equal to the XLA-GPU reference")
        assert same > 0.999


def test_scan_of_20_steps_as_cuda_graphs(cuda_backend, mesh):
    """20 dispatch + combine calls in one lax.scan, captured into CUDA graphs: every step's outputs
    equal the reference (epochs advance on the device, buffers are reused each step)."""
    tokens, hidden, topk, experts, steps = 64, 512, 4, 16, 20
    kw = dict(num_experts=experts, num_topk=topk, hidden=hidden, max_tokens_per_rank=tokens)
    rng = np.random.default_rng(5)
    xs, idxs, ws = zip(*[inputs(rng, tokens, hidden, topk, experts,
                                "messy" if s % 2 else "distinct") for s in range(steps)], strict=True)
    capacity = _cfg("cuda", **kw).resolved_capacity(R)
    ys = random_normal(rng, (steps, R * capacity, hidden), jnp.bfloat16)
    stacked = [np.stack(a) for a in (xs, idxs, ws)] + [ys]
    args = [jax.device_put(a, NamedSharding(mesh, P(None, AXIS))) for a in stacked]

    def make(backend):
        cfg = _cfg(backend, **kw)

        def body(x, idx, w, y):
            def step(carry, xs):
                d = jax_ep.dispatch(*xs[:3], cfg)
                return carry, (jax.tree.map(lambda a: a[None], d), jax_ep.combine(xs[3], d.handle, cfg))
            return lax.scan(step, 0, (x, idx, w, y))[1]

        return jax.shard_map(body, mesh=mesh, in_specs=P(None, AXIS), out_specs=P(None, AXIS))

    options = GRAPH_OPTIONS["graphs"]
    want_d, want_out = to_np(jax.jit(make("reference"))(*args))
    compiled = jax.jit(make("cuda"), compiler_options=options).lower(*args).compile()
    before = handler_stats("jax_ep_dispatch")
    for run in range(2):  # the second run replays the graphs of the first
        poison_device_memory(mesh.devices.flat, 128 << 20)
        got_d, got_out = to_np(compiled(*args))
        for s in range(steps):
            pick = lambda t, s=s: jax.tree.map(lambda a: a[s], t)  # noqa: E731
            assert_dispatch_equal(pick(got_d), pick(want_d), f"run {run} step {s}")
            assert_combine_close(got_out[s], want_out[s], f"run {run} step {s} combine")
    assert_captured("jax_ep_dispatch", before, "graphs", options)


def grad_case(seed, tokens, hidden, topk, experts, kind):
    """(config sizes, (x, topk_idx, topk_weights, expert weights [E, H, H] bf16, output cotangent))."""
    kw = dict(num_experts=experts, num_topk=topk, hidden=hidden, max_tokens_per_rank=tokens)
    rng = np.random.default_rng(seed)
    x, idx, w = inputs(rng, tokens, hidden, topk, experts, kind)
    wexp = (rng.standard_normal((experts, hidden, hidden)) / np.sqrt(hidden)).astype(jnp.bfloat16)
    ct = rng.standard_normal((R * tokens, hidden)).astype(np.float32)
    return kw, (x, idx, w, wexp, ct)


def gradient_body(cfg):
    """The per-rank body of gradient_fn."""

    def loss(x, w, wexp, idx, ct):
        d = jax_ep.dispatch(x, idx, w, cfg)
        y = lax.ragged_dot(d.x, wexp, d.group_sizes)
        out = jax_ep.combine(y.astype(x.dtype), d.handle, cfg)
        return jnp.sum(out.astype(jnp.float32) * ct), out

    def body(x, w, wexp, idx, ct):
        (value, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(
            x, w, wexp, idx, ct)
        return (value[None], out) + grads

    return body


def gradient_fn(mesh, cfg):
    """(x, topk_weights, expert weights, topk_idx, cotangent) -> (loss [R], combine output, d x,
    d topk_weights, d expert weights) of dispatch -> ragged_dot -> combine, per rank."""
    return jax.jit(jax.shard_map(gradient_body(cfg), mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))


def test_gradients_match_reference(cuda_backend, mesh):
    """jax.grad through dispatch -> ragged_dot -> combine: d x (combine without weights), d gate
    weights (slot_values), d expert weights (broadcast of the output cotangent).

    Tolerances are bf16 rounding, two steps: XLA keeps the reference's bf16 intermediates in
    float32 where it can (xla_allow_excess_precision, on by default: the ragged_dot output feeding
    the reference's float32 sums is not rounded to bf16), while the kernels read and write bf16
    buffers (measured on 2x H200: rows, y, d topk_weights and d expert weights bit-identical; the
    combine output within two bf16 steps of the row max)."""
    kw, (x, idx, w, wexp, ct) = grad_case(9, 128, 1024, 4, 16, "messy")
    args = put(mesh, x, w, wexp, idx, ct)
    want = to_np(gradient_fn(mesh, _cfg("reference", **kw))(*args))
    poison_device_memory(mesh.devices.flat, 128 << 20)
    got = to_np(gradient_fn(mesh, _cfg("cuda", **kw))(*args))
    loss_got, out_got, dx_got, dw_got, dwexp_got = got
    loss_want, out_want, dx_want, dw_want, dwexp_want = want
    assert_combine_close(out_got, out_want, "forward combine", steps=2)
    # the loss within the bf16 rounding of its terms
    terms = np.abs(np.asarray(out_want, np.float32) * ct).reshape(R, -1).sum(axis=1)
    err = np.abs(loss_got - loss_want)
    print(f"loss {loss_got} vs {loss_want}: error {err} (bound {terms * 2.0 ** -7})")
    assert (err <= terms * 2.0 ** -7).all()
    for name, g, r in (("d x", dx_got, dx_want), ("d topk_weights", dw_got, dw_want),
                       ("d expert weights", dwexp_got, dwexp_want)):
        g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
        assert np.isfinite(g).all(), name
        rel = np.linalg.norm(g - r) / (np.linalg.norm(r) + 1e-30)
        print(f"{name}: relative error {rel:.3g}")
        assert rel < 1e-2, f"{name}: relative error {rel:.3g}"


def test_the_gpu_schedule_keeps_independent_ep_calls_in_program_order(cuda_backend, mesh, monkeypatch):
    """With the order on (several processes compile: ordering.needed), XLA's GPU schedule issues the EP
    calls of the gradient program in program order, though dispatch's backward issues two that do not
    depend on each other (combine for d x, slot_values for d topk_weights). The optimization barriers
    that carry the order are removed by XLA after it schedules (on CPU they are removed before, and
    the order is lost: review of 2026-12-05); this fails if a jax release moves that pass."""
    from jax_ep import ordering

    monkeypatch.setattr(ordering, "needed", lambda: True)
    kw, (x, idx, w, wexp, ct) = grad_case(9, 128, 1024, 4, 16, "messy")
    args = put(mesh, x, w, wexp, idx, ct)
    fn = gradient_fn(mesh, _cfg("cuda", **kw))
    expected = ordering.ep_calls(jax.make_jaxpr(fn)(*args))
    assert "jax_ep_slot_values" in expected and expected.count("jax_ep_combine") >= 2, expected
    assert scheduled_ep_calls(fn.lower(*args).compile().as_text()) == expected


@functools.cache
def combine_vjp_fn(mesh, cfg, masked, empty_rows_zero=False, weighted=True):
    """(x, idx, w, y, g, mask) -> (d y, d row_weights, handle.src_index) of combine's backward over
    the handle of cfg's dispatch (the mask, if masked, on combine only: an unmasked dispatch)."""

    def body(x, idx, w, y, g, mask):
        d = jax_ep.dispatch(x, idx, w, cfg)
        # NaN wherever no token landed: the backward must never read y there
        y = jnp.where((d.handle.src_index >= 0)[:, None], y, jnp.nan).astype(y.dtype)
        _, vjp = jax.vjp(lambda y, rw: jax_ep.combine(y, d.handle._replace(row_weights=rw), cfg,
                                                      rank_mask=mask if masked else None,
                                                      empty_rows_zero=empty_rows_zero, weighted=weighted),
                         y, d.handle.row_weights)
        dy, drw = vjp(g)
        return dy, drw, d.handle.src_index

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))


def combine_backward_case(mesh, y_dtype, masked, empty_rows_zero, weighted, seed, handler, num_sms=None,
                          pull=False):
    """combine's backward through a messy dispatch's handle (capacity drops; masked: rank 0 active, the
    others masked, on combine only) on the reference and then on 'cuda' over poisoned device memory
    (its data kernels on num_sms blocks; None: the default; pull: KernelConfig.broadcast_pull),
    checking that `handler` ran:
    (want, got, mask, tokens, hidden), want / got as combine_vjp_fn's."""
    if masked:
        needs_two_ranks(R)
    mask = (1,) + (0,) * (R - 1) if masked else None
    tokens, hidden, topk, experts = 160, 2304, 6, 16
    kw = dict(num_experts=experts, num_topk=topk, hidden=hidden, max_tokens_per_rank=tokens,
              capacity=640, expert_alignment=4)
    rng = np.random.default_rng(seed)
    x, idx, w = inputs(rng, tokens, hidden, topk, experts, "messy")
    capacity = _cfg("cuda", **kw).resolved_capacity(R)
    y = random_normal(rng, (R * capacity, hidden), y_dtype)
    g = random_normal(rng, (R * tokens, hidden), y_dtype)
    m = np.tile(np.asarray(mask or (1,) * R, np.int32), R)
    args = put(mesh, x, idx, w, y, g, m)

    def run(backend):
        # pushed or pulled as the case says (not as the auto table would choose for the default)
        kernel = jax_ep.KernelConfig(num_sms=num_sms, broadcast_pull=pull)
        extra = {"kernel": kernel} if backend == "cuda" else {}
        fn = combine_vjp_fn(mesh, _cfg(backend, **kw, **extra), masked, empty_rows_zero, weighted)
        return to_np(fn(*args))

    want = run("reference")
    before = handler_stats(handler)["calls"]
    poison_device_memory(mesh.devices.flat, 128 << 20)
    got = run("cuda")
    assert handler_stats(handler)["calls"] > before
    return want, got, mask, tokens, hidden


@pytest.mark.parametrize("num_sms", [None, 8], ids=["all_sms", "8_sms"])
@pytest.mark.parametrize("empty_rows_zero", [False, True], ids=["zeroed", "in_y"])
@pytest.mark.parametrize("y_dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("masked", [False, True])
def test_combine_backward_fused_matches_reference(cuda_backend, mesh, y_dtype, masked, empty_rows_zero,
                                                  num_sms):
    """backend='cuda' runs combine's backward as one kernel (jax_ep_combine_bwd): d y and
    d row_weights bit-exact against the reference (same float32 order, reference.row_dot), y's empty
    rows NaN (never read: +0.0 in both), capacity drops, messy routing; masked: rank 0 active, the
    others masked, on combine only (after an unmasked dispatch), so each rank links only itself and
    the other ranks' rows get +0.0. Device memory poisoned; the fused call really ran (handler count).
    in_y (combine's empty_rows_zero): d y written into y's buffer, its rows with no token y's (NaN
    here, as in the reference), every other row as above. 8_sms: the data kernels on 8 blocks, where the
    rows' y and g are prefetched into L2 a round of loads ahead (kBackwardPrefetchMaxBlocks,
    cuda/broadcast.cu)."""
    want, got, mask, tokens, hidden = combine_backward_case(mesh, y_dtype, masked, empty_rows_zero, True, 31,
                                                            "jax_ep_combine_bwd", num_sms)
    dy, drw, src = got
    assert_bits_equal(src, want[2], "handle.src_index")
    assert_bits_equal(dy, want[0], "d y")
    assert_bits_equal(drw, want[1], "d row_weights")
    src = src.reshape(R, -1)
    live = src >= 0
    if mask is not None:  # each rank links only itself: rows of the other rank's tokens are dead
        live &= (src // tokens) == np.arange(R)[:, None]
    drw = drw.reshape(R, -1)
    assert not np.any(drw[~live]) and np.isfinite(drw).all() and np.any(drw[live])
    assert (src < 0).any() and (mask is None or (live != (src >= 0)).any())
    assert np.isnan(dy.reshape(R, -1, hidden)[src < 0]).all() == empty_rows_zero


@pytest.mark.parametrize("weighted", [True, False], ids=["weighted", "unweighted"])
def test_combine_of_rows_of_any_width_matches_reference(cuda_backend, mesh, weighted):
    """Expert outputs y [C, H'] narrower than x and of a width that is not a multiple of 8: the cuda
    backend widens them with zero columns to the kernels' 8 and cuts the results back (2026-12-05;
    before, XLA refused the call when it instantiated it). combine, its fused backward (weighted) or
    the broadcast kernel (unweighted): bit-exact against the reference over poisoned memory."""
    tokens, hidden, topk, experts, width = 96, 256, 4, 8, 100
    kw = dict(num_experts=experts, num_topk=topk, hidden=hidden, max_tokens_per_rank=tokens)
    rng = np.random.default_rng(int(np.random.default_rng().integers(1 << 30)))
    x, idx, w = inputs(rng, tokens, hidden, topk, experts, "messy")
    capacity = _cfg("cuda", **kw).resolved_capacity(R)
    y = random_normal(rng, (R * capacity, width), jnp.bfloat16)
    g = random_normal(rng, (R * tokens, width), jnp.bfloat16)
    args = put(mesh, x, idx, w, y, g)

    def run(backend):
        cfg = _cfg(backend, **kw)

        def body(x, idx, w, y, g):
            d = jax_ep.dispatch(x, idx, w, cfg.replace(backend="reference"))
            y = jnp.where((d.handle.src_index >= 0)[:, None], y, 0).astype(y.dtype)
            out, vjp = jax.vjp(lambda y, rw: jax_ep.combine(y, d.handle._replace(row_weights=rw), cfg,
                                                            weighted=weighted), y, d.handle.row_weights)
            return (out, *vjp(g))

        return to_np(jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))(*args))

    want = run("reference")
    poison_device_memory(mesh.devices.flat, 128 << 20)
    got = run("cuda")
    assert got[0].shape == (R * tokens, width) and got[1].shape == (R * capacity, width)
    for name, a, b in zip(("out", "d y", "d row_weights"), got, want, strict=True):
        assert_bits_equal(a, b, name)
    assert np.any(got[0]) and np.any(got[1])


@pytest.mark.parametrize("pull", [False, True], ids=["pushed", "pulled"])
@pytest.mark.parametrize("empty_rows_zero", [False, True], ids=["zeroed", "in_y"])
@pytest.mark.parametrize("y_dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("masked", [False, True])
def test_unweighted_combine_backward_is_the_broadcast_kernel(cuda_backend, mesh, y_dtype, masked,
                                                             empty_rows_zero, pull):
    """combine(weighted=False) on backend='cuda': its backward is the broadcast kernel (jax_ep_broadcast,
    handler count), d y bit-exact against the reference (each token's g on its live rows, +0.0 on a
    masked source's rows), d row_weights zero; in_y: written into y's buffer (aliased), the rows with no
    token keeping y's NaN, every other row as zeroed's. Device memory poisoned; capacity drops, messy
    routing, the masked case as in the fused test above. pulled: KernelConfig(broadcast_pull=True)."""
    want, got, _, _, hidden = combine_backward_case(mesh, y_dtype, masked, empty_rows_zero, False, 37,
                                                    "jax_ep_broadcast", pull=pull)
    dy, drw, src = got
    assert_bits_equal(src, want[2], "handle.src_index")
    assert_bits_equal(dy, want[0], "d y")
    assert not np.any(drw) and not np.any(want[1])
    src = src.reshape(R, -1)
    dy = dy.reshape(R, -1, hidden)
    assert (src < 0).any() and np.isfinite(dy[src >= 0]).all() and np.any(dy[src >= 0])
    assert np.isnan(dy[src < 0]).all() == empty_rows_zero


def _assert_same_bits_thrice(compiled, args, want, mesh, what: str, names) -> None:
    """Three runs of `compiled`, device memory poisoned before each: every output (named by `names`)
    the same bits as `want`."""
    for run in range(3):
        poison_device_memory(mesh.devices.flat, 128 << 20)
        got = to_np(compiled(*args))
        failed = []     # every output that differs, not only the first (which one says why)
        for name, g, r in zip(names, got, want, strict=True):
            try:
                assert_bits_equal(np.asarray(g), np.asarray(r), f"{what} run {run} {name}")
            except AssertionError as e:
                failed.append(str(e))
        assert not failed, "\n".join(failed)


def test_async_stream_gives_the_same_bits(cuda_backend, mesh):
    """KernelConfig(async_stream=1): the EP ops run as async ops on XLA stream 1 (compute_on), the
    rest of the step on the compute stream. Forward and gradients bit-identical to the ops on the
    compute stream, with an independent matmul chain XLA may run while they are in flight; the
    compiled program really has the ops on stream 1, through the targets XLA never captures into a
    CUDA graph (with the command buffers of the default options and those that capture the EP call
    itself, every call runs its handler outside a graph)."""
    kw, (x, idx, w, wexp, ct) = grad_case(13, 256, 1024, 4, 16, "messy")

    def make(cfg):
        def loss(x, w, wexp, idx, ct):
            d = jax_ep.dispatch(x, idx, w, cfg)
            side = x.astype(jnp.float32)
            for _ in range(4):  # independent of the EP ops: may overlap them
                side = jnp.tanh(side @ wexp[0].astype(jnp.float32))
            y = lax.ragged_dot(d.x, wexp, d.group_sizes)
            out = jax_ep.combine(y.astype(x.dtype), d.handle, cfg)
            return jnp.sum(out.astype(jnp.float32) * ct) + jnp.sum(side), out

        def body(x, w, wexp, idx, ct):
            (value, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(
                x, w, wexp, idx, ct)
            return (value[None], out) + grads

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))

    args = put(mesh, x, w, wexp, idx, ct)
    sync = _cfg("cuda", **kw)
    want = to_np(make(sync)(*args))
    for options in (None, GRAPH_OPTIONS["graphs"]):
        overlapped = make(_cfg("cuda", **kw, kernel=jax_ep.KernelConfig(async_stream=1)))
        compiled = overlapped.lower(*args).compile(options)
        hlo = compiled.as_text()
        assert '_xla_stream_annotation="1"' in hlo and '"jax_ep_dispatch_uncaptured"' in hlo
        before = handler_stats("jax_ep_dispatch")
        _assert_same_bits_thrice(compiled, args, want, mesh, f"{options}",
                                 ("loss", "out", "d x", "d topk_weights", "d expert weights"))
        after = handler_stats("jax_ep_dispatch")
        assert after["calls"] >= before["calls"] + 3, (options, before, after)
        assert after["captured_calls"] == before["captured_calls"], (options, before, after)


SIDE_STREAM_NAMES = {False: ("out", "rows", "group sizes", "chain 1", "chain 2"),
                     True: ("loss", "out", "d x", "d topk_weights", "d expert weights")}


def side_stream_case():
    """The side-stream programs' EPConfig keywords and inputs (seed 13; the PM2 worker's too)."""
    return grad_case(13, 256, 1024, 4, 16, "messy")


def side_stream_fn(mesh, kw, side: bool, differentiated: bool):
    """dispatch beside an elementwise chain, then combine beside another (overlap.beside); with
    side=False the same program without the blocks (each chain after its op). Differentiated: loss,
    out and the gradients of x, topk_weights and the expert weights (SIDE_STREAM_NAMES). The rows are
    compared up to the groups' end: past it they are unspecified."""
    from jax_ep import overlap

    def chain(a, m):
        for i in range(4):
            a = jnp.tanh(a * m[i] + m[i + 4])
        return a

    cfg = _cfg("cuda", **kw)

    def forward(x, w, wexp, idx, ct):
        m = wexp[0].astype(jnp.float32)
        blocks = (lambda *a: overlap.beside(chain, *a)) if side else (
            lambda *a: contextlib.nullcontext(overlap.Beside(chain, a)))
        with blocks(x.astype(jnp.float32), m) as first:
            d = jax_ep.dispatch(x, idx, w, cfg)
        y = lax.ragged_dot(d.x, wexp, d.group_sizes).astype(x.dtype)
        with blocks(ct, m) as second:
            out = jax_ep.combine(y, d.handle, cfg)
        r1 = first.result if side else chain(*first.args)
        r2 = second.result if side else chain(*second.args)
        assert first.overlapped == side and second.overlapped == side
        rows = jnp.where(jnp.arange(d.x.shape[0])[:, None] < jnp.sum(d.group_sizes), d.x, 0)
        return out, rows, d.group_sizes, r1, r2

    def loss(x, w, wexp, idx, ct):
        out, _, _, r1, r2 = forward(x, w, wexp, idx, ct)
        return jnp.sum(out.astype(jnp.float32) * ct) + jnp.sum(r1) + jnp.sum(jnp.sin(r2)), out

    def grads(x, w, wexp, idx, ct):
        (value, out), g = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(x, w, wexp, idx, ct)
        return (value[None], out) + g

    body = grads if differentiated else forward
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))


def assert_side_targets(compiled, differentiated: bool, what: str) -> None:
    """The compiled side-stream program holds each side target and a join per side call, and XLA's
    schedule reads no side call's results before its join."""
    hlo = compiled.as_text()
    targets = ["dispatch_side", "combine_side"] + (["combine_bwd_side", "combine_side"]
                                                   if differentiated else [])
    for target in set(targets):
        assert hlo.count(f'"jax_ep_{target}"') == targets.count(target), (target, what)
    assert hlo.count('"jax_ep_side_join"') == len(targets), what
    assert_side_results_read_after_join(hlo, what)


@pytest.mark.parametrize("differentiated", [False, True])
def test_side_stream_gives_the_same_bits(cuda_backend, mesh, differentiated, ep_order):
    """jax_ep.overlap.beside: dispatch on jax_ep's side stream, an elementwise chain on XLA's stream
    between the fork and the join, then combine beside another chain; differentiated, each op's
    backward beside its chain's backward too. Every output (and gradient; the rows up to the groups'
    end, past it they are unspecified) bit-identical to the same program without the blocks, with
    output memory poisoned before each run, with and without command buffers; the compiled program
    holds the side targets and a join for each. (Elementwise: a matmul chain is autotuned per fusion,
    and the blocks' barriers change XLA's fusions, so its bits may differ for that reason alone.)
    ep_order: also with the EP calls' ordering effect, as several processes lower them (on one H200,
    2026-12-02, XLA then read dispatch's group sizes before the join: a zero-sized join token).
    Process model 2 runs the same programs (process_group_worker's side_stream group)."""
    kw, (x, idx, w, wexp, ct) = side_stream_case()
    args = put(mesh, x, w, wexp, idx, ct.astype(jnp.float32))
    want = to_np(side_stream_fn(mesh, kw, False, differentiated)(*args))
    for options in (None, GRAPH_OPTIONS["graphs"]):
        compiled = side_stream_fn(mesh, kw, True, differentiated).lower(*args).compile(options)
        assert_side_targets(compiled, differentiated, f"{options}")
        _assert_same_bits_thrice(compiled, args, want, mesh, f"{options}",
                                 SIDE_STREAM_NAMES[differentiated])


# Expert outputs whose bf16 rounding XLA's excess precision can remove in the backward graph. Found on
# one H200 (2026-11-23, _before_ reference.as_stored, reference backend): the plain float32 GEMM
# at hidden 512 / top-4 (1.5e-3 of max |dW|) and SiLU of it at hidden 2560 / top-8 (2.0e-3).
_EXPERT_OUTPUTS = {
    "f32_gemm": lambda rows, wexp, sizes: lax.ragged_dot(
        rows, wexp, sizes, preferred_element_type=jnp.float32),
    "silu_of_f32_gemm": lambda rows, wexp, sizes: jax.nn.silu(
        lax.ragged_dot(rows, wexp, sizes, preferred_element_type=jnp.float32)),
}


@pytest.mark.parametrize("backend", ["reference", "cuda"])
@pytest.mark.parametrize("hidden,topk,expert_output", [(512, 4, "f32_gemm"), (2560, 8, "silu_of_f32_gemm")])
def test_topk_weights_gradient_uses_rounded_expert_output(cuda_backend, mesh, backend, hidden, topk,
                                                          expert_output):
    """d topk_weights[t, k] = <g[t], y[row(t, k)]> with y as combine received it: rounded to bf16
    (docs/api.md). The expert output is computed in float32 and rounded to bf16 by the caller; XLA's
    excess precision (on by default) drops that rounding in the backward graph unless the op pins it
    (reference.as_stored). Checked against NumPy on the forward's own bf16 y and the bf16 cotangent
    of the bf16 output, to float32 summation order."""
    kw, (x, idx, w, wexp, ct) = grad_case(12, 256, hidden, topk, 16, "distinct")
    cfg = _cfg(backend, **kw)
    produce = _EXPERT_OUTPUTS[expert_output]

    def loss(w, x, wexp, idx, ct):
        d = jax_ep.dispatch(x, idx, w, cfg)
        y = produce(d.x, wexp, d.group_sizes).astype(jnp.bfloat16)
        out = jax_ep.combine(y, d.handle, cfg)
        return jnp.sum(out.astype(jnp.float32) * ct), (y, d.handle.token_rows)

    def body(w, x, wexp, idx, ct):
        (_, (y, token_rows)), dw = jax.value_and_grad(loss, has_aux=True)(w, x, wexp, idx, ct)
        return dw, y[None], token_rows[None]

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))
    dw, y, token_rows = to_np(fn(*put(mesh, w, x, wexp, idx, ct)))
    g = ct.astype(jnp.bfloat16).astype(np.float64)  # the cotangent of the bf16 combine output
    want = np.zeros_like(dw)
    for p in range(R):  # the rank holding each (source token, slot)'s row
        rows = token_rows[p]
        s, k = np.nonzero(rows >= 0)
        want[s, k] = np.einsum("nh,nh->n", y[p][rows[s, k]].astype(np.float64), g[s])
    rel = np.abs(dw - want).max() / np.abs(want).max()
    print(f"{backend} {expert_output}: d topk_weights max error {rel:.3g} of max |dW|")
    assert rel < 1e-4, f"{backend} {expert_output}: d topk_weights max error {rel:.3g} of max |dW|"


@pytest.mark.parametrize("gate_weights", ["combine", "experts"])
def test_moe_training_step_matches_reference(cuda_backend, mesh, gate_weights):
    """The Flax MoE layer (float32) trains the same on backend='cuda' as on 'reference', the gate
    weights applied in combine or in the experts (EPOptions.gate_weights)."""
    import optax
    from flax import nnx

    from jax_ep.gating import RouterConfig
    from jax_ep.moe import EPOptions, MoE

    hidden, ffn, experts, topk = 64, 96, 8, 2
    x = jnp.asarray(np.random.default_rng(0).standard_normal((16, 8, hidden)), jnp.float32)
    target = jnp.asarray(np.random.default_rng(1).standard_normal((16, 8, hidden)), jnp.float32)
    losses = {}
    for backend in ("reference", "cuda"):
        layer = MoE(hidden, ffn, RouterConfig(experts, topk), rngs=nnx.Rngs(0), mesh=mesh,
                    ep=EPOptions(backend=backend, gate_weights=gate_weights))
        optimizer = nnx.Optimizer(layer, optax.adam(1e-2), wrt=nnx.Param)

        @nnx.jit
        def step(layer, optimizer):
            loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - target) ** 2))(layer)
            optimizer.update(layer, grads)
            return loss

        losses[backend] = [float(step(layer, optimizer)) for _ in range(3)]
    print("losses", losses)
    np.testing.assert_allclose(losses["cuda"], losses["reference"], rtol=1e-4)
    assert losses["cuda"][-1] < losses["cuda"][0]


def test_unsupported_dtype_is_a_clear_error(cuda_backend, mesh):
    # 16 tokens over the group
    cfg = _cfg("cuda", num_experts=8, num_topk=2, hidden=64, max_tokens_per_rank=16 // R)
    fn = jax.jit(jax.shard_map(lambda x, i, w: jax_ep.dispatch(x, i, w, cfg).x, mesh=mesh,
                               in_specs=P(AXIS), out_specs=P(AXIS)))
    with pytest.raises(ValueError, match="float16.*backend='reference'"):
        fn.lower(jnp.zeros((16, 64), jnp.float16), jnp.zeros((16, 2), jnp.int32),
                 jnp.zeros((16, 2), jnp.float32))


_TIMEOUT_BODY = """
    def body(x, idx, w):
        run = lambda: jax_ep.{op}(x, idx, w, cfg).x.astype(jnp.float32).sum()
        skip = lambda: x.astype(jnp.float32).sum() * 0
        # rank 1 skips the call: rank 0 waits for it (group discovery) until the timeout
        return lax.cond(lax.axis_index("ep") == 0, run, skip)[None]
"""


@pytest.mark.parametrize("op", ["dispatch", "dispatch_rank_major"])
def test_rank_skipping_the_call_times_out_naming_op_and_rank(cuda_backend, mesh, op):
    needs_two_ranks(R)
    faults, stdout = faults_of_child(ep_step_child(_TIMEOUT_BODY.format(op=op)))
    assert len(faults) == 1, faults
    fault = faults[0]
    assert fault["kind"] == "timeout" and fault["op"] == op, fault
    assert fault["device_ordinal"] == mesh.devices.flat[0].local_hardware_id, fault
    assert (fault["rank"], fault["waited_rank"]) == (0, 1), fault
    assert 2.0 <= fault["elapsed_s"] < 30, fault
    assert "CHECK_ERRORS=" in stdout and op in stdout, stdout[-4000:]
    assert "waiting for rank 1" in stdout, stdout[-4000:]
