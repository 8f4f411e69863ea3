"""Writes ``jax_ep/auto_table.json`` (what ``backend="auto"`` takes) from benchmark records: per op
and output layout, the device time of the CUDA kernel and of the reference at every shape, token
count and EP size measured, and the decision ``jax_ep.auto_table.min_tokens`` derives from them for
each EP size; and from runs with ``--pull both`` on separate GPUs, where the dispatch and broadcast
kernels pull their rows (section "pull": per EP size and SM count, pushed against pulled, the same
rule). A run replaces the points of each op, layout, wire dtype and EP size it measured (in section
"pull": and SM count) and keeps the table's others (``--replace``: only this run's), so a one-GPU run
and a two-GPU run, or a ``--rank-major`` run and an expert-major one, or a bf16 run and an FP8 one,
each keep their points. Several record files are several runs: where two measured the same point
(combine, timed in the first pass of each ``--dtypes`` split; a pushed and pulled pair alike), the
later file's measurement is taken (running the tool on each file in turn differs: a run replaces every
point of an op, layout, dtype and EP size it measured, at any shape); the same file twice is refused.

The op times are not the last word: users feel the MoE layer's step. Given the layer benchmark's
records too, a layer shape where the step with the EP kernels (``ep_cuda``) is slower than with the
reference EP ops (``ep_reference``) by more than ``LAYER_TIE`` (the run-to-run spread of a step)
vetoes the communicating kernels (every op but the layout) at that EP size: inside a step, XLA
overlaps the reference's NCCL collectives with compute, while the kernels hold its compute stream.
The other way round, a layer shape where the step with every EP kernel (``ep_cuda``) is faster than
with auto's choice (``jax_ep``) by more than ``LAYER_TIE`` makes the kernels of the layer's ops
(``LAYER_OPS``) the choice from that shape's tokens per rank up at that EP size ("layer_prefers"
says why; ``min_tokens_ops`` keeps the ops' own decision): inside a step a reference op's NCCL
collective waits for the peer on the compute stream, which an op timed alone does not show. Since
the preference makes ``jax_ep`` and ``ep_cuda`` the same program, it stays until a layer run at that
EP size measures the kernels slower than auto's choice; re-measured op times do not drop it.

    python -m benchmarks.auto_table ops.json [more_ops.json ...] [--layer bench_layer.json] [--replace]
                                    [--table copy.json]
    python -m benchmarks.auto_table --layer bench_layer.json    (the layer's word on the shipped table)
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


def points_of(records: list[dict]) -> dict[tuple[str, str], list[dict]]:
    """{(op, layout): points} of the records of one run: cuda and reference records of the same op,
    layout, dtype, shape and EP size pair up into a point; unpaired records are ignored. Of cuda records
    at several SM counts (``--num-sms``) the one on the most SMs stands for the kernels (KernelConfig's
    default takes every SM); two records of one backend at one SM count are an error (before 2026-12-05
    the last one in the file won)."""
    keyed = {}
    for r in records:
        # only the ops that have an implementation choice (not e.g. the ll_round_trip composite)
        # (the default kernels only: a run that set the rows pushed or pulled is pull_points_of's)
        if (r.get("measured", True) and r["backend"] in ("cuda", "reference") and _time(r)
                and r["op"] in OPS and _default_transport(r)):
            key = (r["op"], r.get("layout", "expert_major"), r["dtype"], r["tokens_per_rank"], r["hidden"],
                   r["topk"], r["num_experts"], r["ep_size"])
            pair = keyed.setdefault(key, {})
            held = pair.get(r["backend"])
            if held is not None and held.get("num_sms") == r.get("num_sms"):
                raise ValueError(f"two {r['backend']} records of {key} on {r.get('num_sms')} SMs in one "
                                 "run's records: pass each run's records once (runs as files)")
            if held is None or (r.get("num_sms") or 0) > (held.get("num_sms") or 0):
                pair[r["backend"]] = r
    points = collections.defaultdict(list)
    for (op, layout, dtype, tokens, hidden, topk, experts, ep_size), pair in sorted(keyed.items()):
        if len(pair) != 2:
            continue
        points[(op, layout)].append(dict(
            tokens=tokens, dtype=dtype, hidden=hidden, topk=topk, num_experts=experts, ep_size=ep_size,
            kernel_us=round(_time(pair["cuda"]), 1), reference_us=round(_time(pair["reference"]), 1),
            device=pair["cuda"].get("device"), date=pair["cuda"].get("date")))
    return points


def _of_file(points_of_one_run, name: str | None, records: list[dict]):
    """``points_of_one_run(records)`` of the file ``name``; its error names the file."""
    try:
        return points_of_one_run(records)
    except ValueError as e:
        raise ValueError(f"{name}: {e}" if name else str(e)) from None


def points_of_runs(runs: dict[str | None, list[dict]]) -> tuple[dict[tuple[str, str], list[dict]], list[str]]:
    """(points, notes) of several runs' records ({file: records}, in the order given): each file's
    points (points_of; a duplicate inside one file is an error naming it), a point that a later file
    measured again taken from the later file (two runs split by ``--dtypes`` both time combine: before
    2026-12-05 passing them together was refused); notes say which points were taken from which file."""
    merged, notes = _merge_runs(
        runs, points_of,
        lambda group, p: (*group, p["dtype"], p["tokens"], p["hidden"], p["topk"], p["num_experts"],
                          p["ep_size"]),
        lambda k: f"{k[0]} {k[1]} {k[2]} EP{k[7]} {k[3]} tokens per rank")
    points = collections.defaultdict(list)
    for key, pts in sorted(merged.items()):
        points[key[:2]] += pts
    return points, notes


def _merge_runs(runs: dict[str | None, list[dict]], of_one_run, key_of, describe) -> tuple[dict, list[str]]:
    """({key: points}, notes) of several runs' records ({file: records}, in the order given): each file's
    points (``of_one_run``, its errors naming the file) under ``key_of(group, point)``, a key a later file
    measured again taken from the later file; a note (``describe(key)``) says which file's was taken."""
    merged, source, notes = {}, {}, []
    for name, records in runs.items():
        mine = collections.defaultdict(list)   # a list: one run's pull points may differ in send warps
        for group, pts in _of_file(of_one_run, name, records).items():
            for p in pts:
                mine[key_of(group, p)].append(p)
        for key, pts in mine.items():
            if key in merged:
                notes.append(f"{describe(key)}: measured in {source[key]} and {name}; {name}'s taken")
            merged[key], source[key] = pts, name
    return merged, notes


