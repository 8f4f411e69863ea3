#!/usr/bin/env bash
# GPU machine check (no internet there): build the extension, record the topology, run the GPU
# tests and, when present, the benchmark. Every log goes under $OUT (default ./out).
# Idempotent: the CMake build dir (build/) is reused, so a second run only relinks what changed.
#
# Env: OUT     log folder (default ./out)
#      PYTHON  interpreter with jax[cuda], nanobind, scikit-build-core, cmake, ninja, pytest
#      PYTEST_ARGS  extra pytest arguments, split like a shell line (e.g. '-k "smoke or async" -x')
#      SKIP_TESTS=1 skips the GPU tests; TESTS_TIMEOUT their limit in seconds (default 3000)
#      BUILD_TIMEOUT  the build's limit in seconds (default 420; within DEADLINE too)
#      SHARE_GPU=1 then runs the process-model-2 tests (marker process_group) as 2 processes on GPU 0
#               (N with SHARE_PYTEST_ARGS='--processes N'; SHARE_FILES=a,b only tests/gpu/test_{a,b}_gpu.py)
#               under CUDA MPS (pytest --share-gpu; for one-GPU machines: without it they skip there):
#               starts the MPS daemon (pipes in $MPS_PIPE_DIR, default /tmp/jax_ep_mps_pipe; logs in
#               $OUT/mps_log) unless one is running there, and stops it after; one pytest per test file
#               (SHARE_FILE_TIMEOUT each, default 540 s: process_group took 345 s on 2026-12-03; SHARE_TIMEOUT
#               in all, default 2400; JUnit XML $OUT/gpu-tests-shared_<file>.xml each, for
#               tools/gpu_tests_record.py --junit; none passed over all files fails the call); SHARE_PYTEST_ARGS
#               extra pytest arguments. Runs with
#               SKIP_TESTS=1 too. Timings under MPS are not those of separate GPUs.
#               SHARE_FILES=none: no tests. SHARE_BENCH=N then times the process-model-2 benchmark with N
#               processes on GPU 0 (tests/gpu/process_group_worker.py --bench $OUT/share_bench.json plus
#               SHARE_BENCH_ARGS, default a push / pull A/B: '--bench-sms 16 --bench-pull both
#               --bench-dtypes bfloat16 --bench-no-profile'; XLA_PYTHON_CLIENT_MEM_FRACTION 0.2 unless set;
#               log $OUT/share_bench.log): every "peer" is the same GPU, so it shows the SMs' side only.
#      SKIP_BENCH=1 skips the benchmark; BENCH_ARGS extra arguments of python -m benchmarks;
#               BENCH_TIMEOUT its limit in seconds (default 3000)
#      SKIP_LAYER=1 skips the MoE layer benchmark; LAYER_ARGS extra arguments of it
#      PG_BENCH=1 runs the process-model-2 benchmark (2 processes x 1 GPU, NVSHMEM)
#      GEMM=1   the grouped GEMM on this GPU: its GPU tests (tests/gpu/test_gemm_gpu.py; log and JUnit XML
#               $OUT/gemm_tests.{log,xml}), then tools/tune_gemm.py --quick at GEMM_SHAPES (default layers) over
#               GEMM_KERNELS (default all) with the table's entries timed beside the sweep, the FP8 kernel
#               beside the bf16 forward (--fp8), and the expert block
#               alone vs its roofline at the EP2 shapes (record $OUT/gemm_tune.json; the table it wrote,
#               jax_ep/gemm_configs.json, copied to $OUT), then tools/profile_layer.py of the DeepSeek-V3 layer's
#               per-rank expert work at EP2 ($OUT/gemm_profile.log); GEMM_TUNE_TIMEOUT bounds the tuning
#               (default 540 s). In parts, each within one 10-minute device call: GEMM_STEPS (default
#               tests,tune,profile) picks them; GEMM_TEST_K a pytest -k filter of the tests; GEMM_PASSES the
#               tuned passes (unset: forward,dx,dw; set but empty: none, e.g. only --fp8's timings),
#               GEMM_TUNE_EXTRA the tuning's other arguments (unset: --fp8 --block deepseek_ep2,mid_ep2);
#               GEMM_PROFILE_CONFIGS the layer configs profiled, one
#               log each (default jax_ep; e.g. "jax_ep jax_ep_fp8 jax_ep_fp8_cached"; $OUT/gemm_profile.log
#               for jax_ep, $OUT/gemm_profile_<config>.log for the others)
#      GEMM_PEERS=1 times the grouped GEMM at the MoE layer's per-rank shapes beside tokamax.ragged_dot and a
#               dense dot, fwd and vjp (tools/tune_gemm.py --passes "" --compare; record $OUT/gemm_peers.json);
#               tokamax from the carried wheels in .whl/tokamax (tools/gemm_peers.sh), else it is reported
#               missing; GEMM_PEERS_SHAPES (default layers) picks tune_gemm's shapes
#      GEMM_NCU=1 profiles one launch of each grouped GEMM kernel of the DeepSeek-V3 layer per rank at EP2
#            (bf16 forward, dx, dW at the table's configurations; FP8 forward and dx) with ncu, stall
#            reasons included (tools/gemm_ncu.py; GEMM_NCU_SHAPES: gate_up and/or down, default
#            gate_up); reports, details pages and SASS source CSVs tarred into $OUT/gemm_ncu.tar.gz
#      NCU=1 profiles the EP kernels' main kernels (ncu --set full, one launch each) at the
#            DeepSeek-V3 shape over the local GPUs; NCU_ARGS extra arguments of tools/ep_tune.py,
#            NCU_SECTIONS ncu's section arguments, NCU_JOBS other kernels (see the step);
#            reports and their details pages tarred into $OUT/ncu.tar.gz
#      SWEEP=PARTS  the multi-GPU sweep (issues 12, 14, 16) after the rest, one program per part, in the
#               order given (comma-separated; records $OUT/sweep_<part>.json, logs $OUT/sweep_<part>.log):
#                 em     expert-major ops: backends cuda, dense, reference, ragged; bf16 and fp8
#                 rm     rank-major ops (--rank-major): cuda and reference
#                 ll     low-latency ops (--low-latency, tokens 1 and 128): cuda and reference
#                 layer  the MoE layer step: shapes mid and deepseek, configs ep_reference, ep_cuda, jax_ep
#                 overlap   issue 38's A/B of the side-stream overlaps, DeepSeek-V3 shape with its shared
#                           expert (deepseek_shared), sustained: the shared expert beside combine
#                           (shared_beside, all SMs and 24) and dispatch's backward beside the gate|up
#                           weight gradient (weight_grad_beside, 12 and 24 side SMs), the shared expert
#                           beside combine and split beside all four exchanges (shared_split), both with
#                           24 side SMs, against their plain forms
#                 gate      issue 38's A/B of the gate weights in the experts (the default "auto" on the
#                           flat exchange: combine's backward at dispatch's bytes) against in combine,
#                           bf16 and cached FP8, DeepSeek-V3 shape, sustained
#                 pull      issue 38's A/B of the rows pushed and pulled (KernelConfig.dispatch_pull,
#                           broadcast_pull): the cuda ops, DeepSeek-V3 shape, 4096 tokens, bf16 and fp8,
#                           24 and all SMs (broadcast / combine_bwd in place too); the decisions they imply
#                           for KernelConfig's default (None) go to a copy, auto_table_pull.json
#                 decode    issue 38 item 4: the decode forward (DeepSeek-V3, 128 tokens per rank, its shared
#                           expert) with the shared expert beside ll_dispatch_send on jax_ep's side stream
#                           (shared_beside) against the fused ll_dispatch; with SWEEP=ll's times of the ops
#                 remat     the layer rematerialised (jax.checkpoint) without a policy (dispatch's exchange
#                           rerun in the backward), keeping dispatch's results (jax_ep.remat.policy()) and
#                           the gate|up GEMM's output too (dy_in_place off), against the plain step;
#                           DeepSeek-V3 shape, sustained
#                 pg     process model 2: one process per local GPU (tests/gpu/process_group_worker.py;
#                        2 or more GPUs)
#               SWEEP_EP=2,4 runs each part once per EP size, on the first N visible GPUs
#               (CUDA_VISIBLE_DEVICES; records and logs $OUT/sweep_<part>_ep<N>.*): EP2 and EP4 in one call;
#               pg is refused with SWEEP_EP (it takes every GPU: run it in a call without SWEEP_EP).
#               em and rm take SWEEP_PRESETS (default deepseek,sparse) and SWEEP_TOKENS (default
#               128,512,2048,4096,8192); every part runs with --profile. SWEEP_PART_TIMEOUT bounds each
#               (default 900 s). With SWEEP (or GPU_SUITE), SKIP_TESTS, SKIP_BENCH and SKIP_LAYER default
#               to 1 (set them to 0 for those runs too).
#      GPU_SUITE=PARTS  the GPU test suite in parts that each fit one 10-minute device call (comma-separated,
#               run in the order given; GPU_SUITE_RANKS=N ranks on N separate GPUs, default all visible GPUs;
#               the model-1 parts see only the first N (CUDA_VISIBLE_DEVICES), so a record's device is
#               "Nx <gpu>" for them; with no GPU listed the suite is not run and the call fails):
#                 m1a    model 1 (--ep-ranks N, -m "gpu and not process_group"): dispatch, layout, peer_smoke
#                 m1g    model 1: gemm, all but the FP8 tests and the kernel-config sweeps
#                        (-k "not fp8 and not (each_config or ring_weight_gradient)")
#                 m1k    model 1: gemm, the kernel-config sweeps (-k "not fp8 and (each_config or
#                        ring_weight_gradient)")
#                 m1h    model 1: gemm, the FP8 tests (-k fp8)
#                 m1b    model 1: rank_major
#                 m1c    model 1: low_latency, rank_mask, throughput/ll shrink, fingerprint, device_memory,
#                        router, swiglu (every file the other model-1 parts leave)
#                 pga    process model 2 (--processes N, -m "gpu and process_group"): process_group,
#                        hierarchical
#                 pgb    process model 2: put_transport, fingerprint, rank_mask, throughput/ll shrink,
#                        device_memory
#                 pg     process model 2: pga and pgb in one pytest (every file with process_group tests)
#                 pgrep  process model 2: test_process_per_gpu_matches_reference PG_REPEATS times (default 3)
#                        per setting of XLA's sharded autotuning in PG_AUTOTUNING (default off,on: off is
#                        gpu_helpers' --xla_gpu_shard_autotuning=false, on JAX_EP_TEST_SHARD_AUTOTUNING=on);
#                        each run is recorded as the next pgrep_<setting>_<n>, so runs of several calls add up;
#                        with DEADLINE, no run starts with less than PG_RUN_S (default 240) s left; PG_CHECKS=a,b
#                        runs only those worker check groups (e.g. gradients,dispatch_combine: ~45 s a run at 2
#                        processes against ~2 min for all)
#               Each pytest: bounded by GPU_SUITE_PART_TIMEOUT (default 530 s) and DEADLINE, cut with SIGINT
#               (pytest still writes the JUnit XML of the tests done); GPU_SUITE_ARGS extra pytest arguments
#               (e.g. -k); JUnit XML and -v log under $OUT (gpu_suite_<part>_ep<N>.{xml,log}), then
#               tools/gpu_tests_record.py adds the part to $OUT/gpu_tests_<gpu>x<count>_ep<N>_pm<1|2>.json
#               (counts, failing ids, skipped ids with their reasons, seconds per file; a cut part is
#               "incomplete" and names the test it was cut in; a part with none passed fails).
#               GIT_COMMIT names the commit when the machine's .git is stale or absent. Fold the
#               records a call returns into docs/benchmarks/ with tools/gpu_tests_record.py --merge FILES
#               --into docs/benchmarks (the tarball leaves the records out).
#      DEADLINE=S  every bounded step ends by S seconds after the start (a step with less than 20 s left
#               is skipped and says "not run (DEADLINE)" in summary.txt): for a machine whose calls are cut
#               off at a fixed time. It and the other numbers above are checked to be whole seconds / counts,
#               and the *ARGS split like a shell line to parse, before anything runs (else the call fails).
#      TAR_OUT=1  at the end, everything under $OUT but summary.txt and the gpu_tests_*.json records
#               goes into $OUT/gpu_check.tar.gz (machines that return only a few files: 8 on the device
#               machines); unset, that happens when more than 8 files would be left; TAR_OUT=0 never
#      SKIP_BUILD=1  no pip install (an earlier run built this tree): for two runs at once, one per GPU
#               (CUDA_VISIBLE_DEVICES, OUT apart), where two installs of one tree race and one fails
set -uo pipefail
cd "$(dirname "$0")/.."

