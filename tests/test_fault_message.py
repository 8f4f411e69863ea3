"""The texts of the kernels' fault records (what jax_ep.runtime.faults() and check_errors() show), on the
CPU: jax_ep._C.fault_message builds the text of a record with given fields through the one function
that writes them (xla_ffi/fault_message.cc). The config fingerprint's records (cuda/fingerprint.h):
a mismatch names the op, this rank, the peer, the field and both values (op, dtype and transport by
name); an out-of-step peer names
the call counts. tools/kernel_emulator (tests/test_kernel_emulator.py) provokes them in the kernels,
tests/gpu/test_fingerprint_gpu.py on GPUs."""

from __future__ import annotations

import io
import sys
import threading
import time

import pytest

from jax_ep import runtime

native = runtime.extension()
pytestmark = pytest.mark.skipif(native is None, reason=f"jax_ep._C not built: {runtime.extension_error()}")

FIELDS = ("op", "num_ranks", "num_tokens", "hidden", "num_topk", "num_experts", "capacity",
          "expert_alignment", "dtype")


def message(kind, op, rank=0, peer=1, peer_slot=1, expected=0, observed=0, **kw):
    return native.fault_message(kind, op, rank, rank, peer, peer_slot, expected, observed, **kw)


@pytest.mark.parametrize("field", FIELDS[1:-1])
def test_mismatch_names_op_ranks_field_and_both_values(field):
    text = message("mismatch", "dispatch", rank=1, peer=0, peer_slot=0, expected=512, observed=256,
                   field=field)
    assert text.startswith("jax_ep: dispatch on GPU 1 (rank 1): rank 0 (GPU 0) runs a different EP "
                           "call at this point: ")
    assert f"{field} is 512 on rank 1 and 256 on rank 0." in text
    assert "same configuration, in the same order; nothing was exchanged" in text


def test_mismatch_of_op_and_dtype_names_them():
    text = message("mismatch", "dispatch", expected=2, observed=7, field="op")
    assert "op is dispatch on rank 0 and ll_dispatch on rank 1" in text
    text = message("mismatch", "ll_dispatch", expected=0, observed=2, field="dtype")
    assert "dtype is bfloat16 on rank 0 and float8_e4m3fn on rank 1" in text
    text = message("mismatch", "combine", expected=1, observed=0, field="dtype")
    assert "dtype is float32 on rank 0 and bfloat16 on rank 1" in text


def test_mismatch_of_transport_names_both_and_the_knob():
    # a rank-major call over NVSHMEM puts here and over loads / stores on the peer (process model 2)
    text = message("mismatch", "dispatch_rank_major", expected=1, observed=0, field="transport",
                   per_process=True)
    assert text.startswith("jax_ep: dispatch_rank_major on GPU 0 (rank 0): rank 1 (process 1) runs a "
                           "different EP call at this point: transport is put on rank 0 and load_store "
                           "on rank 1.")
    assert "KernelConfig.transport" in text
    text = message("mismatch", "combine_rank_major", rank=1, peer=0, peer_slot=0, expected=0,
                   observed=1, field="transport")
    assert "transport is load_store on rank 1 and put on rank 0." in text
    # a dispatch pulling its rows here and pushing them on the peer (KernelConfig.dispatch_pull)
    text = message("mismatch", "dispatch", expected=2, observed=0, field="transport", per_process=True)
    assert "transport is pull on rank 0 and load_store on rank 1. Every rank must" in text
    assert "give every process the same explicit KernelConfig.dispatch_pull and broadcast_pull" in text
    assert "KernelConfig.transport" not in text


def test_process_model_2_names_the_peer_process():
    text = message("mismatch", "combine", rank=1, peer=0, peer_slot=0, expected=8, observed=4,
                   field="num_topk", per_process=True)
    assert "rank 0 (process 0) runs a different EP call" in text


def test_sequence_mismatch_says_the_calls_are_out_of_step():
    text = message("mismatch", "combine", expected=3, observed=7, field="call_sequence")
    assert text.startswith("jax_ep: combine on GPU 0 (rank 0): the ranks' EP calls are out of step")
    assert "this is EP call 3 of the group on rank 0, and rank 1 (GPU 1) has entered call 7" in text
    assert "call_sequence 3 here, 7 on rank 1" in text


