"""CPU test setup: 8 virtual XLA:CPU devices, set before jax is imported; the repository root (the
`benchmarks` package) and examples/ (`models`, `demo`) importable, as when run from the checkout."""

import os
import pathlib
import sys

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()

ROOT = pathlib.Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "examples"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