OUT="${OUT:-./out}"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PY="${PYTHON:-python3}"
: >"$OUT/summary.txt"

# The settings, checked before anything runs: a number that is not one broke the arithmetic (every part
# then "cut in None"), and an *ARGS that did not parse dropped the user's arguments or, under set -u, the
# whole GPU_SUITE block, with the call still saying OK (review of 2026-12-05).
bad_settings=0
setting_error() { echo "gpu_check: $*" | tee -a "$OUT/summary.txt"; bad_settings=1; }
for var in DEADLINE BUILD_TIMEOUT TESTS_TIMEOUT BENCH_TIMEOUT SHARE_FILE_TIMEOUT SHARE_TIMEOUT SHARE_BENCH \
           GEMM_TUNE_TIMEOUT SWEEP_PART_TIMEOUT GPU_SUITE_RANKS GPU_SUITE_PART_TIMEOUT PG_REPEATS PG_RUN_S; do
  [ -z "${!var:-}" ] || [[ ${!var} =~ ^[0-9]+$ ]] || setting_error "$var='${!var}' is not a whole number"
  # a limit of 0 skipped its step, blamed on DEADLINE (unset: set -u then stopped the script)
  [[ $var != DEADLINE && $var != *_TIMEOUT ]] || [ "${!var:-1}" != 0 ] \
    || setting_error "$var=0: a limit needs 1 or more seconds"
