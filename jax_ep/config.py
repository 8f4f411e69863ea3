"""Static configuration of the expert-parallel ops (hashable, so it can be a jit static argument).

``EPConfig`` says what the ops compute; its ``kernel`` (``KernelConfig``) says how the CUDA kernels run
(grid size, warp roles, copy engine). Both are frozen dataclasses: any change is a new jit cache key.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import numpy as np

from jax_ep.errors import EPTypeError, EPUnsupportedError, EPValueError

DISPATCH_DTYPES = (None, "bfloat16", "float8_e4m3fn")
FP8_BLOCK = 128  # channels per FP8 scale (per token, per 128 channels)
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def _is_bool(value) -> bool:
    return isinstance(value, (bool, np.bool_))


def _is_int(value) -> bool:
    # numbers.Integral: NumPy's integer scalars too (np.int64(16) was refused as "not a positive int")
    return isinstance(value, numbers.Integral) and not _is_bool(value)


def type_name(value) -> str:
    """``value``'s type as an error message names it: ``str``, but ``numpy.bool`` (whose __name__ is
    ``bool`` too: "must be a bool, got np.True_ (bool)" read as a contradiction)."""
    kind = type(value)
    return kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


# ---- option checks: the one place the fields of EPConfig, KernelConfig, EPOptions and MoE's
# arguments are checked. A field's kind: "int" (an int, not a bool/float/str, >= minimum), "int?"
# (the same or None), "bool" (True or False only), "name" (a non-empty str), "name?", "backend" ("auto"
# or a registered backend's name), "seconds" (a positive finite int or float), or a tuple of allowed
# values. A wrong type raises EPTypeError, a wrong value of the right type EPValueError; both name the
# owner, the field and the value. NumPy's integer and float scalars count as ints and numbers.
def check_option(owner: str, name: str, value, kind, minimum: int = 1):
    """Raises EPTypeError / EPValueError unless ``value`` is of ``kind`` (above); returns ``value``, an
    int or number as a Python int / float (one type in the configs' hashes and the jit caches)."""
    what = f"{owner}.{name}" if not owner.endswith(":") else f"{owner} {name}"
    if isinstance(kind, tuple):
        if not any(value is v or (type(value) is type(v) and value == v) for v in kind):
            raise EPValueError(f"{what} must be one of {kind}, got {value!r}")
        return value
    if kind.endswith("?"):
        if value is None:
            return None
        kind = kind[:-1]
        none = "None or "
    else:
        none = ""
    if kind == "bool":
        if not isinstance(value, bool):
            raise EPTypeError(f"{what} must be {none}a bool, got {value!r} "
                              f"({type_name(value)})")
    elif kind == "int":
        noun = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        if not _is_int(value):
            raise EPTypeError(f"{what} must be {none}{noun}, got {value!r} ({type_name(value)})")
        if value < minimum:
            raise EPValueError(f"{what} must be {none}{noun}, got {value!r}")
        return int(value)
    elif kind == "seconds":  # a positive finite number of seconds (a wait's bound)
        if _is_bool(value) or not isinstance(value, numbers.Real):
            raise EPTypeError(f"{what} must be {none}a positive number of seconds, got {value!r} "
                              f"({type_name(value)})")
        if not 0 < value < math.inf:
            raise EPValueError(f"{what} must be {none}a positive finite number of seconds, got {value!r}")
        return int(value) if _is_int(value) else float(value)
    elif kind == "backend":  # "auto" or a registered backend (jax_ep.backends)
        from jax_ep import backends

        allowed = ("auto", *backends.names())
        if not isinstance(value, str) or value not in allowed:
            raise EPValueError(f"{what} must be one of {allowed}, got {value!r}")
    elif kind == "name":
        if not isinstance(value, str):
            raise EPTypeError(f"{what} must be {none}a non-empty str, got {value!r} ({type_name(value)})")
        if not value:
            raise EPValueError(f"{what} must be {none}a non-empty str, got {value!r}")
    else:  # pragma: no cover - a kind this module does not define
        raise AssertionError(kind)
    return value


def check_options(owner: str, obj, kinds: dict) -> None:
    """``check_option`` for each field of ``obj`` (a frozen dataclass) named in ``kinds``; a NumPy int or
    number is stored as the Python one (np.int64(64) and 64 the same config, hash and jit cache key)."""
    for name, kind in kinds.items():
        value = getattr(obj, name)
        checked = check_option(owner, name, value, kind)
        if checked is not value:
            object.__setattr__(obj, name, checked)


def check_fp8_channels(owner: str, **sizes: int) -> None:
    """The one FP8 shape fact: one float32 scale per FP8_BLOCK channels, so every size given (keyword:
    its name) is a multiple of FP8_BLOCK. ``owner`` says who needs it (the message starts with it)."""
    if any(v % FP8_BLOCK for v in sizes.values()):
        what = "a multiple" if len(sizes) == 1 else "multiples"
        got = ", ".join(f"{k}={v}" for k, v in sizes.items())
        raise EPValueError(f"{owner} needs {' and '.join(sizes)} {what} of {FP8_BLOCK} (one FP8 scale per "
                           f"{FP8_BLOCK} channels), got {got}")


def check_kernel(owner: str, value) -> None:
    if not isinstance(value, KernelConfig):
        raise EPTypeError(f"{owner}.kernel must be a KernelConfig (jax_ep.KernelConfig), got {value!r} "
                          f"({type_name(value)})")


TRANSPORTS = ("auto", "load_store", "put")
# The kernels that can pull their rows (dispatch and broadcast, each with its rank-major form; not
# combine_bwd) and the KernelConfig field that asks them to.
PULL_KNOBS = {"dispatch": "dispatch_pull", "broadcast": "broadcast_pull"}

# The kind of each field (check_option); EPConfig.kernel must be a KernelConfig (check_kernel).
KERNEL_CONFIG_KINDS = {"num_sms": "int?", "side_num_sms": "int?", "dispatch_send_warps": "int",
                       "combine_send_warps": "int",
                       "broadcast_send_warps": "int", "bulk_copy": "bool", "async_stream": "int?",
                       "transport": TRANSPORTS, "dispatch_pull": "bool?", "broadcast_pull": "bool?"}
EP_CONFIG_KINDS = {"num_experts": "int", "num_topk": "int", "hidden": "int", "max_tokens_per_rank": "int",
                   "axis_name": "name", "capacity": "int?", "expert_alignment": "int",
                   "dispatch_dtype": DISPATCH_DTYPES, "backend": "backend", "checked": "bool",
                   "shrink": "bool"}


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """How the CUDA kernels of dispatch/combine run (no effect on results, only on speed).

    Attributes:
      num_sms: blocks of the data kernels, one per SM; None (default) = every SM of the device but one.
        XLA runs the ops on its compute stream, serialised with the model's kernels, so SMs held back
        help only work that overlaps the op; measured on 2x H200, 24 SMs make dispatch and combine
        about 1.5x slower than all of them (docs/benchmarks.md).
      side_num_sms: blocks of a data kernel that runs on jax_ep's side stream (``jax_ep.overlap``:
        beside other work, which gets the remaining SMs); None (default): ``num_sms``. So an exchange
        in series keeps every SM while one beside a GEMM takes few.
      dispatch_send_warps: warps of a dispatch block (of 16) that send; the others receive.
      combine_send_warps: warps of a combine block (of 16) that reduce and send; the others receive
        (with no other rank in the group every warp receives).
      broadcast_send_warps: warps of a broadcast block (of 16) that send; the others receive. Also
        combine's fused backward (combine_bwd, the broadcast kernel), whose senders then receive too.
      bulk_copy: dispatch and broadcast (combine_bwd's senders too) copy rows with bulk (TMA) copies
        through shared memory; False uses 16-byte register copies.
      async_stream: None (default): the communicating ops (dispatch, combine, broadcast,
        combine_bwd, slot_values, and the send phases ``ll_dispatch_send`` / ``ll_combine_send``)
        run on XLA's compute stream, in program order. An int N: each runs on XLA execution
        stream N as an async op (``jax.experimental.compute_on.compute_on2`` with
        ``"gpu_stream:N"``), meant for XLA's scheduler to overlap with work that does not depend on it
        (the shared expert, the expert weights' gradients, another micro-batch's GEMMs), with fewer
        ``num_sms`` and the expert GEMMs leaving those SMs free (``MoE(gemm_num_sms=...)``). Measured:
        with jax 0.11.2 nothing runs beside these calls. XLA schedules each async start right before
        its done (the work it could overlap before both), with and without command buffers, with the
        latency-hiding scheduler and with a scheduling group (one H200, 2026-12-02,
        ``tools/overlap_probe.py --dump``: a DeepSeek-V3 GEMM and a dispatch with no data between them,
        0.000 of 0.387 ms hidden; docs/benchmarks.md, session 43). These calls take FFI targets XLA
        never captures ("jax_ep_<op>_uncaptured", the same handlers otherwise): inside XLA's command
        buffers an async region runs in series with the rest (openxla/xla#48900). An order XLA cannot
        move: ``jax_ep.overlap.beside`` (jax_ep's own side stream).
      transport: how the rank-major ops (dispatch_rank_major, combine_rank_major and the
        broadcast_rank_major of their backward) reach their peers. "auto" (default): NVSHMEM puts
        when, in process model 2, some process of the job cannot reach this one's GPU by loads /
        stores (another node), else NVLink loads / stores. "put": always NVSHMEM puts + signals
        (process model 2 only; e.g. to run the inter-node path on one node). "load_store": always
        loads / stores (every peer of the EP group must be on this node; a peer that is not makes
        the call time out naming it). Every process must resolve the same transport for a call: one
        that differs fails on every rank with a fingerprint mismatch, field "transport". The other
        EP ops have no put transport: in a job that spans nodes they need transport="load_store"
        (an EP axis inside a node, e.g. the local axis of a hierarchical mesh) and raise
        NotImplementedError otherwise.
      dispatch_pull: dispatch (and dispatch_rank_major) over NVLink loads / stores in the pull form:
        each sender writes a token routed to other ranks ONCE into its own staging buffer and every
        receiver loads it from there, instead of the sender storing it into each receiver's buffer.
        An SM stores one 32-byte sector per clock wherever the bytes go, so pushing costs the
        sender's SMs a store per remote rank of a token (~2.7 at EP4 with DeepSeek-V3's routing),
        pulling one, plus the receivers' loads (a request per 128-byte line). What it is for: the
        wire rate of dispatch on few SMs at EP >= 4 (docs/benchmarks.md, sessions 47 and 51; under CUDA
        MPS, 4 processes on one H200, it measured a median 8% faster, session 52). None (default):
        pulled where the auto table (``jax_ep/auto_table.json``, section "pull", written by
        ``python -m benchmarks.auto_table`` from ``--pull both`` runs on separate GPUs) measured the
        pulled kernel at least as fast as the pushed one at this EP size, tokens per rank and SM count
        (``num_sms``'s blocks, also for a call on jax_ep's side stream; ``auto_table.pull_faster``),
        pushed otherwise and always with ``EPConfig.shrink`` or over NVSHMEM puts; the shipped table
        has no such measurement yet, so None pushes today. True / False: always pulled / pushed;
        True is refused with ``EPConfig.shrink`` (a receiver the sender gave up on could read its
        staging after the sender's next call rewrote it) and over puts. Every rank of a group must
        agree: a mismatch fails on every rank (fingerprint field "transport").
      broadcast_pull: the same for broadcast and broadcast_rank_major (the backward of an unweighted
        combine: the MoE layer's on the flat exchange, ``EPOptions.gate_weights``), not for
        ``combine_bwd`` (the weighted combine's fused backward reads a token's row once per group of up
        to 3 of its rows: pulled, each read would cross NVLink). None (default): as the auto table
        measured, as for dispatch_pull.
    Tuned on H200 (docs/benchmarks.md, tools/ep_tune.py). Limits a kernel has (warps per block) are
    checked where the kernel is chosen, against the values the extension reports.
    """

    num_sms: int | None = None
    side_num_sms: int | None = None
    dispatch_send_warps: int = 6
    combine_send_warps: int = 8
    broadcast_send_warps: int = 6
    bulk_copy: bool = True
    async_stream: int | None = None
    transport: str = "auto"
    dispatch_pull: bool | None = None
    broadcast_pull: bool | None = None

    def __post_init__(self):
        check_options("KernelConfig", self, KERNEL_CONFIG_KINDS)
        pulled = [k for k in PULL_KNOBS.values() if getattr(self, k) is True]
        if self.transport == "put" and pulled:   # (under "auto", where a call resolves to puts: at its trace)
            raise EPUnsupportedError(
                f"KernelConfig(transport='put') with {pulled[0]}=True: pulling reads the peers' staging by "
                "NVLink loads, which NVSHMEM puts do not give; use one of them")

    def send_warps(self, op: str) -> int:
        return getattr(self, f"{op}_send_warps")

    def replace(self, **changes) -> KernelConfig:
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class EPConfig:
    """Everything the dispatch/combine ops need to know at trace time.

    Attributes:
      num_experts: experts across the whole EP group; must divide by the EP size.
      num_topk: experts each token picks (K).
      hidden: hidden size H of the tokens.
      max_tokens_per_rank: the most tokens a rank passes to one dispatch call (T <= this).
      axis_name: the mesh axis the experts are sharded over (the EP axis).
      capacity: receive rows per rank (C). None = worst case: no row can ever be dropped.
        A smaller capacity drops the overflowing rows deterministically and counts them.
      expert_alignment: each expert's segment of the receive buffer is padded to a multiple of this.
      dispatch_dtype: None keeps x's dtype on the wire; "bfloat16"; or "float8_e4m3fn" with
        per-token, per-128-channel float32 scales (amax / 448).
      backend: "auto" (per op, cuda where its kernel measured faster and runs, else reference),
        "reference" (pure JAX), "cuda", or another backend registered with jax_ep.backends.
      checked: validate traced values (expert ids, dropped rows) at run time and raise on error.
      kernel: how the CUDA kernels run (KernelConfig: SMs, warp roles, bulk copies).
      shrink: shrink mode of the CUDA kernels (backend "cuda"; every EP op but the rank-major ones
        over NVSHMEM puts, which refuse it): a peer that misses a bounded wait is masked, on this
        GPU, for this call and every later EP call of the group (``jax_ep.runtime.rank_masks``
        shows it, ``clear_rank_masks`` clears it), and the call finishes without it instead of
        failing (docs/api.md "Shrink mode"). Off: such a timeout is an error naming op and rank.
    """

    num_experts: int
    num_topk: int
    hidden: int
    max_tokens_per_rank: int
    axis_name: str = "ep"
    capacity: int | None = None
    expert_alignment: int = 1
    dispatch_dtype: str | None = None
    backend: str = "auto"
    checked: bool = False
    kernel: KernelConfig = KernelConfig()
    shrink: bool = False

    def __post_init__(self):
        check_options("EPConfig", self, EP_CONFIG_KINDS)
        check_kernel("EPConfig", self.kernel)
        pulled = [k for k in PULL_KNOBS.values() if getattr(self.kernel, k) is True]
        if self.shrink and pulled:
            raise EPUnsupportedError(
                f"EPConfig(shrink=True) with KernelConfig({pulled[0]}=True) is not built: a receiver "
                "the sender gave up on could still be reading its staging when the sender's next call "
                "rewrites it; use one of them")
        if self.shrink and self.kernel.transport == "put":
            raise EPUnsupportedError(
                "EPConfig(shrink=True) with KernelConfig(transport='put') is not built: the put kernels "
                "have no shrink mode (and the other ops no put transport); use one of them")
        if self.num_topk > self.num_experts:
            raise EPValueError(f"EPConfig.num_topk={self.num_topk} exceeds num_experts={self.num_experts}")
        if self.capacity is not None:
            if self.capacity % self.expert_alignment:
                raise EPValueError(
                    f"EPConfig.capacity={self.capacity} must be a multiple of "
                    f"expert_alignment={self.expert_alignment}")
        if self.dispatch_dtype == "float8_e4m3fn":
            check_fp8_channels("EPConfig: dispatch_dtype='float8_e4m3fn'", hidden=self.hidden)

    # ---- derived sizes (ep_size is the size of the mesh axis, known inside shard_map) ----
    def check_ep_size(self, ep_size: int) -> None:
        check_option("EPConfig's methods:", "ep_size (the EP axis's size)", ep_size, "int")
        if self.num_experts % ep_size:
            raise EPValueError(f"num_experts={self.num_experts} is not divisible by the EP size "
                               f"{ep_size} (mesh axis {self.axis_name!r})")

    def num_local_experts(self, ep_size: int) -> int:
        self.check_ep_size(ep_size)
        return self.num_experts // ep_size

    def worst_case_capacity(self, ep_size: int) -> int:
        """Rows a rank can receive at most: every token of every rank picks min(K, E_local) of its
        experts, and every expert segment carries up to alignment-1 rows of padding."""
        local = self.num_local_experts(ep_size)
        rows = ep_size * self.max_tokens_per_rank * min(self.num_topk, local)
        rows += local * (self.expert_alignment - 1)
        return _round_up(rows, self.expert_alignment)

    def resolved_capacity(self, ep_size: int) -> int:
        if self.capacity is None:
            return self.worst_case_capacity(ep_size)
        return self.capacity

    def wire_dtype(self, x_dtype):
        """dtype of the dispatched rows for tokens of ``x_dtype``."""
        import jax.numpy as jnp  # config stays importable without initialising JAX's numpy
        return jnp.dtype(self.dispatch_dtype or x_dtype)

    @property
    def num_scale_blocks(self) -> int:
        return math.ceil(self.hidden / FP8_BLOCK)

    def replace(self, **changes) -> EPConfig:
        return dataclasses.replace(self, **changes)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
