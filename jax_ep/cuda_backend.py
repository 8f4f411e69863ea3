"""CUDA implementations of the ops, as ``jax.ffi.ffi_call``s of the ``jax_ep._C`` handlers.

Per-rank views, like the reference path: call them inside ``shard_map`` over the EP axis (``layout``
is rank-local and also works outside it). ``jax_ep.ops.backend_for`` picks a function from this
module by op name, so only ops with a kernel are defined here: ``layout``, ``dispatch``,
``combine``, ``broadcast`` and ``slot_values`` (same signatures and results as
``jax_ep.reference``).

The communicating ops need no concrete mesh: they pass ``lax.axis_index(cfg.axis_name)`` (the rank)
and the EP group (linear index over the other manual mesh axes) as int32 device scalars, and the
kernels find the group's GPUs themselves (group discovery, docs/native.md).
"""

from __future__ import annotations

import os
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_ep import runtime
from jax_ep.config import EPConfig
from jax_ep.types import Dispatched, Handle, Layout
from jax_ep.vma import vary_like, vary_over, varying_axes

# Ops whose kernel beat the reference path on the benchmark (docs/benchmarks.md): only these are taken
# by backend="auto". dispatch beat the dense lax.all_to_all reference at 4096 and 8192 tokens per rank
# but not at 128-2048 (2x H200), combine is slower on 2x H200 and faster on 4x H200: backend="cuda"
# runs them.
FASTER_THAN_REFERENCE = ("layout",)

LAYOUT_MAX_TOPK = 64  # the layout kernel keeps a token's ids in registers (cuda/layout.cu)
# Limits of the EP data kernels (mirrored from cuda/ep_layout.h and cuda/device_state.h).
MAX_TOPK = 32         # a warp holds a token's top-k slots, one per lane
MAX_RANKS = 32        # ranks of one NVLink group
MAX_EXPERTS = 8192    # the notify kernel keeps one count per expert in shared memory
MAX_GROUPS = 64       # EP groups of one mesh (group discovery directory)
DIRECTORY_AXES = 4    # directory slots of distinct EP mesh axes
# Warps per block (of 16) that send / reduce in the data kernels; the others receive / finalise.
# Tuning knobs, read at trace time: JAX_EP_DISPATCH_SEND_WARPS, JAX_EP_COMBINE_SEND_WARPS,
# JAX_EP_BROADCAST_SEND_WARPS.
DEFAULT_SEND_WARPS = {"dispatch": 6, "combine": 8, "broadcast": 6}
_ROW_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def layout(topk_idx: jax.Array, num_experts: int, ep_size: int) -> Layout:
    """DeepEP's get_dispatch_layout on the GPU; same semantics as ``jax_ep.reference.layout``.

    topk_idx: [T, K] int32 (ids < 0 or >= num_experts are unused slots; repeats within a token
    count once). Returns tokens per rank [R], tokens per expert [E], is_token_in_rank [T, R].
    """
    num_experts, ep_size = int(num_experts), int(ep_size)
    if ep_size < 1 or num_experts < 1 or num_experts % ep_size:
        raise ValueError(f"layout: num_experts={num_experts} must be a positive multiple of "
                         f"ep_size={ep_size}")
    if getattr(topk_idx, "ndim", None) != 2 or topk_idx.dtype != jnp.int32:
        raise ValueError("layout: topk_idx must be an int32 array [tokens, topk], got "
                         f"{getattr(topk_idx, 'dtype', None)} {getattr(topk_idx, 'shape', None)}")
    if topk_idx.shape[1] > LAYOUT_MAX_TOPK:
        raise ValueError(f"layout: the CUDA kernel supports topk <= {LAYOUT_MAX_TOPK}, got "
                         f"{topk_idx.shape[1]}; use backend='reference'")
    runtime.register_targets()  # rank-local: needs no communication buffer
    num_tokens = topk_idx.shape[0]
    call = jax.ffi.ffi_call(
        "jax_ep_dispatch_layout",
        (jax.ShapeDtypeStruct((ep_size,), jnp.int32),
         jax.ShapeDtypeStruct((num_experts,), jnp.int32),
         jax.ShapeDtypeStruct((num_tokens, ep_size), jnp.bool_)),
        vmap_method="sequential",
    )
    outputs = call(topk_idx, num_experts=np.int64(num_experts), num_ranks=np.int64(ep_size))
    return Layout(*vary_like(outputs, topk_idx))