done
[ "${GPU_SUITE_RANKS:-1}" != 0 ] || setting_error "GPU_SUITE_RANKS=0: needs 1 or more"
# any other value read as "never tar": the device machine brings back 8 files, summary.txt maybe not
[ -z "${TAR_OUT:-}" ] || [[ $TAR_OUT =~ ^[01]$ ]] || setting_error "TAR_OUT='$TAR_OUT' must be 0 or 1"
# the shared-GPU settings do something only with SHARE_GPU=1 (a call with them alone said OK, ran nothing)
if [ "${SHARE_GPU:-0}" != 1 ]; then
  for var in SHARE_BENCH SHARE_FILES SHARE_PYTEST_ARGS; do
    [ -z "${!var:-}" ] || setting_error "$var is set but SHARE_GPU is not 1: it would do nothing"
  done
fi
[ -z "${SWEEP_EP:-}" ] || [[ $SWEEP_EP =~ ^[0-9]+(,[0-9]+)*$ ]] \
  || setting_error "SWEEP_EP='$SWEEP_EP' is not comma-separated whole numbers"
# parse_args ARRAY VALUE: VALUE split like a shell line (quotes work: '-k "a or b"') into ARRAY
parse_args() {
  eval "$1=($2)" 2>/dev/null || setting_error "$3='$2' does not parse as a shell line (unbalanced quote?)"
}
parse_args pytest_args "${PYTEST_ARGS:-}" PYTEST_ARGS
parse_args share_args "${SHARE_PYTEST_ARGS:-}" SHARE_PYTEST_ARGS
parse_args bench_args "${SHARE_BENCH_ARGS:---bench-sms 16 --bench-pull both --bench-dtypes bfloat16 --bench-no-profile}" \
  SHARE_BENCH_ARGS
parse_args suite_args "${GPU_SUITE_ARGS:-}" GPU_SUITE_ARGS
if [ $bad_settings = 1 ]; then
  echo "gpu_check: FAILED (settings above; nothing ran)" | tee -a "$OUT/summary.txt"
  exit 2
fi
# SWEEP and GPU_SUITE each fit one 10-minute call: the 3000 s default runs before them would eat it
if [ -n "${SWEEP:-}${GPU_SUITE:-}" ]; then
  SKIP_TESTS=${SKIP_TESTS:-1} SKIP_BENCH=${SKIP_BENCH:-1} SKIP_LAYER=${SKIP_LAYER:-1}
fi

# NVLink multicast stays off on these machines (NCCL and NVSHMEM).
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
# XLA preallocates this share of GPU memory; jax_ep's communication buffers (cudaMalloc) live in
# the rest.
user_mem_fraction="${XLA_PYTHON_CLIENT_MEM_FRACTION:-}"   # as the caller set it (SHARE_BENCH's default differs)
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.6}"
export PYTHONUNBUFFERED=1

status=0
step() { echo "== $*"; }
# bounded LIMIT: LIMIT, or less so that the step ends by DEADLINE; 0 when under 20 s are left
bounded() {
  local lim=$1
  if [ -n "${DEADLINE:-}" ]; then
    local left=$((DEADLINE - SECONDS - 15))
    [ "$left" -lt "$lim" ] && lim=$left
    [ "$lim" -lt 20 ] && lim=0
  fi
  echo "$lim"
}
# bounded_run [--int] LIMIT CMD...: CMD under timeout; when DEADLINE leaves no time, skipped (rc 124,
# not_run=1, and a line in summary.txt). --int: cut with SIGINT, then SIGKILL 10 s later, so that pytest
# still writes its JUnit XML (after SIGTERM it writes none).
bounded_run() {
  local lim sig=(-k 5)
  if [ "$1" = --int ]; then sig=(-s INT -k 10); shift; fi
  lim=$(bounded "$1")
  shift
  not_run=0
  if [ "$lim" = 0 ]; then
    not_run=1
    echo "SKIPPED: DEADLINE ($DEADLINE s) reached, not run (DEADLINE): $*" | tee -a "$OUT/summary.txt"
    return 124
  fi
  timeout "${sig[@]}" "$lim" "$@"
}
# rc_text RC: "rc=RC", or "not run (DEADLINE)" when the last bounded_run was skipped for the deadline
rc_text() { if [ "${not_run:-0}" = 1 ]; then echo "not run (DEADLINE)"; else echo "rc=$1"; fi; }
# visible_gpus: gpu_ids, the GPUs CUDA will see (nvidia-smi lists every GPU, whatever
# CUDA_VISIBLE_DEVICES says), and gpus, their count
visible_gpus() {
  if [ -n "${CUDA_VISIBLE_DEVICES+set}" ]; then
    IFS=',' read -r -a gpu_ids <<<"$CUDA_VISIBLE_DEVICES"
  else
    read -r -a gpu_ids <<<"$(nvidia-smi -L 2>/dev/null | sed -nE 's/^GPU ([0-9]+):.*/\1/p' | tr '\n' ' ')"
  fi
  gpus=${#gpu_ids[@]}
}
# first_gpus N: the first N visible GPUs, for CUDA_VISIBLE_DEVICES
first_gpus() { local IFS=,; echo "${gpu_ids[*]:0:$1}"; }

step "environment" | tee -a "$OUT/summary.txt"
{
  nvidia-smi -L || true
  bounded_run 120 "$PY" -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__)" || true
  nvcc --version | tail -1 || true
  env | grep -E '^(NCCL_NVLS_ENABLE|NVSHMEM_DISABLE_NVLS|XLA_PYTHON_CLIENT_MEM_FRACTION|XLA_FLAGS|JAX_EP_)' || true
} 2>&1 | tee -a "$OUT/summary.txt"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
step "topology (nvidia-smi topo -m)"
nvidia-smi topo -m 2>&1 | tee "$OUT/topo.txt"

if [ "${SKIP_BUILD:-0}" = 1 ]; then
  step "build: skipped (SKIP_BUILD=1)"
else
  step "build: pip install --no-build-isolation --no-deps -e ."
  start=$SECONDS
  # (without PYTHONPATH: with the repository root on it, pip's build backend failed to import on the
  # GPU machine, 2026-11-30: "Cannot import 'scikit_build_core.build'")
  # bounded: a first build on a fresh machine, or a hang, would otherwise eat the call (the device kills it
  # at 600 s: no summary line, no tarball)
  pip_install() {
    bounded_run "${BUILD_TIMEOUT:-420}" env -u PYTHONPATH "$PY" -m pip install --no-build-isolation --no-deps -e . \
      "$@" >"$OUT/build.log" 2>&1
  }
  if ! pip_install; then
    if grep -q externally-managed-environment "$OUT/build.log"; then
      pip_install --break-system-packages || status=1
    else
      status=1
    fi
  fi
  if [ $status -ne 0 ]; then
    tail -40 "$OUT/build.log"
    echo "gpu_check: BUILD FAILED (log: $OUT/build.log)" | tee -a "$OUT/summary.txt"
    # what the call was for, by name: otherwise nothing says these parts did not run
    IFS=',' read -r -a parts <<<"${GPU_SUITE:-}"
    for part in "${parts[@]}"; do echo "gpu suite $part: not run (build failed)"; done | tee -a "$OUT/summary.txt"
    IFS=',' read -r -a parts <<<"${SWEEP:-}"
    for part in "${parts[@]}"; do echo "sweep $part: not run (build failed)"; done | tee -a "$OUT/summary.txt"
    exit 1
  fi
  echo "built in $((SECONDS - start)) s" | tee -a "$OUT/summary.txt"
fi

