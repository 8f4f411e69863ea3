"""Public ops: get_dispatch_layout, dispatch and combine, with custom_vjp; ll_dispatch and ll_combine
(low-latency decode mode, forward-only), also in two phases (ll_dispatch_send / ll_dispatch_recv,
ll_combine_send / ll_combine_recv); dispatch_rank_major and combine_rank_major (DeepEP's rank-major
contract, one row per (token, rank), with custom_vjp).

Call them inside ``shard_map`` over ``cfg.axis_name`` (per-rank view). Each op is declared once, in
``OPS`` below: its output types (``jax_ep.types``: the contract), its implementations (the same
function in each registered backend, ``jax_ep.backends``), and which backend a call takes
(``Op.plan``: ``backend="auto"`` takes a kernel where it measured faster). The
backward passes reuse the forward machinery: the gradient of dispatch is a combine with unit weights
(plus the gate-weight gradients sent back to their top-k slots, ``slot_values``); the gradient of
combine is a ``broadcast`` of the cotangents through the same handle, fused with the local part
(d y and d row_weights) into one ``combine_bwd`` where its kernel is taken. The rank-major pair works
the same way: combine_rank_major is the backward of dispatch_rank_major (rows and gate weights) and
``broadcast_rank_major`` that of combine_rank_major. The low-latency ops have no
backward pass: differentiating through them raises ``NotImplementedError`` naming the op.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref

import jax
import jax.numpy as jnp
from jax import lax

from jax_ep import auto_table, backends, overlap, remat, types, vma
from jax_ep.config import EPConfig, KernelConfig, check_option
from jax_ep.errors import EPRuntimeError, EPTypeError, EPUnsupportedError, EPValueError
from jax_ep.fp8 import dequantize_rows
from jax_ep.validation import (
    check_combine_args,
    check_combine_rank_major_args,
    check_dispatch_args,
    check_layout_args,
    check_ll_combine_args,
    check_ll_dispatch_args,
    check_no_drops,
    check_rank_mask,
    check_rank_mask_agrees,
    check_topk_values,
    float0_like,
    fp8_forward_only,
    tie,
)


@dataclasses.dataclass(frozen=True)
class OpPlan:
    """What an EP op runs: ``impl``, the backend (``jax_ep.backends``: "reference", the pure-JAX path;
    "cuda", its kernel), and why."""

    op: str
    impl: str
    reason: str


@dataclasses.dataclass(frozen=True)
class Op:
    """One op and the output layout it produces (the key of its row in ``auto_table.json``).

    ``form_of``: the op whose backend function this one runs in another form (the MoE layer's in-place
    backward: ``broadcast_in_place`` is ``broadcast`` into y's buffer), timed as its own table entry;
    where the table has no decision for it at an EP size, that op's decision stands in
    (``jax_ep.auto_table.kernel_faster``)."""

    name: str
    layout: str = "expert_major"
    form_of: str | None = None

    @property
    def function(self) -> str:
        """The name of the backend function that runs it (``jax_ep.backends.Functions``)."""
        return self.form_of or self.name

    def wire_dtype(self, cfg: EPConfig, dtype=None) -> str:
        """The dtype name of this op's rows on the wire, which the auto table decides the dispatch ops by:
        a dispatch's ``cfg.wire_dtype`` of its rows (``dtype``; None: bfloat16, the benchmark's), every
        other op's rows as they are."""
        rows = jnp.bfloat16 if dtype is None else dtype
        return (cfg.wire_dtype(rows) if self.function.startswith(("dispatch", "ll_dispatch"))
                else jnp.dtype(rows)).name

    def kernel_by_default(self, cfg: EPConfig, ep_size: int, dtype=None) -> bool:
        """A backend's kernel of it measured faster than the reference at cfg's tokens per rank on
        `ep_size` GPUs with cfg's wire rows (``jax_ep.auto_table``, written by the benchmark)."""
        return any(backend.faster(self.name, self.layout, cfg.max_tokens_per_rank, ep_size,
                                  self.wire_dtype(cfg, dtype))
                   for backend in backends.measured())

    def plan(self, cfg: EPConfig, ep_size: int, dtype=None) -> OpPlan:
        """Which backend cfg.backend takes for this op on an EP group of ``ep_size`` with rows of
        ``dtype``, and why (what ``implementation`` runs).

        A named backend: that one, or an error saying why it cannot run the call. "auto": the first
        backend with a measured kernel (``jax_ep.backends.measured``: "cuda") whose kernel measured
        faster (the auto table), that runs on the platform of the call (``backends.platform``), is
        available and supports the sizes; the reference otherwise, the reason naming the first of
        these that failed. A rank mask plays no part in the choice: every kernel but layout's takes
        one, with the reference's masked semantics bit for bit (the table was measured without one;
        the mask adds one [R] read).
        """
        if cfg.backend != "auto":
            backend = backends.get(cfg.backend)
            if backend.name != backends.REFERENCE:
                self._check_runs(backend, cfg, ep_size, dtype)
            return self._taken(backend, cfg, ep_size, f"backend={backend.name!r}")
        candidates = backends.measured()
        reasons = []
        for backend in candidates:
            reason = self._why_auto_skips(backend, cfg, ep_size, dtype)
            if reason is None:
                args = (self.name, self.layout, cfg.max_tokens_per_rank, ep_size, self.wire_dtype(cfg, dtype))
                why = (backend.why_faster(*args) if backend.why_faster is not None
                       else f"its kernel measured faster at {cfg.max_tokens_per_rank} tokens per rank")
                return self._taken(backend, cfg, ep_size, f"backend='auto': {why}, and it runs here")
            reasons.append(reason if len(candidates) == 1 else f"{backend.name}: {reason}")
        if not reasons:
            reasons.append("no backend but the reference is registered")
        return OpPlan(self.name, backends.REFERENCE, "backend='auto': " + "; ".join(reasons))

    def _taken(self, backend: backends.Backend, cfg: EPConfig, ep_size: int, reason: str) -> OpPlan:
        form = backend.form(self.function, cfg, ep_size)
        return OpPlan(self.name, backend.name, reason if form is None else f"{reason}; {form}")

    def _why_auto_skips(self, backend: backends.Backend, cfg: EPConfig, ep_size: int, dtype) -> str | None:
        if not backend.implements(self.function):
            return f"this version of jax_ep has no {backend.name} kernel for it"
        if not backend.faster(self.name, self.layout, cfg.max_tokens_per_rank, ep_size,
                              self.wire_dtype(cfg, dtype)):
            stands_in = "" if self.form_of is None else f"; its row, else {self.form_of}'s"
            return (f"its kernel did not measure faster than the reference at {cfg.max_tokens_per_rank} "
                    f"tokens per rank on {auto_table.gpus(ep_size)} (jax_ep/auto_table.json, layout "
                    f"{self.layout!r}{stands_in})")
        here = backends.platform()
        if not backend.runs_on(here):
            return f"the platform of the call is {here!r}, not {backend.platforms[0]!r}"
        usable, why = backend.available()   # asked only on its platform (the extension loads there)
        if not usable:
            return f"the {backend.name} backend is unavailable: {why}"
        why = backend.unsupported(self.function, cfg, ep_size, dtype)
        if why is not None:
            return f"its kernel does not support this call: {why}"
        return None

    def _check_runs(self, backend: backends.Backend, cfg: EPConfig, ep_size: int, dtype) -> None:
        """cfg.backend names ``backend``: an error unless it can run this call."""
        backend.function(self.function)   # EPUnsupportedError when it has none
        usable, why = backend.available()
        if not usable:
            raise EPRuntimeError(f"jax_ep: backend={backend.name!r} is unavailable: {why}. Use "
                                 "backend='reference' or 'auto'.")
        here = backends.platform()
        if not backend.runs_on(here):
            raise EPValueError(f"jax_ep.{self.name} (backend={backend.name!r}): it runs on "
                               f"{'/'.join(backend.platforms)}, the platform of this call is {here!r} "
                               "(the mesh's devices); use backend='reference' or 'auto'")
        why = backend.unsupported(self.function, cfg, ep_size, dtype)
        if why is not None:
            raise EPValueError(f"jax_ep.{self.name} (backend={backend.name!r}): {why}; use "
                               "backend='reference' (or 'auto', which falls back to it)")

    def implementation(self, cfg: EPConfig, ep_size: int, dtype=None):
        """The function implementing this op for cfg.backend (``plan``'s choice)."""
        return backends.get(self.plan(cfg, ep_size, dtype).impl).function(self.function)


