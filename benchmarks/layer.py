"""MoE layer benchmark: one jitted training step (forward + backward: gradients of the parameters and
of the input, as inside a model) of ``jax_ep.moe.MoE`` alone on all local devices, next to its
roofline and to what a JAX user has today.

    python -m benchmarks --layer [--layer-shapes deepseek,mid] [--out bench_layer.json]

For each layer shape, two configurations, measured in the same run:
  * ``jax_ep``: the defaults (``EPOptions(backend="auto")``, ``gemm="auto"``): Hopper grouped GEMM
    kernels, and the EP kernels wherever they measured faster than the reference;
  * ``plain_jax``: ``EPOptions(backend="reference")`` (dense ``lax.all_to_all``) + ``gemm="ragged_dot"``
    (``lax.ragged_dot``), what the layer did before jax_ep had a grouped GEMM; ``plain_jax_cudnn`` (only
    when named) the same step compiled with XLA's cuDNN ragged-dot fusion on
    (``compiler_options={"xla_gpu_experimental_use_ragged_dot_fusion": True}``, cuDNN >= 9.22; the record's
    ``cudnn_fusions`` counts the GEMMs XLA gave cuDNN, 0 = its dense expansion); the table's speed-up is
    over the faster of the two.
With ``--layer-configs ep_hier_reference,ep_hier_cuda`` (only when named), the same layer with the
hierarchical dispatch / combine (``MoE(node_axis=...)``), the local devices taken as 2 nodes of
(devices / 2) GPUs: on one host the "node" hop runs over NVLink like the others, so this times the
composition's extra stage, not a network, and the gate weights in combine, as the hierarchical layer
applies them, where ``jax_ep`` applies them in the experts (``jax_ep_gate_in_combine``: like for like).
``--layer-configs jax_ep_fp8`` (only when named): the defaults
with both expert GEMMs in FP8 (``MoE(gemm_dtype="float8_e4m3fn")``), ``jax_ep_fp8_cached`` the same
with the weights quantised once outside the step (``MoE.quantize_weights``, what gradient accumulation
reuses over its micro-batches; ``quantise_ms`` is that quantisation, timed apart), ``jax_ep_fp8_cached_dw8``
that with the weight gradients in FP8 too (``MoE(fp8_weight_grad=True)``); with FP8 GEMMs the layer's
throughput path sends FP8 on the wire by default (trained through, its rows straight into the FP8 gate|up
GEMM), and ``jax_ep_fp8_bf16_wire`` is the cached form with a bfloat16 wire instead
(``EPOptions(dispatch_dtype="bfloat16")``, the default before 2026-11-30); ``jax_ep_chunks2`` and
``ep_cuda_async_chunks2`` (only when named): the tokens in 2 chunks (``EPOptions(chunks=2)``), the latter
with the EP kernels on an async stream, so one chunk's exchange can overlap the other's expert GEMMs;
``jax_ep_dy_zeroed`` (only when named): the defaults with ``EPOptions(dy_in_place=False)`` (combine's
backward writes every row of the receive buffer), beside ``jax_ep``; ``jax_ep_gate_in_combine`` and
``jax_ep_fp8_cached_gate_in_combine`` (only when named): ``EPOptions(gate_weights="combine")`` (combine
weights each token's rows and its backward reads them again for the weights' gradient: the default
before 2026-12-04; the default "auto" scales SwiGLU's rows on the flat exchange) with the bf16 and the
cached FP8 GEMMs; ``jax_ep_mb2`` (only when named): two micro-batches in one jitted step, their losses
summed (gradient accumulation's program), in series, and ``ep_cuda_async_mb2_free12`` /
``ep_cuda_async_mb2_free24`` the same with the EP kernels on XLA stream 1 on 12 / 24 SMs and the expert
GEMMs on the rest (``MoE(gemm_num_sms=...)``), so that one micro-batch's exchanges can run beside the
other's GEMMs, and ``ep_cuda_async_mb2_chunked_free24`` the two micro-batches in one call as its two token
chunks (``EPOptions(chunks=2)``: micro-batch 1's dispatch issued before micro-batch 0's GEMMs); their
``step_ms`` is the step's time per micro-batch (``micro_batches`` in the record). The same three with
``_nocb`` time the step compiled without XLA's command buffers (``command_buffers`` in the record):
inside a command buffer an async region runs in series with the rest (openxla/xla#48900), so only there
can the async forms hide anything. ``jax_ep_remat``, ``jax_ep_remat_dispatch`` and ``jax_ep_remat_gate_up``
(only when named): the layer under ``jax.checkpoint`` (as in a rematerialised block) without a policy
(its backward reruns dispatch's exchange), with ``jax_ep.remat.policy()`` (dispatch's results kept), and
with the gate|up GEMM's output kept too and ``dy_in_place=False`` (no grouped GEMM in the rerun);
``checkpoint`` in the config, ``checkpoint_policy``.
The roofline is the step's expert-GEMM FLOPs (3 GEMMs, forward + 2 backward, real rows only) run as plain
dense bf16 dots of the same shapes on one device, timed in the same run; the FP8 configs are compared with
it too (a bf16 roofline: with FP8 forward and input-gradient GEMMs the step's own roofline is lower, about
2/3 of it, so their ``roofline_ratio`` reads low). ``weight_floor_ms`` is the memory side
of it: the bytes of weights a step must move per rank (W: the local experts' bf16 weights,
``expert_weight_bytes``, and the shared expert's: read by the forward and by the input gradient, their
gradient written once; 2W for cached FP8 weights; ``weight_floor_bytes``) over the read bandwidth measured
at the start of the run (``read_gbps``: a lower bound, as writes are no faster). With few rows per expert
(DeepSeek-V3 at EP1: 128) it exceeds the dense dots' time, and the step cannot reach the roofline.
The read is timed after at least ``READ_SUSTAIN_S`` of back-to-back reads on a GPU whatever ``--sustain``
says (``read_sustain_s``): a burst read 3.29 TB/s where sustained reads gave 4.05-4.17 on one H200
(2026-12-05), which would put a floor 23% above what the hardware does. ``roofline_flops`` adds the
shared expert's dots to ``gemm_flops`` (the roofline times both), ``roofline_tflops`` is their rate in
the roofline's dots, and ``spec_ratio`` the step against the same FLOPs at the device's published dense
bf16 peak (``SPEC_BF16_TFLOPS``, where known): the dots' measured rate moves with the clocks (613-761
TF/s on one H200 across runs), the spec does not. Each expert's rows are padded to the GEMM's alignment
in the step, not in the roofline (real rows only).
``gemm_ms`` is the layer's expert block (both grouped GEMMs and SwiGLU, forward and backward) timed alone
on one device at the per-rank shapes; ``gemm_tflops`` the expert-GEMM FLOPs over it. ``split_ms`` sums
the device time of the GPU events of device 0 (all streams, so overlapping streams add up) by the layer's
named scopes (moe.SCOPES), each with its
backward (dispatch's backward is a combine kernel, combine's a broadcast); events the profile does not tie
to an HLO instruction with a scope count as "rest"; a fusion of several scopes' instructions counts in the
one whose instructions output the most elements (hlo_scopes). The split runs the step without XLA's command
buffers (split_by_scope says why). ``device_step_ms`` is that profiled step's span on device 0 and
``ep_hidden_ms`` how much of the EP ops' device time ran beside other work (the device time summed over
streams minus the span, at most the EP time; 0 when the exchanges run in series with the GEMMs): how much
the overlap hides when the step runs without command buffers, as the ``_nocb`` configs time it (the others'
``step_ms`` runs with them). ``--sustain S`` runs S seconds of back-to-back steps before each timing (and
before the roofline's): the clocks a training job runs at, where a timing right after compiling catches a
GPU below its power limit (an H200 settles 15-18% slower within about a second at its 700 W cap;
``best_of``); records carry ``sustain_s``. On GPUs, records carry ``clocks``: the SM clock and power of
each GPU (medians over NVML samples every 20 ms, ``benchmarks.clocks``) during the timed calls of the step
(``step``), the expert block alone (``gemm``; ``experts`` for decode), the roofline's dense dots
(``roofline``) and, with ``--profile``, the profiled steps of the split (``split``: with ``--sustain`` they
follow that long of steps inside the trace, else they run after the profiler's pause, nearer the burst
clock than a sustained ``step``); None where NVML is not there.
"""

from __future__ import annotations

import collections
import datetime
import functools
import glob
import itertools
import math
import operator
import re
import tempfile
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks import clocks
from jax_ep import moe, remat
from jax_ep.config import EPConfig, KernelConfig
from jax_ep.gating import RouterConfig

