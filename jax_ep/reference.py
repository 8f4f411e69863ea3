"""The reference path: dispatch/combine in pure JAX. It defines the exact semantics.

Everything here is a per-rank view, called inside ``shard_map`` over the EP mesh axis. Tokens travel
with ``lax.all_to_all`` on capacity-padded buffers ``[R, T, ...]`` (slot t of the block for rank r
holds token t if it goes to r, zeros otherwise), then each receiver expands what it got into
expert-major rows. It runs on any platform (``ragged_all_to_all`` is not implemented on XLA:CPU) and
is the baseline the CUDA path is measured against.

Semantics (docs/api.md has the user-facing version):
  * ``topk_idx`` is sanitised first: an id < 0 or >= num_experts is an unused slot (like -1), and a
    slot naming an expert already named by an earlier slot of the same token is unused too. Checked
    mode turns out-of-range ids into an error instead.
  * Expert e lives on rank e // E_local. A token travels to a rank once, however many of that
    rank's experts it picked.
  * Receive rows are expert-major. Within a local expert, rows are ordered by (source rank, source
    token). Expert segment e starts at offset_e = sum_{e'<e} round_up(count_e', alignment).
  * Capacity: rows whose offset would reach C are dropped, in that order (the last experts' rows
    first, and within an expert the last source ranks/tokens first); group_sizes stay aligned and
    num_dropped counts the dropped rows. A dropped row contributes nothing to combine.
  * combine: each receiver sums, in float32 and in top-k slot order, the weighted rows of each
    (token, rank) pair, rounds the partial sum to y's dtype, sends it back; the source sums the
    partial sums in float32 in rank order and rounds to y's dtype.
  * combine's backward (``combine_bwd``): for each receive row of a token (of a linked source),
    d y = w * g[token] (one float32 product rounded to y's dtype) and d row_weight = the float32 dot
    product of y's row as stored with g[token] in ``row_dot``'s fixed order; every other row gets +0.0
    in both, whatever y holds there.
  * Rank masking (``rank_mask`` bool[R], optional, the same on every rank): a masked rank sends and
    receives nothing, as the CUDA kernels do (they can neither wait for nor write to a dead rank).
    dispatch: only pairs from an active source to an active destination travel; a masked rank keeps
    no rows, its handle has no rows and every slot NOT_ROUTED (its own included). A pair that goes
    nowhere (masked source or destination) counts in its *source's* num_dropped (the only rank that
    knows it): an active rank's num_dropped = its capacity drops + its own pairs to masked ranks'
    experts, a masked rank's = all its own pairs. Over the group: kept + dropped = routed pairs.
    is_token_in_rank is the source's routing, mask or not. combine / broadcast / slot_values: a rank
    exchanges data only with the ranks linked to it (every active rank if it is active, itself only
    if it is masked); another rank's partial sums count as +0.0, rows from it as zero. A masked
    rank's own tokens thus combine to zero. No mask and an all-active mask give the same bits.

Rank-major mode, ``dispatch_rank_major`` / ``combine_rank_major`` (DeepEP's contract; docs/api.md):
  * One row per (source token, this rank) pair whose token picked any expert of this rank, packed
    from row 0: source rank major, source token order within. The buffer has R*T rows (every token
    of every rank may come here: no capacity, no drops); rows past the last are empty (x zero, ids
    -1, weights 0, src_index EMPTY_ROW). Each row carries the token's K slots: the local expert id
    where the slot's expert lives here, -1 elsewhere, and the slot's gate weight (0 where -1).
  * combine_rank_major: each receiver returns row i to its source token unchanged (no weights: the
    user's expert kernel applied them); the source sums the rows of the ranks its token went to in
    float32 in rank order (a rank the token did not go to adds +0.0) and rounds once to y's dtype.
    Empty rows never reach the sum, whatever they hold.
  * Rank masking in rank-major mode: as above, a masked rank sends and receives nothing (rows only
    from active sources to active ranks; a masked rank has no rows and num_tokens_per_rank /
    num_tokens_per_expert 0); combine_rank_major / broadcast_rank_major use the linked ranks only.
    No output counts the pairs that go nowhere (rank-major mode has no drop count):
    ``masked_pairs`` at their source gives them.

Low-latency (decode) mode, ``ll_dispatch`` / ``ll_combine`` (docs/api.md, "Low-latency mode"):
  * Fixed receive slots: local expert e has R blocks of T slots; slot (e, r*T + i) holds the i-th
    token (in token order) of source rank r among those routed to global expert r_me*E_local + e.
    No capacity, no drops (but rank masking, below), no layout pass: a token's slot i(t, k) is known
    at the source (the number of its earlier tokens routed to the same expert).
  * combine: each filled slot's expert output goes back to its source (token, top-k slot); the source
    sums, in top-k slot order, the float32 products w * y (each product rounded to float32, no fused
    multiply-add) over the slots whose handle weight is nonzero, starting from +0.0, and rounds to
    bfloat16. A slot of weight 0 (every unused slot) is skipped by a select: whatever y holds there,
    NaN included, never reaches the sum.
  * Rank masking (``rank_mask`` bool[R], optional, the same on every rank): a masked rank is out of
    the call both ways (a dead rank can be neither waited for nor written to). It sends and receives
    nothing: a (token, top-k slot) pair whose expert's rank is masked, and every pair of a masked
    rank, is dropped (not sent; counted in num_dropped; weight 0 and dest_rank -1 in the handle);
    counts from a masked source are 0 and its slots empty. ll_combine with a mask: a slot whose
    rank is masked adds +0.0, and a masked rank's output is all +0.0. No mask and an all-active mask
    give the same bits.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jax_ep import routing, types
from jax_ep.config import EPConfig
from jax_ep.fp8 import as_stored, quantize_fp8
from jax_ep.types import (
    DROPPED,
    EMPTY_ROW,
    EMPTY_SLOT,
    NOT_ROUTED,
)


def layout(topk_idx: jax.Array, cfg: EPConfig) -> types.Layout:
    """Per-rank and per-expert token counts and token->rank membership (DeepEP's get_dispatch_layout)."""
    return routing.layout_of(topk_idx, cfg.num_experts, lax.axis_size(cfg.axis_name))


def _all_to_all(send: jax.Array, axis_name: str) -> jax.Array:
    """send[r] goes to rank r; result[s] came from rank s."""
    return lax.all_to_all(send, axis_name, 0, 0, tiled=True)


def _sum_returned(blocks: jax.Array, cfg: EPConfig, rank_mask: jax.Array | None) -> jax.Array:
    """Each rank's [R, T, H] block of rows for the others' tokens sent back to them (all-to-all), and
    per token the float32 sum over the source ranks in rank order, rounded once to the blocks' dtype.
    rank_mask: rows only from the ranks linked to this one (``routing.linked``); the others add +0.0."""
    returned = _all_to_all(blocks, cfg.axis_name).astype(jnp.float32)
    if rank_mask is not None:
        returned = jnp.where(routing.linked(rank_mask, cfg.axis_name)[:, None, None], returned, 0.0)
    total = returned[0]
    for r in range(1, blocks.shape[0]):  # fixed summation order: rank order
        total = total + returned[r]
    return total.astype(blocks.dtype)


def _round_up(x: jax.Array, multiple: int) -> jax.Array:
    return (x + multiple - 1) // multiple * multiple


def take_rows(table: jax.Array, index: jax.Array) -> jax.Array:
    """table[index] with zeros where index == -1."""
    if table.shape[0] == 0:  # no tokens anywhere (T = 0): every index is -1
        return jnp.zeros(index.shape + table.shape[1:], table.dtype)
    safe = jnp.where(index >= 0, index, table.shape[0])
    return jnp.take(table, safe, axis=0, mode="fill", fill_value=0)


class _Received(NamedTuple):
    """What a rank receives from the wire of dispatch (both layouts), slot n = src_rank * T + token."""

    x: jax.Array             # [R*T, H] the token in the wire dtype (zero where it did not come here)
    expert: jax.Array        # [R*T, K] local expert id of each top-k slot on this rank, else -1
    weight: jax.Array        # [R*T, K] float32 gate weight where expert >= 0, else 0
    scales: jax.Array | None  # [R*T, ceil(H/128)] FP8 scales, or None
    is_token_in_rank: jax.Array  # [T, R] (this rank's tokens)


def _send_tokens(x: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array, cfg: EPConfig,
                 rank_mask: jax.Array | None = None) -> _Received:
    """The wire of dispatch: every rank sends a [T, ...] block to every rank (the token where it
    picked an expert of that rank), with the slots' local expert ids and weights. With rank_mask,
    only to the live destinations (``routing.live``): a masked rank sends nothing, not even to itself, and
    is sent nothing."""
    ep_size = lax.axis_size(cfg.axis_name)
    local_experts = cfg.num_local_experts(ep_size)
    num_tokens, topk = topk_idx.shape
    idx = routing.sanitize_topk(topk_idx, cfg.num_experts)
    dest_rank, is_token_in_rank = routing.destinations(idx, cfg.num_experts, ep_size)
    local_expert = jnp.where(idx >= 0, idx % local_experts, -1)
    if cfg.dispatch_dtype == "float8_e4m3fn":
        payload, scales = quantize_fp8(x)
    else:
        payload = x.astype(cfg.dispatch_dtype) if cfg.dispatch_dtype else x
        scales = None
    live = routing.live(rank_mask, cfg.axis_name, ep_size)                    # [R]
    to_rank = is_token_in_rank.T & live[:, None]                       # [R, T]
    on_rank = (dest_rank[None] == jnp.arange(ep_size)[:, None, None]) & live[:, None, None]  # [R, T, K]
    num_slots = ep_size * num_tokens
    # explicit reshapes: T may be 0
    recv_x = _all_to_all(jnp.where(to_rank[:, :, None], payload[None], 0), cfg.axis_name)
    recv_expert = _all_to_all(jnp.where(on_rank, local_expert[None], -1), cfg.axis_name)
    recv_weight = _all_to_all(jnp.where(on_rank, topk_weights.astype(jnp.float32)[None], 0.0),
                              cfg.axis_name)
    recv_scales = None
    if scales is not None:
        recv_scales = _all_to_all(jnp.where(to_rank[:, :, None], scales[None], 0.0), cfg.axis_name)
        recv_scales = recv_scales.reshape(num_slots, scales.shape[1])
    return _Received(recv_x.reshape(num_slots, payload.shape[1]), recv_expert.reshape(num_slots, topk),
                     recv_weight.reshape(num_slots, topk), recv_scales, is_token_in_rank)


def dispatch(x: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array, cfg: EPConfig,
             rank_mask: jax.Array | None = None) -> types.Dispatched:
    """Forward dispatch (no custom_vjp here: jax_ep.ops wraps it). rank_mask: bool[R] or None; a
    masked rank sends and receives nothing, and each pair that goes nowhere counts in its source's
    num_dropped (module docstring)."""
    ep_size = lax.axis_size(cfg.axis_name)
    local_experts = cfg.num_local_experts(ep_size)
    capacity = cfg.resolved_capacity(ep_size)
    align = cfg.expert_alignment
    num_tokens = topk_idx.shape[0]
    num_slots = ep_size * num_tokens
    recv_x, recv_expert, recv_weight, recv_scales, is_token_in_rank = _send_tokens(
        x, topk_idx, topk_weights, cfg, rank_mask)

    # --- expansion into expert-major rows ------------------------------------------------------
    picks = jnp.any(recv_expert[:, :, None] == jnp.arange(local_experts)[None, None, :], axis=1)
    picks_i = picks.astype(jnp.int32)                                   # [N, E_local]
    counts = jnp.sum(picks_i, axis=0)
    aligned = _round_up(counts, align)
    offsets = jnp.minimum(jnp.cumsum(aligned) - aligned, capacity)
    kept = jnp.minimum(counts, capacity - offsets)  # (a masked rank: counts are 0)
    group_sizes = _round_up(kept, align).astype(jnp.int32)
    rank_in_expert = jnp.cumsum(picks_i, axis=0) - picks_i              # exclusive
    keep = picks & (rank_in_expert < kept[None, :])
    position = offsets[None, :] + rank_in_expert                        # [N, E_local]

    slot_ids = jnp.broadcast_to(jnp.arange(num_slots, dtype=jnp.int32)[:, None], picks.shape)
    src_index = jnp.full((capacity,), EMPTY_ROW, jnp.int32).at[jnp.where(keep, position, capacity)].set(
        slot_ids, mode="drop")
    expert_of_slot = jnp.maximum(recv_expert, 0)
    slot_row = jnp.take_along_axis(position, expert_of_slot, axis=1)
    slot_kept = jnp.take_along_axis(keep, expert_of_slot, axis=1) & (recv_expert >= 0)
    token_rows = jnp.where(slot_kept, slot_row,
                           jnp.where(recv_expert >= 0, DROPPED, NOT_ROUTED)).astype(jnp.int32)
    row_weights = jnp.zeros((capacity,), jnp.float32).at[jnp.where(slot_kept, slot_row, capacity)].set(
        recv_weight, mode="drop")

    rows = take_rows(recv_x, src_index)
    row_scales = None if recv_scales is None else take_rows(recv_scales, src_index)
    active = routing.active(rank_mask, ep_size).astype(jnp.int32)
    handle = types.Handle(src_index, token_rows, is_token_in_rank, row_weights,
                          None if rank_mask is None else active)
    num_dropped = jnp.sum(counts - kept).astype(jnp.int32) + routing.masked_pairs(topk_idx, cfg, rank_mask)
    return types.Dispatched(rows, row_scales, group_sizes, kept.astype(jnp.int32), num_dropped, handle,
                            active)


def combine(y: jax.Array, handle: types.Handle, cfg: EPConfig, rank_mask: jax.Array | None = None
            ) -> jax.Array:
    """Gate-weighted sum (handle.row_weights) of each token's rows, back at its source. rank_mask:
    the source takes partial sums only from the ranks linked to it (``routing.linked``; the others' count
    as +0.0): a masked rank only its own."""
    ep_size = lax.axis_size(cfg.axis_name)
    num_slots, topk = handle.token_rows.shape
    num_tokens = num_slots // ep_size
    yf = as_stored(y).astype(jnp.float32)
    partial = jnp.zeros((num_slots, y.shape[1]), jnp.float32)
    for k in range(topk):  # fixed summation order: top-k slot order
        rows = handle.token_rows[:, k]
        term = take_rows(yf, rows) * take_rows(handle.row_weights, rows)[:, None]
        partial = partial + term
    return _sum_returned(partial.astype(y.dtype).reshape(ep_size, num_tokens, y.shape[1]), cfg, rank_mask)


def broadcast(g: jax.Array, handle: types.Handle, cfg: EPConfig, rank_mask: jax.Array | None = None,
              into: jax.Array | None = None) -> jax.Array:
    """Send each token's row to the ranks it was dispatched to and place it on its receive rows
    (dispatch with a known handle; no gate weights). Empty rows are zero; with rank_mask, so are
    the rows whose source is not linked to this rank (``routing.linked``). into ([C, H] of g's dtype,
    or None): the rows with no token (src_index -1) are into's instead of zero (the CUDA kernel then
    writes into into's buffer: an unweighted combine's backward in place, ``combine(weighted=False,
    empty_rows_zero=True)``)."""
    to_rank = handle.is_token_in_rank.T
    if rank_mask is not None:
        to_rank = to_rank & routing.linked(rank_mask, cfg.axis_name)[:, None]
    recv = _all_to_all(jnp.where(to_rank[:, :, None], g[None], 0), cfg.axis_name)
    rows = take_rows(recv.reshape(-1, g.shape[1]), handle.src_index)
    return rows if into is None else jnp.where((handle.src_index < 0)[:, None], into, rows)


# The float32 dot product of a row in the kernels' order (cuda/broadcast.cu, combine_bwd): a warp walks
# the row in steps of 256 elements, lane l taking the 8 consecutive elements at 256 s + 8 l.
_DOT_LANES, _DOT_VECTOR = 32, 8
_DOT_STEP = _DOT_LANES * _DOT_VECTOR


def row_dot(a: jax.Array, b: jax.Array, runtime_zero: jax.Array) -> jax.Array:
    """[N] float32: per row n, sum over h of a[n, h] * b[n, h] (float32 [N, H] each), in this order:
    each product rounded to float32 (no fused multiply-add); the row padded with zeros to a multiple
    of 256 and cut into steps of 256, element h = 256 s + 8 l + i (lane l < 32, i < 8); per (l, i)
    the products of the steps summed in step order (starting from step 0's); then per lane its 8
    sums pairwise (i with i + 4, then i + 2, then i + 1); then the 32 lanes' pairwise (l with l + 16,
    then + 8, + 4, + 2, + 1). ``runtime_zero``: an int32 zero XLA cannot see (``_rounded``)."""
    rows, width = a.shape
    steps = -(-width // _DOT_STEP)
    if steps == 0:
        return jnp.zeros((rows,), jnp.float32)
    pad = ((0, 0), (0, steps * _DOT_STEP - width))
    products = _rounded(jnp.pad(a, pad) * jnp.pad(b, pad), runtime_zero)
    products = products.reshape(rows, steps, _DOT_LANES, _DOT_VECTOR)
    acc = products[:, 0]
    for s in range(1, steps):  # fixed summation order: step order
        acc = acc + products[:, s]
    for half in (4, 2, 1):     # then within a lane, pairwise
        acc = acc[..., :half] + acc[..., half:2 * half]
    acc = acc[..., 0]
    for half in (16, 8, 4, 2, 1):  # then across the lanes, pairwise (the warp's butterfly)
        acc = acc[:, :half] + acc[:, half:2 * half]
    return acc[:, 0]


def live_rows(handle: types.Handle, cfg: EPConfig, rank_mask: jax.Array | None = None) -> jax.Array:
    """[C] bool: the receive rows that hold a token of a source linked to this rank (``routing.linked``):
    the rows combine reads and its backward writes. Empty rows are not; with rank_mask, neither
    are the rows of the sources it does not link (combine's mask after an unmasked dispatch)."""
    src = handle.src_index
    live = src >= 0
    if rank_mask is None:
        return live
    num_tokens = max(types.num_source_tokens(handle, lax.axis_size(cfg.axis_name)), 1)
    return live & routing.linked(rank_mask, cfg.axis_name)[jnp.maximum(src, 0) // num_tokens]


def combine_bwd(g: jax.Array, y: jax.Array, handle: types.Handle, cfg: EPConfig,
                rank_mask: jax.Array | None = None, empty_rows_from_y: bool = False
                ) -> tuple[jax.Array, jax.Array]:
    """combine's backward at this rank: (d y [C, H] of y's dtype, d row_weights [C] float32) for the
    output cotangent g [T, H] (y's dtype) of combine(y, handle, cfg, rank_mask). With g's rows g_r =
    ``broadcast`` of g (the token's g on each of its rows): per live row (``live_rows``) d y = w * g_r
    (one float32 product, rounded to y's dtype) and d row_weight = ``row_dot`` of y's row as stored
    (``as_stored``: its dtype's value) and g_r; every other row +0.0 in both, whatever y holds there
    (NaN included: the select drops it). empty_rows_from_y (combine's ``empty_rows_zero``): d y of the
    rows that hold no token (src_index -1) is y's row instead, which the caller states is zero (the
    kernel writes d y into y's buffer and leaves those rows)."""
    live = live_rows(handle, cfg, rank_mask)
    gf = broadcast(g, handle, cfg, rank_mask).astype(jnp.float32)
    dy = jnp.where(live[:, None], gf * handle.row_weights[:, None], 0.0).astype(y.dtype)
    if empty_rows_from_y:
        dy = jnp.where((handle.src_index < 0)[:, None], y, dy)
    # src_index >= -1 always: a zero XLA cannot see, keeping the products apart from the sums
    runtime_zero = jnp.any(handle.src_index < EMPTY_ROW)
    dots = row_dot(as_stored(y).astype(jnp.float32), gf, runtime_zero)
    return dy, jnp.where(live, dots, 0.0)


def slot_values(values: jax.Array, handle: types.Handle, cfg: EPConfig,
                rank_mask: jax.Array | None = None) -> jax.Array:
    """For each source token and top-k slot, the value of its receive row ([C] -> [T, K]); 0 where
    the slot has no row (unused, duplicate or dropped). rank_mask: values only from the ranks linked
    to this rank (``routing.linked``); a masked dispatch's handle has no rows elsewhere anyway."""
    ep_size = lax.axis_size(cfg.axis_name)
    num_slots, topk = handle.token_rows.shape
    per_slot = take_rows(values, handle.token_rows.reshape(-1)).reshape(ep_size, num_slots // ep_size, topk)
    returned = _all_to_all(per_slot, cfg.axis_name)
    if rank_mask is not None:
        returned = jnp.where(routing.linked(rank_mask, cfg.axis_name)[:, None, None], returned, 0.0)
    return jnp.sum(returned, axis=0)


# ---- rank-major mode (DeepEP's contract) -----------------------------------------------------------
def dispatch_rank_major(x: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array, cfg: EPConfig,
                        rank_mask: jax.Array | None = None) -> types.RankMajorDispatched:
    """Forward rank-major dispatch (no custom_vjp here: jax_ep.ops wraps it). Same wire as
    ``dispatch`` (with rank_mask, only between active ranks); the receiver packs the received
    tokens in (source rank, source token) order."""
    ep_size = lax.axis_size(cfg.axis_name)
    local_experts = cfg.num_local_experts(ep_size)
    num_tokens = topk_idx.shape[0]
    num_slots = ep_size * num_tokens
    recv_x, recv_expert, recv_weight, recv_scales, is_token_in_rank = _send_tokens(
        x, topk_idx, topk_weights, cfg, rank_mask)

    present = jnp.any(recv_expert >= 0, axis=1)                        # [R*T] slot n holds a token
    present_i = present.astype(jnp.int32)
    position = jnp.cumsum(present_i) - present_i                       # exclusive prefix sum
    src_index = jnp.full((num_slots,), EMPTY_ROW, jnp.int32).at[
        jnp.where(present, position, num_slots)].set(jnp.arange(num_slots, dtype=jnp.int32), mode="drop")
    filled = src_index >= 0
    rows = take_rows(recv_x, src_index)
    row_ids = jnp.where(filled[:, None], take_rows(recv_expert, src_index), -1)
    row_weights = jnp.where(row_ids >= 0, take_rows(recv_weight, src_index), 0.0)
    row_scales = None if recv_scales is None else take_rows(recv_scales, src_index)
    per_rank = jnp.sum(present_i.reshape(ep_size, num_tokens), axis=1, dtype=jnp.int32)
    per_expert = jnp.sum(recv_expert[:, :, None] == jnp.arange(local_experts)[None, None, :],
                         axis=(0, 1), dtype=jnp.int32)
    mask = None if rank_mask is None else routing.active(rank_mask, ep_size).astype(jnp.int32)
    return types.RankMajorDispatched(rows, row_scales, row_ids.astype(jnp.int32), row_weights, per_rank,
                                     per_expert, types.RankMajorHandle(src_index, is_token_in_rank, mask))


def combine_rank_major(y: jax.Array, handle: types.RankMajorHandle, cfg: EPConfig,
                       rank_mask: jax.Array | None = None) -> jax.Array:
    """Each row back to its source token; per token the float32 sum over ranks in rank order of the
    rows returned, rounded once to y's dtype. Empty rows are never read. rank_mask: rows only from
    the ranks linked to this one (``routing.linked``); the others add +0.0."""
    ep_size = lax.axis_size(cfg.axis_name)
    num_slots = handle.src_index.shape[0]
    num_tokens = num_slots // ep_size
    src = handle.src_index
    # scatter (not a product): whatever an empty row holds, NaN included, never reaches the sum
    block = jnp.zeros((num_slots, y.shape[1]), y.dtype).at[jnp.where(src >= 0, src, num_slots)].set(
        as_stored(y), mode="drop")
    return _sum_returned(block.reshape(ep_size, num_tokens, y.shape[1]), cfg, rank_mask)


def broadcast_rank_major(g: jax.Array, handle: types.RankMajorHandle, cfg: EPConfig,
                         rank_mask: jax.Array | None = None) -> jax.Array:
    """Each token's row g[t] to the rows it was dispatched to ([T, H'] -> [R*T, H']; empty rows zero):
    dispatch_rank_major's data movement through a known handle (the backward of combine_rank_major).
    rank_mask: rows only between linked ranks (``routing.linked``), the others zero."""
    ep_size = lax.axis_size(cfg.axis_name)
    to_rank = handle.is_token_in_rank.T
    if rank_mask is not None:
        to_rank = to_rank & routing.linked(rank_mask, cfg.axis_name)[:, None]
    recv = _all_to_all(jnp.where(to_rank[:, :, None], g[None], 0), cfg.axis_name)
    return take_rows(recv.reshape(ep_size * g.shape[0], g.shape[1]), handle.src_index)


# ---- low-latency (decode) mode --------------------------------------------------------------------
def _gather_rows(table: jax.Array, index: jax.Array) -> jax.Array:
    """table[index] along axis 0, zeros where index is -1 (also when table has no rows)."""
    if table.shape[0] == 0:
        return jnp.zeros(index.shape + table.shape[1:], table.dtype)
    safe = jnp.where(index >= 0, index, table.shape[0])
    return jnp.take(table, safe, axis=0, mode="fill", fill_value=0)


def _expert_blocks_to_ranks(a: jax.Array, ep_size: int) -> jax.Array:
    """[E_local, R*T, ...] (receive slots) -> [R, E_local*T, ...] (block r for rank r)."""
    local, slots = a.shape[:2]
    tokens = slots // ep_size
    a = a.reshape((local, ep_size, tokens) + a.shape[2:])
    return jnp.swapaxes(a, 0, 1).reshape((ep_size, local * tokens) + a.shape[3:])


def _rank_blocks_to_experts(a: jax.Array, local: int) -> jax.Array:
    """[R, E_local*T, ...] (block r from rank r) -> [E_local, R*T, ...] (receive slots)."""
    ep_size, n = a.shape[:2]
    tokens = n // local
    a = a.reshape((ep_size, local, tokens) + a.shape[2:])
    return jnp.swapaxes(a, 0, 1).reshape((local, ep_size * tokens) + a.shape[3:])


@jax.custom_jvp
def _rounded(products: jax.Array, runtime_zero: jax.Array) -> jax.Array:
    """The float32 products as stored, so that a later addition cannot fuse with the multiplication
    into a fused multiply-add (XLA:CPU and XLA:GPU contract a*b + c within a fusion, and drop an
    optimization_barrier or a no-op reduce_precision in between). OR-ing the bits with a zero known
    only at run time keeps the multiply and the add apart. Differentiable as the identity it is (a
    bit cast has no derivative for JAX: the second-order gradients through combine's backward, whose
    gate-weight gradient is a row_dot, were zero)."""
    bits = lax.bitcast_convert_type(products, jnp.int32) | runtime_zero.astype(jnp.int32)
    return lax.bitcast_convert_type(bits, jnp.float32)


@_rounded.defjvp
def _rounded_jvp(primals, tangents):
    return _rounded(*primals), tangents[0]


def ll_dest_rank(idx: jax.Array, active: jax.Array, local: int, me: jax.Array) -> jax.Array:
    """[T, K] int32: the rank of each sanitised id's expert where the pair is sent (this rank and
    the expert's rank active), -1 where unused or dropped."""
    dest = jnp.where(idx >= 0, idx // local, 0)
    sent = (idx >= 0) & active[dest] & active[me]
    return jnp.where(sent, dest, -1).astype(jnp.int32)


def ll_dispatch(x: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array,
                cfg: EPConfig, rank_mask: jax.Array | None = None) -> types.LLDispatched:
    """Low-latency dispatch into fixed slots [E_local, R*T] (no custom_vjp here: jax_ep.ops wraps it).

    The source knows where each of its (token, top-k slot) pairs lands: global expert g = idx[t, k]
    (rank g // E_local, local expert g % E_local), slot i(t, k) = number of its earlier tokens routed
    to g. It fills a capacity block [R, E_local, T] (one row per (expert, slot), zeros elsewhere) and
    one all_to_all delivers block r to rank r.
    """
    ep_size = lax.axis_size(cfg.axis_name)
    local = cfg.num_local_experts(ep_size)
    num_experts = cfg.num_experts
    num_tokens, topk = topk_idx.shape

    idx = routing.sanitize_topk(topk_idx, num_experts)
    used = idx >= 0
    active = routing.active(rank_mask, ep_size)
    dest_rank = ll_dest_rank(idx, active, local, lax.axis_index(cfg.axis_name))
    sent = dest_rank >= 0  # a pair to a masked rank, or of a masked rank, is dropped
    weights = jnp.where(sent, topk_weights.astype(jnp.float32), 0.0)

    # i(t, k): this rank's earlier tokens routed to the same expert (exclusive cumsum over tokens)
    picks = jnp.any(idx[:, :, None] == jnp.arange(num_experts, dtype=jnp.int32)[None, None, :], axis=1)
    picks_i = picks.astype(jnp.int32)                                   # [T, E]
    earlier = jnp.cumsum(picks_i, axis=0) - picks_i
    slot = jnp.take_along_axis(earlier, jnp.maximum(idx, 0), axis=1)    # [T, K]
    # position in the send buffer [E*T] = [R, E_local, T] (expert-major, then slot)
    position = jnp.where(sent, idx * num_tokens + slot, num_experts * num_tokens).reshape(-1)
    tk = jnp.arange(num_tokens * topk, dtype=jnp.int32)                 # t*K + k
    send_src = jnp.full((num_experts * num_tokens,), EMPTY_SLOT, jnp.int32).at[position].set(
        tk, mode="drop")
    send_token = jnp.where(send_src >= 0, send_src // topk, -1)

    if cfg.dispatch_dtype == "float8_e4m3fn":
        payload, scales = quantize_fp8(x)
    else:
        payload, scales = x.astype(cfg.wire_dtype(x.dtype)), None

    def deliver(per_token):  # [T, ...] -> [E_local, R*T, ...] on the receivers
        send = _gather_rows(per_token, send_token).reshape((ep_size, local * num_tokens) +
                                                           per_token.shape[1:])
        return _rank_blocks_to_experts(_all_to_all(send, cfg.axis_name), local)

    recv_x = deliver(payload)
    recv_scales = None if scales is None else deliver(scales)
    recv_src = _rank_blocks_to_experts(_all_to_all(send_src.reshape(ep_size, local * num_tokens),
                                                   cfg.axis_name), local)  # [E_local, R*T]
    counts = jnp.sum((recv_src >= 0).reshape(local, ep_size, num_tokens), axis=2, dtype=jnp.int32)
    num_dropped = jnp.sum(used & ~sent, dtype=jnp.int32)
    return types.LLDispatched(recv_x, recv_scales, counts, types.LLHandle(recv_src, weights, dest_rank),
                              num_dropped, active.astype(jnp.int32))


def ll_combine(y: jax.Array, handle: types.LLHandle, cfg: EPConfig,
               rank_mask: jax.Array | None = None) -> jax.Array:
    """Low-latency combine: the expert output of every filled slot goes back to its source (token,
    top-k slot); the source takes the weighted sum (module docstring). rank_mask: a masked rank
    returns nothing and gets nothing; its slots add +0.0."""
    ep_size = lax.axis_size(cfg.axis_name)
    local, _, hidden = y.shape
    num_tokens, topk = handle.topk_weights.shape
    num_pairs = num_tokens * topk
    active = routing.active(rank_mask, ep_size)
    me_active = active[lax.axis_index(cfg.axis_name)]

    # receiver: block r = [T*K] rows for source rank r, row t*K + k holding that pair's output
    src = _expert_blocks_to_ranks(handle.src_slot, ep_size)            # [R, E_local*T]
    ranks = jnp.arange(ep_size, dtype=jnp.int32)[:, None]
    filled = (src >= 0) & me_active & active[:, None]  # nothing to or from a masked rank
    target = jnp.where(filled, ranks * num_pairs + src, ep_size * num_pairs).reshape(-1)
    flat_slot = jnp.arange(ep_size * local * num_tokens, dtype=jnp.int32)   # in [R, E_local*T] order
    row_of = jnp.full((ep_size * num_pairs,), -1, jnp.int32).at[target].set(flat_slot, mode="drop")
    y_slots = _expert_blocks_to_ranks(y, ep_size).reshape(-1, hidden)  # unfilled slots never read
    send = _gather_rows(y_slots, row_of).reshape(ep_size, num_pairs, hidden)
    back = _all_to_all(send, cfg.axis_name)                              # [R (expert's rank), T*K, H]
    came = _all_to_all((row_of >= 0).astype(jnp.int32).reshape(ep_size, num_pairs), cfg.axis_name)

    # source: the one rank that sent each pair, then the weighted sum in top-k order
    from_rank = jnp.argmax(came, axis=0)                                 # [T*K]
    y_back = jnp.take_along_axis(back, from_rank[None, :, None], axis=0)[0]
    dest = handle.dest_rank
    w = jnp.where((dest >= 0) & active[jnp.maximum(dest, 0)] & me_active, handle.topk_weights, 0.0)
    products = w[:, :, None] * y_back.astype(jnp.float32).reshape(num_tokens, topk, hidden)
    products = _rounded(products, jnp.min(came, initial=0))  # came is 0/1: a zero XLA cannot see
    total = jnp.zeros((num_tokens, hidden), jnp.float32)
    for k in range(topk):  # fixed summation order: top-k slot order
        total = jnp.where((w[:, k] != 0)[:, None], total + products[:, k], total)
    return total.astype(jnp.bfloat16)


# ---- two-phase form: the send is bookkeeping here, the receive runs the op ----------------------
def ll_dispatch_send(x: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array,
                     cfg: EPConfig, rank_mask: jax.Array | None = None) -> types.LLDispatchPending:
    """ll_dispatch's first phase: keeps the inputs (nothing moves until ll_dispatch_recv)."""
    ep_size = lax.axis_size(cfg.axis_name)
    idx = routing.sanitize_topk(topk_idx, cfg.num_experts)
    active = routing.active(rank_mask, ep_size)
    dest = ll_dest_rank(idx, active, cfg.num_local_experts(ep_size), lax.axis_index(cfg.axis_name))
    weights = jnp.where(dest >= 0, topk_weights.astype(jnp.float32), 0.0)
    dropped = jnp.sum((idx >= 0) & (dest < 0), dtype=jnp.int32)
    return types.LLDispatchPending(jnp.zeros((4,), jnp.uint32), weights, dest, dropped, x, topk_idx, active)


def ll_dispatch_recv(pending: types.LLDispatchPending, cfg: EPConfig) -> types.LLDispatched:
    """ll_dispatch's second phase: the op itself."""
    return ll_dispatch(pending.x, pending.topk_idx, pending.topk_weights, cfg, pending.rank_mask)


def ll_combine_send(y: jax.Array, handle: types.LLHandle, cfg: EPConfig,
                    rank_mask: jax.Array | None = None) -> types.LLCombinePending:
    """ll_combine's first phase: keeps the inputs."""
    return types.LLCombinePending(jnp.zeros((4,), jnp.uint32), handle.topk_weights, handle.dest_rank, y,
                                  handle.src_slot, routing.active(rank_mask, lax.axis_size(cfg.axis_name)))


def ll_combine_recv(pending: types.LLCombinePending, cfg: EPConfig) -> jax.Array:
    """ll_combine's second phase: the op itself."""
    handle = types.LLHandle(pending.src_slot, pending.topk_weights, pending.dest_rank)
    return ll_combine(pending.y, handle, cfg, pending.rank_mask)