def test_discovery_timeout_says_how_far_behind_the_peer_is():
    text = message("timeout", "dispatch", peer_slot=-1, expected=5, observed=4, elapsed_s=2.0,
                   field="call_sequence")
    assert text.startswith("jax_ep: dispatch on GPU 0 (rank 0) timed out after 2.0")
    assert "waiting for rank 1 (GPU not known yet: group discovery) to enter this call" in text
    assert "rank 1 has entered 4 (it is 1 call behind: it has not issued this call" in text
    assert text.endswith("Every rank must issue the same EP calls in the same order; a rank that is alive "
                         "but busy on its host longer than the bound (compiling, writing a checkpoint) looks "
                         "the same: raise JAX_EP_TIMEOUT_S.")
    # other waits keep the epoch wording
    text = message("timeout", "combine", expected=5, observed=3, elapsed_s=1.0)
    assert "waiting for rank 1 (GPU 1): it expected barrier epoch 5 and saw 3." in text


def test_timeouts_that_are_no_peers_lateness_say_what_they_are():
    """Found by a review (2026-12-05): a dispatch whose own prep blocks never ran named itself as the rank
    waited for, with block counts as "barrier epochs", and advised issuing the same EP calls; a peer whose
    configuration words lagged its entry read as "1 call behind"; a data flag holding another call
    site's rows printed them as an epoch."""
    text = message("timeout", "dispatch", rank=1, peer=1, peer_slot=1, expected=131, observed=64,
                   elapsed_s=40.0, field="prep_blocks")
    assert text.startswith("jax_ep: dispatch on GPU 1 (rank 1): timed out after 40.0")
    assert "waiting for its own prep blocks: 64 of 131 ran. No peer is late" in text
    assert "epoch" not in text and "same EP calls" not in text
    text = message("timeout", "combine", rank=0, peer=3, peer_slot=3, expected=7, observed=6,
                   elapsed_s=10.0, field="fingerprint_words")
    assert "reading the configuration of rank 3 (GPU 3) for EP call 7: its entry for this call " in text
    assert "still held those of call 6" in text and "behind" not in text
    text = message("timeout", "dispatch", rank=0, peer=2, peer_slot=2, expected=9, observed=0,
                   elapsed_s=10.0, field="foreign_flag")
    assert "waiting for rank 2 (GPU 2): it expected the flag of its call 9 and found none of this EP " in text
    assert "saw" not in text


def test_other_kinds_keep_their_texts():
    assert "call 3 would overwrite the receive buffer of call 1" in message(
        "ll_in_flight", "ll_dispatch", peer=-1, peer_slot=1, expected=3, observed=1)
    assert message("stale_runtime", "combine", expected=10, observed=4) == (
        "jax_ep: combine on GPU 0 (rank 0) ran after shutdown() or with a too small communication "
        "buffer: needs 10 bytes, 4 available.")


def test_unknown_names_are_refused():
    with pytest.raises(ValueError, match="unknown field 'width'"):
        message("mismatch", "dispatch", field="width")
    with pytest.raises(ValueError, match="unknown op 'gather'"):
        message("mismatch", "gather", field="hidden")


def test_faults_lists_no_fault_on_a_machine_without_one():
    assert runtime.faults() == []


# ---- the records reach the user: jax_ep.runtime.report_faults / watch_faults --------------------------
class _FakeExtension:
    """Stands in for jax_ep._C (no GPU here): ``records`` as _C.faults() gives them, and what
    register_targets asks of it."""

    def __init__(self):
        self.records = []

    def faults(self):
        return list(self.records)

    def state_type(self):
        return None

    def ffi_handlers(self):
        return {}

    def managed_devices(self):
        return [0]   # set up already: register_targets asks nothing more


def _record(ordinal, op="dispatch"):
    text = message("timeout", op, rank=ordinal, peer=3, peer_slot=3, expected=2, observed=1)
    return {"device_ordinal": ordinal, "op": op, "kind": "timeout", "message": text}


@pytest.fixture
def fake_records(monkeypatch):
    """A fake extension, and a fresh fault watcher that the test's end stops."""
    fake = _FakeExtension()
    monkeypatch.setattr(runtime, "_C", fake)
    monkeypatch.setattr(runtime, "_reported", set())
    monkeypatch.setattr(runtime, "_watcher", None)
    monkeypatch.setattr(runtime, "_stop_watching", threading.Event())
    monkeypatch.setattr(runtime.atexit, "register", lambda fn: None)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)   # restored after the test
    yield fake
    runtime._stop_watching.set()
    if runtime._watcher is not None:
        runtime._watcher.join(10)


