"""SwiGLU of an expert buffer, over the rows that hold rows: ``silu(gate) * up``.

The MoE layer's expert block is gate|up GEMM -> SwiGLU -> down GEMM over dispatch's buffer, whose rows
past ``sum(group_sizes)`` hold nothing (the layer's default capacity is the worst case: about half the
buffer at EP2, three quarters at EP4 at the DeepSeek-V3 shape). The GEMMs skip those rows; XLA's
elementwise SwiGLU and its backward (three fusions) cannot know them and pass over every row.
``backend="pallas"`` runs one Triton kernel forward and one backward over the row blocks that start
below ``live_rows`` and leaves the rows past them unwritten (unspecified, as dispatch's rows there are);
``"xla"`` is ``jax.nn.silu(gate) * up`` over every row (any platform; what JAX differentiates itself).
``"auto"`` (the default) takes the kernels on a Hopper GPU, where they were measured faster (H200,
2026-11-30, tools/tune_swiglu.py: DeepSeek-V3's per-rank buffer at EP2, forward + backward 0.53 ms against
XLA's 0.59, mid 0.22 against 0.28; the layer's step at EP2 0.8-1.6% faster; the backward since then 25-27%
faster, 0.200 ms at DeepSeek-V3's EP2 buffer, 2026-12-04), when the buffer's shape fits them, XLA otherwise;
``choose`` says which and why.

Arithmetic of the kernels, in float32, rounded once to the buffer's dtype: forward
``h = g * sigmoid(g) * u``; backward ``du = dh * g * sigmoid(g)``, ``dg = dh * u * s * (1 + g * (1 - s))``
with ``s = sigmoid(g)`` (the derivative of ``g * s``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_ep.config import FP8_BLOCK, check_option
from jax_ep.errors import EPValueError
from jax_ep.gemm import hopper_reason
from jax_ep.gemm_fp8 import QUANTIZE_ROWS, quantize_row_block, quantize_rows_fits
from jax_ep.vma import shape_like, vary_jointly

BACKENDS = ("auto", "xla", "pallas")


@dataclasses.dataclass(frozen=True)
class Tiling:
    """The Pallas kernels' blocks: ``rows`` x ``cols`` (at most; the largest power-of-2 divisor of F up
    to it), ``warps`` per program (tools/tune_swiglu.py times them)."""

    rows: int = 32
    cols: int = 128
    warps: int = 4


# tools/tune_swiglu.py (H200, 2026-11-30) had 32x128 with 4 warps within 1% of the best of 24 tilings at
# DeepSeek-V3's and the mid shape's per-rank buffers, its backward 25% faster than 64x256's; GPU tests
# 14 passed with both (2026-11-30); layer at EP2 vs XLA's SwiGLU: DeepSeek-V3 19.92 / 19.85 ms, mid
# 5.23 / 5.35 (docs/benchmarks.md, session 28)
TILING = Tiling()
# swiglu_rows_fp8's blocks are the FP8 quantiser's (QUANTIZE_ROWS x FP8_BLOCK); 8 warps per block measured
# 4-5% faster than 4 on an H200 (DeepSeek-V3's EP2 buffer 129.7 vs 136.0 us, mid's 68.0 vs 71.3; 1 warp
# 155.8, 2 130.0; same bits; docs/benchmarks.md session 59)
ROWS_FP8_WARPS = 8


def swiglu(gate_up: jax.Array, live_rows: jax.Array, *, backend: str = "auto", interpret: bool = False,
           tiling: Tiling = TILING, row_scale: jax.Array | None = None) -> jax.Array:
    """[M, 2F] gate|up (gate columns first) -> [M, F] ``silu(gate) * up``.

    live_rows: int32 scalar, the rows that hold rows (``sum(group_sizes)``); the kernels leave the rows
    from the first row block (``tiling.rows``) at or past it unwritten in the result and in the gradient
    (``"xla"`` computes every row); ``backend="auto"``: see ``choose``. ``interpret``: run the Pallas
    kernels in interpret mode (CPU tests). ``row_scale``: None, or float32 [M], each row's result
    multiplied by it before the one rounding (the MoE layer's gate weights applied in the experts:
    ``EPOptions.gate_weights`` "auto" on the flat exchange, or "experts"), differentiable too: its
    gradient is the row's float32 dot product of ``silu(gate) * up`` and the result's cotangent (the
    kernels: per column block, summed).
    Differentiable in gate_up. ``tiling``: the kernels' blocks (``TILING``, tuned on an H200)."""
    check_option("swiglu:", "backend", backend, BACKENDS)
    if np.ndim(gate_up) != 2 or np.shape(gate_up)[1] % 2:
        raise EPValueError(f"swiglu: gate_up must be [M, 2F], an even width (gate and up side by side), got "
                           f"{np.shape(gate_up)}")
    m = gate_up.shape[0]
    _check_live_rows("swiglu", live_rows)
    _check_row_scale("swiglu", row_scale, m)
    backend = resolve(gate_up.shape, backend, tiling)
    if backend == "xla":
        gate, up = jnp.split(gate_up, 2, axis=1)
        if row_scale is None:
            return jax.nn.silu(gate) * up
        f32 = lambda a: a.astype(jnp.float32)  # noqa: E731  (the kernels' arithmetic)
        return (jax.nn.silu(f32(gate)) * f32(up) * row_scale[:, None]).astype(gate_up.dtype)
    _check_gpu("swiglu: backend='pallas'", interpret, " (use backend='xla')")
    reason = kernel_unfit(gate_up.shape, tiling)
    if reason:
        raise EPValueError(f"swiglu: backend='pallas' cannot take gate_up {gate_up.shape}: {reason}")
    live = jnp.clip(jnp.asarray(live_rows, jnp.int32).reshape(1), 0, m)
    if row_scale is None:
        return _swiglu(*vary_jointly(gate_up, live), None, interpret, tiling)
    gate_up, live, row_scale = vary_jointly(gate_up, live, row_scale)
    return _swiglu(gate_up, live, row_scale, interpret, tiling)


