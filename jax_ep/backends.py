"""The EP backends, by registry: what implements the per-rank functions of the EP ops.

A backend (``Backend``) is a module with the functions of ``Functions`` (same signatures, same
results: the output types of ``jax_ep.types``), the JAX platforms it runs on, whether it can run
here and which calls its kernels cannot take. ``EPConfig.backend`` names one, or "auto": the first
registered backend with ``faster`` whose kernel measured faster for the call and that can run it on
the platform of the call, else the reference (``jax_ep.ops.Op.plan`` decides, ``jax_ep.explain``
says why). Registered here: "reference" (``jax_ep.reference``, pure JAX, the semantics; any platform)
and "cuda" (``jax_ep.cuda_backend``, the CUDA kernels; GPUs). A third registers itself with
``register``. A backend's module is imported when first used: the CUDA extension is optional.

The platform of a call (``platform``) is that of the mesh's devices inside ``shard_map`` over a
concrete mesh, else JAX's default platform: a CPU mesh on a GPU machine runs the reference.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import jax

from jax_ep.errors import EPUnsupportedError, EPValueError

if TYPE_CHECKING:  # the types of the signatures below only (no import cycle at run time)
    from jax_ep import types as t
    from jax_ep.config import EPConfig

Mask = jax.Array | None  # a data op's rank_mask: None (every rank active) or the checked [R] mask
REFERENCE = "reference"  # the backend that defines the semantics; 'auto' falls back to it


class Functions(Protocol):
    """What a backend's module implements: one function per op. Per-rank views, inside shard_map over
    cfg.axis_name. Every op but layout and the ``*_recv`` halves (the send's mask comes with the pending
    value) takes ``rank_mask`` (the ops always pass it, None without a mask). A backend may leave an op
    out ('auto' then takes another for it; naming the backend for it is an error). The two-phase
    low-latency ops come in pairs: a backend's ``*_recv`` takes the pending value of its own ``*_send``
    (the value names the backend, ``pending.backend``)."""

    def layout(self, topk_idx: jax.Array, cfg: EPConfig) -> t.Layout: ...
    def dispatch(self, x: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array,
                 cfg: EPConfig, rank_mask: Mask = None) -> t.Dispatched: ...
    def combine(self, y: jax.Array, handle: t.Handle, cfg: EPConfig, rank_mask: Mask = None) -> jax.Array: ...
    def broadcast(self, g: jax.Array, handle: t.Handle, cfg: EPConfig,
                  rank_mask: Mask = None, into: jax.Array | None = None) -> jax.Array: ...
    def combine_bwd(self, g: jax.Array, y: jax.Array, handle: t.Handle, cfg: EPConfig,
                    rank_mask: Mask = None, empty_rows_from_y: bool = False
                    ) -> tuple[jax.Array, jax.Array]: ...
    def slot_values(self, values: jax.Array, handle: t.Handle, cfg: EPConfig,
                    rank_mask: Mask = None) -> jax.Array: ...
    def ll_dispatch(self, x: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array,
                    cfg: EPConfig, rank_mask: Mask = None) -> t.LLDispatched: ...
    def ll_combine(self, y: jax.Array, handle: t.LLHandle, cfg: EPConfig,
                   rank_mask: Mask = None) -> jax.Array: ...
    def ll_dispatch_send(self, x: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array,
                         cfg: EPConfig, rank_mask: Mask = None) -> t.LLDispatchPending: ...
    def ll_dispatch_recv(self, pending: t.LLDispatchPending, cfg: EPConfig) -> t.LLDispatched: ...
    def ll_combine_send(self, y: jax.Array, handle: t.LLHandle, cfg: EPConfig,
                        rank_mask: Mask = None) -> t.LLCombinePending: ...
    def ll_combine_recv(self, pending: t.LLCombinePending, cfg: EPConfig) -> jax.Array: ...
    def dispatch_rank_major(self, x: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array,
                            cfg: EPConfig, rank_mask: Mask = None) -> t.RankMajorDispatched: ...
    def combine_rank_major(self, y: jax.Array, handle: t.RankMajorHandle, cfg: EPConfig,
                           rank_mask: Mask = None) -> jax.Array: ...
    def broadcast_rank_major(self, g: jax.Array, handle: t.RankMajorHandle, cfg: EPConfig,
                             rank_mask: Mask = None) -> jax.Array: ...


def _can_run_anywhere() -> tuple[bool, str]:
    return True, ""


def _supports_everything(op: str, cfg: EPConfig, ep_size: int, dtype) -> str | None:
    return None


def _no_form(op: str, cfg: EPConfig, ep_size: int) -> str | None:
    return None


@dataclasses.dataclass(frozen=True)
class Backend:
    """A registered backend.

    Attributes:
      name: what EPConfig.backend calls it.
      module: the module of its functions (``Functions``), imported when first used.
      platforms: the JAX platforms it runs on (``platform()``); empty: every platform.
      available: () -> (usable, why not): whether it can run in this process.
      unsupported: (op, cfg, ep_size, dtype) -> why its kernel of ``op`` cannot run that call (None
        when it can).
      faster: (op, layout, tokens per rank, ep_size, wire_dtype) -> whether 'auto' takes it for that
        call (its kernel measured faster than the reference, ``jax_ep.auto_table``; ``wire_dtype``: the
        rows' dtype on the wire, a name as "bfloat16"); None: 'auto' never does.
        ``op`` is the op's name, for a form of another op (``jax_ep.ops.Op.form_of``) the form's;
        ``unsupported`` and ``form`` get the name of the function that runs it (``Op.function``).
      form: (op, cfg, ep_size) -> how its kernel of ``op`` runs that call where it has a choice (the
        end of ``jax_ep.explain``'s reason), or None.
      why_faster: ``faster``'s arguments -> what made 'auto' take it (``jax_ep.explain``'s reason), or
        None: "its kernel measured faster".
    """

    name: str
    module: str
    platforms: tuple[str, ...] = ()
    available: Callable[[], tuple[bool, str]] = _can_run_anywhere
    unsupported: Callable[..., str | None] = _supports_everything
    faster: Callable[[str, str, int, int, str], bool] | None = None
    form: Callable[..., str | None] = _no_form
    why_faster: Callable[[str, str, int, int, str], str] | None = None

    def functions(self):
        return importlib.import_module(self.module)

    def implements(self, op: str) -> bool:
        return callable(getattr(self.functions(), op, None))

    def function(self, op: str):
        """Its function of ``op``; EPUnsupportedError naming both when it has none."""
        fn = getattr(self.functions(), op, None)
        if not callable(fn):
            raise EPUnsupportedError(f"jax_ep.{op} (backend={self.name!r}): this version of jax_ep has no "
                                     f"{self.name} implementation of it ({self.module}.{op}); use "
                                     "backend='reference' or 'auto'")
        return fn

    def runs_on(self, platform_name: str) -> bool:
        return not self.platforms or platform_name in self.platforms


def _cuda_available() -> tuple[bool, str]:
    from jax_ep import runtime

    return runtime.available()


def _cuda_unsupported(op: str, cfg: EPConfig, ep_size: int, dtype) -> str | None:
    from jax_ep import cuda_backend

    return cuda_backend.unsupported(op, cfg, ep_size, dtype)


def _cuda_faster(op: str, layout: str, tokens: int, ep_size: int, wire_dtype: str) -> bool:
    from jax_ep import auto_table

    return auto_table.kernel_faster(op, layout, tokens, ep_size, wire_dtype)


def _cuda_why_faster(op: str, layout: str, tokens: int, ep_size: int, wire_dtype: str) -> str:
    from jax_ep import auto_table

    return auto_table.why_taken(op, layout, tokens, ep_size, wire_dtype)


def _cuda_form(op: str, cfg: EPConfig, ep_size: int) -> str | None:
    from jax_ep import cuda_backend

    choice = cuda_backend.pull_choice(op, cfg, ep_size)
    if choice is None:
        return None
    pulled, why = choice
    knob = cuda_backend.pull_knob(op)
    if not pulled:
        return f"rows pushed by the senders ({why})"
    return (f"rows pulled by the receivers where the call reaches its peers by NVLink loads / stores "
            f"({why}; over NVSHMEM puts {'refused' if getattr(cfg.kernel, knob) else 'pushed'})")


_REGISTRY: dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
    """Adds ``backend`` (or replaces the one of its name); 'auto' tries the backends with ``faster``
    in the order they were registered. Returns it."""
    if not isinstance(backend, Backend):
        raise EPValueError(f"jax_ep.backends.register: expected a jax_ep.backends.Backend, got "
                           f"{type(backend).__name__}")
    if backend.name == "auto" or not backend.name:
        raise EPValueError(f"jax_ep.backends.register: {backend.name!r} cannot name a backend")
    _REGISTRY[backend.name] = backend
    return backend


def unregister(name: str) -> None:
    """Removes the backend ``name`` (not the reference)."""
    if name == REFERENCE:
        raise EPValueError("jax_ep.backends.unregister: the reference backend stays")
    _REGISTRY.pop(name, None)


def names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def get(name: str) -> Backend:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise EPValueError(f"jax_ep: no backend {name!r}; the backends are {names()} (or 'auto')") from None


def measured() -> tuple[Backend, ...]:
    """The backends 'auto' may take instead of the reference, in the order it tries them."""
    return tuple(b for b in _REGISTRY.values() if b.faster is not None)


def platform() -> str:
    """The JAX platform the EP ops run on here: the mesh's devices' inside shard_map over a concrete
    mesh, else JAX's default platform."""
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    return device.platform if device is not None else jax.default_backend()


register(Backend(REFERENCE, "jax_ep.reference"))
register(Backend("cuda", "jax_ep.cuda_backend", platforms=("gpu", "cuda"), available=_cuda_available,
                 unsupported=_cuda_unsupported, faster=_cuda_faster, form=_cuda_form,
                 why_faster=_cuda_why_faster))
