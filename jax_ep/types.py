"""The arrays the ops exchange, and each op's output types (the contract every backend meets).

All are per-rank views (inside shard_map over the EP axis). Shapes: T tokens on this rank, K =
num_topk, H = hidden, R = EP size, E = num_experts, E_local = E / R, C = capacity (receive rows on
this rank). A received token is named by its *source slot* n = src_rank * T + src_token.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_ep.config import EPConfig

# Sentinels in the handle's index arrays.
EMPTY_ROW = -1    # src_index: the receive row holds no token (padding or past the last expert)
NOT_ROUTED = -1   # token_rows: the top-k slot does not name an expert of this rank (or is unused)
DROPPED = -2      # token_rows: the slot was routed here but its row was dropped for lack of capacity
EMPTY_SLOT = -1   # LLHandle.src_slot (low-latency mode): the receive slot holds no token


class Layout(NamedTuple):
    """Where this rank's tokens go (DeepEP's get_dispatch_layout)."""

    num_tokens_per_rank: jax.Array    # [R] int32: tokens of this rank sent to each rank (once per rank)
    num_tokens_per_expert: jax.Array  # [E] int32: tokens of this rank that picked each expert
    is_token_in_rank: jax.Array       # [T, R] bool: token t travels to rank r


class Handle(NamedTuple):
    """What combine (and the backward passes) need from dispatch. Arrays only: a pytree that passes
    whole through jit and custom_vjp (its integer fields get float0 cotangents)."""

    src_index: jax.Array         # [C] int32: source slot of the token each receive row holds, or EMPTY_ROW
    token_rows: jax.Array        # [R*T, K] int32: receive row of (source slot n, top-k slot k), or
                                 # NOT_ROUTED / DROPPED
    is_token_in_rank: jax.Array  # [T, R] bool: source side, token t was sent to rank r
    row_weights: jax.Array       # [C] float32: gate weight of each receive row (0 for empty rows)
    # [R] int32: the rank_mask the dispatch ran with (1 active), None when it had none; the ops of the
    # handle AND theirs with it (ops.handle_mask): a rank the dispatch masked has no rows to give back
    rank_mask: jax.Array | None = None


class Dispatched(NamedTuple):
    """Result of dispatch on one rank: expert-major rows ready for jax_ep.grouped_matmul."""

    x: jax.Array                  # [C, H] rows (x's dtype, bfloat16 or float8_e4m3fn)
    scales: jax.Array | None      # [C, ceil(H/128)] float32 for FP8 rows, else None
    group_sizes: jax.Array        # [E_local] int32 rows per local expert, padded to expert_alignment
    expert_counts: jax.Array      # [E_local] int32 rows per local expert actually received (unpadded)
    num_dropped: jax.Array        # [] int32 rows this rank dropped for lack of capacity, and its own
                                  # pairs that went nowhere (a rank masked: docs/api.md "Rank masking")
    handle: Handle
    rank_mask: jax.Array | None = None  # [R] int32: the ranks this rank's call ran with (1) or without
                                        # (0): the rank_mask argument AND NOT the persistent mask
                                        # (backend "cuda", shrink mode); all ones without a mask

    @property
    def row_weights(self) -> jax.Array:
        """[C] float32 gate weight per receive row (the handle's)."""
        return self.handle.row_weights


# ---- rank-major mode (DeepEP's contract): one row per (token, destination rank) ------------------
class RankMajorHandle(NamedTuple):
    """What combine_rank_major (and the backward passes) need from dispatch_rank_major. Arrays only:
    a pytree that passes whole through jit and custom_vjp."""

    src_index: jax.Array         # [R*T] int32: source slot n = src_rank*T + src_token of each row,
                                 # or EMPTY_ROW (rows past the last received token)
    is_token_in_rank: jax.Array  # [T, R] bool: source side, token t was sent to rank r
    rank_mask: jax.Array | None = None   # as Handle.rank_mask


class RankMajorDispatched(NamedTuple):
    """Result of dispatch_rank_major on one rank: one row per (source token, this rank) pair whose
    token picked any expert of this rank. Rows are packed from row 0: source rank major, token order
    within; rows past sum(num_tokens_per_rank) are empty (x zero, ids -1, weights 0)."""

    x: jax.Array                     # [R*T, H] rows (x's dtype, bfloat16 or float8_e4m3fn)
    scales: jax.Array | None         # [R*T, ceil(H/128)] float32 for FP8 rows, else None
    topk_idx: jax.Array              # [R*T, K] int32: the token's local expert id (0..E_local-1) in
                                     # each top-k slot naming an expert of this rank, -1 elsewhere
    topk_weights: jax.Array          # [R*T, K] float32: the slot's gate weight where topk_idx >= 0, else 0
    num_tokens_per_rank: jax.Array   # [R] int32: rows received from each source rank
    num_tokens_per_expert: jax.Array  # [E_local] int32: (token, local expert) pairs received per expert
    handle: RankMajorHandle


# ---- low-latency (decode) mode: fixed receive slots per (local expert, source rank) ---------------
class LLHandle(NamedTuple):
    """What ll_combine needs from ll_dispatch (arrays only: a pytree that passes whole through jit)."""

    src_slot: jax.Array      # [E_local, R*T] int32: t*K + k of the source (token, top-k slot) each
                             # receive slot holds (source rank r = slot // T), or EMPTY_SLOT
    topk_weights: jax.Array  # [T, K] float32: this rank's gate weights, 0 where the sanitised id is
                             # unused or the slot was dropped (ll_combine skips every weight-0 slot)
    dest_rank: jax.Array     # [T, K] int32: the rank each top-k slot went to, -1 where unused or
                             # dropped (its rank masked); ll_combine skips slots of masked ranks
    rank_mask: jax.Array | None = None   # [R] int32: the ranks that took part in a masked dispatch
                                         # (LLDispatched.rank_mask), None without a mask (as
                                         # Handle.rank_mask); ll_combine ANDs its mask with it


class LLDispatched(NamedTuple):
    """Result of ll_dispatch on one rank: per local expert, R blocks of T fixed slots (block r holds
    source rank r's tokens routed to that expert, in token order, then unspecified slots)."""

    x: jax.Array              # [E_local, R*T, H] bfloat16 or float8_e4m3fn; slots past counts unspecified
    scales: jax.Array | None  # [E_local, R*T, ceil(H/128)] float32 for FP8, else None
    counts: jax.Array         # [E_local, R] int32 tokens received per (local expert, source rank)
    handle: LLHandle
    num_dropped: jax.Array    # [] int32: this rank's (token, top-k slot) pairs not sent because the
                              # expert's rank (or this rank) is masked in the call
    rank_mask: jax.Array      # [R] int32: the ranks that took part in the call (1) or were masked (0)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["token", "topk_weights", "dest_rank", "num_dropped", "x", "topk_idx",
                                "rank_mask"],
                   meta_fields=["backend", "cfg", "masked"])
