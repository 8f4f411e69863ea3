"""The CUDA backend: each op as a ``jax.ffi.ffi_call`` of its ``jax_ep._C`` handler.

Same functions, signatures and results as ``jax_ep.reference`` (``jax_ep.backends.Functions``); output types
come from ``jax_ep.types``. Per-rank views: call them inside ``shard_map`` over the EP axis.

The communicating ops need no concrete mesh: they pass ``lax.axis_index(cfg.axis_name)`` (the rank)
and the EP group (linear index over the other manual mesh axes) as int32 device scalars, and the
kernels find the group's GPUs themselves (group discovery, docs/native.md). Their static attributes
(one ``EPAttrs`` struct in the handlers) size the communication buffer when XLA instantiates the
executable; nothing is allocated at trace time.
"""

from __future__ import annotations

import functools
import os
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import compute_on as _compute_on

from jax_ep import auto_table, ordering, overlap, routing, runtime, types
from jax_ep.config import PULL_KNOBS, EPConfig, KernelConfig
from jax_ep.errors import EPUnsupportedError, EPValueError
from jax_ep.vma import manual_axes, vary_also, vary_like, vary_over, varying_axes

_ROW_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
_DATA_OPS = ("dispatch", "combine", "broadcast", "slot_values")
# the rank-major ops run the kernels (and take the knobs) of these expert-major ones
_RANK_MAJOR_OPS = {"dispatch_rank_major": "dispatch", "combine_rank_major": "combine",
                   "broadcast_rank_major": "broadcast"}
# combine's fused backward is the broadcast kernel with a computing receiver: broadcast's knobs
_KERNEL_OF = {**_RANK_MAJOR_OPS, "combine_bwd": "broadcast"}
_LL_OPS = ("ll_dispatch", "ll_combine", "ll_dispatch_send", "ll_dispatch_recv", "ll_combine_send",
           "ll_combine_recv")


def unsupported(op: str, cfg: EPConfig, ep_size: int, dtype=None) -> str | None:
    """Why the CUDA kernel of ``op`` cannot run ``cfg`` on an EP group of ``ep_size`` with rows of
    ``dtype`` (None when it can). The limits are the extension's own (``jax_ep._C.LIMITS``)."""
    limits = runtime.limits()
    if op == "layout":
        if cfg.num_topk > limits["layout_max_topk"]:
            return f"num_topk={cfg.num_topk} exceeds {limits['layout_max_topk']}"
        return None
    pads_rows = op in ("combine_rank_major", "broadcast_rank_major")  # any width (_pad_rows)
    rank_major = op in _RANK_MAJOR_OPS
    op = _KERNEL_OF.get(op, op)
    assert op in _DATA_OPS + _LL_OPS, op
    if cfg.num_topk > limits["max_topk"]:
        return f"num_topk={cfg.num_topk} exceeds {limits['max_topk']}"
    if ep_size > limits["max_ranks"]:
        return f"EP size {ep_size} exceeds {limits['max_ranks']}"
    if op in _LL_OPS:
        return _ll_unsupported(op, cfg, ep_size, dtype, limits)
    if op == "slot_values":
        return None
    if cfg.num_experts > limits["max_experts"]:
        return f"num_experts={cfg.num_experts} exceeds {limits['max_experts']}"
    if cfg.hidden > limits["max_hidden"]:
        return f"hidden={cfg.hidden} exceeds {limits['max_hidden']}"
    # the handle's src_index / token_rows are int32: the R*T source slots and the capacity must fit
    sources = ep_size * cfg.max_tokens_per_rank
    rows = sources if rank_major else cfg.resolved_capacity(ep_size)
    if max(sources, rows) > limits["max_rows"]:
        return (f"{'EP size x max_tokens_per_rank' if sources >= rows else 'the capacity'} = "
                f"{max(sources, rows)} rows exceeds the kernels' {limits['max_rows']} (int32 row indices)")
    if cfg.hidden % limits["row_alignment"] and not pads_rows:
        return (f"hidden={cfg.hidden} must be a multiple of {limits['row_alignment']} "
                "(16-byte vectors)")
    warps = cfg.kernel.send_warps(op) if op != "slot_values" else 1
    if warps >= limits["data_warps"]:
        return (f"KernelConfig.{op}_send_warps={warps} must be below the {limits['data_warps']} "
                "warps of a block")
    if dtype is not None and jnp.dtype(dtype) not in _ROW_DTYPES:
        return f"rows must be bfloat16 or float32, got dtype {jnp.dtype(dtype)}"
    return None


def _ll_unsupported(op: str, cfg: EPConfig, ep_size: int, dtype, limits: dict) -> str | None:
    """``unsupported`` for the low-latency ops (what xla_ffi/low_latency.cc's LLInstantiate refuses)."""
    if cfg.hidden % limits["row_alignment"]:
        return f"hidden={cfg.hidden} must be a multiple of {limits['row_alignment']}"
    if cfg.num_experts > limits["max_experts"]:
        return f"num_experts={cfg.num_experts} exceeds {limits['max_experts']}"
    tokens = cfg.max_tokens_per_rank
    if tokens > limits["ll_max_tokens"]:
        return (f"max_tokens_per_rank={tokens} exceeds the low-latency kernels' {limits['ll_max_tokens']}; "
                "use dispatch / combine")
    shared = runtime.extension().ll_shared_bytes(op.startswith("ll_dispatch"), ep_size, tokens,
                                                 cfg.num_experts)
    if shared > limits["ll_max_shared_bytes"]:
        return (f"num_experts={cfg.num_experts} x max_tokens_per_rank={tokens} need a routing table of "
                f"{shared} bytes of shared memory, beyond the low-latency kernels' "
                f"{limits['ll_max_shared_bytes']}; use dispatch / combine")
    if op.startswith("ll_combine") and dtype is not None and jnp.dtype(dtype) != jnp.bfloat16:
        return f"y must be bfloat16, got dtype {jnp.dtype(dtype)}"
    if op.startswith("ll_dispatch") and dtype is not None and jnp.dtype(dtype) not in _ROW_DTYPES:
        return f"x must be bfloat16 or float32, got dtype {jnp.dtype(dtype)}"
    return None


