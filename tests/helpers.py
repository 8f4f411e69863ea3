"""Mesh / shard_map utilities for the CPU tests.

Convention: every global input has a leading rank axis [R, ...]; rank r sees its block without that
axis. Every per-rank output gets a leading rank axis back, so ``out[r]`` is rank r's view.
"""

from __future__ import annotations

import functools
import os
import threading

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

AXIS = "ep"
# jax_ep._C.LIMITS of a build, for tests that lower backend='cuda' without one (lower_cuda_here)
STUB_LIMITS = {"max_topk": 32, "layout_max_topk": 64, "max_experts": 8192, "max_ranks": 32, "max_groups": 64,
               "directory_axes": 4, "data_warps": 16, "row_alignment": 8, "max_rows": 2 ** 31 - 1,
               "max_hidden": 2 ** 28 - 1}


def lower_cuda_here(monkeypatch, *, stub_extension: bool) -> None:
    """backend='cuda' traces and lowers on this CPU machine (its FFI calls compile on GPUs only): what
    only a GPU process does at trace time (register the targets, size the buffers) is skipped and the
    calls take a GPU mesh's platform. stub_extension: without a build (STUB_LIMITS, every call
    supported); else the built extension's limits (skips where there is none)."""
    from jax_ep import cuda_backend, runtime

    if stub_extension:
        monkeypatch.setattr(runtime, "limits", lambda: dict(STUB_LIMITS))
        monkeypatch.setattr(cuda_backend, "unsupported", lambda *a: None)
    elif runtime.extension() is None:
        import pytest

        pytest.skip(f"jax_ep._C not built: {runtime.extension_error()}")
    monkeypatch.setattr(runtime, "available", lambda: (True, ""))
    monkeypatch.setattr("jax_ep.backends.platform", lambda: "gpu")
    monkeypatch.setattr(runtime, "reserve", lambda n: None)
    monkeypatch.setattr(runtime, "register_targets", lambda: None)


def run_logged(commands: dict[str, list[str]], tmp, *, cwd, env=None, wait_s: float,
               env_for: dict | None = None) -> dict:
    """Runs the commands at once, each one's output to tmp/<name>.log (files: no pipe can fill up);
    {name: (exit code, log)}. ``env_for[name]`` replaces ``env`` for that command. The waits are bounded by
    wait_s in all; a command still running then is killed and the test fails naming it."""
    import subprocess
    import time

    import pytest

    procs, logs = {}, {}
    try:
        for name, command in commands.items():
            logs[name] = open(tmp / f"{name}.log", "w")
            procs[name] = subprocess.Popen(command, cwd=cwd, env=(env_for or {}).get(name, env),
                                           stdout=logs[name], stderr=subprocess.STDOUT)
        deadline = time.monotonic() + wait_s
        for name, proc in procs.items():
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{name} did not finish in {wait_s} s: {' '.join(commands[name])}\n"
                            + (tmp / f"{name}.log").read_text()[-5000:])
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
        for log in logs.values():
            log.close()
    return {name: (proc.returncode, (tmp / f"{name}.log").read_text()) for name, proc in procs.items()}


def parametrize_slow_tail(argnames, argvalues, *, fast=1, **kwargs):
    """``pytest.mark.parametrize(argnames, argvalues, **kwargs)`` whose first ``fast`` values (or, if
    ``fast`` is a collection, the values at those indices) run in the default suite (``make test``) and
    the others carry the ``slow`` marker (``make test-all`` runs them): a sweep keeps a cheap
    representative in every run and its tail in ``make test-slow``. Values that are ``pytest.param`` keep
    their marks."""
    import pytest

    names = argnames.split(",") if isinstance(argnames, str) else list(argnames)
    keep = set(range(fast)) if isinstance(fast, int) else set(fast)
    values = []
    for i, value in enumerate(argvalues):
        if i in keep:
            values.append(value)
        elif hasattr(value, "values") and hasattr(value, "marks"):  # already a pytest.param
            values.append(pytest.param(*value.values, marks=(*value.marks, pytest.mark.slow), id=value.id))
        else:
            values.append(pytest.param(*(value if len(names) > 1 else (value,)), marks=pytest.mark.slow))
    return pytest.mark.parametrize(argnames, values, **kwargs)


def require_devices(n: int) -> None:
    import pytest

    if len(jax.devices()) < n:
        pytest.skip(f"needs {n} devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")


