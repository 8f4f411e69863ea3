"""Grouped matrix multiplication for the expert FFN: ``jax_ep.grouped_matmul(x, w, group_sizes)``.

Semantics are ``jax.lax.ragged_dot``'s: ``x [M, K]`` holds consecutive groups of rows
(``group_sizes [G]``), group g is multiplied by ``w[g]`` (``w [G, K, N]``), and rows past
``sum(group_sizes)`` (a dispatch buffer's capacity padding) come out as zeros. Differentiable in x and w
(``custom_vjp``: dx is the same grouped GEMM against ``w[g].T``, dw the transposed grouped GEMM).

Which implementation runs (decided at trace time, per pass: forward, dx, dw):
  * ``"mosaic_gpu"``: Hopper kernels (``jax_ep.gemm_mgpu``, derived from JAX's Mosaic GPU
    ragged_dot kernels) with a block configuration per shape from ``gemm_configs.json``
    (written by ``python tools/tune_gemm.py`` on a GPU).
  * ``"ragged_dot"``: ``jax.lax.ragged_dot`` (any platform; far from the tensor cores on GPUs in
    jax 0.11, and it materialises [M, G, K] at large G).
``backend="auto"`` takes the kernel wherever it can run and ``lax.ragged_dot`` elsewhere;
``explain(x, w, group_sizes)`` says which and why (also logged at DEBUG on logger ``jax_ep``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import pathlib

import jax
import jax.numpy as jnp
from jax import lax

from jax_ep.config import check_option
from jax_ep.errors import EPValueError
from jax_ep.validation import float0_like
from jax_ep.vma import vary_as, vary_jointly

BACKENDS = ("auto", "mosaic_gpu", "ragged_dot")
_KERNEL_DTYPES = (jnp.bfloat16, jnp.float16)
_CONFIG_FILE = pathlib.Path(__file__).with_name("gemm_configs.json")
_log = logging.getLogger("jax_ep")

# Groups whose sizes are multiples of this start on a kernel tile boundary: no tile is computed once
# per group it touches (a ragged boundary costs a whole extra tile of matrix work).
ROW_ALIGNMENT = 64

# The kernels' tile order (BlockConfig.grid_minor; the FP8 kernel form's 4th field) that visits each
# group's row tiles together, one column tile at a time (gemm_mgpu._row_tiles).
GROUP_MAJOR = 2

# The three passes: forward out = x @ w[g]; dx = dy @ w[g].T; dw[g] = x[g rows].T @ dy[g rows].
PASSES = ("forward", "dx", "dw")


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one pass runs: ``impl`` "mosaic_gpu" with ``config`` on ``num_sms`` SMs (None: all), or
    "ragged_dot" with ``reason``."""

    impl: str
    config: object = None
    reason: str = ""
    num_sms: int | None = None


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, backend: str = "auto",
                   zero_tail: bool = True, num_sms: int | None = None,
                   dw_num_sms: int | None = None) -> jax.Array:
    """``lax.ragged_dot(x, w, group_sizes)``, fast on Hopper GPUs.

    Args:
      x: [M, K] rows, grouped consecutively (bfloat16/float16 for the GPU kernel).
      w: [G, K, N] one matrix per group (same dtype as x for the GPU kernels).
      group_sizes: [G] int32 rows per group; rows past their sum come out as zeros.
      backend: "auto", "mosaic_gpu" (raise if the kernel cannot run here) or "ragged_dot".
      zero_tail: False leaves the rows past sum(group_sizes) of the output, and of the gradient of x,
        unspecified (the kernel does not write them; ``lax.ragged_dot`` still gives zeros): for a caller
        that never reads them, e.g. rows from ``jax_ep.dispatch``, whose rows there are unspecified
        too. At the MoE layer's default (worst-case) capacity most of the buffer lies past the groups
        at EP >= 4, and writing its zeros costs a pass over it.
      num_sms: the SMs the kernels of every pass take: None (default) every SM, or a positive int (all
        of them on a GPU with fewer). Fewer leave SMs to kernels on other streams: the EP exchanges on
        ``KernelConfig.async_stream`` run beside the GEMMs only on SMs the GEMMs leave free.
      dw_num_sms: the SMs of the weight-gradient pass's kernels; None (default): ``num_sms``. E.g. fewer
        for the pass that runs beside an exchange (``jax_ep.overlap.chain``).
    Returns: [M, N] in x's dtype where x and w share it, else in the dtype they promote to (as
    ``lax.ragged_dot``); float32 accumulation.
    """
    _check_args(x, w, group_sizes, backend)
    check_option("grouped_matmul:", "zero_tail", zero_tail, "bool")
    num_sms = check_option("grouped_matmul:", "num_sms", num_sms, "int?")
    dw_num_sms = check_option("grouped_matmul:", "dw_num_sms", dw_num_sms, "int?")
    plans = _plans(x.shape, w.shape, x.dtype, w.dtype, backend, num_sms, dw_num_sms)
    return _grouped_matmul(*vary_jointly(x, w, int32_sizes(group_sizes)), plans, zero_tail)


