"""Hierarchical (multi-node) dispatch / combine: the existing ops composed over a 2-D (node, local) mesh.

The EP group is ``node_axis`` x ``cfg.axis_name`` (the local axis), node-major: GPU (n, l) is global EP
rank ``n * L + l``, and expert e lives on node ``e // (E / N)``, local rank ``(e % (E / N)) // E_local``
(exactly where a flat dispatch over the N * L ranks puts it). Per GPU, inside ``shard_map`` over both
axes:

1. ``dispatch_rank_major`` over the node axis, the experts grouped per node: GPU (n, l) sends one row per
   (token, destination node) to GPU (n', l), the same local index, carrying the token's K slots as
   node-local expert ids (-1 where the expert is on another node) and their gate weights. This is the
   hop that crosses the network, once per (token, node).
2. ``dispatch`` over the local axis with those N*T rows as its tokens: the usual expert-major rows of
   this GPU's E_local experts, forwarded inside the node.

``combine_hierarchical`` runs the two combines in reverse: ``combine`` over the local axis (the weighted
in-node reduction: one row per (token, node)), then ``combine_rank_major`` over the node axis (one row
per (token, node) back, summed at the source). Gradients come from each op's custom_vjp.

Transports (``KernelConfig.transport``, backend "cuda"): the node hop takes cfg's (over other nodes
"auto" picks NVSHMEM puts; "put" forces them on one node), the local axis always NVLink loads / stores.

FP8 (``dispatch_dtype="float8_e4m3fn"``, forward-only): stage 1 quantises each token once at its
source (per token, per 128 channels, amax / 448: ``fp8.quantize_fp8``, the flat FP8 dispatch's
quantisation) and sends FP8 rows + float32 scales over the network. Stage 2's expert-major dispatch
takes no scales for rows already quantised, so it forwards each stage-1 row as one opaque row: its H
FP8 bytes, then its H/128 scales' bytes, zero-padded to a multiple of 32 bytes and read as float32
words (``fp8_packed_width``), dispatched with dispatch_dtype None (a plain copy of the bits:
``_fp8_stages``); the received rows are unpacked into FP8 rows [C, H] and scales [C, H/128]. Rows
and scales are thus the flat FP8 dispatch's bit for bit, in the hierarchical row order. Cost: the
pack (over the N*T stage-1 rows) and the unpack (over the C rows) are two more passes over the rows
in XLA, each reading and writing about 1.03 H bytes a row; both hops carry FP8's bytes (+ up to 28
bytes of padding a row in stage 2; none for H a multiple of 1024). Differentiating through it raises
NotImplementedError, as the flat FP8 dispatch does.

Not built: rank masking.
"""

from __future__ import annotations

import functools
import zlib
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jax_ep import ops, overlap
from jax_ep.config import FP8_BLOCK, EPConfig, check_option
from jax_ep.errors import EPTypeError, EPUnsupportedError, EPValueError
from jax_ep.types import Handle, RankMajorHandle
from jax_ep.validation import (
    check_combine_args,
    check_dispatch_args,
    check_handle,
    check_no_drops,
    check_topk_values,
    fp8_forward_only,
)


class HierarchicalHandle(NamedTuple):
    """What ``combine_hierarchical`` needs from ``dispatch_hierarchical`` (a pytree of arrays)."""

    node: RankMajorHandle  # stage 1 (node axis): src_index [N*T] (source slot s*T + t of each row of this
    #                        GPU's stage-1 buffer, or EMPTY_ROW), is_token_in_rank [T, N] (source side)
    local: Handle          # stage 2 (local axis): its tokens are the N*T stage-1 rows, so src_index names
    #                        slot l_src * (N*T) + i: row i of the stage-1 buffer of GPU (n, l_src)

    @property
    def row_weights(self) -> jax.Array:
        """[C] float32 gate weight per receive row."""
        return self.local.row_weights


