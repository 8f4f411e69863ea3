"""FP8 grouped GEMM in DeepSeek-V3's block layout: ``grouped_matmul_fp8(xq, x_scales, wq, w_scales, ...)``.

Activations are e4m3 rows with one float32 scale per row and 128 channels (what FP8 dispatch delivers:
``jax_ep.fp8.quantize_fp8``), weights e4m3 with one scale per 128 x 128 block
(``quantize_weight_blocks``). The product of group g's rows is, in exact arithmetic,

    out[r, n] = sum_kb  x_scales[r, kb] * w_scales[g, kb, n // 128] * sum_{k in kb} xq[r, k] * wq[g, k, n]

i.e. ``dequantize(x) @ dequantize(w)``; the kernel sums each 128-channel block in float32 on the tensor
cores and applies the two scales as it adds the block to its running sum. Square weight blocks make the
transposed weights' scales the transposed scales, so the input gradient (dy @ w[g].T) runs in the same
kernel from dy's FP8 rows (DeepSeek-V3 keeps both weight layouts quantised).

``fp8_grouped_matmul(x, w, group_sizes)`` is the trainable form the MoE layer uses with
``gemm_dtype="float8_e4m3fn"``: it quantises x per row and 128 channels and w per 128 x 128 block, runs
the forward in FP8, and its backward computes dx in FP8 (dy quantised the same way, w's blocks
transposed) and dw in bfloat16 from the FP8 rows the forward used (``jax_ep.gemm.weight_gradient``);
quantisation is passed through (straight-through), as in DeepSeek-V3's training.

Status (one H200, 2026-11-29; docs/benchmarks.md, session 18): the Hopper kernels
(``jax_ep.gemm_mgpu.ragged_dot_fp8``, ``backend="mosaic_gpu"``) agree with the reference (dequantise, then a
float32 ``lax.ragged_dot``) to ~1e-3 and run 1.3-1.6x the bf16 passes; the trainable form is nevertheless
slower than bf16 per step at 32-128 local experts, because every step quantises the weights in both
layouts (``quantize_weight_blocks_both``). ``quantize_weights(w)`` does that once (``FP8Weights``), for
``fp8_grouped_matmul(..., quantized=...)`` to reuse over the micro-batches of one optimiser step, as
TransformerEngine's FP8 weight caching does. Not yet: the weight gradient in FP8.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jax_ep.config import FP8_BLOCK, FP8_MAX, check_fp8_channels, check_option
from jax_ep.errors import EPTypeError, EPValueError
from jax_ep.fp8 import (
    FP8_GEMM_MIN_AMAX,
    abs_for_amax,
    as_stored,
    dequantize_rows,
    fp8_scales,
    quantize_fp8,
    to_e4m3,
)
from jax_ep.gemm import (
    GROUP_MAJOR,
    _kernel_platform,
    check_backend,
    check_group_sizes,
    rows_reason,
    tuned_entry,
    weight_gradient,
)
from jax_ep.validation import float0_like
from jax_ep.vma import shape_like, vary_as, vary_jointly

BACKENDS = ("reference", "mosaic_gpu")
# The Hopper kernel's form (warp_specialized, block_m, stages[, grid_minor[, ring[, scales_smem[,
# lagged]]]]): per shape the form tools/tune_gemm.py --fp8 measured fastest (gemm_configs.json passes
# forward_fp8 / dx_fp8 / dw_fp8, read through gemm.tuned_entry), else KERNEL / CLASSIC_KERNEL below.
# Measured on one H200 (2026-11-29, tools/tune_gemm.py --fp8, DeepSeek-V3 and mid per-rank shapes): the
# warp-specialised 64 x 256 form is 1.3-1.7x the one-consumer 64 x 128 form; 128 x 256 runs at a third of it
# (two float32 tiles per consumer thread: the accumulator and the running sum). Its 256-wide tile needs N %
# 256 == 0; other N (e.g. dx of a 1408-wide projection) take the one-consumer form (fp8_kernel_form).
# grid_minor is the tile order: 0 strips of 4 row tiles, GROUP_MAJOR group by group, the default since it
# measured 5-9% faster at DeepSeek-V3's gate|up forward and dx and down dx, the same at down forward
# (2026-11-29, docs/benchmarks/h200_gemm_s20.json). DeepGEMM's overlap (a step's block sum promoted while
# the next WGMMA runs; one more f32 tile per thread) measured 1.12-1.16x slower than the 64 x 256 form (one
# K step per loop iteration; two per iteration, the lagged element, is faster), and so did two consumers
# stacked along M (128 x 256 and 128 x 128 CTA tiles, 20-40% fewer bytes per FLOP from L2: 2.77 / 2.95 ms vs
# 2.57 forward at gate|up), so L2 -> SM bytes are not what bounds it. Neither did the consumers issuing
# their K steps in turns (2-3% slower) nor a 5th K stage made room for by output tiles in column halves (not
# faster) help (2026-12-01, docs/benchmarks/h200_gemm_s34.json).
KERNEL = (True, 64, 4, GROUP_MAJOR)
CLASSIC_KERNEL = (False, 64, 4, 0)   # group-major not yet measured (nor GPU-tested) in this form
# what tune_gemm.py --fp8 times; the last four: one ring of K-step buffers across tiles
# (BlockConfig.ring), the same with each K step's weight scales copied into the ring (scales_smem), and
# both with each block sum promoted under the next step's WGMMAs (lagged: gemm_mgpu.ragged_dot_fp8;
# 1.1-3.7% faster on the DeepSeek-V3 passes, means of three runs, tools/fp8_bounds.py, H200, 2026-12-01)
KERNELS = (CLASSIC_KERNEL, KERNEL, (True, 64, 4, 0), (True, 128, 3), (True, 64, 4, GROUP_MAJOR, 1),
           (True, 64, 4, GROUP_MAJOR, 1, 1), (True, 64, 4, GROUP_MAJOR, 1, 0, 1),
           (True, 64, 4, GROUP_MAJOR, 1, 1, 1))


def fp8_kernel_form(n: int, kernel: tuple | None = None) -> tuple[bool, int, int, int, bool, bool, bool]:
    """The Hopper FP8 kernel's form (warp_specialized, block_m, stages, grid_minor, ring, scales_smem,
    lagged) for N output columns: `kernel` when given (checked; a 3-tuple takes the strips of grid_minor 0,
    a 4-tuple no ring, a 5-tuple the weight scales read from global memory, a 6-tuple each block sum
    promoted after its own wait), else KERNEL where its 256-wide tile divides N, else CLASSIC_KERNEL
    (128-wide tiles)."""
    if kernel is None:
        kernel = KERNEL if n % (2 * FP8_BLOCK) == 0 else CLASSIC_KERNEL
    warp_specialized, block_m, stages, grid_minor, ring, scales_smem, lagged = (*kernel, 0, 0, 0, 0)[:7]
    width = 2 * FP8_BLOCK if warp_specialized else FP8_BLOCK
    if (n % width or block_m not in (64, 128) or grid_minor not in (0, GROUP_MAJOR) or len(kernel) > 7
            or ring not in (0, 1) or (ring and not warp_specialized) or scales_smem not in (0, 1)
            or lagged not in (0, 1) or ((scales_smem or lagged) and not ring)):
        raise EPValueError(f"grouped_matmul_fp8: kernel {kernel} needs N % {width} == 0, block_m 64 or 128, "
                           f"grid_minor 0 or {GROUP_MAJOR}, ring 0 or 1 (1 only warp-specialised), "
                           f"scales_smem and lagged 0 or 1 (1 only with the ring), got N={n}")
    return warp_specialized, block_m, stages, grid_minor, bool(ring), bool(scales_smem), bool(lagged)


# rows per program of quantize_gemm_rows' kernel (the capacity buffers' rows are multiples of 64)
QUANTIZE_ROWS = 32


def quantize_gemm_rows(x: jax.Array, live_rows: jax.Array | None = None, *, backend: str = "reference",
                       interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """Rows [M, K] as the FP8 GEMMs read them (the forward's x, the backward's dy): quantize_fp8's 1 x 128
    layout with the GEMMs' amax floor (FP8_GEMM_MIN_AMAX: a gradient is as small as the loss makes it).

    backend "pallas" (a GPU, or ``interpret``; K a multiple of 128, M of QUANTIZE_ROWS): one Triton kernel
    over blocks of QUANTIZE_ROWS rows x 128 channels that quantises only the blocks starting below
    ``live_rows`` (int32 scalar: ``sum(group_sizes)``) and leaves the rows from the first block at or past
    it unwritten, as the FP8 GEMMs never read rows past the groups. At the MoE layer's default capacity
    those are half the rows at EP2 and three quarters at EP4, which XLA's quantisation reads and writes
    whole. The rows it writes are the reference's bits (``tests/test_gemm_fp8.py``)."""
    if backend == "reference":
        return quantize_fp8(x, FP8_GEMM_MIN_AMAX)
    if backend != "pallas" or live_rows is None:
        raise EPValueError(f"quantize_gemm_rows: backend must be 'reference', or 'pallas' with live_rows, "
                           f"got backend={backend!r}, live_rows={live_rows!r}")
    if not quantize_rows_fits(x.shape):
        raise EPValueError(f"quantize_gemm_rows: backend='pallas' needs K % {FP8_BLOCK} == 0 and "
                           f"M % {QUANTIZE_ROWS} == 0, got x {x.shape}")

    def block(rows_ref, q_ref, scale_ref):
        q_ref[...], scale = quantize_row_block(rows_ref[...].astype(jnp.float32), interpret)
        scale_ref[...] = scale[None, :]

    q, scales_t = _live_row_blocks(block, "jax_ep_quantize_rows", live_rows, [x], [False],
                                   [(jnp.float8_e4m3fn, False), (jnp.float32, True)], interpret)
    return q, scales_t.T


