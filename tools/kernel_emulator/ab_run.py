"""A kernel change against its previous form, byte for byte, on the CPU emulation: every case of run.py
runs on the same inputs with the kernels of this tree and with some kernel files as they were at a git
revision, and every output of every op (timings aside) must be byte-identical. Then run.py's own check
against jax_ep.reference runs on this tree's outputs as usual.

    python tools/kernel_emulator/ab_run.py --rev e628f92 --files cuda/combine.cu [run.py's options]
    python tools/kernel_emulator/ab_run.py --rev HEAD~1 --files cuda/combine.cu,cuda/ep_device.cuh -k slices

For a change meant to leave results unchanged (a faster kernel, a refactor): the reference check allows
the expert-major combine one step of its dtype, this one nothing. Files named in --files that a source
includes (headers) are taken from the revision too: the old tree is the revision's copy of those files
laid over this tree in a temporary folder.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
import run  # noqa: E402

ROOT = harness.ROOT


def old_tree(rev: str, files: list[str], into: str) -> str:
    """This tree's kernel sources and emulation (cuda/, xla_ffi/ (the fault messages),
    tools/kernel_emulator/: everything a driver builds from) copied into `into`, with `files` as they
    were at `rev`."""
    for folder in ("cuda", "xla_ffi", os.path.join("tools", "kernel_emulator")):
        shutil.copytree(os.path.join(ROOT, folder), os.path.join(into, folder))
    for f in files:
        text = subprocess.run(["git", "show", f"{rev}:{f}"], cwd=ROOT, check=True, capture_output=True).stdout
        with open(os.path.join(into, f), "wb") as out:
            out.write(text)
    return into


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", required=True, help="the git revision of the previous form")
    parser.add_argument("--files", required=True, help="comma-separated files taken from --rev")
    args, rest = parser.parse_known_args()
    files = [f.strip() for f in args.files.split(",") if f.strip()]
    stats = dict(cases=0, files=0, differ=0)
    with tempfile.TemporaryDirectory() as tmp:
        tree = old_tree(args.rev, files, os.path.join(tmp, "old"))
        old_driver = harness.build(run.SOURCES, os.path.join(tmp, "old_driver"), root=tree)

        def ab_case(name, cmd, inputs, check, env=None, timeout=600):
            with tempfile.TemporaryDirectory() as new_d, tempfile.TemporaryDirectory() as old_d:
                procs = []
                for d, driver in ((new_d, cmd[0]), (old_d, old_driver)):
                    harness.write_inputs(d, inputs)
                    procs.append(subprocess.run([str(c) for c in [driver, d, *cmd[1:]]], capture_output=True,
                                                text=True, timeout=timeout, env=env))
                if any(p.returncode for p in procs):
                    for label, p in zip(("new", "old"), procs, strict=True):
                        print(f"FAIL {name}: {label} driver rc={p.returncode}\n"
                              f"{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
                    return False
                outs = sorted(f for f in os.listdir(new_d)
                              if re.search(r"\d+_\d+\.bin$", f) and not f.startswith("time"))
                differ = [f for f in outs
                          if not filecmp.cmp(os.path.join(new_d, f), os.path.join(old_d, f), shallow=False)]
                stats["cases"] += 1
                stats["files"] += len(outs)
                stats["differ"] += len(differ)
                print(f"  {name}: {len(outs)} outputs, {len(differ)} differ from {args.rev}"
                      f"{' ' + str(differ[:8]) if differ else ''}", flush=True)
                return check(new_d, 0.0) and not differ

        run.run_driver_case = ab_case
        sys.argv = [sys.argv[0], *rest]
        try:
            run.main()
        finally:
            print(f"against {args.rev} ({', '.join(files)}): {stats['cases']} cases, "
                  f"{stats['files']} outputs, {stats['differ']} differ")


if __name__ == "__main__":
    main()
