#!/usr/bin/env bash
# GPU validation of seqpack, for a machine with an NVIDIA GPU, the CUDA toolkit
# (nvcc), a CUDA build of PyTorch and no network (nothing is downloaded: the build
# uses the current environment's scikit-build-core, pybind11 and CMake).
#
#   bash scripts/gpu_check.sh [OUT_DIR]        (default build/gpu_check/<date>)
#
# Steps, each logging to a file under OUT_DIR and printing a one-line summary:
#   env        nvidia-smi, nvcc, Python / PyTorch / torch.version.cuda, git HEAD, date -> env.txt
#   build      pip install --no-build-isolation into the current Python (CMake build dir
#              build/gpu, GoogleTest suite on; CUDAARCHS from the environment passes through),
#              then seqpack.build_info() must report CUDA objects and a device
#   ctest      the GoogleTest suite of build/gpu
#   gpu-tests  every pytest test marked gpu -> gpu_tests.xml (JUnit)
#   bench      the GPU benchmarks benchmarks/bench_gpu.py -> gpu.csv,
#              benchmarks/bench_stream_memory.py -> stream_memory.csv and
#              benchmarks/bench_prefix_reuse.py --device cuda (bf16) -> prefix_reuse.csv
#   sanitizer  compute-sanitizer memcheck / racecheck / synccheck / initcheck over a
#              small subset of the GPU tests (last: the slowest step)
# A failing step does not stop the later ones (a failed build skips what needs it);
# the script ends with a table of step -> status and exits non-zero if any step failed.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

OUT=${1:-build/gpu_check/$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
elif command -v python >/dev/null 2>&1; then
  PY=python
else
  PY=python3
fi

# nvcc and compute-sanitizer often live in the toolkit's bin/ without being on PATH.
CUDA_BIN=""
for dir in "${CUDA_HOME:-}" "${CUDA_PATH:-}" /usr/local/cuda; do
  if [ -n "$dir" ] && [ -x "$dir/bin/nvcc" ]; then CUDA_BIN="$dir/bin"; break; fi
done
if ! command -v nvcc >/dev/null 2>&1 && [ -n "$CUDA_BIN" ]; then
  export PATH="$CUDA_BIN:$PATH"
fi

# The sanitizer's subset: fast tests covering both kernels' vectorised and scalar
# paths, grid-stride loops, masked/NaN rows, vocabulary slices, misaligned and
# strided views, empty batches and zero-size rows (names in tests/python/*/test_*_gpu.py).
SANITIZER_TESTS="(test_logprobs_match_torch and 1027) or test_masked_all_masked_and_nan_rows"
SANITIZER_TESTS+=" or (test_vocab_start_slice and 384) or (test_misaligned_and_strided and bf16)"
SANITIZER_TESTS+=" or test_empty_batch or (test_more_rows_than_one_grid and bf16) or test_pack_many_sequences"
SANITIZER_TESTS+=" or test_zero_size_trailing or test_cuda_gradients_and_stream"
# SANITIZER_TOOLS="memcheck racecheck" runs a subset (a short lease).
read -r -a SANITIZER_TOOLS <<<"${SANITIZER_TOOLS:-memcheck racecheck synccheck initcheck}"
# initcheck watches seqpack's kernels only (kernel names containing "seqpack"): some
# PyTorch kernels read padding they never wrote. SANITIZER_INITCHECK_FILTER= checks all.
SANITIZER_INITCHECK_FILTER=${SANITIZER_INITCHECK_FILTER-kns=seqpack}
# A hung step must not hold the machine forever (seconds; needs coreutils timeout).
STEP_TIMEOUT=${STEP_TIMEOUT:-3600}
LIMIT=()
if command -v timeout >/dev/null 2>&1; then LIMIT=(timeout "$STEP_TIMEOUT"); fi

NAMES=()
STATES=()
FAILED=0
BUILD_OK=0

record() {  # record NAME STATUS [DETAIL]: one summary line now, one table row at the end
  local name=$1 status=$2 detail=${3:-}
  NAMES+=("$name")
  STATES+=("$status${detail:+ ($detail)}")
  case $status in FAILED*) FAILED=1 ;; esac
  printf '%-22s %s\n' "$name" "$status${detail:+ ($detail)}"
}

