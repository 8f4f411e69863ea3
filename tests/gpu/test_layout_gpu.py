"""The dispatch_layout kernel (jax_ep.cuda_backend.layout) against jax_ep.routing.layout_of.

Exact equality of all three outputs on fresh random routings: -1 slots, out-of-range ids, repeated
experts, skewed and degenerate routings, several T/K/E/R; on one GPU, under jit + shard_map on all
local GPUs, repeated, and inside lax.scan with and without CUDA-graph capture. Device memory is
poisoned before each call so an element the kernel does not write cannot pass by luck.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gpu_helpers import GRAPH_OPTIONS, assert_captured, handler_stats, poison_device_memory
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_ep import routing

pytestmark = pytest.mark.gpu

AXIS = "ep"
FIELDS = ("num_tokens_per_rank", "num_tokens_per_expert", "is_token_in_rank")
INT32_EXTREMES = np.array([np.iinfo(np.int32).max, np.iinfo(np.int32).min], np.int64)


def make_routing(rng: np.random.Generator, tokens: int, topk: int, num_experts: int,
                 kind: str) -> np.ndarray:
    """topk_idx [tokens, topk] int32 of the given kind."""
    shape = (tokens, topk)
    if kind == "distinct":  # what a router emits: K different experts per token
        if topk <= num_experts:
            return np.argsort(rng.random((tokens, num_experts)), axis=1)[:, :topk].astype(np.int32)
        return rng.integers(0, num_experts, shape).astype(np.int32)
    if kind == "messy":  # unused slots, out-of-range ids and repeats, all mixed
        idx = rng.integers(0, num_experts, shape).astype(np.int64)
        u = rng.random(shape)
        bad = rng.choice(np.concatenate([[num_experts, num_experts + 3, -1, -2, -100],
                                         INT32_EXTREMES]), size=shape)
        idx = np.where(u < 0.25, bad, idx)
        if topk > 1:
            repeat = rng.random(shape) < 0.25
            src = rng.integers(0, topk, shape)
            idx = np.where(repeat, np.take_along_axis(idx, src, axis=1), idx)
        return idx.astype(np.int32)
    if kind == "skewed":  # Zipf-like popularity: hot experts, many repeats, some unused slots
        weights = 1.0 / np.arange(1, num_experts + 1) ** 1.5
        idx = rng.choice(num_experts, size=shape, p=weights / weights.sum())
        return np.where(rng.random(shape) < 0.1, -1, idx).astype(np.int32)
    if kind == "all_unused":
        return np.full(shape, -1, np.int32)
    if kind == "all_same":  # every slot names the last expert (lives on the last rank)
        return np.full(shape, num_experts - 1, np.int32)
    raise ValueError(kind)


@functools.cache
def _reference_fn(num_experts: int, ep_size: int):
    return jax.jit(lambda idx: routing.layout_of(idx, num_experts, ep_size))


def reference_layout(topk_idx: np.ndarray, num_experts: int, ep_size: int) -> list[np.ndarray]:
    """The reference on the CPU: independent of the GPU under test."""
    cpu = jax.devices("cpu")[0]
    out = _reference_fn(num_experts, ep_size)(jax.device_put(topk_idx, cpu))
    return [np.asarray(a) for a in out]


def assert_layout_equal(got, want, what: str) -> None:
    for field, g, w in zip(FIELDS, got, want, strict=True):
        g, w = np.asarray(g), np.asarray(w)
        assert g.shape == w.shape and g.dtype == w.dtype, (
            f"{what} {field}: {g.dtype}{list(g.shape)} != {w.dtype}{list(w.shape)}")
        diff = g != w
        if diff.any():
            first = tuple(int(i) for i in np.argwhere(diff)[0])
            raise AssertionError(f"{what} {field}: {int(diff.sum())} of {diff.size} elements differ; "
                                 f"first at {first}: got {g[first]!r}, want {w[first]!r}")


# (tokens, topk, experts, ranks), a line per what the kernel must get right: the register capacities
# 8/16/32/64 for a token's ids, the 16-, 4- and 1-byte clears of an is_token_in_rank row (R % 16, R % 4,
# other R), E + R beyond the shared-memory bins (global atomics), more blocks than the grid cap
# (grid-stride loop), E_local = 1, K > E, zero tokens.
SHAPES = [
    (1, 1, 1, 1), (0, 4, 16, 4), (7, 3, 8, 2),            # one token and E_local = 1, zero tokens, small
    (5, 10, 4, 2), (100, 20, 60, 3), (64, 33, 40, 4),     # K in 16, 32, 64 registers (the first: K > E)
    (333, 6, 64, 16), (2048, 4, 1024, 64),                # 16-byte row clears
    (1000, 8, 288, 8), (513, 9, 72, 72),                  # 4-byte row clears (the second: E_local = 1)
    (300, 4, 9000, 8),                                    # E + R = 9008 > 8192 bins: global atomics
    (4096, 8, 256, 2), (20000, 8, 256, 32),               # 16 and 79 blocks of 256 tokens (grid cap: 64)
]
KINDS = ["distinct", "messy", "skewed", "all_unused", "all_same"]


@functools.cache
def _single_device_fn(backend, num_experts: int, ep_size: int):
    return jax.jit(lambda idx: tuple(backend.layout_of(idx, num_experts, ep_size)))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tokens,topk,num_experts,ep_size", SHAPES)
def test_layout_one_gpu_matches_reference(cuda_backend, gpus, tokens, topk, num_experts, ep_size,
                                          kind):
    rng = np.random.default_rng([tokens, topk, num_experts, ep_size, KINDS.index(kind)])
    idx = make_routing(rng, tokens, topk, num_experts, kind)
    fn = _single_device_fn(cuda_backend, num_experts, ep_size)
    poison_device_memory(gpus[:1])
    got = fn(jax.device_put(idx, gpus[0]))
    assert_layout_equal(got, reference_layout(idx, num_experts, ep_size),
                        f"T={tokens} K={topk} E={num_experts} R={ep_size} {kind}")


def _sharded_layout(backend, mesh: Mesh, num_experts: int):
    """Per-rank layout under shard_map: [R, T, K] -> ([R, R], [R, E], [R, T, R])."""
    ep_size = mesh.shape[AXIS]

    def body(idx):
        out = backend.layout_of(idx[0], num_experts, ep_size)
        return tuple(v[None] for v in out)

    return jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS))


def _all_gpu_mesh(gpus) -> Mesh:
    return Mesh(np.array(gpus), (AXIS,))


def test_layout_all_gpus_repeated_calls(cuda_backend, gpus):
    mesh = _all_gpu_mesh(gpus)
    ep_size, tokens, topk = len(gpus), 512, 8
    num_experts = 32 * ep_size
    fn = jax.jit(_sharded_layout(cuda_backend, mesh, num_experts))
    rng = np.random.default_rng(7)
    for call, kind in enumerate(["messy", "distinct", "skewed", "messy", "all_same"]):
        idx = np.stack([make_routing(rng, tokens, topk, num_experts, kind) for _ in range(ep_size)])
        poison_device_memory(gpus)
        got = fn(jax.device_put(idx, NamedSharding(mesh, P(AXIS))))
        for rank in range(ep_size):
            assert_layout_equal([g[rank] for g in got], reference_layout(idx[rank], num_experts, ep_size),
                                f"call {call} ({kind}) rank {rank}")


@pytest.mark.parametrize("graph_mode", list(GRAPH_OPTIONS))
def test_layout_inside_scan(cuda_backend, gpus, graph_mode):
    """Each scan step computes a fresh routing's layout; the loop reuses the op's output buffers, so
    an element left unwritten would carry the previous step's value."""
    mesh = _all_gpu_mesh(gpus)
    ep_size, tokens, topk, steps = len(gpus), 256, 6, 6
    num_experts = 16 * ep_size
    sharded = _sharded_layout(cuda_backend, mesh, num_experts)

    def run(xs):  # xs [steps, R, T, K]
        return lax.scan(lambda carry, idx: (carry, sharded(idx)), 0, xs)[1]

    rng = np.random.default_rng(11)
    kinds = ["messy", "skewed", "distinct", "all_unused", "messy", "all_same"]
    xs = np.stack([np.stack([make_routing(rng, tokens, topk, num_experts, kinds[s])
                             for _ in range(ep_size)]) for s in range(steps)])
    xs_dev = jax.device_put(xs, NamedSharding(mesh, P(None, AXIS)))
    options = GRAPH_OPTIONS[graph_mode]
    compiled = jax.jit(run, compiler_options=options).lower(xs_dev).compile()
    before = handler_stats("jax_ep_dispatch_layout")
    for repeat in range(2):  # a second run replays whatever graphs the first one built
        poison_device_memory(gpus)
        got = compiled(xs_dev)
        print(graph_mode, "run", repeat, handler_stats("jax_ep_dispatch_layout"))
        for step in range(steps):
            for rank in range(ep_size):
                assert_layout_equal([g[step, rank] for g in got],
                                    reference_layout(xs[step, rank], num_experts, ep_size),
                                    f"{graph_mode} run {repeat} step {step} rank {rank}")
    assert_captured("jax_ep_dispatch_layout", before, graph_mode, options)


