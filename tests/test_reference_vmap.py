"""The process-model-2 GPU workers' reference (tests/gpu/gpu_helpers.reference_by_vmap): the reference
path's per-rank function run for every rank in one process, on one device, under
jax.vmap(axis_name=...) instead of shard_map over a mesh of R devices, so that processes sharing a GPU
need no XLA collective (NCCL refuses two processes on one GPU). It must give the shard_map reference's
bits, every output leaf in full, at R = 2 and 4 (8 virtual CPU devices, tests/conftest.py), for what
the workers compare: dispatch + combine (bf16, FP8, float32 x on a bf16 wire, overflowing capacity),
gradients through dispatch -> ragged_dot -> combine, the rank-major ops (round trip with broadcast,
a scan of 10 steps, gradients), the rank-mask step (dispatch, combine and their gradients under a
mask), and the low-latency ops (fused and two-phase, masked too).
"""

import pathlib
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from helpers import parametrize_slow_tail
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_ep

GPU_TESTS = pathlib.Path(__file__).resolve().parent / "gpu"
if str(GPU_TESTS) not in sys.path:
    sys.path.insert(0, str(GPU_TESTS))

from gpu_helpers import rank_rows, reference_by_vmap  # noqa: E402
from put_transport_worker import grad_body, round_trip_body, scan_body  # noqa: E402
from rank_mask_worker import reference_body  # noqa: E402
from test_dispatch_gpu import (  # noqa: E402
    assert_combine_close,
    dispatch_combine_body,
    gradient_body,
    routing,
)

AXIS = "ep"
RANKS = [2, 4]


def cfg(**kw):
    return jax_ep.EPConfig(axis_name=AXIS, backend="reference", **kw)


def by_shard_map(body, ranks, axes=AXIS):
    """jit(shard_map(body)) over `ranks` devices; a tuple `ranks` (with a tuple `axes`) is a mesh of
    several axes, e.g. the hierarchical ops' (node, local)."""
    shape = (ranks,) if isinstance(ranks, int) else tuple(ranks)
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    mesh = Mesh(np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape), names)
    spec = P(axes)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))


def assert_same_bits(body, ranks, *host, close=(), steps=1, axes=AXIS):
    """reference_by_vmap(body) on one device == jit(shard_map(body)) over `ranks` devices: every leaf
    bit for bit (NaN payloads and signed zeros included), except the top-level outputs in `close`
    (indices of a tuple output, keys of a dict), which the workers compare within bf16 rounding
    (test_dispatch_gpu.assert_combine_close, `steps` bf16 steps of the row's largest value) and so
    are compared here the same way; rank_rows gives each rank's rows of the global outputs."""
    want = by_shard_map(body, ranks, axes)(*host)
    got = reference_by_vmap(body, ranks, axes, device=jax.devices()[0])(*host)
    ranks = int(np.prod(ranks))
    assert jax.tree.structure(got) == jax.tree.structure(want)
    if isinstance(want, dict):
        parts = list(want)
    elif isinstance(want, tuple) and not hasattr(want, "_fields"):
        parts = list(range(len(want)))
    else:
        parts = [None]
    for part in parts:
        pick = (lambda t: t) if part is None else (lambda t, part=part: t[part])  # noqa: E731
        for i, (g, w) in enumerate(zip(jax.tree.leaves(pick(got)), jax.tree.leaves(pick(want)), strict=True)):
            g, w = np.asarray(g), np.asarray(w)
            what = f"output {part} leaf {i} {w.dtype}{list(w.shape)}"
            assert g.shape == w.shape and g.dtype == w.dtype, (what, g.shape, g.dtype)
            if part in close:
                assert_combine_close(g.reshape(g.shape[0], -1), w.reshape(w.shape[0], -1), what, steps)
                continue
            bytes_g = g.reshape(-1).view(np.uint8).reshape(g.size, -1)
            bytes_w = w.reshape(-1).view(np.uint8).reshape(w.size, -1)
            differ = (bytes_g != bytes_w).any(-1)
            assert not differ.any(), f"{what}: {int(differ.sum())} elements differ"
    leaves = jax.tree.leaves(got)
    for rank in range(ranks):  # each rank's part: what `local` gives of the shard_map output on its process
        for leaf, whole in zip(jax.tree.leaves(rank_rows(got, rank, ranks)), leaves, strict=True):
            rows = whole.shape[0] // ranks
            assert np.array_equal(np.asarray(leaf).view(np.uint8),
                                  np.asarray(whole)[rank * rows:(rank + 1) * rows].view(np.uint8))
    return got


def token_inputs(rng, ranks, tokens, hidden, topk, experts, kind, x_dtype=jnp.bfloat16):
    n = ranks * tokens
    x = (rng.standard_normal((n, hidden)) * 2).astype(np.float32).astype(x_dtype)
    return x, routing(rng, kind, n, topk, experts), rng.random((n, topk)).astype(np.float32)


