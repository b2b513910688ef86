#!/usr/bin/env bash
# A/B of library builds and settings on nccl-tests (NVIDIA's, built here from .gpu/nccl-tests
# with nvcc against Open MPI in .gpu/ompi; scripts/gpu-carry), rounds alternating between the
# variants so that a machine's drift (runs of one build differ from round to round) falls on all
# of them alike. On a lent GPU machine, after scripts/gpu-carry build; a daemon of .gpu/commd is
# started here.
#   tests/gpu/nccl_ab.sh OUTDIR
#   AB_VARIANTS  "name=LIB[,VAR=VALUE...];..."  LIB: a libcommd_nccl.so, or nccl (real NCCL)
#                default "commd=.gpu/libcommd_nccl.so;base=.gpu/base/libcommd_nccl.so;nccl=nccl"
#                e.g. "ll=.gpu/libcommd_nccl.so;simple=.gpu/libcommd_nccl.so,COMMD_DIRECT_LL_MAX_BYTES=0;nccl=nccl"
#   AB_OPS       nccl-tests ops (default: all_reduce reduce_scatter all_gather alltoall broadcast sendrecv)
#   AB_ARGS      their arguments (default: -b 8 -e 256K -f 8 -n 1000 -w 100)
#   AB_ROUNDS    rounds (default 3); AB_NP ranks, one GPU each (default: every GPU)
# Writes OUTDIR/ab-OP-NAME-rR.log and OUTDIR/ab.md: per op and size, each variant's best and
# worst time (us, out of place) over the rounds, and the wrong values nccl-tests counted.
set -u
cd "$(dirname "$0")/../.."
out=${1:?usage: tests/gpu/nccl_ab.sh OUTDIR}; mkdir -p "$out"
export NCCL_NVLS_ENABLE=0
ompi=$(readlink -f .gpu/ompi); export OPAL_PREFIX=$ompi PRTE_PREFIX=$ompi PMIX_PREFIX=$ompi OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
nccl_pkg=$(python3 -c "import nvidia.nccl as m; print(list(m.__path__)[0])")
real=$(mktemp -d); mkdir -p "$real/lib"; ln -s "$nccl_pkg/include" "$real/include"
ln -s "$nccl_pkg/lib/libnccl.so.2" "$real/lib/libnccl.so.2"; ln -s libnccl.so.2 "$real/lib/libnccl.so"
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc); cuda_home=$(dirname "$(dirname "$nvcc")")
build=/tmp/nccl-tests-build
make -C .gpu/nccl-tests -j16 MPI=1 MPI_HOME="$ompi" NCCL_HOME="$real" CUDA_HOME="$cuda_home" \
  NVCC_GENCODE="-gencode=arch=compute_90,code=sm_90" BUILDDIR="$build" >"$out/build.log" 2>&1 \
  || { tail -20 "$out/build.log"; exit 1; }
# A socket of its own: a daemon of an earlier run may still be shutting down on another one.
sock=$(mktemp -d /tmp/ncclab.XXXXXX)/c.sock; export COMMD_SOCKET=$sock
.gpu/commd serve --socket $sock >"$out/daemon.log" 2>&1 & dp=$!
trap 'kill $dp 2>/dev/null' EXIT
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
np=${AB_NP:-$(nvidia-smi -L | wc -l)}
IFS=';' read -ra variants <<<"${AB_VARIANTS:-commd=.gpu/libcommd_nccl.so;base=.gpu/base/libcommd_nccl.so;nccl=nccl}"
for r in $(seq "${AB_ROUNDS:-3}"); do
  for t in ${AB_OPS:-all_reduce reduce_scatter all_gather alltoall broadcast sendrecv}; do
    for v in "${variants[@]}"; do
      name=${v%%=*}; rest=${v#*=}; lib=${rest%%,*}; sets=(); [ "$rest" = "$lib" ] || IFS=',' read -ra sets <<<"${rest#*,}"
      if [ "$lib" = nccl ]; then d=$real/lib; else
        d=$(mktemp -d); ln -s "$(readlink -f "$lib")" "$d/libnccl.so.2"; fi
      xs=(); for s in "${sets[@]}"; do xs+=(-x "$s"); done
      # shellcheck disable=SC2086
      timeout 120 "$ompi/bin/mpirun" --oversubscribe -np "$np" -x LD_LIBRARY_PATH="$ompi/lib:$d" \
        -x COMMD_SOCKET -x NCCL_NVLS_ENABLE=0 "${xs[@]}" "$build/${t}_perf" ${AB_ARGS:--b 8 -e 256K -f 8 -n 1000 -w 100} -g 1 \
        >"$out/ab-$t-$name-r$r.log" 2>&1 || echo "ab: $t $name round $r exited $?"
    done
  done
  echo "ab: round $r done at ${SECONDS} s"
done
python3 - "$out" <<'PY'
import collections, glob, os, re, sys
out = sys.argv[1]
t = collections.defaultdict(list)
wrong = collections.Counter()
names = []
for f in sorted(glob.glob(f"{out}/ab-*-r*.log")):
    m = re.match(r"ab-(\w+?)-(.+)-r(\d+)\.log$", os.path.basename(f))
    if not m:
        continue
    op, name, _ = m.groups()
    if name not in names:
        names.append(name)
    for line in open(f, errors="replace"):
        p = line.split()
        if len(p) >= 13 and p[0].isdigit() and p[1].isdigit():
            try:
                t[(op, int(p[0]), name)].append(float(p[5]))
            except ValueError:
                continue
            wrong[name] += sum(int(x) for x in (p[8], p[12]) if x.isdigit())
lines = ["| op | bytes | " + " | ".join(f"{n} best/worst" for n in names) + " |",
         "|---|---:|" + "---:|" * len(names)]
for op, size in sorted({(k[0], k[1]) for k in t}):
    cells = []
    for n in names:
        v = t.get((op, size, n), [])
        cells.append(f"{min(v):.2f}/{max(v):.2f}" if v else "-")
    lines.append(f"| {op} | {size} | " + " | ".join(cells) + " |")
lines.append("")
lines.append("wrong values: " + ", ".join(f"{n} {wrong[n]}" for n in names))
open(f"{out}/ab.md", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
