"""tools/gpu_check.sh's control flow (SWEEP parts, DEADLINE, TAR_OUT) with stub commands: a fake
nvidia-smi that lists GPUs and a fake interpreter that logs its arguments. What the GPU machine runs is
the same script; here nothing is built or timed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tools" / "gpu_check.sh"


# The stub interpreters' first lines: the script's MPS probe (jax_ep/mps.py, run by path from the
# repository root, standard library only) runs in a real interpreter.
STUB_HEAD = f"""#!/bin/bash
if [ "$1" = -c ] && [[ "$2" == *jax_ep/mps.py* ]]; then exec {sys.executable} "$@"; fi
"""

MPS_STUB = """#!/bin/bash
pipe=$CUDA_MPS_PIPE_DIRECTORY
if [ "$1" = -d ]; then
  {python} -c 'import os, socket, sys, time
s = socket.socket(socket.AF_UNIX)
s.bind(sys.argv[1])
s.listen(64)
open(sys.argv[2], "w").write(str(os.getpid()))
time.sleep(300)' "$pipe/control" "$pipe/daemon.pid" >/dev/null 2>&1 &
  for _ in $(seq 50); do [ -s "$pipe/daemon.pid" ] && exit 0; sleep 0.1; done
  exit 1
fi
read -r command
if [ "$command" = quit ]; then
  echo quit >> "$pipe/commands"
  kill "$(cat "$pipe/daemon.pid")"
  rm -f "$pipe/daemon.pid"
fi
"""


def run_check(tmp_path: Path, gpus: int, _stub: str | None = None, _script: Path = SCRIPT,
              _smi_pause: float = 0, **env) -> tuple[int, str, Path, list[str]]:
    """Runs the script with stubs; returns (exit code, output, $OUT, the stub interpreter's calls).
    _stub: the stub interpreter's script (default: log the arguments); _script: the script (a copy in
    another tree); _smi_pause: seconds nvidia-smi -L pauses after each GPU's line; an env value None removes
    the variable (the SKIP_* ones are 1 unless given)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    listing = "".join(f"echo 'GPU {i}: stub'; sleep {_smi_pause}; " for i in range(gpus))
    smi = f'#!/bin/bash\n[ "$1" = -L ] && {{ {listing}exit 0; }}\necho stub-smi\n'
    (bin_dir / "nvidia-smi").write_text(smi)
    calls = tmp_path / "calls.txt"
    (bin_dir / "py").write_text(_stub or STUB_HEAD + textwrap.dedent(f"""\
        echo "$*" >> {calls}
        echo "stub python $*"
        """))
    (bin_dir / "nvcc").write_text("#!/bin/bash\necho stub-nvcc\n")
    # MPS: -d starts a "daemon" listening on the control socket; "quit" on stdin stops it and leaves the
    # socket file behind, as CUDA 13's daemon does
    (bin_dir / "nvidia-cuda-mps-control").write_text(MPS_STUB.format(python=sys.executable))
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    out = tmp_path / "out"
    skips = {"SKIP_BENCH": "1", "SKIP_LAYER": "1", "SKIP_TESTS": "1"}
    full_env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", OUT=str(out),
                    PYTHON=str(bin_dir / "py"), **{**skips, **env})
    full_env = {k: v for k, v in full_env.items() if v is not None}
    proc = subprocess.run(["bash", str(_script)], env=full_env, capture_output=True, text=True, timeout=120)
    lines = calls.read_text().splitlines() if calls.exists() else []
    return proc.returncode, proc.stdout + proc.stderr, out, lines


def test_sweep_runs_every_part_with_its_arguments(tmp_path):
    rc, output, out, calls = run_check(tmp_path, gpus=4, SWEEP="em,rm,ll,layer,pg", SWEEP_TOKENS="128,4096")
    assert rc == 0, output
    sweeps = [c for c in calls if "benchmarks" in c or "jax_ep.launch" in c]
    assert len(sweeps) == 5, sweeps
    em, rm, ll, layer, pg = sweeps
    assert "--backends cuda,dense,reference,ragged" in em and "--tokens 128,4096" in em
    assert f"--out {out}/sweep_em.json" in em and "--profile" in em
    assert "--rank-major" in rm and "--backends cuda,reference" in rm and f"{out}/sweep_rm.json" in rm
    assert "--low-latency --tokens 1,128" in ll
    assert "--layer " in layer and "--layer-configs ep_reference,ep_cuda,jax_ep" in layer
    assert "-m jax_ep.launch --nproc 4" in pg and "process_group_worker.py" in pg and "--out" not in pg
    summary = (out / "summary.txt").read_text()
    for part in ("em", "rm", "ll", "layer", "pg"):
        assert f"sweep {part}: rc=0" in summary, summary
    assert "gpu_check: OK" in summary


def test_unknown_part_and_pg_on_one_gpu_fail_by_name(tmp_path):
    rc, output, out, calls = run_check(tmp_path, gpus=1, SWEEP="ll,bogus,pg")
    assert rc == 1, output
    summary = (out / "summary.txt").read_text()
    assert "unknown SWEEP part 'bogus'" in summary
    assert "sweep pg: not run: needs 2 or more GPUs" in summary
    assert "sweep ll: rc=0" in summary and "gpu_check: FAILED" in summary
    assert not any("jax_ep.launch" in c for c in calls), calls


def test_deadline_skips_what_it_leaves_no_time_for(tmp_path):
    # DEADLINE=30 leaves under 20 s for any step: every part is skipped, says "not run (DEADLINE)" in
    # summary.txt, and fails the run
    rc, output, out, calls = run_check(tmp_path, gpus=2, SWEEP="em,ll", DEADLINE="30", SKIP_BUILD="1")
    assert rc == 1, output
    assert not any("benchmarks" in c for c in calls), calls
    summary = (out / "summary.txt").read_text()
    for part in ("em", "ll"):
        assert "SKIPPED: DEADLINE (30 s) reached" in (out / f"sweep_{part}.log").read_text()
        assert f"sweep {part}: not run (DEADLINE) in" in summary, summary
    assert "SKIPPED: DEADLINE (30 s) reached, not run (DEADLINE): " in summary, summary


def test_tar_out_leaves_the_summary_and_one_archive(tmp_path):
    rc, output, out, _ = run_check(tmp_path, gpus=2, SWEEP="ll", TAR_OUT="1")
    assert rc == 0, output
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.tar.gz", "summary.txt"]
    with tarfile.open(out / "gpu_check.tar.gz") as tar:
        names = tar.getnames()
    assert "sweep_ll.log" in names and "build.log" in names and "summary.txt" not in names


def test_share_gpu_runs_the_chosen_files_with_the_process_count(tmp_path):
    rc, output, out, calls = run_suite(tmp_path, 1, junit_xml(1, 0), SHARE_GPU="1",
                                       SHARE_FILES="rank_mask,ll_shrink", SHARE_PYTEST_ARGS="--processes 4",
                                       MPS_PIPE_DIR=str(tmp_path / "mps"))
    assert rc == 0, output
    runs = [c for c in calls if "-m pytest" in c]
    assert len(runs) == 2, runs
    for run, name in zip(runs, ("rank_mask", "ll_shrink"), strict=True):
        assert f"tests/gpu/test_{name}_gpu.py" in run and "--share-gpu" in run and "--processes 4" in run
        assert f"--junitxml={out}/gpu-tests-shared_test_{name}_gpu.xml" in run, run
    summary = (out / "summary.txt").read_text()
    assert "tests/gpu/test_rank_mask_gpu.py: rc=0" in summary and "gpu_check: OK" in summary, summary
    assert "starting it" in output and (tmp_path / "mps" / "commands").read_text() == "quit\n", output