def peer_smoke_buffer_bytes(ep_size: int, n: int) -> int:
    """Communication-buffer bytes peer_smoke needs (mirrors peer_smoke_comm_bytes in cuda/)."""
    return 2 * ep_size * n * 4


def peer_smoke(tag: jax.Array, n: int, *, mesh: jax.sharding.Mesh,
               axis_name: str) -> tuple[jax.Array, jax.Array]:
    """Cross-GPU smoke test of the peer tables and the device-side barrier. Call inside
    ``shard_map`` over ``axis_name`` of ``mesh`` (the concrete mesh: the op needs its devices).

    Every rank writes ``pattern(tag, writer=me, reader=peer, i)`` (see
    ``tests/gpu/test_peer_smoke_gpu.py``) for i < n into slot ``me`` of every peer's communication
    buffer, passes a group barrier, and returns what each rank wrote into its own buffer:
    ``received`` [R, n] uint32 (row w from rank w) and ``epochs`` [R] uint32 (barriers passed
    together with each rank, counted on the device).
    """
    group_size = int(mesh.shape[axis_name])
    mesh_ordinals = _local_group_ordinals(mesh, axis_name)
    runtime.ensure_initialized(peer_smoke_buffer_bytes(group_size, int(n)))
    call = jax.ffi.ffi_call(
        "jax_ep_peer_smoke",
        (jax.ShapeDtypeStruct((group_size, int(n)), jnp.uint32),
         jax.ShapeDtypeStruct((group_size,), jnp.uint32)),
        has_side_effect=True,  # it communicates: never dropped, never merged with another call
        vmap_method="sequential",
    )
    received, epochs = call(jnp.asarray(tag, jnp.int32).reshape(()), mesh_ordinals=mesh_ordinals,
                            group_size=np.int64(group_size))
    try:
        jax.lax.axis_size(axis_name)
    except NameError:  # called outside shard_map (e.g. a single-device test): nothing to type
        return received, epochs
    return vary_over((received, epochs), (axis_name,))


def _local_group_ordinals(mesh: jax.sharding.Mesh, axis_name: str) -> np.ndarray:
    """The CUDA ordinals of the mesh's EP groups that live in this process, flattened row-major as
    [groups, R] (rank = position along ``axis_name``). Each device finds its row and column in it,
    so the attribute is static and valid for every device of the program."""
    if axis_name not in mesh.axis_names:
        raise ValueError(f"axis {axis_name!r} is not an axis of the mesh {mesh.axis_names}")
    devices = np.asarray(mesh.devices)
    if any(d.platform != "gpu" for d in devices.flat):
        raise ValueError("jax_ep CUDA ops need a mesh of GPU devices")
    return group_ordinals(devices, mesh.axis_names.index(axis_name), jax.process_index())


def group_ordinals(devices: np.ndarray, axis: int, process_index: int) -> np.ndarray:
    """Rows of local_hardware_id along ``axis`` (one row per EP group) for the groups whose
    devices all belong to ``process_index``, flattened. A group split across processes needs
    process model 2 (NVSHMEM), which this build does not have."""
    groups = np.moveaxis(devices, axis, -1).reshape(-1, devices.shape[axis])
    rows = []
    for group in groups:
        local = [d.process_index == process_index for d in group]
        if all(local):
            rows.append([d.local_hardware_id for d in group])
        elif any(local):
            raise NotImplementedError(
                f"jax_ep: the EP group {[d.id for d in group]} spans processes; the NVLink path "
                "of this build needs every rank of a group in one process (process model 1)")
    return np.asarray(rows, dtype=np.int64).reshape(-1)


# ---- throughput dispatch / combine over NVLink -------------------------------------------------
def _send_warps(op: str) -> int:
    name = f"JAX_EP_{op.upper()}_SEND_WARPS"
    text = os.environ.get(name, "")
    if not text:
        return DEFAULT_SEND_WARPS[op]
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name} must be an integer in [1, 15], got {text!r}") from None
    if not 1 <= value <= 15:
        raise ValueError(f"{name} must be an integer in [1, 15], got {value}")
    return value


