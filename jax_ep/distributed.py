"""The one place jax_ep touches JAX's distributed runtime (``jax.distributed.initialize``).

Starting: ``initialize()`` calls ``jax.distributed.initialize`` with what ``python -m jax_ep.launch``
put in the environment (``JAX_EP_NUM_PROCESSES``, ``JAX_EP_PROCESS_ID``; JAX itself reads
``JAX_COORDINATOR_ADDRESS`` and ``JAX_LOCAL_DEVICE_IDS``, but has no variables for the process count
and index), or lets JAX detect the cluster (SLURM, Open MPI, ...) when they are absent.
``launched_by()`` says whether this process is one of several, so that scripts can call
``initialize()`` only then and keep their single-process behaviour otherwise.

Process model 2 (one process per GPU) bootstraps NVSHMEM by passing a unique id through JAX's
key-value store. JAX exposes that store only through a private object
(``jax._src.distributed.global_state.client``); every use goes through the functions here, so when
JAX moves it there is one clear error and one place to mend. Every wait is bounded and its error
names what was waited for and the processes that did not arrive.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence

import jax

from jax_ep.config import _is_int, check_option
from jax_ep.errors import EPRuntimeError, EPTimeoutError, EPValueError

DEFAULT_TIMEOUT_S = 120.0
LIVENESS_WAIT_S = 2.0  # how long an error waits for JAX to say which processes are dead

# set by python -m jax_ep.launch for each process it starts (JAX reads no variable for these two)
ENV_NUM_PROCESSES = "JAX_EP_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_EP_PROCESS_ID"
# read by jax.distributed.initialize itself; the launcher sets them too
ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_LOCAL_DEVICE_IDS = "JAX_LOCAL_DEVICE_IDS"
LAUNCHER = "jax_ep.launch"


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise EPValueError(f"jax_ep: environment variable {name} must be an integer, got {value!r}") from None


def _launch_env() -> tuple[int, int] | None:
    """(num_processes, process_id) set by jax_ep.launch, checked; None when neither is set."""
    num, pid = _env_int(ENV_NUM_PROCESSES), _env_int(ENV_PROCESS_ID)
    if num is None and pid is None:
        return None
    if num is None or pid is None:
        have, missing = (ENV_NUM_PROCESSES, ENV_PROCESS_ID) if pid is None else (ENV_PROCESS_ID,
                                                                                ENV_NUM_PROCESSES)
        raise EPValueError(f"jax_ep: {have}={os.environ[have]!r} is set but {missing} is not: set both "
                           f"(python -m {LAUNCHER} does) or neither")
    if num < 1:
        raise EPValueError(f"jax_ep: {ENV_NUM_PROCESSES} must be at least 1, got {num}")
    if not 0 <= pid < num:
        raise EPValueError(f"jax_ep: {ENV_PROCESS_ID} must be in [0, {ENV_NUM_PROCESSES}={num}), got {pid}")
    return num, pid


def _detected_cluster(only: tuple[str, ...] | None = None) -> tuple[str, int] | None:
    """(name, process count) of the cluster JAX's auto-detection would use (SLURM, Open MPI, ...;
    opt-in methods such as mpi4py excluded; of the names ``only`` when given), or None. Uses JAX's
    private cluster registry."""
    try:
        from jax._src import clusters
        kinds = clusters.ClusterEnv._cluster_types
    except (ImportError, AttributeError):  # pragma: no cover - depends on the JAX version
        return None
    for kind in kinds:
        if only is not None and kind.name not in only:
            continue
        try:
            if not kind.opt_in_only_method and kind.is_env_present():
                return kind.name or kind.__name__, int(kind.get_process_count())
        except Exception:  # noqa: BLE001 - a half-configured environment: not this cluster
            continue
    return None


def _open_mpi_5() -> int | None:
    """The process count of an Open MPI 5 (PRRTE) mpirun job, which JAX's Open MPI detection misses (it
    reads OMPI_MCA_orte_hnp_uri, which only Open MPI < 5 sets); None when not such a job."""
    if "OMPI_MCA_orte_hnp_uri" in os.environ:
        return None
    try:
        return int(os.environ["OMPI_COMM_WORLD_SIZE"])
    except (KeyError, ValueError):
        return None


def launched_by() -> str | None:
    """Who started this process: ``"jax_ep.launch"`` (any ``--nproc``), or ``"slurm"`` or ``"ompi"``
    (Open MPI's mpirun, 5 included) when that job has more than one process; else None (a single
    process: no need for ``initialize()``). Reads environment variables only (JAX's SLURM and Open
    MPI detection)."""
    if _launch_env() is not None:
        return LAUNCHER
    cluster = _detected_cluster(only=("slurm", "ompi"))
    if cluster is None and (_open_mpi_5() or 0) > 1:
        return "ompi"   # so that initialize() says what JAX lacks, not each rank running alone
    return cluster[0] if cluster is not None and cluster[1] > 1 else None


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, local_device_ids: int | Sequence[int] | None = None, *,
               initialization_timeout: int = 300, **kwargs) -> None:
    """``jax.distributed.initialize`` for jax_ep programs; call it first, before any JAX computation.

    Arguments given here win; then the environment of ``python -m jax_ep.launch``
    (``JAX_EP_NUM_PROCESSES``, ``JAX_EP_PROCESS_ID``, ``JAX_COORDINATOR_ADDRESS``,
    ``JAX_LOCAL_DEVICE_IDS``); without it, JAX's own detection of the cluster (SLURM, Open MPI,
    Kubernetes, Cloud TPU). ``kwargs`` go to ``jax.distributed.initialize``. On CPU, collectives
    across processes use gloo unless ``jax_cpu_collectives_implementation`` is set. Does nothing
    when jax.distributed is already initialised.

    Raises ValueError naming the variable for a malformed launcher environment, a malformed coordinator
    address or local device ids, a process id out of range or a timeout that is not a positive int of
    seconds; RuntimeError when JAX already computed (no process would find its coordinator) or nothing
    says how many processes there are (not launched, no cluster detected).
    """
    if jax.distributed.is_initialized():
        return
    initialization_timeout = check_option("jax_ep.distributed.initialize:", "initialization_timeout",
                                          initialization_timeout, "int")
    launched = _launch_env()
    if launched is not None:
        if coordinator_address is None and not os.environ.get(ENV_COORDINATOR):
            raise EPValueError(f"jax_ep: {ENV_NUM_PROCESSES} and {ENV_PROCESS_ID} are set but "
                               f"{ENV_COORDINATOR} is not (python -m {LAUNCHER} sets all three)")
        num_processes = launched[0] if num_processes is None else num_processes
        process_id = launched[1] if process_id is None else process_id
    elif (None in (coordinator_address or os.environ.get(ENV_COORDINATOR), num_processes, process_id)
          and not kwargs.get("cluster_detection_method") and _detected_cluster() is None):
        mpi5 = (" This is an Open MPI 5 mpirun job, which JAX's detection does not know (it knows Open MPI "
                "< 5): pass cluster_detection_method='mpi4py' (needs mpi4py) or the three arguments."
                if _open_mpi_5() is not None else "")
        raise EPRuntimeError(
            "jax_ep.distributed.initialize: no multi-process environment: not started by "
            f"`python -m {LAUNCHER}` ({ENV_NUM_PROCESSES} is unset) and JAX detects no cluster "
            "(SLURM, Open MPI, ...); pass coordinator_address, num_processes and process_id" + mpi5)
    try:
        if jax.config.jax_cpu_collectives_implementation is None:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except AttributeError:  # pragma: no cover - depends on the JAX version
        pass
    num_processes = check_option("jax_ep.distributed.initialize:", "num_processes", num_processes, "int?")
    process_id = check_option("jax_ep.distributed.initialize:", "process_id", process_id, "int?", minimum=0)
    if None not in (num_processes, process_id) and process_id >= num_processes:
        raise EPValueError(f"jax_ep.distributed.initialize: process_id={process_id} is not below "
                           f"num_processes={num_processes}")
    local_device_ids = _local_device_ids(local_device_ids)
    address = coordinator_address or os.environ.get(ENV_COORDINATOR)
    source = "coordinator_address" if coordinator_address else ENV_COORDINATOR
    if address:
        host_port(address, source)   # a malformed address is an error now, not after the wait below
    from jax._src import xla_bridge
    if xla_bridge.backends_are_initialized():
        # before the coordinator wait below: process 0 fails the same way at once (JAX's error), so the
        # others would wait the whole timeout for a coordinator it never starts, and blame it
        raise EPRuntimeError("jax_ep.distributed.initialize: JAX already ran a computation or listed its "
                             "devices in this process: call initialize() before any other JAX call")
    if address and process_id not in (None, 0):
        waited = _wait_for_coordinator(address, process_id, initialization_timeout, source)
        initialization_timeout = max(1, int(initialization_timeout - waited))   # one bound for both waits
    jax.distributed.initialize(coordinator_address, num_processes, process_id, local_device_ids,
                               initialization_timeout=initialization_timeout, **kwargs)


def _local_device_ids(ids) -> int | list[int] | None:
    """``local_device_ids`` checked, or the launcher's JAX_LOCAL_DEVICE_IDS parsed and checked when it is
    None (JAX would parse the variable with a bare int() error, and take a str argument character by
    character); an EPValueError names the argument or variable and its value."""
    given, source = ids, "local_device_ids"
    if ids is None:
        given, source = os.environ.get(ENV_LOCAL_DEVICE_IDS), ENV_LOCAL_DEVICE_IDS
        if not given:   # unset or empty: JAX reads an empty value as unset too
            return None
        try:
            ids = [int(i) for i in given.split(",")]
        except ValueError:
            ids = None
    elif _is_int(ids):
        ids = [ids]
    elif isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        ids = None
    if not ids or any(not _is_int(i) or i < 0 for i in ids):
        raise EPValueError(f"jax_ep.distributed.initialize: {source}={given!r} is not a device ordinal or a "
                           + ("comma-separated list of them (e.g. '0,1')" if source == ENV_LOCAL_DEVICE_IDS
                              else "list of them (ints >= 0)"))
    return [int(i) for i in ids]   # NumPy ints pass _is_int; JAX gets Python ints


COORDINATOR_NOTE_S = 30.0   # after this long a waiting process says what it waits for


def host_port(address: str, source: str = "the coordinator address") -> tuple[str, int]:
    """(host, port) of a coordinator address "HOST:PORT" (an IPv6 host in brackets, as gRPC reads it:
    "[::1]:1234"); an EPValueError naming ``source`` (where the address came from) when it is not one."""
    host, _, port = str(address).rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    host = host[1:-1] if bracketed else host
    if not host or not port.isdigit() or not 0 < int(port) < 65536 or (":" in host and not bracketed):
        raise EPValueError(f"jax_ep: {source}={address!r} is not HOST:PORT (a port in 1..65535; an IPv6 "
                           "host in brackets: [HOST]:PORT)")
    return host, int(port)


def _wait_for_coordinator(address: str, process_id: int, timeout_s: float, source: str) -> float:
    """Waits (at most timeout_s) until process 0's coordinator at ``address`` accepts a connection;
    returns the seconds waited. Why:
    JAX waits as long, silently, and then aborts the process (a fatal log, not an exception) blaming
    "another task"; here a wrong or unreachable address is an EPTimeoutError naming it."""
    import socket
    import sys

    host, port = host_port(address)
    start = time.monotonic()
    noted = False
    while True:
        try:
            with socket.create_connection((host, port), timeout=2.0):
                return time.monotonic() - start
        except OSError as e:
            error = e
        waited = time.monotonic() - start
        if waited >= timeout_s:
            raise EPTimeoutError(
                f"jax_ep.distributed.initialize: process {process_id} found no coordinator at {address!r} "
                f"({source}) within {timeout_s:.0f} s ({type(error).__name__}: {error}): process 0 did not "
                "start, or the address is not process 0's")
        if not noted and waited >= COORDINATOR_NOTE_S:
            print(f"jax_ep: process {process_id} is waiting for the coordinator at {address} ({source}); "
                  f"gives up after {timeout_s:.0f} s", file=sys.stderr, flush=True)
            noted = True
        time.sleep(0.5)


def _client():
    """JAX's DistributedRuntimeClient, or a RuntimeError saying why there is none."""
    try:
        from jax._src import distributed as jax_distributed
        client = jax_distributed.global_state.client
    except (ImportError, AttributeError) as e:  # pragma: no cover - depends on the JAX version
        raise EPRuntimeError(
            f"jax_ep: this JAX ({jax.__version__}) no longer has the distributed key-value store at "
            f"jax._src.distributed.global_state.client ({e}); jax_ep.distributed must be updated"
        ) from e
    if client is None:
        raise EPRuntimeError("jax_ep: jax.distributed is not initialised: call "
                             "jax.distributed.initialize() (or start the program with "
                             "`python -m jax_ep.launch`) before using jax_ep across processes")
    return client


