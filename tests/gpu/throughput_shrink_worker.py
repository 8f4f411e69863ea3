"""One process of tests/gpu/test_throughput_shrink_gpu.py::test_throughput_shrink_a_process_that_stops_calling
(process model 2: one process per GPU): shrink mode of the throughput ops (EPConfig(shrink=True)) when a
process stops calling.

    python -m jax_ep.launch --nproc N tests/gpu/throughput_shrink_worker.py

The processes compile every step first and run one (dispatch, combine, dispatch_rank_major,
combine_rank_major) together, unmasked, checked against the reference. Then process 1 stops calling EP
ops (it stays alive, waiting on the key-value store) while every other process runs: a first call (it
waits out the bounded wait once, masks rank 1, and returns the reference's outputs with rank 1 masked), a
second call (no wait: the persistent mask), then jax_ep.runtime.rank_masks() must name rank 1,
the dispatch XLA ran first and 'discovery'; clear_rank_masks() empties it, and a call with rank 1 in
the explicit mask neither waits nor masks it again. Dispatch outputs and handles bit-exact (rows up to
sum(group_sizes)); the combines within bf16 rounding. Prints "throughput_shrink_worker OK process N".

No XLA collective runs across the processes (they may share one GPU: pytest --share-gpu): the
reference runs in each process alone, every rank under jax.vmap (gpu_helpers.reference_by_vmap).
"""

from __future__ import annotations

import os
import sys
import time

import jax
import ml_dtypes
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from gpu_helpers import local, rank1_masked, rank_rows, reference_by_vmap, worker_main  # noqa: E402
from test_dispatch_gpu import assert_bits_equal, assert_combine_close  # noqa: E402

import jax_ep  # noqa: E402
import jax_ep.distributed  # noqa: E402
from jax_ep import runtime  # noqa: E402

AXIS = "ep"
T, H, K, E = 32, 256, 3, 8


def masks(ranks: int):
    """[R, R] masks, one copy per rank: every rank active, and rank 1 masked."""
    return np.ones((ranks, ranks), np.int32), np.tile(np.array(rank1_masked(ranks), np.int32), (ranks, 1))


def body(cfg, masked: bool):
    def per_rank(x, idx, w, y, mask):
        m = mask[0] if masked else None
        d = jax_ep.dispatch(x, idx, w, cfg, rank_mask=m)
        out = jax_ep.combine(y, d.handle, cfg, rank_mask=m)
        rm = jax_ep.dispatch_rank_major(x, idx, w, cfg, rank_mask=m)
        back = jax_ep.combine_rank_major(rm.x, rm.handle, cfg, rank_mask=m)
        return jax.tree.map(lambda a: a[None], (d, rm)), out, back

    return per_rank


def inputs(cfg, ranks: int):
    rng = np.random.default_rng(11)
    x = rng.standard_normal((ranks * T, H)).astype(ml_dtypes.bfloat16)
    idx = np.stack([rng.permutation(E)[:K] for _ in range(ranks * T)]).astype(np.int32)
    w = rng.random((ranks * T, K)).astype(np.float32)
    y = rng.standard_normal((ranks * cfg.resolved_capacity(ranks), H)).astype(ml_dtypes.bfloat16)
    return x, idx, w, y


