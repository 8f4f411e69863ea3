"""Writes ``jax_ep/auto_table.json`` (what ``backend="auto"`` takes) from benchmark records: per op
and output layout, the device time of the CUDA kernel and of the reference at every shape and token
count measured in the run, and the decision ``jax_ep.auto_table.min_tokens`` derives from them.

The op times are not the last word: users feel the MoE layer's step. Given the layer benchmark's
records too, a layer shape where the step with the EP kernels (``ep_cuda``) is slower than with the
reference EP ops (``ep_reference``) by more than ``LAYER_TIE`` (the run-to-run spread of a step)
vetoes the communicating kernels (every op but the layout): inside a step, XLA overlaps the
reference's NCCL collectives with compute, while the kernels hold its compute stream.

    python -m benchmarks.auto_table ops.json [more_ops.json ...] [--layer bench_layer.json]
"""

from __future__ import annotations

import collections
import datetime
import json
import pathlib

from jax_ep import auto_table
from jax_ep.ops import OPS


def _time(record) -> float | None:
    return record.get("device_us") or record.get("us")


def build(records: list[dict]) -> dict:
    """The table from the records of one run (cuda and reference records of the same op, layout,
    dtype and shape pair up into points; unpaired records are ignored)."""
    keyed = {}
    for r in records:
        # only the ops that have an implementation choice (not e.g. the ll_round_trip composite)
        if (r.get("measured", True) and r["backend"] in ("cuda", "reference") and _time(r)
                and r["op"] in OPS):
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
        "written_by": "python -m benchmarks.auto_table",
        "date": datetime.date.today().isoformat(),
        "measured_on": sorted(str(d) for d in devices),
        "time": "device µs per call (the sum of the op's kernels on GPU 0) where profiled, else wall",
        "ops": ops,
    }


# A layer step differs by up to ~1.5% between repeats of one run (2x H200): a tie is no veto.
LAYER_TIE = 0.02


def layer_veto(layer_records: list[dict]) -> str | None:
    """Why the layer benchmark vetoes the communicating kernels, or None."""
    steps = {(r["shape"], r["config"]): r.get("step_ms") for r in layer_records}
    for (shape, config), cuda_ms in sorted(steps.items()):
        reference_ms = steps.get((shape, "ep_reference"))
        if config == "ep_cuda" and cuda_ms and reference_ms and cuda_ms > reference_ms * (1 + LAYER_TIE):
            return (f"layer step {shape}: {cuda_ms:.2f} ms with the EP kernels (ep_cuda) > "
                    f"{reference_ms:.2f} ms with the reference EP ops (ep_reference)")
    return None


def write(records: list[dict], path: pathlib.Path = auto_table.TABLE_FILE,
          layer_records: list[dict] | None = None) -> dict:
    table = build(records)
    veto = layer_veto(layer_records or [])
    if veto is not None:
        table["vetoed"] = veto
        for op, layouts in table["ops"].items():
            for entry in layouts.values():
                if op != "layout":
                    entry["min_tokens_ops"] = entry["min_tokens"]
                    entry["min_tokens"] = None
    if not table["ops"]:
        raise ValueError("no op has both a cuda and a reference record: nothing to decide")
    path.write_text(json.dumps(table, indent=1) + "\n")
    return table


def main(argv=None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m benchmarks.auto_table", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ops", nargs="+", help="record files of python -m benchmarks --profile (cuda and "
                        "reference), e.g. the sweep and the low-latency run")
    parser.add_argument("--layer", help="records of python -m benchmarks --layer")
    args = parser.parse_args(argv)
    records = [r for f in args.ops for r in json.loads(pathlib.Path(f).read_text())]
    layer = json.loads(pathlib.Path(args.layer).read_text()) if args.layer else None
    table = write(records, layer_records=layer)
    for op, layouts in table["ops"].items():
        for layout, entry in layouts.items():
            print(f"{op} {layout}: kernel from {entry['min_tokens']} tokens per rank")
    if "vetoed" in table:
        print(f"vetoed: {table['vetoed']}")
    print(f"wrote {auto_table.TABLE_FILE}")


if __name__ == "__main__":
    main()