def test_share_bench_times_the_process_group_benchmark_under_mps(tmp_path, monkeypatch):
    """SHARE_BENCH=N with SHARE_FILES=none: no tests, the process-model-2 benchmark with N processes on
    GPU 0 under MPS (default arguments: the push / pull A/B), a small memory fraction per process (not
    the 0.6 the script gives its other steps: session 53 lost a run to that), the caller's if set."""
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    calls_file = tmp_path / "calls.txt"
    stub = STUB_HEAD + textwrap.dedent(f"""\
        echo "$* MEM=$XLA_PYTHON_CLIENT_MEM_FRACTION" >> {calls_file}
        """)
    rc, output, out, calls = run_check(tmp_path, gpus=1, _stub=stub, SHARE_GPU="1", SHARE_FILES="none",
                                       SHARE_BENCH="4", MPS_PIPE_DIR=str(tmp_path / "mps"))
    assert rc == 0, output
    assert not [c for c in calls if c.startswith("-m pytest")], calls
    (bench,) = [c for c in calls if "jax_ep.launch" in c]
    assert bench.endswith("MEM=0.2"), bench
    assert "--nproc 4 --share-gpus tests/gpu/process_group_worker.py" in bench, bench
    assert f"--bench {out}/share_bench.json --bench-sms 16 --bench-pull both" in bench, bench
    summary = (out / "summary.txt").read_text()
    assert "process-model-2 benchmark, 4 processes on one GPU (MPS): rc=0" in summary, summary
    assert "tests on one GPU" not in summary and (tmp_path / "mps" / "commands").read_text() == "quit\n"
    (tmp_path / "b").mkdir()
    other = stub.replace(str(calls_file), str(tmp_path / "b" / "c"))
    run_check(tmp_path / "b", gpus=1, _stub=other, SHARE_GPU="1", SHARE_FILES="none", SHARE_BENCH="2",
              MPS_PIPE_DIR=str(tmp_path / "mps"), XLA_PYTHON_CLIENT_MEM_FRACTION="0.3")
    bench = [c for c in (tmp_path / "b" / "c").read_text().splitlines() if "jax_ep.launch" in c]
    assert len(bench) == 1 and bench[0].endswith("MEM=0.3"), bench


def test_share_gpu_restarts_mps_when_only_a_stopped_daemons_socket_is_left(tmp_path):
    """A second run after one that stopped its daemon: the socket file is still there, but nothing answers
    (2026-12-01: such runs said "already running" and ran without MPS); it starts MPS again and stops
    it. A daemon that answers is used and left running."""
    pipe = tmp_path / "mps"
    for run in (1, 2):
        rc, output, out, _ = run_suite(tmp_path, 1, junit_xml(1, 0), SHARE_GPU="1", SHARE_FILES="rank_mask",
                                       MPS_PIPE_DIR=str(pipe))
        assert rc == 0, output
        assert (pipe / "control").exists() and not (pipe / "daemon.pid").exists()   # stopped, socket left
        assert (pipe / "commands").read_text() == "quit\n" * run, output
        if run == 2:
            assert f"CUDA MPS: its control socket {pipe}/control refuses connections (" in output, output
            assert "already running" not in output, output
    env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=str(pipe))
    control = str(tmp_path / "bin" / "nvidia-cuda-mps-control")
    (pipe / "control").unlink()
    subprocess.run([control, "-d"], env=env, check=True)
    try:
        rc, output, out, _ = run_suite(tmp_path, 1, junit_xml(1, 0), SHARE_GPU="1", SHARE_FILES="rank_mask",
                                       MPS_PIPE_DIR=str(pipe))
        assert rc == 0 and "CUDA MPS already running" in output, output
        assert (pipe / "daemon.pid").exists() and (pipe / "commands").read_text() == "quit\n" * 2, output
    finally:
        subprocess.run([control], input="quit\n", text=True, env=env)


# ---- GPU_SUITE: the suite in parts, JUnit -> records (tools/gpu_tests_record.py) ---------------------
sys.path.insert(0, str(ROOT / "tools"))
try:
    import gpu_tests_record as rec
finally:
    sys.path.pop(0)


def junit_xml(passed: int, failed: int, skipped: int = 0, name: str = "tests.gpu.test_x_gpu",
              errors: int = 0) -> str:
    cases = [f'<testcase classname="{name}" name="test_ok_{i}" time="1.0"/>' for i in range(passed)]
    cases += [f'<testcase classname="{name}" name="test_bad_{i}" time="2.0"><failure message="x"/></testcase>'
              for i in range(failed)]
    cases += [f'<testcase classname="{name}" name="test_err_{i}" time="0.5"><error message="x"/></testcase>'
              for i in range(errors)]
    cases += [f'<testcase classname="{name}" name="test_skip_{i}" time="0"><skipped/></testcase>'
              for i in range(skipped)]
    return (f'<?xml version="1.0"?><testsuites><testsuite name="pytest" time="{passed + 2 * failed}.5">'
            + "".join(cases) + "</testsuite></testsuites>")


def test_record_commit_says_when_the_tree_is_not_its_head(tmp_path, monkeypatch):
    """A record's commit: $GIT_COMMIT when set; else HEAD, marked "+changes" when tracked files differ from
    it (a GPU machine's tree beside a stale .git), and "unknown" outside a checkout."""
    monkeypatch.delenv("GIT_COMMIT", raising=False)
    assert rec.commit(tmp_path) == "unknown"
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "f.py").write_text("a = 1\n")
    subprocess.run([*git, "-C", str(tmp_path), "add", "f.py"], check=True)
    subprocess.run([*git, "-C", str(tmp_path), "commit", "-qm", "one"], check=True)
    head = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    assert rec.commit(tmp_path) == head
    (tmp_path / "f.py").write_text("a = 2\n")
    assert rec.commit(tmp_path) == head + "+changes"
    monkeypatch.setenv("GIT_COMMIT", "abc123")
    assert rec.commit(tmp_path) == "abc123"


def run_suite(tmp_path: Path, gpus: int, junit: str | None, log: str = "", pytest_rc: int = 0,
              smi_pause: float = 0, **env):
    """run_check with a stub interpreter that, as pytest, writes `junit` wherever it is asked for JUnit XML
    (none when None), prints `log` and exits `pytest_rc`, and runs tools/gpu_tests_record.py for real."""
    if junit is not None:
        (tmp_path / "junit.xml").write_text(junit)
    (tmp_path / "pytest_log.txt").write_text(log)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    calls_file, junit_file = tmp_path / "calls.txt", tmp_path / "junit.xml"
    stub = STUB_HEAD + textwrap.dedent(f"""\
        echo "JAX_EP_TEST_SHARD_AUTOTUNING=${{JAX_EP_TEST_SHARD_AUTOTUNING:-}} \
        JAX_EP_TEST_PG_CHECKS=${{JAX_EP_TEST_PG_CHECKS:-}} \
        CVD=${{CUDA_VISIBLE_DEVICES-unset}} $*" >> {calls_file}
        if [[ "$*" == *gpu_tests_record.py* ]]; then exec {sys.executable} "$@"; fi
        if [[ "$*" == *"-m pytest"* ]]; then
          for a in "$@"; do
            case $a in --junitxml=*) [ -f {junit_file} ] && cp {junit_file} "${{a#--junitxml=}}";; esac
          done
          cat {tmp_path / "pytest_log.txt"}
          exit {pytest_rc}
        fi
        echo "stub python $*"
        """)
    rc, output, out, _ = run_check(tmp_path, gpus=gpus, _stub=stub, _smi_pause=smi_pause, **env)
    calls = calls_file.read_text().splitlines() if calls_file.exists() else []
    return rc, output, out, calls


def pytest_runs(calls: list[str]) -> list[str]:
    return [c for c in calls if "-m pytest" in c]


def files_of(run: str) -> set[str]:
    return {a for a in run.split() if a.startswith("tests/gpu/")}


GPU_FILES = {str(p.relative_to(ROOT)) for p in (ROOT / "tests" / "gpu").glob("test_*.py")}
PG_FILES = {f for f in GPU_FILES if "mark.process_group" in (ROOT / f).read_text()}


