"""What a failed multi-process run prints of each process (jax_ep.failure_report), on the CPU with synthetic
outputs shaped like a real failure's (4 H200s, process model 2, 2026-11-28): a device-side fingerprint check
traps in one process ("runs a different EP call"), every process fails with CUDA_ERROR_LAUNCH_FAILED, and
XLA then logs hundreds of cuda_stream.cc teardown errors. The test printed only "(532 lines of XLA teardown
errors left out)" and the tail of the cuda_stream.cc lines. Now each process's output starts with a summary
(failing check, jax_ep fault records, first CUDA / XLA error, EP op) and has no teardown noise: in the
library (failure_report.OutputDigest), in python -m jax_ep.launch's output of a failed run, and in the
process-model-2 GPU tests' harness (tests/gpu/gpu_helpers.run_process_group)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from jax_ep import failure_report, launch

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOISE_LINES = 600


def fault_record(me: int, peer: int) -> dict:
    """A record as jax_ep.runtime.faults() gives it (xla_ffi/module.cc FaultToDict): the fingerprint check
    of slot_values found its peer in combine."""
    return {"kind": "mismatch", "op": "slot_values", "field": "op", "device_ordinal": me, "rank": me,
            "waited_rank": peer, "waited_ordinal": peer, "expected": 6, "observed": 2, "elapsed_s": 0.0,
            "message": f"jax_ep: slot_values on GPU {me} (rank {me}): rank {peer} (process {peer}) runs a "
                       f"different EP call at this point: op is slot_values on rank {me} and combine on "
                       f"rank {peer}. Every rank must issue the same EP calls, with the same configuration, "
                       "in the same order; nothing was exchanged."}


XLA_ERROR = ("E1128 12:34:56.789012  812345 pjrt_stream_executor_client.cc:2850] Execution of replica 0 "
             "failed: INTERNAL: CUDA error: Failed to synchronize GPU stream: CUDA_ERROR_LAUNCH_FAILED: "
             "unspecified launch failure")
TEARDOWN = [f"E1128 12:34:57.{i:06d}  812345 cuda_stream.cc:{140 + i % 3}] Failed to destroy CUDA stream "
            f"0x7f3a{i:04x}: CUDA_ERROR_LAUNCH_FAILED: unspecified launch failure"
            for i in range(NOISE_LINES)]


def failed_check_output(me: int, peer: int) -> tuple[list[str], list[str]]:
    """(stdout, stderr) of a process_group_worker whose check failed after the fault: its report line
    with the fault records, XLA's error, the AssertionError's traceback, then XLA's teardown."""
    stdout = [f"process {me}: dispatch_combine h7168_k8_e256 call 0",
              f"process {me}: check dispatch_combine failed; jax_ep faults: {[fault_record(me, peer)]}"]
    stderr = [XLA_ERROR,
              "Traceback (most recent call last):",
              '  File "/w/tests/gpu/process_group_worker.py", line 296, in main',
              "    counts[name] = checks[name](mesh, me)",
              "                   ^^^^^^^^^^^^^^^^^^^^^^",
              '  File "/w/tests/gpu/process_group_worker.py", line 120, in check_cases',
              '    model1.assert_combine_close(got_out, want_out, f"{what} combine")',
              f"AssertionError: process {me} h7168_k8_e256 call 0 combine: 917504 of 917504 values differ",
              *TEARDOWN]
    return stdout, stderr


def xla_error_output() -> tuple[list[str], list[str]]:
    """(stdout, stderr) of a process with no fault record of its own: JAX's chained traceback of the
    XlaRuntimeError its EP call raised, then XLA's teardown."""
    error = ("jaxlib._jax.XlaRuntimeError: INTERNAL: Failed to execute XLA Runtime executable: run time "
             "error: custom call 'jax_ep_combine' failed: CUDA_ERROR_LAUNCH_FAILED: unspecified launch "
             "failure")
    stderr = ["Traceback (most recent call last):",
              '  File "/w/tests/gpu/process_group_worker.py", line 296, in main',
              "jax.errors.SimplifiedTraceback: For simplicity, JAX has removed its internal frames from the "
              "traceback of the following exception. Set JAX_TRACEBACK_FILTERING=off to include these.",
              "",
              "The above exception was the direct cause of the following exception:",
              "",
              "Traceback (most recent call last):",
              '  File "/w/tests/gpu/process_group_worker.py", line 311, in <module>',
              "    main(sys.argv[1:])",
              error, *TEARDOWN]
    return ["process 1: dispatch_combine h7168_k8_e256 call 0"], stderr