class HierarchicalDispatched(NamedTuple):
    """Result of ``dispatch_hierarchical`` on one GPU: expert-major rows of its E_local experts."""

    x: jax.Array                    # [C, H] rows (x's dtype, bfloat16 or float8_e4m3fn)
    group_sizes: jax.Array          # [E_local] int32 rows per local expert, padded to expert_alignment
    expert_counts: jax.Array        # [E_local] int32 rows actually received per local expert
    num_dropped: jax.Array          # [] int32 rows this GPU dropped for lack of capacity
    num_tokens_per_node: jax.Array  # [N] int32 stage-1 rows this GPU received from each node
    handle: HierarchicalHandle
    scales: jax.Array | None = None  # [C, H/128] float32 for FP8 rows, else None (last: positional
    #                                  constructions of the six fields above stay valid)

    @property
    def row_weights(self) -> jax.Array:
        """[C] float32 gate weight per receive row (the handle's)."""
        return self.handle.local.row_weights


def _axis_size(axis: str, what: str, op: str) -> int:
    try:
        return lax.axis_size(axis)
    except NameError as e:
        raise EPValueError(f"jax_ep.{op} must run inside shard_map over the mesh axes {what}={axis!r}; "
                           "that axis is not bound here") from e


def stage_configs(cfg: EPConfig, node_axis: str, op: str = "dispatch_hierarchical"
                  ) -> tuple[EPConfig, EPConfig]:
    """(stage 1 config over the node axis, stage 2 config over the local axis) for ``cfg`` (whose
    ``axis_name`` is the local axis), inside shard_map over both. Stage 2's tokens are the N*T stage-1
    rows and its experts the E / N of one node, so its worst-case capacity equals a flat dispatch's over
    the N*L ranks: each GPU receives the same (token, expert) pairs as there. With FP8 both keep
    cfg's dispatch_dtype: stage 1 quantises; stage 2's dispatch runs on packed rows
    (``_packed_config``), its combine on the expert outputs as ever."""
    if not isinstance(cfg, EPConfig):
        raise EPTypeError(f"jax_ep.{op}: cfg must be a jax_ep.EPConfig, got {type(cfg).__name__}")
    check_option(f"jax_ep.{op}:", "node_axis", node_axis, "name")
    if node_axis == cfg.axis_name:
        raise EPValueError(f"jax_ep.{op}: node_axis={node_axis!r} must differ from cfg.axis_name "
                           f"{cfg.axis_name!r} (the local axis)")
    nodes = _axis_size(node_axis, "node_axis", op)
    local = _axis_size(cfg.axis_name, "cfg.axis_name", op)
    if cfg.num_experts % (nodes * local):
        raise EPValueError(f"jax_ep.{op}: num_experts={cfg.num_experts} is not divisible by the EP size "
                           f"{nodes * local} (node axis {node_axis!r} of {nodes} x local axis "
                           f"{cfg.axis_name!r} of {local})")
    backend = cfg.backend
    if backend != "reference" and _directory_slots_collide(node_axis, cfg.axis_name, backend, op):
        backend = "reference"  # "auto" only; "cuda" raised
    # shrink is the kernels' mode: a lost GPU would drop its stage-1 group's rows for its whole node,
    # uncounted
    if cfg.shrink and cfg.backend != "reference":
        raise EPUnsupportedError(f"jax_ep.{op}: EPConfig(shrink=True) with the hierarchical ops: rank "
                                 "masking is not built for the two-stage composition; leave shrink False")
    # Both stages push their rows: a pulled stage would rewrite its own staging while a peer of the
    # other stage, which its start barrier does not wait for, may still read it (one buffer per device)
    pulled = [k for k in ("dispatch_pull", "broadcast_pull") if getattr(cfg.kernel, k)]
    if pulled:
        raise EPUnsupportedError(f"jax_ep.{op}: KernelConfig({pulled[0]}=True) with the hierarchical ops: "
                                 "the pull form is not safe across the two stages' groups; leave it None")
    kernel = cfg.kernel.replace(dispatch_pull=False, broadcast_pull=False)
    # the checks that need values run here over the whole group (both axes), not per stage
    node_cfg = cfg.replace(axis_name=node_axis, checked=False, backend=backend, kernel=kernel)
    # The local axis stays inside a node (the mesh's contract): its ops reach their peers by NVLink
    # loads / stores even in a job that spans nodes; the node hop keeps cfg's transport ("auto":
    # NVSHMEM puts when a process of the job is on another node, "put": forced).
    # A stage-1 row holds at most E / N used slots (distinct experts of one node): with fewer experts
    # per node than K (e.g. 8 experts, top-2, over 8 nodes) stage 2 takes E / N slots (_stage_two_slots).
    local_cfg = cfg.replace(num_experts=cfg.num_experts // nodes,
                            num_topk=min(cfg.num_topk, cfg.num_experts // nodes),
                            max_tokens_per_rank=nodes * cfg.max_tokens_per_rank, checked=False,
                            backend=backend, kernel=kernel.replace(transport="load_store"))
    return node_cfg, local_cfg


def _stage_two_slots(topk_idx: jax.Array, topk_weights: jax.Array, slots: int
                     ) -> tuple[jax.Array, jax.Array]:
    """Stage 1's [M, K] node-local ids and weights -> stage 2's [M, slots]: each row's used slots
    (id >= 0, not a repeat of an earlier slot) first, in slot order, then unused ones. The identity
    when slots == K. A row has at most E / N used slots, so none is lost, and the order of the used
    ones (combine's float32 summation order) is kept: the results are those of K slots."""
    k = topk_idx.shape[-1]
    if slots >= k:
        return topk_idx, topk_weights
    used = topk_idx >= 0
    for j in range(1, k):
        for i in range(j):
            used = used.at[:, j].set(used[:, j] & (topk_idx[:, j] != topk_idx[:, i]))
    order = jnp.argsort(~used, axis=-1, stable=True)[:, :slots]
    idx = jnp.take_along_axis(jnp.where(used, topk_idx, -1), order, axis=-1)
    return idx, jnp.take_along_axis(topk_weights, order, axis=-1)


def _directory_slots_collide(node_axis: str, local_axis: str, backend: str, op: str) -> bool:
    """The CUDA kernels find their group in a directory slot per axis name (crc32(name) % 4): both
    axes of one program need different slots, or their epochs would mix (docs/native.md)."""
    from jax_ep import runtime

    if backend == "auto" and not runtime.available()[0]:
        return False  # auto runs the reference here anyway
    slots = runtime.limits()["directory_axes"]
    node_slot, local_slot = (zlib.crc32(a.encode()) % slots for a in (node_axis, local_axis))
    if node_slot != local_slot:
        return False
    if backend == "cuda":
        raise EPValueError(f"jax_ep.{op} (backend='cuda'): the mesh axes {node_axis!r} and {local_axis!r} "
                           f"share the CUDA kernels' directory slot {node_slot} (crc32(name) % {slots}); "
                           "rename one of them (e.g. 'node' and 'local')")
    return True


@overlap.in_order
def dispatch_hierarchical(x: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array, cfg: EPConfig,
                          node_axis: str) -> HierarchicalDispatched:
    """Two-stage dispatch over the (node_axis, cfg.axis_name) mesh (module docstring).

    Args:
      x: [T, H] tokens of this GPU (T <= cfg.max_tokens_per_rank).
      topk_idx: [T, K] int32 global expert ids in [0, E); -1 (or out of range, or a repeat) is unused.
      topk_weights: [T, K] float32 gate weights.
      cfg: EPConfig of the whole group: E = num_experts over all N*L GPUs, axis_name = the local axis;
        capacity (None: the flat worst case) and expert_alignment apply to the expert-major rows.
      node_axis: the mesh axis of the nodes.
    Returns:
      HierarchicalDispatched: rows [C, H] expert-major; within an expert ordered by (source local rank,
      source node, source token) (flat dispatch: (source node, source local rank, source token)), then
      group_sizes, expert_counts, num_dropped, num_tokens_per_node [N], handle, and scales
      [C, H/128] float32 for FP8 (None otherwise). FP8 rows and scales are bit for bit those of a
      flat FP8 dispatch of the same tokens (module docstring); FP8 is forward-only.
    """
    op = "dispatch_hierarchical"
    node_cfg, local_cfg = stage_configs(cfg, node_axis, op)
    check_dispatch_args(x, topk_idx, topk_weights, cfg, op=op)
    group = (node_axis, cfg.axis_name)
    if cfg.checked:
        topk_idx = check_topk_values(topk_idx, cfg.num_experts, group, op)
    if cfg.dispatch_dtype == "float8_e4m3fn":
        d1, d2 = _fp8_stages(x, topk_idx, topk_weights, node_cfg, local_cfg)
    else:
        d1 = ops.dispatch_rank_major(x, topk_idx, topk_weights, node_cfg)
        idx2, w2 = _stage_two_slots(d1.topk_idx, d1.topk_weights, local_cfg.num_topk)
        d2 = ops.dispatch(d1.x, idx2, w2, local_cfg)
    if cfg.checked:
        stage_two_idx = _stage_two_slots(d1.topk_idx, d1.topk_weights, local_cfg.num_topk)[0]
        d2 = check_no_drops(d2, stage_two_idx, local_cfg.replace(checked=True), lax.axis_size(cfg.axis_name),
                            outer_axis=node_axis, op=op)
    return HierarchicalDispatched(d2.x, d2.group_sizes, d2.expert_counts, d2.num_dropped,
                                  d1.num_tokens_per_rank, HierarchicalHandle(d1.handle, d2.handle), d2.scales)


# ---- FP8: stage 2 forwards the quantised rows as opaque packed rows ----------------------------------
# Packed rows travel as float32 words, not bfloat16 pairs: XLA:CPU computes a bfloat16 select in
# float32 and rounds back, which turns every NaN payload into the canonical NaN (seen: jnp.where on
# bfloat16 0x7F81 gives 0x7FC0), and the scales' low bytes read as bfloat16 make such payloads
# routinely. float32 selects, gathers and all_to_all keep every bit (tests/test_hierarchical.py).
_PACK_DTYPE = jnp.float32
# The kernels move rows of whole 8-element vectors (cuda_backend.unsupported: hidden a multiple of
# row_alignment = 8 elements): 32 bytes of float32. The packed rows are padded to that on every backend.
_PACK_ALIGN_BYTES = 32


def fp8_packed_width(hidden: int) -> int:
    """float32 elements of a packed stage-2 row for FP8 rows of ``hidden`` channels: the row's
    ``hidden`` FP8 bytes, then its hidden/128 float32 scales (4 bytes each), zero-padded to a multiple
    of 32 bytes. Any hidden that is a multiple of 128 packs (e.g. 7168 -> 1848: 7392 bytes, no
    padding; 128 -> 40: 132 bytes + 28 of padding)."""
    if not isinstance(hidden, int) or hidden < FP8_BLOCK or hidden % FP8_BLOCK:
        raise EPValueError(
            f"jax_ep.dispatch_hierarchical: FP8 rows of hidden={hidden!r} cannot be packed for "
            f"stage 2: hidden must be a positive multiple of {FP8_BLOCK}")
    data = hidden + 4 * (hidden // FP8_BLOCK)
    return -(-data // _PACK_ALIGN_BYTES) * _PACK_ALIGN_BYTES // 4


def _packed_config(local_cfg: EPConfig) -> EPConfig:
    """Stage 2's dispatch config for packed FP8 rows: float32 rows of fp8_packed_width(H), kept as
    they are on the wire (dispatch_dtype None). Capacity, alignment and experts are local_cfg's."""
    return local_cfg.replace(hidden=fp8_packed_width(local_cfg.hidden), dispatch_dtype=None)


def _pack_fp8_rows(rows: jax.Array, scales: jax.Array) -> jax.Array:
    """FP8 rows [M, H] + float32 scales [M, H/128] -> [M, fp8_packed_width(H)] float32 words (bitcasts
    and a concatenation: no arithmetic, every bit kept)."""
    m, hidden = rows.shape
    width = fp8_packed_width(hidden)
    parts = [lax.bitcast_convert_type(rows, jnp.uint8),
             lax.bitcast_convert_type(scales, jnp.uint8).reshape(m, 4 * scales.shape[1])]
    pad = 4 * width - hidden - 4 * scales.shape[1]
    if pad:
        parts.append(jnp.zeros((m, pad), jnp.uint8))
    return lax.bitcast_convert_type(jnp.concatenate(parts, axis=1).reshape(m, width, 4), _PACK_DTYPE)


def _unpack_fp8_rows(packed: jax.Array, hidden: int) -> tuple[jax.Array, jax.Array]:
    """Inverse of _pack_fp8_rows: [C, fp8_packed_width(H)] float32 words -> (FP8 rows [C, H], float32
    scales [C, H/128]). An empty row (all zero bytes) gives +0 rows and +0.0 scales, as the flat
    dispatch's empty rows."""
    c, width = packed.shape
    blocks = hidden // FP8_BLOCK
    raw = lax.bitcast_convert_type(packed, jnp.uint8).reshape(c, 4 * width)
    rows = lax.bitcast_convert_type(raw[:, :hidden], jnp.float8_e4m3fn)
    scales = lax.bitcast_convert_type(raw[:, hidden:hidden + 4 * blocks].reshape(c, blocks, 4), jnp.float32)
    return rows, scales


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _fp8_stages(x, topk_idx, topk_weights, node_cfg: EPConfig, local_cfg: EPConfig):
    """(stage 1's RankMajorDispatched, stage 2's Dispatched with FP8 rows and their scales).

    Stage 2 copies the packed rows bit for bit: a dispatch with dispatch_dtype None keeps x's dtype
    and only moves rows. The reference (jax_ep.reference._send_tokens / dispatch) moves them with
    float32 selects against zero, all_to_all and gathers, no arithmetic on the values; the CUDA
    kernels take the kConvCopy path (cuda/dispatch.cu: rows of x's dtype), raw 16-byte vector or TMA
    bulk copies (warp_copy_row), and zero the padding rows. So any word (NaN payloads, subnormals,
    -0.0: FP8 bytes read as float32 make subnormals routinely) survives (tests/test_hierarchical.py
    sends such words through it)."""
    d1 = ops.dispatch_rank_major(x, topk_idx, topk_weights, node_cfg)
    packed = _pack_fp8_rows(d1.x, d1.scales)
    d2 = ops.dispatch(packed, *_stage_two_slots(d1.topk_idx, d1.topk_weights, local_cfg.num_topk),
                      _packed_config(local_cfg))
    rows, scales = _unpack_fp8_rows(d2.x, local_cfg.hidden)
    return d1, d2._replace(x=rows, scales=scales)


def _fp8_stages_fwd(x, topk_idx, topk_weights, node_cfg, local_cfg):
    return _fp8_stages(x, topk_idx, topk_weights, node_cfg, local_cfg), None


def _fp8_stages_bwd(node_cfg, local_cfg, residuals, ct):
    raise fp8_forward_only("dispatch_hierarchical")


_fp8_stages.defvjp(_fp8_stages_fwd, _fp8_stages_bwd)


@overlap.in_order
def combine_hierarchical(y: jax.Array, handle: HierarchicalHandle, cfg: EPConfig,
                         node_axis: str) -> jax.Array:
    """y [C, H'] (the expert outputs, row for row) -> [T, H'] of y's dtype: for each token of this GPU
    the gate-weighted sum of its expert outputs. Each GPU sums a (token, GPU) pair's rows in float32 in
    top-k slot order and rounds to y's dtype (as flat combine); the node's GPUs' partial sums are summed
    in float32 in local rank order and rounded to y's dtype again (the extra rounding of the
    hierarchical path); the source sums the nodes' rows in float32 in node order and rounds once more."""
    op = "combine_hierarchical"
    check_handle(handle, HierarchicalHandle, f"jax_ep.{op}", "dispatch_hierarchical")
    node_cfg, local_cfg = stage_configs(cfg, node_axis, op)
    check_combine_args(y, handle.local, local_cfg, op=f"jax_ep.{op}")
    per_node = ops.combine(y, handle.local, local_cfg)        # [N*T, H']: one row per (token, node)
    return ops.combine_rank_major(per_node, handle.node, node_cfg)


__all__ = ["HierarchicalDispatched", "HierarchicalHandle", "combine_hierarchical", "dispatch_hierarchical",
           "fp8_packed_width", "stage_configs"]
