"""One process of the hierarchical GPU test (tests/gpu/test_hierarchical_gpu.py), issue 13's test 3b:
the hierarchical dispatch / combine (jax_ep.dispatch_hierarchical / combine_hierarchical) with the
machine taken as "2 nodes of 1 GPU". Two processes x 1 GPU (process model 2) on a (node, local) mesh
of 2 x 1; the node hop's rank-major ops run with KernelConfig(transport="put"), so every byte between
the "nodes" goes through NVSHMEM puts + signals as it would between machines (NVSHMEM carries them
over P2P here, or within the GPU when both processes share it under MPS); the local stage is an
expert-major dispatch / combine over a local axis of one GPU.

    python -m jax_ep.launch --nproc 2 tests/gpu/hierarchical_worker.py

Each process checks its own GPU against the reference path run through the same composition:
dispatch_hierarchical's rows, counts and both handles bit-exact (FP8: rows and scales against NumPy's
IEEE quantisation of each row's source token, matched through both handles, as XLA's GPU division may
round the reference's differently; the packed stage-2 rows must arrive bit for bit), combine_hierarchical
within two bf16 steps (XLA contracts the reference's multiply-adds its own way), two calls of each
compiled function on poisoned memory; jax.grad through dispatch_hierarchical -> a per-row scale by the
gate weight -> combine_hierarchical (d x, d topk_weights). Prints "hierarchical_worker OK <checks>" at
the end.

No XLA collective runs across the processes (they may share one GPU: pytest --share-gpu, and NCCL
refuses two processes on one GPU): inputs from the same seed on every process, each putting its own
shards (gpu_helpers.put_global), and the reference in each process alone, both mesh axes under
jax.vmap (gpu_helpers.reference_by_vmap).
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from gpu_helpers import local, poison_device_memory, put_global, rank_rows, reference_by_vmap  # noqa: E402
from test_dispatch_gpu import (  # noqa: E402
    assert_bits_equal,
    assert_combine_close,
    quantize_fp8_numpy,
    routing,
)

import jax_ep  # noqa: E402
import jax_ep.distributed  # noqa: E402
from jax_ep import runtime  # noqa: E402

NODE, LOCAL = "node", "local"
GROUP = (NODE, LOCAL)
PUT = jax_ep.KernelConfig(transport="put")

# (tokens, hidden, topk, experts, routing, x dtype, y dtype, extra config)
CASES = {
    "deepseek bf16": (256, 7168, 8, 256, "distinct", jnp.bfloat16, jnp.bfloat16, {}),
    "messy top6 align8": (300, 2048, 6, 64, "messy", jnp.bfloat16, jnp.bfloat16, {"expert_alignment": 8}),
    "skewed top2 overflow": (256, 1024, 2, 8, "skewed", jnp.bfloat16, jnp.bfloat16,
                             {"capacity": 192, "expert_alignment": 4}),
    "f32 x, bf16 wire, f32 y": (128, 4096, 4, 16, "messy", jnp.float32, jnp.float32,
                                {"dispatch_dtype": "bfloat16"}),
    # stage 1 FP8 + scales over the puts, stage 2 the packed float32 rows (7168 packs with no padding)
    "fp8 deepseek": (256, 7168, 8, 256, "distinct", jnp.bfloat16, jnp.bfloat16,
                     {"dispatch_dtype": "float8_e4m3fn"}),
}


def cfg(backend, **kw):
    kernel = {"kernel": PUT} if backend == "cuda" else {}
    return jax_ep.EPConfig(axis_name=LOCAL, backend=backend, **kernel, **kw)


def y_rows(tokens, topk, experts, alignment, ranks) -> int:
    """Rows of the y input per GPU: at least the local stage's capacity (sliced inside the body)."""
    return ranks * tokens * topk + experts * alignment


def round_trip_body(c):
    """dispatch_hierarchical -> y (its first C rows, NaN in the rows no token filled) ->
    combine_hierarchical; the Dispatched with a leading rank axis and the combined [T, H]."""

    def body(x, idx, w, y):
        d = jax_ep.dispatch_hierarchical(x, idx, w, c, node_axis=NODE)
        rows = d.x.shape[0]
        assert y.shape[0] >= rows, (y.shape, rows)
        y = jnp.where((d.handle.local.src_index >= 0)[:, None], y[:rows], jnp.nan).astype(y.dtype)
        out = jax_ep.combine_hierarchical(y, d.handle, c, node_axis=NODE)
        return jax.tree.map(lambda a: a[None], d), out

    return body


