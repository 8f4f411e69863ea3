"""One process of the process-model-2 GPU test (tests/gpu/test_process_group_gpu.py): one process
per GPU, jax.distributed, NVSHMEM symmetric buffers, the same kernels as process model 1.

    python -m jax_ep.launch --nproc 2 tests/gpu/process_group_worker.py [--bench OUT.json
        [--bench-sms N] [--bench-pull push|pull|both] [--bench-send-warps W,...] [--bench-dtypes D,...]
        [--bench-no-profile]] [--absent P] [--remote] [--checks GROUP,...] [--ll-num-sms N]

Checks, on this process's shard of every output (each process compares its own rank):
dispatch + combine of the model-1 cases against the reference path (dispatch bit-exact, combine
within bf16 rounding), FP8 dispatch, gradients through dispatch -> ragged_dot -> combine, the
rank-major ops (put_transport_worker's cases over the NVLink kernels, bit-exact), the low-latency
ops' round trip (fused and two-phase, model 1's cases, bit-exact) and 20 two-phase steps in a
lax.scan as CUDA graphs (each step's bits those of the fused step), dispatch and combine on jax_ep's
side stream (overlap.beside) the same bits as without, the MoE layer's training step against a dense
computation of the layer (and its side-stream overlaps the same within rounding), and
remote_smoke (NVSHMEM device puts + signals, the transport of the inter-node path, which NVSHMEM
carries over P2P on one node) against peer_smoke's pattern. With --remote, the remote_smoke check
only. With --bench, instead times dispatch/combine at the DeepSeek-V3 shape
(benchmarks.ops.bench_shape) and process 0 writes the records. With --absent P, process P leaves
right after jax.distributed is up and the others must fail the NVSHMEM bootstrap within a bounded
time, naming process P. Prints "process_group_worker OK <checks> <checks per group, JSON>" at the end.

No XLA collective runs across the processes (they may share one GPU: pytest --share-gpu, and NCCL
refuses two processes on one GPU): the inputs are built from the same seed on every process, which
puts its own shards (gpu_helpers.put_global); the reference runs in each process alone, every rank
under jax.vmap (gpu_helpers.reference_by_vmap); only jax_ep's own ops communicate.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tests/ (helpers)

import put_transport_worker as rank_major_model2  # noqa: E402  (the rank-major cases, any transport)
import test_dispatch_gpu as model1  # noqa: E402  (cases, inputs and comparisons of model 1)
import test_low_latency_gpu as ll_model1  # noqa: E402  (the low-latency cases and comparisons)
from gpu_helpers import (  # noqa: E402
    GRAPH_OPTIONS,
    ll_grid,
    local,
    poison_device_memory,
    put_global,
    random_normal,
    rank_rows,
    reference_by_vmap,
    rel_err,
)
from helpers import dense_moe  # noqa: E402  (tests/helpers.py: the layer without EP)
from test_peer_smoke_gpu import pattern  # noqa: E402  (peer_smoke_pattern of cuda/peer_smoke.h)

import jax_ep.distributed  # noqa: E402
from jax_ep import cuda_backend, launch, runtime  # noqa: E402

AXIS, R = model1.AXIS, model1.R


def assert_dispatch_equal(got, want, what):
    total = int(want.group_sizes[0].sum())
    eq = model1.assert_bits_equal
    eq(got.group_sizes[0], want.group_sizes[0], f"{what} group_sizes")
    eq(got.x[0][:total], want.x[0][:total], f"{what} rows")
    if want.scales is not None:
        eq(got.scales[0][:total], want.scales[0][:total], f"{what} scales")
    for field in ("expert_counts", "row_weights", "num_dropped"):
        eq(getattr(got, field)[0], getattr(want, field)[0], f"{what} {field}")
    for field in ("src_index", "token_rows", "is_token_in_rank", "row_weights"):
        eq(getattr(got.handle, field)[0], getattr(want.handle, field)[0], f"{what} handle.{field}")


def assert_fp8_rows(got, x, what):
    """FP8 rows and scales: the bits of an IEEE float32 NumPy quantisation of their source tokens
    (model 1's test_fp8_dispatch_matches_quantisation); padding rows zero."""
    q_all, s_all = model1.quantize_fp8_numpy(np.asarray(x))
    total = int(got.group_sizes[0].sum())
    src = got.handle.src_index[0][:total]
    filled = src >= 0
    model1.assert_bits_equal(got.x[0][:total][filled], q_all[src[filled]], f"{what} fp8 rows")
    model1.assert_bits_equal(got.scales[0][:total][filled], s_all[src[filled]], f"{what} scales")
    assert not got.x[0][:total][~filled].astype(np.float32).any(), f"{what}: padding rows not zero"


def check_cases(mesh, me, pull=False, names=None) -> int:
    """model1.CASES (or those in `names`) in this process's rows against the reference; pull: the
    dispatch pulls its rows (KernelConfig.dispatch_pull)."""
    checks = 0
    for name, (tokens, hidden, topk, experts, kind, extra) in model1.CASES.items():
        if names is not None and name not in names:
            continue
        x_dtype = jnp.float32 if name.startswith("f32") else jnp.bfloat16
        for dtype in ("bfloat16", "float8_e4m3fn") if name == "h7168_k8_e256" else (None,):
            kw = dict(num_experts=experts, num_topk=topk, hidden=hidden,
                      max_tokens_per_rank=tokens, **extra)
            # pushed or pulled as asked (not as the auto table would choose for the default)
            kw["kernel"] = jax_ep.KernelConfig(dispatch_pull=pull)
            if dtype is not None:
                kw["dispatch_dtype"] = dtype
            cuda_fn = model1.dispatch_combine_fn(mesh, model1._cfg("cuda", **kw))
            ref_fn = reference_by_vmap(model1.dispatch_combine_body(model1._cfg("reference", **kw)), R)
            capacity = model1._cfg("cuda", **kw).resolved_capacity(R)
            rng = np.random.default_rng(list(model1.CASES).index(name))  # same on every process
            for call in range(2):
                x, idx, w = model1.inputs(rng, tokens, hidden, topk, experts, kind, x_dtype)
                host = (x, idx, w, random_normal(rng, (R * capacity, hidden), jnp.bfloat16))
                want_d, want_out = rank_rows(ref_fn(*host), me, R)
                args = put_global(mesh, *host)
                poison_device_memory(jax.local_devices(), 256 << 20)
                got_d, got_out = local(cuda_fn(*args))
                what = f"process {me} {name} {dtype or ''}{' pull' if pull else ''} call {call}"
                if dtype == "float8_e4m3fn":  # XLA's division may round differently: NumPy's bits
                    assert_fp8_rows(got_d, x, what)
                    got_d, want_d = (d._replace(x=d.x[:, :0], scales=None) for d in (got_d, want_d))
                assert_dispatch_equal(got_d, want_d, what)
                model1.assert_combine_close(got_out, want_out, f"{what} combine")
                checks += 1
    return checks


def check_dispatch_pull(mesh, me) -> int:
    """The dispatches pulling their rows (KernelConfig.dispatch_pull: each process stages a token once
    in its own buffer, each peer loads it from there): dispatch + combine at DeepSeek-V3's shape (bf16
    and FP8 wire), with drops, and from f32 x; dispatch_rank_major's round trip (every case, FP8 too);
    each against the reference as the pushed form is; broadcast_rank_major pulling too (broadcast_pull)."""
    return (check_cases(mesh, me, pull=True,
                        names=("h7168_k8_e256", "h2048_k2_skewed_overflow", "f32_x_bf16_rows_k4"))
            + rank_major_model2.check_cases(mesh, me, transport="load_store", pull=True))


def check_gradients(mesh, me) -> int:
    """jax.grad through dispatch -> ragged_dot -> combine (model 1's test_gradients_match_reference
    case): the forward output, d x, d topk_weights and d expert weights within two bf16 steps."""
    kw, (x, idx, w, wexp, ct) = model1.grad_case(9, 128, 1024, 4, 16, "messy")
    host = (x, w, wexp, idx, ct)
    want = rank_rows(reference_by_vmap(model1.gradient_body(model1._cfg("reference", **kw)), R)(*host),
                     me, R)[1:]
    args = put_global(mesh, *host)
    poison_device_memory(jax.local_devices(), 128 << 20)
    got = local(model1.gradient_fn(mesh, model1._cfg("cuda", **kw))(*args))[1:]
    for what, g, r in zip(("forward combine", "d x", "d topk_weights", "d expert weights"), got,
                          want, strict=True):
        model1.assert_combine_close(g.reshape(g.shape[0], -1), r.reshape(r.shape[0], -1), what,
                                    steps=2)
    return 1


def check_side_stream(mesh, me) -> int:
    """jax_ep.overlap.beside in process model 2 (model 1's test_side_stream_gives_the_same_bits):
    dispatch and combine on jax_ep's side stream beside elementwise chains, forward and
    differentiated, with and without command buffers; this process's rank of every output the same
    bits as the program without the blocks, device memory poisoned before each of two runs."""
    kw, (x, idx, w, wexp, ct) = model1.side_stream_case()
    args = put_global(mesh, x, w, wexp, idx, ct.astype(np.float32))
    checks = 0
    for differentiated in (False, True):
        want = local(model1.side_stream_fn(mesh, kw, False, differentiated)(*args))
        for options in (None, GRAPH_OPTIONS["graphs"]):
            compiled = model1.side_stream_fn(mesh, kw, True, differentiated).lower(*args).compile(options)
            model1.assert_side_targets(compiled, differentiated, f"process {me} {options}")
            for run in range(2):
                poison_device_memory(jax.local_devices(), 128 << 20)
                got = local(compiled(*args))
                for name, g, r in zip(model1.SIDE_STREAM_NAMES[differentiated], got, want, strict=True):
                    model1.assert_bits_equal(g, r, f"process {me} side stream {options} run {run} {name}")
            checks += 1
    return checks


LAYER_EXPERTS_PER_RANK = 8


def _per_rank_layer(ranks: int, backend: str, **options):
    """The MoE layer of check_layer (hidden 256, ffn 384, 8 experts per rank, top-4, a 256-wide shared
    expert, float32) for use inside a shard_map (mesh=None), with EPOptions `options`: (graphdef, rest,
    the parameters' tree, their names, which are expert-sharded, their host values, the host values as
    passed: expert-sharded ones whole, every other one stacked once per rank so that its gradient comes
    back per rank, with no XLA collective across the processes)."""
    from flax import nnx

    from jax_ep import gating
    from jax_ep.moe import EPOptions, MoE

    layer = MoE(256, 384, gating.RouterConfig(LAYER_EXPERTS_PER_RANK * ranks, 4), rngs=nnx.Rngs(3), mesh=None,
                axis_name=AXIS,
                ep=EPOptions(backend=backend, kernel=jax_ep.KernelConfig(side_num_sms=24), **options),
                shared_ffn_hidden=256)
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
    paths, tree = jax.tree_util.tree_flatten_with_path(params)
    names = [jax.tree_util.keystr(path) for path, _ in paths]
    expert = [n in ("['w_gate_up'].value", "['w_down'].value") for n in names]
    host = [np.asarray(v) for _, v in paths]
    stacked = [v if e else np.stack([v] * ranks) for v, e in zip(host, expert, strict=True)]
    return graphdef, rest, tree, names, expert, host, stacked


def _layer(graphdef, rest, tree, values):
    """The layer of _per_rank_layer with parameter values `values` (its leaves' order)."""
    from flax import nnx

    return nnx.merge(graphdef, jax.tree_util.tree_unflatten(tree, values), rest)


def _merged(graphdef, rest, tree, expert, leaves):
    """The per-rank layer from shard_map's local leaves (a stacked leaf's one row)."""
    return _layer(graphdef, rest, tree, [v if e else v[0] for v, e in zip(leaves, expert, strict=True)])


def _assert_close(got, want, rtol: float, what: str) -> None:
    assert np.shape(got) == np.shape(want), (what, np.shape(got), np.shape(want))
    err = rel_err(got, want)
    assert np.any(want) and err < rtol, f"{what}: relative error {err:.3g} (bound {rtol})"


def check_layer(mesh, me, backend: str = "cuda") -> int:
    """The Flax MoE layer in process model 2 (the multi-node path), float32 at the highest matmul
    precision, inside a shard_map over the processes (_per_rank_layer: no XLA collective crosses them),
    with the CUDA EP kernels, against a dense computation of the same layer in this process alone
    (every token runs its chosen experts). Training step: the loss, output and d x of this rank's tokens,
    the gradients of this rank's experts (from every rank's tokens) and of the router and shared expert
    (from this rank's tokens), within 1e-4 of the dense norm; the shared expert beside combine and
    dispatch's backward beside the weight gradient (jax_ep's side stream on 24 SMs), and the split shared
    expert in a layer under jax.checkpoint (jax_ep.remat.policy()), within 1e-5 of the plain step (XLA
    fuses and autotunes their dots per program: bits may differ). Decode forward (the
    low-latency ops; the wire and the routed output in bfloat16): within 1e-2 of the dense output, and
    with the shared expert beside ll_dispatch_send within 1e-5 of it. (backend "reference" runs the
    same check on CPU devices in one process, as rank 0.)"""
    ranks = int(mesh.shape[AXIS])
    tokens, decode_tokens, hidden = 512, 64, 256
    rng = np.random.default_rng(21)   # the same on every process
    x = rng.standard_normal((ranks * tokens, hidden)).astype(np.float32)
    ct = rng.standard_normal((ranks * tokens, hidden)).astype(np.float32)
    xd = rng.standard_normal((ranks * decode_tokens, hidden)).astype(np.float32)
    mine = slice(me * tokens, (me + 1) * tokens)
    step_out, decode_out = {}, {}
    with jax.default_matmul_precision("highest"):
        for name, options in {"plain": {}, "shared_beside": {"shared_beside": True},
                              "shared_split": {"shared_beside": True, "shared_split": True},
                              "weight_grad_beside": {"weight_grad_beside": True},
                              # the split under jax.checkpoint (its side calls never rerun)
                              "shared_split_remat": {"shared_beside": True, "shared_split": True}}.items():
            graphdef, rest, tree, names, expert, host, stacked = _per_rank_layer(ranks, backend, **options)
            layer_of = functools.partial(_merged, graphdef, rest, tree, expert)

            def run(leaves, x, layer_of=layer_of):
                return layer_of(leaves)(x, update_stats=False)
            if name.endswith("_remat"):
                from jax_ep import remat

                run = jax.checkpoint(run, policy=remat.policy())

            def body(leaves, x, ct, run=run):
                def loss(leaves, x):
                    out = run(leaves, x)
                    return jnp.sum(out * ct), out

                (value, out), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(leaves, x)
                return value[None], out, grads

            step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))
            poison_device_memory(jax.local_devices(), 128 << 20)
            value, out, (grads, gx) = local(step(put_global(mesh, *stacked), *put_global(mesh, x, ct)))
            step_out[name] = (value, out, gx, grads)
            if name not in ("weight_grad_beside", "shared_split_remat"):   # (training options)
                def decode(leaves, xd, layer_of=layer_of):
                    return layer_of(leaves)(xd, decode=True, update_stats=False)

                forward = jax.jit(jax.shard_map(decode, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))
                decode_out[name] = local(forward(put_global(mesh, *stacked), *put_global(mesh, xd)))

        # the dense layer in this process alone, float32
        def dense(host, x):
            return dense_moe(_layer(graphdef, rest, tree, host), x)

        def dense_loss(host, x, rows):   # rows: the tokens whose loss counts
            out = dense(host, x)
            return jnp.sum(jnp.where(rows[:, None], out * ct, 0.0)), out

        everyone = np.ones(ranks * tokens, bool)
        this_rank = np.zeros(ranks * tokens, bool)
        this_rank[mine] = True
        grad = jax.jit(jax.value_and_grad(dense_loss, argnums=(0, 1), has_aux=True))
        (_, want_out), (want_all, want_gx) = grad(host, x, everyone)
        (want_value, _), (want_mine, _) = grad(host, x, this_rank)
        want_decode = np.asarray(jax.jit(dense)(host, xd))[me * decode_tokens:(me + 1) * decode_tokens]
    value, out, gx, grads = step_out["plain"]
    e = slice(me * LAYER_EXPERTS_PER_RANK, (me + 1) * LAYER_EXPERTS_PER_RANK)
    checks = [("loss", value[0], want_value), ("out", out, np.asarray(want_out)[mine]),
              ("d x", gx, np.asarray(want_gx)[mine])]
    for n, g, wa, wm, ex in zip(names, grads, want_all, want_mine, expert, strict=True):
        checks.append((f"d {n}", g if ex else g[0], np.asarray(wa)[e] if ex else np.asarray(wm)))
    for what, g, w in checks:
        _assert_close(g, w, 1e-4, f"process {me} layer step {what}")
    for name in ("shared_beside", "shared_split", "weight_grad_beside", "shared_split_remat"):
        for i, (a, b) in enumerate(zip(jax.tree.leaves(step_out["plain"]), jax.tree.leaves(step_out[name]),
                                       strict=True)):
            _assert_close(b, a, 1e-5, f"process {me} layer step {name} vs plain, output {i}")
    _assert_close(decode_out["plain"], want_decode, 1e-2, f"process {me} decode")
    _assert_close(decode_out["shared_beside"], decode_out["plain"], 1e-5,
                  f"process {me} decode shared_beside vs plain")
    print(f"process {me}: layer OK ({len(checks)} arrays of the step and the decode output against the "
          "dense layer; the step's overlaps, rematerialised too, and decode's within rounding)", flush=True)
    return 4


