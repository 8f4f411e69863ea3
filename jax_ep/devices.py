"""Device set-up helpers for scripts (never called on import)."""

from __future__ import annotations

import os

import jax


def use_virtual_cpu_devices(count: int = 8) -> None:
    """Gives the CPU backend `count` virtual devices, so EP code runs on a machine without GPUs (a
    GPU, if present, stays the default backend).

    Call it before the first device query; afterwards (JAX already running, e.g. under pytest) the
    devices stay as they are. ``JAX_NUM_CPU_DEVICES`` in the environment wins (``python -m
    jax_ep.launch`` sets it to the devices of each process), and so does
    ``XLA_FLAGS=--xla_force_host_platform_device_count=N``."""
    from jax_ep.config import check_option

    count = check_option("use_virtual_cpu_devices:", "count", count, "int")   # NumPy ints too
    if os.environ.get("JAX_NUM_CPU_DEVICES") or \
            "--xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        return   # the user's count (jax_num_cpu_devices would override the XLA flag)
    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:  # backends already initialised
        pass
