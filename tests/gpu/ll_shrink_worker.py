"""One process of tests/gpu/test_ll_shrink_gpu.py::test_ll_shrink_a_process_that_stops_calling
(process model 2: one process per GPU): shrink mode (EPConfig(shrink=True)) when a process stops
calling.

    python -m jax_ep.launch --nproc N tests/gpu/ll_shrink_worker.py [--ll-num-sms G]

The processes run one ll_dispatch + ll_combine together (it sets the runtime up, collectively, and
must be correct unmasked). Then process 1 stops calling EP ops (it stays alive, waiting on the
key-value store) while every other process runs: a fused call (it waits out JAX_EP_TIMEOUT_S once, masks
rank 1, and returns the reference's outputs with rank 1 masked, bit for bit), a second fused call and a
two-phase call (no wait: the persistent mask), then jax_ep.runtime.rank_masks() must name rank 1,
ll_dispatch and 'discovery', and clear_rank_masks() must empty it. The expected outputs come from
the NumPy model (tests/numpy_model.py), so a process needs no peer to compute them. --ll-num-sms G:
the kernels' grid (gpu_helpers.ll_grid_args: more than 2 processes sharing a GPU). Prints
"ll_shrink_worker OK process N" at the end.
"""

from __future__ import annotations

import os
import sys
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, os.path.dirname(HERE))  # tests/: numpy_model

import numpy_model as nm  # noqa: E402
from gpu_helpers import ll_grid, rank1_masked, worker_main  # noqa: E402

import jax_ep  # noqa: E402
import jax_ep.distributed  # noqa: E402
from jax_ep import runtime  # noqa: E402

AXIS = "ep"
T, K, E, H = 16, 3, 8, 256


def step(mesh, cfg, two_phase: bool):
    def body(x, idx, w, y):
        if two_phase:
            d = jax_ep.ll_dispatch_recv(jax_ep.ll_dispatch_send(x[0], idx[0], w[0], cfg), cfg)
        else:
            d = jax_ep.ll_dispatch(x[0], idx[0], w[0], cfg)
        yy = jnp.where((d.handle.src_slot >= 0)[..., None], y[0], jnp.nan).astype(jnp.bfloat16)
        if two_phase:
            out = jax_ep.ll_combine_recv(jax_ep.ll_combine_send(yy, d.handle, cfg), cfg)
        else:
            out = jax_ep.ll_combine(yy, d.handle, cfg)
        return jax.tree.map(lambda a: a[None], (d, out))

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))


def inputs(ranks: int):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((ranks, T, H)).astype(ml_dtypes.bfloat16)
    idx = np.stack([np.stack([rng.permutation(E)[:K] for _ in range(T)])
                    for _ in range(ranks)]).astype(np.int32)
    w = rng.random((ranks, T, K)).astype(np.float32)
    y = rng.standard_normal((ranks, E // ranks, ranks * T, H)).astype(ml_dtypes.bfloat16)
    return x, idx, w, y


def check_rank(got, me, mask, x, idx, w, y) -> None:
    """This process's outputs against the NumPy model with `mask`."""
    d, out = got
    m = nm.ll_dispatch(x, idx, w, num_experts=E, dispatch_dtype="bfloat16", rank_mask=mask)
    filled = m.ranks[me].filled
    local = lambda a: np.asarray(a.addressable_shards[0].data)[0]  # noqa: E731
    assert np.array_equal(local(d.counts), m.ranks[me].counts), "counts"
    assert np.array_equal(local(d.handle.src_slot), m.ranks[me].src_slot), "src_slot"
    assert np.array_equal(local(d.x)[filled].view(np.uint16), m.ranks[me].x[filled].view(np.uint16)), "x"
    assert np.array_equal(local(d.handle.dest_rank), m.dest_rank[me]), "dest_rank"
    assert int(local(d.num_dropped)) == int(m.num_dropped[me]), "num_dropped"
    assert local(d.rank_mask).tolist() == list(mask), "rank_mask"
    ypoison = np.where(np.stack([r.filled for r in m.ranks])[..., None], y, np.nan).astype(ml_dtypes.bfloat16)
    want = nm.ll_combine(ypoison, m, mask)[me]
    assert np.array_equal(local(out).view(np.uint16), want.view(np.uint16)), "ll_combine"


def run(me: int, mesh) -> str:
    cfg = ll_grid(jax_ep.EPConfig(num_experts=E, num_topk=K, hidden=H, max_tokens_per_rank=T, axis_name=AXIS,
                                  dispatch_dtype="bfloat16", backend="cuda", shrink=True))
    ranks = jax.process_count()
    everyone, without_1 = [1] * ranks, list(rank1_masked(ranks))
    sharding = NamedSharding(mesh, P(AXIS))
    x, idx, w, y = inputs(ranks)
    args = [jax.make_array_from_process_local_data(sharding, a[me:me + 1]) for a in (x, idx, w, y)]
    fused = step(mesh, cfg, False).lower(*args).compile()
    jax_ep.distributed.barrier("ll_shrink_compiled", 180)
    check_rank(jax.block_until_ready(fused(*args)), me, everyone, x, idx, w, y)  # together, unmasked
    if me == 1:  # stops calling; stays alive until the others are done
        jax_ep.distributed.barrier("ll_shrink_done", 600)
        return "stopped calling after one call"
    timeout_s = float(os.environ["JAX_EP_TIMEOUT_S"])
    two_phase = step(mesh, cfg, True).lower(*args).compile()
    times = []
    for fn in (fused, fused, two_phase):
        start = time.monotonic()
        got = jax.block_until_ready(fn(*args))
        times.append(time.monotonic() - start)
        check_rank(got, me, without_1, x, idx, w, y)
        if len(times) == 1:
            masks = runtime.rank_masks(axis_name=AXIS)
    assert times[0] >= timeout_s and max(times[1:]) < timeout_s / 2, times
    assert [(m["rank"], m["masked_rank"], m["op"], m["during"]) for m in masks] == [
        (me, 1, "ll_dispatch", "discovery")], masks
    assert runtime.faults() == [], runtime.faults()
    runtime.clear_rank_masks(axis_name=AXIS)
    assert runtime.rank_masks() == []
    jax_ep.distributed.barrier("ll_shrink_done", 600)
    return f"call times {[round(t, 2) for t in times]} s, masks {masks}"


def main() -> None:
    worker_main(run, "ll_shrink_worker", AXIS)


if __name__ == "__main__":
    main()
