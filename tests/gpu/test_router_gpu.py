"""The router's GEMMs on a GPU: the bf16 router's backward runs as bfloat16 GEMMs of the gradient's parts
(moe.router_grads_split) and gives the float64 gradients rounded to bf16 for nearly every element, closer
than a TF32 GEMM of the float32 gradient (emulated) and than XLA's own backward of the GEMM."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_ep.moe import _logits, router_logits

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def gpu():
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")


@pytest.mark.parametrize("t,h,e", [(4096, 7168, 256), (1024, 4096, 64)])
def test_router_gradients_take_the_bf16_parts_on_the_gpu(t, h, e):
    kx, kr, kg = jax.random.split(jax.random.key(t + e), 3)
    x = jax.random.normal(kx, (t, h), jnp.bfloat16)
    router = (h ** -0.5 * jax.random.normal(kr, (h, e))).astype(jnp.bfloat16)
    g = jax.random.normal(kg, (t, e), jnp.float32) * jnp.exp(jax.random.normal(kr, (t, e)))

    grads = jax.jit(jax.grad(lambda x, r: jnp.sum(router_logits(x, r) * g), (0, 1)))
    xla = jax.jit(lambda x, r: jax.vjp(_logits, x, r)[1](g))  # JAX's own backward of the same GEMM
    x64, r64, g64 = (np.asarray(a, np.float64) for a in (x, router, g))
    tf32 = np.asarray(jax.lax.reduce_precision(g, exponent_bits=8, mantissa_bits=10), np.float64)
    bf16 = lambda a: np.asarray(jnp.asarray(a, jnp.float32).astype(jnp.bfloat16), np.float64)  # noqa: E731
    for got, theirs, exact, near in zip(grads(x, router), xla(x, router), (g64 @ r64.T, x64.T @ g64),
                                        (tf32 @ r64.T, x64.T @ tf32), strict=True):
        same = np.mean(np.asarray(got, np.float64) == bf16(exact))
        assert same > 0.99 and same > np.mean(bf16(near) == bf16(exact)), same
        assert same > np.mean(np.asarray(theirs, np.float64) == bf16(exact)), "closer than XLA's GEMMs"
