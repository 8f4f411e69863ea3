"""One process of tests/gpu/test_fingerprint_gpu.py (process model 2: one process per GPU, each
tracing its own program): the processes run EP calls that do not match, and each must get an error
naming the op, its rank and the field (jax_ep.runtime.faults(), check_errors()) within bounded time:
never a hang, never wrong rows (the config fingerprint, cuda/fingerprint.h).

    python -m jax_ep.launch --nproc 2 tests/gpu/fingerprint_worker.py CASE

CASE:
  hidden    process 1's dispatch has hidden 512, process 0's 256: both fault naming `hidden`
  capacity  process 1's dispatch has capacity 192, process 0's 128: both fault naming `capacity`
  op        process 1 runs ll_dispatch where process 0 runs dispatch: both fault naming `op`
  behind    process 1 runs its dispatch twice, process 0 once: process 0 returns, process 1's second
            call times out (JAX_EP_TIMEOUT_S) saying rank 0 is 1 call behind
With more than 2 processes (--nproc N) every process but 1 does what process 0 does.
A mismatch must be reported well before the timeout (JAX_EP_TIMEOUT_S, 30 s in the test): the
kernels compare the fingerprints at the start barrier. Prints "fingerprint_worker OK ..." at the end;
exits with os._exit (a trap has killed this process's CUDA context: no teardown).
"""

from __future__ import annotations

import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax_ep  # noqa: E402
import jax_ep.distributed  # noqa: E402
from jax_ep import runtime  # noqa: E402

AXIS = "ep"
T, K, E = 64, 2, 8
CASES = ("hidden", "capacity", "op", "behind")


def config(case: str, me: int) -> jax_ep.EPConfig:
    hidden = 512 if case == "hidden" and me == 1 else 256
    capacity = 192 if case == "capacity" and me == 1 else 128
    return jax_ep.EPConfig(num_experts=E, num_topk=K, hidden=hidden, max_tokens_per_rank=T,
                           capacity=capacity, axis_name=AXIS, backend="cuda")


def step(mesh, cfg, op: str):
    """The jitted EP step of this process: one dispatch (or ll_dispatch) per rank, a checksum out (so
    XLA keeps the call)."""

    def body(x, idx, w):
        d = (jax_ep.ll_dispatch if op == "ll_dispatch" else jax_ep.dispatch)(x, idx, w, cfg)
        return jnp.sum(d.x.astype(jnp.float32))[None]

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))


def wait_for_faults(seconds: float) -> list[dict]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        found = runtime.faults()
        if found:
            return found
        time.sleep(0.01)
    return []


def check(case: str, me: int, mesh) -> str:
    cfg = config(case, me)
    op = "ll_dispatch" if case == "op" and me == 1 else "dispatch"
    sharding = NamedSharding(mesh, P(AXIS))
    local = (np.ones((T, cfg.hidden), jnp.bfloat16), np.tile(np.array([[0, 5]], np.int32), (T, 1)),
             np.ones((T, K), np.float32))
    args = [jax.make_array_from_process_local_data(sharding, a) for a in local]
    compiled = step(mesh, cfg, op).lower(*args).compile()
    # both start the call together: a peer still compiling would make this rank's wait a timeout
    jax_ep.distributed.barrier(f"fingerprint_worker_{case}_compiled", 180)
    calls = 2 if case == "behind" and me == 1 else 1
    timeout_s = float(os.environ["JAX_EP_TIMEOUT_S"])
    start = time.monotonic()
    try:
        for _ in range(calls):
            jax.block_until_ready(compiled(*args))
        outcome = "returned"
    except Exception as e:  # noqa: BLE001  (the trap surfaces as an XLA runtime error)
        outcome = f"raised {type(e).__name__}"
    if case == "behind" and me != 1:  # its one call matched process 1's first
        assert outcome == "returned" and not runtime.faults(), (outcome, runtime.faults())
        return f"process {me} returned after {time.monotonic() - start:.1f} s"
    faults = wait_for_faults(2 * timeout_s + 30)
    elapsed = time.monotonic() - start
    time.sleep(3 + 5 * runtime.FAULT_POLL_S)   # the watcher prints it (the test reads it) before os._exit
    if case == "behind":
        assert faults, f"no fault after {elapsed:.1f} s ({outcome})"
        f = faults[0]
        assert f["kind"] == "timeout" and f["field"] == "call_sequence", f
        assert f["op"] == "dispatch" and f["rank"] == 1 and f["waited_rank"] != 1, f
        assert f"rank {f['waited_rank']} has entered 1 (it is 1 call behind" in f["message"], f["message"]
        assert elapsed < 3 * timeout_s, f"{elapsed:.1f} s"
        return f"after {elapsed:.1f} s: {f['message']}"
    assert faults, f"process {me}: no fault after {elapsed:.1f} s ({outcome})"
    f = faults[0]
    # process 1 differs from every other process, which agree among themselves: the others name rank
    # 1; process 1 any of them (a thread per peer compares, so with more than 2 processes the first
    # record may name any peer)
    other = f["waited_rank"]
    assert (other != 1) if me == 1 else (other == 1), f
    mine, theirs = {"hidden": (256, 512), "capacity": (128, 192), "op": (2, 7)}[case]
    if me == 1:
        mine, theirs = theirs, mine
    names = {2: "dispatch", 7: "ll_dispatch"}
    assert f["kind"] == "mismatch" and f["field"] == case, f
    assert f["op"] == op and f["rank"] == me and f["waited_rank"] == other, f
    assert (f["expected"], f["observed"]) == (mine, theirs), f
    text = f["message"]
    for part in (f"jax_ep: {op} on GPU", f"(rank {me}): rank {other} (process {other})",
                 f"{case} is {names.get(mine, mine) if case == 'op' else mine} on rank {me} and "
                 f"{names.get(theirs, theirs) if case == 'op' else theirs} on rank {other}"):
        assert part in text, (part, text)
    assert elapsed < timeout_s / 2, f"reported after {elapsed:.1f} s: a timeout, not the fingerprint"
    try:
        runtime.check_errors()
        raise AssertionError("check_errors() did not raise")
    except runtime.DeviceFaultError as e:
        assert text in str(e), str(e)
    return f"after {elapsed:.1f} s ({outcome}): {text}"


def main(argv) -> None:
    case = argv[0]
    assert case in CASES, f"CASE must be one of {CASES}, got {case!r}"
    jax_ep.distributed.initialize()  # from python -m jax_ep.launch: one GPU per process
    me = jax.process_index()
    assert runtime.process_model() == "process_per_gpu", runtime.process_model()
    mesh = Mesh(np.array(jax.devices()), (AXIS,))
    try:
        report = check(case, me, mesh)
    except BaseException:  # noqa: BLE001  (a dead CUDA context: no teardown, exit now)
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    print(f"fingerprint_worker OK {case} process {me}: {report}", flush=True)
    jax_ep.distributed.barrier(f"fingerprint_worker_{case}_done", 180)  # the other has checked too
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
