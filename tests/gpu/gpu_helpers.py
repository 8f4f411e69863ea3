"""Helpers of the GPU tests (imported as a top-level module: pytest puts tests/gpu on sys.path)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_ep import failure_report, launch

POISON_WORD = 0xA5A5A5A5

# EP group size of the single-axis suites (pytest --ep-ranks, tests/conftest.py; default 2). At 1 the
# kernels run on one GPU with every rank sending to itself: the local paths only.
EP_RANKS = int(os.environ.get("JAX_EP_TEST_EP_RANKS", "2"))


# pytest --share-gpu (tests/conftest.py): the process-model-2 tests run their processes on GPU 0 together
# (python -m jax_ep.launch --share-gpus, under CUDA MPS) instead of one GPU each.
SHARE_GPU = os.environ.get("JAX_EP_TEST_SHARE_GPU") == "1"
# pytest --processes N (default 2): the process-model-2 tests run N processes x 1 GPU (or all N on GPU 0
# with --share-gpu). Their workers take the EP size from jax.process_count().
NUM_PROCESSES = int(os.environ.get("JAX_EP_TEST_PROCESSES", "2"))
# The fused low-latency kernels need every block of their grid resident at once. With more than 2
# processes sharing one GPU under MPS the default grids (the SMs - 1 each) are not (session 13:
# timeouts at 3 and 4 clients), so those workers get a grid of 8 (KernelConfig.num_sms; --ll-num-sms).
LL_NUM_SMS_SHARED = 8


def ll_grid_args() -> list[str]:
    """The worker arguments that set the low-latency kernels' grid for this run ([] = the default)."""
    return ["--ll-num-sms", str(LL_NUM_SMS_SHARED)] if SHARE_GPU and NUM_PROCESSES > 2 else []


def ll_grid(cfg, argv=None):
    """A worker's config with the low-latency kernels' grid of its --ll-num-sms G (ll_grid_args; argv:
    sys.argv by default); unchanged without it."""
    argv = sys.argv if argv is None else argv
    if "--ll-num-sms" not in argv:
        return cfg
    return cfg.replace(kernel=cfg.kernel.replace(num_sms=int(argv[argv.index("--ll-num-sms") + 1])))


def rank1_masked(ranks: int) -> tuple[int, ...]:
    """The rank mask of the process-model-2 tests' stopped process: every rank active but rank 1."""
    return tuple(0 if r == 1 else 1 for r in range(ranks))


def needs_two_ranks(r: int) -> None:
    """Skip a test that needs a peer (timeouts, ranks skipping a call) when the suite runs at one rank."""
    import pytest

    if r < 2:
        pytest.skip("needs a peer rank (run with --ep-ranks 2 or more)")


