"""Helpers of the GPU tests (imported as a top-level module: pytest puts tests/gpu on sys.path)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np

POISON_WORD = 0xA5A5A5A5

# EP group size of the single-axis suites (pytest --ep-ranks, tests/conftest.py; default 2). At 1 the
# kernels run on one GPU with every rank sending to itself: the local paths only.
EP_RANKS = int(os.environ.get("JAX_EP_TEST_EP_RANKS", "2"))


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
