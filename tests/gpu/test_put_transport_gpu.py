"""The put transport of the rank-major ops (cuda/remote_rank_major.cu) on 2 processes x 1 GPU: the
issue's test 3b ("2 nodes of 1 GPU" on one machine, KernelConfig(transport="put") forcing the
inter-node path). Each process runs tests/gpu/put_transport_worker.py and checks its rank bit-exact
against the reference path (dispatch_rank_major, combine_rank_major, broadcast_rank_major, a scan
captured as CUDA graphs, gradients). With pytest --share-gpu, both processes on GPU 0 under CUDA MPS."""

from __future__ import annotations

import os

import pytest
from gpu_helpers import assert_workers_ok

pytestmark = [pytest.mark.gpu, pytest.mark.process_group]

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "put_transport_worker.py")


def test_rank_major_ops_over_puts_match_reference(process_group):
    # 12 checks: 5 cases x 2 calls, the scan, the gradients
    assert_workers_ok(WORKER, "put_transport_worker OK 12", timeout_s=480)
