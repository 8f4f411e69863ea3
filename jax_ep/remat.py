"""Rematerialisation (``jax.checkpoint`` / ``nnx.remat``) and the EP exchanges.

A rematerialised block runs its forward again in the backward to rebuild what the backward reads, and
an MoE layer's backward reads dispatch's results (the rows, for the expert GEMMs' weight gradients, and
the handle, for every backward exchange): without a policy that keeps them, the block's backward runs
dispatch again, one exchange more per layer and step (and combine again where the block's backward
reads the layer's output). The ops name their results with ``jax.ad_checkpoint.checkpoint_name``:

- ``DISPATCH``: every dispatch's results (``dispatch``, ``dispatch_rank_major``, both stages of
  ``dispatch_hierarchical``; the FP8 wire's e4m3 rows and scales, not their dequantised copy, which the
  backward rebuilds without an exchange).
- ``COMBINE``: every combine's output (``combine``, ``combine_rank_major``, ``combine_hierarchical``).
- ``GATE_UP``: the MoE layer's gate|up grouped GEMM output [C, 2F] (``moe.expert_block`` and the layer's
  throughput path): kept with dispatch's results, the rerun holds no GEMM either (SwiGLU alone).

``policy()`` builds a ``jax.checkpoint`` policy that keeps them (or moves them to host memory) beside
whatever another policy keeps. Keeping dispatch's results costs their bytes until the backward: the
rows [C, H] at the capacity C (``EPConfig.capacity``), about C / T times the block's input. The layer's
combine writes its backward into the down GEMM's output buffer (``EPOptions.dy_in_place``, the
default), so a rerun computes that GEMM again unless ``dy_in_place=False``. With several
processes the EP calls carry an ordered effect (``jax_ep.ordering``), and JAX never runs an effect again:
it keeps their results with or without a policy (offloading them is refused there)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
from jax.ad_checkpoint import checkpoint_name

from jax_ep.errors import EPUnsupportedError, EPValueError

DISPATCH = "jax_ep.dispatch"
COMBINE = "jax_ep.combine"
GATE_UP = "jax_ep.gate_up"
NAMES = (DISPATCH, COMBINE, GATE_UP)


def named(tree, name: str):
    """tree's arrays named ``name`` for checkpoint policies (the same values)."""
    return checkpoint_name(tree, name)


def policy(save: Sequence[str] = (DISPATCH,), *, offload: Sequence[str] = (), base: Callable | None = None,
           offload_src: str = "device", offload_dst: str = "pinned_host") -> Callable:
    """A ``jax.checkpoint`` policy: the exchanges' results named in ``save`` are kept for the backward,
    those in ``offload`` are moved to ``offload_dst`` memory and back (``save_and_offload_only_these_
    names``), and with ``base`` (another policy, e.g. ``jax.checkpoint_policies.dots_saveable``) whatever
    it keeps is kept too. The default keeps dispatch's results: the backward runs no exchange again.

    Example: ``nnx.remat(block, policy=jax_ep.remat.policy())``."""
    for what, names in (("save", save), ("offload", offload)):
        if isinstance(names, str) or any(n not in NAMES for n in names):
            raise EPValueError(f"jax_ep.remat.policy: {what} must be a sequence of {NAMES}, got {names!r}")
    if set(save) & set(offload):
        raise EPValueError(f"jax_ep.remat.policy: {sorted(set(save) & set(offload))} both saved and "
                           "offloaded")
    cp = jax.checkpoint_policies
    if offload:
        ours = _one_process_only(cp.save_and_offload_only_these_names(
            names_which_can_be_saved=list(save), names_which_can_be_offloaded=list(offload),
            offload_src=offload_src, offload_dst=offload_dst), offload)
    else:
        ours = cp.save_only_these_names(*save)
    return ours if base is None else cp.save_from_both_policies(ours, base)


def _one_process_only(offloading: Callable, offload) -> Callable:
    """The offloading policy, refused (when a name it would offload is met) where the EP calls carry
    the ordering effect (several processes, ``jax_ep.ordering``): JAX keeps an effect's results on the
    device anyway (it never runs an effect twice), and jax 0.10-0.11 fails to lower host offload in a
    program with ordered effects (a ValueError from safe_zip in mlir.lower_jaxpr_to_fun)."""
    from jax_ep import ordering

    def policy_fn(prim, *args, **params):
        decision = offloading(prim, *args, **params)
        if params.get("name") in offload and ordering.needed():
            raise EPUnsupportedError(
                f"jax_ep.remat.policy(offload={tuple(offload)}): host offload of the exchanges' results "
                "needs one process; with several processes the EP calls carry an ordered effect, whose "
                "results JAX keeps on the device without a policy, and jax cannot lower host offload "
                "beside ordered effects. Use remat.policy() (or no policy) there")
        return decision
    return policy_fn