def compare(got, want, what: str) -> None:
    """One rank's outputs: dispatch (rows up to sum(group_sizes)) and rank-major dispatch bit for bit,
    the combines within bf16 rounding."""
    (d, rm), out, back = got
    (dw, rmw), out_w, back_w = want
    total = int(dw.group_sizes[0].sum())
    assert_bits_equal(d.x[0][:total], dw.x[0][:total], f"{what} dispatch rows")
    for field in ("group_sizes", "expert_counts", "num_dropped", "rank_mask"):
        if getattr(dw, field) is not None:
            assert_bits_equal(getattr(d, field)[0], getattr(dw, field)[0], f"{what} dispatch {field}")
    for field in ("src_index", "token_rows", "is_token_in_rank", "row_weights"):
        assert_bits_equal(getattr(d.handle, field)[0], getattr(dw.handle, field)[0], f"{what} handle.{field}")
    filled = rmw.handle.src_index[0] >= 0
    assert_bits_equal(rm.x[0][filled], rmw.x[0][filled], f"{what} rank-major rows")
    for field in ("topk_idx", "topk_weights", "num_tokens_per_rank", "num_tokens_per_expert"):
        assert_bits_equal(getattr(rm, field)[0], getattr(rmw, field)[0], f"{what} rank-major {field}")
    for field in ("src_index", "is_token_in_rank"):
        assert_bits_equal(getattr(rm.handle, field)[0], getattr(rmw.handle, field)[0],
                          f"{what} rank-major handle.{field}")
    assert_combine_close(out, out_w, f"{what} combine")
    assert_combine_close(back, back_w, f"{what} combine_rank_major")


def run(me: int, mesh) -> str:
    cfg = jax_ep.EPConfig(num_experts=E, num_topk=K, hidden=H, max_tokens_per_rank=T, axis_name=AXIS,
                          backend="cuda", shrink=True)
    ref = cfg.replace(backend="reference", shrink=False)
    ranks = jax.process_count()
    ones, masked = masks(ranks)
    x, idx, w, y = inputs(cfg, ranks)
    sharding = NamedSharding(mesh, P(AXIS))

    def put(a):  # this process's part of a global [ranks * n, ...] array
        n = len(a) // ranks
        return jax.make_array_from_process_local_data(sharding, a[me * n:(me + 1) * n])

    args = [put(a) for a in (x, idx, w, y)]
    steps = {m: jax.jit(jax.shard_map(body(cfg, m), mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))
             for m in (False, True)}
    compiled = {m: fn.lower(*args, put(ones)).compile() for m, fn in steps.items()}
    want_all = rank_rows(reference_by_vmap(body(ref, False), ranks)(x, idx, w, y, ones), me, ranks)
    want_masked = rank_rows(reference_by_vmap(body(ref, True), ranks)(x, idx, w, y, masked), me, ranks)
    jax_ep.distributed.barrier("throughput_shrink_compiled", 180)
    together = jax.block_until_ready(compiled[False](*args, put(ones)))
    compare(local(together), want_all, f"process {me} together")
    if me == 1:  # stops calling; stays alive until the others are done
        jax_ep.distributed.barrier("throughput_shrink_done", 600)
        return "stopped calling after one call"
    timeout_s = float(os.environ["JAX_EP_TIMEOUT_S"])
    times = []
    for name in ("first", "second"):
        start = time.monotonic()
        got = jax.block_until_ready(compiled[False](*args, put(ones)))
        times.append(time.monotonic() - start)
        compare(local(got), want_masked, f"process {me} {name} call without rank 1")
        if name == "first":
            found = runtime.rank_masks(axis_name=AXIS)
    assert times[0] >= timeout_s and times[1] < timeout_s / 2, times
    # the step's two dispatches are independent: XLA runs either first, and that one masks rank 1 (seen:
    # dispatch_rank_major, one H200 under MPS)
    assert [(m["rank"], m["masked_rank"], m["during"]) for m in found] == [(me, 1, "discovery")], found
    assert found[0]["op"] in ("dispatch", "dispatch_rank_major"), found
    runtime.clear_rank_masks(axis_name=AXIS)
    assert runtime.rank_masks() == []
    start = time.monotonic()
    got = jax.block_until_ready(compiled[True](*args, put(masked)))
    explicit_s = time.monotonic() - start
    compare(local(got), want_masked, f"process {me} explicit mask")
    assert explicit_s < timeout_s / 2 and runtime.rank_masks() == [], (explicit_s, runtime.rank_masks())
    assert runtime.faults() == [], runtime.faults()
    jax_ep.distributed.barrier("throughput_shrink_done", 600)
    return f"call times {[round(t, 2) for t in times]} s, explicit {explicit_s:.2f} s, masks {found}"


def main() -> None:
    worker_main(run, "throughput_shrink_worker", AXIS)


if __name__ == "__main__":
    main()
