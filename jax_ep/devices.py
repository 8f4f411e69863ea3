"""Device set-up helpers for scripts (never called on import)."""

from __future__ import annotations

import jax


def use_virtual_cpu_devices(count: int = 8) -> None:
    """Gives the CPU backend `count` virtual devices, so EP code runs on a machine without GPUs (a
    GPU, if present, stays the default backend).

    Call it before the first device query; afterwards (JAX already running, e.g. under pytest) the
    devices stay as they are."""
    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:  # backends already initialised
        pass
