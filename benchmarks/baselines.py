"""What a JAX user writes today without jax_ep: a MaxText-style dispatch/combine on
``jax.lax.ragged_all_to_all``. Used by the benchmark as a baseline; it is not part of the API.

Per rank: expand every (token, top-k slot) pair, sort the pairs by expert, exchange the per-rank
chunks with ``ragged_all_to_all``, then sort what arrived by local expert. Combine undoes it.
``ragged_all_to_all`` has no XLA:CPU implementation, so this runs on GPU only.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax


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