@functools.cache
def mesh(ep_size: int, axis: str = AXIS) -> Mesh:
    require_devices(ep_size)
    return Mesh(np.array(jax.devices()[:ep_size]), (axis,))


def per_rank(fn, ep_size: int, axis: str = AXIS, jit: bool = True):
    """Wrap ``fn(*per_rank_args)`` into a function of global [R, ...] arrays (jitted by default)."""
    m = mesh(ep_size, axis)

    def body(*args):
        out = fn(*(a[0] for a in args))
        return jax.tree.map(lambda v: v[None], out)

    def wrapped(*args):
        return jax.shard_map(body, mesh=m, in_specs=(P(axis),) * len(args), out_specs=P(axis))(*args)

    return jax.jit(wrapped) if jit else wrapped


def to_numpy(tree):
    return jax.tree.map(np.asarray, tree)


def bits(a: np.ndarray) -> np.ndarray:
    """A view of `a` as unsigned ints of the same width (bit-exact comparison, NaN-safe)."""
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def assert_bits_equal(got, want, what: str = "") -> None:
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    diff = bits(got) != bits(want)
    if diff.any():
        where = np.argwhere(diff)
        first = tuple(int(i) for i in where[0])
        raise AssertionError(f"{what}: {diff.sum()} of {diff.size} elements differ; first at {first}: "
                             f"got {got[first]!r}, want {want[first]!r}")


def random_routing(rng, ep_size: int, tokens: int, topk: int, num_experts: int, *,
                   p_unused: float = 0.15, p_out_of_range: float = 0.1, p_repeat: float = 0.15):
    """topk_idx [R, T, K] int32 with -1 slots, out-of-range ids (>= E and < -1) and repeated experts."""
    idx = np.stack([np.stack([rng.permutation(num_experts)[:topk] for _ in range(tokens)])
                    for _ in range(ep_size)]).astype(np.int32)
    u = rng.random(idx.shape)
    idx = np.where(u < p_unused, -1, idx)
    bad = rng.choice(np.array([num_experts, num_experts + 3, -2, -7, 2**31 - 1, -(2**31)], np.int64),
                     size=idx.shape)
    idx = np.where((u >= p_unused) & (u < p_unused + p_out_of_range), bad, idx)
    if topk > 1:  # copy an earlier slot's id into a later slot
        rep = rng.random(idx.shape[:2]) < p_repeat
        src = rng.integers(0, topk - 1, size=idx.shape[:2])
        dst = np.minimum(src + 1 + rng.integers(0, topk - 1, size=idx.shape[:2]), topk - 1)
        for r, t in zip(*np.nonzero(rep), strict=True):
            idx[r, t, dst[r, t]] = idx[r, t, src[r, t]]
    return idx.astype(np.int32)


def random_inputs(rng, ep_size: int, tokens: int, hidden: int, topk: int, dtype=np.float32):
    """x [R, T, H] nonzero (no exact zeros), weights [R, T, K] float32 in (0.1, 1.1)."""
    x = rng.standard_normal((ep_size, tokens, hidden)).astype(np.float32)
    x = np.where(np.abs(x) < 1e-3, 0.5, x).astype(dtype)
    w = (rng.random((ep_size, tokens, topk)) + 0.1).astype(np.float32)
    return x, w


def random_tokens(rng, ep_size: int, tokens: int, cfg, dtype=np.float32, routing=random_routing):
    """(x, topk_idx, topk_weights) for cfg's hidden size, top-k and experts: random_inputs, then
    ``routing(rng, ep_size, tokens, topk, num_experts)`` (random_routing by default)."""
    x, w = random_inputs(rng, ep_size, tokens, cfg.hidden, cfg.num_topk, dtype)
    return x, routing(rng, ep_size, tokens, cfg.num_topk, cfg.num_experts), w


# ---- configuration and comparison against the NumPy model ----------------------------------------
# The CPU suite runs the pure-JAX reference path; JAX_EP_TEST_BACKEND=auto|cuda points it elsewhere.
BACKEND = os.environ.get("JAX_EP_TEST_BACKEND", "reference")


def make_cfg(**kw):
    import jax_ep

    kw.setdefault("backend", BACKEND)
    return jax_ep.EPConfig(**kw)


