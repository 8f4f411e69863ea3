"""An EP exchange beside other work on the same GPU: jax_ep's side stream (issue 38).

    from jax_ep import overlap

    with overlap.beside(expert_gemm, rows, w, group_sizes) as work:
        received = jax_ep.dispatch(next_x, next_idx, next_weights, cfg)   # cfg.backend "cuda"
    out = work.result        # expert_gemm(rows, w, group_sizes)

The first call of a public op that takes a block (dispatch, combine, ll_dispatch_send, ll_combine_send:
"Where it applies" below) traced inside it enqueues its kernels on jax_ep's side stream of the device,
after everything XLA enqueued before it. (More targets have side twins, xla_ffi/handlers.h
JAX_EP_ASYNC_TARGETS: the backward ops, used by the backward rules here; the rank-major ops in a block
run as plain calls.) ``fn(*args)`` is traced right after that call and ordered after it (its operands
pass an ``optimization_barrier`` with the call's results), so XLA's stream runs fn's kernels while the
side stream runs the exchange; then ``jax_ep_side_join`` makes XLA's stream wait for the side stream.
The call's results and ``work.result`` come out of a barrier with the join's token: nothing reads them
before the join. The join keeps the call's operands and results and fn's results allocated until then.

Why not XLA's own async streams (``KernelConfig.async_stream``): with jax 0.11.2 XLA schedules the
async start right before its done, so nothing runs beside it, with or without command buffers, the
latency-hiding scheduler or a scheduling group (one H200, 2026-12-02: ``tools/overlap_probe.py``,
docs/benchmarks.md session 43). Here the order is data, which every XLA schedule keeps.

Where it applies: the public ops ``dispatch``, ``combine``, ``ll_dispatch_send`` and ``ll_combine_send``
called inside the block at the block's own trace level (e.g. both inside one ``shard_map`` body). The op
and fn become one ``custom_vjp`` (``_differentiated``): not differentiated, its function runs the op's
forward function beside fn; differentiated (now, or later: ``jax.checkpoint``, a ``lax.scan`` body or a
``jit`` under ``grad`` trace the block before AD sees it), the forward runs the op beside fn's forward,
the backward runs the op's backward (dispatch's combine, combine's combine_bwd, or broadcast when
unweighted) beside fn's backward; the same values and gradients. The side call and its join are bound
with ``ordering.kept_call``: ``jax.checkpoint`` never reruns them (a rerun would have no join).
fn should leave the exchange SMs (e.g. ``grouped_matmul(num_sms=...)`` with
``KernelConfig(num_sms=...)`` for the exchange): a persistent GEMM on every SM leaves it none. In one
process EP calls carry no ordering effect, so a side call's operands are ordered after every EP call
traced at the same level since the last join, and every later call's after its join (``after_previous``;
a differentiated
call's backward side call after its forward's join, whose token it keeps as a residual, and the
backward's calls traced before it). A ``shard_map`` holding EP calls is a trace of its own: the MoE
layer orders its call as one at its caller's level (``region``: two calls of a layer in one step, e.g.
on two micro-batches, run one after the other, forward and backward). The level is the trace that
stages the calls (``_level``: AD's traces are not levels of their own). Not ordered against a side
call: EP calls of other traces, i.e. another jitted function, a ``shard_map`` of your own or a
``jax.checkpoint`` of its own (wrap such a call with ``region``), and the forward calls a
``jax.checkpoint`` reruns in its backward (copied, not traced again): they must depend on the block's
results (or run with several processes, whose ordered effect orders every call). An EP call inside
fn is refused (``check_not_beside``). When no call takes the work (the reference backend, an op without
a side twin, ``KernelConfig.async_stream`` set), ``fn(*args)`` runs at the block's end, after everything
in it, and ``work.overlapped`` is False.

``chain(op, op_args, fn, fn_args)``: for work that needs the op's result (dispatch, then the gate|up
GEMM): in series forward; the backward runs the op's backward beside the part of fn's backward the op's
does not need (the gradients of ``fn_args``: the GEMM's weight gradient).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import weakref
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import core
from jax._src.ad_util import SymbolicZero
from jax._src.interpreters import ad

from jax_ep import ordering, vma
from jax_ep.config import check_option, type_name
from jax_ep.errors import EPTypeError, EPUnsupportedError, EPValueError

_pending: contextvars.ContextVar[Beside | None] = contextvars.ContextVar("jax_ep_overlap", default=None)


@dataclasses.dataclass
class Beside:
    """``fn(*args)`` to run beside the block's first side-capable EP call. After the block, ``result``
    is fn's result and ``overlapped`` says whether it ran beside an exchange."""

    fn: Callable
    args: tuple
    trace: Any = None   # the trace the block was opened at: only a call traced there takes the work
    result: Any = None
    taken: bool = False        # set when a call takes the work (before fn is traced: fn's own EP calls
                               # do not take it)
    overlapped: bool = False   # whether fn ran beside an exchange on the side stream


