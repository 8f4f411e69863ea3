"""What a JAX user writes today without jax_ep. Used by the benchmark as baselines; not part of the API.
Every function is a per-rank view, called inside ``shard_map`` over the EP axis.

``ragged_dispatch`` / ``ragged_combine`` (backend ``ragged``): MaxText style, on
``jax.lax.ragged_all_to_all``. Per rank: expand every (token, top-k slot) pair, sort the pairs by expert,
exchange the per-rank chunks with ``ragged_all_to_all``, then sort what arrived by local expert
(expert-major rows). Combine undoes it. ``ragged_all_to_all`` has no XLA:CPU implementation, so this
runs on GPU only.

``dense_dispatch`` / ``dense_combine`` (backend ``dense``): one dense ``lax.all_to_all`` of
capacity-T blocks, rank-major rows (DeepEP V1's normal-mode output layout). Runs everywhere.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jax_ep.fp8 import quantize_fp8  # the same FP8 rounding
from jax_ep.reference import take_rows  # the same row gather


class RaggedHandle(NamedTuple):
    order: jax.Array          # [T*K] pair order after sorting by expert
    send_sizes: jax.Array     # [R]
    recv_sizes: jax.Array     # [R]
    input_offsets: jax.Array  # [R]
    output_offsets: jax.Array  # [R] where my chunk lands on each destination
    recv_order: jax.Array     # [B] received row -> expert-major position
    weights: jax.Array        # [T, K]


def _exclusive_cumsum(x):
    return jnp.cumsum(x) - x


def ragged_dispatch(x, topk_idx, topk_weights, num_experts: int, axis_name: str):
    ep_size = lax.axis_size(axis_name)
    if num_experts % ep_size:   # the experts past the last whole rank would be no rank's: pairs dropped
        raise ValueError(f"num_experts={num_experts} is not divisible by the EP size {ep_size}")
    me = lax.axis_index(axis_name)
    local_experts = num_experts // ep_size
    tokens, topk = topk_idx.shape
    flat_expert = jnp.where(topk_idx >= 0, topk_idx, num_experts).reshape(-1)
    order = jnp.argsort(flat_expert, stable=True)
    sorted_expert = flat_expert[order]
    sorted_rows = x[order // topk]
    dest = sorted_expert // local_experts                       # R for unused slots: never sent
    send_sizes = jnp.sum(dest[:, None] == jnp.arange(ep_size)[None], axis=0, dtype=jnp.int32)
    all_sizes = lax.all_gather(send_sizes, axis_name)         # [R_src, R_dst]
    recv_sizes = all_sizes[:, me]
    input_offsets = _exclusive_cumsum(send_sizes)
    output_offsets = jnp.sum(jnp.where(jnp.arange(ep_size)[:, None] < me, all_sizes, 0), axis=0,
                             dtype=jnp.int32)
    buffer_rows = ep_size * tokens * min(topk, local_experts)
    recv = lax.ragged_all_to_all(sorted_rows, jnp.zeros((buffer_rows, x.shape[1]), x.dtype),
                                 input_offsets, send_sizes, output_offsets, recv_sizes,
                                 axis_name=axis_name)
    recv_expert = lax.ragged_all_to_all(sorted_expert % local_experts,
                                        jnp.full((buffer_rows,), local_experts, jnp.int32),
                                        input_offsets, send_sizes, output_offsets, recv_sizes,
                                        axis_name=axis_name)
    recv_order = jnp.argsort(recv_expert, stable=True)
    rows = recv[recv_order]
    group_sizes = jnp.sum(recv_expert[:, None] == jnp.arange(local_experts)[None], axis=0, dtype=jnp.int32)
    handle = RaggedHandle(order, send_sizes, recv_sizes, input_offsets, output_offsets, recv_order,
                          topk_weights)
    return rows, group_sizes, handle


def ragged_combine(y, handle: RaggedHandle, axis_name: str):
    tokens, topk = handle.weights.shape
    ep_size = lax.axis_size(axis_name)
    me = lax.axis_index(axis_name)
    unsorted = jnp.zeros_like(y).at[handle.recv_order].set(y)
    # the reverse exchange: what I received from s goes back to s, at s's input offsets for me
    all_recv = lax.all_gather(handle.recv_sizes, axis_name)   # [R_dst(me), R_src]
    back_offsets = jnp.sum(jnp.where(jnp.arange(ep_size)[:, None] < me, all_recv, 0), axis=0,
                           dtype=jnp.int32)
    returned = lax.ragged_all_to_all(unsorted, jnp.zeros((tokens * topk, y.shape[1]), y.dtype),
                                     _exclusive_cumsum(handle.recv_sizes), handle.recv_sizes,
                                     back_offsets, handle.send_sizes, axis_name=axis_name)
    pairs = jnp.zeros_like(returned).at[handle.order].set(returned).reshape(tokens, topk, -1)
    weighted = pairs.astype(jnp.float32) * handle.weights[:, :, None]
    return jnp.sum(weighted, axis=1).astype(y.dtype)


class DenseHandle(NamedTuple):
    token_slot: jax.Array       # [T, R] row of token t in the block it sent to rank r, -1 if not sent


class DenseDispatched(NamedTuple):
    """Rank-major receive buffer of ``dense_dispatch``: block s (rows s·T … s·T+T-1) holds, packed at its
    start, the tokens of source rank s that picked any expert on this rank, in source-token order;
    rows past ``recv_counts[s]`` are zero and carry expert id -1 and weight 0."""

    x: jax.Array                # [R*T, H] rows (the wire dtype: x's, bfloat16, or float8_e4m3fn)
    scales: jax.Array | None    # [R*T, ceil(H/128)] float32 for FP8 rows, else None
    local_experts: jax.Array    # [R*T, K] int32 the row's top-k ids on this rank (local ids), -1 elsewhere
    weights: jax.Array          # [R*T, K] float32 the matching gate weights, 0 elsewhere
    recv_counts: jax.Array      # [R] int32 rows received from each source rank
    handle: DenseHandle


def dense_dispatch(x, topk_idx, topk_weights, num_experts: int, axis_name: str,
                   dtype: str | None = None) -> DenseDispatched:
    """Send each token once to every rank holding one of its experts, with its top-k ids and weights
    on that rank. ``topk_idx``: [T, K] distinct expert ids per token (what a top-k router gives), -1 for
    an unused slot. Capacity is T rows per (source, destination) pair, so nothing is ever dropped.
    ``dtype``: the rows' dtype on the wire (None: x's); ``"float8_e4m3fn"`` quantises at the source
    (jax_ep's per-token, per-128-channel rule, float32 scales)."""
    ep_size = lax.axis_size(axis_name)
    if num_experts % ep_size:   # the experts past the last whole rank would be no rank's: pairs dropped
        raise ValueError(f"num_experts={num_experts} is not divisible by the EP size {ep_size}")
    local = num_experts // ep_size
    tokens, _ = topk_idx.shape
    dest = jnp.where(topk_idx >= 0, topk_idx // local, -1)                      # [T, K]
    on_rank = dest[None] == jnp.arange(ep_size)[:, None, None]                  # [R, T, K]
    to_rank = jnp.any(on_rank, axis=2)                                          # [R, T]
    to_rank_i = to_rank.astype(jnp.int32)
    slot = jnp.cumsum(to_rank_i, axis=1) - to_rank_i                            # packed row, per rank
    send_counts = jnp.sum(to_rank_i, axis=1)                                    # [R]
    send_token = jnp.full((ep_size, tokens), -1, jnp.int32).at[
        jnp.arange(ep_size)[:, None], jnp.where(to_rank, slot, tokens)].set(
        jnp.arange(tokens, dtype=jnp.int32)[None], mode="drop")                 # [R, T] token per row

    if dtype == "float8_e4m3fn":
        payload, scales = quantize_fp8(x)
    else:
        payload, scales = (x if dtype is None else x.astype(dtype)), None
    experts = jnp.where(on_rank, topk_idx % local, -1)                          # [R, T, K]
    weights = jnp.where(on_rank, topk_weights.astype(jnp.float32)[None], 0.0)
    safe = jnp.where(send_token >= 0, send_token, 0)[:, :, None]
    sent = send_token[:, :, None] >= 0

    def exchange(a):
        return lax.all_to_all(a, axis_name, 0, 0, tiled=True).reshape(ep_size * tokens, *a.shape[2:])

    rows = exchange(take_rows(payload, send_token.reshape(-1)).reshape(ep_size, tokens, -1))
    row_scales = None
    if scales is not None:
        row_scales = exchange(take_rows(scales, send_token.reshape(-1)).reshape(ep_size, tokens, -1))
    row_experts = exchange(jnp.where(sent, jnp.take_along_axis(experts, safe, axis=1), -1))
    row_weights = exchange(jnp.where(sent, jnp.take_along_axis(weights, safe, axis=1), 0.0))
    recv_counts = lax.all_to_all(send_counts, axis_name, 0, 0, tiled=True)
    handle = DenseHandle(jnp.where(to_rank, slot, -1).T.astype(jnp.int32))
    return DenseDispatched(rows, row_scales, row_experts, row_weights, recv_counts, handle)


def dense_combine(y, handle: DenseHandle, axis_name: str):
    """``y``: [R*T, H], row j of block s the already gate-weighted sum of this rank's experts for that
    receive row (what comes back to source s). The reverse ``all_to_all``, then each source sums, in
    float32 and in rank order, its token's rows; rows nobody sent are never read."""
    ep_size = lax.axis_size(axis_name)
    tokens = handle.token_slot.shape[0]
    back = lax.all_to_all(y.reshape(ep_size, tokens, -1), axis_name, 0, 0, tiled=True)
    total = jnp.zeros((tokens, y.shape[-1]), jnp.float32)
    for r in range(ep_size):
        total = total + take_rows(back[r], handle.token_slot[:, r]).astype(jnp.float32)
    return total.astype(y.dtype)