def test_gpu_suite_runs_each_part_with_its_files_and_options_and_records_it(tmp_path):
    parts = "m1a,m1g,m1h,m1k,m1b,m1c,pga,pgb"
    rc, output, out, calls = run_suite(tmp_path, 4, junit_xml(3, 0, 1), GIT_COMMIT="abc123", GPU_SUITE=parts,
                                       GPU_SUITE_ARGS='-k "not slow"')
    assert rc == 0, output
    runs = pytest_runs(calls)
    assert len(runs) == 8, runs
    m1a, m1g, m1h, m1k, m1b, m1c, pga, pgb = runs
    for run in (m1a, m1g, m1h, m1k, m1b, m1c):
        assert "-m gpu and not process_group --ep-ranks 4" in run and "--processes" not in run, run
    for run in (pga, pgb):
        assert "-m gpu and process_group --processes 4" in run and "--ep-ranks" not in run, run
    for run, tag in zip(runs, ("m1a", "m1g", "m1h", "m1k", "m1b", "m1c", "pga", "pgb"), strict=True):
        assert f"--junitxml={out}/gpu_suite_{tag}_ep4.xml" in run, run
    for run in (m1a, m1b, m1c, pga, pgb):
        assert run.endswith("-k not slow"), run
    # the GEMM file in three parts, each part's own -k joined with GPU_SUITE_ARGS' one
    assert m1g.endswith("-k (not fp8 and not (each_config or ring_weight_gradient)) and (not slow)"), m1g
    assert m1k.endswith("-k (not fp8 and (each_config or ring_weight_gradient)) and (not slow)"), m1k
    assert m1h.endswith("-k (fp8) and (not slow)")
    assert files_of(m1g) == files_of(m1h) == files_of(m1k) == {"tests/gpu/test_gemm_gpu.py"}
    assert "tests/gpu/test_dispatch_gpu.py" in files_of(m1a)
    assert "tests/gpu/test_gemm_gpu.py" not in files_of(m1a) | files_of(m1c)
    assert files_of(m1b) == {"tests/gpu/test_rank_major_gpu.py"}
    # the model-1 parts together: every GPU test file, each once
    m1 = [f for run in (m1a, m1g, m1b, m1c) for f in files_of(run)]
    assert sorted(m1) == sorted(GPU_FILES), m1
    assert {"tests/gpu/test_fingerprint_gpu.py", "tests/gpu/test_ll_shrink_gpu.py"} <= files_of(m1c)
    # the process-model-2 parts together: every file with process_group tests, each once
    assert files_of(pga) == {"tests/gpu/test_process_group_gpu.py", "tests/gpu/test_hierarchical_gpu.py"}
    pm2_files = [f for run in (pga, pgb) for f in files_of(run)]
    assert sorted(pm2_files) == sorted(PG_FILES) and "tests/gpu/test_put_transport_gpu.py" in PG_FILES
    pm1 = json.loads((out / "gpu_tests_stubx4_ep4_pm1.json").read_text())
    pm2 = json.loads((out / "gpu_tests_stubx4_ep4_pm2.json").read_text())
    assert (pm1["op"], pm1["ep_size"], pm1["process_model"]) == ("gpu_tests", 4, 1)
    assert (pm2["op"], pm2["ep_size"], pm2["process_model"]) == ("gpu_tests", 4, 2)
    assert pm1["device"] == "4x NVIDIA STUB"
    assert sorted(pm1["parts"]) == ["m1a", "m1b", "m1c", "m1g", "m1h", "m1k"]
    assert sorted(pm2["parts"]) == ["pga", "pgb"]
    assert (pm1["passed"], pm1["failed"], pm1["skipped"]) == (18, 0, 6) and pm2["passed"] == 6
    assert pm1["parts"]["m1h"]["command"].endswith("tests/gpu/test_gemm_gpu.py -k 'fp8' -k \"not slow\""), pm1
    assert pm1["commit"] == "abc123" and pm1["commits"] == ["abc123"] and pm1["failed_ids"] == []
    assert pm1["parts"]["m1b"]["command"].startswith("pytest -m gpu and not process_group --ep-ranks 4 ")
    assert pm1["parts"]["m1a"]["file_seconds"] == {"tests/gpu/test_x_gpu.py": 3.0}
    assert "gpu suite m1c: rc=0" in (out / "summary.txt").read_text()


def test_gpu_suite_pg_runs_every_process_group_file_at_the_rank_count(tmp_path):
    rc, output, out, calls = run_suite(tmp_path, 4, junit_xml(1, 0), GPU_SUITE="pg", GPU_SUITE_RANKS="2")
    assert rc == 0, output
    (run,) = pytest_runs(calls)
    assert "-m gpu and process_group --processes 2" in run and files_of(run) == PG_FILES
    assert json.loads((out / "gpu_tests_stubx4_ep2_pm2.json").read_text())["ep_size"] == 2


def test_gpu_suite_records_failures_and_fails_the_run(tmp_path):
    rc, output, out, _ = run_suite(tmp_path, 2, junit_xml(1, 2, errors=1), GPU_SUITE="m1b", GIT_COMMIT="c")
    assert rc == 1, output
    record = json.loads((out / "gpu_tests_stubx2_ep2_pm1.json").read_text())
    assert (record["passed"], record["failed"], record["errors"]) == (1, 2, 1)
    assert record["failed_ids"] == [f"tests/gpu/test_x_gpu.py::{t}" for t in ("test_bad_0", "test_bad_1",
                                                                              "test_err_0")]
    # the stub pytest exits 0: the record's failures alone fail the part
    assert "gpu suite m1b: rc=1" in (out / "summary.txt").read_text()


CUT_LOG = """\
tests/gpu/test_rank_major_gpu.py::test_a[bf16] PASSED                     [  1%]
tests/gpu/test_rank_major_gpu.py::test_a[fp8] FAILED                      [  2%]
tests/gpu/test_rank_major_gpu.py::test_b SKIPPED (needs 4 GPUs)           [  3%]
tests/gpu/test_rank_major_gpu.py::test_c[x y] PASSED                      [  4%]
tests/gpu/test_rank_major_gpu.py::test_c[x y] ERROR                       [  4%]
tests/gpu/test_rank_major_gpu.py::test_d[deepseek]\x20
FAILED tests/gpu/test_rank_major_gpu.py::test_a[fp8] - AssertionError
"""


def test_gpu_suite_part_cut_by_its_timeout_is_recorded_from_its_log(tmp_path):
    # no JUnit XML and the timeout's exit code: counts from the -v log, incomplete, the test it was cut in
    rc, output, out, calls = run_suite(tmp_path, 2, None, log=CUT_LOG, pytest_rc=124, GPU_SUITE="m1b")
    assert rc == 1, output
    (run,) = pytest_runs(calls)
    part = json.loads((out / "gpu_tests_stubx2_ep2_pm1.json").read_text())["parts"]["m1b"]
    assert (part["passed"], part["failed"], part["skipped"], part["errors"]) == (1, 1, 1, 1)
    assert part["failed_ids"] == ["tests/gpu/test_rank_major_gpu.py::test_a[fp8]",
                                  "tests/gpu/test_rank_major_gpu.py::test_c[x y]"]
    assert part["incomplete"] and part["cut_in"] == "tests/gpu/test_rank_major_gpu.py::test_d[deepseek]"
    assert part["rc"] == 124
    assert "(cut in tests/gpu/test_rank_major_gpu.py::test_d[deepseek])" in (out / "summary.txt").read_text()


def test_part_counts_xml_of_a_cut_run_is_incomplete(tmp_path):
    # SIGINT from timeout: pytest wrote the XML of what it finished (and a nameless case); rc 124
    xml = tmp_path / "j.xml"
    xml.write_text(junit_xml(2, 0).replace("</testsuite>", '<testcase time="0.000" /></testsuite>'))
    log = tmp_path / "log"
    log.write_text(CUT_LOG)
    counts = rec.part_counts(xml, log, 124)
    assert (counts["passed"], counts["failed"], counts["incomplete"]) == (2, 0, True)
    assert counts["cut_in"] == "tests/gpu/test_rank_major_gpu.py::test_d[deepseek]"
    done = rec.part_counts(xml, log, 0)
    assert "incomplete" not in done and done["passed"] == 2


def test_gpu_suite_deadline_skips_a_part_without_recording_it(tmp_path):
    rc, output, out, calls = run_suite(tmp_path, 2, junit_xml(1, 0), GPU_SUITE="m1a", DEADLINE="30",
                                       SKIP_BUILD="1")
    assert rc == 1, output
    assert not pytest_runs(calls)
    assert not list(out.glob("gpu_tests_*.json"))
    assert "gpu suite m1a: not run (DEADLINE) in" in (out / "summary.txt").read_text()


PGREP_TEST = "test_process_per_gpu_matches_reference"


