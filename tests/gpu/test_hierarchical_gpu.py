"""The hierarchical dispatch / combine on 2 processes x 1 GPU, the machine taken as "2 nodes of 1 GPU"
(issue 13's test 3b): a (node, local) mesh of 2 x 1, the node hop over NVSHMEM puts
(KernelConfig(transport="put")). Each process runs tests/gpu/hierarchical_worker.py and checks its GPU
against the reference path (rows, counts and handles bit-exact; FP8 rows and scales against NumPy's
quantisation; combine within two bf16 steps; gradients). With pytest --share-gpu, both processes on
GPU 0 under CUDA MPS."""

from __future__ import annotations

import os

import pytest
from gpu_helpers import assert_workers_ok

pytestmark = [pytest.mark.gpu, pytest.mark.process_group]

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hierarchical_worker.py")


def test_hierarchical_over_puts_matches_reference(process_group):
    # 11 checks: 5 cases x 2 calls (FP8 among them), the gradients
    assert_workers_ok(WORKER, "hierarchical_worker OK 11", timeout_s=420)