@dataclasses.dataclass(frozen=True)
class LLDispatchPending:
    """What ll_dispatch_send hands to ll_dispatch_recv (a pytree of arrays; ``backend``, static, names
    the backend whose receive takes it: the send's, jax_ep.backends). Pass it on unchanged and receive
    it exactly once, before the op's call two later (fused or sent; see docs/api.md)."""

    token: jax.Array               # [4] uint32: the call (backend="cuda"); zeros on the reference path
    # the handle's slots as the send keeps them (its rank mask; the receive also drops the pairs of a
    # rank masked during the call, shrink mode): as LLHandle's, and LLDispatched's num_dropped
    topk_weights: jax.Array        # [T, K] float32: 0 where the pair is not sent
    dest_rank: jax.Array           # [T, K] int32: the rank of each sent pair's expert, -1 elsewhere
    num_dropped: jax.Array         # [] int32: the used pairs not sent
    x: jax.Array | None = None     # reference path only: the tokens (its send is bookkeeping)
    topk_idx: jax.Array | None = None
    rank_mask: jax.Array | None = None  # reference path only: the send's mask (bool [R])
    backend: str | None = dataclasses.field(default=None, kw_only=True)  # the send's (jax_ep.ops sets it)
    cfg: EPConfig | None = dataclasses.field(default=None, kw_only=True)  # the send's: the receive checks it
    # the send had a rank_mask (static; jax_ep.ops sets it): the received handle carries the mask then
    masked: bool = dataclasses.field(default=False, kw_only=True)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["token", "topk_weights", "dest_rank", "y", "src_slot", "rank_mask"],
                   meta_fields=["backend", "cfg"])
@dataclasses.dataclass(frozen=True)
class LLCombinePending:
    """What ll_combine_send hands to ll_combine_recv (a pytree of arrays; ``backend`` static); same
    rules as LLDispatchPending."""

    token: jax.Array               # [4] uint32: the call (backend="cuda"); zeros on the reference path
    topk_weights: jax.Array        # [T, K] float32: the LLHandle's
    dest_rank: jax.Array           # [T, K] int32: the LLHandle's
    y: jax.Array | None = None     # the expert outputs (the CUDA receive reads its own rank's rows)
    src_slot: jax.Array | None = None  # reference path only: the handle's slots
    rank_mask: jax.Array | None = None  # reference path only: the send's mask (bool [R])
    backend: str | None = dataclasses.field(default=None, kw_only=True)  # the send's (jax_ep.ops sets it)
    cfg: EPConfig | None = dataclasses.field(default=None, kw_only=True)  # the send's: the receive checks it


# ---- output types of each op (the backends' contract) ----------------------------------------------
def _sds(shape, dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))


def layout_types(num_tokens: int, num_experts: int, ep_size: int) -> Layout:
    return Layout(_sds((ep_size,), jnp.int32), _sds((num_experts,), jnp.int32),
                  _sds((num_tokens, ep_size), jnp.bool_))


