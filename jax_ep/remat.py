"""Rematerialisation (``jax.checkpoint`` / ``nnx.remat``) and the EP exchanges.

A rematerialised block runs its forward again in the backward to rebuild what the backward reads, and
an MoE layer's backward reads dispatch's results (the rows, for the expert GEMMs' weight gradients, and
the handle, for every backward exchange): without a policy that keeps them, the block's backward runs
dispatch again, one exchange more per layer and step (two on the hierarchical path; and combine again
where the block's backward reads the layer's output). The ops name their results with
``jax.ad_checkpoint.checkpoint_name``:

- ``DISPATCH``: every dispatch's results (``dispatch``, ``dispatch_rank_major``, both stages of
  ``dispatch_hierarchical``; the FP8 wire's e4m3 rows and scales, not their dequantised copy, which the
  backward rebuilds without an exchange).
- ``COMBINE``: every combine's output (``combine``, ``combine_rank_major``, ``combine_hierarchical``).
- ``GATE_UP``: the MoE layer's gate|up grouped GEMM output [C, 2F] (``moe.expert_block`` and the layer's
  throughput path).

``policy()`` builds a ``jax.checkpoint`` policy that keeps the named results (or moves them to host
memory) beside what another policy keeps. Keeping dispatch's results costs their bytes until the
backward: the rows [C, H] at the capacity C (``EPConfig.capacity``), about C / T times the block's
input. What the layer's rerun then holds besides the router (docs/api.md): both grouped GEMMs' forwards
with ``policy()`` (the gate|up GEMM's output feeds SwiGLU's backward; the down GEMM's is the buffer
combine's backward writes into, ``EPOptions.dy_in_place``, the default, or what the weighted combine's
backward reads, ``gate_weights="combine"``); none with ``GATE_UP`` kept too, ``dy_in_place=False`` and
the gate weights in the experts. Checked mode's checks (``EPConfig.checked``) rerun. With several
processes the EP calls carry an ordered effect (``jax_ep.ordering``), and JAX never runs an effect again:
it keeps their results with or without a policy, and host offload is refused there. Calls on jax_ep's
side stream are never rerun in one process either (``ordering.kept_call``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax._src.interpreters import partial_eval as pe
from jax.ad_checkpoint import checkpoint_name

from jax_ep import ordering
from jax_ep.errors import EPUnsupportedError, EPValueError

DISPATCH = "jax_ep.dispatch"
COMBINE = "jax_ep.combine"
GATE_UP = "jax_ep.gate_up"
NAMES = (DISPATCH, COMBINE, GATE_UP)


def named(tree, name: str):
    """``checkpoint_name`` of a pytree of results, an FP8 array named as its bits (uint8): an e4m3 array a
    policy kept came back as garbage in the backward of a jax.checkpoint inside shard_map (the FP8 wire's
    rows: NaN outputs and gradients with ``policy()``, none without a policy; jax 0.10.2 on the CPU, found
    by a fuzzer, 2026-12-06; the cause inside JAX is not pinned down), while its bits come back whole."""
    def one(leaf):
        if jnp.issubdtype(leaf.dtype, jnp.floating) and jnp.dtype(leaf.dtype).itemsize == 1:
            return lax.bitcast_convert_type(checkpoint_name(lax.bitcast_convert_type(leaf, jnp.uint8), name),
                                            leaf.dtype)
        return checkpoint_name(leaf, name)
    return jax.tree.map(one, tree)


def policy(save: Sequence[str] | None = None, *, offload: Sequence[str] = (), base: Callable | None = None,
           offload_src: str = "device", offload_dst: str = "pinned_host") -> Callable:
    """A ``jax.checkpoint`` policy: the results named in ``save`` are kept for the backward, those in
    ``offload`` are moved to ``offload_dst`` memory and back (JAX's
    ``save_and_offload_only_these_names``), and with ``base`` (another policy, e.g.
    ``jax.checkpoint_policies.dots_saveable``) what it keeps or offloads is kept or offloaded too. The
    default (``save=None``) keeps dispatch's results, unless ``offload`` names them: the backward runs
    no exchange again.

    Example: ``nnx.remat(block, policy=jax_ep.remat.policy())``."""
    if save is None:
        save = () if not isinstance(offload, str) and DISPATCH in offload else (DISPATCH,)
    for what, names in (("save", save), ("offload", offload)):
        if isinstance(names, str) or any(n not in NAMES for n in names):
            raise EPValueError(f"jax_ep.remat.policy: {what} must be a sequence of {NAMES}, got {names!r}")
    if set(save) & set(offload):
        raise EPValueError(f"jax_ep.remat.policy: {sorted(set(save) & set(offload))} both saved and "
                           "offloaded")
    ours = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=list(save), names_which_can_be_offloaded=list(offload),
        offload_src=offload_src, offload_dst=offload_dst)

    def policy_fn(prim, *args, **params):
        # JAX's save_from_both_policies takes boolean policies only (not an offloading one): its OR here
        decision = pe.ensure_enum(ours(prim, *args, **params))
        if isinstance(decision, pe.RecomputeType) and base is not None:
            decision = pe.ensure_enum(base(prim, *args, **params))
        if isinstance(decision, pe.Offloadable) and ordering.needed():
            raise EPUnsupportedError(
                f"jax_ep.remat.policy: host offload (offload={tuple(offload)}, or base's) needs one "
                "process: with several processes the EP calls carry an ordered effect (jax_ep.ordering), "
                "and jax 0.10-0.11 cannot lower host offload in a program with ordered effects (the EP "
                "calls' own results are kept on the device there without any policy: JAX never reruns "
                "an effect). Save instead (remat.policy(save=...))")
        return decision
    return policy_fn
