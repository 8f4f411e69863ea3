"""GPU memory: jax_ep's buffers that do not fit beside XLA's preallocation raise
jax_ep.runtime.DeviceMemoryError naming the buffer, the bytes, the GPU's free/total memory,
XLA_PYTHON_CLIENT_MEM_FRACTION and what to do (the text: xla_ffi/device_memory.cc, checked for given
numbers on the CPU in tests/test_device_memory.py). Here each case runs in a child process with its
own XLA memory settings:

* ensure_initialized of more than the GPU has free (process model 1): the error, the runtime still
  usable, and the XLA_PYTHON_CLIENT_MEM_FRACTION the message suggests makes the same call succeed;
* a traced dispatch whose buffer cannot fit: the error at trace time (jit(...).lower), from the call;
* room gone between tracing and compiling (XLA_PYTHON_CLIENT_PREALLOCATE=false): XLA's instantiation
  of the op fails with RESOURCE_EXHAUSTED and the same text;
* process model 2 (2 processes x 1 GPU, NVSHMEM; with pytest --share-gpu both on GPU 0 under MPS):
  growing the symmetric buffer beyond the GPU is refused on every process before NVSHMEM is asked
  (NVSHMEM 3.4.5 would kill the job), with the symmetric heap and the processes lacking room named,
  and the process group still works after.

The children need the GPUs' memory to themselves: the cases skip (saying so) when another process
holds more than a tenth of GPU 0, e.g. when an earlier test of the same pytest run initialised JAX
on the GPU (this file sorts first among tests/gpu, and it never initialises JAX in the pytest
process). To be sure: pytest -m gpu tests/gpu/test_device_memory_gpu.py
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from gpu_helpers import NUM_PROCESSES, SHARE_GPU, run_process_group

from jax_ep import runtime

pytestmark = pytest.mark.gpu

MiB = 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Every child starts with this: skips when jax_ep cannot run or another process holds GPU memory,
# lets XLA take its pool, hands the GPUs to jax_ep; then `free`, `total` of the first GPU.
PRELUDE = r"""
import json, os
import numpy as np
from jax_ep import runtime
C = runtime.extension()

def result(**kw):
    print("RESULT=" + json.dumps(kw), flush=True)
    os._exit(0)  # the verdict is out; no teardown that could hang after a failed allocation

def round2(n):
    return n // (2 << 20) * (2 << 20)

if C is None:
    result(skip=f"jax_ep._C not built: {runtime.extension_error()}")
try:
    avail_before, total = C.memory_info(0)  # before JAX: what other processes left
except RuntimeError as e:
    result(skip=f"no usable CUDA device ({e})")
if avail_before < 0.9 * total:
    result(skip=f"GPU 0 has {C.format_bytes(avail_before)} free of {C.format_bytes(total)} before "
                "JAX starts: another process holds memory; run this file alone")
import jax
usable, reason = runtime.available()
if not usable:
    result(skip=reason)
devices = jax.local_devices(backend="gpu")
for d in devices:  # XLA takes its pool now (preallocation), before jax_ep allocates
    jax.device_put(np.zeros(1, np.float32), d).block_until_ready()