OPS = {op.name: op for op in (
    Op("layout"), Op("dispatch"), Op("combine"), Op("broadcast"), Op("combine_bwd"), Op("slot_values"),
    # combine's backward as the MoE layer runs it (EPOptions.dy_in_place): into y's donated buffer, only
    # the token rows written (the plain ops zero every row of C that holds no token)
    Op("broadcast_in_place", form_of="broadcast"), Op("combine_bwd_in_place", form_of="combine_bwd"),
    Op("ll_dispatch", "fixed_slots"), Op("ll_combine", "fixed_slots"),
    *(Op(name, "rank_major") for name in ("dispatch_rank_major", "combine_rank_major",
                                          "broadcast_rank_major")),
)}
# a form runs a plain op's backend function and falls back on its table row (one step, same layout)
assert all(OPS[op.form_of].form_of is None and OPS[op.form_of].layout == op.layout
           for op in OPS.values() if op.form_of is not None)


def explain(cfg: EPConfig, ep_size: int, dtype=jnp.bfloat16, ops=None) -> dict[str, OpPlan]:
    """Which implementation each EP op (``OPS``: the forward ops, their backward ops and the layout)
    would take for ``cfg`` on an EP group of ``ep_size`` GPUs with rows of ``dtype``, and why: the same
    decision the op makes when called inside shard_map (``jax_ep.gemm.explain`` does this for the
    expert GEMM). ``ops``: a subset of OPS' names. backend='cuda' raises as the op would where its
    kernel cannot run."""
    if not isinstance(cfg, EPConfig):
        raise EPTypeError(f"jax_ep.explain: cfg must be a jax_ep.EPConfig, got {type(cfg).__name__}")
    ep_size = check_option("jax_ep.explain:", "ep_size", ep_size, "int")
    cfg.check_ep_size(ep_size)
    if isinstance(ops, str):
        raise EPTypeError(f"jax_ep.explain: ops must be a sequence of op names, got the str {ops!r} "
                          f"(e.g. ops=[{ops!r}])")
    names = list(OPS) if ops is None else list(ops)
    unknown = [name for name in names if name not in OPS]
    if unknown:
        raise EPValueError(f"jax_ep.explain: unknown ops {unknown}; the EP ops are {list(OPS)}")
    return {name: OPS[name].plan(cfg, ep_size, None if name == "layout" else dtype) for name in names}


def implementation(op: str, cfg: EPConfig, dtype=None):
    """The function ``cfg.backend`` runs for ``op`` (inside shard_map over cfg.axis_name)."""
    return backends.get(_backend_here(op, cfg, dtype)).function(OPS[op].function)