def _check_live_rows(what: str, live_rows) -> None:
    """Checked on every backend, though "xla" ignores it: a call that runs off Hopper runs on it too."""
    shape, dtype = np.shape(live_rows), getattr(live_rows, "dtype", type(live_rows))
    if shape not in ((), (1,)) or not jnp.issubdtype(dtype, jnp.integer):
        raise EPValueError(f"{what}: live_rows must be an integer scalar (the rows that hold rows, "
                           f"sum(group_sizes)), got {getattr(dtype, '__name__', dtype)} of shape {shape}")


def _check_row_scale(what: str, row_scale, m: int) -> None:
    if row_scale is None:
        return
    array = hasattr(row_scale, "shape") and hasattr(row_scale, "dtype")
    if not array or row_scale.shape != (m,) or row_scale.dtype != jnp.float32:
        got = f"{row_scale.dtype} {row_scale.shape}" if array else type(row_scale).__name__
        raise EPValueError(f"{what}: row_scale must be float32 [{m}] (one per row of gate_up), got "
                           f"{got}")


def _check_gpu(what: str, interpret: bool, hint: str = "") -> None:
    if not interpret and jax.default_backend() != "gpu":
        raise EPValueError(f"{what} runs Triton kernels on a GPU; the default platform is "
                           f"{jax.default_backend()!r}{hint}")


def resolve(shape, backend: str, tiling: Tiling = TILING) -> str:
    """The backend ``swiglu(gate_up, ..., backend=backend)`` runs for a gate|up buffer of this shape."""
    return choose(shape, tiling)[0] if backend == "auto" else backend


