"""The CUDA kernels on the CPU kernel emulator (tools/kernel_emulator): a seeded random sweep
(``run.py --random N --seed S``) compared with the reference path like the fixed cases (bit-exact;
combine within one step of its dtype). Needs g++ (C++20); in CI (CI=true) a missing g++ is a failure,
elsewhere a skip. Each test builds its driver with g++ (~20 s on 2 cores), then ~3-9 s a case.

`make test` runs the smoke cases (``run.py --quick``, ``ll_run.py --quick``: the throughput and the
low-latency kernels, together about a minute); the sweeps, masks, token tiles, fingerprints and the put
transport (about 12 minutes on 2 cores) are marked slow: `make test-all` runs them.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
from helpers import run_logged

ROOT = pathlib.Path(__file__).resolve().parents[1]
RUN = ROOT / "tools" / "kernel_emulator" / "run.py"
SEED, CASES = 28, 16  # the sweep covers EP sizes 1-4, no tokens, FP8, f32 -> bf16, drops (asserted)


def _need_gxx() -> None:
    if shutil.which("g++") is None:
        if os.environ.get("CI"):
            pytest.fail("g++ is needed for the kernel emulator test and is missing on this CI machine")
        pytest.skip("needs g++ (C++20) for tools/kernel_emulator")


def _run(cmd: list[str]) -> str:
    """Runs an emulator script; its output (stdout + stderr), after asserting it succeeded."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} failed (rc={proc.returncode}):\n{out[-6000:]}"
    return out


def test_kernel_emulator_smoke(tmp_path):
    """The smoke cases, both scripts at once (each builds its driver with one g++: on 2 cores the builds
    overlap). The throughput kernels (``run.py --quick``: the first 3 fixed cases, 2 ranks, bf16 rows,
    messy routing with alignment 4, FP8 from bf16, and 3 ranks whose dispatches pull their rows,
    ``KernelConfig.dispatch_pull``, ``broadcast_pull``): every expert-major op (dispatch, combine and
    combine_bwd, broadcast, slot_values) and rank-major op bit-exact against the reference. The
    low-latency kernels (``ll_run.py --quick``: the first 4 fixed cases, fused, two-phase and two calls
    in flight, bf16 and FP8 wire, 2-4 ranks), bit-exact against jax_ep.reference.ll_dispatch /
    ll_combine."""
    _need_gxx()
    commands = {
        "run.py": [sys.executable, str(RUN), "--quick", "--driver", str(tmp_path / "driver")],
        "ll_run.py": [sys.executable, str(ROOT / "tools" / "kernel_emulator" / "ll_run.py"), "--quick",
                      "--driver", str(tmp_path / "ll_driver")],
    }
    results = run_logged(commands, tmp_path, cwd=ROOT, wait_s=600)   # under pytest's 900 s faulthandler
    for name, (code, log) in results.items():
        assert code == 0, f"{' '.join(commands[name])} failed (rc={code}):\n{log[-6000:]}"
    outs = {name: log for name, (_, log) in results.items()}
    out = outs["run.py"]
    assert "4/4 cases pass" in out, out[-6000:]
    for name in ("bf16 basic", "bf16 messy align4", "fp8 from bf16", "pull 3 ranks bf16"):
        assert f"ok   {name} (" in out, (name, out[-6000:])
    out = outs["ll_run.py"]
    assert "4/4 low-latency cases pass" in out, out[-6000:]
    for mode in ("fused", "two-phase", "two in flight"):
        assert re.search(rf"^ok   \(.*\) {mode}, \d blocks", out, flags=re.M), (mode, out[-6000:])


@pytest.mark.slow
def test_kernel_emulator_random_sweep(tmp_path):
    _need_gxx()
    cmd = [sys.executable, str(RUN), "--random", str(CASES), "--seed", str(SEED),
           "--driver", str(tmp_path / "driver")]
    out = _run(cmd)
    assert f"{CASES}/{CASES} cases pass" in out, out[-6000:]
    cases = re.findall(r"^ok   random seed \d+ case \d+: R=(\d+) T=(\d+)/\d+ H=\d+ K=\d+ E=\d+ .*? "
                       r"(\w+)->(\w+) .*dropped \[([\d, ]+)\]", out, flags=re.M)
    assert len(cases) == CASES, out[-6000:]
    # what the sweep exercised (a change to random_case that loses any of it shows here)
    assert {int(c[0]) for c in cases} == {1, 2, 3, 4}
    assert any(int(c[1]) == 0 for c in cases), "no case without tokens"
    assert any(c[3] == "fp8" for c in cases) and any(c[2:4] == ("f32", "bf16") for c in cases)
    assert sum(any(int(v) for v in c[4].split(",")) for c in cases) >= 2, "fewer than 2 cases drop rows"
    pulled = re.findall(r"^ok   random seed \d+ case \d+: R=(\d+) .* pull=1", out, flags=re.M)
    assert any(int(r) >= 2 for r in pulled), "no case with peers pulls its rows"
    masked = re.findall(r"^ok   random seed .* mask=\(([\d, ]+)\) absent=\(([\d, ]*)\)", out, flags=re.M)
    assert any(a.strip() for _, a in masked) and any(not a.strip() for _, a in masked), (
        "the sweep must mask ranks that run the ops and ranks that run none")