def test_gpu_suite_pgrep_repeats_with_sharded_autotuning_off_then_on(tmp_path):
    rc, output, out, calls = run_suite(tmp_path, 2, junit_xml(1, 0), GPU_SUITE="pgrep", PG_REPEATS="2",
                                       GIT_COMMIT="c")
    assert rc == 0, output
    runs = pytest_runs(calls)
    assert [r.split()[0] for r in runs] == ["JAX_EP_TEST_SHARD_AUTOTUNING=off"] * 2 + [
        "JAX_EP_TEST_SHARD_AUTOTUNING=on"] * 2
    for run in runs:
        assert files_of(run) == {f"tests/gpu/test_process_group_gpu.py::{PGREP_TEST}"}
        assert "-m gpu and process_group --processes 2" in run
    record = json.loads((out / "gpu_tests_stubx2_ep2_pm2.json").read_text())
    assert sorted(record["parts"]) == ["pgrep_off_1", "pgrep_off_2", "pgrep_on_1", "pgrep_on_2"]
    assert record["repeats"] == {"shard_autotuning_off": {"runs": 2, "passed": 2, "failed": 0},
                                 "shard_autotuning_on": {"runs": 2, "passed": 2, "failed": 0}}
    assert "gpu suite pgrep: rc=0" in (out / "summary.txt").read_text()
    assert all(r.split()[1] == "JAX_EP_TEST_PG_CHECKS=" for r in runs), runs    # every check group


def test_gpu_suite_pgrep_runs_the_chosen_check_groups(tmp_path):
    """PG_CHECKS: the worker's check groups for the repeat runs, passed to the test and in the record."""
    rc, output, out, calls = run_suite(tmp_path, 2, junit_xml(1, 0), GPU_SUITE="pgrep", PG_REPEATS="1",
                                       PG_AUTOTUNING="off", PG_CHECKS="gradients,dispatch_combine")
    assert rc == 0, output
    (run,) = pytest_runs(calls)
    assert run.split()[:2] == ["JAX_EP_TEST_SHARD_AUTOTUNING=off",
                               "JAX_EP_TEST_PG_CHECKS=gradients,dispatch_combine"], run
    record = json.loads((out / "gpu_tests_stubx2_ep2_pm2.json").read_text())
    command = record["parts"]["pgrep_off_1"]["command"]
    assert "JAX_EP_TEST_PG_CHECKS=gradients,dispatch_combine pytest" in command, command


def test_gpu_suite_pgrep_one_setting_adds_to_the_record_of_an_earlier_call(tmp_path):
    rc, output, out, calls = run_suite(tmp_path, 2, junit_xml(0, 1), GPU_SUITE="pgrep,pgrep", PG_REPEATS="1",
                                       PG_AUTOTUNING="on")
    assert rc == 1, output
    assert [r.split()[0] for r in pytest_runs(calls)] == ["JAX_EP_TEST_SHARD_AUTOTUNING=on"] * 2
    record = json.loads((out / "gpu_tests_stubx2_ep2_pm2.json").read_text())
    assert sorted(record["parts"]) == ["pgrep_on_1", "pgrep_on_2"]
    assert record["repeats"] == {"shard_autotuning_on": {"runs": 2, "passed": 0, "failed": 2}}


def test_gpu_suite_pgrep_stops_before_a_run_the_deadline_would_cut(tmp_path):
    rc, output, out, calls = run_suite(tmp_path, 2, junit_xml(1, 0), GPU_SUITE="pgrep", DEADLINE="200")
    assert rc == 0, output
    assert not pytest_runs(calls)
    assert "run 1: not run: DEADLINE leaves under PG_RUN_S=240 s" in (out / "summary.txt").read_text()


def test_gpu_suite_unknown_part_and_too_many_ranks_fail_by_name(tmp_path):
    rc, output, out, calls = run_suite(tmp_path, 2, junit_xml(1, 0), GPU_SUITE="bogus,m1a",
                                       GPU_SUITE_RANKS="4")
    assert rc == 1, output
    summary = (out / "summary.txt").read_text()
    assert "unknown GPU_SUITE part 'bogus'" in summary
    assert "gpu suite m1a: not run: 4 ranks on 2 GPUs" in summary
    assert not pytest_runs(calls)
    rc, output, out, calls = run_suite(tmp_path, 2, junit_xml(1, 0), GPU_SUITE="pga", GPU_SUITE_RANKS="1")
    assert rc == 1 and "gpu suite pga: not run: 1 ranks on 2 GPUs" in (out / "summary.txt").read_text()


def test_tar_out_keeps_the_gpu_tests_records_apart(tmp_path):
    rc, output, out, _ = run_suite(tmp_path, 2, junit_xml(1, 0), GPU_SUITE="m1a", TAR_OUT="1")
    assert rc == 0, output
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.tar.gz", "gpu_tests_stubx2_ep2_pm1.json",
                                                     "summary.txt"]
    with tarfile.open(out / "gpu_check.tar.gz") as tar:
        assert "gpu_suite_m1a_ep2.log" in tar.getnames()


KW = dict(ep_size=4, process_model=1, device="4x NVIDIA H200")
A = {"passed": 5, "failed": 1, "errors": 0, "skipped": 0, "failed_ids": ["t::a"], "duration_s": 9.0}
B = {"passed": 7, "failed": 0, "errors": 0, "skipped": 2, "failed_ids": [], "duration_s": 3.0}


def test_records_merge_parts_and_refuse_another_setup():
    record = rec.update(None, "m1a", A, commit_id="c1", date="2026-11-28T10:00:00+00:00", **KW)
    record = rec.update(record, "m1b", B, commit_id="c2", date="2026-11-28T11:00:00+00:00", **KW)
    assert (record["passed"], record["failed"], record["skipped"]) == (12, 1, 2)
    assert record["failed_ids"] == ["t::a"] and record["commits"] == ["c1", "c2"] and record["commit"] == "c2"
    assert record["duration_s"] == 12.0
    fixed = dict(A, passed=6, failed=0, failed_ids=[])
    record = rec.update(record, "m1a", fixed, commit_id="c2", date="2026-11-28T12:00:00+00:00", **KW)
    assert (record["passed"], record["failed"]) == (13, 0) and record["commits"] == ["c2"]
    assert record["date"] == "2026-11-28T12:00:00+00:00"
    with pytest.raises(ValueError, match="ep_size=4"):
        rec.update(record, "m1c", B, ep_size=2, process_model=1, device="4x NVIDIA H200")


def test_merge_folds_two_calls_records_into_one(tmp_path):
    # two device calls, each returning a record of its parts; --merge folds both into docs' record
    call1 = rec.update(None, "m1a", A, commit_id="c1", date="2026-11-28T10:00:00+00:00", **KW)
    call2 = rec.update(None, "m1b", B, commit_id="c1", date="2026-11-28T11:00:00+00:00", **KW)
    kw2 = dict(KW, process_model=2)
    rep = dict(B, skipped=0, passed=1)
    bad = dict(rep, passed=0, failed=1, failed_ids=["t::m"])
    call2_pm2 = rec.update(None, "pgrep_off", rep, commit_id="c1", date="2026-11-28T11:10:00+00:00",
                           repeat=True, **kw2)
    call3_pm2 = rec.update(None, "pgrep_off", bad, commit_id="c1", date="2026-11-28T12:00:00+00:00",
                           repeat=True, **kw2)
    returned, docs = tmp_path / "ret", tmp_path / "docs"
    returned.mkdir()
    docs.mkdir()
    pm1_name, pm2_name = "gpu_tests_h200x4_ep4_pm1.json", "gpu_tests_h200x4_ep4_pm2.json"
    for i, (rec_, name) in enumerate([(call1, pm1_name), (call2, pm1_name), (call2_pm2, pm2_name),
                                      (call3_pm2, pm2_name)]):
        (returned / str(i)).mkdir()
        (returned / str(i) / name).write_text(json.dumps(rec_))
        assert rec.main(["--merge", str(returned / str(i) / name), "--into", str(docs)]) == 0
    # merging the same call's record again changes nothing
    assert rec.main(["--merge", str(returned / "3" / pm2_name), "--into", str(docs)]) == 0
    pm1 = json.loads((docs / pm1_name).read_text())
    pm2 = json.loads((docs / pm2_name).read_text())
    assert sorted(pm1["parts"]) == ["m1a", "m1b"]
    assert (pm1["passed"], pm1["failed"], pm1["skipped"]) == (12, 1, 2)
    assert pm1["failed_ids"] == ["t::a"] and pm1["date"] == "2026-11-28T11:00:00+00:00"
    assert sorted(pm2["parts"]) == ["pgrep_off_1", "pgrep_off_2"]
    assert pm2["repeats"] == {"shard_autotuning_off": {"runs": 2, "passed": 1, "failed": 1}}
    assert pm2["failed_ids"] == ["t::m"]
    # a record of another setup under the same name is refused
    other = tmp_path / pm1_name
    other.write_text(json.dumps(rec.update(None, "m1a", A, ep_size=2, process_model=1, device=KW["device"])))
    with pytest.raises(ValueError, match="ep_size=4"):
        rec.main(["--merge", str(other), "--into", str(docs)])