@contextlib.contextmanager
def beside(fn: Callable, *args):
    """Run ``fn(*args)`` beside the first EP call of the block that has a side twin (module doc)."""
    if not callable(fn):
        raise EPTypeError(f"jax_ep.overlap.beside: fn must be callable, got {type_name(fn)}")
    if _pending.get() is not None:
        raise EPValueError("jax_ep.overlap.beside: blocks do not nest (one side stream per device)")
    with _block(fn, args) as work:
        yield work


@contextlib.contextmanager
def _block(fn: Callable, args: tuple):
    """beside's block without its checks: also opened inside a taken block (the differentiated call's
    forward and backward rules, ``_differentiated``)."""
    work = Beside(fn, args, core.trace_ctx.trace)
    reset = _pending.set(work)
    try:
        yield work
    finally:
        _pending.reset(reset)
    if not work.taken:
        work.result = fn(*args)


def claim() -> Beside | None:
    """The open block's work if no call took it yet and this call is traced at the block's level
    (cuda_backend._call: its call then goes on the side stream and runs it with ``run_beside``), else
    None."""
    work = _pending.get()
    if work is None or work.taken or core.trace_ctx.trace is not work.trace:
        return None
    return work


def primal(op):
    """What a public op calls for its ``custom_vjp`` ``op``: the op itself; inside an open block
    ``_differentiated``: the op and fn as one custom_vjp, whose own forward (not differentiated) and
    rules (differentiated) each run the op beside fn. Always that, not by the trace: a block traced
    without AD may still be differentiated later (inside ``jax.checkpoint``, a ``lax.scan`` body or a
    ``jit`` under ``grad``, the function is staged to a jaxpr first), and its side call must then have
    a derivative (session 64: ``jax_ep_combine_side`` "cannot be differentiated" under remat)."""
    work = claim()
    if work is None:
        return op
    return functools.partial(_differentiated, op, work)


