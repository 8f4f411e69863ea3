"""Runs the CUDA EP kernels on the CPU emulation (emu_cuda.h + driver.cc) and compares every
output with jax_ep.reference (bit-exact; combine too: same summation order). Every case runs the
expert-major ops (dispatch, combine and combine_bwd with NaN in y's empty rows, combine_bwd also in
y's buffer, broadcast, slot_values) and the rank-major ones (dispatch_rank_major, combine_rank_major
with NaN in the empty rows and some -0.0, broadcast_rank_major).
The cases with a rank mask (``mask=``, ``absent=``; ``-k mask`` runs the fixed ones) run every op
with the mask, some masked ranks' processes running no op at all, and compare every rank that runs
them, masked ones included (see ``run_case``).

    python tools/kernel_emulator/run.py [--quick] [-k NAME]   # --quick: 3 cases + one pulled
    python tools/kernel_emulator/run.py --random N [--seed S]   # N random cases (a sweep)

Needs g++ (C++20). Each GPU is a process, each CUDA thread an OS thread: keep shapes small.

``--random N --seed S`` draws N cases (``random_case``): EP size 1-4, tokens per rank 0-24, hidden a
multiple of 8 (of 128 for FP8), top-k 1-8, experts a multiple of the EP size, expert alignment 1/2/4/8,
the worst-case capacity or a smaller one (drops), x / row / y dtypes, routing with -1, out-of-range ids
(int32 extremes too), repeated experts and hot experts, kernel blocks, send warps, bulk copies on/off,
repetitions on the same (poisoned) memory, and in a quarter of the cases with R >= 2 a rank mask
(``random_mask``). Each is checked like the fixed cases. Case i of seed S is
``random_case(np.random.default_rng([S, i]))``: a failure prints its parameters, and
``--random N --seed S --only I`` runs that case alone.

``--mismatch`` runs the config-fingerprint cases instead (``MISMATCHES``): two ranks, one dispatch
each, the last rank's call differing in one field of cuda/fingerprint.h (or its call count in the
group ahead; or, case ``transport``, a dispatch_rank_major over NVSHMEM puts on rank 0 and over
loads / stores on rank 1; or, case ``pull``, rank 0's dispatch pulling its rows and rank 1's pushing
them: field transport); every rank must trap with a fault record naming the field and both
values, and the host's message (xla_ffi/fault_message.cc, printed by the driver) must name the op,
the rank, the field and both values.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax  # noqa: E402
import numpy as np  # noqa: E402
from harness import (  # noqa: E402  (sets up jax with 8 CPU devices)
    FIELD_ID,
    KIND,
    bits_equal,
    build,
    faults_of,
    load_output,
    rank_major_reference,
    routing,
    run_driver_case,
    to_dtype,
)
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jax_ep import reference  # noqa: E402
from jax_ep.config import EPConfig  # noqa: E402

DRIVER = os.path.join(tempfile.gettempdir(), "jax_ep_emu_driver")
SOURCES = ("cuda/group.cu", "cuda/dispatch.cu", "cuda/combine.cu", "cuda/broadcast.cu", "cuda/slot_values.cu",
           "cuda/remote_rank_major.cu", "xla_ffi/fault_message.cc", "tools/kernel_emulator/driver.cc")


def random_case(rng) -> dict:
    """One random case for run_case (the --random sweep): shapes, routing, capacity, alignment, dtypes
    and kernel knobs drawn from rng."""
    R = int(rng.choice([1, 2, 3, 4], p=[0.15, 0.45, 0.15, 0.25]))
    E = R * int(rng.integers(1, 5))
    K = int(rng.integers(1, min(E, 8) + 1))
    T = int(rng.choice([0, 1, 2, 3, 5, 8, 13, 17, 24]))
    max_tokens = max(T, 1) + int(rng.choice([0, 0, 3]))  # sometimes fewer tokens than the maximum
    x_dtype = str(rng.choice(["bfloat16", "float32"]))
    dispatch_dtype = rng.choice([None, "bfloat16", "float8_e4m3fn"], p=[0.5, 0.2, 0.3])
    if dispatch_dtype == "bfloat16" and x_dtype == "bfloat16":
        dispatch_dtype = None
    if dispatch_dtype == "float8_e4m3fn":
        H = 128 * int(rng.integers(1, 4))
    elif rng.random() < 0.1:
        H = 8 * int(rng.integers(256, 513))  # long rows (combine moves them in pieces)
    else:
        H = 8 * int(rng.integers(1, 49))
    align = int(rng.choice([1, 2, 4, 8]))
    worst = EPConfig(num_experts=E, num_topk=K, hidden=H, max_tokens_per_rank=max_tokens,
                     expert_alignment=align).worst_case_capacity(R)
    capacity = None
    if rng.random() < 0.5:  # smaller than the worst case, biased to very small (many drops)
        capacity = align * max(1, int(worst // align * rng.random() ** 2))
    return dict(R=R, T=T, H=H, K=K, E=E, max_tokens=max_tokens, capacity=capacity, align=align,
                x_dtype=x_dtype, dispatch_dtype=None if dispatch_dtype is None else str(dispatch_dtype),
                y_dtype=str(rng.choice(["bfloat16", "float32"])), kind="fuzz",
                blocks=int(rng.integers(1, 4)), send_warps=int(rng.integers(1, 16)),
                reps=int(rng.integers(1, 3)), tma=bool(rng.random() < 0.7),
                seed=int(rng.integers(0, 2**31)), **random_mask(rng, R))


def with_pull(case: dict) -> dict:
    """A random case with the pull form (dispatches, broadcasts) in half the cases (an odd case seed; no
    draw of its own, so the sweep's other parameters stay those of the sweep before it)."""
    return dict(case, pull=case["seed"] % 2 == 1)


def random_mask(rng, R) -> dict:
    """A quarter of the random cases with R >= 2 mask ranks (drawn after everything else, so the
    other parameters of case i are those of the sweep before rank masking): any mask, all-active
    included, with at least one active rank; each masked rank runs no op with probability 1/2."""
    if R < 2 or rng.random() >= 0.25:
        return {}
    mask = tuple(int(m) for m in rng.integers(0, 2, R))
    if not any(mask):
        keep = int(rng.integers(0, R))
        mask = tuple(int(r == keep) for r in range(R))
    absent = tuple(r for r in range(R) if not mask[r] and rng.random() < 0.5)
    return dict(mask=mask, absent=absent)


def case_inputs(seed, R, T, H, K, E, capacity=None, align=1, x_dtype="bfloat16", dispatch_dtype=None,
                y_dtype="bfloat16", kind="distinct", max_tokens=None):
    """A case's EPConfig (reference backend), capacity C, row dtype and global inputs [R, ...]: x,
    idx, w, y (expert outputs [R, C, H]), g (per-token rows), v (row values), yr (rank-major expert
    rows [R, R*T, H], some -0.0)."""
    rng = np.random.default_rng(seed)
    cfg = EPConfig(num_experts=E, num_topk=K, hidden=H, max_tokens_per_rank=max_tokens or max(T, 1),
                   capacity=capacity, expert_alignment=align, dispatch_dtype=dispatch_dtype,
                   backend="reference")
    C = cfg.resolved_capacity(R)
    x = to_dtype(rng.standard_normal((R, T, H)).astype(np.float32) * 3, x_dtype)
    idx = routing(rng, kind, R, T, K, E)
    w = rng.random((R, T, K)).astype(np.float32)
    y = to_dtype(rng.standard_normal((R, C, H)).astype(np.float32), y_dtype)
    g = to_dtype(rng.standard_normal((R, T, H)).astype(np.float32), y_dtype)
    v = rng.standard_normal((R, C)).astype(np.float32)
    yr = rng.standard_normal((R, R * T, H)).astype(np.float32)
    yr = to_dtype(np.where(rng.random(yr.shape) < 0.05, np.float32(-0.0), yr), y_dtype)
    return cfg, C, dispatch_dtype or x_dtype, (x, idx, w, y, g, v, yr)


def run_case(name, *, R, T, H, K, E, capacity=None, align=1, x_dtype="bfloat16", dispatch_dtype=None,
             y_dtype="bfloat16", kind="distinct", blocks=2, send_warps=4, reps=2, seed=0,
             max_tokens=None, tma=True, mask=None, absent=(), mask_odd=None, unmasked_dispatch=False,
             persistent=None, persistent_at="start", stop=None, timeout_s=None, pull=False):
    """Run one case on the emulated kernels and compare with the reference. T tokens per rank (0 is
    fine), max_tokens (default T) sizes the default capacity; tma=False sets JAX_EP_TMA=0; pull: both
    dispatches and both broadcasts (expert- and rank-major) pull their rows (KernelConfig.dispatch_pull,
    broadcast_pull) on every rank.

    mask (one 0/1 per rank): rank masking for every op, expert- and rank-major. Every rank that runs
    the ops, masked ones too, is compared with the reference under the same mask and the same
    routing (a masked rank sends and receives nothing).
    absent: masked ranks whose process runs no op at all (the others must still finish; nothing of
    theirs is compared).
    mask_odd: the mask of the odd repetitions (default: mask), e.g. a rank masked in one call and
    active in the next (it ran the masked call, so it is in step).
    unmasked_dispatch: both dispatches run without the mask, the ops through their handles with it
    (a combine mask after an unmasked dispatch: rows of sources the ops do not link).
    persistent (one 0/1 per rank, 0 = masked): the persistent mask of the group (what a shrink-mode
    call leaves, cuda/device_state.h rank_masks), set on every running rank at the start of each
    repetition (persistent_at="start") or right after its expert-major dispatch ("dispatch": the
    rest of the repetition runs with it). The kernels must AND it into their rank_mask: the
    outputs equal the reference with the explicit mask mask AND persistent (from the op where it is
    set on), the dispatch's rank_mask output included.
    stop (rank, n): shrink mode (EPConfig.shrink) with that rank's process stopping after n
    repetitions (n = 0: it never calls). The others' repetitions before it equal the reference,
    those from it on the reference with that rank masked; check_stop: the first call of
    repetition n (the dispatch) waits out the timeout (timeout_s) once and masks it persistently
    (event: dispatch, discovery), no later repetition waits."""
    cfg, C, row_dtype, (x, idx, w, y, g, v, yr) = case_inputs(
        seed, R, T, H, K, E, capacity, align, x_dtype, dispatch_dtype, y_dtype, kind, max_tokens)
    mesh = Mesh(np.array(jax.devices()[:R]), ("ep",))
    assert mask_odd is None or (mask is not None and not absent), "mask_odd: every rank runs"
    assert not unmasked_dispatch or (mask is not None and not absent), "unmasked_dispatch: every rank runs"
    # per repetition: the mask of the expert-major dispatch, and of the ops after it
    plans = [(mask if rep % 2 == 0 or mask_odd is None else mask_odd,) * 2 for rep in range(reps)]
    if persistent is not None:  # the explicit mask it amounts to
        assert mask_odd is None and not unmasked_dispatch, "persistent: one mask for every call"
        late = tuple(int(a) & int(b) for a, b in zip(mask or (1,) * R, persistent, strict=True))
        plans = [(late if persistent_at == "start" else mask, late)] * reps
    if stop is not None:  # from repetition n on, the stopped rank is masked
        lost = tuple(int(a) & int(r != stop[0]) for r, a in enumerate(mask or (1,) * R))
        plans = [plan if rep < stop[1] else (lost, lost) for rep, plan in enumerate(plans)]
    for m, _ in plans:
        assert m is None or all(m[r] == 0 for r in absent), "only a masked rank may be absent"
    distinct = list(dict.fromkeys(plans))

    def refs(keep=None):
        return {p: reference_outputs(cfg, mesh, p[0], x, idx, w, y, g, v, yr, unmasked_dispatch, keep,
                                     late=None if p[1] == p[0] else p[1]) for p in distinct}

    found = refs()
    if len(distinct) > 1:  # NaN only in the rows empty under every mask
        found = refs((np.any([found[p]["src_index"] >= 0 for p in distinct], axis=0),
                      np.any([found[p]["rm_src"] >= 0 for p in distinct], axis=0)))
    y, yr = found[distinct[0]]["y"], found[distinct[0]]["rm_y"]
    for p in distinct:
        found[p].pop("y"), found[p].pop("rm_y")
    if stop is not None and mask is not None:  # an explicitly masked rank waits for nobody: it does
        for p in distinct:                     # not see the stopped one go (its rank_mask output)
            found[p]["rank_mask"] = found[p]["rank_mask"].copy()
            found[p]["rank_mask"][np.asarray(mask) == 0] = np.asarray(mask, np.int32)
    wants = [found[p] for p in plans]
    want = wants[0]
    masks = [mask, mask if mask_odd is None else mask_odd]

    cmd = [DRIVER, R, T, H, K, E, C, align, KIND[x_dtype], KIND[row_dtype], KIND[y_dtype], blocks,
           send_warps, reps]
    flags = ["" if m is None else ",".join(str(int(f)) for f in m) for m in masks]
    if persistent is not None:  # the operand masks are the explicit ones only
        flags = ["" if mask is None else ",".join(str(int(f)) for f in mask)] * 2
    env = dict(os.environ, JAX_EP_TMA="1" if tma else "0", JAX_EP_EMU_MASK=flags[0],
               JAX_EP_EMU_MASK_ODD=flags[1], JAX_EP_EMU_ABSENT=",".join(str(r) for r in absent),
               JAX_EP_EMU_UNMASKED_DISPATCH="1" if unmasked_dispatch else "0",
               JAX_EP_EMU_PERSISTENT="" if persistent is None else ",".join(map(str, persistent)),
               JAX_EP_EMU_PERSISTENT_AT=persistent_at, JAX_EP_EMU_SHRINK="1" if stop else "0",
               JAX_EP_EMU_STOP="" if stop is None else f"{stop[0]},{stop[1]}",
               JAX_EP_EMU_TIMEOUT_S="" if timeout_s is None else str(timeout_s),
               JAX_EP_EMU_PULL="1" if pull else "0")

    def check(d, took):
        ok = True
        for r in range(R):
            if r in absent:  # (it ran nothing)
                continue
            for rep in range(reps):
                if stop is None or r != stop[0] or rep < stop[1]:
                    ok &= compare_rank(name, d, r, rep, wants[rep])
        if stop is not None and (error := check_stop(d, R, reps, stop, timeout_s, mask)):
            print(f"  {error}")
            ok = False
        rows = [int(s.sum()) for s in want["group_sizes"]]
        more = f"rank-major rows {[int(s.sum()) for s in want['rm_per_rank']]}"
        if mask is not None:
            more += f", mask {list(mask)}, absent {list(absent)}"
        if mask_odd is not None:
            more += f", odd calls mask {list(mask_odd)}"
        if unmasked_dispatch:
            more += ", dispatches unmasked"
        if persistent is not None:
            more += f", persistent {list(persistent)} from the {persistent_at}"
        if stop is not None:
            more += f", shrink, rank {stop[0]} stops after {stop[1]} repetitions"
        print(f"{'ok  ' if ok else 'FAIL'} {name} (C={C}, rows {rows}, dropped "
              f"{want['num_dropped'].tolist()}, {more}, {took:.1f}s)")
        return ok

    inputs = dict(x=x, idx=idx, w=w, y=y, g=g, v=v, yr=yr)
    return run_driver_case(name, cmd, inputs, check, env=env, timeout=900)


# The persistent mask state of a group (cuda/device_state.h SyncCounters::RankMaskState).
RANK_MASK_EVENT = np.dtype([("op", np.int32), ("during", np.int32), ("epoch", np.uint64)])
RANK_MASK_STATE = np.dtype([("masked", np.uint32), ("rank", np.int32), ("events", RANK_MASK_EVENT, (32,))])
OPS_PER_REP = 11  # EP calls of a repetition (driver.cc): each bumps the group's epoch


def check_stop(d, R, reps, stop, timeout_s, mask=None) -> str:
    """A `stop` case (shrink mode): each other active rank's persistent mask after each repetition,
    and how long its dispatch took: the rank is masked from repetition n on (event: dispatch during
    discovery, in that repetition's dispatch), only repetition n's dispatch waited for it ('' when
    so). A rank masked by `mask` waits for nobody."""
    lost, n = stop
    for r in range(R):
        if r == lost or (mask is not None and not mask[r]):
            continue
        took = [float(np.fromfile(os.path.join(d, f"time{r}_{rep}.bin"))[0]) for rep in range(reps)]
        for rep in range(reps):
            state = np.fromfile(os.path.join(d, f"masked{r}_{rep}.bin"), dtype=RANK_MASK_STATE)[0]
            want = 0 if rep < n else 1 << lost
            if int(state["masked"]) != want:
                return f"rank {r} rep {rep}: persistent mask {int(state['masked']):#x}, want {want:#x}"
            if rep >= n:
                ev = state["events"][lost]
                got = (int(ev["op"]), int(ev["during"]), int(ev["epoch"]))
                if got != (OPS["dispatch"], 1, OPS_PER_REP * n + 1):
                    return f"rank {r}: event {got}, want (dispatch, discovery, epoch {OPS_PER_REP * n + 1})"
            # repetition n waits the timeout; a later one must not: it takes at least half the
            # timeout less (an absolute bound failed on loaded CPUs, where one dispatch took 3.3 s
            # of work with a 3 s timeout)
            if rep == n and took[rep] < timeout_s:
                return (f"rank {r}: the dispatch of repetition {n} took {took[rep]:.1f}s: it must "
                        f"wait the {timeout_s}s timeout")
            if rep > n and took[rep] > took[n] - timeout_s / 2:
                return (f"rank {r}: the dispatch of repetition {rep} took {took[rep]:.1f}s, that of "
                        f"repetition {n} {took[n]:.1f}s: only repetition {n} may wait the "
                        f"{timeout_s}s timeout")
    return ""


def reference_outputs(cfg, mesh, mask, x, idx, w, y, g, v, yr, unmasked_dispatch=False, keep=None,
                      late=None) -> dict:
    """What every rank's driver outputs must be ([R, ...] each), under the mask (None: none; with
    unmasked_dispatch, the dispatches run without it).
    y / rm_y: the expert-major / rank-major y the driver gets, NaN in the empty rows (keep: a pair
    of [R, C] and [R, R*T] bool, rows kept even if empty). late: the mask of every op after the
    expert-major dispatch (default: mask), e.g. with a persistent mask set between them."""
    rank_mask = None if mask is None else jax.numpy.asarray(mask, bool)
    dispatch_mask = None if unmasked_dispatch else rank_mask
    late_mask = rank_mask if late is None else jax.numpy.asarray(late, bool)
    if keep is None:
        keep = (np.zeros(y.shape[:2], bool), np.zeros(yr.shape[:2], bool))

    def body(x, idx, w, y, g, v, yr, keep, rm_keep):
        d = reference.dispatch(x[0], idx[0], w[0], cfg, dispatch_mask)
        # the expert outputs: empty rows hold NaN (combine and combine_bwd never read them)
        y_in = jax.numpy.where(((d.handle.src_index >= 0) | keep[0])[:, None], y[0],
                               jax.numpy.nan).astype(y.dtype)
        # the driver's unweighted combine (row_weights null) is the reference with weights 1
        unweighted = d.handle._replace(row_weights=jax.numpy.ones_like(d.row_weights))
        bwd_dy, bwd_drw = reference.combine_bwd(g[0], y_in, d.handle, cfg, late_mask)
        # the same in y's buffer: the rows with no token keep y's (NaN here)
        bwd_dy_in_y, bwd_drw_in_y = reference.combine_bwd(g[0], y_in, d.handle, cfg, late_mask,
                                                          empty_rows_from_y=True)
        out = dict(rows=d.x, group_sizes=d.group_sizes, expert_counts=d.expert_counts,
                   row_weights=d.row_weights, num_dropped=d.num_dropped, rank_mask=d.rank_mask,
                   src_index=d.handle.src_index,
                   token_rows=d.handle.token_rows, in_rank=d.handle.is_token_in_rank,
                   comb_w=reference.combine(y_in, d.handle, cfg, late_mask),
                   comb_u=reference.combine(y_in, unweighted, cfg, late_mask),
                   bcast=reference.broadcast(g[0], d.handle, cfg, late_mask),
                   bcast_in_y=reference.broadcast(g[0], d.handle, cfg, late_mask, into=y_in),
                   bwd_dy=bwd_dy, bwd_drw=bwd_drw, bwd_dy_in_y=bwd_dy_in_y, bwd_drw_in_y=bwd_drw_in_y,
                   y=y_in,
                   slotv=reference.slot_values(v[0], d.handle, cfg, late_mask))
        if d.scales is not None:
            out["scales"] = d.scales
        # (the rank-major ops run after the expert-major ones: with the late mask)
        out.update(rank_major_reference(x[0], idx[0], w[0], g[0], yr[0], cfg, late_mask, rm_keep[0],
                                        unmasked_dispatch))
        return {k: a[None] for k, a in out.items()}

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    args = [jax.device_put(a, NamedSharding(mesh, P("ep"))) for a in (x, idx, w, y, g, v, yr, *keep)]
    return {k: np.asarray(a) for k, a in fn(*args).items()}


def compare_rank(name, d, r, rep, want) -> bool:
    """Outputs of rank r, repetition rep, against the reference: bit-exact, except the expert-major
    combine (float32 summation: within one step of the output dtype, relative to the row's largest
    value). combine_rank_major (rm_comb) adds whole rows in rank order: bit-exact."""
    ok = True
    total = int(want["group_sizes"][r].sum()) if "group_sizes" in want else None
    for field, ref in want.items():
        ref = np.atleast_1d(ref[r])
        got = load_output(d, field, r, rep, ref)
        if field in ("rows", "scales") and total is not None:  # rows past sum(group_sizes): unspecified
            ref, got = ref[:total], got[:total]
        if field in ("comb_w", "comb_u"):
            gf, rf = got.astype(np.float32), ref.astype(np.float32)
            err = np.abs(gf - rf) / (np.abs(rf).max(axis=1, keepdims=True) + 1e-30)
            step = 2.0 ** -7 if ref.dtype != np.float32 else 2.0 ** -22
            worst = float(err.max(initial=0.0))  # no tokens (T = 0): nothing to compare
            if not (np.isfinite(gf).all() and worst <= step):
                ok = False
                print(f"  MISMATCH {name} rank {r} rep {rep} {field}: max error {worst:.3g}")
            continue
        ok &= bits_equal(f"{name} rank {r} rep {rep} {field}", got, ref)
    return ok


CASES = [
    dict(name="bf16 basic", R=2, T=40, H=256, K=4, E=8),
    dict(name="bf16 messy align4", R=2, T=37, H=264, K=6, E=16, align=4, kind="messy"),
    dict(name="fp8 from bf16", R=2, T=24, H=384, K=4, E=8, dispatch_dtype="float8_e4m3fn"),
    dict(name="fp8 from f32", R=2, T=20, H=256, K=3, E=8, x_dtype="float32",
         dispatch_dtype="float8_e4m3fn", y_dtype="float32"),
    dict(name="f32 -> bf16 rows", R=2, T=18, H=128, K=2, E=4, x_dtype="float32",
         dispatch_dtype="bfloat16"),
    dict(name="f32 rows, f32 y", R=2, T=16, H=64, K=2, E=4, x_dtype="float32", y_dtype="float32"),
    dict(name="capacity overflow skewed", R=2, T=48, H=128, K=4, E=8, capacity=40, align=4,
         kind="skewed"),
    dict(name="3 ranks messy top1", R=3, T=30, H=96, K=1, E=9, kind="messy", capacity=24),
    dict(name="4 ranks top8", R=4, T=17, H=128, K=8, E=16, kind="messy"),
    # EP8, as inside one 8-GPU node (no such machine has been lent: these are the EP8 checks)
    dict(name="8 ranks top8 fp8", R=8, T=6, H=256, K=8, E=16, kind="messy",
         dispatch_dtype="float8_e4m3fn", blocks=1, reps=1),
    dict(name="8 ranks top6 bf16 align8", R=8, T=9, H=128, K=6, E=32, kind="messy", align=8, blocks=1,
         reps=1),
    dict(name="K > E_local, 3 blocks, 1 send warp", R=2, T=41, H=7168, K=6, E=8, blocks=3,
         send_warps=1),
    dict(name="f32 y rows of 16 KiB (two combine pieces)", R=2, T=12, H=4096, K=4, E=8,
         x_dtype="float32", y_dtype="float32"),
    dict(name="fp8 odd blocks, 15 send warps", R=2, T=9, H=640, K=2, E=4,
         dispatch_dtype="float8_e4m3fn", send_warps=15, reps=3),
    # more than 32 experts per rank: notify's segment scan runs over several groups of 32 (with
    # drops where the capacity cuts a segment)
    dict(name="80 experts per rank, segment scan", R=2, T=40, H=64, K=6, E=160, align=4,
         capacity=200, kind="messy"),
    dict(name="70 experts on one rank, segment scan", R=1, T=30, H=64, K=8, E=70, align=2),
    # prep's register slots per token: 8 (K <= 8), 16 (K <= 16), kMaxTopk (wider)
    dict(name="top12 messy (prep's 16 slots)", R=2, T=20, H=64, K=12, E=16, kind="messy"),
    dict(name="top20 messy (prep's kMaxTopk slots)", R=2, T=24, H=64, K=20, E=32, kind="messy"),
    # converting bulk copies in more than one piece of the warp's shared buffer (26 BF16 / 50 FP8
    # steps of 256 elements per piece)
    dict(name="f32 -> bf16 rows in two bulk pieces", R=2, T=10, H=7168, K=4, E=8, x_dtype="float32",
         dispatch_dtype="bfloat16"),
    dict(name="fp8 rows in two bulk pieces", R=2, T=6, H=13440, K=3, E=4,
         dispatch_dtype="float8_e4m3fn"),
    # column slices (CommLayout::num_slices, cuda/ep_layout.h): few tokens per rank cut each row into
    # slices of whole 1.5 KiB pieces as extra work items (one ready flag per chunk and slice), the
    # last one shorter: T = 5 and 14 KiB bf16 rows, 10 slices; FP8 rows of 3.5 KiB in 3 slices
    # (whole 128-channel scale groups) beside 5 of bf16 y; f32 y of exactly 6 slices; R = 4
    dict(name="slices bf16, 10 per row", R=2, T=5, H=7168, K=4, E=8, kind="messy", send_warps=3),
    dict(name="slices fp8 rows, R=4", R=4, T=6, H=3584, K=3, E=8, kind="messy",
         dispatch_dtype="float8_e4m3fn", blocks=3),
    dict(name="slices f32 y, R=4", R=4, T=3, H=2304, K=4, E=16, x_dtype="float32",
         dispatch_dtype="bfloat16", y_dtype="float32", tma=False),
    # slices of several pieces: T = 512 wants 8 slices of a 10-piece row, so 5 of 2 pieces
    dict(name="slices of two pieces, T=512", R=2, T=512, H=7168, K=2, E=4, blocks=3, reps=1),
    # prep walks the tokens in tiles of 1024, the next tile's ids loaded a tile ahead (8 slots)
    dict(name="prep over 3 tiles, top8 (8 slots)", R=2, T=2100, H=64, K=8, E=16, kind="messy", reps=1),
    dict(name="prep over 2 tiles, top12 (16 slots)", R=2, T=1100, H=64, K=12, E=16, kind="messy",
         reps=1),
    dict(name="prep over 2 tiles, top16 (16 slots)", R=2, T=1030, H=64, K=16, E=32, kind="messy",
         reps=1),
    dict(name="mask rank 1 absent, slices", R=3, T=4, H=4096, K=3, E=9, kind="messy", mask=(1, 0, 1),
         absent=(1,)),
    dict(name="mask shrink, rank 2 stops calling, slices", R=3, T=3, H=4096, K=3, E=6, kind="messy",
         stop=(2, 1), reps=2, timeout_s=3),
    # rank masking: all active (the same bits as no mask), masked ranks that run the ops, and masked
    # ranks whose process runs none (the others must not wait for them)
    dict(name="mask all active", R=3, T=20, H=128, K=4, E=9, kind="messy", mask=(1, 1, 1)),
    dict(name="mask rank 1 runs", R=3, T=20, H=128, K=4, E=9, kind="messy", mask=(1, 0, 1),
         capacity=30),
    dict(name="mask rank 0 absent fp8", R=2, T=24, H=256, K=3, E=8, mask=(0, 1), absent=(0,),
         dispatch_dtype="float8_e4m3fn"),
    dict(name="mask ranks 1, 3 absent, f32 y", R=4, T=13, H=64, K=6, E=16, kind="messy",
         mask=(1, 0, 1, 0), absent=(1, 3), x_dtype="float32", y_dtype="float32", align=4),
    dict(name="mask changes between calls", R=3, T=16, H=128, K=3, E=6, kind="messy", capacity=24,
         mask=(0, 1, 1), mask_odd=(1, 1, 0), reps=4),
    # the mask on the ops through the handle only (combine's mask after an unmasked dispatch): rows of
    # sources a rank does not link get nothing (broadcast and combine_bwd zero them)
    dict(name="mask after unmasked dispatch", R=3, T=14, H=264, K=4, E=9, kind="messy", mask=(1, 0, 1),
         unmasked_dispatch=True, mask_odd=(1, 1, 0)),
    # the persistent mask (a rank lost in an earlier shrink-mode call): ANDed into every op's mask,
    # a rank of it absent (it died), or set between a dispatch and the ops through its handle
    dict(name="mask persistent, rank 2 absent", R=3, T=20, H=128, K=4, E=9, kind="messy",
         persistent=(1, 1, 0), absent=(2,), capacity=40),
    dict(name="mask persistent and explicit, fp8", R=4, T=11, H=256, K=3, E=8, kind="messy",
         mask=(1, 1, 0, 1), persistent=(0, 1, 1, 1), absent=(0, 2), dispatch_dtype="float8_e4m3fn"),
    dict(name="mask persistent set after the dispatch", R=3, T=16, H=64, K=3, E=6, kind="messy",
         persistent=(1, 0, 1), persistent_at="dispatch", y_dtype="float32"),
    # shrink mode (EPConfig.shrink): a rank whose process stops calling is masked by the first call
    # that times out on it (once) and by every later one (the persistent mask)
    dict(name="mask shrink, rank 1 stops calling", R=3, T=14, H=128, K=3, E=6, kind="messy",
         stop=(1, 1), reps=3, timeout_s=3),
    dict(name="mask shrink, rank 0 never calls, explicit mask, fp8", R=4, T=9, H=256, K=4, E=8,
         kind="messy", mask=(1, 1, 0, 1), stop=(0, 0), reps=2, timeout_s=3,
         dispatch_dtype="float8_e4m3fn"),
    # the pull form of the dispatches and broadcasts (KernelConfig.dispatch_pull, broadcast_pull): each
    # receiver loads a peer's token from the peer's own staging; the same bits as the push form
    dict(name="pull 3 ranks bf16", R=3, T=8, H=256, K=4, E=9, kind="messy", pull=True),  # (--quick)
    dict(name="pull 4 ranks top8", R=4, T=17, H=128, K=8, E=16, kind="messy", pull=True),
    dict(name="pull slices fp8 rows, R=4", R=4, T=6, H=3584, K=3, E=8, kind="messy",
         dispatch_dtype="float8_e4m3fn", blocks=3, pull=True),
    dict(name="pull f32 -> bf16, no bulk copies, R=3", R=3, T=20, H=264, K=4, E=9, kind="messy",
         x_dtype="float32", dispatch_dtype="bfloat16", tma=False, capacity=30, pull=True),
    dict(name="pull, rank 1 absent", R=3, T=16, H=128, K=4, E=9, kind="messy", mask=(1, 0, 1),
         absent=(1,), pull=True),
    dict(name="pull 8 ranks top6 align8", R=8, T=9, H=128, K=6, E=32, kind="messy", align=8, blocks=1,
         reps=2, pull=True),
]

# the pull form's case in --quick (make test's smoke run)
QUICK_PULL = "pull 3 ranks bf16"


# Config-fingerprint cases (driver.cc, `mismatch`): rank 0 runs dispatch with MISMATCH_SIZES, rank 1
# the same call with one field changed. field -> (rank 0's value, rank 1's), as the messages print
# them. transport: both run dispatch_rank_major, rank 0 over NVSHMEM puts, rank 1 over loads /
# stores (each process of model 2 resolves its own KernelConfig.transport).
MISMATCH_SIZES = dict(R=2, T=4, H=256, K=2, E=12, C=16, align=1, x_kind=KIND["float32"],
                      row_kind=KIND["bfloat16"], y_kind=KIND["bfloat16"])
MISMATCHES = {
    "op": ("dispatch", "combine"),
    "num_ranks": (2, 3),
    "num_tokens": (4, 5),
    "hidden": (256, 264),
    "num_topk": (2, 1),
    "num_experts": (12, 14),
    "capacity": (16, 17),
    "expert_alignment": (1, 2),
    "dtype": ("bfloat16", "float32"),
    "transport": ("put", "load_store"),
    "pull": ("pull", "load_store"),
}
OPS = {"dispatch": 2, "combine": 3, "dispatch_rank_major": 9}
# the values of the fields the messages print by name (cuda/ep_layout.h RowKind, cuda/fingerprint.h
# Transport)
NUMBERS = {"op": OPS, "dtype": {"bfloat16": 0, "float32": 1}, "transport": {"load_store": 0, "put": 1},
           "pull": {"load_store": 0, "pull": 2}}


def run_mismatch(field: str) -> str:
    """One config-fingerprint case (driver.cc `mismatch`); '' when every rank reported what it must."""
    z = MISMATCH_SIZES
    cmd = [DRIVER, tempfile.gettempdir(), z["R"], z["T"], z["H"], z["K"], z["E"], z["C"], z["align"],
           z["x_kind"], z["row_kind"], z["y_kind"], 1, 4, 1, field]
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=300)
    out = proc.stdout
    records, messages = faults_of(out)
    if proc.returncode == 0 or sorted(records) != [0, 1] or sorted(messages) != [0, 1]:
        return f"expected a fault on both ranks, got rc={proc.returncode}:\n{out[-3000:]}"
    sequence = FIELD_ID["call_sequence"]
    for rank, (kind, op, waited, _what, got_field, expected, observed) in records.items():
        text = messages[rank]
        where = f"rank {rank}: {text}"
        op_name = ("combine" if field == "op" and rank == 1
                   else "dispatch_rank_major" if field == "transport" else "dispatch")
        if op != OPS[op_name]:
            return f"{where}: record {records[rank]} names op {op}, not {op_name}"
        if field == "call_sequence":  # rank 1 is 5 calls ahead: rank 0 says so, rank 1 times out
            want = (5, sequence, 1, 6) if rank == 0 else (1, sequence, 6, 1)
            if (kind, got_field, expected, observed) != want or waited != 1 - rank:
                return f"{where}: record {records[rank]}, want kind/field/expected/observed {want}"
            phrase = "out of step" if rank == 0 else "rank 0 has entered 1 (it is 5 calls behind"
            if phrase not in text or "call_sequence" not in text and rank == 0:
                return f"{where}: message lacks {phrase!r}"
            continue
        if field == "behind":  # rank 1 is 1 call ahead: rank 0 times out in the data, rank 1 says why
            if kind != 1 or waited != 1 - rank:
                return f"{where}: record {records[rank]}, want a timeout waiting for rank {1 - rank}"
            behind = "rank 0 has entered 1 (it is 1 call behind"
            if rank == 1 and (got_field != sequence or behind not in text):
                return f"{where}: rank 1's discovery timeout must say rank 0 is 1 call behind"
            continue
        values = MISMATCHES[field]
        mine, theirs = values[rank], values[1 - rank]
        number = NUMBERS.get(field, {})
        named = "transport" if field == "pull" else field  # the fingerprint field it differs in
        want = (5, FIELD_ID[named], number.get(mine, mine), number.get(theirs, theirs))
        if (kind, got_field, expected, observed) != want or waited != 1 - rank:
            return f"{where}: record {records[rank]}, want kind/field/expected/observed {want}"
        parts = [f"jax_ep: {op_name} on GPU {rank} (rank {rank})", f"rank {1 - rank}",
                 f"{named} is {mine} on rank {rank} and {theirs} on rank {1 - rank}"]
        if field == "transport":
            parts.append("KernelConfig.transport")
        if field == "pull":
            parts.append("give every process the same explicit KernelConfig.dispatch_pull and broadcast_pull")
        for part in parts:
            if part not in text:
                return f"{where}: message lacks {part!r}"
    return ""


