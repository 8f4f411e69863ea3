"""Public ops: dispatch, combine and get_dispatch_layout, with custom_vjp.

Call them inside ``shard_map`` over ``cfg.axis_name`` (per-rank view). The backward passes reuse the
forward machinery: the gradient of dispatch is a combine without gate weights (plus the gate-weight
gradients sent back to their top-k slots); the gradient of combine is a dispatch of the cotangents
through the same handle.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jax_ep import reference
from jax_ep.config import EPConfig
from jax_ep.types import Dispatched, Handle, Layout
from jax_ep.validation import (
    check_combine_args,
    check_dispatch_args,
    check_no_drops,
    check_topk_values,
    float0_like,
)

_OPS = ("layout", "dispatch", "combine", "broadcast", "slot_values")


def backend_for(cfg: EPConfig, op: str):
    """The function implementing `op` for cfg.backend.

    "auto" takes the CUDA kernel when the extension is loaded, the default platform is a GPU and the
    op is in ``cuda_backend.FASTER_THAN_REFERENCE`` (its kernel measured faster than the reference
    path, docs/benchmarks.md); otherwise the reference. "cuda" takes every kernel there is and never
    falls back: it raises with the reason.
    """
    assert op in _OPS, op
    if cfg.backend == "reference":
        return getattr(reference, op)
    from jax_ep import cuda_backend, runtime  # imported lazily: the extension is optional

    kernel = getattr(cuda_backend, op, None)
    usable, reason = runtime.available()
    if cfg.backend == "auto":
        if usable and op in cuda_backend.FASTER_THAN_REFERENCE and jax.default_backend() == "gpu":
            return kernel
        return getattr(reference, op)
    if not usable:
        raise RuntimeError(f"jax_ep: backend='cuda' is unavailable: {reason}. Use backend='reference' "
                           "or 'auto'.")
    if kernel is None:
        raise NotImplementedError(f"jax_ep: the cuda backend has no kernel for {op!r} in this build; "
                                  "use backend='reference' or 'auto' for it.")
    return kernel


def _ep_size(cfg: EPConfig, op: str) -> int:
    try:
        return lax.axis_size(cfg.axis_name)
    except NameError as e:
        raise ValueError(f"jax_ep.{op} must run inside shard_map over the mesh axis "
                         f"{cfg.axis_name!r} (cfg.axis_name); that axis is not bound here") from e


def get_dispatch_layout(topk_idx: jax.Array, cfg: EPConfig) -> Layout:
    """Tokens of this rank per destination rank and per expert, and token->rank membership."""
    ep_size = _ep_size(cfg, "get_dispatch_layout")
    cfg.check_ep_size(ep_size)
    if getattr(topk_idx, "ndim", None) != 2 or topk_idx.shape[1] != cfg.num_topk:
        raise ValueError(f"get_dispatch_layout: topk_idx must have shape [tokens, {cfg.num_topk}], "
                         f"got {getattr(topk_idx, 'shape', None)}")
    if topk_idx.dtype != jnp.int32:
        raise ValueError(f"get_dispatch_layout: topk_idx must be int32, got dtype {topk_idx.dtype}")
    if cfg.checked:
        check_topk_values(topk_idx, cfg.num_experts, cfg.axis_name)
    return backend_for(cfg, "layout")(topk_idx, cfg.num_experts, ep_size)


def dispatch(x: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array, cfg: EPConfig) -> Dispatched:
    """Send each token to the ranks of its top-k experts; return expert-major rows on each rank.

    Args:
      x: [T, H] tokens of this rank.
      topk_idx: [T, K] int32 expert ids; -1 marks an unused slot.
      topk_weights: [T, K] float32 gate weights.
      cfg: EPConfig (static).
    Returns:
      Dispatched: rows [C, H] (expert-major, one per (token, local expert) pair), scales for FP8,
      group_sizes [E_local] (aligned), expert_counts, row_weights [C], num_dropped, handle.
    """
    ep_size = _ep_size(cfg, "dispatch")
    check_dispatch_args(x, topk_idx, topk_weights, cfg, ep_size)
    if cfg.checked:
        check_topk_values(topk_idx, cfg.num_experts, cfg.axis_name)
    out = _dispatch(x, topk_idx, topk_weights, cfg)
    if cfg.checked:
        check_no_drops(out.num_dropped, cfg.resolved_capacity(ep_size), cfg.axis_name)
    return out


def combine(y: jax.Array, handle: Handle, cfg: EPConfig) -> jax.Array:
    """For each token of this rank, the gate-weighted sum of its expert outputs y ([C, H] -> [T, H])."""
    _ep_size(cfg, "combine")
    check_combine_args(y, handle, cfg)
    return _combine(y, handle.row_weights, handle.src_index, handle.token_rows, handle.is_token_in_rank,
                    cfg)


# ---- dispatch -------------------------------------------------------------------------------------
@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _dispatch(x, topk_idx, topk_weights, cfg):
    return backend_for(cfg, "dispatch")(x, topk_idx, topk_weights, cfg)


def _dispatch_fwd(x, topk_idx, topk_weights, cfg):
    out = backend_for(cfg, "dispatch")(x, topk_idx, topk_weights, cfg)
    dtype_token = jnp.zeros((0,), x.dtype)  # residuals must be arrays: carries x's dtype
    return out, (out.handle, dtype_token, topk_idx)


def _dispatch_bwd(cfg, residuals, ct):
    handle, dtype_token, topk_idx = residuals
    if cfg.dispatch_dtype == "float8_e4m3fn":
        raise NotImplementedError(
            "jax_ep: dispatch with dispatch_dtype='float8_e4m3fn' is forward-only (inference and "
            "prefill); differentiate through a bfloat16 dispatch instead")
    d_rows = ct.x
    d_row_weights = ct.row_weights + ct.handle.row_weights
    dx = backend_for(cfg, "combine")(d_rows, None, handle, cfg).astype(dtype_token.dtype)
    d_topk_weights = backend_for(cfg, "slot_values")(d_row_weights, handle, cfg)
    return dx, float0_like(topk_idx), d_topk_weights


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


# ---- combine --------------------------------------------------------------------------------------
@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _combine(y, row_weights, src_index, token_rows, is_token_in_rank, cfg):
    handle = Handle(src_index, token_rows, is_token_in_rank, row_weights)
    return backend_for(cfg, "combine")(y, row_weights, handle, cfg)


def _combine_fwd(y, row_weights, src_index, token_rows, is_token_in_rank, cfg):
    handle = Handle(src_index, token_rows, is_token_in_rank, row_weights)
    out = backend_for(cfg, "combine")(y, row_weights, handle, cfg)
    return out, (y, row_weights, src_index, token_rows, is_token_in_rank)


def _combine_bwd(cfg, residuals, g):
    y, row_weights, src_index, token_rows, is_token_in_rank = residuals
    handle = Handle(src_index, token_rows, is_token_in_rank, row_weights)
    g_rows = backend_for(cfg, "broadcast")(g, handle, cfg).astype(jnp.float32)
    dy = (g_rows * row_weights[:, None]).astype(y.dtype)
    d_row_weights = jnp.sum(y.astype(jnp.float32) * g_rows, axis=1)
    return (dy, d_row_weights, float0_like(src_index), float0_like(token_rows),
            float0_like(is_token_in_rank))


_combine.defvjp(_combine_fwd, _combine_bwd)