def prefixed(p: int, lines: list[str]) -> str:
    return "\n".join(f"[p{p}] {line}" for line in lines)


def assert_summary_first(text: str, p: int, exception: str, fault: str | None, op: str) -> None:
    """The report of process p: its summary first (check, fault record, first CUDA error, op), then the
    tail; none of the teardown lines, their count."""
    lines = text.splitlines()
    assert lines[0].startswith(f"==== process {p}: "), text[:500]
    tail_at = next(i for i, line in enumerate(lines) if line.startswith(f"---- process {p}: the last"))
    summary = "\n".join(lines[:tail_at])
    assert "failing check: " in summary and exception in summary, summary
    if fault is None:
        assert "jax_ep fault records: none printed" in summary, summary
    else:
        assert "jax_ep fault records:\n  " + fault in summary, summary
    first = next(line for line in lines if line.startswith("first CUDA/XLA error: "))
    assert "CUDA_ERROR_LAUNCH_FAILED" in first and "cuda_stream.cc" not in first, first
    assert f"EP op running: {op}" in summary, summary
    assert f"({NOISE_LINES} lines of XLA teardown errors left out)" in summary, summary
    assert "cuda_stream.cc" not in text, text[-2000:]


# ---- the library ------------------------------------------------------------------------------------

def test_summary_names_the_check_fault_error_and_op_before_the_tail():
    stdout, stderr = failed_check_output(0, 3)
    text = failure_report.report(prefixed(0, stdout + stderr), 0, "exited with code 1")
    fault = fault_record(0, 3)["message"]
    assert_summary_first(text, 0, "AssertionError: process 0 h7168_k8_e256 call 0 combine: 917504 of", fault,
                         "slot_values (its fault record; op is slot_values on rank 0 and combine on rank 3)")
    assert "failing check: process 0: check dispatch_combine failed\n" in text, text
    assert "first CUDA/XLA error: " + XLA_ERROR in text
    assert text.rstrip().endswith("values differ"), text[-300:]       # the tail: the traceback's end
    assert len(text) < 4000


def test_chained_xla_error_without_a_fault_record_names_the_custom_call():
    stdout, stderr = xla_error_output()
    found = failure_report.digest(prefixed(1, stdout + stderr))
    assert found.failed()
    text = found.report(1, "exited with code 1")
    assert_summary_first(text, 1, "jaxlib._jax.XlaRuntimeError: INTERNAL: Failed to execute", None,
                         "combine (the custom call jax_ep_combine in an error line)")
    check = text.split("failing check: ", 1)[1].split("\njax_ep fault records")[0]
    assert "SimplifiedTraceback" not in check, check              # JAX's note is not the failure


def test_fault_records_in_every_form_they_are_printed():
    record = dict(fault_record(1, 0), message="jax_ep: combine on GPU 1 (rank 1): the ranks' EP calls are "
                                              "out of step: this is EP call 3")   # a quote: repr's "..."
    forms = [f"process 1: check x failed; jax_ep faults: {[record]}",            # repr of faults()
             "FAULTS=" + json.dumps([record]),                                   # JSON
             "jax_ep.runtime.DeviceFaultError: " + record["message"]]            # check_errors()
    for line in forms:
        assert failure_report.fault_texts(line) == [record["message"]], line
    found = failure_report.digest("\n".join(forms))
    assert found.faults == [record["message"]]                                   # one record, once
    assert found.op().startswith("combine (its fault record")


def test_teardown_noise_and_what_is_never_noise():
    noise = [TEARDOWN[0], "[p2] " + TEARDOWN[1],
             "E1128 12:34:57.000001  812345 cuda_event.cc:50] Error destroying CUDA event: CUDA_ERROR_FOO",
             "E1128 12:34:57.000002  812345 cuda_executor.cc:1200] failed to unload module",
             "E1128 12:34:57.000003  812345 tracked_device_buffer.cc:90] Failed to deallocate buffer 0x7f00",
             "=== Source Location Trace: ===", "xla/stream_executor/cuda/cuda_stream.cc:141", "[p0] "]
    kept = [XLA_ERROR, "jaxlib._jax.XlaRuntimeError: INTERNAL: cuda_stream.cc: CUDA_ERROR_LAUNCH_FAILED",
            "[p0] " + fault_record(0, 1)["message"], "Traceback (most recent call last):",
            "process 0: check dispatch_combine failed"]
    assert [line for line in noise + kept if failure_report.is_teardown_noise(line)] == noise
    assert failure_report.without_teardown_noise("\n".join(noise + kept)).splitlines() == kept + [
        f"({len(noise)} lines of XLA teardown errors left out)"]


