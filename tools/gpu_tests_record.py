"""GPU test runs as machine-readable records: pytest JUnit XML -> one JSON record per (device, EP size,
process model), merged across parts run in separate device calls.

    python tools/gpu_tests_record.py --junit OUT/gpu_suite_m1a_ep4.xml --part m1a --ep-size 4 \
        --process-model 1 --device "4x NVIDIA H200" --record OUT/gpu_tests_h200x4_ep4_pm1.json

The record (op "gpu_tests") holds each part's counts, failing test ids, duration, commit and date, and the
totals over its parts; running a part again replaces that part's entry. ``--record`` may be an existing
record (e.g. the one in docs/benchmarks/ from an earlier call): it is read and updated. Exits 1 when the
part has failures or errors. The commit is
``$GIT_COMMIT`` when set (the GPU machine's copy of the tree may carry a stale .git), else ``git
rev-parse HEAD``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

COUNTS = ("passed", "failed", "errors", "skipped")


def junit_counts(path: str | Path) -> dict:
    """passed / failed / errors / skipped, the failing test ids and the duration of a JUnit XML file."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    result = {name: 0 for name in COUNTS}
    result["failed_ids"], result["duration_s"] = [], 0.0
    for suite in suites:
        result["duration_s"] += float(suite.get("time", 0) or 0)
        for case in suite.iter("testcase"):
            test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
            if case.find("failure") is not None:
                result["failed"] += 1
                result["failed_ids"].append(test_id)
            elif case.find("error") is not None:
                result["errors"] += 1
                result["failed_ids"].append(test_id)
            elif case.find("skipped") is not None:
                result["skipped"] += 1
            else:
                result["passed"] += 1
    result["duration_s"] = round(result["duration_s"], 1)
    return result


def commit() -> str:
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True, cwd=Path(__file__).resolve().parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def update(record: dict | None, part: str, counts: dict, *, ep_size: int, process_model: int,
           device: str, command: str = "", commit_id: str | None = None, date: str | None = None) -> dict:
    """The record with `part`'s entry set to `counts` (replacing an earlier run of it) and the totals
    recomputed. A record of another EP size, process model or device is refused."""
    record = dict(record or {})
    ident = {"op": "gpu_tests", "ep_size": int(ep_size), "process_model": int(process_model),
             "device": device}
    for key, value in ident.items():
        if key in record and record[key] != value:
            raise ValueError(f"gpu_tests_record: the record is for {key}={record[key]!r}, this part ran with "
                             f"{key}={value!r}")
    record.update(ident)
    parts = dict(record.get("parts", {}))
    parts[part] = {**counts, "commit": commit_id or commit(),
                   "date": date or datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   "command": command}
    record["parts"] = dict(sorted(parts.items()))
    for name in COUNTS:
        record[name] = sum(p[name] for p in parts.values())
    record["failed_ids"] = [i for p in record["parts"].values() for i in p["failed_ids"]]
    record["commits"] = sorted({p["commit"] for p in parts.values()})
    record["date"] = max(p["date"] for p in parts.values())
    return record


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--junit", required=True, help="pytest --junitxml file of the part")
    parser.add_argument("--part", required=True, help="the part's name (e.g. m1a, pg)")
    parser.add_argument("--ep-size", type=int, required=True)
    parser.add_argument("--process-model", type=int, choices=(1, 2), required=True)
    parser.add_argument("--device", required=True, help='e.g. "4x NVIDIA H200"')
    parser.add_argument("--record", required=True, help="JSON record to create or update")
    parser.add_argument("--command", default="", help="the command that ran the part")
    args = parser.parse_args(argv)
    path = Path(args.record)
    old = json.loads(path.read_text()) if path.exists() else None
    record = update(old, args.part, junit_counts(args.junit), ep_size=args.ep_size,
                    process_model=args.process_model, device=args.device, command=args.command)
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"gpu_tests_record: {path}: part {args.part}: " + ", ".join(
        f"{record['parts'][args.part][n]} {n}" for n in COUNTS) + "; record totals: " + ", ".join(
        f"{record[n]} {n}" for n in COUNTS))
    part = record["parts"][args.part]
    return 1 if part["failed"] or part["errors"] else 0  # what pytest's exit code says, from the XML


if __name__ == "__main__":
    sys.exit(main())