def _differentiated(op, work: Beside, *args):
    """``op(*args)`` and the block's ``fn(*work.args)`` as one custom_vjp, so that both directions
    overlap: not differentiated, its function runs the op's forward function (``op.fun``) in a block of
    its own beside fn; differentiated, its forward rule runs the op's forward rule beside fn's forward
    (``jax.vjp(fn)``) and its backward rule the op's backward rule (e.g. dispatch's combine) beside fn's
    backward. Each opens its block at its own trace level, where the op's kernels are traced: a jaxpr of
    its own where the function is staged (a custom_vjp stages it so; so does AD for a call whose inputs
    all have zero tangents), where this level's calls are not seen. So the op's operands are ordered
    here after the EP calls since the last join, as a side call's are, and the join's token comes out to
    order the calls after it (both through ``_ordered``, which AD passes straight through: a
    differentiated barrier would tie cotangents together). Sets ``work.result`` and
    ``work.overlapped``; returns the op's outputs."""
    work.taken = True
    leaves, tree = jax.tree.flatten(args)
    live = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array)]
    # fn's arguments: its arrays go through the custom_vjp, anything else (e.g. an axis) is closed over
    fn_leaves, fn_tree = jax.tree.flatten(work.args)
    fn_live = [i for i, leaf in enumerate(fn_leaves) if isinstance(leaf, jax.Array)]

    def run(fun, *values):
        return fun(*jax.tree.unflatten(tree, _refill(leaves, live, values)))

    def fn(*values):
        return work.fn(*jax.tree.unflatten(fn_tree, _refill(fn_leaves, fn_live, values)))

    run_op = functools.partial(run, op)
    blocks = []
    fn_axes = [vma.varying_axes(fn_leaves[i]) for i in fn_live]   # (_summed_to)

    def token_out(token):
        """The join's token (last_join()) where the block's call went on the side stream, else a
        stand-in (the custom_vjp's outputs have one structure)."""
        return jnp.zeros(JOIN_TOKEN.shape, JOIN_TOKEN.dtype) if token is None else token

    @jax.custom_vjp
    def both(op_in, fn_in):
        # op.fun: its call traced at this block's level takes the work (the op's custom_vjp would
        # stage it a level below)
        with _block(fn, fn_in) as inner:
            out = run(op.fun, *op_in)
        blocks.append(inner)
        return out, inner.result, token_out(last_join())

    def fwd(op_in, fn_in):
        with _block(lambda *a: jax.vjp(fn, *a), fn_in) as inner:
            out, op_vjp = jax.vjp(run_op, *op_in)
        blocks.append(inner)
        fn_out, fn_vjp = inner.result
        # the join's token: the backward's side call is ordered after it (the backward is traced
        # elsewhere, e.g. in the transposed shard_map's body, where after_previous cannot see it)
        token = last_join()
        return (out, fn_out, token_out(token)), (op_vjp, fn_vjp, token)

    def bwd(res, cts):
        op_vjp, fn_vjp, token = res
        ct_out, ct_fn, _ = cts
        if token is not None:
            record(token, side=True, keep_calls=True)
        with _block(fn_vjp, (ct_fn,)) as inner:
            op_cts = op_vjp(ct_out)
        return tuple(op_cts), _summed_to(inner.result, fn_axes)

    both.defvjp(fwd, bwd)
    op_in = tuple(leaves[i] for i in live)
    fn_in = tuple(fn_leaves[i] for i in fn_live)
    before = _before_side_call()
    out, result, token = both(_ordered(op_in, before) if before else op_in, fn_in)
    # the block that ran now (the function's or, differentiated here, the forward rule's; a rule
    # traced later runs as that function did)
    work.overlapped = bool(blocks) and blocks[0].overlapped
    if work.overlapped and not ordering.needed():
        # the token tied to the outputs (kept alive by them) marks the join for the calls after it
        out, result = _ordered((out, result), [token])
        record(token, side=True)
    work.result = result
    return out


@jax.custom_jvp
def _ordered(args, after):
    """``args`` after the values ``after`` (an optimization_barrier); differentiated, tangents pass
    straight through: the barrier orders the forward's calls, and its transpose would tie unrelated
    cotangents together (making gradients nobody asked for live, e.g. a dispatch's gate-weight
    exchange)."""
    args, _ = lax.optimization_barrier((args, after))
    return args


def _ordered_jvp(primals, tangents):
    args, after = primals
    out = _ordered(args, after)
    # an integer value's tangent (float0) typed as its output (e.g. a rank mask varying over the EP axis:
    # an untyped float0 was refused) as a symbolic zero; the others pass straight through
    return out, jax.tree.map(
        lambda t, o: SymbolicZero.from_primal_value(o) if _no_tangent(t) else t, tangents[0], out,
        is_leaf=lambda t: isinstance(t, SymbolicZero))


def _no_tangent(t) -> bool:
    return isinstance(t, SymbolicZero) or getattr(t, "dtype", None) == jax.dtypes.float0


# symbolic zeros: an argument nobody differentiates keeps a zero tangent that AD can drop (instantiated,
# it would make its cotangent live, e.g. the gate weights' exchange where only d x is asked for)
_ordered.defjvp(_ordered_jvp, symbolic_zeros=True)


