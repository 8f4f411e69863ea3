"""FP8 numerics shared by the EP ops and the expert GEMM: e4m3 with one float32 scale per token and 128
channels (DeepSeek-V3's activation layout), the scales from one IEEE division (the same bits on the CPU
and in the CUDA kernels; XLA on a GPU divides approximately, so the reference run there differs from the
kernels by an ulp in some scales and one e4m3 step in ~0.1% of the values: tests/gpu/test_gemm_gpu.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jax_ep.config import FP8_BLOCK, FP8_MAX
from jax_ep.errors import EPUnsupportedError, EPValueError

# amax floors: both keep the scale finite for all-zero blocks.
FP8_MIN_AMAX = 1e-4        # the dispatch wire's (DeepEP's clamp; the CUDA kernels' 1e-4f): activations
# The FP8 GEMMs' operands, gradients among them: a gradient's scale is the loss's (any size), and a
# 1e-4 floor above a block's amax leaves its values in e4m3's subnormals (2026-11-29: the FP8 weight
# gradient 26% from bf16 at a mean-square loss's ~1e-7 gradients, 7.7% with this floor, as at a 1000x
# larger loss). 448 / 1e-30 stays finite in float32.
FP8_GEMM_MIN_AMAX = 1e-30


def quantize_fp8(x: jax.Array, min_amax: float = FP8_MIN_AMAX) -> tuple[jax.Array, jax.Array]:
    """Per-token, per-128-channel e4m3 quantisation: scale = amax / 448, q = x * (448 / amax), amax
    floored at ``min_amax`` (the wire's FP8_MIN_AMAX; the GEMMs pass FP8_GEMM_MIN_AMAX). x as stored
    (``as_stored``) and NaN left out of amax (``abs_for_amax``), as the kernels read it."""
    if getattr(x, "ndim", None) != 2:
        raise EPValueError(f"quantize_fp8: x must be rows [T, H], got shape {tuple(getattr(x, 'shape', ()))}")
    t, h = x.shape
    blocks = -(-h // FP8_BLOCK)
    xf = as_stored(x).astype(jnp.float32)
    padded = jnp.pad(xf, ((0, 0), (0, blocks * FP8_BLOCK - h))).reshape(t, blocks, FP8_BLOCK)
    inv_scale, scales = fp8_scales(jnp.max(abs_for_amax(padded), axis=2), min_amax)
    q = (padded * inv_scale[:, :, None]).reshape(t, blocks * FP8_BLOCK)[:, :h]
    return to_e4m3(q), scales


def as_stored(y: jax.Array) -> jax.Array:
    """y exactly as its dtype stores it. XLA's excess precision (xla_allow_excess_precision, on by
    default) may otherwise read the float32 value that a bf16 y was rounded from when y is widened
    again; the documented combine and its gradients use the rounded y, as the kernels do, and a
    reference quantiser must see the values a kernel reads from memory."""
    return lax.optimization_barrier(y)


def abs_for_amax(x: jax.Array) -> jax.Array:
    """|x| with NaN as 0, the operand of an amax: the CUDA wire (fmaxf) and the Triton quantisers
    (maxnumf) leave NaN out of a block's amax, so only the NaN channel is NaN. XLA's max propagated it
    (the whole block NaN) or, on the CPU, lost it to -inf in some positions (the amax floor then; the
    block's finite values overflowed to NaN)."""
    return jnp.where(jnp.isnan(x), 0.0, jnp.abs(x))


def to_e4m3(x: jax.Array) -> jax.Array:
    """x (float32, already scaled) rounded to e4m3, kept e4m3 in every compiled program: XLA's GPU
    compiler removes convert chains f32 -> e4m3 -> f32 under xla_allow_excess_precision (on by default;
    its SimplifyFPConversions pass), which would make a quantisation a no-op wherever its values are
    converted back in the same program (the reference FP8 GEMM, the bf16 weight gradient from the
    forward's rows), so GPU results would not be the reference numerics. The barrier keeps the chain
    apart."""
    return lax.optimization_barrier(x.astype(jnp.float8_e4m3fn))


def fp8_scales(amax: jax.Array, min_amax: float = FP8_MIN_AMAX) -> tuple[jax.Array, jax.Array]:
    """Per block's absolute maximum: (the factor into e4m3, 448 / amax; the scale back, amax / 448),
    amax floored at ``min_amax`` so all-zero blocks keep a finite scale."""
    amax = jnp.maximum(amax, min_amax)
    # A true IEEE division: XLA rewrites division by a constant into a multiplication by its
    # (inexact) reciprocal, which would make the scales differ by an ulp between platforms. The
    # divisor is 448 computed from amax (amax < 0 never holds, NaN included), not a constant: under
    # jax.vmap a constant stays unbatched and gets broadcast, and XLA rewrites A / broadcast(B) into
    # A * broadcast(1 / B) even behind the barrier (tests/test_reference_vmap.py).
    fp8_max = lax.optimization_barrier(jnp.where(amax < 0, amax, FP8_MAX))
    return FP8_MAX / amax, amax / fp8_max


def dequantize_fp8(q: jax.Array, scales: jax.Array, dtype=jnp.float32) -> jax.Array:
    """Inverse of quantize_fp8 (up to e4m3 rounding): rows q [..., H] float8_e4m3fn with their float32
    scales [..., ceil(H/128)] (the same leading dims: a dispatch's [C, H], a low-latency dispatch's
    [E_local, slots, H]) -> [..., H] in ``dtype``. Differentiable in the scales, not in q: an e4m3
    cotangent would be rounded to 3 mantissa bits and overflow to NaN above 448, so a gradient that
    reaches q raises (training takes the FP8 wire through ``jax_ep.ops.dispatch_straight_through``
    and the FP8 GEMMs' own gradients)."""
    if getattr(q, "dtype", None) != jnp.float8_e4m3fn or getattr(q, "ndim", 0) < 1:
        raise EPValueError(f"dequantize_fp8: q must be float8_e4m3fn rows [..., H], got "
                           f"{getattr(q, 'dtype', type(q).__name__)}{tuple(getattr(q, 'shape', ()))}")
    h = q.shape[-1]
    want = (*q.shape[:-1], -(-h // FP8_BLOCK))
    if tuple(getattr(scales, "shape", ())) != want or scales.dtype != jnp.float32:
        raise EPValueError(f"dequantize_fp8: scales must be float32 {list(want)} (one per row and "
                           f"{FP8_BLOCK} channels of q {list(q.shape)}), got "
                           f"{getattr(scales, 'dtype', type(scales).__name__)}"
                           f"{list(getattr(scales, 'shape', ()))}")
    return dequantize_rows(_constant_rows(q), scales, dtype)


def dequantize_rows(q: jax.Array, scales: jax.Array, dtype=jnp.float32) -> jax.Array:
    """dequantize_fp8 unchecked and without its guard, for jax_ep's own callers: the FP8 dispatches'
    rows (their own rules name the FP8 wire's error) and the FP8 GEMMs (inside their custom_vjps)."""
    per_channel = jnp.repeat(scales, FP8_BLOCK, axis=-1)[..., :q.shape[-1]]
    return (q.astype(jnp.float32) * per_channel).astype(dtype)


@jax.custom_vjp
def _constant_rows(q: jax.Array) -> jax.Array:
    """q itself; a gradient that reaches it, an error. A custom_vjp whose backward raises: it runs only
    where a cotangent reaches q (a metric of the rows under value_and_grad(has_aux=True) or behind a
    stop_gradient is fine). Not a custom_jvp (its rule ran wherever q had a tangent, used or not), nor
    symbolic zeros (JAX cannot differentiate those in an eager shard_map)."""
    return q


def _constant_rows_fwd(q):
    return q, None


def _constant_rows_bwd(residuals, ct):
    # a rounded cotangent, NaN above 448 (found by a review, 2026-12-05)
    raise EPUnsupportedError(
        "jax_ep.dequantize_fp8 is not differentiable in q (float8_e4m3fn: its cotangent would be rounded "
        "to 3 mantissa bits and overflow to NaN above 448). The FP8 wire of dispatch is forward-only: to "
        "train with it use jax_ep.ops.dispatch_straight_through; a straight-through estimate of "
        "quantize_fp8 is x + lax.stop_gradient(dequantize_fp8(*quantize_fp8(lax.stop_gradient(x))) - x); "
        "or take q as a constant (lax.stop_gradient(q))")


_constant_rows.defvjp(_constant_rows_fwd, _constant_rows_bwd)
