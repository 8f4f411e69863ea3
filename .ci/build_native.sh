#!/usr/bin/env bash
# CI checks of the native part on a CPU-only machine with nvcc (called by .ci/run after
# `make install`): (a) the pip-built extension imports without a GPU and the runtime says why the
# CUDA backend is unavailable; (b) the offline bazel build of the same extension.
# Env: PYTHON (default .venv/bin/python, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=$(command -v python3); fi
fi
PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")  # absolute: bazel runs it from elsewhere

have_nvcc=0
if command -v nvcc >/dev/null || [ -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ]; then have_nvcc=1; fi
have_gpu=0
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then have_gpu=1; fi

echo "-- (a) pip-built extension: import without GPU, runtime.available() reason"
HAVE_NVCC=$have_nvcc HAVE_GPU=$have_gpu "$PY" - <<'PYEOF'
import os

from jax_ep import runtime

native = runtime.extension()
if os.environ["HAVE_NVCC"] == "1":
    assert native is not None, f"nvcc is installed but jax_ep._C did not import: {runtime.extension_error()}"
    # the one list is the extension's (JAX_EP_TARGETS); tests/test_native_cpu.py checks it covers every op
    assert native.ffi_handlers() and all(n.startswith("jax_ep_") for n in native.ffi_handlers()), \
        native.ffi_handlers()
    print(f"jax_ep._C imported from {native.__file__}; FFI API {native.FFI_API_VERSION}; "
          f"targets {sorted(native.ffi_handlers())}")
usable, reason = runtime.available()
print(f"runtime.available() -> {usable}, {reason!r}")
if os.environ["HAVE_GPU"] != "1":
    assert usable is False and reason, "without a GPU the CUDA backend must be unavailable, with a reason"
PYEOF

echo "-- (b) bazel build (offline)"
if ! command -v bazel >/dev/null || [ ! -d /usr/share/bazel/rules/cc ] || [ ! -d /usr/share/bazel/rules/java ]; then
  SUDO=""
  if [ "$(id -u)" != 0 ]; then SUDO=sudo; fi
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq bazel-bootstrap bazel-rules-cc bazel-rules-java >/dev/null
fi
# The repository rule imports jaxlib and nanobind with this interpreter; pip's build isolation
# does not leave nanobind in the venv.
if ! "$PY" -c "import nanobind" 2>/dev/null; then
  constraints=()
  if [ -f constraints.txt ]; then constraints=(-c constraints.txt); fi
  "$PY" -m pip install -q "${constraints[@]}" nanobind
fi
JAX_EP_PYTHON="$PY" tools/bazel_build.sh
"$PY" - <<'PYEOF'
import importlib.util

import jax_ep.runtime  # noqa: F401  (loads the NVSHMEM wheel's host library, as for any jax_ep._C)

spec = importlib.util.spec_from_file_location("jax_ep._C", "bazel-bin/jax_ep/_C.so")
native = importlib.util.module_from_spec(spec)
spec.loader.exec_module(native)
print(f"bazel-bin/jax_ep/_C.so imports; targets {sorted(native.ffi_handlers())}")
PYEOF
