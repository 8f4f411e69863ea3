"""tools/gpu_check.sh's control flow (SWEEP parts, DEADLINE, TAR_OUT) with stub commands: a fake
nvidia-smi that lists GPUs and a fake interpreter that logs its arguments. What the GPU machine runs is
the same script; here nothing is built or timed."""

from __future__ import annotations

import os
import subprocess
import tarfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tools" / "gpu_check.sh"


def run_check(tmp_path: Path, gpus: int, **env) -> tuple[int, str, Path, list[str]]:
    """Runs the script with stubs; returns (exit code, output, $OUT, the stub interpreter's calls)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    listing = "".join(f"echo 'GPU {i}: stub'; " for i in range(gpus))
    smi = f'#!/bin/bash\n[ "$1" = -L ] && {{ {listing}exit 0; }}\necho stub-smi\n'
    (bin_dir / "nvidia-smi").write_text(smi)
    calls = tmp_path / "calls.txt"
    (bin_dir / "py").write_text(textwrap.dedent(f"""\
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