def _default_transport(record) -> bool:
    """Whether the record's kernels ran as KernelConfig's default takes them (``--pull auto``; records
    from before the setting was noted: pushed, the default then)."""
    setting = record.get("pull_setting")
    return setting == "auto" or (setting is None and not record.get("pull"))


# The records that decide each pull knob (KernelConfig.dispatch_pull / broadcast_pull). broadcast: the
# in-place form where the run has it (what the MoE layer runs; the plain op also zeroes every row
# that holds no token, the same work pushed or pulled, which dilutes the difference).
PULL_OPS = {"dispatch_pull": ("dispatch", "dispatch_rank_major"),
            "broadcast_pull": ("broadcast_in_place", "broadcast", "broadcast_rank_major")}


def pull_points_of(records: list[dict]) -> dict[str, list[dict]]:
    """{knob: points} of the records of one run (``python -m benchmarks --pull both``): a cuda record
    with its rows pushed and one pulled of the same op, layout, dtype, shape, EP size, SM count, send
    warps, device and process model pair up into a point (a second record of the same key is an
    error, not a silent pair). Not from one GPU (nothing to pull) nor from processes sharing a GPU
    (``shared_gpu``: the SMs' side only, not the wire)."""
    keyed = {}
    for r in records:
        knob = next((k for k, ops in PULL_OPS.items() if r["op"] in ops), None)
        if (knob is None or r["backend"] != "cuda" or not r.get("measured", True) or not _time(r)
                or r.get("pull_setting") not in ("push", "pull") or r["ep_size"] < 2 or r.get("shared_gpu")):
            continue
        key = (knob, r["op"], r.get("layout", "expert_major"), r["dtype"], r["tokens_per_rank"], r["hidden"],
               r["topk"], r["num_experts"], r["ep_size"], r["num_sms"], r.get("dispatch_send_warps"),
               str(r.get("device")), str(r.get("process_model")))
        pair = keyed.setdefault(key, {})
        if r["pull_setting"] in pair:
            raise ValueError(f"two {r['pull_setting']} records of {key} in one run's records: pass each "
                             "run's records once (runs as files)")
        pair[r["pull_setting"]] = r
    points = collections.defaultdict(list)
    for (knob, op, _, dtype, tokens, hidden, topk, experts, ep_size, sms, *_), pair in sorted(
            keyed.items(), key=lambda item: str(item[0])):
        if len(pair) == 2:
            points[knob].append(dict(
                op=op, tokens=tokens, dtype=dtype, hidden=hidden, topk=topk, num_experts=experts,
                ep_size=ep_size, num_sms=sms, push_us=round(_time(pair["push"]), 1),
                pull_us=round(_time(pair["pull"]), 1), device=pair["pull"].get("device"),
                date=pair["pull"].get("date")))
    return {knob: pts for knob, pts in points.items() if pts}