def comm_bytes(cfg: EPConfig, ep_size: int, dtype=jnp.bfloat16) -> int:
    """Communication-buffer bytes (per GPU) the CUDA throughput ops of ``cfg`` (dispatch, combine,
    their rank-major forms and backward) need at most on an EP group of ``ep_size``, for tokens /
    expert outputs / gradients of ``dtype``: what their instantiation reserves (same layout function,
    ``jax_ep._C.comm_bytes``). The low-latency ops need ``ll_comm_bytes``. Pass the largest of a
    program's to ``jax_ep.runtime.ensure_initialized`` to size the buffers once up front."""
    # the extension's layout arithmetic only: register_targets would set up the runtime, a collective
    # in process model 2 (one process asking the size waited 120 s, then put every later set-up out of
    # step; found by a review, 2026-12-06)
    native = runtime.built_extension("jax_ep.cuda_backend.comm_bytes")
    wire = max(cfg.wire_dtype(dtype).itemsize, jnp.dtype(dtype).itemsize)
    scales = 4 * cfg.num_scale_blocks if cfg.dispatch_dtype == "float8_e4m3fn" else 0
    return int(native.comm_bytes(ep_size, cfg.max_tokens_per_rank, cfg.num_topk, cfg.num_experts,
                                 cfg.hidden * wire, scales))


def ll_comm_bytes(cfg: EPConfig, ep_size: int, dtype=jnp.bfloat16) -> int:
    """``comm_bytes`` for the low-latency ops (ll_dispatch, ll_combine and their two-phase forms) with
    tokens of ``dtype``: their instantiation's reservation (``jax_ep._C.ll_comm_bytes``), larger than
    the throughput ops' at the same sizes (two halves of returned rows, T x K each)."""
    native = runtime.built_extension("jax_ep.cuda_backend.ll_comm_bytes")   # as comm_bytes
    sizes = (ep_size, cfg.max_tokens_per_rank, cfg.num_topk, cfg.num_experts)
    wire = cfg.wire_dtype(dtype)
    scales = 4 * cfg.num_scale_blocks if wire == jnp.float8_e4m3fn else 0
    # as the call sites reserve: _ll_dispatch_attrs; ll_combine bfloat16 rows, no scales
    return int(max(native.ll_comm_bytes(*sizes, cfg.hidden, cfg.hidden * wire.itemsize, scales),
                   native.ll_comm_bytes(*sizes, cfg.hidden, cfg.hidden * 2, 0)))


def layout(topk_idx: jax.Array, cfg: EPConfig) -> types.Layout:
    """DeepEP's get_dispatch_layout on the GPU; same semantics as ``jax_ep.reference.layout``."""
    ep_size = lax.axis_size(cfg.axis_name)
    return layout_of(topk_idx, cfg.num_experts, ep_size)


def layout_of(topk_idx: jax.Array, num_experts: int, ep_size: int) -> types.Layout:
    """``layout`` for a given EP size (rank-local: needs no mesh axis)."""
    call = jax.ffi.ffi_call(runtime.target("dispatch_layout"),
                            tuple(types.layout_types(topk_idx.shape[0], num_experts, ep_size)),
                            vmap_method="sequential")
    outputs = call(topk_idx, num_experts=np.int64(num_experts), num_ranks=np.int64(ep_size))
    return types.Layout(*vary_like(outputs, topk_idx))


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
    name = runtime.target("peer_smoke")
    mesh_slots = _local_group_slots(mesh, axis_name)
    call = jax.ffi.ffi_call(
        name,
        (jax.ShapeDtypeStruct((group_size, int(n)), jnp.uint32),
         jax.ShapeDtypeStruct((group_size,), jnp.uint32)),
        vmap_method="sequential",
    )
    received, epochs = ordering.ordered_call(
        lambda t: call(t, mesh_slots=mesh_slots, group_size=np.int64(group_size), n=np.int64(n)),
        jnp.asarray(tag, jnp.int32).reshape(()), name=name)
    try:
        jax.lax.axis_size(axis_name)
    except NameError:  # called outside shard_map (e.g. a single-device test): nothing to type
        return received, epochs
    return vary_over((received, epochs), (axis_name,))


def remote_smoke(tag: jax.Array, n: int, *, mesh: jax.sharding.Mesh, axis_name: str) -> jax.Array:
    """Smoke test of the NVSHMEM put/signal transport (what the inter-node path uses), process model
    2 only (one process per GPU under ``jax.distributed``). Call inside ``shard_map`` over
    ``axis_name`` of ``mesh`` (the concrete mesh), like ``peer_smoke``.

    Every rank puts ``pattern(tag, writer=me, reader=peer, i)`` (peer_smoke's pattern, see
    ``tests/gpu/test_peer_smoke_gpu.py``) for i < n into slot ``me`` of every peer's communication
    buffer with NVSHMEM device puts, each followed by a signal; it then waits (bounded by
    ``JAX_EP_TIMEOUT_S``) for every peer's signal and returns ``received`` [R, n] uint32 (row w
    from rank w). On one node NVSHMEM carries the puts over NVLink/P2P.
    """
    group_size = int(mesh.shape[axis_name])
    name = runtime.target("remote_smoke")
    if runtime.process_model() != "process_per_gpu":
        raise EPUnsupportedError(
            "jax_ep: remote_smoke needs process model 2 (NVSHMEM): one process per GPU under "
            "jax.distributed; this process drives its GPUs in process model 1 (local peers)")
    mesh_slots = _local_group_slots(mesh, axis_name)
    # Growing the symmetric buffer is collective: done here, at trace time, on every process.
    runtime.reserve(runtime.extension().remote_smoke_comm_bytes(group_size, int(n)))
    call = jax.ffi.ffi_call(
        name,
        jax.ShapeDtypeStruct((group_size, int(n)), jnp.uint32),
        vmap_method="sequential",
    )
    received = ordering.ordered_call(
        lambda t: call(t, mesh_slots=mesh_slots, group_size=np.int64(group_size), n=np.int64(n)),
        jnp.asarray(tag, jnp.int32).reshape(()), name=name)
    try:
        jax.lax.axis_size(axis_name)
    except NameError:  # called outside shard_map: nothing to type
        return received
    return vary_over(received, (axis_name,))


def _local_group_slots(mesh: jax.sharding.Mesh, axis_name: str) -> np.ndarray:
    """The slots (cuda/device_state.h) of the mesh's EP groups this process takes part in,
    flattened row-major as [groups, R] (rank = position along ``axis_name``). Each device finds its
    row and column in it, so the attribute is static and valid for every device of the program."""
    if axis_name not in mesh.axis_names:
        raise EPValueError(f"axis {axis_name!r} is not an axis of the mesh {mesh.axis_names}")
    devices = np.asarray(mesh.devices)
    if any(d.platform != "gpu" for d in devices.flat):
        raise EPValueError("jax_ep CUDA ops need a mesh of GPU devices")
    return group_slots(devices, mesh.axis_names.index(axis_name), jax.process_index(),
                       runtime.process_model())