# ---- python -m jax_ep.launch ----------------------------------------------------------------------

def child_script(tmp_path: pathlib.Path, outputs: dict[int, tuple[list[str], list[str]]]) -> str:
    """A launcher child: process p prints outputs[p] (stdout, then stderr) and exits 1 once every process
    with an output has printed (a barrier of files; SIGTERM ignored meanwhile: the launcher stops the
    others when the first one exits, which on a loaded machine came before a slow starter had printed);
    a process without an output sleeps (the launcher stops it)."""
    path = tmp_path / "failing_worker.py"
    barrier = tmp_path / "printed"
    path.write_text(f"""
import json, os, pathlib, signal, sys, time
outputs = json.loads({json.dumps(json.dumps({str(p): o for p, o in outputs.items()}))})
me = os.environ["JAX_EP_PROCESS_ID"]
if me not in outputs:
    time.sleep(60)
    sys.exit(0)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
stdout, stderr = outputs[me]
print("\\n".join(stdout), flush=True)
print("\\n".join(stderr), file=sys.stderr, flush=True)
barrier = pathlib.Path({str(barrier)!r})
barrier.mkdir(exist_ok=True)
(barrier / me).touch()
deadline = time.monotonic() + 30
while len(list(barrier.iterdir())) < len(outputs) and time.monotonic() < deadline:
    time.sleep(0.05)
os._exit(1)
""")
    return str(path)


def cpu_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_EP_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["JAX_PLATFORMS"] = "cpu"
    return env