def chain(op: Callable, op_args: tuple, fn: Callable, fn_args: tuple):
    """``out = op(*op_args)``, then ``fn(out, *fn_args)``; returns (out, fn's result). Differentiated,
    the backward takes fn's gradient in ``out`` first, then runs op's backward (e.g. dispatch's, a
    combine) on jax_ep's side stream beside the rest of fn's backward: the gradients of ``fn_args``
    (e.g. the gate|up GEMM's weight gradient, which nothing of op's backward needs). The forward runs
    in series (fn needs op's result). Same values and gradients as ``fn(op(*op_args), *fn_args)``.
    op_args and fn_args: pytrees whose arrays are all the arrays op and fn read (a custom_vjp takes
    them as its operands). fn's backward is traced twice, once for each part; XLA drops the dead half of
    each (the weight gradient from the first, the input gradient from the second)."""
    for name, value in (("op", op), ("fn", fn)):
        if not callable(value):
            raise EPTypeError(f"overlap.chain: {name} must be callable, got {type_name(value)}")
    for name, value in (("op_args", op_args), ("fn_args", fn_args)):
        if not isinstance(value, (tuple, list)):   # tuple(array) would split it into rows
            raise EPTypeError(f"overlap.chain: {name} must be a tuple (or list) of arguments, got "
                              f"{type_name(value)}")
    fn_axes = [vma.varying_axes(a) for a in jax.tree.leaves(fn_args)]   # (_summed_to)

    @jax.custom_vjp
    def both(op_in, fn_in):
        out = op(*op_in)
        return out, fn(out, *fn_in)

    def fwd(op_in, fn_in):
        out, op_vjp = jax.vjp(op, *op_in)
        result, fn_vjp = jax.vjp(fn, out, *fn_in)
        return (out, result), (op_vjp, fn_vjp)

    def bwd(res, cts):
        op_vjp, fn_vjp = res
        ct_out, ct_result = cts
        ct_out = jax.tree.map(_add_cotangents, ct_out, fn_vjp(ct_result)[0])
        with _block(lambda ct: fn_vjp(ct)[1:], (ct_result,)) as inner:
            op_cts = op_vjp(ct_out)
        return tuple(op_cts), _summed_to(inner.result, fn_axes)

    both.defvjp(fwd, bwd)
    return both(tuple(op_args), tuple(fn_args))


def _summed_to(cotangents, axes: list) -> tuple:
    """The block's fn cotangents (a tuple), each summed to the varying axes of its primal (``axes``, in
    leaf order): fn's operands passed the side call's barrier, which types them varying with its
    results, so their cotangents come back varying over axes the operands themselves do not."""
    leaves, tree = jax.tree.flatten(cotangents)
    return tuple(jax.tree.unflatten(tree, [vma.sum_to(ct, a) for ct, a in zip(leaves, axes, strict=True)]))


def _add_cotangents(a, b):
    """The sum of two cotangents of one value (an integer value's, float0, is nothing to sum)."""
    return a if a.dtype == jax.dtypes.float0 else a + b.astype(a.dtype)


# set while fn is traced beside a side call (run_beside): an EP call there would run between the side
# call and its join, on the same buffers (check_not_beside)
_beside_a_side_call: contextvars.ContextVar[bool] = contextvars.ContextVar("jax_ep_beside", default=False)


def check_not_beside(op: str) -> None:
    """Refuses an EP call traced inside the work of a block whose exchange is on the side stream
    (cuda_backend._call, every CUDA call)."""
    if _beside_a_side_call.get():
        raise EPUnsupportedError(
            f"jax_ep.{op}: called inside the work of jax_ep.overlap.beside, which runs while the block's "
            "exchange is on jax_ep's side stream; the two would use the same EP buffers at once: call it "
            "before or after the block")


def run_beside(work: Beside, outputs, inputs, join: Callable):
    """After a side call: ``work.fn`` ordered after it, then ``join(*buffers)`` (the jax_ep_side_join
    custom call, returning a token), then the call's outputs and fn's result ordered after the join.
    Returns the outputs; the join is the trace's last EP call (``after_previous``)."""
    work.taken = work.overlapped = True
    first = jax.tree.leaves(outputs)[0]
    args, _ = lax.optimization_barrier((work.args, first))
    reset = _beside_a_side_call.set(True)
    try:
        result = work.fn(*args)
    finally:
        _beside_a_side_call.reset(reset)
    kept = [a for a in jax.tree.leaves((inputs, outputs, result)) if isinstance(a, jax.Array)]
    token = join(*kept)
    outputs, result, _ = lax.optimization_barrier((outputs, result, token))
    work.result = result
    record(token, side=True)
    return outputs