LAYER_PRESETS = {
    # name: (hidden, ffn_hidden, experts, top-k, tokens per rank)
    "deepseek": (7168, 2048, 256, 8, 4096),
    "mid": (4096, 1408, 64, 6, 4096),
    "small": (256, 128, 16, 2, 128),
    # one rank's expert work of "deepseek" at EP2 / EP4 (its local experts, so the same weights, FLOPs and
    # rows per expert), run on however many GPUs are here: what one GPU can say of those steps
    "deepseek_e128": (7168, 2048, 128, 8, 4096),
    "deepseek_e64": (7168, 2048, 64, 8, 4096),
    # decode (the layer's low-latency path, forward only): issue 14's shape, 128 tokens per rank
    "deepseek_decode": (7168, 2048, 288, 8, 128),
    "small_decode": (256, 128, 16, 2, 16),
}
# <preset>_shared: the preset with the dense shared expert DeepSeek-V3 has (MoE(shared_ffn_hidden=...)),
# the work an exchange on another stream (KernelConfig.async_stream) can run beside; its FFN width here
# (0 or absent: none); the roofline counts its GEMMs too
SHARED_FFN = {"deepseek_shared": 2048, "small_shared": 128, "deepseek_decode_shared": 2048,
              "small_decode_shared": 128}
LAYER_PRESETS.update({name: LAYER_PRESETS[name.removesuffix("_shared")] for name in SHARED_FFN})
DECODE_SHAPES = tuple(name for name in LAYER_PRESETS if "_decode" in name)
CONFIGS = {"jax_ep": dict(backend="auto", gemm="auto"),
           # the same layer with the EP ops on one path each: what the EP kernels add to the step
           "ep_reference": dict(backend="reference", gemm="auto"),
           "ep_cuda": dict(backend="cuda", gemm="auto"),
           # the kernels as async ops on XLA stream 1, overlapping independent work (KernelConfig)
           "ep_cuda_async": dict(backend="cuda", gemm="auto", kernel=dict(async_stream=1)),
           "ep_cuda_async_48": dict(backend="cuda", gemm="auto", kernel=dict(async_stream=1, num_sms=48)),
           # (XLA's SwiGLU: jax_ep's Triton kernels are not what a plain-JAX user has; before 2026-12-05 the
           # plain-JAX configs took them on Hopper)
           "plain_jax": dict(backend="reference", gemm="ragged_dot", swiglu_backend="xla"),
           # the same with the step compiled as a plain-JAX user can switch XLA's cuDNN ragged-dot fusion on
           # (cuDNN >= 9.22 on the GPU; the record counts the fusions XLA made: 0 = its dense expansion)
           "plain_jax_cudnn": dict(backend="reference", gemm="ragged_dot", swiglu_backend="xla",
                                   compiler_options={"xla_gpu_experimental_use_ragged_dot_fusion": True}),
           # hierarchical dispatch / combine (MoE(node_axis=...)): the local GPUs taken as `nodes` nodes
           # of (GPUs / nodes) each; the node hop runs over the same NVLink (peer access), not a network
           "ep_hier_reference": dict(backend="reference", gemm="auto", nodes=2),
           "ep_hier_cuda": dict(backend="cuda", gemm="auto", nodes=2),
           # the defaults with both expert GEMMs in FP8 (MoE(gemm_dtype="float8_e4m3fn"); opt-in)
           "jax_ep_fp8": dict(backend="auto", gemm="auto", gemm_dtype="float8_e4m3fn"),
           # ... with the weights quantised once per optimiser step, outside the timed micro-batch step
           "jax_ep_fp8_cached": dict(backend="auto", gemm="auto", gemm_dtype="float8_e4m3fn",
                                     fp8_cached=True),
           # ... and the weight gradients in FP8 too (MoE(fp8_weight_grad=True))
           "jax_ep_fp8_cached_dw8": dict(backend="auto", gemm="auto", gemm_dtype="float8_e4m3fn",
                                         fp8_cached=True, fp8_weight_grad=True),
           # ... (cached weights) with a bfloat16 wire instead of the FP8 one the FP8 GEMMs take by default
           # (EPOptions(dispatch_dtype="bfloat16"): the GEMM quantises the received rows itself)
           "jax_ep_fp8_bf16_wire": dict(backend="auto", gemm="auto", gemm_dtype="float8_e4m3fn",
                                        fp8_cached=True, dispatch_dtype="bfloat16"),
           # the tokens in 2 chunks (EPOptions.chunks): chunk 1's exchange can overlap chunk 0's GEMMs
           "jax_ep_chunks2": dict(backend="auto", gemm="auto", chunks=2),
           "ep_cuda_async_chunks2": dict(backend="cuda", gemm="auto", kernel=dict(async_stream=1), chunks=2),
           # the defaults with combine's backward writing every row of C (EPOptions.dy_in_place off, as
           # before 2026-11-29): the same-run comparison of the aliased d y
           "jax_ep_dy_zeroed": dict(backend="auto", gemm="auto", dy_in_place=False),
           # the defaults with XLA's SwiGLU over every row (MoE(swiglu_backend="xla")) instead of the
           # Triton kernels over the live rows that "auto" takes on Hopper: the same-run comparison
           "jax_ep_xla_swiglu": dict(backend="auto", gemm="auto", swiglu_backend="xla"),
           # the gate weights applied in combine (EPOptions(gate_weights="combine"): combine weights the
           # rows, its backward reads them again) against the default's SwiGLU-scaled rows, bf16 and
           # cached FP8 GEMMs
           "jax_ep_gate_in_combine": dict(backend="auto", gemm="auto", gate_weights="combine"),
           "jax_ep_fp8_cached_gate_in_combine": dict(backend="auto", gemm="auto", gemm_dtype="float8_e4m3fn",
                                                     fp8_cached=True, gate_weights="combine"),
           # two micro-batches in one jitted step (gradient accumulation's loss sum): in series (the
           # defaults), or each exchange on XLA stream 1 with `free` SMs (KernelConfig.num_sms) and the
           # expert GEMMs on the others (MoE(gemm_num_sms=SMs - free)), so that one micro-batch's
           # exchanges can run beside the other's GEMMs (DeepSeek-V3's dual micro-batch overlap)
           "jax_ep_mb2": dict(backend="auto", gemm="auto", micro_batches=2),
           "ep_cuda_async_mb2_free12": dict(backend="cuda", gemm="auto", micro_batches=2, gemm_free_sms=12,
                                            kernel=dict(async_stream=1, num_sms=12)),
           "ep_cuda_async_mb2_free24": dict(backend="cuda", gemm="auto", micro_batches=2, gemm_free_sms=24,
                                            kernel=dict(async_stream=1, num_sms=24)),
           # ... the two micro-batches in one call of the layer as its 2 token chunks (EPOptions.chunks):
           # chunk 1's dispatch issued before chunk 0's GEMMs (program order, which process model 2
           # keeps for every EP call; XLA's scheduler need not find the overlap itself)
           "ep_cuda_async_mb2_chunked_free24": dict(backend="cuda", gemm="auto", micro_batches=2, chunks=2,
                                                    gemm_free_sms=24,
                                                    kernel=dict(async_stream=1, num_sms=24)),
           # the shared expert beside the last combine on jax_ep's side stream (EPOptions.shared_beside;
           # presets with a shared expert): with the exchanges on every SM, and on 24 SMs (the GEMMs on
           # XLA's stream take the others as CTAs free up) next to the same 24 SMs in series
           "jax_ep_shared_beside": dict(backend="auto", gemm="auto", shared_beside=True),
           "ep_cuda_shared_beside": dict(backend="cuda", gemm="auto", shared_beside=True),
           "ep_cuda_sms24": dict(backend="cuda", gemm="auto", kernel=dict(num_sms=24)),
           "ep_cuda_shared_beside_sms24": dict(backend="cuda", gemm="auto", shared_beside=True,
                                               kernel=dict(num_sms=24)),
           # dispatch's backward beside the gate|up GEMM's weight gradient on jax_ep's side stream
           # (EPOptions.weight_grad_beside): the side call on every SM, and on 24 or 12
           # (KernelConfig.side_num_sms: the weight gradient leaves them, the exchanges in series keep
           # every SM); with the shared expert beside combine too
           "ep_cuda_wgrad_beside": dict(backend="cuda", gemm="auto", weight_grad_beside=True),
           "ep_cuda_wgrad_beside_side24": dict(backend="cuda", gemm="auto", weight_grad_beside=True,
                                               kernel=dict(side_num_sms=24)),
           "ep_cuda_wgrad_beside_side12": dict(backend="cuda", gemm="auto", weight_grad_beside=True,
                                               kernel=dict(side_num_sms=12)),
           "ep_cuda_both_beside_side24": dict(backend="cuda", gemm="auto", weight_grad_beside=True,
                                              shared_beside=True, kernel=dict(side_num_sms=24)),
           "jax_ep_wgrad_beside_side24": dict(backend="auto", gemm="auto", weight_grad_beside=True,
                                              kernel=dict(side_num_sms=24)),
           # the shared expert split as DeepSeek-V3 overlaps it (EPOptions.shared_split): its gate|up half
           # beside the first dispatch, its down GEMM beside the last combine, each exchange's backward
           # beside theirs; the side calls on 24 SMs, the exchanges in series on every SM; and, like for
           # like, the whole shared expert beside the last combine with the same SMs
           "ep_cuda_shared_split_side24": dict(backend="cuda", gemm="auto", shared_beside=True,
                                               shared_split=True, kernel=dict(side_num_sms=24)),
           "ep_cuda_shared_beside_side24": dict(backend="cuda", gemm="auto", shared_beside=True,
                                                kernel=dict(side_num_sms=24)),
           # the layer rematerialised (jax.checkpoint, as inside a rematerialised block; checkpoint_policy):
           # nothing kept (the backward reruns dispatch's exchange), dispatch's results kept
           # (jax_ep.remat.policy()), and the gate|up GEMM's output too with combine's backward not in
           # place (no GEMM in the rerun)
           "jax_ep_remat": dict(backend="auto", gemm="auto", checkpoint="no_policy"),
           "jax_ep_remat_dispatch": dict(backend="auto", gemm="auto", checkpoint="dispatch"),
           "jax_ep_remat_gate_up": dict(backend="auto", gemm="auto", checkpoint="gate_up",
                                        dy_in_place=False)}