def _row_dtype(cfg: EPConfig, x_dtype) -> jnp.dtype:
    if cfg.dispatch_dtype == "float8_e4m3fn":
        return jnp.dtype(jnp.float8_e4m3fn)
    if cfg.dispatch_dtype == "bfloat16":
        return jnp.dtype(jnp.bfloat16)
    return jnp.dtype(x_dtype)


def _layout_bytes(ep_size: int, tokens: int, topk: int, experts: int, data_row_bytes: int,
                  scale_row_bytes: int) -> int:
    native = runtime.extension()
    if native is None:
        raise RuntimeError(f"jax_ep: the CUDA extension is not built ({runtime.extension_error()})")
    return int(native.comm_bytes(ep_size, tokens, topk, experts, data_row_bytes, scale_row_bytes))


def comm_bytes(cfg: EPConfig, ep_size: int, dtype=jnp.bfloat16) -> int:
    """Communication-buffer bytes (per GPU) the CUDA ops of ``cfg`` need on an EP group of
    ``ep_size``, for tokens / expert outputs / gradients of ``dtype`` (bfloat16: the common case;
    float32 needs more). Pass it to ``jax_ep.runtime.ensure_initialized`` to size the buffers once
    up front; every op also sizes them at trace time (growing synchronises the GPUs)."""
    itemsize = jnp.dtype(dtype).itemsize
    wire = _row_dtype(cfg, dtype).itemsize
    scales = 4 * cfg.num_scale_blocks if cfg.dispatch_dtype == "float8_e4m3fn" else 0
    rows = cfg.hidden * max(wire, itemsize)  # dispatch rows, combine partials, broadcast rows
    return _layout_bytes(ep_size, cfg.max_tokens_per_rank, cfg.num_topk, cfg.num_experts, rows,
                         scales)


def _ensure_buffers(cfg: EPConfig, ep_size: int, needed: int) -> None:
    runtime.ensure_initialized(max(int(needed), comm_bytes(cfg, ep_size)))


def _group_of(axis_name: str) -> tuple[jax.Array, jax.Array, int]:
    """(rank, group, axis_slot): this device's index along the EP axis and its EP group (linear
    index over the other manual mesh axes), as int32 scalars for the kernels' group discovery, and
    the directory slot of the EP axis name."""
    mesh = jax.sharding.get_abstract_mesh()
    names = tuple(getattr(mesh, "axis_names", ()) or ())
    manual = set(getattr(mesh, "manual_axes", ()) or ())
    if names and axis_name in names and manual and axis_name not in manual:
        raise ValueError(f"jax_ep: the EP axis {axis_name!r} must be a manual axis of the enclosing "
                         "shard_map")
    group = jnp.int32(0)
    num_groups = 1
    for name in names:
        size = int(mesh.shape[name])
        if name == axis_name or size == 1:
            continue
        if name not in manual:
            raise NotImplementedError(
                f"jax_ep (backend='cuda'): mesh axis {name!r} (size {size}) is not manual in this "
                "shard_map, so every device along it would join the same EP group. Run the EP ops "
                "in a shard_map over all mesh axes, or use backend='reference'.")
        group = group * size + lax.axis_index(name).astype(jnp.int32)
        num_groups *= size
    if num_groups > MAX_GROUPS:
        raise NotImplementedError(f"jax_ep (backend='cuda'): {num_groups} EP groups in one mesh; "
                                  f"the CUDA backend supports up to {MAX_GROUPS}")
    rank = lax.axis_index(axis_name).astype(jnp.int32)
    return rank, group, zlib.crc32(axis_name.encode()) % DIRECTORY_AXES


def _check_sizes(op: str, cfg: EPConfig, ep_size: int, topk: int, hidden: int) -> None:
    hint = "; use backend='reference' (or 'auto' on a machine without these limits)"
    if topk > MAX_TOPK:
        raise ValueError(f"jax_ep.{op} (backend='cuda'): num_topk={topk} exceeds {MAX_TOPK}{hint}")
    if ep_size > MAX_RANKS:
        raise ValueError(f"jax_ep.{op} (backend='cuda'): EP size {ep_size} exceeds {MAX_RANKS}{hint}")
    if cfg.num_experts > MAX_EXPERTS:
        raise ValueError(f"jax_ep.{op} (backend='cuda'): num_experts={cfg.num_experts} exceeds "
                         f"{MAX_EXPERTS}{hint}")
    if hidden % 8:
        raise ValueError(f"jax_ep.{op} (backend='cuda'): hidden={hidden} must be a multiple of 8 "
                         f"(16-byte vectors){hint}")


