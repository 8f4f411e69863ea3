"""The backend registry (jax_ep.backends): a third backend registers itself and the ops run it, by name
or through 'auto'; the two-phase receive runs the backend of its send; the platform of a call is its
mesh's; a named backend that cannot run the call says why."""

from __future__ import annotations

import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_bits_equal, make_cfg, per_rank, random_tokens, require_devices, to_numpy
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import backends, ops, reference

E, K, H, T = 8, 2, 64, 8


@pytest.fixture
def mirror(monkeypatch):
    """A backend "mirror": the reference's functions under another module, counting each call."""
    calls = {}
    module = types.ModuleType("mirror_backend")

    def counted(name):
        def fn(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return getattr(reference, name)(*args, **kwargs)
        return fn

    for name in [n for n in dir(backends.Functions) if not n.startswith("_")]:
        setattr(module, name, counted(name))
    monkeypatch.setitem(sys.modules, "mirror_backend", module)
    yield calls, module
    backends.unregister("mirror")


def test_a_registered_backend_is_run_by_name_and_matches_the_reference(mirror):
    require_devices(2)
    calls, _ = mirror
    with pytest.raises(ValueError, match=r"EPConfig.backend must be one of \('auto', 'reference', 'cuda'\), "
                                         r"got 'mirror'"):
        make_cfg(num_experts=E, num_topk=K, hidden=H, max_tokens_per_rank=T, backend="mirror")
    backends.register(backends.Backend("mirror", "mirror_backend"))
    cfg = make_cfg(num_experts=E, num_topk=K, hidden=H, max_tokens_per_rank=T, backend="mirror")
    assert jax_ep.explain(cfg, 2)["dispatch"] == ops.OpPlan("dispatch", "mirror", "backend='mirror'")
    x, idx, w = random_tokens(np.random.default_rng(81), 2, T, cfg)

    def step(cfg):
        def f(x, idx, w):
            d = jax_ep.dispatch(x, idx, w, cfg)
            return jax_ep.combine(d.x * 2.0, d.handle, cfg)
        return per_rank(f, 2)

    got = to_numpy(step(cfg)(x, idx, w))
    assert calls == {"dispatch": 1, "combine": 1}, calls
    want = to_numpy(step(cfg.replace(backend="reference"))(x, idx, w))
    assert np.abs(got).max() > 0
    assert_bits_equal(got, want, "mirror vs reference")


def test_auto_takes_a_measured_backend_that_runs_on_the_platform_of_the_call(mirror):
    require_devices(2)
    calls, _ = mirror
    faster = {"dispatch"}
    backends.register(backends.Backend("mirror", "mirror_backend", platforms=("cpu",),
                                       faster=lambda op, layout, tokens, ep, dtype: op in faster))
    cfg = make_cfg(num_experts=E, num_topk=K, hidden=H, max_tokens_per_rank=T, backend="auto")
    plans = jax_ep.explain(cfg, 2, ops=["dispatch", "combine"])
    assert plans["dispatch"].impl == "mirror", plans
    assert plans["combine"].impl == "reference"
    # two candidates ('cuda' first, registered first): the reason names each
    assert plans["combine"].reason.startswith("backend='auto': cuda: "), plans["combine"].reason
    assert "mirror: its kernel did not measure faster" in plans["combine"].reason
    x, idx, w = random_tokens(np.random.default_rng(82), 2, T, cfg)
    per_rank(lambda x, idx, w: jax_ep.combine(jax_ep.dispatch(x, idx, w, cfg).x, jax_ep.dispatch(
        x, idx, w, cfg).handle, cfg), 2)(x, idx, w)
    assert calls == {"dispatch": 2}, calls  # combine ran on the reference
    faster.add("combine")
    backends.register(backends.Backend("mirror", "mirror_backend", platforms=("tpu",),
                                       faster=lambda op, layout, tokens, ep, dtype: True))
    assert "mirror: the platform of the call is 'cpu', not 'tpu'" in \
        jax_ep.explain(cfg, 2, ops=["combine"])["combine"].reason


def test_the_two_phase_receive_runs_the_backend_of_its_send(mirror):
    require_devices(2)
    calls, _ = mirror
    backends.register(backends.Backend("mirror", "mirror_backend"))
    cfg = make_cfg(num_experts=E, num_topk=K, hidden=H, max_tokens_per_rank=T, backend="mirror",
                   dispatch_dtype="bfloat16")
    x, idx, w = random_tokens(np.random.default_rng(83), 2, T, cfg)

    def f(x, idx, w):
        pending = jax_ep.ll_dispatch_send(x, idx, w, cfg)
        assert pending.backend == "mirror"
        d = jax_ep.ll_dispatch_recv(pending, cfg)
        # received with a reference config: the pending value, not cfg, picks the receive
        return jax_ep.ll_combine(d.x, d.handle, cfg.replace(backend="reference"))

    got = to_numpy(per_rank(f, 2)(x, idx, w))
    assert calls == {"ll_dispatch_send": 1, "ll_dispatch_recv": 1}, calls
    ref = cfg.replace(backend="reference")
    want = to_numpy(per_rank(lambda x, idx, w: jax_ep.ll_combine(
        *(lambda d: (d.x, d.handle))(jax_ep.ll_dispatch(x, idx, w, ref)), ref), 2)(x, idx, w))
    assert_bits_equal(got, want, "two-phase on mirror vs the fused reference")


def test_the_platform_of_a_call_is_its_meshs_and_a_named_backend_says_why_it_cannot_run(monkeypatch):
    require_devices(2)
    assert backends.platform() == jax.default_backend()
    seen = []

    def f(x):
        seen.append(backends.platform())
        return x

    mesh = jax.make_mesh((2,), ("ep",), devices=jax.devices("cpu")[:2])
    jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(), out_specs=P()))(jnp.zeros(4))
    assert seen == ["cpu"]
    # 'cuda' named on a CPU mesh, its extension usable: refused, naming the platform
    monkeypatch.setattr("jax_ep.runtime.available", lambda: (True, ""))
    cfg = make_cfg(num_experts=E, num_topk=K, hidden=H, max_tokens_per_rank=T, backend="cuda")
    x, idx, w = random_tokens(np.random.default_rng(84), 2, T, cfg)
    with pytest.raises(jax_ep.EPValueError, match=r"jax_ep.dispatch \(backend='cuda'\): it runs on gpu/cuda, "
                                                  r"the platform of this call is 'cpu'"):
        per_rank(lambda x, idx, w: jax_ep.dispatch(x, idx, w, cfg).x, 2)(x, idx, w)


