"""GPU test runs as machine-readable records: pytest JUnit XML -> one JSON record per (device, EP size,
process model), merged across parts run in separate device calls.

    python tools/gpu_tests_record.py --junit OUT/gpu_suite_m1a_ep4.xml --log OUT/gpu_suite_m1a_ep4.log \
        --rc 0 --part m1a --ep-size 4 --process-model 1 --device "4x NVIDIA H200" \
        --record OUT/gpu_tests_h200x4_ep4_pm1.json
    python tools/gpu_tests_record.py --merge OUT/gpu_tests_*.json --into docs/benchmarks

The record (op "gpu_tests") holds each part's counts, failing test ids (pytest node ids), skipped test
ids with their reasons (``skipped_ids``), the collected / deselected counts when the log shows them,
duration, seconds per test file, commit, date and command, and the totals over its parts; running a
part again replaces that part's entry. ``--repeat`` numbers the part instead (``pgrep_off`` ->
``pgrep_off_3`` after ``_1`` and ``_2``), so that repeated runs accumulate; the record's ``repeats``
counts them per setting. A part cut short (``--rc`` 124/137: timeout; or no JUnit XML) is ``incomplete``
and names the test it was cut in (``cut_in``, from pytest -v's ``--log``); with no XML its counts come
from that log. A part that did not start (another rc and no XML: an import or usage error) or that
pytest interrupted (a collection error: "Interrupted:" in the log) is ``incomplete`` too, saying so in
``note``. ``--record`` may be an existing record: it is read and updated. ``--merge`` folds records
(e.g. those a device call returned) into the records of the same name under ``--into``. Exits 1 when
the part has failures or errors, was cut, did not start, ended with an rc other than 0, or passed no
test (one whose every test skipped, e.g. without the CUDA extension, is no pass). The commit is
``$GIT_COMMIT`` when set (the GPU machine's copy of the tree may carry a stale .git or none), else
``git rev-parse HEAD`` with "+changes" when the tracked files differ from it, else "unknown".
``--passed XML...`` prints how many tests those files passed in all (gpu_check.sh's SHARE_GPU check).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

COUNTS = ("passed", "failed", "errors", "skipped")
TIMEOUT_RCS = (124, 137)
# pytest -v: "tests/gpu/test_x_gpu.py::test_y[a-b] PASSED    [ 10%]"; a test still running when the
# run was cut has its id and nothing after it
LOG_OUTCOME = re.compile(r"^(\S+\.py::\S.*?) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)(?: (.*))?$")
# the reason pytest -v prints after SKIPPED, before the progress: "SKIPPED (needs 4 GPUs)     [  3%]"
LOG_REASON = re.compile(r"^\((.*)\)(?:\s+\[\s*\d+%\])?$")
# "collected 422 items / 3 deselected / 419 selected"
LOG_COLLECTED = re.compile(r"collected (\d+) items?(?: / (\d+) deselected)?")
LOG_START = re.compile(r"^(\S+\.py::\S.*?)\s*$")
REPEAT = re.compile(r"^(.*)_(\d+)$")


def node_id(case: ET.Element) -> str:
    """pytest's node id of a JUnit testcase: classname tests.gpu.test_x_gpu[.Class] ->
    tests/gpu/test_x_gpu.py[::Class]::name. A collection error has no classname and the module as its name
    (tests.gpu.test_x_gpu -> tests/gpu/test_x_gpu.py)."""
    if not case.get("classname"):
        return case.get("name", "").replace(".", "/") + ".py"
    parts = case.get("classname", "").split(".")
    module = (i + 1 for i, p in enumerate(parts) if p.startswith("test_") or p.endswith("_test"))
    split = next(module, len(parts))
    path = "/".join(parts[:split]) + ".py"
    return "::".join([path, *parts[split:], case.get("name", "")])


def empty_counts() -> dict:
    return {**{name: 0 for name in COUNTS}, "failed_ids": [], "skipped_ids": {}, "duration_s": 0.0,
            "file_seconds": {}}


def junit_counts(path: str | Path) -> dict:
    """passed / failed / errors / skipped, the failing test ids, the skipped ones with their reasons, the
    duration and the seconds per test file of a JUnit XML file."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    result = empty_counts()
    for suite in suites:
        result["duration_s"] += float(suite.get("time", 0) or 0)
        for case in suite.iter("testcase"):
            if not case.get("name"):  # pytest writes a nameless one for the test a Ctrl-C cut
                continue
            test_id = node_id(case)
            file = test_id.split("::")[0]
            seconds = float(case.get("time", 0) or 0)
            result["file_seconds"][file] = result["file_seconds"].get(file, 0.0) + seconds
            if case.find("failure") is not None:
                result["failed"] += 1
                result["failed_ids"].append(test_id)
            elif case.find("error") is not None:
                result["errors"] += 1
                result["failed_ids"].append(test_id)
            elif (skip := case.find("skipped")) is not None:
                result["skipped"] += 1
                result["skipped_ids"][test_id] = skip.get("message", "")
            else:
                result["passed"] += 1
    result["duration_s"] = round(result["duration_s"], 1)
    result["file_seconds"] = {f: round(s, 1) for f, s in sorted(result["file_seconds"].items())}
    return result