def swiglu_rows_fp8(gate_up: jax.Array, live_rows: jax.Array, *, row_scale: jax.Array | None = None,
                    interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """What ``jax_ep.gemm_fp8.quantize_gemm_rows(h, live_rows, backend="pallas")`` makes of ``h =
    swiglu(gate_up, live_rows, backend="pallas", row_scale=row_scale)``, in one kernel that never writes
    h: (e4m3 [M, F], float32 scales [M, F/128]), the same bits over the row blocks that start below
    ``live_rows``, the rest unwritten. What the MoE layer's FP8 down GEMM multiplies
    (``fp8_grouped_matmul``'s ``x_fp8``): h's bf16 write and the quantiser's read of it saved. The outputs
    carry no gradient (the operands pass through ``stop_gradient``, so JAX never differentiates the
    kernel): the FP8 GEMM takes such rows as constants, and its input gradient reaches gate_up through
    ``swiglu``, whose forward nothing then reads. Needs F % 128 == 0 and M % 32 == 0 (the quantiser's
    shapes, ``quantize_rows_fits``), a GPU or ``interpret``."""
    from jax.experimental import pallas as pl

    if gate_up.ndim != 2 or gate_up.shape[1] % 2 or not quantize_rows_fits(
            (gate_up.shape[0], gate_up.shape[1] // 2)):
        raise EPValueError(f"swiglu_rows_fp8: gate_up must be [M, 2F] with F % {FP8_BLOCK} == 0, M % "
                           f"{QUANTIZE_ROWS} == 0 and the e4m3 rows addressable by Pallas, got "
                           f"{gate_up.shape}")
    m, f = gate_up.shape[0], gate_up.shape[1] // 2
    _check_live_rows("swiglu_rows_fp8", live_rows)
    _check_row_scale("swiglu_rows_fp8", row_scale, m)
    _check_gpu("swiglu_rows_fp8", interpret)
    tiling = Tiling(QUANTIZE_ROWS, FP8_BLOCK, ROWS_FP8_WARPS)  # the quantiser's: a scale per row per block
    nb = f // _cols(f, tiling)
    live = jnp.clip(jnp.asarray(live_rows, jnp.int32).reshape(1), 0, m)
    gate_up, live, *scales = vary_jointly(*(lax.stop_gradient(a) for a in (
        gate_up, live, *([] if row_scale is None else [row_scale]))))

    def write(h, q_ref, s_ref):
        # swiglu's h rounded to the buffer's dtype, then the quantiser's arithmetic on those values
        q_ref[...], scale = quantize_row_block(h.astype(gate_up.dtype).astype(jnp.float32), interpret)
        s_ref[...] = scale[None, :]

    q, scales_t = _over_live_blocks(
        write, gate_up, live, *scales, tiling=tiling, interpret=interpret, name="jax_ep_swiglu_fp8",
        out_specs=[None, pl.BlockSpec((1, tiling.rows), lambda i, j: (j, i))],
        out_shape=[shape_like((m, f), jnp.float8_e4m3fn, gate_up), shape_like((nb, m), jnp.float32, gate_up)])
    return q, scales_t.T


def choose(shape, tiling: Tiling = TILING) -> tuple[str, str]:
    """(backend, why) that ``backend="auto"`` takes for a gate|up buffer of this [M, 2F] shape."""
    reason = hopper_reason()
    if reason:
        return "xla", reason + ", where the kernels were measured"
    reason = kernel_unfit(shape, tiling)
    if reason:
        return "xla", f"the kernels cannot take gate_up {tuple(shape)}: {reason}"
    return "pallas", "a Hopper GPU: the kernels over the live rows measured faster than XLA's SwiGLU"


def kernel_unfit(shape, tiling: Tiling = TILING) -> str:
    """'' when the Pallas kernels take a gate|up buffer of this [M, 2F] shape, else why not."""
    m, width = shape
    f = width // 2
    for name in ("rows", "cols"):   # Triton blocks are powers of 2
        size = getattr(tiling, name)
        if size < 1 or size & (size - 1):
            return f"Tiling.{name}={size} is not a power of 2"
    if m == 0 or f == 0:            # (a grid of no programs)
        return f"gate_up {tuple(shape)} has no elements"
    if m % tiling.rows:
        return f"its rows M={m} are not a multiple of {tiling.rows}"
    if f % 64:
        return f"its half width F={f} is not a multiple of 64"
    return ""


def _triton_params(tiling: Tiling):
    """Triton, not Mosaic GPU (the default Pallas GPU backend): elementwise work over row blocks."""
    from jax.experimental.pallas import triton as pltriton

    return pltriton.CompilerParams(num_warps=tiling.warps, num_stages=1)


def _cols(f: int, tiling: Tiling) -> int:
    cols = tiling.cols
    while f % cols:
        cols //= 2
    return cols


# row_scale: None (no cotangent) or float32 [M]
@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _swiglu(gate_up, live, row_scale, interpret, tiling):
    return _forward(gate_up, live, interpret, tiling, row_scale)


def _swiglu_fwd(gate_up, live, row_scale, interpret, tiling):
    return _forward(gate_up, live, interpret, tiling, row_scale), (gate_up, live, row_scale)


def _swiglu_bwd(interpret, tiling, residuals, dh):
    gate_up, live, row_scale = residuals
    scales = () if row_scale is None else (row_scale,)
    gate_up, live, dh, *scales = vary_jointly(gate_up, live, dh.astype(gate_up.dtype), *scales)
    if row_scale is None:
        return _backward(gate_up, live, dh, interpret, tiling), None, None
    d_gate_up, partial_dots = _backward(gate_up, live, dh, interpret, tiling, *scales)
    # per row, its column blocks' partial dot products (rows past the live blocks: unwritten, as
    # d gate_up's there; nothing reads a gate weight's gradient there)
    return d_gate_up, None, jnp.sum(partial_dots, axis=0)


_swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


def _specs(f: int, tiling: Tiling):
    """The kernels' grid (row blocks x nb) and blocks over gate_up [M, 2F] as it is (gate columns, then
    up): column block j of gate is block j, of up block nb + j (nb = F / cols); ``out``, the forward's
    block j of h [M, F]. The backward writes its two blocks into the whole [M, 2F] output (``_backward``):
    on an H200 that took 25-27% less time than one program per output block, which read gate and dh
    twice (2026-12-04, same bits); a [M, 2, F] view with blocks of both halves had measured 3x slower,
    and two [M, F] outputs concatenated by XLA slower at every tiling (2026-11-30)."""
    from jax.experimental import pallas as pl

    rows, cols = tiling.rows, _cols(f, tiling)
    nb = f // cols
    live = pl.BlockSpec((1,), lambda i, j: (0,))
    gate = pl.BlockSpec((rows, cols), lambda i, j: (i, j))   # also d h's block, of [M, F]
    up = pl.BlockSpec((rows, cols), lambda i, j: (i, nb + j))
    out = pl.BlockSpec((rows, cols), lambda i, j: (i, j))
    return nb, live, gate, up, out


def _silu_times_up(g_ref, u_ref, w_ref=None):
    """The forward's float32 arithmetic on one block: g * sigmoid(g) * u, times the row scale if given
    (shared by the kernels that write h and its FP8 rows, whose bits depend on it being the same)."""
    g = g_ref[...].astype(jnp.float32)
    h = g * jax.nn.sigmoid(g) * u_ref[...].astype(jnp.float32)
    return h if w_ref is None else h * w_ref[...][:, None]


def _forward(gate_up, live, interpret, tiling, row_scale=None):
    def write(h, h_ref):
        h_ref[...] = h.astype(h_ref.dtype)

    f = gate_up.shape[1] // 2
    return _over_live_blocks(write, gate_up, live, *([] if row_scale is None else [row_scale]), tiling=tiling,
                             interpret=interpret, name="jax_ep_swiglu", out_specs=None,
                             out_shape=shape_like((gate_up.shape[0], f), gate_up.dtype, gate_up))


def _over_live_blocks(write, gate_up, live, *row_scale, tiling, interpret, name, out_specs, out_shape):
    """The forward kernels' call: one program per (row block, column block) of h = silu(gate) * up
    [* row_scale] whose row block starts below live[0] runs write(h float32, *output refs); out_specs'
    None entries (or None for a single output) are h's block."""
    from jax.experimental import pallas as pl

    m, f = gate_up.shape[0], gate_up.shape[1] // 2
    nb, live_spec, gate, up, out = _specs(f, tiling)
    rows = tiling.rows

    def kernel(live_ref, g_ref, u_ref, *refs):
        w_ref, outs = (refs[0], refs[1:]) if row_scale else (None, refs)

        @pl.when(pl.program_id(0) * rows < live_ref[0])
        def _():
            write(_silu_times_up(g_ref, u_ref, w_ref), *outs)

    in_specs = [live_spec, gate, up] + ([pl.BlockSpec((rows,), lambda i, j: (i,))] if row_scale else [])
    out_specs = out if out_specs is None else [out if o is None else o for o in out_specs]
    return pl.pallas_call(kernel, grid=(m // rows, nb), in_specs=in_specs, out_specs=out_specs,
                          out_shape=out_shape, interpret=interpret, compiler_params=_triton_params(tiling),
                          name=name)(live, gate_up, gate_up, *row_scale)


def _backward(gate_up, live, dh, interpret, tiling, row_scale=None):
    """d gate_up [M, 2F]; with row_scale also the partial dot products [nb, M] float32 of the rows'
    ``silu(gate) * up`` and dh, one per column block.

    Program (i, j) reads row block i's column block j of gate, up and dh once and writes both blocks it
    determines, d gate's (column block j) and d up's (nb + j), into the whole [M, 2F] output: 3 blocks
    read and 2 written, where one program per output block read 5 (gate and dh twice)."""
    from jax.experimental import pallas as pl

    m, f = gate_up.shape[0], gate_up.shape[1] // 2
    nb, live_spec, gate, up, _ = _specs(f, tiling)
    rows, cols = tiling.rows, _cols(f, tiling)
    scaled = row_scale is not None
    f32 = lambda ref: ref[...].astype(jnp.float32)  # noqa: E731

    def kernel(live_ref, g_ref, u_ref, dh_ref, *refs):
        w_ref, dgu_ref, dots_ref = refs if scaled else (None, *refs, None)
        i, j = pl.program_id(0), pl.program_id(1)

        @pl.when(i * rows < live_ref[0])
        def _():
            g, u, dh = f32(g_ref), f32(u_ref), f32(dh_ref)
            s = jax.nn.sigmoid(g)
            ds = dh * w_ref[...][:, None] if scaled else dh   # the cotangent of silu(g) * u
            block = pl.ds(i * rows, rows)
            d_gate = ds * u * (s * (1.0 + g * (1.0 - s)))
            dgu_ref[block, pl.ds(j * cols, cols)] = d_gate.astype(dgu_ref.dtype)
            dgu_ref[block, pl.ds(f + j * cols, cols)] = (ds * (g * s)).astype(dgu_ref.dtype)
            if scaled:
                dots_ref[...] = jnp.sum(g * s * u * dh, axis=1)

    in_specs = [live_spec, gate, up, gate]
    out_specs, out_shape = pl.no_block_spec, shape_like((m, 2 * f), gate_up.dtype, gate_up)
    if scaled:
        blocks = m // rows   # program (i, j) writes block j of row block i's dots
        in_specs.append(pl.BlockSpec((rows,), lambda i, j: (i,)))
        out_specs = [out_specs, pl.BlockSpec((rows,), lambda i, j: (j * blocks + i,))]
        out_shape = [out_shape, shape_like((nb * m,), jnp.float32, gate_up)]
    result = pl.pallas_call(kernel, grid=(m // rows, nb), in_specs=in_specs, out_specs=out_specs,
                            out_shape=out_shape, interpret=interpret, compiler_params=_triton_params(tiling),
                            name="jax_ep_swiglu_bwd"
                            )(live, gate_up, gate_up, dh, *([row_scale] if scaled else []))
    if not scaled:
        return result
    d_gate_up, dots = result
    return d_gate_up, dots.reshape(nb, m)