def gradient_body(c):
    def loss(x, w, idx, ct):
        d = jax_ep.dispatch_hierarchical(x, idx, w, c, node_axis=NODE)
        y = (d.x.astype(jnp.float32) * (1.0 + d.row_weights[:, None])).astype(x.dtype)
        out = jax_ep.combine_hierarchical(y, d.handle, c, node_axis=NODE)
        return jnp.sum(out.astype(jnp.float32) * ct)

    def grads(x, w, idx, ct):
        value, g = jax.value_and_grad(loss, argnums=(0, 1))(x, w, idx, ct)
        return (value[None], *g)

    return grads


def assert_dispatch_equal(got, want, what, rows=True):
    total = int(want.group_sizes[0].sum())
    assert_bits_equal(got.group_sizes[0], want.group_sizes[0], f"{what} group_sizes")
    if rows:
        assert_bits_equal(got.x[0][:total], want.x[0][:total], f"{what} rows")
    for field in ("expert_counts", "num_dropped", "num_tokens_per_node"):
        assert_bits_equal(getattr(got, field)[0], getattr(want, field)[0], f"{what} {field}")
    for field in ("src_index", "is_token_in_rank"):
        assert_bits_equal(getattr(got.handle.node, field)[0], getattr(want.handle.node, field)[0],
                          f"{what} handle.node.{field}")
    for field in ("src_index", "token_rows", "is_token_in_rank", "row_weights"):
        assert_bits_equal(getattr(got.handle.local, field)[0], getattr(want.handle.local, field)[0],
                          f"{what} handle.local.{field}")


def row_sources(d, me, shape, tokens) -> np.ndarray:
    """[C] global source token (GPU g * T + t) of each expert-major row of GPU `me`, -1 for empty rows,
    from both handles of the whole group's `d` (leading GPU axis): row -> stage-2 slot l_src * N*T + i
    -> stage-1 row i of GPU (n, l_src) -> its source slot s * T + t -> GPU s * L + l_src."""
    nodes, local_size = shape
    n = me // local_size
    src = np.asarray(d.handle.local.src_index[me])
    l_src, i = np.divmod(np.maximum(src, 0), nodes * tokens)
    stage1 = np.asarray(d.handle.node.src_index)[n * local_size + l_src, i]
    s, t = np.divmod(stage1, tokens)
    return np.where(src >= 0, (s * local_size + l_src) * tokens + t, -1)


def assert_fp8_rows(got, full_want, x, me, shape, tokens, what):
    """FP8 rows and scales of GPU `me` bit for bit NumPy's quantisation of each row's source token;
    the alignment-padding rows (empty, before sum(group_sizes)) zero."""
    total = int(got.group_sizes[0].sum())
    src = row_sources(full_want, me, shape, tokens)[:total]
    filled = src >= 0
    q_all, s_all = quantize_fp8_numpy(np.asarray(x))
    assert_bits_equal(got.x[0][:total][filled], q_all[src[filled]], f"{what} fp8 rows")
    assert_bits_equal(got.scales[0][:total][filled], s_all[src[filled]], f"{what} scales")
    assert not got.x[0][:total][~filled].view(np.uint8).any(), f"{what}: padding rows not zero"
    assert not got.scales[0][:total][~filled].view(np.uint32).any(), f"{what}: padding scales not zero"


def inputs(rng, ranks, tokens, hidden, topk, experts, kind, x_dtype):
    n = ranks * tokens
    x = (rng.standard_normal((n, hidden)) * 2).astype(np.float32).astype(x_dtype)
    return x, routing(rng, kind, n, topk, experts), rng.random((n, topk)).astype(np.float32)