def group_slots(devices: np.ndarray, axis: int, process_index: int,
                model: str = "local_peers") -> np.ndarray:
    """Rows of slots along ``axis`` (one row per EP group), flattened. Process model 1
    (``local_peers``): the groups whose devices all belong to ``process_index``, by CUDA ordinal
    (local_hardware_id); a group split across processes is an error. Model 2 (``process_per_gpu``):
    every group, by process index (the NVSHMEM PE)."""
    groups = np.moveaxis(devices, axis, -1).reshape(-1, devices.shape[axis])
    if model == "process_per_gpu":
        return np.asarray([[d.process_index for d in group] for group in groups],
                          dtype=np.int64).reshape(-1)
    rows = []
    for group in groups:
        local = [d.process_index == process_index for d in group]
        if all(local):
            rows.append([d.local_hardware_id for d in group])
        elif any(local):
            raise EPUnsupportedError(
                f"jax_ep: the EP group {[d.id for d in group]} spans processes that drive several "
                "GPUs each; across processes jax_ep needs one GPU per process (process model 2)")
    return np.asarray(rows, dtype=np.int64).reshape(-1)


# ---- EP data ops over NVLink ----------------------------------------------------------------
def _group_of(axis_name: str) -> tuple[jax.Array, jax.Array, int]:
    """(rank, group, axis_slot): this device's index along the EP axis and its EP group (linear
    index over the other manual mesh axes), as int32 scalars for the kernels' group discovery, and
    the directory slot of the EP axis name."""
    mesh = jax.sharding.get_abstract_mesh()
    names = tuple(getattr(mesh, "axis_names", ()) or ())
    manual = set(manual_axes())
    if names and axis_name in names and manual and axis_name not in manual:
        raise EPValueError(f"jax_ep: the EP axis {axis_name!r} must be a manual axis of the enclosing "
                           "shard_map")
    group = jnp.int32(0)
    num_groups = 1
    for name in names:
        size = int(mesh.shape[name])
        if name == axis_name or size == 1:
            continue
        if name not in manual:
            raise EPUnsupportedError(
                f"jax_ep (backend='cuda'): mesh axis {name!r} (size {size}) is not manual in this "
                "shard_map, so every device along it would join the same EP group. Run the EP ops "
                "in a shard_map over all mesh axes, or use backend='reference'.")
        group = group * size + lax.axis_index(name).astype(jnp.int32)
        num_groups *= size
    limits = runtime.limits()
    if num_groups > limits["max_groups"]:
        raise EPUnsupportedError(f"jax_ep (backend='cuda'): {num_groups} EP groups in one mesh; "
                                 f"the CUDA backend supports up to {limits['max_groups']}")
    rank = lax.axis_index(axis_name).astype(jnp.int32)
    return rank, group, runtime.axis_slot(axis_name)


def _vary_all(outputs, axis_name: str, *inputs):
    """ffi_call results are typed invariant; they vary over the EP axis and every axis an input
    varies over (a result already varying over some, one that passed jax_ep.overlap's barrier with
    the join's token, is cast over the others only)."""
    axes = {axis_name}
    for x in inputs:
        if x is not None:   # (a handle's absent rank_mask)
            axes.update(varying_axes(x))
    return jax.tree.map(lambda out: vary_also(out, axes), outputs)


ALL_SMS = 1 << 16
TRANSPORT_LOAD_STORE, TRANSPORT_PUT, TRANSPORT_PULL = 0, 1, 2  # EPAttrs::transport: cuda/fingerprint.h


def _transport(op: str, cfg: EPConfig, ep_size: int, blocks: int | None = None, masked: bool = False) -> int:
    """How the call site reaches its peers (``KernelConfig.transport``): NVLink loads / stores, or
    NVSHMEM puts + signals (cuda/remote_rank_major.cu), which only the rank-major ops have.
    "auto" takes puts when, in process model 2, some process of the job cannot be reached by
    loads / stores (the EP group is not known at trace time, only the job). Raises
    NotImplementedError naming the op where neither transport can serve it. Over loads / stores the
    dispatches and broadcasts take their pull form where ``pull_choice`` says so (combine_bwd, the
    broadcast kernel that computes, has none). ``blocks``: the call's (``call_blocks``; None:
    num_sms's)."""
    transport = _peer_transport(op, cfg)
    choice = pull_choice(op, cfg, ep_size, blocks, masked)
    if choice is None or not choice[0]:
        return transport
    if transport == TRANSPORT_LOAD_STORE:
        return TRANSPORT_PULL
    knob = pull_knob(op)
    if getattr(cfg.kernel, knob) is None:   # auto: the put transport pushes
        return transport
    raise EPUnsupportedError(
        f"jax_ep: {op} with KernelConfig({knob}=True) needs NVLink / P2P loads, and this call site "
        "takes the NVSHMEM put transport (KernelConfig.transport, or a job that spans nodes); pass "
        f"{knob}=False")


def pull_knob(op: str) -> str | None:
    """The KernelConfig field that says whether ``op``'s kernels pull their rows; None: it has none."""
    return PULL_KNOBS.get(_RANK_MAJOR_OPS.get(op, op))


def pulls(op: str, cfg: EPConfig, ep_size: int) -> bool:
    """Whether ``op``'s kernels pull their rows in this call (``_transport``)."""
    return _transport(op, cfg, ep_size) == TRANSPORT_PULL


def pull_choice(op: str, cfg: EPConfig, ep_size: int, blocks: int | None = None,
                masked: bool = False) -> tuple[bool, str] | None:
    """(whether ``op``'s kernels take their pull form over loads / stores, why), from
    ``KernelConfig.dispatch_pull`` / ``broadcast_pull``; None: the op has none (combine, combine_bwd,
    ...). A knob left None: where the auto table measured the pulled kernels at least as fast at
    this call's tokens per rank, EP size and blocks (``blocks``; None: ``kernel_blocks``'s; never
    with EPConfig.shrink)."""
    knob = pull_knob(op)
    if knob is None:
        return None
    setting = getattr(cfg.kernel, knob)
    if masked:
        # a rank masked in this call is not waited for at the start, yet may still be pulling the previous
        # call's rows from this rank's staging, which the pulled form rewrites (pushed rows land in the
        # reader's own buffer)
        if setting:
            raise EPUnsupportedError(f"jax_ep: {op} with a rank_mask and KernelConfig({knob}=True): the "
                                     "pull form is not safe when the mask changes between calls; leave it "
                                     "None")
        return False, f"KernelConfig.{knob}: pushed with a rank_mask"
    if setting is not None:
        return setting, f"KernelConfig.{knob}={setting}"
    if cfg.shrink:
        return False, f"KernelConfig.{knob}=None: pushed with EPConfig(shrink=True)"
    tokens = cfg.max_tokens_per_rank
    blocks = kernel_blocks(cfg.kernel) if blocks is None else blocks
    faster = auto_table.pull_faster(knob, tokens, ep_size, blocks)
    verdict = "measured" if faster else "has not measured"
    on = "every SM but one" if blocks == ALL_SMS else f"{blocks} blocks"
    return faster, (f"KernelConfig.{knob}=None: the auto table {verdict} the pulled kernels at least as "
                    f"fast at {tokens} tokens per rank on {auto_table.gpus(ep_size)} with {on}")