# ... and the step compiled without XLA's command buffers (an async region inside one runs in series,
# openxla/xla#48900): the forms that can overlap there, and the serial baseline timed the same way
for _name in ("jax_ep_mb2", "ep_cuda_async_mb2_free24", "ep_cuda_async_mb2_chunked_free24"):
    CONFIGS[_name + "_nocb"] = dict(CONFIGS[_name], command_buffers=False)
# configurations timed only when named in --layer-configs
# the plain-JAX peers: the layer table's speed-up is over the fastest of those that ran
PLAIN_JAX = ("plain_jax", "plain_jax_cudnn")
NAMED_ONLY = ("plain_jax_cudnn", "ep_hier_reference", "ep_hier_cuda", "jax_ep_fp8", "jax_ep_fp8_cached",
              "jax_ep_fp8_cached_dw8", "jax_ep_fp8_bf16_wire", "jax_ep_chunks2",
              "ep_cuda_async_chunks2", "jax_ep_dy_zeroed", "jax_ep_xla_swiglu", "jax_ep_gate_in_combine",
              "jax_ep_fp8_cached_gate_in_combine", "jax_ep_mb2", "ep_cuda_async_mb2_free12",
              "ep_cuda_async_mb2_free24", "ep_cuda_async_mb2_chunked_free24", "jax_ep_mb2_nocb",
              "ep_cuda_async_mb2_free24_nocb", "ep_cuda_async_mb2_chunked_free24_nocb",
              "jax_ep_shared_beside", "ep_cuda_shared_beside", "ep_cuda_sms24", "ep_cuda_shared_beside_sms24",
              "ep_cuda_wgrad_beside", "ep_cuda_wgrad_beside_side24", "ep_cuda_wgrad_beside_side12",
              "ep_cuda_both_beside_side24", "ep_cuda_shared_split_side24", "ep_cuda_shared_beside_side24",
              "jax_ep_wgrad_beside_side24", "jax_ep_remat", "jax_ep_remat_dispatch", "jax_ep_remat_gate_up")


def best_of(fn, *args, iters: int, repeats: int, chain: bool = False,
            sustain_s: float | tuple[float, ...] = 0.0) -> float | tuple[float, ...]:
    """Best (over repeats) mean seconds per call of a chain of `iters` calls. ``chain``: each call takes
    the previous call's output as its first argument (a buffer ``fn`` donates and writes in place).
    ``sustain_s``: first run chains for this long, so that the timed ones see the clocks of sustained
    load rather than those of a short burst after an idle gap (an H200 at its 700 W limit settles at
    1335-1500 MHz within about a second, where a burst after compiling runs at up to 1980: the grouped
    GEMMs measured 15-18% slower sustained, session 35). A tuple of settings times the one compiled fn
    at each in turn and returns one best per setting, e.g. (0, 2): right after compiling, then
    sustained. The timed chains' window goes to ``benchmarks.clocks`` (the clock they ran at)."""
    if isinstance(sustain_s, tuple):
        return tuple(best_of(fn, *args, iters=iters, repeats=repeats, chain=chain, sustain_s=s)
                     for s in sustain_s)
    out = jax.block_until_ready(fn(*args))
    if chain:   # the chained call's first argument (fn's committed output) may have another signature than
        # the one given (e.g. a host array): compile it here, not in the first timed chain
        args = (out, *args[1:])
        out = jax.block_until_ready(fn(*args))

    def chain_of(n):
        nonlocal args, out
        for _ in range(n):
            if chain:
                args = (out, *args[1:])
            out = fn(*args)
        jax.block_until_ready(out)

    end = time.perf_counter() + sustain_s
    while time.perf_counter() < end:
        chain_of(iters)
    best = float("inf")
    timed = time.perf_counter()
    for _ in range(repeats):
        start = time.perf_counter()
        chain_of(iters)
        best = min(best, (time.perf_counter() - start) / iters)
    clocks.mark(timed, time.perf_counter())
    return best


