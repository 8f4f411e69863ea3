"""The GPUs' SM clock and power while a timing runs, so that a time carries the clock it ran at.

An H200 under sustained load sits at its 700 W cap and lowers its SM clock (1980 MHz in a short burst,
1335-1500 under load: docs/benchmarks.md session 35), so two timings of one kernel can differ by 15-18%
and two kernels of the same FLOPs can run at different clocks. ``sampling()`` polls NVML (the driver's
``libnvidia-ml.so.1``, through ctypes) from a background thread for the length of a run; ``best_of``
marks the window it times (``mark``), and ``collect()`` gathers the windows marked inside it:

    with clocks.sampling():
        with clocks.collect() as c:
            seconds = best_of(fn, *args, iters=10, repeats=3)
        record["clocks"] = c.summary()   # {"sm_mhz": [...], "power_w": [...], "samples": n} or None

Each GPU that NVML sees is sampled (by NVML index, which need not be JAX's device order); the summary
gives each one's median over the samples in the marked windows. Where NVML is missing (no GPU, or no
driver library) sampling is off and summaries are None: a record then says nothing about clocks rather
than something wrong.
"""

from __future__ import annotations

import contextlib
import ctypes
import statistics
import threading
import time
from collections.abc import Callable, Iterator

_NVML_CLOCK_SM = 1
NEAREST_S = 0.25   # how far from a window without samples its nearest sample may be (clocks move slowly)
_SAMPLER: Sampler | None = None
_COLLECTORS: list[Collector] = []


def nvml_reader() -> Callable[[], tuple[list[float], list[float]]]:
    """A function reading (SM clock MHz, power W) of every GPU NVML sees; raises OSError where NVML
    cannot be loaded or initialised (AttributeError where the library lacks a function)."""
    nvml = ctypes.CDLL("libnvidia-ml.so.1")

    def check(rc: int, what: str):
        if rc != 0:
            raise OSError(f"NVML {what} returned {rc}")

    check(nvml.nvmlInit_v2(), "nvmlInit_v2")
    count = ctypes.c_uint()
    check(nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)), "nvmlDeviceGetCount_v2")
    handles = []
    for i in range(count.value):
        handle = ctypes.c_void_p()
        check(nvml.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(handle)), "nvmlDeviceGetHandleByIndex_v2")
        handles.append(handle)
    if not handles:
        raise OSError("NVML sees no GPU")

    def read():
        mhz, mw, value = [], [], ctypes.c_uint()
        for handle in handles:
            check(nvml.nvmlDeviceGetClockInfo(handle, _NVML_CLOCK_SM, ctypes.byref(value)), "GetClockInfo")
            mhz.append(float(value.value))
            check(nvml.nvmlDeviceGetPowerUsage(handle, ctypes.byref(value)), "GetPowerUsage")
            mw.append(value.value / 1e3)
        return mhz, mw
    return read


class Sampler:
    """Calls ``read()`` every ``period_s`` seconds on a daemon thread, keeping (perf_counter, SM clocks,
    powers) per call."""

    def __init__(self, read: Callable[[], tuple[list[float], list[float]]], period_s: float = 0.02):
        self._read, self._period = read, period_s
        self._samples: list[tuple[float, list[float], list[float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="clocks", daemon=True)
        self.error: str | None = None

    def _loop(self):
        while not self._stop.is_set():
            try:
                mhz, watts = self._read()
            except OSError as e:    # a driver hiccup ends the sampling, not the benchmark
                self.error = str(e)
                return
            self._samples.append((time.perf_counter(), mhz, watts))
            self._stop.wait(self._period)

    def start(self) -> Sampler:
        self._thread.start()
        return self

    def stop(self):
        self._stop.set()
        self._thread.join()

    def between(self, start: float, end: float) -> list[tuple[float, list[float], list[float]]]:
        """The samples taken in [start, end] (perf_counter seconds)."""
        return [s for s in list(self._samples) if start <= s[0] <= end]

    def nearest(self, start: float, end: float
                ) -> tuple[float, tuple[float, list[float], list[float]]] | None:
        """(seconds from the window, sample) of the sample taken closest to [start, end], if any."""
        samples = list(self._samples)
        if not samples:
            return None
        return min(((max(start - s[0], s[0] - end, 0.0), s) for s in samples), key=lambda d: d[0])


class Collector:
    """The windows ``mark``ed while it is active; ``summary()`` of the samples taken in them."""

    def __init__(self, sampler: Sampler | None):
        self.sampler, self.windows = sampler, []

    def summary(self) -> dict | None:
        """The median clock and power of the samples in the windows; where no sample fell in any window
        (a window shorter than the sampling period, or the sampler not scheduled during it), the sample
        nearest each window within NEAREST_S, with ``samples`` 0 and ``nearest_ms`` its distance (before
        2026-12-05: None, the record said nothing about its clock)."""
        if self.sampler is None:
            return None
        samples = [s for w in self.windows for s in self.sampler.between(*w)]
        extra = {}
        if not samples:
            near = [n for n in (self.sampler.nearest(*w) for w in self.windows)
                    if n is not None and n[0] <= NEAREST_S]
            if not near:
                return None
            samples = [s for _, s in near]
            extra = dict(nearest_ms=round(1e3 * max(d for d, _ in near), 1))
        gpus = range(len(samples[0][1]))
        return dict(sm_mhz=[statistics.median(s[1][g] for s in samples) for g in gpus],
                    power_w=[round(statistics.median(s[2][g] for s in samples), 1) for g in gpus],
                    samples=0 if extra else len(samples), **extra)


@contextlib.contextmanager
def sampling(read: Callable[[], tuple[list[float], list[float]]] | None = None,
             period_s: float = 0.02) -> Iterator[Sampler | None]:
    """Samples the GPUs while the block runs (``read``: NVML's by default); yields the sampler, or None
    where NVML is not there. Nested use keeps the outer sampler."""
    global _SAMPLER
    if _SAMPLER is not None:
        yield _SAMPLER
        return
    try:
        read = read or nvml_reader()
    except (OSError, AttributeError):     # no library, no GPU, or a library without these symbols
        yield None
        return
    _SAMPLER = Sampler(read, period_s).start()
    try:
        yield _SAMPLER
    finally:
        _SAMPLER.stop()
        _SAMPLER = None


@contextlib.contextmanager
def collect() -> Iterator[Collector]:
    """Gathers the windows ``mark``ed inside the block (by ``best_of`` and ``layer.profiled_steps``)."""
    collector = Collector(_SAMPLER)
    _COLLECTORS.append(collector)
    try:
        yield collector
    finally:
        _COLLECTORS.remove(collector)


def mark(start: float, end: float):
    """A timed window (perf_counter seconds) for every active ``collect()``."""
    for collector in _COLLECTORS:
        collector.windows.append((start, end))
