#!/usr/bin/env bash
# Ops split into direct ops (COMMD_DIRECT_SPLIT_MAX_BYTES: all-reduce, broadcast, reduce past
# the direct limit) on a lent machine with 2+ GPUs, after scripts/gpu-carry build nccltests:
#   tests/gpu/split_check.sh OUTDIR
# 1. tests/gpu/eager_direct.py and tests/gpu/graph_capture.py on SPLIT_NP ranks (default: every
#    GPU, at most 4), one GPU each: right results against references, every root, mismatches
#    (on 2 ranks also with the direct limits at 4 MiB, where 4-8 MiB ops split);
# 2. tests/gpu/nccl_ab.sh: nccl-tests all_reduce, broadcast, reduce at 1-16 MiB (-c 1: nccl-tests
#    checks every value) through the library with the split, without it
#    (COMMD_DIRECT_SPLIT_MAX_BYTES=0: the daemon's path past the limit), and real NCCL, in
#    alternating rounds (on 2 ranks the library's variants with the 4 MiB limits): OUTDIR/ab/ab.md.
# Exits non-zero if a test failed or nccl-tests counted a wrong value.
set -u
cd "$(dirname "$0")/../.."
out=${1:?usage: tests/gpu/split_check.sh OUTDIR}; mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
ngpu=$(nvidia-smi -L | wc -l)
np=${SPLIT_NP:-$((ngpu < 4 ? ngpu : 4))}
[ "$np" -ge 2 ] || { echo "split_check: needs 2 or more GPUs (found $ngpu)"; exit 2; }
python3 -m pip install -q --no-deps --no-index --target /tmp/commd-site .gpu/commd-*.whl || exit 2
cp client-py/python/commd/*.py /tmp/commd-site/commd/
export PYTHONPATH=/tmp/commd-site${PYTHONPATH:+:$PYTHONPATH}
sock=$(mktemp -d)/commd.sock; export COMMD_SOCKET=$sock
.gpu/commd serve --socket "$sock" >"$out/daemon.log" 2>&1 & dp=$!
trap 'kill $dp 2>/dev/null' EXIT
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
rc=0
tr=(python3 -m torch.distributed.run --standalone --nproc_per_node "$np")
# On 2 ranks nothing splits in shares by default (one direct op up to 16 MiB, a larger one's
# share past the split's 8 MiB; only a reduce runs in chunks of 16 MiB up to 64 MiB): the tests
# run again with the limits at 4 MiB, where ops of 4-8 MiB split.
limits=("")
lim4=(COMMD_EAGER_DIRECT_MAX_BYTES=4194304 COMMD_GRAPH_DIRECT_MAX_BYTES=4194304)
[ "$np" -eq 2 ] && limits+=("${lim4[*]}")
for l in "${limits[@]}"; do
  for t in eager_direct graph_capture; do
    log=$out/$t${l:+-4m}.log
    echo "== $t on $np ranks ${l:-(default limits)}"
    # shellcheck disable=SC2086
    if ! env COMMD_EAGER_DIRECT=auto $l timeout 600 "${tr[@]}" "tests/gpu/$t.py" >"$log" 2>&1; then
      rc=1; echo "FAILED: $t ${l}"; tail -30 "$log"
    fi
  done
done
kill $dp 2>/dev/null
ab_lim=; [ "$np" -eq 2 ] && ab_lim=$(IFS=,; echo ",${lim4[*]}")
AB_NP=$np AB_ROUNDS=${SPLIT_ROUNDS:-3} AB_OPS="all_reduce broadcast reduce" \
  AB_ARGS="-b 1M -e 16M -f 2 -n 200 -w 20 -c 1" \
  AB_VARIANTS="split=.gpu/libcommd_nccl.so$ab_lim;nosplit=.gpu/libcommd_nccl.so,COMMD_DIRECT_SPLIT_MAX_BYTES=0$ab_lim;nccl=nccl" \
  tests/gpu/nccl_ab.sh "$out/ab" >"$out/ab.log" 2>&1 || rc=1
cat "$out/ab.log"
if grep " exited " "$out/ab.log"; then rc=1; echo "FAILED: an nccl-tests run failed"; fi
if grep "^wrong values:" "$out/ab/ab.md" | grep -E " [1-9][0-9]*(,|$)"; then
  rc=1; echo "FAILED: nccl-tests counted wrong values"
fi
exit $rc
