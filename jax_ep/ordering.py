"""One order of EP calls in every process: an ordered effect threaded through every communicating call.

Why: XLA does not know that a jax_ep custom call communicates. Two EP calls of one program that do not
depend on each other (e.g. the backward of dispatch: the combine for d x and the ``slot_values`` for
d topk_weights) may be scheduled in either order, and in process model 2 every process compiles its own
executable: autotuning results, flags and caches differ per process, so schedules differ, and one process
runs ``combine`` while its peers run ``slot_values`` (a deadlock, or the fingerprint's trap). A library of
collectives must impose its order, whatever each compiler decides.

How: every communicating call is bound as ``ep_call_p``, a primitive carrying JAX's ordered effect
``EP_ORDER`` (the mechanism of ``io_callback(ordered=True)``). JAX threads one token through all
primitives with that effect in program (jaxpr) order, through ``jit``, ``shard_map``, ``custom_vjp``,
``scan``/``cond``, ``remat`` and across jitted functions (a runtime token per device). Its lowering makes the
call's operands depend on the incoming token and the outgoing token depend on its results, through
``optimization_barrier``s: a data dependency from each EP call to the next, which XLA's scheduler keeps.
(XLA's GPU compiler removes the barriers only after it schedules, adding no control dependency; on CPU
it removes them before, and the order is lost there. A GPU test checks the compiled schedule,
tests/gpu/test_dispatch_gpu.py, so a jax release that moves that pass is caught.) The program order is the
Python order of the calls, the same in every process. What it costs: the calls are never reordered among
themselves (they still overlap with non-EP work; a call whose results are unused is removed from the
jaxpr, the same in every process), and jitted functions holding them take JAX's dispatch path for effects,
which before each call waits for the previous call's runtime token on the host (``_token_shard_arg``
blocks on it): the host cannot enqueue a step while the one before runs, and the GPU idles for the next
step's launch (measured 2026-11-30 on one H200: 0.8-1.4 ms per training step, 7-20% of it).

When: only where several processes compile (``jax.process_count() > 1``: process model 2, or model 1 over
several hosts). One process compiles one SPMD program for all of its devices, so every device runs the
same schedule and the same sequence of programs; the calls are then issued without the effect
(``needed``). Such a process must launch its EP programs from one thread, as the programs' order on
every device then is the order in which that thread launches them. Calls on jax_ep's side stream and
their joins are bound with ``kept_call``: with the effect where it is needed, else with the unordered
``EP_ISSUE`` alone, so that ``jax.checkpoint`` keeps their results instead of rerunning them.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax import tree_util
from jax._src import core, effects
from jax._src.ffi import FfiEffect
from jax._src.interpreters import ad, batching, mlir
from jax._src.interpreters import partial_eval as pe
from jax._src.lib.mlir.dialects import hlo

from jax_ep.errors import EPUnsupportedError


class EPOrderEffect(effects.Effect):
    """The ordered effect of jax_ep's communicating calls (one token per device, program order)."""

    def __str__(self):
        return "jax_ep.EPOrder"


EP_ORDER = EPOrderEffect()


class EPIssueEffect(effects.Effect):
    """An unordered companion of EP_ORDER (and, alone, the effect of ``kept_call`` in one process: a call
    JAX never reruns under ``jax.checkpoint``). Beside EP_ORDER for one reason: jax 0.10-0.11's
    ahead-of-time path (``jit(f).lower(...).compile()``) installs its C++ fast path for an executable
    with ordered but without unordered effects, and that path omits the runtime token: the second call
    of the compiled function fails ("Execution supplied 1 arguments but compiled program expected 2", seen on
    2x H200 with jax 0.11.2 and on CPU with 0.10.2). With an unordered effect too, every call takes
    the Python path, which passes the token (jit's own fast path is already off for ordered effects).
    What it costs alone (one process, side-stream calls): no host wait, but JAX's Python dispatch path,
    ~30 µs of host time per call of the jitted step instead of ~3 (CPU, 2026-12-05)."""

    def __str__(self):
        return "jax_ep.EPIssue"


EP_ISSUE = EPIssueEffect()

# What JAX must allow for it: ordered (tokens), shardable (multi-device programs: each device sees the
# calls in program order), lowerable, and allowed inside control flow, custom_vjp/custom_jvp and remat.
for _set in ("ordered_effects", "shardable_ordered_effects", "lowerable_effects",
             "control_flow_allowed_effects", "custom_derivatives_allowed_effects",
             "remat_allowed_effects"):
    getattr(effects, _set).add_type(EPOrderEffect)
    if _set not in ("ordered_effects", "shardable_ordered_effects"):
        getattr(effects, _set).add_type(EPIssueEffect)
# A call whose results are unused may still be removed (e.g. the backward of dispatch when nothing needs
# d x): JAX's dead-code elimination runs on the jaxpr, which is the same in every process, so every
# process removes the same calls. (XLA does not remove one whose results the token uses, except a call
# whose results are all zero-size, which its ZeroSizedHloElimination replaces by constants: the same
# static shapes in every process, so the same calls everywhere; cuda_backend issues no low-latency combine
# at T = 0.)
pe.dceable_effects.add_type(EPOrderEffect)
pe.dceable_effects.add_type(EPIssueEffect)

ep_call_p = core.Primitive("jax_ep_call")
ep_call_p.multiple_results = True


def needed() -> bool:
    """Whether EP calls carry the ordering effect: when several processes compile their own programs."""
    return jax.process_count() > 1


def ordered_call(fun: Callable, *args, name: str):
    """``fun(*args)`` as one ordered EP call: issued after every EP call before it in program order and
    before every one after it, in every process. ``fun`` must be traceable and communicate (it holds
    the custom call); ``name`` (the custom-call target) names it in jaxprs and errors. In a single
    process (``needed()`` false) it is ``fun(*args)`` itself."""
    if not needed():
        return fun(*args)
    return _bind(fun, args, name, ordered=True)