def explain(x, w, group_sizes=None, *, backend: str = "auto") -> dict[str, Plan]:
    """Which implementation each pass (forward, dx, dw) would take for these shapes/dtypes, and why.
    x and w may be arrays or jax.ShapeDtypeStruct."""
    _check_args(x, w, group_sizes, backend)
    return dict(zip(PASSES, _plans(tuple(x.shape), tuple(w.shape), x.dtype, w.dtype, backend), strict=True))


def preferred_alignment(x, w, *, backend: str = "auto") -> int:
    """The group-size alignment to ask of dispatch (``EPConfig.expert_alignment``) for rows feeding
    this GEMM: ROW_ALIGNMENT where the forward pass runs the Mosaic GPU kernel, else 1 (no padding).
    x and w may be arrays or jax.ShapeDtypeStruct."""
    _check_args(x, w, None, backend)
    # x's rows do not decide: the alignment asked for makes them a multiple of it (the MoE layer asks
    # with a stand-in of one row)
    forward = _plans((ROW_ALIGNMENT, x.shape[1]), tuple(w.shape), x.dtype, w.dtype, backend)[0]
    return ROW_ALIGNMENT if forward.impl == "mosaic_gpu" else 1


def check_backend(backend, op: str = "grouped_matmul", name: str = "backend") -> None:
    """backend is one of BACKENDS (every entry point: an unknown name would plan as "auto")."""
    if backend not in BACKENDS:
        raise EPValueError(f"{op}: {name} must be one of {BACKENDS}, got {backend!r}")


def check_group_sizes(group_sizes, num_groups: int, op: str = "grouped_matmul") -> jax.Array:
    """group_sizes: [G] integer, one per group of the weights; returns them as every backend reads them
    (``int32_sizes``)."""
    if getattr(group_sizes, "shape", None) != (num_groups,):
        raise EPValueError(f"{op}: group_sizes must have shape ({num_groups},) (one per group "
                           f"of w), got {getattr(group_sizes, 'shape', None)}")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise EPValueError(f"{op}: group_sizes must be integer, got dtype {group_sizes.dtype}")
    return int32_sizes(group_sizes)


def int32_sizes(group_sizes: jax.Array) -> jax.Array:
    """group_sizes as every backend reads them: int32 (lax.ragged_dot sums the sizes in their own dtype,
    so int8 sizes of 100 wrapped around; the kernels cast), negative sizes as 0 (as the kernels' tile
    schedule takes them; lax.ragged_dot's running sum went back rows)."""
    return jnp.maximum(group_sizes.astype(jnp.int32), 0)


def _check_args(x, w, group_sizes, backend: str) -> None:
    check_backend(backend)
    if getattr(x, "ndim", None) != 2:
        raise EPValueError(f"grouped_matmul: x must be 2-D [M, K], got shape {getattr(x, 'shape', None)}")
    if getattr(w, "ndim", None) != 3:
        raise EPValueError(f"grouped_matmul: w must be 3-D [G, K, N], got shape {getattr(w, 'shape', None)}")
    if w.shape[1] != x.shape[1]:
        raise EPValueError(f"grouped_matmul: x has K={x.shape[1]} but w has K={w.shape[1]} "
                           f"(x {x.shape}, w {w.shape})")
    if group_sizes is not None:
        check_group_sizes(group_sizes, w.shape[0])


# ---- choosing an implementation -------------------------------------------------------------------
def hopper_reason() -> str:
    """'' when the default device is a Hopper GPU (compute capability 9.0), where jax_ep's GPU kernels
    (the grouped GEMMs, the SwiGLU kernels) were tuned and measured, else why not."""
    if jax.default_backend() != "gpu":
        return f"the default platform is {jax.default_backend()!r}, not a GPU"
    device = jax.devices()[0]
    capability = getattr(device, "compute_capability", None)
    if capability != "9.0":
        return f"{device.device_kind} (compute capability {capability}) is not a Hopper GPU (9.0)"
    return ""


