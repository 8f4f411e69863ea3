"""The low-latency kernels (backend='cuda') against the reference path on 2 GPUs: counts, src_slot
and every filled slot's row / FP8 scales bit-exact, combine bit-exact (float32 sums in top-k order,
no FMA, in both), NaN in every unfilled slot of y never leaks; the two-phase form (send, other work,
receive; also two calls in flight) gives the fused form's bits; repeated calls in a 20-step lax.scan
(captured as CUDA graphs) equal separate calls, fused and two-phase. Device memory is poisoned before
each call. Broken rules fault with a clear record: a rank skipping the call (timeout naming the op
and the rank), a third send in flight, a throughput op while a send is in flight."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from gpu_helpers import (
    EP_RANKS,
    assert_side_results_read_after_join,
    ep_step_child,
    faults_of_child,
    needs_two_ranks,
    poison_device_memory,
    random_normal,
    rel_err,
)
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from test_dispatch_gpu import assert_bits_equal, quantize_fp8_numpy, routing

import jax_ep

pytestmark = pytest.mark.gpu

AXIS = "ep"
R = EP_RANKS


@pytest.fixture(scope="module")
def mesh(gpus):
    if len(gpus) < R:
        pytest.skip(f"needs {R} GPUs, have {len(gpus)}")
    return Mesh(np.array(gpus[:R]), (AXIS,))


def _cfg(backend, **kw):
    return jax_ep.EPConfig(axis_name=AXIS, backend=backend, **kw)


def round_trip_body(cfg):
    """One rank's ll_dispatch -> ll_combine (y: [1, E_local, R*T, H], this rank's expert outputs)."""
    def body(x, idx, w, y):
        d = jax_ep.ll_dispatch(x, idx, w, cfg)
        y = y[0]
        # NaN wherever no token landed: the kernels must never read those slots
        y = jnp.where((d.handle.src_slot >= 0)[..., None], y, jnp.nan).astype(jnp.bfloat16)
        out = jax_ep.ll_combine(y, d.handle, cfg)
        return jax.tree.map(lambda a: a[None], d), out

    return body


@functools.cache
def round_trip_fn(mesh, cfg):
    return jax.jit(jax.shard_map(round_trip_body(cfg), mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))


def two_phase_body(cfg, in_flight=1):
    """round_trip_body through ll_dispatch_send / _recv and ll_combine_send / _recv, with a stand-in
    for independent work between each send and its receive; in_flight=2: a second call (tokens x 2,
    outputs y 2) is sent before the first is received (optimization barriers fix the order)."""
    def body(x, idx, w, y):
        pending = [jax_ep.ll_dispatch_send(x, idx, w, cfg)]
        for i in range(1, in_flight):
            xi, _ = lax.optimization_barrier((x * (i + 1), pending[-1].token))
            pending.append(jax_ep.ll_dispatch_send(xi, idx, w, cfg))
        work = jnp.tanh(x.astype(jnp.float32)).sum()  # "attention" while the tokens travel
        ds = []
        for p in pending:
            p, _, _ = lax.optimization_barrier((p, pending[-1].token, work))
            ds.append(jax_ep.ll_dispatch_recv(p, cfg))
        ys = [jnp.where((d.handle.src_slot >= 0)[..., None], y[0] * (i + 1), jnp.nan).astype(
            jnp.bfloat16) for i, d in enumerate(ds)]
        sent = [jax_ep.ll_combine_send(yi, d.handle, cfg) for yi, d in zip(ys, ds, strict=True)]
        outs = [jax_ep.ll_combine_recv(q, cfg) for q in sent]
        return jax.tree.map(lambda a: a[None], ds), outs

    return body


@functools.cache
def two_phase_fn(mesh, cfg, in_flight=1):
    return jax.jit(jax.shard_map(two_phase_body(cfg, in_flight), mesh=mesh, in_specs=P(AXIS),
                                 out_specs=P(AXIS)))


CASES = {  # tokens, hidden, topk, experts, routing, x dtype, wire dtype
    "decode_fp8": (128, 7168, 8, 288, "distinct", jnp.bfloat16, "float8_e4m3fn"),
    "decode_bf16": (128, 7168, 8, 288, "messy", jnp.bfloat16, "bfloat16"),
    "small_f32_fp8": (5, 256, 3, 8, "messy", jnp.float32, "float8_e4m3fn"),
    "one_token": (1, 2048, 2, 8, "distinct", jnp.bfloat16, "bfloat16"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_ll_matches_reference(cuda_backend, mesh, case):
    tokens, hidden, topk, experts, kind, x_dtype, wire = CASES[case]
    kw = dict(num_experts=experts, num_topk=topk, hidden=hidden, max_tokens_per_rank=tokens,
              dispatch_dtype=wire)
    cuda_fn, ref_fn = round_trip_fn(mesh, _cfg("cuda", **kw)), round_trip_fn(mesh, _cfg("reference", **kw))
    rng = np.random.default_rng(list(CASES).index(case))
    for call in range(2):
        x, idx, w, y = ll_case_inputs(rng, case, R)
        args = [jax.device_put(a, NamedSharding(mesh, P(AXIS))) for a in (x, idx, w, y)]
        want_d, want_out = jax.tree.map(np.asarray, ref_fn(*args))
        poison_device_memory(mesh.devices.flat, 256 << 20)
        got_d, got_out = jax.tree.map(np.asarray, cuda_fn(*args))
        poison_device_memory(mesh.devices.flat, 256 << 20)
        two = jax.tree.map(np.asarray, two_phase_fn(mesh, _cfg("cuda", **kw))(*args))
        assert want_d.counts.sum() > 0, "no token went anywhere"
        assert_ll_equal((got_d, got_out), (want_d, want_out), two, x, tokens, topk, f"{case} call {call}")


def ll_case_inputs(rng, case, ranks):
    """A case's global inputs (x, topk_idx, topk_weights, y) for `ranks` ranks from `rng`."""
    tokens, hidden, topk, experts, kind, x_dtype, _ = CASES[case]
    n = ranks * tokens
    x = (rng.standard_normal((n, hidden)) * 2).astype(np.float32).astype(x_dtype)
    idx = routing(rng, kind, n, topk, experts)
    w = rng.random((n, topk)).astype(np.float32)
    y = random_normal(rng, (ranks, experts // ranks, ranks * tokens, hidden), ml_dtypes.bfloat16)
    return x, idx, w, y


def assert_ll_equal(got, want, two, x, tokens, topk, what):
    """The kernels' round trip `got` = (LLDispatchResult, combined) against the reference's `want`
    (counts, src_slot, weights, every filled slot's row / FP8 scales and combine bit-exact; no NaN of
    an unfilled slot leaks), and the two-phase form's `two` = ([result], [combined]) against `got`.
    Every array has the ranks it holds on its leading axis (all of them in process model 1, this
    process's in model 2); x is the global input."""
    (got_d, got_out), (want_d, want_out), ((two_d,), (two_out,)) = got, want, two
    assert_bits_equal(got_d.counts, want_d.counts, f"{what} counts")
    assert_bits_equal(got_d.handle.src_slot, want_d.handle.src_slot, f"{what} src_slot")
    assert_bits_equal(got_d.handle.topk_weights, want_d.handle.topk_weights, f"{what} weights")
    filled = want_d.handle.src_slot >= 0
    assert filled.sum() == want_d.counts.sum()  # (a rank of many may receive no token: one_token)
    if want_d.scales is None:
        assert_bits_equal(got_d.x[filled], want_d.x[filled], f"{what} rows")
    else:  # XLA's GPU division may round an fp8 differently: NumPy's IEEE bits, as in model 1
        q_all, s_all = quantize_fp8_numpy(np.asarray(x))
        slot = np.broadcast_to(np.arange(filled.shape[-1]), filled.shape)
        source = (slot // tokens) * tokens + want_d.handle.src_slot // topk  # global token
        assert_bits_equal(got_d.x[filled], q_all[source[filled]], f"{what} fp8 rows")
        assert_bits_equal(got_d.scales[filled], s_all[source[filled]], f"{what} scales")
    assert np.isfinite(np.asarray(got_out, np.float32)).all(), f"{what}: unfilled slots leaked"
    assert_bits_equal(got_out, want_out, f"{what} combine")
    # the two-phase form: the fused form's bits (filled slots, counts, handle, combine)
    assert_bits_equal(two_d.counts, got_d.counts, f"{what} two-phase counts")
    assert_bits_equal(two_d.handle.src_slot, got_d.handle.src_slot, f"{what} two-phase src_slot")
    assert_bits_equal(two_d.x[filled], got_d.x[filled], f"{what} two-phase rows")
    if got_d.scales is not None:
        assert_bits_equal(two_d.scales[filled], got_d.scales[filled], f"{what} two-phase scales")
    assert_bits_equal(two_out, got_out, f"{what} two-phase combine")


def test_ll_zero_tokens_then_calls_with_tokens_match_the_reference(cuda_backend, mesh):
    """T = 0 on every rank, fused and two-phase (no combine call is issued: XLA would drop a call whose
    results are all empty; 2026-12-05), then calls with tokens: nothing left in flight, no fault, the
    reference's bits. (One output kind per program: with every input zero-size, JAX's Shardy lowering
    refuses some programs returning both the counts and an empty combine output.)"""
    tokens, hidden, topk, experts, _, _, wire = CASES["one_token"]
    kw = dict(num_experts=experts, num_topk=topk, hidden=hidden, max_tokens_per_rank=tokens,
              dispatch_dtype=wire)
    cfg = _cfg("cuda", **kw)

    def fused(counts):
        def body(x, idx, w):
            d = jax_ep.ll_dispatch(x, idx, w, cfg)
            return d.counts[None] if counts else jax_ep.ll_combine(d.x, d.handle, cfg)[None]
        return body

    def two_phase(counts):
        def body(x, idx, w):
            d = jax_ep.ll_dispatch_recv(jax_ep.ll_dispatch_send(x, idx, w, cfg), cfg)
            if counts:
                return d.counts[None]
            return jax_ep.ll_combine_recv(jax_ep.ll_combine_send(d.x, d.handle, cfg), cfg)[None]
        return body

    empty = (np.zeros((0, hidden), ml_dtypes.bfloat16), np.zeros((0, topk), np.int32),
             np.zeros((0, topk), np.float32))
    args = [jax.device_put(a, NamedSharding(mesh, P(AXIS))) for a in empty]
    for make in (fused, two_phase):
        for counts in (True, False):
            fn = jax.jit(jax.shard_map(make(counts), mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))
            got = np.asarray(fn(*args))
            if counts:
                assert got.shape == (R, experts // R, R) and (got == 0).all(), (make.__name__, got)
            else:
                assert got.shape == (R, 0, hidden), (make.__name__, got.shape)
    assert not jax_ep.runtime.faults()
    rng = np.random.default_rng(7)
    for call in range(2):
        x, idx, w, y = ll_case_inputs(rng, "one_token", R)
        args = [jax.device_put(a, NamedSharding(mesh, P(AXIS))) for a in (x, idx, w, y)]
        want = jax.tree.map(np.asarray, round_trip_fn(mesh, _cfg("reference", **kw))(*args))
        got = jax.tree.map(np.asarray, round_trip_fn(mesh, cfg)(*args))
        two = jax.tree.map(np.asarray, two_phase_fn(mesh, cfg)(*args))
        assert_ll_equal(got, want, two, x, tokens, topk, f"after T = 0, call {call}")


def test_ll_two_calls_in_flight(cuda_backend, mesh):
    """Two sends of each op before their receives (both halves of the double buffer in use): each
    receive gets its own call's data, as two fused calls do."""
    tokens, hidden, topk, experts = 96, 2048, 8, 32
    cfg = _cfg("cuda", num_experts=experts, num_topk=topk, hidden=hidden, max_tokens_per_rank=tokens,
               dispatch_dtype="float8_e4m3fn")
    rng = np.random.default_rng(11)
    n = R * tokens
    x = rng.standard_normal((n, hidden)).astype(ml_dtypes.bfloat16)
    idx = routing(rng, "messy", n, topk, experts)
    w = rng.random((n, topk)).astype(np.float32)
    y = random_normal(rng, (R, experts // R, R * tokens, hidden), ml_dtypes.bfloat16)
    args = [jax.device_put(a, NamedSharding(mesh, P(AXIS))) for a in (x, idx, w, y)]
    ds, outs = jax.tree.map(np.asarray, two_phase_fn(mesh, cfg, in_flight=2)(*args))
    fused = round_trip_fn(mesh, cfg)
    for i in range(2):
        xi = (x.astype(np.float32) * (i + 1)).astype(ml_dtypes.bfloat16)
        yi = (y.astype(np.float32) * (i + 1)).astype(ml_dtypes.bfloat16)
        put = [jax.device_put(a, NamedSharding(mesh, P(AXIS))) for a in (xi, idx, w, yi)]
        want_d, want_out = jax.tree.map(np.asarray, fused(*put))
        filled = want_d.handle.src_slot >= 0
        assert_bits_equal(ds[i].counts, want_d.counts, f"call {i} counts")
        assert_bits_equal(ds[i].x[filled], want_d.x[filled], f"call {i} rows")
        assert_bits_equal(ds[i].scales[filled], want_d.scales[filled], f"call {i} scales")
        assert_bits_equal(outs[i], want_out, f"call {i} combine")


def test_ll_in_scan_matches_separate_calls(cuda_backend, mesh):
    """20 decode steps in one jitted lax.scan (XLA captures the loop body as a CUDA graph): each
    step's combine equals that step run alone."""
    cfg = scan_cfg()
    xs, idx, w = scan_inputs(np.random.default_rng(3), R)
    step = fused_step_body(cfg)

    def scanned(xs, idx, w):
        return lax.scan(lambda c, a: (c, step(*a)), 0, (xs, idx, w))[1]

    spec = P(None, AXIS)
    run_scan = jax.jit(jax.shard_map(scanned, mesh=mesh, in_specs=spec, out_specs=spec))
    run_step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))
    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
    got = np.asarray(run_scan(put(xs, spec), put(idx, spec), put(w, spec)))
    for s in range(len(xs)):
        want = np.asarray(run_step(put(xs[s], P(AXIS)), put(idx[s], P(AXIS)), put(w[s], P(AXIS))))
        assert_bits_equal(got[s], want, f"scan step {s}")


SCAN_SHAPE = dict(tokens=64, hidden=1024, topk=4, experts=16, steps=20)


def scan_inputs(rng, ranks):
    """SCAN_SHAPE's inputs for `ranks` ranks: xs [steps, R*T, H], idx and w [steps, R*T, K]."""
    tokens, hidden, topk, experts, steps = (SCAN_SHAPE[k] for k in ("tokens", "hidden", "topk", "experts",
                                                                   "steps"))
    n = ranks * tokens
    xs = rng.standard_normal((steps, n, hidden)).astype(ml_dtypes.bfloat16)
    idx = np.stack([routing(rng, "messy", n, topk, experts) for _ in range(steps)])
    w = rng.random((steps, n, topk)).astype(np.float32)
    return xs, idx, w


def scan_cfg(async_stream=None):
    s = SCAN_SHAPE
    return _cfg("cuda", num_experts=s["experts"], num_topk=s["topk"], hidden=s["hidden"],
                max_tokens_per_rank=s["tokens"], dispatch_dtype="float8_e4m3fn",
                kernel=jax_ep.KernelConfig(async_stream=async_stream))


def fused_step_body(cfg):
    """One decode step, fused ops, identity experts: (x, idx, w) -> combined [T, H]."""
    def body(x, i, w):
        d = jax_ep.ll_dispatch(x, i, w, cfg)
        return jax_ep.ll_combine(_identity_experts(d), d.handle, cfg)

    return body


def two_phase_scan_body(cfg):
    """The step of fused_step_body through the two-phase ops (each receive after a stand-in for
    independent work), `steps` of them in a lax.scan: (xs, idx, w) [steps, T, ...] -> [steps, T, H]."""
    def two_phase(x, i, w):
        p = jax_ep.ll_dispatch_send(x, i, w, cfg)
        work = jnp.tanh(x.astype(jnp.float32)).sum()
        p, _ = lax.optimization_barrier((p, work))
        d = jax_ep.ll_dispatch_recv(p, cfg)
        q = jax_ep.ll_combine_send(_identity_experts(d), d.handle, cfg)
        return jax_ep.ll_combine_recv(q, cfg)

    return lambda xs, idx, w: lax.scan(lambda c, a: (c, two_phase(*a)), 0, (xs, idx, w))[1]


def _identity_experts(d):
    scale = jnp.repeat(d.scales, 128, axis=-1)
    return (d.x.astype(jnp.float32) * scale).astype(jnp.bfloat16)


@pytest.mark.parametrize("async_stream", [None, 1])
def test_ll_two_phase_in_scan_matches_fused(cuda_backend, mesh, async_stream):
    """20 decode steps in a lax.scan through the two-phase ops (each step's receive after a stand-in
    for independent work; with async_stream the sends run on XLA stream 1 beside it): the fused step's
    bits, every step."""
    cfg = scan_cfg(async_stream)
    xs, idx, w = scan_inputs(np.random.default_rng(4), R)
    spec = P(None, AXIS)
    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
    run_scan = jax.jit(jax.shard_map(two_phase_scan_body(cfg), mesh=mesh, in_specs=spec, out_specs=spec))
    run_step = jax.jit(jax.shard_map(fused_step_body(cfg), mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))
    got = np.asarray(run_scan(put(xs, spec), put(idx, spec), put(w, spec)))
    for s in range(len(xs)):
        want = np.asarray(run_step(put(xs[s], P(AXIS)), put(idx[s], P(AXIS)), put(w[s], P(AXIS))))
        assert_bits_equal(got[s], want, f"two-phase scan step {s}")


_SKIP_CHILD = ep_step_child("""
    def body(x, idx, w):
        run = lambda: jax_ep.ll_dispatch(x, idx, w, cfg).x.astype(jnp.float32).sum()
        skip = lambda: x.astype(jnp.float32).sum() * 0
        # rank 1 skips the call: rank 0 waits for it until the timeout
        return lax.cond(lax.axis_index("ep") == 0, run, skip)[None]
""", dispatch_dtype="bfloat16")


def test_ll_rank_skipping_the_call_times_out_naming_op_and_rank(cuda_backend, mesh):
    needs_two_ranks(R)
    faults, stdout = faults_of_child(_SKIP_CHILD)
    assert len(faults) == 1, faults
    fault = faults[0]
    assert fault["kind"] == "timeout" and fault["op"] == "ll_dispatch", fault
    assert fault["device_ordinal"] == mesh.devices.flat[0].local_hardware_id, fault
    assert (fault["rank"], fault["waited_rank"]) == (0, 1), fault
    assert 2.0 <= fault["elapsed_s"] < 30, fault
    assert "waiting for rank 1" in stdout, stdout[-4000:]


_THREE_IN_FLIGHT_CHILD = ep_step_child("""
    def body(x, idx, w):
        pending = [jax_ep.ll_dispatch_send(x, idx, w, cfg)]
        for i in range(2):  # two more sends, each after the previous one, before any receive
            xi, _ = lax.optimization_barrier((x, pending[-1].token))
            pending.append(jax_ep.ll_dispatch_send(xi, idx, w, cfg))
        out = 0.0
        for p in pending:
            p, _ = lax.optimization_barrier((p, pending[-1].token))
            out = out + jax_ep.ll_dispatch_recv(p, cfg).x.astype(jnp.float32).sum()
        return out[None]
""", dispatch_dtype="bfloat16")


def test_ll_third_send_in_flight_is_a_clear_error(cuda_backend, mesh):
    """A sent call must be received before the op's call n + 2: the third send faults on the device
    before it writes anything (never a silent overwrite), with a message saying the rule."""
    faults, stdout = faults_of_child(_THREE_IN_FLIGHT_CHILD)
    assert faults, stdout[-4000:]
    for fault in faults:
        assert fault["kind"] == "ll_in_flight" and fault["op"] == "ll_dispatch", fault
        assert (fault["expected"], fault["observed"]) == (3, 1), fault
        assert "receive call n of an op before its call n + 2" in fault["message"], fault
    assert "CHECK_ERRORS=" in stdout and "before its call n + 2" in stdout, stdout[-4000:]


_THROUGHPUT_IN_FLIGHT_CHILD = ep_step_child("""
    def body(x, idx, w):
        pending = jax_ep.ll_dispatch_send(x, idx, w, cfg)
        xi, _ = lax.optimization_barrier((x, pending.token))
        d = jax_ep.dispatch(xi, idx, w, cfg)  # a throughput op while the send is in flight
        pending, _ = lax.optimization_barrier((pending, d.x))
        return (jax_ep.ll_dispatch_recv(pending, cfg).x.astype(jnp.float32).sum() +
                d.x.astype(jnp.float32).sum())[None]
""", dispatch_dtype="bfloat16")


def test_ll_throughput_op_while_in_flight_is_a_clear_error(cuda_backend, mesh):
    faults, stdout = faults_of_child(_THROUGHPUT_IN_FLIGHT_CHILD)
    assert faults, stdout[-4000:]
    for fault in faults:
        assert fault["kind"] == "ll_in_flight" and fault["op"] == "dispatch", fault
        assert "throughput EP op ran while 1 two-phase" in fault["message"], fault


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8_weights"])
def test_decode_layer_with_the_kernels_matches_the_reference_ops(cuda_backend, mesh, fp8):
    """MoE's decode forward (ll_dispatch, the expert GEMMs over the filled slots written back into the
    dispatch's buffer in place, ll_combine) with the CUDA low-latency ops gives the bits of the same
    layer with the reference ops (same GEMMs on this GPU; the kernels' slots are the reference's), bf16
    weights and cached FP8 ones; device memory poisoned first, so the unfilled slots the experts' rows
    are written back among hold garbage; every output finite and not all zero."""
    from flax import nnx

    from jax_ep.gating import RouterConfig
    from jax_ep.moe import EPOptions, MoE

    hidden, ffn, experts, topk, tokens = 2048, 512, 8 * R, 4, 64
    x = jax.device_put(jnp.asarray(random_normal(np.random.default_rng(11), (R * tokens, hidden),
                                                 np.float32), jnp.bfloat16), NamedSharding(mesh, P(AXIS)))
    outs = {}
    for backend in ("reference", "cuda"):
        poison_device_memory(mesh.devices.flat, 256 << 20)   # unfilled slots start as garbage
        layer = MoE(hidden, ffn, RouterConfig(experts, topk), rngs=nnx.Rngs(3), mesh=mesh,
                    ep=EPOptions(backend=backend), param_dtype=jnp.bfloat16, decode=True,
                    gemm_dtype="float8_e4m3fn" if fp8 else None)
        quantized = nnx.jit(lambda m: m.quantize_weights())(layer) if fp8 else None
        step = nnx.jit(lambda m, x, q: m(x, decode=True, update_stats=False, fp8_weights=q))
        outs[backend] = np.asarray(step(layer, x, quantized).astype(jnp.float32))
    assert np.isfinite(outs["cuda"]).all() and np.abs(outs["cuda"]).max() > 0
    np.testing.assert_array_equal(outs["cuda"], outs["reference"])


def test_decode_layer_with_the_shared_expert_beside_the_send(cuda_backend, mesh, ep_order):
    """EPOptions(shared_beside=True) on the decode path: the shared expert on XLA's stream beside
    ll_dispatch_send on jax_ep's side stream (24 SMs), then ll_dispatch_recv. The output equals the same
    layer's without it within 1e-3 of its norm (XLA fuses and autotunes the shared expert's cuBLAS dots
    per program, so bits may differ; an early read of the send's results is off by O(1)); the compiled
    forward holds the side send and its join, the plain one neither, and XLA's schedule reads nothing
    of the send before its join. ep_order: also with the EP calls' ordering effect (process model 2's
    lowering)."""
    from flax import nnx

    from jax_ep.gating import RouterConfig
    from jax_ep.moe import EPOptions, MoE

    hidden, ffn, experts, topk, tokens = 2048, 512, 8 * R, 4, 64
    x = jax.device_put(jnp.asarray(random_normal(np.random.default_rng(12), (R * tokens, hidden),
                                                 np.float32), jnp.bfloat16), NamedSharding(mesh, P(AXIS)))
    outs, hlo = {}, {}
    for beside in (False, True):
        layer = MoE(hidden, ffn, RouterConfig(experts, topk), rngs=nnx.Rngs(3), mesh=mesh,
                    ep=EPOptions(backend="cuda", shared_beside=beside,
                                 kernel=jax_ep.KernelConfig(side_num_sms=24)),
                    param_dtype=jnp.bfloat16, decode=True, shared_ffn_hidden=1024)
        graphdef, state = nnx.split(layer)
        step = jax.jit(lambda state, x, graphdef=graphdef: nnx.merge(graphdef, state)(
            x, decode=True, update_stats=False))
        compiled = step.lower(state, x).compile()
        hlo[beside] = compiled.as_text()
        poison_device_memory(mesh.devices.flat, 256 << 20)
        outs[beside] = np.asarray(compiled(state, x).astype(jnp.float32))
    assert '"jax_ep_ll_dispatch_send_side"' not in hlo[False] and '"jax_ep_side_join"' not in hlo[False]
    assert hlo[True].count('"jax_ep_ll_dispatch_send_side"') == 1
    assert hlo[True].count('"jax_ep_side_join"') == 1
    assert_side_results_read_after_join(hlo[True], "decode shared_beside")
    assert np.isfinite(outs[True]).all() and np.abs(outs[False]).max() > 0
    err = rel_err(outs[True], outs[False])
    assert err <= 1e-3, f"the decode output with the shared expert beside differs by {err:.3g}"
