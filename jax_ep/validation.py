"""Argument checks. Static ones (shapes, dtypes, sizes) raise at trace time; value checks on traced
arrays (expert ids, dropped rows) run in checked mode and raise when the computation runs."""

from __future__ import annotations

import atexit
import contextlib
import logging
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_ep import types
from jax_ep.config import EPConfig
from jax_ep.errors import EPTypeError, EPUnsupportedError, EPValueError
from jax_ep.routing import layout_of, masked_pairs, reached_topk
from jax_ep.vma import vary_also


def _shape_of(a) -> tuple:
    return tuple(getattr(a, "shape", ()))


def check_layout_args(topk_idx, cfg: EPConfig) -> None:
    if getattr(topk_idx, "ndim", None) != 2 or topk_idx.shape[1] != cfg.num_topk:
        raise EPValueError(f"get_dispatch_layout: topk_idx must have shape [tokens, {cfg.num_topk}], "
                           f"got {getattr(topk_idx, 'shape', None)}")
    if topk_idx.shape[0] > cfg.max_tokens_per_rank:   # as dispatch refuses them
        raise EPValueError(f"get_dispatch_layout: topk_idx has {topk_idx.shape[0]} tokens on this rank, more "
                           f"than cfg.max_tokens_per_rank={cfg.max_tokens_per_rank}")
    if topk_idx.dtype != jnp.int32:
        raise EPValueError(f"get_dispatch_layout: topk_idx must be int32, got dtype {topk_idx.dtype}")