@pytest.mark.slow
def test_rank_masking_on_the_emulator(tmp_path):
    """Rank masking (run.py's fixed 'mask' cases): an all-active mask, a masked rank that runs the
    ops, masked ranks whose process runs none (the others finish without them), a mask that changes
    between calls (a rank masked in one call, active in the next), the mask on the ops through the
    handles only (combine's mask after an unmasked dispatch: broadcast, broadcast_rank_major and
    combine_bwd zero the rows of sources they do not link), and the persistent mask (what a
    shrink-mode call leaves: set on every running rank before the calls, a rank of it absent, with
    an explicit mask too, or set between the dispatch and the ops through its handle); every
    running rank's outputs of every op, expert- and rank-major (masked ranks' too, dispatch's
    rank_mask output included), bit-exact against the reference under the equivalent explicit mask
    and the same routing; shrink mode with a rank that stops calling (after one repetition, or
    before the first, beside an explicit mask): the others' calls equal the reference with it
    masked from then on, only the first call after it waits out the bound and masks it
    persistently (dispatch, discovery); both with rows in column slices too (a masked rank absent,
    a rank that stops calling in shrink mode). About 2 min."""
    _need_gxx()
    cmd = [sys.executable, str(RUN), "-k", "mask", "--driver", str(tmp_path / "driver")]
    out = _run(cmd)
    assert "13/13 cases pass" in out, out[-6000:]
    assert "dispatches unmasked" in out, out[-6000:]


@pytest.mark.slow
def test_pull_form_on_the_emulator(tmp_path):
    """The pull form of the dispatches and broadcasts (KernelConfig.dispatch_pull, broadcast_pull: each
    sender stages a token once in its own buffer, each receiver loads it from there): run.py's 'pull'
    cases, 3, 4 and 8 ranks, bf16, FP8 rows in column slices, f32 -> bf16 with register copies and
    drops, a masked rank that runs no op; every output of every op, expert- and rank-major, bit-exact
    against the reference (combine_bwd, which has no pull form, pushes beside them). About 2 min."""
    _need_gxx()
    cmd = [sys.executable, str(RUN), "-k", "pull", "--driver", str(tmp_path / "driver")]
    out = _run(cmd)
    assert "6/6 cases pass" in out, out[-6000:]


@pytest.mark.slow
def test_prep_over_several_token_tiles_and_slot_widths_on_the_emulator(tmp_path):
    """Dispatch's prep walks the tokens in tiles of 1024, loading the next tile's ids while it walks
    one, a token's ids in 8, 16 or kMaxTopk register slots by top-k: run.py's 'slots' cases (T = 2100
    top-8, T = 1100 top-12 and T = 1030 top-16 over several tiles; top-12 and top-20 in one), every
    output of both layouts bit-exact against the reference. The other cases have fewer than 1024
    tokens and top-k <= 8. About 4 min."""
    _need_gxx()
    cmd = [sys.executable, str(RUN), "-k", "slots", "--driver", str(tmp_path / "driver")]
    out = _run(cmd)
    assert "5/5 cases pass" in out, out[-6000:]


