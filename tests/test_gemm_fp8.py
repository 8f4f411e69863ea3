"""The FP8 grouped GEMM (jax_ep.gemm_fp8) on CPU: DeepSeek-V3's block semantics written out in NumPy, the
weights' 128 x 128 block quantisation, the input-gradient form, accuracy against the unquantised product,
argument errors, and the Hopper kernel lowering for CUDA (the GPU test runs it)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_ep import gemm_fp8
from jax_ep import gemm_mgpu as mgpu
from jax_ep.errors import EPValueError
from jax_ep.fp8 import dequantize_fp8, quantize_fp8
from jax_ep.gemm_fp8 import dequantize_weight_blocks, grouped_matmul_fp8, quantize_weight_blocks


def case(seed, m=320, k=256, n=384, g=4):
    rng = np.random.default_rng(seed)
    sizes = np.array([100, 0, 130, 50], np.int32)[:g]
    x = rng.standard_normal((m, k)).astype(np.float32) * rng.uniform(0.1, 10, (m, 1)).astype(np.float32)
    w = (rng.standard_normal((g, k, n)) / np.sqrt(k)).astype(np.float32)
    return x, w, sizes


def blockwise(xq, xs, wq, ws, sizes):
    """The definition, term by term in float64: per row r of group g and output n,
    sum over 128-channel blocks kb of xs[r, kb] * ws[g, kb, n // 128] * (xq[r, kb] . wq[g, kb, n])."""
    xq, xs = np.asarray(xq, np.float64), np.asarray(xs, np.float64)
    wq, ws = np.asarray(wq, np.float64), np.asarray(ws, np.float64)
    m, k = xq.shape
    n = wq.shape[2]
    out = np.zeros((m, n))
    start = 0
    for gi, size in enumerate(sizes):
        for r in range(start, start + size):
            for kb in range(k // 128):
                part = xq[r, kb * 128:(kb + 1) * 128] @ wq[gi, kb * 128:(kb + 1) * 128]
                out[r] += part * xs[r, kb] * np.repeat(ws[gi, kb], 128)
        start += size
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_reference_is_the_blockwise_definition(seed):
    x, w, sizes = case(seed)
    xq, xs = quantize_fp8(jnp.asarray(x))
    wq, ws = quantize_weight_blocks(jnp.asarray(w))
    out = grouped_matmul_fp8(xq, xs, wq, ws, jnp.asarray(sizes), out_dtype=jnp.float32)
    expected = blockwise(xq, xs, wq, ws, sizes)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-4)
    assert np.all(np.asarray(out)[sizes.sum():] == 0)                 # rows past the groups: zeros


def test_dequantize_fp8_checks_its_scales_and_takes_leading_dims():
    """Found by a review (2026-12-05): scales [1, 2] for 4 rows were broadcast (three rows scaled by the
    first's), extra scale columns dropped, int scales taken, 3-D (low-latency) rows an unpack error."""
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((2, 4, 200)) * rng.uniform(0.1, 100, (2, 4, 1)), jnp.float32)
    q, s = quantize_fp8(x.reshape(8, 200))
    q3, s3 = q.reshape(2, 4, 200), s.reshape(2, 4, 2)
    np.testing.assert_array_equal(np.asarray(dequantize_fp8(q3, s3)).reshape(8, 200),
                                  np.asarray(dequantize_fp8(q, s)))
    err = np.abs(np.asarray(dequantize_fp8(q3, s3)) - np.asarray(x))
    assert (err <= np.abs(np.asarray(x)) / 16 + np.asarray(s3).repeat(128, -1)[..., :200] / 2 ** 7).all()
    for qq, ss, message in (
            (q, s[:1], r"scales must be float32 \[8, 2\] .* got float32\[1, 2\]"),
            (q, jnp.concatenate([s, s], 1), r"got float32\[8, 4\]"),
            (q, s.astype(jnp.int32), r"got int32\[8, 2\]"),
            (q.astype(jnp.float32), s, r"q must be float8_e4m3fn rows \[..., H\], got float32")):
        with pytest.raises(EPValueError, match=message):
            dequantize_fp8(qq, ss)


def test_fp8_gemms_check_dtypes_and_dims_before_reading_them():
    """Found by a review (2026-12-05): int32 scales gave an all-zero output, int x an int32 one, a 2-D w
    an IndexError."""
    x, w, sizes = case(0, m=16, k=128, n=128, g=2)
    sizes = np.array([8, 8], np.int32)
    xq, xs = quantize_fp8(jnp.asarray(x))
    wq, ws = quantize_weight_blocks(jnp.asarray(w))
    with pytest.raises(EPValueError, match="w_scales must be float32, got int32"):
        grouped_matmul_fp8(xq, xs, wq, ws.astype(jnp.int32), jnp.asarray(sizes))
    with pytest.raises(EPValueError, match=r"wq must be float8_e4m3fn of 3 dims, got .*\(128, 128\)"):
        grouped_matmul_fp8(xq, xs, wq[0], ws, jnp.asarray(sizes))
    fp8 = gemm_fp8.fp8_grouped_matmul
    with pytest.raises(EPValueError, match="x must be bfloat16/float32/float16 .* got int32"):
        fp8(jnp.asarray(x).astype(jnp.int32), jnp.asarray(w), jnp.asarray(sizes))
    with pytest.raises(EPValueError, match=r"x \[M, K\] and w \[G, K, N\] must share K"):
        fp8(jnp.asarray(x), jnp.asarray(w)[0], jnp.asarray(sizes))
    with pytest.raises(EPValueError, match="x_fp8 must be"):
        fp8(jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes), x_fp8=(xq, xs.astype(jnp.int32)))


