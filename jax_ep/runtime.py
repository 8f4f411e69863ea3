"""The native runtime: loads the optional CUDA extension ``jax_ep._C``, registers its XLA FFI
targets, and bootstraps per-device memory (process model 1: this process drives all local GPUs).

Nothing here touches CUDA at import time. ``available()`` answers whether the CUDA backend can run
(and why not); ``ensure_initialized()`` is called at trace time by ops that need communication
buffers; ``check_errors()`` turns a device-side fault (e.g. a peer that never arrived at a barrier)
into a Python exception with the op and ranks involved.
"""

from __future__ import annotations

import functools
import os
import threading

import jax

try:  # the extension is optional: it exists only when the package was built with nvcc
    from jax_ep import _C
    _IMPORT_ERROR: str | None = None
except ImportError as e:  # pragma: no cover - depends on the build
    _C = None
    _IMPORT_ERROR = str(e)

# Every FFI target the extension exports (names as registered with XLA).
FFI_TARGETS = ("jax_ep_dispatch_layout", "jax_ep_peer_smoke", "jax_ep_dispatch", "jax_ep_combine",
               "jax_ep_broadcast", "jax_ep_slot_values")

_lock = threading.Lock()
_registered = False
_initialized: tuple[tuple[int, ...], int] | None = None  # (ordinals, buffer bytes) of the last init


class DeviceFaultError(RuntimeError):
    """A jax_ep kernel recorded a fault (timeout, stale runtime) and trapped. The CUDA context of
    that GPU is dead: restart the process."""


def extension():
    """The ``jax_ep._C`` module, or None when it was not built."""
    return _C


def extension_error() -> str | None:
    """Why ``jax_ep._C`` failed to import, or None when it imported."""
    return _IMPORT_ERROR


def local_gpu_ordinals() -> list[int]:
    """CUDA ordinals of the GPUs JAX uses in this process, in JAX's device order."""
    return [d.local_hardware_id for d in jax.local_devices(backend="gpu")]


@functools.cache
def available() -> tuple[bool, str]:
    """(True, "") when the CUDA backend can run here, else (False, reason).

    Checks, in order: the extension is built, CUDA sees a device, JAX has a GPU backend, and every
    pair of local GPUs has peer access (the NVLink group needs it). Cached: the answer does not
    change within a process.
    """
    if _C is None:
        return False, f"the CUDA extension jax_ep._C is not built ({_IMPORT_ERROR})"
    try:
        count = _C.device_count()
    except RuntimeError as e:
        return False, f"no usable CUDA device ({e})"
    if count == 0:
        return False, "no CUDA device"
    try:
        ordinals = local_gpu_ordinals()
    except RuntimeError as e:
        return False, f"JAX has no GPU backend ({e})"
    if not ordinals:
        return False, "JAX has no GPU devices"
    matrix = _C.peer_access_matrix(ordinals)
    for i, a in enumerate(ordinals):
        for j, b in enumerate(ordinals):
            if not matrix[i][j]:
                return False, (f"GPU {a} cannot access the memory of GPU {b} "
                               "(cudaDeviceCanAccessPeer is false); jax_ep needs peer access "
                               "between all local GPUs (restrict them with CUDA_VISIBLE_DEVICES)")
    return True, ""


def _require_available() -> None:
    usable, reason = available()
    if not usable:
        raise RuntimeError(f"jax_ep: the CUDA backend is unavailable: {reason}")


def register_targets() -> None:
    """Registers every FFI target with XLA (platform CUDA), once per process."""
    global _registered
    if _registered:
        return
    _require_available()
    with _lock:
        if _registered:
            return
        handlers = _C.ffi_handlers()
        missing = set(FFI_TARGETS) - set(handlers)
        if missing:
            raise RuntimeError(f"jax_ep._C lacks FFI targets {sorted(missing)}: stale build? "
                               "Reinstall jax_ep.")
        for name, capsule in handlers.items():
            jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
        _registered = True


def _buffer_floor() -> int:
    text = os.environ.get("JAX_EP_BUFFER_BYTES", "")
    if not text:
        return 0
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"JAX_EP_BUFFER_BYTES must be an integer number of bytes, got {text!r}") from None
    if value < 0:
        raise ValueError(f"JAX_EP_BUFFER_BYTES must be >= 0, got {value}")
    return value


def ensure_initialized(buffer_bytes: int) -> None:
    """Makes every local GPU's communication buffer at least ``buffer_bytes`` (or the
    ``JAX_EP_BUFFER_BYTES`` floor) and the peer tables ready; registers the FFI targets.

    Call at trace time, from Python. Cheap when nothing changes. Growing the buffers synchronises
    every GPU, so size them once for the largest config (no EP computation may run meanwhile).
    The timeout of device-side waits is read from ``JAX_EP_TIMEOUT_S`` (seconds, default 10) when
    the runtime (re)initialises.
    """
    global _initialized
    register_targets()
    wanted = max(int(buffer_bytes), _buffer_floor(), 1)
    ordinals = tuple(local_gpu_ordinals())
    with _lock:
        if _initialized is not None and _initialized[0] == ordinals and _initialized[1] >= wanted:
            return
        _C.init(list(ordinals), wanted)
        _initialized = (ordinals, int(_C.buffer_bytes()))


def shutdown() -> None:
    """Frees the communication buffers (after synchronising the GPUs). Compiled computations using
    EP ops must not run again until ``ensure_initialized`` (they would trap with a clear message)."""
    global _initialized
    if _C is None:
        return
    with _lock:
        _C.shutdown()
        _initialized = None


def faults() -> list[dict]:
    """Device-side faults recorded by jax_ep kernels, one dict per GPU that faulted."""
    return [] if _C is None else list(_C.faults())


def check_errors() -> None:
    """Raises DeviceFaultError if a jax_ep kernel recorded a fault (a timeout names the op, the
    waiting rank and the rank it waited on). Call it when a computation failed with a CUDA error
    such as an illegal instruction / unspecified launch failure."""
    found = faults()
    if found:
        raise DeviceFaultError("\n".join(f["message"] for f in found))
