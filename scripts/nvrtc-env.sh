# Sourced by scripts/test: makes NVRTC 13.0 (libnvrtc.so.13) loadable, so the client's reduction
# kernels are compiled in every test run, GPU or not, and sets COMMD_REQUIRE_NVRTC=1 so a missing
# NVRTC fails the tests instead of skipping them.
#
# NVRTC comes from the `nvidia-cuda-nvrtc==13.0.*` wheel, installed with pip into its own
# directory ($COMMD_NVRTC_HOME, default ~/.cache/commd/nvrtc-13.0) rather than into site-packages,
# where it would replace the NVRTC that torch's wheels pin. 13.0, not newer: PTX from a newer NVRTC
# does not load on a CUDA 13.0 driver (the kernels themselves load SASS, which any 13.x makes).
# Order: $COMMD_NVRTC_LIB_DIR if set; an installed 13.0 wheel (site-packages or our directory);
# pip install into our directory; else, offline, any installed 13.x wheel, with a warning.

_commd_nvrtc_find() {
  # Prints the lib dir of the first nvidia-cuda-nvrtc whose version starts with $1, searching the
  # site-packages of python3 and then $2.
  python3 - "$1" "$2" <<'EOF'
import glob, os, sys
from importlib import metadata
want, extra = sys.argv[1], sys.argv[2]
paths = [extra] + sys.path
for dist in metadata.distributions(path=paths):
    if (dist.metadata["Name"] or "").lower() != "nvidia-cuda-nvrtc" or not dist.version.startswith(want):
        continue
    for f in dist.files or []:
        if os.path.basename(str(f)) == "libnvrtc.so.13":
            print(os.path.dirname(os.path.realpath(dist.locate_file(f))))
            sys.exit(0)
sys.exit(1)
EOF
}

_commd_nvrtc_setup() {
  local home="${COMMD_NVRTC_HOME:-$HOME/.cache/commd/nvrtc-13.0}"
  local dir="${COMMD_NVRTC_LIB_DIR:-}"
  if [ -z "$dir" ]; then
    dir=$(_commd_nvrtc_find 13.0. "$home") || dir=""
  fi
  if [ -z "$dir" ]; then
    local out
    if out=$(python3 -m pip install --quiet --disable-pip-version-check --no-deps --upgrade \
      --target "$home" 'nvidia-cuda-nvrtc==13.0.*' 2>&1); then
      dir=$(_commd_nvrtc_find 13.0. "$home") || dir=""
    else
      echo "$out" | grep -v "Running pip as the 'root' user" >&2 || true
    fi
  fi
  if [ -z "$dir" ]; then
    dir=$(_commd_nvrtc_find 13. "$home") || dir=""
    if [ -n "$dir" ]; then
      echo "nvrtc-env: nvidia-cuda-nvrtc==13.0.* unavailable (offline?); using $dir" >&2
    fi
  fi
  if [ -z "$dir" ] || [ ! -e "$dir/libnvrtc.so.13" ]; then
    echo "nvrtc-env: libnvrtc.so.13 not found: pip install nvidia-cuda-nvrtc==13.0.*, or set" \
      "COMMD_NVRTC_LIB_DIR to the lib dir of a CUDA 13 toolkit" >&2
    return 1
  fi
  case ":${LD_LIBRARY_PATH:-}:" in
    *":$dir:"*) ;;
    *) export LD_LIBRARY_PATH="$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ;;
  esac
  export COMMD_REQUIRE_NVRTC=1
}

_commd_nvrtc_setup
