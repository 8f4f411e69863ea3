"""The error raised when jax_ep's GPU buffers do not fit beside XLA's preallocation
(jax_ep.runtime.DeviceMemoryError), on the CPU: its text for given numbers comes from the one function
that writes it (jax_ep._C.device_memory_message, xla_ffi/device_memory.cc), and the trace-time check
is wired into runtime.reserve. tests/gpu/test_device_memory_gpu.py provokes it on a GPU."""

from __future__ import annotations

import json
import re
import types

import pytest

from jax_ep import runtime

GiB = 1 << 30
MiB = 1 << 20

native = runtime.extension()
pytestmark = pytest.mark.skipif(native is None, reason=f"jax_ep._C not built: {runtime.extension_error()}")


def message(buffer="communication buffer", ordinal=0, needed=17 * GiB, free=15 * GiB, total=80 * GiB,
            **kw):
    return native.device_memory_message(buffer, ordinal, needed, free, total, **kw)


def suggested_fraction(text: str, variable: str = "XLA_PYTHON_CLIENT_MEM_FRACTION") -> float | None:
    found = re.search(rf"set {variable}=(0\.\d\d) \(or lower\)", text)
    return float(found.group(1)) if found else None


def test_error_type_is_a_runtime_error_exported_by_runtime():
    assert runtime.DeviceMemoryError is native.DeviceMemoryError
    assert issubclass(runtime.DeviceMemoryError, RuntimeError)


