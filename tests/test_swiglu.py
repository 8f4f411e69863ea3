"""jax_ep.swiglu on CPU: the Pallas kernels (interpret mode) against XLA's silu(gate) * up, forward and
gradient, over the live rows; their Triton lowering for CUDA; the arguments it refuses."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_ep.errors import EPValueError
from jax_ep.swiglu import Tiling, kernel_unfit, swiglu


def _f32(a):
    return np.asarray(a, np.float32)


@pytest.mark.parametrize("tiling", [Tiling(), Tiling(rows=64, cols=256, warps=8)], ids=["default", "64x256"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("m,f,live", [(256, 128, 150), (192, 192, 192), (128, 64, 0), (320, 320, 64)])
def test_kernels_match_xla_over_the_live_rows(dtype, m, f, live, tiling):
    """Forward and gradient of the Pallas kernels: the float64 formula rounded once, and XLA's
    silu(gate) * up, in every row of the blocks that start below live (the rest the kernels leave
    alone)."""
    rng = np.random.default_rng(m + f + live)
    gu = jnp.asarray(rng.standard_normal((m, 2 * f)) * 3, dtype)
    dh = jnp.asarray(rng.standard_normal((m, f)), dtype)
    n = jnp.int32(live)

    def both(backend):
        h, vjp = jax.vjp(lambda a: swiglu(a, n, backend=backend, interpret=True, tiling=tiling), gu)
        return _f32(h), _f32(vjp(dh)[0])

    (h, d), (h_ref, d_ref) = both("pallas"), both("xla")
    covered = -(-live // tiling.rows) * tiling.rows   # the row blocks that start below live
    # the kernels round once from float32: within one rounding of the float64 formula
    g, u, dhf = (np.asarray(a, np.float64) for a in (gu[:covered, :f], gu[:covered, f:], dh[:covered]))
    s = 1 / (1 + np.exp(-g))
    one = dict(rtol=2**-7, atol=1e-30) if dtype == jnp.bfloat16 else dict(rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(h[:covered], g * s * u, **one)
    np.testing.assert_allclose(d[:covered, f:], dhf * g * s, **one)
    np.testing.assert_allclose(d[:covered, :f], dhf * u * s * (1 + g * (1 - s)), **one)
    # XLA's (bf16: rounded after every op) agrees in norm
    for got, want in ((h, h_ref), (d, d_ref)):
        err = np.linalg.norm(got[:covered] - want[:covered]) / max(np.linalg.norm(want[:covered]), 1e-30)
        assert err < (1e-2 if dtype == jnp.bfloat16 else 1e-6), err


@pytest.mark.parametrize("tiling", [Tiling(), Tiling(rows=64, cols=256, warps=8)], ids=["default", "64x256"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("m,f,live", [(256, 128, 150), (192, 320, 192), (128, 64, 0)])
def test_row_scale_kernels_match_the_formula_over_the_live_rows(dtype, m, f, live, tiling):
    """row_scale w (the gate weights applied in the experts): h = w * silu(g) * u rounded once; its
    gradient d gate_up = the unscaled one's formula with w * dh, d w = the float32 dot product of the
    row's silu(g) * u and dh (per column block, summed) against the float64 formula, in every row of the
    blocks that start below live; XLA's form agrees; weights of both signs and some zero (padding rows),
    NaN in the rows past the live blocks (what the GEMM leaves there) reaching no live row."""
    rng = np.random.default_rng(7 * m + f + live)
    gu = rng.standard_normal((m, 2 * f)) * 3
    covered = -(-live // tiling.rows) * tiling.rows   # the row blocks that start below live
    gu[covered:] = np.nan
    gu = jnp.asarray(gu, dtype)
    w = rng.standard_normal(m).astype(np.float32)
    w[::5] = 0.0
    dh = jnp.asarray(rng.standard_normal((m, f)), dtype)
    n = jnp.int32(live)

    def run(backend):
        fn = lambda a, w: swiglu(a, n, backend=backend, interpret=True, tiling=tiling, row_scale=w)  # noqa: E731
        h, vjp = jax.vjp(fn, gu, jnp.asarray(w))
        d_gu, d_w = vjp(dh)
        return _f32(h)[:covered], _f32(d_gu)[:covered], _f32(d_w)[:covered]

    (h, d, dw), (h_x, d_x, dw_x) = run("pallas"), run("xla")
    g, u, dhf = (np.asarray(a, np.float64) for a in (gu[:covered, :f], gu[:covered, f:], dh[:covered]))
    wf = w[:covered, None].astype(np.float64)
    s = 1 / (1 + np.exp(-g))
    one = dict(rtol=2**-7, atol=1e-30) if dtype == jnp.bfloat16 else dict(rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(h, wf * g * s * u, **one)
    np.testing.assert_allclose(d[:, f:], wf * dhf * g * s, **one)
    np.testing.assert_allclose(d[:, :f], wf * dhf * u * s * (1 + g * (1 - s)), **one)
    want_dw = np.sum(g * s * u * dhf, axis=1)
    np.testing.assert_allclose(dw, want_dw, rtol=1e-4, atol=1e-4 * np.abs(want_dw).max(initial=1.0))
    assert (h[w[:covered] == 0] == 0).all()
    for got, want in ((h, h_x), (d, d_x)):
        np.testing.assert_allclose(got, want, rtol=2**-7 if dtype == jnp.bfloat16 else 1e-5, atol=1e-5)
    # (float32 sums of F products in other orders)
    np.testing.assert_allclose(dw, dw_x, rtol=1e-4, atol=1e-5 * np.abs(dw_x).max(initial=1.0))


@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "row_scale"])
@pytest.mark.parametrize("tiling", [Tiling(), Tiling(rows=32, cols=512, warps=8)], ids=["default", "32x512"])
def test_the_kernels_lower_to_triton_for_cuda(monkeypatch, tiling, scaled):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")    # lowering needs no GPU
    gu = jax.ShapeDtypeStruct((4096, 2 * 2048), jnp.bfloat16)
    dh = jax.ShapeDtypeStruct((4096, 2048), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((4096,), jnp.float32)

    def step(a, w, d):
        fn = lambda a, w: swiglu(a, jnp.int32(1000), backend="pallas", tiling=tiling,  # noqa: E731
                                 row_scale=w if scaled else None)
        return jax.vjp(fn, a, w)[1](d)

    text = jax.jit(step).trace(gu, w, dh).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("triton") >= 2, text[:2000]


def test_arguments_it_refuses_name_the_value():
    with pytest.raises(EPValueError, match="backend must be one of"):
        swiglu(jnp.ones((64, 128)), 3, backend="cuda")
    with pytest.raises(EPValueError, match="even width"):
        swiglu(jnp.ones((64, 127)), 3)
    with pytest.raises(EPValueError, match="M=100 are not a multiple of 32"):
        swiglu(jnp.ones((100, 128)), 3, backend="pallas", interpret=True)
    with pytest.raises(EPValueError, match="runs Triton kernels on a GPU; the default platform is 'cpu'"):
        swiglu(jnp.ones((64, 128)), 3, backend="pallas")
    with pytest.raises(EPValueError, match=r"row_scale must be float32 \[64\] \(one per row of gate_up\), "
                                           r"got bfloat16 \(64,\)"):
        swiglu(jnp.ones((64, 128)), 3, row_scale=jnp.ones((64,), jnp.bfloat16))
    # found by a review (2026-12-05): a bare unpacking error; a list row_scale an AttributeError; a
    # live_rows of group sizes ignored by "xla" (what auto runs off Hopper) and a TypeError on Hopper
    for shape in ((2, 64, 128), (64,)):
        with pytest.raises(EPValueError, match=rf"gate_up must be \[M, 2F\].*got {re.escape(str(shape))}"):
            swiglu(jnp.ones(shape), 3)
    with pytest.raises(EPValueError, match=r"row_scale must be float32 \[64\] .*got list"):
        swiglu(jnp.ones((64, 128)), 3, row_scale=[1.0] * 64)
    for live, got in ((jnp.array([4, 4, 4, 4]), r"int32 of shape \(4,\)"), (10.7, r"float of shape \(\)")):
        for backend in ("xla", "pallas"):
            with pytest.raises(EPValueError, match=rf"live_rows must be an integer scalar .*got {got}"):
                swiglu(jnp.ones((64, 128)), live, backend=backend, interpret=True)
    assert swiglu(jnp.ones((64, 128)), jnp.int32(3)).shape == (64, 64)
    assert kernel_unfit((128, 2 * 96)) == "its half width F=96 is not a multiple of 64"
    assert kernel_unfit((128, 256)) == ""
    # found by a review (2026-12-05): no rows was taken (a grid of no programs; interpret mode failed),
    # and a tiling Triton refuses only at lowering
    assert kernel_unfit((0, 256)) == "gate_up (0, 256) has no elements"
    assert kernel_unfit((96, 256), Tiling(rows=48)) == "Tiling.rows=48 is not a power of 2"
    assert kernel_unfit((128, 384), Tiling(cols=96)) == "Tiling.cols=96 is not a power of 2"


def test_the_expert_block_with_the_pallas_swiglu_matches_xla(monkeypatch):
    """expert_block(swiglu_backend="pallas") (the kernels in interpret mode here): output and gradients
    of the rows that hold rows and of both weights as with XLA's SwiGLU."""
    import functools

    from jax_ep import moe
    from jax_ep import swiglu as swiglu_module

    monkeypatch.setattr(moe, "swiglu", functools.partial(swiglu_module.swiglu, interpret=True))
    rng = np.random.default_rng(5)
    m, h, f, g = 256, 64, 64, 4
    sizes = jnp.asarray([40, 0, 70, 50], jnp.int32)       # 160 live rows, 96 past them
    rows = jnp.asarray(rng.standard_normal((m, h)), jnp.float32)
    w1 = jnp.asarray(rng.standard_normal((g, h, 2 * f)) / 8, jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((g, f, h)) / 8, jnp.float32)

    def run(backend):
        def loss(rows, w1, w2):
            y = moe.expert_block(rows, w1, w2, sizes, gemm="ragged_dot", swiglu_backend=backend)
            return jnp.sum(y[:160] ** 2), y
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(rows, w1, w2)

    ((got, y), grads), ((want, y_ref), grads_ref) = run("pallas"), run("xla")
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(y[:160]), np.asarray(y_ref[:160]), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(grads[0][:160]), np.asarray(grads_ref[0][:160]),
                               rtol=1e-4, atol=1e-5)
    for a, b in zip(grads[1:], grads_ref[1:], strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_the_layer_passes_its_swiglu_backend_to_the_experts(monkeypatch):
    from flax import nnx
    from jax.sharding import Mesh

    from jax_ep import moe
    from jax_ep.gating import RouterConfig

    seen = []

    def recording(gate_up, live_rows, *, backend, row_scale=None):
        seen.append(backend)
        return swiglu(gate_up, live_rows, backend="xla", row_scale=row_scale)

    monkeypatch.setattr(moe, "swiglu", recording)
    mesh = Mesh(np.array(jax.devices()[:4]), ("ep",))
    x = jax.random.normal(jax.random.key(3), (4 * 32, 128), jnp.float32)
    for kwargs, want in ((dict(swiglu_backend="pallas"), "pallas"), ({}, "auto"),
                         # FP8 GEMMs: "auto" too (the rows the kernels leave unwritten reach no sum)
                         (dict(dtype="bfloat16", gemm_dtype="float8_e4m3fn"), "auto")):
        layer = moe.MoE(128, 128, RouterConfig(8, 2), rngs=nnx.Rngs(0), mesh=mesh,
                        ep=moe.EPOptions(backend="reference"), **kwargs)
        assert layer.swiglu_backend == kwargs.get("swiglu_backend", "auto")
        graphdef, state = nnx.split(layer)   # traced only: the backend is handed over at trace time
        jax.eval_shape(lambda state, x, g=graphdef: nnx.merge(g, state)(x, update_stats=False), state, x)
        assert seen.pop() == want, kwargs
    with pytest.raises(EPValueError, match="swiglu_backend must be one of"):
        moe.MoE(64, 64, RouterConfig(8, 2), rngs=nnx.Rngs(0), mesh=mesh, swiglu_backend="triton")


def test_auto_takes_the_kernels_on_hopper_only(monkeypatch):
    """choose: XLA off GPUs, off Hopper and for shapes the kernels cannot take; the kernels on Hopper."""
    from jax_ep import swiglu as swiglu_module

    assert swiglu_module.choose((4096, 4096))[0] == "xla"   # CPU here
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    for capability, want in (("8.0", "xla"), ("10.0", "xla"), ("9.0", "pallas")):   # (9.0 stays)
        device = type("Device", (), dict(compute_capability=capability, device_kind="GPU"))()
        monkeypatch.setattr(jax, "devices", lambda device=device: [device])
        assert swiglu_module.choose((4096, 4096))[0] == want, capability
    backend, why = swiglu_module.choose((4100, 4096))
    assert backend == "xla" and "M=4100" in why
    assert swiglu_module.choose((4096, 4096), Tiling(rows=64))[0] == "pallas"


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "row_scale"])
@pytest.mark.parametrize("m,f,live", [(256, 384, 200), (128, 128, 128), (96, 256, 0)])
def test_swiglu_rows_fp8_are_the_live_row_quantisers_bits(m, f, live, scaled, dtype):
    """swiglu_rows_fp8 (interpret mode): over the row blocks below live_rows, the e4m3 rows and scales
    quantize_gemm_rows' kernel makes of the SwiGLU kernel's h, bit for bit, row scale or not; outputs of
    the shapes the FP8 GEMM takes."""
    from jax_ep.gemm_fp8 import quantize_gemm_rows
    from jax_ep.swiglu import swiglu_rows_fp8

    rng = np.random.default_rng(m + f + live)
    gate_up = jnp.asarray(3 * rng.standard_normal((m, 2 * f)), dtype)
    row_scale = jnp.asarray(rng.random(m), jnp.float32) if scaled else None
    n = jnp.int32(live)
    h = swiglu(gate_up, n, backend="pallas", interpret=True, row_scale=row_scale)
    want_q, want_s = quantize_gemm_rows(h, n, backend="pallas", interpret=True)
    q, s = swiglu_rows_fp8(gate_up, n, row_scale=row_scale, interpret=True)
    assert q.dtype == jnp.float8_e4m3fn and q.shape == (m, f) and s.dtype == jnp.float32
    assert s.shape == (m, f // 128)
    rows = -(-live // 32) * 32
    if rows:
        assert _f32(want_q[:rows]).any() and np.abs(_f32(want_q[:rows])).max() == 448.0
    np.testing.assert_array_equal(_f32(q[:rows]), _f32(want_q[:rows]))
    np.testing.assert_array_equal(np.asarray(s[:rows]), np.asarray(want_s[:rows]))


def test_swiglu_rows_fp8_refuses_shapes_it_cannot_take():
    from jax_ep.swiglu import swiglu_rows_fp8

    for shape in ((64, 192), (64, 257), (48, 256), (256,)):
        with pytest.raises(EPValueError, match=rf"F % 128 == 0, M % 32 == 0 .*got \({shape[0]},"):
            swiglu_rows_fp8(jnp.zeros(shape, jnp.bfloat16), 64, interpret=True)
    with pytest.raises(EPValueError, match=r"row_scale must be float32 \[64\]"):
        swiglu_rows_fp8(jnp.zeros((64, 256), jnp.bfloat16), 64, row_scale=jnp.ones(64, jnp.bfloat16),
                        interpret=True)


@pytest.mark.parametrize("fp8_weight_grad", [False, True], ids=["dw_bf16", "dw_fp8"])
def test_fp8_expert_block_with_swiglus_fp8_rows_gives_the_same_bits(monkeypatch, fp8_weight_grad):
    """expert_block with FP8 GEMMs where the down GEMM's rows come from swiglu_rows_fp8 (the kernels in
    interpret mode, forced on here; on a Hopper GPU ``fp8_rows_from_swiglu`` decides): loss and every
    gradient bit for bit as when the FP8 GEMM quantises SwiGLU's h itself (on CPU with XLA's quantiser,
    which divides in IEEE as the kernel's does)."""
    import functools

    from jax_ep import moe
    from jax_ep import swiglu as swiglu_module

    monkeypatch.setattr(moe, "swiglu", functools.partial(swiglu_module.swiglu, interpret=True))
    monkeypatch.setattr(moe, "swiglu_rows_fp8", functools.partial(swiglu_module.swiglu_rows_fp8,
                                                                  interpret=True))
    rng = np.random.default_rng(8)
    m, h, f, g = 256, 128, 256, 4
    sizes = jnp.asarray([40, 0, 100, 84], jnp.int32)       # 224 live rows, one block past them
    rows = jnp.asarray(rng.standard_normal((m, h)), jnp.bfloat16)
    w1 = jnp.asarray(rng.standard_normal((g, h, 2 * f)) / 8, jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((g, f, h)) / 8, jnp.bfloat16)
    weights = jnp.asarray(rng.random(m), jnp.float32)

    def run(fused):
        monkeypatch.setattr(moe._ExpertGEMMs, "fp8_rows_from_swiglu", lambda *_: fused)

        def loss(rows, w1, w2, weights):
            y = moe.expert_block(rows, w1, w2, sizes, gemm="ragged_dot", gemm_dtype="float8_e4m3fn",
                                 swiglu_backend="pallas", row_weights=weights,
                                 fp8_weight_grad=fp8_weight_grad)
            return jnp.sum(y[:224].astype(jnp.float32) ** 2)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(rows, w1, w2, weights)

    (got, grads), (want, grads_ref) = run(True), run(False)
    assert float(want) > 0 and float(got) == float(want)
    live = lambda d: (d[0][:224], d[1], d[2], d[3][:224])  # noqa: E731  (rows past the groups: unspecified)
    for a, b in zip(live(grads), live(grads_ref), strict=True):
        assert np.abs(_f32(b)).max() > 0
        np.testing.assert_array_equal(_f32(a), _f32(b))


def test_fp8_rows_from_swiglu_needs_the_kernels_on_both_sides(monkeypatch):
    """_ExpertGEMMs.fp8_rows_from_swiglu: only with FP8 GEMMs, SwiGLU's kernels and the FP8 GEMM's live-row
    quantiser (a Hopper GPU); never on CPU."""
    from jax_ep import moe

    fp8, bf16 = moe._ExpertGEMMs(gemm_dtype="float8_e4m3fn"), moe._ExpertGEMMs()
    shapes = ((256, 512), (4, 256, 128))
    assert not fp8.fp8_rows_from_swiglu(*shapes, "auto")      # CPU: XLA's SwiGLU, the reference GEMM
    monkeypatch.setattr(moe, "live_rows_quantiser", lambda *_: "pallas")
    # XLA's SwiGLU rounds after each op: its h is not the kernel's, whose bits the fused rows are
    assert not fp8.fp8_rows_from_swiglu(*shapes, "xla") and fp8.fp8_rows_from_swiglu(*shapes, "pallas")
    monkeypatch.setattr(moe, "swiglu_resolve", lambda shape, backend: "pallas")
    assert fp8.fp8_rows_from_swiglu(*shapes, "auto") and not bf16.fp8_rows_from_swiglu(*shapes, "auto")
    monkeypatch.setattr(moe, "live_rows_quantiser", lambda *_: "reference")
    assert not fp8.fp8_rows_from_swiglu(*shapes, "pallas")


@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "row_scale"])
def test_swiglu_rows_fp8_lowers_to_triton_for_cuda(monkeypatch, scaled):
    """The kernel's CUDA lowering (its IEEE divisions as inline PTX, which interpret mode never runs)."""
    from jax_ep.swiglu import swiglu_rows_fp8

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")    # lowering needs no GPU
    gu = jax.ShapeDtypeStruct((4096, 2 * 2048), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((4096,), jnp.float32)
    fn = jax.jit(lambda a, w: swiglu_rows_fp8(a, jnp.int32(1000), row_scale=w if scaled else None))
    text = fn.trace(gu, w).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text and "jax_ep_swiglu_fp8" in text, text[:2000]
