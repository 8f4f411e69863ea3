"""Shrink mode of the low-latency kernels (EPConfig(shrink=True)) on 2 GPUs. Process model 1: GPU 1
stops calling (its rank takes the other branch of a lax.cond, so it never enters ll_dispatch /
ll_combine). GPU 0's first call waits out the bounded wait once, masks rank 1 (the persistent mask,
jax_ep.runtime.rank_masks, names it, the op and 'discovery') and finishes; its outputs equal the
reference path's with rank_mask [1, 0], bit for bit, but for FP8 rows and scales, which equal an
IEEE float32 NumPy quantisation of their source tokens (tests/numpy_model.py) as in every other GPU
test: XLA's GPU division is not IEEE, so the reference's quantize_fp8 compiled for the GPU rounds
some differently from the kernels and from XLA:CPU (on 2 H200s, jax 0.11.2: 26 of the 38 scales of
rank 0's filled slots 1 ulp off; tests/test_ll_shrink_oracle.py). Uses GPUs 0 and 1 whatever
--ep-ranks says. The next calls (fused and two-phase) do not wait; clear_rank_masks() empties the
mask, and a call with rank 1 in the explicit mask neither waits nor masks it again. Runs in a child
process (its own JAX_EP_TIMEOUT_S and runtime state). Process model 2: a process that stops calling
(tests/gpu/ll_shrink_worker.py).

Written without a GPU (none was lent when it was written); the kernels' logic is checked on the CPU
kernel emulator (tools/kernel_emulator/ll_run.py modes 6 and 7).
"""

from __future__ import annotations

import os

import jax
import pytest
from gpu_helpers import assert_workers_ok, ll_grid_args, report_of_child

pytestmark = pytest.mark.gpu

TIMEOUT_S = 4.0
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: numpy_model

_CHILD = r"""
import json, sys, time
import jax, jax.numpy as jnp, ml_dtypes, numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
import jax_ep
from jax_ep import runtime
from jax_ep.vma import vary_as

sys.path.insert(0, %(tests)r)
import numpy_model as nm

TIMEOUT_S = %(timeout)r
gpus = jax.local_devices(backend="gpu")[:2]
mesh = Mesh(np.array(gpus), ("ep",))
cfg = jax_ep.EPConfig(num_experts=8, num_topk=3, hidden=256, max_tokens_per_rank=16,
                      dispatch_dtype=%(wire)r, backend="cuda", shrink=True)
ref = cfg.replace(backend="reference", shrink=False)
rng = np.random.default_rng(7)
x = rng.standard_normal((2, 16, 256)).astype(ml_dtypes.bfloat16)
idx = np.stack([np.stack([rng.permutation(8)[:3] for _ in range(16)]) for _ in range(2)]).astype(np.int32)
idx[0, :, 0] = 5  # every token of rank 0 picks an expert of rank 1 first: those pairs are dropped
w = rng.random((2, 16, 3)).astype(np.float32)
y = rng.standard_normal((2, 4, 32, 256)).astype(ml_dtypes.bfloat16)
MASK = np.array([[1, 0], [1, 0]], np.int32)  # rank 1 masked, one copy per rank
# rank 0's receive side with rank 1 masked in IEEE float32 NumPy: the FP8 rows' and scales' bits
MODEL = nm.ll_dispatch(x, idx, w, num_experts=8, dispatch_dtype=%(wire)r, rank_mask=MASK[0]).ranks[0]


def run(cfg, x, idx, w, y, mask, two_phase):
    if two_phase:
        d = jax_ep.ll_dispatch_recv(jax_ep.ll_dispatch_send(x, idx, w, cfg, rank_mask=mask), cfg)
    else:
        d = jax_ep.ll_dispatch(x, idx, w, cfg, rank_mask=mask)
    y = jnp.where((d.handle.src_slot >= 0)[..., None], y, jnp.nan).astype(jnp.bfloat16)
    if two_phase:
        out = jax_ep.ll_combine_recv(jax_ep.ll_combine_send(y, d.handle, cfg, rank_mask=mask), cfg)
    else:
        out = jax_ep.ll_combine(y, d.handle, cfg, rank_mask=mask)
    return d, out


def per_rank(branch, like):
    # lax.cond's branches must agree on the mesh axes each output varies over: type them all per rank
    return lambda: jax.tree.map(lambda a: vary_as(a, like), branch())


def step_fn(cfg, absent, two_phase=False):
    def body(x, idx, w, y, mask):
        args = (cfg, x[0], idx[0], w[0], y[0], mask[0], two_phase)
        if absent:  # rank 1 never enters the LL calls
            shapes = jax.eval_shape(lambda: run(*args))
            zeros = lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
            d, out = lax.cond(lax.axis_index("ep") == 1, per_rank(zeros, x), per_rank(lambda: run(*args), x))
        else:
            d, out = run(*args)
        return jax.tree.map(lambda a: a[None], (d, out))
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))


def differs(got, want):
    # the names of rank 0's outputs that differ, bit for bit (none: []): x and scales on the filled
    # slots only (the others are unspecified: the kernels leave them, the reference writes zeros);
    # FP8 rows and scales against MODEL's IEEE quantisation, not the reference's XLA:GPU one
    (dg, og), (dw, ow) = got, want
    filled = np.asarray(dw.handle.src_slot)[0] >= 0
    if dw.scales is None:
        pairs = {"x": (np.asarray(dg.x)[0][filled], np.asarray(dw.x)[0][filled])}
    else:
        pairs = {"x": (np.asarray(dg.x)[0][filled], MODEL.x[filled]),
                 "scales": (np.asarray(dg.scales)[0][filled], MODEL.scales[filled]),
                 "model filled": (filled, MODEL.filled)}
    rest = lambda d, o: {"counts": d.counts, "src_slot": d.handle.src_slot,
                         "topk_weights": d.handle.topk_weights, "dest_rank": d.handle.dest_rank,
                         "num_dropped": d.num_dropped, "rank_mask": d.rank_mask, "combine": o}
    pairs |= {name: (np.asarray(a)[0], np.asarray(b)[0])
              for (name, a), b in zip(rest(dg, og).items(), rest(dw, ow).values())}
    return [name for name, (a, b) in pairs.items()
            if np.shape(a) != np.shape(b) or
            not np.array_equal(np.atleast_1d(a).view(np.uint8), np.atleast_1d(b).view(np.uint8))]


ones = np.ones((2, 2), np.int32)
want = step_fn(ref, False)(x, idx, w, y, MASK)
report = {"calls": []}
for name, fn, mask in (("first", step_fn(cfg, True), ones), ("second", step_fn(cfg, True), ones),
                       ("two_phase", step_fn(cfg, True, True), ones)):
    compiled = fn.lower(x, idx, w, y, mask).compile()  # the timing is the call's, not the compile's
    start = time.time()
    got = jax.block_until_ready(compiled(x, idx, w, y, mask))
    seconds = time.time() - start
    report["calls"].append({"name": name, "seconds": seconds, "differs": differs(got, want),
                            "rank_mask": np.asarray(got[0].rank_mask)[0].tolist(),
                            "num_dropped": int(np.asarray(got[0].num_dropped)[0])})
    if name == "first":
        report["masks"] = runtime.rank_masks(axis_name="ep")
runtime.clear_rank_masks(axis_name="ep")
report["cleared"] = runtime.rank_masks()
compiled = step_fn(cfg, True).lower(x, idx, w, y, MASK).compile()
start = time.time()
got = jax.block_until_ready(compiled(x, idx, w, y, MASK))
report["explicit"] = {"seconds": time.time() - start,
                      "differs": differs(got, want),
                      "masks": runtime.rank_masks()}
report["faults"] = runtime.faults()
print("REPORT=" + json.dumps(report), flush=True)
"""