def test_report_faults_prints_each_record_once_in_the_launchers_fault_form(fake_records):
    """A trap surfaces as XLA's generic CUDA error; the record naming op and ranks was printed by nothing
    (2026-11-28, process model 2 on 4 GPUs: "a device fault and nothing useful")."""
    from jax_ep import failure_report

    out = io.StringIO()
    assert runtime.report_faults(out) == [] and out.getvalue() == ""
    fake_records.records = [_record(1)]
    (printed,) = runtime.report_faults(out)
    assert runtime.report_faults(out) == []   # once
    fake_records.records = [_record(1), _record(2, "combine")]
    assert runtime.report_faults(out) == [_record(2, "combine")["message"]]
    lines = out.getvalue().splitlines()
    second = _record(2, "combine")["message"]
    assert lines == [f"jax_ep device fault: {printed}", f"jax_ep device fault: {second}"]
    assert lines[0].startswith("jax_ep device fault: jax_ep: dispatch on GPU 1 (rank 1) timed out")
    assert "raise JAX_EP_TIMEOUT_S" in lines[0]
    # what python -m jax_ep.launch summarises for a failed process: its fault records and their op
    output = ["Traceback (most recent call last):", *lines,
              "jaxlib._jax.XlaRuntimeError: INTERNAL: CUDA_ERROR_LAUNCH_FAILED"]
    summary = failure_report.report("\n".join(output), process=1)
    assert "jax_ep: dispatch on GPU 1 (rank 1)" in summary and "none printed" not in summary, summary


def test_watch_faults_prints_new_records_while_running_and_at_an_uncaught_exception(fake_records, monkeypatch,
                                                                                     capsys):
    registered = []
    monkeypatch.setattr(runtime, "FAULT_POLL_S", 0.01)
    monkeypatch.setattr(runtime.atexit, "register", registered.append)
    previous = []
    monkeypatch.setattr(sys, "excepthook", lambda *exc: previous.append(exc))
    runtime.watch_faults()
    watcher = runtime._watcher
    runtime.watch_faults()   # idempotent: one thread, one hook
    assert runtime._watcher is watcher and registered == [runtime._stop_watching_and_report]
    fake_records.records = [_record(0)]
    deadline = time.monotonic() + 30
    while "dispatch on GPU 0" not in capsys.readouterr().err:
        assert time.monotonic() < deadline, "the watcher printed nothing in 30 s"
        time.sleep(0.01)
    runtime._stop_watching.set()   # the thread ends: what follows is the hook's and the exit's
    watcher.join(10)
    assert not watcher.is_alive()
    fake_records.records = [_record(0), _record(1, "combine_bwd")]
    error = RuntimeError("CUDA_ERROR_LAUNCH_FAILED")
    sys.excepthook(RuntimeError, error, None)
    err = capsys.readouterr().err
    assert "jax_ep device fault: jax_ep: combine_bwd on GPU 1" in err and "GPU 0" not in err, err
    assert previous == [(RuntimeError, error, None)]   # the user's hook still runs, after
    fake_records.records.append(_record(2, "combine"))
    runtime._stop_watching_and_report()   # at exit
    assert capsys.readouterr().err == f"jax_ep device fault: {_record(2, 'combine')['message']}\n"


def test_the_exit_stops_a_running_watcher_before_its_last_report(fake_records, monkeypatch, capsys):
    """No watcher thread may be inside the extension while the interpreter finalises."""
    monkeypatch.setattr(runtime, "FAULT_POLL_S", 0.01)
    runtime.watch_faults()
    watcher = runtime._watcher
    assert watcher.is_alive()
    fake_records.records = [_record(3)]
    runtime._stop_watching_and_report()
    assert not watcher.is_alive()
    assert capsys.readouterr().err.count("dispatch on GPU 3") == 1


def test_register_targets_starts_the_watcher_without_deadlocking(fake_records, monkeypatch):
    """Found by a review (2026-12-05): register_targets called watch_faults under runtime._lock, which
    watch_faults took again: the first EP trace on a GPU hung."""
    monkeypatch.setattr(runtime, "_registered", False)
    monkeypatch.setattr(runtime, "_lock", threading.Lock())   # a deadlock here must not hang later tests
    monkeypatch.setattr(runtime, "_require_available", lambda: None)
    monkeypatch.setattr(runtime.jax.ffi, "register_ffi_type", lambda *a, **k: None)
    monkeypatch.setattr(runtime.jax.ffi, "register_ffi_target", lambda *a, **k: None)
    done = threading.Thread(target=runtime.register_targets, daemon=True)
    done.start()
    done.join(30)
    assert not done.is_alive(), "register_targets deadlocked"
    assert runtime._registered and runtime._watcher is not None and runtime._watcher.is_alive()