def _in_place_decides(points: list[dict]) -> list[dict]:
    """broadcast_pull's points less plain broadcast's at each EP size and SM count where the in-place
    form was measured (PULL_OPS says why); applied once, in build_pull, where every run's points and
    the table's meet."""
    in_place = {(p["ep_size"], p["num_sms"]) for p in points if p["op"] == "broadcast_in_place"}
    return [p for p in points if p["op"] != "broadcast" or (p["ep_size"], p["num_sms"]) not in in_place]


def pull_points_of_runs(runs: dict[str | None, list[dict]]) -> tuple[dict[str, list[dict]], list[str]]:
    """(points, notes) of several runs' records ({file: records}, in the order given), as points_of_runs
    for the backends: each file's pull points (pull_points_of; a duplicate inside one file is an error
    naming it), a point that a later file measured again taken from the later file (before 2026-12-05
    every file's records were pooled and such a pair was refused without naming the files)."""
    merged, notes = _merge_runs(
        runs, pull_points_of,
        lambda knob, p: (knob, p["op"], p["dtype"], p["tokens"], p["hidden"], p["topk"], p["num_experts"],
                         p["ep_size"], p["num_sms"]),
        lambda k: f"{k[0]} {k[1]} {k[2]} EP{k[7]} {k[8]} SMs {k[3]} tokens per rank")
    points = collections.defaultdict(list)
    for key, pts in sorted(merged.items(), key=lambda item: str(item[0])):
        points[key[0]] += pts
    return {knob: pts for knob, pts in points.items() if pts}, notes


def _replaced_with(point: dict) -> tuple:
    """What a run's pull point replaces of the table's: the points of its op, wire dtype, EP size and SM
    count (every shape and token count), as build does per op, layout, dtype and EP size."""
    return point["op"], point["dtype"], point["ep_size"], point["num_sms"]


def build_pull(points: dict[str, list[dict]], old: dict | None = None) -> dict:
    """The table's "pull" section from a run's pull points (pull_points_of[_runs]), keeping `old`'s points
    of each knob at the (op, wire dtype, EP size, SM count) the run did not measure for it (before
    2026-12-05: at the EP sizes it did not measure, so a --rank-major run dropped the expert-major
    dispatch's points there): per knob, per EP size and SM count the decision
    ``auto_table.min_tokens`` takes with the pushed kernel in the reference's place (pulled from that
    many tokens per rank up; null: never). Plain broadcast's points, old or new, give way to the
    in-place form's at an EP size and SM count where either run measured it."""
    merged = {knob: list(pts) for knob, pts in points.items()}
    for knob, entry in (old or {}).get("pull", {}).items():
        measured = {_replaced_with(p) for p in points.get(knob, [])}
        merged.setdefault(knob, []).extend(p for p in entry["points"] if _replaced_with(p) not in measured)
    if "broadcast_pull" in merged:   # a plain broadcast of any run or of the table meets any in-place form
        merged["broadcast_pull"] = _in_place_decides(merged["broadcast_pull"])
    section = {}
    for knob, pts in sorted(merged.items()):
        if not pts:
            continue
        pts.sort(key=lambda p: (p["ep_size"], p["num_sms"], p["tokens"], p["op"], p["dtype"]))
        decisions = {}
        for ep, sms in sorted({(p["ep_size"], p["num_sms"]) for p in pts}):
            mine = [dict(p, kernel_us=p["pull_us"], reference_us=p["push_us"]) for p in pts
                    if (p["ep_size"], p["num_sms"]) == (ep, sms)]
            decisions.setdefault(str(ep), {})[str(sms)] = auto_table.min_tokens(mine)
        section[knob] = {"ops": list(PULL_OPS[knob]), "min_tokens": decisions, "points": pts}
    return section