# run_logged LOG FUNCTION [ARGS...]: runs the step in a subshell under set -e with its
# output in LOG and leaves the exit status in RC. Call it as a plain command (never
# in `if` or `||`, where bash would ignore set -e inside the step).
RC=0
run_logged() {
  local log=$1
  shift
  set +e
  ( set -e; "$@" ) >"$log" 2>&1
  RC=$?
  set -e
}

# The pytest summary line of a log ("190 passed, 2 skipped in 51.2s").
pytest_line() {
  grep -E '[0-9]+ (passed|failed|errors?|skipped|deselected)' "$1" 2>/dev/null | grep -v 'SUMMARY' | tail -n 1 \
    | tr -s '=' | sed 's/^ *= *//; s/ *= *$//' || true
}

# ---- (a) environment -------------------------------------------------------------
env_report() {
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ) (local: $(date))"
  echo "git HEAD: $(git rev-parse HEAD 2>/dev/null || echo 'not a git checkout')"
  echo "git status --short:"
  git status --short 2>/dev/null || true
  echo "CUDAARCHS: ${CUDAARCHS:-<unset: the project default>}"
  echo "host: $(uname -a)"
  echo
  echo "== nvidia-smi"
  nvidia-smi || echo "nvidia-smi failed or is missing"
  echo
  echo "== nvcc --version ($(command -v nvcc || echo 'not found'))"
  nvcc --version || echo "nvcc is missing: the CUDA objects cannot be built"
  echo
  echo "== cmake --version"
  cmake --version || echo "cmake is not on PATH (the build may still find the Python cmake package)"
  echo
  echo "== python ($(command -v "$PY"))"
  "$PY" - <<'EOF'
import importlib, platform, sys
print("python", sys.version.replace("\n", " "), platform.platform())
for name in ("torch", "numpy", "scikit_build_core", "pybind11", "pytest", "hypothesis", "cmake", "ninja"):
    try:
        module = importlib.import_module(name)
        print(f"{name} {getattr(module, '__version__', '?')}")
    except Exception as err:  # noqa: BLE001
        print(f"{name}: not importable ({type(err).__name__}: {err})")
import torch
print("torch.version.cuda", torch.version.cuda)
print("torch.cuda.is_available()", torch.cuda.is_available())
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        print(f"device {i}: {p.name}, sm_{p.major}{p.minor}, {p.total_memory / 2**30:.1f} GiB")
EOF
}

env_summary() {
  local gpu torch_line
  gpu=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -n 1 || true)
  torch_line=$("$PY" -c 'import torch; print(f"torch {torch.__version__} CUDA {torch.version.cuda} available={torch.cuda.is_available()}")' 2>/dev/null || echo "torch not importable")
  echo "${gpu:-no nvidia-smi}; $(nvcc --version 2>/dev/null | grep -o 'release [0-9.]*' || echo 'no nvcc'); $torch_line"
}

run_logged "$OUT/env.txt" env_report
if [ "$RC" = 0 ]; then
  record "env" "ok" "$(env_summary); $OUT/env.txt"
else
  record "env" "incomplete" "$(env_summary); some queries failed, see $OUT/env.txt"
fi

# ---- (b) build and install ---------------------------------------------------------
build() {
  echo "CUDAARCHS=${CUDAARCHS:-<unset>}"
  "$PY" -c 'import scikit_build_core, pybind11' || {
    echo "scikit-build-core and pybind11 must be installed for a --no-build-isolation build (no network here)"
    return 1
  }
  "$PY" -m pip install --no-build-isolation --no-deps -v . \
    --config-settings=build-dir=build/gpu \
    --config-settings=cmake.define.SEQPACK_BUILD_TESTS=ON
  # From tests/, so that `import seqpack` is the installed package.
  (cd tests && "$PY" -c 'import seqpack; print(seqpack.build_info())')
  (cd tests && "$PY" - <<'EOF'
import seqpack
info = seqpack.build_info()
if not info["built_with_cuda"]:
    raise SystemExit("seqpack was built without its CUDA objects (nvcc not found by CMake?)")
if info["cuda_device_count"] <= 0:
    raise SystemExit(f"seqpack's CUDA runtime {info['cuda_runtime_version']} sees no device (driver too old?)")
EOF
  )
}

