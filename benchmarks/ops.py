"""Time dispatch and combine on the available devices, for every backend present; with ``--layer``, the
MoE layer's training step (``benchmarks.layer``). Run from the repository root:

    python -m benchmarks [--preset auto|small|deepseek|sparse[,...]] [--tokens 128,4096] [--out FILE]
    python -m benchmarks --preset deepseek,sparse --tokens 128,512,2048,4096,8192   # a tokens sweep
    python -m benchmarks --layer [--layer-shapes mid,deepseek] [--profile] [--out FILE]
    python -m benchmarks --rank-major --preset deepseek --backends reference,dense,cuda --profile

The JSON records go to ``out/bench.json`` (``out/bench_layer.json`` with ``--layer``,
``out/bench_ll.json`` with ``--low-latency``) under the repository root, a git-ignored folder, unless
``--out`` names another file.

Backends (``layout``: the order of the receive rows):
  reference  jax_ep's pure-JAX path: dense lax.all_to_all, then expansion into expert-major rows
  dense      the plain-JAX baseline (benchmarks.baselines): dense lax.all_to_all of rank-major rows
             (capacity T per rank pair), combine = the reverse all_to_all and a sum per token
  ragged     the MaxText-style lax.ragged_all_to_all baseline, expert-major (where the platform has it)
  cuda       jax_ep's kernels, expert-major (where built)
``--rank-major``: reference and cuda time jax_ep's rank-major ops instead (dispatch_rank_major per
dispatch dtype; combine_rank_major and broadcast_rank_major, its backward, on bf16 rows of a bf16
dispatch), recorded under those op names with layout rank_major (the auto table's rank_major rows);
dense, rank-major already, is the plain-JAX baseline to compare with.
``--tokens`` replaces the tokens per rank of every preset shape. Every dispatch dtype has its own
dispatch record; combine has one record per shape and backend, timed on the handle and bf16 rows of a
bf16 dispatch (``dispatch_dtype`` in its record), in the pass of the first of ``--dtypes`` when
bfloat16 is not among them. The bf16 pass also times get_dispatch_layout, slot_values, broadcast and
combine_bwd, the last two both as ops (every one of the C rows written: zeros where no token is) and in
place (``broadcast_in_place``, ``combine_bwd_in_place``: into y's donated buffer, only the token rows
written, as the MoE layer runs them). ``--pull both`` times the cuda dispatch and broadcast with their
rows pushed and pulled (``KernelConfig.dispatch_pull`` / ``broadcast_pull``); a cuda record says whether
its kernels pulled (``pull``) and the run's setting (``pull_setting``: auto, the default, push or pull),
from which ``python -m benchmarks.auto_table`` decides the default's form.
Each time is the median over ``--repeats`` chains of ``--iters``
back-to-back jitted calls, per call; each call returns its whole output (nothing dropped, nothing
copied). ``--profile`` adds the device time of every kernel per call
on GPU 0, from a jax.profiler trace (``kernels_us``; their sum is ``device_us``); on several GPUs
each profiled call first lines the GPUs up (a large GEMM and an all-reduce, as DeepEP's benchmarks
do; ``aligned`` in the record), so that launch skew between them is not charged to the op.

When the DeepSeek-V3 shape (4096 tokens per rank, hidden 7168, top-8, 256 experts) is in the run, the
table and the records also carry DeepEP V1's published figures for it (2x H200, 24 SMs), with
``measured: false``: they come from the design notes, not from this run.

Bytes: ``logical`` counts one copy of each token's row per destination rank (self included) — what the
op delivers; ``wire`` counts only the copies that leave the rank (what must cross NVLink). Both are
per rank. ``logical_gbps`` / ``wire_gbps`` divide by the wall time of a call (``us``, the median, launch
and host included); ``wire_gbps_device`` by its profiled device time (``device_us``, ``--profile``): the
kernels' own rate, the one to set beside device times and NVLink (before 2026-12-05 the tables printed
wall-time GB/s beside device µs). ``pct_of_peak`` compares wire GB/s with a device-to-device copy
measured at the start of the same run (GPUs only), ``pct_of_peak_device`` the device rate.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks import baselines
from benchmarks import layer as bench_layer
from jax_ep import cuda_backend, routing
from jax_ep.config import EPConfig, KernelConfig
from jax_ep.devices import use_virtual_cpu_devices
from jax_ep.launch import positive_int
from jax_ep.ops import (
    combine,
    combine_rank_major,
    dispatch,
    dispatch_rank_major,
    get_dispatch_layout,
    implementation,
    ll_combine,
    ll_combine_recv,
    ll_combine_send,
    ll_dispatch,
    ll_dispatch_recv,
    ll_dispatch_send,
)

PRESETS = {
    # name: (tokens per rank, hidden, top-k, experts)
    "small": [(256, 512, 4, 32)],
    "deepseek": [(4096, 7168, 8, 256)],
    "sparse": [(4096, 7168, 2, 8)],
}
BYTES = {"bfloat16": 2, "float8_e4m3fn": 1}
LAYOUTS = {"reference": "expert_major", "cuda": "expert_major", "ragged": "expert_major",
           "dense": "rank_major"}
DEEPSEEK_V3 = PRESETS["deepseek"][0]
# DeepEP V1 normal mode at the DeepSeek-V3 shape, 2x H200, 24 SMs (PyTorch), from ../shared/design.md
# ("Targets measured on the same machine kind"): not measured by this benchmark.
DEEPEP_V1 = {("dispatch", "bfloat16"): 343.0, ("dispatch", "float8_e4m3fn"): 244.0,
             ("combine", "bfloat16"): 400.0}
PUBLISHED_BACKEND = "deepep_v1 (published)"
# Where the records go by default: out/ under the repository root (git-ignored), not the source tree.
OUT_DIR = pathlib.Path(__file__).resolve().parents[1] / "out"
DEFAULT_OUT = {"ops": "bench.json", "layer": "bench_layer.json", "low_latency": "bench_ll.json"}


def routing_inputs(rng, n, experts, topk):
    """(topk_idx, topk_weights) of n tokens: top-k distinct experts each, weights summing to 1 (NumPy)."""
    idx = np.argsort(rng.random((n, experts)), axis=1)[:, :topk].astype(np.int32)
    w = rng.random((n, topk)).astype(np.float32)
    return idx, w / w.sum(1, keepdims=True)


def _put(mesh, a: np.ndarray) -> jax.Array:
    """Host array `a` sharded over "ep" on its leading dimension, each process putting its own shards:
    jax.device_put to several processes runs an XLA collective, which NCCL refuses between processes
    that share a GPU (process_group_worker.py --bench under CUDA MPS)."""
    return jax.make_array_from_callback(a.shape, NamedSharding(mesh, P("ep")), lambda index: a[index])


def _runner(fn, args, chain: int | None = None):
    """A function of no arguments that calls jit(fn)(*args). With `chain`, args[chain] is donated to
    each call and replaced by the call's first output: an op that writes in place (its output aliases
    that operand) then runs as in a training step, where the operand is dead after it, not after a
    copy XLA would make to keep the operand alive. The chain starts from a copy (the caller's array
    stays valid)."""
    if chain is None:
        run = jax.jit(fn)
        return lambda: run(*args)
    run = jax.jit(fn, donate_argnums=(chain,))
    state = list(args)
    state[chain] = jnp.copy(args[chain])

    def call():
        out = run(*state)
        state[chain] = jax.tree.leaves(out)[0]
        return out
    return call


def _time_calls(fn, args, iters: int, repeats: int, chain: int | None = None) -> float:
    """Median seconds per call of jit(fn)(*args), over `repeats` chains of `iters` calls (`chain`:
    _runner's).

    Every call is a separate jitted call whose whole output is returned, so XLA can neither drop
    nor hoist any of its work, and no output is copied. The host enqueues the calls asynchronously
    (each returns before the device finishes), so the device runs them back to back and the chain's
    wall time over `iters` is the device time per call once the calls take longer to run than to
    enqueue (a few tens of µs)."""
    call = _runner(fn, args, chain)
    jax.block_until_ready(call())
    times = []
    for _ in range(repeats):
        jax.block_until_ready(call())
        start = time.perf_counter()
        out = None
        for _ in range(iters):
            out = call()  # the previous output is freed here, stream-ordered
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / iters)
    return float(np.median(times))


def _trace_totals(calls, iters: int, device_index: int = 0) -> dict[str, float]:
    """Device time per iteration of each GPU kernel / copy on one device while `calls()` runs `iters`
    times under jax.profiler: the events of the device's streams summed by name."""
    data = bench_layer.profiled(calls, iters)
    totals: dict[str, float] = {}
    plane_name = f"/device:GPU:{device_index}"
    for plane in data.planes:
        if plane.name != plane_name:
            continue
        for line in plane.lines:
            if not line.name.startswith("Stream"):
                continue
            for event in line.events:
                totals[event.name] = totals.get(event.name, 0.0) + event.duration_ns / 1e3 / iters
    return totals


ALIGN_GEMM = 8192  # the aligning GEMM: ~1.5 ms on an H200, longer than the host takes to enqueue a call


@functools.cache
def _aligner(mesh):
    """A step that lines the GPUs up before a profiled call, as DeepEP's benchmarks do
    (``barrier_comm_profiling``: a large GEMM, then an all-reduce): while the GEMM runs the host
    enqueues the next call, and the all-reduce ends on every GPU at about the same time, so the call
    starts together everywhere. Without it a host-bound chain of calls (each GPU starting a call when
    the host reaches it) charges the launch skew between the GPUs to the op's first group-sync kernel.
    Returns (fn, args, the step's own kernel times per call on GPU 0)."""
    axis = mesh.axis_names[0]
    # one matrix per GPU (varying over the axis: the all-reduce sums values that differ per GPU)
    a = jax.device_put(jnp.ones((mesh.size, ALIGN_GEMM, ALIGN_GEMM), jnp.bfloat16),
                       NamedSharding(mesh, P(axis)))
    step = jax.jit(jax.shard_map(lambda a: lax.psum(jnp.dot(a[0], a[0]), axis), mesh=mesh,
                                 in_specs=P(axis), out_specs=P()))
    jax.block_until_ready(step(a))
    return step, a, _trace_totals(lambda: step(a), 3)


def kernel_profile(fn, args, iters: int, mesh=None, chain: int | None = None) -> dict[str, float]:
    """Device time per call of each GPU kernel / copy that jit(fn)(*args) runs on GPU 0.

    Traces `iters` calls with jax.profiler and sums the events of the device's streams by name.
    For communicating kernels this includes the time spent waiting for peers. With a `mesh` of
    several GPUs each call follows the aligning step of ``_aligner`` (its own kernels taken out of
    the sums: by name, or where the call runs a kernel of the same name, by the step's time alone).
    `chain`: _runner's (an op in place)."""
    call = _runner(fn, args, chain)
    jax.block_until_ready(call())
    if mesh is None or mesh.size < 2:
        totals = _trace_totals(call, iters)
    else:
        step, a, own = _aligner(mesh)

        def aligned():
            step(a)
            return call()
        alone = _trace_totals(call, 2)
        totals = _trace_totals(aligned, iters)
        for name, us in own.items():
            if name in alone:   # the call's too: keep the call's share
                totals[name] = max(0.0, totals.get(name, 0.0) - us)
            else:
                totals.pop(name, None)
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def measure_copy_peak(devices, nbytes: int = 1 << 30) -> float | None:
    """GB/s of a device-to-device copy between the first two GPUs (None on CPU or one device)."""
    if len(devices) < 2 or devices[0].platform != "gpu":
        return None
    x = jax.device_put(jnp.ones((nbytes // 4,), jnp.float32), devices[0])
    jax.block_until_ready(jax.device_put(x, devices[1]))
    times = []
    for _ in range(5):
        start = time.perf_counter()
        jax.block_until_ready(jax.device_put(x, devices[1]))
        times.append(time.perf_counter() - start)
    return nbytes / float(np.median(times)) / 1e9


def resolve_shapes(preset: str, platform: str, tokens: str | None = None, hidden: int | None = None,
                   topk: int | None = None, experts: int | None = None, ep_size: int | None = None
                   ) -> list[tuple[int, int, int, int]]:
    """The (tokens per rank, hidden, top-k, experts) shapes of a run. ``preset``: "auto" (small on CPU,
    deepseek and sparse on GPUs) or comma-separated preset names; ``tokens`` (comma-separated) replaces
    the tokens of every preset shape; hidden/topk/experts override theirs. Duplicates are run once.
    ``ep_size``: refuse (ValueError naming the option or preset) the experts it does not divide and a
    top-k above the experts, which jax_ep refuses while the dense baseline ran them (before 2026-12-05:
    silently dropping the pairs of the experts past the last whole rank, or a broadcasting error)."""
    if preset == "auto":
        names = ["small"] if platform == "cpu" else ["deepseek", "sparse"]
    else:
        names = preset.split(",")
        unknown = [n for n in names if n not in PRESETS]
        if unknown:
            raise ValueError(f"unknown preset(s) {unknown}; choose from {sorted(PRESETS)} or auto")
    for name in names:
        for _, _, k, e in PRESETS[name]:
            k_from = f"--topk {topk}" if topk else f"preset {name}'s top-{k}"
            e_from = f"--experts {experts}" if experts else f"preset {name}'s {e} experts"
            k, e = topk or k, experts or e
            if ep_size and e % ep_size:
                raise ValueError(f"{e_from}: not divisible by the EP size {ep_size} (the devices); give "
                                 f"--experts a multiple of {ep_size}")
            if k > e:
                raise ValueError(f"{k_from} exceeds {e_from}: each token picks top-k distinct experts")
    shapes = [shape for name in names for shape in PRESETS[name]]
    if tokens:
        shapes = [(int(t), h, k, e) for _, h, k, e in shapes for t in tokens.split(",")]
    shapes = [(t, hidden or h, topk or k, experts or e) for t, h, k, e in shapes]
    return list(dict.fromkeys(shapes))


def published_records(shapes, dtypes) -> list[dict]:
    """DeepEP V1's published figures (``measured: false``) for the DeepSeek-V3 shape, when in ``shapes``."""
    if DEEPSEEK_V3 not in shapes:
        return []
    tokens, hidden, topk, experts = DEEPSEEK_V3
    records = []  # device_us: DeepEP's own tests time the kernels on the device
    for (op, dtype), us in DEEPEP_V1.items():
        if op == "dispatch" and dtype not in dtypes:
            continue
        records.append(dict(op=op, backend=PUBLISHED_BACKEND, layout="rank_major", dtype=dtype,
                            tokens_per_rank=tokens, hidden=hidden, topk=topk, num_experts=experts,
                            ep_size=2, us=us, device_us=us, logical_gbps=None, wire_gbps=None, num_sms=24,
                            device="2x H200 (DeepEP V1, PyTorch)", date=None, peer_copy_gbps=None,
                            pct_of_peak=None, measured=False,
                            source="../shared/design.md: targets measured on 2x H200, not by this run"))
    return records


def _backends(requested: list[str], platform: str) -> list[str]:
    usable = []
    for name in requested:
        if name == "ragged" and platform == "cpu":
            print("skip ragged: lax.ragged_all_to_all is not implemented on XLA:CPU")
            continue
        if name == "cuda":
            from jax_ep import runtime
            ok, why = runtime.available()
            if not ok:
                print(f"skip cuda: {why}")
                continue
        usable.append(name)
    return usable


def bench_shape(mesh, backend, dtype, tokens, hidden, topk, experts, iters, repeats, rng,
                profile=False, kernel: KernelConfig | None = None, with_combine: bool = True,
                rank_major: bool = False):
    """Records of dispatch (``dtype`` on the wire) and, with ``with_combine``, of combine (on the
    handle and bf16 rows of a bf16 dispatch; ``dispatch_dtype`` in its record) at one shape.
    ``kernel``: the CUDA kernels' configuration (default: EPConfig's); ``num_sms`` in the records is
    its SM count when the CUDA dispatch ran. ``rank_major`` (reference, cuda): the rank-major ops
    (dispatch_rank_major, combine_rank_major and, bf16 pass, broadcast_rank_major) instead."""
    ep_size = mesh.size
    n = tokens * ep_size
    x = _put(mesh, rng.standard_normal((n, hidden)).astype(np.float32).astype(jnp.bfloat16))
    idx, w = routing_inputs(rng, n, experts, topk)
    spec = P("ep")
    # on the devices up front, so that no call pays a host-to-device copy
    idx_dev, w_dev = (_put(mesh, a) for a in (idx, w))
    records = []
    if backend == "ragged":
        disp = lambda x, i, w: baselines.ragged_dispatch(x, i, w, experts, "ep")  # noqa: E731
        # every output (rows, group sizes, handle), as the other backends' calls return theirs
        d_fn = jax.shard_map(lambda x, i, w: jax.tree.leaves(disp(x, i, w)), mesh=mesh, in_specs=spec,
                             out_specs=spec)
        t_dispatch = _time_calls(d_fn, (x, idx_dev, w_dev), iters, repeats)
        d_args = (x, idx_dev, w_dev)

        def round_trip(x, i, w):
            rows, _, handle = disp(x, i, w)
            return baselines.ragged_combine(rows, handle, "ep")
        rt = jax.shard_map(round_trip, mesh=mesh, in_specs=spec, out_specs=spec)
        t_combine = (_time_calls(rt, (x, idx_dev, w_dev), iters, repeats) - t_dispatch
                     if with_combine else None)
        c_fn, c_args = rt, (x, idx_dev, w_dev)
        num_sms = None
    elif backend == "dense":
        def dense_outputs(x, i, w):
            return jax.tree.leaves(baselines.dense_dispatch(x, i, w, experts, "ep", dtype))

        d_fn = jax.shard_map(dense_outputs, mesh=mesh, in_specs=spec, out_specs=spec)
        t_dispatch = _time_calls(d_fn, (x, idx_dev, w_dev), iters, repeats)

        # combine is timed alone on dispatched bf16 rows (standing in for the gate-weighted expert
        # outputs) and the handle
        def rows_and_handle(x, i, w):
            d = baselines.dense_dispatch(x, i, w, experts, "ep", "bfloat16")
            return d.x, d.handle

        make = jax.jit(jax.shard_map(rows_and_handle, mesh=mesh, in_specs=spec, out_specs=spec))
        rows, handle = make(x, idx_dev, w_dev)
        c_fn = jax.shard_map(lambda y, h: baselines.dense_combine(y, h, "ep"), mesh=mesh, in_specs=spec,
                             out_specs=spec)
        t_combine = _time_calls(c_fn, (rows, handle), iters, repeats) if with_combine else None
        d_args, c_args = (x, idx_dev, w_dev), (rows, handle)
        num_sms = None
    else:
        cfg = EPConfig(num_experts=experts, num_topk=topk, hidden=hidden, max_tokens_per_rank=tokens,
                       backend=backend, dispatch_dtype=dtype, kernel=kernel or KernelConfig())
        dispatch_impl = []   # the module that ran dispatch, noted when d_fn is traced (inside shard_map)
        dispatch_op, combine_fn = ("dispatch_rank_major", combine_rank_major) if rank_major else (
            "dispatch", combine)
        dispatch_fn = dispatch_rank_major if rank_major else dispatch

        def dispatch_outputs(x, i, w):
            dispatch_impl.append(implementation(dispatch_op, cfg, x.dtype).__module__)
            # every output array of dispatch (scalars as [1]), so no part of the op is dead code
            return [a.reshape(-1) if a.ndim == 0 else a for a in jax.tree.leaves(dispatch_fn(x, i, w, cfg))]

        d_fn = jax.shard_map(dispatch_outputs, mesh=mesh, in_specs=spec, out_specs=spec)
        t_dispatch = _time_calls(d_fn, (x, idx_dev, w_dev), iters, repeats)
        # combine is timed alone on a dispatched handle and bf16 expert outputs
        bf16_cfg = cfg.replace(dispatch_dtype="bfloat16")

        def rows_and_handle(x, i, w):
            d = dispatch_fn(x, i, w, bf16_cfg)
            return d.x, d.handle

        make = jax.jit(jax.shard_map(rows_and_handle, mesh=mesh, in_specs=spec, out_specs=spec))
        rows, handle = make(x, idx_dev, w_dev)
        c_fn = jax.shard_map(lambda y, h: combine_fn(y, h, bf16_cfg), mesh=mesh, in_specs=spec,
                             out_specs=spec)
        t_combine = _time_calls(c_fn, (rows, handle), iters, repeats) if with_combine else None
        d_args, c_args = (x, idx_dev, w_dev), (rows, handle)
        num_sms = (cuda_backend.kernel_blocks(cfg.kernel) if dispatch_impl[-1].endswith("cuda_backend")
                   else None)
    extra = {}  # the layout and the backward ops, for the auto table (bf16 pass only)
    if backend in ("cuda", "reference") and dtype == "bfloat16" and with_combine and rank_major:
        extra = _extra_ops(mesh, bf16_cfg, None, (x, handle), None, iters, repeats, rank_major=True)
    elif backend in ("cuda", "reference") and dtype == "bfloat16" and with_combine:
        extra = _extra_ops(mesh, bf16_cfg, (idx_dev,), (x, handle), (rows[..., 0], handle), iters, repeats,
                           combine_bwd_args=(x, rows, handle))
    # bytes, from the routing actually used (host-side layout of every rank)
    per_rank_layout = [np.asarray(routing.layout_of(jnp.asarray(idx[r * tokens:(r + 1) * tokens]),
                                                      experts, ep_size).num_tokens_per_rank)
                       for r in range(ep_size)]
    pairs = np.mean([lay.sum() for lay in per_rank_layout])
    remote = np.mean([lay.sum() - lay[r] for r, lay in enumerate(per_rank_layout)])
    row_bytes = {"dispatch": hidden * BYTES[dtype] + (4 * -(-hidden // 128) if dtype != "bfloat16" else 0),
                 "combine": hidden * 2}
    row_bytes.update(broadcast=hidden * 2, combine_bwd=hidden * 2, broadcast_in_place=hidden * 2,
                     combine_bwd_in_place=hidden * 2, layout=None, slot_values=None)
    names = {"dispatch": "dispatch", "combine": "combine", "broadcast": "broadcast"}
    if rank_major and backend in ("cuda", "reference"):
        names = {op: f"{op}_rank_major" for op in names}
    kernels = {}
    if profile and mesh.devices.flat[0].platform == "gpu":
        kernels = {"dispatch": kernel_profile(d_fn, d_args, iters, mesh)}
        if with_combine:
            kernels["combine"] = kernel_profile(c_fn, c_args, iters, mesh)
        kernels.update({op: kernel_profile(fn, args, iters, mesh, chain)
                        for op, (_, fn, args, chain) in extra.items()})
    device_us = {op: sum(k.values()) for op, k in kernels.items()}
    if backend == "ragged" and "combine" in kernels:  # its combine is profiled as a round trip
        device_us["combine"] -= device_us["dispatch"]
    timed = [("dispatch", t_dispatch)] + ([("combine", t_combine)] if with_combine else [])
    timed += [(op, seconds) for op, (seconds, _, _, _) in extra.items()]
    for op, seconds in timed:
        moved = row_bytes[op]
        records.append(dict(op=names.get(op, op), backend=backend,
                            layout="rank_major" if names.get(op, op).endswith("_rank_major")
                            else LAYOUTS[backend],
                            dtype=dtype if op == "dispatch" else "bfloat16",
                            tokens_per_rank=tokens, hidden=hidden, topk=topk, num_experts=experts,
                            ep_size=ep_size, us=1e6 * seconds, device_us=device_us.get(op),
                            logical_gbps=None if moved is None else pairs * moved / seconds / 1e9,
                            wire_gbps=None if moved is None else remote * moved / seconds / 1e9,
                            wire_gbps_device=None if moved is None or not device_us.get(op)
                            else remote * moved / device_us[op] / 1e3,
                            num_sms=num_sms, measured=True))
        if num_sms is not None:  # the CUDA kernels ran: whether they pulled their rows, and the setting
            records[-1].update(pull_fields(names.get(op, op), dispatch_op, cfg, ep_size))
        if op == "combine":  # which dispatch made its handle and rows
            records[-1]["dispatch_dtype"] = "bfloat16"
        if op in kernels:  # aligned: each profiled call followed _aligner's step (several GPUs)
            records[-1].update(kernels_us={k: round(v, 1) for k, v in kernels[op].items()},
                               aligned=ep_size > 1)
    return records


# Low-latency (decode) shape of issue 14 and DeepEP V1's low-latency figures on 2x H200 (from
# ../shared/design.md; not measured by this benchmark).
LL_SHAPE = dict(hidden=7168, topk=8, experts=288)
LL_TOKENS = "1,16,64,128,256"
DEEPEP_V1_LL = {"ll_dispatch": 28.6, "ll_combine": 39.8, "ll_round_trip": 72.1}
# ll_two_phase: the round trip through ll_dispatch_send / _recv and ll_combine_send / _recv


def bench_low_latency(mesh, backend, dtype, tokens, hidden, topk, experts, iters, repeats, rng,
                      profile=False, combine=True) -> list[dict]:
    """Records of ll_dispatch (``dtype`` on the wire), ll_combine (bf16; ``combine``: timed in this pass)
    and their round trip."""
    n = tokens * mesh.size
    spec = P("ep")
    x = jax.device_put(rng.standard_normal((n, hidden)).astype(np.float32).astype(jnp.bfloat16),
                       NamedSharding(mesh, spec))
    idx, w = (jax.device_put(a, NamedSharding(mesh, spec)) for a in routing_inputs(rng, n, experts, topk))
    cfg = EPConfig(num_experts=experts, num_topk=topk, hidden=hidden, max_tokens_per_rank=tokens,
                   backend=backend, dispatch_dtype=dtype)

    def d_body(x, i, w):
        return _ll_leaves(ll_dispatch(x, i, w, cfg))

    # The expert outputs of the round trips: fixed rows y, ordered after the dispatch by an
    # optimization barrier (no kernel; an XLA convert of the whole slot buffer cost more than both ops)
    def round_trip(x, i, w, y):
        d = ll_dispatch(x, i, w, cfg)
        y, _ = lax.optimization_barrier((y, d.x))
        return ll_combine(y, d.handle, cfg)

    def two_phase(x, i, w, y):  # the same through the send / receive phases, back to back
        d = ll_dispatch_recv(ll_dispatch_send(x, i, w, cfg), cfg)
        y, _ = lax.optimization_barrier((y, d.x))
        return ll_combine_recv(ll_combine_send(y, d.handle, cfg), cfg)

    def make_y(x, i, w):
        d = ll_dispatch(x, i, w, cfg)
        return d.x.astype(jnp.bfloat16), d.handle

    d_fn = jax.shard_map(d_body, mesh=mesh, in_specs=spec, out_specs=spec)
    rt_fn = jax.shard_map(round_trip, mesh=mesh, in_specs=spec, out_specs=spec)
    two_fn = jax.shard_map(two_phase, mesh=mesh, in_specs=spec, out_specs=spec)
    y, handle = jax.jit(jax.shard_map(make_y, mesh=mesh, in_specs=spec, out_specs=spec))(x, idx, w)
    c_fn = jax.shard_map(lambda y, h: ll_combine(y, h, cfg), mesh=mesh, in_specs=spec, out_specs=spec)
    timed = {"ll_dispatch": (d_fn, (x, idx, w)), "ll_combine": (c_fn, (y, handle)),
             "ll_round_trip": (rt_fn, (x, idx, w, y)), "ll_two_phase": (two_fn, (x, idx, w, y))}
    if not combine:
        del timed["ll_combine"]
    records = []
    on_gpu = mesh.devices.flat[0].platform == "gpu"
    for op, (fn, args) in timed.items():
        seconds = _time_calls(fn, args, iters, repeats)
        kernels = kernel_profile(fn, args, iters, mesh) if profile and on_gpu else {}
        records.append(dict(op=op, backend=backend, layout="fixed_slots",
                            dtype=dtype if op != "ll_combine" else "bfloat16", tokens_per_rank=tokens,
                            hidden=hidden, topk=topk, num_experts=experts, ep_size=mesh.size,
                            us=1e6 * seconds, device_us=sum(kernels.values()) if kernels else None,
                            logical_gbps=None, wire_gbps=None, num_sms=None, measured=True,
                            **({"kernels_us": {k: round(v, 1) for k, v in kernels.items()},
                                  "aligned": mesh.size > 1} if kernels else {})))
    if backend == "cuda" and on_gpu:
        records.append(ll_overlap(mesh, cfg, (x, idx, w), iters, repeats, rng, profile=profile))
    return records


def _ll_leaves(d) -> list:
    """Every output of an ll_dispatch (all returned: XLA keeps the whole op), scalars (num_dropped)
    as [1] so that out_specs P("ep") fits them."""
    return [jnp.atleast_1d(a) for a in jax.tree.leaves(d)]


# the shared expert placed between the send and the receive (DeepSeek-V3's: one SwiGLU of 2048)
LL_OVERLAP_FFN = 2048
# decode layers per timed call of ll_overlap: the device, not the host, sets the pace
LL_OVERLAP_LAYERS = 16


def ll_overlap(mesh, cfg: EPConfig, dispatch_args, iters: int, repeats: int, rng,
               profile: bool = False) -> dict:
    """How much of ll_dispatch the two-phase form hides behind real work, in a decode-like loop of
    LL_OVERLAP_LAYERS layers per call (one jitted call, so the device sets the pace, not the host).
    Each layer runs, on XLA's compute stream: ``serial``: ll_dispatch, then a shared expert (SwiGLU
    of LL_OVERLAP_FFN) on the same tokens; ``overlapped``: ll_dispatch_send, the shared expert, then
    ll_dispatch_recv (pinned in that order by optimization barriers); ``shared``: the shared expert
    alone. The next layer's tokens depend on both results. Wall µs per layer; ``hidden_us`` = serial -
    overlapped; ``dispatch_in_step_us`` = serial - shared (what the dispatch adds to the layer);
    ``hidden_share`` = hidden_us / dispatch_in_step_us. Over NVLink the send's own warps move the
    data, so what can hide is the receive's wait for the peers (their skew and the transfer's
    latency), not the copying. ``profile`` (GPU): the kernels of both forms per layer
    (``kernels_us`` / ``serial_kernels_us``; ``device_us`` / ``serial_device_us`` their sums)."""
    hidden, ffn = cfg.hidden, LL_OVERLAP_FFN
    replicated = NamedSharding(mesh, P())
    w1, w2 = (jax.device_put((rng.standard_normal(shape) * shape[0] ** -0.5).astype(jnp.bfloat16), replicated)
              for shape in ((hidden, 2 * ffn), (ffn, hidden)))

    def shared(x, w1, w2):
        h = jnp.dot(x, w1)
        return jnp.dot(jax.nn.silu(h[:, :ffn]) * h[:, ffn:], w2)

    def next_x(s, d):  # the next layer's tokens: the shared expert's output and one received row
        return (s + 1e-3 * d.x[0, :1].astype(jnp.float32)).astype(jnp.bfloat16)

    # both forms through the same two optimization barriers, so that XLA fuses the rest alike
    def serial(x, i, w, w1, w2):
        d = ll_dispatch(x, i, w, cfg)
        x, d = lax.optimization_barrier((x, d))
        s = shared(x, w1, w2)
        s, d = lax.optimization_barrier((s, d))
        return next_x(s, d)

    def overlapped(x, i, w, w1, w2):
        pending = ll_dispatch_send(x, i, w, cfg)
        x, pending = lax.optimization_barrier((x, pending))  # the send before the shared expert
        s = shared(x, w1, w2)
        s, pending = lax.optimization_barrier((s, pending))  # the shared expert before the receive
        return next_x(s, ll_dispatch_recv(pending, cfg))

    def shared_only(x, i, w, w1, w2):
        return shared(x, w1, w2).astype(jnp.bfloat16)

    def layers(step):
        def run(x, i, w, w1, w2):
            return lax.fori_loop(0, LL_OVERLAP_LAYERS, lambda _, x: step(x, i, w, w1, w2), x)
        return jax.shard_map(run, mesh=mesh, in_specs=(P("ep"), P("ep"), P("ep"), P(), P()),
                             out_specs=P("ep"))

    args = (*dispatch_args, w1, w2)
    us = {name: 1e6 * _time_calls(layers(fn), args, iters, repeats) / LL_OVERLAP_LAYERS
          for name, fn in (("serial", serial), ("overlapped", overlapped), ("shared", shared_only))}
    hidden_us = us["serial"] - us["overlapped"]
    dispatch_in_step_us = us["serial"] - us["shared"]
    kernels = {}
    if profile and mesh.devices.flat[0].platform == "gpu":
        for name, fn in (("serial", serial), ("overlapped", overlapped)):
            per_call = kernel_profile(layers(fn), args, iters, mesh)
            kernels[name] = {k: round(v / LL_OVERLAP_LAYERS, 2) for k, v in per_call.items()}
    profiled = dict(kernels_us=kernels["overlapped"], serial_kernels_us=kernels["serial"],
                    serial_device_us=sum(kernels["serial"].values()),
                    aligned=mesh.size > 1) if kernels else {}
    return dict(op="ll_overlap", backend=cfg.backend, layout="fixed_slots",
                dtype=str(jnp.dtype(cfg.wire_dtype(jnp.bfloat16))), tokens_per_rank=cfg.max_tokens_per_rank,
                hidden=hidden, topk=cfg.num_topk,
                num_experts=cfg.num_experts, ep_size=mesh.size, us=us["overlapped"], us_serial=us["serial"],
                us_shared=us["shared"], dispatch_in_step_us=dispatch_in_step_us, hidden_us=hidden_us,
                hidden_share=hidden_us / dispatch_in_step_us if dispatch_in_step_us > 0 else None,
                shared_ffn=ffn, layers=LL_OVERLAP_LAYERS,
                device_us=sum(kernels["overlapped"].values()) if kernels else None, logical_gbps=None,
                wire_gbps=None, num_sms=None, measured=True, **profiled)


# --pull's settings and the KernelConfig.dispatch_pull / broadcast_pull value each sets ("both": push, pull)
PULL_SETTINGS = {"auto": None, "push": False, "pull": True}


def pull_fields(op: str, dispatch_op: str, cfg: EPConfig, ep_size: int) -> dict:
    """A cuda record's ``pull`` (whether the kernels of its op pulled their rows: a broadcast's own knob,
    the other ops their dispatch's) and ``pull_setting`` (the run's KernelConfig: "auto", the default,
    dispatch_pull None; "push" or "pull": the benchmark sets both knobs alike)."""
    knob_op = (op if op.startswith("broadcast_rank") else "broadcast" if op.startswith("broadcast")
               else dispatch_op)
    return dict(pull=cuda_backend.pulls(knob_op, cfg, ep_size),
                pull_setting={v: k for k, v in PULL_SETTINGS.items()}[cfg.kernel.dispatch_pull])


def _extra_ops(mesh, cfg, layout_args, broadcast_args, slot_args, iters, repeats, rank_major=False,
               combine_bwd_args=None):
    """{op: (seconds per call, fn, args, chain)} of get_dispatch_layout, broadcast (the data movement of
    combine's backward), combine_bwd (combine's whole backward: d y and d row_weights, on (g [T, H],
    y [C, H], handle)), both also in place (``*_in_place``: into y's buffer, as the MoE layer runs them
    with ``EPOptions.dy_in_place``: only the rows that hold a token are written, where the others zero
    all C rows, at EP4 with the worst-case capacity 4x the rows of dispatch; `chain`: the donated
    operand, _runner's) and slot_values (dispatch's backward, on a row vector) for cfg.backend;
    ``rank_major``: only broadcast_rank_major (combine_rank_major's backward), under the key
    "broadcast"."""
    spec = P("ep")
    if rank_major:
        fns = {"broadcast": lambda g, h: implementation("broadcast_rank_major", cfg, g.dtype)(g, h, cfg)}
    else:
        fns = {
            "layout": lambda i: jax.tree.leaves(get_dispatch_layout(i, cfg)),
            "broadcast": lambda g, h: implementation("broadcast", cfg, g.dtype)(g, h, cfg),
            "combine_bwd": lambda g, y, h: implementation("combine_bwd", cfg, y.dtype)(g, y, h, cfg),
            "broadcast_in_place": lambda g, y, h: implementation("broadcast_in_place", cfg, g.dtype)(
                g, h, cfg, into=y),
            "combine_bwd_in_place": lambda g, y, h: implementation("combine_bwd_in_place", cfg, y.dtype)(
                g, y, h, cfg, empty_rows_from_y=True),
            "slot_values": lambda v, h: implementation("slot_values", cfg)(v.astype(jnp.float32), h, cfg),
        }
    args = {"layout": layout_args, "broadcast": broadcast_args, "slot_values": slot_args,
            "combine_bwd": combine_bwd_args, "broadcast_in_place": combine_bwd_args,
            "combine_bwd_in_place": combine_bwd_args}
    out = {}
    for op, fn in fns.items():  # (fns decides which ops run: args has every op's)
        mapped = jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec)
        chain = 1 if op.endswith("_in_place") else None   # y's buffer, written in place
        out[op] = (_time_calls(mapped, args[op], iters, repeats, chain), mapped, args[op], chain)
    return out


def gbps(value) -> str:
    """GB/s with 4 significant digits (CPU runs move well under 1 GB/s: 0.01234, not 0.0)."""
    if value is None:
        return ""
    return f"{value:.4g}" if abs(value) < 1000 else f"{value:.0f}"


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The module docstring as written, and every option's default in its help (options whose
    default is None say what it means themselves; flags are off by default)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "(default" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        return text + " (default: %(default)s)"


def print_table(records) -> None:
    """One line per record; ``device us`` is the profiled kernels' sum (``--profile``)."""
    def num(value, fmt):
        return "" if value is None else format(value, fmt)

    print(f"{'op':21}{'backend':23}{'layout':13}{'dtype':14}{'T/rank':>7}{'H':>6}{'K':>3}{'E':>5}{'EP':>4}"
          f"{'SMs':>5}{'us':>11}{'device us':>11}{'logical GB/s':>14}{'wire GB/s':>11}{'% peak':>8}"
          f"{'dev wire GB/s':>15}{'% peak':>8}")
    for r in records:
        backend = r["backend"] + (" (pull)" if r.get("pull") else "")
        print(f"{r['op']:21}{backend:23}{r['layout']:13}{r['dtype']:14}{r['tokens_per_rank']:>7}"
              f"{r['hidden']:>6}{r['topk']:>3}{r['num_experts']:>5}{r['ep_size']:>4}"
              f"{num(r['num_sms'], 'd'):>5}"
              f"{r['us']:>11.1f}{num(r.get('device_us'), '.1f'):>11}{gbps(r['logical_gbps']):>14}"
              f"{gbps(r['wire_gbps']):>11}{num(r['pct_of_peak'], '.0f'):>8}"
              f"{gbps(r.get('wire_gbps_device')):>15}{num(r.get('pct_of_peak_device'), '.0f'):>8}")
    if any(not r["measured"] for r in records):
        print(f"{PUBLISHED_BACKEND}: DeepEP V1's figures as published (2x H200, 24 SMs, rank-major output), "
              "not measured in this run")


BACKENDS = ("reference", "dense", "ragged", "cuda")
LL_BACKENDS = ("reference", "cuda")
MODES = {"--layer": "layer", "--low-latency": "low_latency"}   # each mode has its own options (--help)
LL_DESCRIPTION = f"""Time the low-latency (decode) ops on the available devices: ll_dispatch (each dispatch
dtype on the wire), ll_combine (bf16) and their round trip, fused and in two phases (ll_dispatch_send /
_recv, ll_combine_send / _recv), at issue 14's shape (hidden {LL_SHAPE['hidden']}, top-{LL_SHAPE['topk']}, \
{LL_SHAPE['experts']} experts) and each of
--tokens per rank; with the cuda backend on GPUs also ll_overlap (how much of ll_dispatch the two-phase
form hides behind a shared expert). The records go to out/{DEFAULT_OUT['low_latency']} under the repository \
root
unless --out names another file, beside DeepEP V1's published low-latency figures (measured: false).

    python -m benchmarks --low-latency [--tokens {LL_TOKENS}] [--backends reference,cuda] [--profile]
"""
EXIT_CODES = """
Exit status: 0 when every requested point was measured; 1 when a point failed (the output says why; the
records of the others are written) or nothing was measured (e.g. only backends this machine lacks);
2 on a bad argument. Each mode lists its own options: python -m benchmarks --layer --help,
python -m benchmarks --low-latency --help."""


def _positive_ints(value: str) -> str:
    """Comma-separated positive integers (kept as the text: the modes split it)."""
    try:
        numbers = [int(v) for v in value.split(",")]
    except ValueError:
        numbers = [0]
    if min(numbers) < 1:
        raise argparse.ArgumentTypeError(f"must be comma-separated positive integers, got {value!r}")
    return value


def _names(known):
    """An argparse type: comma-separated names, each one of ``known`` (kept as the text)."""
    def check(value: str) -> str:
        unknown = [name for name in value.split(",") if name not in known]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(map(repr, unknown))} in {value!r}; "
                                             f"choose from {', '.join(known)}")
        return value
    return check


def seconds_arg(value: str) -> float:
    """An argparse type: a finite number of seconds >= 0 (--sustain here and in tools/tune_gemm.py)."""
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {value!r}")
    return seconds


def build_parser(mode: str = "ops") -> argparse.ArgumentParser:
    """The options of one mode: "ops" (dispatch / combine, --rank-major too), "layer" or "low_latency"."""
    description = {"ops": __doc__, "layer": bench_layer.__doc__, "low_latency": LL_DESCRIPTION}[mode]
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=description,
                                     epilog=EXIT_CODES, formatter_class=_HelpFormatter, allow_abbrev=False)
    if mode == "layer":
        parser.add_argument("--layer", action="store_true", required=True,
                            help="time the MoE layer's training step (this mode)")
        parser.add_argument("--layer-shapes", default=None, type=_names(list(bench_layer.LAYER_PRESETS)),
                            help=f"comma-separated layer presets {list(bench_layer.LAYER_PRESETS)} "
                                 "(default: mid,deepseek on GPUs, small on CPU)")
        parser.add_argument("--layer-configs", default=None, type=_names(list(bench_layer.CONFIGS)),
                            help=f"comma-separated layer configurations {list(bench_layer.CONFIGS)} "
                                 "(default: jax_ep, ep_reference, ep_cuda, ep_cuda_async, ep_cuda_async_48, "
                                 "plain_jax: those the platform runs; the others (FP8, hierarchical, "
                                 "overlap, fewer SMs, remat, chunk and micro-batch forms) only when named)")
        parser.add_argument("--sustain", default=0.0, type=seconds_arg,
                            help="seconds of back-to-back calls before each timing, so that it sees the "
                                 "clocks of sustained load (an H200 at its power limit settles 25-33%% below "
                                 "its boost clock within a second, its GEMMs then 15-18%% slower; default 0: "
                                 "a burst after compiling)")
    elif mode == "low_latency":
        parser.add_argument("--low-latency", action="store_true", required=True,
                            help="time the low-latency (decode) ops (this mode)")
        parser.add_argument("--tokens", default=LL_TOKENS, type=_positive_ints,
                            help="comma-separated tokens per rank")
        parser.add_argument("--dtypes", default="bfloat16,float8_e4m3fn", type=_names(list(BYTES)),
                            help="comma-separated ll_dispatch dtypes on the wire (ll_combine: bf16)")
        parser.add_argument("--backends", default=",".join(LL_BACKENDS), type=_names(LL_BACKENDS),
                            help="comma-separated backends; cuda is skipped where it cannot run")
    else:
        parser.add_argument("--preset", default="auto", type=_names(["auto", *PRESETS]),
                            help=f"auto or comma-separated presets of {sorted(PRESETS)} (auto: small on CPU, "
                                 "deepseek,sparse on GPUs)")
        parser.add_argument("--tokens", default=None, type=_positive_ints,
                            help="comma-separated tokens per rank, replacing those of every preset shape "
                                 "(default: the presets')")
        parser.add_argument("--hidden", type=positive_int, default=None,
                            help="hidden size (default: the presets')")
        parser.add_argument("--topk", type=positive_int, default=None,
                            help="experts per token (default: the presets')")
        parser.add_argument("--experts", type=positive_int, default=None,
                            help="number of experts (default: the presets')")
        parser.add_argument("--dtypes", default="bfloat16,float8_e4m3fn", type=_names(list(BYTES)),
                            help="comma-separated dispatch dtypes on the wire (combine: bf16, timed once)")
        parser.add_argument("--backends", default=",".join(BACKENDS), type=_names(BACKENDS),
                            help="comma-separated backends; those this machine lacks are skipped")
        parser.add_argument("--num-sms", default=None, type=_positive_ints,
                            help="comma-separated SM counts for the cuda kernels (default: KernelConfig's)")
        parser.add_argument("--pull", default="auto", choices=(*PULL_SETTINGS, "both"),
                            help="the rows of the cuda dispatch and broadcast as KernelConfig's default "
                                 "takes them (auto: the auto table's choice), pushed by the senders, "
                                 "pulled by the receivers (KernelConfig.dispatch_pull and "
                                 "broadcast_pull), or both in one run (records: pull, what ran, and "
                                 "pull_setting; `python -m benchmarks.auto_table` decides from both)")
        parser.add_argument("--rank-major", action="store_true",
                            help="reference and cuda time the rank-major ops (dispatch_rank_major, "
                                 "combine_rank_major, broadcast_rank_major) instead of the expert-major ones")
        parser.add_argument("--layer", action="store_true",
                            help="time the MoE layer's training step instead of the ops (benchmarks.layer; "
                                 "its options: --layer --help)")
        parser.add_argument("--low-latency", action="store_true",
                            help="time ll_dispatch / ll_combine / their round trip, fused and in two "
                                 f"phases (decode mode) at hidden 7168, top-8, 288 experts, tokens "
                                 f"{LL_TOKENS} (its options: --low-latency --help)")
    parser.add_argument("--iters", type=positive_int, default=10, help="back-to-back calls per timed chain")
    parser.add_argument("--repeats", type=positive_int, default=5,
                        help="timed chains; the median is reported" if mode != "layer" else
                             "timed chains; the best is reported")
    parser.add_argument("--out", default=None,
                        help=f"JSON file of the records (default: {OUT_DIR}/{DEFAULT_OUT[mode]}; out/ is "
                             "git-ignored)")
    parser.add_argument("--profile", action="store_true",
                        help="also record each kernel's device time per call (GPU, jax.profiler)"
                        if mode != "layer" else "also split the step's device time by the layer's scopes "
                        "(GPU, jax.profiler: split_ms)")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    """The options of the mode ``argv`` names (--layer, --low-latency, else the ops), each mode with its
    own parser: its --help lists its options, and an option of another mode is an error (exit 2)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    modes = [MODES[a] for a in dict.fromkeys(argv) if a in MODES]
    if len(modes) > 1:
        build_parser().error("--layer and --low-latency are separate modes: give one")
    mode = modes[0] if modes else "ops"
    parser = build_parser(mode)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        flag = {"ops": "", "layer": " --layer", "low_latency": " --low-latency"}[mode]
        parser.error(f"unrecognized arguments: {' '.join(unknown)} (python -m benchmarks{flag} --help "
                     "lists this mode's options)")
    for name, default in (("layer", False), ("low_latency", False), ("rank_major", False),
                          ("preset", "auto"), ("hidden", None), ("topk", None), ("experts", None),
                          ("num_sms", None), ("pull", "auto"), ("layer_shapes", None),
                          ("layer_configs", None),
                          ("sustain", 0.0)):
        if not hasattr(args, name):
            setattr(args, name, default)
    args.mode = mode
    if args.out is None:
        args.out = str(OUT_DIR / DEFAULT_OUT[mode])
    return args


def check_outcome(measured: int, failed: list[str], out: str) -> None:
    """Exits with status 1 (SystemExit) when a requested point failed or nothing was measured, saying so
    on stderr; the records are written before."""
    if failed:
        message = (f"{len(failed)} requested point(s) failed ({'; '.join(failed)[:500]}); the {measured} "
                   f"measured record(s) are in {out}")
    elif measured == 0:
        message = "nothing was measured (no requested backend runs here); see the lines above"
    else:
        return
    print(f"python -m benchmarks: {message}", file=sys.stderr, flush=True)
    raise SystemExit(1)


def main(argv=None) -> list[dict]:
    """Runs the mode ``argv`` names and returns its records; exits 2 on a bad argument and 1 (after
    writing the records) when a requested point failed or nothing was measured."""
    args = parse_args(argv)
    use_virtual_cpu_devices()
    if args.layer:
        records = bench_layer.main(args, save=lambda recs: write_records(recs, args.out, quiet=True))
        write_records(records, args.out)
        # plain JAX out of memory (DeepSeek-V3 on 2 GPUs: XLA's ragged_dot asks for 112 GiB) is a result
        failed = [f"{r['shape']} {r['config']}: {r.get('error', 'failed')[:120]}" for r in records
                  if r.get("step_ms") is None and not r.get("peer_out_of_memory")]
        # a profile asked for and failed (its step time stands)
        failed += [f"{r['shape']} {r['config']} profile: {r['split_error'][:120]}" for r in records
                   if r.get("split_error")]
        check_outcome(sum(r.get("step_ms") is not None for r in records), failed, args.out)
        return records

    devices = jax.devices()
    platform = devices[0].platform
    mesh = Mesh(np.array(devices), ("ep",))
    try:
        shapes = resolve_shapes(args.preset, platform, args.tokens, args.hidden, args.topk, args.experts,
                                None if args.low_latency else len(devices))   # low-latency: its own shape
    except ValueError as e:
        build_parser(args.mode).error(str(e))
    preset = args.preset if args.preset != "auto" else ("small" if platform == "cpu" else "deepseek,sparse")
    if args.low_latency:
        preset = "low-latency"
    peak = measure_copy_peak(devices)
    device_name = f"{len(devices)}x {devices[0].device_kind}"
    today = datetime.date.today().isoformat()
    print(f"jax_ep bench: {device_name}, preset {preset}, peer-copy peak "
          f"{'n/a' if peak is None else f'{peak:.0f} GB/s'}")
    rng = np.random.default_rng(0)
    records = []
    failed = []   # the requested points that raised: the run exits 1 (check_outcome)
    dtypes = args.dtypes.split(",")
    # combine / ll_combine (bf16 whatever the dispatch's wire) are timed in one pass: a second record of
    # one in a run's file is refused by benchmarks.auto_table
    combine_dtype = "bfloat16" if "bfloat16" in dtypes else dtypes[0]
    if args.low_latency:
        for backend in _backends(args.backends.split(","), platform):
            for dtype in dtypes:
                for tokens in [int(t) for t in args.tokens.split(",")]:
                    try:
                        recs = bench_low_latency(mesh, backend, dtype, tokens, LL_SHAPE["hidden"],
                                                 LL_SHAPE["topk"], LL_SHAPE["experts"], args.iters,
                                                 args.repeats, rng, args.profile,
                                                 combine=dtype == combine_dtype)
                    except Exception as e:  # one failing backend must not hide the others' numbers
                        print(f"FAILED {backend} {dtype} T={tokens}: {type(e).__name__}: {str(e)[:300]}")
                        failed.append(f"{backend} {dtype} T={tokens}: {type(e).__name__}")
                        continue
                    for r in recs:
                        r.update(device=device_name, date=today)
                    records.extend(recs)
                    write_records(records, args.out, quiet=True)
        for op, us in DEEPEP_V1_LL.items():
            records.append(dict(op=op, backend=PUBLISHED_BACKEND, layout="fixed_slots",
                                dtype="float8_e4m3fn" if op != "ll_combine" else "bfloat16",
                                tokens_per_rank=128, ep_size=2, us=us, device_us=us, measured=False,
                                **LL_SHAPE))
        for r in records:
            # the device time blank where not profiled, as print_table leaves it (not "device 0.0 us")
            device = "" if r.get("device_us") is None else f"device {r['device_us']:9.1f} us"
            line = (f"{r['op']:14s} {r['backend']:24s} {r['dtype']:14s} T={r['tokens_per_rank']:4d} "
                    f"{r['us']:9.1f} us  {device:19s}"
                    + (f"  per layer: serial {r['us_serial']:.1f}, shared expert {r['us_shared']:.1f}, "
                       f"dispatch in the step {r['dispatch_in_step_us']:.1f}: {r['hidden_us']:.1f} us hidden"
                       if r["op"] == "ll_overlap" else ""))
            print(line.rstrip())
        write_records(records, args.out)
        check_outcome(sum(r["measured"] for r in records), failed, args.out)
        return records
    for backend in _backends(args.backends.split(","), platform):
        for dtype in dtypes:
            if backend == "ragged" and dtype != "bfloat16":
                continue
            kernels = [None]
            if backend == "cuda":
                pulls = [False, True] if args.pull == "both" else [PULL_SETTINGS[args.pull]]
                sms = [int(n) for n in args.num_sms.split(",")] if args.num_sms else [None]
                if sms != [None] or pulls != [None]:
                    kernels = [KernelConfig(num_sms=n, dispatch_pull=pull, broadcast_pull=pull)
                               for n in sms for pull in pulls]
            for (tokens, hidden, topk, experts), kernel in itertools.product(shapes, kernels):
                try:
                    recs = bench_shape(mesh, backend, dtype, tokens, hidden, topk, experts,
                                       args.iters, args.repeats, rng, args.profile, kernel,
                                       with_combine=dtype == combine_dtype,
                                       rank_major=args.rank_major)
                except Exception as e:  # one failing backend must not hide the others' numbers
                    print(f"FAILED {backend} {dtype} T={tokens}: {type(e).__name__}: {str(e)[:300]}")
                    failed.append(f"{backend} {dtype} T={tokens}: {type(e).__name__}")
                    continue
                for r in recs:
                    r.update(device=device_name, date=today, peer_copy_gbps=peak,
                             pct_of_peak=None if peak is None or r["wire_gbps"] is None
                             else 100 * r["wire_gbps"] / peak,
                             pct_of_peak_device=None if peak is None or not r.get("wire_gbps_device")
                             else 100 * r["wire_gbps_device"] / peak)
                records.extend(recs)
                write_records(records, args.out, quiet=True)
    records.extend(published_records(shapes, dtypes))
    print_table(records)
    for r in records:
        if r.get("kernels_us"):
            print(f"kernels per call, GPU 0: {r['op']} {r['backend']} {r['dtype']} "
                  f"T={r['tokens_per_rank']} E={r['num_experts']}")
            for name, us in list(r["kernels_us"].items())[:8]:
                print(f"  {us:>10.1f} us  {name[:90]}")
    write_records(records, args.out)
    check_outcome(sum(r["measured"] for r in records), failed, args.out)
    return records


def write_records(records, path, quiet: bool = False) -> None:
    """Writes the records (again after every measured point, so a run stopped by a time limit keeps
    what it measured)."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(records, f, indent=1)
    if not quiet:
        print(f"wrote {len(records)} records to {path}")


if __name__ == "__main__":
    main()