def quantize_row_block(rows: jax.Array, interpret: bool) -> tuple[jax.Array, jax.Array]:
    """quantize_gemm_rows' arithmetic on one Triton block: float32 rows [r, 128] -> (e4m3 [r, 128], their
    float32 scales [r]); ``interpret``: the CPU's (Pallas interpret mode)."""
    amax = jnp.maximum(jnp.max(jnp.abs(rows), axis=1), FP8_GEMM_MIN_AMAX)        # per row
    inv_scale, scale = _ieee_fp8_factors(amax, interpret)
    return (rows * inv_scale[:, None]).astype(jnp.float8_e4m3fn), scale


def _ieee_fp8_factors(amax: jax.Array, interpret: bool) -> tuple[jax.Array, jax.Array]:
    """fp8_scales' (448 / amax, amax / 448) inside a Pallas Triton kernel, both IEEE-rounded divisions as
    the CUDA FP8 wire's (``__fdiv_rn``) and every CPU reference's: Triton lowers a float32 division to
    PTX's div.full.f32 (within 2 ulp), which moved 0.08% of the e4m3 values one step on 2x H200
    (2026-11-30: products that IEEE division puts exactly on a tie between two e4m3 values), so the FP8
    wire's rows were not the rows this quantiser makes from the bf16 wire. XLA's own GPU quantisation
    (``quantize_fp8`` on a GPU) gave div.full's bits too, and stays the platform's
    (tests/gpu/test_gemm_gpu.py: test_fp8_quantisers_round_as_ieee)."""
    if interpret:   # the CPU's XLA: fp8_scales' IEEE divisions
        return fp8_scales(amax, FP8_GEMM_MIN_AMAX)
    from jax.experimental.pallas import triton as pltriton

    fp8_max = jnp.full(amax.shape, FP8_MAX, jnp.float32)

    def div_rn(a, b):
        return pltriton.elementwise_inline_asm(
            "div.rn.f32 $0, $1, $2;", args=[a, b], constraints="=f,f,f", pack=1,
            result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)])[0]
    return div_rn(fp8_max, amax), div_rn(amax, fp8_max)


def dequantize_gemm_rows(xq: jax.Array, x_scales: jax.Array, live_rows: jax.Array, *, dtype=jnp.bfloat16,
                         backend: str = "reference", interpret: bool = False) -> jax.Array:
    """quantize_gemm_rows' rows back in ``dtype`` (``jax_ep.fp8.dequantize_fp8``'s values) for the rows
    below ``live_rows``: what the bf16 weight gradient of an FP8 GEMM reads (it never reads rows past the
    groups into a sum, ``jax_ep.gemm.weight_gradient``). "reference": XLA, every row; "pallas" (as
    quantize_gemm_rows': a GPU or ``interpret``, the same shapes): one Triton kernel over the blocks
    starting below live_rows, the rest left unwritten."""
    m, k = xq.shape
    if backend == "reference":
        return dequantize_rows(xq, x_scales, dtype)
    if backend != "pallas" or not quantize_rows_fits(xq.shape):
        raise EPValueError(f"dequantize_gemm_rows: backend must be 'reference' or 'pallas' (rows [M, K] with "
                           f"K % {FP8_BLOCK} == 0 and M % {QUANTIZE_ROWS} == 0), got backend={backend!r}, "
                           f"rows {xq.shape}")

    def block(q_ref, s_ref, out_ref):
        out_ref[...] = (q_ref[...].astype(jnp.float32) * s_ref[0, :][:, None]).astype(out_ref.dtype)

    scales_t = x_scales.astype(jnp.float32).T
    [rows] = _live_row_blocks(block, "jax_ep_dequantize_rows", live_rows, [xq, scales_t], [False, True],
                              [(dtype, False)], interpret)
    return rows


