"""What ``backend="auto"`` takes on GPUs: the CUDA kernel of an op where it measured faster than the
reference path, read from ``auto_table.json``.

The table is written from benchmark records (``python -m benchmarks.auto_table ops.json --layer
bench_layer.json``), never by hand: for every op and output layout, the device time of the kernel and
of the reference at each measured shape, token count and EP size, and the decisions derived from them
per measured EP size, ``min_tokens``: the kernel is taken from that many tokens per rank up (0:
always; null: never); where an op was measured with rows of several wire dtypes (the dispatch ops:
bf16 and FP8), ``min_tokens_by_dtype`` holds the same decision per wire dtype, which a call of that
dtype takes (before 2026-12-05 one decision pooled both: the FP8 rank-major dispatch, 1.6-2x faster than
the reference from 512 tokens on one GPU, was never taken because of one bf16 point 3% slower). A
layer step measured slower with the kernels vetoes the communicating ones at
that EP size ("vetoed" says why); one measured faster with every kernel than with this table's choice
takes the layer ops' kernels from its tokens per rank up ("layer_prefers" says why). A call on an EP
size the table has no decision for takes that of the nearest measured multi-GPU size (the largest
below it, else the smallest above); one GPU (EP1, nothing to exchange) only ever takes EP1's own,
since a multi-GPU measurement says nothing about a local permute. An op that is a form of another
(``jax_ep.ops.Op.form_of``: the MoE layer's in-place backward, ``broadcast_in_place`` and
``combine_bwd_in_place``) has an entry of its own where it was timed; on an EP size that entry has no
decision for, the plain op's decides (``decided_by``). It holds for any CUDA GPU; it was measured on
the devices named in the file.

Its section "pull" says where the kernels that can pull their rows (``KernelConfig.dispatch_pull`` and
``broadcast_pull``, None by default) take that form: per knob, the device time of the pushed and of the
pulled kernel at each measured shape, token count, EP size and SM count (separate GPUs only), and per
EP size and SM count ``min_tokens`` as above with the pushed kernel in the reference's place
(``pull_faster``).
"""

from __future__ import annotations

import functools
import json
import pathlib

from jax_ep.errors import EPValueError

TABLE_FILE = pathlib.Path(__file__).with_name("auto_table.json")
LAYOUTS = ("expert_major", "rank_major", "fixed_slots")  # fixed_slots: the low-latency ops


@functools.cache
def table() -> dict:
    """The table as written by the benchmark ({} when the file is absent: no kernel by default)."""
    if not TABLE_FILE.exists():
        return {}
    return json.loads(TABLE_FILE.read_text())


def decision_ep_size(measured: list[int], ep_size: int) -> int | None:
    """Which measured EP size's decision a call on `ep_size` GPUs takes (see the module docstring)."""
    if ep_size in measured:
        return ep_size
    if ep_size < 2:
        return None
    multi = sorted(m for m in measured if m >= 2)
    below = [m for m in multi if m < ep_size]
    return below[-1] if below else (multi[0] if multi else None)


def decided_by(op: str, layout: str, ep_size: int) -> str:
    """Whose entry decides `op` on `ep_size` GPUs. For a form of another op (``jax_ep.ops.Op.form_of``:
    the in-place backward ops) the first of: its own decision measured at that EP size, the plain op's
    measured there (its veto or layer preference included), its own that stands in (decision_ep_size),
    the plain op's that stands in. Any other op: its own."""
    if layout not in LAYOUTS:
        raise EPValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    from jax_ep.ops import OPS  # here: jax_ep.ops reaches this module through the backends

    plain = OPS[op].form_of if op in OPS else None
    if plain is None:
        return op
    for name in (op, plain):
        if ep_size in _decisions(name, layout):
            return name
    return op if decision_ep_size(sorted(_decisions(op, layout)), ep_size) is not None else plain


def _decisions(op: str, layout: str, wire_dtype: str | None = None) -> dict[int, int | None]:
    """{measured EP size: min_tokens} of `op`'s own entry ({} when it has none); those of its rows of
    ``wire_dtype`` where the entry has points of several wire dtypes (``min_tokens_by_dtype``)."""
    entry = table().get("ops", {}).get(op, {}).get(layout)
    if entry is None:
        return {}
    decisions = entry.get("min_tokens_by_dtype", {}).get(wire_dtype, entry["min_tokens"])
    return {int(k): v for k, v in decisions.items()}


