"""The rank-major kernels (dispatch_rank_major / combine_rank_major / broadcast_rank_major with
backend='cuda') against the reference path on 2 GPUs.

Bit-exact: every dispatch output (all R*T rows: the empty ones are zero / -1 / 0), every handle
field, combine_rank_major (whole rows added in rank order in float32: no multiply-add to contract;
the expert kernel's empty rows hold NaN, which must never be read) and broadcast_rank_major. FP8
rows and scales: the same bits as an IEEE float32 NumPy quantisation (XLA's GPU division may differ
from IEEE in a few elements, as for the expert-major dispatch). Gradients through dispatch ->
per-row expert -> combine and a 20-step lax.scan captured as CUDA graphs (a rank that skips the call:
test_dispatch_gpu's timeout test, for dispatch_rank_major too). Device memory is poisoned before each
call.

    pytest -m gpu tests/gpu/test_rank_major_gpu.py
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gpu_helpers import (
    GRAPH_OPTIONS,
    assert_captured,
    handler_stats,
    poison_device_memory,
)
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from test_dispatch_gpu import (
    AXIS,
    R,
    _cfg,
    assert_bits_equal,
    bits,
    inputs,
    put,
    quantize_fp8_numpy,
    to_np,
)

import jax_ep
from jax_ep import ops

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def mesh(gpus):
    if len(gpus) < R:
        pytest.skip(f"needs {R} GPUs, have {len(gpus)}")
    return Mesh(np.array(gpus[:R]), (AXIS,))


@functools.cache
def round_trip_fn(mesh, cfg):
    """(x, idx, w, y, g) -> (RankMajorDispatched with a leading rank axis, combine_rank_major(y')
    [R*T, H], broadcast_rank_major(g) [R*R*T, H] (combine_rank_major's backward, called directly),
    y'), where y' is y with NaN in the empty rows."""

    def body(x, idx, w, y, g):
        d = jax_ep.dispatch_rank_major(x, idx, w, cfg)
        y = jnp.where(d.handle.src_index[:, None] >= 0, y, jnp.nan).astype(y.dtype)
        out = jax_ep.combine_rank_major(y, d.handle, cfg)
        back = ops.implementation("broadcast_rank_major", cfg, g.dtype)(g, d.handle, cfg)
        return jax.tree.map(lambda a: a[None], d), out, back, y

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))


def assert_rank_major_equal(got, want, what, rows=True):
    for r in range(R):
        w = f"{what} rank {r}"
        if rows:
            assert_bits_equal(got.x[r], want.x[r], f"{w} rows")
            if want.scales is not None:
                assert_bits_equal(got.scales[r], want.scales[r], f"{w} scales")
        for field in ("topk_idx", "topk_weights", "num_tokens_per_rank", "num_tokens_per_expert"):
            assert_bits_equal(getattr(got, field)[r], getattr(want, field)[r], f"{w} {field}")
        for field in ("src_index", "is_token_in_rank"):
            assert_bits_equal(getattr(got.handle, field)[r], getattr(want.handle, field)[r],
                              f"{w} handle.{field}")


PULLED = jax_ep.KernelConfig(dispatch_pull=True, broadcast_pull=True)
# (tokens, hidden, topk, experts, routing, extra config)
CASES = {
    "deepseek bf16": (512, 7168, 8, 256, "distinct", {}),
    "messy top6": (300, 2048, 6, 64, "messy", {}),
    "skewed top2": (256, 1024, 2, 8, "skewed", {}),
    "f32 x, bf16 wire": (128, 4096, 4, 16, "messy", {"dispatch_dtype": "bfloat16"}),
    "f32 rows": (96, 1024, 4, 16, "distinct", {}),
    "top1 no bulk copies": (200, 1024, 1, 8, "messy", {"kernel": jax_ep.KernelConfig(bulk_copy=False)}),
    "24 SMs, 2 send warps": (1024, 7168, 8, 256, "distinct",
                             {"kernel": jax_ep.KernelConfig(num_sms=24, dispatch_send_warps=2)}),
    # the receivers pull the rows from the senders' staging (KernelConfig.dispatch_pull, broadcast_pull)
    "deepseek pulled": (512, 7168, 8, 256, "distinct", {"kernel": PULLED}),
    "messy top6 pulled, no bulk copies": (300, 2048, 6, 64, "messy",
                                          {"kernel": PULLED.replace(bulk_copy=False)}),
    # top-k above 8: prep's 16 register slots per token, then kMaxTopk's over two token tiles
    "top12 messy": (300, 1024, 12, 32, "messy", {}),
    "top20 over two tiles": (1100, 512, 20, 64, "distinct", {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_rank_major_ops_match_reference(cuda_backend, mesh, case):
    tokens, hidden, topk, experts, kind, extra = CASES[case]
    x_dtype = jnp.float32 if case.startswith("f32") else jnp.bfloat16
    y_dtype = jnp.float32 if case == "f32 rows" else jnp.bfloat16
    kw = dict(num_experts=experts, num_topk=topk, hidden=hidden, max_tokens_per_rank=tokens, **extra)
    cuda_fn = round_trip_fn(mesh, _cfg("cuda", **kw))
    ref_fn = round_trip_fn(mesh, _cfg("reference", **kw))
    rng = np.random.default_rng(100 + list(CASES).index(case))
    for call in range(2):  # repeated calls of one compiled function, fresh data
        x, idx, w = inputs(rng, tokens, hidden, topk, experts, kind, x_dtype)
        y = rng.standard_normal((R * R * tokens, hidden)).astype(np.float32)
        y = np.where(rng.random(y.shape) < 0.01, np.float32(-0.0), y).astype(y_dtype)  # signs of zero
        g = rng.standard_normal((R * tokens, hidden)).astype(np.float32).astype(y_dtype)
        args = put(mesh, x, idx, w, y, g)
        want_d, want_out, want_back, want_y = to_np(ref_fn(*args))
        poison_device_memory(mesh.devices.flat, 256 << 20)
        got_d, got_out, got_back, _ = to_np(cuda_fn(*args))
        what = f"{case} call {call}"
        assert np.isnan(np.asarray(want_y, np.float32)).any() or all(
            int(want_d.num_tokens_per_rank[r].sum()) == R * tokens for r in range(R)), "no empty row"
        assert_rank_major_equal(got_d, want_d, what)
        assert_bits_equal(got_out, want_out, f"{what} combine_rank_major")
        assert_bits_equal(got_back, want_back, f"{what} broadcast_rank_major")
        filled = [int(want_d.num_tokens_per_rank[r].sum()) for r in range(R)]
        print(f"{what}: rows {filled} of {R * tokens} per rank")


@pytest.mark.parametrize("x_dtype", [jnp.bfloat16, jnp.float32])
def test_fp8_rank_major_dispatch_matches_quantisation(cuda_backend, mesh, x_dtype):
    tokens, hidden, topk, experts = 256, 7168, 8, 256
    kw = dict(num_experts=experts, num_topk=topk, hidden=hidden, max_tokens_per_rank=tokens,
              dispatch_dtype="float8_e4m3fn")
    cuda_fn = round_trip_fn(mesh, _cfg("cuda", **kw))
    ref_fn = round_trip_fn(mesh, _cfg("reference", **kw))
    rng = np.random.default_rng(23)
    x, idx, w = inputs(rng, tokens, hidden, topk, experts, "messy", x_dtype)
    y = rng.standard_normal((R * R * tokens, hidden)).astype(np.float32).astype(jnp.bfloat16)
    g = rng.standard_normal((R * tokens, hidden)).astype(np.float32).astype(jnp.bfloat16)
    args = put(mesh, x, idx, w, y, g)
    want_d, want_out, want_back, _ = to_np(ref_fn(*args))
    poison_device_memory(mesh.devices.flat, 256 << 20)
    got_d, got_out, got_back, _ = to_np(cuda_fn(*args))
    assert_rank_major_equal(got_d, want_d, "fp8", rows=False)
    assert_bits_equal(got_out, want_out, "fp8 combine_rank_major")
    assert_bits_equal(got_back, want_back, "fp8 broadcast_rank_major")
    q_all, s_all = quantize_fp8_numpy(np.asarray(x))
    for r in range(R):
        src = got_d.handle.src_index[r]
        filled = src >= 0
        assert_bits_equal(got_d.x[r][filled], q_all[src[filled]], f"rank {r} fp8 rows")
        assert_bits_equal(got_d.scales[r][filled], s_all[src[filled]], f"rank {r} scales")
        assert not got_d.x[r][~filled].astype(np.float32).any(), "empty rows not zero"
        assert not got_d.scales[r][~filled].any(), "empty scales not zero"
        same = np.mean(bits(got_d.x[r]) == bits(want_d.x[r]))
        print(f"rank {r}: {100 * same:.4f}% of fp8 bytes equal to the XLA-GPU reference")
        assert same > 0.999


def test_scan_of_20_steps_as_cuda_graphs(cuda_backend, mesh):
    """20 dispatch_rank_major + combine_rank_major calls in one lax.scan, captured into CUDA graphs:
    every step's outputs equal the reference (twice: the second run replays the graphs)."""
    tokens, hidden, topk, experts, steps = 64, 512, 4, 16, 20
    kw = dict(num_experts=experts, num_topk=topk, hidden=hidden, max_tokens_per_rank=tokens)
    rng = np.random.default_rng(31)
    xs, idxs, ws = zip(*[inputs(rng, tokens, hidden, topk, experts,
                                "messy" if s % 2 else "distinct") for s in range(steps)], strict=True)
    ys = rng.standard_normal((steps, R * R * tokens, hidden)).astype(np.float32).astype(jnp.bfloat16)
    stacked = [np.stack(a) for a in (xs, idxs, ws)] + [ys]
    args = [jax.device_put(a, NamedSharding(mesh, P(None, AXIS))) for a in stacked]

    def make(backend):
        cfg = _cfg(backend, **kw)

        def body(x, idx, w, y):
            def step(carry, xs):
                d = jax_ep.dispatch_rank_major(*xs[:3], cfg)
                out = jax_ep.combine_rank_major(xs[3], d.handle, cfg)
                return carry, (jax.tree.map(lambda a: a[None], d), out)
            return lax.scan(step, 0, (x, idx, w, y))[1]

        return jax.shard_map(body, mesh=mesh, in_specs=P(None, AXIS), out_specs=P(None, AXIS))

    options = GRAPH_OPTIONS["graphs"]
    want_d, want_out = to_np(jax.jit(make("reference"))(*args))
    compiled = jax.jit(make("cuda"), compiler_options=options).lower(*args).compile()
    before = handler_stats("jax_ep_dispatch_rank_major")
    for run in range(2):
        poison_device_memory(mesh.devices.flat, 128 << 20)
        got_d, got_out = to_np(compiled(*args))
        for s in range(steps):
            pick = lambda t, s=s: jax.tree.map(lambda a: a[s], t)  # noqa: E731
            assert_rank_major_equal(pick(got_d), pick(want_d), f"run {run} step {s}")
            assert_bits_equal(got_out[s], want_out[s], f"run {run} step {s} combine_rank_major")
    assert_captured("jax_ep_dispatch_rank_major", before, "graphs", options)


@functools.cache
def gradient_fn(mesh, cfg):
    """(x, w, wexp, idx, ct) -> (loss, out, d x, d topk_weights, d wexp): the user's expert kernel
    weights each row's local experts itself (DeepEP's contract)."""

    def loss(x, w, wexp, idx, ct):  # wexp: this rank's experts [E_local, H, H]
        d = jax_ep.dispatch_rank_major(x, idx, w, cfg)
        local = wexp.shape[0]
        h = jnp.einsum("nh,ehk->nek", d.x, wexp, preferred_element_type=jnp.float32)   # [N, E_l, H]
        gate = jnp.sum(jnp.where(d.topk_idx[:, :, None] == jnp.arange(local), d.topk_weights[:, :, None],
                                 0.0), axis=1)                                         # [N, E_l]
        y = jnp.sum(h * gate[:, :, None], axis=1).astype(x.dtype)
        out = jax_ep.combine_rank_major(y, d.handle, cfg)
        return jnp.sum(out.astype(jnp.float32) * ct), out

    def body(x, w, wexp, idx, ct):
        (value, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(
            x, w, wexp, idx, ct)
        return (value[None], out, *grads)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))


def test_gradients_match_reference(cuda_backend, mesh):
    """jax.grad through dispatch_rank_major -> weighted experts -> combine_rank_major: the backward
    runs combine_rank_major (d x, d topk_weights) and broadcast_rank_major (d y). The kernels and
    the reference move the same bits, so everything matches to float32 summation-order noise of
    XLA's own ops (printed: the fraction bit-identical)."""
    tokens, hidden, topk, experts = 128, 512, 4, 16
    kw = dict(num_experts=experts, num_topk=topk, hidden=hidden, max_tokens_per_rank=tokens)
    rng = np.random.default_rng(41)
    x, idx, w = inputs(rng, tokens, hidden, topk, experts, "messy")
    wexp = (rng.standard_normal((experts, hidden, hidden)) / np.sqrt(hidden)).astype(jnp.bfloat16)
    ct = rng.standard_normal((R * tokens, hidden)).astype(np.float32)
    args = put(mesh, x, w, wexp, idx, ct)
    want = to_np(gradient_fn(mesh, _cfg("reference", **kw))(*args))
    poison_device_memory(mesh.devices.flat, 128 << 20)
    got = to_np(gradient_fn(mesh, _cfg("cuda", **kw))(*args))
    for name, g, r in zip(("loss", "out", "d x", "d topk_weights", "d expert weights"), got, want,
                          strict=True):
        g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
        assert np.isfinite(g).all(), name
        rel = np.linalg.norm(g - r) / (np.linalg.norm(r) + 1e-30)
        print(f"{name}: {100 * np.mean(g == r):.3f}% bit-identical, relative error {rel:.3g}")
        assert rel < 1e-2, f"{name}: relative error {rel:.3g}"