def test_launcher_prints_a_summary_of_each_failed_process(tmp_path):
    """Process 0 fails as above (a fault record, the AssertionError, 600 teardown lines); process 1, asleep,
    is stopped by the launcher. Its output ends with every exit code and each process's summary."""
    worker = child_script(tmp_path, {0: failed_check_output(0, 1)})
    proc = subprocess.run([sys.executable, "-m", "jax_ep.launch", "--nproc", "2", "--grace", "5", worker],
                          capture_output=True, text=True, timeout=60, env=cpu_env(), cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert launch.exit_codes(proc.stderr) == {0: 1, 1: -15}, proc.stderr[-3000:]
    after = proc.stderr.split(f"{launch.PREFIX} exit codes:", 1)[1]     # after every streamed line
    blocks = after.split("==== process ")
    p0 = "==== process " + blocks[1]
    assert p0.startswith("==== process 0: pid "), p0[:200]
    assert_summary_first(p0, 0, "AssertionError: process 0 h7168_k8_e256 call 0",
                         fault_record(0, 1)["message"], "slot_values")
    assert "exited with code 1" in p0.splitlines()[0]
    p1 = "==== process " + blocks[2]
    assert "was killed by SIGTERM" in p1.splitlines()[0] and "failing check: none found" in p1, p1
    assert proc.stderr.rstrip().endswith(f"{launch.PREFIX} failed: process 0 exited with code 1")


def test_launcher_prints_no_summary_when_every_process_succeeds(tmp_path):
    worker = tmp_path / "ok.py"
    worker.write_text("print('worker OK')\n")
    proc = subprocess.run([sys.executable, "-m", "jax_ep.launch", "--nproc", "2", str(worker)],
                          capture_output=True, text=True, timeout=60, env=cpu_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "exit codes:" not in proc.stderr and "==== process" not in proc.stderr
    assert launch.exit_codes(proc.stderr) == {}


# gloo's connection messages as 2 processes of examples/train_moe.py print them (CPU, 2026-11-28): 23 lines,
# written piecewise by several threads, so that two can share a line and a message's end can stand alone
GLOO = ["[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1",
        "[Gloo] Rank 0 is connected to 0 peer ranks. Expected number of connected peer ranks is : 0",
        "[Gloo] Rank 5 is connected to 7 peer ranks. Expected number of connected peer ranks is : 7",
        "[Gloo] Rank 7 is connected to [Gloo] Rank 6 is connected to 7 peer ranks. Expected number of "
        "connected peer ranks is : 7",
        "7 peer ranks. Expected number of connected peer ranks is : 7"]


def test_gloo_connection_messages_are_transport_chatter():
    chatter = GLOO + ["[p1] " + line for line in GLOO] + [GLOO[0] + "\n"]
    kept = ["[Gloo] Rank 1 failed to connect to rank 0: Connection refused",
            "[p0] Gloo: connected 7 peer ranks", "process 1 is connected to 7 peer ranks", "7", "[p0] ",
            "", "train_moe: 8 x cpu devices in 2 processes", "Traceback (most recent call last):",
            "[p0] [Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1 "
            "and then something else"]
    assert [line for line in chatter + kept if failure_report.is_transport_chatter(line)] == chatter


def test_launcher_leaves_out_gloo_chatter_unless_verbose(tmp_path):
    """python -m jax_ep.launch prints the processes' lines but gloo's connection messages, saying how many
    it left out; --verbose prints them too."""
    worker = tmp_path / "chatty.py"
    worker.write_text(f"""
import json, sys
print("worker OK", flush=True)
for line in json.loads({json.dumps(json.dumps(GLOO))}):
    print(line, file=sys.stderr, flush=True)
print("[Gloo] Rank 1 failed to connect to rank 0", file=sys.stderr, flush=True)
print("worker done", flush=True)
""")

    def launch_run(*flags):
        proc = subprocess.run([sys.executable, "-m", "jax_ep.launch", "--nproc", "2", *flags, str(worker)],
                              capture_output=True, text=True, timeout=60, env=cpu_env(), cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        return proc

    quiet = launch_run()
    for i in range(2):
        assert f"[p{i}] worker OK\n" in quiet.stdout and f"[p{i}] worker done\n" in quiet.stdout
        assert f"[p{i}] [Gloo] Rank 1 failed to connect to rank 0" in quiet.stderr   # not chatter
    assert "is connected to" not in quiet.stderr and "peer ranks" not in quiet.stderr, quiet.stderr
    assert f"{launch.PREFIX} left out {2 * len(GLOO)} lines of gloo connection messages (--verbose prints " \
           "them)" in quiet.stderr
    verbose = launch_run("--verbose")
    for i in range(2):
        for line in GLOO:
            assert f"[p{i}] {line}\n" in verbose.stderr
    assert "left out" not in verbose.stderr


# ---- the GPU tests' harness (tests/gpu/gpu_helpers.py) ----------------------------------------------

@pytest.fixture
def gpu_helpers(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tests" / "gpu"))
    import gpu_helpers

    monkeypatch.setattr(gpu_helpers, "SHARE_GPU", False)
    return gpu_helpers


def test_gpu_harness_prints_each_processes_summary_first(gpu_helpers, tmp_path):
    """run_process_group (what test_process_per_gpu_matches_reference prints: out[-6000:], out[-4000:] in
    its assertion) on a failed run: each process's text is its summary, then its tail, within 4000
    characters. A passing run's output stays as it was."""
    ok = tmp_path / "ok.py"
    ok.write_text("import os\nprint('worker OK process', os.environ['JAX_EP_PROCESS_ID'])\n")
    rc, _, per_process = gpu_helpers.run_process_group(str(ok), timeout_s=60, env=cpu_env())
    assert rc == 0
    assert per_process == [f"[p{p}] worker OK process {p}" for p in range(gpu_helpers.NUM_PROCESSES)]

    n = gpu_helpers.NUM_PROCESSES
    outputs = {p: failed_check_output(p, (p + 1) % n) for p in range(n)}
    outputs[n - 1] = xla_error_output()
    worker = child_script(tmp_path, outputs)
    rc, out, per_process = gpu_helpers.run_process_group(worker, timeout_s=60, env=cpu_env())
    assert rc == 1, out[-3000:]
    assert len(per_process) == n
    for p, text in enumerate(per_process):
        shown = text[-4000:]
        assert shown == text, len(text)
        assert shown.splitlines()[0] == f"==== process {p}: exited with code 1 ====", shown[:300]
        if p == n - 1:
            assert_summary_first(shown, p, "XlaRuntimeError: INTERNAL:", None, "combine")
        else:
            assert_summary_first(shown, p, f"AssertionError: process {p} h7168",
                                 fault_record(p, (p + 1) % n)["message"], "slot_values")



CHECKED_MODE_FAILURE = """\
Traceback (most recent call last):
  File "train.py", line 14, in <module>
  File "/venv/jax/_src/array.py", line 647, in _value
jax.errors.JaxRuntimeError: INTERNAL: CpuCallback error calling callback: Traceback (most recent call last):
  File "/venv/jax/_src/callback.py", line 816, in _wrapped_callback
  File "/work/jax_ep/validation.py", line 295, in callback
EPValueError: jax_ep.dispatch: topk_idx has 1 ids outside [-1, 8) across the EP group; first bad value 99

The above exception was the direct cause of the following exception:

Traceback (most recent call last):
  File "train.py", line 16, in <module>
RuntimeError: training step 3 failed
"""


def test_a_checked_mode_failure_names_its_message_and_the_exception_raised_from_it():
    """JAX's error of a checked-mode check holds the callback's traceback, then 'EPValueError: <message>'
    (docs/api.md): the summary showed the JaxRuntimeError with three of the callback's 'File' lines and
    never the message; and the message's further lines ended the reader, dropping what was raised from it."""
    check = failure_report.digest(CHECKED_MODE_FAILURE).failing_check()
    assert check == ["EPValueError: jax_ep.dispatch: topk_idx has 1 ids outside [-1, 8) across the EP group; "
                     "first bad value 99", "RuntimeError: training step 3 failed"], check
    alone = CHECKED_MODE_FAILURE.split("\n\nThe above")[0]
    assert failure_report.digest(alone).failing_check()[-1].startswith("EPValueError: jax_ep.dispatch: ")
    several = ("Traceback (most recent call last):\n  File \"a.py\", line 1, in <module>\n"
               "jax_ep.DeviceFaultError: 2 jax_ep device faults:\njax_ep: dispatch on GPU 0 timed out\n"
               "jax_ep: dispatch on GPU 1 timed out\nthird line\nfourth line\n\n"
               "During handling of the above exception, another exception occurred:\n\n"
               "Traceback (most recent call last):\n  File \"a.py\", line 3, in <module>\nSystemExit: 3\n")
    assert failure_report.digest(several).failing_check()[-1] == "SystemExit: 3"


def test_other_threads_lines_between_the_frames_are_not_the_exception():
    """XLA's absl log line (another replica's failure) or the fault watcher's record printed between a
    traceback's frames was taken as the exception, and the real one dropped."""
    xla = ("E1128 12:34:56.789012  812345 pjrt_stream_executor_client.cc:2850] Execution of replica 1 "
           "failed: INTERNAL: CUDA error")
    for other in (xla, "jax_ep device fault: jax_ep: dispatch on GPU 1 timed out"):
        text = "\n".join(["Traceback (most recent call last):", '  File "/w/train.py", line 88, in <module>',
                          other, "    loss = step(params, batch)",
                          "jaxlib._jax.XlaRuntimeError: INTERNAL: CUDA error: CUDA_ERROR_LAUNCH_FAILED"])
        check = failure_report.digest(text).failing_check()
        assert check == ["jaxlib._jax.XlaRuntimeError: INTERNAL: CUDA error: CUDA_ERROR_LAUNCH_FAILED"], check


@pytest.mark.parametrize("target,op", [("jax_ep_combine_uncaptured", "combine"),
                                       ("jax_ep_dispatch_side", "dispatch"), ("jax_ep_side_join", None)])
def test_a_target_variant_names_its_op(target, op):
    """runtime.target's variants (an op on XLA's async stream or on jax_ep's side stream) named ops
    'combine_uncaptured' / 'dispatch_side', and the side stream's join 'side_join'."""
    text = f"jaxlib._jax.XlaRuntimeError: INTERNAL: custom call '{target}' failed: CUDA_ERROR_ILLEGAL_ADDRESS"
    named = failure_report.digest(text).op()
    assert (named or "").split(" (")[0] == (op or ""), named


def test_a_long_fault_record_keeps_its_advice():
    """The longest fault records (~530 characters: a group-discovery timeout) end with their advice,
    which the summary's 400-character cut removed."""
    record = ("jax_ep: dispatch on GPU 1 (rank 1 of 2) timed out after 100 s waiting for "
              + "the peers' group discovery, " * 16 + "raise JAX_EP_TIMEOUT_S.")
    assert len(record) > 500
    assert record in failure_report.digest(f"jax_ep device fault: {record}").summary(0)
