"""Cross-GPU smoke op: peer tables, peer stores, the device-side group barrier and its epochs, in
plain calls, repeated calls, inside a jitted lax.scan (CUDA graphs), across runtime growth and
re-initialisation, and the timeout path (a rank whose peer never arrives records a fault)."""

from __future__ import annotations

import textwrap

import jax
import numpy as np
import pytest
from gpu_helpers import GRAPH_OPTIONS, assert_captured, faults_of_child, handler_stats, poison_device_memory
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

pytestmark = pytest.mark.gpu

AXIS = "ep"
MASK = 0xFFFFFFFF


def pattern(tag: int, writer: int, reader: int, n: int) -> np.ndarray:
    """peer_smoke_pattern of cuda/peer_smoke.h, in uint32 wrap-around arithmetic."""
    i = np.arange(n, dtype=np.uint64)
    base = (((tag & MASK) * 0x9E3779B1) & MASK) ^ ((writer * 0x85EBCA77) & MASK) ^ (
        (reader * 0xC2B2AE3D) & MASK)
    return (np.uint64(base) ^ ((i * np.uint64(0x27D4EB2F)) & np.uint64(MASK))).astype(np.uint32)


@pytest.fixture(scope="module")
def two_or_more(gpus):
    if len(gpus) < 2:
        pytest.skip(f"needs >= 2 GPUs, have {len(gpus)}")
    return gpus


def smoke_fn(backend, mesh: Mesh, n: int, out_spec=None):
    """tag (replicated scalar) -> received [R, R, n], epochs [R, R] (leading axis: the rank)."""
    out_spec = P(AXIS) if out_spec is None else out_spec

    def body(tag):
        received, epochs = backend.peer_smoke(tag, n, mesh=mesh, axis_name=AXIS)
        lead = (None,) * len(out_spec)
        return received[lead], epochs[lead]

    return jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=out_spec)


def check_smoke(received, epochs, tag: int, what: str) -> np.ndarray:
    """Every reader got exactly what every writer wrote for this tag; epochs are symmetric."""
    received, epochs = np.asarray(received), np.asarray(epochs)
    ranks, n = received.shape[0], received.shape[2]
    assert received.shape == (ranks, ranks, n) and received.dtype == np.uint32
    for reader in range(ranks):
        for writer in range(ranks):
            want = pattern(tag, writer, reader, n)
            got = received[reader, writer]
            bad = np.flatnonzero(got != want)
            assert bad.size == 0, (f"{what}: rank {reader} holds wrong data from rank {writer} at "
                                   f"{bad.size} of {n} elements; first i={bad[0]}: got "
                                   f"{got[bad[0]]:#x}, want {want[bad[0]]:#x}")
    assert (epochs == epochs.T).all(), f"{what}: pair epochs not symmetric:\n{epochs}"
    return epochs.astype(np.int64)


@pytest.mark.parametrize("n", [1, 1000, 1 << 16])
def test_peer_smoke_reaches_every_peer(cuda_backend, two_or_more, n):
    mesh = Mesh(np.array(two_or_more), (AXIS,))
    fn = jax.jit(smoke_fn(cuda_backend, mesh, n))
    poison_device_memory(two_or_more)
    received, epochs = fn(np.int32(12345))
    before = check_smoke(received, epochs, 12345, f"n={n}")
    received, epochs = fn(np.int32(-7))
    after = check_smoke(received, epochs, -7, f"n={n} second call")
    assert (after == before + 1).all(), f"epochs did not advance by one:\n{before}\n{after}"


def test_peer_smoke_repeated_calls(cuda_backend, two_or_more):
    mesh = Mesh(np.array(two_or_more), (AXIS,))
    fn = jax.jit(smoke_fn(cuda_backend, mesh, 4096))
    previous = None
    for call, tag in enumerate([0, 1, 2, -1, 2**31 - 1, -(2**31), 99]):
        poison_device_memory(two_or_more)
        received, epochs = fn(np.int32(tag))
        epochs = check_smoke(received, epochs, tag, f"call {call}")
        if previous is not None:
            assert (epochs == previous + 1).all(), f"call {call}: epochs {previous} -> {epochs}"
        previous = epochs


@pytest.mark.parametrize("graph_mode", list(GRAPH_OPTIONS))
def test_peer_smoke_inside_jitted_scan(cuda_backend, two_or_more, graph_mode):
    """Epochs advance on the device, so replayed CUDA graphs stay in step with their peers."""
    mesh = Mesh(np.array(two_or_more), (AXIS,))
    n, steps = 777, 8
    smoke = smoke_fn(cuda_backend, mesh, n)

    def run(first_tag):
        def step(tag, _):
            received, epochs = smoke(tag)
            return tag + 1, (received, epochs)

        return lax.scan(step, first_tag, None, length=steps)[1]

    tag0 = np.int32(1000)
    options = GRAPH_OPTIONS[graph_mode]
    compiled = jax.jit(run, compiler_options=options).lower(tag0).compile()
    before = handler_stats("jax_ep_peer_smoke")
    first_epochs = None
    for repeat in range(3):  # later runs replay the graphs built by the first
        poison_device_memory(two_or_more)
        received, epochs = compiled(tag0)
        print(graph_mode, "run", repeat, handler_stats("jax_ep_peer_smoke"))
        received, epochs = np.asarray(received), np.asarray(epochs)
        for s in range(steps):
            e = check_smoke(received[s], epochs[s], int(tag0) + s, f"{graph_mode} run {repeat} step {s}")
            if first_epochs is None:
                first_epochs = e - s
            expected = first_epochs + repeat * steps + s
            assert (e == expected).all(), f"{graph_mode} run {repeat} step {s}: epochs {e}, want {expected}"
    assert_captured("jax_ep_peer_smoke", before, graph_mode, options)


