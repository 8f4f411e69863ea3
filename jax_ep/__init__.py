"""jax_ep: expert-parallel dispatch/combine for Mixture-of-Experts models in JAX."""

from jax_ep.config import EPConfig, KernelConfig
from jax_ep.gemm import grouped_matmul
from jax_ep.ops import combine, dispatch, get_dispatch_layout, ll_combine, ll_dispatch
from jax_ep.reference import dequantize_fp8
from jax_ep.types import Dispatched, Handle, Layout, LLDispatched, LLHandle
from jax_ep.validation import EPValueError, ep_errors, run_checked

__version__ = "0.1.0"

__all__ = [
    "EPConfig",
    "Dispatched",
    "EPValueError",
    "Handle",
    "KernelConfig",
    "LLDispatched",
    "LLHandle",
    "Layout",
    "combine",
    "dequantize_fp8",
    "dispatch",
    "ep_errors",
    "get_dispatch_layout",
    "grouped_matmul",
    "ll_combine",
    "ll_dispatch",
    "run_checked",
]