def log_outcomes(path: str | Path,
                 reasons: dict[str, str] | None = None) -> tuple[dict[str, str], str | None]:
    """From a pytest -v log: each test's last outcome, and the test that started last without one (the
    one a cut ended), or None. `reasons` gets the skipped tests' reasons."""
    outcomes: dict[str, str] = {}
    started: list[str] = []
    for line in Path(path).read_text(errors="replace").splitlines():
        if m := LOG_OUTCOME.match(line.rstrip()):
            test, outcome = m.group(1), m.group(2)
            # a teardown error comes after PASSED: the test counts as an error
            outcomes[test] = "ERROR" if outcomes.get(test) == "ERROR" else outcome
            if outcome == "SKIPPED" and reasons is not None:
                reason = LOG_REASON.match((m.group(3) or "").strip())
                reasons[test] = reason.group(1) if reason else ""
        elif m := LOG_START.match(line):
            started.append(m.group(1))
    cut = next((t for t in reversed(started) if t not in outcomes), None)
    return outcomes, cut


def log_collected(path: str | Path) -> dict:
    """pytest's "collected N items / M deselected" as {"collected": N, "deselected": M}, or {}; and
    "interrupted": pytest's reason when it stopped the run (a collection error)."""
    result: dict = {}
    for line in Path(path).read_text(errors="replace").splitlines():
        if "collected" not in result and (m := LOG_COLLECTED.search(line)):
            result["collected"] = int(m.group(1))
            result["deselected"] = int(m.group(2) or 0)
        if "Interrupted: " in line and line.lstrip().startswith("!"):
            result["interrupted"] = line.split("Interrupted: ", 1)[1].strip(" !")
    return result


def log_counts(path: str | Path) -> dict:
    """junit_counts' fields from a pytest -v log (when the JUnit XML is missing)."""
    result = empty_counts()
    reasons: dict[str, str] = {}
    outcomes, _ = log_outcomes(path, reasons)
    for test, outcome in outcomes.items():
        key = {"PASSED": "passed", "XPASS": "passed", "FAILED": "failed", "ERROR": "errors"}.get(outcome,
                                                                                                 "skipped")
        result[key] += 1
        if key in ("failed", "errors"):
            result["failed_ids"].append(test)
        elif key == "skipped":
            result["skipped_ids"][test] = reasons.get(test, outcome.lower())
    return result


def part_counts(junit: str | Path | None, log: str | Path | None = None, rc: int | None = None) -> dict:
    """A part's counts: from the JUnit XML when there is one, else from the log; a timeout's rc or a
    missing XML marks it incomplete, naming the test it was cut in when the log shows it (a part with
    another rc and no XML did not start: "note" says so); pytest's own interruption (a collection error)
    marks it incomplete too. The log's collected / deselected counts are added when it has them."""
    have_xml = junit is not None and Path(junit).is_file() and Path(junit).stat().st_size > 0
    have_log = log is not None and Path(log).is_file()
    if have_xml:
        try:
            counts = junit_counts(junit)
        except ET.ParseError:
            have_xml, counts = False, empty_counts()
    if not have_xml:
        counts = log_counts(log) if have_log else empty_counts()
    if rc is not None:
        counts["rc"] = rc
    collected = log_collected(log) if have_log else {}
    interrupted = collected.pop("interrupted", None)
    counts.update(collected)
    if not have_xml and rc not in (None, 0, *TIMEOUT_RCS):
        counts["incomplete"] = True
        counts["note"] = f"did not start (rc {rc})"
    elif not have_xml or rc in TIMEOUT_RCS:
        counts["incomplete"] = True
        counts["cut_in"] = log_outcomes(log)[1] if have_log else None
    elif interrupted:
        counts["incomplete"] = True
        counts["note"] = f"interrupted: {interrupted}"
    if rc == 5 and "note" not in counts:
        counts["note"] = "no tests collected (rc 5)"
    return counts