def check_low_latency(mesh, me) -> int:
    """The low-latency ops (model 1's test_ll_matches_reference cases: decode shape fp8 and bf16,
    -1 and repeated slots, float32 tokens, one token): fused and two-phase round trips, two calls
    each, on this process's rank against the reference, bit-exact."""
    checks = 0
    for case, (tokens, hidden, topk, experts, _, _, wire) in ll_model1.CASES.items():
        kw = dict(num_experts=experts, num_topk=topk, hidden=hidden, max_tokens_per_rank=tokens,
                  dispatch_dtype=wire)
        cuda_cfg = ll_grid(ll_model1._cfg("cuda", **kw))
        ref_fn = reference_by_vmap(ll_model1.round_trip_body(ll_model1._cfg("reference", **kw)), R)
        rng = np.random.default_rng(list(ll_model1.CASES).index(case))  # same on every process
        for call in range(2):
            host = ll_model1.ll_case_inputs(rng, case, R)
            want = rank_rows(ref_fn(*host), me, R)
            args = put_global(mesh, *host)
            poison_device_memory(jax.local_devices(), 256 << 20)
            got = local(ll_model1.round_trip_fn(mesh, cuda_cfg)(*args))
            poison_device_memory(jax.local_devices(), 256 << 20)
            two = local(ll_model1.two_phase_fn(mesh, cuda_cfg)(*args))
            ll_model1.assert_ll_equal(got, want, two, host[0], tokens, topk,
                                      f"process {me} low-latency {case} call {call}")
            checks += 1
    return checks


