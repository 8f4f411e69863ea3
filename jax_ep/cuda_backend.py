"""CUDA implementations of the ops, as ``jax.ffi.ffi_call``s of the ``jax_ep._C`` handlers.

Per-rank views, like the reference path: call them inside ``shard_map`` over the EP axis (``layout``
is rank-local and also works outside it). ``jax_ep.ops.backend_for`` picks a function from this
module by op name, so only ops with a kernel are defined here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep import runtime
from jax_ep.types import Layout

LAYOUT_MAX_TOPK = 64  # the layout kernel keeps a token's ids in registers (cuda/layout.cu)


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
    return Layout(*_vary_like(outputs, topk_idx))


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
    return _vary_over((received, epochs), (axis_name,))


def _varying_axes(x) -> tuple:
    """The manual mesh axes x varies over inside shard_map (empty outside, or without check_vma)."""
    aval = jax.typeof(x)
    for get in (lambda a: a.vma, lambda a: a.mat.varying):  # attribute name differs across jax versions
        try:
            return tuple(sorted(get(aval)))
        except AttributeError:
            continue
    return ()


def _vary_over(outputs, axes: tuple):
    """ffi_call results are typed as invariant across manual axes; per-rank results vary."""
    if not axes:
        return outputs
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(outputs, axes, to="varying")
    return jax.lax.pvary(outputs, axes)


def _vary_like(outputs, like):
    """Types rank-local outputs as varying over the same mesh axes as the input they derive from
    (what the pure-JAX reference gets automatically)."""
    return _vary_over(outputs, _varying_axes(like))


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


def _varying_axes(x) -> tuple:
    """The manual mesh axes x varies over inside shard_map (empty outside, or without check_vma)."""
    aval = jax.typeof(x)
    for get in (lambda a: a.vma, lambda a: a.mat.varying):  # attribute name differs across jax versions
        try:
            return tuple(sorted(get(aval)))
        except AttributeError:
            continue
    return ()


def _vary_over(outputs, axes: tuple):
    """ffi_call results are typed as invariant across manual axes; per-rank results vary."""
    if not axes:
        return outputs
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(outputs, axes, to="varying")
    return jax.lax.pvary(outputs, axes)


def _vary_like(outputs, like):
    """Types rank-local outputs as varying over the same mesh axes as the input they derive from
    (what the pure-JAX reference gets automatically)."""
    return _vary_over(outputs, _varying_axes(like))


def _local_group_ordinals(mesh: jax.sharding.Mesh, axis_name: str) -> np.ndarray:
    """The CUDA ordinals of the mesh's EP groups that live in this process, flattened row-major as
    [groups, R] (rank = position along ``axis_name``). Each device finds its row and column in it,
    so the attribute is static and valid for every device of the program."""
    if axis_name not in mesh.axis_names:
        raise ValueError(f"axis {axis_name!r} is not an axis of the mesh {mesh.axis_names}")
    devices = np.asarray(mesh.devices)
    axis = mesh.axis_names.index(axis_name)
    groups = np.moveaxis(devices, axis, -1).reshape(-1, devices.shape[axis])
    me = jax.process_index()
    rows = []
    for group in groups:
        local = [d.process_index == me for d in group]
        if all(local):
            rows.append([d.local_hardware_id for d in group])
        elif any(local):
            raise NotImplementedError(
                f"jax_ep: the EP group {[d.id for d in group]} spans processes; the NVLink path "
                "of this build needs every rank of a group in one process (process model 1)")
    if any(d.platform != "gpu" for d in devices.flat):
        raise ValueError("jax_ep CUDA ops need a mesh of GPU devices")
    return np.asarray(rows, dtype=np.int64).reshape(-1)