def _live_row_blocks(block, name, live_rows, operands, per_row, outputs, interpret):
    """One Triton kernel over the [QUANTIZE_ROWS, 128] blocks of [M, K] rows that start below
    ``live_rows``; the others are left unwritten. ``block(*in_refs, *out_refs)`` computes one block.
    Operands and outputs are [M, K] (blocks of the rows) or, where ``per_row`` / an output's flag says so,
    [K/128, M] (one value per row and 128 channels, stored channel-block-major: a contiguous block per
    program). ``outputs``: (dtype, per_row) each."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltriton

    m, k = operands[0].shape
    r, b = QUANTIZE_ROWS, FP8_BLOCK
    live, *operands = vary_jointly(jnp.clip(jnp.asarray(live_rows, jnp.int32).reshape(1), 0, m), *operands)
    specs = {False: pl.BlockSpec((r, b), lambda i, j: (i, j)),      # a block of the rows
             True: pl.BlockSpec((1, r), lambda i, j: (j, i))}       # their per-row values
    n_in = len(operands)

    def kernel(live_ref, *refs):
        @pl.when(pl.program_id(0) * r < live_ref[0])
        def _():
            block(*refs[:n_in], *refs[n_in:])

    return pl.pallas_call(
        kernel, grid=(m // r, k // b),
        in_specs=[pl.BlockSpec((1,), lambda i, j: (0,)), *(specs[p] for p in per_row)],
        out_specs=[specs[p] for _, p in outputs],
        out_shape=[shape_like((k // b, m) if p else (m, k), dtype, operands[0]) for dtype, p in outputs],
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1), interpret=interpret,
        name=name)(live, *operands)


def quantize_rows_fits(shape) -> bool:
    """Whether quantize_gemm_rows' kernel takes rows of this [M, K] shape (and Pallas addresses them)."""
    m, k = shape
    return m > 0 and k % FP8_BLOCK == 0 and m % QUANTIZE_ROWS == 0 and _pallas_indexes(m * k)


