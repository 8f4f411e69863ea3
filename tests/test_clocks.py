"""benchmarks.clocks: the SM clock and power sampled while best_of times, and what a record gets."""

import ctypes
import time

import pytest
from helpers import FakeGPUs

from benchmarks import clocks
from benchmarks.layer import best_of


def sleeper(seconds):
    def fn():
        time.sleep(seconds)
        return 0
    return fn


def test_best_of_window_gets_only_the_samples_taken_while_it_timed():
    gpus = FakeGPUs(1000.0)
    with clocks.sampling(read=gpus, period_s=0.001) as sampler:
        assert sampler is not None
        time.sleep(0.05)            # idle samples at 1000 MHz before the timing
        gpus.mhz = 1500.0
        with clocks.collect() as c:
            best_of(sleeper(0.01), iters=2, repeats=3)   # 60 ms timed, after an untimed first call
        gpus.mhz = 1980.0
        time.sleep(0.05)            # and after it
        summary = c.summary()
    assert summary["sm_mhz"] == [1500.0, 1510.0] and summary["power_w"] == [500.0, 600.0]
    assert 10 <= summary["samples"] < gpus.calls
    # sampling stopped with the block
    calls = gpus.calls
    time.sleep(0.02)
    assert gpus.calls == calls


def test_collectors_nest_and_each_gets_the_windows_marked_inside_it():
    gpus = FakeGPUs(1200.0)
    with clocks.sampling(read=gpus, period_s=0.001):
        with clocks.collect() as outer:
            best_of(sleeper(0.005), iters=2, repeats=2)
            with clocks.collect() as inner:
                best_of(sleeper(0.005), iters=2, repeats=2)
    assert len(outer.windows) == 2 and len(inner.windows) == 1
    assert inner.windows[0] == outer.windows[1]
    assert outer.summary()["samples"] > inner.summary()["samples"] > 0


def test_a_window_without_samples_takes_the_nearest():
    """A window shorter than the sampling period gets the sample nearest it, marked (samples 0,
    nearest_ms); before 2026-12-05 its summary was None (a test under load saw it)."""
    gpus = FakeGPUs(1300.0)
    with clocks.sampling(read=gpus, period_s=0.05) as sampler:
        time.sleep(0.01)
        with clocks.collect() as c:
            now = time.perf_counter()
            c.windows.append((now, now + 1e-6))          # no sample can fall in it
        summary = c.summary()
        assert summary["sm_mhz"][0] == 1300.0 and summary["samples"] == 0
        assert 0 <= summary["nearest_ms"] <= 250
        far = time.perf_counter() + 10.0
        c.windows[:] = [(far, far + 1e-6)]
        assert c.summary() is None                       # nothing within clocks.NEAREST_S
    assert sampler is not None


def test_nested_sampling_keeps_the_outer_sampler():
    gpus = FakeGPUs(1400.0)
    with clocks.sampling(read=gpus, period_s=0.001) as outer:
        with clocks.sampling() as inner:      # e.g. the layer benchmark's own, inside a test's fake
            assert inner is outer


def test_without_nvml_summaries_are_none_and_timing_works(monkeypatch):
    def no_library(name):
        raise OSError(f"{name}: cannot open shared object file")
    monkeypatch.setattr(ctypes, "CDLL", no_library)
    with pytest.raises(OSError):
        clocks.nvml_reader()
    with clocks.sampling() as sampler:
        assert sampler is None
        with clocks.collect() as c:
            assert best_of(sleeper(0.001), iters=1, repeats=1) > 0
    assert c.summary() is None


def test_a_failing_read_ends_the_sampling_with_its_reason():
    def broken():
        raise OSError("NVML GetClockInfo returned 999")
    with clocks.sampling(read=broken, period_s=0.001) as sampler:
        with clocks.collect() as c:
            best_of(sleeper(0.005), iters=1, repeats=2)
    assert sampler.error == "NVML GetClockInfo returned 999"
    assert c.summary() is None