def check_low_latency_scan(mesh, me) -> int:
    """Model 1's test_ll_two_phase_in_scan_matches_fused: 20 decode steps in a lax.scan through the
    two-phase ops, captured as CUDA graphs (each call's buffer half and epoch from the device), with
    and without the sends on XLA stream 1: every step's combine on this process's rank equals that
    step run alone through the fused ops, bit for bit."""
    xs, idx, w = ll_model1.scan_inputs(np.random.default_rng(4), R)  # same on every process
    steps_spec = NamedSharding(mesh, P(None, AXIS))
    scan_args = [jax.make_array_from_callback(a.shape, steps_spec, lambda i, a=a: a[i]) for a in (xs, idx, w)]
    checks = 0
    for async_stream in (None, 1):
        cfg = ll_grid(ll_model1.scan_cfg(async_stream))
        fn = jax.shard_map(ll_model1.two_phase_scan_body(cfg), mesh=mesh, in_specs=P(None, AXIS),
                           out_specs=P(None, AXIS))
        poison_device_memory(jax.local_devices(), 64 << 20)
        got = local(jax.jit(fn).lower(*scan_args).compile(GRAPH_OPTIONS["graphs"])(*scan_args))
        step = jax.jit(jax.shard_map(ll_model1.fused_step_body(cfg), mesh=mesh, in_specs=P(AXIS),
                                     out_specs=P(AXIS)))
        for s in range(len(xs)):
            want = local(step(*put_global(mesh, xs[s], idx[s], w[s])))
            model1.assert_bits_equal(got[s], want, f"process {me} two-phase scan step {s}, "
                                                   f"async_stream {async_stream}")
        checks += 1
    return checks