def check_cases(mesh, me, shape) -> int:
    ranks = int(np.prod(shape))
    checks = 0
    for name, (tokens, hidden, topk, experts, kind, x_dtype, y_dtype, extra) in CASES.items():
        kw = dict(num_experts=experts, num_topk=topk, hidden=hidden, max_tokens_per_rank=tokens, **extra)
        cuda_fn = jax.jit(jax.shard_map(round_trip_body(cfg("cuda", **kw)), mesh=mesh, in_specs=P(GROUP),
                                        out_specs=P(GROUP)))
        ref_fn = reference_by_vmap(round_trip_body(cfg("reference", **kw)), shape, GROUP)
        rng = np.random.default_rng(list(CASES).index(name))  # the same on every process
        rows = y_rows(tokens, topk, experts, extra.get("expert_alignment", 1), ranks)
        for call in range(2):
            x, idx, w = inputs(rng, ranks, tokens, hidden, topk, experts, kind, x_dtype)
            y = rng.standard_normal((ranks * rows, hidden)).astype(np.float32)
            y = np.where(rng.random(y.shape) < 0.01, np.float32(-0.0), y).astype(y_dtype)
            host = (x, idx, w, y)
            full = ref_fn(*host)
            want_d, want_out = rank_rows(full, me, ranks)
            args = put_global(mesh, *host, axis=GROUP)
            poison_device_memory(jax.local_devices(), 256 << 20)
            got_d, got_out = local(cuda_fn(*args))
            what = f"process {me} {name} call {call}"
            fp8 = extra.get("dispatch_dtype") == "float8_e4m3fn"
            assert_dispatch_equal(got_d, want_d, what, rows=not fp8)
            if fp8:  # XLA's GPU division may round the reference's differently: NumPy's IEEE bits
                assert_fp8_rows(got_d, full[0], x, me, shape, tokens, what)
            assert_combine_close(got_out, want_out, f"{what} combine_hierarchical", steps=2)
            print(f"{what}: {int(want_d.group_sizes[0].sum())} rows here, {int(want_d.num_dropped[0])} "
                  f"dropped, {int(want_d.num_tokens_per_node[0].sum())} (token, node) rows sent", flush=True)
            checks += 1
    return checks


def check_gradients(mesh, me, shape) -> int:
    ranks = int(np.prod(shape))
    tokens, hidden, topk, experts = 128, 1024, 4, 16
    kw = dict(num_experts=experts, num_topk=topk, hidden=hidden, max_tokens_per_rank=tokens)
    rng = np.random.default_rng(41)
    x, idx, w = inputs(rng, ranks, tokens, hidden, topk, experts, "messy", jnp.bfloat16)
    ct = rng.standard_normal((ranks * tokens, hidden)).astype(np.float32)
    host = (x, w, idx, ct)
    want = rank_rows(reference_by_vmap(gradient_body(cfg("reference", **kw)), shape, GROUP)(*host), me, ranks)
    args = put_global(mesh, *host, axis=GROUP)
    poison_device_memory(jax.local_devices(), 128 << 20)
    fn = jax.shard_map(gradient_body(cfg("cuda", **kw)), mesh=mesh, in_specs=P(GROUP), out_specs=P(GROUP))
    got = local(jax.jit(fn)(*args))
    assert_combine_close(got[1], want[1], f"process {me} gradient d x", steps=3)
    # d topk_weights[t, k] are dot products over the hidden size (<d out_t, y_row> plus the y path's
    # w * <d out_t, x_t>) whose terms cancel: a row's largest value is no scale for their rounding (seen:
    # 0.96 left of terms ~2, off by 0.19 of the reference on CPU against a float64 model: bf16 roundings
    # the two programs place differently). The scale is the root-sum-square of the terms
    # sqrt(sum_h (ct_th x_th)^2) * (1 + max_k w_tk), within which a missing or doubled term (~w * scale)
    # still shows.
    tokens_here = slice(me * tokens, (me + 1) * tokens)
    terms = ct[tokens_here] * np.asarray(x[tokens_here], np.float32)
    scale = np.sqrt((terms.astype(np.float64) ** 2).sum(1)) * (1 + w[tokens_here].max(1))
    err = np.abs(np.asarray(got[2], np.float64) - np.asarray(want[2], np.float64)) / scale[:, None]
    print(f"process {me} gradient d topk_weights: {100 * np.mean(got[2] == want[2]):.1f}% bit-exact, max "
          f"error {err.max():.3g} of the terms' root-sum-square", flush=True)
    assert np.isfinite(got[2]).all(), f"process {me} d topk_weights: non-finite values"
    assert err.max() <= 2.0 ** -5, f"process {me} d topk_weights: max error {err.max():.3g}"
    return 1


def main() -> None:
    jax_ep.distributed.initialize()  # from python -m jax_ep.launch: one GPU per process
    me = jax.process_index()
    assert runtime.process_model() == "process_per_gpu", runtime.process_model()
    shape = (jax.process_count(), 1)  # every process a "node" of one GPU
    mesh = Mesh(np.array(jax.devices()).reshape(shape), GROUP)
    checks = check_cases(mesh, me, shape)
    checks += check_gradients(mesh, me, shape)
    stats = {target: s["calls"] for target, s in runtime.extension().handler_stats().items() if s["calls"]}
    print(f"hierarchical_worker OK {checks} (process {me}, calls {stats}, faults {runtime.faults()})",
          flush=True)


if __name__ == "__main__":
    main()
