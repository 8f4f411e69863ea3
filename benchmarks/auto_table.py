"""Writes ``jax_ep/auto_table.json`` (what ``backend="auto"`` takes) from benchmark records: per op
and output layout, the device time of the CUDA kernel and of the reference at every shape and token
count measured in the run, and the decision ``jax_ep.auto_table.min_tokens`` derives from them."""

from __future__ import annotations

import collections
import datetime
import json
import pathlib

from jax_ep import auto_table


def _time(record) -> float | None:
    return record.get("device_us") or record.get("us")


def build(records: list[dict]) -> dict:
    """The table from the records of one run (cuda and reference records of the same op, layout,
    dtype and shape pair up into points; unpaired records are ignored)."""
    keyed = {}
    for r in records:
        if r.get("measured", True) and r["backend"] in ("cuda", "reference") and _time(r):
            key = (r["op"], r.get("layout", "expert_major"), r["dtype"], r["tokens_per_rank"], r["hidden"],
                   r["topk"], r["num_experts"], r["ep_size"])
            keyed.setdefault(key, {})[r["backend"]] = r
    points = collections.defaultdict(list)
    devices = set()
    for (op, layout, dtype, tokens, hidden, topk, experts, ep_size), pair in sorted(keyed.items()):
        if len(pair) != 2:
            continue
        devices.add(pair["cuda"].get("device"))
        points[(op, layout)].append(dict(
            tokens=tokens, dtype=dtype, hidden=hidden, topk=topk, num_experts=experts, ep_size=ep_size,
            kernel_us=round(_time(pair["cuda"]), 1), reference_us=round(_time(pair["reference"]), 1)))
    ops = {}
    for (op, layout), pts in sorted(points.items()):
        ops.setdefault(op, {})[layout] = {"min_tokens": auto_table.min_tokens(pts), "points": pts}
    return {
        "written_by": "python -m benchmarks --write-auto-table",
        "date": datetime.date.today().isoformat(),
        "measured_on": sorted(str(d) for d in devices),
        "time": "device µs per call (the sum of the op's kernels on GPU 0) where profiled, else wall",
        "ops": ops,
    }


def write(records: list[dict], path: pathlib.Path = auto_table.TABLE_FILE) -> dict:
    table = build(records)
    if not table["ops"]:
        raise ValueError("no op has both a cuda and a reference record: nothing to decide")
    path.write_text(json.dumps(table, indent=1) + "\n")
    return table