def test_bytes_are_written_human_readable_and_exact():
    assert native.format_bytes(0) == "0 bytes"
    assert native.format_bytes(1023) == "1023 bytes"
    assert native.format_bytes(1536) == "1.50 KiB (1536 bytes)"
    assert native.format_bytes(3 * GiB // 2) == "1.50 GiB (1610612736 bytes)"
    assert native.format_bytes(80 * GiB) == "80.00 GiB (85899345920 bytes)"


def test_message_names_buffer_bytes_memory_and_xla_fraction():
    text = message()
    first = text.splitlines()[0]
    assert first.startswith("jax_ep: the communication buffer does not fit in the memory of GPU 0")
    assert "it needs 17.00 GiB (18253611008 bytes)" in first
    assert "the GPU has 15.00 GiB (16106127360 bytes) free of 80.00 GiB (85899345920 bytes)" in first
    assert ("XLA preallocates XLA_PYTHON_CLIENT_MEM_FRACTION of every GPU's memory for JAX's arrays "
            "(XLA_PYTHON_CLIENT_MEM_FRACTION=0.75, the default)") in text
    # What to do: a fraction that leaves room, no preallocation + early init, a smaller buffer.
    assert suggested_fraction(text) == 0.71  # 0.75 - 2/80 = 0.725 -> 0.72, less one hundredth
    assert "XLA then leaves about 3.20 GiB (3435973836 bytes) more free" in text
    assert ("set XLA_PYTHON_CLIENT_PREALLOCATE=false and call "
            "jax_ep.runtime.ensure_initialized(18253611008) before the program creates its large "
            "arrays") in text
    assert "max_tokens_per_rank" in text and "jax_ep.cuda_backend.comm_bytes(cfg, ep_size)" in text
    assert "on every process" not in text  # process model 1
    assert "[" not in first  # a check before allocating: no failing call to name


@pytest.mark.parametrize("needed,free,total,fraction", [
    (17 * GiB, 15 * GiB, 80 * GiB, "0.75"),
    (40 * GiB, 19 * GiB, 80 * GiB, None),
    (30 * GiB, 3 * GiB, 141 * GiB, "0.95"),
    (2 * GiB, 2 * GiB + MiB, 80 * GiB, "0.6"),  # free enough, cudaMalloc failed anyway
    (1 * GiB + 7, 1 * GiB, 94 * GiB, "0.9"),
])
def test_suggested_fraction_leaves_room_for_the_buffer(needed, free, total, fraction):
    """Lowering XLA's share from f to the suggestion frees (f - f') * total: at least the shortfall
    plus one hundredth of the GPU, and the suggestion is the largest such two-digit value."""
    env = {} if fraction is None else {"XLA_PYTHON_CLIENT_MEM_FRACTION": fraction}
    f = 0.75 if fraction is None else float(fraction)
    suggestion = suggested_fraction(message(needed=needed, free=free, total=total, env=env))
    assert suggestion is not None
    shortfall = max(needed - free, 0)
    assert (f - suggestion) * total >= shortfall + 0.01 * total - 1
    assert (f - suggestion - 0.01) * total < shortfall + 0.02 * total


def test_the_fraction_variable_in_use_is_the_one_advised():
    """jaxlib refuses XLA_CLIENT_MEM_FRACTION together with XLA_PYTHON_CLIENT_MEM_FRACTION: when the
    new name is set, the advice names it."""
    text = message(env={"XLA_CLIENT_MEM_FRACTION": "0.9"})
    assert "(XLA_CLIENT_MEM_FRACTION=0.9)" in text
    assert suggested_fraction(text, "XLA_CLIENT_MEM_FRACTION") == 0.86
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in text
    set_text = message(env={"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.6"})
    assert "(XLA_PYTHON_CLIENT_MEM_FRACTION=0.6)" in set_text and "the default" not in set_text


@pytest.mark.parametrize("name,value", [("XLA_PYTHON_CLIENT_PREALLOCATE", "false"),
                                        ("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")])
def test_without_preallocation_the_advice_is_to_start_early(name, value):
    text = message(env={name: value})
    why = f"{name}={value}"
    assert f"XLA does not preallocate here ({why})" in text
    assert suggested_fraction(text) is None
    assert "call jax_ep.runtime.ensure_initialized(18253611008) before the program creates" in text


def test_growth_names_the_buffer_already_held():
    text = message(needed=4 * GiB, free=3 * GiB, held_bytes=2 * GiB, ordinal=1,
                   cause="cudaMalloc: cudaErrorMemoryAllocation")
    first = text.splitlines()[0]
    assert "GPU 1: it needs 4.00 GiB (4294967296 bytes), beside the 2.00 GiB (2147483648 bytes) of " \
           "jax_ep's current buffer there (freed once the new one is in place)" in first
    assert first.endswith("[cudaMalloc: cudaErrorMemoryAllocation].")
    assert "size the buffer once, before the first EP op" in text


def test_larger_than_the_gpu_only_a_smaller_buffer_helps():
    text = message(needed=100 * GiB, free=15 * GiB, total=80 * GiB)
    assert "It is larger than the whole GPU; only a smaller buffer helps:" in text
    assert suggested_fraction(text) is None and "PREALLOCATE=false" not in text
    assert "lower max_tokens_per_rank" in text


def test_symmetric_heap_messages_name_nvshmem_and_every_process():
    text = message(needed=3 * GiB, free=1 * GiB, held_bytes=1 * GiB, heap_bytes=3 * GiB,
                   kind="symmetric_heap", cause="nvshmem_malloc returned NULL",
                   env={"NVSHMEM_SYMMETRIC_SIZE": "3G"})
    assert "[nvshmem_malloc returned NULL]" in text
    assert "NVSHMEM symmetric heap (process model 2: one process per GPU) of 3.00 GiB" in text
    assert "NVSHMEM_SYMMETRIC_SIZE=3G" in text
    assert "set NVSHMEM_SYMMETRIC_SIZE to at least 4.06 GiB (4362076160 bytes) on every process" in text
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION=0.71 (or lower) on every process" in text
    reserve = message(buffer="NVSHMEM symmetric heap", needed=3 * GiB, free=1 * GiB,
                      kind="heap_reservation", cause="NVSHMEM init failed with status 7")
    assert reserve.startswith("jax_ep: the NVSHMEM symmetric heap does not fit in the memory of GPU 0")
    assert "NVSHMEM reserves its symmetric heap when it starts" in reserve
    assert "NVSHMEM_SYMMETRIC_SIZE=unset" in reserve
    assert "set a smaller NVSHMEM_SYMMETRIC_SIZE on every process" in reserve
    with pytest.raises(ValueError, match="kind must be"):
        message(kind="somewhere")


def test_nvshmem_sizes_are_read_like_nvshmem():
    size = native.nvshmem_size_bytes
    assert size("1073741824") == GiB
    assert size("2G") == size("2g") == 2 * GiB
    assert size("20m") == 20971520 and size("3.1M") == 3250586 and size(".5m") == 524288
    assert size("20kk") == 20 * 1024  # one multiplier, the rest ignored
    assert size("") == 0 and size("lots") == 0 and size("5x") == 0


def test_reserve_checks_the_buffer_at_trace_time_in_process_model_1(monkeypatch):
    """runtime.reserve (every traced op) asks the extension whether the buffer fits: the error comes
    from the traced call, not from XLA's instantiation."""
    calls = []

    class FakeC:
        DeviceMemoryError = native.DeviceMemoryError

        @staticmethod
        def process_group():
            return {"model": "local_peers"}

        @staticmethod
        def check_buffer_fits(nbytes):
            calls.append(nbytes)
            if nbytes > GiB:
                raise native.DeviceMemoryError(message(needed=nbytes))

    monkeypatch.setattr(runtime, "register_targets", lambda: None)
    monkeypatch.setattr(runtime, "_C", FakeC)
    runtime.reserve(MiB)
    with pytest.raises(runtime.DeviceMemoryError, match=r"it needs 17\.00 GiB \(18253611008 bytes\)"):
        runtime.reserve(17 * GiB)
    assert calls == [MiB, 17 * GiB]


# ---- process model 2: the collective room check before NVSHMEM's heap grows ----

def test_heap_device_bytes_follow_nvshmem_heap_growth():
    """What NVSHMEM 3.4's symmetric heap takes from the GPU for one set-up step (the pure function
    behind runtime's check): the CUDA VMM heap grows by the allocation rounded up to whole steps of
    NVSHMEM_CUMEM_GRANULARITY (512 MiB); when NVSHMEM starts, its own allocations take the first
    step and a buffer that does not fit beside them adds its own steps; the static heap
    (NVSHMEM_DISABLE_CUDA_VMM=1) is allocated whole at start and never grows; SYSMEM is host memory."""
    heap = native.heap_device_bytes
    step = 512 * MiB
    assert heap(False, 64 * GiB) == 64 * GiB                    # a multiple of the step: as is
    assert heap(False, 60 * GiB + 2 * MiB) == 60 * GiB + step   # rounded up to a whole step
    assert heap(False, 2 * MiB) == step
    assert heap(False, 0) == 0                                  # nothing allocated: nothing taken
    assert heap(True, 2 * MiB) == step                          # start: one step holds it all
    assert heap(True, 256 * MiB) == step
    assert heap(True, 256 * MiB + 2 * MiB) == 2 * step          # does not fit beside NVSHMEM's own
    assert heap(True, 3 * GiB) == step + 3 * GiB
    assert heap(False, 60 * GiB + 2 * MiB, granularity=2 * MiB) == 60 * GiB + 2 * MiB
    assert heap(True, 100 * MiB, granularity=2 * MiB) == 256 * MiB + 100 * MiB
    assert heap(True, 64 * MiB, dynamic=False, static_heap_bytes=GiB) == GiB + step
    assert heap(False, 64 * GiB, dynamic=False, static_heap_bytes=GiB) == 0
    assert heap(True, 64 * GiB, on_device=False) == heap(False, 64 * GiB, on_device=False) == 0


def plan(buffer, held=0, heap_bytes=None, starting=False, dynamic=True, granularity=512 * MiB):
    if heap_bytes is None:
        heap_bytes = native.heap_device_bytes(starting, buffer, dynamic=dynamic, granularity=granularity)
    return {"first": starting, "nvshmem_starting": starting, "buffer": buffer, "held": held,
            "heap_on_device": True, "heap_dynamic": dynamic, "heap_granularity": granularity,
            "heap_bytes": heap_bytes}


def test_room_verdict_keeps_a_margin_beside_the_heap():
    grow = plan(60 * GiB + 2 * MiB, held=64 * MiB)  # the heap grows by 60.5 GiB
    need = 60 * GiB + 512 * MiB + runtime.HEAP_ROOM_MARGIN_BYTES
    fits = runtime._room_verdict(0, 0, grow, free=need, total=141 * GiB)
    assert fits["fits"] and fits["heap_bytes"] == 60 * GiB + 512 * MiB
    assert fits["margin"] == runtime.HEAP_ROOM_MARGIN_BYTES == 256 * MiB
    assert not runtime._room_verdict(1, 1, grow, free=need - 1, total=141 * GiB)["fits"]
    none = runtime._room_verdict(0, 0, plan(64 * MiB, held=64 * MiB, heap_bytes=0), free=0, total=GiB)
    assert none["fits"] and none["margin"] == 0  # the step takes nothing: nothing to check
    assert json.loads(json.dumps(fits)) == fits  # what goes through the key-value store


def verdicts_for(frees, buffer=60 * GiB + 2 * MiB, held=64 * MiB, total=141 * GiB, **kw):
    step = plan(buffer, held=held, **kw)
    return [runtime._room_verdict(p, p, step, free, total) for p, free in enumerate(frees)]


def test_heap_room_error_is_none_when_every_process_fits():
    assert runtime._heap_room_error(verdicts_for([70 * GiB, 61 * GiB])) is None
    assert runtime._heap_room_error([]) is None


def test_heap_room_error_names_the_heap_and_the_processes_lacking_room():
    verdicts = verdicts_for([70 * GiB, 35 * GiB, 70 * GiB, 20 * GiB])
    text = runtime._heap_room_error(verdicts, env={})
    first = text.splitlines()[0]
    assert first.startswith("jax_ep: the communication buffer does not fit in the memory of every GPU of "
                            "the process group: it needs 60.00 GiB (64426606592 bytes), beside the "
                            "64.00 MiB (67108864 bytes) of jax_ep's current buffer"), first
    assert "NVSHMEM symmetric heap (process model 2: one process per GPU), and 2 of 4 processes lack room:" \
        in first
    grows = ("the heap would grow by 60.50 GiB (64961380352 bytes), and jax_ep keeps 256.00 MiB "
             "(268435456 bytes)")
    assert f"\n  * process 1 (GPU 1): {grows} free beside it; the GPU has 35.00 GiB (37580963840 bytes) " \
           "free of 141.00 GiB (151397597184 bytes)." in text
    assert f"\n  * process 3 (GPU 3): {grows} free beside it; the GPU has 20.00 GiB" in text
    assert "process 0 " not in text and "process 2 " not in text  # only those lacking room
    assert "every process raises this error; nothing was allocated" in text
    assert "NVSHMEM_CUMEM_GRANULARITY (512.00 MiB (536870912 bytes))" in text
    # The advice holds for the tightest process: XLA must leave 60.75 - 20 GiB more on GPU 3.
    fraction = suggested_fraction(text)
    assert fraction is not None and (0.75 - fraction) * 141 * GiB >= (60.75 - 20) * GiB
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 (or lower) on every process" in text
    assert "set XLA_PYTHON_CLIENT_PREALLOCATE=false on every process and call " \
           "jax_ep.runtime.ensure_initialized(64426606592)" in text
    assert "size the buffer once" in text and "max_tokens_per_rank" in text
    assert "NVSHMEM_CUMEM_GRANULARITY=2m" not in text  # a finer step alone would not make room
    # The decision and the text depend on the published verdicts only, not on their order.
    assert runtime._heap_room_error(verdicts[::-1], env={}) == text


def test_heap_room_error_advises_a_finer_step_when_the_rounding_is_short():
    # 60 GiB + 2 MiB grows the heap by 60.5 GiB; 60.3 GiB free holds 60 GiB + 2 MiB + 256 MiB.
    text = runtime._heap_room_error(verdicts_for([int(60.3 * GiB)] * 2), env={})
    assert "2 of 2 processes lack room" in text
    assert ("set NVSHMEM_CUMEM_GRANULARITY=2m on every process before NVSHMEM starts (jax_ep starts it "
            "at the first EP op: restart the job)") in text


def test_heap_room_error_when_nvshmem_starts_or_the_heap_is_static():
    start = runtime._heap_room_error(verdicts_for([GiB, 100 * MiB], buffer=2 * MiB, held=0, starting=True),
                                     env={})
    assert "and 1 of 2 processes lacks room:" in start
    assert "process 1 (GPU 1): NVSHMEM would take 512.00 MiB (536870912 bytes)" in start
    assert "NVSHMEM starts in this step" in start and "beside the" not in start.splitlines()[0]
    static = runtime._heap_room_error(
        verdicts_for([GiB], buffer=64 * MiB, held=0, starting=True, dynamic=False,
                     heap_bytes=GiB + 512 * MiB), env={"NVSHMEM_SYMMETRIC_SIZE": "1G"})
    assert "NVSHMEM allocates its whole heap when it starts" in static
    assert "NVSHMEM_SYMMETRIC_SIZE=1G" in static
    assert "set a smaller NVSHMEM_SYMMETRIC_SIZE on every process" in static


class FakeGroup:
    """A process-model-2 extension and key-value store for simulated processes, one at a time."""

    def __init__(self, frees, total=141 * GiB):
        self.frees, self.total, self.me = frees, total, 0
        self.store: dict[str, bytes] = {}
        self.nvshmem_calls: list[str] = []
        self.DeviceMemoryError = native.DeviceMemoryError
        self.MEMORY_ENV_VARS = native.MEMORY_ENV_VARS
        self.device_memory_message = native.device_memory_message

    def process_group(self):
        return {"model": "process_per_gpu", "reachable_pes": list(range(len(self.frees)))}

    def plan_process_group(self, nbytes):
        return plan(nbytes, held=64 * MiB)

    def memory_info(self, gpu):
        assert gpu == self.me
        return self.frees[self.me], self.total

    def init_process_group(self, *args):
        self.nvshmem_calls.append("init_process_group")

    def nvshmem_unique_id(self):
        self.nvshmem_calls.append("nvshmem_unique_id")
        return b"id"

    def kv_set_bytes(self, key, value):
        self.store[key] = bytes(value)

    def kv_get_bytes(self, key, timeout_s=0, *, writer=""):
        if key not in self.store:
            raise TimeoutError(f"nothing under {key!r} from {writer}")
        return self.store[key]


def run_as(monkeypatch, group, process, nbytes):
    group.me = process
    monkeypatch.setattr(runtime, "_C", group)
    monkeypatch.setattr(runtime, "_collective_calls", 0)
    monkeypatch.setattr(runtime, "local_gpu_ordinals", lambda: [process])
    monkeypatch.setattr(runtime.jax, "process_index", lambda: process)
    monkeypatch.setattr(runtime.jax, "process_count", lambda: len(group.frees))
    monkeypatch.setattr(runtime.distributed, "kv_set_bytes", group.kv_set_bytes)
    monkeypatch.setattr(runtime.distributed, "kv_get_bytes", group.kv_get_bytes)
    monkeypatch.setattr(runtime.distributed, "barrier", lambda *a, **k: None)
    try:
        runtime._init_process_group(nbytes)
    except Exception as e:  # noqa: BLE001 - returned to the test
        return e
    return None


def publish_as(group, process, nbytes, agreed):
    """What `process` publishes in call 0, as if it ran ahead: its size, then its verdict on the
    size agreed on (the largest)."""
    group.store[f"jax_ep/process_group/0/bytes/{process}"] = str(nbytes).encode()
    verdict = runtime._room_verdict(process, process, group.plan_process_group(agreed),
                                    group.frees[process], group.total)
    group.store[f"jax_ep/process_group/0/room/{process}"] = json.dumps(verdict).encode()


def test_every_process_refuses_the_growth_before_nvshmem_is_asked(monkeypatch):
    """2 simulated processes, process 1's GPU lacks room; the larger request (process 0's) is the
    agreed size: both raise DeviceMemoryError naming process 1, and neither calls NVSHMEM."""
    group = FakeGroup([80 * GiB, 35 * GiB])
    publish_as(group, 1, 60 * GiB, 60 * GiB + 2 * MiB)  # process 1 ran ahead, asking for less
    errors = [run_as(monkeypatch, group, 0, 60 * GiB + 2 * MiB)]
    errors.append(run_as(monkeypatch, group, 1, 60 * GiB))
    assert group.nvshmem_calls == []
    for error in errors:
        assert isinstance(error, runtime.DeviceMemoryError), error
        assert "process 1 (GPU 1): the heap would grow by 60.50 GiB" in str(error)
        assert "1 of 2 processes lacks room" in str(error) and "process 0 " not in str(error)
    assert str(errors[0]) == str(errors[1])
    verdict = json.loads(group.store["jax_ep/process_group/0/room/0"])
    assert verdict["fits"] and verdict["buffer"] == 60 * GiB + 2 * MiB  # judged at the agreed size


def test_the_growth_goes_on_when_every_process_has_room(monkeypatch):
    group = FakeGroup([80 * GiB, 80 * GiB])
    publish_as(group, 1, 60 * GiB, 60 * GiB)
    assert run_as(monkeypatch, group, 0, 60 * GiB) is None
    assert group.nvshmem_calls == ["init_process_group"]


def test_a_process_that_cannot_measure_stops_every_process(monkeypatch):
    group = FakeGroup([80 * GiB, 80 * GiB])
    group.store["jax_ep/process_group/0/bytes/1"] = b"1024"
    group.store["jax_ep/process_group/0/room/1"] = json.dumps(
        {"process": 1, "error": "RuntimeError: cudaMemGetInfo failed"}).encode()
    error = run_as(monkeypatch, group, 0, 1024)
    assert isinstance(error, RuntimeError) and not isinstance(error, runtime.DeviceMemoryError)
    assert "process 1 could not check its GPU's free memory (RuntimeError: cudaMemGetInfo failed)" \
        in str(error)
    assert group.nvshmem_calls == []


def test_plan_reads_the_heap_shape_as_nvshmem_would(monkeypatch):
    """_C.plan_process_group before any set-up (no CUDA call): the first step starts NVSHMEM; the
    heap's shape comes from NVSHMEM's variables, read as NVSHMEM reads them."""
    if native.process_group()["model"] != "none":
        pytest.skip("this process already set up the runtime")
    for name in ("NVSHMEM_HEAP_KIND", "NVSHMEM_DISABLE_CUDA_VMM", "NVSHMEM_CUMEM_GRANULARITY",
                 "NVSHMEM_SYMMETRIC_SIZE"):
        monkeypatch.delenv(name, raising=False)
    first = native.plan_process_group(100 * MiB + 1)
    assert first["first"] and first["nvshmem_starting"] and first["held"] == 0
    assert first["buffer"] == 102 * MiB  # rounded up to 2 MiB, as the runtime sizes buffers
    assert first["heap_dynamic"] and first["heap_on_device"] and first["heap_granularity"] == 512 * MiB
    assert first["heap_bytes"] == 512 * MiB  # NVSHMEM's first step holds its own and the buffer
    monkeypatch.setenv("NVSHMEM_CUMEM_GRANULARITY", "1m")  # below CUDA's 2 MiB: NVSHMEM takes 2 MiB
    assert native.plan_process_group(3 * GiB)["heap_granularity"] == 2 * MiB
    monkeypatch.setenv("NVSHMEM_CUMEM_GRANULARITY", "4g")  # at most 2 GiB
    assert native.plan_process_group(3 * GiB)["heap_granularity"] == 2 * GiB
    monkeypatch.setenv("NVSHMEM_DISABLE_CUDA_VMM", "no")  # NVSHMEM: n/N/f/F/0 mean false
    assert native.plan_process_group(3 * GiB)["heap_dynamic"]
    monkeypatch.setenv("NVSHMEM_DISABLE_CUDA_VMM", "1")
    monkeypatch.setenv("NVSHMEM_CUMEM_GRANULARITY", "512m")
    static = native.plan_process_group(64 * MiB)
    assert not static["heap_dynamic"]
    assert static["heap_bytes"] == GiB + 512 * MiB  # jax_ep's 1 GiB heap + NVSHMEM's share, rounded
    monkeypatch.setenv("NVSHMEM_SYMMETRIC_SIZE", "3G")  # the user's size wins
    assert native.plan_process_group(64 * MiB)["heap_bytes"] == 3 * GiB + 512 * MiB
    monkeypatch.setenv("NVSHMEM_HEAP_KIND", "sysmem")
    sysmem = native.plan_process_group(64 * MiB)
    assert not sysmem["heap_on_device"] and sysmem["heap_bytes"] == 0


class FakeRelease(FakeGroup):
    """FakeGroup with the runtime's holders count and a shutdown that records itself."""

    def __init__(self, holders):
        super().__init__([80 * GiB] * len(holders), 80 * GiB)
        self.holders, self.freed, self.finalized = holders, [], []

    def runtime_holders(self):
        return self.holders[self.me]

    def shutdown(self):
        self.freed.append(self.me)

    def finalize_process_group(self):
        self.finalized.append(self.me)

    def faults(self):
        return []


def shutdown_as(monkeypatch, group, process, call=runtime.shutdown, fresh=True):
    group.me = process
    monkeypatch.setattr(runtime, "_C", group)
    if fresh:
        monkeypatch.setattr(runtime, "_release_calls", {})
        monkeypatch.setattr(runtime, "_release_broken", {})
    monkeypatch.setattr(runtime.jax, "process_index", lambda: process)
    monkeypatch.setattr(runtime.jax, "process_count", lambda: len(group.holders))
    monkeypatch.setattr(runtime.distributed, "kv_set_bytes", group.kv_set_bytes)
    monkeypatch.setattr(runtime.distributed, "kv_get_bytes", group.kv_get_bytes)

    def barrier(name, timeout_s):   # every process has published its count (the store holds them all)
        missing = [q for q in range(len(group.holders))
                   if name.replace("/agreed", f"/{q}") not in group.store]
        if missing:
            raise TimeoutError(f"barrier {name!r}: processes {missing} did not arrive in {timeout_s} s")
    monkeypatch.setattr(runtime.distributed, "barrier", barrier)
    try:
        call()
    except Exception as e:  # noqa: BLE001 - returned to the test
        return e
    return None


def test_process_model_2_shutdown_refuses_on_every_process_when_one_holds_the_runtime(monkeypatch):
    """Found by a review (2026-12-05): each process decided alone, so one refusing (a live executable)
    left the others in NVSHMEM's collective free, unbounded. Now every process publishes its holders
    first: all refuse together, naming the process; none frees."""
    group = FakeRelease([0, 2])
    group.store["jax_ep/release/shutdown/0/1"] = b"2"   # process 1 ran ahead
    for process in (0, 1):
        error = shutdown_as(monkeypatch, group, process)
        assert isinstance(error, runtime.errors.EPRuntimeError), error
        assert "shutdown refused on every process" in str(error) and "process 1 (2)" in str(error)
        assert "process 0" not in str(error)
    assert group.freed == []


def test_process_model_2_shutdown_frees_when_every_process_agrees_and_names_one_that_never_comes(monkeypatch,
                                                                                                capsys):
    group = FakeRelease([0, 0])
    group.store["jax_ep/release/shutdown/0/1"] = b"0"
    assert shutdown_as(monkeypatch, group, 0) is None and group.freed == [0]
    group.store["jax_ep/release/shutdown/1/1"] = b"0"   # a second shutdown(): the next agreement
    assert shutdown_as(monkeypatch, group, 0, fresh=False) is None and group.freed == [0, 0]
    assert "jax_ep/release/shutdown/1/0" in group.store   # its own key: the count advanced
    late = FakeRelease([0, 0])   # process 1 never calls shutdown(): a bounded barrier, naming it
    error = shutdown_as(monkeypatch, late, 0)
    assert isinstance(error, TimeoutError) and "processes [1] did not arrive" in str(error), error
    assert late.freed == []
    # the processes' shutdown() counts may now differ for good: a later call says so, not a wrong pairing
    error = shutdown_as(monkeypatch, late, 0, fresh=False)
    assert isinstance(error, runtime.errors.EPRuntimeError) and "out of step; restart" in str(error), error
    # process 1's teardown at exit is an agreement of its own: it does not pair with process 0's
    # shutdown() (the review's case: process 1 finalised NVSHMEM while process 0 freed, both collective)
    shutdown_as(monkeypatch, late, 1, call=runtime._finalize_process_group)
    assert late.freed == [] and late.finalized == []
    assert "teardown skipped" in capsys.readouterr().out


def test_a_failed_first_bootstrap_is_retried_under_new_keys(monkeypatch):
    """Process model 2: NVSHMEM's first init failing (or its barrier running out while a peer compiles)
    leaves process 0's unique id in JAX's store, which refuses to write a key twice; the next set-up
    publishes under that call's own keys and reaches NVSHMEM again (before 2026-12-05 it died with
    JAX's raw ALREADY_EXISTS on the fixed key 'jax_ep/nvshmem_unique_id')."""
    class FirstInitFails(FakeGroup):
        def process_group(self):
            return {"model": "none"}

        def init_process_group(self, *args):
            super().init_process_group(*args)
            if self.nvshmem_calls.count("init_process_group") == 1:
                raise RuntimeError("nvshmem init failed")

        def kv_set_bytes(self, key, value):
            if key in self.store:
                raise RuntimeError(f"ALREADY_EXISTS: key {key} already exists")
            super().kv_set_bytes(key, value)

    group = FirstInitFails([80 * GiB])
    error = run_as(monkeypatch, group, 0, MiB)
    assert isinstance(error, RuntimeError) and "nvshmem init failed" in str(error)
    monkeypatch.setattr(runtime, "atexit", types.SimpleNamespace(register=lambda f: None))
    runtime._init_process_group(MiB)    # the next traced EP op's set-up: call 1
    assert group.nvshmem_calls == ["nvshmem_unique_id", "init_process_group"] * 2