def is_multiprocess() -> bool:
    """True when this JAX program runs as several processes (jax.distributed initialised)."""
    return jax.process_count() > 1


def _missing(what: str, timeout_s: float, error: Exception,
             waited: float) -> EPTimeoutError | EPRuntimeError:
    """The error of a wait that did not complete, naming the processes JAX sees as absent: an
    EPTimeoutError where the wait ran out (JAX's DEADLINE_EXCEEDED), else an EPRuntimeError with JAX's
    error (e.g. the coordinator gone), not called a timeout."""
    found: list[str] = []

    def query() -> None:
        try:
            live = _client().get_live_nodes(list(range(jax.process_count())))
            gone = sorted(set(range(jax.process_count())) - set(int(p) for p in live))
            if gone:
                found.append(f"; processes not alive: {gone}")
        except Exception:  # noqa: BLE001 - best effort: the timeout is the error
            pass

    # JAX's liveness query can block until the coordinator's heartbeat notices a dead process
    # (~100 s, seen on 2x H200): ask it on the side and wait LIVENESS_WAIT_S at most.
    asking = threading.Thread(target=query, daemon=True)
    asking.start()
    asking.join(LIVENESS_WAIT_S)
    absent = found[0] if found else ""
    if "DEADLINE_EXCEEDED" in str(error) or waited >= timeout_s:
        return EPTimeoutError(f"jax_ep: process {jax.process_index()} waited {timeout_s:g} s for {what} "
                              f"and gave up{absent} ({error})")
    return EPRuntimeError(f"jax_ep: process {jax.process_index()} stopped waiting for {what} after "
                          f"{waited:.1f} s of {timeout_s:g}{absent}: {type(error).__name__}: {error}")