def failure(part: dict) -> str | None:
    """Why the part fails beyond its failing tests (which its counts show), or None."""
    if part.get("note"):
        return part["note"]
    if part.get("incomplete"):
        return f"cut in {part.get('cut_in')}"
    if part.get("failed") or part.get("errors"):
        return None
    if part.get("rc") not in (None, 0):
        return f"rc {part['rc']}"
    if not part.get("passed"):
        return "none passed"
    return None


def fails(part: dict) -> bool:
    return bool(part.get("failed") or part.get("errors") or failure(part))


TOOLS = Path(__file__).resolve().parent


def commit(repo: Path = TOOLS) -> str:
    """$GIT_COMMIT, else the checkout's HEAD with "+changes" when its tracked files differ from it (a GPU
    machine's copy of the tree next to a stale .git: 2026-12-01, a record named the commit before the
    one that ran), else "unknown"."""
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=repo).stdout.strip()
        changed = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], capture_output=True,
                                 cwd=repo).returncode != 0
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return (head + "+changes" * changed) or "unknown"


def next_repeat(parts: dict, base: str) -> str:
    """base_<n>, n one more than the highest of base's numbered parts."""
    taken = [int(m.group(2)) for name in parts if (m := REPEAT.match(name)) and m.group(1) == base]
    return f"{base}_{max(taken, default=0) + 1}"


def summarize(record: dict) -> dict:
    """The totals, failing ids, commits, date, duration and repeat counts over the record's parts."""
    parts = record["parts"] = dict(sorted(record.get("parts", {}).items()))
    for name in COUNTS:
        record[name] = sum(p.get(name, 0) for p in parts.values())
    record["failed_ids"] = [i for p in parts.values() for i in p.get("failed_ids", [])]
    record["incomplete"] = sorted(n for n, p in parts.items() if p.get("incomplete"))
    record["commits"] = sorted({p["commit"] for p in parts.values()})
    latest = max(parts.values(), key=lambda p: p["date"]) if parts else {}
    record["commit"] = latest.get("commit")
    record["date"] = latest.get("date")
    record["duration_s"] = round(sum(p.get("duration_s", 0.0) for p in parts.values()), 1)
    repeats: dict[str, dict] = {}
    for name, p in parts.items():
        m = re.match(r"^pgrep_(on|off)_\d+$", name)
        if m:
            r = repeats.setdefault(f"shard_autotuning_{m.group(1)}", {"runs": 0, "passed": 0, "failed": 0})
            r["runs"] += 1
            r["failed" if fails(p) else "passed"] += 1
    if repeats:
        record["repeats"] = dict(sorted(repeats.items()))
    else:
        record.pop("repeats", None)
    return record


def check_ident(record: dict, ident: dict) -> None:
    for key, value in ident.items():
        if key in record and record[key] != value:
            raise ValueError(f"gpu_tests_record: the record is for {key}={record[key]!r}, this part ran with "
                             f"{key}={value!r}")


def update(record: dict | None, part: str, counts: dict, *, ep_size: int, process_model: int,
           device: str, command: str = "", commit_id: str | None = None, date: str | None = None,
           repeat: bool = False) -> dict:
    """The record with `part`'s entry set to `counts` (replacing an earlier run of it; with `repeat`, as
    the next numbered run part_<n>) and the totals recomputed. A record of another EP size, process
    model or device is refused."""
    record = dict(record or {})
    ident = {"op": "gpu_tests", "ep_size": int(ep_size), "process_model": int(process_model),
             "device": device}
    check_ident(record, ident)
    record.update(ident)
    parts = dict(record.get("parts", {}))
    name = next_repeat(parts, part) if repeat else part
    parts[name] = {**counts, "commit": commit_id or commit(),
                   "date": date or datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   "command": command}
    record["parts"] = parts
    record["last_part"] = name
    return summarize(record)


