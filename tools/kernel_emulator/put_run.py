"""Runs the put transport of the rank-major ops (cuda/remote_rank_major.cu: dispatch_rank_major,
combine_rank_major, broadcast_rank_major over NVSHMEM puts + signals) on the CPU emulation
(emu_cuda.h, the NVSHMEM shim include/nvshmem*.h, put_driver.cc) and compares every output with
jax_ep.reference, bit-exact. No PE has a load/store address of another: all traffic goes through
the shim's puts. Each case runs `reps` consecutive calls of the three ops on the same buffers.

    python tools/kernel_emulator/put_run.py [--quick] [-k NAME] [--random N --seed S]

Without --quick / -k / --random the fixed cases are followed by the fault case. ``--missing`` runs
only the fault case: the last PE issues no call, and every other PE must time out in
dispatch_rank_major naming it (fault record and message).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax  # noqa: E402
import numpy as np  # noqa: E402
from harness import (  # noqa: E402  (sets up jax with 8 CPU devices)
    KIND,
    build,
    compare_rank,
    faults_of,
    rank_major_reference,
    routing,
    run_driver_case,
    to_dtype,
)
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jax_ep.config import EPConfig  # noqa: E402

DRIVER = os.path.join(tempfile.gettempdir(), "jax_ep_emu_put_driver")
# the kernels against emu_cuda.h and the NVSHMEM shim (include/nvshmem*.h)
SOURCES = ("cuda/remote_rank_major.cu", "xla_ffi/fault_message.cc", "tools/kernel_emulator/put_driver.cc")


def reference_outputs(x, idx, w, g, yr, cfg, R):
    """The reference's rank-major outputs per rank (and yr with NaN in the empty rows)."""
    mesh = Mesh(np.array(jax.devices()[:R]), ("ep",))

    def body(x, idx, w, g, yr):
        out = rank_major_reference(x[0], idx[0], w[0], g[0], yr[0], cfg)
        return {k: a[None] for k, a in out.items()}

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    args = [jax.device_put(a, NamedSharding(mesh, P("ep"))) for a in (x, idx, w, g, yr)]
    return {k: np.asarray(a) for k, a in fn(*args).items()}


def run_case(name, *, R, T, H, K, E, x_dtype="bfloat16", dispatch_dtype=None, y_dtype="bfloat16",
             kind="distinct", blocks=2, reps=2, seed=0, empty_ranks=()):
    """One case: random inputs, the put driver, every output of every rank and rep bit-exact.
    empty_ranks: ranks none of whose experts any token picks (they receive nothing)."""
    rng = np.random.default_rng(seed)
    cfg = EPConfig(num_experts=E, num_topk=K, hidden=H, max_tokens_per_rank=max(T, 1),
                   dispatch_dtype=dispatch_dtype, backend="reference")
    row_dtype = dispatch_dtype or x_dtype
    x = to_dtype(rng.standard_normal((R, T, H)).astype(np.float32) * 3, x_dtype)
    idx = routing(rng, kind, R, T, K, E)
    local = E // R
    for r in empty_ranks:  # slots naming an expert of rank r become unused
        idx = np.where((idx >= r * local) & (idx < (r + 1) * local), -1, idx).astype(np.int32)
    w = rng.random((R, T, K)).astype(np.float32)
    g = to_dtype(rng.standard_normal((R, T, H)).astype(np.float32), y_dtype)
    yr = rng.standard_normal((R, R * T, H)).astype(np.float32)
    yr = to_dtype(np.where(rng.random(yr.shape) < 0.05, np.float32(-0.0), yr), y_dtype)
    want = reference_outputs(x, idx, w, g, yr, cfg, R)
    yr = want.pop("rm_y")

    def check(d, took):
        ok = True
        for r in range(R):
            for rep in range(reps):
                ok &= compare_rank(name, d, r, rep, want)
        rows = [int(s.sum()) for s in want["rm_per_rank"]]
        print(f"{'ok  ' if ok else 'FAIL'} {name} (rank-major rows {rows}, {took:.1f}s)")
        return ok

    cmd = [DRIVER, R, T, H, K, E, KIND[x_dtype], KIND[row_dtype], KIND[y_dtype], blocks, reps]
    return run_driver_case(name, cmd, dict(x=x, idx=idx, w=w, g=g, yr=yr), check)


