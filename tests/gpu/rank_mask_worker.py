"""Rank masking on the CUDA kernels with a masked rank that never enters the call
(tests/gpu/test_rank_mask_gpu.py). Rank 1 masked (rank_mask [1, 0] on two GPUs; with N processes
every rank but 1 active).

    python tests/gpu/rank_mask_worker.py model1
        one process drives both GPUs; rank 1's GPU skips the EP calls (a lax.cond on
        lax.axis_index): rank 0 must finish and match the reference
    python -m jax_ep.launch --nproc N tests/gpu/rank_mask_worker.py model2
        one process per GPU; after a first all-active step together, process 1 stops calling (it
        waits at a distributed barrier) and the others run the masked step 3 times without it

The step: dispatch, combine, and their gradients (combine's backward: broadcast; dispatch's:
combine, slot_values), all with the mask. A masked rank sends and receives nothing on every backend,
so each active rank is compared with the reference under the same mask and inputs: dispatch outputs
and handle fields bit-exact (num_dropped includes its pairs to rank 1's experts), combine and the
gradients within bf16 rounding. Prints "rank_mask_worker OK <model> ..." at the end.

Model 2 runs no XLA collective across the processes (they may share one GPU: pytest --share-gpu, and
NCCL refuses two processes on one GPU): its reference runs in each process alone, every rank under
jax.vmap (gpu_helpers.reference_by_vmap).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from gpu_helpers import local, rank1_masked, rank_rows, reference_by_vmap  # noqa: E402

import jax_ep  # noqa: E402
from jax_ep.vma import varying_axes  # noqa: E402

AXIS = "ep"
T, H, K, E = 64, 256, 2, 8
CFG = jax_ep.EPConfig(num_experts=E, num_topk=K, hidden=H, max_tokens_per_rank=T, axis_name=AXIS,
                      capacity=48, backend="cuda")  # rank 0 drops for capacity too
EXACT = ("rows", "group_sizes", "expert_counts", "num_dropped", "src_index", "token_rows",
         "is_token_in_rank", "row_weights")


def inputs(R: int):
    """[R * T, ...] global inputs (the same on every process)."""
    rng = np.random.default_rng(15)
    x = rng.standard_normal((R * T, H)).astype(jnp.bfloat16)
    idx = np.argsort(rng.random((R * T, E)), axis=1)[:, :K].astype(np.int32)
    w = rng.random((R * T, K)).astype(np.float32)
    return x, idx, w


def step_outputs(x, idx, w, mask, cfg):
    """The per-rank step: dispatch, combine and the gradients wrt x and topk_weights."""

    def loss(x, w):
        d = jax_ep.dispatch(x, idx, w, cfg, rank_mask=mask)
        out = jax_ep.combine(d.x, d.handle, cfg, rank_mask=mask)
        return jnp.sum(out.astype(jnp.float32) ** 2), (d, out)

    (_, (d, out)), (gx, gw) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, w)
    return dict(rows=d.x, group_sizes=d.group_sizes, expert_counts=d.expert_counts,
                num_dropped=d.num_dropped, src_index=d.handle.src_index, token_rows=d.handle.token_rows,
                is_token_in_rank=d.handle.is_token_in_rank, row_weights=d.handle.row_weights,
                out=out, gx=gx, gw=gw)


def varying(tree):
    """Every leaf typed as varying over the EP axis."""
    return jax.tree.map(
        lambda a: a if AXIS in varying_axes(a) else lax.pcast(a, (AXIS,), to="varying"), tree)


def step(mesh, cfg, skip_masked: bool):
    """jit(shard_map) of the step; mask [R * R] (each rank's row: the [R] mask). skip_masked: the
    masked ranks' GPUs skip it (lax.cond on the axis index: zeros there, no EP call)."""

    def body(x, idx, w, m):
        # both branches' outputs typed as varying over the axis (lax.cond wants equal types)
        run = lambda: varying(step_outputs(x, idx, w, m, cfg))  # noqa: E731
        if skip_masked:
            zeros = lambda: varying(  # noqa: E731
                jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(run)))
            res = lax.cond(m[lax.axis_index(AXIS)] == 0, zeros, run)
        else:
            res = run()
        return {k: v[None] for k, v in res.items()}

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))


def reference_body(cfg):
    """The per-rank body of reference_step: `step`'s without its typing for lax.cond (there is no
    cond, and vmap has no mesh axes). tests/test_reference_vmap.py checks its reference_by_vmap on CPU."""

    def body(x, idx, w, m):
        return {k: v[None] for k, v in step_outputs(x, idx, w, m, cfg).items()}

    return body


def reference_step(cfg, R: int):
    """The step of every rank in this process (reference_by_vmap; global [R * ...] in and out, as
    `step`'s)."""
    return reference_by_vmap(reference_body(cfg), R, AXIS)


