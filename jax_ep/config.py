"""Static configuration of the expert-parallel ops (hashable, so it can be a jit static argument).

``EPConfig`` says what the ops compute; its ``kernel`` (``KernelConfig``) says how the CUDA kernels run
(grid size, warp roles, copy engine). Both are frozen dataclasses: any change is a new jit cache key.
"""

from __future__ import annotations

import dataclasses
import math

DISPATCH_DTYPES = (None, "bfloat16", "float8_e4m3fn")
BACKENDS = ("auto", "reference", "cuda")
FP8_BLOCK = 128  # channels per FP8 scale (per token, per 128 channels)
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def _check_positive_int(owner: str, name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{owner}.{name} must be a positive int, got {value!r}")


TRANSPORTS = ("auto", "load_store", "put")


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """How the CUDA kernels of dispatch/combine run (no effect on results, only on speed).

    Attributes:
      num_sms: blocks of the data kernels, one per SM; None (default) = every SM of the device but one.
        XLA runs the ops on its compute stream, serialised with the model's kernels, so SMs held back
        help only work that overlaps the op; measured on 2x H200, 24 SMs make dispatch and combine
        about 1.5x slower than all of them (docs/benchmarks.md).
      dispatch_send_warps: warps of a dispatch block (of 16) that send; the others receive.
      combine_send_warps: warps of a combine block (of 16) that reduce and send; the others receive.
      broadcast_send_warps: warps of a broadcast block (of 16) that send; the others receive. Also
        combine's fused backward (combine_bwd, the broadcast kernel), whose senders then receive too.
      bulk_copy: dispatch and broadcast (combine_bwd's senders too) copy rows with bulk (TMA) copies
        through shared memory; False uses 16-byte register copies.
      async_stream: None (default): the communicating ops (dispatch, combine, broadcast,
        combine_bwd, slot_values, and the send phases ``ll_dispatch_send`` / ``ll_combine_send``)
        run on XLA's compute stream, in program order. An int N: each runs on XLA execution
        stream N as an async op (``jax.experimental.compute_on.compute_on2`` with
        ``"gpu_stream:N"``), which XLA's scheduler overlaps with work that does not depend on it
        (the shared expert, the expert weights' gradients); then fewer ``num_sms`` leave the
        overlapping kernels room. Over NVLink a low-latency send moves the data with its own warps,
        so the two-phase form overlaps work placed between send and receive only this way.
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
    Tuned on H200 (docs/benchmarks.md, tools/ep_tune.py). Limits a kernel has (warps per block) are
    checked where the kernel is chosen, against the values the extension reports.
    """

    num_sms: int | None = None
    dispatch_send_warps: int = 6
    combine_send_warps: int = 8
    broadcast_send_warps: int = 6
    bulk_copy: bool = True
    async_stream: int | None = None
    transport: str = "auto"

    def __post_init__(self):
        if self.transport not in TRANSPORTS:
            raise ValueError(f"KernelConfig.transport must be one of {TRANSPORTS}, got {self.transport!r}")
        for field in dataclasses.fields(self):
            if field.name in ("num_sms", "async_stream") and getattr(self, field.name) is None:
                continue
            if field.name == "transport":
                continue
            if field.name != "bulk_copy":
                _check_positive_int("KernelConfig", field.name, getattr(self, field.name))
        if not isinstance(self.bulk_copy, bool):
            raise ValueError(f"KernelConfig.bulk_copy must be a bool, got {self.bulk_copy!r}")

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
      backend: "auto" (cuda when available, else reference), "reference" (pure JAX), "cuda".
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
        for name in ("num_experts", "num_topk", "hidden", "max_tokens_per_rank", "expert_alignment"):
            _check_positive_int("EPConfig", name, getattr(self, name))
        if not isinstance(self.shrink, bool):
            raise ValueError(f"EPConfig.shrink must be a bool, got {self.shrink!r}")
        if not isinstance(self.kernel, KernelConfig):
            raise ValueError(f"EPConfig.kernel must be a KernelConfig, got {self.kernel!r}")
        if self.num_topk > self.num_experts:
            raise ValueError(f"EPConfig.num_topk={self.num_topk} exceeds num_experts={self.num_experts}")
        if self.capacity is not None:
            if not isinstance(self.capacity, int) or isinstance(self.capacity, bool) or self.capacity < 1:
                raise ValueError(f"EPConfig.capacity must be None or a positive int, got {self.capacity!r}")
            if self.capacity % self.expert_alignment:
                raise ValueError(
                    f"EPConfig.capacity={self.capacity} must be a multiple of "
                    f"expert_alignment={self.expert_alignment}")
        if self.dispatch_dtype not in DISPATCH_DTYPES:
            raise ValueError(f"EPConfig.dispatch_dtype must be one of {DISPATCH_DTYPES}, "
                             f"got {self.dispatch_dtype!r}")
        if self.dispatch_dtype == "float8_e4m3fn" and self.hidden % FP8_BLOCK:
            raise ValueError(f"EPConfig.hidden={self.hidden} must be a multiple of {FP8_BLOCK} "
                             "for dispatch_dtype='float8_e4m3fn'")
        if self.backend not in BACKENDS:
            raise ValueError(f"EPConfig.backend must be one of {BACKENDS}, got {self.backend!r}")
        if not isinstance(self.axis_name, str) or not self.axis_name:
            raise ValueError(f"EPConfig.axis_name must be a non-empty str, got {self.axis_name!r}")

    # ---- derived sizes (ep_size is the size of the mesh axis, known inside shard_map) ----
    def check_ep_size(self, ep_size: int) -> None:
        if self.num_experts % ep_size:
            raise ValueError(f"num_experts={self.num_experts} is not divisible by the EP size "
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