def random_cases(n: int, seed: int) -> list[dict]:
    """The --random sweep: case i is random_case(default_rng([seed, i])), named by seed and index."""
    cases = []
    for i in range(n):
        c = with_pull(random_case(np.random.default_rng([seed, i])))
        short = {"bfloat16": "bf16", "float32": "f32", "float8_e4m3fn": "fp8"}
        rows = short[c["dispatch_dtype"] or c["x_dtype"]]
        name = (f"random seed {seed} case {i}: R={c['R']} T={c['T']}/{c['max_tokens']} H={c['H']} "
                f"K={c['K']} E={c['E']} align={c['align']} capacity={c['capacity']} "
                f"{short[c['x_dtype']]}->{rows} y={short[c['y_dtype']]} blocks={c['blocks']} "
                f"warps={c['send_warps']} tma={int(c['tma'])} reps={c['reps']} pull={int(c['pull'])}"
                + (f" mask={c['mask']} absent={c['absent']}" if "mask" in c else ""))
        cases.append(dict(name=name, **c))
    return cases


def main():
    global DRIVER
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help=f"the first 3 fixed cases and {QUICK_PULL!r}")
    parser.add_argument("-k", default="", help="only cases whose name contains this")
    parser.add_argument("--random", type=int, default=0, metavar="N",
                        help="run N random cases (random_case) instead of the fixed ones")
    parser.add_argument("--seed", type=int, default=0, help="seed of the --random sweep (default 0)")
    parser.add_argument("--only", type=int, default=None, metavar="I",
                        help="with --random: run only case I of the sweep")
    parser.add_argument("--driver", default=DRIVER, help=f"where to build the driver (default {DRIVER})")
    parser.add_argument("--mismatch", action="store_true",
                        help="run the config-fingerprint cases (MISMATCHES) instead")
    args = parser.parse_args()
    DRIVER = args.driver
    build(SOURCES, DRIVER)
    if args.mismatch:
        names = [n for n in [*MISMATCHES, "call_sequence", "behind"] if args.k in n]
        failed = 0
        for name in names:
            start = time.time()
            error = run_mismatch(name)
            print(f"{'FAIL' if error else 'ok  '} mismatch {name} ({time.time() - start:.1f}s) {error}",
                  flush=True)
            failed += bool(error)
        print(f"{len(names) - failed}/{len(names)} mismatch cases pass")
        sys.exit(1 if failed else 0)
    if args.random:
        cases = random_cases(args.random, args.seed)
        if args.only is not None:
            cases = [cases[args.only]]
    else:
        cases = CASES[:3] + [c for c in CASES if c["name"] == QUICK_PULL] if args.quick else CASES
    results = []
    for c in cases:
        if args.k not in c["name"]:
            continue
        ok = run_case(**c)
        if not ok and args.random:
            params = {k: v for k, v in c.items() if k != "name"}
            print(f"  case parameters: {params}")
        results.append(ok)
    print(f"{sum(results)}/{len(results)} cases pass")
    sys.exit(0 if all(results) else 1)


if __name__ == "__main__":
    main()