def _backend_here(op: str, cfg: EPConfig, dtype) -> str:
    """The backend ``plan`` picks for ``op``, where the call runs: a kernel needs one device per rank, so
    an EP axis that no enclosing shard_map makes manual (a ``jax.vmap`` axis) takes the reference with
    "auto" and is an error with a named backend. It lowered to one sequential call per rank on one device,
    each waiting for peers that start only after it ends (found by a review, 2026-12-05)."""
    name = OPS[op].plan(cfg, ep_size(cfg, op), dtype).impl
    # a backend for every platform is pure JAX (the reference): it runs under vmap as under shard_map
    if not backends.get(name).platforms or cfg.axis_name in vma.manual_axes():
        return name
    if cfg.backend == "auto":
        return backends.REFERENCE
    raise EPValueError(f"jax_ep.{op} (backend={cfg.backend!r}): the EP axis {cfg.axis_name!r} is not a "
                       "manual axis of an enclosing shard_map (a jax.vmap axis?): the kernels need one "
                       "device per rank; run the op in shard_map over the mesh, or use backend='reference'")


def _typed_inputs(x, topk_weights, topk_idx, cfg: EPConfig):
    """(x, topk_weights) of a dispatch, typed as one primitive would type its operands: an input invariant
    over the mesh gets its cotangent summed over it, the EP axis included (the op's results vary over it,
    and so do the cotangents its backward returns)."""
    x, topk_weights, _ = vma.vary_jointly(vma.vary_also(x, (cfg.axis_name,)), topk_weights, topk_idx)
    return x, topk_weights


def _typed_rows(y, handle, cfg: EPConfig):
    """A combine's rows y typed as its handle and the EP axis (``_typed_inputs``)."""
    return vma.vary_also(vma.vary_as(y, handle.src_index), (cfg.axis_name,))


def _type_token(x):
    """A zero-size array carrying x's dtype and mesh typing: custom_vjp residuals must be arrays, and the
    backward types its cotangents by it (``vma.typed_like``)."""
    return vma.vary_like(jnp.zeros((0,), x.dtype), x)


def handle_mask(rank_mask: jax.Array | None, handle) -> jax.Array | None:
    """The mask an op of a dispatch's handle runs with: its own ANDed with the dispatch's
    (``handle.rank_mask``). A rank the dispatch masked holds no rows of the call: let in by the op's mask
    it would give back nothing, and the CUDA kernels' sources would add the partial sums its staging held
    from an earlier call (kernel emulator, 2026-12-05); the reference's result is the same either way."""
    if handle.rank_mask is None:
        return rank_mask
    if rank_mask is None:
        return handle.rank_mask
    return ((rank_mask != 0) & (handle.rank_mask != 0)).astype(jnp.int32)


def ep_size(cfg: EPConfig, op: str) -> int:
    """The size of the EP axis; a clear error outside shard_map."""
    if not isinstance(cfg, EPConfig):
        raise EPTypeError(f"jax_ep.{op}: cfg must be a jax_ep.EPConfig, got {type(cfg).__name__}")
    try:
        size = lax.axis_size(cfg.axis_name)
    except NameError as e:
        raise EPValueError(f"jax_ep.{op} must run inside shard_map over the mesh axis "
                           f"{cfg.axis_name!r} (cfg.axis_name); that axis is not bound here") from e
    cfg.check_ep_size(size)
    return size


# ---- public ops -----------------------------------------------------------------------------------
def get_dispatch_layout(topk_idx: jax.Array, cfg: EPConfig) -> types.Layout:
    """Tokens of this rank per destination rank and per expert, and token->rank membership."""
    ep_size(cfg, "get_dispatch_layout")
    check_layout_args(topk_idx, cfg)
    if cfg.checked:
        topk_idx = check_topk_values(topk_idx, cfg.num_experts, cfg.axis_name, "get_dispatch_layout")
    return implementation("layout", cfg)(topk_idx, cfg)


@overlap.in_order
def dispatch(x: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array, cfg: EPConfig,
             rank_mask: jax.Array | None = None) -> types.Dispatched:
    """Send each token to the ranks of its top-k experts; return expert-major rows on each rank.

    Args:
      x: [T, H] tokens of this rank.
      topk_idx: [T, K] int32 expert ids; -1 marks an unused slot.
      topk_weights: [T, K] float32 gate weights.
      cfg: EPConfig (static).
      rank_mask: None (every rank active) or [R] bool / integer (nonzero: active), the same on every
        rank, traced. A masked rank sends and receives nothing: its own tokens are not routed, it
        keeps no rows, and every pair that goes nowhere (masked source or destination) counts in
        its source's num_dropped (docs/api.md, "Rank masking"). The same on every backend.
    Returns:
      Dispatched: rows [C, H] (expert-major, one per (token, local expert) pair), scales for FP8,
      group_sizes [E_local] (aligned), expert_counts, num_dropped, handle (row_weights [C] in it),
      rank_mask [R] int32 (the ranks this call ran with: the argument AND NOT the persistent mask).
    """
    return _checked_dispatch(overlap.primal(_dispatch), x, topk_idx, topk_weights, cfg, rank_mask)


@overlap.in_order
def dispatch_straight_through(x: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array, cfg: EPConfig,
                              rank_mask: jax.Array | None = None) -> tuple[types.Dispatched, jax.Array]:
    """``dispatch`` with an FP8 wire (``cfg.dispatch_dtype == "float8_e4m3fn"``), differentiable as
    DeepSeek-V3 trains it: (Dispatched, its rows dequantised to x's dtype). The gradient of those rows
    goes straight through the quantisation into dispatch's backward (a combine of the row cotangents);
    the e4m3 rows and their scales are constants (an FP8 GEMM reading them gives them zero cotangents).
    ``dispatch`` itself stays forward-only with an FP8 wire: its rows are e4m3, and a cotangent of that
    dtype would round the gradient to 3 mantissa bits. What the MoE layer's FP8 wire runs."""
    if cfg.dispatch_dtype != "float8_e4m3fn":
        raise EPValueError(f"dispatch_straight_through: cfg.dispatch_dtype must be 'float8_e4m3fn', got "
                           f"{cfg.dispatch_dtype!r} (use dispatch)")
    return _checked_dispatch(_dispatch_st, x, topk_idx, topk_weights, cfg, rank_mask, with_rows=True,
                             op="dispatch_straight_through")