# (tokens, hidden, topk, experts, routing, x dtype, extra config)
EXPERT_MAJOR = {
    "bf16 messy align8": (48, 256, 6, 16, "messy", jnp.bfloat16, {"expert_alignment": 8}),
    "bf16 skewed overflow": (64, 256, 2, 8, "skewed", jnp.bfloat16, {"capacity": 48, "expert_alignment": 4}),
    "fp8": (40, 384, 4, 16, "messy", jnp.bfloat16, {"dispatch_dtype": "float8_e4m3fn"}),
    "fp8 from f32": (40, 256, 3, 8, "distinct", jnp.float32, {"dispatch_dtype": "float8_e4m3fn"}),
    "f32 x bf16 wire": (32, 256, 4, 16, "messy", jnp.float32, {"dispatch_dtype": "bfloat16"}),
}


@parametrize_slow_tail("ranks", RANKS)
@parametrize_slow_tail("case", list(EXPERT_MAJOR))
def test_dispatch_combine(ranks, case):
    """The body of process_group_worker.check_cases (test_dispatch_gpu.dispatch_combine_body)."""
    tokens, hidden, topk, experts, kind, x_dtype, extra = EXPERT_MAJOR[case]
    c = cfg(num_experts=experts, num_topk=topk, hidden=hidden, max_tokens_per_rank=tokens, **extra)
    rng = np.random.default_rng([ranks, list(EXPERT_MAJOR).index(case)])
    x, idx, w = token_inputs(rng, ranks, tokens, hidden, topk, experts, kind, x_dtype)
    y = rng.standard_normal((ranks * c.resolved_capacity(ranks), hidden)).astype(jnp.bfloat16)
    # combine within bf16 rounding, as the worker compares it: XLA contracts its multiply-adds (not
    # rounded apart, unlike ll_combine's) differently in the two programs (seen: 1 element of
    # 80 x 384, 1 bf16 ulp, in the fp8 case at R=2)
    d, _ = assert_same_bits(dispatch_combine_body(c), ranks, x, idx, w, y, close={1})
    if "overflow" in case:
        assert np.asarray(d.num_dropped).sum() > 0, "the case should overflow the capacity"


@parametrize_slow_tail("ranks", RANKS)
def test_gradients(ranks):
    """process_group_worker.check_gradients' body (test_dispatch_gpu.gradient_body): dispatch ->
    lax.ragged_dot -> combine, value and gradients wrt x, topk_weights and the expert weights."""
    tokens, hidden, topk, experts = 32, 128, 4, 16
    c = cfg(num_experts=experts, num_topk=topk, hidden=hidden, max_tokens_per_rank=tokens)
    rng = np.random.default_rng([ranks, 9])
    x, idx, w = token_inputs(rng, ranks, tokens, hidden, topk, experts, "messy")
    wexp = (rng.standard_normal((experts, hidden, hidden)) / np.sqrt(hidden)).astype(jnp.bfloat16)
    ct = rng.standard_normal((ranks * tokens, hidden)).astype(np.float32)
    # compared as the worker does: within two bf16 steps (it does not compare the loss)
    assert_same_bits(gradient_body(c), ranks, x, w, wexp, idx, ct, close={0, 1, 2, 3, 4}, steps=2)


RANK_MAJOR = {
    "bf16 messy": (48, 256, 6, 16, "messy", jnp.bfloat16, jnp.bfloat16, {}),
    "skewed top2": (40, 128, 2, 8, "skewed", jnp.bfloat16, jnp.bfloat16, {}),
    "f32 x, bf16 wire, f32 y": (32, 256, 4, 16, "messy", jnp.float32, jnp.float32,
                                {"dispatch_dtype": "bfloat16"}),
    "fp8": (40, 256, 4, 16, "messy", jnp.bfloat16, jnp.bfloat16, {"dispatch_dtype": "float8_e4m3fn"}),
}


@parametrize_slow_tail("ranks", RANKS)
@parametrize_slow_tail("case", list(RANK_MAJOR))
def test_rank_major_round_trip(ranks, case):
    """put_transport_worker.check_cases' body (round_trip_body): dispatch_rank_major, combine_rank_major
    of y with NaN in the empty rows and -0.0 here and there, broadcast_rank_major."""
    tokens, hidden, topk, experts, kind, x_dtype, y_dtype, extra = RANK_MAJOR[case]
    c = cfg(num_experts=experts, num_topk=topk, hidden=hidden, max_tokens_per_rank=tokens, **extra)
    rng = np.random.default_rng([ranks, 100 + list(RANK_MAJOR).index(case)])
    x, idx, w = token_inputs(rng, ranks, tokens, hidden, topk, experts, kind, x_dtype)
    y = rng.standard_normal((ranks * ranks * tokens, hidden)).astype(np.float32)
    y = np.where(rng.random(y.shape) < 0.01, np.float32(-0.0), y).astype(y_dtype)
    g = rng.standard_normal((ranks * tokens, hidden)).astype(np.float32).astype(y_dtype)
    assert_same_bits(round_trip_body(c), ranks, x, idx, w, y, g)