def test_merge_numbers_any_parts_repeats():
    """--repeat numbers any part; merge gives another run's numbered repeat the next free number for
    every part, not only pgrep_on/off (before 2026-12-05 two calls' decode_layer_1 overwrote each other)."""
    calls = [rec.update(None, "decode_layer", counts, commit_id="c", date=date, repeat=True, **KW)
             for counts, date in ((A, "2026-11-28T10:00:00+00:00"), (B, "2026-11-28T11:00:00+00:00"))]
    merged = rec.merge(rec.merge(None, calls[0]), calls[1])
    assert sorted(merged["parts"]) == ["decode_layer_1", "decode_layer_2"]
    assert (merged["passed"], merged["failed"]) == (12, 1)
    assert rec.merge(merged, calls[1]) == merged                # the same call's record again: no change
    # a part of another name is still replaced by the later run
    later = rec.update(None, "m1a", B, commit_id="c", date="2026-11-28T12:00:00+00:00", **KW)
    earlier = rec.update(None, "m1a", A, commit_id="c", date="2026-11-28T09:00:00+00:00", **KW)
    merged = rec.merge(rec.merge(None, earlier), later)
    assert list(merged["parts"]) == ["m1a"] and merged["passed"] == 7


def test_junit_ids_are_pytest_node_ids():
    case = ET.fromstring('<testcase classname="tests.gpu.test_a_gpu.TestX" name="test_y[bf16-2]"/>')
    assert rec.node_id(case) == "tests/gpu/test_a_gpu.py::TestX::test_y[bf16-2]"


def test_repeats_count_errors_and_cut_runs_as_faults():
    kw = dict(KW, process_model=2)
    record = None
    for counts in (dict(B, skipped=0), dict(B, errors=1, failed_ids=["t::e"]),
                   dict(B, incomplete=True, cut_in="t::m")):
        record = rec.update(record, "pgrep_on", counts, commit_id="c", repeat=True, **kw)
    assert record["repeats"] == {"shard_autotuning_on": {"runs": 3, "passed": 1, "failed": 2}}
    assert record["incomplete"] == ["pgrep_on_3"]


def test_gemm_peers_installs_tokamax_then_times_the_layer_shapes_without_tuning(tmp_path):
    rc, output, out, calls = run_check(tmp_path, gpus=1, GEMM_PEERS="1")
    assert rc == 0, output
    peers = [c for c in calls if "tune_gemm.py" in c]
    assert len(peers) == 1, calls
    assert "--shapes layers" in peers[0] and '--passes  --compare' in peers[0]   # "" = no sweep
    assert f"--report {out}/gemm_peers.json" in peers[0]
    assert "jax_ep/gemm_configs.json" not in peers[0]   # the table in the tree is left alone
    assert "gemm peers: rc=0" in (out / "summary.txt").read_text()


def test_gemm_runs_its_gpu_tests_then_tunes_with_the_block_and_returns_the_table(tmp_path):
    # (TAR_OUT=0: its files stay in $OUT, more than the 8 that would tar them)
    rc, output, out, calls = run_check(tmp_path, gpus=1, GEMM="1", GEMM_SHAPES="dsv3", GEMM_KERNELS="ws",
                                       TAR_OUT="0")
    assert rc == 0, output
    tests = [c for c in calls if "tests/gpu/test_gemm_gpu.py" in c]
    tune = [c for c in calls if "tune_gemm.py" in c]
    assert len(tests) == 1 and "-m gpu" in tests[0] and f"--junitxml={out}/gemm_tests.xml" in tests[0]
    assert len(tune) == 1 and "--shapes dsv3" in tune[0] and "--kernels ws" in tune[0]
    assert "--block deepseek_ep2,mid_ep2" in tune[0]
    assert "--fp8" in tune[0] and f"--report {out}/gemm_tune.json" in tune[0]
    assert (out / "gemm_configs.json").exists()
    profile = [c for c in calls if "profile_layer.py" in c]
    assert len(profile) == 1 and "deepseek jax_ep --experts 128" in profile[0]
    assert "gemm: rc=0" in (out / "summary.txt").read_text()


def test_gemm_runs_in_parts_with_passes_and_profiled_configs(tmp_path):
    """GEMM_STEPS picks the parts (here no tests), GEMM_PASSES the tuned passes, GEMM_TUNE_EXTRA the rest,
    GEMM_PROFILE_CONFIGS the profiled layer configs (one log each)."""
    rc, output, out, calls = run_check(tmp_path, gpus=1, GEMM="1", GEMM_STEPS="tune,profile",
                                       GEMM_PASSES="dw", GEMM_TUNE_EXTRA="--kernels classic",
                                       GEMM_PROFILE_CONFIGS="jax_ep jax_ep_fp8_cached")
    assert rc == 0, output
    assert not [c for c in calls if "tests/gpu/test_gemm_gpu.py" in c]
    [tune] = [c for c in calls if "tune_gemm.py" in c]
    assert "--passes dw" in tune and "--kernels classic" in tune and "--block" not in tune
    profile = [c for c in calls if "profile_layer.py" in c]
    assert [c.split("profile_layer.py ")[1].split(" --")[0] for c in profile] == [
        "deepseek jax_ep", "deepseek jax_ep_fp8_cached"]
    (tmp_path / "empty").mkdir()
    rc, output, out, calls = run_check(tmp_path / "empty", gpus=1, GEMM="1", GEMM_STEPS="tune",
                                       GEMM_TUNE_EXTRA="")
    [tune] = [c for c in calls if "tune_gemm.py" in c]
    assert rc == 0 and "--fp8" not in tune and "--block" not in tune   # set but empty: no extras
    assert "--passes forward,dx,dw" in tune                             # GEMM_PASSES unset: all three
    (tmp_path / "fp8_only").mkdir()
    rc, output, out, calls = run_check(tmp_path / "fp8_only", gpus=1, GEMM="1", GEMM_STEPS="tune",
                                       GEMM_PASSES="", GEMM_TUNE_EXTRA="--fp8")
    [tune] = [c for c in calls if "tune_gemm.py" in c]
    assert rc == 0 and " --passes  --quick " in tune and "--fp8" in tune   # set but empty: none swept


@pytest.mark.parametrize("skip", ["0", "1"])
def test_skip_build_leaves_pip_out(tmp_path, skip):
    """SKIP_BUILD=1 (a second run at once on another GPU of a tree already built) runs no pip install,
    and says so; without it the build runs first."""
    rc, output, out, calls = run_check(tmp_path, gpus=2, SKIP_BUILD=skip)
    assert rc == 0, output
    pips = [c for c in calls if "pip install" in c]
    summary = (out / "summary.txt").read_text()
    if skip == "1":
        assert not pips and "build: skipped (SKIP_BUILD=1)" in output, (calls, output)
    else:
        assert len(pips) == 1 and "built in" in summary, (calls, summary)


def test_issue38_ab_parts_name_known_layer_configs(tmp_path):
    """SWEEP=overlap,gate,decode,remat: one layer benchmark each (the training steps sustained), whose
    shape and configs exist in benchmarks.layer (a renamed config would otherwise fail on the GPU
    machine); decode times a decode shape with a shared expert, beside and not; remat the three
    rematerialised forms beside the plain step."""
    from benchmarks import layer

    parts = ("overlap", "gate", "decode", "remat")
    rc, output, out, calls = run_check(tmp_path, gpus=2, SWEEP=",".join(parts))
    assert rc == 0, output
    sweeps = [c for c in calls if "benchmarks" in c]
    assert len(sweeps) == len(parts), sweeps
    for part, call in zip(parts, sweeps, strict=True):
        args = call.split()
        assert "--layer" in args and f"{out}/sweep_{part}.json" in call
        assert ("--sustain" in args) == (part != "decode")
        if part == "decode":
            shape = args[args.index("--layer-shapes") + 1]
            assert shape in layer.DECODE_SHAPES and shape in layer.SHARED_FFN, shape
            configs = set(args[args.index("--layer-configs") + 1].split(","))
            assert {"jax_ep", "jax_ep_shared_beside"} <= configs, configs
        if part == "remat":
            configs = args[args.index("--layer-configs") + 1].split(",")
            assert configs[0] == "jax_ep" and all(layer.CONFIGS[c].get("checkpoint") for c in configs[1:])
        shape = args[args.index("--layer-shapes") + 1]
        assert shape in layer.LAYER_PRESETS, shape
        configs = args[args.index("--layer-configs") + 1].split(",")
        assert len(configs) >= 4 and set(configs) <= set(layer.CONFIGS), configs