def _op_points(ops: dict) -> list[dict]:
    """Every point of the table's "ops" section."""
    return [p for layouts in ops.values() for entry in layouts.values() for p in entry["points"]]


def measured_on(points: list[dict]) -> dict[str, list[str]]:
    """{EP size: the devices and dates its points were measured on}."""
    devices = collections.defaultdict(set)
    for p in points:
        devices[str(p["ep_size"])].add(f"{p.get('device')} ({p.get('date')})")
    return {e: sorted(d) for e, d in sorted(devices.items())}


def build(points: dict[tuple[str, str], list[dict]], old: dict | None = None) -> dict:
    """The table from the points of one run (points_of; extended in place), keeping `old`'s points of
    each op and layout at the wire dtypes and EP sizes the run did not measure for it (before
    2026-12-05 a run measuring one op at an EP size dropped every other op's points there)."""
    for op, layouts in (old or {}).get("ops", {}).items():
        for layout, entry in layouts.items():
            measured = {(p["dtype"], p["ep_size"]) for p in points.get((op, layout), [])}
            points[(op, layout)] += [p for p in entry["points"] if (p["dtype"], p["ep_size"]) not in measured]
    ops = {}
    for (op, layout), pts in sorted(points.items()):
        if not pts:
            continue
        pts.sort(key=lambda p: (p["ep_size"], p["tokens"], p["dtype"], p["num_experts"]))
        sizes = sorted({p["ep_size"] for p in pts})
        entry = ops.setdefault(op, {})[layout] = {
            "min_tokens": {str(e): auto_table.min_tokens([p for p in pts if p["ep_size"] == e])
                           for e in sizes},
            "points": pts}
        dtypes = sorted({p["dtype"] for p in pts})
        if len(dtypes) > 1:   # a decision per wire dtype, at the EP sizes that dtype was measured on
            entry["min_tokens_by_dtype"] = {
                d: {str(e): auto_table.min_tokens(mine) for e in sizes
                    if (mine := [p for p in pts if p["ep_size"] == e and p["dtype"] == d])}
                for d in dtypes}
    return {
        "written_by": "python -m benchmarks.auto_table",
        "date": datetime.date.today().isoformat(),
        "measured_on": measured_on(_op_points(ops)),
        "time": "device µs per call (the sum of the op's kernels on GPU 0) where profiled, else wall",
        "ops": ops,
    }


# A layer step differs by up to ~1.5% between repeats of one run (2x H200): a tie is no veto.
LAYER_TIE = 0.02
# The ops of the MoE layer's training step (expert-major): those a layer measurement speaks for.
LAYER_OPS = tuple(name for name, op in OPS.items() if op.layout == "expert_major")


def _layer_steps(layer_records: list[dict]) -> dict[tuple[str, str, int], dict]:
    return {(r["shape"], r["config"], r["ep_size"]): r for r in layer_records
            if r.get("op") != "moe_layer_decode" and r.get("step_ms")}


def layer_vetoes(layer_records: list[dict]) -> tuple[dict[str, str], set[str]]:
    """({EP size: why the layer benchmark vetoes the communicating kernels there}, {EP sizes where a layer
    shape was measured with the EP kernels and with the reference ops})."""
    steps = {key: r["step_ms"] for key, r in _layer_steps(layer_records).items()}
    vetoes, compared = {}, set()
    for (shape, config, ep_size), cuda_ms in sorted(steps.items()):
        reference_ms = steps.get((shape, "ep_reference", ep_size))
        if config != "ep_cuda" or reference_ms is None:
            continue
        compared.add(str(ep_size))
        if cuda_ms > reference_ms * (1 + LAYER_TIE):
            vetoes.setdefault(str(ep_size), (
                f"layer step {shape}, EP{ep_size}: {cuda_ms:.2f} ms with the EP kernels (ep_cuda) > "
                f"{reference_ms:.2f} ms with the reference EP ops (ep_reference)"))
    return vetoes, compared