step "runtime"
bounded_run 120 "$PY" - 2>&1 <<'PYEOF' | tee "$OUT/runtime.txt"
import sys

from jax_ep import runtime

native = runtime.extension()
print("extension:", native.__file__ if native else runtime.extension_error())
print("FFI API built against:", native.FFI_API_VERSION if native else None)
print("available:", runtime.available())
if native is not None and runtime.available()[0]:
    ordinals = runtime.local_gpu_ordinals()
    print("local GPU ordinals:", ordinals)
    print("peer access matrix:", native.peer_access_matrix(ordinals))
sys.exit(0 if native is not None and runtime.available()[0] else 3)
PYEOF
# without the extension or a CUDA backend every GPU test skips (the cuda_backend fixture): that is no pass
runtime_rc=${PIPESTATUS[0]}
if [ "$runtime_rc" -ne 0 ]; then
  { if [ "$runtime_rc" = 3 ]; then echo "runtime: CUDA backend unavailable ($OUT/runtime.txt):"
    else echo "runtime: the probe failed (rc=$runtime_rc; $OUT/runtime.txt)"; fi
    grep -E "^(extension|available):" "$OUT/runtime.txt"; } | tee -a "$OUT/summary.txt"
  status=1
fi

if [ "${SKIP_TESTS:-0}" != 1 ]; then
step "GPU tests: pytest -m gpu tests/gpu"
start=$SECONDS
# PYTEST_ARGS: split at the start (parse_args)
bounded_run --int "${TESTS_TIMEOUT:-3000}" "$PY" -m pytest -m gpu tests/gpu -v -rs --durations=10 --junitxml="$OUT/gpu-tests.xml" \
  "${pytest_args[@]}" >"$OUT/gpu-tests.log" 2>&1
tests_rc=$?
tail -25 "$OUT/gpu-tests.log"
echo "gpu tests: $(rc_text $tests_rc) in $((SECONDS - start)) s (log: $OUT/gpu-tests.log)" | tee -a "$OUT/summary.txt"
[ $tests_rc -eq 0 ] || status=1
bounded_run 120 "$PY" -c "from jax_ep import runtime; print('device faults:', runtime.faults())" 2>&1 \
  | tee -a "$OUT/summary.txt"
fi

if [ "${SHARE_GPU:-0}" = 1 ]; then
  step "process-model-2 tests, processes on GPU 0 under CUDA MPS: pytest -m 'gpu and process_group' --share-gpu ${SHARE_PYTEST_ARGS:-}"
  start=$SECONDS
  # After the other GPU tests, in its own pytest: under MPS a device fault of one client (these tests
  # provoke some) ends every client of the GPU, and MPS takes no new client until they have all exited.
  export CUDA_MPS_PIPE_DIRECTORY="${MPS_PIPE_DIR:-/tmp/jax_ep_mps_pipe}" CUDA_MPS_LOG_DIRECTORY="$OUT/mps_log"
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  # a daemon answers at the control socket (a stopped one leaves the socket behind, and CUDA then runs
  # its clients without MPS, silently: jax_ep/mps.py connects to it; run by path, it imports no JAX,
  # which took 2-3 s a call, up to ~12 calls a run)
  mps_down() { "$PY" -c 'import runpy; runpy.run_path("jax_ep/mps.py", run_name="__main__")'; }
  stop_mps() {   # and wait for it to go, so that the next start does not meet a daemon shutting down
    # not skipped for DEADLINE: a daemon left running would serve the warm machine's next call
    echo quit | timeout -k 5 30 nvidia-cuda-mps-control
    for _ in $(seq 10); do mps_down >/dev/null && return; sleep 0.5; done
    echo "gpu_check: CUDA MPS still answers after quit"
  }
  started_mps=0
  if ! why=$(mps_down); then
    echo "CUDA MPS already running (pipes in $CUDA_MPS_PIPE_DIRECTORY): using it"
  else
    echo "CUDA MPS: $why; starting it"
    rm -f "$CUDA_MPS_PIPE_DIRECTORY/control"   # a stopped daemon's socket (nothing answers there)
    if bounded_run 60 nvidia-cuda-mps-control -d; then
      started_mps=1
      trap stop_mps EXIT   # stopped even if this script is interrupted
      for _ in $(seq 10); do mps_down >/dev/null || break; sleep 0.5; done
    fi
  fi
  if why=$(mps_down); then
    echo "gpu_check: could not start CUDA MPS ($why; nvidia-cuda-mps-control -d; logs in $CUDA_MPS_LOG_DIRECTORY)" | tee -a "$OUT/summary.txt"
    status=1
  else
    # one pytest per file, each bounded: a hang costs its own file's results, not the others' (their
    # output would be lost with the killed pytest)
    : >"$OUT/gpu-tests-shared.log"
    share_rc=0
    if [ "${SHARE_FILES:-}" = none ]; then
      share_files=""
    elif [ -n "${SHARE_FILES:-}" ]; then
      share_files=$(echo "$SHARE_FILES" | tr ',' '\n' | sed 's|.*|tests/gpu/test_&_gpu.py|')
    else
      share_files=$(grep -l "mark.process_group" tests/gpu/test_*.py)   # files with process-model-2 tests
    fi
    share_xmls=()
    for file in $share_files; do
      echo "---- $file" >>"$OUT/gpu-tests-shared.log"
      share_xmls+=("$OUT/gpu-tests-shared_$(basename "$file" .py).xml")
      rm -f "${share_xmls[-1]}"
      # JUnit XML per file: without it tools/gpu_tests_record.py counts from the log and marks the run incomplete
      bounded_run --int "${SHARE_FILE_TIMEOUT:-540}" "$PY" -m pytest -m "gpu and process_group" --share-gpu "$file" -v -rs \
        --durations=5 --junitxml="${share_xmls[-1]}" "${share_args[@]}" \
        >>"$OUT/gpu-tests-shared.log" 2>&1
      rc=$?
      [ $rc -eq 5 ] && rc=0   # no test of the marker in that file
      [ $rc -eq 0 ] || share_rc=$rc
      echo "$file: rc=$rc" | tee -a "$OUT/summary.txt"
      [ $((SECONDS - start)) -lt "${SHARE_TIMEOUT:-2400}" ] || { echo "SHARE_TIMEOUT reached"; share_rc=124; break; }
    done
    if [ -n "$share_files" ]; then
      # every test skipped (e.g. no extension, no MPS for the processes) or none collected is no pass
      share_passed=$("$PY" tools/gpu_tests_record.py --passed "${share_xmls[@]}") || share_passed=""
      if ! [[ $share_passed =~ ^[0-9]+$ ]]; then
        echo "gpu_check: could not count the passed tests of ${share_xmls[*]}: $share_passed" | tee -a "$OUT/summary.txt"
        share_rc=1
      elif [ "$share_passed" = 0 ] && [ $share_rc -eq 0 ]; then
        echo "process-model-2 tests on one GPU (MPS): no test passed (all skipped or none collected)" \
          | tee -a "$OUT/summary.txt"
        share_rc=1
      fi
      tail -25 "$OUT/gpu-tests-shared.log"
      echo "process-model-2 tests on one GPU (MPS): rc=$share_rc in $((SECONDS - start)) s (log: $OUT/gpu-tests-shared.log)" | tee -a "$OUT/summary.txt"
    fi
    [ $share_rc -eq 0 ] || status=1
    if [ -n "${SHARE_BENCH:-}" ]; then
      start=$SECONDS
      # N processes share the GPU: each preallocating 0.6 of it leaves no room (session 53 lost a run to it)
      XLA_PYTHON_CLIENT_MEM_FRACTION=${user_mem_fraction:-0.2} bounded_run "${SHARE_FILE_TIMEOUT:-540}" \
        "$PY" -m jax_ep.launch --nproc "$SHARE_BENCH" --share-gpus tests/gpu/process_group_worker.py \
        --bench "$OUT/share_bench.json" "${bench_args[@]}" >"$OUT/share_bench.log" 2>&1
      rc=$?
      grep -E "bench |Error" "$OUT/share_bench.log" | cut -c1-200 | head -40
      echo "process-model-2 benchmark, $SHARE_BENCH processes on one GPU (MPS): $(rc_text $rc) in $((SECONDS - start)) s" \
        "(log: $OUT/share_bench.log)" | tee -a "$OUT/summary.txt"
      [ $rc -eq 0 ] || status=1
    fi
  fi
  if [ $started_mps = 1 ]; then
    stop_mps
    trap - EXIT
  fi
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
fi