@parametrize_slow_tail("ranks", RANKS)
def test_rank_major_scan_and_gradients(ranks):
    """put_transport_worker.check_scan's and check_gradients' bodies (scan_body, grad_body)."""
    tokens, hidden, topk, experts = 32, 256, 4, 16
    c = cfg(num_experts=experts, num_topk=topk, hidden=hidden, max_tokens_per_rank=tokens)
    rng = np.random.default_rng([ranks, 5])
    x, idx, w = token_inputs(rng, ranks, tokens, hidden, topk, experts, "messy")
    assert_same_bits(scan_body(c), ranks, x, idx, w)
    ct = rng.standard_normal((ranks * tokens, hidden)).astype(np.float32)
    assert_same_bits(grad_body(c), ranks, x, w, idx, ct)


@parametrize_slow_tail("ranks", RANKS)
@parametrize_slow_tail("mask", ["all active", "last masked"])
def test_rank_mask_step(ranks, mask):
    """rank_mask_worker's reference (reference_step's body, reference_body: step_outputs, with capacity
    drops): dispatch, combine and the gradients wrt x and topk_weights, with a rank mask."""
    tokens, hidden, topk, experts = 32, 128, 2, 8
    c = cfg(num_experts=experts, num_topk=topk, hidden=hidden, max_tokens_per_rank=tokens, capacity=24)
    rng = np.random.default_rng([ranks, 15])
    x, idx, w = token_inputs(rng, ranks, tokens, hidden, topk, experts, "distinct")
    active = np.ones(ranks, np.int32)
    if mask == "last masked":
        active[-1] = 0
    masks = np.tile(active, (ranks, 1)).reshape(-1)
    # combine and the gradients within a bf16 step, as the worker compares them (rank_mask_worker.compare)
    assert_same_bits(reference_body(c), ranks, x, idx, w, masks, close={"out", "gx", "gw"})


def ll_body(c, two_phase, masked):
    def body(x, idx, w, y, m):
        mask = m if masked else None
        if two_phase:
            d = jax_ep.ll_dispatch_recv(jax_ep.ll_dispatch_send(x, idx, w, c, rank_mask=mask), c)
        else:
            d = jax_ep.ll_dispatch(x, idx, w, c, rank_mask=mask)
        yy = jnp.where((d.handle.src_slot >= 0)[..., None], y, jnp.nan).astype(jnp.bfloat16)
        if two_phase:
            out = jax_ep.ll_combine_recv(jax_ep.ll_combine_send(yy, d.handle, c, rank_mask=mask), c)
        else:
            out = jax_ep.ll_combine(yy, d.handle, c, rank_mask=mask)
        return jax.tree.map(lambda a: a[None], d), out

    return body


@parametrize_slow_tail("ranks", RANKS)
@parametrize_slow_tail("wire", ["bfloat16", "float8_e4m3fn"])
@parametrize_slow_tail("form", ["fused", "two-phase", "masked"])
def test_low_latency(ranks, wire, form):
    tokens, hidden, topk, experts = 16, 256, 3, 8
    c = cfg(num_experts=experts, num_topk=topk, hidden=hidden, max_tokens_per_rank=tokens,
            dispatch_dtype=wire)
    rng = np.random.default_rng([ranks, 3])
    x = rng.standard_normal((ranks * tokens, hidden)).astype(ml_dtypes.bfloat16)
    idx = routing(rng, "messy", ranks * tokens, topk, experts)
    w = rng.random((ranks * tokens, topk)).astype(np.float32)
    local = experts // ranks
    y = rng.standard_normal((ranks * local, ranks * tokens, hidden)).astype(ml_dtypes.bfloat16)
    active = np.ones(ranks, np.int32)
    active[0] = 0
    masks = np.tile(active, (ranks, 1)).reshape(-1)
    assert_same_bits(ll_body(c, form == "two-phase", form == "masked"), ranks, x, idx, w, y, masks)


@parametrize_slow_tail("shape", [(2, 1), (2, 2)])
@parametrize_slow_tail("case", ["messy top6 align8", "skewed top2 overflow", "f32 x, bf16 wire, f32 y",
                                  "fp8 deepseek"])