def check_dispatch_args(x, topk_idx, topk_weights, cfg: EPConfig, op: str = "dispatch") -> None:
    if getattr(x, "ndim", None) != 2:
        raise EPValueError(f"{op}: x must be 2-D [tokens, hidden], got shape {_shape_of(x)}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise EPValueError(f"{op}: x must be floating point, got dtype {x.dtype}")
    tokens, hidden = x.shape
    if hidden != cfg.hidden:
        raise EPValueError(f"{op}: x has hidden size {hidden} but cfg.hidden={cfg.hidden}")
    if tokens > cfg.max_tokens_per_rank:
        raise EPValueError(f"{op}: x has {tokens} tokens on this rank, more than "
                           f"cfg.max_tokens_per_rank={cfg.max_tokens_per_rank}")
    expected = (tokens, cfg.num_topk)
    if _shape_of(topk_idx) != expected:
        raise EPValueError(f"{op}: topk_idx must have shape {expected} (tokens, num_topk), "
                           f"got {_shape_of(topk_idx)}")
    if topk_idx.dtype != jnp.int32:
        raise EPValueError(f"{op}: topk_idx must be int32, got dtype {topk_idx.dtype}")
    if _shape_of(topk_weights) != expected:
        raise EPValueError(f"{op}: topk_weights must have shape {expected} (tokens, num_topk), "
                           f"got {_shape_of(topk_weights)}")
    if topk_weights.dtype != jnp.float32:
        raise EPValueError(f"{op}: topk_weights must be float32, got dtype {topk_weights.dtype}")


def check_rank_mask(rank_mask, ep_size: int, op: str, name: str = "rank_mask"):
    """None, or the mask as bool[ep_size] (nonzero: active). Static checks: shape and dtype. ``name``:
    the argument (or a handle's field, "handle.rank_mask") the mask came from."""
    if rank_mask is None:
        return None
    if not hasattr(rank_mask, "dtype"):
        rank_mask = jnp.asarray(rank_mask)
    if _shape_of(rank_mask) != (ep_size,):
        raise EPValueError(f"{op}: {name} must have shape [{ep_size}] (one flag per rank of the EP axis), "
                           f"got {_shape_of(rank_mask)}")
    if not (rank_mask.dtype == jnp.bool_ or jnp.issubdtype(rank_mask.dtype, jnp.integer)):
        raise EPValueError(f"{op}: {name} must be bool or integer (nonzero: active), got dtype "
                           f"{rank_mask.dtype}")
    return rank_mask if rank_mask.dtype == jnp.bool_ else rank_mask != 0


def fp8_forward_only(op: str) -> EPUnsupportedError:
    """The error of differentiating an FP8 dispatch (``op``: its public name): the wire is forward-only."""
    # only the expert-major dispatch has a form that trains with the FP8 wire
    trains = ("to train with the FP8 wire use jax_ep.ops.dispatch_straight_through (the e4m3 rows for the "
              "FP8 GEMM and a dequantised copy whose gradient goes through the dispatch), or "
              if op == "dispatch" else "")
    return EPUnsupportedError(
        f"jax_ep: {op} with dispatch_dtype='float8_e4m3fn' is forward-only (inference and prefill); "
        f"{trains}differentiate through a bfloat16 dispatch")


def check_handle(handle, kind: type, op: str, producer: str) -> None:
    """``handle`` is a ``kind`` (the handle type ``producer`` returns); else an EPTypeError naming
    what was given and, for another op's handle, the op that takes it."""
    if isinstance(handle, kind):
        return
    takers = {types.Handle: "combine", types.RankMajorHandle: "combine_rank_major",
              types.LLHandle: "ll_combine"}
    hint = ""
    for other, taker in takers.items():
        if isinstance(handle, other):
            hint = f" (the handle of another op: pass it to jax_ep.{taker})"
    if hasattr(handle, "handle") and isinstance(handle.handle, kind):
        hint = f" (pass its .handle: {type(handle).__name__}.handle)"
    raise EPTypeError(f"{op}: handle must be the {kind.__name__} of {producer} (its .handle), got "
                      f"{type(handle).__name__}{hint}")


def check_combine_args(y, handle, cfg: EPConfig, op: str = "combine", ep_size: int | None = None) -> None:
    """combine (``op``: the caller, e.g. combine_hierarchical, whose stage 2 is a combine): y
    [capacity, H'] of a float dtype (not FP8) for the Handle of a dispatch, its fields of the shapes and
    dtypes dispatch gives them (a user may ``_replace`` one; the reference would read a short
    row_weights as zeros); with ``ep_size`` the EP-sized ones too."""
    check_handle(handle, types.Handle, op, "dispatch")
    src_index = handle.src_index
    if getattr(src_index, "ndim", None) != 1 or src_index.dtype != jnp.int32:
        raise EPValueError(f"{op}: handle.src_index must be int32 [capacity], got "
                           f"{getattr(src_index, 'dtype', None)}{_shape_of(src_index)}")
    capacity = src_index.shape[0]
    fields = {"row_weights": (jnp.float32, (capacity,), "[capacity]")}
    in_rank = handle.is_token_in_rank
    if (getattr(in_rank, "ndim", None) != 2 or in_rank.dtype != jnp.bool_
            or ep_size not in (None, in_rank.shape[1])):
        raise EPValueError(f"{op}: handle.is_token_in_rank must be bool [tokens, "
                           f"{'EP size' if ep_size is None else ep_size}], got "
                           f"{getattr(in_rank, 'dtype', None)}{_shape_of(in_rank)}")
    check_rank_mask(handle.rank_mask, in_rank.shape[1], op, "handle.rank_mask")
    if ep_size is not None:
        tokens = in_rank.shape[0]
        fields["token_rows"] = (jnp.int32, (ep_size * tokens, cfg.num_topk),
                                f"[{ep_size} x {tokens}, {cfg.num_topk}] (EP size x tokens, num_topk)")
    for name, (dtype, shape, what) in fields.items():
        value = getattr(handle, name)
        if _shape_of(value) != shape or getattr(value, "dtype", None) != dtype:
            raise EPValueError(f"{op}: handle.{name} must be {jnp.dtype(dtype).name} {what}, got "
                               f"{getattr(value, 'dtype', None)}{_shape_of(value)}")
    if getattr(y, "ndim", None) != 2 or y.shape[0] != capacity:
        raise EPValueError(f"{op}: y must have shape [capacity={capacity}, hidden], got {_shape_of(y)}")
    _check_combine_y_dtype(y, op)


def check_combine_rank_major_args(y, handle, cfg: EPConfig, ep_size: int,
                                  op: str = "combine_rank_major") -> None:
    """combine_rank_major: a RankMajorHandle of dispatch_rank_major on this EP group and rows
    y [R*T, H'] of a float dtype (not FP8)."""
    src_index = getattr(handle, "src_index", None)
    in_rank = getattr(handle, "is_token_in_rank", None)
    if src_index is None or in_rank is None or hasattr(handle, "token_rows"):
        raise EPTypeError(f"{op}: handle must be the RankMajorHandle of dispatch_rank_major, got "
                          f"{type(handle).__name__}")
    if getattr(in_rank, "ndim", None) != 2 or in_rank.shape[1] != ep_size or in_rank.dtype != jnp.bool_:
        raise EPValueError(f"{op}: handle.is_token_in_rank must be bool [tokens, {ep_size}] (EP size), got "
                           f"{getattr(in_rank, 'dtype', None)}{_shape_of(in_rank)}")
    check_rank_mask(getattr(handle, "rank_mask", None), ep_size, op, "handle.rank_mask")
    rows = ep_size * in_rank.shape[0]
    if _shape_of(src_index) != (rows,) or src_index.dtype != jnp.int32:
        raise EPValueError(f"{op}: handle.src_index must be int32 [{rows}] (EP size x tokens), got "
                           f"{getattr(src_index, 'dtype', None)}{_shape_of(src_index)}")
    if getattr(y, "ndim", None) != 2 or y.shape[0] != rows:
        raise EPValueError(f"{op}: y must have shape [{rows}, hidden] (one row per dispatched row: EP size "
                           f"{ep_size} x {in_rank.shape[0]} tokens), got {_shape_of(y)}")
    _check_combine_y_dtype(y, op)


def _check_combine_y_dtype(y, op: str) -> None:
    if jnp.dtype(y.dtype) not in COMBINE_Y_DTYPES:
        raise EPValueError(f"{op}: y must be float32/bfloat16/float16 (float64 with x64), got dtype "
                           f"{y.dtype}")


LL_X_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
# combine's rows (float64: the reference path under jax_enable_x64, as dispatch's x): the other FP8 /
# FP4 kinds were let through to the reference, which combined in them, while the kernels refuse them
COMBINE_Y_DTYPES = tuple(map(jnp.dtype, ("float32", "bfloat16", "float16", "float64")))
LL_WIRE_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float8_e4m3fn))


