"""jax_ep.swiglu's Triton kernels on a GPU: forward and gradient against the float64 formula over the
live rows, with NaN past them (never reaching the live rows); the expert block with them against XLA's
SwiGLU, on the Hopper GEMM kernels."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_ep import moe
from jax_ep.swiglu import TILING, Tiling, swiglu

# the default (32x128, tools/tune_swiglu.py's pick, 2026-11-30) and the previous one, 64x256
TILINGS = [TILING, Tiling(rows=64, cols=256, warps=4)]
TILING_IDS = ["default", "t64x256"]

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def gpu():
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")


@pytest.mark.parametrize("tiling", TILINGS, ids=TILING_IDS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("m,f,live", [(4096, 2048, 2500), (2048, 704, 2048), (1024, 256, 0)])
def test_kernels_match_the_formula_over_the_live_rows(dtype, m, f, live, tiling):
    rng = np.random.default_rng(m + f + live)
    gu = jnp.asarray(rng.standard_normal((m, 2 * f)) * 3, dtype).at[live:].set(jnp.nan)
    dh = jnp.asarray(rng.standard_normal((m, f)), dtype).at[live:].set(jnp.nan)
    h, vjp = jax.vjp(lambda a: swiglu(a, jnp.int32(live), backend="pallas", tiling=tiling), gu)
    d = np.asarray(jax.jit(vjp)(dh)[0], np.float32)
    h = np.asarray(h, np.float32)
    g, u, dhf = (np.asarray(a[:live], np.float64) for a in (gu[:, :f], gu[:, f:], dh))
    s = 1 / (1 + np.exp(-g))
    one = dict(rtol=2**-7, atol=1e-30) if dtype == jnp.bfloat16 else dict(rtol=2e-6, atol=1e-6)
    np.testing.assert_allclose(h[:live], g * s * u, **one)
    np.testing.assert_allclose(d[:live, f:], dhf * g * s, **one)
    np.testing.assert_allclose(d[:live, :f], dhf * u * s * (1 + g * (1 - s)), **one)
    covered = -(-live // tiling.rows) * tiling.rows
    assert covered == live or not np.isfinite(h[live:covered]).any()   # the boundary block: computed NaN


@pytest.mark.parametrize("tiling", TILINGS, ids=TILING_IDS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("m,f,live", [(4096, 2048, 2500), (2048, 704, 2048)])
def test_row_scale_kernels_match_the_formula_over_the_live_rows(dtype, m, f, live, tiling):
    """row_scale (the gate weights in the experts): h = w * silu(g) * u, d gate_up with w * dh, d w the
    row's dot product of silu(g) * u and dh, against the float64 formula; weights of both signs and
    zeros; NaN past live never reaching a live row."""
    rng = np.random.default_rng(3 * m + f + live)
    gu = jnp.asarray(rng.standard_normal((m, 2 * f)) * 3, dtype).at[live:].set(jnp.nan)
    dh = jnp.asarray(rng.standard_normal((m, f)), dtype).at[live:].set(jnp.nan)
    w = rng.standard_normal(m).astype(np.float32)
    w[::7] = 0.0
    fn = lambda a, w: swiglu(a, jnp.int32(live), backend="pallas", tiling=tiling, row_scale=w)  # noqa: E731
    h, vjp = jax.vjp(fn, gu, jnp.asarray(w))
    d, dw = (np.asarray(a, np.float32) for a in jax.jit(vjp)(dh))
    h = np.asarray(h, np.float32)
    g, u, dhf = (np.asarray(a[:live], np.float64) for a in (gu[:, :f], gu[:, f:], dh))
    wf = w[:live, None].astype(np.float64)
    s = 1 / (1 + np.exp(-g))
    one = dict(rtol=2**-7, atol=1e-30) if dtype == jnp.bfloat16 else dict(rtol=2e-6, atol=1e-6)
    np.testing.assert_allclose(h[:live], wf * g * s * u, **one)
    np.testing.assert_allclose(d[:live, f:], wf * dhf * g * s, **one)
    np.testing.assert_allclose(d[:live, :f], wf * dhf * u * s * (1 + g * (1 - s)), **one)
    want_dw = np.sum(g * s * u * dhf, axis=1)
    np.testing.assert_allclose(dw[:live], want_dw, rtol=1e-4, atol=1e-5 * np.abs(want_dw).max())


@pytest.mark.parametrize("tiling", TILINGS, ids=TILING_IDS)
@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "row_weights"])
def test_expert_block_with_the_kernels_matches_xla_swiglu(tiling, scaled, monkeypatch):
    """At a layer-like shape with capacity padding past the groups (the gate|up GEMM leaves it unwritten):
    output token rows and gradients of the rows and weights as with XLA's SwiGLU."""
    rng = np.random.default_rng(11)
    m, h, f, g = 8192, 1024, 512, 16
    sizes = (np.diff(np.concatenate([[0], np.sort(rng.integers(0, 60, g - 1)), [60]])) * 64).astype(np.int32)
    total = int(sizes.sum())
    gs = jnp.asarray(sizes)
    rows = jnp.asarray(rng.standard_normal((m, h)), jnp.bfloat16).at[total:].set(jnp.nan)
    w1 = jnp.asarray(rng.standard_normal((g, h, 2 * f)) / np.sqrt(h), jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((g, f, h)) / np.sqrt(f), jnp.bfloat16)
    dy = jnp.asarray(rng.standard_normal((m, h)), jnp.bfloat16)
    # the gate weights (row_weights: 0 past the groups, as dispatch's handle has them)
    rw = jnp.asarray(np.where(np.arange(m) < total, rng.uniform(0.05, 1.0, m), 0.0), jnp.float32)

    monkeypatch.setattr(moe, "swiglu", functools.partial(moe.swiglu, tiling=tiling))

    def run(backend):
        def f_(rows, w1, w2, rw):
            return moe.expert_block(rows, w1, w2, gs, gemm="mosaic_gpu", swiglu_backend=backend,
                                    row_weights=rw if scaled else None)
        y, vjp = jax.vjp(f_, rows, w1, w2, rw)
        return [np.asarray(a, np.float32) for a in (y, *jax.jit(vjp)(dy))]

    got, want = run("pallas"), run("xla")
    names = ("y", "d rows", "d w_gate_up", "d w_down", "d row_weights")
    for name, a, b in zip(names, got, want, strict=True):
        if name == "d row_weights" and not scaled:
            continue
        a, b = (a[:total], b[:total]) if name in ("y", "d rows", "d row_weights") else (a, b)
        assert np.isfinite(a).all(), name
        err = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)
        assert err < 1e-2, (name, err)
