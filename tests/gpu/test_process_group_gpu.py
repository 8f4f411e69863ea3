"""Process model 2 on the GPUs of one host: one process per GPU (jax.distributed), NVSHMEM
symmetric buffers and peer tables, the model-1 kernels. Each process runs
tests/gpu/process_group_worker.py, which checks its rank's outputs against the reference path.
pytest --processes N runs N processes (default 2); with --share-gpu all on GPU 0 under CUDA MPS
(gpu_helpers.launch_command)."""

from __future__ import annotations

import json
import os
import re

import pytest
from gpu_helpers import ll_grid_args, run_workers

pytestmark = [pytest.mark.gpu, pytest.mark.process_group]

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "process_group_worker.py")
TIMEOUT_S = 420
# process_group_worker's check groups: each must have run at least once on every process
CHECK_GROUPS = ("dispatch_combine", "gradients", "rank_major", "low_latency", "low_latency_scan",
                "remote_smoke", "side_stream", "layer", "dispatch_pull")


def test_process_per_gpu_matches_reference(process_group):
    # JAX_EP_TEST_PG_CHECKS=a,b: only those check groups (tools/gpu_check.sh's repeat check, PG_CHECKS:
    # the programs with several independent EP calls, where per-process schedules could differ)
    chosen = os.environ.get("JAX_EP_TEST_PG_CHECKS", "")
    groups = tuple(chosen.split(",")) if chosen else CHECK_GROUPS
    assert set(groups) <= set(CHECK_GROUPS), f"JAX_EP_TEST_PG_CHECKS={chosen!r}: groups are {CHECK_GROUPS}"
    extra = ("--checks", chosen) if chosen else ()
    results = run_workers(WORKER, (*ll_grid_args(), *extra), timeout_s=TIMEOUT_S)
    for p, (rc, out) in enumerate(results):
        print(f"---- process {p} (rc {rc})\n{out[-6000:]}")
    for p, (rc, out) in enumerate(results):
        assert rc == 0, f"process {p} failed (rc {rc}):\n{out[-4000:]}"
        ok = re.search(r"process_group_worker OK \d+ (\{.*?\})", out)
        assert ok, f"process {p}: no OK line"
        counts = json.loads(ok.group(1))
        missing = [g for g in groups if counts.get(g, 0) < 1]
        assert not missing, f"process {p}: no check of {missing} ran ({counts})"


def test_remote_smoke_puts_and_signals(process_group):
    """The NVSHMEM device put/signal transport alone (the worker's --remote): remote_smoke's rows
    bit-exact on every process, single calls and a scan replayed as CUDA graphs."""
    results = run_workers(WORKER, ("--remote",), timeout_s=240)
    for p, (rc, out) in enumerate(results):
        print(f"---- process {p} (rc {rc})\n{out[-3000:]}")
    for p, (rc, out) in enumerate(results):
        assert rc == 0, f"process {p} failed (rc {rc}):\n{out[-4000:]}"
        assert "remote_smoke OK" in out and "process_group_worker OK" in out, out[-3000:]


def test_bootstrap_without_a_process_fails_in_bounded_time_naming_it(process_group):
    """Process 1 leaves before the NVSHMEM bootstrap: every other process raises TimeoutError naming
    it (runtime.BOOTSTRAP_TIMEOUT_S, set to 10 s by the worker) instead of waiting forever."""
    results = run_workers(WORKER, ("--absent", "1"), timeout_s=120)
    for p, (rc, out) in enumerate(results):
        print(f"---- process {p} (rc {rc})\n{out[-3000:]}")
    for p, (rc, out) in enumerate(results):
        if p != 1:
            assert rc == 0 and f"(process {p}, absent process named)" in out, out[-3000:]