build_summary() {
  cd "$ROOT/tests"
  "$PY" - <<'EOF'
import seqpack
i = seqpack.build_info()
print("built_with_cuda=%s archs=%s devices=%s runtime=%s" % (
    i["built_with_cuda"], ",".join(i["cuda_architectures"]), i["cuda_device_count"], i["cuda_runtime_version"]))
EOF
}

run_logged "$OUT/build.log" build
if [ "$RC" = 0 ]; then
  BUILD_OK=1
  record "build" "ok" "$( (build_summary) 2>/dev/null || echo 'build_info unavailable')"
  (cd tests && "$PY" -c 'import seqpack; print(seqpack.build_info())') || true
else
  record "build" "FAILED" "see $OUT/build.log"
fi

# ---- (c) GoogleTest ----------------------------------------------------------------------
if [ "$BUILD_OK" = 1 ]; then
  run_logged "$OUT/ctest.log" ctest --test-dir build/gpu --output-on-failure --no-tests=error --timeout 600
  if [ "$RC" = 0 ]; then
    record "ctest" "ok" "$(grep -E 'tests passed' "$OUT/ctest.log" | tail -n 1 || true)"
  else
    summary=$(grep -E 'tests passed|tests failed|No tests' "$OUT/ctest.log" | tail -n 1 || true)
    record "ctest" "FAILED" "exit $RC${summary:+: $summary}; see $OUT/ctest.log"
  fi
else
  record "ctest" "skipped" "no build"
fi

# ---- (d) GPU tests ---------------------------------------------------------------------
gpu_tests() {
  cd "$ROOT/tests"
  # Only the modules that hold GPU tests: the others may import optional packages
  # (omegaconf, TRL, datasets) a GPU image lacks, and one collection error stops pytest.
  local files
  mapfile -t files < <(grep -rlE 'mark\.gpu' python --include='test_*.py' | sort)
  echo "modules with GPU tests: ${files[*]}"
  ${LIMIT[@]+"${LIMIT[@]}"} "$PY" -m pytest "${files[@]}" -m gpu -v -p no:cacheprovider --junitxml="$OUT/gpu_tests.xml"
}

if [ "$BUILD_OK" = 1 ]; then
  run_logged "$OUT/gpu_tests.log" gpu_tests
  if [ "$RC" = 0 ]; then
    record "gpu-tests" "ok" "$(pytest_line "$OUT/gpu_tests.log")"
  else
    record "gpu-tests" "FAILED" "pytest exit $RC: $(pytest_line "$OUT/gpu_tests.log"); see $OUT/gpu_tests.log"
  fi
else
  record "gpu-tests" "skipped" "no build"
fi

# ---- (e) GPU benchmarks ---------------------------------------------------------------
bench() {  # bench SCRIPT CSV [ARGS...]
  cd "$ROOT"
  "$PY" "$1" --csv "$2" "${@:3}"
}

# bench_gpu.py: pack/unpack vs a device copy and the per-sequence loop, fused
# log-probs vs log_softmax + gather, sync-free and CUDA-graph checks.
if [ "$BUILD_OK" != 1 ]; then
  record "bench-gpu" "skipped" "no build"