@pytest.mark.slow
def test_low_latency_kernels_on_the_emulator(tmp_path):
    """cuda/low_latency.cu (tools/kernel_emulator/ll_run.py): the fixed cases and a seeded random
    sweep, fused, two-phase and with two calls in flight, every output bit-exact against
    jax_ep.reference.ll_dispatch / ll_combine, NaN in every unfilled slot of y (must not leak), two
    calls on the same poisoned memory; a third send in flight, a call token received twice and a
    receive of another shape fault; a peer whose call differs in a fingerprint field (ll_combine or
    the throughput dispatch against ll_dispatch included; or is 5 calls ahead) makes both ranks fault
    naming the field, and at 4 ranks (the throughput dispatch, hidden) every rank, not only the odd
    one and one peer (tests/gpu/test_fingerprint_gpu.py's process-model-1 cases). Rank masking:
    explicit masks (bf16 and FP8; fused, two-phase, two calls in flight with different masks; random
    masks on the random cases) bit-exact against the reference
    with the mask; shrink mode with the last rank absent (fused, two-phase): the others' outputs
    equal the reference with it masked, the first call waits the timeout once and the later ones do
    not (the persistent mask names the rank, the op and 'discovery'), the host's clear empties it
    and an explicitly masked call after it neither waits nor masks again; a rank that stops after
    one ll_dispatch: the others' ll_combine masks it and adds +0.0 for its rows (~15 s of timeouts)."""
    _need_gxx()
    cmd = [sys.executable, str(ROOT / "tools" / "kernel_emulator" / "ll_run.py"), "--random", "4",
           "--seed", "7", "--driver", str(tmp_path / "ll_driver")]
    out = _run(cmd)
    assert "39/39 low-latency cases pass" in out, out[-6000:]
    masked = re.findall(r"^ok   \(.*\) (.*), \d blocks, masks (\[.*\]) $", out, flags=re.M)
    assert len(masked) == 12, out[-6000:]  # 5 fixed, 3 shrink, 4 random
    assert {m[0] for m in masked} >= {"fused", "two-phase", "two in flight",
                                      "shrink, last rank absent, fused",
                                      "shrink, last rank absent, two-phase",
                                      "shrink, last rank stops after one ll_dispatch, fused"}
    assert any("0" in m[1] for m in masked[7:]), "the random masks masked nothing"
    for field in ("op", "op_throughput", "num_ranks", "num_tokens", "hidden", "num_topk",
                  "num_experts", "dtype", "call_sequence"):
        assert f"ok   mismatch {field}: faults naming it" in out, field
    for field in ("op_throughput", "hidden"):
        assert f"ok   mismatch {field} at 4 ranks: faults naming it" in out, field


@pytest.mark.slow
def test_config_fingerprint_mismatches_on_the_emulator(tmp_path):
    """The config fingerprint (cuda/fingerprint.h) in the throughput kernels (run.py --mismatch): the
    last rank's dispatch differs in one field (op: it runs combine), or its call count in the group
    is 5 calls ahead, or 1 call ahead; or dispatch_rank_major runs over NVSHMEM puts on rank 0
    (cuda/remote_rank_major.cu) and over loads / stores on rank 1 (transport), or rank 0's dispatch
    pulls its rows and rank 1's pushes them (pull: field transport); both ranks trap,
    each record names the field with this rank's value and the peer's, and the host's message
    (xla_ffi/fault_message.cc) names the op, the rank, the field and both values; an out-of-step
    peer is named as such, and a rank left waiting says how many calls behind the other is. About
    30 s (three cases wait for the 5 s timeout; the transport one must not)."""
    _need_gxx()
    cmd = [sys.executable, str(RUN), "--mismatch", "--driver", str(tmp_path / "driver")]
    out = _run(cmd)
    assert "13/13 mismatch cases pass" in out, out[-6000:]
    # a mixed-transport pair (puts / loads and stores, or pulled / pushed rows) is told apart in
    # discovery, not after the 5 s bound
    for case in ("transport", "pull"):
        took = re.search(rf"^ok   mismatch {case} \(([\d.]+)s\)", out, flags=re.M)
        assert took is not None and float(took[1]) < 4, (case, out[-6000:])


@pytest.mark.slow
def test_rank_major_put_transport_on_the_emulator(tmp_path):
    """The rank-major ops over NVSHMEM puts (cuda/remote_rank_major.cu, tools/kernel_emulator/
    put_run.py): no PE has a load/store address of another, every byte crosses through the NVSHMEM
    shim's putmem_signal; dispatch_rank_major (bf16, FP8 from bf16 and f32, f32 -> bf16 rows, 2-4
    ranks, messy routing, a rank that receives nothing, no tokens), then combine_rank_major (NaN in
    the empty rows, -0.0) and broadcast_rank_major through its handle, 1-3 consecutive calls on the
    same buffers: every output bit-exact against jax_ep.reference. Then a PE that issues no call:
    the other times out (3 s) in dispatch_rank_major naming it. About 30 s."""
    _need_gxx()
    cmd = [sys.executable, str(ROOT / "tools" / "kernel_emulator" / "put_run.py"),
           "--driver", str(tmp_path / "put_driver")]
    out = _run(cmd)
    assert "6/6 cases bit-exact" in out, out[-6000:]
    assert "rank 1 receives nothing (rank-major rows [51, 0, 53]" in out, out[-6000:]
    assert "ok   put missing peer -> timeout naming dispatch_rank_major" in out, out[-6000:]
