#!/usr/bin/env bash
# Builds tests/gpu/nccl_sr_probe.cu with nvcc against Open MPI (.gpu/ompi, scripts/gpu-carry) and
# NCCL's headers (the nvidia-nccl wheel) and runs it on $NP ranks (default 4, one GPU each)
# through real NCCL and through commd's library (a daemon of .gpu/commd started here), at 8 B
# and 4 KiB. On a lent GPU machine, after scripts/gpu-carry build.
#   WHO="nccl commd base"   libraries: nccl, commd (.gpu/libcommd_nccl.so), base
#                           (.gpu/base/libcommd_nccl.so)
#   PROF=2000               COMMD_EAGER_PROFILE for commd's runs (host time per group by phase)
set -u
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/out}; mkdir -p "$out"
export NCCL_NVLS_ENABLE=0
ompi=$(readlink -f .gpu/ompi); export OPAL_PREFIX=$ompi PRTE_PREFIX=$ompi PMIX_PREFIX=$ompi OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
nccl_pkg=$(python3 -c "import nvidia.nccl as m; print(list(m.__path__)[0])")
real=$(mktemp -d); mkdir -p "$real/lib"; ln -s "$nccl_pkg/include" "$real/include"
ln -s "$nccl_pkg/lib/libnccl.so.2" "$real/lib/libnccl.so.2"; ln -s libnccl.so.2 "$real/lib/libnccl.so"
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
"$nvcc" -O2 -gencode=arch=compute_90,code=sm_90 -I"$ompi/include" -I"$real/include" tests/gpu/nccl_sr_probe.cu \
  -o /tmp/nccl_sr_probe -L"$ompi/lib" -lmpi -L"$real/lib" -lnccl > "$out/probe-build.log" 2>&1 || { cat "$out/probe-build.log"; exit 1; }
sock=/tmp/srprobe/c.sock; mkdir -p /tmp/srprobe; export COMMD_SOCKET=$sock
.gpu/commd serve --socket $sock > "$out/probe-daemon.log" 2>&1 & dp=$!
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
np=${NP:-4}
for who in ${WHO:-nccl commd base}; do
  case $who in
    nccl) d=$real/lib;;
    commd) d=$(mktemp -d); ln -s "$(readlink -f .gpu/libcommd_nccl.so)" "$d/libnccl.so.2";;
    base) d=$(mktemp -d); ln -s "$(readlink -f .gpu/base/libcommd_nccl.so)" "$d/libnccl.so.2";;
    *) echo "unknown library $who"; continue;;
  esac
  for b in 8 4096; do
    echo "== $who $b bytes"
    timeout 90 "$ompi/bin/mpirun" --oversubscribe -np "$np" -x LD_LIBRARY_PATH="$ompi/lib:$d" -x COMMD_SOCKET \
      -x NCCL_NVLS_ENABLE=0 ${PROF:+-x COMMD_EAGER_PROFILE=$PROF} /tmp/nccl_sr_probe $b 2000 2>&1 \
      | grep -E "rank [0-9]+ |profile" | sort
  done
done
kill $dp
