"""jax_ep: expert-parallel dispatch/combine for Mixture-of-Experts models in JAX."""

from jax_ep.config import EPConfig, KernelConfig
from jax_ep.errors import (
    CheckpointMismatchError,
    CheckpointNotFoundError,
    DeviceFaultError,
    EPError,
    EPRuntimeError,
    EPTimeoutError,
    EPTypeError,
    EPUnsupportedError,
    EPValueError,
)
from jax_ep.fp8 import dequantize_fp8
from jax_ep.gemm import grouped_matmul
from jax_ep.hierarchical import (
    HierarchicalDispatched,
    HierarchicalHandle,
    combine_hierarchical,
    dispatch_hierarchical,
)
from jax_ep.ops import (
    combine,
    combine_rank_major,
    dispatch,
    dispatch_rank_major,
    explain,
    get_dispatch_layout,
    ll_combine,
    ll_combine_recv,
    ll_combine_send,
    ll_dispatch,
    ll_dispatch_recv,
    ll_dispatch_send,
)
from jax_ep.types import (
    Dispatched,
    Handle,
    Layout,
    LLCombinePending,
    LLDispatched,
    LLDispatchPending,
    LLHandle,
    RankMajorDispatched,
    RankMajorHandle,
)
from jax_ep.validation import ep_errors, run_checked

__version__ = "0.1.0"


__all__ = [
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "DeviceFaultError",
    "DeviceMemoryError",
    "EPConfig",
    "Dispatched",
    "EPError",
    "EPRuntimeError",
    "EPTimeoutError",
    "EPTypeError",
    "EPUnsupportedError",
    "EPValueError",
    "Handle",
    "HierarchicalDispatched",
    "HierarchicalHandle",
    "KernelConfig",
    "LLCombinePending",
    "LLDispatchPending",
    "LLDispatched",
    "LLHandle",
    "Layout",
    "RankMajorDispatched",
    "RankMajorHandle",
    "combine",
    "combine_hierarchical",
    "combine_rank_major",
    "dequantize_fp8",
    "dispatch",
    "dispatch_hierarchical",
    "dispatch_rank_major",
    "ep_errors",
    "explain",
    "get_dispatch_layout",
    "grouped_matmul",
    "ll_combine",
    "ll_combine_recv",
    "ll_combine_send",
    "ll_dispatch",
    "ll_dispatch_recv",
    "ll_dispatch_send",
    "run_checked",
]


# submodules are attributes after `import jax_ep` (jax_ep.moe.MoE, jax_ep.runtime.rank_masks, ...),
# imported on first use: importing them all here would load Flax and Orbax for every op user


def __getattr__(name: str):
    # jax_ep.DeviceMemoryError is the CUDA extension's class when it is built (jax_ep.runtime loads
    # it; not at import: loading the extension is left to the programs that use it).
    if name == "DeviceMemoryError":
        from jax_ep.runtime import DeviceMemoryError

        return DeviceMemoryError
    import importlib
    import importlib.util

    if not name.startswith("_") and importlib.util.find_spec(f"jax_ep.{name}") is not None:
        return importlib.import_module(f"jax_ep.{name}")
    raise AttributeError(f"module 'jax_ep' has no attribute {name!r}")
