"""The config fingerprint (cuda/fingerprint.h). Process model 2: 2 processes x 1 GPU, each tracing
its own program (tests/gpu/fingerprint_worker.py). When the processes' EP calls do not match (another
hidden size, another capacity, another op at the same point), both get an error naming the op, their
rank and the field with both values, well before the spin timeout; a process one call behind makes
the other's discovery time out saying so. Never a hang, never wrong rows. Process model 1 (one
process, the EP_RANKS GPUs of --ep-ranks): rank 0 of one program runs the other branch of a lax.cond
(another op, another hidden size) than ranks 1..R-1: every GPU's record names the field, as every
rank compares every peer's fingerprint before it writes (expected_mismatch_faults)."""

from __future__ import annotations

import os

import pytest
from gpu_helpers import EP_RANKS, NUM_PROCESSES, SHARE_GPU, assert_workers_ok, ep_step_child, faults_of_child

pytestmark = pytest.mark.gpu

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fingerprint_worker.py")


def run_case(case: str, timeout_env: str = "30"):
    if SHARE_GPU and NUM_PROCESSES > 2:
        # Under MPS one process's trap ends every process of the GPU, maybe before the others have
        # recorded their fault. At 4 processes on one H100 the first case did not finish in 120 s
        # (2026-11-24); on separate GPUs each process has its own context.
        pytest.skip("more than 2 processes sharing a GPU: one process's trap ends the others (MPS)")
    results = assert_workers_ok(WORKER, f"fingerprint_worker OK {case} process {{p}}", (case,),
                                timeout_env=timeout_env)
    # the user sees each record without asking: jax_ep's fault watcher prints it on stderr
    for p, (_, out) in enumerate(results):
        if case == "behind" and p != 1:   # its one call matched process 1's first: no fault
            assert "jax_ep device fault:" not in out, out[-4000:]
            continue
        op = "ll_dispatch" if case == "op" and p == 1 else "dispatch"
        assert f"jax_ep device fault: jax_ep: {op} on GPU" in out, f"process {p}:\n{out[-4000:]}"


@pytest.mark.process_group
@pytest.mark.parametrize("case", ["hidden", "capacity", "op"])
def test_mismatched_calls_fail_on_both_processes_naming_op_rank_and_field(process_group, case):
    """hidden 256 vs 512, capacity 128 vs 192, dispatch vs ll_dispatch: both processes' records are
    kind 'mismatch' with that field, their own value and the peer's, and the message names the op,
    the rank, the peer process, the field and both values, in less than half of JAX_EP_TIMEOUT_S."""
    run_case(case)


@pytest.mark.process_group
def test_a_process_one_call_behind_is_named_by_the_timeout(process_group):
    """Process 1 runs its dispatch twice, process 0 once: process 0's call returns, process 1's
    second call times out after JAX_EP_TIMEOUT_S (5 s here) saying rank 0 is 1 call behind."""
    run_case("behind", timeout_env="5")


def expected_mismatch_faults(branches: list[int]) -> dict[int, set[int]]:
    """Which ranks fault, and which peers each may name, when rank r runs branch branches[r] of one
    program and the branches' EP calls differ in a fingerprint field (cuda/fingerprint.cuh). Every
    rank waits for every peer's directory entry and compares that peer's fingerprint words with its
    own before it writes anything (peer_call_differs, one thread per peer), and a rank that finds a
    difference publishes its own entry and words before it traps (trap_if_any_differs), so each
    peer sees them: rank r faults iff some peer runs the other branch, and its record (the first
    thread to claim the device's one fault record) names one of those peers. With rank 0 alone in
    its branch that is every rank, at any R: rank 0 naming any of 1..R-1, each other rank rank 0
    (at 2 ranks [0, 1], at 4 [0, 1, 2, 3])."""
    return {rank: {peer for peer, other in enumerate(branches) if other != mine}
            for rank, mine in enumerate(branches) if any(other != mine for other in branches)}


# Process model 1: rank 0 runs dispatch, ranks 1.. ll_dispatch at the same point of one program.
_OP_CHILD = ep_step_child("""
    def body(x, idx, w):
        throughput = lambda: jax_ep.dispatch(x, idx, w, cfg).x.astype(jnp.float32).sum()
        low_latency = lambda: jax_ep.ll_dispatch(x, idx, w, cfg).x.astype(jnp.float32).sum()
        return lax.cond(lax.axis_index("ep") == 0, throughput, low_latency)[None]
""", dispatch_dtype="bfloat16")

# Process model 1: ranks 1..'s dispatch has hidden 128 (their x cut to 128 columns), rank 0's 256.
_HIDDEN_CHILD = ep_step_child("""
    import dataclasses
    narrow = dataclasses.replace(cfg, hidden=128)
    def body(x, idx, w):
        wide = lambda: jax_ep.dispatch(x, idx, w, cfg).x.astype(jnp.float32).sum()
        thin = lambda: jax_ep.dispatch(x[:, :128], idx, w, narrow).x.astype(jnp.float32).sum()
        return lax.cond(lax.axis_index("ep") == 0, wide, thin)[None]
""")


@pytest.mark.parametrize("child, field, ops, values", [
    (_OP_CHILD, "op", ("dispatch", "ll_dispatch"), (2, 7)),
    (_HIDDEN_CHILD, "hidden", ("dispatch", "dispatch"), (256, 128)),
], ids=["op", "hidden"])
def test_model_1_ranks_in_different_branches_fault_naming_the_field(gpus, child, field, ops, values):
    """One program over the first EP_RANKS GPUs, rank 0 in one branch of a lax.cond and the others
    in the other (ops[b], values[b]: branch b's op and value of `field`): every rank that has a peer
    in the other branch (expected_mismatch_faults: all of them) records a mismatch of `field` (its
    value, the named peer's), not a timeout (JAX_EP_TIMEOUT_S is 60 s here)."""
    ranks = len(gpus[:EP_RANKS])  # the child's mesh
    if ranks < 2:
        pytest.skip("needs 2 GPUs")
    branches = [0 if rank == 0 else 1 for rank in range(ranks)]  # the lax.cond's branch of each rank
    expected = expected_mismatch_faults(branches)
    faults, stdout = faults_of_child(child, timeout_s="60", want=len(expected))
    by_rank = {f["rank"]: f for f in faults}
    assert sorted(by_rank) == sorted(expected), faults
    for rank, f in by_rank.items():
        other = f["waited_rank"]
        assert other in expected[rank], f
        mine, theirs = branches[rank], branches[other]
        assert f["kind"] == "mismatch" and f["field"] == field, f
        assert f["op"] == ops[mine], f
        assert (f["expected"], f["observed"]) == (values[mine], values[theirs]), f
        assert f["device_ordinal"] == gpus[rank].local_hardware_id, f
        assert f"(rank {rank}): rank {other} (GPU " in f["message"], f["message"]
    assert "CHECK_ERRORS=" in stdout and f"{field} is " in stdout, stdout[-4000:]