if [ "${SKIP_BENCH:-0}" != 1 ] && [ -f benchmarks/ops.py ]; then
  step "benchmark: python -m benchmarks --out $OUT/bench.json"
  start=$SECONDS
  # shellcheck disable=SC2086
  bounded_run "${BENCH_TIMEOUT:-3000}" "$PY" -m benchmarks --out "$OUT/bench.json" ${BENCH_ARGS:-} >"$OUT/bench.log" 2>&1
  bench_rc=$?
  tail -60 "$OUT/bench.log"
  echo "bench: $(rc_text $bench_rc) in $((SECONDS - start)) s (log: $OUT/bench.log)" | tee -a "$OUT/summary.txt"
  [ $bench_rc -eq 0 ] || status=1
fi

if [ "${SKIP_LAYER:-0}" != 1 ]; then
  step "layer benchmark: python -m benchmarks --layer --profile --out $OUT/bench_layer.json"
  start=$SECONDS
  # shellcheck disable=SC2086
  bounded_run 3000 "$PY" -m benchmarks --layer --profile --out "$OUT/bench_layer.json" ${LAYER_ARGS:-} >"$OUT/bench_layer.log" 2>&1
  layer_rc=$?
  layer_said=$(rc_text $layer_rc)
  tail -12 "$OUT/bench_layer.log"
  bounded_run 60 "$PY" tools/plot_bench.py "$OUT/bench_layer.json" "$OUT/bench_layer.png" \
    || { [ $layer_rc -ne 0 ] || layer_said="rc=1 (plot)"; layer_rc=1; }
  echo "layer bench: $layer_said in $((SECONDS - start)) s (log: $OUT/bench_layer.log)" | tee -a "$OUT/summary.txt"
  [ $layer_rc -eq 0 ] || status=1
fi

if [ "${GEMM:-0}" = 1 ]; then
  gemm_steps=",${GEMM_STEPS:-tests,tune,profile},"
  step "grouped GEMM (${GEMM_STEPS:-tests,tune,profile}): GPU tests, tuning at ${GEMM_SHAPES:-layers}, profile"
  start=$SECONDS
  gemm_rc=0
  if [[ $gemm_steps == *,tests,* ]]; then
    k_filter=()
    [ -n "${GEMM_TEST_K:-}" ] && k_filter=(-k "$GEMM_TEST_K")
    bounded_run --int 400 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_gemm_gpu.py "${k_filter[@]}" \
      --junitxml="$OUT/gemm_tests.xml" >"$OUT/gemm_tests.log" 2>&1 || gemm_rc=1
    tail -3 "$OUT/gemm_tests.log"
  fi
  if [[ $gemm_steps == *,tune,* ]]; then
    # shellcheck disable=SC2086
    bounded_run "${GEMM_TUNE_TIMEOUT:-540}" "$PY" tools/tune_gemm.py --shapes "${GEMM_SHAPES:-layers}" \
      --kernels "${GEMM_KERNELS:-all}" --passes "${GEMM_PASSES-forward,dx,dw}" --quick \
      ${GEMM_TUNE_EXTRA---fp8 --block deepseek_ep2,mid_ep2} --report "$OUT/gemm_tune.json" \
      >"$OUT/gemm_tune.log" 2>&1 || gemm_rc=1
    grep -E "^(forward|dx|dw|block|fp8) |table's config|WRONG" "$OUT/gemm_tune.log"
    cp jax_ep/gemm_configs.json "$OUT/gemm_configs.json"
  fi
  if [[ $gemm_steps == *,profile,* ]]; then
    # what the DeepSeek-V3 layer's per-rank expert work at EP2 is made of, kernel by kernel (one GPU)
    for config in ${GEMM_PROFILE_CONFIGS:-jax_ep}; do
      log="$OUT/gemm_profile.log"
      [ "$config" = jax_ep ] || log="$OUT/gemm_profile_$config.log"
      bounded_run 240 "$PY" tools/profile_layer.py deepseek "$config" --experts 128 --top 30 \
        >"$log" 2>&1 || gemm_rc=1
      grep -E "^step|^weight quantisation" "$log"
      tail -45 "$log"
    done
  fi
  echo "gemm: rc=$gemm_rc in $((SECONDS - start)) s (logs: $OUT/gemm_*.log)" | tee -a "$OUT/summary.txt"
  [ $gemm_rc -eq 0 ] || status=1
fi

if [ "${GEMM_PEERS:-0}" = 1 ]; then
  step "grouped GEMM vs tokamax vs dense dot: tools/tune_gemm.py --compare"
  start=$SECONDS
  peers_dir="${TMPDIR:-/tmp}/jax_ep_gemm_peers"
  PYTHON="$PY" bounded_run 120 bash tools/gemm_peers.sh install "$peers_dir" >"$OUT/gemm_peers_install.log" 2>&1 \
    || echo "tokamax not installed (log: $OUT/gemm_peers_install.log)"
  PYTHONPATH="$peers_dir:${PYTHONPATH:-}" bounded_run 900 "$PY" tools/tune_gemm.py \
    --shapes "${GEMM_PEERS_SHAPES:-layers}" --passes "" --compare --out "${TMPDIR:-/tmp}/gemm_configs_peers.json" \
    --report "$OUT/gemm_peers.json" >"$OUT/gemm_peers.log" 2>&1
  peers_rc=$?
  grep -E "^peers|dense bf16" "$OUT/gemm_peers.log"
  echo "gemm peers: $(rc_text $peers_rc) in $((SECONDS - start)) s (log: $OUT/gemm_peers.log)" | tee -a "$OUT/summary.txt"
  [ $peers_rc -eq 0 ] || status=1
fi