def test_issue38_pull_part_times_both_forms_of_the_ops(tmp_path, capsys):
    """SWEEP=pull: one ops benchmark of the cuda kernels with the rows pushed and pulled in the same run
    (--pull both), at 24 and all SMs, with options the benchmark's parser takes; then the decisions
    they imply for KernelConfig's default, written to a copy of the auto table (never the shipped one)."""
    from benchmarks import auto_table, ops

    rc, output, out, calls = run_check(tmp_path, gpus=4, SWEEP="pull")
    assert rc == 0, output
    sweeps = [c for c in calls if "benchmarks " in c]
    assert len(sweeps) == 1 and f"{out}/sweep_pull.json" in sweeps[0], sweeps
    tables = [c.split() for c in calls if "benchmarks.auto_table" in c]
    assert len(tables) == 1, calls
    table_args = tables[0][tables[0].index("benchmarks.auto_table") + 1:]
    assert table_args == [f"{out}/sweep_pull.json", "--table", f"{out}/auto_table_pull.json"], table_args
    # the writer's parser takes them (a run with no records: nothing to decide, a parser error)
    Path(out, "sweep_pull.json").write_text("[]")
    with pytest.raises(SystemExit):
        auto_table.main(table_args)
    assert "sweep_pull.json: no op has both" in capsys.readouterr().err
    args = sweeps[0].split()
    args = args[args.index("benchmarks") + 1:]
    parsed = ops.parse_args(args)
    assert parsed.pull == "both" and parsed.backends == "cuda" and parsed.num_sms == "24,131", parsed


def test_sweep_at_several_ep_sizes_in_one_call(tmp_path):
    """SWEEP_EP=2,4: each part once per EP size on the first N GPUs (CUDA_VISIBLE_DEVICES), its records
    and log named by the size, the pull part's decisions gathered in one copy of the table; a size
    above the GPUs, and pg, are refused by name (the call fails, the other sizes still run)."""
    calls = tmp_path / "calls.txt"
    stub = STUB_HEAD + textwrap.dedent(f"""\
        echo "CVD=${{CUDA_VISIBLE_DEVICES:-all}} $*" >> {calls}
        """)
    rc, output, out, lines = run_check(tmp_path, gpus=4, _stub=stub, SWEEP="pull", SWEEP_EP="2,4")
    assert rc == 0, output
    runs = [c for c in lines if "benchmarks " in c]
    assert [c.split()[0] for c in runs] == ["CVD=0,1", "CVD=0,1,2,3"], runs
    assert f"--out {out}/sweep_pull_ep2.json" in runs[0] and f"--out {out}/sweep_pull_ep4.json" in runs[1]
    tables = [c for c in lines if "benchmarks.auto_table" in c]
    assert [f"{out}/sweep_pull_ep{n}.json --table {out}/auto_table_pull.json" in t
            for n, t in zip((2, 4), tables, strict=True)] == [True, True], tables
    assert "sweep pull_ep2: rc=0" in output and "sweep pull_ep4: rc=0" in output
    (tmp_path / "b").mkdir()
    rc, output, _, _ = run_check(tmp_path / "b", gpus=2, SWEEP="pull,pg", SWEEP_EP="2,4")
    assert rc != 0
    assert "sweep pull at EP4: not run (SWEEP_EP takes 1..2 GPUs, and not the pg part)" in output
    assert "sweep pg at EP2: not run" in output and "sweep pull_ep2: rc=0" in output


# ---- the 2026-12-05 review's fixes ----------------------------------------------------------------------
@pytest.mark.parametrize("var", ["GPU_SUITE_ARGS", "PYTEST_ARGS", "SHARE_PYTEST_ARGS", "SHARE_BENCH_ARGS"])
def test_args_that_do_not_parse_stop_the_call_before_the_build(tmp_path, var):
    """An unbalanced quote made the eval fail: GPU_SUITE_ARGS then dropped the whole GPU_SUITE block under
    set -u and PYTEST_ARGS ran the full suite without them, both saying OK."""
    rc, output, out, calls = run_suite(tmp_path, 2, junit_xml(1, 0), GPU_SUITE="m1a", SHARE_GPU="1",
                                       SKIP_TESTS="0", **{var: '-k "dispatch'})
    assert rc == 2, output
    assert not calls, calls   # nothing ran, the build included
    summary = (out / "summary.txt").read_text()
    assert f"""gpu_check: {var}='-k "dispatch' does not parse as a shell line""" in summary, summary
    assert "gpu_check: FAILED" in summary and "OK" not in summary


# TESTS_TIMEOUT=0 / GPU_SUITE_PART_TIMEOUT=0: the step was skipped "(DEADLINE)" with DEADLINE unset;
# TAR_OUT=yes: never tarred; SHARE_BENCH without SHARE_GPU=1: nothing ran, OK (review of 2026-12-05)
@pytest.mark.parametrize("setting", ["DEADLINE=abc", "DEADLINE=585.5", "GPU_SUITE_RANKS=abc",
                                     "GPU_SUITE_RANKS=0", "SWEEP_PART_TIMEOUT=9m", "PG_REPEATS=-1",
                                     "BUILD_TIMEOUT=1e3", "SWEEP_EP=2;4", "TESTS_TIMEOUT=0",
                                     "GPU_SUITE_PART_TIMEOUT=0", "TAR_OUT=yes", "SHARE_BENCH=1"])
def test_numbers_are_checked_before_anything_runs(tmp_path, setting):
    var, value = setting.split("=")
    rc, output, out, calls = run_suite(tmp_path, 2, junit_xml(1, 0), GPU_SUITE="m1a", **{var: value})
    assert rc == 2, output
    assert not calls, calls
    summary = (out / "summary.txt").read_text()
    assert f"gpu_check: {var}" in summary and "nothing ran" in summary, summary


def test_runtime_probe_failure_fails_the_call(tmp_path):
    """The runtime probe, run for real by this interpreter on a machine without a GPU: the CUDA backend is
    unavailable, which must fail the call and say so (every GPU test would skip, the call said OK)."""
    calls_file = tmp_path / "calls.txt"
    stub = STUB_HEAD + textwrap.dedent(f"""\
        echo "$*" >> {calls_file}
        if [ "$1" = - ]; then exec {sys.executable} -; fi
        """)
    rc, output, out, _ = run_check(tmp_path, gpus=1, _stub=stub, SKIP_BUILD="1")
    assert rc == 1, output
    summary = (out / "summary.txt").read_text()
    assert "runtime: CUDA backend unavailable" in summary and "available: (False, " in summary, summary
    assert "gpu_check: FAILED" in summary


def test_a_part_with_every_test_skipped_fails(tmp_path):
    rc, output, out, _ = run_suite(tmp_path, 2, junit_xml(0, 0, skipped=3), GPU_SUITE="m1b")
    assert rc == 1, output
    summary = (out / "summary.txt").read_text()
    assert "part m1b: 0 passed, 0 failed, 0 errors, 3 skipped (none passed)" in summary, summary
    assert "gpu suite m1b: rc=1" in summary


def test_out_is_tarred_when_more_than_8_files_would_be_left(tmp_path):
    """The device returns at most 8 files of $OUT, its choice which: a GPU_SUITE call left 10-12, and the
    record could be among those lost. Unless TAR_OUT says otherwise, more than 8 tar all but summary.txt
    and the records; fewer stay as they are."""
    rc, output, out, _ = run_suite(tmp_path, 2, junit_xml(1, 0), GPU_SUITE="m1a,m1b,m1c,pga")
    assert rc == 0, output
    assert sorted(p.name for p in out.iterdir()) == [
        "gpu_check.tar.gz", "gpu_tests_stubx2_ep2_pm1.json", "gpu_tests_stubx2_ep2_pm2.json", "summary.txt"]
    with tarfile.open(out / "gpu_check.tar.gz") as tar:
        assert {"gpu_suite_m1c_ep2.xml", "build.log"} <= set(tar.getnames())
    (tmp_path / "few").mkdir()
    rc, output, out, _ = run_suite(tmp_path / "few", 2, junit_xml(1, 0), GPU_SUITE="m1b")
    assert rc == 0 and not (out / "gpu_check.tar.gz").exists() and len(list(out.iterdir())) <= 8