def test_public_get_dispatch_layout_uses_kernel(cuda_backend, gpus):
    """jax_ep.get_dispatch_layout with backend='cuda' equals backend='reference' on all GPUs."""
    import jax_ep

    mesh = _all_gpu_mesh(gpus)
    ep_size, tokens, topk = len(gpus), 300, 8
    num_experts = 8 * ep_size
    rng = np.random.default_rng(3)
    idx = np.stack([make_routing(rng, tokens, topk, num_experts, "messy") for _ in range(ep_size)])
    idx_dev = jax.device_put(idx, NamedSharding(mesh, P(AXIS)))
    results = {}
    for backend in ("cuda", "reference"):
        cfg = jax_ep.EPConfig(num_experts=num_experts, num_topk=topk, hidden=128,
                              max_tokens_per_rank=tokens, axis_name=AXIS, backend=backend)

        def body(block, cfg=cfg):
            return tuple(v[None] for v in jax_ep.get_dispatch_layout(block[0], cfg))

        fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))
        results[backend] = [np.asarray(a) for a in fn(idx_dev)]
        if backend == "cuda":
            assert "jax_ep_dispatch_layout" in fn.lower(idx_dev).as_text()
    assert_layout_equal(results["cuda"], results["reference"], "get_dispatch_layout cuda vs reference")


def test_layout_handler_rejects_inconsistent_shapes(cuda_backend, gpus):
    """Shape errors found by the FFI handler come back as Python exceptions naming the op."""
    from jax_ep import runtime

    runtime.register_targets()
    bad = jax.ffi.ffi_call(
        "jax_ep_dispatch_layout",
        (jax.ShapeDtypeStruct((3,), jnp.int32),  # should be [num_ranks] = [2]
         jax.ShapeDtypeStruct((8,), jnp.int32),
         jax.ShapeDtypeStruct((4, 2), jnp.bool_)),
    )
    fn = jax.jit(lambda idx: bad(idx, num_experts=np.int64(8), num_ranks=np.int64(2)))
    with pytest.raises(Exception, match="jax_ep_dispatch_layout"):
        jax.block_until_ready(fn(jax.device_put(np.zeros((4, 2), np.int32), gpus[0])))