def kept_call(fun: Callable, *args, name: str):
    """``fun(*args)`` as an EP call that JAX never runs twice: ``jax.checkpoint`` keeps its results for
    the backward instead of rerunning it (JAX never reruns an effect). ``ordered_call``'s with several
    processes; in one process bound with the unordered ``EP_ISSUE`` alone (no order, no runtime
    token). What jax_ep's side-stream calls and their joins are (``jax_ep.overlap``): rerun in a
    rematerialised backward without its join, a side call's results would be read before it ends."""
    return _bind(fun, args, name, ordered=needed())


def _bind(fun: Callable, args: tuple, name: str, *, ordered: bool):
    flat_args, in_tree = tree_util.tree_flatten(args)
    out_tree = []

    def flat_fun(*flat):
        out = fun(*tree_util.tree_unflatten(in_tree, flat))
        flat_out, tree = tree_util.tree_flatten(out)
        out_tree.append(tree)
        return flat_out

    closed = _trace(flat_fun, flat_args)
    outs = ep_call_p.bind(*flat_args, jaxpr=closed, name=name, ordered=ordered)
    return tree_util.tree_unflatten(out_tree[0], outs)


def _trace(flat_fun, flat_args) -> core.ClosedJaxpr:
    """The jaxpr of flat_fun on the avals of flat_args (their varying-axes types included)."""
    import jax.extend.linear_util as lu  # noqa: PLC0415  (stable alias of jax._src.linear_util)

    avals = [jax.typeof(x) for x in flat_args]
    wrapped = lu.wrap_init(flat_fun, debug_info=_debug_info(flat_fun, flat_args))
    jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(wrapped, avals)
    return core.ClosedJaxpr(jaxpr, consts)


def _debug_info(fun, args):
    from jax._src import api_util  # noqa: PLC0415

    return api_util.debug_info("jax_ep.ordered_call", fun, args, {})


def _abstract_eval(*avals, jaxpr: core.ClosedJaxpr, name: str, ordered: bool):
    del avals, name
    # not a custom call's FFI effect (the side join's has_side_effect, which keeps it in XLA's
    # program): jax.checkpoint refuses that effect, and EP_ISSUE keeps the call in the jaxpr instead
    inner = {e for e in jaxpr.effects if not isinstance(e, FfiEffect)}
    return jaxpr.out_avals, {EP_ISSUE, *inner} | ({EP_ORDER} if ordered else set())


ep_call_p.def_effectful_abstract_eval(_abstract_eval)


def _impl(*args, jaxpr: core.ClosedJaxpr, name: str, ordered: bool):
    """Outside jit: run it as a jitted function (JAX threads the runtime token)."""
    return jax.jit(lambda *a: ep_call_p.bind(*a, jaxpr=jaxpr, name=name, ordered=ordered))(*args)


ep_call_p.def_impl(_impl)


def _lowering(ctx: mlir.LoweringRuleContext, *args, jaxpr: core.ClosedJaxpr, name: str, ordered: bool):
    del name
    if not ordered:   # kept_call in one process: the call itself
        return mlir.lower_fun(core.jaxpr_as_fun(jaxpr), multiple_results=True)(ctx, *args)
    token = ctx.tokens_in.get(EP_ORDER)
    flat_args, tree = mlir.ir_tree_registry.flatten(args)
    before = hlo.OptimizationBarrierOp([token, *flat_args])  # the operands wait for the token
    token, *flat_args = before.results
    args = tree.unflatten(flat_args)
    inner = ctx.replace(tokens_out=None)
    outs = mlir.lower_fun(core.jaxpr_as_fun(jaxpr), multiple_results=True)(inner, *args)
    flat_outs, _ = mlir.ir_tree_registry.flatten(outs)
    after = hlo.OptimizationBarrierOp([token, *flat_outs])  # the next token waits for the results
    token = after.results[0]
    tokens = inner.tokens_out if inner.tokens_out is not None else ctx.tokens_in
    ctx.set_tokens_out(tokens.update_tokens(mlir.TokenSet({EP_ORDER: token})))
    return outs


mlir.register_lowering(ep_call_p, _lowering)


def _batching(args, dims, *, jaxpr: core.ClosedJaxpr, name: str, ordered: bool):
    """vmap: one call of the vmapped body, bound as the call was (its custom calls batch as they
    declare)."""
    fun = jax.vmap(core.jaxpr_as_fun(jaxpr), in_axes=tuple(dims), out_axes=0)
    outs = _bind(fun, tuple(args), name, ordered=ordered)
    return outs, [0] * len(outs)


batching.primitive_batchers[ep_call_p] = _batching


def _jvp(primals, tangents, *, jaxpr: core.ClosedJaxpr, name: str, ordered: bool):
    del primals, tangents, jaxpr, ordered
    raise EPUnsupportedError(
        f"jax_ep: {name} has no derivative rule of its own: differentiate through the jax_ep op that "
        "issued it (dispatch, combine, their rank-major forms); the low-latency ops are forward-only")


ad.primitive_jvps[ep_call_p] = _jvp


def ep_calls(jaxpr) -> list[str]:
    """The names of the ordered EP calls of a (closed) jaxpr, nested jaxprs included, in program order
    (a call in a loop body counts once): what tests and tools inspect."""
    found = []

    def walk(j):
        j = getattr(j, "jaxpr", j)
        for eqn in j.eqns:
            if eqn.primitive is ep_call_p:
                if eqn.params["ordered"]:   # (kept_call's in one process is not)
                    found.append(eqn.params["name"])
                continue
            for sub in core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jaxpr)
    return found
