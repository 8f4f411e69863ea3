"""Shrink mode and the persistent mask in the throughput ops (EPConfig(shrink=True); docs/api.md
"Rank masking") on 2 GPUs, process model 1, in a child process (its own JAX_EP_TIMEOUT_S and runtime
state). GPU 1 stops calling: its rank takes the other branch of a lax.cond and never enters the EP
calls.

* test_throughput_shrink_masks_a_gpu_that_stops_calling: dispatch + combine (and dispatch_rank_major
  + combine_rank_major) with shrink: GPU 0's first dispatch waits out the bounded wait once, masks
  rank 1 (runtime.rank_masks() names it, dispatch, 'discovery') and finishes; every output of rank 0
  (Dispatched.rank_mask [1, 0] included) equals the reference path's with rank_mask [1, 0], bit for
  bit (rows up to sum(group_sizes)); the next call waits for nobody; clear_rank_masks() empties the
  mask, and a call with rank 1 in the explicit mask neither waits nor masks it again. No fault.
* test_throughput_shrink_a_process_that_stops_calling: the same in process model 2 (one process per GPU,
  or both on one GPU under MPS with pytest --share-gpu): tests/gpu/throughput_shrink_worker.py.
* test_a_rank_lost_in_a_low_latency_call_drops_out_of_the_throughput_ops: an ll_dispatch in shrink
  mode masks rank 1; a throughput dispatch + combine afterwards, without shrink and without a mask,
  does not wait for it and equals the reference with rank_mask [1, 0].

Written without a GPU (none was lent when it was written); the kernels' logic is checked on the CPU
kernel emulator (tools/kernel_emulator/run.py 'mask persistent' and 'mask shrink' cases,
fault_run.py).
"""

from __future__ import annotations

import os

import jax
import pytest
from gpu_helpers import assert_workers_ok, report_of_child

pytestmark = pytest.mark.gpu

TIMEOUT_S = 4.0

_CHILD = r"""
import json, time
import jax, jax.numpy as jnp, ml_dtypes, numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
import jax_ep
from jax_ep import runtime
from jax_ep.vma import vary_as

gpus = jax.local_devices(backend="gpu")[:2]
mesh = Mesh(np.array(gpus), ("ep",))
T, H, K, E = 32, 256, 3, 8
cfg = jax_ep.EPConfig(num_experts=E, num_topk=K, hidden=H, max_tokens_per_rank=T, backend="cuda",
                      shrink=%(shrink)r)
ref = cfg.replace(backend="reference", shrink=False)
ll_cfg = cfg.replace(dispatch_dtype="bfloat16", shrink=True)
rng = np.random.default_rng(11)
x = rng.standard_normal((2, T, H)).astype(ml_dtypes.bfloat16)
idx = np.stack([np.stack([rng.permutation(E)[:K] for _ in range(T)]) for _ in range(2)]).astype(np.int32)
w = rng.random((2, T, K)).astype(np.float32)
C = cfg.resolved_capacity(2)
y = rng.standard_normal((2, C, H)).astype(ml_dtypes.bfloat16)
MASK = np.array([[1, 0], [1, 0]], np.int32)
ONES = np.ones((2, 2), np.int32)


def run(cfg, x, idx, w, y, mask, masked):
    m = mask if masked else None
    d = jax_ep.dispatch(x, idx, w, cfg, rank_mask=m)
    out = jax_ep.combine(y, d.handle, cfg, rank_mask=m)
    rm = jax_ep.dispatch_rank_major(x, idx, w, cfg, rank_mask=m)
    back = jax_ep.combine_rank_major(rm.x, rm.handle, cfg, rank_mask=m)
    return d, out, rm, back


def per_rank(branch, like):
    # lax.cond's branches must agree on the mesh axes each output varies over: type them all per rank
    return lambda: jax.tree.map(lambda a: vary_as(a, like), branch())


def step_fn(cfg, absent, masked=True):
    def body(x, idx, w, y, mask):
        args = (cfg, x[0], idx[0], w[0], y[0], mask[0], masked)
        if absent:  # rank 1 never enters the EP calls
            shapes = jax.eval_shape(lambda: run(*args))
            zeros = lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
            res = lax.cond(lax.axis_index("ep") == 1, per_rank(zeros, x), per_rank(lambda: run(*args), x))
        else:
            res = run(*args)
        return jax.tree.map(lambda a: a[None], res)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))


def ll_fn():
    def body(x, idx, w):
        def call():
            return jax_ep.ll_dispatch(x[0], idx[0], w[0], ll_cfg).counts
        shape = jax.eval_shape(call)
        counts = lax.cond(lax.axis_index("ep") == 1, per_rank(lambda: jnp.zeros(shape.shape, shape.dtype), x),
                          per_rank(call, x))
        return counts[None]
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))


def same(got, want):
    # rank 0's outputs bit for bit: rows / scales up to sum(group_sizes) (the rest unspecified)
    (dg, og, rg, bg), (dw, ow, rw, bw) = got, want
    total = int(np.asarray(dw.group_sizes)[0].sum())
    pairs = [(np.asarray(dg.x)[0][:total], np.asarray(dw.x)[0][:total])]
    rest = lambda d, o, r, b: jax.tree.leaves((d.group_sizes, d.expert_counts, d.num_dropped, d.handle,
                                               d.rank_mask, o, r, b))
    pairs += [(np.asarray(a)[0], np.asarray(b)[0])
              for a, b in zip(rest(dg, og, rg, bg), rest(dw, ow, rw, bw))]
    return all(np.array_equal(np.atleast_1d(a).view(np.uint8), np.atleast_1d(b).view(np.uint8))
               for a, b in pairs)


def timed(fn, *args):
    compiled = fn.lower(*args).compile()  # the timing is the call's, not the compile's
    start = time.time()
    got = jax.block_until_ready(compiled(*args))
    return got, time.time() - start


want = step_fn(ref, False)(x, idx, w, y, MASK)
report = {"calls": []}
if %(via_ll)r:  # the rank is lost in a low-latency call first
    _, seconds = timed(ll_fn(), x, idx, w)
    report["ll_seconds"] = seconds
    report["ll_masks"] = runtime.rank_masks(axis_name="ep")
    calls = (("after_ll", step_fn(cfg, True, False), ONES),)
else:
    calls = (("first", step_fn(cfg, True), ONES), ("second", step_fn(cfg, True), ONES))
for name, fn, mask in calls:
    got, seconds = timed(fn, x, idx, w, y, mask)
    report["calls"].append({"name": name, "seconds": seconds, "same": same(got, want),
                            "rank_mask": np.asarray(got[0].rank_mask)[0].tolist()})
    if name == "first":
        report["masks"] = runtime.rank_masks(axis_name="ep")
runtime.clear_rank_masks(axis_name="ep")
report["cleared"] = runtime.rank_masks()
got, seconds = timed(step_fn(cfg, True), x, idx, w, y, MASK)
report["explicit"] = {"seconds": seconds, "same": same(got, want), "masks": runtime.rank_masks()}
report["faults"] = runtime.faults()
print("REPORT=" + json.dumps(report), flush=True)
"""


