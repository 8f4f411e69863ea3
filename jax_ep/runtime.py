"""The native runtime: loads the optional CUDA extension ``jax_ep._C`` and registers its XLA FFI
targets (process model 1: this process drives all local GPUs).

Nothing here touches CUDA at import time. ``available()`` answers whether the CUDA backend can run
(and why not); ``register_targets()`` is called at trace time by the CUDA ops and hands the runtime
the local GPUs. The communication buffers are sized by the ops themselves: each call site's FFI
*instantiate* handler (run when XLA instantiates the executable) reserves what its static shapes need
and holds the runtime until the executable is destroyed. ``check_errors()`` turns a device-side fault
(e.g. a peer that never arrived at a barrier) into a Python exception with the op and ranks involved.
"""

from __future__ import annotations

import functools
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

STATE_TYPE = "jax_ep_op_state"  # the FFI state type of the communicating ops (instantiate stage)

_lock = threading.Lock()
_registered = False


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


def limits() -> dict:
    """The kernels' limits as the extension defines them (``jax_ep._C.LIMITS``: max_topk,
    layout_max_topk, max_experts, max_ranks, max_groups, directory_axes, data_warps, row_alignment)."""
    _require_available()
    return dict(_C.LIMITS)


def register_targets() -> None:
    """Registers every FFI target (and the ops' state type) with XLA, platform CUDA, once per
    process, and hands the runtime the local GPUs (peer access, device tables). Cheap when done."""
    global _registered
    _require_available()
    with _lock:
        if not _registered:
            handlers = _C.ffi_handlers()
            missing = set(FFI_TARGETS) - set(handlers)
            if missing:
                raise RuntimeError(f"jax_ep._C lacks FFI targets {sorted(missing)}: stale build? "
                                   "Reinstall jax_ep.")
            jax.ffi.register_ffi_type(STATE_TYPE, _C.state_type(), platform="CUDA")
            for name, stages in handlers.items():
                jax.ffi.register_ffi_target(name, stages, platform="CUDA")
            _registered = True
        if not _C.managed_devices():
            _C.init(local_gpu_ordinals(), 0)


def ensure_initialized(buffer_bytes: int) -> None:
    """Makes every local GPU's communication buffer at least ``buffer_bytes`` now (the ops reserve
    what they need when XLA instantiates them; this only sizes the buffers up front, e.g. to
    ``cuda_backend.comm_bytes(cfg, ep_size)`` of the largest config, so that no later instantiation
    has to grow them: growing synchronises every GPU)."""
    register_targets()
    with _lock:
        _C.init(local_gpu_ordinals(), max(int(buffer_bytes), 0))


def shutdown() -> None:
    """Frees the communication buffers (after synchronising the GPUs). Refuses, with a RuntimeError,
    while compiled computations that use EP ops are alive (they hold the runtime): delete them and
    call ``jax.clear_caches()`` first. The next instantiation sets the runtime up again."""
    if _C is None:
        return
    with _lock:
        _C.shutdown()


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