def _kernel_platform() -> str:
    """'' when the Mosaic GPU kernels can run on the default device, else why not."""
    why = hopper_reason()
    if why:
        return why
    try:
        from jax.experimental.pallas import mosaic_gpu  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the jax build
        return f"jax.experimental.pallas.mosaic_gpu is unavailable: {e}"
    return ""


def _plans(x_shape, w_shape, x_dtype, w_dtype, backend: str, num_sms: int | None = None,
           dw_num_sms: int | None = None) -> tuple[Plan, ...]:
    if backend == "ragged_dot":
        return tuple(Plan("ragged_dot", reason="backend='ragged_dot'") for _ in PASSES)
    why = _kernel_platform()
    if not why and x_dtype != w_dtype:
        why = f"x ({x_dtype}) and w ({w_dtype}) differ in dtype"
    if not why and jnp.dtype(x_dtype) not in map(jnp.dtype, _KERNEL_DTYPES):
        why = f"dtype {x_dtype} is not bfloat16/float16"
    m, k = x_shape
    g, _, n = w_shape
    plans = []
    for name in PASSES:
        reason = why or _shape_reason(name, m, k, n)
        if reason:
            if backend == "mosaic_gpu":
                raise EPValueError(f"grouped_matmul: backend='mosaic_gpu' cannot run the {name} pass of "
                                   f"x {tuple(x_shape)} @ w {tuple(w_shape)}: {reason}")
            _log.debug("grouped_matmul %s pass of x %s @ w %s: lax.ragged_dot (%s)", name, x_shape,
                       w_shape, reason)
            plans.append(Plan("ragged_dot", reason=reason))
        else:
            sms = dw_num_sms if name == "dw" and dw_num_sms is not None else num_sms
            plans.append(Plan("mosaic_gpu", config=block_config(name, m, k, n, g), num_sms=sms))
    return tuple(plans)


def rows_reason(m: int, fp8: bool = False) -> str:
    """Why the Hopper kernels cannot take M rows ('' if they can). The rows' TMA tiles are 8 rows tall
    (gemm_mgpu.ROW_ALIGN): above 8 rows, M must be a multiple of 8 (Mosaic refused to build the kernel
    otherwise, e.g. for the layer's rows at a capacity of 100); the FP8 kernels read the row scales
    M-minor, in 16-byte strides, so M must be a multiple of 4 there too; M=0 raised a math domain
    error."""
    from jax_ep.gemm_mgpu import ROW_ALIGN

    if m == 0:
        return "there are no rows (M=0)"
    if m > ROW_ALIGN and m % ROW_ALIGN:
        return f"M={m} rows is not a multiple of {ROW_ALIGN} (the kernels' row tiling)"
    if fp8 and m % 4:
        return f"M={m} rows is not a multiple of 4 (the FP8 kernels' row scales, 16-byte strides)"
    return ""


def _shape_reason(name: str, m: int, k: int, n: int) -> str:
    """Why the kernel cannot take this pass's shape ('' if it can). The kernels step K by 64 and tile
    the output by multiples of 64."""
    # forward: [M, K] @ [K, N]; dx: [M, N] @ [N, K]; dw: [M, K].T @ [M, N] -> [K, N]
    if why := rows_reason(m):
        return why
    if name == "dw":
        return "" if k % 64 == 0 and n % 64 == 0 else (
            f"K={k} and N={n} must be multiples of 64 for the weight-gradient kernel")
    inner, outer = (k, n) if name == "forward" else (n, k)
    if inner % 64:
        return f"the contracted dimension {inner} is not a multiple of 64"
    if outer % 64:
        return f"the output width {outer} is not a multiple of 64"
    return ""


# ---- block configurations -------------------------------------------------------------------------
@functools.cache
def _tuned() -> dict:
    if not _CONFIG_FILE.exists():
        return {}
    entries = json.loads(_CONFIG_FILE.read_text())["configs"]
    return {(e["pass"], e["m"], e["k"], e["n"], e["g"]): tuple(e["config"]) for e in entries}


def tuned_entry(name: str, m: int, k: int, n: int, g: int) -> tuple | None:
    """The configuration tools/tune_gemm.py measured fastest for pass `name` of a [G, K, N] weight: the
    gemm_configs.json entry of the same (k, n) with the nearest (m, g), or None. Passes "forward", "dx",
    "dw" hold BlockConfig fields; "forward_fp8", "dx_fp8", "dw_fp8" the FP8 kernels' forms (gemm_fp8)."""
    tuned = [(key, cfg) for key, cfg in _tuned().items() if key[0] == name and key[2:4] == (k, n)]
    if not tuned:
        return None
    return min(tuned, key=lambda kv: (abs(kv[0][1] - m) / max(m, 1) + abs(kv[0][4] - g) / max(g, 1)))[1]