def _child(shrink: bool, via_ll: bool) -> dict:
    return report_of_child(_CHILD % {"shrink": shrink, "via_ll": via_ll}, TIMEOUT_S)


def _check_explicit(report) -> None:
    assert report["cleared"] == []
    explicit = report["explicit"]
    assert explicit["same"] and explicit["seconds"] < TIMEOUT_S / 2 and explicit["masks"] == [], explicit
    assert report["faults"] == [], "shrink mode must not record a fault"


def test_throughput_shrink_masks_a_gpu_that_stops_calling(cuda_backend):
    if len(jax.local_devices(backend="gpu")) < 2:
        pytest.skip("needs 2 GPUs")
    report = _child(shrink=True, via_ll=False)
    first, second = report["calls"]
    for call in report["calls"]:
        assert call["same"], f"{call['name']}: rank 0's outputs differ from the reference with rank 1 masked"
        assert call["rank_mask"] == [1, 0], call
    assert first["seconds"] >= TIMEOUT_S, "the first call must have waited for rank 1 once"
    assert second["seconds"] < TIMEOUT_S / 2, report["calls"]
    # the step's two dispatches are independent: XLA runs either first, and that one masks rank 1
    assert [(m["device_ordinal"], m["rank"], m["masked_rank"], m["during"])
            for m in report["masks"]] == [(0, 0, 1, "discovery")], report["masks"]
    assert report["masks"][0]["op"] in ("dispatch", "dispatch_rank_major"), report["masks"]
    _check_explicit(report)


def test_a_rank_lost_in_a_low_latency_call_drops_out_of_the_throughput_ops(cuda_backend):
    if len(jax.local_devices(backend="gpu")) < 2:
        pytest.skip("needs 2 GPUs")
    report = _child(shrink=False, via_ll=True)
    assert report["ll_seconds"] >= TIMEOUT_S, "the ll_dispatch must have waited for rank 1 once"
    assert [(m["masked_rank"], m["op"], m["during"]) for m in report["ll_masks"]] == [
        (1, "ll_dispatch", "discovery")], report["ll_masks"]
    (after,) = report["calls"]
    assert after["same"] and after["rank_mask"] == [1, 0], after
    assert after["seconds"] < TIMEOUT_S / 2, "the throughput ops must not wait for a masked rank"
    _check_explicit(report)


@pytest.mark.process_group
def test_throughput_shrink_a_process_that_stops_calling(process_group):
    """Process model 2 (tests/gpu/throughput_shrink_worker.py): after one call together, process 1 stops
    calling; process 0's next call waits out JAX_EP_TIMEOUT_S (5 s) once, masks rank 1 and returns the
    reference's outputs with rank_mask [1, 0]; the next call does not wait; rank_masks() names rank 1,
    dispatch, 'discovery'; clear_rank_masks() empties it; an explicit mask neither waits nor masks."""
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "throughput_shrink_worker.py")
    assert_workers_ok(worker, "throughput_shrink_worker OK process {p}", timeout_env="5")
