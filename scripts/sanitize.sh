#!/usr/bin/env bash
# The C++ core under AddressSanitizer + UndefinedBehaviorSanitizer, and fuzzed:
#   1. the GoogleTest suite;
#   2. the Python planning / THD / reliability tests against a sanitized build of the
#      extension (Python preloads the ASan runtime);
#   3. every libFuzzer target of tests/fuzz for SEQPACK_FUZZ_SECONDS (default 30),
#      two at a time, from the seed corpus in tests/fuzz/corpus.
# Any sanitizer report, broken invariant or crash fails the script; a fuzzer's
# finding is printed as base64 so it can be replayed anywhere:
#   base64 -d > crash && build/sanitize/fuzz_<target> crash
# Needs clang (Debian's, installed here when missing) and an active virtual
# environment with seqpack's test extras (scripts/test.sh installs them).
set -euo pipefail
cd "$(dirname "$0")/.."
fuzz_seconds=${SEQPACK_FUZZ_SECONDS:-30}
build=build/sanitize

if ! command -v clang++ >/dev/null 2>&1; then
  echo "== installing clang (libFuzzer, sanitizers)"
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq clang >/dev/null
fi
python3 -m pip install --quiet cmake ninja "pybind11>=2.12"

echo "== building the core, its tests, the fuzzers and the extension with ASan + UBSan (clang)"
cmake -S . -B "$build" -G Ninja -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSEQPACK_BUILD_FUZZERS=ON -DSEQPACK_BUILD_TESTS=ON \
  -DSEQPACK_BUILD_PYTHON=ON -DSEQPACK_ENABLE_CUDA=OFF \
  -Dpybind11_DIR="$(python3 -m pybind11 --cmakedir)" >/dev/null
cmake --build "$build" -j 2

export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
export ASAN_OPTIONS=detect_leaks=0:strict_string_checks=1:check_initialization_order=1

echo "== GoogleTest under ASan + UBSan"
"$build/seqpack_core_tests" --gtest_brief=1

echo "== Python planning / THD / reliability tests against the sanitized extension"
# The package from the source tree with the sanitized extension next to it. The
# interpreter is not instrumented: the ASan runtime must be loaded first, and leak
# checking is off (CPython keeps objects alive at exit by design).
pkg="$build/python"
rm -rf "$pkg" && mkdir -p "$pkg"
cp -r python/seqpack "$pkg/"
cp "$build"/_core*.so "$pkg/seqpack/"
version=$(python3 -c "import tomllib; print(tomllib.load(open('pyproject.toml', 'rb'))['project']['version'])")
printf '__version__ = "%s"\n' "$version" > "$pkg/seqpack/_version.py"
asan_runtime=$(clang++ -print-file-name=libclang_rt.asan-x86_64.so)
(cd tests && LD_PRELOAD="$asan_runtime" PYTHONPATH="$PWD/../$pkg" \
  python3 -m pytest -q -p no:cacheprovider -x \
    python/planning python/tensors/test_thd.py python/tensors/test_layout.py \
    python/test_reliability.py python/test_core_boundary.py \
    python/test_pickling.py::test_corrupt_pickled_state_is_refused \
    python/test_pickling.py::test_layout_pickles_through_its_offsets_and_keeps_working \
    python/test_pickling.py::test_pickle_and_deepcopy_round_trip)

echo "== libFuzzer: ${fuzz_seconds} s per target"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
run_fuzzer() {
  local target=$1 name
  name=$(basename "$target")
  mkdir -p "$work/$name/corpus"
  if "$target" -max_total_time="$fuzz_seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
       -artifact_prefix="$work/$name/" "$work/$name/corpus" "tests/fuzz/corpus/$name" >"$work/$name/log" 2>&1; then
    echo "$name: $(grep -E '^stat::number_of_executed_units' "$work/$name/log" | awk '{print $2}') runs, no finding"
  else
    echo "$name: FINDING"
    tail -n 40 "$work/$name/log"
    for crash in "$work/$name"/crash-* "$work/$name"/timeout-* "$work/$name"/oom-* "$work/$name"/leak-*; do
      [ -f "$crash" ] && { echo "input $(basename "$crash") (base64):"; base64 -w0 "$crash"; echo; }
    done
    return 1
  fi
}
failed=0
fuzzers=("$build"/fuzz_*)
for ((i = 0; i < ${#fuzzers[@]}; i += 2)); do
  pids=()
  for target in "${fuzzers[@]:i:2}"; do
    run_fuzzer "$target" & pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
done
exit $failed