# Per trace: (the last side call's join, or None; the EP calls traced there since that join), each as
# weak references to its results. Weakly held: a trace that ended drops out, and a call none of whose
# results is still referenced is dropped from the program (nothing reads them), so it needs no order.
_since: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def record(outputs, side: bool = False, keep_calls: bool = False) -> None:
    """Note an EP call's results at its trace (cuda_backend._call and ``in_order``, every call); with
    ``side``, a join's token (run_beside, _differentiated), which becomes the trace's last join and
    clears the calls before it (the join is after them: its side call was ordered after them), unless
    ``keep_calls`` (a backward rule noting its forward's join, traced before this trace's calls)."""
    # (not a zero-element one, e.g. dispatch's absent scales: XLA makes it a constant, which orders nothing)
    leaves = [_primal(a) for a in jax.tree.leaves(outputs) if isinstance(a, jax.Array) and a.size > 0]
    trace = _level()
    if not leaves or isinstance(trace, core.EvalTrace):   # run eagerly: each call in program order
        return
    join, calls = _since.get(trace, (None, ()))
    refs = tuple(weakref.ref(a) for a in leaves)
    calls = tuple(c for c in calls if any(ref() is not None for ref in c))
    if side:
        # keep_calls: the calls since and this trace's own join, both traced before the rule's calls
        _since[trace] = (refs, ((*calls, join) if join else calls) if keep_calls else ())
    else:
        _since[trace] = (join, (*calls, refs))


def _level():
    """The trace EP calls are recorded at: the current one, out of AD's traces (JVP, linearize) to the
    trace that stages them. A differentiated function's forward runs under an AD trace of its own while
    its backward, and the calls around the ``jax.grad``, are traced at the staging trace: keyed by the AD
    trace, a forward call the backward does not read (or a call outside the grad in the same jit) was
    ordered against nothing there. The recorded values are primals (``_primal``), which live there."""
    trace = core.trace_ctx.trace
    while isinstance(trace, _AD_TRACES):
        trace = trace.parent_trace
    return trace


_AD_TRACES = (ad.JVPTrace, getattr(ad, "LinearizeTrace", ad.JVPTrace))


def _primal(a):
    """An AD tracer's primal value (a weak reference to the tracer would die while its primal, which the
    program keeps, lives on)."""
    while isinstance(a, _AD_TRACERS):
        a = a.primal
    return a


_AD_TRACERS = tuple({ad.JVPTracer, getattr(ad, "LinearizeTracer", ad.JVPTracer)})


def _live(refs) -> list:
    """One live value of a recorded call (or join), or none."""
    value = next((v for v in (ref() for ref in refs or ()) if v is not None), None)
    return [] if value is None else [value]


def _since_join() -> tuple[list, list]:
    """(the last join's token if still live, one live result of each call recorded since) at this
    trace."""
    join, calls = _since.get(_level(), (None, ()))
    return _live(join), [v for c in calls for v in _live(c)]


def last_join():
    """The token of the last side call's join if it is the last EP call traced at this level, else None."""
    join, calls = _since_join()
    return join[0] if join and not calls else None


def _before_side_call() -> list:
    """What a side call traced at this level is ordered after: the last join and every call since (none
    where the ordered effect orders every call)."""
    if ordering.needed():
        return []
    join, calls = _since_join()
    return join + calls


def after_previous(args, side: bool):
    """``args`` ordered after the last join traced at this level, and, where this call is a side call,
    after every EP call traced there since. Why: in one process EP calls carry no ordering effect
    (jax_ep.ordering) and two calls on one stream run in order whatever XLA schedules, but a side call
    runs beside XLA's stream: a plain EP call that XLA scheduled between its fork and its join would use
    the same buffers at once (every plain call after a join, not only the first: XLA may schedule two
    independent ones either way). What it costs: a call traced before a side call runs even where its
    results end up unused (e.g. in a backward that asks for d x only, the gate weights' exchange,
    ``slot_values``, traced beside it). (Calls of other traces, e.g. another jitted function, are not
    ordered here, a ``region`` is; several processes order every call through the effect.)"""
    if ordering.needed():   # the ordered effect orders every EP call already (and keeps dead ones dead)
        return args
    join, calls = _since_join()
    values = join + calls if side else join
    return _ordered(args, values) if values else args