@pytest.mark.parametrize("arrangement", ["ep_first_2d", "two_groups"])
def test_peer_smoke_on_2d_mesh(cuda_backend, two_or_more, arrangement):
    """The EP axis need not be the only (or first) mesh axis; several groups run side by side."""
    devices = np.array(two_or_more)
    if arrangement == "ep_first_2d":
        mesh = Mesh(devices.reshape(-1, 1), (AXIS, "dp"))
        out_spec = P(AXIS, "dp")
    else:
        if len(devices) < 4 or len(devices) % 2:
            pytest.skip("needs an even number >= 4 of GPUs for two EP groups")
        mesh = Mesh(devices.reshape(2, -1), ("dp", AXIS))
        out_spec = P("dp", AXIS)
    n = 300
    fn = jax.jit(smoke_fn(cuda_backend, mesh, n, out_spec))
    received, epochs = (np.asarray(a) for a in fn(np.int32(5)))
    if arrangement == "ep_first_2d":  # [R, 1, R, n] -> [R, R, n]
        received, epochs = received[:, 0], epochs[:, 0]
        check_smoke(received, epochs, 5, arrangement)
    else:  # [2, R, R, n]: one independent group per row
        for g in range(2):
            check_smoke(received[g], epochs[g], 5, f"{arrangement} group {g}")


def test_runtime_growth_and_reinit(cuda_backend, two_or_more):
    """A compiled smoke op keeps working after the buffers grow; shutdown refuses while its
    executable holds the runtime, and once it is gone a new executable sets the runtime up again at
    instantiation: kernels reach buffers through the per-device state, whose address never changes."""
    import gc

    from jax_ep import runtime

    native = runtime.extension()
    ordinals = runtime.local_gpu_ordinals()
    mesh = Mesh(np.array(two_or_more), (AXIS,))
    fn = jax.jit(smoke_fn(cuda_backend, mesh, 2048))
    check_smoke(*fn(np.int32(1)), 1, "initial")
    assert sorted(native.managed_devices()) == sorted(ordinals)
    assert all(all(row) for row in native.peer_access_matrix(ordinals))
    assert native.timeout_seconds() > 0
    # instantiation reserved what the call site needs: 2 * R * n uint32
    assert native.buffer_bytes() >= 2 * len(two_or_more) * 2048 * 4

    size = native.buffer_bytes()
    runtime.ensure_initialized(size + (16 << 20))
    assert native.buffer_bytes() >= size + (16 << 20)
    check_smoke(*fn(np.int32(2)), 2, "after growth")

    with pytest.raises(RuntimeError, match=r"shutdown\(\) refused: \d+ instantiated EP call site"):
        runtime.shutdown()
    assert native.buffer_bytes() >= size  # refused: nothing freed
    del fn
    jax.clear_caches()
    gc.collect()
    runtime.shutdown()
    assert native.buffer_bytes() == 0 and native.managed_devices() == []
    fn = jax.jit(smoke_fn(cuda_backend, mesh, 2048))  # a new executable: instantiation re-inits
    check_smoke(*fn(np.int32(3)), 3, "after shutdown + re-instantiation")
    assert sorted(native.managed_devices()) == sorted(ordinals)
    assert runtime.faults() == []
    runtime.check_errors()


_TIMEOUT_CHILD = textwrap.dedent("""
    import time
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh
    from jax_ep import cuda_backend

    gpus = jax.local_devices(backend="gpu")
    mesh = Mesh(np.array(gpus[:2]), ("ep",))
    # Only GPU 0 runs the op (plain jit, input on GPU 0): rank 0 waits for rank 1 forever.
    fn = jax.jit(lambda t: cuda_backend.peer_smoke(t, 16, mesh=mesh, axis_name="ep"))
    _START = time.time()
    try:
        fn(jax.device_put(jnp.int32(1), gpus[0]))
    except Exception as e:  # the dispatch may already report the trap
        print("CALL_RAISED", type(e).__name__, flush=True)
""")


def test_timeout_records_fault_naming_op_and_ranks(cuda_backend, two_or_more):
    """A peer that never arrives: the barrier gives up after JAX_EP_TIMEOUT_S, records which op,
    rank and peer, and traps (in a child process: the trap kills that CUDA context)."""
    faults, stdout = faults_of_child(_TIMEOUT_CHILD)
    assert len(faults) == 1, faults
    fault = faults[0]
    ordinals = [d.local_hardware_id for d in two_or_more[:2]]
    assert fault["kind"] == "timeout" and fault["op"] == "peer_smoke", fault
    assert (fault["device_ordinal"], fault["rank"]) == (ordinals[0], 0), fault
    assert (fault["waited_ordinal"], fault["waited_rank"]) == (ordinals[1], 1), fault
    assert fault["elapsed_s"] >= 2.0, fault
    assert "CHECK_ERRORS=" in stdout and "timed out" in stdout, stdout[-4000:]


def test_remote_smoke_needs_process_model_2(cuda_backend, gpus):
    """remote_smoke (NVSHMEM device puts) exists in process model 2 only (tests/gpu/
    process_group_worker.py runs it there); in model 1 it is a clear error at trace time."""
    mesh = Mesh(np.array(gpus), (AXIS,))

    def body(tag):
        return cuda_backend.remote_smoke(tag, 8, mesh=mesh, axis_name=AXIS)[None]

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(AXIS)))
    with pytest.raises(NotImplementedError, match="remote_smoke needs process model 2"):
        fn(np.int32(1))
