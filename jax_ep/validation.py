"""Argument checks. Static ones (shapes, dtypes, sizes) raise at trace time; value checks on traced
arrays (expert ids, dropped rows) run in checked mode and raise when the computation runs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_ep.config import EPConfig


class EPValueError(ValueError):
    """A traced value was invalid (checked mode)."""


def _shape_of(a) -> tuple:
    return tuple(getattr(a, "shape", ()))


def check_layout_args(topk_idx, cfg: EPConfig) -> None:
    if getattr(topk_idx, "ndim", None) != 2 or topk_idx.shape[1] != cfg.num_topk:
        raise ValueError(f"get_dispatch_layout: topk_idx must have shape [tokens, {cfg.num_topk}], "
                         f"got {getattr(topk_idx, 'shape', None)}")
    if topk_idx.dtype != jnp.int32:
        raise ValueError(f"get_dispatch_layout: topk_idx must be int32, got dtype {topk_idx.dtype}")


def check_dispatch_args(x, topk_idx, topk_weights, cfg: EPConfig, op: str = "dispatch") -> None:
    if getattr(x, "ndim", None) != 2:
        raise ValueError(f"{op}: x must be 2-D [tokens, hidden], got shape {_shape_of(x)}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{op}: x must be floating point, got dtype {x.dtype}")
    tokens, hidden = x.shape
    if hidden != cfg.hidden:
        raise ValueError(f"{op}: x has hidden size {hidden} but cfg.hidden={cfg.hidden}")
    if tokens > cfg.max_tokens_per_rank:
        raise ValueError(f"{op}: x has {tokens} tokens on this rank, more than "
                         f"cfg.max_tokens_per_rank={cfg.max_tokens_per_rank}")
    expected = (tokens, cfg.num_topk)
    if _shape_of(topk_idx) != expected:
        raise ValueError(f"{op}: topk_idx must have shape {expected} (tokens, num_topk), "
                         f"got {_shape_of(topk_idx)}")
    if topk_idx.dtype != jnp.int32:
        raise ValueError(f"{op}: topk_idx must be int32, got dtype {topk_idx.dtype}")
    if _shape_of(topk_weights) != expected:
        raise ValueError(f"{op}: topk_weights must have shape {expected} (tokens, num_topk), "
                         f"got {_shape_of(topk_weights)}")
    if topk_weights.dtype != jnp.float32:
        raise ValueError(f"{op}: topk_weights must be float32, got dtype {topk_weights.dtype}")


def check_combine_args(y, handle, cfg: EPConfig) -> None:
    capacity = handle.src_index.shape[0]
    if getattr(y, "ndim", None) != 2 or y.shape[0] != capacity:
        raise ValueError(f"combine: y must have shape [capacity={capacity}, hidden], got {_shape_of(y)}")
    if not jnp.issubdtype(y.dtype, jnp.floating) or y.dtype == jnp.float8_e4m3fn:
        raise ValueError(f"combine: y must be float32/bfloat16/float16, got dtype {y.dtype}")


LL_X_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
LL_WIRE_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float8_e4m3fn))


def check_ll_dispatch_args(x, topk_idx, topk_weights, cfg: EPConfig) -> None:
    """ll_dispatch: dispatch's checks, x bfloat16 or float32, and a bfloat16 or FP8 wire."""
    check_dispatch_args(x, topk_idx, topk_weights, cfg, op="ll_dispatch")
    if x.dtype not in LL_X_DTYPES:
        raise ValueError(f"ll_dispatch: x must be bfloat16 or float32, got dtype {x.dtype}")
    wire = cfg.wire_dtype(x.dtype)
    if wire not in LL_WIRE_DTYPES:
        raise ValueError(f"ll_dispatch: tokens travel as bfloat16 or float8_e4m3fn, but x is {x.dtype} "
                         f"and cfg.dispatch_dtype={cfg.dispatch_dtype!r} keeps it; set "
                         "EPConfig.dispatch_dtype='bfloat16' or 'float8_e4m3fn'")


def check_ll_combine_args(y, handle, cfg: EPConfig, ep_size: int) -> None:
    """ll_combine: y [E_local, R*T, H] bfloat16 and a handle of ll_dispatch for this config."""
    local = cfg.num_local_experts(ep_size)
    weights = getattr(handle, "topk_weights", None)
    src_slot = getattr(handle, "src_slot", None)
    if weights is None or src_slot is None:
        raise ValueError("ll_combine: handle must be the LLHandle of ll_dispatch, got "
                         f"{type(handle).__name__}")
    if getattr(weights, "ndim", None) != 2 or weights.shape[1] != cfg.num_topk:
        raise ValueError(f"ll_combine: handle.topk_weights must have shape [tokens, {cfg.num_topk}], "
                         f"got {_shape_of(weights)}")
    if weights.dtype != jnp.float32:
        raise ValueError(f"ll_combine: handle.topk_weights must be float32, got dtype {weights.dtype}")
    tokens = weights.shape[0]
    slots = (local, ep_size * tokens)
    if _shape_of(src_slot) != slots:
        raise ValueError(f"ll_combine: handle.src_slot must have shape {slots} (E_local, R*T), "
                         f"got {_shape_of(src_slot)}")
    if src_slot.dtype != jnp.int32:
        raise ValueError(f"ll_combine: handle.src_slot must be int32, got dtype {src_slot.dtype}")
    expected = slots + (cfg.hidden,)
    if _shape_of(y) != expected:
        raise ValueError(f"ll_combine: y must have shape {expected} (E_local, R*T, cfg.hidden), "
                         f"got {_shape_of(y)}")
    if y.dtype != jnp.bfloat16:
        raise ValueError(f"ll_combine: y must be bfloat16, got dtype {y.dtype}")


def check_topk_values(topk_idx: jax.Array, num_experts: int, axis_name: str) -> None:
    """Checked mode: every id must be -1 or in [0, num_experts). The count is summed over the EP
    group so that every rank raises (a rank left waiting in a collective would hang instead)."""
    bad = (topk_idx < -1) | (topk_idx >= num_experts)
    local_first = jnp.where(jnp.any(bad), topk_idx.reshape(-1)[jnp.argmax(bad.reshape(-1))], 0)
    num_bad = lax.psum(jnp.sum(bad, dtype=jnp.int32), axis_name)
    # the bad value of the lowest rank that has one
    rank = lax.axis_index(axis_name)
    first_rank = lax.pmin(jnp.where(jnp.any(bad), rank, jnp.iinfo(jnp.int32).max), axis_name)
    first = lax.psum(jnp.where(rank == first_rank, local_first, 0), axis_name)

    def _raise(num_bad, first_value):
        if int(num_bad):
            raise EPValueError(f"jax_ep: topk_idx has {int(num_bad)} ids outside [-1, {num_experts}) "
                               f"across the EP group; first bad value {int(first_value)}")

    jax.debug.callback(_raise, num_bad, first)


def check_no_drops(num_dropped: jax.Array, capacity: int, axis_name: str) -> None:
    """Checked mode: capacity overflow is an error naming the count (summed over the EP group, so
    that every rank raises)."""
    total = lax.psum(num_dropped, axis_name)

    def _raise(dropped):
        if int(dropped):
            raise EPValueError(f"jax_ep: capacity {capacity} too small: {int(dropped)} rows dropped "
                               "across the EP group (raise EPConfig.capacity, or None for the worst case)")

    jax.debug.callback(_raise, total)


def float0_like(a) -> np.ndarray:
    return np.zeros(np.shape(a), dtype=jax.dtypes.float0)