def _checked_dispatch(custom, x, topk_idx, topk_weights, cfg, rank_mask, *, with_rows=False,
                      op="dispatch"):
    """dispatch's checks and input typing around its custom_vjp ``custom``, which returns the Dispatched
    (``with_rows``: and its dequantised rows); errors name ``op``."""
    size = ep_size(cfg, op)
    check_dispatch_args(x, topk_idx, topk_weights, cfg, op=op)
    rank_mask, topk_idx = _checked_mask(rank_mask, size, cfg, op, topk_idx)
    if cfg.checked:
        topk_idx = check_topk_values(topk_idx, cfg.num_experts, cfg.axis_name, op)
    x, topk_weights = _typed_inputs(x, topk_weights, topk_idx, cfg)
    out = custom(x, topk_idx, topk_weights, rank_mask, cfg)
    if cfg.checked:  # the mask the call ran with (the persistent one ANDed in, on 'cuda')
        d = out[0] if with_rows else out
        # every output tied: a caller that reads only the rows (an FP8 GEMM) ran no check
        out = check_no_drops(d, topk_idx, cfg, size, d.rank_mask != 0, op=op, tied=out)
    return out


@overlap.in_order
def combine(y: jax.Array, handle: types.Handle, cfg: EPConfig, rank_mask: jax.Array | None = None, *,
            empty_rows_zero: bool = False, weighted: bool = True) -> jax.Array:
    """For each token of this rank, the gate-weighted sum (handle.row_weights) of its expert outputs
    y ([C, H] -> [T, H]). rank_mask (as for dispatch; pass the dispatch's): an active source takes
    partial sums from the active ranks only, a masked one from itself only; what a rank ignores
    gets a zero gradient. empty_rows_zero: the gradient of y takes the rows that hold no token
    (handle.src_index -1: alignment padding, rows past the groups) from y (so the CUDA kernel writes
    d y into y's buffer and only its token rows: at the worst-case capacity most rows hold no token).
    The caller states that y is zero in every such row that y's producer reads back from d y: the
    alignment padding, and the rows past the groups unless the producer's backward skips them, as an
    expert block's GEMMs do (``jax_ep.moe.expert_block``: they leave those rows of y unwritten). Wrong
    otherwise (those rows of d y are y's).
    weighted=False: the plain sum of each token's rows (the gate weights applied before, e.g. in the
    experts: ``expert_block(row_weights=...)``); the gradient of y is then a ``broadcast`` of the output's
    (in place with empty_rows_zero: the token rows written, nothing read), handle.row_weights gets none."""
    for name, flag in (("empty_rows_zero", empty_rows_zero), ("weighted", weighted)):
        if not isinstance(flag, bool):
            raise EPTypeError(f"combine: {name} must be a bool, got {flag!r}")
    size = ep_size(cfg, "combine")
    check_combine_args(y, handle, cfg, ep_size=size)
    rank_mask, y = _checked_mask(rank_mask, size, cfg, "combine", y)
    rank_mask = handle_mask(rank_mask, handle)
    return overlap.primal(_combine)(_typed_rows(y, handle, cfg), handle, rank_mask, cfg, empty_rows_zero,
                                    weighted)


def _checked_mask(rank_mask, size: int, cfg: EPConfig, op: str, tied):
    """(check_rank_mask's mask, ``tied``): in checked mode ``tied`` made to depend on the check that the
    mask is the same on every rank."""
    rank_mask = check_rank_mask(rank_mask, size, op)
    if cfg.checked and rank_mask is not None:
        tied = tie(check_rank_mask_agrees(rank_mask, cfg.axis_name, op), tied)
    return rank_mask, tied


# ---- dispatch: custom_vjp -------------------------------------------------------------------------
@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _dispatch(x, topk_idx, topk_weights, rank_mask, cfg):
    # named for jax.checkpoint policies (jax_ep.remat): a rematerialised block may keep them
    out = implementation("dispatch", cfg, x.dtype)(x, topk_idx, topk_weights, cfg, rank_mask=rank_mask)
    return remat.named(out, remat.DISPATCH)


def _dispatch_fwd(x, topk_idx, topk_weights, rank_mask, cfg):
    # .fun, not the custom_vjp: called here it would stage its primal into a jaxpr of its own, a trace
    # level below this rule's (where jax_ep.overlap's block of a differentiated call waits for it)
    out = _dispatch.fun(x, topk_idx, topk_weights, rank_mask, cfg)
    return out, _dispatch_residuals(out, x, topk_idx, rank_mask)


def _dispatch_residuals(out, x, topk_idx, rank_mask):
    # (topk_weights is typed as x: _typed_inputs)
    return out.handle, _type_token(x), topk_idx, rank_mask


def _dispatch_bwd(cfg, residuals, ct):
    if cfg.dispatch_dtype == "float8_e4m3fn":
        raise fp8_forward_only("dispatch")
    return _dispatch_transpose(cfg, residuals, ct.x, ct.handle.row_weights)


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


# dispatch_straight_through's: the FP8 wire's rows dequantised, their cotangent taken as the rows'
@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _dispatch_st(x, topk_idx, topk_weights, rank_mask, cfg):
    # named here too: inside this rule's forward _dispatch is a call of its own, its names hidden
    out = remat.named(_dispatch(x, topk_idx, topk_weights, rank_mask, cfg), remat.DISPATCH)
    return out, dequantize_rows(out.x, out.scales, x.dtype)


def _dispatch_st_fwd(x, topk_idx, topk_weights, rank_mask, cfg):
    out = _dispatch_st.fun(x, topk_idx, topk_weights, rank_mask, cfg)   # .fun: as _dispatch_fwd
    return out, _dispatch_residuals(out[0], x, topk_idx, rank_mask)