def region(fn: Callable, *args, side: bool):
    """``fn(*args)``, whose EP calls are traced a level below this one (the MoE layer's ``shard_map``),
    ordered here as one EP call, forward and backward; with ``side`` (fn holds side calls) as one side
    call and its join: after every EP call and region traced here since the last join, and everything
    traced here after it after all of its outputs. Why: in one process a side call is ordered only
    against the calls of its own trace, and two independent regions (e.g. one layer on two micro-batches
    whose losses are summed in one step) would let XLA schedule one region's EP calls between the
    other's side call and its join, on the same buffers. The backward: fn's output cotangents pass
    ``after_previous`` where the backward is traced, and its input cotangents are recorded there (with
    ``side``: all of them together, so none is read before the region's last join; what it costs: an
    input cotangent nobody asks for, e.g. d x of a layer fed by data, is computed). Not ordered: regions
    or calls of yet other traces (e.g. a region inside a ``jax.checkpoint`` against one outside it).
    Several processes: ``fn(*args)`` (the ordered effect orders every call)."""
    if not callable(fn):
        raise EPTypeError(f"overlap.region: fn must be callable, got {type_name(fn)}")
    check_option("overlap.region:", "side", side, "bool")
    if ordering.needed():
        return fn(*args)
    args = _map_leaves(args, _is_array, lambda values: after_previous(list(values), side))
    args = _map_leaves(args, _has_tangent, lambda values: _on_backward(values, "record", side))
    out = fn(*args)
    out = _map_leaves(out, _has_tangent, lambda values: _on_backward(values, "order", side))
    if side:   # one barrier: any output stands for all of them (each after the region's last join)
        out = _map_leaves(out, _is_array, lambda values: _ordered(values, []))
    record(out, side=side)
    return out


def _is_array(leaf) -> bool:
    return isinstance(leaf, jax.Array)


def _has_tangent(leaf) -> bool:
    """A floating-point array: a value with a cotangent."""
    return _is_array(leaf) and jnp.issubdtype(leaf.dtype, jnp.inexact)


def _map_leaves(tree, pick: Callable, fun: Callable):
    """``tree`` with the leaves ``pick`` accepts replaced by ``fun`` of them (a sequence in, one of the
    same length out)."""
    leaves, treedef = jax.tree.flatten(tree)
    picked = [i for i, leaf in enumerate(leaves) if pick(leaf)]
    if picked:
        leaves = _refill(leaves, picked, fun(tuple(leaves[i] for i in picked)))
    return jax.tree.unflatten(treedef, leaves)


def _refill(leaves: list, picked: list, values) -> list:
    """A copy of ``leaves`` with ``values`` at the indices ``picked``."""
    full = list(leaves)
    for i, value in zip(picked, values, strict=True):
        full[i] = value
    return full


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _on_backward(values: tuple, action: str, side: bool) -> tuple:
    """``values`` (a region's inputs or outputs); differentiated, their cotangents, where the backward is
    traced: ``"order"`` (the outputs') pass ``after_previous``, so the region's backward starts after the
    last join there (and, with ``side``, after every EP call since); ``"record"`` (the inputs', the
    region's backward's results) are recorded: with ``side`` all at once as a join, else each as a call
    (whichever region's backward is traced next is ordered against all of them)."""
    return values


def _on_backward_fwd(values, action, side):
    return values, None


def _on_backward_bwd(action, side, _, cts):
    if action == "order":
        return (tuple(after_previous(list(cts), side)),)
    if side:   # (keep_calls: whatever was traced here meanwhile stays ordered before later side calls)
        cts = lax.optimization_barrier(cts)
        record(cts, side=True, keep_calls=True)
    else:
        for ct in cts:
            record(ct)
    return (cts,)


_on_backward.defvjp(_on_backward_fwd, _on_backward_bwd)


def in_order(op: Callable) -> Callable:
    """A public communicating op, ordered against side calls at its caller's trace level
    (``after_previous``, ``record``): its kernels' custom call may be traced a level below (a
    ``custom_vjp`` stages its primal into a jaxpr of its own), where the caller's calls are not seen."""

    @functools.wraps(op)
    def ordered(*args, **kwargs):
        args, kwargs = _map_leaves((args, kwargs), _is_array, lambda values: after_previous(list(values),
                                                                                          side=False))
        trace = _level()
        before = _since.get(trace, (None, ()))[0]
        out = op(*args, **kwargs)
        join = _since.get(trace, (None, ()))[0]
        if join is None or join is before:   # else a side call recorded its join: that orders what follows
            record(out)
        return out

    return ordered


# The join's result: a token whose value is never read (unspecified: the join writes nothing), which
# orders its readers after the join. Not zero-sized: XLA replaces a zero-element value by a constant,
# which orders nothing, and XLA's stream then ran readers of a side call's results before the join
# (process model 2 under MPS, one H200, 2026-12-02: the group sizes' prefix sum was read before the
# side dispatch wrote them, and the combine's output came out wrong).
JOIN_TOKEN = jax.ShapeDtypeStruct((1,), jnp.int32)