def test_gpu_suite_ranks_restrict_the_visible_gpus_of_model_1(tmp_path):
    """GPU_SUITE_RANKS=1 on 4 GPUs: the model-1 part sees GPU 0 only (tests that take every visible GPU ran
    at EP4 in an "ep1" record) and its record says 1 GPU; process model 2 keeps every GPU."""
    rc, output, out, calls = run_suite(tmp_path, 4, junit_xml(1, 0), GPU_SUITE="m1g,pga", GPU_SUITE_RANKS="2")
    assert rc == 0, output
    m1g, pga = pytest_runs(calls)
    assert m1g.split()[2] == "CVD=0,1" and "--ep-ranks 2" in m1g, m1g
    assert pga.split()[2] == "CVD=unset" and "--processes 2" in pga, pga
    pm1 = json.loads((out / "gpu_tests_stubx2_ep2_pm1.json").read_text())
    assert pm1["device"] == "2x NVIDIA STUB" and pm1["ep_size"] == 2
    assert json.loads((out / "gpu_tests_stubx4_ep2_pm2.json").read_text())["device"] == "4x NVIDIA STUB"


def test_gpu_count_honours_cuda_visible_devices(tmp_path):
    """nvidia-smi lists every GPU whatever CUDA_VISIBLE_DEVICES says: CUDA_VISIBLE_DEVICES=1 on 2 GPUs ran
    --ep-ranks 2 on one GPU, recorded as 2 GPUs. Now the count is the caller's list, and the first N of it
    are the ones a part takes (a sweep's EP sizes too)."""
    rc, output, out, calls = run_suite(tmp_path, 4, junit_xml(1, 0), GPU_SUITE="m1a,pga",
                                       CUDA_VISIBLE_DEVICES="3,1,2")
    assert rc == 0, output
    m1a, pga = pytest_runs(calls)
    assert m1a.split()[2] == "CVD=3,1,2" and "--ep-ranks 3" in m1a, m1a
    assert pga.split()[2] == "CVD=3,1,2" and "--processes 3" in pga, pga
    assert json.loads((out / "gpu_tests_stubx3_ep3_pm1.json").read_text())["device"] == "3x NVIDIA STUB"
    (tmp_path / "one").mkdir()
    rc, output, out, calls = run_suite(tmp_path / "one", 4, junit_xml(1, 0), GPU_SUITE="m1a",
                                       CUDA_VISIBLE_DEVICES="2,3", GPU_SUITE_RANKS="1")
    assert rc == 0 and pytest_runs(calls)[0].split()[2] == "CVD=2", calls
    assert (out / "gpu_tests_stubx1_ep1_pm1.json").exists()
    (tmp_path / "sweep").mkdir()
    rc, output, out, calls = run_suite(tmp_path / "sweep", 4, None, SWEEP="ll", SWEEP_EP="2",
                                       CUDA_VISIBLE_DEVICES="2,3")
    assert rc == 0 and [c.split()[2] for c in calls if "benchmarks" in c] == ["CVD=2,3"], calls


@pytest.mark.parametrize("gpus, cvd", [(0, None), (2, "")])
def test_gpu_suite_with_no_gpu_listed_fails_by_name(tmp_path, gpus, cvd):
    rc, output, out, calls = run_suite(tmp_path, gpus, junit_xml(0, 0, skipped=1), GPU_SUITE="m1a,m1b",
                                       CUDA_VISIBLE_DEVICES=cvd)
    assert rc == 1, output
    assert not pytest_runs(calls) and not list(out.glob("gpu_tests_*.json")), calls
    assert "gpu suite m1a,m1b: not run: no GPU listed" in (out / "summary.txt").read_text()


def test_build_is_bounded_and_its_failure_names_what_did_not_run(tmp_path):
    """The pip install had no bound (a hang ate the call; the device kills it at 600 s with nothing
    returned): BUILD_TIMEOUT, within DEADLINE. A failed build names the parts and sweeps not run."""
    calls_file = tmp_path / "calls.txt"
    stub = STUB_HEAD + textwrap.dedent(f"""\
        echo "$*" >> {calls_file}
        if [[ "$*" == *"pip install"* ]]; then sleep 60 & wait $!; fi
        """)
    rc, output, out, _ = run_check(tmp_path, gpus=2, _stub=stub, BUILD_TIMEOUT="1", GPU_SUITE="m1a,pga",
                                   SWEEP="em")
    assert rc == 1, output
    summary = (out / "summary.txt").read_text()
    assert "BUILD FAILED" in summary, summary
    for line in ("gpu suite m1a: not run (build failed)", "gpu suite pga: not run (build failed)",
                 "sweep em: not run (build failed)"):
        assert line in summary, summary
    (tmp_path / "dl").mkdir()
    rc, output, out, calls = run_check(tmp_path / "dl", gpus=2, DEADLINE="30", GPU_SUITE="m1a")
    assert rc == 1 and not [c for c in calls if "pip" in c], calls
    summary = (out / "summary.txt").read_text()
    assert "not run (DEADLINE): env -u PYTHONPATH" in summary and "m1a: not run (build failed)" in summary


