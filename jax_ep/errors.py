"""The errors jax_ep raises on purpose: one family under ``jax_ep.EPError``.

``except jax_ep.EPError`` catches every error jax_ep raises deliberately (a wrong argument or option, a
feature not built for this case, a failed run-time check, a device fault, too little GPU memory, a
process that did not arrive in time). Each subclass also keeps the built-in base Python code expects
for its kind (``EPValueError`` is a ``ValueError``, ``EPUnsupportedError`` a ``NotImplementedError``,
...), so ``except ValueError`` and the like keep working. docs/api.md, "Errors", lists them.

This module imports nothing from jax_ep (every other module may import it).
"""

from __future__ import annotations


class EPError(Exception):
    """Base of every error jax_ep raises on purpose."""


class EPValueError(EPError, ValueError):
    """A wrong argument or option value (shape, dtype, size, a config field out of range), raised
    when the op is called or traced; and a checked-mode failure (``EPConfig(checked=True)``: a traced
    value was invalid), raised when the computation runs. The latter is raised as such by
    ``jax_ep.run_checked`` / ``jax_ep.ep_errors``; without them JAX reports it as a
    ``jax.errors.JaxRuntimeError`` whose text ends with ``EPValueError: <message>``."""


class EPTypeError(EPError, TypeError, ValueError):
    """An argument or option of the wrong type (``EPConfig(checked="no")``, a float where an int
    belongs, a tuple where ``combine`` takes a ``Handle``). Also a ``ValueError``: jax_ep raised
    ``ValueError`` for these before this class existed."""


class EPUnsupportedError(EPError, NotImplementedError):
    """A valid request that this build or backend does not implement (e.g. hierarchical dispatch
    with an expert placement, a CUDA op on an EP group the kernels do not support)."""


class EPRuntimeError(EPError, RuntimeError):
    """Something in the environment is not as jax_ep needs it (the CUDA backend unavailable, a
    stale extension build, ``jax.distributed`` not initialised, a set-up step refused)."""


class EPTimeoutError(EPError, TimeoutError):
    """Process model 2: a process waited for the others (a key, a barrier) and gave up, naming what
    it waited for and the processes JAX sees as absent."""


class DeviceFaultError(EPError, RuntimeError):
    """A jax_ep kernel recorded a fault (a timeout, ranks running different EP calls, a stale
    runtime, ...) and trapped. The CUDA context of that GPU is dead: restart the process."""


class DeviceMemoryError(EPError, RuntimeError):
    """A jax_ep buffer (communication buffer, device state, NVSHMEM symmetric heap) does not fit in
    a GPU's free memory beside XLA's preallocation. The GPU stays usable. When the CUDA extension is
    built, ``jax_ep.runtime.DeviceMemoryError`` is the extension's class (raised from C++), a subclass
    of this one, so that either name catches it (``except jax_ep.errors.DeviceMemoryError`` missed it
    before 2026-12-06); this one stands in for it otherwise."""


class CheckpointMismatchError(EPValueError):
    """The checkpoint does not fit the model (or optimizer) it is restored into."""


class CheckpointNotFoundError(EPError, FileNotFoundError):
    """``jax_ep.checkpoint`` found no checkpoint at the path it was given."""


ERRORS = (EPError, EPValueError, EPTypeError, EPUnsupportedError, EPRuntimeError, EPTimeoutError,
          DeviceFaultError, DeviceMemoryError, CheckpointMismatchError, CheckpointNotFoundError)

for _cls in ERRORS:
    _cls.__module__ = "jax_ep"  # shown as jax_ep.EPValueError etc., the names users catch
del _cls
