"""The one place jax_ep touches JAX's distributed runtime (``jax.distributed.initialize``).

Process model 2 (one process per GPU) bootstraps NVSHMEM by passing a unique id through JAX's
key-value store. JAX exposes that store only through a private object
(``jax._src.distributed.global_state.client``); every use goes through the functions here, so when
JAX moves it there is one clear error and one place to mend. Every wait is bounded and its error
names what was waited for and the processes that did not arrive.
"""

from __future__ import annotations

import jax

DEFAULT_TIMEOUT_S = 120.0


def _client():
    """JAX's DistributedRuntimeClient, or a RuntimeError saying why there is none."""
    try:
        from jax._src import distributed as jax_distributed
        client = jax_distributed.global_state.client
    except (ImportError, AttributeError) as e:  # pragma: no cover - depends on the JAX version
        raise RuntimeError(
            f"jax_ep: this JAX ({jax.__version__}) no longer has the distributed key-value store at "
            f"jax._src.distributed.global_state.client ({e}); jax_ep.distributed must be updated"
        ) from e
    if client is None:
        raise RuntimeError("jax_ep: jax.distributed is not initialised: call "
                           "jax.distributed.initialize() (or start the program with "
                           "`python -m jax_ep.launch`) before using jax_ep across processes")
    return client


def is_multiprocess() -> bool:
    """True when this JAX program runs as several processes (jax.distributed initialised)."""
    return jax.process_count() > 1


def _missing(what: str, timeout_s: float, error: Exception) -> TimeoutError:
    """The error of a wait that did not complete, naming the processes JAX sees as absent."""
    absent = ""
    try:
        live = _client().get_live_nodes(list(range(jax.process_count())))
        gone = sorted(set(range(jax.process_count())) - set(int(p) for p in live))
        if gone:
            absent = f"; processes not alive: {gone}"
    except Exception:  # noqa: BLE001 - the liveness query is best effort, the timeout is the error
        pass
    return TimeoutError(f"jax_ep: process {jax.process_index()} waited {timeout_s:g} s for {what} "
                        f"and gave up{absent} ({error})")


def kv_set_bytes(key: str, value: bytes) -> None:
    """Publishes ``value`` under ``key`` for every process (keys are written once)."""
    _client().key_value_set_bytes(key, bytes(value))


def kv_get_bytes(key: str, timeout_s: float = DEFAULT_TIMEOUT_S, *, writer: str = "") -> bytes:
    """The value another process published under ``key``; TimeoutError after ``timeout_s``
    naming the key and ``writer`` (who was expected to publish it)."""
    try:
        return bytes(_client().blocking_key_value_get_bytes(key, int(timeout_s * 1000)))
    except Exception as e:  # JAX raises XlaRuntimeError (DEADLINE_EXCEEDED) on timeout
        who = f" from {writer}" if writer else ""
        raise _missing(f"key {key!r}{who}", timeout_s, e) from e


def barrier(name: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Waits until every process reaches the barrier ``name``; TimeoutError naming it (and the
    processes JAX sees as dead) after ``timeout_s``."""
    try:
        _client().wait_at_barrier(name, int(timeout_s * 1000))
    except Exception as e:  # noqa: BLE001 - re-raised with the barrier's name
        raise _missing(f"barrier {name!r} (all {jax.process_count()} processes)", timeout_s,
                       e) from e