def kv_set_bytes(key: str, value: bytes) -> None:
    """Publishes ``value`` under ``key`` for every process (keys are written once)."""
    _client().key_value_set_bytes(key, bytes(value))


def kv_get_bytes(key: str, timeout_s: float = DEFAULT_TIMEOUT_S, *, writer: str = "") -> bytes:
    """The value another process published under ``key``; TimeoutError after ``timeout_s``
    naming the key and ``writer`` (who was expected to publish it)."""
    timeout_s = check_option("jax_ep.distributed.kv_get_bytes:", "timeout_s", timeout_s, "seconds")
    client = _client()   # not initialised: its RuntimeError, not a timeout
    start = time.monotonic()
    try:
        return bytes(client.blocking_key_value_get_bytes(key, int(timeout_s * 1000)))
    except Exception as e:  # JAX raises XlaRuntimeError (DEADLINE_EXCEEDED) on timeout
        who = f" from {writer}" if writer else ""
        raise _missing(f"key {key!r}{who}", timeout_s, e, time.monotonic() - start) from e


def barrier(name: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Waits until every process reaches the barrier ``name``; TimeoutError naming it (and the
    processes JAX sees as dead) after ``timeout_s``."""
    timeout_s = check_option("jax_ep.distributed.barrier:", "timeout_s", timeout_s, "seconds")
    client = _client()
    start = time.monotonic()
    try:
        client.wait_at_barrier(name, int(timeout_s * 1000))
    except Exception as e:  # noqa: BLE001 - re-raised with the barrier's name
        raise _missing(f"barrier {name!r} (all {jax.process_count()} processes)", timeout_s,
                       e, time.monotonic() - start) from e