def check_remote_smoke(mesh, me) -> int:
    """remote_smoke: every rank puts peer_smoke's pattern into its slot of every peer's buffer with
    NVSHMEM device puts + signals and returns what arrived, [R, n] per rank. This process checks its
    own rows (reader = me) bit-exact against the pattern: single calls of several sizes (two tags
    each: the second call uses the other receive half), then a lax.scan of back-to-back calls
    captured as CUDA graphs and replayed (the call counts live on the device)."""
    ranks = int(mesh.shape[AXIS])

    def smoke(n):
        def body(tag):
            return cuda_backend.remote_smoke(tag, n, mesh=mesh, axis_name=AXIS)[None]

        return jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(AXIS))

    def replicated(tag):  # the same scalar on every process (no collective: each puts its own copy)
        return jax.make_array_from_callback((), NamedSharding(mesh, P()), lambda _: np.int32(tag))

    def check(received, tag, n, what):
        assert received.shape == (ranks, n) and received.dtype == np.uint32, (what, received.shape)
        for writer in range(ranks):
            want = pattern(tag, writer, me, n)
            bad = np.flatnonzero(received[writer] != want)
            assert bad.size == 0, (f"{what}: process {me} holds wrong data from rank {writer} at "
                                   f"{bad.size} of {n} elements; first i={bad[0]}: got "
                                   f"{received[writer][bad[0]]:#x}, want {want[bad[0]]:#x}")

    checks = 0
    for n in (1, 1000, 1 << 16):
        fn = jax.jit(smoke(n))
        for tag in (12345, -7):
            poison_device_memory(jax.local_devices(), 64 << 20)
            check(local(fn(replicated(tag)))[0], tag, n, f"remote_smoke n={n} tag={tag}")
        checks += 1

    n, steps = 777, 6
    step_fn = smoke(n)

    def run(first_tag):
        def step(tag, _):
            return tag + 1, step_fn(tag)

        return lax.scan(step, first_tag, None, length=steps)[1]

    tag0 = replicated(1000)
    compiled = jax.jit(run, compiler_options=GRAPH_OPTIONS["graphs"]).lower(tag0).compile()
    for repeat in range(2):  # the second run replays the graphs of the first
        poison_device_memory(jax.local_devices(), 64 << 20)
        received = local(compiled(tag0))  # [steps, 1, R, n]
        for s in range(steps):
            check(received[s][0], 1000 + s, n, f"remote_smoke scan run {repeat} step {s}")
    stats = runtime.extension().handler_stats()["jax_ep_remote_smoke"]
    print(f"process {me}: remote_smoke OK, handler stats {stats}", flush=True)
    return checks + 1