def expert_group_sizes(rows: int, groups: int, rng, *, uniform: bool = False, align: int = 1
                       ) -> np.ndarray:
    """Group sizes of a dispatch buffer: `rows` real rows over `groups` experts (equal, or mildly uneven
    as after balancing), each padded to `align` as dispatch pads them."""
    if uniform:
        sizes = np.full(groups, rows // groups)
    else:
        sizes = rng.multinomial(rows, rng.dirichlet(np.full(groups, 8.0)))
    return (-(-sizes // align) * align).astype(np.int32)


def roofline_seconds(rows: int, hidden: int, ffn: int, dtype, iters: int, repeats: int,
                     sustain_s: float | tuple[float, ...] = 0.0) -> float | tuple[float, ...]:
    """The expert GEMMs of one step as dense dots (gate|up, down; forward and backward) on one device
    (``sustain_s``: best_of's; a tuple gives one time per setting)."""
    rng = np.random.default_rng(0)
    put = lambda shape, scale: jax.device_put(  # noqa: E731
        jnp.asarray(rng.standard_normal(shape) * scale, dtype), jax.devices()[0])
    x, w1, w2, g = put((rows, hidden), 1.0), put((hidden, 2 * ffn), hidden ** -0.5), \
        put((ffn, hidden), ffn ** -0.5), put((rows, hidden), 1.0)

    @jax.jit
    def dense_step(x, w1, w2, g):
        def f(x, w1, w2):
            h = jnp.dot(x, w1)
            return jnp.dot(h[:, :ffn] * h[:, ffn:], w2)   # the FLOPs of SwiGLU's GEMMs, no activation
        out, vjp = jax.vjp(f, x, w1, w2)
        return out, vjp(g)

    return best_of(dense_step, x, w1, w2, g, iters=iters, repeats=repeats, sustain_s=sustain_s)


READ_SUSTAIN_S = 1.0   # the read bandwidth's sustained warm-up on a GPU (the weight floor's divisor)
# dense bf16 tensor-core peaks as published (TF/s, no sparsity), by the start of jax's device_kind
SPEC_BF16_TFLOPS = {"NVIDIA H200": 989.4, "NVIDIA H100 80GB HBM3": 989.4}


def spec_tflops(device_kind: str) -> float | None:
    """The published dense bf16 peak of a device kind (SPEC_BF16_TFLOPS), None where unknown."""
    return next((v for k, v in SPEC_BF16_TFLOPS.items() if device_kind.startswith(k)), None)


def read_bytes_per_second(nbytes: int, iters: int, repeats: int, sustain_s: float = 0.0) -> float:
    """The bytes per second one device reads from its memory in an XLA sum over an ``nbytes`` bf16 buffer,
    timed as the step is: the memory roof the weight floor divides by. A read-only stream: an elementwise
    copy (reads and writes interleaved) measured 3.2-3.3 TB/s on an H200 (2026-12-04) where this sum read
    4.16-4.19, and a floor must not be above what the hardware can do."""
    a = jax.device_put(jnp.ones(nbytes // 2, jnp.bfloat16), jax.devices()[0])
    seconds = best_of(jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32)), a, iters=iters, repeats=repeats,
                      sustain_s=sustain_s)
    return nbytes / seconds


def weight_floor_bytes(config: str, weight_bytes: int) -> int | None:
    """The bytes of weights one micro-batch of ``config``'s step must move at least, for ``weight_bytes``
    of bf16 weights per rank (the local experts' and the shared expert's): read by the forward and by the
    input gradient (2W; W when they are FP8 quantised beforehand, ``fp8_cached``), their gradient written
    once per step (W, bf16; shared by the step's micro-batches). None for FP8 weights quantised inside the
    step (the quantisation's own traffic depends on its kernels)."""
    options = CONFIGS[config]
    fp8 = options.get("gemm_dtype") is not None
    if fp8 and not options.get("fp8_cached"):
        return None
    return (weight_bytes if fp8 else 2 * weight_bytes) + weight_bytes // options.get("micro_batches", 1)


def block_options(options: dict) -> dict:
    """The expert block's options of a config (CONFIGS) besides its GEMM backend and dtype: what its layer
    passes to moe.expert_block (its SwiGLU, FP8 weight gradient, the GEMMs' SMs)."""
    block = {k: options[k] for k in ("fp8_weight_grad", "swiglu_backend") if k in options}
    if "gemm_free_sms" in options:
        from jax_ep.gemm_mgpu import _num_sms

        # the grid the grouped GEMMs take by default is every SM (132 off a GPU): leave that many free
        block["gemm_num_sms"] = _num_sms() - options["gemm_free_sms"]
    return block


def expert_gemm_seconds(rows: int, hidden: int, ffn: int, local_experts: int, capacity: int, gemm: str,
                        iters: int, repeats: int, gemm_dtype: str | None = None, fp8_cached: bool = False,
                        sustain_s: float | tuple[float, ...] = 0.0,
                        compiler_options: dict | None = None,
                        block: dict | None = None) -> float | tuple[float, ...] | None:
    """The layer's expert block alone (gate|up GEMM, SwiGLU, down GEMM; forward and backward) on one
    device, on a dispatch-like buffer: `capacity` rows of which `rows` are spread over the local experts
    (mildly uneven), each expert padded to the alignment the layer asks of dispatch. `gemm_dtype` is the
    MoE layer's (None: bf16 GEMMs; "float8_e4m3fn": jax_ep.gemm_fp8.fp8_grouped_matmul as the layer uses
    it; ``fp8_cached``: with the weights quantised beforehand, MoE.quantize_weights' way). None if it fails
    (e.g. lax.ragged_dot out of memory). ``sustain_s``: best_of's (a tuple gives one time per setting).
    ``compiler_options``: XLA's, as the config's step is compiled with (e.g. the cuDNN ragged-dot fusion).
    ``block``: more of moe.expert_block's options, the config's (``block_options``)."""
    from jax_ep.gemm import preferred_alignment

    rng = np.random.default_rng(0)
    dev = jax.devices()[0]
    keys = jax.random.split(jax.random.key(0), 4)
    with jax.default_device(dev):  # made on the device: NumPy takes minutes for DeepSeek-V3's 11 GB
        w1 = jax.random.normal(keys[0], (local_experts, hidden, 2 * ffn), jnp.bfloat16) * hidden ** -0.5
        w2 = jax.random.normal(keys[1], (local_experts, ffn, hidden), jnp.bfloat16) * ffn ** -0.5
    align = preferred_alignment(jax.ShapeDtypeStruct((capacity, hidden), jnp.bfloat16), w1, backend=gemm)
    sizes = expert_group_sizes(rows, local_experts, rng, align=align)
    capacity = max(capacity, int(sizes.sum()))
    with jax.default_device(dev):
        x = jax.random.normal(keys[2], (capacity, hidden), jnp.bfloat16)
        g = jax.random.normal(keys[3], (capacity, hidden), jnp.bfloat16)
    group_sizes = jax.device_put(jnp.asarray(sizes), dev)

    @jax.jit
    def experts(x, w1, w2, g, fp8=None):
        def f(x, w1, w2):
            return moe.expert_block(x, w1, w2, group_sizes, gemm=gemm, gemm_dtype=gemm_dtype, fp8_weights=fp8,
                                    **(block or {}))
        out, vjp = jax.vjp(f, x, w1, w2)
        return out, vjp(g)

    try:
        fp8 = jax.jit(moe.quantize_expert_weights)(w1, w2) if fp8_cached else None
        timed = experts.lower(x, w1, w2, g, fp8).compile(compiler_options) if compiler_options else experts
        return best_of(timed, x, w1, w2, g, fp8, iters=iters, repeats=repeats, sustain_s=sustain_s)
    except Exception as e:  # noqa: BLE001 - a failing configuration is a result
        print(f"  expert block alone ({gemm}): {type(e).__name__}: {str(e)[:160]}", flush=True)
        return None


def _hlo_instructions(compiled_text: str) -> dict[str, list[tuple[str, int, str, str | None]]]:
    """{computation: [(instruction, elements it outputs, its op_name metadata, computation it calls)]}."""
    computations, current = {}, None
    for line in compiled_text.splitlines():
        head = re.match(r"(?:ENTRY )?%?([\w.\-]+) \(.*\{\s*$", line)
        if head:
            current = computations.setdefault(head.group(1), [])
        elif line.startswith("}"):
            current = None
        elif current is not None and (instr := re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (.*)", line)):
            rest = instr.group(2)
            shape = rest.split(" ", 1)[0]
            if rest.startswith("("):   # a tuple shape, maybe nested: up to its closing parenthesis
                depth = itertools.accumulate(1 if c == "(" else -1 if c == ")" else 0 for c in rest)
                shape = rest[:next(i for i, d in enumerate(depth) if d == 0) + 1]
            elements = sum(math.prod(int(d) for d in dims.split(",") if d)
                           for dims in re.findall(r"\[([\d,]*)\]", shape))
            op_name = re.search(r'op_name="([^"]*)"', rest)
            calls = re.search(r"calls=%?([\w.\-]+)", rest)
            current.append((instr.group(1), elements, op_name.group(1) if op_name else "",
                            calls.group(1) if calls else None))
    return computations


def hlo_scopes(compiled_text: str, scopes=None) -> dict[str, str]:
    """{HLO instruction name: its op_name metadata (the jax name-scope path)} of a compiled module.

    A fusion takes the op_name of its body's dominant scope among `scopes` (default the layer's,
    moe.SCOPES): the one whose instructions output the most elements, rather than its root's, unless its
    instructions named outside those scopes (e.g. a loss's) output more, or none is named (then its own).
    XLA fuses across the layer's parts, e.g. the reference dispatch's backward (8 expert-major rows
    gathered per token) into the add of the router's input gradient, a 0.16 ms kernel at DeepSeek-V3 on
    one H200 (2026-12-04) whose root is the router's."""
    computations = _hlo_instructions(compiled_text)
    scopes = tuple(moe.SCOPES.values()) if scopes is None else scopes

    def body(name, seen):   # a computation's instructions and those of the computations it calls
        for instruction in computations.get(name, ()):
            yield instruction
            if instruction[3] is not None and instruction[3] not in seen:
                yield from body(instruction[3], seen | {instruction[3]})

    result = {}
    for instructions in computations.values():
        for name, _, op_name, calls in instructions:
            # per scope ("" outside `scopes`) of the body's named instructions (the unnamed ones,
            # parameters and constants, are the compiler's): elements output, its largest instruction
            totals, largest = collections.Counter(), {}
            for _, elements, body_name, _ in body(calls, {calls}) if calls is not None else ():
                if body_name:
                    scope = next((s for s in scopes if s in body_name), "")
                    totals[scope] += elements
                    largest[scope] = max(largest.get(scope, (-1, "")), (elements, body_name))
            dominant = max(totals, key=totals.get, default="")
            if dominant:
                op_name = largest[dominant][1]
            if op_name:
                result[name] = op_name
    return result


# Compile options of a program run kernel by kernel: without XLA's command buffers (CUDA graphs)
NO_COMMAND_BUFFERS = {"xla_gpu_enable_command_buffer": ""}


def profiled(call, iters: int):
    """The jax.profiler trace (ProfileData) of `iters` back-to-back `call()`s."""
    return profiled_steps(call, iters)[0]


def profiled_steps(call, iters: int, sustain_s: float = 0.0):
    """(the jax.profiler trace, how many calls it holds) of `iters` back-to-back `call()`s. ``sustain_s``:
    first, inside the trace, chains of `iters` calls for that long, so that the last `iters` run at the
    clocks of sustained load rather than at the burst clock the profiler's start-up pause leaves (session
    62: 1830 MHz against a sustained step's 1365); ``last_steps`` keeps the last `iters` calls' events."""
    calls = iters
    with tempfile.TemporaryDirectory() as log_dir:
        with jax.profiler.trace(log_dir):
            end = time.perf_counter() + sustain_s
            while time.perf_counter() < end:
                out = None   # one step's outputs alive at a time (a list of them held every step's)
                for _ in range(iters):
                    out = call()
                jax.block_until_ready(out)
                calls += iters
            out, start = None, time.perf_counter()
            for _ in range(iters):
                out = call()
            jax.block_until_ready(out)
            clocks.mark(start, time.perf_counter())   # the clock the split ran at
        files = glob.glob(f"{log_dir}/**/*.xplane.pb", recursive=True)
        return jax.profiler.ProfileData.from_file(files[0]), calls


def last_steps(events: list, calls: int, iters: int, start=lambda e: e.start_ns) -> list:
    """The events of the last `iters` of `calls` steps, from a step's events in start order (every step
    runs the same program, so each holds len(events) / calls of them; where the count does not divide,
    the same share of the list). ``start``: an event's start time."""
    if calls <= iters:
        return events
    if len(events) % calls:   # a step's events missing (e.g. the profiler's buffer full): said, not hidden
        warnings.warn(f"last_steps: {len(events)} events over {calls} steps do not divide: the last {iters} "
                      "steps' share of them is counted", stacklevel=2)
    events = sorted(events, key=start)
    return events[len(events) - round(len(events) * iters / calls):]


def split_by_scope(compiled, args, iters: int,
                   sustain_s: float = 0.0) -> tuple[dict[str, float], float] | None:
    """Device ms per step on device 0, attributed to the layer's named scopes, and the step's device span
    (first kernel start to last kernel end over the chain, per step); GPU only. ``sustain_s``: the chain
    profiled after that long of back-to-back steps (``profiled_steps``), only its last `iters` steps counted.

    Each GPU event of a profiled chain of steps is matched to its HLO instruction (event name or the
    event's stats), whose op_name metadata carries the jax name scopes; unmatched time is "rest".
    ``compiled``: the step compiled with NO_COMMAND_BUFFERS: a kernel replayed from a CUDA graph carries
    no HLO instruction in the trace (seen on one H200, 2026-11-24: everything in "rest"), so the split is
    of the step run kernel by kernel (``step_ms`` is timed with the default options)."""
    if jax.devices()[0].platform != "gpu":
        return None
    scopes = hlo_scopes(compiled.as_text())
    jax.block_until_ready(compiled(*args))
    data, calls = profiled_steps(lambda: compiled(*args), iters, sustain_s)
    split = {name: 0.0 for name in (*moe.SCOPES, "rest")}
    first, last = float("inf"), 0.0
    events = [event for plane in data.planes if plane.name == "/device:GPU:0" for line in plane.lines
              if line.name.startswith("Stream") for event in line.events]
    for event in last_steps(events, calls, iters):
        words = [event.name, *(str(v) for _, v in getattr(event, "stats", ()))]
        # the event's HLO instruction's scope (hlo_scopes: a fusion's dominant one) before any op_name the
        # trace itself carries (a fusion's root's)
        mapped = [scopes[word] for word in words if word in scopes]
        text = " ".join(mapped or words)
        part = next((name for name, scope in moe.SCOPES.items() if scope in text), "rest")
        split[part] += event.duration_ns / 1e6 / iters
        first, last = min(first, event.start_ns), max(last, event.end_ns)
    return {k: round(v, 3) for k, v in split.items()}, round(max(0.0, last - first) / 1e6 / iters, 3)


def kernel_events(data, device: str = "/device:GPU:0") -> list[tuple[int, int, str, str]]:
    """(start ns, end ns, stream line, name) of every kernel on `device`'s stream lines of a jax.profiler
    trace (``profiled``), in start order."""
    return sorted((e.start_ns, e.end_ns, line.name, e.name) for plane in data.planes if plane.name == device
                  for line in plane.lines if line.name.startswith("Stream") for e in line.events)


def kernel_overlap_ms(data, iters: int, device: str = "/device:GPU:0",
                      calls: int | None = None) -> tuple[float, float]:
    """(kernels' summed device ms, ms with some kernel running) per step of a jax.profiler trace of `iters`
    steps (``profiled``), from the kernels' intervals on `device`'s stream lines: their difference is how
    long kernels ran beside another. Intervals rather than stream lines, since inside a CUDA graph (XLA's
    command buffers) an async stream's kernels may be reported on the graph's launch stream (one line on
    one H200, 2026-12-01) and still run beside the compute stream's. ``calls``: the trace holds that many
    steps (``profiled_steps`` with sustain_s), of which the last `iters` count (``last_steps``)."""
    kernels = [(start, end) for start, end, _, _ in last_steps(kernel_events(data, device), calls or iters,
                                                               iters, start=lambda e: e[0])]
    union_ns, reach = 0, None
    for start, end in kernels:
        if reach is None or start >= reach:
            union_ns, reach = union_ns + end - start, end
        elif end > reach:
            union_ns, reach = union_ns + end - reach, end
    summed_ns = sum(end - start for start, end in kernels)
    return summed_ns / 1e6 / iters, union_ns / 1e6 / iters


def hidden_ep_ms(split: dict[str, float], device_step_ms: float) -> float:
    """The EP ops' device time (the dispatch and combine scopes, each with its backward) that ran beside
    other work: the step's device time summed over its streams minus its span, at most the EP time. A
    lower bound of what overlapping hides (idle gaps in the span count against it); 0 in series."""
    ep = split["dispatch"] + split["combine"]
    return round(min(ep, max(0.0, sum(split.values()) - device_step_ms)), 3)


def ep_options(options: dict) -> moe.EPOptions:
    """The layer's EPOptions of a config (CONFIGS), for the training step and the decode step alike."""
    return moe.EPOptions(backend=options["backend"], kernel=KernelConfig(**options.get("kernel", {})),
                         **{k: options[k] for k in ("chunks", "dy_in_place", "dispatch_dtype", "gate_weights",
                                                    "shared_beside", "shared_split", "weight_grad_beside")
                            if k in options})


def layer_and_tokens(mesh: Mesh, shape, config: str, shared_ffn: int = 0):
    """The layer a config benchmarks on the devices of `mesh` (bfloat16 parameters, seed 0; a dense
    shared expert of `shared_ffn` when not 0) and its
    input (tokens_per_rank bfloat16 tokens per device, sharded as the layer's batch). A config with
    `nodes` takes them as that many nodes of (devices / nodes) GPUs each, node-major (GPU n * L + l
    holds the experts a flat EP of N * L ranks puts there), with the hierarchical dispatch / combine.
    A config with `micro_batches` gets a tuple of that many inputs, or with `chunks` too one input that
    holds them as each rank's token chunks (rank r's rows: micro-batch 0's rows of rank r, then micro-batch
    1's, ...: chunk c of a rank is micro-batch c's); with `gemm_free_sms` the expert GEMMs leave that many
    of the GPU's SMs free (MoE(gemm_num_sms=...))."""
    hidden, ffn, experts, topk, tokens = shape
    ep, options = mesh.size, CONFIGS[config]
    layout = dict(mesh=mesh, axis_name=mesh.axis_names[0])
    if "nodes" in options:
        nodes = options["nodes"]
        if ep % nodes or experts % ep:
            raise ValueError(f"{config} needs a multiple of {nodes} devices dividing {experts} experts, "
                             f"got {ep}")
        layout = dict(mesh=Mesh(np.array(mesh.devices).reshape(nodes, ep // nodes), ("node", "local")),
                      axis_name="local", node_axis="node")
    layer = moe.MoE(hidden, ffn, RouterConfig(experts, topk), rngs=nnx.Rngs(0), **layout,
                    ep=ep_options(options), gemm=options["gemm"], param_dtype=jnp.bfloat16,
                    shared_ffn_hidden=shared_ffn, gemm_dtype=options.get("gemm_dtype"),
                    **block_options(options))
    sharding = NamedSharding(layer.mesh, P(layer.batch_axes))
    micro_batches = options.get("micro_batches", 1)
    inputs = tuple(jax.device_put(jax.random.normal(jax.random.key(1 + b), (ep * tokens, hidden),
                                                    jnp.bfloat16), sharding) for b in range(micro_batches))
    if "micro_batches" not in options:
        return layer, inputs[0]
    if "chunks" in options:
        chunked = jnp.stack(inputs).reshape(micro_batches, ep, tokens, hidden).transpose(1, 0, 2, 3)
        return layer, jax.device_put(chunked.reshape(ep * micro_batches * tokens, hidden), sharding)
    return layer, inputs


def checkpoint_policy(name: str):
    """The jax.checkpoint policy of a config's ``checkpoint``: "no_policy" (JAX's default, nothing kept:
    the backward reruns the forward, dispatch's exchange included), "dispatch" (``jax_ep.remat.policy()``:
    dispatch's results kept), "gate_up" (and the gate|up GEMM's output)."""
    return {"no_policy": None, "dispatch": remat.policy(),
            "gate_up": remat.policy(save=(remat.DISPATCH, remat.GATE_UP))}[name]


def training_step(graphdef, rest, checkpoint: str | None = None):
    """(step, quantise) of a layer split as nnx.split(layer, nnx.Param, ...): step(params, x, fp8=None)
    is one jitted training step (loss, gradients of the parameters and of x) with cached FP8 weights
    when given; x a tuple of micro-batches: their losses summed, as gradient accumulation does, in one
    program (each micro-batch's work free to run beside the others'). quantise(params) makes the FP8
    weights (MoE.quantize_weights, once per optimiser step). checkpoint: None, else the layer under
    jax.checkpoint with ``checkpoint_policy(checkpoint)``, as a rematerialised block runs it."""
    def layer(params, xb, fp8):
        return nnx.merge(graphdef, params, rest)(xb, update_stats=False, fp8_weights=fp8)
    if checkpoint is not None:
        layer = jax.checkpoint(layer, policy=checkpoint_policy(checkpoint))

    @jax.jit
    def step(params, x, fp8=None):
        # d x too: inside a model the layer's input gradient feeds the layers below (without it XLA
        # drops the backward of dispatch and the expert GEMM feeding it)
        def loss(params, x):
            return functools.reduce(operator.add, (
                jnp.mean(layer(params, xb, fp8).astype(jnp.float32) ** 2)
                for xb in (x if isinstance(x, tuple) else (x,))))
        return jax.value_and_grad(loss, argnums=(0, 1))(params, x)

    return step, jax.jit(lambda params: nnx.merge(graphdef, params, rest).quantize_weights())


def bench_layer(mesh: Mesh, shape, config: str, iters: int, repeats: int, profile: bool,
                shared_ffn: int = 0, sustain_s: float = 0.0) -> dict:
    hidden, ffn, experts, topk, tokens = shape
    ep = mesh.size
    record = dict(op="moe_layer", backend=CONFIGS[config]["backend"], config=config, hidden=hidden,
                  ffn_hidden=ffn, num_experts=experts, topk=topk, tokens_per_rank=tokens, ep_size=ep,
                  shared_ffn_hidden=shared_ffn)
    if "nodes" in CONFIGS[config]:
        record["nodes"] = CONFIGS[config]["nodes"]
    try:
        layer, x = layer_and_tokens(mesh, shape, config, shared_ffn)
    except ValueError as e:  # a config this machine cannot form (e.g. GPUs not a multiple of nodes)
        return dict(record, gemm="", step_ms=None, split_ms=None, error=str(e))
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
    step, quantise = training_step(graphdef, rest, CONFIGS[config].get("checkpoint"))
    record["gemm"] = layer_gemm_plans(layer, mesh, x[0] if isinstance(x, tuple) else x)
    record["ep_ops"] = layer_ep_plans(layer, tokens, ("dispatch", "combine"))
    record["gate_weights"] = layer.gate_weights   # "auto" resolved: "experts" flat, "combine" with nodes
    try:
        args = (params, x)
        if CONFIGS[config].get("fp8_cached"):   # once per optimiser step: timed apart from the step
            record["quantise_ms"] = 1e3 * best_of(quantise, params, iters=iters, repeats=repeats,
                                                  sustain_s=sustain_s)
            args = (params, x, quantise(params))
        # a step of several micro-batches: its time per micro-batch, what the other configs' step is
        record["micro_batches"] = CONFIGS[config].get("micro_batches", 1)
        record["command_buffers"] = CONFIGS[config].get("command_buffers", True)
        # XLA options of the whole step (a plain-JAX user's switch): the step compiled with them
        xla_options = CONFIGS[config].get("compiler_options", {})
        kernel_by_kernel = profile or not record["command_buffers"]
        lowered = step.lower(*args) if xla_options or kernel_by_kernel else None
        timed = lowered.compile(xla_options) if xla_options else step
        if xla_options:
            record["compiler_options"] = xla_options
            record["cudnn_fusions"] = timed.as_text().count("__cudnn$fusion")
        # the step kernel by kernel: what a _nocb config times and what the profile splits
        no_cb = lowered.compile({**NO_COMMAND_BUFFERS, **xla_options}) if kernel_by_kernel else None
        with clocks.collect() as step_clocks:
            record["step_ms"] = 1e3 * best_of(timed if record["command_buffers"] else no_cb, *args,
                                              iters=iters, repeats=repeats, sustain_s=sustain_s) \
                / record["micro_batches"]
        record["clocks"] = dict(step=step_clocks.summary())
        split = None
        if profile:
            try:   # its own failure: it keeps the step time measured above (and says nothing of the peer)
                with clocks.collect() as split_clocks:
                    split = split_by_scope(no_cb, args, iters, sustain_s)
                record["clocks"]["split"] = split_clocks.summary()
            except Exception as e:
                record["split_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        record["split_ms"], record["device_step_ms"] = split or (None, None)
        record["ep_hidden_ms"] = None if split is None else hidden_ep_ms(*split)
    except Exception as e:  # e.g. XLA's ragged_dot lowering running out of memory: a result, not a crash
        record.update(step_ms=None, split_ms=None, error=f"{type(e).__name__}: {str(e)[:300]}")
        # plain JAX (the peer) not fitting in memory is what this benchmark measures about it, not a
        # failure of the run; jax_ep's own configurations failing is
        record["peer_out_of_memory"] = config in PLAIN_JAX and is_out_of_memory(e)
    return record


def is_out_of_memory(e: BaseException) -> bool:
    """XLA's allocation failure (RESOURCE_EXHAUSTED / out of memory), as raised by jit or at run time."""
    text = f"{type(e).__name__}: {e}"
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def decode_step(mesh: Mesh, shape, config: str, shared_ffn: int = 0):
    """(layer, step, args): one jitted forward of the layer's decode path (ll_dispatch, grouped GEMMs over
    the filled slots, ll_combine; a dense shared expert of `shared_ffn` beside them when not 0),
    ``step(*args)``. A config with cached FP8 weights (``fp8_cached``)
    runs the decode experts in FP8 from ``MoE.quantize_weights()``, made here once (a server quantises
    once per weight load)."""
    hidden, ffn, experts, topk, tokens = shape
    ep = mesh.size
    options = CONFIGS[config]
    fp8 = bool(options.get("fp8_cached"))
    layer = moe.MoE(hidden, ffn, RouterConfig(experts, topk), rngs=nnx.Rngs(0), mesh=mesh,
                    gemm_dtype=options.get("gemm_dtype") if fp8 else None,
                    ep=ep_options(options), gemm=options["gemm"], param_dtype=jnp.bfloat16, decode=True,
                    shared_ffn_hidden=shared_ffn)
    x = jax.device_put(jax.random.normal(jax.random.key(1), (ep * tokens, hidden), jnp.bfloat16),
                       NamedSharding(mesh, P("ep")))
    quantized = nnx.jit(lambda m: m.quantize_weights())(layer) if fp8 else None
    graphdef, state = nnx.split(layer)
    step = jax.jit(lambda state, x, q: nnx.merge(graphdef, state)(x, decode=True, update_stats=False,
                                                                   fp8_weights=q))
    return layer, step, (state, x, quantized)


def bench_decode(mesh: Mesh, shape, config: str, iters: int, repeats: int, shared_ffn: int = 0,
                 sustain_s: float = 0.0) -> dict:
    """``decode_step`` timed, and its expert block alone on one device next to the batched einsum over
    every fixed slot (what the decode path computed before, and what DeepEP's contract invites)."""
    hidden, ffn, experts, topk, tokens = shape
    ep = mesh.size
    options = CONFIGS[config]
    layer, step, args = decode_step(mesh, shape, config, shared_ffn)
    record = dict(op="moe_layer_decode", backend=options["backend"], config=config, hidden=hidden,
                  ffn_hidden=ffn, num_experts=experts, topk=topk, tokens_per_rank=tokens, ep_size=ep,
                  shared_ffn_hidden=shared_ffn,
                  ep_ops=layer_ep_plans(layer, tokens, ("ll_dispatch", "ll_combine")))
    try:
        with clocks.collect() as step_clocks:
            record["step_ms"] = 1e3 * best_of(step, *args, iters=iters, repeats=repeats, sustain_s=sustain_s)
        record["clocks"] = dict(step=step_clocks.summary())
    except Exception as e:  # noqa: BLE001 - a failing configuration is a result
        record.update(step_ms=None, error=f"{type(e).__name__}: {str(e)[:300]}")
    with clocks.collect() as experts_clocks:
        grouped, einsum, weight_bytes = decode_experts_seconds(hidden, ffn, experts, topk, tokens, ep,
                                                               options["gemm"], iters, repeats,
                                                               bool(options.get("fp8_cached")), sustain_s)
    record.setdefault("clocks", {})["experts"] = experts_clocks.summary()
    fp8 = bool(options.get("fp8_cached"))
    local = experts // ep
    scale_bytes = 4 * local * 3 * (hidden // 128) * (ffn // 128) if fp8 else 0   # one float32 per 128 x 128
    record.update(experts_ms=1e3 * grouped, experts_einsum_ms=1e3 * einsum, expert_weight_bytes=weight_bytes,
                  experts_read_bytes=weight_bytes // 2 + scale_bytes if fp8 else weight_bytes)
    return record


def decode_expert_block(hidden: int, ffn: int, experts: int, topk: int, tokens: int, ep: int, gemm: str,
                        fp8: bool = False):
    """The decode layer's expert block on one device at the per-rank shapes, from uniform random routing
    of `tokens` per rank on `ep` ranks: (grouped, einsum, args, weight_bytes): the jitted expert block
    over the filled slots (``moe.slot_experts``; ``fp8``: its GEMMs in FP8 from weights quantised once
    here; it takes the slots' buffer (donated) and writes its rows back into it, as in the layer where
    the buffer is the dispatch's: ``slots = grouped(slots, *args[1:])``), the batched einsum over all
    slots (bf16; what DeepEP's fixed-slot contract invites), their arguments (``einsum(*args[:4])`` before
    any ``grouped`` call has taken ``args[0]``), and
    the bytes of this rank's bf16 expert weights: what either must read at least."""
    local = experts // ep
    rng = np.random.default_rng(0)
    dev = jax.devices()[0]
    counts = np.zeros((local, ep), np.int32)
    for r in range(ep):
        for _ in range(tokens):
            picked = rng.choice(experts, size=topk, replace=False)
            np.add.at(counts[:, r], picked[picked < local], 1)
    # made on the device: at DeepSeek-V3 decode sizes the weights are 12.7 GB (NumPy takes minutes)
    keys = jax.random.split(jax.random.key(0), 3)
    with jax.default_device(dev):
        w1 = jax.random.normal(keys[0], (local, hidden, 2 * ffn), jnp.bfloat16) * hidden ** -0.5
        w2 = jax.random.normal(keys[1], (local, ffn, hidden), jnp.bfloat16) * ffn ** -0.5
        slots = jax.random.normal(keys[2], (local, ep * tokens, hidden), jnp.bfloat16)
    counts = jax.device_put(jnp.asarray(counts), dev)
    quantized = jax.jit(moe.quantize_expert_weights)(w1, w2) if fp8 else None

    @functools.partial(jax.jit, donate_argnums=0)
    def grouped(slots, counts, w1, w2, quantized):
        return moe.slot_experts(slots, None, counts, w1, w2, min(topk, local), jnp.bfloat16, gemm, quantized)

    @jax.jit
    def einsum(slots, counts, w1, w2):
        block = jnp.arange(tokens, dtype=jnp.int32)
        filled = (block[None, None, :] < counts[:, :, None]).reshape(local, -1)
        slots = jnp.where(filled[:, :, None], slots, jnp.zeros((), slots.dtype))
        gate, up = jnp.split(jnp.einsum("esh,ehf->esf", slots, w1), 2, axis=2)
        return jnp.einsum("esf,efh->esh", jax.nn.silu(gate) * up, w2)

    return grouped, einsum, (slots, counts, w1, w2, quantized), int(w1.size + w2.size) * 2


def decode_experts_seconds(hidden: int, ffn: int, experts: int, topk: int, tokens: int, ep: int, gemm: str,
                           iters: int, repeats: int, fp8: bool = False, sustain_s: float = 0.0
                           ) -> tuple[float, float, int]:
    """``decode_expert_block``'s two forms timed: (grouped s, einsum s, weight bytes)."""
    grouped, einsum, args, weight_bytes = decode_expert_block(hidden, ffn, experts, topk, tokens, ep, gemm,
                                                              fp8)
    timing = dict(iters=iters, repeats=repeats, sustain_s=sustain_s)
    einsum_s = best_of(einsum, *args[:4], **timing)   # before grouped takes the slots
    return best_of(grouped, *args, chain=True, **timing), einsum_s, weight_bytes


def layer_gemm_plans(layer, mesh, x) -> str:
    """"mosaic_gpu" / "ragged_dot" (or "mixed") for the layer's expert GEMMs at this shape: the choice at
    the widths and dtypes, for rows as dispatch gives them where the kernel runs (a multiple of
    gemm.ROW_ALIGNMENT; the kernels refuse only row counts the layer does not make then)."""
    from jax_ep.gemm import ROW_ALIGNMENT, explain

    local = layer.num_experts // mesh.size
    rows = ROW_ALIGNMENT
    shapes = [((rows, layer.hidden), (local, layer.hidden, 2 * layer.ffn_hidden)),
              ((rows, layer.ffn_hidden), (local, layer.ffn_hidden, layer.hidden))]
    impls = {plan.impl for xs, ws in shapes
             for plan in explain(jax.ShapeDtypeStruct(xs, x.dtype), jax.ShapeDtypeStruct(ws, x.dtype),
                                 backend=layer.gemm).values()}
    return impls.pop() if len(impls) == 1 else "mixed"


def layer_ep_plans(layer, tokens: int, op_names) -> str:
    """The backend the layer's EP ops take (jax_ep.explain; e.g. "cuda", or "reference" where 'auto'
    found no usable kernel, with the reason): a record says what ran, not only what was asked."""
    from jax_ep import explain

    cfg = layer.ep.ep_config(num_experts=layer.num_experts, num_topk=layer.num_topk, hidden=layer.hidden,
                             max_tokens_per_rank=tokens // layer.ep.chunks, axis_name=layer.axis_name)
    plans = explain(cfg, layer.mesh.shape[layer.axis_name], ops=op_names)
    impls = {plan.impl for plan in plans.values()}
    if len(impls) == 1 and impls != {"reference"}:
        return impls.pop()
    return "; ".join(f"{plan.op}: {plan.impl} ({plan.reason})" for plan in plans.values())


def sm_clocks(record: dict) -> str:
    """"step/gemm/roofline" median SM MHz on the first GPU ("-" for a part without samples), or ""."""
    parts = [(record.get("clocks") or {}).get(k) for k in ("step", "gemm", "roofline")]
    return "" if not any(parts) else "/".join(f"{p['sm_mhz'][0]:.0f}" if p else "-" for p in parts)


def clock_note(record: dict) -> str:
    """" at <SM MHz> MHz, <W> W" for a record's step timing on its first GPU, or "" without a sample."""
    step = (record.get("clocks") or {}).get("step")
    return "" if not step else f" at {step['sm_mhz'][0]:.0f} MHz, {step['power_w'][0]:.0f} W"


def print_table(records: list[dict]) -> None:
    """The layer records' table: one line per (shape, config), then the EP ops' long explanations."""
    from benchmarks.ops import gbps as four_digits  # here: benchmarks.ops imports this module

    base = {(r["shape"], r["config"]): r["step_ms"] for r in records}
    rows = [r for r in records if r["op"] == "moe_layer"]
    steps = [("out of memory" if r.get("peer_out_of_memory") else "failed") if r["step_ms"] is None
             else f"{r['step_ms']:.2f}" for r in rows]
    # columns as wide as their longest entry, so that long preset names and "out of memory" stay apart
    sw = max([9] + [len(r["shape"]) + 1 for r in rows])
    cw = max([18] + [len(r["config"]) + 1 for r in rows])
    tw = max([10] + [len(step) + 1 for step in steps])
    print(f"{'layer':{sw}}{'config':{cw}}{'gemm':12}{'EP ops':>10}{'EP':>3}{'step ms':>{tw}}{'roofline':>10}"
          f"{'w floor':>9}{'x roof':>8}{'speedup':>9}{'GEMM ms':>9}{'GEMM TF/s':>11}"
          f"{'MHz step/gemm/roof':>20}"
          f"  split ms ({'/'.join((*moe.SCOPES, 'rest'))}); EP hidden ms / EP ms")
    for r, step in zip(rows, steps, strict=True):
        plain = min((base[r["shape"], c] for c in PLAIN_JAX if base.get((r["shape"], c))), default=None)
        speedup = "" if not (plain and r["step_ms"]) else f"{plain / r['step_ms']:.1f}x"
        split = "" if not r["split_ms"] else "/".join(f"{v:.2f}" for v in r["split_ms"].values()) + (
            f"; {r['ep_hidden_ms']:.2f} / {r['split_ms']['dispatch'] + r['split_ms']['combine']:.2f}")
        ratio = "" if r["roofline_ratio"] is None else f"{r['roofline_ratio']:.2f}"
        # 4 significant figures, as the ops table's GB/s (a CPU run's GEMMs do well under 1 TF/s: not "0")
        tflops = four_digits(r["gemm_tflops"])
        gemm_ms = "" if r["gemm_ms"] is None else f"{r['gemm_ms']:.2f}"
        floor_ms = "" if r["weight_floor_ms"] is None else f"{r['weight_floor_ms']:.2f}"
        ep_ops = r.get("ep_ops", "")
        ep_ops = ep_ops if len(ep_ops) <= 10 else "see below"
        print(f"{r['shape']:{sw}}{r['config']:{cw}}{r['gemm']:12}{ep_ops:>10}"
              f"{r['ep_size']:>3}{step:>{tw}}"
              f"{r['roofline_ms']:>10.2f}{floor_ms:>9}{ratio:>8}{speedup:>9}{gemm_ms:>9}{tflops:>11}"
              f"{sm_clocks(r):>20}  {split}")
    for r in [r for r in rows if len(r.get("ep_ops", "")) > 10]:
        print(f"  EP ops of {r['shape']} {r['config']}: {r['ep_ops']}")


def main(args, save=lambda records: None) -> list[dict]:
    """Times the layer shapes and configs of ``args``; ``save(records)`` after every record. The GPUs'
    SM clock and power are sampled throughout (``benchmarks.clocks``; records' ``clocks``)."""
    with clocks.sampling():
        return _main(args, save)


def _main(args, save) -> list[dict]:
    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("ep",))
    platform = devices[0].platform
    names = args.layer_shapes.split(",") if args.layer_shapes else (
        ["small"] if platform == "cpu" else ["mid", "deepseek"])
    device = f"{len(devices)}x {devices[0].device_kind}"
    spec = spec_tflops(devices[0].device_kind) if platform == "gpu" else None
    today = datetime.date.today().isoformat()
    sustain = getattr(args, "sustain", 0.0)
    records = []
    # NAMED_ONLY configs only when named: they time the same layer on the same GPUs another way
    wanted = args.layer_configs.split(",") if getattr(args, "layer_configs", None) else [
        c for c in CONFIGS if c not in NAMED_ONLY]
    unknown = sorted(set(wanted) - set(CONFIGS))
    if unknown:
        raise SystemExit(f"--layer-configs: unknown {unknown}; known: {list(CONFIGS)}")
    skipped = [c for c in wanted if platform != "gpu" and CONFIGS[c]["backend"] == "cuda"]
    if skipped:
        print(f"skip {','.join(skipped)}: the cuda backend needs GPUs")
    wanted = [c for c in wanted if c not in skipped]
    for name in [n for n in names if n in DECODE_SHAPES]:
        # the einsum is the plain-JAX baseline; the hierarchical path has no decode ops
        for config in [c for c in wanted if c not in PLAIN_JAX and "nodes" not in CONFIGS[c]]:
            r = bench_decode(mesh, LAYER_PRESETS[name], config, args.iters, args.repeats,
                             SHARED_FFN.get(name, 0), sustain)
            r.update(shape=name, device=device, date=today, sustain_s=sustain)
            records.append(r)
            save(records)
            step = "failed" if r["step_ms"] is None else f"{r['step_ms']:.3f} ms{clock_note(r)}"
            print(f"  {name} {config} (EP ops: {r['ep_ops']}): decode forward {step}; experts alone "
                  f"{r['experts_ms']:.3f} ms over the filled slots, {r['experts_einsum_ms']:.3f} ms as an "
                  f"einsum over all slots "
                  f"({r['expert_weight_bytes'] / 1e9:.2f} GB of expert weights per rank)", flush=True)
    names = [n for n in names if n not in DECODE_SHAPES]
    read_gbps = None
    for name in names:
        shape = LAYER_PRESETS[name]
        hidden, ffn, experts, topk, tokens = shape
        rows = tokens * topk   # real rows per rank on average (uniform routing)
        shared_ffn = SHARED_FFN.get(name, 0)
        with clocks.collect() as roof_clocks:
            roof = 1e3 * roofline_seconds(rows, hidden, ffn, jnp.bfloat16, args.iters, args.repeats, sustain)
            if shared_ffn:      # the shared expert's GEMMs over every token, as dense dots too
                roof += 1e3 * roofline_seconds(tokens, hidden, shared_ffn, jnp.bfloat16, args.iters,
                                               args.repeats, sustain)
        gemm_flops = 3 * 3 * 2 * rows * hidden * ffn    # 3 GEMMs x (forward + 2 backward)
        roofline_flops = gemm_flops + 3 * 3 * 2 * tokens * hidden * shared_ffn   # + the shared expert's
        local = experts // mesh.size
        # w1 [H, 2F] and w2 [F, H] in bf16: the local experts' (as decode's records count them), and with the
        # shared expert's for the floor, which moves both
        weight_bytes = local * ffn * 3 * hidden * 2
        moved_weight_bytes = weight_bytes + shared_ffn * 3 * hidden * 2
        if read_gbps is None:   # once per run: the memory roof (2 GiB on a GPU: well past the L2)
            read_sustain = max(sustain, READ_SUSTAIN_S) if platform == "gpu" else sustain
            read_gbps = read_bytes_per_second(2 << 30 if platform == "gpu" else 64 << 20, args.iters,
                                              args.repeats, read_sustain) / 1e9
        capacity = EPConfig(experts, topk, hidden, tokens).worst_case_capacity(mesh.size)  # before alignment
        for config in wanted:
            r = bench_layer(mesh, shape, config, args.iters, args.repeats, args.profile, shared_ffn, sustain)
            with clocks.collect() as gemm_clocks:
                seconds = expert_gemm_seconds(rows, hidden, ffn, local, capacity, CONFIGS[config]["gemm"],
                                              args.iters, args.repeats, CONFIGS[config].get("gemm_dtype"),
                                              CONFIGS[config].get("fp8_cached", False), sustain,
                                              CONFIGS[config].get("compiler_options"),
                                              block_options(CONFIGS[config]))
            r.setdefault("clocks", {}).update(gemm=gemm_clocks.summary(), roofline=roof_clocks.summary())
            gemm_ms = None if seconds is None else 1e3 * seconds
            floor = weight_floor_bytes(config, moved_weight_bytes)
            r.update(shape=name, roofline_ms=roof, gemm_flops=gemm_flops, gemm_ms=gemm_ms,
                     expert_weight_bytes=weight_bytes, read_gbps=read_gbps, weight_floor_bytes=floor,
                     weight_floor_ms=None if floor is None else floor / read_gbps / 1e6,
                     gemm_tflops=None if not gemm_ms else gemm_flops / gemm_ms / 1e9,
                     roofline_ratio=None if r["step_ms"] is None else r["step_ms"] / roof,
                     roofline_flops=roofline_flops, roofline_tflops=roofline_flops / roof / 1e9,
                     spec_tflops=spec, spec_ratio=None if r["step_ms"] is None or spec is None
                     else r["step_ms"] / (roofline_flops / spec / 1e9),
                     read_sustain_s=read_sustain, device=device, date=today, sustain_s=sustain)
            records.append(r)
            save(records)
            print(f"  {name} {config}: {r['step_ms'] if r['step_ms'] is None else round(r['step_ms'], 2)} ms"
                  + clock_note(r) + (f" ({r['error'][:120]})" if "error" in r else ""), flush=True)
    print_table(records)
    return records
