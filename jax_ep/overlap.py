"""An EP exchange beside other work on the same GPU: jax_ep's side stream (issue 38).

    from jax_ep import overlap

    with overlap.beside(expert_gemm, rows, w, group_sizes) as work:
        received = jax_ep.dispatch(next_x, next_idx, next_weights, cfg)   # cfg.backend "cuda"
    out = work.result        # expert_gemm(rows, w, group_sizes)

The first EP call traced inside the block whose op has a side twin (dispatch, combine, broadcast,
combine_bwd, slot_values, the low-latency sends, the rank-major ops: xla_ffi/handlers.h,
JAX_EP_ASYNC_TARGETS) enqueues its kernels on jax_ep's side stream of the device, after everything XLA
enqueued before it. ``fn(*args)`` is traced right after that call and ordered after it (its operands
pass an ``optimization_barrier`` with the call's results), so XLA's stream runs fn's kernels while the
side stream runs the exchange; then ``jax_ep_side_join`` makes XLA's stream wait for the side stream.
The call's results and ``work.result`` come out of a barrier with the join's token: nothing reads them
before the join. The join keeps the call's operands and results and fn's results allocated until then.

Why not XLA's own async streams (``KernelConfig.async_stream``): with jax 0.11.2 XLA schedules the
async start right before its done, so nothing runs beside it, with or without command buffers, the
latency-hiding scheduler or a scheduling group (one H200, 2026-12-02: ``tools/overlap_probe.py``,
docs/benchmarks.md session 43). Here the order is data, which every XLA schedule keeps.

Where it applies: the public ops ``dispatch``, ``combine``, ``ll_dispatch_send`` and ``ll_combine_send``
called inside the block at the block's own trace level (e.g. both inside one ``shard_map`` body), not
differentiated: the block runs the op's forward function itself, so that fn is traced at the level it
was written (inside the op's ``custom_vjp`` its result could not leave); a differentiated call is an
EPUnsupportedError (forward-only for now: inference, prefill, decode). fn should leave the exchange
SMs (e.g. ``grouped_matmul(num_sms=...)`` with ``KernelConfig(num_sms=...)`` for the exchange): a
persistent GEMM on every SM leaves it none. An EP call after the block must depend on ``work.result``
or on the exchange's results: XLA may otherwise start it before the join, beside the exchange that
shares its buffers. When no call takes the work (the reference backend, an op without a side twin,
``KernelConfig.async_stream`` set), ``fn(*args)`` runs at the block's end, after everything in it, and
``work.overlapped`` is False.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import core
from jax._src.interpreters import ad

from jax_ep.errors import EPUnsupportedError

_pending: contextvars.ContextVar[Beside | None] = contextvars.ContextVar("jax_ep_overlap", default=None)


@dataclasses.dataclass
class Beside:
    """``fn(*args)`` to run beside the block's first side-capable EP call. After the block, ``result``
    is fn's result and ``overlapped`` says whether it ran beside an exchange."""

    fn: Callable
    args: tuple
    trace: Any = None   # the trace the block was opened at: only a call traced there takes the work
    result: Any = None
    overlapped: bool = False   # set when a call takes the work (before fn is traced: fn's own EP calls
                               # do not take it)


@contextlib.contextmanager
def beside(fn: Callable, *args):
    """Run ``fn(*args)`` beside the first EP call of the block that has a side twin (module doc)."""
    if not callable(fn):
        raise TypeError(f"jax_ep.overlap.beside: fn must be callable, got {type(fn).__name__}")
    if _pending.get() is not None:
        raise ValueError("jax_ep.overlap.beside: blocks do not nest (one side stream per device)")
    work = Beside(fn, args, core.trace_ctx.trace)
    reset = _pending.set(work)
    try:
        yield work
    finally:
        _pending.reset(reset)
    if not work.overlapped:
        work.result = fn(*args)


def claim() -> Beside | None:
    """The open block's work if no call took it yet and this call is traced at the block's level
    (cuda_backend._call: its call then goes on the side stream and runs it with ``run_beside``), else
    None."""
    work = _pending.get()
    if work is None or work.overlapped or core.trace_ctx.trace is not work.trace:
        return None
    return work


def primal(op):
    """What a public op calls for its ``custom_vjp`` ``op``: the op itself, or inside an open block its
    forward function (``op.fun``), so that its call is traced at the block's level and can take the
    work. Differentiating such a call is an EPUnsupportedError (forward-only for now)."""
    if claim() is None:
        return op
    if isinstance(core.trace_ctx.trace, (ad.JVPTrace, getattr(ad, "LinearizeTrace", ad.JVPTrace))):
        raise EPUnsupportedError(
            "jax_ep.overlap.beside: the EP call in the block is differentiated; the side stream is "
            "forward-only for now (call the op outside the block to differentiate it)")
    return op.fun


def run_beside(work: Beside, outputs, inputs, join: Callable):
    """After a side call: ``work.fn`` ordered after it, then ``join(*buffers)`` (the jax_ep_side_join
    custom call, returning a token), then the call's outputs and fn's result ordered after the join.
    Returns the outputs."""
    work.overlapped = True
    first = jax.tree.leaves(outputs)[0]
    args, _ = lax.optimization_barrier((work.args, first))
    result = work.fn(*args)
    kept = [a for a in jax.tree.leaves((inputs, outputs, result)) if isinstance(a, jax.Array)]
    token = join(*kept)
    outputs, result, _ = lax.optimization_barrier((outputs, result, token))
    work.result = result
    return outputs


# The join's result: an int32[0] token, which only orders its readers after the join
JOIN_TOKEN = jax.ShapeDtypeStruct((0,), jnp.int32)