def kernel_blocks(kernel: KernelConfig, side: bool = False) -> int:
    """The data kernels' blocks, as the handlers clamp them: KernelConfig.num_sms (``side``: a call on
    jax_ep's side stream, side_num_sms where set), or every SM but one (None); ALL_SMS where the GPU's
    SM count is not known here (no GPU is JAX's default platform)."""
    wanted = kernel.side_num_sms if side and kernel.side_num_sms is not None else kernel.num_sms
    device = jax.local_devices()[0]   # (process model 2: this process's GPU; 1: one of the same kind)
    sms = getattr(device, "core_count", 0) if device.platform == "gpu" else 0
    if sms <= 1:
        return wanted if wanted is not None else ALL_SMS
    return min(wanted if wanted is not None else sms, sms - 1)


def call_blocks(op: str, kernel: KernelConfig) -> int:
    """``kernel_blocks`` of a call of ``op`` traced here: on jax_ep's side stream (``_side_work``) it
    takes side_num_sms."""
    return kernel_blocks(kernel, side=_side_work(op, kernel) is not None)


def _side_work(op: str, kernel: KernelConfig) -> overlap.Beside | None:
    """The open ``jax_ep.overlap.beside`` block's work that a call of ``op`` traced here takes onto
    jax_ep's side stream (an op with a side target, not on an XLA stream of its own), else None."""
    work = overlap.claim() if kernel.async_stream is None else None
    return work if work is not None and runtime.has_variant(op, "side") else None


def _peer_transport(op: str, cfg: EPConfig) -> int:
    """``_transport`` before the pull form: load / store or put."""
    wanted = cfg.kernel.transport
    if wanted == "load_store":
        return TRANSPORT_LOAD_STORE
    if wanted == "put" and op not in _RANK_MAJOR_OPS:
        raise EPUnsupportedError(
            f"jax_ep: {op} has no NVSHMEM put transport (KernelConfig(transport='put')): only "
            "dispatch_rank_major, combine_rank_major and broadcast_rank_major have one")
    runtime.register_targets()  # process model 2: bootstraps NVSHMEM (collective), once
    model = runtime.process_model()
    unreachable = runtime.unreachable_processes()
    if op in _RANK_MAJOR_OPS:
        if wanted == "put" and model != "process_per_gpu":
            raise EPUnsupportedError(
                f"jax_ep: {op} with KernelConfig(transport='put') needs process model 2 (one process "
                "per GPU under jax.distributed: NVSHMEM's symmetric heap); this process drives its "
                "GPUs in process model 1")
        return TRANSPORT_PUT if wanted == "put" or unreachable else TRANSPORT_LOAD_STORE
    if unreachable:
        raise EPUnsupportedError(
            f"jax_ep: {op} reaches its peers by NVLink / P2P loads and stores, and processes "
            f"{unreachable} of this job are on other nodes (no load/store address); only the "
            "rank-major ops (dispatch_rank_major, combine_rank_major) cross nodes, through NVSHMEM "
            "puts. If this op's EP axis stays inside a node (e.g. the local axis of a hierarchical "
            "mesh), pass KernelConfig(transport='load_store'): a peer that is not on this node then "
            "makes the call time out naming it")
    return TRANSPORT_LOAD_STORE


def _check_put_mask(op: str, cfg: EPConfig, rank_mask: jax.Array | None) -> None:
    """The put kernels (cuda/remote_rank_major.cu) apply no rank mask and have no shrink mode:
    refuse either there rather than ignore it."""
    if (rank_mask is not None or cfg.shrink) and _peer_transport(op, cfg) == TRANSPORT_PUT:
        what = "a rank_mask" if rank_mask is not None else "EPConfig(shrink=True)"
        raise EPUnsupportedError(
            f"jax_ep: {op} with {what} over the NVSHMEM put transport is not built (the put "
            "kernels exchange with every rank of the group); call it without, or over NVLink "
            "loads / stores")


def shard_autotuning_hazard(xla_flags: str, process_count: int) -> str | None:
    """Why shrink mode over several processes can hang at compile time, or None. XLA shards its GPU
    autotuning across the processes (--xla_gpu_shard_autotuning, on by default) and each compilation
    waits for every process's share: after a process died, a program the survivors compile (a new
    shape, a function's first call) never finishes compiling (docs/api.md, "Every process must compile
    the same programs")."""
    if process_count < 2:
        return None
    settings = re.findall(r"--xla_gpu_shard_autotuning(?:=(\S*))?", xla_flags or "")
    if settings and settings[-1].lower() in ("false", "0"):
        return None
    return ("jax_ep: EPConfig(shrink=True) over several processes with XLA's sharded autotuning on: a "
            "program compiled after a process died waits for that process forever (XLA waits for every "
            "process's share of the autotuning results). Compile what the survivors run beforehand, or "
            "set XLA_FLAGS=--xla_gpu_shard_autotuning=false before JAX starts (docs/api.md, \"Every "
            "process must compile the same programs\").")


@functools.cache
def _warn_shard_autotuning() -> None:
    """Once per process: shard_autotuning_hazard's warning, if it applies."""
    why = shard_autotuning_hazard(os.environ.get("XLA_FLAGS", ""), jax.process_count())
    if why:
        warnings.warn(why, RuntimeWarning, stacklevel=4)


def _attrs(op: str, cfg: EPConfig, ep_size: int, axis_slot: int, num_tokens: int, hidden: int = 0,
           row_bytes: int = 0, scale_bytes: int = 0, capacity: int = 0, num_experts: int = 0,
           num_topk: int | None = None, masked: bool = False) -> dict:
    """The handlers' EPAttrs (xla_ffi/handlers.h): every data op gets the same fields; those it does
    not use are 0. The sizes fix the communication-buffer layout at instantiation. A rank-major op
    takes the knobs of the expert-major op whose kernels it runs; num_topk: cfg's unless given."""
    kernel = cfg.kernel
    if cfg.shrink:
        _warn_shard_autotuning()
    rank_major = op in _RANK_MAJOR_OPS
    transport = _transport(op, cfg, ep_size, call_blocks(op, kernel) if pull_knob(op) else None, masked)
    data_kernel = _data_kernel(op)
    op = _KERNEL_OF.get(op, op)
    # the handlers clamp num_sms to the device's SMs - 1: None (all of them) passes a bound above any GPU
    num_sms = kernel.num_sms if kernel.num_sms is not None else ALL_SMS
    values = dict(num_ranks=ep_size, num_tokens=num_tokens,
                  num_topk=cfg.num_topk if num_topk is None else num_topk,
                  num_experts=num_experts, hidden=hidden, row_bytes=row_bytes, scale_bytes=scale_bytes,
                  capacity=capacity,
                  alignment=cfg.expert_alignment if op == "dispatch" and not rank_major else 0,
                  axis_slot=axis_slot, num_sms=num_sms if data_kernel else 1,
                  # the low-latency kernels: every warp sends, then receives
                  send_warps=kernel.send_warps(op) if op in _DATA_OPS[:3] else 1,
                  bulk_copy=int(kernel.bulk_copy) if op in ("dispatch", "broadcast") else 0,
                  shrink=int(cfg.shrink),
                  transport=transport)
    return {name: np.int64(value) for name, value in values.items()}


