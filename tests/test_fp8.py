"""FP8 numerics (jax_ep.fp8): what the reference quantiser reads (the stored values, NaN left out of the
amax, as the kernels), and dequantize_fp8's gradients. Findings of a review, 2026-12-05."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import make_cfg, per_rank

import jax_ep
from jax_ep.fp8 import FP8_BLOCK, FP8_MAX, quantize_fp8

R, T, H, E, K = 2, 16, 256, 8, 2


def _bytes(a):
    return np.asarray(a).view(np.uint8)


@pytest.mark.parametrize("op", ["dispatch", "ll_dispatch"])
def test_fp8_dispatch_quantises_the_tokens_as_stored(op):
    """x = a * b computed in bf16 in the same jit as the FP8 dispatch: XLA's excess precision handed the
    reference quantiser the float32 product, not the bf16 token the CUDA wire reads (324 of 32768 e4m3
    bytes and 122 of 256 scales differed from the dispatch of the stored tokens)."""
    rng = np.random.default_rng()
    cfg = make_cfg(num_experts=E, num_topk=K, hidden=H, max_tokens_per_rank=T, backend="reference",
                   dispatch_dtype="float8_e4m3fn")
    a, b = (jnp.asarray(rng.standard_normal((R, T, H)), jnp.bfloat16) for _ in range(2))
    idx = jnp.asarray(np.stack([np.stack([rng.permutation(E)[:K] for _ in range(T)]) for _ in range(R)]),
                      jnp.int32)
    w = jnp.asarray(rng.random((R, T, K)), jnp.float32)
    fn = getattr(jax_ep, op)
    fused = per_rank(lambda a, b, i, w: fn(a * b, i, w, cfg), R)(a, b, idx, w)
    stored = per_rank(lambda x, i, w: fn(x, i, w, cfg), R)(jax.jit(jnp.multiply)(a, b), idx, w)
    np.testing.assert_array_equal(_bytes(fused.x), _bytes(stored.x))
    np.testing.assert_array_equal(np.asarray(fused.scales), np.asarray(stored.scales))


@pytest.mark.parametrize("channel", [3, 127, 200])
@pytest.mark.parametrize("batch", [1, 64])
def test_a_nan_is_left_out_of_the_amax_as_the_kernels_do(channel, batch):
    """The CUDA wire (fmaxf) and the Triton quantisers (maxnumf) leave NaN out of a block's amax: only
    the NaN channel is NaN. XLA's max made the whole block NaN for a token alone, a finite scale in a
    batch of 64, and with the NaN in channel 127 the amax floor (the block's values overflowed to NaN)."""
    rng = np.random.default_rng()
    x = rng.standard_normal((batch, H)).astype(np.float32)
    x[0, channel] = np.nan
    q, scales = quantize_fp8(jnp.asarray(x))
    block = channel // FP8_BLOCK
    finite = np.delete(x[0, block * FP8_BLOCK:(block + 1) * FP8_BLOCK], channel % FP8_BLOCK)
    assert float(scales[0, block]) == np.float32(np.abs(finite).max()) / np.float32(FP8_MAX)
    row = np.asarray(q[0].astype(jnp.float32))
    assert np.isnan(row[channel]) and np.isfinite(np.delete(row, channel)).all()
    clean, clean_scales = quantize_fp8(jnp.asarray(np.where(np.isnan(x), 0.0, x)))
    keep = np.ones(H, bool)
    keep[channel] = False
    np.testing.assert_array_equal(_bytes(q[0])[keep], _bytes(clean[0])[keep])
    np.testing.assert_array_equal(np.asarray(scales), np.asarray(clean_scales))


def test_quantize_fp8_names_a_wrong_shape():
    for shape in [(H,), (2, 3, H)]:
        message = f"quantize_fp8: x must be rows [T, H], got shape {shape}"
        with pytest.raises(ValueError, match=re.escape(message)):
            quantize_fp8(jnp.ones(shape))


def test_dequantize_fp8_is_differentiable_in_the_scales_and_refuses_q():
    """Differentiated through q, dequantize_fp8(*quantize_fp8(x)) gave NaN gradients (an e4m3 cotangent
    overflows above 448; |x|~300 with loss 1000*sum: 256 of 256 NaN) or a rounded one (0.89-1.15 where
    straight-through is 1). Now q refuses; the scales' gradient is exact."""
    rng = np.random.default_rng()
    x = jnp.asarray(rng.standard_normal((4, 200)) * 300, jnp.float32)
    q, scales = quantize_fp8(x)
    with pytest.raises(NotImplementedError, match=r"dequantize_fp8 is not differentiable in q"):
        jax.grad(lambda x: (1000 * jax_ep.dequantize_fp8(*quantize_fp8(x))).sum())(x)
    coef = jnp.asarray(rng.standard_normal((4, 200)), jnp.float32)
    for dtype in (jnp.float32, jnp.bfloat16):
        def loss(s, dtype=dtype):
            return (jax_ep.dequantize_fp8(q, s, dtype).astype(jnp.float32) * coef).sum()
        got = jax.grad(loss)(scales)
        deq = np.asarray(q.astype(jnp.float32), np.float64) * np.asarray(coef, np.float64)
        blocks = [deq[:, :128], deq[:, 128:]]
        want = np.stack([b.sum(1) for b in blocks], axis=1)
        terms = np.stack([np.abs(b).sum(1) for b in blocks], axis=1)
        # the error follows the terms, not the sum: float32 sums of up to 128 products (~1e-6 of their
        # abs sum), and in bf16 the cotangent rounded to bf16 (at most 2**-9 of each product: under half
        # of 2**-8). A zero, a wrong block's or an unscaled gradient is off by ~|want|, ~10% of the terms
        tol = 1e-5 if dtype == jnp.float32 else 2**-8
        # |got - want| <= tol * (terms + |want|) elementwise, as a ratio (assert_allclose wants a scalar atol)
        np.testing.assert_allclose(np.asarray(got) / terms, want / terms, rtol=tol, atol=tol,
                                   err_msg=f"{dtype.__name__}: gradient / sum|q * coef| of its block")
    # the forward is what it was, and a straight-through estimate as the message writes it works
    np.testing.assert_array_equal(
        np.asarray(jax_ep.dequantize_fp8(q, scales)),
        np.asarray(q.astype(jnp.float32)) * np.repeat(np.asarray(scales), 128, axis=1)[:, :200])
    sg = jax.lax.stop_gradient
    st = jax.grad(lambda x: (x + sg(jax_ep.dequantize_fp8(*quantize_fp8(sg(x))) - x)).sum())(x)
    np.testing.assert_array_equal(np.asarray(st), np.ones(x.shape, np.float32))


def test_dequantize_fp8_differentiates_in_the_scales_in_an_eager_shard_map():
    """Not jitted, inside shard_map: the guard on q must not stop the scales' gradient (a custom_vjp with
    symbolic zeros raised JAX's "not implemented with shard_map" there)."""
    rng = np.random.default_rng()
    q, scales = quantize_fp8(jnp.asarray(rng.standard_normal((R * 4, H)), jnp.float32))
    coef = jnp.asarray(rng.standard_normal((R * 4, H)), jnp.float32)

    def loss(s):
        per = per_rank(lambda q, s, c: (jax_ep.dequantize_fp8(q, s) * c).sum(), R, jit=False)
        return per(q.reshape(R, 4, H), s.reshape(R, 4, -1), coef.reshape(R, 4, H)).sum()
    got = np.asarray(jax.grad(loss)(scales))
    deq = (np.asarray(q.astype(jnp.float32), np.float64) * np.asarray(coef, np.float64)).reshape(
        R * 4, -1, FP8_BLOCK)
    # float32 sums of 128 terms: the error scales with the terms' magnitudes, not the sum's (CI saw
    # 4.3e-4 on a sum of -19.7 whose terms reach ~1000)
    np.testing.assert_allclose(got, deq.sum(-1), rtol=1e-5, atol=1e-5 * np.abs(deq).sum(-1).max())


def test_fp8_rows_used_outside_the_gradient_do_not_raise():
    """Only a gradient that reaches the e4m3 rows raises (dispatch's backward, dequantize_fp8's guard):
    an FP8 dispatch, or dequantize_fp8 of its rows, as a metric under value_and_grad(has_aux=True) or
    behind a stop_gradient, with x carrying a tangent, runs (the forward-rule raises of d164f46 refused
    these; found by a review, 2026-12-05)."""
    rng = np.random.default_rng()
    cfg = make_cfg(num_experts=E, num_topk=K, hidden=H, max_tokens_per_rank=T, backend="reference",
                   dispatch_dtype="float8_e4m3fn")
    x = jnp.asarray(rng.standard_normal((R, T, H)), jnp.float32)
    idx = jnp.asarray(np.stack([np.stack([rng.permutation(E)[:K] for _ in range(T)]) for _ in range(R)]),
                      jnp.int32)
    w = jnp.asarray(rng.random((R, T, K)), jnp.float32)
    rows = per_rank(lambda x, i, w: (lambda d: jax_ep.dequantize_fp8(d.x, d.scales))(
        jax_ep.dispatch(x, i, w, cfg)), R)

    def loss(x):
        return (x ** 2).sum(), rows(x, idx, w).sum()
    (value, metric), g = jax.value_and_grad(loss, has_aux=True)(x)
    np.testing.assert_array_equal(np.asarray(g), 2 * np.asarray(x))
    assert np.isfinite(float(metric)) and float(metric) == float(rows(x, idx, w).sum())
    g = jax.grad(lambda x: (x ** 2).sum() + jax.lax.stop_gradient(rows(x, idx, w).sum()))(x)
    np.testing.assert_array_equal(np.asarray(g), 2 * np.asarray(x))
    with pytest.raises(NotImplementedError, match="forward-only"):
        jax.grad(lambda x: rows(x, idx, w).sum())(x)


@pytest.mark.parametrize("ep_size", [1, 2])
def test_fp8_wire_under_a_remat_policy_inside_shard_map(ep_size):
    """The FP8 wire's rows kept by jax_ep.remat.policy() in a jax.checkpoint inside shard_map came back as
    garbage: NaN values and gradients where no policy, or plain jax.checkpoint, gave the right ones (found
    by a fuzzer of the MoE layer, 2026-12-06). The ops now name an FP8 array as its bits
    (jax_ep.remat.named). Only the live rows (below the groups' sum) enter the loss."""
    rng = np.random.default_rng()
    tokens, hidden, experts = 3, 128, 2 * ep_size
    cfg = jax_ep.EPConfig(experts, 1, hidden, tokens, dispatch_dtype="float8_e4m3fn", backend="reference")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:ep_size]), ("ep",))
    x = jnp.asarray(rng.normal(size=(ep_size * tokens, hidden)), jnp.float32)
    idx = jnp.asarray(rng.integers(0, experts, size=(ep_size * tokens, 1)), jnp.int32)
    w = jnp.ones((ep_size * tokens, 1), jnp.float32)

    def loss(x, idx, w):
        d, rows = jax_ep.ops.dispatch_straight_through(x, idx, w, cfg)
        live = jnp.arange(rows.shape[0]) < jnp.sum(d.group_sizes)
        return jnp.sum(jnp.where(live[:, None], rows * rows, 0.0))

    results = []
    for policy in (None, jax_ep.remat.policy()):
        body = jax.shard_map(lambda *a, p=policy: jax.lax.psum(jax.checkpoint(loss, policy=p)(*a), "ep"),
                             mesh=mesh, in_specs=(jax.sharding.PartitionSpec("ep"),) * 3,
                             out_specs=jax.sharding.PartitionSpec())
        value, dx = jax.jit(jax.value_and_grad(body))(x, idx, w)
        assert np.isfinite(float(value)) and np.isfinite(np.asarray(dx)).all(), policy
        results.append((float(value), np.asarray(dx)))
    assert results[0][0] == results[1][0] > 0
    np.testing.assert_array_equal(results[0][1], results[1][1])