def check_ll_dispatch_args(x, topk_idx, topk_weights, cfg: EPConfig, op: str = "ll_dispatch") -> None:
    """ll_dispatch: dispatch's checks, x bfloat16 or float32, and a bfloat16 or FP8 wire."""
    check_dispatch_args(x, topk_idx, topk_weights, cfg, op=op)
    if x.dtype not in LL_X_DTYPES:
        raise EPValueError(f"{op}: x must be bfloat16 or float32, got dtype {x.dtype}")
    wire = cfg.wire_dtype(x.dtype)
    if wire not in LL_WIRE_DTYPES:
        raise EPValueError(f"{op}: tokens travel as bfloat16 or float8_e4m3fn, but x is {x.dtype} "
                           f"and cfg.dispatch_dtype={cfg.dispatch_dtype!r} keeps it; set "
                           "EPConfig.dispatch_dtype='bfloat16' or 'float8_e4m3fn'")


def check_ll_combine_args(y, handle, cfg: EPConfig, ep_size: int, op: str = "ll_combine") -> None:
    """ll_combine: y [E_local, R*T, H] bfloat16 and a handle of ll_dispatch for this config."""
    local = cfg.num_local_experts(ep_size)
    weights = getattr(handle, "topk_weights", None)
    src_slot = getattr(handle, "src_slot", None)
    if weights is None or src_slot is None:
        raise EPTypeError(f"{op}: handle must be the LLHandle of ll_dispatch, got "
                          f"{type(handle).__name__}")
    if getattr(weights, "ndim", None) != 2 or weights.shape[1] != cfg.num_topk:
        raise EPValueError(f"{op}: handle.topk_weights must have shape [tokens, {cfg.num_topk}], "
                           f"got {_shape_of(weights)}")
    if weights.dtype != jnp.float32:
        raise EPValueError(f"{op}: handle.topk_weights must be float32, got dtype {weights.dtype}")
    tokens = weights.shape[0]
    slots = (local, ep_size * tokens)
    if _shape_of(src_slot) != slots:
        raise EPValueError(f"{op}: handle.src_slot must have shape {slots} (E_local, R*T), "
                           f"got {_shape_of(src_slot)}")
    if src_slot.dtype != jnp.int32:
        raise EPValueError(f"{op}: handle.src_slot must be int32, got dtype {src_slot.dtype}")
    dest_rank = getattr(handle, "dest_rank", None)
    if _shape_of(dest_rank) != weights.shape or dest_rank.dtype != jnp.int32:
        raise EPValueError(f"{op}: handle.dest_rank must be int32 {weights.shape} (as topk_weights), got "
                           f"{getattr(dest_rank, 'dtype', None)}{_shape_of(dest_rank)}")
    check_rank_mask(getattr(handle, "rank_mask", None), ep_size, op, "handle.rank_mask")
    expected = slots + (cfg.hidden,)
    if _shape_of(y) != expected:
        raise EPValueError(f"{op}: y must have shape {expected} (E_local, R*T, cfg.hidden), "
                           f"got {_shape_of(y)}")
    if y.dtype != jnp.bfloat16:
        raise EPValueError(f"{op}: y must be bfloat16, got dtype {y.dtype}")