def layer_preferences(layer_records: list[dict]) -> tuple[dict[str, dict], set[str]]:
    """({EP size: {"tokens": from how many tokens per rank the layer wants the kernels, "why": ...}},
    {EP sizes where a layer shape measured the kernels slower than auto's choice: no preference})."""
    steps = _layer_steps(layer_records)
    prefers, against = {}, set()
    for (shape, config, ep_size), cuda in sorted(steps.items()):
        auto = steps.get((shape, "jax_ep", ep_size))
        if config != "ep_cuda" or auto is None:
            continue
        ep, tokens = str(ep_size), cuda["tokens_per_rank"]
        if cuda["step_ms"] > auto["step_ms"] * (1 + LAYER_TIE):
            against.add(ep)
        elif auto["step_ms"] > cuda["step_ms"] * (1 + LAYER_TIE) and (
                ep not in prefers or tokens < prefers[ep]["tokens"]):
            prefers[ep] = dict(tokens=tokens, why=(
                f"layer step {shape}, EP{ep_size}, {tokens} tokens per rank: {cuda['step_ms']:.2f} ms with "
                f"every EP kernel (ep_cuda) < {auto['step_ms']:.2f} ms with auto's choice (jax_ep), "
                f"{cuda.get('device')} {cuda.get('date')}"))
    for ep in against:
        prefers.pop(ep, None)
    return prefers, against


def write(records: list[dict] | dict[str, list[dict]], path: pathlib.Path = auto_table.TABLE_FILE,
          layer_records: list[dict] | None = None, replace: bool = False, rederive: bool = False) -> dict:
    """The table from a run's records, or several runs' ({file: records}, points_of_runs; see the module
    docstring); ``rederive``: no records, the table's own points decided again (after a change of the
    rule), its vetoes and preferences kept."""
    runs = records if isinstance(records, dict) else {None: records}
    points, _ = points_of_runs(runs)
    pulled, _ = pull_points_of_runs(runs)
    measured = {str(p["ep_size"]) for pts in points.values() for p in pts}
    if not measured and not pulled and not layer_records and not rederive:
        raise ValueError("no op has both a cuda and a reference record, nor a pushed and a pulled one: "
                         "nothing to decide")
    prior = json.loads(path.read_text()) if path.exists() else None
    # --replace drops what the table held of the sections this run measured (a run of pushed and
    # pulled records alone keeps the backends' decisions, and the other way round)
    old = None if replace and (measured or not pulled) else prior
    table = build(points, old)
    pull = build_pull(pulled, None if replace and pulled else prior)
    if pull:
        table["pull"] = pull
        table["measured_on"] = measured_on(_op_points(table["ops"])
                                           + [p for entry in pull.values() for p in entry["points"]])
    vetoes, compared = layer_vetoes(layer_records or [])
    # a veto stays until a layer run measures the EP kernels' step again at that EP size (op timings cannot
    # show the in-step effect; before 2026-12-05 an ops-only run lifted it and a layer-only run kept it)
    for ep, why in (prior or {}).get("vetoed", {}).items():
        if ep not in compared:
            vetoes.setdefault(ep, why)
    prefers, against = layer_preferences(layer_records or [])
    # a preference stays until a layer run measures the kernels slower there (see the docstring), as a
    # veto does: read from the table before this run, --replace or not (before 2026-12-05 --replace
    # dropped the preferences and kept the vetoes)
    for ep, pref in (prior or {}).get("layer_prefers", {}).items():
        if ep not in against:
            prefers.setdefault(ep, pref)
    prefers = {ep: pref for ep, pref in prefers.items() if ep not in vetoes}
    if vetoes:
        table["vetoed"] = vetoes
    if prefers:
        table["layer_prefers"] = prefers
    for op, layouts in table["ops"].items():
        for entry in layouts.values():
            # the layer's word applies to every decision of the entry: pooled and per wire dtype (the
            # pooled one's own decision kept in min_tokens_ops where it changes)
            decisions = [entry["min_tokens"], *entry.get("min_tokens_by_dtype", {}).values()]
            for ep in set(entry["min_tokens"]) & set(vetoes):
                if op != "layout":
                    entry.setdefault("min_tokens_ops", {})[ep] = entry["min_tokens"][ep]
                    for d in decisions:
                        if ep in d:
                            d[ep] = None
            for ep in set(entry["min_tokens"]) & set(prefers):
                tokens, pooled = prefers[ep]["tokens"], entry["min_tokens"][ep]
                if op not in LAYER_OPS:
                    continue
                if pooled is None or pooled > tokens:
                    entry.setdefault("min_tokens_ops", {})[ep] = pooled
                for d in decisions:
                    if ep in d and (d[ep] is None or d[ep] > tokens):
                        d[ep] = tokens
    path.write_text(json.dumps(table, indent=1) + "\n")
    return table


