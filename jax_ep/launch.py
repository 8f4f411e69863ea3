"""Start a JAX program as several processes on this host (``jax.distributed``, one process per GPU).

    python -m jax_ep.launch --nproc N [--coordinator HOST:PORT] [--local-devices-per-process K]
                            [--local-device-ids auto|none|I,J,...] [--share-gpus] [--timeout S]
                            [--grace S] [--verbose] script.py [args...]

Starts N processes of ``python script.py args...``. Process i gets the environment that
``jax_ep.distributed.initialize()`` reads: ``JAX_COORDINATOR_ADDRESS`` (default: a free port on
127.0.0.1), ``JAX_EP_NUM_PROCESSES=N`` and ``JAX_EP_PROCESS_ID=i`` (JAX has no variables for these
two), and its devices:

* GPUs (when the host has NVIDIA GPUs and ``JAX_PLATFORMS`` does not exclude them): process i uses
  GPUs ``i*K .. i*K+K-1`` through ``JAX_LOCAL_DEVICE_IDS`` (``jax.distributed``'s local_device_ids),
  not ``CUDA_VISIBLE_DEVICES``: every process still sees every GPU, as peer access needs.
  ``--local-device-ids none`` leaves the device choice to JAX; ``--local-device-ids 4,5,6,7`` gives
  the processes those GPUs, K each, in order.
* CPU: K virtual CPU devices per process (``JAX_NUM_CPU_DEVICES``), on GPU hosts too.

``--share-gpus`` (development and testing only) lets several processes use one GPU: repeated indices
in ``--local-device-ids`` (e.g. ``0,0``), and ``auto`` assigns the GPUs round-robin when the host has
fewer than N*K (``--nproc 2`` on a one-GPU host: both processes on GPU 0). A process still never gets
one GPU twice. Processes sharing a GPU must run their kernels at the same time (jax_ep's kernels
spin-wait on each other's), which needs CUDA MPS: the launcher refuses to start when a GPU is shared
and no MPS daemon answers at its control pipe (``$CUDA_MPS_PIPE_DIRECTORY/control``, default
``/tmp/nvidia-mps/control``; a stopped daemon leaves it behind, so ``jax_ep.mps.mps_unavailable``
connects to it), and gives each process ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` = 100 // (processes per GPU)
unless it is set, so the persistent kernels of every process fit on the GPU beside the others'.
That held for 2 processes per GPU; with 3 and 4 (one H100, 2026-11-24) the fused low-latency ops
waited out their timeout in ll_combine at the default grid, and passed with
``KernelConfig(num_sms=8)`` or ``16`` (8 processes on one H200 too, with 8): give the low-latency ops
a smaller grid when more than 2 processes share a GPU.
No XLA collective may run across processes sharing a GPU (NCCL refuses two ranks on one GPU:
"Duplicate GPU detected"); only jax_ep's own ops communicate. The processes split one GPU's SMs,
memory and bandwidth, and "remote" traffic never leaves it: timings are not those of separate GPUs.

Every line a process writes (stdout and stderr) is printed with the prefix ``[pI]``, except gloo's
connection messages (``[Gloo] Rank N is connected to M peer ranks ...``: jax.distributed's CPU
collectives print one per rank and communicator, ~23 lines for 2 processes of examples/train_moe.py):
the launcher leaves them out (``failure_report.is_transport_chatter``) and says how many, unless
``--verbose``. When the launcher's stdout or stderr is closed (``... | head``), what would go there is
dropped and the run goes on (the processes' output is still read: none blocks on a full pipe). SIGINT and
SIGTERM are passed on to the processes. When one process fails (non-zero exit or killed by a signal),
the others get SIGTERM, then SIGKILL after ``--grace`` seconds, and the launcher exits with the failed
process's code (128 + signal for a signal), naming it. Each process starts a process group of its own,
and the launcher signals whole groups: what a process started (unless it left the group) gets the
signals too, also after that process exited, and SIGKILL when the launcher exits. A failed run (a
process failed, or ``--timeout``) ends with a line giving every process's exit code
(``exit codes: p0=1 p1=-15``; ``exit_codes()`` reads it back) and, for each process that did not exit
0, a summary of its output (``jax_ep.failure_report``): the failing check (its first traceback's
exception), the jax_ep fault records it printed, its first CUDA / XLA error line, the EP op running, how
many lines of XLA's teardown errors (after a device fault) were left out, then its last lines without
them. ``--timeout`` bounds the whole run (exit code 124); a run that reaches it prints where each
process was: the processes run with ``PYTHONFAULTHANDLER=1`` (unless that variable is set already), so
the SIGABRT the launcher sends them first makes each print the Python stack of every thread
(``faulthandler``) on its stderr, prefixed ``[pI]``; after min(``--grace``, 5) seconds the processes
still running get SIGTERM, then SIGKILL after ``--grace``. Before the SIGABRT the launcher sets the
processes' core file size limit to 0 (Linux), so the abort leaves no core file (processes they started
keep theirs). Only ``--timeout`` sends SIGABRT: a failed process and SIGINT/SIGTERM stop the others with
SIGTERM as above. The exit code is 0 when every process exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import glob
import os
import pathlib
import resource
import signal
import socket
import subprocess
import sys
import threading
import time

from jax_ep import failure_report
from jax_ep.distributed import (
    ENV_COORDINATOR,
    ENV_LOCAL_DEVICE_IDS,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    LAUNCHER,
    host_port,
)
from jax_ep.errors import EPValueError
from jax_ep.mps import mps_unavailable

PREFIX = LAUNCHER + ":"
TIMEOUT_EXIT_CODE = 124
MPS_PERCENTAGE = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
# set to "1" in every process of a job where some GPU is shared (--share-gpus): timings there are not
# those of separate GPUs (the benchmark records say so)
ENV_SHARED_GPUS = "JAX_EP_SHARED_GPUS"
POLL_S = 0.05
SUMMARY_TAIL_LINES = 12   # a failed run: the last lines of each failed process's output after its summary
EXIT_CODES = "exit codes:"   # the line of a failed run giving every process's exit code (exit_codes())
ABORT_WAIT_S = 5.0    # --timeout: at most this long (and --grace) between SIGABRT and SIGTERM


def positive_int(value: str) -> int:
    """An argparse type: an integer >= 1 (also the benchmark CLI's)."""
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value!r}")
    return number