def poison_device_memory(devices, nbytes: int = 64 << 20) -> None:
    """Fills nbytes on each device with 0xA5 and frees it: XLA's allocator hands that memory out
    again, so outputs start as garbage."""
    host = np.full(nbytes // 4, POISON_WORD, np.uint32)
    arrays = [jax.device_put(host, d) for d in devices]
    for a in arrays:
        a.block_until_ready()
    del arrays


def handler_stats(target: str) -> dict:
    """{'calls', 'captured_calls'} of an FFI handler so far (jax_ep._C.handler_stats)."""
    from jax_ep import runtime

    return dict(runtime.extension().handler_stats()[target])


def assert_captured(target: str, before: dict, graph_mode: str, options: dict) -> None:
    """With min graph size 1, XLA must have run the handler under stream capture (a CUDA graph).
    (Measured with jax 0.11.2: the default options capture the scan bodies too; with WHILE in the
    command types XLA captured peer_smoke but ran the layout handler outside a graph, so only the
    'graphs' mode asserts.)"""
    after = handler_stats(target)
    print(f"{target} {graph_mode}: handler stats {before} -> {after}")
    if graph_mode == "graphs":
        assert after["captured_calls"] > before["captured_calls"], (
            f"XLA never captured {target} into a CUDA graph with {options}: {before} -> {after}")


# Compile options of the CUDA-graph variants: XLA captures sequences of >= 5 commands by default;
# 1 makes it capture the EP call itself, and WHILE turns a whole lax.scan into one graph.
GRAPH_OPTIONS = {
    "default": {},
    "graphs": {"xla_gpu_graph_min_graph_size": 1},
    "graph_while": {"xla_gpu_graph_min_graph_size": 1,
                    "xla_gpu_enable_command_buffer": "FUSION,CUSTOM_CALL,WHILE"},
}


# Tail of a child script whose last op traps on the device: polls jax_ep.runtime.faults() until
# _WANT GPUs have faulted and prints them (and check_errors()'s message) for the parent; exits 3 if
# no fault appears.
_POLL_FAULTS = """
import json as _json, os as _os, time as _time
from jax_ep import runtime as _runtime
_deadline = _time.time() + 120
while _time.time() < _deadline:
    _faults = _runtime.faults()
    if len(_faults) >= _WANT:
        print("FAULTS=" + _json.dumps(_faults), flush=True)
        print("SECONDS=%.2f" % (_time.time() - _START), flush=True)
        try:
            _runtime.check_errors()
        except _runtime.DeviceFaultError as _e:
            print("CHECK_ERRORS=" + str(_e), flush=True)
        _os._exit(0)
    _time.sleep(0.01)
print("NO_FAULT", flush=True)
_os._exit(3)
"""


def report_of_child(script: str, timeout_s: int) -> dict:
    """Runs `script` in a fresh Python (jax_ep's wait bound timeout_s, no preallocation) and returns
    the JSON it printed on its "REPORT=" line; the child must exit 0."""
    env = dict(os.environ, JAX_EP_TIMEOUT_S=str(timeout_s), XLA_PYTHON_CLIENT_PREALLOCATE="false")
    child = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                           timeout=300)
    lines = [line for line in child.stdout.splitlines() if line.startswith("REPORT=")]
    assert child.returncode == 0 and lines, f"rc={child.returncode}:\n{(child.stdout + child.stderr)[-4000:]}"
    report = json.loads(lines[0][len("REPORT="):])
    print(report)
    return report


