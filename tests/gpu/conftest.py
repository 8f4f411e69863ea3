"""Fixtures of the GPU tests (marker `gpu`): they skip cleanly when the CUDA backend is unavailable
(no extension, no GPU, no peer access). The process-model-2 tests (marker `process_group`) take the
`process_group` fixture instead: 2 GPUs, or with pytest --share-gpu one GPU that both processes
share under CUDA MPS (gpu_helpers.process_group_skip_reason)."""

from __future__ import annotations

import jax
import pytest


@pytest.fixture(scope="session")
def cuda_backend():
    from jax_ep import runtime

    usable, reason = runtime.available()
    if not usable:
        pytest.skip(f"jax_ep CUDA backend unavailable: {reason}")
    from jax_ep import cuda_backend as backend

    return backend


@pytest.fixture(scope="session")
def gpus(cuda_backend):
    return jax.local_devices(backend="gpu")


@pytest.fixture(scope="session")
def process_group():
    from gpu_helpers import process_group_skip_reason

    reason = process_group_skip_reason()
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture(params=[False, True], ids=["one_process", "ordered"])
def ep_order(request, monkeypatch):
    """Each test twice: as one process lowers its EP calls, and with the calls' ordering effect forced on
    (jax_ep.ordering), as several processes lower them (process model 2), on this one process's GPUs.
    The value: whether the effect is on."""
    if request.param:
        from jax_ep import ordering

        monkeypatch.setattr(ordering, "needed", lambda: True)
    return request.param