def _non_negative_float(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        number = -1.0
    if not number >= 0:   # NaN too
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {value!r}")
    return number


def _coordinator(value: str) -> str:
    try:
        host, _ = host_port(value)
    except EPValueError:
        raise argparse.ArgumentTypeError(f"must be HOST:PORT with a port in 1..65535, got {value!r}"
                                         ) from None
    # every process runs on this host, process 0's coordinator too: HOST must be one of its addresses
    # (else process 0 cannot listen there and the others wait for it until JAX aborts them)
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.bind((host, 0))
    except OSError as e:
        raise argparse.ArgumentTypeError(f"HOST of {value!r} is not an address of this host ({e}); the "
                                         "launcher starts every process here") from None
    return value


DEVICE_IDS_FORM = "auto, none or distinct GPU indices I,J,..."


def _device_ids(value: str) -> str | list[int]:
    """auto, none or GPU indices (repeats are checked in parse_args: --share-gpus allows them)."""
    if value in ("auto", "none"):
        return value
    try:
        ids = [int(v) for v in value.split(",")]
    except ValueError:
        ids = [-1]
    if min(ids) < 0:
        raise argparse.ArgumentTypeError(f"must be {DEVICE_IDS_FORM}, got {value!r}")
    return ids


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"python -m {LAUNCHER}", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--nproc", type=positive_int, required=True, help="number of processes")
    parser.add_argument("--coordinator", type=_coordinator, default=None,
                        help="HOST:PORT of process 0's coordinator (default: a free port on 127.0.0.1)")
    parser.add_argument("--local-devices-per-process", type=positive_int, default=1, metavar="K",
                        help="GPUs per process on GPU hosts; virtual CPU devices per process (default 1)")
    parser.add_argument("--local-device-ids", type=_device_ids, default="auto",
                        metavar="auto|none|I,J,...",
                        help="GPUs of the processes (default auto: process i gets GPUs i*K..i*K+K-1 "
                             "when the host has GPUs; none: JAX's default)")
    parser.add_argument("--share-gpus", action="store_true",
                        help="development/testing: let processes share a GPU (repeated indices in "
                             "--local-device-ids; auto assigns round-robin when the host has too few "
                             "GPUs); needs CUDA MPS running; timings are not those of separate GPUs")
    parser.add_argument("--grace", type=_non_negative_float, default=10.0, metavar="S",
                        help="seconds between SIGTERM and SIGKILL when stopping the processes (default 10)")
    parser.add_argument("--timeout", type=_non_negative_float, default=0.0, metavar="S",
                        help="stop every process after S seconds and exit 124 (default 0: no limit)")
    parser.add_argument("--verbose", action="store_true",
                        help="also print the processes' gloo connection messages ('[Gloo] Rank N is "
                             "connected to M peer ranks ...'), left out by default")
    parser.add_argument("script", help="the Python script each process runs")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    args = parser.parse_args(argv)
    if not pathlib.Path(args.script).is_file():
        parser.error(f"argument script: no such file: {args.script!r}")
    n, k, ids = args.nproc, args.local_devices_per_process, args.local_device_ids
    if isinstance(ids, list):
        text = ",".join(map(str, ids))
        if len(ids) != n * k:
            parser.error(f"argument --local-device-ids: {len(ids)} GPU indices {text} for --nproc {n} x "
                         f"--local-devices-per-process {k} = {n * k} devices")
        if len(set(ids)) != len(ids) and not args.share_gpus:
            parser.error(f"argument --local-device-ids: must be {DEVICE_IDS_FORM}, got {text!r} "
                         "(processes sharing a GPU: --share-gpus)")
        twice = next((i for i in range(n) if len(set(ids[i * k:(i + 1) * k])) != k), None)
        if twice is not None:
            parser.error(f"argument --local-device-ids: process {twice} would get GPUs "
                         f"{ids[twice * k:(twice + 1) * k]}: a process cannot use one GPU twice")
    return args


def host_gpu_count() -> int:
    """NVIDIA GPUs JAX could use here: 0 when JAX_PLATFORMS excludes CUDA, else those
    CUDA_VISIBLE_DEVICES names, else the /dev/nvidiaN device files (no CUDA initialisation)."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms and not any(p in platforms for p in ("cuda", "gpu")):
        return 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        names = [v for v in visible.split(",") if v.strip()]
        return 0 if names[:1] == ["-1"] else len(names)
    return len(glob.glob("/dev/nvidia[0-9]*"))


def shared_gpus(ids: list[int], k: int) -> dict[int, list[int]]:
    """{GPU: the processes using it} for the GPUs that more than one process uses."""
    users: dict[int, list[int]] = {}
    for position, gpu in enumerate(ids):
        users.setdefault(gpu, []).append(position // k)
    return {gpu: procs for gpu, procs in users.items() if len(procs) > 1}


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def process_envs(args: argparse.Namespace, gpus: int) -> list[dict[str, str]]:
    """The environment of each process (see the module docstring)."""
    n, k = args.nproc, args.local_devices_per_process
    common = dict(os.environ, PYTHONUNBUFFERED="1", JAX_NUM_CPU_DEVICES=str(k),
                  **{ENV_NUM_PROCESSES: str(n)})
    common.setdefault("PYTHONFAULTHANDLER", "1")   # --timeout's SIGABRT prints every thread's stack
    if args.coordinator is None:
        port = free_port()
        common[ENV_COORDINATOR] = f"127.0.0.1:{port}"
        common["JAX_COORDINATOR_BIND_ADDRESS"] = f"127.0.0.1:{port}"   # not every interface
    else:
        common[ENV_COORDINATOR] = args.coordinator
    ids = args.local_device_ids
    if ids == "auto":
        if gpus and gpus < n * k and not args.share_gpus:
            raise SystemExit(f"{PREFIX} --nproc {n} x --local-devices-per-process {k} needs {n * k} "
                             f"GPUs, this host has {gpus} (--local-device-ids none: JAX's default; "
                             "--share-gpus: processes sharing GPUs, for testing)")
        if gpus and k > gpus:
            raise SystemExit(f"{PREFIX} --local-devices-per-process {k}: this host has {gpus} GPUs, and a "
                             "process cannot use one GPU twice")
        ids = [d % gpus for d in range(n * k)] if gpus else None   # round-robin: only with --share-gpus
    elif ids == "none":
        ids = None
    shared = shared_gpus(ids, k) if ids is not None else {}
    if shared:
        why = mps_unavailable()
        if why is not None:
            gpu, procs = next(iter(shared.items()))
            raise SystemExit(
                f"{PREFIX} --share-gpus: GPU {gpu} would be shared by processes {procs}, but CUDA MPS is "
                f"not running ({why}). Processes sharing a GPU must run their kernels "
                "at the same time (jax_ep's kernels wait on each other's), which needs MPS: start it "
                "with `nvidia-cuda-mps-control -d` (with the same CUDA_MPS_PIPE_DIRECTORY as here) and "
                "stop it with `echo quit | nvidia-cuda-mps-control`")
    envs = []
    for i in range(n):
        env = dict(common, **{ENV_PROCESS_ID: str(i)})
        if shared:
            env[ENV_SHARED_GPUS] = "1"
        if ids is not None:
            mine = ids[i * k:(i + 1) * k]
            env[ENV_LOCAL_DEVICE_IDS] = ",".join(str(d) for d in mine)
            sharing = max(len(shared.get(d, ())) for d in mine)
            if sharing > 1 and not env.get(MPS_PERCENTAGE):   # each process's persistent kernels fit
                env[MPS_PERCENTAGE] = str(100 // sharing)
        envs.append(env)
    return envs


def _die_with_parent(parent: int, prctl) -> None:  # pragma: no cover - runs in the child before exec
    """Linux: the child gets SIGTERM when the launcher dies (even by SIGKILL), so none is left over."""
    prctl(1, int(signal.SIGTERM))   # PR_SET_PDEATHSIG
    if os.getppid() != parent:      # the launcher died before that
        os._exit(1)


def _child_setup():
    """The preexec_fn of the processes (Linux: _die_with_parent), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (ImportError, OSError, AttributeError):
        return None
    return functools.partial(_die_with_parent, os.getpid(), prctl)


class Launcher:
    """N processes, their prefixed output, and how they are stopped."""

    def __init__(self, args: argparse.Namespace, envs: list[dict[str, str]]):
        self.args, self.envs = args, envs
        self.procs: list[subprocess.Popen] = []
        self.threads: list[threading.Thread] = []
        self.lock = threading.Lock()
        self.signal: int | None = None       # a signal the launcher received
        self.stop_deadline: float | None = None
        # each process's output, boiled down for the failure summary (bounded)
        self.digests = [failure_report.OutputDigest(SUMMARY_TAIL_LINES) for _ in envs]
        self.digest_locks = [threading.Lock() for _ in envs]   # stdout's and stderr's threads feed one
        self.chatter = 0      # gloo connection messages left out (without --verbose)
        self.empty_groups: set[int] = set()   # process groups found empty after their process exited
        self.signal_said = False               # wait() has said which signal the launcher got

    def _write(self, stream, data) -> bool:
        """Writes ``data`` to ``stream`` (self.lock held). A stream whose reader is gone (``| head``)
        raises BrokenPipeError: it is pointed at /dev/null, so the launcher's later writes and Python's
        flush at exit go nowhere instead of failing. True when that happened just now."""
        try:
            stream.write(data)
            stream.flush()
            return False
        except BlockingIOError:   # a non-blocking stream, full for now: this line may be lost, not the rest
            return False
        except (BrokenPipeError, ConnectionResetError):   # the reader is gone for good
            pass
        except OSError:   # e.g. a full disk for now: this line is lost, the stream stays
            return False
        # once redirected, the stream's writes succeed: this is reached once per stream
        with contextlib.suppress(OSError, ValueError):   # ValueError: no file descriptor (then writes
            devnull = os.open(os.devnull, os.O_WRONLY)   # keep failing, and are dropped here)
            os.dup2(devnull, stream.fileno())
            os.close(devnull)
            return True
        return False

    def say(self, message: str) -> None:
        with self.lock:
            self._write(sys.stderr, f"{PREFIX} {message}\n")

    def _pump(self, index: int, pipe, out, name: str) -> None:
        """Prints process ``index``'s output from ``pipe`` to ``out`` (the launcher's stream ``name``)
        until the process and what it started close the pipe, also after ``out`` is found closed."""
        prefix = f"[p{index}] ".encode()
        verbose = getattr(self.args, "verbose", False)
        for line in iter(pipe.readline, b""):
            text = line.decode(errors="replace")
            chatter = failure_report.is_transport_chatter(text)
            with self.lock:
                if chatter and not verbose:
                    self.chatter += 1
                    continue
                closed = self._write(out, prefix + line + (b"" if line.endswith(b"\n") else b"\n"))
            if closed:
                self.say(f"the launcher's {name} is closed: what the processes print there is dropped")
            if not chatter:   # the failure summary's tail: what the process said, not gloo's handshakes
                with self.digest_locks[index]:
                    self.digests[index].feed(text, stream=out)
        pipe.close()

    def start(self) -> None:
        command = [sys.executable, self.args.script, *self.args.args]
        setup = _child_setup()
        for env in self.envs:
            self.procs.append(subprocess.Popen(
                command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                start_new_session=True,   # a terminal's Ctrl-C reaches the launcher, which passes it on
                preexec_fn=setup))
        for i, proc in enumerate(self.procs):
            for pipe, out, name in ((proc.stdout, sys.stdout.buffer, "stdout"),
                                    (proc.stderr, sys.stderr.buffer, "stderr")):
                thread = threading.Thread(target=self._pump, args=(i, pipe, out, name), daemon=True)
                thread.start()
                self.threads.append(thread)

    def send(self, sig: int) -> None:
        """Sends ``sig`` to the process group of every process: the process and what it started, which
        may outlive it, so also after the process exited. A group found empty then is left alone from
        there on: its id (the process's pid) is free for another process (sig 0 just looks). Safe in a
        signal handler: no locks (``returncode``, not ``poll()``)."""
        for proc in self.procs:
            if proc.pid in self.empty_groups:
                continue
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                if proc.returncode is not None:   # the id stays taken while the process is not reaped
                    self.empty_groups.add(proc.pid)
            except PermissionError:   # every process left in the group is another user's (setuid)
                pass

    def abort(self) -> None:
        """SIGABRT to every process group (send): faulthandler prints each Python
        thread's stack. Core files off first, for these processes only: the abort is no crash."""
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(OSError, AttributeError, ValueError):   # exited; not Linux
                    _, hard = resource.prlimit(proc.pid, resource.RLIMIT_CORE)
                    resource.prlimit(proc.pid, resource.RLIMIT_CORE, (0, hard))
        self.send(signal.SIGABRT)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Sends ``sig`` to the process groups now (send), and SIGKILL ``--grace`` seconds later while a
        process still runs (wait())."""
        self.send(sig)
        if self.stop_deadline is None:
            self.stop_deadline = time.monotonic() + self.args.grace

    def on_signal(self, sig: int, frame) -> None:
        """SIGINT / SIGTERM: passed on to the process groups; wait() says so. Nothing printed here: the
        handler runs on the main thread, which may be inside say() holding self.lock (e.g. blocked on a
        full stderr), so taking the lock here would wait for itself forever."""
        if self.signal is not None:       # a second Ctrl-C: no more waiting
            self.send(signal.SIGKILL)
            return
        self.signal = sig
        self.stop(sig)

    def _say_signal(self) -> None:
        """Says which signal the launcher got (once): on_signal does not print."""
        if self.signal is not None and not self.signal_said:
            self.signal_said = True
            self.say(f"got {signal.Signals(self.signal).name}, passing it on to the processes")

    def wait(self) -> int:
        """Waits for the processes; returns the launcher's exit code."""
        deadline = time.monotonic() + self.args.timeout if self.args.timeout else None
        failed: tuple[int, int] | None = None        # (process index, exit code) of the first failure
        timed_out = killed = False
        abort_deadline: float | None = None           # --timeout: SIGTERM after the stacks are printed
        while True:
            self._say_signal()
            codes = [proc.poll() for proc in self.procs]
            self.send(0)     # finds the groups that emptied after their process exited (their ids get free)
            running = [i for i, code in enumerate(codes) if code is None]
            if not running:
                break
            if failed is None and self.signal is None and not timed_out:
                failed = next(((i, code) for i, code in enumerate(codes) if code not in (None, 0)), None)
                if failed is not None:
                    i, code = failed
                    self.say(f"process {i} (pid {self.procs[i].pid}) {describe(code)}; "
                             f"stopping processes {running}")
                    self.stop()
            now = time.monotonic()
            if deadline is not None and now > deadline and not timed_out and self.stop_deadline is None:
                timed_out = True
                wait_s = min(self.args.grace, ABORT_WAIT_S)
                self.say(f"--timeout {self.args.timeout:g} s reached; SIGABRT to processes {running} "
                         f"(their Python stacks), SIGTERM to those left after {wait_s:g} s")
                self.abort()
                abort_deadline = now + wait_s
            if abort_deadline is not None and now > abort_deadline and self.stop_deadline is None:
                self.say(f"processes {running} still running: SIGTERM")
                self.stop()
            if self.stop_deadline is not None and now > self.stop_deadline and not killed:
                self.say(f"processes {running} still running {self.args.grace:g} s after "
                         "being told to stop: SIGKILL")
                self.send(signal.SIGKILL)
                killed = True
            time.sleep(POLL_S)
        for thread in self.threads:         # output still in the pipes; bounded: a grandchild may hold one
            thread.join(timeout=2.0)
        if self.chatter:
            self.say(f"left out {self.chatter} lines of gloo connection messages (--verbose prints them)")
        if failed is None:                  # the first failure found after the loop (same poll)
            failed = next(((i, p.returncode) for i, p in enumerate(self.procs) if p.returncode), None)
        if self.signal is not None:
            self._say_signal()              # one that came after the last poll
            return 128 + self.signal
        if timed_out or failed is not None:
            self.summarize()
        if timed_out:
            self.say(f"failed: --timeout {self.args.timeout:g} s")
            return TIMEOUT_EXIT_CODE
        if failed is None:
            return 0
        index, code = failed
        self.say(f"failed: process {index} {describe(code)}")
        return code if code > 0 else 128 - code

    def summarize(self) -> None:
        """A failed run: every process's exit code, then for each process that did not exit 0 its
        failure summary (failure_report: the failing check, jax_ep's fault records, the first CUDA /
        XLA error, the EP op) and the last lines of its output without XLA's teardown noise."""
        codes = [proc.returncode for proc in self.procs]
        blocks = [f"{EXIT_CODES} " + " ".join(f"p{i}={code}" for i, code in enumerate(codes))]
        for i, code in enumerate(codes):
            if code != 0:
                blocks.append(self.digests[i].report(i, f"pid {self.procs[i].pid}, {describe(code)}",
                                                     tail_chars=3000))
        with self.lock:
            self._write(sys.stderr, f"{PREFIX} " + "\n".join(blocks) + "\n")


def exit_codes(output: str) -> dict[int, int]:
    """{process index: exit code (minus the signal when killed by one)} from the launcher's output of a
    failed run (its 'exit codes:' line); {} when the output has none (the run did not fail)."""
    for line in output.splitlines():
        if line.startswith(f"{PREFIX} {EXIT_CODES}"):
            pairs = line.split(EXIT_CODES, 1)[1].split()
            return {int(name[1:]): int(code) for name, code in (pair.split("=") for pair in pairs)}
    return {}


def describe(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
        return f"was killed by signal {-code}"
    return f"exited with code {code}"


def main(argv=None) -> int:
    args = parse_args(argv)
    envs = process_envs(args, host_gpu_count())
    launcher = Launcher(args, envs)
    devices = ("GPUs " + ", ".join(f"p{i}: {env[ENV_LOCAL_DEVICE_IDS]}" for i, env in enumerate(envs))
               if ENV_LOCAL_DEVICE_IDS in envs[0] else f"{args.local_devices_per_process} CPU device(s) each")
    used = [d for env in envs for d in env.get(ENV_LOCAL_DEVICE_IDS, "").split(",") if d]
    if len(set(used)) < len(used):
        devices += (" shared through CUDA MPS (" + ", ".join(
            f"p{i}: {env.get(MPS_PERCENTAGE, 100)}%" for i, env in enumerate(envs))
            + " of the SMs; timings are not those of separate GPUs)")
    launcher.say(f"{args.nproc} processes of {args.script}, coordinator {envs[0][ENV_COORDINATOR]}, "
                 f"{devices}")
    previous = {sig: signal.signal(sig, launcher.on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        launcher.start()
        if launcher.signal is not None:   # it came during start(): the processes started after it
            launcher.send(launcher.signal)
        return launcher.wait()
    finally:
        launcher.send(0)                  # groups emptied since the last poll: their ids may be reused
        launcher.send(signal.SIGKILL)     # nothing outlives the launcher: what the processes started too
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())