else
  run_logged "$OUT/bench_gpu.log" bench benchmarks/bench_gpu.py "$OUT/gpu.csv"
  if [ "$RC" = 0 ]; then
    record "bench-gpu" "ok" "$OUT/gpu.csv"
  else
    record "bench-gpu" "FAILED" "exit $RC; see $OUT/bench_gpu.log"
  fi
  # bench_stream_memory.py: max_memory_reserved over 20 streamed steps, planned vs
  # largest first vs static buckets (issue 42).
  run_logged "$OUT/bench_stream_memory.log" bench benchmarks/bench_stream_memory.py "$OUT/stream_memory.csv"
  if [ "$RC" = 0 ]; then
    record "bench-stream-memory" "ok" "$OUT/stream_memory.csv"
  else
    record "bench-stream-memory" "FAILED" "exit $RC; see $OUT/bench_stream_memory.log"
  fi
  # bench_prefix_reuse.py: a tree larger than the cap in passes vs the split plan,
  # bf16 on the GPU (issue 52).
  run_logged "$OUT/bench_prefix_reuse.log" bench benchmarks/bench_prefix_reuse.py "$OUT/prefix_reuse.csv" \
    --device cuda --dtype bfloat16
  if [ "$RC" = 0 ]; then
    record "bench-prefix-reuse" "ok" "$OUT/prefix_reuse.csv"
  else
    record "bench-prefix-reuse" "FAILED" "exit $RC; see $OUT/bench_prefix_reuse.log"
  fi
fi

# ---- (f) compute-sanitizer ------------------------------------------------------------
SANITIZER=$(command -v compute-sanitizer 2>/dev/null || true)
if [ -z "$SANITIZER" ]; then
  for candidate in "${CUDA_BIN:-}/compute-sanitizer" /usr/local/cuda/bin/compute-sanitizer; do
    if [ -x "$candidate" ]; then SANITIZER=$candidate; break; fi
  done
fi

sanitize() {  # sanitize TOOL
  cd "$ROOT/tests"
  local filter=()
  if [ "$1" = initcheck ] && [ -n "$SANITIZER_INITCHECK_FILTER" ]; then
    filter=(--kernel-name "$SANITIZER_INITCHECK_FILTER")
  fi
  echo "$SANITIZER --tool $1 ${filter[*]} over: $SANITIZER_TESTS"
  # Without PyTorch's caching allocator every tensor is its own allocation, so the
  # sanitizer sees the real bounds (and initialisation state) of each buffer.
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 ${LIMIT[@]+"${LIMIT[@]}"} "$SANITIZER" --tool "$1" ${filter[@]+"${filter[@]}"} --error-exitcode 86 \
    --print-limit 200 \
    "$PY" -m pytest python/training/test_logprobs_gpu.py python/tensors/test_thd_gpu.py -m gpu -q -x -p no:cacheprovider \
    -k "$SANITIZER_TESTS"
}

if [ "$BUILD_OK" != 1 ]; then
  record "sanitizer" "skipped" "no build"
elif [ -z "$SANITIZER" ]; then
  echo "compute-sanitizer not found (PATH, \$CUDA_HOME/bin, /usr/local/cuda/bin): skipping the sanitizer runs" \
    | tee "$OUT/sanitizer.txt"
  record "sanitizer" "skipped" "compute-sanitizer not found"
else
  for tool in "${SANITIZER_TOOLS[@]}"; do
    run_logged "$OUT/sanitizer_$tool.log" sanitize "$tool"
    errors=$(grep -E '(ERROR SUMMARY|RACECHECK SUMMARY)' "$OUT/sanitizer_$tool.log" | tail -n 1 \
      | sed 's/^=* *//' || true)
    if [ "$RC" = 0 ]; then
      record "sanitizer-$tool" "ok" "${errors:-no summary}; $(pytest_line "$OUT/sanitizer_$tool.log")"
    else
      record "sanitizer-$tool" "FAILED" "exit $RC${errors:+, $errors}; $(pytest_line "$OUT/sanitizer_$tool.log"); see $OUT/sanitizer_$tool.log"
    fi
  done
fi

# ---- summary -----------------------------------------------------------------------------
{
  echo
  echo "seqpack GPU check, $(date -u +%Y-%m-%dT%H:%M:%SZ), HEAD $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  printf '%-22s %s\n' "step" "status"
  printf '%-22s %s\n' "----" "------"
  for i in "${!NAMES[@]}"; do
    printf '%-22s %s\n' "${NAMES[$i]}" "${STATES[$i]}"
  done
  echo "logs: $OUT"
} | tee "$OUT/summary.txt"

if [ "$FAILED" != 0 ]; then
  echo "GPU check FAILED" >&2
  exit 1
fi
echo "GPU check passed"
