"""One process of the put-transport GPU test (tests/gpu/test_put_transport_gpu.py), the issue's test
3b: "2 nodes of 1 GPU" on one machine. Two processes x 1 GPU (process model 2), the rank-major ops
with KernelConfig(transport="put"): every byte between the processes goes through NVSHMEM puts +
signals (cuda/remote_rank_major.cu), as it would between nodes (NVSHMEM carries them over P2P here).

    python -m jax_ep.launch --nproc 2 tests/gpu/put_transport_worker.py

Each process checks its own rank against the reference path, bit-exact: dispatch_rank_major (every
output and handle field; FP8 rows and scales against an IEEE NumPy quantisation), combine_rank_major
(NaN in the empty rows, -0.0 in y) and broadcast_rank_major, two calls of each compiled function on
poisoned memory; a 10-step lax.scan captured as CUDA graphs; jax.grad through dispatch_rank_major ->
a per-row scale by the row's gate weights -> combine_rank_major (d x and d topk_weights). Prints
"put_transport_worker OK <checks>" at the end.

No XLA collective runs across the processes (they may share one GPU: pytest --share-gpu, and NCCL
refuses two processes on one GPU): inputs from the same seed on every process, each putting its own
shards (gpu_helpers.put_global), and the reference in each process alone, every rank under jax.vmap
(gpu_helpers.reference_by_vmap).
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import test_dispatch_gpu as model1  # noqa: E402  (inputs, put, bit comparisons)
from gpu_helpers import (  # noqa: E402
    GRAPH_OPTIONS,
    local,
    poison_device_memory,
    put_global,
    rank_rows,
    reference_by_vmap,
)

import jax_ep  # noqa: E402
import jax_ep.distributed  # noqa: E402
from jax_ep import ops, runtime  # noqa: E402

AXIS, R = model1.AXIS, model1.R


def cfg(backend, transport="put", pull=False, **kw):
    if backend != "cuda":
        return model1._cfg(backend, **kw)
    kernel = jax_ep.KernelConfig(transport=transport, dispatch_pull=pull, broadcast_pull=pull)
    return model1._cfg(backend, kernel=kernel, **kw)


def round_trip_body(c):
    def body(x, idx, w, y, g):
        d = jax_ep.dispatch_rank_major(x, idx, w, c)
        y = jnp.where(d.handle.src_index[:, None] >= 0, y, jnp.nan).astype(y.dtype)
        out = jax_ep.combine_rank_major(y, d.handle, c)
        back = ops.implementation("broadcast_rank_major", c, g.dtype)(g, d.handle, c)
        return jax.tree.map(lambda a: a[None], d), out, back

    return body


def round_trip_fn(mesh, c):
    return jax.jit(jax.shard_map(round_trip_body(c), mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))


def scan_body(c):
    """check_scan's per-rank body: 10 steps of dispatch_rank_major -> combine_rank_major in a
    lax.scan, the carry out (tests/test_reference_vmap.py checks its reference_by_vmap on CPU)."""

    def body(x, idx, w):
        def step(carry, _):
            d = jax_ep.dispatch_rank_major(carry, idx, w, c)
            out = jax_ep.combine_rank_major(d.x, d.handle, c)
            return (out * 0.5).astype(carry.dtype), None

        return lax.scan(step, x, None, length=10)[0]

    return body


def grad_body(c):
    """check_gradients' per-rank body: the loss through dispatch_rank_major -> each row scaled by the
    sum of its gate weights -> combine_rank_major; (loss[None], d x, d topk_weights)."""

    def loss(x, w, idx, ct):
        d = jax_ep.dispatch_rank_major(x, idx, w, c)
        scale = jnp.sum(d.topk_weights, axis=1, keepdims=True)
        y = (d.x.astype(jnp.float32) * scale).astype(x.dtype)
        out = jax_ep.combine_rank_major(y, d.handle, c)
        return jnp.sum(out.astype(jnp.float32) * ct)

    def grads(x, w, idx, ct):
        value, grads = jax.value_and_grad(loss, argnums=(0, 1))(x, w, idx, ct)
        return (value[None], *grads)

    return grads


def assert_dispatch_equal(got, want, what, rows=True):
    eq = model1.assert_bits_equal
    if rows:
        eq(got.x[0], want.x[0], f"{what} rows")
        if want.scales is not None:
            eq(got.scales[0], want.scales[0], f"{what} scales")
    for field in ("topk_idx", "topk_weights", "num_tokens_per_rank", "num_tokens_per_expert"):
        eq(getattr(got, field)[0], getattr(want, field)[0], f"{what} {field}")
    for field in ("src_index", "is_token_in_rank"):
        eq(getattr(got.handle, field)[0], getattr(want.handle, field)[0], f"{what} handle.{field}")


# (tokens, hidden, topk, experts, routing, x dtype, y dtype, extra config)
CASES = {
    "deepseek bf16": (512, 7168, 8, 256, "distinct", jnp.bfloat16, jnp.bfloat16, {}),
    "messy top6": (300, 2048, 6, 64, "messy", jnp.bfloat16, jnp.bfloat16, {}),
    "skewed top2": (256, 1024, 2, 8, "skewed", jnp.bfloat16, jnp.bfloat16, {}),
    "f32 x, bf16 wire, f32 y": (128, 4096, 4, 16, "messy", jnp.float32, jnp.float32,
                                {"dispatch_dtype": "bfloat16"}),
    "fp8 from bf16": (256, 7168, 8, 256, "messy", jnp.bfloat16, jnp.bfloat16,
                      {"dispatch_dtype": "float8_e4m3fn"}),
}


def check_cases(mesh, me, transport="put", pull=False) -> int:
    """CASES over `transport` (process_group_worker runs them with "load_store": the NVLink kernels;
    pull: dispatch_rank_major and broadcast_rank_major pulling their rows, KernelConfig.dispatch_pull and
    broadcast_pull)."""
    checks = 0
    for name, (tokens, hidden, topk, experts, kind, x_dtype, y_dtype, extra) in CASES.items():
        kw = dict(num_experts=experts, num_topk=topk, hidden=hidden, max_tokens_per_rank=tokens, **extra)
        cuda_fn = round_trip_fn(mesh, cfg("cuda", transport, pull, **kw))
        ref_fn = reference_by_vmap(round_trip_body(cfg("reference", **kw)), R)
        rng = np.random.default_rng(list(CASES).index(name))  # the same on every process
        fp8 = extra.get("dispatch_dtype") == "float8_e4m3fn"
        for call in range(2):
            x, idx, w = model1.inputs(rng, tokens, hidden, topk, experts, kind, x_dtype)
            y = rng.standard_normal((R * R * tokens, hidden)).astype(np.float32)
            y = np.where(rng.random(y.shape) < 0.01, np.float32(-0.0), y).astype(y_dtype)
            g = rng.standard_normal((R * tokens, hidden)).astype(np.float32).astype(y_dtype)
            host = (x, idx, w, y, g)
            want_d, want_out, want_back = rank_rows(ref_fn(*host), me, R)
            args = put_global(mesh, *host)
            poison_device_memory(jax.local_devices(), 256 << 20)
            got_d, got_out, got_back = local(cuda_fn(*args))
            what = f"process {me} {transport}{' pull' if pull else ''} {name} call {call}"
            assert_dispatch_equal(got_d, want_d, what, rows=not fp8)
            if fp8:  # XLA's GPU division may round differently: NumPy's IEEE bits
                q_all, s_all = model1.quantize_fp8_numpy(np.asarray(x))
                src = got_d.handle.src_index[0]
                filled = src >= 0
                model1.assert_bits_equal(got_d.x[0][filled], q_all[src[filled]], f"{what} fp8 rows")
                model1.assert_bits_equal(got_d.scales[0][filled], s_all[src[filled]], f"{what} scales")
                assert not got_d.x[0][~filled].astype(np.float32).any(), f"{what}: empty rows not zero"
            model1.assert_bits_equal(got_out, want_out, f"{what} combine_rank_major")
            model1.assert_bits_equal(got_back, want_back, f"{what} broadcast_rank_major")
            rows = int(want_d.num_tokens_per_rank[0].sum())
            print(f"{what}: {rows} rows of {R * tokens} here, bit-exact", flush=True)
            checks += 1
    return checks


def check_scan(mesh, me) -> int:
    """10 steps of dispatch_rank_major -> combine_rank_major in a lax.scan, compiled so that XLA
    captures the calls into CUDA graphs: the carry after the scan bit-exact with the reference."""
    tokens, hidden, topk, experts = 128, 1024, 4, 16
    kw = dict(num_experts=experts, num_topk=topk, hidden=hidden, max_tokens_per_rank=tokens)
    rng = np.random.default_rng(5)
    x, idx, w = model1.inputs(rng, tokens, hidden, topk, experts, "messy")
    want = rank_rows(reference_by_vmap(scan_body(cfg("reference", **kw)), R)(x, idx, w), me, R)
    args = put_global(mesh, x, idx, w)
    fn = jax.shard_map(scan_body(cfg("cuda", **kw)), mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS))
    got = local(jax.jit(fn).lower(*args).compile(GRAPH_OPTIONS["graphs"])(*args))
    model1.assert_bits_equal(got, want, f"process {me} scan of 10 steps")
    return 1


def check_gradients(mesh, me) -> int:
    """jax.grad through dispatch_rank_major -> each row scaled by the sum of its gate weights ->
    combine_rank_major: the backward runs combine_rank_major (d x, d topk_weights) and
    broadcast_rank_major (d y) over puts. Every op around the EP ops is elementwise, so d x and
    d topk_weights are bit-exact with the reference."""
    tokens, hidden, topk, experts = 128, 512, 4, 16
    kw = dict(num_experts=experts, num_topk=topk, hidden=hidden, max_tokens_per_rank=tokens)
    rng = np.random.default_rng(41)
    x, idx, w = model1.inputs(rng, tokens, hidden, topk, experts, "messy")
    ct = rng.standard_normal((R * tokens, hidden)).astype(np.float32)
    host = (x, w, idx, ct)
    want = rank_rows(reference_by_vmap(grad_body(cfg("reference", **kw)), R)(*host), me, R)
    args = put_global(mesh, *host)
    poison_device_memory(jax.local_devices(), 128 << 20)
    fn = jax.shard_map(grad_body(cfg("cuda", **kw)), mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS))
    got = local(jax.jit(fn)(*args))
    for name, g, r in zip(("d x", "d topk_weights"), got[1:], want[1:], strict=True):
        model1.assert_bits_equal(g, r, f"process {me} gradient {name}")
    return 1


def main() -> None:
    jax_ep.distributed.initialize()  # from python -m jax_ep.launch: one GPU per process
    me = jax.process_index()
    assert runtime.process_model() == "process_per_gpu", runtime.process_model()
    mesh = Mesh(np.array(jax.devices()), (AXIS,))
    assert R == jax.process_count(), f"test_dispatch_gpu's EP size {R} (JAX_EP_TEST_EP_RANKS) != processes"
    checks = check_cases(mesh, me)
    checks += check_scan(mesh, me)
    checks += check_gradients(mesh, me)
    stats = {target: s["calls"] for target, s in runtime.extension().handler_stats().items()
             if "rank_major" in target}
    print(f"put_transport_worker OK {checks} (process {me}, calls {stats}, faults {runtime.faults()})",
          flush=True)


if __name__ == "__main__":
    main()