def bench(mesh, out_path: str, num_sms: int | None = None, pulls: tuple[bool, ...] = (False,),
          profile: bool = True, send_warps: tuple[int, ...] = (6,),
          dtypes: tuple[str, ...] = ("bfloat16", "float8_e4m3fn")) -> None:
    """dispatch and combine at DeepSeek-V3's shape (bf16 and FP8 wire), the kernels on ``num_sms`` SMs
    (None: KernelConfig's), the dispatch pushing and / or pulling its rows (``pulls``) with each of
    ``send_warps`` sending warps per block (--bench-send-warps 3,6); profile=False
    (--bench-no-profile) for processes sharing a GPU: the profile's alignment step is an XLA
    collective, which NCCL refuses there."""
    from benchmarks import ops

    records = []
    rng = np.random.default_rng(0)
    for dtype in dtypes:
        for pull in pulls:
            for warps in send_warps:
                kernel = jax_ep.KernelConfig(num_sms=num_sms, dispatch_pull=pull, broadcast_pull=pull,
                                             dispatch_send_warps=warps)
                recs = ops.bench_shape(mesh, "cuda", dtype, 4096, 7168, 8, 256, iters=20, repeats=3,
                                       rng=rng, profile=profile, kernel=kernel)
                for r in recs:
                    r["dispatch_send_warps"] = warps
                records += recs
    shared = os.environ.get(launch.ENV_SHARED_GPUS) == "1"   # the launcher's --share-gpus (CUDA MPS)
    for r in records:
        r["process_model"] = "process_per_gpu"
        if shared:   # not the wire of separate GPUs: benchmarks.auto_table leaves these out
            r["shared_gpu"] = True
    if jax.process_index() == 0:
        with open(out_path, "w") as f:
            json.dump(records, f, indent=1)
        for r in records:
            pulled = int(r.get("pull", 0))
            print(f"bench {r['op']:9s} {r['dtype']:14s} SMs {r['num_sms']} pull {pulled} "
                  f"send warps {r['dispatch_send_warps']} "
                  f"{r['us']:8.1f} us wall "
                  f"{r.get('device_us') or 0:8.1f} us device")