def _dispatch_st_bwd(cfg, residuals, ct):
    ct_d, d_rows = ct
    return _dispatch_transpose(cfg, residuals, d_rows, ct_d.handle.row_weights)


_dispatch_st.defvjp(_dispatch_st_fwd, _dispatch_st_bwd)


def _dispatch_transpose(cfg, residuals, d_rows, d_row_weights):
    """dispatch's backward from the cotangents of its rows [C, H] and of its handle's row weights [C]."""
    handle, dtype_token, topk_idx, rank_mask = residuals
    dtype = dtype_token.dtype
    dx = implementation("combine", cfg, d_rows.dtype)(
        d_rows, _unit_weights(handle), cfg, rank_mask=rank_mask).astype(dtype)
    # a masked slot is DROPPED in the handle: it has no row, its weight's gradient is 0
    d_topk_weights = implementation("slot_values", cfg)(d_row_weights, handle, cfg, rank_mask=rank_mask)
    dx, d_topk_weights = (vma.typed_like(ct, dtype_token) for ct in (dx, d_topk_weights))
    return dx, float0_like(topk_idx), d_topk_weights, None if rank_mask is None else float0_like(rank_mask)


def _unit_weights(handle: types.Handle) -> types.Handle:
    """The handle with every row weight 1: y * 1.0 is exact, so combine through it is the plain sum of
    each token's rows (dispatch's backward, the unweighted combine)."""
    return handle._replace(row_weights=jnp.ones_like(handle.row_weights))


# ---- combine: custom_vjp --------------------------------------------------------------------------
@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _combine(y, handle, rank_mask, cfg, empty_rows_zero, weighted):
    return remat.named(implementation("combine", cfg, y.dtype)(
        y, handle if weighted else _unit_weights(handle), cfg, rank_mask=rank_mask), remat.COMBINE)


def _combine_fwd(y, handle, rank_mask, cfg, empty_rows_zero, weighted):
    # y itself only where the backward reads it (weighted) or writes into its buffer (in place); else
    # its dtype alone, so that the forward's [C, H] rows are not held until the backward for nothing
    kept = y if weighted or empty_rows_zero else _type_token(y)
    out = _combine.fun(y, handle, rank_mask, cfg, empty_rows_zero, weighted)   # .fun: as _dispatch_fwd
    return out, (kept, handle, rank_mask)


def _combine_bwd(cfg, empty_rows_zero, weighted, residuals, g):
    y, handle, rank_mask = residuals
    if weighted:
        # The kernel: g moved, y read and d y written once. Otherwise the whole reference backward, its
        # broadcast included even where the broadcast kernel is faster alone: XLA fuses the reference's
        # gather into the rows' products, while a kernel's [C, H] rows must be written and read back
        # (2x H200, DeepSeek-V3 layer: 2 ms more per step with the kernel there, docs/benchmarks.md).
        op = "combine_bwd_in_place" if empty_rows_zero else "combine_bwd"
        dy, d_row_weights = implementation(op, cfg, y.dtype)(g, y, handle, cfg, rank_mask=rank_mask,
                                                             empty_rows_from_y=empty_rows_zero)
    else:  # dispatch's bytes: g moved, the token rows written, y not read
        dy = implementation("broadcast_in_place" if empty_rows_zero else "broadcast", cfg, y.dtype)(
            g.astype(y.dtype), handle, cfg, rank_mask=rank_mask, into=y if empty_rows_zero else None)
        d_row_weights = jnp.zeros_like(handle.row_weights)
    dy, d_row_weights = vma.typed_like(dy, y), vma.typed_like(d_row_weights, handle.row_weights)
    d_handle = types.Handle(float0_like(handle.src_index), float0_like(handle.token_rows),
                            float0_like(handle.is_token_in_rank), d_row_weights,
                            None if handle.rank_mask is None else float0_like(handle.rank_mask))
    return dy, d_handle, None if rank_mask is None else float0_like(rank_mask)


_combine.defvjp(_combine_fwd, _combine_bwd)


# ---- rank-major mode (DeepEP's contract): custom_vjp ----------------------------------------------
@overlap.in_order
def dispatch_rank_major(x: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array, cfg: EPConfig,
                        rank_mask: jax.Array | None = None) -> types.RankMajorDispatched:
    """Send each token once to each rank that holds any of its top-k experts; return one row per
    (token, this rank) pair, for expert kernels that permute (and weight) the rows themselves.

    Args:
      x: [T, H] tokens of this rank (T <= cfg.max_tokens_per_rank).
      topk_idx: [T, K] int32 expert ids; -1 (or any id outside [0, E), or a repeat within a token)
        marks an unused slot.
      topk_weights: [T, K] float32 gate weights.
      cfg: EPConfig (static); capacity and expert_alignment play no part (no drops).
      rank_mask: as for dispatch: a masked rank sends and receives nothing (rows only from active
        sources to active ranks; no output counts the pairs that go nowhere:
        ``routing.masked_pairs``). Pass the same mask to combine_rank_major.
    Returns:
      RankMajorDispatched: x [R*T, H] rows packed from row 0 (source rank major, token order within;
      rows past sum(num_tokens_per_rank) are empty: zero), scales [R*T, ceil(H/128)] for FP8,
      topk_idx [R*T, K] int32 local expert ids (-1 where the slot's expert is not on this rank, and
      in empty rows), topk_weights [R*T, K] float32 (0 where topk_idx is -1), num_tokens_per_rank [R],
      num_tokens_per_expert [E_local], handle (RankMajorHandle) for combine_rank_major.
    Differentiable in x and topk_weights (bfloat16 / float32 wire; FP8 is forward-only).
    """
    size = ep_size(cfg, "dispatch_rank_major")
    check_dispatch_args(x, topk_idx, topk_weights, cfg, op="dispatch_rank_major")
    rank_mask, topk_idx = _checked_mask(rank_mask, size, cfg, "dispatch_rank_major", topk_idx)
    if cfg.checked:
        topk_idx = check_topk_values(topk_idx, cfg.num_experts, cfg.axis_name, "dispatch_rank_major")
    x, topk_weights = _typed_inputs(x, topk_weights, topk_idx, cfg)
    return _dispatch_rank_major(x, topk_idx, topk_weights, rank_mask, cfg)


