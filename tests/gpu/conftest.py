"""Fixtures of the GPU tests (marker `gpu`): they skip cleanly when the CUDA backend is unavailable
(no extension, no GPU, no peer access)."""

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
