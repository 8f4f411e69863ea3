"""The native part on a machine without GPU: the extension (when built) imports without touching
CUDA, exports a handler capsule per FFI target, and the runtime reports why it is unavailable."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import STUB_LIMITS

import jax_ep
from jax_ep import cuda_backend, runtime


def _has_cuda_device() -> bool:
    native = runtime.extension()
    if native is None:
        return False
    try:
        return native.device_count() > 0
    except RuntimeError:
        return False


def test_extension_imports_or_says_why():
    native = runtime.extension()
    if native is None:
        assert runtime.extension_error(), "jax_ep._C missing without an import error"
        usable, reason = runtime.available()
        assert not usable and "not built" in reason
    else:
        assert runtime.extension_error() is None
        assert native.__name__ == "jax_ep._C"


# the ops jax_ep.cuda_backend may issue on KernelConfig.async_stream
ASYNC_OPS = ("dispatch", "combine", "broadcast", "combine_bwd", "slot_values", "ll_dispatch_send",
             "ll_combine_send", "dispatch_rank_major", "combine_rank_major", "broadcast_rank_major")


def test_handler_capsules_for_every_target():
    native = runtime.extension()
    if native is None:
        pytest.skip(f"jax_ep._C not built: {runtime.extension_error()}")
    handlers = native.ffi_handlers()
    stateful = {"jax_ep_peer_smoke", "jax_ep_dispatch", "jax_ep_combine", "jax_ep_broadcast",
                "jax_ep_combine_bwd", "jax_ep_slot_values", "jax_ep_remote_smoke", "jax_ep_ll_dispatch",
                "jax_ep_ll_combine",
                "jax_ep_ll_dispatch_send", "jax_ep_ll_dispatch_recv", "jax_ep_ll_combine_send",
                "jax_ep_ll_combine_recv", "jax_ep_dispatch_rank_major", "jax_ep_combine_rank_major",
                "jax_ep_broadcast_rank_major"}
    # the ops a call may put on an XLA stream of its own, also as the twin XLA keeps out of command
    # buffers (xla_ffi/handlers.h, JAX_EP_ASYNC_TARGETS) and on jax_ep's side stream (jax_ep.overlap)
    twins = {f"jax_ep_{op}_{variant}" for op in ASYNC_OPS for variant in ("uncaptured", "side")}
    assert set(handlers) == stateful | twins | {"jax_ep_dispatch_layout", "jax_ep_side_join"}
    stateful |= twins
    for name, entry in handlers.items():
        capsules = entry.values() if name in stateful else [entry]
        if name in stateful:  # the communicating ops keep state per call site (instantiate stage)
            assert set(entry) == {"instantiate", "execute"}, (name, entry)
        for capsule in capsules:
            assert type(capsule).__name__ == "PyCapsule", (name, type(capsule))
    state_type = native.state_type()
    assert set(state_type) == {"type_id", "type_info"}
    major, minor = native.FFI_API_VERSION
    assert (major, minor) >= (0, 3)
    stats = native.handler_stats()
    # one list (xla_ffi/handlers.h, JAX_EP_TARGETS); a twin counts under its op
    assert set(stats) == set(handlers) - twins
    assert all(set(s) == {"calls", "captured_calls"} for s in stats.values())


def test_every_op_the_cuda_backend_calls_has_its_target(monkeypatch):
    """runtime.target(op) names an FFI target of the extension for every op the CUDA backend calls
    (the EP ops, layout, the smoke ops, the low-latency send/recv halves), and refuses one the
    extension lacks, as a stale build would, naming it."""
    from jax_ep import errors, ops

    native = runtime.extension()
    if native is None:
        pytest.skip(f"jax_ep._C not built: {runtime.extension_error()}")
    monkeypatch.setattr(runtime, "register_targets", lambda: None)
    called = {op.function for op in ops.OPS.values()} - {"layout"}
    called |= {"dispatch_layout", "peer_smoke", "remote_smoke", "ll_dispatch_send", "ll_dispatch_recv",
               "ll_combine_send", "ll_combine_recv", "side_join"}
    assert ({runtime.target(op) for op in called}
            | {runtime.target(op, variant) for op in ASYNC_OPS for variant in ("uncaptured", "side")}
            == set(native.ffi_handlers()))
    assert runtime.target("combine", "uncaptured") == "jax_ep_combine_uncaptured"
    assert runtime.target("combine", "side") == "jax_ep_combine_side"
    with pytest.raises(errors.EPRuntimeError, match="no FFI target 'jax_ep_dispatchh'.*stale build"):
        runtime.target("dispatchh")
    with pytest.raises(errors.EPRuntimeError, match="no FFI target 'jax_ep_ll_dispatch_recv_uncaptured'"):
        runtime.target("ll_dispatch_recv", "uncaptured")   # never on a stream of its own
    with pytest.raises(errors.EPRuntimeError, match="no FFI target 'jax_ep_dispatch_layout_side'"):
        runtime.target("dispatch_layout", "side")


def test_nvshmem_device_library_is_linked_in():
    """The extension carries NVSHMEM's device library (linked with our relocatable kernels, one
    device link): nvshmemi_init_thread, which initialises our module's device state, is defined
    inside it (not imported), and it calls the host library's nvshmemid_hostlib_init_attr; the
    host-only init of the host library is no longer used."""
    import shutil
    import subprocess

    native = runtime.extension()
    if native is None:
        pytest.skip(f"jax_ep._C not built: {runtime.extension_error()}")
    if shutil.which("nm") is None:
        pytest.skip("no nm (binutils)")
    lines = subprocess.run(["nm", "-D", native.__file__], capture_output=True, text=True,
                           check=True).stdout.splitlines()
    imported = {line.split()[-1].split("@")[0] for line in lines if line.split()[-2:-1] == ["U"]}
    exported = {line.split()[-1] for line in lines if line.split()[-2:-1] != ["U"]}
    assert "nvshmemid_hostlib_init_attr" in imported, sorted(n for n in imported if "nvshmem" in n)
    assert "nvshmemid_hostlib_finalize" in imported
    assert not {"_Z20nvshmemi_init_threadiPijP21nvshmemx_init_attr_v118nvshmemi_version_t",
                "nvshmemi_finalize", "nvshmemx_hostlib_init_attr"} & imported
    # Nothing of the device link is exported (another library built from the same NVSHMEM, e.g.
    # DeepEP, must not interpose its registration functions).
    assert not [n for n in exported if "cudaRegister" in n or "nvshmem" in n], exported
    assert native.remote_smoke_comm_bytes(2, 1000) == 3 * 2 * 1000 * 4


def test_runtime_queries_before_init():
    native = runtime.extension()
    if native is None:
        pytest.skip(f"jax_ep._C not built: {runtime.extension_error()}")
    assert native.managed_devices() == []
    assert native.buffer_bytes() == 0
    assert native.faults() == []
    assert runtime.faults() == []
    runtime.check_errors()  # nothing recorded: no exception


def test_unavailable_without_gpu_with_reason():
    if _has_cuda_device():
        pytest.skip("a CUDA device is present")
    usable, reason = runtime.available()
    assert usable is False
    assert isinstance(reason, str) and reason
    with pytest.raises(RuntimeError, match="unavailable"):
        runtime.ensure_initialized(1 << 20)
    with pytest.raises(RuntimeError, match="unavailable"):
        cuda_backend.layout_of(jnp.zeros((4, 2), jnp.int32), 8, 2)
    with pytest.raises(RuntimeError, match="unavailable"):
        runtime.limits()


def test_unavailable_reason_without_extension(monkeypatch):
    monkeypatch.setattr(runtime, "_C", None)
    monkeypatch.setattr(runtime, "_IMPORT_ERROR", "No module named 'jax_ep._C'")
    runtime.available.cache_clear()
    try:
        usable, reason = runtime.available()
        assert not usable and "jax_ep._C is not built" in reason
        assert runtime.faults() == []
    finally:
        runtime.available.cache_clear()


def test_limits_come_from_the_extension():
    """The Python side never restates a kernel limit: it reads them from jax_ep._C.LIMITS, and these
    are the values the kernels were built with (the headers' constants)."""
    native = runtime.extension()
    if native is None:
        pytest.skip(f"jax_ep._C not built: {runtime.extension_error()}")
    assert native.LIMITS == {"max_topk": 32, "layout_max_topk": 64, "max_experts": 8192,
                             "max_ranks": 32, "max_groups": 64, "directory_axes": 4, "data_warps": 16,
                             "row_alignment": 8, "fp8_block": 128,
                             "fp8_min_amax": float(np.float32(1e-4)), "ll_max_tokens": 65535,
                             "ll_max_shared_bytes": 200 * 1024, "max_rows": 2 ** 31 - 1,
                             "max_hidden": 2 ** 28 - 1}
    # the FP8 row format is one fact: the kernels' scale block and amax floor are the reference's
    from jax_ep.config import FP8_BLOCK
    from jax_ep.fp8 import FP8_MIN_AMAX
    assert native.LIMITS["fp8_block"] == FP8_BLOCK
    assert native.LIMITS["fp8_min_amax"] == float(np.float32(FP8_MIN_AMAX))
    # the tests that lower backend='cuda' without a build stub these (helpers.lower_cuda_here)
    assert STUB_LIMITS.items() <= native.LIMITS.items()
    # hierarchical FP8 packs its stage-2 rows (float32 words) to the kernels' row vectors on every
    # backend, the reference included (no extension there): the same width
    from jax_ep import hierarchical
    assert hierarchical._PACK_ALIGN_BYTES == 4 * native.LIMITS["row_alignment"]


def test_kernel_support_is_decided_from_the_limits(monkeypatch):
    """What the cuda backend can run (its use-the-kernel check) follows the extension's limits."""
    from jax_ep import EPConfig, KernelConfig

    monkeypatch.setattr(runtime, "limits", lambda: dict(STUB_LIMITS))
    cfg = EPConfig(num_experts=64, num_topk=8, hidden=256, max_tokens_per_rank=16)
    for op in ("layout", "dispatch", "combine", "broadcast", "slot_values"):
        assert cuda_backend.unsupported(op, cfg, 4, "bfloat16") is None, op
    assert "num_topk=40 exceeds 32" in cuda_backend.unsupported(
        "dispatch", cfg.replace(num_topk=40), 4)
    assert cuda_backend.unsupported("layout", cfg.replace(num_topk=40), 4) is None
    assert "num_topk=65 exceeds 64" in cuda_backend.unsupported(
        "layout", cfg.replace(num_experts=128, num_topk=65), 4)
    assert "hidden=260 must be a multiple of 8" in cuda_backend.unsupported(
        "combine", cfg.replace(hidden=260), 4)
    assert "EP size 64 exceeds 32" in cuda_backend.unsupported("slot_values", cfg, 64)
    assert "dispatch_send_warps=16" in cuda_backend.unsupported(
        "dispatch", cfg.replace(kernel=KernelConfig(dispatch_send_warps=16)), 4)
    assert "float16" in cuda_backend.unsupported("broadcast", cfg, 4, "float16")
    # int32 row indices (found by a review, 2026-12-05: the dispatch receivers' tail count wrapped at
    # C = 2^31 - 8191, leaving every row unwritten, and only an instantiate-time check refused more)
    huge = EPConfig(num_experts=2, num_topk=1, hidden=8, max_tokens_per_rank=1024, capacity=2147475457)
    assert cuda_backend.unsupported("dispatch", huge, 2) is None
    assert "the capacity = 2147483648 rows exceeds the kernels' 2147483647 (int32 row indices)" in \
        cuda_backend.unsupported("dispatch", huge.replace(capacity=2 ** 31), 2)
    wide = cfg.replace(num_experts=8, max_tokens_per_rank=2 ** 30, capacity=8)
    assert "EP size x max_tokens_per_rank = 2147483648 rows exceeds" in cuda_backend.unsupported(
        "dispatch_rank_major", wide, 2)
    assert "EP size x max_tokens_per_rank" in cuda_backend.unsupported("combine", wide, 2)
    assert cuda_backend.unsupported("combine", wide, 1) is None
    assert "hidden=268435456 exceeds 268435455" in cuda_backend.unsupported(
        "combine", cfg.replace(hidden=2 ** 28), 4)
    # the low-latency kernels' top-k and EP-size limits are the same limits (a warp lane per slot)
    assert "num_topk=40 exceeds 32" in cuda_backend.unsupported("ll_dispatch", cfg.replace(num_topk=40), 4)
    assert "EP size 64 exceeds 32" in cuda_backend.unsupported("ll_combine", cfg, 64)
    monkeypatch.setattr(runtime, "limits", lambda: {**STUB_LIMITS, "max_topk": 4})
    for op in ("ll_dispatch", "ll_combine", "dispatch"):
        assert "num_topk=8 exceeds 4" in cuda_backend.unsupported(op, cfg, 4), op


def test_low_latency_support_follows_the_instantiation_limits(monkeypatch):
    """The low-latency kernels' token count, routing-table shared memory and expert count are refused at
    trace time (backend='auto' then takes the reference), not by XLA's instantiation of the call."""
    from jax_ep import EPConfig

    native = runtime.extension()
    if native is None:
        pytest.skip(f"jax_ep._C not built: {runtime.extension_error()}")
    monkeypatch.setattr(runtime, "limits", lambda: dict(native.LIMITS))   # (no GPU here)
    cfg = EPConfig(num_experts=256, num_topk=8, hidden=7168, max_tokens_per_rank=128)
    for op in ("ll_dispatch", "ll_combine"):
        assert cuda_backend.unsupported(op, cfg, 16, "bfloat16") is None, op
    # 256 experts x ceil(8192 / 32) words: 262,656 bytes of shared memory (dispatch's table only)
    big = cfg.replace(max_tokens_per_rank=8192)
    assert native.ll_shared_bytes(True, 16, 8192, 256) == 262656
    assert "routing table of 262656 bytes" in cuda_backend.unsupported("ll_dispatch", big, 16, "bfloat16")
    assert cuda_backend.unsupported("ll_combine", big, 16, "bfloat16") is None
    assert "max_tokens_per_rank=70000 exceeds the low-latency kernels' 65535" in cuda_backend.unsupported(
        "ll_combine", EPConfig(num_experts=8, num_topk=2, hidden=128, max_tokens_per_rank=70000), 2)
    assert "num_experts=16384 exceeds 8192" in cuda_backend.unsupported(
        "ll_combine", cfg.replace(num_experts=16384), 8)


def test_ll_comm_bytes_is_what_a_low_latency_call_site_reserves(monkeypatch):
    """cuda_backend.ll_comm_bytes (docs/api.md: what to reserve up front for decode) is what a
    low-latency call site reserves, ~10x the throughput ops' comm_bytes at a decode shape (which
    comm_bytes gave for them before 2026-12-05)."""
    from jax_ep import EPConfig

    native = runtime.extension()
    if native is None:
        pytest.skip(f"jax_ep._C not built: {runtime.extension_error()}")
    monkeypatch.setattr(runtime, "register_targets", lambda: None)
    for wire in ("bfloat16", "float8_e4m3fn"):
        cfg = EPConfig(num_experts=288, num_topk=8, hidden=7168, max_tokens_per_rank=128, dispatch_dtype=wire)
        need = cuda_backend.ll_comm_bytes(cfg, 2)
        attrs = cuda_backend._ll_dispatch_attrs(cfg, 2, 0, 128, cfg.wire_dtype(jnp.bfloat16))
        sizes = [int(attrs[k]) for k in ("num_ranks", "num_tokens", "num_topk", "num_experts")]
        ll = native.ll_comm_bytes(*sizes, 7168, int(attrs["row_bytes"]), int(attrs["scale_bytes"]))
        assert need == max(ll, native.ll_comm_bytes(*sizes, 7168, 7168 * 2, 0)), wire
        assert need > 5 * cuda_backend.comm_bytes(cfg, 2), wire


def test_comm_bytes_need_only_the_extension(monkeypatch):
    """comm_bytes / ll_comm_bytes are the extension's layout arithmetic: they work without a GPU and set
    nothing up. Before 2026-12-06 they set up the runtime (register_targets), a collective in process
    model 2: one process asking the size waited 120 s for the others, then every later set-up was out of
    step (found by a review)."""
    from jax_ep import EPConfig

    if runtime.extension() is None:
        pytest.skip(f"jax_ep._C not built: {runtime.extension_error()}")

    def refuse():
        raise AssertionError("register_targets called")
    monkeypatch.setattr(runtime, "register_targets", refuse)
    cfg = EPConfig(num_experts=64, num_topk=4, hidden=2048, max_tokens_per_rank=256)
    sizes = (4, 256, 4, 64)
    assert cuda_backend.comm_bytes(cfg, 4) == runtime.extension().comm_bytes(*sizes, 2048 * 2, 0) > 0
    assert cuda_backend.ll_comm_bytes(cfg, 4) == runtime.extension().ll_comm_bytes(*sizes, 2048, 2048 * 2, 0)


def test_ensure_initialized_names_a_bad_buffer_size(monkeypatch):
    """buffer_bytes is checked first (a negative size became 0 and a string gave int()'s bare error;
    found by a review, 2026-12-06)."""
    monkeypatch.setattr(runtime, "register_targets", lambda: pytest.fail("reached the set-up"))
    for bad, error in ((-1 << 30, jax_ep.EPValueError), ("1GiB", jax_ep.EPTypeError),
                       (None, jax_ep.EPTypeError), (True, jax_ep.EPTypeError), (2.5e9, jax_ep.EPTypeError)):
        with pytest.raises(error, match=rf"jax_ep.runtime.ensure_initialized: buffer_bytes must be an int "
                                        rf">= 0, got {re.escape(repr(bad))}"):
            runtime.ensure_initialized(bad)


@pytest.mark.parametrize("op", ["clear_rank_masks", "rank_masks"])
def test_rank_mask_queries_name_a_bad_group(op):
    """group is an int in [0, max_groups) (the runtime took a negative one as every group and one past
    the last as none, without a word, and rank_masks found no mask for either; found by a review,
    2026-12-06)."""
    call = getattr(runtime, op)
    with pytest.raises(jax_ep.EPValueError, match=rf"{op}: group must be an int >= 0, got -1"):
        call(group=-1)
    with pytest.raises(jax_ep.EPTypeError, match=rf"{op}: group must be an int >= 0, got '0'"):
        call(group="0")
    if runtime.extension() is None:
        pytest.skip(f"jax_ep._C not built: {runtime.extension_error()}")
    most = runtime.extension().LIMITS["max_groups"]
    with pytest.raises(jax_ep.EPValueError, match=rf"{op}: group must be below the runtime's max_groups "
                                                  rf"{most}, got {most}"):
        call(group=most)
    call(group=np.int64(most - 1))   # no GPU managed here: nothing to clear or find


def test_group_slots_put_the_ep_axis_last():
    """The static group table of the peer ops: one row per EP group, columns = ranks."""
    from types import SimpleNamespace

    import numpy as np

    def device(i, process=0):
        return SimpleNamespace(id=i, process_index=process, local_hardware_id=10 + i)

    grid = np.array([[device(0), device(1), device(2)],
                     [device(3), device(4), device(5)]], dtype=object)  # mesh ("dp", "ep")
    assert cuda_backend.group_slots(grid, 1, 0).tolist() == [10, 11, 12, 13, 14, 15]
    assert cuda_backend.group_slots(grid, 0, 0).tolist() == [10, 13, 11, 14, 12, 15]
    # groups of other processes are left out; a group split across processes is refused
    two_hosts = np.array([[device(0), device(1)], [device(2, 1), device(3, 1)]], dtype=object)
    assert cuda_backend.group_slots(two_hosts, 1, 1).tolist() == [12, 13]
    with pytest.raises(NotImplementedError, match="spans processes"):
        cuda_backend.group_slots(two_hosts, 0, 0)
    # process model 2: every group, each rank by its process (the NVSHMEM PE)
    per_gpu = np.array([[device(0, 0), device(1, 1)], [device(2, 2), device(3, 3)]], dtype=object)
    assert cuda_backend.group_slots(per_gpu, 0, 1, "process_per_gpu").tolist() == [0, 2, 1, 3]


def test_peer_ops_refuse_non_gpu_meshes():
    import numpy as np
    from jax.sharding import Mesh

    mesh = Mesh(np.array(jax.devices()[:1]), ("ep",))
    with pytest.raises(ValueError, match="GPU"):
        cuda_backend._local_group_slots(mesh, "ep")
    with pytest.raises(ValueError, match="not an axis"):
        cuda_backend._local_group_slots(mesh, "tp")