if [ "${PG_BENCH:-0}" = 1 ]; then
  step "process model 2 benchmark: 2 processes x 1 GPU (tests/gpu/process_group_worker.py --bench)"
  start=$SECONDS
  bounded_run 500 "$PY" -m jax_ep.launch --nproc 2 --timeout 480 tests/gpu/process_group_worker.py \
    --bench "$OUT/bench_pg.json" >"$OUT/pg_bench.log" 2>&1
  pg_rc=$?
  grep -E "bench|OK" "$OUT/pg_bench.log"
  echo "process model 2 bench: $(rc_text $pg_rc) in $((SECONDS - start)) s" | tee -a "$OUT/summary.txt"
  [ $pg_rc -eq 0 ] || { status=1; tail -40 "$OUT/pg_bench.log"; }
fi

# ncu_pages BASE VIEW...: BASE.ncu-rep's details page as BASE.txt and its source page per VIEW (sass,
# cuda) as BASE.source_VIEW.csv
ncu_pages() {
  local base=$1 view
  shift
  bounded_run 120 ncu --import "$base.ncu-rep" --page details --print-units base >"$base.txt" 2>&1
  for view in "$@"; do
    bounded_run 120 ncu --import "$base.ncu-rep" --page source --csv --print-source "$view" >"$base.source_$view.csv" 2>&1 || true
  done
}

NCU_DEFAULT_SECTIONS="--section SpeedOfLight --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
--section ComputeWorkloadAnalysis --section SchedulerStats --section WarpStateStats --section LaunchStats \
--section Occupancy"

if [ "${GEMM_NCU:-0}" = 1 ]; then
  step "ncu: the grouped GEMM kernels, bf16 and FP8 (tools/gemm_ncu.py under ncu)"
  start=$SECONDS
  mkdir -p "$OUT/gemm_ncu"
  for shape in ${GEMM_NCU_SHAPES:-gate_up}; do
    # the 5 warm-up launches skipped, then one launch of each kernel (tools/gemm_ncu.py --print-order);
    # SourceCounters: stall reasons per instruction
    # shellcheck disable=SC2086
    bounded_run 300 ncu --clock-control none ${NCU_SECTIONS:-$NCU_DEFAULT_SECTIONS} --section SourceCounters \
      -k regex:mosaic --launch-skip 5 --launch-count 5 -f -o "$OUT/gemm_ncu/$shape" \
      "$PY" tools/gemm_ncu.py --shape "$shape" >"$OUT/gemm_ncu/$shape.log" 2>&1
    gemm_ncu_rc=$?
    grep -E "^launched" "$OUT/gemm_ncu/$shape.log"
    ncu_pages "$OUT/gemm_ncu/$shape" sass
    grep -E "Duration|DRAM Throughput|Compute \(SM\) Th|Executed Ipc A|No Eligible|Registers Per" \
      "$OUT/gemm_ncu/$shape.txt" | tee -a "$OUT/summary.txt"
    [ $gemm_ncu_rc -eq 0 ] || status=1
  done
  tar -C "$OUT" -czf "$OUT/gemm_ncu.tar.gz" gemm_ncu && rm -rf "$OUT/gemm_ncu"
  echo "gemm ncu: in $((SECONDS - start)) s" | tee -a "$OUT/summary.txt"
fi

if [ "${NCU:-0}" = 1 ]; then
  step "ncu: the EP main kernels (tools/ep_tune.py under ncu)"
  start=$SECONDS
  mkdir -p "$OUT/ncu"
  # name | kernels | launches | ep_tune arguments. bf16: each op's first calls (the warm-up, the
  # timed chain and the handle's dispatch), so every main kernel is caught at least twice.
  sections="${NCU_SECTIONS:-$NCU_DEFAULT_SECTIONS}"
  jobs=("expert_major|dispatch_main|combine_main|broadcast_main|9|--dtypes bfloat16"
        "expert_major_fp8|dispatch_main|dispatch_main|dispatch_main|1|--dtypes float8_e4m3fn"
        "rank_major|dispatch_main|combine_main|broadcast_main|9|--dtypes bfloat16 --rank-major")
  # NCU_JOBS: other jobs, ';'-separated, in the same form (name|k1|k2|k3|launches|ep_tune args)
  [ -n "${NCU_JOBS:-}" ] && IFS=';' read -r -a jobs <<<"$NCU_JOBS"
  for job in "${jobs[@]}"; do
    IFS='|' read -r name k1 k2 k3 count extra <<<"$job"
    # shellcheck disable=SC2086
    bounded_run 240 ncu --clock-control none $sections -k "regex:${k1}|${k2}|${k3}" --launch-count "$count" \
      -f -o "$OUT/ncu/$name" "$PY" tools/ep_tune.py --splits 6:8:1 --iters 1 --repeats 1 $extra \
      ${NCU_ARGS:-} >"$OUT/ncu/$name.log" 2>&1
    ncu_rc=$?
    tail -5 "$OUT/ncu/$name.log"
    # per-instruction samples (stall reasons): only with --section SourceCounters in NCU_SECTIONS
    ncu_pages "$OUT/ncu/$name" sass cuda
    grep -E "^  [a-z_]+kernel|Duration|DRAM Throughput|L1/TEX Cache Throughput|Executed Ipc A|Compute \(SM\) Th" \
      "$OUT/ncu/$name.txt" | tee -a "$OUT/summary.txt"
    [ $ncu_rc -eq 0 ] || status=1
  done
  tar -C "$OUT" -czf "$OUT/ncu.tar.gz" ncu && rm -rf "$OUT/ncu"
  echo "ncu: in $((SECONDS - start)) s" | tee -a "$OUT/summary.txt"
fi

