#!/usr/bin/env bash
# tokamax (Google's JAX kernel library, Mosaic GPU ragged_dot on sm90) as a same-run peer of jax_ep's
# grouped GEMM in `tools/tune_gemm.py --compare`. A benchmark peer only: jax_ep never imports it.
# The GPU machines have no internet, so the wheels travel with the working tree:
#   bash tools/gemm_peers.sh download        # here, with internet: wheels into .whl/tokamax/ (ignored by git;
#                                            # pass carry=[".whl"] to the device call)
#   bash tools/gemm_peers.sh install DIR     # there: the wheels into DIR; then PYTHONPATH=DIR:$PYTHONPATH
# tokamax 0.0.17 needs Python 3.12 and jax >= 0.11.1 (both on the GPU machines); PYTHON names the
# interpreter (default python). Its benchmarking module imports xprof.cli.tools.get_kernel_stats_tool at
# import time (only its profiler timing uses it); install writes a stub module there that raises if called.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=.whl/tokamax
PY="${PYTHON:-python}"
PACKAGES=(tokamax==0.0.17 einshape pydantic pydantic-core annotated-types typing-inspection typing-extensions
          qwix immutabledict tensorboardx jaxtyping wadler-lindig tqdm)
case "${1:-}" in
  download)
    mkdir -p "$WHEELS"
    "$PY" -m pip download -q --no-deps --python-version 3.12 --platform manylinux2014_x86_64 \
      --platform manylinux_2_17_x86_64 --platform any --only-binary=:all: -d "$WHEELS" "${PACKAGES[@]}"
    # pydantic pins pydantic-core exactly: fetch the pinned one
    pin=$(unzip -p "$WHEELS"/pydantic-[0-9]*.whl '*/METADATA' | sed -n 's/^Requires-Dist: pydantic-core==//p')
    rm -f "$WHEELS"/pydantic_core-*.whl
    "$PY" -m pip download -q --no-deps --python-version 3.12 --platform manylinux2014_x86_64 \
      --platform manylinux_2_17_x86_64 --only-binary=:all: -d "$WHEELS" "pydantic-core==$pin"
    ls "$WHEELS" ;;
  install)
    dir="${2:?usage: gemm_peers.sh install DIR}"
    ls "$WHEELS"/tokamax-*.whl >/dev/null 2>&1 || { echo "gemm_peers: no wheels in $WHEELS (run download here, carry .whl)"; exit 1; }
    "$PY" -m pip install -q --no-deps --target "$dir" "$WHEELS"/*.whl
    mkdir -p "$dir/xprof/cli"
    : > "$dir/xprof/__init__.py"
    : > "$dir/xprof/cli/__init__.py"
    cat > "$dir/xprof/cli/tools.py" <<'PY'
"""Stub of xprof.cli.tools for tokamax's import (written by jax_ep tools/gemm_peers.sh)."""


class get_kernel_stats_tool:  # noqa: N801 - the name tokamax imports
    @staticmethod
    def compute_kernel_stats(*args, **kwargs):
        raise NotImplementedError("xprof is not installed (stub from tools/gemm_peers.sh)")
PY
    PYTHONPATH="$dir:${PYTHONPATH:-}" "$PY" -c "import tokamax; print('tokamax', tokamax.__version__, 'in $dir')" ;;
  *)
    echo "usage: bash tools/gemm_peers.sh download | install DIR"; exit 2 ;;
esac
