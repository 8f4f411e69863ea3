"""Flax NNX Mixture-of-Experts layer on jax_ep's dispatch/combine.

Router (linear -> softmax/sigmoid -> top-k, optional DeepSeek-V3 group-limited selection and
auxiliary-loss-free balancing bias), experts as stacked SwiGLU weights sharded along the EP axis and
run with ``jax_ep.grouped_matmul`` on the expert-major rows (gate and up projections as one grouped GEMM
of twice the width, then the down projection; Hopper kernels on H100/H200, ``lax.ragged_dot``
elsewhere), optional shared expert. ``MoE``'s docstring says how to build and call it.

Decode (``layer(x, decode=True)``, or ``MoE(..., decode=True)``): the same router and experts on
jax_ep's low-latency ops instead (``ll_dispatch`` into fixed slots ``[E_local, R*T, H]``, a batched
SwiGLU over every slot of each expert, ``ll_combine``): for decode steps of a few tokens per rank,
forward only. Tokens travel as bfloat16 (or FP8) and the experts' outputs return as bfloat16.

Expert placement (``placement=jax_ep.eplb.Placement``, EPLB replication): the router still scores the
``num_experts`` logical experts; each pick is mapped to one replica (``eplb.apply_placement`` with
global token ids) and dispatch runs over the ``num_ranks * slots_per_rank`` physical slots. The
parameters stay the logical experts ``[num_experts, ...]`` (same param tree, checkpoints and optimizer
state with or without a placement; re-planning changes no parameter, and a replicated expert's
gradient is the sum over its replicas, so replicas can never drift apart). Each step, every rank
gathers the weights of its slots from them (``w[physical_to_logical[slots of this rank]]``): an
all-gather of the expert weights forward and a reduction of their gradients backward.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_ep import backends, eplb, overlap, remat
from jax_ep.balancing import BalancingConfig, expert_counts, sequence_aux_terms, update_bias
from jax_ep.config import (
    EP_CONFIG_KINDS,
    FP8_BLOCK,
    EPConfig,
    KernelConfig,
    check_fp8_channels,
    check_kernel,
    check_option,
    check_options,
    type_name,
)
from jax_ep.errors import EPTypeError, EPUnsupportedError, EPValueError
from jax_ep.fp8 import dequantize_rows
from jax_ep.gating import RouterConfig, route
from jax_ep.gemm import BACKENDS as GEMM_BACKENDS
from jax_ep.gemm import grouped_matmul, preferred_alignment
from jax_ep.gemm_fp8 import FP8Weights, fp8_grouped_matmul, live_rows_quantiser, quantize_weights
from jax_ep.hierarchical import combine_hierarchical, dispatch_hierarchical
from jax_ep.ops import (
    combine,
    dispatch,
    dispatch_straight_through,
    ll_combine,
    ll_dispatch,
    ll_dispatch_recv,
    ll_dispatch_send,
)
from jax_ep.swiglu import BACKENDS as SWIGLU_BACKENDS
from jax_ep.swiglu import resolve as swiglu_resolve
from jax_ep.swiglu import swiglu, swiglu_rows_fp8
from jax_ep.vma import manual_axes, sum_to, vary_also, varying_axes

GEMM_DTYPES = (None, "float8_e4m3fn")  # MoE(gemm_dtype=...): the expert GEMMs' operand dtype (None: compute)

_NO_HIERARCHICAL_DECODE = ("MoE: node_axis (hierarchical dispatch) has no decode path (the low-latency ops "
                           "are flat); use decode=False or node_axis=None")


def _no_hierarchical_gate_weights(node_axis) -> str:
    return ("MoE: EPOptions(gate_weights='experts') is built for the flat exchange only; "
            f"with node_axis={node_axis!r} use gate_weights='combine'")

# name scopes of the layer's parts (the layer benchmark attributes device time by them)
SCOPES = {"router": "moe_router", "dispatch": "moe_dispatch", "experts": "moe_experts",
          "combine": "moe_combine", "shared": "moe_shared"}


# EPOptions' fields are EPConfig's (same kinds), but expert_alignment may be None (chosen by the layer).
EP_OPTIONS_KINDS = {**{name: EP_CONFIG_KINDS[name] for name in ("capacity", "dispatch_dtype", "backend",
                                                                 "checked")},
                    "expert_alignment": "int?", "chunks": "int", "dy_in_place": "bool",
                    "gate_weights": ("auto", "combine", "experts"), "shared_beside": "bool",
                    "shared_split": "bool", "weight_grad_beside": "bool"}


@dataclasses.dataclass(frozen=True)
class EPOptions:
    """How an MoE layer dispatches and combines: the ``jax_ep.EPConfig`` fields the layer cannot know
    itself (it knows the sizes: experts, top-k, hidden, tokens per rank, and its EP axis).

    Attributes:
      capacity: receive rows per rank (``EPConfig.capacity``); None = worst case, nothing is dropped.
      expert_alignment: pad each expert's rows to a multiple of this. None (default): what the expert
        GEMM prefers (``jax_ep.gemm.preferred_alignment``: 64 rows for the Hopper kernel, so no kernel
        tile straddles two experts; 1 for lax.ragged_dot) when ``capacity`` is None or a multiple of it,
        1 otherwise.
      dispatch_dtype: None (the experts' compute dtype; with ``MoE(gemm_dtype="float8_e4m3fn")`` on the
        throughput path without ``node_axis``, "float8_e4m3fn": the same loss and gradients with bf16
        tokens, measured faster), "bfloat16" or "float8_e4m3fn" (trainable on the flat exchange: with
        ``gemm_dtype="float8_e4m3fn"`` the e4m3 rows go into the gate|up GEMM as they came, else they are
        dequantised to the compute dtype first; gradients straight through the quantisation,
        ``jax_ep.ops.dispatch_straight_through``; forward-only with ``node_axis``).
      backend: "auto", "reference" or "cuda" (``EPConfig.backend``).
      checked: raise at run time on bad expert ids or dropped rows (``EPConfig.checked``).
      kernel: how the CUDA kernels run (``jax_ep.KernelConfig``).
      chunks: the throughput path splits each rank's tokens into this many equal chunks (it must divide
        the tokens per rank) after routing, and dispatches, computes and combines each on its own, in the
        order dispatch 0, dispatch 1, experts 0, combine 0, dispatch 2, experts 1, ...: chunk i's exchange
        has no data dependence on chunk i-1's expert GEMMs, meant to run beside them with the kernels on
        an async stream (``KernelConfig(async_stream=1)``; with jax 0.11.2 XLA runs nothing beside those
        calls: ``KernelConfig``'s async_stream says why). Results equal ``chunks=1``'s when
        nothing is dropped (``capacity`` applies to each chunk's dispatch). Each chunk streams every local
        expert's weights through its GEMMs once more (and adds the chunks' weight gradients): measured slower,
        so 1 (default). 2 chunks on 2 H200s (2026-11-29, ``benchmarks --layer``, configs ``*_chunks2``):
        DeepSeek-V3 step 35.0-36.3 ms against 20.7-22.1, mid 8.32 against 6.42, nothing of the exchanges
        hidden (the persistent GEMM kernels hold every SM; docs/benchmarks.md, session 23).
      dy_in_place: the throughput path's combine takes ``empty_rows_zero=True`` (the expert block's output
        is zero in every row that holds no token), so combine's backward writes d y into that output's
        buffer and only its token rows; False writes every row of the receive buffer. True (default) by
        the bytes it saves at the worst-case capacity; against False (``benchmarks --layer``, config
        ``jax_ep_dy_zeroed``) a tie on 2 H200s (2026-11-29: DeepSeek-V3 step 22.30 / 22.34 and 22.60 /
        22.79 ms, mid 6.75 / 6.34 and 6.46 / 6.46; docs/benchmarks.md, session 25).
      gate_weights: where the throughput path applies the gate weights. "combine": combine sums each
        token's expert outputs weighted, and its backward reads the outputs again for the weights'
        gradient (``combine_bwd``). "experts": each row's SwiGLU output is scaled by its weight before the
        down GEMM (``expert_block(row_weights=...)``; linear, so the same function, rounded at another
        place), combine sums the rows unweighted and its backward is a plain broadcast (in place with
        ``dy_in_place``: dispatch's bytes), the weights' gradient a row dot product inside SwiGLU's
        backward, which reads those rows anyway. Flat exchange only (not with ``node_axis``). "auto"
        (default): "experts" on the flat exchange, "combine" with ``node_axis``. Why: combine's backward
        in place took 1.34-1.51x dispatch's time, the in-place broadcast 0.94-0.98x (4 processes under
        CUDA MPS on one H200, DeepSeek-V3, 8-24 SMs, 2026-12-03, docs/benchmarks.md session 52); on one
        H200 at the EP2 rank's work (session 37) combine's backward 0.30 -> 0.15 ms, SwiGLU's backward
        +0.03 ms; the step at EP1, where combine's backward is local (2026-12-04, session 56, 4 alternating
        rounds): within +-0.4% with bf16 GEMMs (DeepSeek-V3 at 128 and 64 experts, mid), -0.2% / -1.3%
        with cached FP8 GEMMs (DeepSeek-V3 / mid). Not yet timed on separate GPUs. With backend "auto" on
        2+ GPUs the in-place broadcast (the table's ``broadcast_in_place``, so far measured at EP1 only)
        takes the plain broadcast's decision, the kernel from 4096 tokens per rank (the fused backward's
        from 2048): from 2048 to 4095 "combine" is likely faster until it is measured there (docs/api.md).
      shared_beside: with a shared expert (``MoE(shared_ffn_hidden=...)``), the shared expert runs on each
        rank's tokens inside the layer, beside an exchange on jax_ep's side stream
        (``jax_ep.overlap.beside``): on the throughput path its forward beside the last combine and its
        backward beside combine's backward (the in-place broadcast by default, see gate_weights); on the
        decode path beside the dispatch's send phase (``ll_dispatch_send``). The same values and gradients.
        Takes effect where the op has a side twin (the 'cuda' backend); elsewhere the shared expert runs after
        the block. False (default): the shared expert after the layer, on XLA's stream. On one H200
        (2026-12-02, DeepSeek-V3 layer with its shared expert, EP1, docs/benchmarks.md session 44) not faster:
        the training step 25.47 ms against 25.25 with the exchanges on every SM (they hold the SMs the shared
        expert's GEMMs wait for), 26.09 against 26.51 on 24 SMs; decode 6.11 against 6.04. What it is for,
        combine's backward at EP2 / EP4 (0.6 / 1.2 ms as combine_bwd on 2026-11-28, at about dispatch's time
        as the broadcast), needs 2 and 4 GPUs to measure.
      shared_split: with shared_beside, the throughput path splits the shared expert as DeepSeek-V3 overlaps
        it: its gate|up half (two GEMMs and SwiGLU) beside the first dispatch and its down GEMM beside the
        last combine, so that each of the step's four exchanges has shared-expert work beside it (backward:
        dispatch's backward beside the gate|up half's, combine's backward beside the down GEMM's). The same
        values and gradients. Not with weight_grad_beside (both take dispatch's backward); the decode path
        keeps shared_beside's form. False (default). Not yet timed (needs 2 and 4 GPUs to mean anything).
      weight_grad_beside: the throughput path's backward runs dispatch's backward (a combine of the rows'
        gradient) on jax_ep's side stream beside the gate|up GEMM's weight gradient, which nothing of it
        needs (``jax_ep.overlap.chain``: dispatch and the gate|up GEMM as one custom_vjp whose backward
        takes the GEMM's input gradient first). The same values and gradients. Takes effect where
        dispatch's backward has a side twin (the 'cuda' backend); elsewhere it runs after the weight
        gradient. With ``KernelConfig.side_num_sms`` the weight gradient's kernels leave that many SMs to
        the exchange (its persistent grid on every SM leaves none, and the exchange waits for its end).
        False (default): XLA orders the two on its stream. On one H200 (2026-12-02, docs/benchmarks.md
        session 45) the exchange ran beside the weight gradient (0.70 of 0.70 ms on 24 SMs, 1.37 of 1.37
        on 12, at the EP2 rank's expert count) but the DeepSeek-V3 step was slower at EP1, where
        dispatch's backward is a 0.15 ms local copy: 24.78 ms (24 SMs) and 24.46 (12) against 23.67.
        What it is for, dispatch's backward over NVLink (0.23-0.30 ms at EP2, 0.50 at EP4 on every SM),
        needs 2 and 4 GPUs to measure.

    The decode path (``MoE(..., decode=True)``, ``layer(x, decode=True)``) uses ``dispatch_dtype``
    ("bfloat16" when None: the low-latency ops send bfloat16 or FP8), ``backend``, ``checked``
    and ``kernel``; capacity and expert_alignment play no part there (fixed slots, nothing is dropped).
    """

    capacity: int | None = None
    expert_alignment: int | None = None
    dispatch_dtype: str | None = None
    backend: str = "auto"
    checked: bool = False
    kernel: KernelConfig = KernelConfig()
    chunks: int = 1
    dy_in_place: bool = True
    gate_weights: str = "auto"
    shared_beside: bool = False
    weight_grad_beside: bool = False
    shared_split: bool = False   # last: a field added later leaves the positional order as it was

    def __post_init__(self):
        check_options("EPOptions", self, EP_OPTIONS_KINDS)
        check_kernel("EPOptions", self.kernel)
        if self.shared_split and not self.shared_beside:
            raise EPValueError("EPOptions.shared_split=True splits the shared expert beside the exchanges: "
                               "it needs shared_beside=True, got shared_beside=False")
        if self.shared_split and self.weight_grad_beside:
            raise EPValueError("EPOptions.shared_split=True and weight_grad_beside=True both put work beside "
                               "dispatch's backward: choose one")
        # EPConfig's checks across fields, with placeholder sizes (the layer's sizes are checked when
        # its EPConfig is made, at trace time)
        self.ep_config(num_experts=1, num_topk=1, hidden=FP8_BLOCK, max_tokens_per_rank=1, axis_name="ep")

    def ep_config(self, *, num_experts: int, num_topk: int, hidden: int, max_tokens_per_rank: int,
                  axis_name: str, preferred_alignment: int = 1) -> EPConfig:
        """The EPConfig for these sizes; ``preferred_alignment`` applies when ``expert_alignment`` is None."""
        align = self.expert_alignment
        if align is None:
            fits = self.capacity is None or self.capacity % preferred_alignment == 0
            align = preferred_alignment if fits else 1
        return EPConfig(num_experts, num_topk, hidden, max_tokens_per_rank, axis_name=axis_name,
                        capacity=self.capacity, expert_alignment=align, dispatch_dtype=self.dispatch_dtype,
                        backend=self.backend, checked=self.checked, kernel=self.kernel)


class ExpertBias(nnx.Variable):
    """Per-expert selection bias of auxiliary-loss-free balancing (not trained by gradients)."""


class ExpertLoad(nnx.Variable):
    """Load statistics: tokens per expert in the last step and accumulated over steps."""


class ExpertPlacement(nnx.Variable):
    """Expert placement tables (jax_ep.eplb.Placement arrays): not trained; replace with `set_placement`."""


class RankMask(nnx.Variable):
    """Active EP ranks of an MoE layer (bool[R]; ``MoE.set_rank_mask``)."""


class ExpertFP8Weights(NamedTuple):
    """A layer's expert weights quantised once for its FP8 GEMMs (``MoE.quantize_weights``): the gate|up
    and down projections as ``jax_ep.gemm_fp8.FP8Weights`` ([E, ...] each, sharded as the weights)."""
    gate_up: FP8Weights
    down: FP8Weights


def quantize_expert_weights(w_gate_up: jax.Array, w_down: jax.Array, dtype=None) -> ExpertFP8Weights:
    """Both expert projections quantised for the FP8 GEMMs (``jax_ep.gemm_fp8.quantize_weights``), after a
    cast to ``dtype`` when given: what ``MoE.quantize_weights`` computes per device."""
    def cast(w):
        return w if dtype is None else w.astype(dtype)
    return ExpertFP8Weights(quantize_weights(cast(w_gate_up)), quantize_weights(cast(w_down)))


class MoEStats(NamedTuple):
    expert_load: jax.Array   # [E] int32 tokens the router sent to each logical expert this call (all token
    #                          shards; before capacity drops and rank masks: the demand: balancing, EPLB)
    num_dropped: jax.Array   # [] int32 rows dropped for lack of capacity (all ranks)
    aux_loss: jax.Array      # [] float32 sequence-wise auxiliary loss (0 when disabled)
    slot_load: jax.Array     # [num_slots] int32 rows each physical slot received (after drops; summed over
    #                          replicas, = expert_load when nothing is dropped)


def _check_experts_divide(num_experts: int, ep_size: int, axis_name: str, node_axis: str | None) -> None:
    """Without a placement each EP rank holds num_experts / ep_size experts."""
    if num_experts % ep_size:
        axes = repr(axis_name) if node_axis is None else f"{node_axis!r} x {axis_name!r}"
        raise EPValueError(
            f"MoE: routing.num_experts={num_experts} is not divisible by the EP size {ep_size} (mesh "
            f"axis {axes}): each EP rank holds num_experts / EP size experts; choose num_experts as a "
            "multiple of the EP size, or give an expert placement (jax_ep.eplb) with slots that divide")


def router_logits(x: jax.Array, router: jax.Array) -> jax.Array:
    """[T, E] float32 router logits, x @ router summed in float32.

    The operands go to the GEMM in their own dtypes (jnp's promotion: a float32 one makes both float32):
    bfloat16 tokens and a bfloat16 router multiply as a bfloat16 GEMM with a float32 result, whose
    products are exact in float32 as the products of their float32 upcasts are, so it is the float32
    GEMM of the upcasts up to the order of the sums, without a float32 copy of the tokens. Its backward
    on a GPU multiplies the float32 gradient as bfloat16 parts (``router_grads_split``), as many as the
    ``jax.default_matmul_precision`` in effect at this call asks for (where JAX's own dots read it too). The
    bf16 form is a ``custom_vjp``: reverse-mode differentiation only, as the layer's EP ops."""
    if x.dtype == router.dtype == jnp.bfloat16:
        return _router_logits_bf16(x, router, jax.config.jax_default_matmul_precision)
    return _logits(x, router)


def _logits(x, router):
    return jnp.dot(x, router, preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _router_logits_bf16(x, router, precision):
    return _logits(x, router)


def _router_logits_bf16_fwd(x, router, precision):
    return _logits(x, router), (x, router)


# the jax_default_matmul_precision spellings that ask for float32 products (JAX's names and the
# algorithm names of at least float32's precision): three bf16 parts of the gradient, else two
_FLOAT32_PRECISIONS = ("highest", "float32", "f32_f32_f32", "bf16_bf16_f32_x6", "bf16_bf16_f32_x9")


def _router_parts(precision) -> int:
    return 3 if str(precision).lower() in _FLOAT32_PRECISIONS else 2


def _router_logits_bf16_bwd(precision, res, g):
    x, router = res
    parts = _router_parts(precision)
    with jax.default_matmul_precision(precision):   # the forward's, for JAX's backward elsewhere
        return lax.platform_dependent(g, cuda=lambda g: router_grads_split(x, router, g, parts),
                                      default=lambda g: jax.vjp(_logits, x, router)[1](g))


_router_logits_bf16.defvjp(_router_logits_bf16_fwd, _router_logits_bf16_bwd)


def router_grads_split(x: jax.Array, router: jax.Array, g: jax.Array, parts: int = 2
                       ) -> tuple[jax.Array, jax.Array]:
    """(d x, d router) of the bf16 router GEMM for the float32 logits' gradient ``g``, as bfloat16 GEMMs.

    XLA multiplies the float32 g with the bf16 operands as TF32 GEMMs (10 significand bits of g, at half
    the bf16 rate and with the operand upcast in the kernel: 0.24 ms per DeepSeek-V3 step on an H200).
    Here g is split into ``parts`` bfloat16 values whose sum is g to 16 significand bits (two parts) or to
    float32's 24 (three: ``router_logits`` takes them under ``jax.default_matmul_precision("highest")``);
    each part times a bf16 operand is exact in float32, so the float32 sums of the parts' products are at
    least as precise as XLA's TF32 GEMMs. The parts go side by side into one GEMM per gradient: d x
    contracts [T, n·E] with the router repeated n times, d router is x^T times [T, n·E], its n column
    blocks summed."""
    if parts not in (2, 3):
        raise EPValueError(f"router_grads_split: parts must be 2 or 3, got {parts!r}")
    x_shape = x.shape   # [..., H] tokens (router_logits takes any leading shape): as [T, H] here
    x, g = x.reshape(-1, x_shape[-1]), g.reshape(-1, g.shape[-1])
    split, rest = [], g
    for _ in range(parts):
        # a part rounded by reduce_precision, which XLA never folds away as it may a convert round trip
        part = lax.reduce_precision(rest, exponent_bits=8, mantissa_bits=7)
        split.append(part.astype(jnp.bfloat16))                                       # exact
        rest = rest - part
    e = g.shape[-1]
    gs = jnp.concatenate(split, axis=-1)                                              # [T, n·E]
    dx = jnp.dot(gs, jnp.concatenate([router] * parts, axis=-1).T, preferred_element_type=jnp.float32)
    dr = jnp.dot(x.T, gs, preferred_element_type=jnp.float32)                          # [H, n·E]
    dr = dr.reshape(dr.shape[0], parts, e).sum(axis=1)                                # [H, E]
    # typed as their primals inside shard_map: a replicated router's gradient summed over the ranks
    return tuple(sum_to(vary_also(d, varying_axes(p)), varying_axes(p)).astype(p.dtype)
                 for d, p in ((dx.reshape(x_shape), x), (dr, router)))


def _float_dtype(name: str, value) -> np.dtype:
    """MoE's ``name`` (dtype / param_dtype) as a floating dtype, or an error naming it and the value."""
    try:
        dtype = jnp.dtype(value)
    except TypeError as e:
        raise EPTypeError(f"MoE: {name} must be a floating dtype (e.g. jnp.bfloat16 or 'float32'), got "
                          f"{value!r} ({type_name(value)})") from e
    if not jnp.issubdtype(dtype, jnp.floating):
        raise EPValueError(f"MoE: {name} must be a floating dtype, got {dtype}")
    return dtype


class MoE(nnx.Module):
    """Mixture-of-Experts FFN layer with expert parallelism (Flax NNX).

    ``MoE(hidden, ffn_hidden, routing, rngs=..., mesh=...)``, e.g.
    ``MoE(1024, 512, RouterConfig(num_experts=64, num_topk=6), rngs=nnx.Rngs(0), mesh=mesh)``.

    Args:
      hidden: H, the model width (last axis of the input and output).
      ffn_hidden: width of each routed expert's SwiGLU.
      routing: the router (``jax_ep.gating.RouterConfig``): number of experts E, top-k K, score function,
        group limit, node cap (give its ``ranks_per_node``), rank cap, weight scaling. Leave its ``ep_size``
        at 1: the layer sets it to its EP size.
      rngs: parameter initialisation.
      mesh: the device mesh, to call the layer with global arrays (below); None to call it inside your
        own ``shard_map``.
      axis_name: the mesh axis the experts are sharded over (the EP axis).
      batch_axes: mesh axes the tokens are sharded over (default: every axis of the mesh, e.g. data x ep;
        with ``mesh=None``, the EP axes: name every other axis of your shard_map the tokens are split
        over, or the statistics count one shard's tokens; not one they are replicated over, e.g. all-gathered
        for sequence parallelism, nor a pipeline axis); a tuple, the EP axes among them (checked with
        ``mesh=None`` too). Statistics are summed over them.
      ep: dispatch/combine options (``EPOptions``: capacity, expert alignment, dispatch dtype, backend,
        checked mode, CUDA kernel configuration). None: ``EPOptions()``.
      balancing: ``jax_ep.balancing.BalancingConfig`` (aux-loss-free bias update rate, sequence-wise aux
        loss coefficient). None: ``BalancingConfig()``, no balancing.
      shared_ffn_hidden: width of a dense SwiGLU shared expert every token runs (0 = none).
      placement: expert placement (``jax_ep.eplb.Placement``, EPLB replicas of hot experts) or None
        (expert e on rank e // (E / ep_size)); re-plan later with ``set_placement``.
      gemm: the expert GEMM's backend (``jax_ep.grouped_matmul``): "auto", "mosaic_gpu" or "ragged_dot".
      gemm_dtype: None (the expert GEMMs in the compute dtype) or "float8_e4m3fn": both expert GEMMs of the
        throughput path (training, prefill) in FP8 as DeepSeek-V3 trains them (``jax_ep.gemm_fp8``:
        rows per 128 channels, weights per 128 x 128 block, dx in FP8, dw in bfloat16; hidden and
        ffn_hidden multiples of 128). The decode path keeps the compute dtype. Measured slower than bf16 per
        step at 32-128 local experts when every step quantises the weights (docs/api.md); with gradient
        accumulation, quantise them once per optimiser step (``quantize_weights``) and pass them to each
        micro-batch's call (``fp8_weights=``).
      fp8_weight_grad: with gemm_dtype="float8_e4m3fn", the expert weight gradients in FP8 too
        (``fp8_grouped_matmul(weight_grad="fp8")``: rows and dy quantised 128 x 1 along the tokens, as
        DeepSeek-V3's backward does) instead of bfloat16 from the FP8 rows. Opt-in: slower than the
        bfloat16 weight gradient on an H200 at DeepSeek-V3's shapes (docs/api.md).
      swiglu_backend: the routed experts' SwiGLU on the throughput path (``jax_ep.swiglu``): "auto"
        (default: the kernels on a Hopper GPU when the buffer fits them, else XLA's; ``swiglu.choose``),
        "xla" (XLA's elementwise fusions over every row of the dispatch buffer) or "pallas" (Triton
        kernels over the rows that hold rows only; GPU).
      gemm_num_sms: the SMs the expert GEMM kernels take (``jax_ep.grouped_matmul``'s ``num_sms``): None
        (default) every SM; fewer leave SMs to the EP exchanges, which run beside the GEMMs only on an
        XLA stream of their own (``KernelConfig(async_stream=..., num_sms=...)``) and only on SMs the
        GEMMs leave free: e.g. two micro-batches in one jitted step, one's exchange beside the other's
        GEMMs (``python -m benchmarks --layer``, configs ``*_mb2``). With jax 0.11.2 XLA runs nothing
        beside those calls (``KernelConfig``'s async_stream), so today this only costs GEMM speed.
      dtype: compute dtype of the routed experts: tokens are cast to it for dispatch and the expert GEMMs,
        the output back to x's dtype (None: x's dtype). "bfloat16" puts a float32 model's experts on the
        Hopper kernels. The router takes the cast tokens too (its logits stay float32), as DeepSeek-V3's
        gate takes the bf16 activations: with "bfloat16" on a float32 model some tokens pick other experts
        than the float32 router on x would. The shared expert takes x as given.
      param_dtype: dtype of the parameters (a floating dtype).
      decode: the default of ``__call__``'s ``decode``: False, the throughput ops (training, prefill);
        True, the low-latency ops (decode steps, forward only). ``nnx.view(model, decode=True)`` sets it
        (``set_view``), as it sets ``nnx.MultiHeadAttention``'s.
      node_axis: None (flat EP over ``axis_name``), or a second mesh axis, the nodes: the EP group is
        then ``node_axis`` x ``axis_name`` (node-major; the expert weights sharded over both) and the
        routed experts run through ``jax_ep.dispatch_hierarchical`` / ``combine_hierarchical`` (each
        token crosses to each destination node once, then is forwarded inside the node). The router's
        ``ranks_per_node`` is the size of ``axis_name`` (another value is an error). Not with a
        placement, rank masks or the decode path.

    Parameters: ``router [H, E]``, ``w_gate_up [E, H, 2 * ffn_hidden]`` (gate columns, then up columns),
    ``w_down [E, ffn_hidden, H]`` (experts sharded over ``axis_name`` at rest), ``shared`` (or None).
    State (non-trainable ``nnx.Variable``s, updated by each call unless ``update_stats=False``):
    ``expert_bias [E]`` (the balancing bias), ``last_load`` / ``total_load [E]`` (tokens the router sent
    to each logical expert, before capacity drops and rank masks: the demand that bias balancing and
    ``eplb.plan_placement`` take; in the last call / summed over calls), ``last_slot_load`` /
    ``total_slot_load [num_slots]`` (rows each physical slot received, after drops), ``last_dropped``
    (rows dropped for capacity, and pairs a rank mask sends nowhere),
    ``last_aux_loss`` (also ``aux_loss``).

    Calling: ``layer(x)`` with ``x [..., H]`` returns ``[..., H]`` in x's dtype: for each token the
    gate-weighted sum of its experts' outputs, plus the shared expert's. Two ways:

      * ``mesh=mesh``: from a plain ``jax.jit`` (or ``nnx.jit``) model with global arrays; the layer
        enters ``shard_map`` itself (tokens sharded over ``batch_axes``, experts over ``axis_name``).
      * ``mesh=None``: from inside your own ``shard_map`` body over (at least) ``axis_name`` (per-rank
        view): x is this rank's tokens, and the expert weights you pass in must be this rank's shard
        (``E / ep_size`` experts, ``PartitionSpec(axis_name)``), or all E of them (``PartitionSpec()``)
        when the layer has a placement.

    A leading ``[B, S]`` of x makes each sequence of S tokens one sequence of the aux loss (each token
    shard must then hold whole sequences: B a multiple of the shards); a 1-D token list is one sequence
    per rank.

    Decoding: ``layer(x, decode=True)`` computes the same function with ``jax_ep.ll_dispatch`` /
    ``ll_combine`` (low-latency mode: fixed slots per (local expert, source rank), no layout pass, no
    capacity, no drops; the CUDA kernels where ``ep.backend`` resolves to them). The routed experts
    run as one batched GEMM over every slot of each local expert (``[E_local, R*T, H]``, slots past
    the received counts zeroed first; ``ll_combine`` never reads their outputs). Differences from the
    throughput path: the tokens are rounded to bfloat16 (or FP8, ``ep.dispatch_dtype``) for the wire
    and the routed output is rounded once to bfloat16 (``docs/api.md``); decode applies the gate weights
    in ``ll_combine``, where the throughput path's default on the flat exchange scales SwiGLU's rows
    before their bf16 rounding (``EPOptions.gate_weights``); ``gemm`` plays no part;
    forward only (``jax.grad`` raises). The statistics are the same (rows per expert; never dropped),
    but are not recorded unless ``update_stats=True``: a decode step leaves the balancing bias alone.
    """

    def __init__(self, hidden: int, ffn_hidden: int, routing: RouterConfig, *, rngs: nnx.Rngs,
                 mesh: Mesh | None = None, axis_name: str = "ep", batch_axes: tuple[str, ...] | None = None,
                 ep: EPOptions | None = None, balancing: BalancingConfig | None = None,
                 shared_ffn_hidden: int = 0, placement: eplb.Placement | None = None, gemm: str = "auto",
                 dtype=None, param_dtype=jnp.float32, decode: bool = False, node_axis: str | None = None,
                 gemm_dtype: str | None = None, fp8_weight_grad: bool = False, swiglu_backend: str = "auto",
                 gemm_num_sms: int | None = None):
        ep = EPOptions() if ep is None else ep
        balancing = BalancingConfig() if balancing is None else balancing
        # here, not where they are first used (numpy's TypeError, jax.random's, an AttributeError, or a
        # call that blamed x for an int compute dtype)
        if not isinstance(rngs, nnx.Rngs):
            raise EPTypeError(f"MoE: rngs must be a flax.nnx.Rngs, got {rngs!r} ({type_name(rngs)})")
        param_dtype = _float_dtype("param_dtype", param_dtype)
        for name, value, kind in (("routing", routing, RouterConfig), ("ep", ep, EPOptions),
                                  ("balancing", balancing, BalancingConfig)):
            if not isinstance(value, kind):
                raise EPTypeError(f"MoE: {name} must be a {kind.__module__}.{kind.__name__}, got {value!r}")
        # check_option's Python ints (a NumPy int is accepted): the same static shapes and jit cache keys
        hidden, ffn_hidden, shared_ffn_hidden = (
            check_option("MoE:", name, value, "int", minimum) for name, value, minimum in (
                ("hidden", hidden, 1), ("ffn_hidden", ffn_hidden, 1),
                ("shared_ffn_hidden", shared_ffn_hidden, 0)))
        for name, value, kind, minimum in (("axis_name", axis_name, "name", 1),
                                           ("node_axis", node_axis, "name?", 1),
                                           ("gemm", gemm, GEMM_BACKENDS, 1), ("decode", decode, "bool", 1),
                                           ("fp8_weight_grad", fp8_weight_grad, "bool", 1),
                                           ("swiglu_backend", swiglu_backend, SWIGLU_BACKENDS, 1)):
            check_option("MoE:", name, value, kind, minimum)
        gemm_num_sms = check_option("MoE:", "gemm_num_sms", gemm_num_sms, "int?")
        if gemm_dtype not in GEMM_DTYPES:
            raise EPValueError(f"MoE: gemm_dtype must be one of {GEMM_DTYPES}, got {gemm_dtype!r}")
        if fp8_weight_grad and gemm_dtype is None:
            raise EPValueError("MoE: fp8_weight_grad=True needs gemm_dtype='float8_e4m3fn' (the weight "
                               "gradients of FP8 expert GEMMs)")
        if gemm_dtype is not None:
            check_fp8_channels(f"MoE: gemm_dtype={gemm_dtype!r}", hidden=hidden, ffn_hidden=ffn_hidden)
        if ep.dispatch_dtype == "float8_e4m3fn":   # what the layer's EPConfig would refuse at trace time
            check_fp8_channels("MoE: ep.dispatch_dtype='float8_e4m3fn'", hidden=hidden)
        if mesh is not None and not isinstance(mesh, Mesh):
            raise EPTypeError(f"MoE: mesh must be a jax.sharding.Mesh or None, got {type(mesh).__name__}")
        if mesh is not None and axis_name not in mesh.axis_names:
            raise EPValueError(f"MoE: axis_name={axis_name!r} is not an axis of the mesh {mesh.axis_names}")
        if mesh is not None and manual_axes():   # JAX's "pspec ... contains a manual axes" named no way out
            raise EPValueError(
                f"MoE: built with mesh= inside a shard_map over {manual_axes()}: a layer with a mesh enters "
                "shard_map itself; build it with mesh=None to call it there (on this rank's tokens and "
                "expert shard), or build it outside")
        if node_axis is not None:
            self._check_node_axis(node_axis, axis_name, mesh, routing, decode)
            if ep.gate_weights == "experts":
                raise EPValueError(_no_hierarchical_gate_weights(node_axis))
        self.hidden, self.ffn_hidden = hidden, ffn_hidden
        self.routing, self.ep, self.balancing = routing, ep, balancing
        self.mesh, self.axis_name, self.node_axis = mesh, axis_name, node_axis
        # tokens are split over every mesh axis by default (data x ep); experts over the EP axis only
        if batch_axes is not None:   # with mesh=None too: one without the EP axes counted one rank's tokens
            batch_axes = self._check_batch_axes(batch_axes, mesh)
        self.batch_axes = batch_axes if batch_axes is not None else (
            tuple(mesh.axis_names) if mesh is not None
            else (axis_name,) if node_axis is None else (node_axis, axis_name))
        self.gemm, self.gemm_dtype, self.fp8_weight_grad = gemm, gemm_dtype, fp8_weight_grad
        self.swiglu_backend, self.gemm_num_sms = swiglu_backend, gemm_num_sms
        self.dtype = None if dtype is None else _float_dtype("dtype", dtype)
        self.decode = bool(decode)

        self._set_placement_tables(placement)
        self.rank_mask = nnx.data(None)  # None: every rank active (set_rank_mask / clear_rank_mask)
        if mesh is not None:
            self._router_config(self.mesh_ep_size, placement is not None, mesh.shape[axis_name])

        num_experts = routing.num_experts
        init = nnx.initializers.lecun_normal()
        # Logical expert weights, sharded over the EP axis at rest. With a placement, each step gathers the
        # slots' weights from all of them: inside your own shard_map (mesh=None) pass them whole.
        shardable = mesh is not None and num_experts % self.mesh_ep_size == 0
        expert_spec = (self.ep_axes if placement is None or shardable else None, None, None)
        self.router = nnx.Param(init(rngs.params(), (hidden, num_experts), param_dtype))
        # gate and up projections side by side: one grouped GEMM of twice the width
        w_gate, w_up = (init(key, (num_experts, hidden, ffn_hidden), param_dtype)
                        for key in (rngs.params(), rngs.params()))
        self.w_gate_up = nnx.Param(jnp.concatenate([w_gate, w_up], axis=2),
                                   out_sharding=expert_spec, eager_sharding=False)
        self.w_down = nnx.Param(init(rngs.params(), (num_experts, ffn_hidden, hidden), param_dtype),
                                out_sharding=expert_spec, eager_sharding=False)
        self.shared = nnx.data(SwiGLU(hidden, shared_ffn_hidden, rngs=rngs, param_dtype=param_dtype)
                               if shared_ffn_hidden else None)
        self.expert_bias = ExpertBias(jnp.zeros((num_experts,), jnp.float32))
        self.last_load = ExpertLoad(jnp.zeros((num_experts,), jnp.int32))
        self.total_load = ExpertLoad(jnp.zeros((num_experts,), jnp.float32))
        self._reset_slot_stats()
        self.last_dropped = ExpertLoad(jnp.zeros((), jnp.int32))
        self.last_aux_loss = ExpertLoad(jnp.zeros((), jnp.float32))
        if mesh is not None:
            # On the mesh from the start, as a jitted step returns them: expert weights over the EP axis,
            # the rest replicated. Left on the default device, every call of a jitted step would copy
            # them to the mesh again (measured: 35 of a 57 ms DeepSeek-V3 layer step on 2x H200).
            state = nnx.state(self)
            nnx.update(self, jax.tree.map(self._on_mesh, state, nnx.get_partition_spec(state)))

    def _check_batch_axes(self, batch_axes, mesh: Mesh | None) -> tuple[str, ...]:
        """batch_axes as a tuple: axes of the mesh (with ``mesh=None`` not checkable here), the EP axes
        among them (each EP rank holds its own tokens; the statistics are summed over these axes)."""
        # a str is refused, not split: tuple("data") is ('d', 'a', 't', 'a')
        if isinstance(batch_axes, str) or not isinstance(batch_axes, (tuple, list)) \
                or not all(isinstance(a, str) for a in batch_axes):
            raise EPTypeError(f"MoE: batch_axes must be a tuple of mesh axis names, got {batch_axes!r}")
        batch_axes = tuple(batch_axes)
        unknown = [] if mesh is None else [a for a in batch_axes if a not in mesh.axis_names]
        if unknown:
            raise EPValueError(f"MoE: batch_axes={tuple(batch_axes)!r} names {unknown}, not axes of the mesh "
                               f"{mesh.axis_names}")
        missing = [a for a in (self.axis_name, self.node_axis) if a is not None and a not in batch_axes]
        if missing:
            raise EPValueError(f"MoE: batch_axes={tuple(batch_axes)!r} must include the EP axes {missing}: "
                               "each EP rank routes its own tokens")
        return batch_axes

    def _on_mesh(self, value, spec=None):
        """``value`` placed on the layer's mesh with ``spec`` (a global array on every process)."""
        sharding = NamedSharding(self.mesh, P() if spec is None else spec)
        if isinstance(value, jax.core.Tracer):  # built inside a trace (nnx.jit, nnx.eval_shape)
            return jax.lax.with_sharding_constraint(value, sharding)
        if jax.process_count() == 1:
            return jax.device_put(value, sharding)
        host = np.asarray(value)  # each process made the same values (same seed): take its shards
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    @property
    def ep_axes(self) -> str | tuple[str, str]:
        """The mesh axes the experts are sharded over: ``axis_name``, or ``(node_axis, axis_name)``
        (node-major: global EP rank = node * L + local) for the hierarchical path."""
        return self.axis_name if self.node_axis is None else (self.node_axis, self.axis_name)

    @property
    def mesh_ep_size(self) -> int | None:
        """The EP size on the layer's mesh (None without a mesh)."""
        if self.mesh is None:
            return None
        axes = (self.axis_name,) if self.node_axis is None else (self.node_axis, self.axis_name)
        return int(np.prod([self.mesh.shape[a] for a in axes]))

    @staticmethod
    def _check_node_axis(node_axis, axis_name, mesh, routing: RouterConfig, decode) -> None:
        """The hierarchical path's static conditions (``node_axis``): a second mesh axis, a node cap
        that names the mesh's node size, and what it does not build."""
        if not isinstance(node_axis, str) or not node_axis or node_axis == axis_name:
            raise EPValueError(f"MoE: node_axis must be a mesh axis name other than axis_name={axis_name!r}, "
                               f"got {node_axis!r}")
        if mesh is not None and node_axis not in mesh.axis_names:
            raise EPValueError(f"MoE: node_axis={node_axis!r} is not an axis of the mesh {mesh.axis_names}")
        if mesh is not None and routing.ranks_per_node not in (None, mesh.shape[axis_name]):
            raise EPValueError(f"MoE: routing.ranks_per_node={routing.ranks_per_node}, but with "
                               f"node_axis={node_axis!r} a node is the mesh axis {axis_name!r} of "
                               f"{mesh.shape[axis_name]} ranks; set ranks_per_node={mesh.shape[axis_name]} "
                               "(or None: the layer takes it from the mesh)")
        if decode:
            raise EPUnsupportedError(_NO_HIERARCHICAL_DECODE)

    @property
    def num_experts(self) -> int:
        """E, the logical experts (``routing.num_experts``)."""
        return self.routing.num_experts

    @property
    def num_topk(self) -> int:
        """K, the experts each token picks (``routing.num_topk``)."""
        return self.routing.num_topk

    # ---------------------------------------------------------------------------------------------
    # Placement
    @property
    def placement(self) -> eplb.Placement | None:
        """The expert placement (None: expert e on rank e // (E / ep_size), one slot per expert)."""
        if self.physical_to_logical is None:
            return None
        return eplb.Placement(self.physical_to_logical[...], self.replica_counts[...],
                              self.logical_to_physical[...], self.placement_ranks, self.slots_per_rank)

    @property
    def num_slots(self) -> int:
        """Physical expert slots the dispatch runs over (num_experts without a placement)."""
        return self.num_experts if self.physical_to_logical is None else int(
            self.physical_to_logical.shape[0])   # .shape: an abstract layer (nnx.eval_shape) has no values

    def set_placement(self, placement: eplb.Placement | None) -> None:
        """Re-plan (outside jit), e.g. `eplb.plan_placement(layer.total_load[...], R, S, max_replicas=M)`.

        Parameters are untouched. A placement with the same sizes (and `max_replicas`) does not
        recompile the step; the per-slot load statistics restart when the slot count changes.
        """
        old_slots = self.num_slots
        self._set_placement_tables(placement)
        if self.num_slots != old_slots:
            self._reset_slot_stats()

    def check_placement(self, placement: eplb.Placement | None) -> None:
        """Raises what ``set_placement(placement)`` would raise; changes nothing (a caller setting the
        placements of several layers checks them all first)."""
        if placement is None:
            if self.mesh is not None:   # (set_placement(None), a restore dropping it: checked there too)
                _check_experts_divide(self.num_experts, self.mesh_ep_size, self.axis_name, self.node_axis)
            return
        if not isinstance(placement, eplb.Placement):
            raise EPValueError(f"MoE: placement must be a jax_ep.eplb.Placement or None, got "
                               f"{type(placement).__name__}")
        if placement.num_experts != self.num_experts:
            raise EPValueError(f"MoE: the placement is for {placement.num_experts} experts, the layer has "
                               f"{self.num_experts}")
        eplb.check_placement(placement, "MoE: placement")
        if self.node_axis is not None:
            raise EPUnsupportedError("MoE: node_axis (hierarchical dispatch) with an expert placement "
                                     "is not built; use placement=None or node_axis=None")
        if self.mesh is not None:
            self._check_placement_ranks(placement, self.mesh.shape[self.axis_name])

    def _set_placement_tables(self, placement: eplb.Placement | None) -> None:
        self.check_placement(placement)
        if placement is None:
            # data, not static: a later set_placement puts variables here (NNX refuses variables in an
            # attribute it recorded as static)
            self.physical_to_logical = nnx.data(None)
            self.logical_to_physical = nnx.data(None)
            self.replica_counts = nnx.data(None)
            self.placement_ranks = self.slots_per_rank = None
            return
        # replicated over the mesh, as a jitted step returns them: re-planning then does not recompile
        put = (lambda a: jnp.asarray(a, jnp.int32)) if self.mesh is None else (
            lambda a: self._on_mesh(jnp.asarray(a, jnp.int32)))
        self.physical_to_logical = ExpertPlacement(put(placement.physical_to_logical))
        self.logical_to_physical = ExpertPlacement(put(placement.logical_to_physical))
        self.replica_counts = ExpertPlacement(put(placement.replica_counts))
        self.placement_ranks, self.slots_per_rank = placement.num_ranks, placement.slots_per_rank

    def _check_placement_ranks(self, placement: eplb.Placement, ep_size: int) -> None:
        """At construction with a mesh, else when the layer runs (inside the caller's shard_map)."""
        if placement.num_ranks != ep_size:
            raise EPValueError(f"MoE: the placement is for {placement.num_ranks} ranks, the mesh axis "
                               f"{self.axis_name!r} has {ep_size}")

    def _reset_slot_stats(self) -> None:
        self.last_slot_load = ExpertLoad(jnp.zeros((self.num_slots,), jnp.int32))
        self.total_slot_load = ExpertLoad(jnp.zeros((self.num_slots,), jnp.float32))

    # ---------------------------------------------------------------------------------------------
    # Rank masking (issue 15 item 1)
    def set_rank_mask(self, mask) -> None:
        """Mask EP ranks (outside jit): ``mask`` [R] bool or integer, nonzero = active. A masked rank
        sends and receives nothing: its tokens get no routed-expert output, its experts no rows.
        Routing is unchanged; slots that go nowhere (a masked rank's tokens, experts on masked ranks;
        with a placement, experts with no replica on an active rank) are dropped (their gate weights
        are lost, as with capacity drops; counted in ``last_dropped``). Any backend, the throughput and
        the decode path (docs/api.md, "Rank masking").
        Setting a mask on a layer without one (or clearing it) recompiles the step; changing its
        values does not."""
        if self.node_axis is not None:
            raise EPUnsupportedError("MoE.set_rank_mask: rank masking is not built for node_axis "
                                     "(hierarchical dispatch)")
        if not hasattr(mask, "dtype"):
            mask = jnp.asarray(mask)
        if mask.ndim != 1 or not (mask.dtype == jnp.bool_ or jnp.issubdtype(mask.dtype, jnp.integer)):
            raise EPValueError(
                f"MoE.set_rank_mask: mask must be a 1-D bool or integer array (one flag per EP "
                f"rank), got {mask.dtype}{list(mask.shape)}")
        if self.mesh is not None and mask.shape[0] != self.mesh.shape[self.axis_name]:
            raise EPValueError(f"MoE.set_rank_mask: mask has {mask.shape[0]} flags, the mesh axis "
                               f"{self.axis_name!r} has {self.mesh.shape[self.axis_name]} ranks")
        active = jnp.asarray(mask) != 0
        if self.mesh is not None:  # replicated, as a jitted step returns it: no recompile on a change
            active = self._on_mesh(active)
        self.rank_mask = RankMask(active)

    def clear_rank_mask(self) -> None:
        """Every rank active again (the default)."""
        self.rank_mask = nnx.data(None)

    def set_view(self, decode: bool | None = None) -> None:
        """``nnx.view(model, decode=True)`` / ``nnx.view(model, decode=False)``: the default path of
        ``__call__`` (the low-latency ops for decode steps, or the throughput ops)."""
        check_option("MoE:", "decode", decode, "bool?")   # as MoE(decode=...): bool("False") is True
        if decode is not None:
            self.decode = decode

    # ---------------------------------------------------------------------------------------------
    def __call__(self, x: jax.Array, *, decode: bool | None = None,
                 update_stats: bool | None = None, fp8_weights: ExpertFP8Weights | None = None,
                 token_mask: jax.Array | None = None) -> jax.Array:
        """x: [..., hidden] (global if the layer has a mesh, this rank's tokens otherwise) -> [..., hidden]
        in x's dtype.

        ``decode``: None takes ``self.decode``; True runs the low-latency ops (decode steps, forward only),
        False the throughput ops (training, prefill). ``update_stats``: record the loads, bias update and
        aux loss in the layer's state; None (default) means True for the throughput path and False for
        decode; False leaves the state untouched. ``fp8_weights``: with ``gemm_dtype="float8_e4m3fn"``,
        the expert weights already quantised (``quantize_weights()``, from their current values) instead
        of quantising them in this call: the same result, gradients included (they flow to the bfloat16
        weights), without the per-call quantisation. On the decode path they put the expert GEMMs in FP8
        (half the weight bytes each step reads); without them decode runs its GEMMs in the compute dtype
        (quantising the weights every step would read more than it saves). ``token_mask``: bool
        ``x.shape[:-1]``, False for padding tokens: they go to no routed expert (no exchange, no capacity;
        their routed output is 0, the shared expert's still added) and count in no statistic (loads,
        bias update, aux loss)."""
        check_option("MoE:", "decode", decode, "bool?")   # as MoE(decode=...): bool("False") is True
        check_option("MoE:", "update_stats", update_stats, "bool?")
        decode = self.decode if decode is None else bool(decode)
        if fp8_weights is not None:
            self._check_fp8_weights(fp8_weights)
        if update_stats is None:
            update_stats = not decode
        if x.shape[-1] != self.hidden:
            raise EPValueError(f"MoE: x has hidden size {x.shape[-1]}, the layer expects {self.hidden}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise EPValueError(f"MoE: x must be floating point, got {x.dtype}")
        lead = x.shape[:-1]
        tokens = x.reshape(-1, self.hidden)
        if token_mask is not None:
            if getattr(token_mask, "shape", None) != lead or getattr(token_mask, "dtype", None) != jnp.bool_:
                raise EPValueError(f"MoE: token_mask must be bool of x's token shape {lead}, got "
                                   f"{getattr(token_mask, 'dtype', type(token_mask).__name__)}"
                                   f"{tuple(getattr(token_mask, 'shape', ()))}")
            token_mask = token_mask.reshape(-1)
        routed = tokens if self.dtype is None else tokens.astype(self.dtype)
        seq_len = lead[-1] if len(lead) >= 2 else None  # None: this rank's tokens are one sequence
        params = (self.router[...], self.w_gate_up[...], self.w_down[...], self.expert_bias[...],
                  self.placement, None if self.rank_mask is None else self.rank_mask[...])
        # the shared expert inside the per-rank function, to run beside the last combine (EPOptions)
        beside = self.shared is not None and self.ep.shared_beside
        shared = (tokens, self.shared.weights()) if beside else None
        shards = 1 if self.mesh is None else int(np.prod([self.mesh.shape[a] for a in self.batch_axes]))
        if update_stats:   # the aux loss is computed only to be recorded
            self._check_sequences(x.shape, tokens.shape[0], shards, seq_len)
        if self.mesh is None:
            out, stats, shared_out = self._per_rank(routed, *params, fp8_weights, shared, token_mask,
                                                    seq_len=seq_len, decode=decode, aux=update_stats)
        else:
            manual = manual_axes()
            if manual:
                raise EPValueError(
                    f"MoE: the layer was built with mesh= and enters shard_map itself, but it is called "
                    f"inside a shard_map over {manual}: build it with mesh=None to call it there (on this "
                    "rank's tokens and expert shard), or call it outside")
            batch = P(self.batch_axes)
            if tokens.shape[0] % shards:
                raise EPValueError(
                    f"MoE: x has {tokens.shape[0]} tokens (shape {tuple(x.shape)}), which do not split "
                    f"evenly over the {shards} devices of the batch axes {self.batch_axes}: pass a "
                    f"multiple of {shards} tokens (pad the batch), or set batch_axes")
            # with a placement every rank gathers its slots' weights from all logical experts
            experts = P(self.ep_axes) if self.placement is None else P()
            body = jax.shard_map(
                lambda *a: self._per_rank(*a, seq_len=seq_len, decode=decode, aux=update_stats),
                mesh=self.mesh,
                in_specs=(batch, P(), experts, experts, P(), P(), P(),
                          None if fp8_weights is None else experts, None if shared is None else (batch, P()),
                          None if token_mask is None else batch),
                out_specs=(batch, MoEStats(P(), P(), P(), P()), batch))
            # ordered as one EP call against the layer's other calls in this trace (overlap.region):
            # with a side-stream overlap, another call's EP calls could run beside its side calls
            out, stats, shared_out = overlap.region(body, routed, *params, fp8_weights, shared, token_mask,
                                                    side=self._side_calls(beside))
        out = out.astype(x.dtype)
        if self.shared is not None:
            if shared_out is None:
                with jax.named_scope(SCOPES["shared"]):
                    shared_out = self.shared(tokens)
            out = out + shared_out
        if update_stats:
            self._record(stats)
        return out.reshape(*lead, self.hidden)

    def _side_calls(self, beside: bool) -> bool:
        """Whether a call of the layer may put EP calls on jax_ep's side stream: an overlap asked for
        (beside: the shared expert's), where the CUDA backend can take the ops (named, or "auto" on GPUs)
        and not on XLA's async stream. Else its region is a plain call (overlap.region: the backward
        then computes no input gradient nobody asks for, and second-order gradients of the reference
        path stay differentiable)."""
        if not (beside or self.ep.weight_grad_beside) or self.ep.kernel.async_stream is not None:
            return False
        if self.ep.backend == "auto":   # on GPUs where the CUDA backend runs here
            return (self.mesh is not None and self.mesh.devices.flat[0].platform == "gpu"
                    and backends.get("cuda").available()[0])
        return self.ep.backend != backends.REFERENCE

    def _check_sequences(self, shape, num_tokens: int, shards: int, seq_len: int | None) -> None:
        """The sequence-wise aux loss takes each shard's tokens as whole sequences of seq_len."""
        if not self.balancing.aux_loss_alpha or seq_len is None or num_tokens % shards:
            return   # (tokens that do not split over the shards: the caller says so)
        per_shard = num_tokens // shards
        if per_shard % seq_len:
            raise EPValueError(
                f"MoE: x of shape {tuple(shape)} puts {per_shard} tokens on each of {shards} token shards, "
                f"not whole sequences of {seq_len}: the sequence-wise aux loss (balancing.aux_loss_alpha="
                f"{self.balancing.aux_loss_alpha}) needs each sequence on one shard; pass a batch of whole "
                f"sequences per shard (B a multiple of {shards}), or x as [tokens, hidden] (each shard's "
                "tokens one sequence)")

    @property
    def aux_loss(self) -> jax.Array:
        """Sequence-wise auxiliary balance loss of the last call that recorded statistics (0 unless
        balancing.aux_loss_alpha > 0; a call with update_stats=False leaves it as it was, a constant).
        Add it to the training loss to use it instead of (or with) bias balancing."""
        return self.last_aux_loss[...]

    def quantize_weights(self, dtype=None) -> ExpertFP8Weights:
        """The expert weights quantised for the FP8 GEMMs (``gemm_dtype="float8_e4m3fn"``), once: pass the
        result to each call of one optimiser step (``layer(x, fp8_weights=...)``, e.g. every micro-batch
        of a gradient accumulation) and quantise again after the weights change. The weights are cast to
        the experts' compute dtype first, as the layer's call casts them: ``dtype``, else the layer's
        ``dtype``, else the parameters' (pass the tokens' dtype when the layer has no ``dtype`` and the
        tokens differ from the parameters). With a mesh each device quantises its own experts."""
        if self.gemm_dtype is None:
            raise EPValueError("MoE.quantize_weights: the layer's expert GEMMs are not FP8 "
                               "(gemm_dtype=None); construct it with gemm_dtype='float8_e4m3fn'")
        weights = (self.w_gate_up[...], self.w_down[...])
        dtype = jnp.dtype(dtype or self.dtype or weights[0].dtype)
        quantize = functools.partial(quantize_expert_weights, dtype=dtype)
        if self.mesh is None:
            return quantize(*weights)
        experts = P(self.ep_axes) if self.placement is None else P()
        return jax.shard_map(quantize, mesh=self.mesh, in_specs=(experts, experts),
                             out_specs=experts)(*weights)

    def _check_fp8_weights(self, fp8_weights) -> None:
        if self.gemm_dtype is None:
            raise EPValueError("MoE: fp8_weights were given but the layer's expert GEMMs are not FP8 "
                               "(gemm_dtype=None)")
        if not isinstance(fp8_weights, ExpertFP8Weights):
            raise EPTypeError("MoE: fp8_weights must be the ExpertFP8Weights of MoE.quantize_weights(), got "
                              f"{type(fp8_weights).__name__}")

    def _record(self, stats: MoEStats) -> None:
        self.last_load[...] = stats.expert_load
        self.total_load[...] = self.total_load[...] + stats.expert_load.astype(jnp.float32)
        self.last_slot_load[...] = stats.slot_load
        self.total_slot_load[...] = self.total_slot_load[...] + stats.slot_load.astype(jnp.float32)
        self.last_dropped[...] = stats.num_dropped
        self.last_aux_loss[...] = stats.aux_loss
        if self.balancing.bias_update_rate:
            # the routed load (demand), not the rows received: a capacity drop or a rank mask must not
            # read as underload (the bias would send ever more picks to where they are dropped)
            reachable = None if self.rank_mask is None else self._reachable()
            self.expert_bias[...] = update_bias(self.expert_bias[...], stats.expert_load,
                                                self.balancing.bias_update_rate, reachable)

    def _reachable(self) -> jax.Array:
        """bool [E]: the experts with a slot on an unmasked rank; the others keep their bias."""
        active = self.rank_mask[...].astype(bool)
        if self.physical_to_logical is None:
            return jnp.repeat(active, self.num_experts // active.shape[0])
        p2l = self.physical_to_logical[...]
        slots = jnp.repeat(active, p2l.shape[0] // active.shape[0])
        return jnp.zeros((self.num_experts,), bool).at[p2l].max(slots)

    def _per_rank(self, x, router, w_gate_up, w_down, bias, placement, rank_mask, fp8_weights=None,
                  shared=None, token_mask=None, *, seq_len, decode=False, aux=True):
        """The layer on this rank's tokens: (out, MoEStats, the shared expert's output or None). shared:
        (tokens, the shared expert's weights) to compute it here, beside the last combine, or None."""
        try:
            ep_size = lax.axis_size(self.ep_axes)
        except NameError as e:
            raise EPValueError(f"MoE: axis_name={self.axis_name!r}" + (
                "" if self.node_axis is None else f" (node_axis={self.node_axis!r})") + " is not bound here: "
                "built without a mesh, the layer must be called inside a shard_map over it") from e
        rank = lax.axis_index(self.ep_axes)  # node-major on the hierarchical path
        if decode and self.node_axis is not None:
            raise EPUnsupportedError(_NO_HIERARCHICAL_DECODE)
        if rank_mask is not None:
            if rank_mask.shape != (ep_size,):
                raise EPValueError(f"MoE: the rank mask has shape {rank_mask.shape}, the mesh axis "
                                   f"{self.axis_name!r} has {ep_size} ranks")
        if placement is None:
            _check_experts_divide(self.num_experts, ep_size, self.axis_name, self.node_axis)
            num_slots, local_slots = self.num_experts, self.num_experts // ep_size
            if w_gate_up.shape[0] != local_slots:
                raise EPValueError(f"MoE: this rank holds {w_gate_up.shape[0]} experts but num_experts / "
                                   f"ep_size = {local_slots}; inside your own shard_map pass expert weights "
                                   f"with PartitionSpec({self.axis_name!r})")
        else:
            num_slots, local_slots = placement.num_slots, placement.slots_per_rank
            self._check_placement_ranks(placement, ep_size)
            if w_gate_up.shape[0] != self.num_experts:
                raise EPValueError(f"MoE: with a placement every rank needs all {self.num_experts} logical "
                                   f"experts' weights, got {w_gate_up.shape[0]}; inside your own shard_map "
                                   "pass them with PartitionSpec()")
            # this rank's slots hold these logical experts; gather their weights (gradients add up
            # over the replicas of an expert)
            slot_expert = lax.dynamic_slice_in_dim(placement.physical_to_logical, rank * local_slots,
                                                   local_slots)
            w_gate_up, w_down = w_gate_up[slot_expert], w_down[slot_expert]
            fp8_weights = jax.tree.map(lambda a: a[slot_expert], fp8_weights)
        w_in = jax.ShapeDtypeStruct((local_slots, *w_gate_up.shape[1:]), x.dtype)
        chunks = 1 if decode else self.ep.chunks
        if not x.shape[0]:
            raise EPValueError(f"MoE: x has no tokens on a rank (per-rank shape {tuple(x.shape)}); the layer "
                               "needs at least one token per rank")
        if x.shape[0] % chunks:
            raise EPValueError(f"MoE: EPOptions.chunks={chunks} must divide the tokens per rank, got "
                               f"{x.shape[0]}")
        cfg = self.ep.ep_config(
            num_experts=num_slots, num_topk=self.num_topk, hidden=self.hidden,
            max_tokens_per_rank=x.shape[0] // chunks,
            axis_name=self.axis_name, preferred_alignment=preferred_alignment(
                jax.ShapeDtypeStruct((1, self.hidden), x.dtype), w_in, backend=self.gemm))
        if self._fp8_wire_by_default(decode):
            cfg = cfg.replace(dispatch_dtype="float8_e4m3fn")
        router_cfg = self._router_config(ep_size, placement is not None, lax.axis_size(self.axis_name))
        # named scopes: the layer benchmark splits the step's device time by them (SCOPES)
        with jax.named_scope(SCOPES["router"]):
            logits = router_logits(x, router)
            routing = route(logits, router_cfg, lax.stop_gradient(bias))
            if token_mask is not None:   # padding: unused slots (-1) in every op and statistic
                routing = routing._replace(
                    topk_idx=jnp.where(token_mask[:, None], routing.topk_idx, -1),
                    topk_weights=jnp.where(token_mask[:, None], routing.topk_weights, 0.0))
            topk_idx = routing.topk_idx
            if placement is not None:
                # global token ids, so the replica choice does not repeat on every token shard
                shard = lax.axis_index(self.batch_axes)
                token_ids = shard * x.shape[0] + jnp.arange(x.shape[0], dtype=jnp.int32)
                # under a rank mask, an expert's picks go to its replicas on active ranks
                slot_active = None if rank_mask is None else jnp.repeat(rank_mask, placement.slots_per_rank)
                topk_idx = eplb.apply_placement(topk_idx, placement, token_ids, slot_active)

        if decode:
            out, received, num_dropped, shared_out = self._experts_low_latency(
                x, topk_idx, routing.topk_weights, w_gate_up, w_down, cfg, rank_mask, fp8_weights, shared)
        else:
            out, received, num_dropped, shared_out = self._experts_throughput(
                x, topk_idx, routing.topk_weights, w_gate_up, w_down, cfg, rank_mask, chunks, fp8_weights,
                shared)

        # statistics, summed over all token shards: the rows every rank's slots received (after drops),
        # and the router's picks per logical expert (the demand)
        my_slots = rank * local_slots + jnp.arange(local_slots)
        placed = jnp.zeros((num_slots,), jnp.int32).at[my_slots].set(received)
        slot_load = lax.psum(placed, self.batch_axes)
        load = expert_counts(routing.topk_idx, self.num_experts, axis_name=self.batch_axes)
        dropped = lax.psum(num_dropped, self.batch_axes)
        aux_loss = jnp.zeros((), jnp.float32)
        if self.balancing.aux_loss_alpha and aux:
            # summed over the shards, then divided by the sequences that hold a token (a shard's mean
            # averaged over shards weighed a shard of padding sequences as much as a full one)
            total, sequences = lax.psum(sequence_aux_terms(
                routing.scores, routing.topk_idx, self.num_experts, self.balancing.aux_loss_alpha,
                token_mask=token_mask, sequence_length=seq_len), self.batch_axes)
            aux_loss = total / jnp.maximum(sequences, 1.0)
        return out, MoEStats(load, dropped, aux_loss, slot_load), shared_out

    def _experts_throughput(self, x, topk_idx, topk_weights, w_gate_up, w_down, cfg: EPConfig, rank_mask,
                            chunks: int, fp8_weights: ExpertFP8Weights | None = None, shared=None):
        """dispatch -> gate|up GEMM, SwiGLU, down GEMM -> combine, per chunk of the tokens (EPOptions.chunks),
        chunk i+1 dispatched before chunk i's experts run. shared: (tokens, weights) of the shared expert,
        run beside the last combine (EPOptions.shared_beside), or its gate|up half beside the first dispatch
        and its down GEMM beside the last combine (EPOptions.shared_split). With
        EPOptions.weight_grad_beside each chunk's dispatch and gate|up GEMM are one ``overlap.chain``:
        dispatch's backward beside the GEMM's weight gradient. Returns (out, rows per local expert, pairs
        dropped, the shared expert's output or None)."""
        x_, idx_, wts_ = (jnp.split(a, chunks) for a in (x, topk_idx, topk_weights))
        # EPOptions.shared_split: the shared expert's gate|up half beside the first dispatch, its down GEMM
        # beside the last combine (else all of it beside the last combine)
        split = shared is not None and self.ep.shared_split
        in_experts = self.gate_weights == "experts"
        exchange = (_FlatExchange(cfg, rank_mask, self.ep.dy_in_place) if self.node_axis is None
                    else _HierarchicalExchange(cfg, self.node_axis))
        gemms = _ExpertGEMMs(self.gemm, self.gemm_dtype, self.fp8_weight_grad, self.gemm_num_sms)
        gate_up_q, down_q = (None, None) if fp8_weights is None else fp8_weights
        w_gate_up, w_down = w_gate_up.astype(x.dtype), w_down.astype(x.dtype)

        def dispatch(*args):
            with jax.named_scope(SCOPES["dispatch"]):
                return exchange.dispatch(*args)

        dw_num_sms = self._weight_grad_sms(cfg.kernel)

        def gate_up(sent, w, quantized):
            d, rows = sent
            with jax.named_scope(SCOPES["experts"]):
                # an FP8 wire's rows go into the FP8 gate|up GEMM as they came; `rows` (dequantised)
                # carries their gradient, and is dropped by XLA where nothing else reads it
                scales = getattr(d, "scales", None)
                rows_fp8 = None if scales is None or self.gemm_dtype is None else (d.x, scales)
                gemms.check(fp8_weights, rows_fp8)
                rows_out = gemms.matmul(rows, w, d.group_sizes, quantized, rows_fp8, dw_num_sms)
                return checkpoint_name(rows_out, remat.GATE_UP)   # (jax_ep.remat)

        def send(t):
            """Chunk t dispatched: (dispatch's result, its gate|up GEMM's where run with it, else None)."""
            args = (x_[t], idx_[t], wts_[t])
            if self.ep.weight_grad_beside:   # dispatch's backward beside the GEMM's weight gradient
                # the rank mask an operand of the chain's custom_vjp, not closed over (a tracer closed over
                # escaped under jax.checkpoint)
                def masked_dispatch(x, idx, wts, mask):
                    with jax.named_scope(SCOPES["dispatch"]):
                        ex = exchange if mask is None else dataclasses.replace(exchange, rank_mask=mask)
                        return ex.dispatch(x, idx, wts)
                return overlap.chain(masked_dispatch, (*args, getattr(exchange, "rank_mask", None)), gate_up,
                                     (w_gate_up, gate_up_q))
            return dispatch(*args), None

        def experts_and_back(sent, last):
            received, h = sent
            d = received[0]
            if h is None:
                h = gate_up(received, w_gate_up, gate_up_q)
            with jax.named_scope(SCOPES["experts"]):
                y = gemms.down(h, w_down, d.group_sizes, down_q, self.swiglu_backend,
                               d.handle.row_weights if in_experts else None)
            with jax.named_scope(SCOPES["combine"]):
                if not (last and shared):
                    return exchange.combine(y.astype(x.dtype), d.handle, weighted=not in_experts), None
                fn, fn_args = ((_shared_down, (shared_first.result, shared[1][2])) if split
                               else (_shared_expert, shared))
                with overlap.beside(fn, *fn_args) as work:
                    out = exchange.combine(y.astype(x.dtype), d.handle, weighted=not in_experts)
                return out, work.result

        if split:   # the shared expert's gate|up half beside the first dispatch
            with overlap.beside(_shared_gate_up, shared[0], *shared[1][:2]) as shared_first:
                sent = [send(0)]
        else:
            sent = [send(0)]
        outs = []
        for t in range(chunks):
            if t + 1 < chunks:   # the next chunk's exchange before this chunk's GEMMs (program order)
                sent.append(send(t + 1))
            outs.append(experts_and_back(sent[t], t + 1 == chunks))
        out = jnp.concatenate([o for o, _ in outs])   # (one operand: XLA drops the concatenate)
        received = sum(d.expert_counts for (d, _), _ in sent)
        num_dropped = sum(d.num_dropped for (d, _), _ in sent)
        return out, received, num_dropped, outs[-1][1]

    @property
    def gate_weights(self) -> str:
        """Where the throughput path applies the gate weights, "experts" or "combine": EPOptions.gate_weights
        resolved ("auto" is "experts" on the flat exchange, "combine" with node_axis, where the unweighted
        combine is not built)."""
        if self.ep.gate_weights != "auto":
            return self.ep.gate_weights
        return "experts" if self.node_axis is None else "combine"

    def _weight_grad_sms(self, kernel) -> int | None:
        """The SMs of the gate|up GEMM's weight gradient: with EPOptions.weight_grad_beside and
        KernelConfig.side_num_sms, the GEMMs' SMs but those the exchange beside it takes (a persistent
        GEMM on every SM leaves it none: it waits for the GEMM's end); else None (the GEMMs')."""
        if not self.ep.weight_grad_beside or kernel.side_num_sms is None:
            return None
        sms = _device_sms(self.mesh)
        if not sms:   # not a GPU: no side stream here
            return None
        return max(1, min(self.gemm_num_sms or sms, sms) - kernel.side_num_sms)

    def _fp8_wire_by_default(self, decode: bool) -> bool:
        """EPOptions.dispatch_dtype None with the FP8 expert GEMMs on the throughput path's flat exchange:
        the FP8 wire, whose e4m3 rows the gate|up GEMM takes as they came (the bf16 wire's loss and
        gradients bit for bit with bf16 tokens whose 128-channel blocks have amax 0 or >= 1e-4, the
        wire's floor; half the dispatch bytes, no quantisation of the gate|up
        GEMM's input: measured faster on 2 H200s, 2026-11-30, docs/benchmarks.md session 29). Not for
        decode (its FP8 wire measured 16% slower) nor node_axis (forward-only FP8 wire there)."""
        return (self.ep.dispatch_dtype is None and self.gemm_dtype == "float8_e4m3fn" and not decode
                and self.node_axis is None)

    def _router_config(self, ep_size: int, placed: bool, local: int) -> RouterConfig:
        """The RouterConfig the layer routes with on ``ep_size`` ranks, ``local`` of them on the axis_name
        axis (a node's ranks with a node_axis); RouterConfig checks it. At construction on a mesh (a
        routing the mesh's EP size cannot take is an error there, not at the first call) and per call."""
        if self.routing.ep_size not in (1, ep_size):
            raise EPValueError(f"MoE: routing.ep_size={self.routing.ep_size}, but the mesh axis "
                               f"{self.axis_name!r} has {ep_size} ranks; leave it at 1 (the layer sets it)")
        # ep_size only matters for the rank and node caps, which assume the contiguous logical layout
        capped = not placed or self.routing.max_ranks_per_token is not None \
            or self.routing.max_nodes_per_token is not None
        router_cfg = dataclasses.replace(self.routing, ep_size=ep_size if capped else 1)
        if self.node_axis is not None:   # a node is the local axis: routing.ranks_per_node must match it
            if self.routing.ranks_per_node not in (None, local):
                raise EPValueError(f"MoE: routing.ranks_per_node={self.routing.ranks_per_node}, but with "
                                   f"node_axis={self.node_axis!r} a node is the mesh axis "
                                   f"{self.axis_name!r} of {local} ranks; set ranks_per_node={local} "
                                   "(or None)")
            router_cfg = dataclasses.replace(router_cfg, ep_size=ep_size, ranks_per_node=local)
        return router_cfg

    def _experts_low_latency(self, x, topk_idx, topk_weights, w_gate_up, w_down, cfg: EPConfig,
                             rank_mask=None, fp8_weights=None, shared=None):
        """The routed experts on the low-latency ops (per rank): ll_dispatch, the filled slots gathered
        into rows grouped by local expert, the grouped SwiGLU GEMMs over them, the results put back in
        their slots, ll_combine. rank_mask (bool [R] or None) goes to both ops, as on the throughput
        path: a masked rank sends and receives nothing. Returns (out [T, H] bfloat16, rows per local
        expert [E_local], this rank's pairs dropped: those the mask sends nowhere, 0 without one; the
        low-latency ops drop nothing for capacity, the shared expert's output or None). fp8_weights: the
        expert GEMMs in FP8 from them. shared: (tokens, weights) of the shared expert, run beside the
        dispatch's send phase (ll_dispatch_send, then ll_dispatch_recv: the same bits as ll_dispatch)."""
        # the wire: bfloat16 unless FP8 was asked for (the low-latency ops send nothing else)
        ll_cfg = dataclasses.replace(cfg, dispatch_dtype=self.ep.dispatch_dtype or "bfloat16")
        sent = x if x.dtype in (jnp.bfloat16, jnp.float32) else x.astype(jnp.float32)
        shared_out = None
        with jax.named_scope(SCOPES["dispatch"]):
            if shared is None:
                d = ll_dispatch(sent, topk_idx, topk_weights, ll_cfg, rank_mask=rank_mask)
            else:
                with overlap.beside(_shared_expert, *shared) as work:
                    pending = ll_dispatch_send(sent, topk_idx, topk_weights, ll_cfg, rank_mask=rank_mask)
                d = ll_dispatch_recv(pending, ll_cfg)
                shared_out = work.result
        with jax.named_scope(SCOPES["experts"]):
            y = slot_experts(d.x, d.scales, d.counts, w_gate_up, w_down, min(cfg.num_topk, d.x.shape[0]),
                             x.dtype, self.gemm, fp8_weights, self.gemm_num_sms)
        with jax.named_scope(SCOPES["combine"]):
            out = ll_combine(y, d.handle, ll_cfg, rank_mask=rank_mask)
        return out, jnp.sum(d.counts, axis=1, dtype=jnp.int32), d.num_dropped, shared_out


def _device_sms(mesh: Mesh | None) -> int | None:
    """The SMs of the layer's GPUs (its mesh's, else JAX's default device); None off a GPU."""
    device = mesh.devices.flat[0] if mesh is not None else jax.devices()[0]
    return getattr(device, "core_count", None) if device.platform == "gpu" else None


@dataclasses.dataclass(frozen=True)
class _FlatExchange:
    """The throughput path's exchange over one EP axis: ``jax_ep.dispatch`` / ``combine`` (rank_mask:
    the layer's active ranks or None; dy_in_place: ``EPOptions.dy_in_place``)."""

    cfg: EPConfig
    rank_mask: jax.Array | None
    dy_in_place: bool

    def dispatch(self, x, topk_idx, topk_weights):
        """(Dispatched, its rows in x's dtype). An FP8 wire is trainable here: the rows are its dequantised
        e4m3 rows, whose gradient goes straight through the quantisation (``dispatch_straight_through``)."""
        if self.cfg.dispatch_dtype == "float8_e4m3fn":
            return dispatch_straight_through(x, topk_idx, topk_weights, self.cfg, rank_mask=self.rank_mask)
        d = dispatch(x, topk_idx, topk_weights, self.cfg, rank_mask=self.rank_mask)
        return d, d.x.astype(x.dtype)

    def combine(self, y, handle, weighted=True):
        # y is zero in the alignment padding (dispatch zeroes it, and every expert maps zero rows to
        # zero rows); its rows past the groups are unspecified, and their gradient (y's rows, handed
        # back by combine's backward) reaches only the down GEMM's backward, which skips them
        return combine(y, handle, self.cfg, rank_mask=self.rank_mask, empty_rows_zero=self.dy_in_place,
                       weighted=weighted)


@dataclasses.dataclass(frozen=True)
class _HierarchicalExchange:
    """The throughput path's exchange over nodes (node_axis) and the GPUs of a node (the EP axis):
    ``jax_ep.dispatch_hierarchical`` / ``combine_hierarchical`` (no rank mask: set_rank_mask refuses)."""

    cfg: EPConfig
    node_axis: str

    def dispatch(self, x, topk_idx, topk_weights):
        """(Dispatched, its rows in x's dtype; an FP8 wire's dequantised: forward-only here)."""
        d = dispatch_hierarchical(x, topk_idx, topk_weights, self.cfg, self.node_axis)
        scales = getattr(d, "scales", None)
        return d, d.x.astype(x.dtype) if scales is None else dequantize_rows(d.x, scales, x.dtype)

    def combine(self, y, handle, weighted=True):
        if not weighted:
            # (also refused at construction; here for an `ep` replaced since)
            raise EPValueError(_no_hierarchical_gate_weights(self.node_axis))
        return combine_hierarchical(y, handle, self.cfg, self.node_axis)


def expert_block(rows: jax.Array, w_gate_up: jax.Array, w_down: jax.Array, group_sizes: jax.Array, *,
                 gemm: str = "auto", gemm_dtype: str | None = None,
                 fp8_weights: ExpertFP8Weights | None = None, fp8_weight_grad: bool = False,
                 swiglu_backend: str = "auto", rows_fp8: tuple[jax.Array, jax.Array] | None = None,
                 row_weights: jax.Array | None = None, gemm_num_sms: int | None = None) -> jax.Array:
    """The routed experts on expert-major rows: the gate|up grouped GEMM, SwiGLU, the down grouped GEMM
    (``gemm``: jax_ep.grouped_matmul's backend; ``gemm_dtype`` "float8_e4m3fn": both GEMMs in FP8,
    jax_ep.gemm_fp8.fp8_grouped_matmul, from ``fp8_weights`` when given instead of quantising the
    weights here, their weight gradients in FP8 too with ``fp8_weight_grad``). What MoE's throughput
    path runs per chunk; the layer benchmark times it alone. Its output's rows past sum(group_sizes)
    are unspecified, and so is the gradient of ``rows`` there (as dispatch's rows there are): the
    GEMMs write neither their outputs' nor their input gradients' rows there (``zero_tail=False``), and
    nothing reads them (the GEMMs skip rows past the groups, SwiGLU works row by row, combine reads the
    token rows; ``combine(..., empty_rows_zero=True)`` hands y's rows there back as their gradient,
    which the down GEMM's backward never reads). At DeepSeek-V3's worst-case capacity that tail is half
    the rows at EP2 and three quarters at EP4 (0.5 / 1.4 GB of zeros not written per step).
    ``swiglu_backend``: ``jax_ep.swiglu``'s ("pallas": only the rows that hold rows;
    "auto": ``jax_ep.swiglu.choose``). ``rows_fp8``: with the FP8 GEMMs, ``rows`` already quantised
    (e4m3 [M, H], float32 scales [M, H/128]: an FP8 dispatch's), which the gate|up GEMM multiplies as they
    are (``fp8_grouped_matmul``'s ``x_fp8``); ``rows`` then carries their gradient only. ``row_weights``:
    None, or float32 [M] (dispatch's ``handle.row_weights``, differentiable): each row's SwiGLU output scaled
    by it before the down GEMM, so that the output rows come gate-weighted (``EPOptions.gate_weights``;
    zero in the alignment padding, whose weight is 0). ``gemm_num_sms``: the SMs the GEMM kernels take
    (``MoE``'s)."""
    gemms = _ExpertGEMMs(gemm, gemm_dtype, fp8_weight_grad, gemm_num_sms)
    gemms.check(fp8_weights, rows_fp8)
    gate_up_q, down_q = (None, None) if fp8_weights is None else fp8_weights
    gate_up = checkpoint_name(gemms.matmul(rows, w_gate_up, group_sizes, gate_up_q, rows_fp8), remat.GATE_UP)
    return gemms.down(gate_up, w_down, group_sizes, down_q, swiglu_backend, row_weights)


# the FP8 expert GEMMs' backend (fp8_grouped_matmul's): the kernels on Hopper, else the reference
_FP8_GEMM_BACKEND = "auto"


@dataclasses.dataclass(frozen=True)
class _ExpertGEMMs:
    """expert_block's two grouped GEMMs (its arguments of these names; num_sms: gemm_num_sms), apart:
    the layer runs the gate|up GEMM together with dispatch where its weight gradient goes beside
    dispatch's backward (EPOptions.weight_grad_beside)."""

    gemm: str = "auto"
    gemm_dtype: str | None = None
    fp8_weight_grad: bool = False
    num_sms: int | None = None

    def check(self, fp8_weights, rows_fp8) -> None:
        if self.gemm_dtype not in GEMM_DTYPES:   # (MoE checks its own where it is built)
            raise EPValueError(f"expert_block: gemm_dtype must be one of {GEMM_DTYPES}, got "
                               f"{self.gemm_dtype!r}")
        if rows_fp8 is not None and self.gemm_dtype is None:
            raise EPValueError("expert_block: rows_fp8 needs gemm_dtype='float8_e4m3fn'")
        if self.gemm_dtype is None and (fp8_weights is not None or self.fp8_weight_grad):
            raise EPValueError("expert_block: fp8_weights and fp8_weight_grad need "
                               "gemm_dtype='float8_e4m3fn'")

    def matmul(self, x, w, group_sizes, quantized=None, x_fp8=None, dw_num_sms=None):
        """One grouped GEMM of the block (rows past the groups left unwritten: zero_tail=False);
        dw_num_sms: its weight gradient's SMs (grouped_matmul's)."""
        if self.gemm_dtype is None:
            return grouped_matmul(x, w, group_sizes, backend=self.gemm, num_sms=self.num_sms,
                                  dw_num_sms=dw_num_sms, zero_tail=False)
        return fp8_grouped_matmul(x, w, group_sizes, backend=_FP8_GEMM_BACKEND, gemm=self.gemm,
                                  num_sms=self.num_sms, dw_num_sms=dw_num_sms, quantized=quantized,
                                  x_fp8=x_fp8, zero_tail=False,
                                  weight_grad="fp8" if self.fp8_weight_grad else "bf16")

    def down(self, gate_up, w_down, group_sizes, quantized, swiglu_backend, row_weights):
        """SwiGLU and the down GEMM, from the gate|up GEMM's output."""
        # "auto" takes the SwiGLU kernels with the FP8 GEMMs too (the same bf16 buffers as with the bf16
        # ones): the rows they leave unwritten (past the live rows' blocks) reach no sum there either: the
        # Hopper FP8 kernels and their live-row quantiser never read them, XLA's quantisation is row by
        # row, quantize_rows_t masks them, and the weight gradients skip rows past the groups
        live = jnp.sum(group_sizes)
        h = swiglu(gate_up, live_rows=live, backend=swiglu_backend, row_scale=row_weights)
        h_fp8 = None
        if self.fp8_rows_from_swiglu(gate_up.shape, w_down.shape, swiglu_backend):
            # the FP8 GEMM's rows straight from SwiGLU's kernel, the bits its live-row quantiser makes of
            # h; h itself then only carries the gradient (nothing reads its value: XLA drops its kernel)
            h_fp8 = swiglu_rows_fp8(gate_up, live, row_scale=row_weights)
        return self.matmul(h, w_down, group_sizes, quantized, h_fp8)

    def fp8_rows_from_swiglu(self, gate_up_shape, w_down_shape, swiglu_backend) -> bool:
        """Whether ``down`` takes the FP8 down GEMM's rows from SwiGLU's quantising kernel: FP8 GEMMs whose
        rows the live-row kernel would quantise, after SwiGLU's kernels (the same arithmetic and bits)."""
        h_shape = (gate_up_shape[0], gate_up_shape[1] // 2)
        return (self.gemm_dtype is not None and swiglu_resolve(gate_up_shape, swiglu_backend) == "pallas"
                and live_rows_quantiser(h_shape, w_down_shape, _FP8_GEMM_BACKEND) == "pallas")


def slot_experts(slots: jax.Array, scales: jax.Array | None, counts: jax.Array, w_gate_up: jax.Array,
                 w_down: jax.Array, max_experts_per_token: int, dtype, gemm: str = "auto",
                 fp8_weights: ExpertFP8Weights | None = None, gemm_num_sms: int | None = None) -> jax.Array:
    """The SwiGLU experts over a low-latency dispatch's output (``ll_dispatch``'s ``x``, ``scales``,
    ``counts``): y [E_local, R * T_max, H] bfloat16, what ``ll_combine`` reads (the unfilled slots hold
    what ``slots`` held when it is bfloat16, else 0).

    Only the filled slots are computed: at decode sizes they are a small share of the fixed slots
    (DeepSeek-V3, 128 tokens per rank, EP2: 2,048 rows at most of 36,864 slots), gathered into rows
    grouped by local expert (``filled_slots``), so the grouped GEMMs (``gemm``: jax_ep.grouped_matmul's
    backend, in ``dtype``) read each expert's weights once for its few rows. ``fp8_weights``: both GEMMs
    in FP8 (``fp8_grouped_matmul``) from these quantised weights, the rows quantised per token and 128
    channels as the throughput path does; an FP8 dispatch's rows (``scales``) go into the first GEMM as
    they came (no dequantise and quantise again). ``gemm_num_sms``: the SMs the GEMM kernels take
    (``MoE``'s)."""
    slot, filled = filled_slots(counts, slots.shape[1], max_experts_per_token)
    flat = slots.reshape(-1, slots.shape[2])
    rows = flat[slot]
    # rows past the filled ones are unspecified slots (NaN included on the CUDA path): zeros, so that
    # every product of the GEMM is finite
    rows = jnp.where(filled[:, None], rows, jnp.zeros((), rows.dtype))
    if scales is not None:
        scales = jnp.where(filled[:, None], scales.reshape(flat.shape[0], -1)[slot], 0.0)
    group_sizes = jnp.sum(counts, axis=1, dtype=jnp.int32)

    def matmul(x, w, quantized, x_fp8=None):
        if fp8_weights is None:
            return grouped_matmul(x, w, group_sizes, backend=gemm, num_sms=gemm_num_sms)
        return fp8_grouped_matmul(x, w, group_sizes, gemm=gemm, quantized=quantized, x_fp8=x_fp8,
                                  num_sms=gemm_num_sms)

    gate_up_q, down_q = (None, None) if fp8_weights is None else fp8_weights
    # with the FP8 GEMMs the wire's FP8 rows go in as they came (their dequantised copy is then unused:
    # XLA drops it)
    rows_fp8 = None if scales is None or fp8_weights is None else (rows, scales)
    rows = rows.astype(dtype) if scales is None else dequantize_rows(rows, scales, dtype)
    gate, up = jnp.split(matmul(rows, w_gate_up.astype(dtype), gate_up_q, rows_fp8), 2, axis=1)
    y = matmul(jax.nn.silu(gate) * up, w_down.astype(dtype), down_q)
    # back into the slots ll_combine reads; it never reads the others (NaN allowed), so a bfloat16
    # dispatch's own buffer takes them in place: no slot-sized buffer of zeros (528 MB per step at
    # DeepSeek-V3 decode sizes, 0.31 ms on an H200)
    slot = jnp.where(filled, slot, flat.shape[0])
    into = flat if flat.dtype == jnp.bfloat16 and y.shape[1] == flat.shape[1] else jnp.zeros(
        (flat.shape[0], y.shape[1]), jnp.bfloat16)
    return into.at[slot].set(y.astype(jnp.bfloat16), mode="drop", unique_indices=True).reshape(
        slots.shape[:2] + y.shape[1:])


def filled_slots(counts: jax.Array, num_slots: int, max_experts_per_token: int
                 ) -> tuple[jax.Array, jax.Array]:
    """The filled slots of a low-latency dispatch, as rows grouped by local expert.

    Slot ``r * T_max + i`` of local expert ``e`` (``T_max = num_slots / R``) holds a token iff
    ``i < counts[e, r]``. Returns (slot [N], filled [N]): row ``n`` of the compacted rows is flattened slot
    ``slot[n]`` (``e * num_slots + r * T_max + i``, in (e, r, i) order, so each expert's rows are
    consecutive: ``group_sizes = counts.sum(1)``), ``filled[n]`` False past the last filled one (its slot
    is 0). ``N = R * T_max * max_experts_per_token``: a source rank's token fills at most that many
    local experts' slots here, so no filled slot is left out. The rows stay packed: starting each
    expert's rows at a multiple of the Hopper kernel's 64-row tile measured 26% slower at DeepSeek-V3
    decode sizes (2× H200, 2026-11-30; docs/benchmarks.md, session 28)."""
    local, ep_size = counts.shape
    per_block = num_slots // ep_size
    n = min(local * num_slots, ep_size * per_block * max_experts_per_token)
    ends = jnp.cumsum(counts.reshape(-1), dtype=jnp.int32)   # blocks (e, r) in order
    row = jnp.arange(n, dtype=jnp.int32)
    # compare_all: one fused kernel, not the default search's XLA while loop (a host round trip per step)
    block = jnp.minimum(jnp.searchsorted(ends, row, side="right", method="compare_all").astype(jnp.int32),
                        local * ep_size - 1)
    within = row - (ends[block] - counts.reshape(-1)[block])
    filled = row < ends[-1]
    slot = (block // ep_size) * num_slots + (block % ep_size) * per_block + within
    return jnp.where(filled, slot, 0), filled


class SwiGLU(nnx.Module):
    """Dense SwiGLU FFN (the shared expert)."""

    def __init__(self, hidden: int, ffn_hidden: int, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        init = nnx.initializers.lecun_normal()
        self.w_gate = nnx.Param(init(rngs.params(), (hidden, ffn_hidden), param_dtype))
        self.w_up = nnx.Param(init(rngs.params(), (hidden, ffn_hidden), param_dtype))
        self.w_down = nnx.Param(init(rngs.params(), (ffn_hidden, hidden), param_dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        return swiglu_ffn(x, *self.weights())

    def weights(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(w_gate, w_up, w_down) as arrays (what ``swiglu_ffn`` takes)."""
        return self.w_gate[...], self.w_up[...], self.w_down[...]


def _shared_expert(tokens, weights):
    """The shared expert inside the per-rank function (EPOptions.shared_beside), in its scope."""
    with jax.named_scope(SCOPES["shared"]):
        return swiglu_ffn(tokens, *weights)


def _shared_gate_up(tokens, w_gate, w_up):
    """The shared expert's first half (EPOptions.shared_split), in its scope."""
    with jax.named_scope(SCOPES["shared"]):
        return swiglu_hidden(tokens, w_gate, w_up)


def _shared_down(h, w_down):
    """The shared expert's down GEMM (EPOptions.shared_split), in its scope."""
    with jax.named_scope(SCOPES["shared"]):
        return h @ w_down.astype(h.dtype)


def swiglu_hidden(x: jax.Array, w_gate: jax.Array, w_up: jax.Array) -> jax.Array:
    """The dense SwiGLU FFN's hidden activations in x's dtype: silu(x @ w_gate) * (x @ w_up)."""
    return jax.nn.silu(x @ w_gate.astype(x.dtype)) * (x @ w_up.astype(x.dtype))


def swiglu_ffn(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """The dense SwiGLU FFN in x's dtype: silu(x @ w_gate) * (x @ w_up) @ w_down."""
    return swiglu_hidden(x, w_gate, w_up) @ w_down.astype(x.dtype)