CASES = [
    dict(name="put bf16 basic", R=2, T=40, H=256, K=4, E=8),
    dict(name="put fp8 from bf16", R=2, T=24, H=384, K=4, E=8, dispatch_dtype="float8_e4m3fn"),
    dict(name="put 3 ranks messy, rank 1 receives nothing", R=3, T=30, H=96, K=3, E=9, kind="messy",
         empty_ranks=(1,)),
    dict(name="put fp8 from f32, f32 y", R=2, T=20, H=256, K=3, E=8, x_dtype="float32",
         dispatch_dtype="float8_e4m3fn", y_dtype="float32", blocks=3),
    dict(name="put f32 -> bf16 rows, 4 ranks top8, 3 reps", R=4, T=17, H=128, K=8, E=16, kind="fuzz",
         x_dtype="float32", dispatch_dtype="bfloat16", reps=3),
    dict(name="put f32 rows, no tokens", R=2, T=0, H=64, K=2, E=4, x_dtype="float32", y_dtype="float32"),
]


def random_case(rng) -> dict:
    R = int(rng.choice([1, 2, 3, 4]))
    E = R * int(rng.integers(1, 4))
    K = int(rng.integers(1, min(E, 8) + 1))
    T = int(rng.choice([0, 1, 3, 8, 17, 24]))
    x_dtype = str(rng.choice(["bfloat16", "float32"]))
    dispatch_dtype = rng.choice([None, "bfloat16", "float8_e4m3fn"], p=[0.5, 0.2, 0.3])
    if dispatch_dtype == "bfloat16" and x_dtype == "bfloat16":
        dispatch_dtype = None
    H = 128 * int(rng.integers(1, 3)) if dispatch_dtype == "float8_e4m3fn" else 8 * int(rng.integers(1, 33))
    empty = tuple(int(r) for r in range(R) if rng.random() < 0.25)
    return dict(R=R, T=T, H=H, K=K, E=E, x_dtype=x_dtype,
                dispatch_dtype=None if dispatch_dtype is None else str(dispatch_dtype),
                y_dtype=str(rng.choice(["bfloat16", "float32"])), kind="fuzz",
                blocks=int(rng.integers(1, 4)), reps=int(rng.integers(1, 3)),
                seed=int(rng.integers(0, 2**31)), empty_ranks=empty)


def run_missing() -> bool:
    """The last of 2 PEs issues no call: PE 0 must time out in dispatch_rank_major (op 9) waiting for
    rank 1, with a message naming both."""
    cmd = [DRIVER, tempfile.gettempdir(), 2, 4, 64, 2, 4, 0, 0, 0, 1, 1, "missing"]
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=120)
    records, messages = faults_of(proc.stdout)
    msg = messages.get(0)
    ok = (proc.returncode != 0 and records.get(0, (0,))[:3] == (1, 9, 1) and msg is not None
          and "dispatch_rank_major" in msg and "timed out" in msg and "rank 1" in msg)
    print(f"{'ok  ' if ok else 'FAIL'} put missing peer -> timeout naming dispatch_rank_major"
          + ("" if ok else f"\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"))
    if ok:
        print(f"     {msg}")
    return ok


def main():
    global DRIVER
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="the first 3 fixed cases")
    parser.add_argument("-k", default="", help="only cases whose name contains this")
    parser.add_argument("--random", type=int, default=0, metavar="N", help="N random cases")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--missing", action="store_true", help="the missing-peer fault case only")
    parser.add_argument("--driver", default=DRIVER, help=f"where to build the driver (default {DRIVER})")
    args = parser.parse_args()
    DRIVER = args.driver
    build(SOURCES, DRIVER)
    if args.missing:
        sys.exit(0 if run_missing() else 1)
    if args.random:
        cases = [dict(name=f"random {args.seed}/{i}", **random_case(np.random.default_rng([args.seed, i])))
                 for i in range(args.random)]
    else:
        cases = CASES[:3] if args.quick else CASES
        cases = [c for c in cases if args.k in c["name"]]
    results = [run_case(**c) for c in cases]
    print(f"{sum(results)}/{len(results)} cases bit-exact")
    missing_ok = True
    if not (args.quick or args.k or args.random):
        missing_ok = run_missing()
    sys.exit(0 if all(results) and missing_ok else 1)


if __name__ == "__main__":
    main()