def _data_kernel(op: str) -> bool:
    """Whether the op's kernels take KernelConfig.num_sms blocks (slot_values runs one)."""
    return _KERNEL_OF.get(op, op) != "slot_values"


def _call(op: str, out_types, *args, kernel: KernelConfig | None = None, aliases: dict | None = None,
          **attrs):
    """The op's custom call. ``kernel`` (None: the defaults): its ``async_stream`` runs the call on that
    XLA execution stream as an async op (``compute_on("gpu_stream:N")``), which XLA's scheduler overlaps
    with independent work on the compute stream; None: on the compute stream, in program order. Inside
    ``jax_ep.overlap``'s block, on jax_ep's side stream on ``side_num_sms`` SMs.
    ``aliases``: ffi_call's input_output_aliases {operand: result} (one buffer for both)."""
    overlap.check_not_beside(op)
    kernel = kernel or KernelConfig()
    stream = kernel.async_stream
    # What the call site will reserve when instantiated (xla_ffi/: handler_util.h DataOpInstantiate,
    # low_latency.cc LLInstantiate), grown now where growing is collective (process model 2).
    sizes = [int(attrs[k]) for k in ("num_ranks", "num_tokens", "num_topk", "num_experts")]
    if int(attrs["transport"]) == TRANSPORT_PUT:
        need = runtime.extension().put_comm_bytes(sizes[0], sizes[1], sizes[2], int(attrs["row_bytes"]),
                                                  int(attrs["scale_bytes"]),
                                                  op == "dispatch_rank_major")
    elif op in _LL_OPS:
        need = runtime.extension().ll_comm_bytes(*sizes, int(attrs["hidden"]),
                                                 int(attrs["row_bytes"]), int(attrs["scale_bytes"]))
    else:
        need = runtime.extension().comm_bytes(*sizes, int(attrs["row_bytes"]),
                                              int(attrs["scale_bytes"]))
    runtime.reserve(need)
    # One order in every process (jax_ep.ordering): the call is bound with the ordered effect, so it
    # runs after every EP call before it in program order, whatever each process's XLA schedules.
    # On a stream of its own, the target XLA keeps out of command buffers: inside one an async region
    # runs in series with the rest (xla_ffi/handler_util.h, JAX_EP_DEFINE_ASYNC_EXECUTE).
    work = _side_work(op, kernel)
    args = overlap.after_previous(args, side=work is not None)
    if work is not None:  # inside jax_ep.overlap.beside: on jax_ep's side stream, beside work.fn
        if kernel.side_num_sms is not None and _data_kernel(op):
            attrs = {**attrs, "num_sms": np.int64(kernel.side_num_sms)}
        name = runtime.target(op, "side")
        call = jax.ffi.ffi_call(name, out_types, vmap_method="sequential", input_output_aliases=aliases)
        # kept: never rerun by jax.checkpoint (a rerun would have no join), in one process too
        outputs = ordering.kept_call(lambda *a: call(*a, **attrs), *args, name=name)
        # A side effect, or XLA drops it where nothing reads its token (overlap.JOIN_TOKEN says why the
        # token is not zero-sized).
        join = jax.ffi.ffi_call(runtime.target("side_join"), overlap.JOIN_TOKEN, vmap_method="sequential",
                                has_side_effect=True)
        # ordered too: with several processes every EP call after it waits for the side stream. The
        # join keeps the operands alive, but not an aliased one: its buffer is a result's (a later use
        # of the operand would make XLA copy it before the call)
        kept = [a for i, a in enumerate(args) if i not in (aliases or {})]
        return overlap.run_beside(work, outputs, kept, lambda *kept: ordering.kept_call(
            join, *kept, name="jax_ep_side_join"))
    name = runtime.target(op, "uncaptured" if stream is not None else None)
    call = jax.ffi.ffi_call(name, out_types, vmap_method="sequential", input_output_aliases=aliases)
    if stream is None:
        outputs = ordering.ordered_call(lambda *a: call(*a, **attrs), *args, name=name)
        overlap.record(outputs)
        return outputs
    # the function form: compute_on2 up to jax 0.10, renamed compute_on in 0.11
    on_stream = getattr(_compute_on, "compute_on2", _compute_on.compute_on)
    issue = on_stream(lambda *a: call(*a, **attrs), compute_type=f"gpu_stream:{stream}",
                      out_memory_spaces=jax.memory.Space.Device)
    return ordering.ordered_call(issue, *args, name=name)


def _mask_operand(rank_mask: jax.Array | None, ep_size: int) -> jax.Array:
    """The int32 [R] rank-mask operand of the throughput ops, expert- and rank-major (nonzero =
    active; all ones without a mask). The kernels never wait for, nor write to, a masked rank."""
    if rank_mask is None:
        return jnp.ones((ep_size,), jnp.int32)
    return (rank_mask != 0).astype(jnp.int32)


def _dispatch_call(op: str, x: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array, cfg: EPConfig,
                   rows: jax.ShapeDtypeStruct, scales: jax.ShapeDtypeStruct | None, rest,
                   rank_mask: jax.Array | None) -> tuple:
    """The custom call of dispatch / dispatch_rank_major (one kernel family): results rows, scales
    (None: no FP8) and ``rest`` (the op's other output types, in order); ``rank_mask`` becomes the
    operand. Returns (rows, scales or None, [the rest]), per rank."""
    axis = cfg.axis_name
    ep_size = lax.axis_size(axis)
    tokens, hidden = x.shape
    fp8 = scales is not None
    rank, group, axis_slot = _group_of(axis)
    outputs = _call(op, (rows, scales if fp8 else jax.ShapeDtypeStruct((0,), jnp.float32), *rest),
                    x, topk_idx, topk_weights, _mask_operand(rank_mask, ep_size), rank, group,
                    kernel=cfg.kernel,
                    **_attrs(op, cfg, ep_size, axis_slot, tokens, hidden,
                             row_bytes=hidden * rows.dtype.itemsize,
                             scale_bytes=4 * cfg.num_scale_blocks if fp8 else 0,
                             capacity=rows.shape[0], num_experts=cfg.num_experts,
                             masked=rank_mask is not None))
    rows, scales, *rest = _vary_all(outputs, axis, x, topk_idx, topk_weights)
    return rows, scales if fp8 else None, rest


