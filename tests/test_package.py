"""The library's boundary: importing jax_ep (every module of it) never reconfigures JAX, and the
benchmarks, demo and example models live outside it."""

import json
import os
import pathlib
import pkgutil
import subprocess
import sys

import jax
import numpy as np

import jax_ep

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Runs in a fresh interpreter, before any JAX backend starts (where a jax.config.update would still take
# effect silently): snapshot JAX's configuration and the environment, import every jax_ep module, compare.
# The environment is snapshot after importing the libraries jax_ep imports: JAX's Mosaic GPU sets
# MOSAIC_GPU_CUDA_ROOT when it is imported (jax/experimental/mosaic/gpu/core.py), which is not jax_ep's doing.
_IMPORT_ALL = """
import importlib, json, os, pkgutil, sys
import jax

def snapshot():
    return {name: repr(value) for name, value in jax.config.values.items()}

before_config = snapshot()
import flax.nnx, jax.experimental.pallas.mosaic_gpu
before_env = dict(os.environ)
import jax_ep
modules = ["jax_ep"] + [m.name for m in pkgutil.walk_packages(jax_ep.__path__, "jax_ep.")]
for name in modules:
    importlib.import_module(name)
after_config = snapshot()
changed = {k: (v, after_config[k]) for k, v in before_config.items() if after_config.get(k) != v}
env_changed = sorted(k for k in set(before_env) | set(os.environ) if before_env.get(k) != os.environ.get(k))
print(json.dumps({"modules": modules, "config": changed, "env": env_changed,
                  "xla_flags": [before_env.get("XLA_FLAGS"), os.environ.get("XLA_FLAGS")]}))
"""


def test_importing_jax_ep_does_not_reconfigure_jax():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    out = subprocess.run([sys.executable, "-c", _IMPORT_ALL], env=env, capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"jax_ep.moe", "jax_ep.ops", "jax_ep.gemm", "jax_ep.runtime"} <= set(result["modules"])
    assert result["config"] == {}, result["config"]
    assert result["xla_flags"][0] == result["xla_flags"][1]
    assert result["env"] == [], result["env"]


def test_library_holds_no_benchmark_or_demo():
    """The benchmark is the top-level `benchmarks` package, the demo and models are examples."""
    names = {m.name for m in pkgutil.iter_modules(jax_ep.__path__)}
    assert not names & {"bench", "bench_layer", "baselines", "demo", "models"}, names
    assert {"ops", "moe", "gating", "balancing", "eplb", "gemm", "gemm_mgpu", "vma"} <= names
    for path in ("benchmarks/__main__.py", "benchmarks/ops.py", "benchmarks/layer.py",
                 "benchmarks/baselines.py", "examples/demo.py", "examples/models.py"):
        assert (ROOT / path).is_file(), path


def test_submodules_are_attributes_of_the_package():
    """After `import jax_ep` alone, jax_ep.moe.MoE, jax_ep.gating.RouterConfig, ... resolve (imported on
    first use), as the README's layer line writes them (before 2026-12-05: AttributeError); a name that
    is no submodule still raises AttributeError."""
    import pytest

    for module in pkgutil.iter_modules(jax_ep.__path__):
        if module.name != "_C":
            assert getattr(jax_ep, module.name).__name__ == f"jax_ep.{module.name}"
    assert jax_ep.moe.MoE and jax_ep.gating.RouterConfig and jax_ep.remat.policy
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        jax_ep.nothing  # noqa: B018
    with pytest.raises(jax_ep.EPValueError, match="count must be a positive int, got 0"):
        jax_ep.devices.use_virtual_cpu_devices(0)
    # a wrong type is an EPTypeError, and a NumPy int is an int (an EPValueError before 2026-12-06)
    with pytest.raises(jax_ep.EPTypeError, match=r"count must be a positive int, got 2\.0 \(float\)"):
        jax_ep.devices.use_virtual_cpu_devices(2.0)
    jax_ep.devices.use_virtual_cpu_devices(np.int64(len(jax.devices())))   # JAX is running: no change


def test_virtual_cpu_devices_leave_a_device_count_the_user_set():
    """XLA_FLAGS=--xla_force_host_platform_device_count=N and JAX_NUM_CPU_DEVICES win over
    use_virtual_cpu_devices()'s 8 (before 2026-12-05 the XLA flag was overridden: 8 devices for 4)."""
    import os
    import subprocess
    import sys

    code = ("import jax_ep.devices, jax; jax_ep.devices.use_virtual_cpu_devices(); "
            "print(len(jax.devices('cpu')))")
    base = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    for extra, want in (({}, "8"), ({"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}, "4"),
                        ({"JAX_NUM_CPU_DEVICES": "3"}, "3")):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                             env={**base, "JAX_PLATFORMS": "cpu", **extra})
        assert out.returncode == 0, out.stderr
        assert out.stdout.split()[-1] == want, (extra, out.stdout)