@pytest.mark.parametrize("wire", ["bfloat16", "float8_e4m3fn"])
def test_ll_shrink_masks_a_gpu_that_stops_calling(cuda_backend, wire):
    if len(jax.local_devices(backend="gpu")) < 2:
        pytest.skip("needs 2 GPUs")
    report = report_of_child(_CHILD % {"timeout": TIMEOUT_S, "wire": wire, "tests": TESTS}, TIMEOUT_S)
    first, second, two_phase = report["calls"]
    for call in report["calls"]:
        assert not call["differs"], (f"{call['name']}: rank 0's {call['differs']} differ from the reference "
                                     "with rank 1 masked")
        assert call["rank_mask"] == [1, 0] and call["num_dropped"] >= 16, call
    assert first["seconds"] >= TIMEOUT_S, "the first call must have waited for rank 1 once"
    assert second["seconds"] < TIMEOUT_S / 2 and two_phase["seconds"] < TIMEOUT_S / 2, report["calls"]
    assert [(m["device_ordinal"], m["rank"], m["masked_rank"], m["op"], m["during"])
            for m in report["masks"]] == [(0, 0, 1, "ll_dispatch", "discovery")], report["masks"]
    assert report["cleared"] == []
    explicit = report["explicit"]
    assert not explicit["differs"] and explicit["seconds"] < TIMEOUT_S / 2, explicit
    assert explicit["masks"] == [], explicit
    assert report["faults"] == [], "shrink mode must not record a fault"


@pytest.mark.process_group
def test_ll_shrink_a_process_that_stops_calling(process_group):
    """Process model 2 (tests/gpu/ll_shrink_worker.py): after one call together, process 1 stops
    calling; each other process's next call waits out JAX_EP_TIMEOUT_S (5 s) once, masks rank 1 and
    returns the NumPy model's outputs with rank 1 masked; the next fused and two-phase calls do not
    wait; rank_masks() names rank 1, ll_dispatch, 'discovery'; clear_rank_masks() empties it."""
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ll_shrink_worker.py")
    assert_workers_ok(worker, "ll_shrink_worker OK process {p}", tuple(ll_grid_args()), timeout_env="5")
