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
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tools" / "gpu_check.sh"


def run_check(tmp_path: Path, gpus: int, _stub: str | None = None,
              **env) -> tuple[int, str, Path, list[str]]:
    """Runs the script with stubs; returns (exit code, output, $OUT, the stub interpreter's calls).
    _stub: the stub interpreter's script (default: log the arguments)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    listing = "".join(f"echo 'GPU {i}: stub'; " for i in range(gpus))
    smi = f'#!/bin/bash\n[ "$1" = -L ] && {{ {listing}exit 0; }}\necho stub-smi\n'
    (bin_dir / "nvidia-smi").write_text(smi)
    calls = tmp_path / "calls.txt"
    (bin_dir / "py").write_text(_stub or textwrap.dedent(f"""\
        #!/bin/bash
        echo "$*" >> {calls}
        echo "stub python $*"
        """))
    (bin_dir / "nvcc").write_text("#!/bin/bash\necho stub-nvcc\n")
    # MPS: -d "starts" the daemon (its control pipe appears); "quit" on stdin stops it
    (bin_dir / "nvidia-cuda-mps-control").write_text(
        '#!/bin/bash\n[ "$1" = -d ] && touch "$CUDA_MPS_PIPE_DIRECTORY/control"; exit 0\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    out = tmp_path / "out"
    full_env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", OUT=str(out),
                    PYTHON=str(bin_dir / "py"), SKIP_BENCH="1", SKIP_LAYER="1", SKIP_TESTS="1", **env)
    proc = subprocess.run(["bash", str(SCRIPT)], env=full_env, capture_output=True, text=True, timeout=120)
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
    # DEADLINE=30 leaves under 20 s for any step: every part is skipped, says so, and fails the run
    rc, output, out, calls = run_check(tmp_path, gpus=2, SWEEP="em,ll", DEADLINE="30")
    assert rc == 1, output
    assert not any("benchmarks" in c for c in calls), calls
    for part in ("em", "ll"):
        assert "SKIPPED: DEADLINE (30 s) reached" in (out / f"sweep_{part}.log").read_text()
        assert f"sweep {part}: rc=124" in (out / "summary.txt").read_text()


def test_tar_out_leaves_the_summary_and_one_archive(tmp_path):
    rc, output, out, _ = run_check(tmp_path, gpus=2, SWEEP="ll", TAR_OUT="1")
    assert rc == 0, output
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.tar.gz", "summary.txt"]
    with tarfile.open(out / "gpu_check.tar.gz") as tar:
        names = tar.getnames()
    assert "sweep_ll.log" in names and "build.log" in names and "summary.txt" not in names


def test_share_gpu_runs_the_chosen_files_with_the_process_count(tmp_path):
    rc, output, out, calls = run_check(tmp_path, gpus=1, SHARE_GPU="1", SHARE_FILES="rank_mask,ll_shrink",
                                       SHARE_PYTEST_ARGS="--processes 4", MPS_PIPE_DIR=str(tmp_path / "mps"))
    assert rc == 0, output
    runs = [c for c in calls if "pytest" in c]
    assert len(runs) == 2, runs
    for run, name in zip(runs, ("rank_mask", "ll_shrink"), strict=True):
        assert f"tests/gpu/test_{name}_gpu.py" in run and "--share-gpu" in run and "--processes 4" in run
    summary = (out / "summary.txt").read_text()
    assert "tests/gpu/test_rank_mask_gpu.py: rc=0" in summary and "gpu_check: OK" in summary, summary


# ---- GPU_SUITE: the suite in parts, JUnit -> records (tools/gpu_tests_record.py) ---------------------
def junit_xml(passed: int, failed: int, skipped: int = 0, name: str = "tests.gpu.test_x_gpu") -> str:
    cases = [f'<testcase classname="{name}" name="test_ok_{i}" time="1.0"/>' for i in range(passed)]
    cases += [f'<testcase classname="{name}" name="test_bad_{i}" time="2.0"><failure message="x"/></testcase>'
              for i in range(failed)]
    cases += [f'<testcase classname="{name}" name="test_skip_{i}" time="0"><skipped/></testcase>'
              for i in range(skipped)]
    return (f'<?xml version="1.0"?><testsuites><testsuite name="pytest" time="{passed + 2 * failed}.5">'
            + "".join(cases) + "</testsuite></testsuites>")


def run_suite(tmp_path: Path, gpus: int, junit: str, **env):
    """run_check with a stub interpreter that writes `junit` wherever pytest is asked for JUnit XML and
    runs tools/gpu_tests_record.py for real."""
    rc, output, out, calls = None, None, None, None
    (tmp_path / "junit.xml").write_text(junit)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    calls_file = tmp_path / "calls.txt"
    stub = textwrap.dedent(f"""\
        #!/bin/bash
        echo "JAX_EP_TEST_SHARD_AUTOTUNING=${{JAX_EP_TEST_SHARD_AUTOTUNING:-}} $*" >> {calls_file}
        if [[ "$*" == *gpu_tests_record.py* ]]; then exec {sys.executable} "$@"; fi
        for a in "$@"; do
          case $a in --junitxml=*) cp {tmp_path / "junit.xml"} "${{a#--junitxml=}}";; esac
        done
        echo "stub python $*"
        """)
    rc, output, out, _ = run_check(tmp_path, gpus=gpus, _stub=stub, **env)
    calls = calls_file.read_text().splitlines() if calls_file.exists() else []
    return rc, output, out, calls


def test_gpu_suite_runs_each_part_with_its_files_and_options_and_records_it(tmp_path):
    rc, output, out, calls = run_suite(tmp_path, 4, junit_xml(3, 0, 1), GPU_SUITE="m1a,m1b,m1c,pg",
                                       GIT_COMMIT="abc123")
    assert rc == 0, output
    runs = [c for c in calls if "-m pytest" in c]
    assert len(runs) == 4, runs
    m1a, m1b, m1c, pg = runs
    assert "gpu and not process_group --ep-ranks 4" in m1a and "test_dispatch_gpu.py" in m1a
    assert "test_rank_major_gpu.py" in m1b and "test_dispatch_gpu.py" not in m1b
    assert "test_fingerprint_gpu.py" in m1c and "test_ll_shrink_gpu.py" in m1c and "--ep-ranks 4" in m1c
    assert "gpu and process_group --processes 4" in pg and "test_process_group_gpu.py" in pg
    m1 = json.loads((out / "gpu_tests_stubx4_ep4_pm1.json").read_text())
    pm2 = json.loads((out / "gpu_tests_stubx4_ep4_pm2.json").read_text())
    assert (m1["op"], m1["ep_size"], m1["process_model"]) == ("gpu_tests", 4, 1)
    assert m1["device"] == "4x NVIDIA STUB"
    assert sorted(m1["parts"]) == ["m1a", "m1b", "m1c"] and sorted(pm2["parts"]) == ["pg"]
    assert (m1["passed"], m1["failed"], m1["skipped"]) == (9, 0, 3) and pm2["passed"] == 3
    assert m1["commits"] == ["abc123"] and m1["failed_ids"] == []


def test_gpu_suite_records_failures_and_fails_the_run(tmp_path):
    rc, output, out, _ = run_suite(tmp_path, 2, junit_xml(1, 2), GPU_SUITE="m1b", GIT_COMMIT="c")
    assert rc == 1, output
    record = json.loads((out / "gpu_tests_stubx2_ep2_pm1.json").read_text())
    assert record["failed"] == 2 and record["failed_ids"] == [
        "tests.gpu.test_x_gpu::test_bad_0", "tests.gpu.test_x_gpu::test_bad_1"]
    # the stub pytest exits 0: the record's failures alone fail the part
    assert "gpu suite m1b: rc=1" in (out / "summary.txt").read_text()


def test_gpu_suite_pgrep_repeats_with_sharded_autotuning_off_then_on(tmp_path):
    rc, output, out, calls = run_suite(tmp_path, 2, junit_xml(1, 0), GPU_SUITE="pgrep", PG_REPEATS="2",
                                       GIT_COMMIT="c")
    assert rc == 0, output
    runs = [c for c in calls if "-m pytest" in c]
    assert [r.split()[0] for r in runs] == ["JAX_EP_TEST_SHARD_AUTOTUNING=off"] * 2 + [
        "JAX_EP_TEST_SHARD_AUTOTUNING=on"] * 2
    assert all("-k matches_reference" in r and "--processes 2" in r for r in runs)
    record = json.loads((out / "gpu_tests_stubx2_ep2_pm2.json").read_text())
    assert sorted(record["parts"]) == ["pgrep_off_1", "pgrep_off_2", "pgrep_on_1", "pgrep_on_2"]
    assert record["passed"] == 4


def test_gpu_suite_unknown_part_and_too_many_ranks_fail_by_name(tmp_path):
    rc, output, out, calls = run_suite(tmp_path, 2, junit_xml(1, 0), GPU_SUITE="bogus,m1a",
                                       GPU_SUITE_RANKS="4")
    assert rc == 1, output
    summary = (out / "summary.txt").read_text()
    assert "unknown GPU_SUITE part 'bogus'" in summary
    assert "gpu suite m1a: not run: 4 ranks on 2 GPUs" in summary
    assert not any("-m pytest" in c for c in calls)


def test_records_merge_across_calls_and_refuse_another_setup():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import gpu_tests_record as rec
    finally:
        sys.path.pop(0)
    kw = dict(ep_size=4, process_model=1, device="4x NVIDIA H200")
    a = {"passed": 5, "failed": 1, "errors": 0, "skipped": 0, "failed_ids": ["t::a"], "duration_s": 9.0}
    b = {"passed": 7, "failed": 0, "errors": 0, "skipped": 2, "failed_ids": [], "duration_s": 3.0}
    record = rec.update(None, "m1a", a, commit_id="c1", date="2026-11-28T10:00:00+00:00", **kw)
    record = rec.update(record, "m1b", b, commit_id="c2", date="2026-11-28T11:00:00+00:00", **kw)
    assert (record["passed"], record["failed"], record["skipped"]) == (12, 1, 2)
    assert record["failed_ids"] == ["t::a"] and record["commits"] == ["c1", "c2"]
    fixed = dict(a, passed=6, failed=0, failed_ids=[])
    record = rec.update(record, "m1a", fixed, commit_id="c2", date="2026-11-28T12:00:00+00:00", **kw)
    assert (record["passed"], record["failed"]) == (13, 0) and record["commits"] == ["c2"]
    assert record["date"] == "2026-11-28T12:00:00+00:00"
    with pytest.raises(ValueError, match="ep_size=4"):
        rec.update(record, "m1c", b, ep_size=2, process_model=1, device="4x NVIDIA H200")