def block_config(name: str, m: int, k: int, n: int, g: int):
    """The block configuration of one pass: the tuned entry (tuned_entry), else a default that fits
    every shape the kernel takes."""
    from jax_ep.gemm_mgpu import BlockConfig

    cfg = tuned_entry(name, m, k, n, g)
    if cfg is not None:
        return BlockConfig(*cfg)
    width = k if name == "dx" else n  # the output width of the pass
    block_n = 256 if width % 256 == 0 else 128 if width % 128 == 0 else 64
    # strips of 4 row tiles: tiles that run together share a weight panel (what won every tuned shape)
    return BlockConfig(64, block_n, 64, 4, grid_minor=0, grid_tile_width=4)


# ---- the op ---------------------------------------------------------------------------------------
def _forward(x, w, group_sizes, plan: Plan, transpose_rhs: bool = False, zero_tail: bool = True):
    if plan.impl == "ragged_dot":
        return lax.ragged_dot(x, jnp.swapaxes(w, 1, 2) if transpose_rhs else w, group_sizes)
    from jax_ep import gemm_mgpu as mgpu

    schedule, num_tiles = mgpu.config_schedule(group_sizes, x.shape[0], plan.config, zero_tail)
    out = mgpu.ragged_dot(x, w, schedule, num_tiles, config=plan.config, transpose_rhs=transpose_rhs,
                          num_sms=plan.num_sms)
    return vary_as(out, x, w)  # a kernel's result is typed invariant inside shard_map; it is per rank


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _grouped_matmul(x, w, group_sizes, plans, zero_tail):
    return _forward(x, w, group_sizes, plans[0], zero_tail=zero_tail)


def _grouped_matmul_fwd(x, w, group_sizes, plans, zero_tail):
    return _forward(x, w, group_sizes, plans[0], zero_tail=zero_tail), (x, w, group_sizes)


def _grouped_matmul_bwd(plans, zero_tail, residuals, dy):
    x, w, group_sizes = residuals
    # the output's dtype (lax.ragged_dot's: x's and w's promoted), so a float32 w's gradient is not rounded
    # through x's bfloat16
    dy = dy.astype(jnp.result_type(x.dtype, w.dtype))
    dx = _forward(dy, w, group_sizes, plans[1], transpose_rhs=True, zero_tail=zero_tail)
    dw = _weight_gradient(x, dy, group_sizes, plans[2])
    return dx.astype(x.dtype), dw.astype(w.dtype), float0_like(group_sizes)


def _weight_gradient(x, dy, group_sizes, plan: Plan):
    if plan.impl == "ragged_dot":
        return lax.ragged_dot_general(
            x, dy, group_sizes,
            lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((0,), (0,)), ((), ())),
                                          lhs_ragged_dimensions=[0], rhs_group_dimensions=[]))
    from jax_ep import gemm_mgpu as mgpu

    return vary_as(mgpu.transposed_ragged_dot(x, dy, group_sizes, config=plan.config, num_sms=plan.num_sms),
                   x, dy)


def weight_gradient(x: jax.Array, dy: jax.Array, group_sizes: jax.Array, *, backend: str = "auto",
                    num_sms: int | None = None) -> jax.Array:
    """``dw[g] = x[rows of g].T @ dy[rows of g]`` ([G, K, N] in x's dtype, zeros for empty groups, rows
    past the groups never read into a sum): grouped_matmul's weight gradient on its own (the FP8 GEMM's
    backward uses it, with its caller's ``num_sms``)."""
    check_backend(backend, "weight_gradient")
    num_sms = check_option("weight_gradient:", "num_sms", num_sms, "int?")
    if getattr(x, "ndim", None) != 2 or getattr(dy, "ndim", None) != 2 or x.shape[0] != dy.shape[0]:
        raise EPValueError(f"weight_gradient: x [M, K] and dy [M, N] must be 2-D with the same rows, got x "
                           f"{getattr(x, 'shape', None)}, dy {getattr(dy, 'shape', None)}")
    g = getattr(group_sizes, "shape", (None,))[0]
    group_sizes = check_group_sizes(group_sizes, g, "weight_gradient")
    w_shape = (g, x.shape[1], dy.shape[1])
    plan = _plans(x.shape, w_shape, x.dtype, dy.dtype, backend, num_sms)[2]
    return _weight_gradient(*vary_jointly(x, dy, group_sizes), plan).astype(x.dtype)


_grouped_matmul.defvjp(_grouped_matmul_fwd, _grouped_matmul_bwd)
