#!/usr/bin/env bash
# Installs seqpack with its test extras and runs every test:
#   1. the C++ core's GoogleTest suite (through CTest), built in the same CMake
#      build as the extension (build/pip), CUDA objects included when nvcc exists;
#   2. the pytest suite against the installed package.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -f /usr/include/gtest/gtest.h ] && [ ! -f /usr/local/include/gtest/gtest.h ]; then
  echo "== installing GoogleTest (libgtest-dev)"
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libgtest-dev >/dev/null
fi

echo "== pip install .[test,plot] (builds the extension and the C++ tests)"
python3 -m pip install --quiet ".[test,plot]" \
  --config-settings=build-dir=build/pip \
  --config-settings=cmake.define.SEQPACK_BUILD_TESTS=ON

echo "== the released packages the drop-ins are compared with (verl, NeMo AutoModel)"
# Their transformers pins (verl <5.11, AutoModel ==5.18) conflict with TRL 1.16's, so
# they come without their dependencies, plus what the compared modules import
# (verl.utils.seqlen_balancing: ray, tensordict in verl's range). Without them the
# differential tests skip and the recorded cases still run.
python3 -m pip install --quiet --no-deps verl==0.9.1 nemo_automodel==0.7.0
python3 -m pip install --quiet "ray>=2.41" "tensordict>=0.8,!=0.9.0,<=0.10.0" codetiming  # codetiming: verl's engine

echo "== C++ core: GoogleTest via CTest"
ctest --test-dir build/pip --output-on-failure --timeout 300

echo "== Python: pytest"
# Run from tests/ so that `import seqpack` resolves to the installed package.
cd tests
python3 -m pytest python -q -p no:cacheprovider