def test_hierarchical_round_trip(shape, case):
    """hierarchical_worker.check_cases' body on a (node, local) mesh: reference_by_vmap over two axes
    (nested vmaps, rank = node * L + local) == shard_map over P((node, local)). FP8: the worker's
    check of each GPU's rows and scales (hierarchical_worker.assert_fp8_rows) holds on the reference."""
    import hierarchical_worker as hw

    tokens, hidden, topk, experts, kind, x_dtype, y_dtype, extra = hw.CASES[case]
    tokens, hidden = min(tokens, 24), min(hidden, 256)
    ranks = shape[0] * shape[1]
    c = hw.cfg("reference", num_experts=experts, num_topk=topk, hidden=hidden, max_tokens_per_rank=tokens,
               **{k: v for k, v in extra.items() if k != "capacity"})
    rng = np.random.default_rng([ranks, list(hw.CASES).index(case)])
    x, idx, w = hw.inputs(rng, ranks, tokens, hidden, topk, experts, kind, x_dtype)
    rows = hw.y_rows(tokens, topk, experts, extra.get("expert_alignment", 1), ranks)
    y = rng.standard_normal((ranks * rows, hidden)).astype(y_dtype)
    got = assert_same_bits(hw.round_trip_body(c), shape, x, idx, w, y, close={1}, axes=hw.GROUP)
    if extra.get("dispatch_dtype") == "float8_e4m3fn":
        for me in range(ranks):
            d = rank_rows(got, me, ranks)[0]
            assert int(d.group_sizes[0].sum()) > 0
            hw.assert_fp8_rows(d, got[0], x, me, shape, tokens, f"GPU {me}")


@parametrize_slow_tail("shape", [(2, 1), (2, 2)])
def test_hierarchical_gradients(shape):
    """hierarchical_worker.check_gradients' body, as above."""
    import hierarchical_worker as hw

    ranks = shape[0] * shape[1]
    tokens, hidden, topk, experts = 16, 128, 4, 16
    c = hw.cfg("reference", num_experts=experts, num_topk=topk, hidden=hidden, max_tokens_per_rank=tokens)
    rng = np.random.default_rng([ranks, 41])
    x, idx, w = hw.inputs(rng, ranks, tokens, hidden, topk, experts, "messy", jnp.bfloat16)
    ct = rng.standard_normal((ranks * tokens, hidden)).astype(np.float32)
    grads = hw.gradient_body(c)
    # the worker compares the gradients only: the loss value is a float32 sum with heavy cancellation,
    # whose order differs between the two programs (seen: 3.26 vs 3.57, terms in the hundreds)
    assert_same_bits(lambda *a: grads(*a)[1:], shape, x, w, idx, ct, close={0, 1}, steps=2, axes=hw.GROUP)


def test_kernels_under_vmap_are_refused_or_leave_auto_on_the_reference(monkeypatch):
    """A kernel needs one device per rank: under jax.vmap(axis_name=cfg.axis_name) backend='cuda' lowered
    to one sequential FFI call per rank on one device, each waiting for peers that start only after it
    ends (a timeout, then a trap; found by a review, 2026-12-05). Now it is refused when traced, and
    'auto', where the table picks the kernel, takes the reference there. Under shard_map: the kernels."""
    from helpers import lower_cuda_here

    from jax_ep import auto_table

    lower_cuda_here(monkeypatch, stub_extension=True)
    monkeypatch.setattr(auto_table, "kernel_faster", lambda *a: True)
    ranks, tokens, hidden, experts, topk = 2, 8, 64, 8, 2
    rng = np.random.default_rng()
    x = jnp.asarray(rng.standard_normal((ranks, tokens, hidden)), jnp.bfloat16)
    idx = jnp.asarray(np.stack([np.stack([rng.permutation(experts)[:topk] for _ in range(tokens)])
                                for _ in range(ranks)]), jnp.int32)
    w = jnp.asarray(rng.random((ranks, tokens, topk)), jnp.float32)

    def body_of(backend):
        c = jax_ep.EPConfig(axis_name=AXIS, num_experts=experts, num_topk=topk, hidden=hidden,
                            max_tokens_per_rank=tokens, backend=backend)

        def body(x, i, w):
            d = jax_ep.dispatch(x, i, w, c)
            return jax_ep.combine(d.x, d.handle, c)
        return body

    refused = r"jax_ep\.dispatch \(backend='cuda'\): the EP axis 'ep' is not a manual axis of an enclosing"
    with np.testing.assert_raises_regex(ValueError, refused):
        jax.jit(jax.vmap(body_of("cuda"), axis_name=AXIS)).lower(x, idx, w)
    vmapped = jax.jit(jax.vmap(body_of("auto"), axis_name=AXIS)).lower(x, idx, w).as_text()
    assert "custom_call @jax_ep" not in vmapped
    auto = body_of("auto")
    sharded = by_shard_map(lambda x, i, w: auto(x[0], i[0], w[0])[None], ranks).lower(x, idx, w).as_text()
    assert "custom_call @jax_ep_dispatch" in sharded and "custom_call @jax_ep_combine" in sharded
