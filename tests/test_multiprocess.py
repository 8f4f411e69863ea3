"""Process model 2 on CPU: the MoE layer run as 2 processes (jax.distributed, gloo collectives) equals the
same computation in one process; the launcher (python -m jax_ep.launch) and jax_ep.distributed's errors.

Every subprocess wait is bounded (a hang fails the test, naming what hung, with the logs).
"""

import contextlib
import errno
import os
import pathlib
import platform
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time

import jax
import numpy as np
import pytest
from helpers import assert_bits_equal, run_logged

import jax_ep.distributed as dist
from jax_ep import launch
from jax_ep import mps as mps_probe
from jax_ep.errors import EPRuntimeError, EPTypeError

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "multiprocess_worker.py"
WAIT_S = 240          # the launcher stops its processes after WAIT_S - 30 s (--timeout)
EPS32 = float(np.finfo(np.float32).eps)


def child_env(**extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in (dist.ENV_NUM_PROCESSES, dist.ENV_PROCESS_ID, dist.ENV_COORDINATOR)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["JAX_PLATFORMS"] = "cpu"    # a CPU test, on GPU machines too
    env.update(extra)
    return env


# ---- the MoE layer across processes ---------------------------------------------------------------

# Floating-point values that are sums over the ranks, with a summation order that differs between one
# process (XLA:CPU's in-process all-reduce) and two (gloo's all-reduce over TCP): the loss, the pmean-ed
# aux loss and the gradients of the replicated parameters (router, shared expert), which the shard_map
# transpose psums over the ranks. They agree to a few float32 ulps of the array's largest value
# (measured: at most 1); a missing or doubled rank would be off by O(1). Everything else (the layer's
# output, the input's gradient, the expert weights' gradients, loads, bias, parameters) is bit-exact.
RANK_SUMS = ("['loss']", "['state']['last_aux_loss']", "['grads']['router']", "['grads']['shared']")
RANK_SUM_ULPS = 32


@pytest.mark.slow
def test_moe_layer_two_processes_equal_one(tmp_path):
    """2 processes x 2 CPU devices (jax_ep.launch, jax.distributed) vs 1 process x 4 devices: the MoE layer
    (reference dispatch/combine through backend="auto") forward, gradients and statistics, on a 4-rank EP
    mesh whose all_to_all crosses the processes."""
    seed = int.from_bytes(os.urandom(4), "little") % 2**31     # fresh inputs, parameters and cotangent
    worker = [str(WORKER), "--seed", str(seed), "--devices", "4"]
    commands = {
        "two_processes": [sys.executable, "-m", "jax_ep.launch", "--nproc", "2",
                          "--local-devices-per-process", "2", "--timeout", str(WAIT_S - 30), "--grace", "5",
                          *worker, "--out", str(tmp_path / "two.npz")],
        "one_process": [sys.executable, *worker, "--out", str(tmp_path / "one.npz")],
    }
    env = child_env(JAX_NUM_CPU_DEVICES="4")    # the launcher sets 2 for each of its processes
    start = time.perf_counter()
    results = run_logged(commands, tmp_path, cwd=tmp_path, env=env, wait_s=WAIT_S)
    seconds = time.perf_counter() - start
    for name, (code, log) in results.items():
        assert code == 0, f"{name} (seed {seed}) exited with {code}:\n{log[-5000:]}"
    log2 = results["two_processes"][1]
    assert "[p0] worker: process 0 of 2, 4 devices" in log2 and "[p1] worker: process 1 of 2" in log2, log2
    assert "worker: process 0 of 1, 4 devices" in results["one_process"][1]

    one, two = np.load(tmp_path / "one.npz"), np.load(tmp_path / "two.npz")
    assert sorted(one.files) == sorted(two.files)
    assert {"['out']", "['grad_x']", "['grads']['w_gate_up']", "['grads']['router']",
            "['state']['last_load']"} <= set(one.files)
    for name in one.files:
        want, got = one[name], two[name]
        what = f"{name} (seed {seed})"
        if name.startswith(RANK_SUMS):
            assert got.shape == want.shape and got.dtype == want.dtype, what
            atol = RANK_SUM_ULPS * EPS32 * float(np.abs(want).max())
            np.testing.assert_allclose(got, want, rtol=0, atol=atol, err_msg=what)
        else:
            assert_bits_equal(got, want, what)
    assert np.abs(one["['grads']['w_down']"]).max() > 0 and np.abs(one["['grads']['router']"]).max() > 0
    print(f"seed {seed}: both runs (started together) took {seconds:.1f} s")


# ---- the launcher ----------------------------------------------------------------------------------

def script(tmp_path: pathlib.Path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def launch_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "jax_ep.launch", *args]


def alive(pid: int, marker: str) -> bool:
    """Is process `pid` still the one running `marker` (not a reused pid)?"""
    try:
        return marker in pathlib.Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return False


def wait_for_files(paths, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline:
            pytest.fail(f"not written within {timeout_s} s: {[str(p) for p in paths if not p.exists()]}")
        time.sleep(0.05)


def test_launcher_environment_and_output(tmp_path):
    child = script(tmp_path, "child.py", """
        import os, sys
        keys = ("JAX_EP_PROCESS_ID", "JAX_EP_NUM_PROCESSES", "JAX_COORDINATOR_ADDRESS", "JAX_NUM_CPU_DEVICES",
                "JAX_LOCAL_DEVICE_IDS")
        print("env", *(os.environ.get(k, "-") for k in keys), *sys.argv[1:])
        print("to stderr", file=sys.stderr)
        sys.stdout.write("no newline at the end")
        """)
    proc = subprocess.run(launch_cmd("--nproc", "3", "--local-devices-per-process", "2", child, "--x", "-h"),
                          capture_output=True, text=True, timeout=60, env=child_env())
    assert proc.returncode == 0, proc.stderr
    envs = sorted(line.split()[1:] for line in proc.stdout.splitlines() if line.split()[1:2] == ["env"])
    assert [e[0] for e in envs] == ["env"] * 3
    assert [e[1] for e in envs] == ["0", "1", "2"] and {e[2] for e in envs} == {"3"}
    assert len({e[3] for e in envs}) == 1 and envs[0][3].startswith("127.0.0.1:")
    assert {e[4] for e in envs} == {"2"} and {e[5] for e in envs} == {"-"}    # CPU: no GPU ids
    assert all(e[6:] == ["--x", "-h"] for e in envs)                         # the script's arguments
    for i in range(3):
        assert f"[p{i}] env {i} 3" in proc.stdout and f"[p{i}] no newline at the end\n" in proc.stdout
        assert f"[p{i}] to stderr" in proc.stderr


def test_launcher_failure_stops_the_others(tmp_path):
    """Process 1 exits with 3: the launcher stops process 0 (asleep for 10 minutes), exits with 3 and
    names process 1."""
    child = script(tmp_path, "fail_child.py", f"""
        import os, pathlib, sys, time
        me = os.environ["JAX_EP_PROCESS_ID"]
        pathlib.Path({str(tmp_path)!r}, "pid" + me).write_text(str(os.getpid()))
        if me == "1":
            while not pathlib.Path({str(tmp_path)!r}, "pid0").exists():
                time.sleep(0.01)
            sys.exit(3)
        time.sleep(600)
        """)
    start = time.monotonic()
    proc = subprocess.run(launch_cmd("--nproc", "2", "--grace", "5", child), capture_output=True, text=True,
                          timeout=60, env=child_env())
    assert proc.returncode == 3, (proc.returncode, proc.stderr)
    assert "process 1" in proc.stderr and "exited with code 3" in proc.stderr, proc.stderr
    assert "failed: process 1 exited with code 3" in proc.stderr, proc.stderr
    assert time.monotonic() - start < 30
    assert not alive(int((tmp_path / "pid0").read_text()), "fail_child.py"), "process 0 still runs"


def test_launcher_passes_signals_on_and_kills_after_grace(tmp_path):
    """SIGTERM to the launcher reaches both processes; the one that ignores it is killed --grace s later;
    the launcher exits with 128 + SIGTERM."""
    child = script(tmp_path, "signal_child.py", f"""
        import os, pathlib, signal, sys, time
        me = os.environ["JAX_EP_PROCESS_ID"]
        folder = pathlib.Path({str(tmp_path)!r})
        if me == "0":
            def on_term(sig, frame):
                (folder / "term0").write_text("got SIGTERM")
                sys.exit(0)
            signal.signal(signal.SIGTERM, on_term)
        else:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        (folder / ("ready" + me)).write_text(str(os.getpid()))
        time.sleep(600)
        """)
    proc = subprocess.Popen(launch_cmd("--nproc", "2", "--grace", "1", child), env=child_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_files([tmp_path / "ready0", tmp_path / "ready1"])
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM, (proc.returncode, stderr)
    assert time.monotonic() - start < 15
    assert (tmp_path / "term0").read_text() == "got SIGTERM"
    assert "SIGKILL" in stderr, stderr
    for i in range(2):
        assert not alive(int((tmp_path / f"ready{i}").read_text()), "signal_child.py"), f"process {i} runs"


def test_launcher_timeout(tmp_path):
    child = script(tmp_path, "sleeper.py", "import time\ntime.sleep(600)\n")
    proc = subprocess.run(launch_cmd("--nproc", "2", "--timeout", "1", "--grace", "1", child),
                          capture_output=True, text=True, timeout=60, env=child_env())
    assert proc.returncode == launch.TIMEOUT_EXIT_CODE, proc.stderr
    assert "--timeout 1 s" in proc.stderr, proc.stderr


def plain_core_files() -> bool:
    """Does a crash here write a core file into its working directory (core_pattern a plain name)?"""
    try:
        pattern = pathlib.Path("/proc/sys/kernel/core_pattern").read_text().strip()
    except OSError:
        return False
    return bool(pattern) and not pattern.startswith("|") and "/" not in pattern


def test_launcher_timeout_prints_stacks(tmp_path):
    """--timeout: every process prints the Python stack of each of its threads ([pI]-prefixed) before it
    is stopped, the launcher exits 124 well before --grace would matter, and the SIGABRT leaves no
    core file although the processes allow one (checked where core_pattern writes into the cwd)."""
    child = script(tmp_path, "hung_child.py", """
        import resource, threading, time
        _, hard = resource.getrlimit(resource.RLIMIT_CORE)
        resource.setrlimit(resource.RLIMIT_CORE, (hard, hard))   # a crash would write a core file

        def background_heartbeat():
            time.sleep(600)

        def waiting_for_peer():
            time.sleep(600)

        threading.Thread(target=background_heartbeat, daemon=True).start()
        print("ready", flush=True)
        waiting_for_peer()
        """)
    env = child_env()
    env.pop("PYTHONFAULTHANDLER", None)          # the launcher sets it
    start = time.monotonic()
    # a grace far above the run's own time (which includes the children's jax import, ~11 s on a
    # loaded 2-core machine): finishing well before it shows the aborted processes were not waited on
    proc = subprocess.run(launch_cmd("--nproc", "2", "--timeout", "3", "--grace", "90", child),
                          capture_output=True, text=True, timeout=150, env=env, cwd=tmp_path)
    seconds = time.monotonic() - start
    assert proc.returncode == launch.TIMEOUT_EXIT_CODE, (proc.returncode, proc.stderr)
    assert seconds < 60, f"{seconds:.1f} s: the aborted processes were waited on for --grace"
    for i in range(2):
        assert f"[p{i}] ready" in proc.stdout, proc.stdout
        for function in ("waiting_for_peer", "background_heartbeat"):   # every thread's stack
            assert any(line.startswith(f"[p{i}] ") and line.endswith(f" in {function}")
                       for line in proc.stderr.splitlines()), (i, function, proc.stderr)
    assert "SIGABRT to processes [0, 1]" in proc.stderr, proc.stderr
    if plain_core_files():
        assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("core")]


@pytest.mark.parametrize("closed", [("stdout",), ("stdout", "stderr")], ids=["stdout", "stdout_stderr"])
def test_launcher_goes_on_when_its_output_is_closed(tmp_path, closed):
    """The launcher's reader goes away (``python -m jax_ep.launch ... | head -1``): what would go there is
    dropped, but the processes' output is still read (a process printing more than a pipe holds is not
    blocked), and the launcher ends with the run's exit code: no hang, no BrokenPipeError."""
    child = script(tmp_path, "chatty.py", """
        import sys
        for i in range(10000):       # ~0.5 MB on each stream: far more than a pipe holds
            print("out", i, "x" * 40)
            print("err", i, "y" * 40, file=sys.stderr)
        print("all printed", file=sys.stderr)
        sys.exit(3)
        """)
    proc = subprocess.Popen(launch_cmd("--nproc", "1", child), env=child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        assert select.select([proc.stderr], [], [], 60)[0], "the launcher said nothing within 60 s"
        assert proc.stderr.readline().startswith(launch.PREFIX.encode())   # it started
        for name in closed:
            getattr(proc, name).close()
        _, stderr = proc.communicate(timeout=45)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the launcher still runs 45 s after its {' and '.join(closed)} closed")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == 3, proc.returncode
    if "stderr" not in closed:
        text = stderr.decode()
        assert "[p0] all printed" in text and "failed: process 0 exited with code 3" in text, text[-3000:]
        assert "the launcher's stdout is closed" in text and "Traceback" not in text, text[-3000:]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_launcher_keeps_an_output_that_fails_for_now(tmp_path):
    """A write error other than a closed reader (here a full device: ENOSPC) loses that line only: the
    launcher does not take the stream for closed (found by a review, 2026-12-05: any OSError sent the
    rest of the run's output to /dev/null, saying the stream was closed)."""
    child = script(tmp_path, "say.py", "print('hello')\n")
    with open("/dev/full", "wb") as full:
        proc = subprocess.run(launch_cmd("--nproc", "1", child), stdout=full, stderr=subprocess.PIPE,
                              text=True, timeout=120, env=child_env())
    assert proc.returncode == 0, proc.stderr
    assert "is closed" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("code", [0, 3])
def test_launcher_stops_what_an_exited_process_started(tmp_path, code):
    """Processes that started a process of their own and exited (code 0, or 3: failed): the launcher's
    signals go to their process groups, so what they started does not outlive the launcher."""
    child = script(tmp_path, "parent.py", f"""
        import os, pathlib, subprocess, sys, time
        sleeper = subprocess.Popen(["sleep", "600"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        folder, me = pathlib.Path({str(tmp_path)!r}), os.environ["JAX_EP_PROCESS_ID"]
        (folder / ("sleeper" + me)).write_text(str(sleeper.pid))
        while not all((folder / f"sleeper{{i}}").exists() for i in range(2)):   # both started theirs
            time.sleep(0.01)
        sys.exit({code})
        """)
    files = [tmp_path / "sleeper0", tmp_path / "sleeper1"]
    try:
        proc = subprocess.run(launch_cmd("--nproc", "2", "--grace", "5", child), capture_output=True,
                              text=True, timeout=60, env=child_env())
        assert proc.returncode == code, (proc.returncode, proc.stderr)
        pids = [int(f.read_text()) for f in files]
        deadline = time.monotonic() + 10    # SIGKILL: gone at once (the wait: a loaded machine)
        while any(alive(pid, "sleep") for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [pid for pid in pids if alive(pid, "sleep")], "a process's child outlived the launcher"
    finally:
        for f in files:
            if f.exists() and alive(int(f.read_text()), "sleep"):
                os.kill(int(f.read_text()), signal.SIGKILL)


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")   # the launcher forks, here in pytest's process
def test_a_signal_during_start_reaches_every_process(tmp_path, monkeypatch):
    """SIGTERM while the launcher starts its processes (here: right after the first): the processes
    started after it get it too, not only SIGKILL --grace seconds later."""
    child = script(tmp_path, "sleeper.py", "import time\ntime.sleep(120)\n")
    started = []

    def popen(*args, **kwargs):
        proc = real_popen(*args, **kwargs)
        started.append(proc)
        if len(started) == 1:
            os.kill(os.getpid(), signal.SIGTERM)   # the launcher's handler, on this (the main) thread
        return proc

    real_popen = subprocess.Popen
    monkeypatch.setattr(launch.subprocess, "Popen", popen)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    try:
        assert launch.main(["--nproc", "2", "--grace", "60", child]) == 128 + signal.SIGTERM
        assert [p.returncode for p in started] == [-signal.SIGTERM, -signal.SIGTERM]
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.kill()


def blocked_writing(pid: int, fd: int) -> bool | None:
    """Is the main thread of process `pid` blocked in write(2) to `fd`? None: this host cannot tell (reads
    /proc/PID/syscall, Linux x86-64 / aarch64)."""
    number = {"x86_64": 1, "aarch64": 64}.get(platform.machine())
    try:
        fields = pathlib.Path(f"/proc/{pid}/syscall").read_text().split()
    except OSError:
        return None
    return None if number is None else fields[:2] == [str(number), hex(fd)]


def test_launcher_signal_while_writing_to_a_full_stderr(tmp_path):
    """SIGTERM comes while the launcher's main thread is blocked writing to its full stderr (holding the
    lock of the launcher's output): the signal still reaches the processes, and once its stderr is read
    the launcher says so and exits 128 + SIGTERM (the handler used to print, taking that lock: forever)."""
    child = script(tmp_path, "go_child.py", f"""
        import os, pathlib, sys, time
        folder, me = pathlib.Path({str(tmp_path)!r}), os.environ["JAX_EP_PROCESS_ID"]
        (folder / ("ready" + me)).write_text(str(os.getpid()))
        if me == "1":
            while not (folder / "go").exists():
                time.sleep(0.01)
            sys.exit(3)
        time.sleep(600)
        """)
    read_end, write_end = os.pipe()
    proc = subprocess.Popen(launch_cmd("--nproc", "2", "--grace", "5", child), env=child_env(),
                            stdout=subprocess.DEVNULL, stderr=write_end)
    # a file description of our own to fill the pipe (O_NONBLOCK on write_end's would be the launcher's too)
    filler = os.open(f"/proc/self/fd/{write_end}", os.O_WRONLY | os.O_NONBLOCK)
    os.close(write_end)
    got = b""
    try:
        wait_for_files([tmp_path / "ready0", tmp_path / "ready1"])   # the launcher's first line is written
        with contextlib.suppress(BlockingIOError):
            while True:
                os.write(filler, b"x" * 64)
        os.close(filler)
        filler = None
        (tmp_path / "go").write_text("")     # process 1 fails: the launcher says so, blocked on the pipe
        deadline = time.monotonic() + 30
        while not blocked_writing(proc.pid, 2):
            if blocked_writing(proc.pid, 2) is None:
                time.sleep(3)        # cannot look: time enough to find the failure and block
                break
            assert time.monotonic() < deadline, "the launcher did not block on its stderr within 30 s"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        time.sleep(1)                # the handler runs inside the blocked write
        deadline = time.monotonic() + 20
        while select.select([read_end], [], [], max(0.0, deadline - time.monotonic()))[0]:
            chunk = os.read(read_end, 65536)
            if not chunk:
                break
            got += chunk
        else:
            pytest.fail("the launcher did not close its stderr within 20 s of it being read: "
                        + re.sub(rb"x{64,}", b"", got).decode()[-2000:])
        proc.wait(timeout=30)
    finally:
        os.close(read_end)
        if filler is not None:
            os.close(filler)
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    text = re.sub(rb"x{64,}", b"", got).decode()
    assert proc.returncode == 128 + signal.SIGTERM, (proc.returncode, text)
    assert "got SIGTERM, passing it on" in text, text
    assert not alive(int((tmp_path / "ready0").read_text()), "go_child.py"), "process 0 still runs"


def test_launcher_keeps_the_users_faulthandler_setting(monkeypatch):
    args = launch.parse_args(["--nproc", "2", __file__])
    monkeypatch.delenv("PYTHONFAULTHANDLER", raising=False)
    assert {env["PYTHONFAULTHANDLER"] for env in launch.process_envs(args, gpus=0)} == {"1"}
    monkeypatch.setenv("PYTHONFAULTHANDLER", "")     # off, as the user asked
    assert {env["PYTHONFAULTHANDLER"] for env in launch.process_envs(args, gpus=0)} == {""}


@pytest.mark.parametrize("argv,message", [
    (["--nproc", "0", "SCRIPT"], "argument --nproc: must be a positive integer, got '0'"),
    (["--nproc", "two", "SCRIPT"], "argument --nproc: must be a positive integer, got 'two'"),
    (["--nproc", "2", "--coordinator", "nohost", "SCRIPT"],
     "argument --coordinator: must be HOST:PORT with a port in 1..65535, got 'nohost'"),
    (["--nproc", "2", "--coordinator", "h:70000", "SCRIPT"], "argument --coordinator: must be HOST:PORT"),
    # every process runs here: HOST must be this host's (TEST-NET-1 is nobody's)
    (["--nproc", "2", "--coordinator", "192.0.2.1:45000", "SCRIPT"],
     "argument --coordinator: HOST of '192.0.2.1:45000' is not an address of this host"),
    (["--nproc", "2", "--local-devices-per-process", "-1", "SCRIPT"],
     "argument --local-devices-per-process: must be a positive integer, got '-1'"),
    (["--nproc", "2", "--local-device-ids", "0,x", "SCRIPT"],
     "argument --local-device-ids: must be auto, none or distinct GPU indices I,J,..., got '0,x'"),
    (["--nproc", "2", "--local-device-ids", "1,1", "SCRIPT"],
     "argument --local-device-ids: must be auto, none or distinct GPU indices I,J,..., got '1,1' "
     "(processes sharing a GPU: --share-gpus)"),
    (["--nproc", "2", "--local-devices-per-process", "2", "--local-device-ids", "0,0,1,1", "--share-gpus",
      "SCRIPT"], "argument --local-device-ids: process 0 would get GPUs [0, 0]: a process cannot use one "
                 "GPU twice"),
    (["--nproc", "2", "--local-device-ids", "0,1,2", "SCRIPT"],
     "argument --local-device-ids: 3 GPU indices 0,1,2 for --nproc 2"),
    (["--nproc", "2", "--grace", "-1", "SCRIPT"],
     "argument --grace: must be a number of seconds >= 0, got '-1'"),
    (["--nproc", "2", "--timeout", "soon", "SCRIPT"], "argument --timeout: must be a number of seconds"),
    (["--nproc", "2", "missing_script.py"], "argument script: no such file: 'missing_script.py'"),
    (["--nproc", "2"], "the following arguments are required: script"),
    (["SCRIPT"], "the following arguments are required: --nproc"),
])
def test_launcher_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        launch.parse_args([__file__ if a == "SCRIPT" else a for a in argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_launcher_devices(monkeypatch):
    args = launch.parse_args(["--nproc", "2", "--local-devices-per-process", "2", __file__])
    gpu = launch.process_envs(args, gpus=4)
    assert [env[dist.ENV_LOCAL_DEVICE_IDS] for env in gpu] == ["0,1", "2,3"]
    assert [env[dist.ENV_PROCESS_ID] for env in gpu] == ["0", "1"]
    assert all(env["JAX_NUM_CPU_DEVICES"] == "2" and env[dist.ENV_NUM_PROCESSES] == "2" for env in gpu)
    assert all(env.get("CUDA_VISIBLE_DEVICES") == os.environ.get("CUDA_VISIBLE_DEVICES") for env in gpu)
    assert all(dist.ENV_LOCAL_DEVICE_IDS not in env for env in launch.process_envs(args, gpus=0))
    with pytest.raises(SystemExit, match="needs 4 GPUs, this host has 3"):
        launch.process_envs(args, gpus=3)
    explicit = launch.parse_args(["--nproc", "2", "--local-device-ids", "6,7,4,5",
                                  "--local-devices-per-process", "2", "--coordinator", "localhost:1234",
                                  __file__])
    envs = launch.process_envs(explicit, gpus=0)
    assert [env[dist.ENV_LOCAL_DEVICE_IDS] for env in envs] == ["6,7", "4,5"]
    assert {env[dist.ENV_COORDINATOR] for env in envs} == {"localhost:1234"}
    none = launch.parse_args(["--nproc", "2", "--local-device-ids", "none", __file__])
    assert all(dist.ENV_LOCAL_DEVICE_IDS not in env for env in launch.process_envs(none, gpus=8))

    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert launch.host_gpu_count() == 0
    monkeypatch.setenv("JAX_PLATFORMS", "cuda,cpu")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,3")
    assert launch.host_gpu_count() == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert launch.host_gpu_count() == 0


@pytest.fixture
def mps(monkeypatch, request):
    """CUDA_MPS_PIPE_DIRECTORY set to an empty folder (MPS not running); mps.start() binds its control
    socket (a stream socket that listens, or the socket type the test's indirect parameter names) as a
    daemon does, and mps.stop() closes it, leaving the file behind, as a stopped daemon does. No
    CUDA_MPS_ACTIVE_THREAD_PERCENTAGE."""
    folder = pathlib.Path(tempfile.mkdtemp(prefix="mps", dir="/tmp"))   # short: a socket path ≤ 107 bytes
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(folder))
    monkeypatch.delenv(launch.MPS_PERCENTAGE, raising=False)
    kind = getattr(request, "param", "SOCK_STREAM")
    listener = socket.socket(socket.AF_UNIX, getattr(socket, kind))

    class Mps:
        pipe = folder / "control"

        @staticmethod
        def start():
            listener.bind(str(folder / "control"))
            if kind != "SOCK_DGRAM":
                listener.listen(128)   # never accepted: room for every check of a test

        @staticmethod
        def stop():
            listener.close()

    yield Mps
    listener.close()
    shutil.rmtree(folder, ignore_errors=True)


def test_mps_unavailable_connects_to_the_control_pipe(mps):
    """No pipe, a listening socket, the socket a stopped daemon left, a named pipe with and without a
    reader, a plain file: mps_unavailable says which, None only when something answers."""
    assert mps_probe.mps_unavailable() == f"no control pipe {mps.pipe}"
    mps.start()
    assert mps_probe.mps_unavailable() is None and mps_probe.mps_unavailable(mps.pipe) is None
    mps.stop()
    why = mps_probe.mps_unavailable()
    assert why.startswith(f"its control socket {mps.pipe} refuses connections (") and why.endswith(
        "a stopped daemon left it behind"), why
    fifo = mps.pipe.with_name("fifo")
    os.mkfifo(fifo)
    assert mps_probe.mps_unavailable(fifo).startswith(f"its control pipe {fifo} has no reader ("), fifo
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        assert mps_probe.mps_unavailable(fifo) is None
    finally:
        os.close(reader)
    plain = mps.pipe.with_name("plain")
    plain.write_text("")
    assert mps_probe.mps_unavailable(plain) == f"{plain} is neither a socket nor a named pipe"


def test_mps_probe_run_by_path_imports_no_jax_and_exits_by_the_answer(mps):
    """tools/gpu_check.sh asks by running jax_ep/mps.py by path: it prints why no daemon answers and
    exits 0, or exits 1 when one answers, without importing JAX or jax_ep (2-3 s an import)."""
    probe = textwrap.dedent(f"""\
        import runpy, sys
        try:
            runpy.run_path({str(ROOT / "jax_ep" / "mps.py")!r}, run_name="__main__")
        except SystemExit as e:
            code = e.code
        print("imported:", sorted(m for m in sys.modules if m.split(".")[0] in ("jax", "jax_ep")))
        sys.exit(code)
        """)

    def ask() -> tuple[int, str]:
        proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
        return proc.returncode, proc.stdout + proc.stderr

    code, out = ask()
    assert code == 0 and out == f"no control pipe {mps.pipe}\nimported: []\n", (code, out)
    mps.start()
    code, out = ask()
    assert code == 1 and out == "\nimported: []\n", (code, out)


def test_an_unreadable_control_pipe_is_no_daemon_and_the_probe_says_why(mps, monkeypatch):
    """CUDA_MPS_PIPE_DIRECTORY naming a file (or another user's 0700 folder): stat raised
    NotADirectoryError / PermissionError out of mps_unavailable, and the probe by path exited 1 on it,
    which tools/gpu_check.sh reads as 'a daemon answers' (then ran the shared-GPU tests without MPS).
    A live daemon's pipe this user may not open is not blamed on a stopped daemon."""
    not_a_folder = mps.pipe.with_name("file")
    not_a_folder.write_text("")
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(not_a_folder))
    assert mps_probe.mps_unavailable() == (f"cannot read the control pipe {not_a_folder / 'control'} "
                                           "(Not a directory)")
    probe = f"import runpy; runpy.run_path({str(ROOT / 'jax_ep' / 'mps.py')!r}, run_name='__main__')"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "cannot read the control pipe" in proc.stdout, proc
    fifo = mps.pipe.with_name("fifo")
    os.mkfifo(fifo)

    def denied(path, flags, *args):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(mps_probe.os, "open", denied)
    why = mps_probe.mps_unavailable(fifo)
    assert why.startswith(f"its control pipe {fifo} is not accessible to this user (Permission denied; "
                          "owned by uid ") and "stopped daemon" not in why, why


@pytest.mark.parametrize("mps", ["SOCK_SEQPACKET", "SOCK_DGRAM"], indirect=True)
def test_mps_unavailable_takes_a_daemon_socket_of_another_type(mps):
    """The real daemon's control socket is not a stream socket (H200, CUDA 13: connecting with one
    gives EPROTOTYPE): a socket of another type bound at the path is a live daemon's, the file it
    leaves when closed is a stopped one's."""
    mps.start()
    assert mps_probe.mps_unavailable() is None
    mps.stop()
    why = mps_probe.mps_unavailable()
    assert why is not None and why.startswith(f"its control socket {mps.pipe} refuses connections ("), why


def share_args(*argv: str):
    return launch.parse_args(["--share-gpus", *argv, __file__])


def shared(*argv: str, gpus: int) -> list[tuple[str, str | None]]:
    """(JAX_LOCAL_DEVICE_IDS, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE) of each process of --share-gpus argv."""
    return [(env[dist.ENV_LOCAL_DEVICE_IDS], env.get(launch.MPS_PERCENTAGE))
            for env in launch.process_envs(share_args(*argv), gpus=gpus)]


def test_launcher_share_gpus_needs_mps(mps, monkeypatch):
    """A shared GPU without MPS's control pipe: a clear error naming the GPU, the processes and the pipe;
    no error when --share-gpus shares nothing; the default control pipe is /tmp/nvidia-mps/control."""
    for args, gpus in ((share_args("--nproc", "2", "--local-device-ids", "0,0"), 8),
                       (share_args("--nproc", "2"), 1)):
        with pytest.raises(SystemExit) as exc:
            launch.process_envs(args, gpus=gpus)
        text = str(exc.value.code)
        assert text.startswith(f"{launch.PREFIX} --share-gpus: GPU 0 would be shared by processes [0, 1], "
                               f"but CUDA MPS is not running (no control pipe {mps.pipe})"), text
        assert "nvidia-cuda-mps-control -d" in text and "wait on each other's" in text, text
    # enough GPUs: nothing is shared, nothing to check
    assert shared("--nproc", "2", gpus=2) == [("0", None), ("1", None)]
    assert mps_probe.mps_control_pipe() == mps.pipe
    mps.start()
    assert launch.process_envs(share_args("--nproc", "2"), gpus=1)
    mps.stop()   # the socket stays: still refused, saying so
    with pytest.raises(SystemExit, match=r"but CUDA MPS is not running \(its control socket .* refuses "
                                         r"connections \(.*\): a stopped daemon left it behind\)"):
        launch.process_envs(share_args("--nproc", "2"), gpus=1)
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY")
    assert mps_probe.mps_control_pipe() == pathlib.Path("/tmp/nvidia-mps/control")


def test_launcher_share_gpus_devices(mps, monkeypatch):
    mps.start()
    # explicit repeats; auto round-robin when the host has fewer GPUs than processes x K
    assert shared("--nproc", "2", "--local-device-ids", "0,0", gpus=0) == [("0", "50"), ("0", "50")]
    assert shared("--nproc", "2", gpus=1) == [("0", "50"), ("0", "50")]
    assert shared("--nproc", "4", gpus=1) == [("0", "25")] * 4
    assert shared("--nproc", "4", gpus=2) == [
        ("0", "50"), ("1", "50"), ("0", "50"), ("1", "50")]
    assert shared("--nproc", "3", gpus=2) == [
        ("0", "50"), ("1", None), ("0", "50")]        # GPU 1 has one process: all of it
    # every process of a job where some GPU is shared is told so (its benchmark records say it)
    envs = launch.process_envs(share_args("--nproc", "3"), gpus=2)
    assert [env.get(launch.ENV_SHARED_GPUS) for env in envs] == ["1", "1", "1"]
    assert all(launch.ENV_SHARED_GPUS not in env
               for env in launch.process_envs(share_args("--nproc", "2"), gpus=2))
    assert shared("--nproc", "3", "--local-devices-per-process", "2", gpus=4) == [
        ("0,1", "50"), ("2,3", None), ("0,1", "50")]
    # GPU 0 is p0's alone, but GPU 1 is shared: p0 gets half of every GPU it uses
    assert shared("--nproc", "2", "--local-devices-per-process", "2", "--local-device-ids", "0,1,1,2",
                  gpus=4) == [("0,1", "50"), ("1,2", "50")]
    assert shared("--nproc", "2", gpus=8) == [("0", None), ("1", None)]
    with pytest.raises(SystemExit, match="--local-devices-per-process 2: this host has 1 GPUs, and a "
                                         "process cannot use one GPU twice"):
        launch.process_envs(share_args("--nproc", "2", "--local-devices-per-process", "2"), gpus=1)
    # a percentage already set is kept
    monkeypatch.setenv(launch.MPS_PERCENTAGE, "30")
    assert shared("--nproc", "2", gpus=1) == [("0", "30"), ("0", "30")]
    # without the flag the errors stay
    with pytest.raises(SystemExit, match="needs 2 GPUs, this host has 1 .*--share-gpus"):
        launch.process_envs(launch.parse_args(["--nproc", "2", __file__]), gpus=1)
    # CPU processes: the flag changes nothing
    cpu = launch.process_envs(share_args("--nproc", "2"), gpus=0)
    assert all(dist.ENV_LOCAL_DEVICE_IDS not in env and env[launch.MPS_PERCENTAGE] == "30" for env in cpu)


def test_launcher_share_gpus_end_to_end(tmp_path, mps):
    """python -m jax_ep.launch --share-gpus --local-device-ids 0,0: both processes get GPU 0 and half
    the SMs, the launcher says so; without MPS it exits 1 before starting anything."""
    child = script(tmp_path, "child.py", """
        import os
        print("env", os.environ["JAX_LOCAL_DEVICE_IDS"], os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"])
        """)
    command = launch_cmd("--nproc", "2", "--share-gpus", "--local-device-ids", "0,0", child)
    proc = subprocess.run(command, capture_output=True, text=True, timeout=60, env=child_env())
    assert proc.returncode == 1 and "CUDA MPS is not running" in proc.stderr, proc.stderr
    assert "[p0]" not in proc.stdout
    mps.start()
    proc = subprocess.run(command, capture_output=True, text=True, timeout=60, env=child_env())
    assert proc.returncode == 0, proc.stderr
    assert "[p0] env 0 50" in proc.stdout and "[p1] env 0 50" in proc.stdout, proc.stdout
    assert ("GPUs p0: 0, p1: 0 shared through CUDA MPS (p0: 50%, p1: 50% of the SMs; timings are not those "
            "of separate GPUs)") in proc.stderr, proc.stderr


# ---- jax_ep.distributed without a cluster ---------------------------------------------------------

detected_cluster = dist._detected_cluster


@pytest.fixture
def no_launch_env(monkeypatch):
    for name in (dist.ENV_NUM_PROCESSES, dist.ENV_PROCESS_ID, dist.ENV_COORDINATOR):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(dist, "_detected_cluster", lambda only=None: None)
    return monkeypatch


def test_a_process_waits_for_the_coordinator_within_a_bound_and_names_it():
    """A process other than 0 waits for process 0's coordinator to listen, at most the initialisation
    timeout, and then raises EPTimeoutError naming the address and where it came from (JAX waits as long
    silently and then aborts the process blaming "another task")."""
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(dist.EPTimeoutError, match=rf"process 1 found no coordinator at '127.0.0.1:{port}' "
                                                  r"\(JAX_COORDINATOR_ADDRESS\) within 1 s"):
        dist._wait_for_coordinator(f"127.0.0.1:{port}", 1, 1.0, dist.ENV_COORDINATOR)
    assert time.monotonic() - start < 10
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        dist._wait_for_coordinator(f"127.0.0.1:{listening.getsockname()[1]}", 1, 5.0, "coordinator_address")


def test_distributed_not_initialised():
    assert not jax.distributed.is_initialized() and not dist.is_multiprocess()
    for call in (lambda: dist.kv_set_bytes("k", b"v"), lambda: dist.kv_get_bytes("k", 1.0),
                 lambda: dist.barrier("b", 1.0)):
        with pytest.raises(RuntimeError, match="jax.distributed is not initialised.*jax_ep.launch"):
            call()


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(coordinator_address="localhost"), dist.EPValueError,
     r"coordinator_address='localhost' is not HOST:PORT \(a port in 1..65535;"),
    (dict(coordinator_address="127.0.0.1:70000"), dist.EPValueError, "is not HOST:PORT"),
    (dict(process_id=5), dist.EPValueError, "process_id=5 is not below num_processes=2"),
    (dict(process_id=-1), dist.EPValueError, "process_id must be None or an int >= 0, got -1"),
    (dict(initialization_timeout="10"), EPTypeError,
     r"initialization_timeout must be a positive int, got '10' \(str\)"),
    (dict(initialization_timeout=0), dist.EPValueError, "initialization_timeout must be a positive int"),
    (dict(coordinator_address="fd00::2"), dist.EPValueError,
     r"'fd00::2' is not HOST:PORT .*an IPv6 host in brackets"),    # was host 'fd00:', port 2
    (dict(local_device_ids="0,1"), dist.EPValueError,
     r"local_device_ids='0,1' is not a device ordinal or a list of them"),   # was GPUs '0,,,1'
    (dict(local_device_ids=[0, -1]), dist.EPValueError, r"local_device_ids=\[0, -1\] is not a device"),
    # JAX already computed (it has in this test process): JAX would refuse process 0 at once, so process
    # 1 waited the whole timeout for a coordinator process 0 never started (here 60 s), then blamed it
    ({}, EPRuntimeError, "JAX already ran a computation .* call initialize\\(\\) before any other JAX call"),
])
def test_distributed_initialize_refuses_bad_arguments_at_once(no_launch_env, kwargs, error, message):
    """A malformed address, a process id out of range or a bad timeout: an error at once (before
    2026-12-05 process 1 waited out the whole timeout for 'localhost', then blamed process 0)."""
    jax.devices()   # JAX has started in this test process (the last case's premise)
    args = dict(coordinator_address="127.0.0.1:1", num_processes=2, process_id=1, initialization_timeout=60)
    start = time.monotonic()
    with pytest.raises(error, match=message):
        dist.initialize(**{**args, **kwargs})
    assert time.monotonic() - start < 5 and not jax.distributed.is_initialized()


@pytest.mark.parametrize("failure,error,message", [
    ("DEADLINE_EXCEEDED: Barrier timed out", dist.EPTimeoutError, r"waited 30 s for {what}.* and gave up"),
    ("UNAVAILABLE: failed to connect to the coordinator", EPRuntimeError,
     r"stopped waiting for {what}.* after \d+\.\d s of 30: RuntimeError: UNAVAILABLE"),
])
def test_a_failed_wait_is_called_a_timeout_only_when_it_timed_out(monkeypatch, failure, error, message):
    """kv_get_bytes and barrier: JAX's deadline is an EPTimeoutError; another failure (raised at once) is
    an EPRuntimeError with JAX's error (before 2026-12-05 every failure read 'waited 120 s ... gave up')."""
    class Client:
        def blocking_key_value_get_bytes(self, key, timeout_ms):
            raise RuntimeError(failure)

        wait_at_barrier = blocking_key_value_get_bytes

        def get_live_nodes(self, ids):
            raise RuntimeError("no liveness here")

    monkeypatch.setattr(dist, "_client", Client)
    for call, what in ((lambda: dist.kv_get_bytes("k", 30.0), "key 'k'"),
                       (lambda: dist.barrier("b", 30.0), "barrier 'b'")):
        with pytest.raises(error, match=message.format(what=what)):
            call()


def test_distributed_launched_by(no_launch_env):
    assert dist.launched_by() is None
    for name in ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID"):
        no_launch_env.setenv(name, "2" if name == "SLURM_NTASKS" else "0")
    no_launch_env.setattr(dist, "_detected_cluster", detected_cluster)     # JAX's own SLURM detection
    assert dist.launched_by() == "slurm"
    no_launch_env.setenv("SLURM_NTASKS", "1")
    assert dist.launched_by() is None
    no_launch_env.setattr(dist, "_detected_cluster", lambda only=None: ("slurm", 1))   # srun -n 1
    assert dist.launched_by() is None
    no_launch_env.setattr(dist, "_detected_cluster", lambda only=None: ("slurm", 8))
    assert dist.launched_by() == "slurm"
    no_launch_env.setenv(dist.ENV_NUM_PROCESSES, "2")
    no_launch_env.setenv(dist.ENV_PROCESS_ID, "1")
    assert dist.launched_by() == "jax_ep.launch"


def test_open_mpi_5_is_launched(no_launch_env):
    """Open MPI 5 (PRRTE) sets no OMPI_MCA_orte_hnp_uri, so JAX's detection misses it: each rank of
    `if launched_by(): initialize()` ran alone before 2026-12-05; now initialize() says why."""
    no_launch_env.delenv("OMPI_MCA_orte_hnp_uri", raising=False)
    no_launch_env.setenv("OMPI_COMM_WORLD_SIZE", "4")
    assert dist.launched_by() == "ompi"
    no_launch_env.setenv("OMPI_COMM_WORLD_SIZE", "1")
    assert dist.launched_by() is None


@pytest.mark.parametrize("kwargs", [dict(num_processes=2, process_id=1),
                                    dict(cluster_detection_method="mpi4py")])
def test_initialize_takes_the_address_variable_and_a_detection_method(no_launch_env, kwargs):
    """JAX_COORDINATOR_ADDRESS with the two counts as arguments, or a detection method JAX runs only on
    request (mpi4py), is a multi-process environment (both were refused as 'no multi-process environment'
    before 2026-12-05); here they reach the next check (JAX already computed in this test process)."""
    no_launch_env.setenv(dist.ENV_COORDINATOR, "127.0.0.1:1")
    jax.devices()   # JAX has started in this test process
    with pytest.raises(EPRuntimeError, match="JAX already ran a computation"):
        dist.initialize(**kwargs, initialization_timeout=10)


def test_an_empty_local_device_ids_variable_is_unset(no_launch_env):
    """JAX reads JAX_LOCAL_DEVICE_IDS='' as unset; the launcher copies the environment into each process,
    so an exported empty value is not an error (the check of the variable refused it, review 2026-12-05):
    the call reaches the next check (JAX already computed in this test process)."""
    for name, value in ((dist.ENV_NUM_PROCESSES, "2"), (dist.ENV_PROCESS_ID, "1"),
                        (dist.ENV_COORDINATOR, "127.0.0.1:1"), (dist.ENV_LOCAL_DEVICE_IDS, "")):
        no_launch_env.setenv(name, value)
    jax.devices()   # JAX has started in this test process
    with pytest.raises(EPRuntimeError, match="JAX already ran a computation"):
        dist.initialize(initialization_timeout=10)


@pytest.mark.parametrize("timeout_s,error", [(-1, dist.EPValueError), (float("inf"), dist.EPValueError),
                                             ("10", EPTypeError)])
def test_key_value_waits_check_their_timeout(timeout_s, error):
    for call in (dist.kv_get_bytes, dist.barrier):
        with pytest.raises(error, match=rf"jax_ep.distributed.{call.__name__}: timeout_s must be a positive"):
            call("k", timeout_s)


@pytest.mark.parametrize("env,error,message", [
    ({"JAX_EP_NUM_PROCESSES": "two", "JAX_EP_PROCESS_ID": "0"}, ValueError,
     "JAX_EP_NUM_PROCESSES must be an integer, got 'two'"),
    ({"JAX_EP_NUM_PROCESSES": "2"}, ValueError,
     "JAX_EP_NUM_PROCESSES='2' is set but JAX_EP_PROCESS_ID is not"),
    ({"JAX_EP_PROCESS_ID": "0"}, ValueError, "JAX_EP_PROCESS_ID='0' is set but JAX_EP_NUM_PROCESSES is not"),
    ({"JAX_EP_NUM_PROCESSES": "2", "JAX_EP_PROCESS_ID": "2"}, ValueError,
     r"JAX_EP_PROCESS_ID must be in \[0, JAX_EP_NUM_PROCESSES=2\), got 2"),
    ({"JAX_EP_NUM_PROCESSES": "0", "JAX_EP_PROCESS_ID": "0"}, ValueError, "must be at least 1, got 0"),
    ({"JAX_EP_NUM_PROCESSES": "2", "JAX_EP_PROCESS_ID": "0"}, ValueError, "JAX_COORDINATOR_ADDRESS is not"),
    ({}, RuntimeError, "no multi-process environment: not started by `python -m jax_ep.launch`"),
    ({"JAX_EP_NUM_PROCESSES": "2", "JAX_EP_PROCESS_ID": "1", "JAX_COORDINATOR_ADDRESS": "127.0.0.1:1",
      "JAX_LOCAL_DEVICE_IDS": "0;1"}, ValueError,
     r"JAX_LOCAL_DEVICE_IDS='0;1' is not a device ordinal or a comma-separated list of them"),
    # Open MPI 5's mpirun, which JAX's detection misses (it reads OMPI_MCA_orte_hnp_uri, gone in 5)
    ({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0"}, RuntimeError,
     "This is an Open MPI 5 mpirun job.*cluster_detection_method='mpi4py'"),
])
def test_distributed_initialize_errors(no_launch_env, env, error, message):
    for name, value in env.items():
        no_launch_env.setenv(name, value)
    with pytest.raises(error, match=message):
        dist.initialize()
    assert not jax.distributed.is_initialized()
