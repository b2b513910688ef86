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
if ! command -v cc >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && apt-get install -y -qq build-essential >/dev/null
  else
    echo "commd: a C compiler (cc) is needed to build; install gcc or clang." >&2
    exit 1
  fi
fi