def faults_of_child(script: str, timeout_s: str = "2", want: int = 1) -> tuple[list[dict], str]:
    """Runs `script` (which must set _START = time.time() before its faulting call) in a child
    process with JAX_EP_TIMEOUT_S=timeout_s, then waits until `want` GPUs have recorded the device
    fault it provokes; returns the fault records and the child's stdout (a trap kills the CUDA
    context, hence the child)."""
    env = dict(os.environ, JAX_EP_TIMEOUT_S=timeout_s, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    child = subprocess.run([sys.executable, "-c", script + f"\n_WANT = {want}\n" + _POLL_FAULTS], env=env,
                           capture_output=True, text=True, timeout=300)
    output = child.stdout + child.stderr
    lines = [line for line in child.stdout.splitlines() if line.startswith("FAULTS=")]
    assert lines, f"child recorded no fault (rc={child.returncode}):\n{output[-4000:]}"
    return json.loads(lines[0][len("FAULTS="):]), child.stdout


# A child script for faults_of_child that runs one EP step over the first EP_RANKS GPUs (mesh axis "ep"):
# `body` is the source of body(x, idx, w), the per-rank step, with x [64, 256] bf16 ones, every token
# to experts 0 and 5 of 8 (num_topk=2) and unit weights; `cfg_args` are more EPConfig arguments.
_EP_STEP_HEAD = """
import time
import jax, jax.numpy as jnp, numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
import jax_ep

gpus = jax.local_devices(backend="gpu")[:%d]
mesh = Mesh(np.array(gpus), ("ep",))
cfg = jax_ep.EPConfig(num_experts=8, num_topk=2, hidden=256, max_tokens_per_rank=64 // len(gpus),
                      backend="cuda"%s)
x = jnp.ones((64, 256), jnp.bfloat16)
idx = jnp.tile(jnp.array([[0, 5]], jnp.int32), (64, 1))
w = jnp.ones((64, 2), jnp.float32)
"""
_EP_STEP_TAIL = """
fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
_START = time.time()
try:
    jax.block_until_ready(fn(x, idx, w))
    print("CALL_RETURNED", flush=True)
except Exception as e:
    print("CALL_RAISED", type(e).__name__, str(e)[:300], flush=True)
"""


def ep_step_child(body: str, **cfg_args) -> str:
    """The script of a child that runs `body` (see _EP_STEP_HEAD) once under jit + shard_map."""
    extra = "".join(f", {name}={value!r}" for name, value in cfg_args.items())
    return _EP_STEP_HEAD % (EP_RANKS, extra) + textwrap.dedent(body) + _EP_STEP_TAIL


# ---- process model 2: the launcher, inputs and the reference without cross-process collectives --------
def process_group_skip_reason() -> str | None:
    """Why this machine cannot run the process-model-2 tests (None: it can). Without --share-gpu: the
    CUDA backend and NUM_PROCESSES GPUs (this initialises JAX on the GPUs here, as the other tests
    do). With --share-gpu: the extension and one CUDA device, without creating a CUDA context in this
    process: under MPS a device fault in any client (the fingerprint tests trap on purpose) ends every
    client on that GPU, this pytest process included, and the MPS server then takes no new client
    until they have all exited."""
    from jax_ep import runtime

    if not SHARE_GPU:
        usable, reason = runtime.available()
        if not usable:
            return f"jax_ep CUDA backend unavailable: {reason}"
        if len(jax.local_devices(backend="gpu")) < NUM_PROCESSES:
            return f"needs {NUM_PROCESSES} GPUs (or --share-gpu with CUDA MPS running)"
        return None
    native = runtime.extension()
    if native is None:
        return f"jax_ep._C not built: {runtime.extension_error()}"
    try:
        count = native.device_count()
    except RuntimeError as e:
        return f"no usable CUDA device ({e})"
    return None if count else "no CUDA device"


def rel_err(a, b) -> float:
    """|a - b| / |b| (Frobenius norms, float64)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


_HLO_LINE = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+) = (.*)$")
_HLO_OP = re.compile(r"(?:^|[\s)}\]])([a-z][a-z\-]*)\(")
_HLO_REF = re.compile(r"(?<![=\w])%([\w.\-]+)")
_HLO_CALLS = re.compile(r"(?:calls|to_apply|body|condition)=(%[\w.\-]+)")


def _hlo_computations(hlo: str) -> tuple[str, dict[str, str]]:
    """A compiled module's text (compiled.as_text()) as (the entry computation's text, {"%name": the text
    of each other computation}: the fusions, command buffers and calls its instructions name)."""
    head, entry = hlo.split("\nENTRY ", 1)
    computations = {}
    for block in head.split("\n\n"):
        m = re.search(r"^(?:%)?([\w.\-]+) ", block.strip())
        if m:
            computations["%" + m.group(1)] = block
    return entry, computations


def scheduled_ep_calls(hlo: str) -> list[str]:
    """The jax_ep custom-call targets of a compiled program (compiled.as_text()) in XLA's schedule: the
    entry computation's instructions in order, a computation an instruction calls (a fusion, a command
    buffer, a call) expanded where it is called."""
    entry, computations = _hlo_computations(hlo)

    def walk(text: str, depth: int) -> list[str]:
        found = []
        for m in map(_HLO_LINE.match, text.splitlines()):
            if not m:
                continue
            rest = m.group(2)
            target = re.search(r'custom_call_target="(jax_ep_\w+)"', rest)
            if target:
                found.append(target.group(1))
            for callee in _HLO_CALLS.findall(rest):
                if callee in computations and depth < 8:
                    found += walk(computations[callee], depth + 1)
        return found

    return walk(entry, 0)


def assert_side_results_read_after_join(hlo: str, what: str) -> None:
    """In the compiled (scheduled) program `hlo` (compiled.as_text()), nothing on XLA's stream reads a side
    call's results between the call and its jax_ep_side_join: until the join they are being written on
    the side stream; nor does another EP call run there meanwhile (it would share the comm buffers). Only
    tuples, get-tuple-elements and optimization barriers (expanded or not) may pass the results on
    (followed per tuple element). Checks every side call of the entry computation; the
    join of a side call is the first join after it; a custom call XLA wrapped in a fusion (its dynamic
    slice fusions) counts as the call. (Found necessary on one H200, 2026-12-02: with a zero-sized join
    token XLA scheduled the group sizes' prefix sum before the join.)"""
    entry, computations = _hlo_computations(hlo)

    def calls_target(rest: str, pattern: str) -> bool:
        texts = [rest] + [computations.get(c, "") for c in _HLO_CALLS.findall(rest)]
        return any(re.search(rf'custom_call_target="{pattern}"', t) for t in texts)

    lines = [m.groups() for m in map(_HLO_LINE.match, entry.splitlines()) if m]
    side_calls = [i for i, (_, rest) in enumerate(lines) if calls_target(rest, r"jax_ep_\w+_side")]
    assert side_calls, f"{what}: no side call in the program"
    for start in side_calls:
        name0 = lines[start][0]
        derived = {name0: None}   # name -> None (every element derived) or the set of tuple indices
        joined = False
        for name, rest in lines[start + 1:]:
            if calls_target(rest, "jax_ep_side_join"):
                joined = True
                break
            assert not calls_target(rest, r"jax_ep_\w+"), (
                f"{what}: EP call %{name} is issued on XLA's stream between side call %{name0} and its "
                f"join: both would use the comm buffers at once")
            body = _HLO_CALLS.sub("", rest)
            op = _HLO_OP.search(body)
            op = op.group(1) if op else ""
            refs = _HLO_REF.findall(body)
            if op == "get-tuple-element":
                index = int(re.search(r"index=(\d+)", body).group(1))
                src = derived.get(refs[0], False)
                if src is None or (src is not False and index in src):
                    derived[name] = None
                continue
            if op in ("tuple", "opt-barrier"):
                hit = {i for i, r in enumerate(refs) if r in derived}
                if hit:
                    derived[name] = hit
                continue
            read = [r for r in refs if r in derived]
            assert not read, (f"{what}: %{name} ({op}) reads {read} of side call %{name0} before its "
                              f"join:\n  {name} = {rest[:300]}")
        assert joined, f"{what}: side call %{name0} has no join after it"


def launch_command(worker, extra=(), timeout_s: int = 420) -> list[str]:
    """python -m jax_ep.launch running `worker` as NUM_PROCESSES processes: one GPU each, or all on GPU 0
    (--share-gpus) with --share-gpu. The launcher stops them after timeout_s - 20 s."""
    command = [sys.executable, "-m", "jax_ep.launch", "--nproc", str(NUM_PROCESSES),
               "--timeout", str(timeout_s - 20)]
    if SHARE_GPU:
        command += ["--share-gpus", "--local-device-ids", ",".join(["0"] * NUM_PROCESSES)]
    return command + [str(worker), *extra]


def launch_env(timeout_env: str = "30", **changes) -> dict:
    """The workers' environment: JAX_EP_TIMEOUT_S=timeout_env, the EP size of test_dispatch_gpu (which
    the workers import) = NUM_PROCESSES whatever --ep-ranks says, and `changes` (None removes)."""
    env = dict(os.environ, JAX_EP_TIMEOUT_S=timeout_env, JAX_EP_TEST_EP_RANKS=str(NUM_PROCESSES))
    # XLA's sharded autotuning (on by default with several processes) makes every compilation wait for
    # the other processes' share of the results: a program one process compiles alone (after its peer
    # stopped calling: ll_shrink_worker; a per-process program on purpose: fingerprint_worker) waited
    # forever in backend_compile_and_load (seen on one H200 under MPS, 2026-11-24). docs/api.md.
    # JAX_EP_TEST_SHARD_AUTOTUNING=on keeps XLA's default (the tests that compile per-process programs
    # on purpose then hang, as above: for the repeated matches_reference runs of tools/gpu_check.sh).
    if os.environ.get("JAX_EP_TEST_SHARD_AUTOTUNING", "off") != "on":
        env["XLA_FLAGS"] = " ".join([env.get("XLA_FLAGS", ""), "--xla_gpu_shard_autotuning=false"]).strip()
    for name, value in changes.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def run_process_group(worker, extra=(), timeout_s: int = 420, timeout_env: str = "30", env=None):
    """Runs `worker` through launch_command; (launcher exit code, its whole output, [each process's
    lines]). By default the workers allocate on demand (XLA_PYTHON_CLIENT_PREALLOCATE=false: this
    pytest process may hold most of the GPUs, and with --share-gpu the processes share one)."""
    import pytest

    if env is None:
        env = launch_env(timeout_env, XLA_PYTHON_CLIENT_PREALLOCATE="false",
                         XLA_PYTHON_CLIENT_MEM_FRACTION=None)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        done = subprocess.run(launch_command(worker, extra, timeout_s), capture_output=True, text=True,
                              env=env, timeout=timeout_s, cwd=root)
    except subprocess.TimeoutExpired as e:
        out = "".join(part.decode(errors="replace") if isinstance(part, bytes) else part or ""
                      for part in (e.stdout, e.stderr))
        reports = "\n".join(process_outputs(out, None))
        pytest.fail(f"the launcher did not finish within {timeout_s} s; its processes' output:\n{reports}")
    out = done.stdout + done.stderr
    return done.returncode, out, process_outputs(out, done.returncode)


# At most this much of a failed process's output (the tests print its last 4000-6000 characters).
PROCESS_REPORT_CHARS = 3900


def process_outputs(out: str, returncode: int | None) -> list[str]:
    """Each process's lines of the launcher's output `out`, without XLA's teardown errors after a device
    fault (hundreds of lines, one per stream, event and buffer it cannot free: they pushed the worker's
    own report out of the tail the tests print). In a failed run (launcher exit code `returncode` != 0;
    None: the launcher did not finish) a process that did not exit 0, or whose output shows a failure,
    gets jax_ep.failure_report's report instead, at most PROCESS_REPORT_CHARS long: first the summary
    (exit code, failing check, jax_ep fault records, first CUDA / XLA error, EP op running, the noise
    left out), then its last lines without the noise. python -m jax_ep.launch prints the same
    summaries at the end of a failed run."""
    codes = launch.exit_codes(out)
    texts = []
    for p in range(NUM_PROCESSES):
        text = "\n".join(line for line in out.splitlines() if line.startswith(f"[p{p}]"))
        found = failure_report.digest(text)
        code = codes.get(p)
        if returncode == 0 or (code == 0 and not found.failed()):
            texts.append(without_teardown_noise(text))
            continue
        launcher = "did not finish" if returncode is None else f"exited with code {returncode}"
        status = (launch.describe(code) if code is not None
                  else f"exit code not known (the launcher {launcher})")
        texts.append(found.report(p, status, total_chars=PROCESS_REPORT_CHARS))
    return texts


without_teardown_noise = failure_report.without_teardown_noise


def run_workers(worker, extra=(), timeout_s: int = 420, timeout_env: str = "30"):
    """[(launcher exit code, process p's lines)] for p < NUM_PROCESSES (run_process_group)."""
    rc, _, per_process = run_process_group(worker, extra, timeout_s, timeout_env)
    return [(rc, out) for out in per_process]


def assert_workers_ok(worker, ok_line: str, extra=(), timeout_s: int = 240, timeout_env: str = "30"):
    """Runs `worker` (run_workers), prints each process's output, and asserts every process exited 0
    and printed `ok_line` with {p} replaced by its index. Returns [(rc, lines)] for more checks."""
    results = run_workers(worker, extra, timeout_s=timeout_s, timeout_env=timeout_env)
    for p, (rc, out) in enumerate(results):
        print(f"---- process {p} (rc {rc})\n{out[-6000:]}")
    for p, (rc, out) in enumerate(results):
        assert rc == 0, f"process {p} failed (rc {rc}):\n{out[-4000:]}"
        assert ok_line.format(p=p) in out, f"process {p}: no line {ok_line.format(p=p)!r}"
    return results


def worker_main(run, name: str, axis: str = "ep") -> None:
    """The main of a process-model-2 worker whose processes stop at different points (one stops
    calling): jax_ep.distributed.initialize(), a mesh of every process's device over `axis`, then
    run(process index, mesh) -> report; prints "<name> OK process N: <report>" and exits at once
    (os._exit: no teardown that would wait for a peer), 1 with the traceback on any error."""
    import traceback

    from jax.sharding import Mesh

    import jax_ep.distributed
    from jax_ep import runtime

    jax_ep.distributed.initialize()
    me = jax.process_index()
    assert runtime.process_model() == "process_per_gpu", runtime.process_model()
    mesh = Mesh(np.array(jax.devices()), (axis,))
    try:
        report = run(me, mesh)
    except BaseException:  # noqa: BLE001  (exit now: a peer may be waiting on the barrier)
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    print(f"{name} OK process {me}: {report}", flush=True)
    os._exit(0)


def put_global(mesh, *arrays, axis: str = "ep"):
    """Global arrays sharded over `axis` on their leading dimension from the same host arrays on every
    process: each process puts its own shards (jax.make_array_from_callback). jax.device_put of host
    data to a sharding over several processes runs a jitted identity whose XLA collective goes through
    NCCL, which refuses two processes on one GPU ("Duplicate GPU detected")."""
    sharding = NamedSharding(mesh, P(axis))
    return [jax.make_array_from_callback(a.shape, sharding, lambda index, a=a: a[index]) for a in arrays]


def local(tree):
    """This process's shard of every output of a jit(shard_map) over the process group (one device per
    process, the rank on the leading axis)."""
    return jax.tree.map(lambda a: np.asarray(a.addressable_shards[0].data), tree)


def reference_by_vmap(body, ranks, axis_name="ep", device=None):
    """fn(*host arrays) = jax.jit(jax.shard_map(body, mesh, in_specs=P(axis_name),
    out_specs=P(axis_name)))(*arrays) over `ranks` ranks, computed in this process alone on `device`
    (default: its first local device): the ranks as a leading axis of size `ranks` under
    jax.vmap(axis_name=axis_name), whose batching of lax.all_to_all / psum / axis_index / axis_size
    stands in for the collectives. Every input is split [R * n, ...] -> [R, n, ...], every output
    merged back [R, m, ...] -> [R * m, ...], the global layout of the shard_map version, so that rank
    r's part of an output is rows r * m .. (r + 1) * m - 1 (rank_rows). A mesh of several axes (the
    hierarchical ops' (node, local)): `ranks` and `axis_name` are tuples, outermost first, and rank r
    is the row-major index over them, as P((node, local)) lays them out. The process-model-2 workers
    compute their reference with it: no XLA collective across the processes (NCCL refuses two
    processes on one GPU). tests/test_reference_vmap.py checks it gives the shard_map reference's
    bits on 8 CPU devices."""
    sizes = (ranks,) if isinstance(ranks, int) else tuple(ranks)
    names = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    assert len(sizes) == len(names), (ranks, axis_name)
    total = int(np.prod(sizes))

    def split(a):
        return a.reshape(*sizes, a.shape[0] // total, *a.shape[1:])

    def merge(a):
        return a.reshape(total * a.shape[len(sizes)], *a.shape[len(sizes) + 1:])

    per_rank = body
    for name, size in reversed(list(zip(names, sizes, strict=True))):  # innermost axis first
        per_rank = jax.vmap(per_rank, axis_name=name, axis_size=size)
    fn = jax.jit(lambda *args: jax.tree.map(merge, per_rank(*jax.tree.map(split, args))))

    def run(*arrays):
        target = device if device is not None else jax.local_devices()[0]
        return fn(*jax.device_put(arrays, target))

    return run


def rank_rows(tree, rank: int, ranks: int):
    """Rank `rank`'s part of every (global) output of reference_by_vmap, as NumPy: what `local` gives
    of the shard_map version on that rank's process. Cut on the device: only that part is copied to
    the host (at EP8 the whole outputs of the DeepSeek-V3 case are several GB per process)."""
    return jax.tree.map(lambda a: np.asarray(a.reshape(ranks, -1, *a.shape[1:])[rank]), tree)


def random_normal(rng, shape, dtype) -> np.ndarray:
    """Standard normal values of `dtype`, drawn in float32 a block of rows at a time: the expert outputs
    `y` grow with R² ([R * C, H] with C growing with R; the low-latency [R, E / R, R * T, H]), and a
    float64 draw of them at EP8 (15-17 GB per process for the DeepSeek-V3 cases) ran the host out of
    memory with 8 processes on one machine."""
    out = np.empty(shape, dtype)
    step = max(1, (64 << 20) // (4 * max(1, int(np.prod(shape[1:])))))
    for i in range(0, shape[0], step):
        n = min(step, shape[0] - i)
        out[i:i + n] = rng.standard_normal((n, *shape[1:]), dtype=np.float32).astype(dtype)
    return out
