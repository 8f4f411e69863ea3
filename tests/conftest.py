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


def pytest_addoption(parser):
    parser.addoption("--ep-ranks", type=int, default=2, metavar="R",
                     help="GPU tests: EP group size of the single-axis GPU suites (default 2; 1 runs the "
                          "kernels on a one-GPU machine, each rank sending to itself)")
    parser.addoption("--share-gpu", action="store_true",
                     help="GPU tests: run the process-model-2 tests (marker process_group) as 2 processes on "
                          "GPU 0 (python -m jax_ep.launch --share-gpus; needs CUDA MPS running) instead of "
                          "one GPU each; run them alone: pytest -m 'gpu and process_group' --share-gpu "
                          "tests/gpu (docs/api.md, 'Processes sharing a GPU')")
    parser.addoption("--processes", type=int, default=2, metavar="N",
                     help="GPU tests: processes of the process-model-2 tests (marker process_group; default "
                          "2): one GPU each, or with --share-gpu all N on GPU 0")


def pytest_configure(config):
    # `make test` leaves these out (-m 'not gpu and not slow'); make test-all runs them (CI: make test)
    config.addinivalue_line("markers", "slow: a long CPU test (emulator sweeps, hypothesis pool tail, multi-"
                            "process and example runs, the tail of a sweep): make test-all, not make test")
    # read by tests/gpu/gpu_helpers.py at import (the GPU modules size their meshes from it)
    os.environ["JAX_EP_TEST_EP_RANKS"] = str(config.getoption("--ep-ranks"))
    os.environ["JAX_EP_TEST_SHARE_GPU"] = "1" if config.getoption("--share-gpu") else "0"
    os.environ["JAX_EP_TEST_PROCESSES"] = str(config.getoption("--processes"))