def _check_dtype(op: str, what: str, dtype) -> None:
    if jnp.dtype(dtype) not in _ROW_DTYPES:
        raise ValueError(f"jax_ep.{op} (backend='cuda'): {what} must be bfloat16 or float32, got "
                         f"dtype {jnp.dtype(dtype)}; use backend='reference' for it")


def _vary_all(outputs, axis_name: str, *inputs):
    """ffi_call results are typed invariant; they vary over the EP axis and every axis an input
    varies over."""
    axes = {axis_name}
    for x in inputs:
        axes.update(varying_axes(x))
    return vary_over(outputs, tuple(sorted(axes)))


def use_tma() -> bool:
    """Whether dispatch and broadcast copy rows with bulk (TMA) copies through shared memory
    (default) or with 16-byte register copies: JAX_EP_TMA=0/1, read at trace time."""
    text = os.environ.get("JAX_EP_TMA", "1")
    if text not in ("0", "1"):
        raise ValueError(f"JAX_EP_TMA must be 0 or 1, got {text!r}")
    return text == "1"


def _attrs(cfg: EPConfig, ep_size: int, axis_slot: int, op: str | None = None) -> dict:
    attrs = {"num_ranks": np.int64(ep_size), "axis_slot": np.int64(axis_slot)}
    if op is not None:
        attrs["num_sms"] = np.int64(cfg.num_sms)
        attrs["send_warps"] = np.int64(_send_warps(op))
    if op in ("dispatch", "broadcast"):
        attrs["tma"] = np.int64(use_tma())
    return attrs


def dispatch(x: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array, cfg: EPConfig) -> Dispatched:
    """``jax_ep.reference.dispatch`` on NVLink kernels (bit-exact outputs). Per-rank view."""
    axis = cfg.axis_name
    ep_size = lax.axis_size(axis)
    tokens, hidden = x.shape
    topk = topk_idx.shape[1]
    _check_sizes("dispatch", cfg, ep_size, topk, hidden)
    _check_dtype("dispatch", "x", x.dtype)
    local = cfg.num_local_experts(ep_size)
    capacity = cfg.resolved_capacity(ep_size)
    row_dtype = _row_dtype(cfg, x.dtype)
    fp8 = cfg.dispatch_dtype == "float8_e4m3fn"
    num_scales = cfg.num_scale_blocks if fp8 else 0
    rank, group, axis_slot = _group_of(axis)
    _ensure_buffers(cfg, ep_size, _layout_bytes(ep_size, tokens, topk, cfg.num_experts,
                                                hidden * row_dtype.itemsize, 4 * num_scales))
    i32, f32 = jnp.int32, jnp.float32
    shapes = (
        jax.ShapeDtypeStruct((capacity, hidden), row_dtype),
        jax.ShapeDtypeStruct((capacity, num_scales) if fp8 else (0,), f32),
        jax.ShapeDtypeStruct((local,), i32),
        jax.ShapeDtypeStruct((local,), i32),
        jax.ShapeDtypeStruct((capacity,), f32),
        jax.ShapeDtypeStruct((), i32),
        jax.ShapeDtypeStruct((capacity,), i32),
        jax.ShapeDtypeStruct((ep_size * tokens, topk), i32),
        jax.ShapeDtypeStruct((tokens, ep_size), jnp.bool_),
    )
    call = jax.ffi.ffi_call("jax_ep_dispatch", shapes, has_side_effect=True,
                            vmap_method="sequential")
    outputs = call(x, topk_idx, topk_weights, rank, group,
                   num_experts=np.int64(cfg.num_experts), capacity=np.int64(capacity),
                   alignment=np.int64(cfg.expert_alignment),
                   **_attrs(cfg, ep_size, axis_slot, "dispatch"))
    rows, scales, group_sizes, counts, row_weights, dropped, src_index, token_rows, in_rank = (
        _vary_all(outputs, axis, x, topk_idx, topk_weights))
    handle = Handle(src_index, token_rows, in_rank, row_weights)
    return Dispatched(rows, scales if fp8 else None, group_sizes, counts, row_weights, dropped,
                      handle)