def merge(into: dict | None, other: dict) -> dict:
    """`other`'s parts folded into `into`: a part of the same name and run (commit and date) is replaced,
    a numbered repeat of another run gets the next free number, any other part of the same name is
    replaced by the later of the two."""
    record = dict(into or {})
    ident = {k: other[k] for k in ("op", "ep_size", "process_model", "device")}
    check_ident(record, ident)
    record.update(ident)
    parts = dict(record.get("parts", {}))
    for name, part in sorted(other.get("parts", {}).items(), key=lambda kv: kv[1]["date"]):
        old = parts.get(name)
        same_run = old is not None and (old["commit"], old["date"]) == (part["commit"], part["date"])
        m = REPEAT.match(name)
        if old is None or same_run:
            parts[name] = part
        elif m:   # any --repeat part, not only pgrep_on/off (before 2026-12-05 others overwrote each other)
            if not any((p["commit"], p["date"]) == (part["commit"], part["date"])
                       for n, p in parts.items() if (r := REPEAT.match(n)) and r.group(1) == m.group(1)):
                parts[next_repeat(parts, m.group(1))] = part
        elif part["date"] >= old["date"]:
            parts[name] = part
    record["parts"] = parts
    record.pop("last_part", None)
    return summarize(record)


ORDER = ("op", "ep_size", "process_model", "device", "commit", "commits", "date", *COUNTS, "failed_ids",
         "incomplete", "repeats", "duration_s", "parts")


def write(path: Path, record: dict) -> None:
    """The record as JSON: the totals first, then the parts."""
    first = {k: record[k] for k in ORDER if k in record}
    record = first | {k: v for k, v in record.items() if k not in ORDER}
    path.write_text(json.dumps(record, indent=1) + "\n")


def totals(record: dict) -> str:
    return ", ".join(f"{record[n]} {n}" for n in COUNTS)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--junit", help="pytest --junitxml file of the part")
    parser.add_argument("--log", help="pytest -v log of the part (the test a cut ended; counts without XML)")
    parser.add_argument("--rc", type=int, help="the part's exit code (124/137: cut by its timeout)")
    parser.add_argument("--part", help="the part's name (e.g. m1a, pga)")
    parser.add_argument("--repeat", action="store_true", help="record as the next numbered run: PART_<n>")
    parser.add_argument("--ep-size", type=int)
    parser.add_argument("--process-model", type=int, choices=(1, 2))
    parser.add_argument("--device", help='e.g. "4x NVIDIA H200"')
    parser.add_argument("--record", help="JSON record to create or update")
    parser.add_argument("--command", default="", help="the command that ran the part")
    parser.add_argument("--merge", nargs="+", metavar="RECORD", help="records to fold into --into")
    parser.add_argument("--into", help="folder of the records to update (e.g. docs/benchmarks)")
    parser.add_argument("--passed", nargs="*", metavar="JUNIT",
                        help="print how many tests these JUnit XML files passed in all (missing files: 0)")
    args = parser.parse_args(argv)
    if args.passed is not None:
        print(sum(junit_counts(p)["passed"] for p in args.passed if Path(p).is_file()))
        return 0
    if args.merge:
        if not args.into:
            parser.error("--merge needs --into")
        for src in map(Path, args.merge):
            dst = Path(args.into) / src.name
            other = json.loads(src.read_text())
            if other.get("op") != "gpu_tests":
                print(f"gpu_tests_record: {src}: not a gpu_tests record", file=sys.stderr)
                return 1
            record = merge(json.loads(dst.read_text()) if dst.exists() else None, other)
            write(dst, record)
            print(f"gpu_tests_record: {src} -> {dst}: parts {', '.join(record['parts'])}; "
                  f"totals {totals(record)}")
        return 0
    missing = [f"--{k.replace('_', '-')}" for k in ("part", "ep_size", "process_model", "device", "record")
               if getattr(args, k) is None]
    if missing:
        parser.error("a part needs " + ", ".join(missing))
    path = Path(args.record)
    old = json.loads(path.read_text()) if path.exists() else None
    record = update(old, args.part, part_counts(args.junit, args.log, args.rc), ep_size=args.ep_size,
                    process_model=args.process_model, device=args.device, command=args.command,
                    repeat=args.repeat)
    name = record.pop("last_part")
    write(path, record)
    part = record["parts"][name]
    why = failure(part)
    print(f"gpu_tests_record: {path}: part {name}: " + ", ".join(f"{part[n]} {n}" for n in COUNTS)
          + (f" ({why})" if why else "") + f"; record totals: {totals(record)}")
    return 1 if fails(part) else 0


if __name__ == "__main__":
    sys.exit(main())