def mask_rows(mask):
    """[R * R]: each rank's copy of the [R] mask."""
    return np.tile(np.asarray(mask, np.int32), (len(mask), 1)).reshape(-1)


def compare(got: dict, want: dict, what: str) -> None:
    """One rank's outputs ([0] of each): exact fields bit for bit (rows up to sum(group_sizes)),
    combine and the gradients within a bf16 step of their row's largest value."""
    total = int(np.asarray(want["group_sizes"][0]).sum())
    for k in EXACT:
        g, r = np.atleast_1d(np.asarray(got[k][0])), np.atleast_1d(np.asarray(want[k][0]))
        if k == "rows":
            g, r = g[:total], r[:total]
        assert g.shape == r.shape and g.dtype == r.dtype, (what, k, g.shape, r.shape)
        gb, rb = g.view(np.uint8), r.view(np.uint8)
        assert np.array_equal(gb, rb), f"{what}: {k} differs in {int(np.sum(gb != rb))} bytes"
    for k in ("out", "gx", "gw"):
        g = np.asarray(got[k][0]).astype(np.float32)
        r = np.asarray(want[k][0]).astype(np.float32)
        scale = np.abs(r).max(axis=-1, keepdims=True) + 1e-30
        err = float((np.abs(g - r) / scale).max(initial=0.0))
        assert np.isfinite(g).all() and err <= 2.0 ** -7, f"{what}: {k} max error {err:.3g}"


def model1() -> str:
    R, MASK = 2, rank1_masked(2)
    gpus = jax.local_devices(backend="gpu")[:R]
    mesh = Mesh(np.array(gpus), (AXIS,))
    x, idx, w = inputs(R)
    ref_cfg = dataclasses.replace(CFG, backend="reference")
    want = step(mesh, ref_cfg, False)(x, idx, w, mask_rows(MASK))
    fn = step(mesh, CFG, True)
    start = time.monotonic()
    for call, mask in enumerate([MASK, (5, 0), MASK]):  # nonzero = active: the same mask, new values
        got = fn(x, idx, w, mask_rows(mask))
        compare(got, want, f"model 1 call {call}")
        zeros = [k for k in EXACT if np.any(np.asarray(got[k][1]))]
        assert not zeros, f"rank 1 skipped the call but its outputs {zeros} are not the cond's zeros"
    seconds = time.monotonic() - start
    assert fn._cache_size() == 1, "new mask values must not recompile"
    from jax_ep import runtime

    assert not runtime.faults(), runtime.faults()
    return f"3 calls in {seconds:.2f} s, rank 0 matches the reference, rank 1 never entered"


def model2() -> str:
    import jax_ep.distributed
    from jax_ep import runtime

    jax_ep.distributed.initialize()  # from python -m jax_ep.launch: one GPU per process
    me, R = jax.process_index(), jax.process_count()
    MASK = rank1_masked(R)
    assert runtime.process_model() == "process_per_gpu", runtime.process_model()
    mesh = Mesh(np.array(jax.devices()), (AXIS,))
    sharding = NamedSharding(mesh, P(AXIS))

    def put(a):
        rows = a.shape[0] // R
        return jax.make_array_from_process_local_data(sharding, a[me * rows:(me + 1) * rows])

    x, idx, w = inputs(R)
    reference = reference_step(dataclasses.replace(CFG, backend="reference"), R)
    # the masked reference, the reference without a mask, and the CUDA step all active (= the latter)
    want = rank_rows(reference(x, idx, w, mask_rows(MASK)), me, R)
    plain = rank_rows(reference(x, idx, w, mask_rows((1,) * R)), me, R)
    fn = step(mesh, CFG, False)
    all_active = local(fn(put(x), put(idx), put(w), put(mask_rows((1,) * R))))
    compare(all_active, plain, f"model 2 all active, process {me}")
    args = (put(x), put(idx), put(w), put(mask_rows(MASK)))
    compiled = fn.lower(*args).compile()
    jax_ep.distributed.barrier("rank_mask_worker_compiled", 180)
    if me == 1:  # stops calling until the others are done
        jax_ep.distributed.barrier("rank_mask_worker_done", 300)
        return "stopped calling; the others finished without it"
    start = time.monotonic()
    for call in range(3):
        compare(local(compiled(*args)), want, f"model 2 process {me} call {call}")
    seconds = time.monotonic() - start
    assert not runtime.faults(), runtime.faults()
    jax_ep.distributed.barrier("rank_mask_worker_done", 300)
    return f"3 masked calls alone in {seconds:.2f} s, matching the reference"


def main(argv) -> None:
    model = argv[0] if argv else ""
    assert model in ("model1", "model2"), f"usage: rank_mask_worker.py model1|model2, got {argv}"
    try:
        report = model1() if model == "model1" else model2()
    except BaseException:  # noqa: BLE001  (maybe a dead CUDA context: no teardown, exit now)
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    print(f"rank_mask_worker OK {model} process {jax.process_index()}: {report}", flush=True)
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
