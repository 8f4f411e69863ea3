#!/usr/bin/env bash
# Offline bazel build of jax_ep: the extension bazel-bin/jax_ep/_C.so and the py_library //:jax_ep.
#
# Uses Debian's bazel 4.2.3 (apt-get install -y bazel-bootstrap bazel-rules-cc). Nothing is
# downloaded: the repositories bazel would fetch point at Debian's local copies, and rules_cc is
# copied to a temp dir and patched (its compiler_flag/cc_flags_supplier rules call
# use_cpp_toolchain(), which bazel 4.2.3 lacks). Native deps come from //bazel:local_deps.bzl.
#
# Env: JAX_EP_PYTHON  interpreter with jaxlib + nanobind (default: python3 on PATH; a relative
#                     path is relative to the caller's directory)
#      CUDA_HOME      CUDA toolkit (default: nvcc on PATH, else /usr/local/cuda)
#      BAZEL_JOBS     parallel jobs (default 2)
# Extra arguments are passed to `bazel build` (e.g. more targets, -s to see the commands).
set -euo pipefail

# The interpreter, resolved before the cd below (a relative path is relative to the caller's
# directory) and made absolute: bazel's repository rule runs it from its external directory.
# Checked before anything needs bazel, so a wrong value is named even where bazel is missing.
JAX_EP_PYTHON="${JAX_EP_PYTHON:-python3}"
python_given=$JAX_EP_PYTHON
if [[ "$JAX_EP_PYTHON" != */* ]]; then  # a bare name: the one on PATH, as the shell would run it
  JAX_EP_PYTHON=$(command -v "$JAX_EP_PYTHON" || true)
fi
if [ -n "$JAX_EP_PYTHON" ] && [[ "$JAX_EP_PYTHON" != /* ]]; then
  JAX_EP_PYTHON="$PWD/$JAX_EP_PYTHON"
fi
if [ -z "$JAX_EP_PYTHON" ] || [ ! -f "$JAX_EP_PYTHON" ] || [ ! -x "$JAX_EP_PYTHON" ]; then
  echo "bazel_build.sh: JAX_EP_PYTHON=$python_given is not an executable file" \
    "(set it to the interpreter that has jaxlib and nanobind installed)" >&2
  exit 1
fi
export JAX_EP_PYTHON

cd "$(dirname "$0")/.."

if ! command -v bazel >/dev/null; then
  echo "bazel_build.sh: bazel not found; install Debian's: apt-get install -y bazel-bootstrap bazel-rules-cc" >&2
  exit 1
fi
RULES_CC=/usr/share/bazel/rules/cc
PLATFORMS=/usr/share/bazel/platforms
for dir in "$RULES_CC" "$PLATFORMS"; do
  [ -d "$dir" ] || { echo "bazel_build.sh: $dir missing (apt-get install -y bazel-bootstrap bazel-rules-cc)" >&2; exit 1; }
done

work=$(mktemp -d "${TMPDIR:-/tmp}/jax_ep_bazel.XXXXXX")
trap 'rm -rf "$work"' EXIT
cp -r "$RULES_CC" "$work/rules_cc"
chmod -R u+w "$work/rules_cc"
for f in "$work"/rules_cc/cc/private/rules_impl/{compiler_flag,cc_flags_supplier}.bzl; do
  sed -i -e 's/, "use_cpp_toolchain")/)/' \
         -e 's|toolchains = use_cpp_toolchain(),|toolchains = ["@bazel_tools//tools/cpp:toolchain_type"],|' "$f"
  if grep -q use_cpp_toolchain "$f"; then
    echo "bazel_build.sh: could not patch $f (unexpected rules_cc version)" >&2
    exit 1
  fi
done

overrides=(
  "--override_repository=rules_cc=$work/rules_cc"
  "--override_repository=platforms=$PLATFORMS"
)
if [ -d /usr/share/bazel/rules/java ]; then  # bazel-rules-java, when installed
  overrides+=("--override_repository=rules_java=/usr/share/bazel/rules/java")
fi

# --batch: no server left running after the build (CI machines are small).
bazel --batch build \
  "${overrides[@]}" \
  --jobs="${BAZEL_JOBS:-2}" \
  --spawn_strategy=local \
  --action_env=PATH \
  //:jax_ep/_C.so //:jax_ep "$@"
echo "bazel_build.sh: built $(pwd)/bazel-bin/jax_ep/_C.so"