def dispatch(x: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array, cfg: EPConfig,
             rank_mask: jax.Array | None = None) -> types.Dispatched:
    """``jax_ep.reference.dispatch`` on NVLink kernels (bit-exact outputs). Per-rank view. With a
    rank_mask, a masked rank is left out of the call both ways (docs/api.md, "Rank masking"); the
    kernels AND it with the persistent mask (shrink mode) and return the result as ``rank_mask``."""
    out = types.dispatch_types(x.shape[0], x.dtype, cfg, lax.axis_size(cfg.axis_name))
    rows, scales, (group_sizes, counts, dropped, *handle, active) = _dispatch_call(
        "dispatch", x, topk_idx, topk_weights, cfg, out.x, out.scales,
        (out.group_sizes, out.expert_counts, out.num_dropped, *out.handle[:4], out.rank_mask), rank_mask)
    handle = types.Handle(*handle, rank_mask=None if rank_mask is None else active)
    return types.Dispatched(rows, scales, group_sizes, counts, dropped, handle, active)


def combine(y: jax.Array, handle: types.Handle, cfg: EPConfig, rank_mask: jax.Array | None = None
            ) -> jax.Array:
    """``jax_ep.reference.combine`` on NVLink kernels (same float32 summation order). Per-rank."""
    axis = cfg.axis_name
    ep_size = lax.axis_size(axis)
    width, y = y.shape[1], _pad_rows(y, "combine")
    out = types.combine_types(y, handle, ep_size)
    tokens, hidden = out.shape
    rank, group, axis_slot = _group_of(axis)
    result = _call("combine", out, y, handle.row_weights, handle.token_rows, handle.is_token_in_rank,
                   _mask_operand(rank_mask, ep_size), rank, group, kernel=cfg.kernel,
                   **_attrs("combine", cfg, ep_size, axis_slot, tokens, hidden,
                            row_bytes=hidden * y.dtype.itemsize))
    return _vary_all(result[:, :width], axis, y, *handle)


def broadcast(g: jax.Array, handle: types.Handle, cfg: EPConfig, rank_mask: jax.Array | None = None,
              into: jax.Array | None = None) -> jax.Array:
    """``jax_ep.reference.broadcast`` (dispatch through a known handle, no weights; rows no token
    landed on are zero, or into's) on NVLink kernels. into: written in place (aliased: the kernel
    sees one buffer), so that only the token rows are written. Per-rank view."""
    axis = cfg.axis_name
    ep_size = lax.axis_size(axis)
    width, g = g.shape[1], _pad_rows(g, "broadcast")
    into = None if into is None else _pad_rows(into)
    out = types.broadcast_types(g, handle)
    tokens, hidden = g.shape
    rank, group, axis_slot = _group_of(axis)
    # (no rows to keep: a [0, H] operand, which the handler reads as "zero the rows with no token")
    kept = jnp.zeros((0, hidden), g.dtype) if into is None else into
    result = _call("broadcast", out, g, handle.token_rows, handle.is_token_in_rank, handle.src_index,
                   kept, _mask_operand(rank_mask, ep_size), rank, group, kernel=cfg.kernel,
                   aliases=None if into is None else {4: 0},
                   **_attrs("broadcast", cfg, ep_size, axis_slot, tokens, hidden,
                            row_bytes=hidden * g.dtype.itemsize, capacity=out.shape[0],
                            masked=rank_mask is not None))
    return _vary_all(result[:, :width], axis, g, handle.token_rows, handle.src_index,
                     *(() if into is None else (into,)))


def combine_bwd(g: jax.Array, y: jax.Array, handle: types.Handle, cfg: EPConfig,
                rank_mask: jax.Array | None = None, empty_rows_from_y: bool = False
                ) -> tuple[jax.Array, jax.Array]:
    """``jax_ep.reference.combine_bwd`` (combine's backward: d y, d row_weights; bit-exact) in one
    kernel of the broadcast family: g moves as broadcast moves it, y is read and d y written once.
    empty_rows_from_y: d y is written into y's buffer (aliased: the kernel sees one buffer and works in
    place), where the rows that hold no token keep y's values, so only the token rows are written.
    Per-rank view."""
    axis = cfg.axis_name
    ep_size = lax.axis_size(axis)
    width, g, y = y.shape[1], _pad_rows(g, "combine_bwd"), _pad_rows(y)   # zero columns: zero products
    dy_type, drw_type = types.combine_bwd_types(y, handle)
    tokens, hidden = g.shape
    rank, group, axis_slot = _group_of(axis)
    dy, d_row_weights = _call(
        "combine_bwd", (dy_type, drw_type), g.astype(y.dtype), y, handle.row_weights, handle.token_rows,
        handle.is_token_in_rank, handle.src_index, _mask_operand(rank_mask, ep_size), rank, group,
        kernel=cfg.kernel, aliases={1: 0} if empty_rows_from_y else None,
        **_attrs("combine_bwd", cfg, ep_size, axis_slot, tokens, hidden, row_bytes=hidden * y.dtype.itemsize,
                 capacity=y.shape[0]))
    return _vary_all((dy[:, :width], d_row_weights), axis, g, y, *handle)


def slot_values(values: jax.Array, handle: types.Handle, cfg: EPConfig,
                rank_mask: jax.Array | None = None) -> jax.Array:
    """``jax_ep.reference.slot_values``: each source token's top-k slot gets the value of its
    receive row ([C] float32 -> [T, K]; 0 for unused, duplicate or dropped slots). Per-rank."""
    axis = cfg.axis_name
    ep_size = lax.axis_size(axis)
    out = types.slot_values_types(handle, cfg, ep_size)
    rank, group, axis_slot = _group_of(axis)
    result = _call("slot_values", out, values.astype(jnp.float32), handle.token_rows,
                   _mask_operand(rank_mask, ep_size), rank, group,
                   kernel=cfg.kernel,
                   **_attrs("slot_values", cfg, ep_size, axis_slot, out.shape[0]))
    return _vary_all(result, axis, values, handle.token_rows)


# ---- rank-major mode (DeepEP's contract) ---------------------------------------------------------
def dispatch_rank_major(x: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array, cfg: EPConfig,
                        rank_mask: jax.Array | None = None) -> types.RankMajorDispatched:
    """``jax_ep.reference.dispatch_rank_major`` on NVLink kernels (the dispatch kernels in their
    rank-major mode; bit-exact outputs, rank mask included). Per-rank view."""
    _check_put_mask("dispatch_rank_major", cfg, rank_mask)
    out = types.rank_major_dispatch_types(x.shape[0], x.dtype, cfg, lax.axis_size(cfg.axis_name))
    rows, scales, (ids, weights, per_rank, per_expert, src_index, in_rank) = _dispatch_call(
        "dispatch_rank_major", x, topk_idx, topk_weights, cfg, out.x, out.scales,
        (out.topk_idx, out.topk_weights, out.num_tokens_per_rank, out.num_tokens_per_expert,
         *out.handle[:2]), rank_mask)
    mask = None if rank_mask is None else _vary_all(_mask_operand(rank_mask, lax.axis_size(cfg.axis_name)),
                                                    cfg.axis_name, x)
    return types.RankMajorDispatched(rows, scales, ids, weights, per_rank, per_expert,
                                     types.RankMajorHandle(src_index, in_rank, mask))


