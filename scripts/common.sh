# Shared by scripts/test and scripts/bench: make sure the toolchain and Python deps exist.
# Installs only from the package registries (apt, PyPI); Rust itself must be rustup's (>= 1.90,
# edition 2024), since Debian's packaged rustc is too old for this workspace.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if ! command -v cargo >/dev/null 2>&1 && [ -x "$HOME/.cargo/bin/cargo" ]; then
  export PATH="$HOME/.cargo/bin:$PATH"
fi
if ! command -v cargo >/dev/null 2>&1; then
  echo "commd: cargo not found. Install Rust >= 1.90 with rustup (https://rustup.rs), then rerun." >&2
  exit 1
fi
# What building needs beyond Rust, for both ./scripts/bench and ./scripts/test on a fresh
# machine: a C compiler, and CMake + libclang for the `rdma-mummy-sys` build script (the verbs
# bindings under the `sideway` crate run cmake and bindgen).
build_apt=()
command -v cc >/dev/null 2>&1 || build_apt+=(build-essential)
command -v cmake >/dev/null 2>&1 || build_apt+=(cmake)
ldconfig -p 2>/dev/null | grep -q 'libclang[-.0-9]*\.so' || ls /usr/lib/llvm-*/lib/libclang.so* >/dev/null 2>&1 \
  || build_apt+=(libclang-dev)
if [ ${#build_apt[@]} -gt 0 ]; then
  if command -v apt-get >/dev/null 2>&1; then
    echo "== apt-get install ${build_apt[*]} (needed to build commd)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${build_apt[@]}" >/dev/null
  else
    echo "commd: building needs ${build_apt[*]} (a C compiler, CMake, libclang); install them, then rerun." >&2
    exit 1
  fi
fi