runtime.register_targets()
ordinal = devices[0].local_hardware_id
free, total = C.memory_info(ordinal)
"""

ENSURE = PRELUDE + r"""
need = int(os.environ.get("JAX_EP_TEST_NEED") or round2(free + total // 10))
error = None
try:
    runtime.ensure_initialized(need)
except Exception as e:  # noqa: BLE001 - reported to the parent
    error = e
kept = C.buffer_bytes()
runtime.ensure_initialized(64 << 20)  # the runtime still works after the failure
result(total=total, free=free, need=need, error=type(error).__name__ if error else None,
       is_device_memory_error=isinstance(error, runtime.DeviceMemoryError),
       message=str(error) if error else "", kept=kept, small=C.buffer_bytes())
"""

# A dispatch of `need` bytes of buffer: H=4096, K=1, one expert per rank, capacity 256 (the
# buffer grows with max_tokens_per_rank; the outputs stay small).
DISPATCH = PRELUDE + r"""
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P
import jax_ep
from jax_ep import cuda_backend
R, H, K = len(devices), 4096, 1
mesh = Mesh(np.array(devices), ("ep",))

def cfg_for(tokens):
    return jax_ep.EPConfig(num_experts=R, num_topk=K, hidden=H, max_tokens_per_rank=tokens,
                           backend="cuda", capacity=256)

def sized(target):
    tokens = max(1024, int(4096 * target / cuda_backend.comm_bytes(cfg_for(4096), R)))
    cfg = cfg_for(tokens)
    fn = jax.jit(jax.shard_map(lambda x, i, w: jax_ep.dispatch(x, i, w, cfg).x[None], mesh=mesh,
                               in_specs=P("ep"), out_specs=P("ep")))
    args = [jax.ShapeDtypeStruct(s, t) for s, t in (((R * tokens, H), jnp.bfloat16),
                                                    ((R * tokens, K), jnp.int32),
                                                    ((R * tokens, K), jnp.float32))]
    return fn, args, cuda_backend.comm_bytes(cfg, R)
"""

TRACE = DISPATCH + r"""
fn, args, need = sized((free + total) // 2)
error = None
try:
    fn.lower(*args)
except Exception as e:  # noqa: BLE001
    error = e
result(total=total, free=free, need=need, error=type(error).__name__ if error else None,
       is_device_memory_error=isinstance(error, runtime.DeviceMemoryError),
       message=str(error) if error else "")
"""

INSTANTIATE = DISPATCH + r"""
fn, args, need = sized(min(3 << 30, free // 4))
lowered = fn.lower(*args)  # the trace-time check passes: the GPUs are nearly empty
keep = []
for d in devices:  # now fill every GPU until less than half the buffer is free
    while True:
        left = C.memory_info(d.local_hardware_id)[0] - need // 2
        n = min(1 << 30, left) // 4096 * 4096
        if n <= 0:
            break
        try:
            keep.append(jnp.zeros((n,), jnp.uint8, device=d).block_until_ready())
        except Exception:  # noqa: BLE001 - XLA's own limit: as full as it gets
            break
free_filled = min(C.memory_info(d.local_hardware_id)[0] for d in devices)
if free_filled >= need:
    result(skip=f"could not fill the GPUs below {need} bytes free ({free_filled} left)")
error = None
try:
    lowered.compile()  # XLA instantiates the FFI call sites when it compiles
except Exception as e:  # noqa: BLE001
    error = e
result(total=total, need=need, free_filled=free_filled, error=type(error).__name__ if error else None,
       message=str(error) if error else "")
"""

PROCESS_GROUP = r"""
import json, os
import numpy as np
import jax
import jax_ep.distributed
jax_ep.distributed.initialize()
from jax_ep import runtime
C = runtime.extension()

def result(**kw):
    print("RESULT=" + json.dumps(kw), flush=True)
    os._exit(0)

d = jax.local_devices(backend="gpu")[0]
jax.device_put(np.zeros(1, np.float32), d).block_until_ready()
runtime.ensure_initialized(64 << 20)  # NVSHMEM up, its heap sized for a small buffer
free, total = C.memory_info(d.local_hardware_id)
need = (free + total) // 2 // (2 << 20) * (2 << 20)
plan = C.plan_process_group(need)  # what this process expects NVSHMEM's heap to take
error = None
try:
    runtime.ensure_initialized(need)  # collective: every process asks (the largest need wins)
except Exception as e:  # noqa: BLE001
    error = e
kept = C.buffer_bytes()
runtime.ensure_initialized(128 << 20)  # collective again: the group still works after the refusal
result(total=total, free=free, need=need, process=jax.process_index(), gpu=d.local_hardware_id,
       heap_bytes=plan["heap_bytes"], error=type(error).__name__ if error else None,
       is_device_memory_error=isinstance(error, runtime.DeviceMemoryError),
       message=str(error) if error else "", buffer=kept, after=C.buffer_bytes())
"""


def _env(**changes) -> dict:
    """This environment with XLA's memory settings replaced (None removes a variable)."""
    env = dict(os.environ, JAX_EP_TIMEOUT_S="30")
    for name in ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION",
                 "XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_ALLOCATOR", "JAX_EP_TEST_NEED"):
        env.pop(name, None)
    env.update({k: v for k, v in changes.items() if v is not None})
    return env


def run_child(script: str, timeout_s: int = 300, **env) -> dict:
    """The RESULT dict of `script` run in a child process (skips the test if the child skipped)."""
    child = subprocess.run([sys.executable, "-c", script], env=_env(**env), capture_output=True,
                           text=True, timeout=timeout_s, cwd=ROOT)
    lines = [line for line in child.stdout.splitlines() if line.startswith("RESULT=")]
    assert lines, f"child gave no result (rc {child.returncode}):\n{(child.stdout + child.stderr)[-5000:]}"
    out = json.loads(lines[-1][len("RESULT="):])
    if "skip" in out:
        pytest.skip(out["skip"])
    print(json.dumps({k: v for k, v in out.items() if k != "message"}))
    print(out.get("message", ""))
    return out


def suggested_fraction(message: str) -> str | None:
    found = re.search(r"set XLA_PYTHON_CLIENT_MEM_FRACTION=(0\.\d\d) \(or lower\)", message)
    return found.group(1) if found else None


@pytest.fixture(scope="module")
def native():
    """jax_ep._C with a CUDA device, without initialising JAX on the GPU in this process."""
    c = runtime.extension()
    if c is None:
        pytest.skip(f"jax_ep._C not built: {runtime.extension_error()}")
    try:
        if c.device_count() == 0:
            pytest.skip("no CUDA device")
    except RuntimeError as e:
        pytest.skip(f"no usable CUDA device ({e})")
    return c


@pytest.fixture(scope="module")
def too_large(native):
    """ensure_initialized(free + total/10) with XLA preallocating 0.75 of each GPU."""
    return run_child(ENSURE, XLA_PYTHON_CLIENT_MEM_FRACTION="0.75")


def test_ensure_initialized_beyond_free_memory_names_bytes_and_fraction(native, too_large):
    out = too_large
    assert out["free"] < out["need"] < out["total"], out
    assert out["error"] == "DeviceMemoryError" and out["is_device_memory_error"], out
    text = out["message"]
    first = text.splitlines()[0]
    assert re.match(r"jax_ep: the communication buffer does not fit in the memory of GPU \d+: it needs ",
                    first), first
    assert f"it needs {native.format_bytes(out['need'])}" in first
    assert f" free of {native.format_bytes(out['total'])}" in first
    assert "beside the 2.00 MiB (2097152 bytes) of jax_ep's current buffer" in first
    assert ("XLA preallocates XLA_PYTHON_CLIENT_MEM_FRACTION of every GPU's memory for JAX's arrays "
            "(XLA_PYTHON_CLIENT_MEM_FRACTION=0.75)") in text
    assert suggested_fraction(text) is not None, text
    early = f"XLA_PYTHON_CLIENT_PREALLOCATE=false and call jax_ep.runtime.ensure_initialized({out['need']})"
    assert early in text
    assert "max_tokens_per_rank" in text
    # Nothing changed on failure, and the runtime still works.
    assert out["kept"] == 2 * MiB and out["small"] == 64 * MiB, out


def test_the_suggested_fraction_makes_room(native, too_large):
    """The same ensure_initialized with XLA_PYTHON_CLIENT_MEM_FRACTION set as the message says."""
    fraction = suggested_fraction(too_large["message"])
    out = run_child(ENSURE, XLA_PYTHON_CLIENT_MEM_FRACTION=fraction,
                    JAX_EP_TEST_NEED=str(too_large["need"]))
    assert out["error"] is None, f"with XLA_PYTHON_CLIENT_MEM_FRACTION={fraction}:\n{out['message']}"
    assert out["kept"] == too_large["need"], out


def test_traced_op_that_cannot_fit_fails_at_trace_time(native):
    out = run_child(TRACE, XLA_PYTHON_CLIENT_MEM_FRACTION="0.75")
    assert out["free"] < out["need"] < out["total"], out
    assert out["error"] == "DeviceMemoryError" and out["is_device_memory_error"], out
    text = out["message"]
    assert text.startswith("jax_ep: the communication buffer does not fit in the memory of GPU "), text
    needs = int(re.search(r"it needs [^(]+\((\d+) bytes\)", text).group(1))
    assert out["need"] - 2 * MiB < needs <= out["need"] + 2 * MiB and needs % (2 * MiB) == 0, (needs, out)
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION=0.75" in text and suggested_fraction(text), text


def test_instantiation_without_room_is_resource_exhausted(native):
    """Room gone after tracing: XLA's instantiation of the call site (at compile time) fails with
    RESOURCE_EXHAUSTED and the same text."""
    out = run_child(INSTANTIATE, XLA_PYTHON_CLIENT_PREALLOCATE="false", XLA_PYTHON_CLIENT_MEM_FRACTION="0.99")
    assert out["free_filled"] < out["need"], out
    assert out["error"] == "JaxRuntimeError", out
    text = out["message"]
    assert "RESOURCE_EXHAUSTED" in text and "dispatch" in text, text
    assert "the communication buffer does not fit in the memory of GPU " in text, text
    assert "XLA does not preallocate here (XLA_PYTHON_CLIENT_PREALLOCATE=false)" in text, text


@pytest.mark.process_group
def test_process_model_2_growth_beyond_the_gpu(native, tmp_path):
    """N processes x 1 GPU (pytest --processes, default 2): growing the symmetric buffer past the free
    memory is refused on every process before NVSHMEM is asked (NVSHMEM 3.4.5 does not return NULL:
    its job dies): each raises the same DeviceMemoryError naming the NVSHMEM symmetric heap and the
    processes lacking room (here all: each asks for more than its GPU has free), nothing changes, and
    the next collective step works. With pytest --share-gpu all processes are on GPU 0 (under MPS),
    each preallocating 0.75 / N of it for XLA."""
    if not SHARE_GPU and native.device_count() < NUM_PROCESSES:
        pytest.skip(f"needs {NUM_PROCESSES} GPUs (or --share-gpu with CUDA MPS running)")
    worker = tmp_path / "memory_worker.py"
    worker.write_text(PROCESS_GROUP)
    fraction = 0.75 / NUM_PROCESSES if SHARE_GPU else 0.75   # XLA's pools of the processes of one GPU
    env = _env(XLA_PYTHON_CLIENT_MEM_FRACTION=f"{fraction:g}")
    returncode, output, _ = run_process_group(worker, timeout_s=240, env=env)
    print(output[-6000:])
    assert "cuMemCreate failed" not in output and "illegal memory access" not in output, output[-5000:]
    outs = []
    for p in range(NUM_PROCESSES):
        lines = [line for line in output.splitlines() if line.startswith(f"[p{p}] RESULT=")]
        assert lines, f"process {p} gave no result (launcher rc {returncode}):\n{output[-5000:]}"
        outs.append(json.loads(lines[-1].split("RESULT=", 1)[1]))
    assert returncode == 0, output[-5000:]
    texts = [out["message"] for out in outs]
    assert all(text == texts[0] for text in texts), texts  # one decision from the same published verdicts
    for out in outs:
        assert out["error"] == "DeviceMemoryError" and out["is_device_memory_error"], out
        text = out["message"]
        assert text.startswith("jax_ep: the communication buffer does not fit in the memory of every GPU "
                               "of the process group: it needs "), text
        assert "NVSHMEM symmetric heap" in text, text
        assert f"{NUM_PROCESSES} of {NUM_PROCESSES} processes lack room" in text, text
        assert "every process raises this error; nothing was allocated" in text, text
        # A smaller XLA fraction is advised only when it would leave room: with the processes on one
        # GPU each heap needs most of it (e.g. 2 x 85 GiB > 140 GiB), so no fraction can, and none is advised.
        assert "on every process" in text and (SHARE_GPU or suggested_fraction(text)), text
        assert out["buffer"] == 64 * MiB and out["after"] == 128 * MiB, out  # unchanged, then usable
    # Each process is named with its GPU and its numbers.
    agreed = max(out["need"] for out in outs)
    for out in outs:
        line = re.search(rf"\n  \* process {out['process']} \(GPU {out['gpu']}\): the heap would grow "
                         r"by [^(]+\((\d+) bytes\), and jax_ep keeps [^(]+\((\d+) bytes\) free beside it; "
                         r"the GPU has [^(]+\((\d+) bytes\) free of [^(]+\((\d+) bytes\)\.", texts[0])
        assert line, texts[0]
        grows, margin, free, total = (int(g) for g in line.groups())
        assert grows >= agreed and grows % (2 * MiB) == 0 and margin == runtime.HEAP_ROOM_MARGIN_BYTES
        assert free < grows + margin and total == out["total"], (line.group(0), out)
        assert abs(free - out["free"]) < 256 * MiB, (free, out)