def _slot_rows_type(handle: types.RankMajorHandle) -> jax.ShapeDtypeStruct:
    """The second result of combine_rank_major / broadcast_rank_major: the handle's slot -> row table
    (scratch the kernels read, dropped here)."""
    return jax.ShapeDtypeStruct(handle.src_index.shape, jnp.int32)


def _pad_rows(a: jax.Array, op: str | None = None) -> jax.Array:
    """Rows widened with zero columns to the kernels' 16-byte multiple (8 elements), cut off after: the
    rank-major backward passes combine [R*T, K] gate-weight cotangents, any K, and combine's rows [C, H']
    may have any width (``unsupported`` checks cfg.hidden, x's). ``op``: the rows' width is checked
    against the kernels' limit, naming it (the handler would refuse it when XLA instantiates the call)."""
    limits = runtime.limits()
    pad = -a.shape[1] % limits["row_alignment"]
    if op is not None and a.shape[1] + pad > limits["max_hidden"]:
        raise EPValueError(f"jax_ep.{op} (cuda backend): rows of width {a.shape[1]} exceed the kernels' "
                           f"{limits['max_hidden']}; use backend='reference'")
    return jnp.pad(a, ((0, 0), (0, pad))) if pad else a


def _rank_major_rows(op: str, rows: jax.Array, handle: types.RankMajorHandle, cfg: EPConfig,
                     rank_mask: jax.Array | None) -> jax.Array:
    """combine_rank_major ([R*T, H] rows to [T, H]) or broadcast_rank_major ([T, H] to [R*T, H]) on
    the kernels: one row per (token, rank), rows widened to the kernels' alignment (zero columns sum
    to zeros, cut off after)."""
    axis = cfg.axis_name
    ep_size = lax.axis_size(axis)
    width = rows.shape[1]
    rows = _pad_rows(rows)
    combining = op == "combine_rank_major"
    out = (types.rank_major_combine_types if combining else types.rank_major_broadcast_types)(rows, handle)
    tokens, hidden = handle.is_token_in_rank.shape[0], rows.shape[1]
    _check_put_mask(op, cfg, rank_mask)
    rank, group, axis_slot = _group_of(axis)
    result, _ = _call(op, (out, _slot_rows_type(handle)), rows, handle.src_index,
                      handle.is_token_in_rank, _mask_operand(rank_mask, ep_size), rank, group,
                      kernel=cfg.kernel,
                      **_attrs(op, cfg, ep_size, axis_slot, tokens, hidden,
                               row_bytes=hidden * rows.dtype.itemsize,
                               capacity=0 if combining else out.shape[0], num_topk=1,
                               masked=rank_mask is not None))
    return _vary_all(result[:, :width], axis, rows, *handle)


def combine_rank_major(y: jax.Array, handle: types.RankMajorHandle, cfg: EPConfig,
                       rank_mask: jax.Array | None = None) -> jax.Array:
    """``jax_ep.reference.combine_rank_major`` on NVLink kernels (the combine kernel with one row per
    (token, rank), rows as they are; the same float32 rank-order sum, bit-exact). Per-rank view."""
    return _rank_major_rows("combine_rank_major", y, handle, cfg, rank_mask)


def broadcast_rank_major(g: jax.Array, handle: types.RankMajorHandle, cfg: EPConfig,
                         rank_mask: jax.Array | None = None) -> jax.Array:
    """``jax_ep.reference.broadcast_rank_major`` (combine_rank_major's backward: each token's row to
    its rows, empty rows zero) on NVLink kernels (the broadcast kernel, one row per (token, rank))."""
    return _rank_major_rows("broadcast_rank_major", g, handle, cfg, rank_mask)


# ---- low-latency (decode) mode ------------------------------------------------------------------
def _ll_mask_operand(rank_mask, ep_size: int) -> jax.Array:
    """The kernels' int32 [R] rank_mask operand (1 = active; all ones without a mask)."""
    return routing.active(rank_mask, ep_size).astype(jnp.int32)


def _ll_slot_types(out: types.LLDispatched) -> tuple:
    """The handle's slots every ll_dispatch kernel writes: topk_weights, dest_rank, num_dropped."""
    return out.handle.topk_weights, out.handle.dest_rank, out.num_dropped


def _ll_dispatched(rows, scales, counts, src_slot, active, weights, dest, dropped) -> types.LLDispatched:
    """LLDispatched from a receiving kernel's outputs (it writes the handle's slots itself: the
    pairs it kept, their weights, and the dropped ones counted, as reference.ll_dispatch)."""
    return types.LLDispatched(rows, scales, counts, types.LLHandle(src_slot, weights, dest), dropped, active)


def ll_dispatch(x: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array,
                cfg: EPConfig, rank_mask: jax.Array | None = None) -> types.LLDispatched:
    """``jax_ep.reference.ll_dispatch`` on NVLink kernels (bit-exact outputs). Per-rank view."""
    axis = cfg.axis_name
    ep_size = lax.axis_size(axis)
    tokens, hidden = x.shape
    out = types.ll_dispatch_types(tokens, x.dtype, cfg, ep_size)
    fp8 = out.scales is not None
    scales = out.scales if fp8 else jax.ShapeDtypeStruct((0,), jnp.float32)
    rank, group, axis_slot = _group_of(axis)
    mask = _ll_mask_operand(rank_mask, ep_size)
    weights = topk_weights.astype(jnp.float32)  # (a no-op for float32 weights)
    outputs = _call("ll_dispatch", (out.x, scales, out.counts, out.handle.src_slot, out.rank_mask,
                                    *_ll_slot_types(out)), x, topk_idx, weights, mask, rank, group,
                    **_attrs("ll_dispatch", cfg, ep_size, axis_slot, tokens, hidden,
                             row_bytes=hidden * out.x.dtype.itemsize,
                             scale_bytes=4 * cfg.num_scale_blocks if fp8 else 0,
                             num_experts=cfg.num_experts))
    rows, scales, counts, src_slot, active, *slots = _vary_all(outputs, axis, x, topk_idx, weights, mask)
    return _ll_dispatched(rows, scales if fp8 else None, counts, src_slot, active, *slots)