def quantize_weight_blocks(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[G, K, N] weights -> (e4m3 [G, K, N], float32 scales [G, K/128, N/128]): one scale per 128 x 128
    block, scale = amax / 448 (K and N multiples of 128)."""
    g, k, n = w.shape
    check_fp8_channels("quantize_weight_blocks", K=k, N=n)
    blocks = w.astype(jnp.float32).reshape(g, k // FP8_BLOCK, FP8_BLOCK, n // FP8_BLOCK, FP8_BLOCK)
    inv_scale, scales = fp8_scales(jnp.max(abs_for_amax(blocks), axis=(2, 4)), FP8_GEMM_MIN_AMAX)
    q = blocks * inv_scale[:, :, None, :, None]
    return to_e4m3(q.reshape(g, k, n)), scales


def quantize_weight_blocks_both(w: jax.Array, *, backend: str = "reference", interpret: bool = False
                                ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """quantize_weight_blocks in both layouts the FP8 kernels read: (e4m3 [G, K, N], the same values
    [G, N, K], scales [G, K/128, N/128]). FP8 WGMMA takes both operands K-major, so the forward reads the
    weights [G, N, K] and the input gradient [G, K, N]. backend "pallas" (a GPU, or ``interpret``) runs one
    Pallas kernel per 128 x 128 block that reads the bfloat16 weights once and writes both layouts: at 128
    local experts of DeepSeek-V3 the weights are 11 GB per step, and XLA's fusions read them three times
    (the block maxima, the scaled cast, the transpose's copy). "reference": those XLA ops."""
    g, k, n = w.shape
    check_fp8_channels("quantize_weight_blocks_both", K=k, N=n)
    if backend == "reference":
        wq, scales = quantize_weight_blocks(w)
        return wq, jnp.swapaxes(wq, 1, 2), scales
    if backend != "pallas":
        raise EPValueError("quantize_weight_blocks_both: backend must be 'reference' or 'pallas', "
                           f"got {backend!r}")
    if not _pallas_indexes(g * k * n):
        raise EPValueError(f"quantize_weight_blocks_both: backend='pallas' cannot address {g * k * n} "
                           f"one-byte elements (w {w.shape}; see _pallas_indexes); use backend='reference'")
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltriton

    b = FP8_BLOCK

    def kernel(w_ref, q_ref, qt_ref, amax_ref):
        block = w_ref[...].astype(jnp.float32)
        amax = jnp.maximum(jnp.max(jnp.abs(block)), FP8_GEMM_MIN_AMAX)
        q = (block * (FP8_MAX / amax)).astype(jnp.float8_e4m3fn)   # as fp8_scales' factor
        q_ref[...] = q
        qt_ref[...] = q.T
        amax_ref[...] = jnp.full(amax_ref.shape, amax, jnp.float32)

    one = pl.BlockSpec((None, b, b), lambda gi, i, j: (gi, i, j))
    wq, wq_t, amax = pl.pallas_call(
        kernel, grid=(g, k // b, n // b),
        in_specs=[one],
        out_specs=[one, pl.BlockSpec((None, b, b), lambda gi, i, j: (gi, j, i)),
                   pl.BlockSpec((None, 1, 1), lambda gi, i, j: (gi, i, j))],
        out_shape=[shape_like((g, k, n), jnp.float8_e4m3fn, w), shape_like((g, n, k), jnp.float8_e4m3fn, w),
                   shape_like((g, k // b, n // b), jnp.float32, w)],
        compiler_params=pltriton.CompilerParams(num_warps=8, num_stages=1),
        interpret=interpret, name="jax_ep_quantize_weight_blocks")(w)
    scales = fp8_scales(amax, FP8_GEMM_MIN_AMAX)[1]   # the scales back, by fp8_scales' exact division
    return wq, wq_t, scales


def _pallas_indexes(elements: int) -> bool:
    """Whether Pallas' Triton lowering addresses an e4m3 array of this many elements correctly: it takes
    32-bit offsets for arrays up to 2**32 bytes, which overflow past 2**31 elements (one byte each); the
    DeepSeek-V3 gate|up weights at 128 local experts (3.76e9) fault with an illegal address on an H200."""
    return elements < 2**31 or elements > 2**32


def weight_quantisation_backend(w_shape) -> str:
    """quantize_weight_blocks_both's backend on a GPU: the one-pass kernel where Pallas addresses it."""
    g, k, n = w_shape
    return "pallas" if _pallas_indexes(g * k * n) else "reference"


def dequantize_weight_blocks(wq: jax.Array, scales: jax.Array, dtype=jnp.float32) -> jax.Array:
    g, k, n = wq.shape
    per = jnp.repeat(jnp.repeat(scales, FP8_BLOCK, axis=1), FP8_BLOCK, axis=2)
    return (wq.astype(jnp.float32) * per).astype(dtype)


def padded_block_rows(m: int, g: int) -> int:
    """Rows of the token-minor FP8 copies (quantize_rows_t): each of g groups of an m-row buffer padded
    to whole 128-row blocks, at most m + 127 g rows, rounded up to a block."""
    return -(-(m + (FP8_BLOCK - 1) * g) // FP8_BLOCK) * FP8_BLOCK


def row_blocks(group_sizes: jax.Array, m: int) -> tuple[jax.Array, jax.Array]:
    """Where each group's rows go in the padded, token-minor layout of quantize_rows_t.

    Returns (info [4, G] int32: per group its first padded row, that plus its rows, its 128-row blocks and
    its first padded row again: gemm_mgpu's per-group K-loop entry; source [2, P/128] int32: per padded
    block its first source row and live rows, 0 past the groups)."""
    g = group_sizes.shape[0]
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends = jnp.minimum(jnp.cumsum(sizes), m)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    sizes = ends - starts
    blocks = -(-sizes // FP8_BLOCK)
    block_end = jnp.cumsum(blocks)
    first_block = block_end - blocks
    info = jnp.stack([first_block * FP8_BLOCK, first_block * FP8_BLOCK + sizes, blocks,
                      first_block * FP8_BLOCK]).astype(jnp.int32)
    b = jnp.arange(padded_block_rows(m, g) // FP8_BLOCK, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(block_end, b, side="right", method="compare_all"), g - 1)  # no loop
    local = (b - first_block[group]) * FP8_BLOCK
    live = jnp.clip(sizes[group] - local, 0, FP8_BLOCK)
    live = jnp.where(b < block_end[-1], live, 0)
    source = jnp.stack([jnp.where(live > 0, starts[group] + local, 0), live]).astype(jnp.int32)
    return info, source


def rows_t_fits(m: int, c: int, g: int) -> bool:
    """Whether quantize_rows_t's Triton kernel addresses rows [M, C] of G groups and their padded copy."""
    return _pallas_indexes(m * c) and _pallas_indexes(c * padded_block_rows(m, g))


def quantize_rows_t(x: jax.Array, group_sizes: jax.Array, *, x_scales: jax.Array | None = None,
                    backend: str = "reference", interpret: bool = False
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Rows [M, C] (bfloat16/float32, or e4m3 with ``x_scales`` [M, C/128]: dequantised first) as the FP8
    weight gradient reads them: token-minor e4m3 [C, P] with each group's rows padded with zeros to whole
    128-row blocks (P = padded_block_rows(M, G)), one scale per block and channel [P/128, C] (DeepSeek-V3's
    128 x 1 tiles of the backward), and row_blocks' info [4, G]. Blocks past the groups are left
    unwritten by the "pallas" backend (one Triton kernel; GPU, or ``interpret``) and are zeros in the
    "reference" (XLA) one; nothing reads them."""
    m, c = x.shape
    g = group_sizes.shape[0]
    if c % FP8_BLOCK:
        raise EPValueError(f"quantize_rows_t: the channels C={c} must be a multiple of {FP8_BLOCK}")
    if (x.dtype == jnp.float8_e4m3fn) != (x_scales is not None):
        raise EPValueError("quantize_rows_t: x_scales must be given exactly when x is float8_e4m3fn, got x "
                           f"{x.dtype} and x_scales {None if x_scales is None else x_scales.shape}")
    info, source = row_blocks(group_sizes, m)
    p = padded_block_rows(m, g)
    b = FP8_BLOCK
    if backend == "reference":
        rows = source[0][:, None] + jnp.arange(b, dtype=jnp.int32)[None, :]          # [P/128, 128]
        valid = jnp.arange(b)[None, :] < source[1][:, None]
        # the rows as stored, as the Triton quantiser reads them (excess precision could otherwise skip
        # the rounding that made a bf16 dy: half the scales differed on one H200, 2026-11-29)
        x = as_stored(x)
        xf = x.astype(jnp.float32) if x_scales is None else dequantize_rows(x, x_scales)
        if m == 0:   # nothing to gather from (every block is then empty: zeros)
            xf = jnp.zeros((1, c), jnp.float32)
        blocks = jnp.where(valid[:, :, None], xf[jnp.where(valid, rows, 0)], 0.0)    # [P/128, 128, C]
        inv_scale, scales = fp8_scales(jnp.max(abs_for_amax(blocks), axis=1), FP8_GEMM_MIN_AMAX)
        q = to_e4m3(blocks * inv_scale[:, None, :])
        return q.transpose(2, 0, 1).reshape(c, p), scales, info
    if backend != "pallas":
        raise EPValueError(f"quantize_rows_t: backend must be 'reference' or 'pallas', got {backend!r}")
    if not rows_t_fits(m, c, g):
        raise EPValueError(f"quantize_rows_t: backend='pallas' cannot address x {x.shape} / its padded copy "
                           f"[{c}, {p}] (see _pallas_indexes); use backend='reference'")
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltriton

    def kernel(source_ref, x_ref, *refs):
        s_ref, (qt_ref, amax_ref) = (refs[0], refs[1:]) if x_scales is not None else (None, refs)
        blk, ch = pl.program_id(0), pl.program_id(1)
        first, live = source_ref[0, blk], source_ref[1, blk]

        @pl.when(live > 0)
        def _():
            valid = jnp.arange(b) < live
            # rows past the block's live ones are masked off (undefined values, replaced by zeros)
            rows = pltriton.load(x_ref.at[pl.ds(first, b), pl.ds(ch * b, b)], mask=valid[:, None])
            rows = rows.astype(jnp.float32)
            if s_ref is not None:                      # one scale per row for these 128 channels
                rows = rows * pltriton.load(s_ref.at[pl.ds(first, b), pl.ds(ch, 1)], mask=valid[:, None])
            rows = jnp.where(valid[:, None], rows, 0.0)
            amax = jnp.maximum(jnp.max(jnp.abs(rows), axis=0), FP8_GEMM_MIN_AMAX)          # [128] per channel
            qt_ref[...] = (rows * (FP8_MAX / amax)[None, :]).astype(jnp.float8_e4m3fn).T
            amax_ref[...] = amax[None, :]

    in_specs = [pl.BlockSpec(source.shape, lambda i, j: (0, 0)), pl.BlockSpec((m, c), lambda i, j: (0, 0))]
    args = [source, x]
    if x_scales is not None:
        in_specs.append(pl.BlockSpec(x_scales.shape, lambda i, j: (0, 0)))
        args.append(x_scales)
    qt, amax = pl.pallas_call(
        kernel, grid=(p // b, c // b), in_specs=in_specs,
        out_specs=[pl.BlockSpec((b, b), lambda i, j: (j, i)), pl.BlockSpec((1, b), lambda i, j: (i, j))],
        out_shape=[shape_like((c, p), jnp.float8_e4m3fn, x), shape_like((p // b, c), jnp.float32, x)],
        compiler_params=pltriton.CompilerParams(num_warps=8, num_stages=1),
        interpret=interpret, name="jax_ep_quantize_rows_t")(*args)
    return qt, fp8_scales(amax, FP8_GEMM_MIN_AMAX)[1], info


def weight_gradient_of_quantized(xt: jax.Array, xs: jax.Array, dyt: jax.Array, dys: jax.Array,
                                 info: jax.Array) -> jax.Array:
    """The reference FP8 weight gradient from quantize_rows_t's outputs (x's and dy's): per group, the sum
    over its 128-row blocks of the dequantised blocks' products, float32 [G, C, N]."""
    xf = xt.astype(jnp.float32) * jnp.repeat(xs.T, FP8_BLOCK, axis=1)           # [C, P]
    dyf = dyt.astype(jnp.float32) * jnp.repeat(dys.T, FP8_BLOCK, axis=1)        # [N, P]
    return lax.ragged_dot_general(
        xf.T, dyf.T, info[2] * FP8_BLOCK,
        lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((0,), (0,)), ((), ())),
                                      lhs_ragged_dimensions=[0], rhs_group_dimensions=[]),
        precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


WEIGHT_GRADIENTS = ("bf16", "fp8")


def _dw_kernel_fits(c: int, n: int) -> bool:
    """Whether gemm_mgpu.transposed_ragged_dot_fp8 tiles a [C, N] weight gradient: 64-row tiles of C, two
    128-column consumers along N."""
    return c % 64 == 0 and n % (2 * FP8_BLOCK) == 0


# The FP8 weight-gradient kernel's form (stages, grid_minor, grid_tile_width: the order of a group's
# output tiles, as BlockConfig's; ring: one ring of K buffers across tiles, BlockConfig.ring). Slower than
# the bf16 weight gradient even in its fastest form, so it is opt-in: H200, 2026-11-30, DeepSeek-V3 EP2
# gate|up, quantisation included, the ring form (4, 0, 8, 1) 4.34 ms (the table's entry), DW_KERNEL 5.53,
# bf16 3.44 (docs/benchmarks/h200_gemm_s31.json). tune_gemm.py --fp8 times DW_KERNELS.
DW_KERNEL = (4, 0, 8)
DW_KERNELS = (DW_KERNEL, (3, 0, 8), (4, 0, 4), (4, 1, 2), (4, 0, 8, 1), (3, 0, 8, 1))


def fp8_weight_gradient(x: jax.Array, dy: jax.Array, group_sizes: jax.Array, *,
                        x_scales: jax.Array | None = None, backend: str = "reference",
                        out_dtype=jnp.bfloat16, kernel: tuple | None = None,
                        num_sms: int | None = None) -> jax.Array:
    """dw[g] = x[rows of g].T @ dy[rows of g] with both operands in FP8 as DeepSeek-V3's backward runs
    it: rows quantised token-minor with one scale per 128 rows and channel (quantize_rows_t), float32
    sums per 128-row block scaled by the outer product of the two blocks' scales, ``out_dtype`` [G, C, N]
    (zeros for empty groups). x [M, C] (e4m3 with ``x_scales`` [M, C/128], e.g. the forward's quantised
    rows, or bfloat16/float32), dy [M, N]; C and N multiples of 128. backend "reference" (dequantise,
    float32 ragged dot; any platform) or "mosaic_gpu" (Hopper: the Triton quantiser and
    gemm_mgpu.transposed_ragged_dot_fp8, which needs C % 64 and N % 256; ``kernel``: its form, one of
    DW_KERNELS' kind; None: the form tools/tune_gemm.py --fp8 measured fastest at this shape, else
    DW_KERNEL); ``num_sms``: the SMs its kernel takes (as fp8_grouped_matmul's)."""
    m, c = x.shape
    n = dy.shape[1]
    if dy.shape[0] != m:
        raise EPValueError(f"fp8_weight_gradient: x {x.shape} and dy {dy.shape} must have the same rows")
    check_fp8_channels("fp8_weight_gradient", K=c, N=n)
    if backend not in BACKENDS:
        raise EPValueError(f"fp8_weight_gradient: backend must be one of {BACKENDS}, got {backend!r}")
    group_sizes = check_group_sizes(group_sizes, getattr(group_sizes, "shape", (None,))[0],
                                    "fp8_weight_gradient")
    num_sms = check_option("fp8_weight_gradient:", "num_sms", num_sms, "int?")
    if backend == "mosaic_gpu" and (why := rows_reason(m, fp8=True)):
        raise EPValueError(f"fp8_weight_gradient: backend='mosaic_gpu' cannot take x {tuple(x.shape)}: {why}")
    if backend == "reference":
        return weight_gradient_of_quantized(*quantize_weight_gradient_operands(
            x, dy, group_sizes, x_scales=x_scales)).astype(out_dtype)
    if not _dw_kernel_fits(c, n):
        raise EPValueError(f"fp8_weight_gradient: the Hopper kernel needs N % {2 * FP8_BLOCK} == 0 and "
                           f"C % 64 == 0, got C={c}, N={n}")
    # the Triton quantiser where Pallas addresses both operands, else XLA's (the same layout and bits,
    # which the kernel reads alike)
    fits = all(rows_t_fits(m, width, group_sizes.shape[0]) for width in (c, n))
    operands = quantize_weight_gradient_operands(x, dy, group_sizes, x_scales=x_scales,
                                                 backend="pallas" if fits else "reference")
    dw = weight_gradient_kernel(operands, m, kernel=kernel, out_dtype=out_dtype, num_sms=num_sms)
    return vary_as(dw, x, dy)   # a kernel's result is typed invariant; it is per rank


def quantize_weight_gradient_operands(x: jax.Array, dy: jax.Array, group_sizes: jax.Array, *,
                                      x_scales: jax.Array | None = None, backend: str = "reference"):
    """What the FP8 weight gradient multiplies: x and dy quantised token-minor (quantize_rows_t, on
    ``backend``), as (xt, xs, dyt, dys, info)."""
    xt, xs, info = quantize_rows_t(x, group_sizes, x_scales=x_scales, backend=backend)
    dyt, dys, _ = quantize_rows_t(dy, group_sizes, backend=backend)
    return xt, xs, dyt, dys, info


def weight_gradient_kernel(operands, m: int, *, kernel: tuple | None = None, out_dtype=jnp.bfloat16,
                           num_sms: int | None = None):
    """The Hopper FP8 weight-gradient kernel (gemm_mgpu.transposed_ragged_dot_fp8) on
    quantize_weight_gradient_operands' output for an m-row buffer, in the form ``kernel`` (DW_KERNELS'
    kind; None: the form tools/tune_gemm.py --fp8 measured fastest at this shape, else DW_KERNEL)."""
    from jax_ep import gemm_mgpu as mgpu

    xt, xs, dyt, dys, info = operands
    if kernel is None:
        kernel = tuned_entry("dw_fp8", m, xt.shape[0], dyt.shape[0], info.shape[1]) or DW_KERNEL
    stages, minor, width, ring = (*kernel, 0)[:4]
    if ring not in (0, 1):
        raise EPValueError(f"fp8_weight_gradient: kernel's ring must be 0 or 1, got {kernel}")
    return mgpu.transposed_ragged_dot_fp8(xt, xs, dyt, dys, info, stages=stages, minor=minor, width=width,
                                          out_dtype=out_dtype, ring=bool(ring), num_sms=num_sms)


class FP8Weights(NamedTuple):
    """[G, K, N] weights quantised once for the FP8 GEMMs (``quantize_weights``): ``wq`` e4m3 [G, K, N]
    (what the input gradient reads), ``wq_t`` the same values [G, N, K] (what the Hopper forward reads;
    None where the GEMM runs on the reference backend) and ``scales`` float32 [G, K/128, N/128]."""
    wq: jax.Array
    wq_t: jax.Array | None
    scales: jax.Array


def quantize_weights(w: jax.Array, *, backend: str = "auto") -> FP8Weights:
    """w [G, K, N] (K and N multiples of 128) quantised per 128 x 128 block, in the layouts the FP8 GEMM
    on ``backend`` ("auto": ``fp8_backend``'s choice) reads: the same bits ``fp8_grouped_matmul(x, w, ...)``
    computes from w on every call, for ``fp8_grouped_matmul(x, w, ..., quantized=...)`` to reuse."""
    if getattr(w, "ndim", None) != 3:
        raise EPValueError("quantize_weights: w must be 3-D [G, K, N], got shape "
                           f"{getattr(w, 'shape', None)}")
    if fp8_backend(w.shape[1], w.shape[2], backend) == "mosaic_gpu":
        return FP8Weights(*quantize_weight_blocks_both(w, backend=weight_quantisation_backend(w.shape)))
    wq, scales = quantize_weight_blocks(w)
    return FP8Weights(wq, None, scales)


def _check_quantized(quantized, w: jax.Array, backend: str) -> None:
    """quantized must be an FP8Weights of w's shape with the layouts `backend`'s GEMM reads."""
    if not isinstance(quantized, FP8Weights):
        raise EPTypeError(f"fp8_grouped_matmul: quantized must be a jax_ep.gemm_fp8.FP8Weights "
                          f"(quantize_weights(w)), got {type(quantized).__name__}")
    g, k, n = w.shape
    want = {"wq": (g, k, n), "scales": (g, k // FP8_BLOCK, n // FP8_BLOCK)}
    if backend == "mosaic_gpu":
        want["wq_t"] = (g, n, k)
    for name, shape in want.items():
        got = getattr(quantized, name)
        if got is None or tuple(got.shape) != shape:
            raise EPValueError(f"fp8_grouped_matmul: quantized.{name} must have shape {shape} for w "
                               f"{tuple(w.shape)} on backend {backend!r}, got "
                               f"{None if got is None else tuple(got.shape)} (quantise the weights with "
                               "quantize_weights on the same backend)")


def grouped_matmul_fp8(xq: jax.Array, x_scales: jax.Array, wq: jax.Array, w_scales: jax.Array,
                       group_sizes: jax.Array, *, wq_t: jax.Array | None = None, transpose_w: bool = False,
                       out_dtype=jnp.bfloat16, backend: str = "reference",
                       kernel: tuple[bool, int, int] | None = None, zero_tail: bool = True,
                       num_sms: int | None = None) -> jax.Array:
    """out = dequantize(xq, x_scales) @ dequantize(wq, w_scales)[g] per group of rows (``transpose_w``:
    @ ...[g].T, the input gradient), float32 sums, ``out_dtype`` out, zeros past sum(group_sizes)
    (``zero_tail=False``: unspecified there on the Hopper kernel, which leaves them unwritten, as
    ``jax_ep.grouped_matmul``'s).

    Args:
      xq: [M, K] float8_e4m3fn rows grouped consecutively; x_scales: [M, K/128] float32.
      wq: [G, K, N] float8_e4m3fn (or [G, N, K] with transpose_w, the same array as the forward's);
        w_scales: [G, K/128, N/128] float32, one per 128 x 128 block (quantize_weight_blocks).
      wq_t: the weights with the contracted dimension minor, for the kernel ([G, N, K] for the forward;
        the kernel reads FP8 operands K-major); computed from wq when None.
      backend: "reference" (dequantise, float32 ragged_dot; any platform) or "mosaic_gpu" (Hopper).
      kernel: the Hopper kernel's form (warp_specialized, block_m, stages[, grid_minor[, ring[,
        scales_smem[, lagged]]]]); None: the tuned form for this shape (gemm.tuned_entry), else
        fp8_kernel_form's default.
      num_sms: the SMs the Hopper kernel takes (as fp8_grouped_matmul's); None: all.
    """
    if backend not in BACKENDS:
        raise EPValueError(f"grouped_matmul_fp8: backend must be one of {BACKENDS}, got {backend!r}")
    for name, a, ndim in (("xq", xq, 2), ("wq", wq, 3)):
        if a.dtype != jnp.float8_e4m3fn or a.ndim != ndim:
            raise EPValueError(f"grouped_matmul_fp8: {name} must be float8_e4m3fn of {ndim} dims, got "
                               f"{a.dtype}{tuple(a.shape)}")
    for name, a in (("x_scales", x_scales), ("w_scales", w_scales)):
        if a.dtype != jnp.float32:
            raise EPValueError(f"grouped_matmul_fp8: {name} must be float32, got {a.dtype}")
    m, k = xq.shape
    g = wq.shape[0]
    kw, n = (wq.shape[2], wq.shape[1]) if transpose_w else wq.shape[1:]
    if kw != k:
        raise EPValueError(f"grouped_matmul_fp8: x {xq.shape} and w {wq.shape} (transpose_w={transpose_w}) "
                           "must share K")
    check_fp8_channels("grouped_matmul_fp8", K=k, N=n)
    group_sizes = check_group_sizes(group_sizes, g, "grouped_matmul_fp8")
    num_sms = check_option("grouped_matmul_fp8:", "num_sms", num_sms, "int?")
    if backend == "mosaic_gpu" and (why := rows_reason(m, fp8=True)):
        raise EPValueError(f"grouped_matmul_fp8: backend='mosaic_gpu' cannot take xq {tuple(xq.shape)}: "
                           f"{why}")
    ws = jnp.swapaxes(w_scales, 1, 2) if transpose_w else w_scales     # [G, K/128 contracted, N/128]
    if x_scales.shape != (m, k // FP8_BLOCK) or ws.shape != (g, k // FP8_BLOCK, n // FP8_BLOCK):
        raise EPValueError(f"grouped_matmul_fp8: scales {x_scales.shape} / {w_scales.shape} do not match "
                           f"x {xq.shape} and w {wq.shape} in blocks of {FP8_BLOCK}")
    if backend == "reference":
        x = dequantize_rows(xq, x_scales)
        w = dequantize_weight_blocks(wq, w_scales)
        w = jnp.swapaxes(w, 1, 2) if transpose_w else w
        out = lax.ragged_dot(x, w, group_sizes, precision=lax.Precision.HIGHEST,
                             preferred_element_type=jnp.float32)
        return out.astype(out_dtype)
    from jax_ep import gemm_mgpu as mgpu

    if wq_t is None:
        wq_t = wq if transpose_w else jnp.swapaxes(wq, 1, 2)
    if kernel is None:   # the form tune_gemm.py --fp8 measured fastest at this shape, if any
        # the table's key is the [G, K, N] weight's (K, N): with transpose_w the contracted dimension is N
        kernel = tuned_entry(*(("dx_fp8", m, n, k, g) if transpose_w else ("forward_fp8", m, k, n, g)))
    warp_specialized, block_m, stages, grid_minor, ring, scales_smem, lagged = fp8_kernel_form(n, kernel)
    schedule, num_tiles = mgpu.tile_schedule(group_sizes, m, block_m, zero_tail)
    out = mgpu.ragged_dot_fp8(xq, x_scales.T, wq_t, ws, schedule, num_tiles, block_m=block_m, stages=stages,
                              out_dtype=out_dtype, warp_specialized=warp_specialized, grid_minor=grid_minor,
                              ring=ring, scales_smem=scales_smem, lagged=lagged, num_sms=num_sms)
    return vary_as(out, xq, x_scales, wq, w_scales)  # a kernel's result is typed invariant; it is per rank


def fp8_backend(k: int, n: int, backend: str = "auto", m: int | None = None) -> str:
    """Where the FP8 GEMM of a [m, k] @ [g, k, n] product runs: "mosaic_gpu" on a Hopper GPU with k and n
    multiples of 128 (and m rows it can tile, where given: gemm.rows_reason), else "reference" (backend
    "auto"); an explicit backend is checked."""
    if backend not in ("auto", *BACKENDS):
        raise EPValueError(f"fp8 grouped GEMM: backend must be 'auto' or one of {BACKENDS}, got {backend!r}")
    why = _kernel_platform() or ("" if k % FP8_BLOCK == 0 and n % FP8_BLOCK == 0 else
                                 f"K={k} and N={n} are not multiples of {FP8_BLOCK}")
    why = why or ("" if m is None else rows_reason(m, fp8=True))
    if backend == "mosaic_gpu" and why:
        raise EPValueError(f"fp8 grouped GEMM: backend='mosaic_gpu' cannot run here: {why}")
    return backend if backend != "auto" else ("reference" if why else "mosaic_gpu")


def fp8_grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, backend: str = "auto",
                       gemm: str = "auto", quantized: FP8Weights | None = None,
                       weight_grad: str = "bf16", x_fp8: tuple[jax.Array, jax.Array] | None = None,
                       zero_tail: bool = True, num_sms: int | None = None,
                       dw_num_sms: int | None = None) -> jax.Array:
    """``grouped_matmul(x, w, group_sizes)`` with the matrix work in FP8 (module docstring): x [M, K]
    bfloat16/float32 rows, w [G, K, N] (K and N multiples of 128), result in x's dtype. Differentiable in
    x and w; ``gemm`` is the backend of the bfloat16 weight-gradient GEMM (jax_ep.grouped_matmul's).

    ``quantized``: w already quantised (``quantize_weights(w)`` on the same backend), used instead of
    quantising w in this call. It is a constant (no gradient flows into it); w still receives the weight
    gradient, which needs only the rows and dy. It must come from w's current values: quantise again after
    each update of w.

    ``weight_grad``: "bf16" (the weight gradient from the dequantised rows and dy in bfloat16, on
    ``gemm``'s backend) or "fp8" (fp8_weight_gradient: both quantised 128 x 1 along the tokens, as
    DeepSeek-V3 does; on the Hopper kernel it needs N % 256 == 0, else it runs on the reference).

    ``x_fp8``: x's rows already quantised per row and 128 channels, (e4m3 [M, K], float32 scales
    [M, K/128]), e.g. by an FP8 dispatch (``jax_ep.fp8.quantize_fp8``): the GEMM multiplies them instead of
    quantising x, and x serves for its gradient only (straight through the quantisation, as when this
    call quantises x; where nothing differentiates, XLA drops x's computation). Constants (no gradient
    flows into them).

    ``zero_tail``: False leaves the rows past sum(group_sizes) of the output and of x's gradient
    unspecified (``jax_ep.grouped_matmul``'s meaning; the Hopper kernels do not write them).

    ``num_sms``: the SMs every kernel of the three passes takes (``jax_ep.grouped_matmul``'s);
    ``dw_num_sms``: the weight-gradient pass's instead, where given (``jax_ep.grouped_matmul``'s)."""
    num_sms = check_option("fp8_grouped_matmul:", "num_sms", num_sms, "int?")
    dw_num_sms = check_option("fp8_grouped_matmul:", "dw_num_sms", dw_num_sms, "int?")
    check_option("fp8_grouped_matmul:", "zero_tail", zero_tail, "bool")
    if weight_grad not in WEIGHT_GRADIENTS:
        raise EPValueError(f"fp8_grouped_matmul: weight_grad must be one of {WEIGHT_GRADIENTS}, got "
                           f"{weight_grad!r}")
    if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[1]:
        raise EPValueError(f"fp8_grouped_matmul: x [M, K] and w [G, K, N] must share K, got x {x.shape}, "
                           f"w {w.shape}")
    for name, a in (("x", x), ("w", w)):
        if not jnp.issubdtype(a.dtype, jnp.floating) or a.dtype == jnp.float8_e4m3fn:
            raise EPValueError(f"fp8_grouped_matmul: {name} must be bfloat16/float32/float16 (the call "
                               f"quantises it), got {a.dtype}")
    k, n = w.shape[1], w.shape[2]
    check_fp8_channels("fp8_grouped_matmul", K=k, N=n)
    group_sizes = check_group_sizes(group_sizes, w.shape[0], "fp8_grouped_matmul")
    check_backend(gemm, "fp8_grouped_matmul", "gemm")
    backend = fp8_backend(k, n, backend, x.shape[0])
    if quantized is not None:
        _check_quantized(quantized, w, backend)
        quantized = FP8Weights(*(None if a is None else vary_as(lax.stop_gradient(a), x, w)
                                 for a in quantized))
    if x_fp8 is not None:
        xq, xs = x_fp8
        if xq.dtype != jnp.float8_e4m3fn or xq.shape != x.shape or xs.shape != (x.shape[0], k // FP8_BLOCK) \
                or xs.dtype != jnp.float32:
            raise EPValueError(f"fp8_grouped_matmul: x_fp8 must be (float8_e4m3fn {x.shape}, float32 "
                               f"{(x.shape[0], k // FP8_BLOCK)}) for x {x.shape}, got "
                               f"({xq.dtype} {xq.shape}, {xs.dtype} {xs.shape})")
        x_fp8 = tuple(vary_as(lax.stop_gradient(a), x, w, group_sizes) for a in (xq, xs))
    return _fp8_matmul(*vary_jointly(x, w, group_sizes), quantized, x_fp8, backend, gemm, weight_grad,
                       zero_tail, num_sms, num_sms if dw_num_sms is None else dw_num_sms)


def _live_rows_backend(shape, backend: str) -> str:
    """The row (de)quantisers' backend beside the FP8 GEMM on ``backend``: the live-row kernels beside the
    Hopper GEMMs (which never read rows past the groups), XLA elsewhere."""
    return "pallas" if backend == "mosaic_gpu" and quantize_rows_fits(shape) else "reference"


def live_rows_quantiser(x_shape, w_shape, backend: str = "auto") -> str:
    """The quantiser fp8_grouped_matmul(x, w, backend=backend) takes for rows x it quantises itself:
    "pallas" (quantize_gemm_rows' live-row kernel, beside the Hopper GEMMs) or "reference"."""
    return _live_rows_backend(tuple(x_shape), fp8_backend(w_shape[1], w_shape[2], backend, x_shape[0]))


def _quantize_live_rows(x, group_sizes, backend):
    """quantize_gemm_rows for the GEMM on ``backend`` (``_live_rows_backend``)."""
    if _live_rows_backend(x.shape, backend) == "pallas":
        return quantize_gemm_rows(x, jnp.sum(group_sizes), backend="pallas")
    return quantize_gemm_rows(x)


def _fp8_forward(x, w, group_sizes, quantized, x_fp8, backend, zero_tail, num_sms):
    xq, xs = _quantize_live_rows(x, group_sizes, backend) if x_fp8 is None else x_fp8
    wq, wq_t, ws = quantize_weights(w, backend=backend) if quantized is None else quantized
    out = grouped_matmul_fp8(xq, xs, wq, ws, group_sizes, wq_t=wq_t, out_dtype=x.dtype, backend=backend,
                             zero_tail=zero_tail, num_sms=num_sms)
    return out, (xq, xs, wq, ws, group_sizes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9, 10))
def _fp8_matmul(x, w, group_sizes, quantized, x_fp8, backend, gemm, weight_grad, zero_tail, num_sms,
                dw_num_sms):
    return _fp8_forward(x, w, group_sizes, quantized, x_fp8, backend, zero_tail, num_sms)[0]


def _fp8_matmul_fwd(x, w, group_sizes, quantized, x_fp8, backend, gemm, weight_grad, zero_tail, num_sms,
                    dw_num_sms):
    out, res = _fp8_forward(x, w, group_sizes, quantized, x_fp8, backend, zero_tail, num_sms)
    # which fields the cached weights have, as scalars: their (zero) cotangent is made in the backward
    # from wq's and ws's shapes, not kept from the forward
    q_like = None if quantized is None else FP8Weights(
        *(None if a is None else jnp.zeros((), a.dtype) for a in quantized))
    given = None if x_fp8 is None else jnp.zeros((), jnp.int32)   # rows given quantised: a pytree flag
    return out, (*res, jnp.zeros((), x.dtype), jnp.zeros((), w.dtype), q_like, given)


def _fp8_matmul_bwd(backend, gemm, weight_grad, zero_tail, num_sms, dw_num_sms, res, dy):
    xq, xs, wq, ws, group_sizes, x_like, w_like, q_like, given = res
    # cached FP8 weights are constants (stop_gradient upstream): zero cotangents, dropped unused
    d_quantized = None if q_like is None else FP8Weights(
        vary_as(jnp.zeros(wq.shape, wq.dtype), wq),
        None if q_like.wq_t is None else vary_as(jnp.zeros((wq.shape[0], wq.shape[2], wq.shape[1]),
                                                           wq.dtype), wq),
        vary_as(jnp.zeros(ws.shape, ws.dtype), ws))
    dyq, dys = _quantize_live_rows(dy, group_sizes, backend)
    dx = grouped_matmul_fp8(dyq, dys, wq, ws, group_sizes, transpose_w=True, out_dtype=x_like.dtype,
                            backend=backend, zero_tail=zero_tail, num_sms=num_sms)
    if weight_grad == "fp8":         # from the rows the forward multiplied, requantised along the tokens
        dw_backend = backend if _dw_kernel_fits(xq.shape[1], dy.shape[1]) else "reference"
        dw = fp8_weight_gradient(xq, dy, group_sizes, x_scales=xs, backend=dw_backend, num_sms=dw_num_sms)
    else:
        # the rows the forward multiplied (past the groups: unwritten beside the Hopper kernels)
        rows = dequantize_gemm_rows(xq, xs, jnp.sum(group_sizes),
                                    backend=_live_rows_backend(xq.shape, backend))
        dw = weight_gradient(rows, dy.astype(jnp.bfloat16), group_sizes, backend=gemm, num_sms=dw_num_sms)
    # rows given quantised (x_fp8) are constants: zero cotangents
    d_x_fp8 = (vary_as(jnp.zeros(xq.shape, xq.dtype), xq), vary_as(jnp.zeros(xs.shape, xs.dtype), xs)
               ) if given is not None else None
    return dx, dw.astype(w_like.dtype), float0_like(group_sizes), d_quantized, d_x_fp8


_fp8_matmul.defvjp(_fp8_matmul_fwd, _fp8_matmul_bwd)