# ---- checked mode: run-time checks of traced values --------------------------------------------------
# A failed check raises EPValueError inside a jax.pure_callback (no effect token, so nothing is left for
# JAX's atexit barrier to re-raise); its zero result is tied to the op's outputs (``tie``) so that it
# is never dead code. JAX surfaces it as a JaxRuntimeError whose text holds the message; ``ep_errors`` /
# ``run_checked`` turn that back into one EPValueError. JAX's per-rank "callback failed" log records
# (a traceback per rank) are filtered out for EPValueError only.
class _QuietEPErrors(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, EPValueError)


logging.getLogger("jax._src.callback").addFilter(_QuietEPErrors())

_MESSAGE = re.compile(r"EPValueError: (jax_ep[^\n]*)")


@contextlib.contextmanager
def ep_errors():
    """Within the block, a checked-mode failure that JAX reports as a ``jax.errors.JaxRuntimeError``
    is raised as one ``EPValueError`` with jax_ep's message (other errors pass unchanged). The error
    surfaces where the result is waited for (``block_until_ready``, ``np.asarray``, ``.item()``):
    keep that inside the block."""
    try:
        yield
    except jax.errors.JaxRuntimeError as e:
        found = _MESSAGE.findall(str(e))
        if not found:
            raise
        _forget_failed_tokens()
        raise EPValueError(found[-1]) from None


def _forget_failed_tokens(only_checks: bool = False) -> list[str]:
    """JAX keeps each device's last runtime token of a computation with a host callback and waits for
    them at exit, re-raising a failed callback's error there as "Exception ignored in atexit callback"
    tracebacks. Forget the tokens that failed (the error has been reported); keep the others.
    ``only_checks``: only those that failed on a jax_ep check. Returns the jax_ep messages of the
    forgotten ones. Uses a private JAX structure: skipped if it is not there."""
    messages: list[str] = []
    try:
        from jax._src import dispatch

        tokens = dispatch.runtime_tokens
        for table in (tokens.output_runtime_tokens, tokens.current_tokens):
            for key, token in list(table.items()):
                try:
                    token.block_until_ready()
                except Exception as e:  # noqa: BLE001 - a failed computation: its error is e
                    found = _MESSAGE.findall(str(e))
                    if found or not only_checks:
                        messages.extend(found[-1:])
                        del table[key]
    except (ImportError, AttributeError):
        pass
    return messages


@atexit.register  # registered after JAX's own exit handlers (jax is imported above), so it runs first
def _checks_failed_at_exit() -> None:
    """A checked-mode failure outside ``run_checked`` / ``ep_errors``: instead of JAX's atexit
    tracebacks (one per handler, each with the callback's), one line per message, unless the
    program already ended with that error."""
    messages = _forget_failed_tokens(only_checks=True)
    shown = str(getattr(sys, "last_value", None) or "")
    for message in dict.fromkeys(messages):
        if message not in shown:
            print(f"jax_ep.EPValueError (a checked-mode check failed; jax_ep.run_checked raises it): "
                  f"{message}", file=sys.stderr)