def handle_types(num_tokens: int, capacity: int, cfg: EPConfig, ep_size: int) -> Handle:
    return Handle(_sds((capacity,), jnp.int32), _sds((ep_size * num_tokens, cfg.num_topk), jnp.int32),
                  _sds((num_tokens, ep_size), jnp.bool_), _sds((capacity,), jnp.float32))


def dispatch_types(num_tokens: int, x_dtype, cfg: EPConfig, ep_size: int) -> Dispatched:
    capacity = cfg.resolved_capacity(ep_size)
    local = cfg.num_local_experts(ep_size)
    scales = (_sds((capacity, cfg.num_scale_blocks), jnp.float32)
              if cfg.dispatch_dtype == "float8_e4m3fn" else None)
    return Dispatched(_sds((capacity, cfg.hidden), cfg.wire_dtype(x_dtype)), scales,
                      _sds((local,), jnp.int32), _sds((local,), jnp.int32), _sds((), jnp.int32),
                      handle_types(num_tokens, capacity, cfg, ep_size), _sds((ep_size,), jnp.int32))


def num_source_tokens(handle: Handle, ep_size: int) -> int:
    """T, the tokens per rank the handle was made for."""
    return handle.token_rows.shape[0] // ep_size


def combine_types(y, handle: Handle, ep_size: int) -> jax.ShapeDtypeStruct:
    """[T, H'] of y's dtype, for expert outputs y [C, H'] (H' need not be cfg.hidden)."""
    return _sds((num_source_tokens(handle, ep_size), y.shape[1]), y.dtype)


def broadcast_types(g, handle: Handle) -> jax.ShapeDtypeStruct:
    """[C, H'] of g's dtype, for per-token rows g [T, H']."""
    return _sds((handle.src_index.shape[0], g.shape[1]), g.dtype)


def combine_bwd_types(y, handle: Handle) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
    """(d y [C, H'] of y's dtype, d row_weights [C] float32), for expert outputs y [C, H']."""
    return _sds(y.shape, y.dtype), _sds(handle.row_weights.shape, jnp.float32)


def ll_dispatch_types(num_tokens: int, x_dtype, cfg: EPConfig, ep_size: int) -> LLDispatched:
    """ll_dispatch's outputs for T = num_tokens tokens of ``x_dtype`` per rank."""
    local = cfg.num_local_experts(ep_size)
    slots = ep_size * num_tokens
    scales = (_sds((local, slots, cfg.num_scale_blocks), jnp.float32)
              if cfg.dispatch_dtype == "float8_e4m3fn" else None)
    return LLDispatched(_sds((local, slots, cfg.hidden), cfg.wire_dtype(x_dtype)), scales,
                        _sds((local, ep_size), jnp.int32),
                        LLHandle(_sds((local, slots), jnp.int32),
                                 _sds((num_tokens, cfg.num_topk), jnp.float32),
                                 _sds((num_tokens, cfg.num_topk), jnp.int32)),
                        _sds((), jnp.int32), _sds((ep_size,), jnp.int32))


def ll_combine_types(handle: LLHandle, cfg: EPConfig) -> jax.ShapeDtypeStruct:
    """[T, H] bfloat16."""
    return _sds((handle.topk_weights.shape[0], cfg.hidden), jnp.bfloat16)


def slot_values_types(handle: Handle, cfg: EPConfig, ep_size: int) -> jax.ShapeDtypeStruct:
    return _sds((num_source_tokens(handle, ep_size), cfg.num_topk), jnp.float32)


def rank_major_dispatch_types(num_tokens: int, x_dtype, cfg: EPConfig, ep_size: int) -> RankMajorDispatched:
    """dispatch_rank_major's outputs for T = num_tokens tokens of ``x_dtype`` per rank."""
    rows = ep_size * num_tokens
    scales = (_sds((rows, cfg.num_scale_blocks), jnp.float32)
              if cfg.dispatch_dtype == "float8_e4m3fn" else None)
    local = cfg.num_local_experts(ep_size)
    handle = RankMajorHandle(_sds((rows,), jnp.int32), _sds((num_tokens, ep_size), jnp.bool_))
    return RankMajorDispatched(_sds((rows, cfg.hidden), cfg.wire_dtype(x_dtype)), scales,
                               _sds((rows, cfg.num_topk), jnp.int32), _sds((rows, cfg.num_topk), jnp.float32),
                               _sds((ep_size,), jnp.int32), _sds((local,), jnp.int32), handle)


def rank_major_combine_types(y, handle: RankMajorHandle) -> jax.ShapeDtypeStruct:
    """[T, H'] of y's dtype, for rows y [R*T, H']."""
    return _sds((handle.is_token_in_rank.shape[0], y.shape[1]), y.dtype)


def rank_major_broadcast_types(g, handle: RankMajorHandle) -> jax.ShapeDtypeStruct:
    """[R*T, H'] of g's dtype, for per-token rows g [T, H']."""
    return _sds((handle.src_index.shape[0], g.shape[1]), g.dtype)