if [ -n "${SWEEP:-}" ]; then
  visible_gpus
  tokens="--tokens ${SWEEP_TOKENS:-128,512,2048,4096,8192}"
  presets="--preset ${SWEEP_PRESETS:-deepseek,sparse}"
  timing="--profile --iters 5 --repeats 2"
  IFS=',' read -r -a parts <<<"$SWEEP"
  IFS=',' read -r -a sweep_eps <<<"${SWEEP_EP:-}"
  [ ${#sweep_eps[@]} -gt 0 ] || sweep_eps=("")
  for part in "${parts[@]}"; do
   for ep in "${sweep_eps[@]}"; do
    lim=$(bounded "${SWEEP_PART_TIMEOUT:-900}")
    name=$part${ep:+_ep$ep}   # the records' and log's name
    visible=()
    if [ -n "$ep" ]; then
      if [ "$part" = pg ] || [ "$ep" -gt "$gpus" ] || [ "$ep" -lt 1 ]; then
        echo "sweep $part at EP$ep: not run (SWEEP_EP takes 1..$gpus GPUs, and not the pg part)" | tee -a "$OUT/summary.txt"
        status=1; continue
      fi
      visible=(env CUDA_VISIBLE_DEVICES="$(first_gpus "$ep")")
    fi
    case $part in
      em) cmd=("$PY" -m benchmarks $presets $tokens $timing --backends cuda,dense,reference,ragged) ;;
      rm) cmd=("$PY" -m benchmarks --rank-major $presets $tokens $timing --backends cuda,reference) ;;
      ll) cmd=("$PY" -m benchmarks --low-latency --tokens 1,128 $timing --backends cuda,reference) ;;
      layer) cmd=("$PY" -m benchmarks --layer --profile --layer-shapes mid,deepseek
                  --layer-configs ep_reference,ep_cuda,jax_ep) ;;
      overlap) cmd=("$PY" -m benchmarks --layer --profile --layer-shapes deepseek_shared --iters 10 --repeats 3
                    --sustain 2 --layer-configs jax_ep,jax_ep_shared_beside,ep_cuda,ep_cuda_sms24,ep_cuda_shared_beside_sms24,ep_cuda_wgrad_beside_side12,ep_cuda_wgrad_beside_side24,ep_cuda_shared_beside_side24,ep_cuda_shared_split_side24) ;;
      gate) cmd=("$PY" -m benchmarks --layer --profile --layer-shapes deepseek --iters 10 --repeats 3 --sustain 2
                 --layer-configs jax_ep,jax_ep_gate_in_combine,jax_ep_fp8_cached,jax_ep_fp8_cached_gate_in_combine) ;;
      pull) cmd=("$PY" -m benchmarks --preset deepseek --tokens 4096 --backends cuda --num-sms 24,131
                 --pull both --profile --iters 10 --repeats 3) ;;
      decode) cmd=("$PY" -m benchmarks --layer --layer-shapes deepseek_decode_shared --iters 10 --repeats 3
                   --layer-configs jax_ep,jax_ep_shared_beside,ep_cuda,ep_cuda_shared_beside) ;;
      remat) cmd=("$PY" -m benchmarks --layer --profile --layer-shapes deepseek --iters 10 --repeats 3 --sustain 2
                  --layer-configs jax_ep,jax_ep_remat,jax_ep_remat_dispatch,jax_ep_remat_gate_up) ;;
      pg) cmd=(env JAX_EP_TEST_EP_RANKS="$gpus" "$PY" -m jax_ep.launch --nproc "$gpus"
               --timeout $((lim > 30 ? lim - 10 : 20)) tests/gpu/process_group_worker.py) ;;
      *) echo "gpu_check: unknown SWEEP part '$part' (em, rm, ll, layer, overlap, gate, pull, decode, remat, pg)" | tee -a "$OUT/summary.txt"
         status=1; continue ;;
    esac
    if [ "$part" = pg ] && [ "$gpus" -lt 2 ]; then  # one process alone is process model 1
      echo "sweep pg: not run: needs 2 or more GPUs (on one GPU: SHARE_GPU=1)" | tee -a "$OUT/summary.txt"
      status=1; continue
    fi
    [ "$part" = pg ] || cmd+=(--out "$OUT/sweep_$name.json")
    step "sweep $part on ${ep:-$gpus} GPUs: ${visible[*]} ${cmd[*]}"
    start=$SECONDS
    bounded_run "${SWEEP_PART_TIMEOUT:-900}" "${visible[@]}" "${cmd[@]}" >"$OUT/sweep_$name.log" 2>&1
    rc=$?
    if [ "$part" = pg ]; then grep -E "worker OK|FAILED|Error" "$OUT/sweep_$name.log" | cut -c1-300
    else tail -30 "$OUT/sweep_$name.log"; fi
    if [ "$part" = pull ] && [ $rc -eq 0 ]; then  # the decisions it implies, on a copy of the table
      bounded_run 60 "$PY" -m benchmarks.auto_table "$OUT/sweep_$name.json" --table "$OUT/auto_table_pull.json" 2>&1 \
        | grep -E "pull|Error" | tee -a "$OUT/summary.txt"
    fi
    echo "sweep $name: $(rc_text $rc) in $((SECONDS - start)) s (log: $OUT/sweep_$name.log)" | tee -a "$OUT/summary.txt"
    [ $rc -eq 0 ] || status=1
   done
  done
fi

if [ -n "${GPU_SUITE:-}" ]; then
  visible_gpus
  if [ "$gpus" -lt 1 ]; then   # else every part ran at --ep-ranks 0, recorded as "0x NVIDIA"
    echo "gpu suite ${GPU_SUITE}: not run: no GPU listed (nvidia-smi -L, CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-unset})" \
      | tee -a "$OUT/summary.txt"
    status=1
    GPU_SUITE=""
  fi
