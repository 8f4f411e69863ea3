"""The error raised when jax_ep's GPU buffers do not fit beside XLA's preallocation
(jax_ep.runtime.DeviceMemoryError), on the CPU: its text for given numbers comes from the one function
that writes it (jax_ep._C.device_memory_message, xla_ffi/device_memory.cc), and the trace-time check
is wired into runtime.reserve. tests/gpu/test_device_memory_gpu.py provokes it on a GPU."""

from __future__ import annotations

import re

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