def run_checked(fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, waited for (``jax.block_until_ready``); a checked-mode failure raises
    one ``EPValueError``."""
    with ep_errors():
        return jax.block_until_ready(fn(*args, **kwargs))


def _host_check(message_fn, *values, dtype=jnp.int32) -> jax.Array:
    """A zero scalar of ``dtype`` from a host callback that raises EPValueError(message_fn(*values)) where
    that is a message (None: the check passed). Sequential under jax.vmap: a checked op runs there as an
    unchecked one does (one check per element)."""
    def callback(*arrays):
        message = message_fn(*(np.asarray(a) for a in arrays))
        if message is not None:
            raise EPValueError(message)
        return np.zeros((), dtype)

    return jax.pure_callback(callback, jax.ShapeDtypeStruct((), dtype), *values, vmap_method="sequential")


def tie(zero: jax.Array, out):
    """out, each array made to depend on the check result ``zero`` (a select, so that the check runs
    whenever any part of out is used; JAX and XLA drop an optimization_barrier's unused operands)."""
    return jax.tree.map(lambda a: jnp.where(zero == 0, a, jnp.zeros_like(a)), out)


def check_rank_mask_agrees(rank_mask: jax.Array, axis_name: str, op: str) -> jax.Array:
    """Checked mode: ``rank_mask`` (bool [R]) must be the same on every rank of the EP group. Returns a
    zero int32 scalar tied to the check. Ranks that disagree wait for different peers (on the kernels a
    timeout) or send rows a peer does not take (on the reference path the pairs went nowhere silently)."""
    flags = rank_mask.astype(jnp.int32)
    lowest, highest = lax.pmin(flags, axis_name), lax.pmax(flags, axis_name)

    def message(lowest, highest):
        differ = np.flatnonzero(lowest != highest)
        if differ.size:
            return (f"jax_ep.{op}: rank_mask differs between the ranks of the EP group (it must be the same "
                    f"on every rank): the flags of ranks {differ.tolist()} are 1 on some ranks, 0 on others")
        return None

    return _host_check(message, lowest, highest)


def check_topk_values(topk_idx: jax.Array, num_experts: int, axis_name: str, op: str) -> jax.Array:
    """Checked mode: every id must be -1 or in [0, num_experts). Returns topk_idx, tied to the check.
    The count is summed over the EP group so that every rank raises (a rank left waiting in a
    collective would hang instead)."""
    bad = (topk_idx < -1) | (topk_idx >= num_experts)
    if topk_idx.size:
        local_first = jnp.where(jnp.any(bad), topk_idx.reshape(-1)[jnp.argmax(bad.reshape(-1))], 0)
    else:  # no tokens on this rank (argmax of nothing is an error)
        local_first = jnp.zeros((), topk_idx.dtype)
    num_bad = lax.psum(jnp.sum(bad, dtype=jnp.int32), axis_name)
    # the bad value of the lowest rank that has one
    rank = lax.axis_index(axis_name)
    first_rank = lax.pmin(jnp.where(jnp.any(bad), rank, jnp.iinfo(jnp.int32).max), axis_name)
    first = lax.psum(jnp.where(rank == first_rank, local_first, 0), axis_name)

    def message(num_bad, first_value):
        if int(num_bad):
            return (f"jax_ep.{op}: topk_idx has {int(num_bad)} ids outside [-1, {num_experts}) across "
                    f"the EP group (-1 marks an unused slot); first bad value {int(first_value)}")
        return None

    return topk_idx + _host_check(message, num_bad, first, dtype=topk_idx.dtype)


def capacity_needed(topk_idx: jax.Array, cfg: EPConfig, ep_size: int, rank_mask=None) -> jax.Array:
    """The capacity no rank drops a row with: max over ranks of the rows it receives (from the pairs
    that reach a rank under rank_mask), each expert's count rounded up to cfg.expert_alignment (as
    group_sizes are). The same on every rank."""
    topk_idx = reached_topk(topk_idx, cfg, rank_mask)
    per_expert = lax.psum(layout_of(topk_idx, cfg.num_experts, ep_size).num_tokens_per_expert,
                          cfg.axis_name)
    align = cfg.expert_alignment
    aligned = (per_expert + align - 1) // align * align
    return jnp.max(jnp.sum(aligned.reshape(ep_size, cfg.num_local_experts(ep_size)), axis=1))


def check_no_drops(out, topk_idx: jax.Array, cfg: EPConfig, ep_size: int, rank_mask=None, *,
                   outer_axis: str | None = None, op: str = "dispatch", tied=None):
    """Checked mode: capacity overflow is an error naming the rows dropped (summed over the EP group,
    so that every rank raises) and the capacity needed. Returns out (Dispatched), tied to the check, or
    ``tied`` (every output of the op: dispatch_straight_through's (Dispatched, rows)), tied to it.
    Pairs that a rank mask sends nowhere (counted in their source's num_dropped,
    ``routing.masked_pairs``) are no error: only capacity drops are. ``outer_axis``: a further mesh
    axis of the EP group (the node axis of jax_ep.hierarchical, whose stage 2 is this dispatch): the
    totals span it too."""
    capacity = cfg.resolved_capacity(ep_size)
    dropped = out.num_dropped - masked_pairs(topk_idx, cfg, rank_mask)
    group = (cfg.axis_name,) if outer_axis is None else (outer_axis, cfg.axis_name)
    # typed over the whole group: with no tokens a count may vary over the local axis only
    total = lax.psum(vary_also(dropped, group), group)
    needed = capacity_needed(topk_idx, cfg, ep_size, rank_mask)
    if outer_axis is not None:
        needed = lax.pmax(needed, outer_axis)

    def message(dropped, needed):
        if int(dropped):
            return (f"jax_ep.{op}: EPConfig.capacity={capacity} is too small: {int(dropped)} rows "
                    f"dropped across the EP group; capacity needed: {int(needed)} (the most rows a rank "
                    f"receives, each expert's count rounded up to expert_alignment={cfg.expert_alignment}"
                    "); set EPConfig.capacity (the MoE layer's EPOptions.capacity) to at least that, or "
                    "None for the worst case")
        return None

    zero = _host_check(message, total, needed)
    return tie(zero, out if tied is None else tied)


def float0_like(a) -> np.ndarray:
    return np.zeros(np.shape(a), dtype=jax.dtypes.float0)