def kernel_faster(op: str, layout: str, tokens: int, ep_size: int, wire_dtype: str | None = None) -> bool:
    """Whether the kernel of `op` measured faster than the reference at `tokens` tokens per rank on
    `ep_size` GPUs (or the EP size whose decision stands for it: decision_ep_size; the entry of
    decided_by), with rows of ``wire_dtype`` on the wire where the table decided per wire dtype (the
    dispatch ops' bf16 and FP8 rows: one kernel can win at one and lose at the other), else over all."""
    decisions = _decisions(decided_by(op, layout, ep_size), layout, wire_dtype)
    size = decision_ep_size(sorted(decisions), ep_size)
    return size is not None and decisions[size] is not None and tokens >= decisions[size]


def gpus(n: int) -> str:
    """"1 GPU", "2 GPUs": the EP size in the reasons ``jax_ep.explain`` gives."""
    return f"{n} GPU{'s' if n != 1 else ''}"


def why_taken(op: str, layout: str, tokens: int, ep_size: int, wire_dtype: str | None = None) -> str:
    """What made the table take `op`'s kernel (``kernel_faster`` true) for ``jax_ep.explain``: from how
    many tokens per rank, which entry and measured EP size decided, and whether the op alone measured
    faster or the MoE layer's step did with it (``layer_prefers``: ``min_tokens_ops`` is the op's own)."""
    name = decided_by(op, layout, ep_size)
    decisions = _decisions(name, layout, wire_dtype)
    size = decision_ep_size(sorted(decisions), ep_size)
    entry = table()["ops"][name][layout]
    if wire_dtype in entry.get("min_tokens_by_dtype", {}):
        # the op-alone decisions (min_tokens_ops) are pooled over the wire dtypes: they say nothing here
        what = "it measured faster than the reference, alone or in the MoE layer's step"
    else:
        alone = entry.get("min_tokens_ops", {}).get(str(size), decisions[size])
        what = ("the op measured faster than the reference" if alone is not None and tokens >= alone
                else "the MoE layer's step measured faster with it, the op alone slower (layer_prefers)")
    start = "at every token count" if decisions[size] == 0 else f"from {decisions[size]} tokens per rank"
    return (f"the auto table takes its kernel {start} ("
            + (f"{name}'s entry, " if name != op else "")
            + f"measured on {gpus(size)}" + (f", standing in for {ep_size}" if size != ep_size else "")
            + f"): {what}")


def min_tokens(points: list[dict]) -> int | None:
    """The decision from measured points ({"tokens", "kernel_us", "reference_us"}, any shapes, one EP
    size): the smallest measured token count from which the kernel is at least as fast at every
    measured point with as many tokens or more; 0 when that is every point, None when the kernel
    loses at the largest."""
    counts = sorted({p["tokens"] for p in points})
    best = None
    for tokens in reversed(counts):
        if all(p["kernel_us"] <= p["reference_us"] for p in points if p["tokens"] == tokens):
            best = tokens
        else:
            break
    if best is not None and best == counts[0]:
        return 0
    return best


def pull_faster(knob: str, tokens: int, ep_size: int, num_sms: int) -> bool:
    """Whether the kernels of ``knob`` ("dispatch_pull" or "broadcast_pull") measured at least as fast
    pulling their rows as pushing them at `tokens` tokens per rank on `ep_size` GPUs (or the EP size
    whose decision stands for it: decision_ep_size; never on one GPU, where nothing is pulled) with
    `num_sms` blocks (the decision of the nearest measured SM count)."""
    entry = table().get("pull", {}).get(knob)
    if entry is None or ep_size < 2:
        return False
    decisions = {int(ep): {int(sms): v for sms, v in by_sms.items()}
                 for ep, by_sms in entry["min_tokens"].items()}
    size = decision_ep_size(sorted(decisions), ep_size)
    if size is None or not decisions[size]:
        return False
    by_sms = decisions[size]
    nearest = min(by_sms, key=lambda sms: (abs(sms - num_sms), sms))
    return by_sms[nearest] is not None and tokens >= by_sms[nearest]