def test_register_refuses_what_is_not_a_backend():
    with pytest.raises(jax_ep.EPValueError, match="expected a jax_ep.backends.Backend, got str"):
        backends.register("mirror")
    with pytest.raises(jax_ep.EPValueError, match="'auto' cannot name a backend"):
        backends.register(backends.Backend("auto", "jax_ep.reference"))
    with pytest.raises(jax_ep.EPValueError, match="the reference backend stays"):
        backends.unregister("reference")
    with pytest.raises(jax_ep.EPValueError,
                       match=r"no backend 'nope'; the backends are \('reference', 'cuda'\)"):
        backends.get("nope")


def test_a_pure_jax_backend_runs_under_vmap_of_the_ep_axis(mirror):
    """A backend for every platform (no ``platforms``) is pure JAX: under jax.vmap(axis_name=...) it runs
    as the reference does; only a device backend is refused there (the first form of that refusal
    refused every backend but the reference; found by a review, 2026-12-05)."""
    calls, _ = mirror
    backends.register(backends.Backend("mirror", "mirror_backend"))
    cfg = make_cfg(num_experts=E, num_topk=K, hidden=H, max_tokens_per_rank=T, backend="mirror")
    x, idx, w = random_tokens(np.random.default_rng(), 2, T, cfg)

    def f(cfg):
        def body(x, idx, w):
            d = jax_ep.dispatch(x, idx, w, cfg)
            return jax_ep.combine(d.x * 2.0, d.handle, cfg)
        return jax.vmap(body, axis_name=cfg.axis_name)

    got = to_numpy(f(cfg)(x, idx, w))
    assert calls == {"dispatch": 1, "combine": 1}, calls
    assert np.abs(got).max() > 0
    assert_bits_equal(got, to_numpy(f(cfg.replace(backend="reference"))(x, idx, w)), "mirror vs reference")
