"""Routing facts every backend and the argument checks share: which top-k slots are used, which rank
each slot's expert lives on, the per-rank and per-expert counts, and what a rank mask cuts. Pure JAX, no
communication (the functions taking a cfg read its mesh axis' size and this rank's index only)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jax_ep.config import EPConfig
from jax_ep.types import Layout


def sanitize_topk(topk_idx: jax.Array, num_experts: int) -> jax.Array:
    """Out-of-range ids and repeated experts within a token become -1 (unused)."""
    idx = jnp.where((topk_idx >= 0) & (topk_idx < num_experts), topk_idx, -1).astype(jnp.int32)
    k = idx.shape[1]
    same = idx[:, :, None] == idx[:, None, :]                      # [T, k, j]
    earlier = jnp.arange(k)[None, :] < jnp.arange(k)[:, None]      # j < k
    repeated = jnp.any(same & earlier[None], axis=2) & (idx >= 0)
    return jnp.where(repeated, -1, idx)


def destinations(idx: jax.Array, num_experts: int, ep_size: int) -> tuple[jax.Array, jax.Array]:
    """For sanitised ids: the rank of each slot's expert (-1 unused) and token->rank membership."""
    dest_rank = jnp.where(idx >= 0, idx // (num_experts // ep_size), -1)
    in_rank = jnp.any(dest_rank[:, :, None] == jnp.arange(ep_size)[None, None, :], axis=1)
    return dest_rank, in_rank


def layout_of(topk_idx: jax.Array, num_experts: int, ep_size: int) -> Layout:
    """The layout op (``reference.layout``) for a given EP size: rank-local, needs no mesh axis
    (host-side statistics)."""
    idx = sanitize_topk(topk_idx, num_experts)
    _, in_rank = destinations(idx, num_experts, ep_size)
    per_expert = jnp.zeros((num_experts,), jnp.int32).at[jnp.where(idx >= 0, idx, num_experts)].add(
        1, mode="drop")
    per_rank = jnp.sum(in_rank, axis=0, dtype=jnp.int32)
    return Layout(per_rank, per_expert, in_rank)


def active(rank_mask: jax.Array | None, ep_size: int) -> jax.Array:
    """bool [R]: the ranks taking part (rank_mask nonzero; every rank without one)."""
    if rank_mask is None:
        return jnp.ones((ep_size,), jnp.bool_)
    return rank_mask.astype(jnp.bool_) if rank_mask.dtype != jnp.bool_ else rank_mask


def linked(rank_mask: jax.Array, axis_name: str) -> jax.Array:
    """[R] bool: the ranks this rank exchanges data with under rank_mask (the kernels'
    OpInfo::linked): every active rank if this one is active, only itself if it is masked."""
    me = lax.axis_index(axis_name)
    rank_mask = active(rank_mask, rank_mask.shape[0])   # an integer mask: nonzero, not its bits
    return jnp.where(rank_mask[me], rank_mask, jnp.arange(rank_mask.shape[0]) == me)


def live(rank_mask: jax.Array | None, axis_name: str, ep_size: int) -> jax.Array:
    """[R] bool: the destinations this rank's dispatch pairs reach: the active ranks if this one is
    active, none if it is masked (all of them without a mask)."""
    if rank_mask is None:
        return jnp.ones((ep_size,), bool)
    rank_mask = active(rank_mask, ep_size)   # an integer mask: nonzero, not its bits (2 & ~2 is 0)
    return rank_mask & rank_mask[lax.axis_index(axis_name)]


def _goes_nowhere(topk_idx: jax.Array, cfg: EPConfig, rank_mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(the sanitised ids, [T, K] bool: the pairs rank_mask sends nowhere)."""
    ep_size = lax.axis_size(cfg.axis_name)
    clean = sanitize_topk(topk_idx, cfg.num_experts)
    dest_rank, _ = destinations(clean, cfg.num_experts, ep_size)
    reached = live(rank_mask, cfg.axis_name, ep_size)
    return clean, (dest_rank >= 0) & ~reached[jnp.maximum(dest_rank, 0)]


def masked_pairs(topk_idx: jax.Array, cfg: EPConfig, rank_mask: jax.Array | None) -> jax.Array:
    """int32: this rank's own (token, expert) pairs that go nowhere under rank_mask (every one on a
    masked rank, those to masked ranks' experts on an active one; 0 without a mask). dispatch counts
    them in this rank's num_dropped."""
    if rank_mask is None:
        return jnp.zeros((), jnp.int32)
    return jnp.sum(_goes_nowhere(topk_idx, cfg, rank_mask)[1], dtype=jnp.int32)


def reached_topk(topk_idx: jax.Array, cfg: EPConfig, rank_mask: jax.Array | None) -> jax.Array:
    """topk_idx with -1 in the slots rank_mask sends nowhere (``masked_pairs``'): the pairs that reach
    a rank (topk_idx itself without a mask)."""
    if rank_mask is None:
        return topk_idx
    clean, nowhere = _goes_nowhere(topk_idx, cfg, rank_mask)
    return jnp.where(nowhere, -1, clean)