def ll_combine(y: jax.Array, handle: types.LLHandle, cfg: EPConfig,
               rank_mask: jax.Array | None = None) -> jax.Array:
    """``jax_ep.reference.ll_combine`` on NVLink kernels (float32 sums in top-k order). Per-rank."""
    axis = cfg.axis_name
    ep_size = lax.axis_size(axis)
    out = types.ll_combine_types(handle, cfg)
    tokens, hidden = out.shape
    rank, group, axis_slot = _group_of(axis)
    mask = _ll_mask_operand(rank_mask, ep_size)
    if not tokens:
        return _vary_all(jnp.zeros(out.shape, out.dtype), axis, y, *handle, mask)
    result = _call("ll_combine", out, y, handle.src_slot, handle.topk_weights, handle.dest_rank, mask,
                   rank, group,
                   **_attrs("ll_combine", cfg, ep_size, axis_slot, tokens, hidden,
                            row_bytes=hidden * 2, num_experts=cfg.num_experts))
    return _vary_all(result, axis, y, *handle, mask)


# ---- low-latency two-phase form: _send returns once its writes are issued, _recv waits -----------
_LL_TOKEN = jax.ShapeDtypeStruct((4,), jnp.uint32)


def _ll_dispatch_attrs(cfg: EPConfig, ep_size: int, axis_slot: int, tokens: int, wire) -> dict:
    fp8 = jnp.dtype(wire) == jnp.float8_e4m3fn
    return _attrs("ll_dispatch", cfg, ep_size, axis_slot, tokens, cfg.hidden,
                  row_bytes=cfg.hidden * jnp.dtype(wire).itemsize,
                  scale_bytes=4 * cfg.num_scale_blocks if fp8 else 0, num_experts=cfg.num_experts)


def ll_dispatch_send(x: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array,
                     cfg: EPConfig, rank_mask: jax.Array | None = None) -> types.LLDispatchPending:
    """ll_dispatch's send phase on NVLink kernels: the tokens are on their way when it returns."""
    axis = cfg.axis_name
    ep_size = lax.axis_size(axis)
    tokens = x.shape[0]
    rank, group, axis_slot = _group_of(axis)
    mask = _ll_mask_operand(rank_mask, ep_size)
    weights = topk_weights.astype(jnp.float32)  # (a no-op for float32 weights)
    out = types.ll_dispatch_types(tokens, x.dtype, cfg, ep_size)
    # on NVLink the send's own warps move the data: it overlaps other work only from another stream;
    # it also writes the handle's slots as its ranks keep them (the receive drops those of a rank
    # masked in between)
    outputs = _call("ll_dispatch_send", (_LL_TOKEN, *_ll_slot_types(out)), x, topk_idx, weights, mask,
                    rank, group, kernel=cfg.kernel,
                    **_ll_dispatch_attrs(cfg, ep_size, axis_slot, tokens, cfg.wire_dtype(x.dtype)))
    token, sent_weights, sent_dest, sent_dropped = _vary_all(outputs, axis, x, topk_idx, weights, mask)
    return types.LLDispatchPending(token, sent_weights, sent_dest, sent_dropped)


def ll_dispatch_recv(pending: types.LLDispatchPending, cfg: EPConfig) -> types.LLDispatched:
    """ll_dispatch's receive phase: waits for the slots and copies them out (``ll_dispatch``'s
    outputs, bit-exact)."""
    axis = cfg.axis_name
    ep_size = lax.axis_size(axis)
    tokens = pending.topk_weights.shape[0]
    out = types.ll_dispatch_types(tokens, jnp.bfloat16, cfg, ep_size)  # the wire dtype of the send
    fp8 = out.scales is not None
    scales = out.scales if fp8 else jax.ShapeDtypeStruct((0,), jnp.float32)
    rank, group, axis_slot = _group_of(axis)
    sent = (pending.token, pending.topk_weights, pending.dest_rank, pending.num_dropped)
    outputs = _call("ll_dispatch_recv", (out.x, scales, out.counts, out.handle.src_slot, out.rank_mask,
                                         *_ll_slot_types(out)), *sent, rank, group,
                    **_ll_dispatch_attrs(cfg, ep_size, axis_slot, tokens, out.x.dtype))
    rows, scales, counts, src_slot, active, *slots = _vary_all(outputs, axis, *sent)
    return _ll_dispatched(rows, scales if fp8 else None, counts, src_slot, active, *slots)


def ll_combine_send(y: jax.Array, handle: types.LLHandle, cfg: EPConfig,
                    rank_mask: jax.Array | None = None) -> types.LLCombinePending:
    """ll_combine's send phase: every filled slot's row is on its way back when it returns.

    With T = 0 tokens (a static size, the same on every rank) no rank has a row to move: ll_combine,
    its send and its receive issue no call. XLA would drop a call whose results are all empty (the
    receive's, the fused op's: ZeroSizedHloElimination) but not a send whose token something else
    keeps (jax_ep.overlap's join), which would leave the send's half in flight."""
    axis = cfg.axis_name
    ep_size = lax.axis_size(axis)
    tokens, hidden = handle.topk_weights.shape[0], cfg.hidden
    rank, group, axis_slot = _group_of(axis)
    mask = _ll_mask_operand(rank_mask, ep_size)
    if not tokens:
        token = jnp.zeros(_LL_TOKEN.shape, _LL_TOKEN.dtype)
    else:
        token = _call("ll_combine_send", _LL_TOKEN, y, handle.src_slot, mask, rank, group,
                      kernel=cfg.kernel,
                      **_attrs("ll_combine", cfg, ep_size, axis_slot, tokens, hidden,
                               row_bytes=hidden * 2, num_experts=cfg.num_experts))
    # the receive reads this rank's own rows from y (they are not copied): y travels with the call
    return types.LLCombinePending(_vary_all(token, axis, y, handle.src_slot, mask), handle.topk_weights,
                                  handle.dest_rank, y=y)


def ll_combine_recv(pending: types.LLCombinePending, cfg: EPConfig) -> jax.Array:
    """ll_combine's receive phase: waits for the rows and sums them (``ll_combine``'s output)."""
    axis = cfg.axis_name
    ep_size = lax.axis_size(axis)
    tokens, hidden = pending.topk_weights.shape[0], cfg.hidden
    rank, group, axis_slot = _group_of(axis)
    if not tokens:
        return _vary_all(jnp.zeros((0, hidden), jnp.bfloat16), axis, pending.token, pending.y,
                         pending.topk_weights, pending.dest_rank)
    result = _call("ll_combine_recv", jax.ShapeDtypeStruct((tokens, hidden), jnp.bfloat16),
                   pending.token, pending.y, pending.topk_weights, pending.dest_rank, rank, group,
                   **_attrs("ll_combine", cfg, ep_size, axis_slot, tokens, hidden,
                            row_bytes=hidden * 2, num_experts=cfg.num_experts))
    return _vary_all(result, axis, pending.token, pending.y, pending.topk_weights, pending.dest_rank)