def test_fp8_weight_gradient_quantises_with_xla_where_pallas_cannot_address_the_rows(monkeypatch):
    """Found by a review (2026-12-05): with rows of 2**31 <= M * C <= 2**32 one-byte elements the FP8 weight
    gradient raised (quantize_rows_t's Triton kernel cannot address them) where the other Pallas users
    fall back to XLA's quantiser; traced for the Hopper path here (GPU-only checks bypassed)."""
    from jax_ep import gemm as gemm_mod

    monkeypatch.setattr(gemm_fp8, "_kernel_platform", lambda: "")
    monkeypatch.setattr(gemm_mod, "_kernel_platform", lambda: "")
    S = jax.ShapeDtypeStruct
    c, n, g = 7168, 512, 4
    assert not gemm_fp8.quantize_rows_fits((300032, c)) and gemm_fp8.quantize_rows_fits((0 + 2048, c))
    assert not gemm_fp8.quantize_rows_fits((0, c))
    for m in (2048, 300032):

        def loss(x, w, gs):
            out = gemm_fp8.fp8_grouped_matmul(x, w, gs, backend="mosaic_gpu", weight_grad="fp8")
            return jnp.sum(out.astype(jnp.float32))

        jax.jit(jax.grad(loss, argnums=(0, 1))).trace(S((m, c), jnp.bfloat16), S((g, c, n), jnp.bfloat16),
                                                     S((g,), jnp.int32))


def test_weight_blocks_quantise_each_128_block_to_its_own_scale():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((2, 256, 384)).astype(np.float32)
    w[1, 128:, 256:] *= 1000.0                                         # one block far larger
    wq, ws = quantize_weight_blocks(jnp.asarray(w))
    assert wq.dtype == jnp.float8_e4m3fn and ws.shape == (2, 2, 3)
    amax = np.abs(w.reshape(2, 2, 128, 3, 128)).max(axis=(2, 4))
    np.testing.assert_allclose(ws, amax / 448.0, rtol=1e-7)
    back = np.asarray(dequantize_weight_blocks(wq, ws))
    assert np.abs(np.asarray(wq, np.float32)).max() <= 448.0
    rel = np.linalg.norm(back - w) / np.linalg.norm(w)
    assert rel < 0.04, rel                                             # e4m3: 3 mantissa bits
    small = np.linalg.norm(back[1, :128] - w[1, :128]) / np.linalg.norm(w[1, :128])
    assert small < 0.04, small                                         # unaffected by the large block


def test_input_gradient_form_uses_the_forward_weights_transposed():
    x, w, sizes = case(5, k=384, n=256)
    rng = np.random.default_rng(6)
    dy = rng.standard_normal((x.shape[0], w.shape[2])).astype(np.float32)
    wq, ws = quantize_weight_blocks(jnp.asarray(w))
    dyq, dys = quantize_fp8(jnp.asarray(dy))
    dx = grouped_matmul_fp8(dyq, dys, wq, ws, jnp.asarray(sizes), transpose_w=True, out_dtype=jnp.float32)
    w_t = np.swapaxes(np.asarray(wq, np.float64), 1, 2)
    ws_t = np.swapaxes(np.asarray(ws), 1, 2)
    np.testing.assert_allclose(dx, blockwise(dyq, dys, w_t, ws_t, sizes), rtol=1e-5, atol=1e-4)


def test_accuracy_against_the_unquantised_product():
    """What FP8 costs: relative (Frobenius) error of the FP8 product against the float64 product of the
    unquantised operands, per group, on rows whose magnitudes differ by 100x: below 6%."""
    x, w, sizes = case(7, k=1024, n=512)
    xq, xs = quantize_fp8(jnp.asarray(x))
    wq, ws = quantize_weight_blocks(jnp.asarray(w))
    out = np.asarray(grouped_matmul_fp8(xq, xs, wq, ws, jnp.asarray(sizes)), np.float64)
    start = 0
    for gi, size in enumerate(sizes):
        if size:
            ref = x[start:start + size].astype(np.float64) @ w[gi]
            err = np.linalg.norm(out[start:start + size] - ref) / np.linalg.norm(ref)
            assert err < 0.06, (gi, err)
        start += size


def test_argument_errors_name_the_argument():
    x, w, sizes = case(0)
    xq, xs = quantize_fp8(jnp.asarray(x))
    wq, ws = quantize_weight_blocks(jnp.asarray(w))
    gs = jnp.asarray(sizes)
    with pytest.raises(EPValueError, match="xq must be float8_e4m3fn"):
        grouped_matmul_fp8(jnp.asarray(x), xs, wq, ws, gs)
    with pytest.raises(EPValueError, match="backend"):
        grouped_matmul_fp8(xq, xs, wq, ws, gs, backend="cuda")
    with pytest.raises(EPValueError, match="scales"):
        grouped_matmul_fp8(xq, xs[:, :1], wq, ws, gs)
    with pytest.raises(EPValueError, match="quantize_weight_blocks needs K and N multiples of 128 .*K=100"):
        quantize_weight_blocks(jnp.ones((1, 100, 128)))
    with pytest.raises(EPValueError, match="must share K"):
        grouped_matmul_fp8(xq[:, :128], xs[:, :1], wq, ws, gs)
    # the trainable form checks group_sizes and the bf16 weight gradient's backend as grouped_matmul does
    x, w = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
    with pytest.raises(EPValueError, match=r"fp8_grouped_matmul: group_sizes must have shape"):
        gemm_fp8.fp8_grouped_matmul(x, w, gs[:-1])
    with pytest.raises(EPValueError, match="fp8_grouped_matmul: group_sizes must be integer"):
        gemm_fp8.fp8_grouped_matmul(x, w, gs.astype(jnp.float32))
    with pytest.raises(EPValueError, match="fp8_grouped_matmul: gemm must be one of .*got 'reference'"):
        gemm_fp8.fp8_grouped_matmul(x, w, gs, gemm="reference")


@pytest.mark.parametrize("weight_grad", ["bf16", "fp8"])
def test_no_rows_give_zero_weight_gradients(weight_grad):
    """A buffer of 0 rows (every group empty): zero weight gradients in both forms (the FP8 one's
    quantiser gathered from the empty rows before 2026-12-05)."""
    x = jnp.ones((0, 128), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(2), (2, 128, 128), jnp.bfloat16)
    gs = jnp.zeros((2,), jnp.int32)
    dw = jax.grad(lambda w: gemm_fp8.fp8_grouped_matmul(x, w, gs, weight_grad=weight_grad)
                  .astype(jnp.float32).sum())(w)
    assert dw.shape == w.shape and not np.any(np.asarray(dw, np.float32))


@pytest.mark.parametrize("kernel", [(False, 64, 4), (True, 64, 4), (True, 128, 3), (True, 64, 4, 2, 1),
                                    (True, 64, 4, 2, 1, 1)])
