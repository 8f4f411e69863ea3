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

Not built: FP8 dispatch (stage 2's expert-major dispatch takes no scales for rows that are already
quantised) and rank masking.
"""

from __future__ import annotations

import zlib
from typing import NamedTuple

import jax
from jax import lax

from jax_ep import ops
from jax_ep.config import EPConfig
from jax_ep.types import Handle, RankMajorHandle
from jax_ep.validation import check_dispatch_args, check_no_drops, check_topk_values


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

    x: jax.Array                    # [C, H] rows (x's dtype, or bfloat16)
    group_sizes: jax.Array          # [E_local] int32 rows per local expert, padded to expert_alignment
    expert_counts: jax.Array        # [E_local] int32 rows actually received per local expert
    num_dropped: jax.Array          # [] int32 rows this GPU dropped for lack of capacity
    num_tokens_per_node: jax.Array  # [N] int32 stage-1 rows this GPU received from each node
    handle: HierarchicalHandle

    @property
    def row_weights(self) -> jax.Array:
        """[C] float32 gate weight per receive row (the handle's)."""
        return self.handle.local.row_weights


def _axis_size(axis: str, what: str, op: str) -> int:
    try:
        return lax.axis_size(axis)
    except NameError as e:
        raise ValueError(f"jax_ep.{op} must run inside shard_map over the mesh axes {what}={axis!r}; "
                         "that axis is not bound here") from e


def stage_configs(cfg: EPConfig, node_axis: str, op: str = "dispatch_hierarchical"
                  ) -> tuple[EPConfig, EPConfig]:
    """(stage 1 config over the node axis, stage 2 config over the local axis) for ``cfg`` (whose
    ``axis_name`` is the local axis), inside shard_map over both. Stage 2's tokens are the N*T stage-1
    rows and its experts the E / N of one node, so its worst-case capacity equals a flat dispatch's over
    the N*L ranks: each GPU receives the same (token, expert) pairs as there."""
    if not isinstance(node_axis, str) or not node_axis:
        raise ValueError(f"jax_ep.{op}: node_axis must be a non-empty str (a mesh axis), got {node_axis!r}")
    if node_axis == cfg.axis_name:
        raise ValueError(f"jax_ep.{op}: node_axis={node_axis!r} must differ from cfg.axis_name "
                         f"{cfg.axis_name!r} (the local axis)")
    if cfg.dispatch_dtype == "float8_e4m3fn":
        raise NotImplementedError(
            f"jax_ep.{op}: dispatch_dtype='float8_e4m3fn' is not built for the hierarchical path (its "
            "intra-node stage, an expert-major dispatch, takes no scales for rows already quantised); "
            "use 'bfloat16' or None")
    nodes = _axis_size(node_axis, "node_axis", op)
    local = _axis_size(cfg.axis_name, "cfg.axis_name", op)
    if cfg.num_experts % (nodes * local):
        raise ValueError(f"jax_ep.{op}: num_experts={cfg.num_experts} is not divisible by the EP size "
                         f"{nodes * local} (node axis {node_axis!r} of {nodes} x local axis "
                         f"{cfg.axis_name!r} of {local})")
    backend = cfg.backend
    if backend != "reference" and _directory_slots_collide(node_axis, cfg.axis_name, backend, op):
        backend = "reference"  # "auto" only; "cuda" raised
    # the checks that need values run here over the whole group (both axes), not per stage
    node_cfg = cfg.replace(axis_name=node_axis, checked=False, backend=backend)
    # The local axis stays inside a node (the mesh's contract): its ops reach their peers by NVLink
    # loads / stores even in a job that spans nodes; the node hop keeps cfg's transport ("auto":
    # NVSHMEM puts when a process of the job is on another node, "put": forced).
    local_cfg = cfg.replace(num_experts=cfg.num_experts // nodes,
                            max_tokens_per_rank=nodes * cfg.max_tokens_per_rank, checked=False,
                            backend=backend, kernel=cfg.kernel.replace(transport="load_store"))
    return node_cfg, local_cfg


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
        raise ValueError(f"jax_ep.{op} (backend='cuda'): the mesh axes {node_axis!r} and {local_axis!r} "
                         f"share the CUDA kernels' directory slot {node_slot} (crc32(name) % {slots}); "
                         "rename one of them (e.g. 'node' and 'local')")
    return True


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
      group_sizes, expert_counts, num_dropped, num_tokens_per_node [N], handle.
    """
    op = "dispatch_hierarchical"
    node_cfg, local_cfg = stage_configs(cfg, node_axis, op)
    check_dispatch_args(x, topk_idx, topk_weights, cfg, op=op)
    group = (node_axis, cfg.axis_name)
    if cfg.checked:
        topk_idx = check_topk_values(topk_idx, cfg.num_experts, group, op)
    d1 = ops.dispatch_rank_major(x, topk_idx, topk_weights, node_cfg)
    d2 = ops.dispatch(d1.x, d1.topk_idx, d1.topk_weights, local_cfg)
    if cfg.checked:
        d2 = check_no_drops(d2, d1.topk_idx, local_cfg.replace(checked=True), lax.axis_size(cfg.axis_name),
                            outer_axis=node_axis, op=op)
    return HierarchicalDispatched(d2.x, d2.group_sizes, d2.expert_counts, d2.num_dropped,
                                  d1.num_tokens_per_rank, HierarchicalHandle(d1.handle, d2.handle))


def combine_hierarchical(y: jax.Array, handle: HierarchicalHandle, cfg: EPConfig,
                         node_axis: str) -> jax.Array:
    """y [C, H'] (the expert outputs, row for row) -> [T, H'] of y's dtype: for each token of this GPU
    the gate-weighted sum of its expert outputs. Each GPU sums a (token, GPU) pair's rows in float32 in
    top-k slot order and rounds to y's dtype (as flat combine); the node's GPUs' partial sums are summed
    in float32 in local rank order and rounded to y's dtype again (the extra rounding of the
    hierarchical path); the source sums the nodes' rows in float32 in node order and rounds once more."""
    op = "combine_hierarchical"
    if not isinstance(handle, HierarchicalHandle):
        raise ValueError(f"jax_ep.{op}: handle must be the HierarchicalHandle of dispatch_hierarchical, got "
                         f"{type(handle).__name__}")
    node_cfg, local_cfg = stage_configs(cfg, node_axis, op)
    per_node = ops.combine(y, handle.local, local_cfg)        # [N*T, H']: one row per (token, node)
    return ops.combine_rank_major(per_node, handle.node, node_cfg)


__all__ = ["HierarchicalDispatched", "HierarchicalHandle", "combine_hierarchical", "dispatch_hierarchical",
           "stage_configs"]