def combine(y: jax.Array, row_weights: jax.Array | None, handle: Handle, cfg: EPConfig) -> jax.Array:
    """``jax_ep.reference.combine`` on NVLink kernels (same float32 summation order). Per-rank."""
    axis = cfg.axis_name
    ep_size = lax.axis_size(axis)
    num_slots, topk = handle.token_rows.shape
    tokens = num_slots // ep_size
    hidden = y.shape[1]
    _check_sizes("combine", cfg, ep_size, topk, hidden)
    _check_dtype("combine", "y", y.dtype)
    rank, group, axis_slot = _group_of(axis)
    _ensure_buffers(cfg, ep_size, _layout_bytes(ep_size, tokens, topk, 0,
                                                hidden * jnp.dtype(y.dtype).itemsize, 0))
    weighted = row_weights is not None
    weights = row_weights.astype(jnp.float32) if weighted else jnp.zeros((0,), jnp.float32)
    call = jax.ffi.ffi_call("jax_ep_combine", jax.ShapeDtypeStruct((tokens, hidden), y.dtype),
                            has_side_effect=True, vmap_method="sequential")
    out = call(y, weights, handle.token_rows, handle.is_token_in_rank, rank, group,
               weighted=np.int64(weighted), **_attrs(cfg, ep_size, axis_slot, "combine"))
    return _vary_all(out, axis, y, handle.token_rows, handle.is_token_in_rank,
                     *([row_weights] if weighted else []))


def broadcast(g: jax.Array, handle: Handle, cfg: EPConfig) -> jax.Array:
    """``jax_ep.reference.broadcast`` (dispatch through a known handle, no weights; rows no token
    landed on are zero) on NVLink kernels. Per-rank view."""
    axis = cfg.axis_name
    ep_size = lax.axis_size(axis)
    tokens, hidden = g.shape
    topk = handle.token_rows.shape[1]
    capacity = handle.src_index.shape[0]
    _check_sizes("broadcast", cfg, ep_size, topk, hidden)
    _check_dtype("broadcast", "the cotangent", g.dtype)
    rank, group, axis_slot = _group_of(axis)
    _ensure_buffers(cfg, ep_size, _layout_bytes(ep_size, tokens, topk, 0,
                                                hidden * jnp.dtype(g.dtype).itemsize, 0))
    call = jax.ffi.ffi_call("jax_ep_broadcast", jax.ShapeDtypeStruct((capacity, hidden), g.dtype),
                            has_side_effect=True, vmap_method="sequential")
    out = call(g, handle.token_rows, handle.is_token_in_rank, handle.src_index, rank, group,
               **_attrs(cfg, ep_size, axis_slot, "broadcast"))
    return _vary_all(out, axis, g, handle.token_rows, handle.src_index)


def slot_values(values: jax.Array, handle: Handle, cfg: EPConfig) -> jax.Array:
    """``jax_ep.reference.slot_values``: each source token's top-k slot gets the value of its
    receive row ([C] float32 -> [T, K]; 0 for unused, duplicate or dropped slots). Per-rank."""
    axis = cfg.axis_name
    ep_size = lax.axis_size(axis)
    num_slots, topk = handle.token_rows.shape
    tokens = num_slots // ep_size
    if topk > MAX_TOPK or ep_size > MAX_RANKS:
        raise ValueError(f"jax_ep.slot_values (backend='cuda'): num_topk={topk} / EP size {ep_size} "
                         f"exceed {MAX_TOPK} / {MAX_RANKS}; use backend='reference'")
    rank, group, axis_slot = _group_of(axis)
    _ensure_buffers(cfg, ep_size, _layout_bytes(ep_size, tokens, topk, 0, 0, 0))
    call = jax.ffi.ffi_call("jax_ep_slot_values", jax.ShapeDtypeStruct((tokens, topk), jnp.float32),
                            has_side_effect=True, vmap_method="sequential")
    out = call(values.astype(jnp.float32), handle.token_rows, rank, group,
               **_attrs(cfg, ep_size, axis_slot))
    return _vary_all(out, axis, values, handle.token_rows)