def model_for(cfg, x, topk_idx, topk_weights, rank_mask=None):
    import numpy_model as nm

    return nm.dispatch(x, topk_idx, topk_weights, num_experts=cfg.num_experts, capacity=cfg.capacity,
                       alignment=cfg.expert_alignment, dispatch_dtype=cfg.dispatch_dtype,
                       max_tokens=cfg.max_tokens_per_rank, rank_mask=rank_mask)


def assert_dispatch_matches(d, m, ep_size: int, scales_ulps: int = 0) -> None:
    """d: Dispatched with a leading rank axis (numpy); m: numpy_model.ModelResult. Bit-exact (FP8
    scales within `scales_ulps` float32 ulps)."""
    assert d.x.shape[:2] == (ep_size, m.capacity), (d.x.shape, m.capacity)
    assert d.num_dropped.shape == (ep_size,)
    for r in range(ep_size):
        mr = m.ranks[r]
        assert_bits_equal(d.x[r], mr.rows, f"rank {r} rows")
        if mr.scales is None:
            assert d.scales is None
        else:
            if scales_ulps:
                assert d.scales[r].shape == mr.scales.shape and d.scales.dtype == np.float32
                apart = np.abs(bits(d.scales[r]).astype(np.int64) - bits(mr.scales).astype(np.int64))
                assert apart.max() <= scales_ulps, f"rank {r} scales: {apart.max()} ulps apart"
            else:
                assert_bits_equal(d.scales[r], mr.scales, f"rank {r} scales")
        assert_bits_equal(d.group_sizes[r], mr.group_sizes, f"rank {r} group_sizes")
        assert_bits_equal(d.expert_counts[r], mr.expert_counts, f"rank {r} expert_counts")
        assert_bits_equal(d.row_weights[r], mr.row_weights, f"rank {r} row_weights")
        assert int(d.num_dropped[r]) == mr.num_dropped, f"rank {r} num_dropped"
        assert_bits_equal(d.rank_mask[r], m.active.astype(np.int32), f"rank {r} rank_mask")
        assert_bits_equal(d.handle.src_index[r], mr.src, f"rank {r} handle.src_index")
        assert_bits_equal(d.handle.token_rows[r], mr.token_rows, f"rank {r} handle.token_rows")
        assert_bits_equal(d.handle.row_weights[r], mr.row_weights, f"rank {r} handle.row_weights")
        assert_bits_equal(d.handle.is_token_in_rank[r], m.layouts[r].is_token_in_rank,
                          f"rank {r} handle.is_token_in_rank")


def assert_close_f(got, want, rtol: float, what: str = "") -> None:
    """Elementwise |got - want| <= rtol * (|want| + max|want|) (float64 comparison)."""
    got = np.asarray(got).astype(np.float64)
    want = np.asarray(want).astype(np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    scale = max(float(np.abs(want).max(initial=0.0)), 1e-30)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale, err_msg=what)


def dense_moe(layer, x, routing_cfg=None):
    """The MoE layer `layer` without EP: every token of x [..., hidden] runs its chosen experts on one
    device (routed with `routing_cfg`, default the layer's), plus the shared expert if it has one
    (test_moe, and process model 2's GPU worker)."""
    import jax.numpy as jnp

    from jax_ep import gating

    tokens = x.reshape(-1, x.shape[-1])
    logits = tokens @ layer.router[...]
    routing = gating.route(logits, routing_cfg or layer.routing, layer.expert_bias[...])
    gate, up = jnp.split(jnp.einsum("th,ehf->tef", tokens, layer.w_gate_up[...]), 2, axis=2)
    y = jnp.einsum("tef,efh->teh", jax.nn.silu(gate) * up, layer.w_down[...])    # [T, E, H]
    picked = jnp.take_along_axis(y, routing.topk_idx[:, :, None], axis=1)      # [T, K, H]
    out = jnp.sum(picked * routing.topk_weights[:, :, None], axis=1)
    if layer.shared is not None:
        out = out + layer.shared(tokens)
    return out.reshape(x.shape)


class FakeGPUs:
    """Two GPUs whose SM clocks read `mhz` (changed by the test) and whose powers read 500 and 600 W."""

    def __init__(self, mhz: float):
        self.mhz, self.calls, self.lock = mhz, 0, threading.Lock()

    def __call__(self):
        with self.lock:
            self.calls += 1
            return [self.mhz, self.mhz + 10], [500.0, 600.0]