def test_deadline_bounds_the_probes_ncu_and_helpers(tmp_path):
    """Under DEADLINE nothing runs past it: the probes, ncu (fixed timeouts of 300 / 240 s, 3 NCU jobs of
    240 s each in a 600 s call), the layer plot and the tokamax install were unbounded; each step says
    "not run (DEADLINE)" in summary.txt."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ncu").write_text(f"#!/bin/bash\necho \"ncu $*\" >> {tmp_path / 'calls.txt'}\n")
    rc, output, out, calls = run_check(tmp_path, gpus=2, DEADLINE="30", SKIP_BUILD="1", NCU="1", GEMM_NCU="1",
                                       GEMM_PEERS="1", SKIP_BENCH="0", SKIP_LAYER="0", PG_BENCH="1")
    assert rc == 1, output
    assert calls == [], calls
    summary = (out / "summary.txt").read_text()
    for step in ("bench", "layer bench", "gemm peers", "process model 2 bench"):
        assert f"{step}: not run (DEADLINE)" in summary, summary


def test_every_slow_step_is_bounded():
    """The steps that can hang (a wedged GPU, a build, ncu) all go through bounded_run (DEADLINE-aware)."""
    text = SCRIPT.read_text()
    for pattern in ("-m pip install --no-build", "ncu --clock-control", "ncu --import", "tools/plot_bench.py",
                    "benchmarks.auto_table", "gemm_peers.sh install", "runtime.faults()",
                    "mps-control -d; then", '"$PY" - 2>&1', "import jax, jaxlib"):
        lines = [line for line in text.splitlines() if pattern in line and not line.lstrip().startswith("#")]
        assert lines and all("bounded_run" in line for line in lines), (pattern, lines)


def test_pytest_steps_are_cut_with_sigint_so_they_write_their_xml(tmp_path):
    """After SIGTERM pytest writes no JUnit XML: the full-suite step and SHARE_GPU's per-file runs cut with
    SIGINT (as GPU_SUITE's parts), then SIGKILL."""
    stub = STUB_HEAD + textwrap.dedent("""\
        if [[ "$*" == *"-m pytest"* ]]; then
          for a in "$@"; do case $a in --junitxml=*) xml=${a#--junitxml=};; esac; done
          trap 'echo "<testsuites/>" > "$xml"; kill $!; exit 2' INT
          sleep 30 & wait $!
        fi
        """)
    rc, output, out, _ = run_check(tmp_path, gpus=1, _stub=stub, SKIP_TESTS="0", TESTS_TIMEOUT="1",
                                   SHARE_GPU="1", SHARE_FILES="rank_mask", SHARE_FILE_TIMEOUT="1",
                                   MPS_PIPE_DIR=str(tmp_path / "mps"), TAR_OUT="0")
    assert rc == 1, output
    assert (out / "gpu-tests.xml").read_text() == "<testsuites/>\n"
    assert (out / "gpu-tests-shared_test_rank_mask_gpu.xml").read_text() == "<testsuites/>\n"


@pytest.mark.parametrize("what", ["SWEEP", "GPU_SUITE"])
def test_sweep_and_gpu_suite_skip_the_default_runs_unless_asked(tmp_path, what):
    """SWEEP=em,... with no SKIP_* first ran the full GPU suite, the benchmark and the layer benchmark
    (3000 s each) before the sweep; now they default to skipped, and an explicit 0 still runs them."""
    value = {"SWEEP": "ll", "GPU_SUITE": "m1b"}[what]
    rc, output, out, calls = run_suite(tmp_path, 2, junit_xml(1, 0), SKIP_TESTS=None, SKIP_BENCH=None,
                                       SKIP_LAYER=None, **{what: value})
    assert rc == 0, output
    assert not [c for c in calls if "-m gpu tests/gpu" in c or f"{out}/bench" in c], calls
    (tmp_path / "b").mkdir()
    rc, output, out, calls = run_suite(tmp_path / "b", 2, junit_xml(1, 0), SKIP_TESTS=None, SKIP_BENCH="0",
                                       SKIP_LAYER=None, **{what: value})
    assert [c for c in calls if f"--out {out}/bench.json" in c], calls
    assert not [c for c in calls if "-m gpu tests/gpu" in c or f"{out}/bench_layer" in c], calls


def test_records_keep_skipped_ids_with_reasons_and_the_deselected_count(tmp_path):
    xml = tmp_path / "j.xml"
    xml.write_text(junit_xml(1, 0).replace(
        "</testsuite>", '<testcase classname="tests.gpu.test_x_gpu" name="test_s" time="0">'
        '<skipped type="pytest.skip" message="needs 4 GPUs">x.py:3: needs 4 GPUs</skipped></testcase>'
        "</testsuite>"))
    log = tmp_path / "log"
    log.write_text("collecting ... collected 10 items / 3 deselected / 7 selected\n" + CUT_LOG)
    counts = rec.part_counts(xml, log, 0)
    assert counts["skipped_ids"] == {"tests/gpu/test_x_gpu.py::test_s": "needs 4 GPUs"}, counts
    assert (counts["collected"], counts["deselected"]) == (10, 3)
    from_log = rec.part_counts(None, log, 124)   # no XML: the reasons pytest -v printed
    assert from_log["skipped_ids"] == {"tests/gpu/test_rank_major_gpu.py::test_b": "needs 4 GPUs"}, from_log


COLLECTION_ERROR = ('<?xml version="1.0"?><testsuites><testsuite name="pytest" errors="1" time="0.7">'
                    '<testcase classname="" name="tests.gpu.test_x_gpu" time="0.000">'
                    '<error message="collection failure">ImportError</error></testcase>'
                    '</testsuite></testsuites>')


def test_a_collection_error_has_a_test_id_and_marks_the_part_incomplete(tmp_path):
    log = "ERROR tests/gpu/test_x_gpu.py\n!!!!!!!!!! Interrupted: 1 error during collection !!!!!!!!!!\n"
    rc, output, out, _ = run_suite(tmp_path, 2, COLLECTION_ERROR, log=log, pytest_rc=2, GPU_SUITE="m1c")
    assert rc == 1, output
    part = json.loads((out / "gpu_tests_stubx2_ep2_pm1.json").read_text())["parts"]["m1c"]
    assert part["failed_ids"] == ["tests/gpu/test_x_gpu.py"] and part["errors"] == 1, part
    assert list(part["file_seconds"]) == ["tests/gpu/test_x_gpu.py"], part
    assert part["incomplete"] and part["note"] == "interrupted: 1 error during collection", part
    assert "(interrupted: 1 error during collection)" in (out / "summary.txt").read_text()


def test_a_part_that_did_not_start_or_collected_nothing_says_so_and_fails(tmp_path):
    """An import or usage error (rc 4, no XML) was recorded as "cut in None"; rc 5 (no tests collected)
    as a pass of 0 tests."""
    rc, output, out, _ = run_suite(tmp_path, 2, None, log="ERROR: usage\n", pytest_rc=4, GPU_SUITE="m1b")
    assert rc == 1, output
    part = json.loads((out / "gpu_tests_stubx2_ep2_pm1.json").read_text())["parts"]["m1b"]
    assert part["incomplete"] and part["note"] == "did not start (rc 4)" and "cut_in" not in part, part
    summary = (out / "summary.txt").read_text()
    assert "(did not start (rc 4))" in summary and "cut in" not in summary, summary
    (tmp_path / "none").mkdir()
    empty = '<?xml version="1.0"?><testsuites><testsuite name="pytest" tests="0" time="0.5"/></testsuites>'
    rc, output, out, _ = run_suite(tmp_path / "none", 2, empty, log="collected 3 items / 3 deselected\n",
                                   pytest_rc=5, GPU_SUITE="m1b")
    assert rc == 1, output
    part = json.loads((out / "gpu_tests_stubx2_ep2_pm1.json").read_text())["parts"]["m1b"]
    assert part["note"] == "no tests collected (rc 5)" and part["deselected"] == 3, part


def test_share_gpu_default_files_are_those_with_process_model_2_tests(tmp_path):
    rc, output, out, calls = run_suite(tmp_path, 1, junit_xml(1, 0), SHARE_GPU="1",
                                       MPS_PIPE_DIR=str(tmp_path / "mps"))
    assert rc == 0, output
    runs = [c for c in calls if "-m pytest" in c]
    assert {f for run in runs for f in files_of(run)} == PG_FILES and len(runs) == len(PG_FILES), runs


@pytest.mark.parametrize("junit", [junit_xml(0, 0, skipped=3), None], ids=["all_skipped", "no_xml"])
def test_share_gpu_with_no_test_passed_fails(tmp_path, junit):
    """Every process-model-2 test skipped under MPS (e.g. no extension), or none collected / no XML
    written, said OK."""
    rc, output, out, _ = run_suite(tmp_path, 1, junit, SHARE_GPU="1", SHARE_FILES="rank_mask,ll_shrink",
                                   MPS_PIPE_DIR=str(tmp_path / "mps"))
    assert rc == 1, output
    summary = (out / "summary.txt").read_text()
    assert "process-model-2 tests on one GPU (MPS): no test passed (all skipped or none collected)" in summary
    assert "rc=1 in" in summary and "gpu_check: FAILED" in summary, summary


def test_m1c_takes_any_new_test_file_and_the_help_names_its_files(tmp_path):
    """A test file not named test_*_gpu.py was collected by pytest but run by no part."""
    tree = tmp_path / "tree"
    (tree / "tools").mkdir(parents=True)
    (tree / "tests" / "gpu").mkdir(parents=True)
    for tool in ("gpu_check.sh", "gpu_tests_record.py"):
        (tree / "tools" / tool).write_text((ROOT / "tools" / tool).read_text())
    for name in ("test_dispatch_gpu.py", "test_gemm_gpu.py", "test_rank_major_gpu.py", "test_router_gpu.py",
                 "test_new.py"):
        (tree / "tests" / "gpu" / name).write_text("")
    rc, output, out, calls = run_suite(tmp_path, 2, junit_xml(1, 0), _script=tree / "tools" / "gpu_check.sh",
                                       GPU_SUITE="m1c")
    assert rc == 0, output
    assert files_of(pytest_runs(calls)[0]) == {"tests/gpu/test_router_gpu.py", "tests/gpu/test_new.py"}
    # the help's m1c line names every file of m1c
    help_text = SCRIPT.read_text().split("#                 m1c")[1].split("#                 pga")[0]
    others = ("dispatch", "layout", "peer_smoke", "gemm", "rank_major",
              "process_group", "hierarchical", "put_transport")   # the last three have no model-1 test
    m1c = GPU_FILES - {f"tests/gpu/test_{n}_gpu.py" for n in others}
    for f in m1c:
        assert Path(f).stem.removeprefix("test_").split("_")[0] in help_text, (f, help_text)
    header = SCRIPT.read_text().split("set -uo pipefail")[0]
    assert "pg is refused with SWEEP_EP" in header and "but pg once per EP size" not in header


def test_the_gpu_name_is_read_once_when_nvidia_smi_lists_slowly(tmp_path):
    """Picking the first visible GPU's line with grep -m1 broke nvidia-smi's pipe before its next line; under
    pipefail the fallback then printed the name a second time, and the record's file name had a newline."""
    rc, output, out, _ = run_suite(tmp_path, 3, junit_xml(1, 0), smi_pause=0.3, GPU_SUITE="m1b",
                                   CUDA_VISIBLE_DEVICES="0,1")
    assert rc == 0, output
    assert [p.name for p in out.glob("gpu_tests_*.json")] == ["gpu_tests_stubx2_ep2_pm1.json"], output