@overlap.in_order
def combine_rank_major(y: jax.Array, handle: types.RankMajorHandle, cfg: EPConfig,
                       rank_mask: jax.Array | None = None) -> jax.Array:
    """y [R*T, H'] (one output row per dispatched row; empty rows may hold anything, NaN included)
    -> [T, H'] of y's dtype: per token of this rank, the sum over the ranks it went to of its rows,
    in float32 in rank order, rounded once to y's dtype. No gate weights: the expert kernel applied
    them (dispatch_rank_major's topk_weights). rank_mask (pass the dispatch's): rows only from the
    ranks linked to this one (every active rank if it is active, itself only if masked)."""
    size = ep_size(cfg, "combine_rank_major")
    check_combine_rank_major_args(y, handle, cfg, size)
    rank_mask, y = _checked_mask(rank_mask, size, cfg, "combine_rank_major", y)
    rank_mask = handle_mask(rank_mask, handle)
    return _combine_rank_major(_typed_rows(y, handle, cfg), handle, rank_mask, cfg)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _dispatch_rank_major(x, topk_idx, topk_weights, rank_mask, cfg):
    impl = implementation("dispatch_rank_major", cfg, x.dtype)
    return remat.named(impl(x, topk_idx, topk_weights, cfg, rank_mask=rank_mask), remat.DISPATCH)


def _dispatch_rank_major_fwd(x, topk_idx, topk_weights, rank_mask, cfg):
    out = _dispatch_rank_major.fun(x, topk_idx, topk_weights, rank_mask, cfg)   # .fun: as _dispatch_fwd
    return out, (out.handle, out.topk_idx, _type_token(x), topk_idx, rank_mask)


def _dispatch_rank_major_bwd(cfg, residuals, ct):
    handle, row_ids, dtype_token, topk_idx, rank_mask = residuals
    if cfg.dispatch_dtype == "float8_e4m3fn":
        raise fp8_forward_only("dispatch_rank_major")
    combine_impl = functools.partial(implementation("combine_rank_major", cfg, ct.x.dtype),
                                     rank_mask=rank_mask)
    dx = combine_impl(ct.x, handle, cfg).astype(dtype_token.dtype)
    # each (token, slot) weight lives on one rank's row: the rank sum adds zeros only, exactly
    d_weights = jnp.where(row_ids >= 0, ct.topk_weights.astype(jnp.float32), 0.0)
    d_topk_weights = combine_impl(d_weights, handle, cfg)
    dx, d_topk_weights = (vma.typed_like(ct, dtype_token) for ct in (dx, d_topk_weights))
    return dx, float0_like(topk_idx), d_topk_weights, None if rank_mask is None else float0_like(rank_mask)