@pytest.mark.parametrize("transpose_w", [False, True])
def test_kernel_lowers_for_hopper(transpose_w, kernel):
    """The Hopper FP8 kernel (per-128-channel scale promotion into a float32 running sum) traces and lowers
    to a Mosaic GPU custom call for CUDA on this CPU machine (shared memory is checked there), forward and
    input-gradient forms, one consumer warpgroup or warp-specialised."""
    m, k, n, g = 1024, 512, 768, 5
    xq = jax.ShapeDtypeStruct((m, k), jnp.float8_e4m3fn)
    xs = jax.ShapeDtypeStruct((m, k // 128), jnp.float32)
    wq = jax.ShapeDtypeStruct((g, n, k) if transpose_w else (g, k, n), jnp.float8_e4m3fn)
    blocks = (g, n // 128, k // 128) if transpose_w else (g, k // 128, n // 128)
    ws = jax.ShapeDtypeStruct(blocks, jnp.float32)
    gs = jax.ShapeDtypeStruct((g,), jnp.int32)
    f = jax.jit(lambda *a: grouped_matmul_fp8(*a, transpose_w=transpose_w, backend="mosaic_gpu",
                                              kernel=kernel))
    text = f.trace(xq, xs, wq, ws, gs).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    assert mgpu.FP8_K_BLOCK == 128


def test_trainable_form_gradients_follow_the_fp8_numerics():
    """fp8_grouped_matmul: forward = the FP8 product of the quantised operands; dx = FP8 dy against the
    weights' blocks transposed; dw = bfloat16 x[g rows].T @ dy from the rows the forward used; empty
    groups get zero dw, padding rows zero dx; all within FP8's error of the float64 gradients."""
    from jax_ep.gemm_fp8 import fp8_grouped_matmul

    x, w, sizes = case(11, k=256, n=384)
    rng = np.random.default_rng(12)
    dy = rng.standard_normal((x.shape[0], w.shape[2])).astype(np.float32)
    xb, wf = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w)
    out, vjp = jax.vjp(lambda x, w: fp8_grouped_matmul(x, w, jnp.asarray(sizes)), xb, wf)
    dx, dw = vjp(jnp.asarray(dy, jnp.bfloat16))
    assert out.dtype == jnp.bfloat16 and dx.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
    total = int(sizes.sum())
    rows = np.repeat(np.arange(len(sizes)), sizes)
    x64, w64, dy64 = np.asarray(xb, np.float64), w.astype(np.float64), np.asarray(
        jnp.asarray(dy, jnp.bfloat16), np.float64)
    rel = lambda a, b: np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b)  # noqa: E731
    assert rel(out[:total], np.einsum("rk,rkn->rn", x64[:total], w64[rows])) < 0.06
    assert rel(dx[:total], np.einsum("rn,rkn->rk", dy64[:total], w64[rows])) < 0.06
    ref_dw = np.zeros(w.shape)
    np.add.at(ref_dw, rows, np.einsum("rk,rn->rkn", x64[:total], dy64[:total]))
    assert rel(dw, ref_dw) < 0.06
    assert np.all(np.asarray(dw)[sizes == 0] == 0) and np.all(np.asarray(dx[total:], np.float32) == 0)
    # the forward is exactly the FP8 reference of the quantised operands
    xq, xs = gemm_fp8.quantize_gemm_rows(xb)
    wq, ws = quantize_weight_blocks(wf)
    np.testing.assert_array_equal(out, grouped_matmul_fp8(xq, xs, wq, ws, jnp.asarray(sizes)))


def test_trainable_form_refuses_shapes_without_whole_blocks():
    from jax_ep.gemm_fp8 import fp8_backend, fp8_grouped_matmul

    with pytest.raises(EPValueError, match="multiples of 128"):
        fp8_grouped_matmul(jnp.ones((8, 96)), jnp.ones((2, 96, 128)), jnp.array([4, 4]))
    with pytest.raises(EPValueError, match="mosaic_gpu"):
        fp8_backend(128, 128, "mosaic_gpu")                       # no Hopper GPU here
    assert fp8_backend(128, 256) == "reference"


@pytest.mark.parametrize("gemm,cached,weight_grad", [("auto", False, "bf16"), ("mosaic_gpu", False, "bf16"),
                                                     ("auto", True, "bf16"), ("auto", True, "fp8")])
def test_trainable_form_under_shard_map_lowers_for_hopper(monkeypatch, gemm, cached, weight_grad):
    """The MoE layer's FP8 path inside shard_map with the Hopper kernels (what MoE(gemm_dtype=...) runs on a
    GPU): the kernels' results are per rank, so the custom_vjp's cotangents must vary over the mesh axis
    like the primal inputs (jax 0.11 refuses the backward otherwise; seen on one H200, 2026-11-29). The
    gradient traces and lowers for CUDA here, with the GPU-only checks bypassed; `cached`: from weights
    quantised beforehand (quantize_weights: both layouts); weight_grad "fp8": the FP8 weight gradient
    (its Triton quantiser and Mosaic kernel)."""
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from jax_ep import gemm as gemm_mod
    from jax_ep import gemm_fp8

    monkeypatch.setattr(gemm_fp8, "_kernel_platform", lambda: "")
    monkeypatch.setattr(gemm_mod, "_kernel_platform", lambda: "")
    mesh = Mesh(np.array(jax.devices()[:2]), ("ep",))
    m, k, n, g = 512, 256, 384 if weight_grad == "bf16" else 512, 3

    def per_rank(x, w, gs):
        q = gemm_fp8.quantize_weights(w) if cached else None
        assert not cached or q.wq_t.shape == (g, n, k)

        def loss(x, w):
            out = gemm_fp8.fp8_grouped_matmul(x, w, gs[0], backend="mosaic_gpu", gemm=gemm, quantized=q,
                                              weight_grad=weight_grad)
            return jnp.sum(out.astype(jnp.float32) ** 2)
        return jax.grad(loss, argnums=(0, 1))(x, w)

    f = jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=(P("ep"), P("ep"), P("ep")),
                          out_specs=(P("ep"), P("ep"))))
    args = (jax.ShapeDtypeStruct((2 * m, k), jnp.bfloat16), jax.ShapeDtypeStruct((2 * g, k, n), jnp.bfloat16),
            jax.ShapeDtypeStruct((2, g), jnp.int32))
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("mosaic_gpu") >= 2
    assert ("jax_ep_quantize_rows_t" in text) == (weight_grad == "fp8")
    # x and dy through the live-row quantiser (its kernel's name is a prefix of quantize_rows_t's); the
    # bf16 weight gradient's rows through the live-row dequantiser
    assert text.count("jax_ep_quantize_rows") > text.count("jax_ep_quantize_rows_t")
    assert ("jax_ep_dequantize_rows" in text) == (weight_grad == "bf16")


