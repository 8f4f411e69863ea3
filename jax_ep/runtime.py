"""The native runtime: loads the optional CUDA extension ``jax_ep._C``, registers its XLA FFI
targets and sets up the GPUs in one of two process models:

1. ``local_peers``: this process drives all its local GPUs (CUDA peer access between them);
2. ``process_per_gpu``: one process per GPU (``jax.distributed`` with several processes and one
   local GPU each): NVSHMEM, bootstrapped through JAX's key-value store, holds the buffers on its
   symmetric heap, and the kernels reach every GPU of the node through ``nvshmem_ptr`` addresses
   (processes on other nodes: the rank-major ops only, through NVSHMEM puts; see
   ``unreachable_processes``).

Nothing here touches CUDA at import time. ``available()`` answers whether the CUDA backend can run
(and why not); ``register_targets()`` is called at trace time by the CUDA ops and hands the runtime
the local GPUs. The communication buffers are sized by the ops themselves: each call site's FFI
*instantiate* handler (run when XLA instantiates the executable) reserves what its static shapes need
and holds the runtime until the executable is destroyed. ``check_errors()`` turns a device-side fault
(e.g. a peer that never arrived at a barrier) into a Python exception with the op and ranks involved.

GPU memory: XLA preallocates ``XLA_PYTHON_CLIENT_MEM_FRACTION`` (default 0.75) of every GPU and the
buffers live in the rest. A buffer that does not fit raises ``DeviceMemoryError`` naming the buffer,
the bytes it needs, the GPU's free/total memory and what to do (its text:
``jax_ep._C.device_memory_message``). Model 1 checks when an op is traced (``reserve``), so the
error comes from the traced call; an instantiation that still cannot allocate fails in XLA with
``RESOURCE_EXHAUSTED`` and the same text. Model 2 checks in the collective set-up step, before
NVSHMEM is asked: every process publishes whether what NVSHMEM's heap would take fits its GPU, and
when one does not, every process raises the same error, naming the processes that lack room.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import json
import math
import os
import re
import sys
import threading
import zlib

import jax

from jax_ep import distributed, errors
from jax_ep.config import check_option


def _load_nvshmem() -> str | None:
    """Loads the NVSHMEM host library of the ``nvidia-nvshmem-cu13`` wheel (the copy jax[cuda13]
    uses) into the process, so that the extension and XLA share one NVSHMEM. None when loaded, else
    why not."""
    try:
        import nvidia.nvshmem as wheel
    except ImportError:
        return "the NVSHMEM wheel is not installed (pip install nvidia-nvshmem-cu13)"
    for folder in wheel.__path__:
        path = os.path.join(folder, "lib", "libnvshmem_host.so.3")
        if os.path.exists(path):
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError as e:
                return f"cannot load {path}: {e}"
            return None
    return f"libnvshmem_host.so.3 not found under {list(wheel.__path__)}"


try:  # the extension is optional: it exists only when the package was built with nvcc
    _NVSHMEM_ERROR = _load_nvshmem()
    from jax_ep import _C
    _IMPORT_ERROR: str | None = None
except ImportError as e:  # pragma: no cover - depends on the build
    _C = None
    _IMPORT_ERROR = str(e) + (f" ({_NVSHMEM_ERROR})" if _NVSHMEM_ERROR else "")

STATE_TYPE = "jax_ep_op_state"  # the FFI state type of the communicating ops (instantiate stage)

_lock = threading.Lock()
_registered = False
_collective_calls = 0  # process model 2: collective set-up calls made by this process
_release_calls: dict = {}   # process model 2: collective releases made by this process, per action
_release_broken: dict = {}  # action -> why its agreement failed: later calls would pair with wrong peers
# Process model 2: how long a process waits for the others at a collective set-up step (they may
# still be compiling) before it raises, naming the processes that did not arrive.
BOOTSTRAP_TIMEOUT_S = 120.0
TIMEOUT_ENV = "JAX_EP_TIMEOUT_S"   # the bound of every device-side wait (xla_ffi/runtime.cc reads it)
# How often the fault watcher (report_faults) reads the records: a trap surfaces as XLA's generic CUDA
# error in the user's code, and the process may exit soon after it
FAULT_POLL_S = 0.2
_report_lock = threading.Lock()   # not _lock: a report must not wait behind a set-up (which may hang)
_reported: set = set()   # the fault records report_faults has printed
_watcher: threading.Thread | None = None
_stop_watching = threading.Event()
_TIMEOUT_TEXT = re.compile(r"[+]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")

# Process model 2: what a GPU must keep free beyond what NVSHMEM's heap would take in a set-up step,
# or the step is refused on every process. cudaMemGetInfo's free memory is not all one allocation
# can get, and the step allocates beside the heap: the driver's bookkeeping for the new physical
# memory and for the mappings of every peer's new heap memory, NVSHMEM's own device memory and
# module when it starts; after it, CUDA still allocates lazily (kernel local memory, the printf
# buffer) and XLA's NCCL communicators live outside its pool. A GPU left with nothing free fails
# there later, with errors far from the cause. 256 MiB is under 0.3% of an H100/H200.
HEAP_ROOM_MARGIN_BYTES = 256 << 20


# The errors of this module (jax_ep/errors.py, exported as jax_ep.DeviceFaultError etc.).
DeviceFaultError = errors.DeviceFaultError

if _C is not None:
    # A jax_ep buffer (communication buffer, device state, NVSHMEM symmetric heap) does not fit in a
    # GPU's free memory beside XLA's preallocation; raised by the extension, a subclass of
    # errors.DeviceMemoryError (an EPError and a RuntimeError; xla_ffi/module.cc). The GPU stays usable.
    DeviceMemoryError = _C.DeviceMemoryError
else:  # pragma: no cover - depends on the build
    DeviceMemoryError = errors.DeviceMemoryError


def extension():
    """The ``jax_ep._C`` module, or None when it was not built."""
    return _C


def built_extension(what: str):
    """``jax_ep._C`` for its pure helpers (sizes, limits' arithmetic), which need no GPU and set nothing
    up; an EPRuntimeError naming ``what`` when it was not built."""
    if _C is None:
        raise errors.EPRuntimeError(f"{what} needs the CUDA extension jax_ep._C, which is not built "
                                    f"({_IMPORT_ERROR})")
    return _C


def extension_error() -> str | None:
    """Why ``jax_ep._C`` failed to import, or None when it imported."""
    return _IMPORT_ERROR


def local_gpu_ordinals() -> list[int]:
    """CUDA ordinals of the GPUs JAX uses in this process, in JAX's device order."""
    return [d.local_hardware_id for d in jax.local_devices(backend="gpu")]


def process_model() -> str:
    """``"process_per_gpu"`` (process model 2, NVSHMEM) when this JAX program runs as several
    processes with one local GPU each, else ``"local_peers"`` (model 1: EP groups live inside one
    process)."""
    if distributed.is_multiprocess() and len(local_gpu_ordinals()) == 1:
        return "process_per_gpu"
    return "local_peers"


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
        raise errors.EPRuntimeError(f"jax_ep: the CUDA backend is unavailable: {reason}")


def limits() -> dict:
    """The kernels' limits as the extension defines them (``jax_ep._C.LIMITS``: max_topk,
    layout_max_topk, max_experts, max_ranks, max_groups, directory_axes, data_warps, row_alignment,
    fp8_block, fp8_min_amax, ll_max_tokens, ll_max_shared_bytes, max_rows, max_hidden)."""
    _require_available()
    return dict(_C.LIMITS)


def _seconds(text: str) -> float:
    """A number as C's strtod reads all of ``text`` (decimal or hexadecimal), NaN where it does not."""
    if _TIMEOUT_TEXT.fullmatch(text):
        return float(text)
    try:
        return float.fromhex(text) if text.lstrip("+-")[:2].lower() == "0x" else math.nan
    except ValueError:
        return math.nan


def check_timeout_env() -> None:
    """JAX_EP_TIMEOUT_S, where set, is a number of seconds in (0, 1e6] (the extension's rule): an
    EPValueError naming the variable here, not a bare ValueError from inside the extension's set-up."""
    text = os.environ.get(TIMEOUT_ENV, "")
    if text and not 0 < _seconds(text.lstrip()) <= 1e6:
        raise errors.EPValueError(f"jax_ep: {TIMEOUT_ENV} must be a positive number of seconds (at most "
                                  f"1e6), got {text!r}")


def register_targets() -> None:
    """Registers every FFI target (and the ops' state type) with XLA, platform CUDA, once per
    process, and hands the runtime the local GPUs (peer access, device tables). Cheap when done."""
    global _registered
    _require_available()
    check_timeout_env()
    with _lock:
        if not _registered:
            jax.ffi.register_ffi_type(STATE_TYPE, _C.state_type(), platform="CUDA")
            # the extension's one list of targets (xla_ffi/handlers.h, JAX_EP_TARGETS)
            for name, stages in _C.ffi_handlers().items():
                jax.ffi.register_ffi_target(name, stages, platform="CUDA")
            _registered = True
            watch_faults()
        if not _C.managed_devices():
            if process_model() == "process_per_gpu":
                _init_process_group(0)
            else:
                _C.init(local_gpu_ordinals(), 0)


def target(op: str, variant: str | None = None) -> str:
    """The FFI target of ``op`` ("jax_ep_<op>"), every target registered (register_targets); an
    EPRuntimeError when the extension lacks it (built from older sources than this package).
    ``variant`` (the ops of xla_ffi/handlers.h's JAX_EP_ASYNC_TARGETS only): "uncaptured", its twin
    "jax_ep_<op>_uncaptured" that XLA keeps out of command buffers (the calls on an XLA async stream:
    xla_ffi/handler_util.h, JAX_EP_DEFINE_ASYNC_EXECUTE); "side", "jax_ep_<op>_side", the op on
    jax_ep's side stream (jax_ep.overlap)."""
    register_targets()
    name = f"jax_ep_{op}" + (f"_{variant}" if variant else "")
    if name not in _targets():
        raise errors.EPRuntimeError(f"jax_ep._C has no FFI target {name!r} (it has {sorted(_targets())}): "
                                    "a stale build? Reinstall jax_ep.")
    return name


def has_variant(op: str, variant: str) -> bool:
    """Whether the extension has ``op``'s target ``variant`` ("jax_ep_<op>_<variant>", ``target``)."""
    return f"jax_ep_{op}_{variant}" in _targets()


@functools.cache
def _targets() -> frozenset:
    return frozenset(_C.ffi_handlers())


def _room_verdict(process: int, gpu: int, plan: dict, free: int, total: int,
                 margin: int = HEAP_ROOM_MARGIN_BYTES) -> dict:
    """Process model 2: one process's verdict on a set-up step, what it publishes for the others
    (pure). ``plan``: ``_C.plan_process_group(agreed bytes)`` on that process (``heap_bytes``: what
    NVSHMEM would take from its GPU); ``free``/``total``: its GPU (``_C.memory_info``). It fits when
    nothing is taken or the GPU keeps ``margin`` bytes free beside it."""
    heap = int(plan["heap_bytes"])
    margin = int(margin) if heap > 0 else 0
    return {"process": int(process), "gpu": int(gpu), "buffer": int(plan["buffer"]),
            "held": int(plan["held"]), "heap_bytes": heap, "margin": margin, "free": int(free),
            "total": int(total), "fits": heap == 0 or int(free) >= heap + margin,
            "starting": bool(plan["nvshmem_starting"]), "dynamic": bool(plan["heap_dynamic"]),
            "granularity": int(plan["heap_granularity"])}


def _heap_room_error(verdicts: list[dict], env: dict[str, str] | None = None) -> str | None:
    """Process model 2: the collective decision on a set-up step (pure): None when every process's
    published verdict (``_room_verdict``) fits, else the DeviceMemoryError text naming the NVSHMEM
    symmetric heap and every process that lacks room, with its numbers. Every process decides from
    the same published verdicts, so all refuse or all go on. ``env``: the memory settings the advice
    reads (default: this process's, ``_C.MEMORY_ENV_VARS``)."""
    short = sorted((v for v in verdicts if not v["fits"]), key=lambda v: v["process"])
    if not short:
        return None
    if env is None:
        env = {name: os.environ[name] for name in _C.MEMORY_ENV_VARS if name in os.environ}
    head = short[0]  # buffer, held and the heap's shape agree: the same step on every process
    rooms = [{name: int(v[name]) for name in ("process", "gpu", "heap_bytes", "margin", "free", "total")}
             for v in short]
    return _C.device_memory_message(
        "communication buffer", head["gpu"], head["buffer"], head["free"], head["total"],
        held_bytes=head["held"], kind="heap_growth", env=dict(env), processes=rooms,
        group_size=len(verdicts), heap_starting=head["starting"], heap_dynamic=head["dynamic"],
        heap_granularity=head["granularity"])


def _exchange(key: str, value: bytes, timeout: float, barrier: bool = False) -> list[bytes]:
    """Process model 2: publishes this process's ``value`` under ``key`` and returns every process's,
    in process order; a process that does not publish within ``timeout`` raises TimeoutError naming
    it (``distributed.kv_get_bytes``). ``barrier``: every process meets at a bounded barrier after
    publishing, so that one arriving after the others gave up fails too (a read alone would find
    every value published)."""
    me, count = jax.process_index(), jax.process_count()
    distributed.kv_set_bytes(f"{key}/{me}", value)
    if barrier:
        distributed.barrier(f"{key}/agreed", timeout)
    return [distributed.kv_get_bytes(f"{key}/{p}", timeout, writer=f"process {p}") for p in range(count)]


def _check_room(key: str, wanted: int, timeout: float) -> None:
    """Process model 2, collective, before NVSHMEM is asked for anything: every process publishes
    whether what the step would allocate on its GPU fits there (``_room_verdict``), reads every
    verdict, and every process raises the same DeviceMemoryError when one lacks room. NVSHMEM 3.4.5
    does not return NULL from nvshmem_malloc when its heap cannot grow: its job dies."""
    me = jax.process_index()
    try:
        gpu = local_gpu_ordinals()[0]
        free, total = _C.memory_info(gpu)
        verdict = _room_verdict(me, gpu, _C.plan_process_group(wanted), free, total)
    except Exception as e:  # noqa: BLE001 - published, so that no process waits for this one
        verdict = {"process": me, "error": f"{type(e).__name__}: {e}"}
    verdicts = [json.loads(v) for v in _exchange(f"{key}/room", json.dumps(verdict).encode(), timeout)]
    failed = [v for v in verdicts if "error" in v]
    if failed:
        raise errors.EPRuntimeError(
            "jax_ep: process model 2 set-up refused on every process: "
            + "; ".join(f"process {v['process']} could not check its GPU's free memory "
            f"({v['error']})" for v in failed))
    error = _heap_room_error(verdicts)
    if error is not None:
        raise DeviceMemoryError(error)


def _init_process_group(buffer_bytes: int) -> None:
    """Process model 2, collective (every process calls it in the same order): agrees on the buffer
    size through the key-value store, checks on every process that what NVSHMEM would allocate fits
    its GPU (all raise DeviceMemoryError together when one lacks room, before NVSHMEM is asked),
    bootstraps NVSHMEM on the first call (process 0's unique id through the store), and grows the
    symmetric buffer when needed. Every wait is bounded and names the processes that did not
    arrive. The caller holds _lock."""
    global _collective_calls
    me, count = jax.process_index(), jax.process_count()
    call = _collective_calls
    _collective_calls += 1
    key = f"jax_ep/process_group/{call}"
    timeout = BOOTSTRAP_TIMEOUT_S
    wanted = max(int(v) for v in _exchange(f"{key}/bytes", str(int(buffer_bytes)).encode(), timeout))
    _check_room(key, wanted, timeout)
    first = _C.process_group()["model"] == "none"
    unique_id = b""
    if first:
        if me == 0:
            unique_id = _C.nvshmem_unique_id()
            distributed.kv_set_bytes(f"{key}/nvshmem_unique_id", unique_id)
        else:
            unique_id = distributed.kv_get_bytes(f"{key}/nvshmem_unique_id", timeout, writer="process 0")
        # NVSHMEM's own bootstrap waits without a bound: enter it only once every process is here. The
        # keys are this call's: a bootstrap that failed (a barrier run out while a peer still compiled)
        # is retried by the next set-up under new keys (JAX's store refuses to write a key twice).
        distributed.barrier(f"{key}/nvshmem_init", timeout)
    _C.init_process_group(local_gpu_ordinals()[0], unique_id, me, count, wanted)
    if first:
        atexit.register(_finalize_process_group)
        # Processes on other nodes have no load/store address: only the rank-major ops reach them
        # (their put transport); cuda_backend refuses the other ops over them at trace time.


def unreachable_processes() -> list[int]:
    """Process model 2: the processes whose GPU this process cannot reach by NVLink / P2P loads and
    stores (on other nodes), once the process group is set up; [] otherwise. What
    KernelConfig.transport="auto" decides on (cuda_backend._transport)."""
    if _C is None:
        return []
    group = _C.process_group()
    if group["model"] != "process_per_gpu":
        return []
    return sorted(set(range(int(group["num_pes"]))) - set(group["reachable_pes"]))


def _finalize_process_group() -> None:
    """At exit, process model 2: frees the symmetric buffers and finalises NVSHMEM, after a bounded
    barrier (NVSHMEM's finalize is collective and would wait forever for a dead process)."""
    _report_quietly()   # registered after watch_faults' own report, so run before it: before the barrier
    try:
        jax.clear_caches()  # compiled EP calls hold the runtime
        _agree_to_release("teardown", 60)   # the bounded barrier: every process frees, or none
        _C.finalize_process_group()
    except Exception as e:  # noqa: BLE001 - at exit: report, never hang or mask the exit status
        print(f"jax_ep: process model 2 teardown skipped: {e}")


def reserve(buffer_bytes: int) -> None:
    """Called when an EP op is traced with what it needs. Process model 2 grows the symmetric buffer
    here, collectively (every process traces the same ops in the same order); model 1 only checks
    that the buffer will fit (DeviceMemoryError now rather than from XLA's instantiation, which
    reserves the buffer)."""
    register_targets()
    if _C.process_group()["model"] != "process_per_gpu":
        _C.check_buffer_fits(int(buffer_bytes))
        return
    if buffer_bytes <= _C.buffer_bytes():
        return
    with _lock:
        _init_process_group(buffer_bytes)


def ensure_initialized(buffer_bytes: int) -> None:
    """Makes every local GPU's communication buffer at least ``buffer_bytes`` now (the ops reserve
    what they need when XLA instantiates them; this only sizes the buffers up front, e.g. to
    ``cuda_backend.comm_bytes(cfg, ep_size)`` of the largest config, ``ll_comm_bytes`` for the
    low-latency ops, so that no later instantiation
    has to grow them: growing synchronises every GPU). Raises DeviceMemoryError when they do not fit
    in a GPU's free memory."""
    buffer_bytes = check_option("jax_ep.runtime.ensure_initialized:", "buffer_bytes", buffer_bytes, "int",
                                minimum=0)
    register_targets()
    with _lock:
        if _C.process_group()["model"] == "process_per_gpu":
            _init_process_group(buffer_bytes)  # collective: call it on every process
        else:
            _C.init(local_gpu_ordinals(), buffer_bytes)


def shutdown() -> None:
    """Frees the communication buffers (after synchronising the GPUs). Refuses, with a RuntimeError,
    while compiled computations that use EP ops are alive (they hold the runtime): delete them and
    call ``jax.clear_caches()`` first. The next instantiation sets the runtime up again. In process
    model 2 it is collective: call it on every process; every process refuses together when one
    would (``_agree_to_release``), and a process that does not call it within BOOTSTRAP_TIMEOUT_S
    makes the others raise naming it."""
    if _C is None:
        return
    with _lock:
        if _C.process_group()["model"] == "process_per_gpu":
            _agree_to_release("shutdown", BOOTSTRAP_TIMEOUT_S)
        _C.shutdown()


def _agree_to_release(action: str, timeout: float) -> None:
    """Process model 2, collective, before the symmetric buffers are freed (NVSHMEM's free and barrier
    wait for every process, without a bound): every process publishes how many instantiated EP call
    sites hold its runtime, then waits at a bounded barrier, then reads every count. All raise the same
    EPRuntimeError when one holds any (a process refusing alone left the others in NVSHMEM's free
    forever); a process that does not come within ``timeout`` (or comes after it) makes the barrier
    fail on every process, naming it. ``action`` ("shutdown", "teardown": the one at exit) keys the
    agreement with a count of its own: a process's shutdown() never pairs with another's teardown.
    After an agreement failed (a process did not come), the processes' counts of that action may differ
    for good: every later call of it raises, saying to restart."""
    if action in _release_broken:
        raise errors.EPRuntimeError(
            f"jax_ep: {action} refused: an earlier {action} did not agree on every process "
            f"({_release_broken[action]}), so the processes' {action} calls are out of step; restart them")
    call = _release_calls[action] = _release_calls.get(action, -1) + 1
    try:
        held = _exchange(f"jax_ep/release/{action}/{call}", str(int(_C.runtime_holders())).encode(), timeout,
                         barrier=True)
    except Exception as e:
        _release_broken[action] = f"{type(e).__name__}: {e}"
        raise
    holding = {p: int(n) for p, n in enumerate(held) if int(n) > 0}
    if holding:
        raise errors.EPRuntimeError(
            f"jax_ep: {action} refused on every process: instantiated EP call sites of live executables "
            "hold the runtime on " + ", ".join(f"process {p} ({n})" for p, n in holding.items())
            + ". Delete the jitted functions that use EP ops and call jax.clear_caches() there first.")


def faults() -> list[dict]:
    """Device-side faults recorded by jax_ep kernels, one dict per GPU that faulted."""
    return [] if _C is None else list(_C.faults())


def report_faults(stream=None) -> list[str]:
    """Prints each device-side fault record not printed yet, once, to ``stream`` (default stderr) as
    "jax_ep device fault: <its message>" (naming the op, this GPU's rank and the rank it waited for or
    disagreed with); returns the messages printed. A kernel that records a fault traps, and the user
    then sees only XLA's generic CUDA error (e.g. CUDA_ERROR_LAUNCH_FAILED) from the next
    synchronising call: ``watch_faults`` calls this every FAULT_POLL_S seconds, at an uncaught
    exception and at exit. The records are in pinned host memory: readable after the trap."""
    out = sys.stderr if stream is None else stream
    new = []
    with _report_lock:   # marked and printed together: an exit's report cannot skip one half-done
        for fault in faults():
            key = (fault["device_ordinal"], fault["message"])
            if key not in _reported:
                _reported.add(key)
                new.append(fault["message"])
                print(f"jax_ep device fault: {fault['message']}", file=out, flush=True)
    return new


def watch_faults() -> None:
    """Makes device-side faults visible without the user asking (idempotent; register_targets calls
    it): a daemon thread prints new fault records (``report_faults``) every FAULT_POLL_S seconds, and
    an uncaught exception and the process's exit print those not printed yet. Under
    ``python -m jax_ep.launch`` a failed process's summary lists them (``failure_report``)."""
    global _watcher
    with _report_lock:
        if _watcher is not None:
            return
        _watcher = threading.Thread(target=_poll_faults, name="jax_ep-fault-watch", daemon=True)
        _watcher.start()
    atexit.register(_stop_watching_and_report)
    previous = sys.excepthook

    def hook(*exc_info):
        _report_quietly()
        previous(*exc_info)
    sys.excepthook = hook


def _poll_faults() -> None:
    while not _stop_watching.wait(FAULT_POLL_S):
        try:
            report_faults()
        except Exception:  # noqa: BLE001 - a report must never take the process down
            return


def _stop_watching_and_report() -> None:
    """At exit: the watcher stops (no thread inside the extension while the interpreter finalises),
    then the records not printed yet are."""
    _stop_watching.set()
    if _watcher is not None:
        _watcher.join(timeout=5)
    _report_quietly()


def _report_quietly() -> None:
    try:
        report_faults()
    except Exception:  # noqa: BLE001 - at exit / in the excepthook: never mask the real error
        pass


def axis_slot(axis_name: str) -> int:
    """The directory slot of an EP mesh axis name (what the kernels key an EP group's state by)."""
    return zlib.crc32(axis_name.encode()) % limits()["directory_axes"]


def rank_masks(axis_name: str | None = None, group: int | None = None) -> list[dict]:
    """The persistent rank masks of the EP groups on this process's GPUs (shrink mode,
    ``EPConfig(shrink=True)``): one dict per (GPU, EP group, masked rank) with ``device_ordinal``,
    ``axis_slot``, ``group`` (the EP group's index over the other mesh axes), ``rank`` (the GPU's
    own), ``masked_rank``, ``op`` (the call whose bounded wait it missed), ``during``
    (``"discovery"``: it had not entered that call; ``"receive"``: it had, its data never came) and
    ``epoch`` (that call's number in the group). Every later EP call of the group on that GPU
    treats ``masked_rank`` as masked until ``clear_rank_masks``. ``axis_name`` / ``group``: only that
    EP axis / group. Synchronises the GPUs; call it outside jit (between steps)."""
    group = _checked_group("rank_masks", group)
    if _C is None:
        return []
    found = list(_C.rank_masks())
    if axis_name is not None:
        found = [m for m in found if m["axis_slot"] == axis_slot(axis_name)]
    if group is not None:
        found = [m for m in found if m["group"] == group]
    return found


def _checked_group(op: str, group):
    """None or an EP group's index, an int in [0, max_groups): the runtime took a negative group as every
    group and one past the last as none, and rank_masks found nothing for either (found by a review,
    2026-12-06)."""
    if group is None:
        return None
    group = check_option(f"jax_ep.runtime.{op}:", "group", group, "int", minimum=0)
    if _C is not None and group >= _C.LIMITS["max_groups"]:
        raise errors.EPValueError(f"jax_ep.runtime.{op}: group must be below the runtime's max_groups "
                                  f"{_C.LIMITS['max_groups']}, got {group}")
    return group


def clear_rank_masks(axis_name: str | None = None, group: int | None = None) -> None:
    """Clears the persistent rank masks (all, or of one EP axis / group) on this process's GPUs,
    after synchronising them: the next EP calls wait for those ranks again. Call it on every rank
    of the group, between steps, once the masked rank is back in step (it must have run the same
    EP calls; otherwise the next call fails naming it, see docs/api.md)."""
    group = _checked_group("clear_rank_masks", group)
    if _C is None:
        return
    _C.clear_rank_masks(-1 if axis_name is None else axis_slot(axis_name), -1 if group is None else group)


def check_errors() -> None:
    """Raises DeviceFaultError if a jax_ep kernel recorded a fault (a timeout names the op, the
    waiting rank and the rank it waited on; a mismatch the op, the rank, the peer, the field of the
    config fingerprint and both values). Call it when a computation failed with a CUDA error
    such as an illegal instruction / unspecified launch failure."""
    found = faults()
    if found:
        raise DeviceFaultError("\n".join(f["message"] for f in found))
