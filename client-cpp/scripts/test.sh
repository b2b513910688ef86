#!/usr/bin/env bash
# Builds and tests the C/C++ client: installs cmake and a C/C++ compiler if missing (apt-get),
# builds the workspace's binaries (the tests run the real `commd` daemon), configures and builds
# client-cpp with CMake (which builds the Rust library with cargo), and runs every ctest test.
# Exits non-zero if anything fails. Extra arguments go to ctest (e.g. -R errors).
#
#   client-cpp/scripts/test.sh
#
# Environment: COMMD_CPP_BUILD_DIR (default: <workspace>/target/client-cpp-build).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
root="$(cd "$here/.." && pwd)"

need=()
command -v cmake >/dev/null 2>&1 || need+=(cmake)
command -v cc >/dev/null 2>&1 || need+=(gcc)
command -v c++ >/dev/null 2>&1 || need+=(g++)
if [ ${#need[@]} -gt 0 ]; then
  echo "== installing ${need[*]}"
  sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
fi

cd "$root"
# The daemon the tests start. The same command as the project's scripts/test, so this is a
# no-op (no rebuild) when that already ran.
echo "== cargo build --release --workspace --bins"
cargo build --release --workspace --bins

build="${COMMD_CPP_BUILD_DIR:-$root/target/client-cpp-build}"
echo "== cmake configure ($build)"
cmake -S "$here" -B "$build" -DCMAKE_BUILD_TYPE=Release -DCOMMD_BUILD_TESTS=ON
echo "== cmake build"
cmake --build "$build" -j "$(nproc)"
echo "== ctest"
cd "$build"
ctest --output-on-failure -j "$(nproc)" "$@"