def main(argv) -> None:
    jax_ep.distributed.initialize()  # from python -m jax_ep.launch: one GPU per process
    me, count = jax.process_index(), jax.process_count()
    assert runtime.process_model() == "process_per_gpu", runtime.process_model()
    if "--absent" in argv:
        absent = int(argv[argv.index("--absent") + 1])
        if me == absent:
            os._exit(0)  # gone without a word (no atexit, no distributed shutdown)
        runtime.BOOTSTRAP_TIMEOUT_S = 10.0
        start = time.monotonic()
        try:
            runtime.register_targets()  # the bootstrap: must not hang
        except TimeoutError as e:
            print(f"bootstrap failed after {time.monotonic() - start:.1f} s: {e}", flush=True)
            assert f"process {absent}" in str(e), e
            print(f"process_group_worker OK 1 (process {me}, absent process named)", flush=True)
            os._exit(0)  # the coordinator would wait for the absent process at shutdown
        raise AssertionError("the bootstrap succeeded without the absent process")
    mesh = Mesh(np.array(jax.devices()), (AXIS,))
    if "--bench" in argv:  # the benchmark only (the test runs the checks); --bench-sms N, --bench-pull both

        def option(name, default):  # the value after `name`, or `default`
            return argv[argv.index(name) + 1] if name in argv else default

        sms = option("--bench-sms", None)
        pulls = {"push": (False,), "pull": (True,), "both": (False, True)}[option("--bench-pull", "push")]
        warps = tuple(int(w) for w in option("--bench-send-warps", "6").split(","))
        dtypes = tuple(option("--bench-dtypes", "bfloat16,float8_e4m3fn").split(","))
        bench(mesh, option("--bench", None), None if sms is None else int(sms), pulls,
              "--bench-no-profile" not in argv, warps, dtypes)
        counts = {}
    elif "--remote" in argv:  # the NVSHMEM put/signal transport only
        counts = {"remote_smoke": check_remote_smoke(mesh, me)}
    else:
        assert R == count, f"test_dispatch_gpu's EP size {R} (JAX_EP_TEST_EP_RANKS) is not {count} processes"
        checks = {"dispatch_combine": check_cases, "gradients": check_gradients,
                  "rank_major": lambda m, p: rank_major_model2.check_cases(m, p, transport="load_store"),
                  "low_latency": check_low_latency, "low_latency_scan": check_low_latency_scan,
                  "remote_smoke": check_remote_smoke, "side_stream": check_side_stream,
                  "layer": check_layer, "dispatch_pull": check_dispatch_pull}
        # --checks a,b: only those groups (a run by hand; the test runs them all)
        chosen = argv[argv.index("--checks") + 1].split(",") if "--checks" in argv else list(checks)
        counts = {}
        for name in chosen:
            try:
                counts[name] = checks[name](mesh, me)
            except Exception:  # a kernel's fault record says more than XLA's launch failure
                for _ in range(50):  # (written just before the kernel traps: give it a moment)
                    if runtime.faults():
                        break
                    time.sleep(0.1)
                print(f"process {me}: check {name} failed; jax_ep faults: {runtime.faults()}", flush=True)
                raise
        group = runtime.extension().process_group()  # (set up by the first EP op)
        assert group["model"] == "process_per_gpu" and group["pe"] == me, group
        assert group["reachable_pes"] == list(range(count)), group
    # the checks per group, as JSON: the test asserts each group it expects ran
    print(f"process_group_worker OK {sum(counts.values())} {json.dumps(counts)} (process {me}, buffer "
          f"{runtime.extension().buffer_bytes()} bytes, faults {runtime.faults()})", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
