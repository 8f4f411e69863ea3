"""Rank masking on the CUDA kernels (issue 15 item 1), with the masked rank never entering the EP
calls (tests/gpu/rank_mask_worker.py): the active rank must finish, without waiting for it, and match
the reference. Process model 1: one process, 2 GPUs, rank 1's GPU in the other branch of a lax.cond.
Process model 2: N processes x 1 GPU (pytest --processes, default 2), process 1 stops calling after a
first all-active step."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import pytest
from gpu_helpers import run_workers

pytestmark = pytest.mark.gpu

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank_mask_worker.py")


def test_model_1_masked_gpu_skips_the_calls(cuda_backend):
    """Rank 1 masked and its GPU skipping dispatch / combine and their backward (lax.cond): rank 0's
    3 calls return (JAX_EP_TIMEOUT_S 20 s: a wait for rank 1 would fault) and match the reference;
    two mask values, one executable."""
    if len(jax.local_devices(backend="gpu")) < 2:
        pytest.skip("needs 2 GPUs")
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", JAX_EP_TIMEOUT_S="20")
    env.pop("XLA_PYTHON_CLIENT_MEM_FRACTION", None)
    child = subprocess.run([sys.executable, WORKER, "model1"], env=env, capture_output=True, text=True,
                           timeout=300)
    out = child.stdout + child.stderr
    print(out[-4000:])
    assert child.returncode == 0 and "rank_mask_worker OK model1" in out, out[-4000:]


@pytest.mark.process_group
def test_model_2_a_process_that_stops_calling(process_group):
    """Process 1 masked and no longer calling (waiting at a distributed barrier): the other processes'
    3 masked steps return and match the reference; the all-active step before matches the reference
    without a mask on every process (pytest --processes N: N processes)."""
    results = run_workers(WORKER, ("model2",), timeout_s=300, timeout_env="20")
    for p, (rc, out) in enumerate(results):
        print(f"---- process {p} (rc {rc})\n{out[-4000:]}")
    for p, (rc, out) in enumerate(results):
        assert rc == 0, f"process {p} failed (rc {rc}):\n{out[-4000:]}"
        assert f"rank_mask_worker OK model2 process {p}" in out, f"process {p}: no OK line"