def _dw_case(seed, sizes, m, c=256, n=512, poison=True):
    rng = np.random.default_rng(seed)
    sizes = np.asarray(sizes, np.int32)
    total = int(sizes.sum())
    x = rng.standard_normal((m, c)) * rng.uniform(0.1, 10, (m, 1))      # rows of very different scales
    dy = rng.standard_normal((m, n)) * rng.uniform(0.1, 10, (1, n))
    if poison:                                                         # capacity rows: never read
        x[total:], dy[total:] = np.nan, np.nan
    return jnp.asarray(x, jnp.bfloat16), jnp.asarray(dy, jnp.bfloat16), jnp.asarray(sizes), total


def _exact_dw(x, dy, sizes):
    x64, dy64 = np.asarray(x, np.float64), np.asarray(dy, np.float64)
    out, start = np.zeros((len(sizes), x.shape[1], dy.shape[1])), 0
    for gi, size in enumerate(np.asarray(sizes)):
        out[gi] = x64[start:start + size].T @ dy64[start:start + size]
        start += size
    return out


@pytest.mark.parametrize("sizes", [[100, 0, 300, 64, 1], [0, 0, 0, 0, 0], [130, 0, 0, 0, 500], [64] * 5])
def test_rows_quantised_along_the_tokens_by_group(sizes):
    """quantize_rows_t: each group's rows padded to whole 128-row blocks, token-minor, one scale per block
    and channel = the block's channel amax / 448; padding rows zero; the Triton kernel (interpret mode)
    gives the reference's bits on every live block, from bfloat16 rows and from e4m3 rows with their
    per-128-channel scales (dequantised first); rows past the groups (NaN) never reach a block."""
    from jax_ep.gemm_fp8 import padded_block_rows, quantize_rows_t

    m = 640
    x, _, gs, total = _dw_case(1, sizes, m)
    qt, scales, info = quantize_rows_t(x, gs)
    p = padded_block_rows(m, len(sizes))
    assert qt.shape == (256, p) and qt.dtype == jnp.float8_e4m3fn and scales.shape == (p // 128, 256)
    first, end, blocks, first2 = np.asarray(info)
    np.testing.assert_array_equal(blocks, -(-np.asarray(sizes) // 128))
    np.testing.assert_array_equal(first, first2)
    np.testing.assert_array_equal(end - first, sizes)
    x64, starts = np.asarray(x, np.float64), np.cumsum(sizes) - sizes
    per_row = np.repeat(np.asarray(scales, np.float64).T, 128, axis=1)             # [C, P]
    deq = np.asarray(qt, np.float64) * per_row
    live = int(blocks.sum())
    for gi, size in enumerate(sizes):
        got = deq[:, first[gi]:first[gi] + blocks[gi] * 128].T              # [rows padded, C]
        want = x64[starts[gi]:starts[gi] + size]
        # e4m3: 3 mantissa bits (half an ulp: 1/16 of the value), subnormal steps of 2**-9 in scaled units
        tol = np.abs(want) / 16 + 2.0**-9 * per_row[:, first[gi]:first[gi] + size].T
        assert np.all(np.abs(got[:size] - want) <= tol * 1.0001)
        assert np.all(got[size:] == 0)
    amax = np.abs(np.asarray(qt[:, :live * 128], np.float32)).reshape(256, live, 128).max(axis=2)
    assert np.all((amax == 448) | (amax == 0))                          # each block's max maps to 448
    assert np.all(np.isfinite(np.asarray(scales[:live])))
    for rows, row_scales in ((x, None), quantize_fp8(x)):
        ref = quantize_rows_t(rows, gs, x_scales=row_scales)
        got = quantize_rows_t(rows, gs, x_scales=row_scales, backend="pallas", interpret=True)
        np.testing.assert_array_equal(np.asarray(got[0][:, :live * 128], np.float32),
                                      np.asarray(ref[0][:, :live * 128], np.float32))
        np.testing.assert_array_equal(got[1][:live], ref[1][:live])
        np.testing.assert_array_equal(got[2], ref[2])


def test_fp8_weight_gradient_is_deepseeks_128x1_product():
    """fp8_weight_gradient (reference): per group, the sum over its 128-row blocks of the block scales'
    outer product times the e4m3 blocks' product (term by term in float64 below), within FP8's error of
    the exact x[g].T @ dy[g]; empty groups zero; rows past the groups (NaN) never read."""
    from jax_ep.gemm_fp8 import fp8_weight_gradient, quantize_rows_t

    sizes = [100, 0, 300, 64, 1]
    x, dy, gs, total = _dw_case(2, sizes, 640)
    dw = fp8_weight_gradient(x, dy, gs, out_dtype=jnp.float32)
    assert dw.shape == (5, 256, 512) and dw.dtype == jnp.float32
    exact = _exact_dw(x[:total], dy[:total], sizes)
    rel = np.linalg.norm(np.asarray(dw, np.float64) - exact) / np.linalg.norm(exact)
    assert rel < 0.05, rel
    assert np.all(np.asarray(dw)[1] == 0)
    xt, xs, info = quantize_rows_t(x, gs)
    dyt, dys, _ = quantize_rows_t(dy, gs)
    first, _, blocks, _ = np.asarray(info)
    for gi in (2, 4):                                               # two blocks; one row
        want = np.zeros((256, 512))
        for b in range(first[gi] // 128, first[gi] // 128 + blocks[gi]):
            cols = slice(b * 128, (b + 1) * 128)
            part = np.asarray(xt[:, cols], np.float64) @ np.asarray(dyt[:, cols], np.float64).T
            want += part * np.outer(np.asarray(xs[b], np.float64), np.asarray(dys[b], np.float64))
        np.testing.assert_allclose(np.asarray(dw[gi], np.float64), want, rtol=1e-5,
                                   atol=1e-6 * np.abs(want).max())


def test_fp8_weight_gradient_in_the_trainable_form():
    """fp8_grouped_matmul(weight_grad="fp8"): the same output and dx as the bf16 weight gradient, a dw
    within FP8's error of the exact one (float32 w: its dtype), and a bad weight_grad refused by name."""
    from jax_ep.gemm_fp8 import fp8_grouped_matmul

    x, w, sizes = case(21, k=256, n=512)
    rng = np.random.default_rng(22)
    dy = jnp.asarray(rng.standard_normal((x.shape[0], 512)), jnp.bfloat16)
    xb, wf, gs = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w), jnp.asarray(sizes)
    outs = {}
    for wg in ("bf16", "fp8"):
        out, vjp = jax.vjp(lambda x, w, wg=wg: fp8_grouped_matmul(x, w, gs, weight_grad=wg), xb, wf)
        outs[wg] = (out, *vjp(dy))
    np.testing.assert_array_equal(outs["fp8"][0], outs["bf16"][0])
    np.testing.assert_array_equal(outs["fp8"][1], outs["bf16"][1])
    total = int(sizes.sum())
    exact = _exact_dw(xb[:total], dy[:total], sizes)
    dw = outs["fp8"][2]
    assert dw.dtype == jnp.float32
    assert np.linalg.norm(np.asarray(dw, np.float64) - exact) / np.linalg.norm(exact) < 0.05
    with pytest.raises(EPValueError, match="weight_grad must be one of"):
        fp8_grouped_matmul(xb, wf, gs, weight_grad="fp16")


@pytest.mark.parametrize("weight_grad", ["bf16", "fp8"])
def test_gradients_do_not_depend_on_the_loss_scale(weight_grad):
    """A gradient is as large as the loss makes it: dy scaled by 2^-24 (a mean over ~10^7 elements is no
    larger) gives dx and dw scaled by exactly 2^-24, bit for bit, because the FP8 quantisation of dy
    scales with it. A fixed amax floor (the wire's 1e-4) put such gradients in e4m3's subnormals:
    the layer's FP8 weight gradient was 26% from bf16 (GPU and CPU, 2026-11-29), 7.7% at a larger loss.
    The same for the forward's rows: x scaled by 2^-24 scales the output."""
    from jax_ep.gemm_fp8 import fp8_grouped_matmul

    x, w, sizes = case(31, k=256, n=512)
    rng = np.random.default_rng(32)
    dy = jnp.asarray(rng.standard_normal((x.shape[0], 512)), jnp.bfloat16)
    xb, wf, gs = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w), jnp.asarray(sizes)
    s = 2.0 ** -24

    def grads(x, dy):
        out, vjp = jax.vjp(lambda x, w: fp8_grouped_matmul(x, w, gs, weight_grad=weight_grad), x, wf)
        return (out, *vjp(dy))

    out, dx, dw = grads(xb, dy)
    _, dx_s, dw_s = grads(xb, dy * s)
    assert np.abs(np.asarray(dx, np.float32)).max() > 0 and np.abs(np.asarray(dw)).max() > 0
    np.testing.assert_array_equal(np.asarray(dx_s, np.float32), np.asarray(dx, np.float32) * s)
    np.testing.assert_array_equal(np.asarray(dw_s), np.asarray(dw) * s)
    out_s = grads(xb * s, dy)[0]
    np.testing.assert_array_equal(np.asarray(out_s, np.float32), np.asarray(out, np.float32) * s)


def _e4m3_converts_used_raw(stablehlo: str) -> list[str]:
    """The StableHLO lines using a convert-to-e4m3's result other than an optimization_barrier."""
    import re

    names = re.findall(r"(%[\w#]+) = stablehlo\.convert .*-> tensor<[^>]*f8E4M3FN>", stablehlo)
    assert names, "no e4m3 convert in the program"
    raw = []
    for name in names:
        uses = [ln for ln in stablehlo.splitlines()
                if re.search(re.escape(name) + r"\b", ln) and not ln.strip().startswith(name + " =")]
        raw += [ln.strip() for ln in uses if "optimization_barrier" not in ln]
    return raw


@pytest.mark.parametrize("weight_grad", ["bf16", "fp8"])
def test_e4m3_roundings_are_kept_apart_from_converts_back(weight_grad):
    """Every rounding to e4m3 of the reference FP8 numerics (the wire's quantize_fp8, the GEMM's rows,
    dy, weight blocks and token-minor copies) goes through an optimization_barrier before anything
    reads it: XLA's GPU compiler removes f32 -> e4m3 -> f32 convert chains (SimplifyFPConversions under
    xla_allow_excess_precision, its default), which made the FP8 reference on a GPU skip the
    quantisation (2026-11-29: the layer's FP8 weight gradient 4.8% from bf16 on the GPU's reference,
    25.7% on the CPU's, same code)."""
    from jax_ep.fp8 import dequantize_fp8
    from jax_ep.gemm_fp8 import fp8_grouped_matmul

    x, w, sizes = case(41, k=256, n=256)
    xb, wf, gs = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w), jnp.asarray(sizes)
    wire = jax.jit(lambda x: dequantize_fp8(*quantize_fp8(x))).lower(xb).as_text()
    assert _e4m3_converts_used_raw(wire) == []

    def loss(x, w):
        out = fp8_grouped_matmul(x, w, gs, backend="reference", weight_grad=weight_grad)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(xb, wf).as_text()
    assert _e4m3_converts_used_raw(step) == []


def test_weight_quantisation_kernel_gives_the_reference_bits():
    """quantize_weight_blocks_both: the Pallas kernel (interpret mode here; the GPU test runs it compiled)
    writes both e4m3 layouts and the block scales bit for bit as the XLA reference, zero blocks and
    scales over 6 orders of magnitude included; the transposed layout is the transpose."""
    from jax_ep.gemm_fp8 import quantize_weight_blocks_both

    rng = np.random.default_rng(21)
    g, k, n = 2, 256, 384
    mag = 10.0 ** rng.uniform(-3, 3, (g, k // 128, 1, n // 128, 1))
    w = (rng.standard_normal((g, k // 128, 128, n // 128, 128)) * mag).reshape(g, k, n)
    w[1, :128, :128] = 0
    w = jnp.asarray(w, jnp.bfloat16)
    got = quantize_weight_blocks_both(w, backend="pallas", interpret=True)
    ref = quantize_weight_blocks_both(w)
    for a, b in zip(got, ref, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert np.array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))
    np.testing.assert_array_equal(np.asarray(jnp.swapaxes(got[0], 1, 2).astype(jnp.float32)),
                                  np.asarray(got[1].astype(jnp.float32)))
    assert float(jnp.min(got[2])) > 0
    with pytest.raises(EPValueError, match="backend"):
        quantize_weight_blocks_both(w, backend="triton")


def test_fp8_kernel_form_fits_the_output_width():
    """The warp-specialised FP8 form's 256-wide tile where it divides N, the one-consumer 128-wide form
    otherwise (a 1408-wide input gradient), in strips of row tiles unless the form asks for the group-major
    order; an explicit form that does not fit is refused by name."""
    from jax_ep.gemm import GROUP_MAJOR
    from jax_ep.gemm_fp8 import CLASSIC_KERNEL, KERNEL, fp8_kernel_form

    off = (False, False, False)
    assert fp8_kernel_form(4096) == (*KERNEL, *off) == (True, 64, 4, GROUP_MAJOR, *off)
    assert fp8_kernel_form(1408) == (*CLASSIC_KERNEL, *off) and not CLASSIC_KERNEL[0]
    assert fp8_kernel_form(1408, (False, 128, 3)) == (False, 128, 3, 0, *off)
    ring = (True, 64, 4, GROUP_MAJOR)
    assert fp8_kernel_form(4096, (*ring, 1)) == (*ring, True, False, False)
    assert fp8_kernel_form(4096, (*ring, 1, 1)) == (*ring, True, True, False)
    assert fp8_kernel_form(4096, (*ring, 1, 0, 1)) == (*ring, True, False, True)
    assert fp8_kernel_form(4096, (*ring, 1, 1, 1)) == (*ring, True, True, True)
    for n, bad in ((1408, KERNEL), (1408, (True, 64, 4)), (4096, (True, 64, 4, 1)), (4096, (True, 96, 4)),
                   (1408, (False, 64, 4, 0, 1)), (4096, (True, 64, 4, 0, 2)), (4096, (True, 64, 4, 0, 0, 1)),
                   (4096, (True, 64, 4, 0, 1, 2)), (4096, (True, 64, 4, 0, 0, 0, 1)),
                   (4096, (True, 64, 4, 0, 1, 1, 2)), (4096, (True, 64, 4, 0, 1, 1, 1, 0))):
        with pytest.raises(EPValueError, match=r"kernel .* needs N % \d+ == 0, block_m 64 or 128, grid"):
            fp8_kernel_form(n, bad)


def test_tuned_fp8_form_is_what_the_kernel_runs(monkeypatch):
    """With no explicit form, the FP8 GEMMs run the form tools/tune_gemm.py --fp8 wrote for the shape
    (gemm_configs.json passes forward_fp8 / dx_fp8, keyed by the [G, K, N] weight's K and N), else the
    default; an explicit form wins over both. Seen in the lowering: the ring form's kernel is ring_body."""
    from jax_ep import gemm
    from jax_ep.gemm import GROUP_MAJOR

    m, k, n, g = 1024, 256, 512, 4
    ring = (True, 64, 4, GROUP_MAJOR, 1)
    assert gemm_fp8.fp8_kernel_form(n, ring) == (True, 64, 4, GROUP_MAJOR, True, False, False)
    monkeypatch.setattr(gemm, "_tuned", lambda: {("forward_fp8", m, k, n, g): ring,
                                                 ("dx_fp8", 4 * m, k, n, 2 * g): ring})
    xq = jax.ShapeDtypeStruct((m, k), jnp.float8_e4m3fn)
    xs = jax.ShapeDtypeStruct((m, k // 128), jnp.float32)
    dyq = jax.ShapeDtypeStruct((m, n), jnp.float8_e4m3fn)
    dys = jax.ShapeDtypeStruct((m, n // 128), jnp.float32)
    wq = jax.ShapeDtypeStruct((g, k, n), jnp.float8_e4m3fn)
    ws = jax.ShapeDtypeStruct((g, k // 128, n // 128), jnp.float32)
    gs = jax.ShapeDtypeStruct((g,), jnp.int32)

    def lowered(transpose_w, kernel=None):
        x, s = (dyq, dys) if transpose_w else (xq, xs)
        f = jax.jit(lambda x, s, wq, ws, gs: grouped_matmul_fp8(
            x, s, wq, ws, gs, transpose_w=transpose_w, backend="mosaic_gpu", kernel=kernel))
        return f.trace(x, s, wq, ws, gs).lower(lowering_platforms=("cuda",)).as_text()

    assert "ring_body" in lowered(False) and "ring_body" in lowered(True)   # nearest tuned (m, g)
    assert "ring_body" not in lowered(False, kernel=(True, 64, 4, GROUP_MAJOR))
    monkeypatch.setattr(gemm, "_tuned", dict)
    assert "ring_body" not in lowered(False)                               # the default form


def test_weight_quantisation_kernel_only_where_pallas_addresses_it():
    """Pallas' Triton lowering takes 32-bit offsets for arrays up to 4 GiB: an e4m3 array of 2**31 to 2**32
    elements (DeepSeek-V3's gate|up weights at 128 local experts) would be addressed wrongly, so those
    weights are quantised by XLA, and an explicit request for the kernel is refused."""
    from jax_ep.gemm_fp8 import quantize_weight_blocks_both, weight_quantisation_backend

    assert weight_quantisation_backend((128, 2048, 7168)) == "pallas"      # 1.9e9 elements
    assert weight_quantisation_backend((128, 7168, 4096)) == "reference"   # 3.8e9
    assert weight_quantisation_backend((300, 7168, 4096)) == "pallas"      # 8.8e9: 64-bit offsets
    with pytest.raises(EPValueError, match="cannot address"):
        jax.eval_shape(lambda w: quantize_weight_blocks_both(w, backend="pallas"),
                       jax.ShapeDtypeStruct((128, 7168, 4096), jnp.bfloat16))


def test_quantised_weights_reused_give_the_same_bits_and_errors_name_them():
    """fp8_grouped_matmul(..., quantized=quantize_weights(w)) is the call that quantises w itself, value
    and both gradients bit for bit; no gradient reaches the quantised copy; a copy of another shape or
    type is refused by name."""
    rng = np.random.default_rng(5)
    g, k, n, m = 3, 256, 384, 512
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((g, k, n)) / 16, jnp.bfloat16)
    gs = jnp.asarray([100, 0, 300], jnp.int32)
    q = gemm_fp8.quantize_weights(w)
    assert q.wq_t is None and q.wq.dtype == jnp.float8_e4m3fn     # the reference GEMM reads one layout

    def loss(x, w, q=None):
        out = gemm_fp8.fp8_grouped_matmul(x, w, gs, quantized=q)
        return jnp.sum(out.astype(jnp.float32) * jnp.sin(jnp.arange(n, dtype=jnp.float32)))

    want = jax.jit(jax.value_and_grad(loss, (0, 1)))(x, w)
    got = jax.jit(jax.value_and_grad(loss, (0, 1)))(x, w, q)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        assert np.abs(np.asarray(a, np.float32)).max() > 0
        np.testing.assert_array_equal(np.asarray(b, np.float32), np.asarray(a, np.float32))
    g_q = jax.grad(lambda q: loss(x, w, q))(q)
    assert all(float(jnp.abs(a.astype(jnp.float32)).max()) == 0 for a in jax.tree.leaves(g_q))
    with pytest.raises(ValueError, match=r"quantized.wq must have shape \(3, 256, 384\)"):
        gemm_fp8.fp8_grouped_matmul(x, w, gs, quantized=gemm_fp8.quantize_weights(w[:2]))
    with pytest.raises(TypeError, match="quantized must be a jax_ep.gemm_fp8.FP8Weights"):
        gemm_fp8.fp8_grouped_matmul(x, w, gs, quantized=(q.wq, q.scales))


@pytest.mark.parametrize("kernel", gemm_fp8.DW_KERNELS, ids=lambda k: "_".join(map(str, k)))
def test_fp8_weight_gradient_kernel_lowers_for_hopper(kernel):
    """Each form of the FP8 weight-gradient kernel tools/tune_gemm.py times (stages, tile order) traces
    and lowers for CUDA here, with its Triton quantisers (the GPU test runs the default form)."""
    m, c, n, g = 640, 256, 512, 5
    x = jax.ShapeDtypeStruct((m, c), jnp.float8_e4m3fn)
    xs = jax.ShapeDtypeStruct((m, c // 128), jnp.float32)
    dy = jax.ShapeDtypeStruct((m, n), jnp.bfloat16)
    gs = jax.ShapeDtypeStruct((g,), jnp.int32)
    f = jax.jit(lambda x, xs, dy, gs: gemm_fp8.fp8_weight_gradient(
        x, dy, gs, x_scales=xs, backend="mosaic_gpu", kernel=kernel))
    text = f.trace(x, xs, dy, gs).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and text.count("jax_ep_quantize_rows_t") >= 2


@pytest.mark.parametrize("cached", [False, True], ids=["quantise_w", "cached_w"])
def test_rows_quantised_elsewhere_go_in_as_they_came(cached):
    """fp8_grouped_matmul(x, w, ..., x_fp8=(xq, xs)): rows quantised elsewhere (an FP8 dispatch's) are
    the GEMM's rows as they are: with xq, xs = quantize_gemm_rows(x) the output and the gradients of x
    and w are the bits of the call that quantises x itself (straight through, the same residuals); with
    NaN rows past the groups (capacity rows: also in x, the gradient's anchor) the groups' rows, dx and
    dw are unchanged; the wire's own quantiser's rows give the blockwise definition on exactly those
    values; pairs that do not fit x are named."""
    x, w, sizes = case(3)
    x, wj, gs = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16), jnp.asarray(sizes)
    total = int(sizes.sum())
    q = gemm_fp8.quantize_weights(wj) if cached else None

    def loss(x, w, x_fp8):
        out = gemm_fp8.fp8_grouped_matmul(x, w, gs, quantized=q, x_fp8=x_fp8)
        return jnp.sum(out.astype(jnp.float32) * jnp.cos(jnp.arange(out.shape[1], dtype=jnp.float32))), out

    grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    (_, out0), (dx0, dw0) = grads(x, wj, None)
    (_, out1), (dx1, dw1) = grads(x, wj, gemm_fp8.quantize_gemm_rows(x))
    for a, b in ((out1, out0), (dx1, dx0), (dw1, dw0)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    xq, xs = gemm_fp8.quantize_gemm_rows(x)
    poisoned = (x.at[total:].set(jnp.nan), (xq.at[total:].set(jnp.nan), xs.at[total:].set(jnp.nan)))
    (_, out2), (dx2, dw2) = grads(poisoned[0], wj, poisoned[1])
    np.testing.assert_array_equal(np.asarray(out2[:total], np.float32), np.asarray(out0[:total], np.float32))
    np.testing.assert_array_equal(np.asarray(dx2[:total], np.float32), np.asarray(dx0[:total], np.float32))
    np.testing.assert_array_equal(np.asarray(dw2, np.float32), np.asarray(dw0, np.float32))
    wq, ws = quantize_weight_blocks(wj)
    wire_q, wire_s = quantize_fp8(x)                 # the FP8 wire's quantiser (its amax floor)
    out = gemm_fp8.fp8_grouped_matmul(x.astype(jnp.float32), wj, gs, quantized=q, x_fp8=(wire_q, wire_s))
    want = blockwise(wire_q[:total], wire_s[:total], wq, ws, sizes)
    np.testing.assert_allclose(np.asarray(out)[:total], want, rtol=1e-5, atol=1e-4)
    with pytest.raises(EPValueError, match=r"x_fp8 must be \(float8_e4m3fn \(320, 256\), float32 "
                                           r"\(320, 2\)\)"):
        gemm_fp8.fp8_grouped_matmul(x, wj, gs, x_fp8=(xq, xs[:, :1]))


def test_rows_quantised_elsewhere_lower_for_hopper_under_shard_map(monkeypatch):
    """The x_fp8 form inside shard_map (the MoE layer's FP8 wire on a GPU), its gradient included: traces
    and lowers for CUDA with the Hopper kernels, the GPU-only checks bypassed; only the backward's dy is
    quantised by the live-row kernel (x's rows come quantised)."""
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from jax_ep import gemm as gemm_mod

    monkeypatch.setattr(gemm_fp8, "_kernel_platform", lambda: "")
    monkeypatch.setattr(gemm_mod, "_kernel_platform", lambda: "")
    mesh = Mesh(np.array(jax.devices()[:2]), ("ep",))
    m, k, n, g = 512, 256, 512, 3

    def per_rank(x, xq, xs, w, gs):
        def loss(x, w):
            out = gemm_fp8.fp8_grouped_matmul(x, w, gs[0], backend="mosaic_gpu", x_fp8=(xq, xs))
            return jnp.sum(out.astype(jnp.float32) ** 2)
        return jax.grad(loss, argnums=(0, 1))(x, w)

    f = jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=(P("ep"),) * 5, out_specs=(P("ep"), P("ep"))))
    args = (jax.ShapeDtypeStruct((2 * m, k), jnp.bfloat16),
            jax.ShapeDtypeStruct((2 * m, k), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((2 * m, k // 128), jnp.float32),
            jax.ShapeDtypeStruct((2 * g, k, n), jnp.bfloat16), jax.ShapeDtypeStruct((2, g), jnp.int32))
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("mosaic_gpu") >= 2
    assert text.count("jax_ep_quantize_rows") - text.count("jax_ep_quantize_rows_t") >= 1


@pytest.mark.parametrize("live", [0, 1, 70, 96, 128])
def test_live_row_quantiser_gives_the_reference_bits(live):
    """quantize_gemm_rows(x, live, backend="pallas") (the Triton kernel, interpret mode here): every row
    of every 32-row block that starts below live is quantize_fp8's (the GEMMs' amax floor) bit for bit,
    e4m3 values and scales, including an all-zero 128-channel block and rows of very different scales;
    the blocks from the first at or past live are not computed (left unwritten); shapes the kernel cannot
    take are named."""
    rng = np.random.default_rng(live)
    x = rng.standard_normal((128, 384)) * rng.uniform(1e-3, 1e3, (128, 1))
    x[5, :128] = 0.0
    x = jnp.asarray(x, jnp.bfloat16)
    q0, s0 = gemm_fp8.quantize_gemm_rows(x)
    q1, s1 = jax.jit(lambda x, n: gemm_fp8.quantize_gemm_rows(x, n, backend="pallas", interpret=True))(
        x, jnp.int32(live))
    done = -(-live // gemm_fp8.QUANTIZE_ROWS) * gemm_fp8.QUANTIZE_ROWS
    np.testing.assert_array_equal(np.asarray(q1[:done]).view(np.uint8), np.asarray(q0[:done]).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(s1[:done]), np.asarray(s0[:done]))
    assert gemm_fp8.quantize_rows_fits((128, 384)) and not gemm_fp8.quantize_rows_fits((100, 384))
    with pytest.raises(EPValueError, match=r"M % 32 == 0, got x \(100, 384\)"):
        gemm_fp8.quantize_gemm_rows(x[:100], 3, backend="pallas", interpret=True)
    with pytest.raises(EPValueError, match="'pallas' with live_rows"):
        gemm_fp8.quantize_gemm_rows(x, backend="pallas")


@pytest.mark.parametrize("live", [0, 1, 70, 128])
def test_live_row_dequantiser_gives_the_reference_values(live):
    """dequantize_gemm_rows(xq, xs, live, backend="pallas") (the Triton kernel the bf16 weight gradient
    of the Hopper FP8 GEMMs reads, interpret mode here): the rows below live are the reference's
    (dequantize_fp8 of every row) bit for bit; the kernel leaves the blocks from the first at or past
    live unwritten; shapes it cannot take are named."""
    rng = np.random.default_rng(live + 1)
    x = jnp.asarray(rng.standard_normal((128, 384)) * rng.uniform(1e-3, 1e3, (128, 1)), jnp.bfloat16)
    xq, xs = gemm_fp8.quantize_gemm_rows(x)
    ref = gemm_fp8.dequantize_gemm_rows(xq, xs, live)
    got = jax.jit(lambda q, s, n: gemm_fp8.dequantize_gemm_rows(q, s, n, backend="pallas", interpret=True))(
        xq, xs, jnp.int32(live))
    np.testing.assert_array_equal(np.asarray(got[:live], np.float32), np.asarray(ref[:live], np.float32))
    np.testing.assert_array_equal(np.asarray(ref, np.float32),
                                  np.asarray(dequantize_fp8(xq, xs, jnp.bfloat16), np.float32))
    with pytest.raises(EPValueError, match=r"rows \(100, 384\)"):
        gemm_fp8.dequantize_gemm_rows(xq[:100], xs[:100], 3, backend="pallas", interpret=True)


@pytest.mark.parametrize("weight_grad", ["bf16", "fp8"])
def test_fp8_kernels_take_num_sms_in_every_pass(monkeypatch, weight_grad):
    """fp8_grouped_matmul(num_sms=N) sizes the Hopper kernels' grids of all three passes (the FP8 forward
    and dx, the bf16 or FP8 weight gradient): lowered for CUDA here, each of the three kernels differs
    from its form on every SM, and a bad value is refused naming the argument."""
    from jax_ep import gemm as gemm_mod
    from jax_ep.errors import EPValueError

    monkeypatch.setattr(gemm_fp8, "_kernel_platform", lambda: "")
    monkeypatch.setattr(gemm_mod, "_kernel_platform", lambda: "")
    m, k, n, g = 512, 256, 512, 3

    def kernels(num_sms):
        def loss(x, w, gs):
            out = gemm_fp8.fp8_grouped_matmul(x, w, gs, backend="mosaic_gpu", weight_grad=weight_grad,
                                              num_sms=num_sms)
            return jnp.sum(out.astype(jnp.float32) ** 2)
        text = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(
            jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((g, k, n), jnp.bfloat16),
            jax.ShapeDtypeStruct((g,), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
        return [line for line in text.splitlines() if "custom_call @mosaic_gpu" in line]

    every, fewer = kernels(None), kernels(64)
    assert len(every) == len(fewer) == 3, (len(every), len(fewer))
    assert all(a != b for a, b in zip(every, fewer, strict=True))
    with pytest.raises(EPValueError,
                       match="fp8_grouped_matmul: num_sms must be None or a positive int, got 0"):
        gemm_fp8.fp8_grouped_matmul(jnp.zeros((m, k), jnp.bfloat16), jnp.zeros((g, k, n), jnp.bfloat16),
                                    jnp.array([m, 0, 0], jnp.int32), num_sms=0)