_dispatch_rank_major.defvjp(_dispatch_rank_major_fwd, _dispatch_rank_major_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _combine_rank_major(y, handle, rank_mask, cfg):
    combined = implementation("combine_rank_major", cfg, y.dtype)(y, handle, cfg, rank_mask=rank_mask)
    return remat.named(combined, remat.COMBINE)


def _combine_rank_major_fwd(y, handle, rank_mask, cfg):
    return _combine_rank_major.fun(y, handle, rank_mask, cfg), (handle, _type_token(y), rank_mask)


def _combine_rank_major_bwd(cfg, residuals, g):
    handle, dtype_token, rank_mask = residuals
    broadcast = implementation("broadcast_rank_major", cfg, g.dtype)
    dy = vma.typed_like(broadcast(g, handle, cfg, rank_mask=rank_mask).astype(dtype_token.dtype), dtype_token)
    return (dy, types.RankMajorHandle(float0_like(handle.src_index), float0_like(handle.is_token_in_rank),
                                      None if handle.rank_mask is None else float0_like(handle.rank_mask)),
            None if rank_mask is None else float0_like(rank_mask))


_combine_rank_major.defvjp(_combine_rank_major_fwd, _combine_rank_major_bwd)



# ---- low-latency (decode) mode: forward-only ------------------------------------------------------
@overlap.in_order
def ll_dispatch(x: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array, cfg: EPConfig,
                rank_mask: jax.Array | None = None) -> types.LLDispatched:
    """Low-latency dispatch (decode): each token goes to fixed slots of its experts' ranks.

    Args:
      x: [T, H] bfloat16 (or float32, cast to the wire dtype) tokens of this rank.
      topk_idx: [T, K] int32 expert ids; -1 (or any id outside [0, E), or a repeat within a token)
        marks an unused slot.
      topk_weights: [T, K] float32 gate weights.
      cfg: EPConfig (static); dispatch_dtype "bfloat16" or "float8_e4m3fn" (None keeps bfloat16 x).
      rank_mask: None (every rank active) or [R] bool / integer (nonzero: active), the same on every
        rank: a masked rank sends and receives nothing; pairs to or of it are dropped and counted.
    Returns:
      LLDispatched: x [E_local, R*T, H] (slot (e, r*T + i): the i-th token of source rank r routed to
      local expert e; slots past counts[e, r] unspecified), scales [E_local, R*T, ceil(H/128)] for
      FP8, counts [E_local, R] int32, handle (LLHandle) for ll_combine, num_dropped [] int32 (pairs
      not sent: their rank masked), rank_mask [R] int32 (the ranks that took part). No capacity.
    Forward-only: differentiating through it raises NotImplementedError.
    """
    size = ep_size(cfg, "ll_dispatch")
    check_ll_dispatch_args(x, topk_idx, topk_weights, cfg)
    rank_mask, topk_idx = _checked_mask(rank_mask, size, cfg, "ll_dispatch", topk_idx)
    if cfg.checked:
        topk_idx = check_topk_values(topk_idx, cfg.num_experts, cfg.axis_name, "ll_dispatch")
    return _masked_ll_handle(_ll_dispatch(x, topk_idx, topk_weights, rank_mask, cfg), rank_mask is not None)


def _masked_ll_handle(out: types.LLDispatched, masked: bool) -> types.LLDispatched:
    """A masked dispatch's handle carries the ranks that took part, as Handle.rank_mask does: ll_combine
    called without the dispatch's mask waited, on the GPU, for a rank the dispatch masked (its discovery
    counts every rank of its own mask; found by a review, 2026-12-06). None without a mask (the handle's
    pytree as before: a scan carry of a hand-built handle; shrink mode's persistent mask is the kernels')."""
    return out._replace(handle=out.handle._replace(rank_mask=out.rank_mask)) if masked else out


@overlap.in_order
def ll_combine(y: jax.Array, handle: types.LLHandle, cfg: EPConfig,
               rank_mask: jax.Array | None = None) -> jax.Array:
    """Low-latency combine (decode): y [E_local, R*T, H] bfloat16, the expert outputs slot for slot
    (unfilled slots may hold anything, NaN included) -> [T, H] bfloat16, per token of this rank the
    sum over its top-k slots of nonzero weight, in slot order, of the float32 products w * y, rounded
    once to bfloat16. rank_mask (as for ll_dispatch; pass the dispatch's): a slot whose rank is masked
    adds +0.0, a masked rank's output is +0.0. Forward-only: differentiating through it raises
    NotImplementedError."""
    size = ep_size(cfg, "ll_combine")
    check_ll_combine_args(y, handle, cfg, size)
    rank_mask, y = _checked_mask(rank_mask, size, cfg, "ll_combine", y)
    return _ll_combine(y, handle, handle_mask(rank_mask, handle), cfg)


def _forward_only_op(op: str, cfg_argnum: int):
    """Decorator: a custom_vjp around the function (its config at cfg_argnum, not differentiated)
    whose gradient is an error naming op (the low-latency ops are forward-only)."""
    def bwd(cfg, residuals, ct):
        raise EPUnsupportedError(
            f"jax_ep.{op} is forward-only (low-latency decode mode) and has no gradient; differentiate "
            "through jax_ep.dispatch / jax_ep.combine instead")

    def wrap(fn):
        wrapped = jax.custom_vjp(fn, nondiff_argnums=(cfg_argnum,))
        # .fun: its call traced at the rule's level (where an open overlap block can take it)
        wrapped.defvjp(lambda *args: (wrapped.fun(*args), None), bwd)
        return wrapped
    return wrap


@_forward_only_op("ll_dispatch", 4)
def _ll_dispatch(x, topk_idx, topk_weights, rank_mask, cfg):
    return implementation("ll_dispatch", cfg, x.dtype)(x, topk_idx, topk_weights, cfg, rank_mask=rank_mask)


@_forward_only_op("ll_combine", 3)
def _ll_combine(y, handle, rank_mask, cfg):
    return implementation("ll_combine", cfg, y.dtype)(y, handle, cfg, rank_mask=rank_mask)


# ---- low-latency two-phase form -----------------------------------------------------------------
# The backend is chosen once, at the send (as for the fused op); the receive runs the same backend's
# second phase, named by the pending value (pending.backend).
def _ll_send_impl(op: str, cfg: EPConfig, dtype):
    name = _backend_here(op, cfg, dtype)
    send = backends.get(name).function(f"{op}_send")
    sent = _as_sent(cfg)
    return lambda *args, **kwargs: dataclasses.replace(send(*args, **kwargs), backend=name, cfg=sent)


def _as_sent(cfg: EPConfig) -> EPConfig:
    """The cfg as a pending value carries it and its receive compares it: the fields a receive may set
    otherwise than its send at their defaults (the send chose the backend; checks and kernel tuning do not
    change what the rows mean), so that a scan carrying pending values of sends that differ only there
    keeps one pytree structure."""
    return cfg.replace(backend="auto", checked=False, kernel=KernelConfig())


def _ll_recv_impl(op: str, pending):
    return backends.get(pending.backend).function(f"{op}_recv")


# per trace, the pending values received there (their tokens, weakly): a second receive of one is an
# error on every backend, as the kernels make it one at run time on GPUs (the reference would run it, so
# a program written on CPU failed only on GPUs). Keyed by trace: a branch of lax.cond or another trace
# of the same function receives on its own.
_received: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _receive_once(op: str):
    """Around a receive, outside ``overlap.in_order`` (which may pass the pending's token on as a new
    value): refuses a pending whose token this trace received already; notes it once the receive (its
    checks) went through, so a refused receive did not receive."""
    def wrap(receive):
        @functools.wraps(receive)
        def once(pending, cfg):
            trace = jax._src.core.trace_ctx.trace
            refs = [r for r in _received.get(trace, ()) if r() is not None]
            token = getattr(pending, "token", None)
            if token is not None and any(r() is token for r in refs):
                raise EPValueError(f"jax_ep.{op}: this pending value was received already: receive each "
                                   "pending value exactly once (docs/api.md, the two-phase low-latency ops)")
            out = receive(pending, cfg)
            _received[trace] = [*refs, weakref.ref(token)]
            return out
        return once
    return wrap


def _check_pending(pending, kind, op: str, cfg: EPConfig) -> None:
    if not isinstance(pending, kind):
        raise EPTypeError(f"jax_ep.{op}: expected the {kind.__name__} of the matching _send, got "
                           f"{type(pending).__name__}")
    weights = pending.topk_weights
    if getattr(weights, "ndim", None) != 2 or weights.shape[1] != cfg.num_topk:
        raise EPValueError(f"jax_ep.{op}: pending.topk_weights must have shape [tokens, {cfg.num_topk}], "
                           f"got {getattr(weights, 'shape', None)}")
    if getattr(pending.token, "shape", None) != (4,) or pending.token.dtype != jnp.uint32:
        raise EPValueError(f"jax_ep.{op}: pending.token must be uint32[4] (the _send's), got "
                           f"{getattr(pending.token, 'dtype', None)}{getattr(pending.token, 'shape', None)}")
    if kind is types.LLCombinePending and pending.y is None:
        raise EPValueError(f"jax_ep.{op}: pending.y is None: the receive reads the expert outputs y "
                           "(ll_combine_send's pending carries them)")
    if pending.backend not in backends.names():
        raise EPValueError(f"jax_ep.{op}: pending.backend={pending.backend!r} names no backend "
                           f"{backends.names()}: pass the pending value of the matching _send unchanged")
    sent, got = pending.cfg, _as_sent(cfg)
    if sent is not None and sent != got:   # another layout read the rows as other experts' (silently)
        differ = [f.name for f in dataclasses.fields(got) if getattr(got, f.name) != getattr(sent, f.name)]
        raise EPValueError(f"jax_ep.{op}: cfg differs from the _send's in " + ", ".join(
            f"{n}={getattr(got, n)!r} (the send's {getattr(sent, n)!r})" for n in differ)
            + ": receive with the cfg of the send")


@overlap.in_order
def ll_dispatch_send(x: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array,
                     cfg: EPConfig, rank_mask: jax.Array | None = None) -> types.LLDispatchPending:
    """First phase of ll_dispatch: issues the writes of this rank's tokens and returns at once (on
    the CUDA backend nothing waits for the data). Run independent work (attention, a shared expert),
    then ``ll_dispatch_recv(pending, cfg)``: together they equal ``ll_dispatch(x, topk_idx,
    topk_weights, cfg)``. Receive each pending value exactly once, and before the op's call two
    later (fused or sent: every ll_dispatch call counts); no other EP op but low-latency calls of the
    same shape may run while one is in flight (docs/api.md). rank_mask as for ll_dispatch (the
    receive serves the send's). Forward-only."""
    size = ep_size(cfg, "ll_dispatch_send")
    check_ll_dispatch_args(x, topk_idx, topk_weights, cfg, op="ll_dispatch_send")
    rank_mask, topk_idx = _checked_mask(rank_mask, size, cfg, "ll_dispatch_send", topk_idx)
    if cfg.checked:
        topk_idx = check_topk_values(topk_idx, cfg.num_experts, cfg.axis_name, "ll_dispatch_send")
    pending = overlap.primal(_ll_dispatch_send)(x, topk_idx, topk_weights, rank_mask, cfg)
    return dataclasses.replace(pending, masked=rank_mask is not None)   # (for the receive's handle)


@_receive_once("ll_dispatch_recv")
@overlap.in_order
def ll_dispatch_recv(pending: types.LLDispatchPending, cfg: EPConfig) -> types.LLDispatched:
    """Second phase of ll_dispatch: waits for the tokens routed to this rank's experts and returns
    ``ll_dispatch``'s result (same bits). Forward-only."""
    ep_size(cfg, "ll_dispatch_recv")
    _check_pending(pending, types.LLDispatchPending, "ll_dispatch_recv", cfg)
    return _masked_ll_handle(_ll_dispatch_recv(pending, cfg), pending.masked)


@overlap.in_order
def ll_combine_send(y: jax.Array, handle: types.LLHandle, cfg: EPConfig,
                    rank_mask: jax.Array | None = None) -> types.LLCombinePending:
    """First phase of ll_combine: issues the writes of the expert outputs back to their sources and
    returns at once. ``ll_combine_recv(pending, cfg)`` then equals ``ll_combine(y, handle, cfg,
    rank_mask)``. Same rules as ll_dispatch_send. Forward-only."""
    size = ep_size(cfg, "ll_combine_send")
    check_ll_combine_args(y, handle, cfg, size, op="ll_combine_send")
    rank_mask, y = _checked_mask(rank_mask, size, cfg, "ll_combine_send", y)
    return overlap.primal(_ll_combine_send)(y, handle, handle_mask(rank_mask, handle), cfg)


@_receive_once("ll_combine_recv")
@overlap.in_order
def ll_combine_recv(pending: types.LLCombinePending, cfg: EPConfig) -> jax.Array:
    """Second phase of ll_combine: waits for this rank's rows and returns ``ll_combine``'s [T, H]
    bfloat16 result (same bits). Forward-only."""
    ep_size(cfg, "ll_combine_recv")
    _check_pending(pending, types.LLCombinePending, "ll_combine_recv", cfg)
    return _ll_combine_recv(pending, cfg)


@_forward_only_op("ll_dispatch_send", 4)
def _ll_dispatch_send(x, topk_idx, topk_weights, rank_mask, cfg):
    return _ll_send_impl("ll_dispatch", cfg, x.dtype)(x, topk_idx, topk_weights, cfg, rank_mask=rank_mask)


@_forward_only_op("ll_dispatch_recv", 1)
def _ll_dispatch_recv(pending, cfg):
    return _ll_recv_impl("ll_dispatch", pending)(pending, cfg)


@_forward_only_op("ll_combine_send", 3)
def _ll_combine_send(y, handle, rank_mask, cfg):
    return _ll_send_impl("ll_combine", cfg, y.dtype)(y, handle, cfg, rank_mask=rank_mask)


@_forward_only_op("ll_combine_recv", 1)
def _ll_combine_recv(pending, cfg):
    return _ll_recv_impl("ll_combine", pending)(pending, cfg)