fi
if [ -n "${GPU_SUITE:-}" ]; then
  ranks="${GPU_SUITE_RANKS:-$gpus}"
  # the name of the first visible GPU (when CUDA_VISIBLE_DEVICES names it by ordinal), else of GPU 0. One
  # pass over the listing: "grep -m1 || head -1" under pipefail printed the name twice when grep's early
  # exit broke nvidia-smi's pipe
  name=$(nvidia-smi -L | sed -nE "s/^GPU ([0-9]+): (NVIDIA )?([^ (]+).*/\1 \3/p" \
    | awk -v want="${gpu_ids[0]}" 'NR == 1 {first = $2} $1 == want {print $2; found = 1; exit}
                                   END {if (!found) print first}' | tr 'A-Z' 'a-z')
  # the groups: m1c and pgb take every file the others leave, so a new test file is never left out
  all_files=$(ls tests/gpu/test_*.py)
  pg_files=$(grep -l "mark.process_group" $all_files)
  m1a="tests/gpu/test_dispatch_gpu.py tests/gpu/test_layout_gpu.py tests/gpu/test_peer_smoke_gpu.py"
  # the GEMM file alone took over 8 minutes at EP2 (2026-11-29): two parts, split by -k
  m1g="tests/gpu/test_gemm_gpu.py"
  m1h=$m1g
  m1k=$m1g
  m1b="tests/gpu/test_rank_major_gpu.py"
  pga="tests/gpu/test_process_group_gpu.py tests/gpu/test_hierarchical_gpu.py"
  others() { local f; for f in $1; do case " $2 " in *" $f "*) ;; *) printf '%s ' "$f" ;; esac; done; }
  m1c=$(others "$all_files" "$m1a $m1b $m1g")
  pgb=$(others "$pg_files" "$pga")
  # suite_pytest TAG LIMIT ARGS...: one bounded pytest (-v, JUnit XML) logging to $OUT/gpu_suite_TAG.log;
  # cut with SIGINT so that pytest still writes the XML of what it finished. Sets rc, and ran=0 when
  # DEADLINE left no time to start it.
  suite_pytest() {
    local tag=$1 lim
    lim=$(bounded "$2")
    shift 2
    xml="$OUT/gpu_suite_$tag.xml"
    rm -f "$xml"
    ran=0
    echo "---- $*" >"$OUT/gpu_suite_$tag.log"
    if [ "$lim" = 0 ]; then
      echo "SKIPPED: DEADLINE ($DEADLINE s) reached: $*" | tee -a "$OUT/gpu_suite_$tag.log"
      rc=124; return
    fi
    ran=1
    local extra=() i k="$part_k"
    for ((i = 0; i < ${#suite_args[@]}; i++)); do
      if [ "${suite_args[i]}" = -k ] && [ -n "$part_k" ]; then
        k="($part_k) and (${suite_args[i + 1]})"; i=$((i + 1))
      else
        extra+=("${suite_args[i]}")
      fi
    done
    [ -z "$k" ] || extra+=(-k "$k")
    timeout -s INT -k 10 "$lim" "${part_env[@]}" "$PY" -m pytest "$@" -v -rs --durations=10 --junitxml="$xml" "${extra[@]}" \
      >>"$OUT/gpu_suite_$tag.log" 2>&1
    rc=$?
  }
  # record PART TAG MODEL COMMAND [--repeat]: the part's XML and log into the record; 1 if it failed or was cut.
  # The GPU count is what the part saw: model 1 the first $ranks GPUs, model 2 every visible one.
  record() {
    local count=$gpus
    [ "$3" = 2 ] || count=$ranks
    "$PY" tools/gpu_tests_record.py --junit "$OUT/gpu_suite_$2.xml" --log "$OUT/gpu_suite_$2.log" --rc "$rc" \
      --part "$1" --ep-size "$ranks" --process-model "$3" --device "${count}x NVIDIA $(echo "$name" | tr 'a-z' 'A-Z')" \
      --record "$OUT/gpu_tests_${name}x${count}_ep${ranks}_pm$3.json" --command "$4" "${@:5}" \
      | tee -a "$OUT/summary.txt"
    return "${PIPESTATUS[0]}"
  }
  IFS=',' read -r -a parts <<<"$GPU_SUITE"
  for part in "${parts[@]}"; do
    part_k=""   # the part's own -k selection, joined with GPU_SUITE_ARGS' -k by "and"
    case $part in
      m1a|m1b|m1c) model=1; files=${!part}; args=(-m "gpu and not process_group" --ep-ranks "$ranks") ;;
      m1g|m1h|m1k) model=1; files=${!part}; args=(-m "gpu and not process_group" --ep-ranks "$ranks")
               sweeps="each_config or ring_weight_gradient"   # the kernel-config sweeps: m1k, not m1g
               case $part in
                 m1g) part_k="not fp8 and not ($sweeps)" ;;
                 m1k) part_k="not fp8 and ($sweeps)" ;;
                 *) part_k=fp8 ;;
               esac ;;
      pga|pgb) model=2; files=${!part}; args=(-m "gpu and process_group" --processes "$ranks") ;;
      pg) model=2; files=$(echo $pg_files); args=(-m "gpu and process_group" --processes "$ranks") ;;
      pgrep) model=2; files="tests/gpu/test_process_group_gpu.py::test_process_per_gpu_matches_reference"
             args=(-m "gpu and process_group" --processes "$ranks") ;;
      *) echo "gpu_check: unknown GPU_SUITE part '$part' (m1a, m1g, m1h, m1k, m1b, m1c, pga, pgb, pg, pgrep)" | tee -a "$OUT/summary.txt"
         status=1; continue ;;
    esac
    if [ "$ranks" -gt "$gpus" ] || { [ "$model" = 2 ] && [ "$ranks" -lt 2 ]; }; then
      echo "gpu suite $part: not run: $ranks ranks on $gpus GPUs" | tee -a "$OUT/summary.txt"
      status=1; continue
    fi
    # model 1 sees only the GPUs it runs on: the GEMM layer, peer_smoke, shrink, rank_mask and fingerprint
    # tests take every visible GPU, so GPU_SUITE_RANKS=1 on 4 GPUs ran them at EP4 in an "ep1" record
    part_env=()
    [ "$model" = 2 ] || part_env=(env CUDA_VISIBLE_DEVICES="$(first_gpus "$ranks")")
    step "gpu suite $part (process model $model, $ranks ranks on separate GPUs): $files"
    start=$SECONDS
    part_rc=0
    part_said=""
    if [ "$part" = pgrep ]; then
      IFS=',' read -r -a settings <<<"${PG_AUTOTUNING:-off,on}"
      for autotuning in "${settings[@]}"; do
        case $autotuning in on|off) ;; *)
          echo "gpu_check: unknown PG_AUTOTUNING setting '$autotuning' (on, off)" | tee -a "$OUT/summary.txt"
          part_rc=1; continue ;;
        esac
        for i in $(seq "${PG_REPEATS:-3}"); do
          tag="pgrep_${autotuning}_ep${ranks}"
          if [ -n "${DEADLINE:-}" ] && [ $((DEADLINE - SECONDS - 15)) -lt "${PG_RUN_S:-240}" ]; then
            # a run cut by the deadline would count as a fault: stop before it (not a failure)
            echo "pgrep shard_autotuning=$autotuning run $i: not run: DEADLINE leaves under PG_RUN_S=${PG_RUN_S:-240} s" \
              | tee -a "$OUT/summary.txt"
            break 2
          fi
          # shellcheck disable=SC2086
          JAX_EP_TEST_SHARD_AUTOTUNING=$autotuning JAX_EP_TEST_PG_CHECKS=${PG_CHECKS:-} \
            suite_pytest "$tag" "${GPU_SUITE_PART_TIMEOUT:-530}" \
            "${args[@]}" $files
          echo "pgrep shard_autotuning=$autotuning run $i: rc=$rc" | tee -a "$OUT/summary.txt"
          if [ $ran = 1 ]; then
            record "pgrep_$autotuning" "$tag" 2 \
              "JAX_EP_TEST_SHARD_AUTOTUNING=$autotuning${PG_CHECKS:+ JAX_EP_TEST_PG_CHECKS=$PG_CHECKS} pytest ${args[*]} $files" \
              --repeat || part_rc=1
          else
            part_rc=124
          fi
          cat "$OUT/gpu_suite_$tag.log" >>"$OUT/gpu_suite_pgrep_ep${ranks}.log"
          rm -f "$OUT/gpu_suite_$tag.log" "$OUT/gpu_suite_$tag.xml"
        done
      done
      tail -15 "$OUT/gpu_suite_pgrep_ep${ranks}.log" 2>/dev/null
    else
      tag="${part}_ep${ranks}"
      # shellcheck disable=SC2086
      suite_pytest "$tag" "${GPU_SUITE_PART_TIMEOUT:-530}" "${args[@]}" $files
      tail -15 "$OUT/gpu_suite_$tag.log"
      if [ $ran = 0 ]; then
        part_rc=124   # not run: nothing to record (an empty entry would replace an earlier run's)
        part_said="not run (DEADLINE)"
      else
        record "$part" "$tag" "$model" "pytest ${args[*]} $files${part_k:+ -k '$part_k'} ${GPU_SUITE_ARGS:-}" \
          || part_rc=1
      fi
    fi
    echo "gpu suite $part: ${part_said:-rc=$part_rc} in $((SECONDS - start)) s (log: $OUT/gpu_suite_${part}_ep${ranks}.log)" \
      | tee -a "$OUT/summary.txt"
    [ $part_rc -eq 0 ] || status=1
  done
fi

echo "gpu_check: $([ $status -eq 0 ] && echo OK || echo FAILED) (logs in $OUT)" | tee -a "$OUT/summary.txt"
# the device machines return at most 8 files of $OUT, their choice which: unless TAR_OUT says, tar when
# more would be left, so that summary.txt and the records are sure to come back
tar_out=${TAR_OUT:-}
[ -n "$tar_out" ] || { [ "$(find "$OUT" -mindepth 1 ! -type d | wc -l)" -gt 8 ] && tar_out=1; }
if [ "$tar_out" = 1 ]; then
  # the gpu_tests records stay out of it: they are what a GPU_SUITE call returns
  keep=(! -name summary.txt ! -name gpu_check.tar.gz ! -name 'gpu_tests_*.json')
  (cd "$OUT" && find . -mindepth 1 -maxdepth 1 "${keep[@]}" -printf '%P\n' | tar -czf gpu_check.tar.gz -T - \
     && find . -mindepth 1 -maxdepth 1 "${keep[@]}" -exec rm -rf {} +)
fi
exit $status