def main(argv=None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m benchmarks.auto_table", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ops", nargs="*", help="record files of python -m benchmarks --profile (cuda and "
                        "reference), e.g. the sweep and the low-latency run; none: only --layer's word "
                        "on the shipped table")
    parser.add_argument("--layer", help="records of python -m benchmarks --layer")
    parser.add_argument("--replace", action="store_true",
                        help="drop the table's points this run did not measure (default: keep those of "
                             "the ops, layouts, wire dtypes and EP sizes, and pull SM counts, it did not "
                             "measure)")
    parser.add_argument("--rederive", action="store_true",
                        help="no records: decide the table's own points again (after a change of the rule)")
    parser.add_argument("--table", default=str(auto_table.TABLE_FILE),
                        help="the table to update (default: the shipped one, jax_ep/auto_table.json); "
                             "a copy elsewhere shows a run's decisions without changing it")
    args = parser.parse_args(argv)
    if not args.ops and not args.layer and not args.rederive:
        parser.error("give op record files, --layer, or both (or --rederive)")
    if args.replace and not args.ops:
        parser.error("--replace drops the table's points: it needs op record files")

    def load(option: str, f: str) -> list[dict]:
        """The records of file `f`, or a parser error naming the option and the file (not a traceback)."""
        try:
            records = json.loads(pathlib.Path(f).read_text())
        except (OSError, ValueError) as e:
            parser.error(f"{option} {f}: {e}")
        if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
            parser.error(f"{option} {f}: not a JSON list of benchmark records")
        return records

    runs = {}
    for f in args.ops:
        if pathlib.Path(f).resolve() in {pathlib.Path(g).resolve() for g in runs}:
            parser.error(f"ops: {f} given twice: pass each run's records once")
        runs[f] = load("ops", f)
        if any("backend" not in r for r in runs[f]):
            parser.error(f"ops {f}: records without a backend, not those of python -m benchmarks (the layer "
                         "benchmark's records go to --layer)")
    layer = load("--layer", args.layer) if args.layer else None
    path = pathlib.Path(args.table)
    try:
        notes = points_of_runs(runs)[1] + pull_points_of_runs(runs)[1]
    except ValueError as e:   # a duplicate inside one file (the message names it)
        parser.error(f"ops {e}")
    copied = path != auto_table.TABLE_FILE and not path.exists() and auto_table.TABLE_FILE.exists()
    if copied:
        path.write_text(auto_table.TABLE_FILE.read_text())   # a copy of the shipped table, updated
    try:
        table = write(runs, path, layer_records=layer, replace=args.replace, rederive=args.rederive)
    except ValueError as e:   # e.g. no cuda and reference pair: nothing to decide
        if copied:
            path.unlink()     # no copy left behind that this run did not update
        parser.error(f"ops {' '.join(args.ops)}: {e}" if args.ops else str(e))
    for note in notes:
        print(note)
    for op, layouts in table["ops"].items():
        for layout, entry in layouts.items():
            for ep, tokens in entry["min_tokens"].items():
                print(f"{op} {layout} EP{ep}: kernel from {tokens} tokens per rank")
            for dtype, decisions in entry.get("min_tokens_by_dtype", {}).items():
                for ep, tokens in decisions.items():
                    print(f"{op} {layout} EP{ep} {dtype}: kernel from {tokens} tokens per rank")
    for knob, entry in table.get("pull", {}).items():
        for ep, by_sms in entry["min_tokens"].items():
            for sms, tokens in by_sms.items():
                when = "never" if tokens is None else f"from {tokens} tokens per rank"
                print(f"{knob} EP{ep} {sms} SMs: pulled {when}")
    if "vetoed" in table:
        print(f"vetoed: {table['vetoed']}")
    if "layer_prefers" in table:
        print(f"layer prefers the kernels: {table['layer_prefers']}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
