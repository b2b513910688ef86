#!/usr/bin/env bash
# The GPU test suite and GPU benchmarks, for a machine with NVIDIA GPUs (2 or more; NVLink
# multicast stays off). Needs the `commd` binary and the commd Python package:
#   - built here:    cargo build --release -p commd && pip install ./client-py
#   - or carried:    COMMD_BIN=path/to/commd and a wheel in $COMMD_WHEEL_DIR (default .gpu/)
# Usage: scripts/gpu-check.sh [tests|bench|breakdown|allreduce|interference|multinode|waitcmp|vmm|graphs|jobstart|eager|p2p|nccl|deepspeed|dinov2|tenancy|dtypes|all] [OUTDIR]
# `dtypes` (also part of `tests`; one GPU is enough): every reduction kernel against the host
# reference bit for bit, fp8 and u32/u64 included (commd-cuda's gpu_kernels_match_host_reference:
# target/release's test binary, .gpu/commd-cuda-tests or $COMMD_CUDA_TESTS), and
# tests/torch_worker.py typed cuda (fp8 e4m3/e5m2 and uint32/uint64 reductions of CUDA tensors
# on the "commd" backend, 2 and 3 ranks, sharing GPU 0 on a one-GPU machine, against CPU
# references in rank order; 3 ranks also with one launch per round and as direct ops).
# `tenancy` (also part of `tests`; one GPU, root): tests/gpu/tenancy.py, user `nobody` against a
# root daemon of its own: GPU registrations bounded per uid, another process's CUDA IPC handle
# refused (needs commd-testclient: target/release, .gpu/ or $COMMD_TESTCLIENT).
# `p2p` (run only by name): send/recv as direct ops (COMMD_P2P_DIRECT, on by default) in the NCCL
# library: tests/gpu/nccl_p2p.py (torch's "nccl" backend on it) and nccl-tests' sendrecv and
# alltoall, with and without it.
# `eager` (docs/design-gpu.md, direct collectives rule 8; run only by name): eager direct ops'
# tests, and their per-op latency against the daemon's path and NCCL (graph_latency.py's eager
# column): eager.jsonl.
# `nccl` (run only by name): tests/gpu/nccl.sh, the NCCL-compatible library
# (libcommd_nccl.so, target/release or .gpu/) under NCCL's own nccl-tests (every collective,
# -c 1; real NCCL in the same run), a torch DDP job on the "nccl" backend name preloaded with it
# against gloo, and vLLM's pynccl calls captured into a CUDA graph: nccl*.log,
# nccltests-summary.txt, ddp-*.json, nccl.jsonl. NCCL_PARTS=vstorch (run only by name) is the
# performance goal: nccl-tests through the library against commd's torch backend measured
# the same way, size by size, 8 B .. 1 GiB: vs-*.log, vs-torch-*.jsonl, nccl-vs-torch.md.
# `deepspeed` (run only by name): DeepSpeed's own ZeRO-2 (and ZeRO-3) training
# step, tests/deepspeed_worker.py --cuda (a 3-layer MLP of hidden $DS_HIDDEN, default 4096:
# 16.9M parameters), one rank per GPU, through NCCL and through commd ("commd" backend name),
# alternated over $DS_ROUNDS rounds (default 2); losses and final parameters compared with NCCL's
# and step times side by side (tests/gpu/deepspeed_compare.py): deepspeed-*.log, deepspeed.jsonl.
# DeepSpeed and its needs come from wheels in .whl/ when the machine has no DeepSpeed.
# `dinov2` (run only by name): dinov2's own training code (tests/gpu/dinov2_accept.py:
# its setup()/enable() with "nccl" hard-coded, SSLMetaArch under its FSDP wrapping, a tiny ViT-S/16,
# $DINOV2_STEPS steps, default 10) on real NCCL, on commd through libcommd_nccl.so preloaded (the
# same "nccl" name), and on the "commd" backend name; rank 0's losses compared step by step with
# NCCL's (4 ranks on 4+ GPUs, else 2; one GPU: 2 ranks sharing it on both commd routes, compared with each other):
# dinov2-*.log, dinov2.jsonl. dinov2's source from $DINOV2_SRC or .gpu/dinov2-src.tar.gz and its
# needs from .whl/ (scripts/gpu-carry prepares both).
# `jobstart` (run only by name): client-py/benchmarks/job_start.py, communicator
# start-up time and GPU memory, commd against NCCL on all GPUs (and 2 commd ranks sharing one
# GPU on a one-GPU machine), then 10 short jobs back to back on one daemon: jobstart.log and
# jobstart.jsonl.
# `graphs` (also part of `tests`): tests/gpu/graph_capture.py, every GPU op captured into CUDA
# graphs and replayed with new data against eager results (docs/contracts.md #6), 2 ranks
# (sharing the GPU on a one-GPU machine) and 4 where there are 4 GPUs; tests/gpu/graph_kill.py
# via kill_rank.sh (a rank killed during replays; more captures than graph doorbell slots, each
# graph destroyed); client-py/benchmarks/graph_latency.py (replay vs eager per-op latency, NCCL
# where there is a GPU per rank: graph_latency.jsonl); with a GPU per rank, the direct captured
# all-reduce (docs/contracts.md #7): the kill on that path and the suite with it off
# (COMMD_GRAPH_DIRECT=0); tests/gpu/vllm_decode.py (vLLM's TP decode step per batch size under
# graphs, commd and NCCL: vllm_decode.jsonl); and tests/gpu/kill_daemon.py (a daemon killed
# while a stream waits on its doorbell: the stream is released, the next call raises).
# COMMD_BENCH_OPS (default "sendrecv all_gather all_reduce") picks the benchmarks of `bench`;
# `breakdown` runs client-py/benchmarks/gpu_op_breakdown.py (per-op CPU/GPU time, cProfile).
# `allreduce`: client-py/benchmarks/gpu_vs_nccl.py for all_reduce and
# reduce_scatter, float32 and bfloat16, 8 KiB .. 1 GiB, each result checked against NCCL, on 2
# GPUs and on 4 when there are 4 (~2-3 min on 4x H200): allreduce-N-gpus.log and
# allreduce.jsonl. COMMD_ALLREDUCE_ALGO=oneshot|rsag in the environment forces commd's
# all-reduce algorithm (the output records the value in effect).
# `interference`: client-py/benchmarks/gemm_interference.py on all GPUs up to 4 (or the counts
# in INTERFERENCE_GPUS, e.g. "2 4"): a bf16 GEMM alone and under a 256 MiB all-reduce loop
# through NCCL, through commd uncapped and at the pacing caps in COMMD_PACING (GB/s, default
# 0,300,200,100,50,25; ~2 min), and commd with one reduction launch per round; then
# client-py/benchmarks/ddp_overlap.py (a DDP transformer step, buckets overlapped with the
# backward, commd vs NCCL): interference-N-gpus*.log, interference.jsonl, ddp_overlap.jsonl. `all` (the default) is tests + bench; the
# two modes above are slower and run only by name; they print the time each section took.
# `multinode` (also part of `tests`): two more daemons on this machine act as two nodes
# (loopback TCP between them), and tests/gpu/gpu_ops.py runs every op and dtype on 2 and 4 GPUs
# across them (GPU ops through host staging, flags::HOST_STAGED), tests/gpu/kill_rank.sh kills a
# rank on one node, then (multinode mode only) gpu_vs_nccl.py measures
# all_reduce/all_gather that way (NCCL in the same run stays within the node over NVLink: a
# reference, not a peer): multinode-*.log, multinode.jsonl.
# `waitcmp`: how client streams wait for done counters (client-rs/src/gpu/wait.rs), compared in
# one run: send/recv (2 GPUs) and f32 all_reduce (2 and 4 GPUs) vs NCCL for each
# COMMD_GPU_WAIT value in $COMMD_WAITCMP_MODES (default "memop auto"), alternating,
# $COMMD_WAITCMP_ROUNDS rounds (default 2; ~1 min per mode and round on 2 GPUs): waitcmp-*.log
# and waitcmp.jsonl (each line's "gpu_wait" has the mode).
# `vmm` (also part of `tests`): cuMem memory, PyTorch's expandable segments
# (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), registered by POSIX-fd export:
# tests/gpu/vmm_remap.py on 1 and 2 GPUs (tensors spanning many pieces, pieces unmapped and
# mapped again), and tests/gpu/gpu_ops.py on 2 GPUs with that allocator.
# `rma` (run only by name): memory windows and one-sided ops of the NCCL library
# (tests/gpu/nccl_rma.py), then nccl-tests with -R 2 and -R 1 through it.
# COMMD_COMMIT names the commit in the benchmarks' output where the checkout has no .git.
# Tests: every op and dtype on 2 and 4 GPUs against NCCL on the same random data, zero-element
# tensors and init_process_group(device_id=...) (tests/gpu/empty_device_id.py), send/recv
# jobs run side by side and a hazard they must not (tests/gpu/p2p_overlap.py), one
# communicator's ops on unordered streams (tests/gpu/multi_stream.py), a torchrun job
# with init_process_group("commd") on CUDA tensors, the IPC handle cache counters, stream
# ordering, a rank killed mid-op; reductions in many rounds with both all-reduce algorithms
# (tests/gpu/gpu_rounds.py against a second daemon with a 64 KiB scratch slot). Bench: send/recv (2 GPUs) and all_gather (4 GPUs) vs NCCL.
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
case $what in
  tests|bench|breakdown|allreduce|interference|multinode|waitcmp|vmm|graphs|jobstart|eager|p2p|nccl|rma|deepspeed|dinov2|tenancy|dtypes|all) ;;
  *) echo "unknown mode '$what': expected tests, bench, breakdown, allreduce, interference, multinode, waitcmp, vmm, graphs, jobstart, eager, p2p, nccl, rma, deepspeed, dinov2, tenancy, dtypes or all"
     exit 2 ;;
esac
out=${2:-${OUT:-/tmp/commd-gpu-out}}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
[ -n "${COMMD_COMMIT:-}" ] || COMMD_COMMIT=$(git rev-parse --short HEAD 2>/dev/null) || true
export COMMD_COMMIT
bin=${COMMD_BIN:-target/release/commd}
[ -x "$bin" ] || bin=.gpu/commd
[ -x "$bin" ] || bin=$(command -v commd || true)
[ -x "$bin" ] || { echo "no commd binary: build it (cargo build --release -p commd) or set COMMD_BIN"; exit 2; }
wheels=${COMMD_WHEEL_DIR:-.gpu}
if ls "$wheels"/commd-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-deps --no-index --target /tmp/commd-site "$wheels"/commd-*.whl \
    && export PYTHONPATH=/tmp/commd-site${PYTHONPATH:+:$PYTHONPATH}
  # The checkout's Python sources win over the wheel's (same native module).
  cp client-py/python/commd/*.py /tmp/commd-site/commd/ 2>/dev/null || true
fi
python3 -c "import commd.torch" || { echo "the commd Python package is not importable"; exit 2; }
ngpu=$(nvidia-smi -L | wc -l)
echo "== $(nvidia-smi -L | head -1) x $ngpu; $("$bin" --version)"
sockdir=$(mktemp -d)
export COMMD_SOCKET=$sockdir/commd.sock
# COMMD_SERVE_ARGS: extra daemon flags, e.g. "--set gpu_scratch_slot_bytes=67108864".
# GPU_CHECK_PACK=FILE.tgz: at the end, the whole output folder in one archive (for the device
# tool, which brings back 8 files at most), logs over 2 MiB cut to their last 1.5 MiB.
# shellcheck disable=SC2086
COMMD_DEBUG=INFO "$bin" serve --socket "$COMMD_SOCKET" ${COMMD_SERVE_ARGS:-} >"$out/daemon-$what.log" 2>&1 &
dpid=$!
trap 'kill $dpid 2>/dev/null; wait $dpid 2>/dev/null' EXIT
for _ in $(seq 100); do [ -S "$COMMD_SOCKET" ] && break; sleep 0.1; done
"$bin" topo --socket "$COMMD_SOCKET" 2>&1 | tee "$out/topo.txt" || true
rc=0
# GPU_CHECK_RUN_LIMIT: seconds one command of `run` may take (default 900; a hang ends there).
run_limit=${GPU_CHECK_RUN_LIMIT:-900}
run_timeout=$run_limit
# GPU_CHECK_ONLY="name1 name2": run only those of the mode's commands (names as printed after
# "== "), e.g. to re-run failures within one device call.
run() { # name, command...
  local name=$1; shift
  if [ -n "${GPU_CHECK_ONLY:-}" ] && [[ " $GPU_CHECK_ONLY " != *" $name "* ]]; then return 0; fi
  echo "== $name"
  if ! timeout "$run_timeout" "$@" 2>&1 | tee "$out/$name.log"; then rc=1; echo "FAILED: $name"; fi
}
timed() { # seconds, name, command...: `run` under that time limit, then the time it took
  local limit=$1 name=$2 t0=$SECONDS; shift
  run_timeout=$limit
  run "$@"
  run_timeout=$run_limit
  echo "-- $name: $((SECONDS - t0)) s"
}
# (not a shell function: `timeout` runs programs)
tr=(python3 -m torch.distributed.run --standalone --nproc_per_node)
# Eager collectives as direct ops (docs/design-gpu.md, direct collectives rule 8; on by
# default): every op, dtype and size against references, two streams, a mismatch; a killed rank
# on that path; the suite with it off (small eager ops through the daemon); ranks sharing a GPU
# keep the daemon's path under auto and take the protocol under shared (3 ranks on 2 GPUs where
# there are 2).
eager_tests() {
  if [ "$ngpu" -ge 2 ]; then
    COMMD_EAGER_DIRECT=auto run "eager-direct-2-gpus" "${tr[@]}" 2 tests/gpu/eager_direct.py
    # Ops of at most 4 KiB on one block and by LL lines (the defaults) above; here on the half
    # grid by flags.
    COMMD_EAGER_DIRECT=auto COMMD_DIRECT_ONE_BLOCK_MAX_BYTES=0 COMMD_DIRECT_LL_MAX_BYTES=0 \
      run "eager-direct-flags-2-gpus" "${tr[@]}" 2 tests/gpu/eager_direct.py
    COMMD_DIRECT_ONE_BLOCK_MAX_BYTES=0 COMMD_DIRECT_LL_MAX_BYTES=0 \
      run "graph-capture-flags-2-gpus" "${tr[@]}" 2 tests/gpu/graph_capture.py
    COMMD_EAGER_DIRECT=0 run "ops-2-gpus-eager-daemon" "${tr[@]}" 2 tests/gpu/gpu_ops.py
    COMMD_EAGER_DIRECT=auto KILL_RANK_ELEMS=4096 run "kill-rank-eager-direct" tests/gpu/kill_rank.sh
  fi
  if [ "$ngpu" -ge 4 ]; then
    COMMD_EAGER_DIRECT=auto run "eager-direct-4-gpus" "${tr[@]}" 4 tests/gpu/eager_direct.py
  fi
  COMMD_EAGER_DIRECT=auto EAGER_DIRECT_EXPECT=daemon run "eager-direct-auto-shared-gpu-2-ranks" \
    env CUDA_VISIBLE_DEVICES=0 "${tr[@]}" 2 tests/gpu/eager_direct.py
  local two=0; [ "$ngpu" -ge 2 ] && two=0,1
  COMMD_EAGER_DIRECT=shared run "eager-direct-shared-3-ranks" \
    env CUDA_VISIBLE_DEVICES=$two "${tr[@]}" 3 tests/gpu/eager_direct.py
}
if [ "$what" = tests ] || [ "$what" = all ]; then
  for n in 2 4; do
    [ "$n" -le "$ngpu" ] && run "ops-$n-gpus" "${tr[@]}" "$n" tests/gpu/gpu_ops.py
  done
  # Both ways streams wait for done counters (client-rs/src/gpu/wait.rs; the default, auto,
  # mixes them by op size): every op with the polling kernel, and with cuStreamWaitValue32. The
  # daemon's path for every op (small eager ops are direct ops by default, with no such wait).
  if [ "$ngpu" -ge 2 ]; then
    COMMD_EAGER_DIRECT=0 COMMD_GPU_WAIT=kernel run "ops-2-gpus-kernel" "${tr[@]}" 2 tests/gpu/gpu_ops.py
    COMMD_EAGER_DIRECT=0 COMMD_GPU_WAIT=memop run "ops-2-gpus-memop" "${tr[@]}" 2 tests/gpu/gpu_ops.py
  fi
  # Small (memory-op wait) and large (kernel wait) ops alternating on one stream, no CPU sync
  # (the daemon's path, as above).
  for n in 1 2; do
    [ "$n" -le "$ngpu" ] && COMMD_EAGER_DIRECT=0 run "wait-mix-$n-gpus" "${tr[@]}" "$n" tests/gpu/wait_mix.py
  done
  run kill-rank tests/gpu/kill_rank.sh
  eager_tests
  # init_process_group(device_id=...), new_group after it, zero-element CUDA tensors.
  run "empty-device-id-2-ranks" "${tr[@]}" 2 tests/gpu/empty_device_id.py
  # ProcessGroupNCCL's semantics beyond values: coalesced ops' futures, wait(timeout), uneven
  # all-to-all's own block, overlapping outputs.
  run "torch-semantics-2-ranks" "${tr[@]}" 2 tests/gpu/torch_semantics.py
  run "p2p-overlap-2-ranks" "${tr[@]}" 2 tests/gpu/p2p_overlap.py
  # 4 ranks (sharing GPUs where fewer): the ring matched out of order (case 3).
  run "p2p-overlap-4-ranks" "${tr[@]}" 4 tests/gpu/p2p_overlap.py
  # One communicator's ops on three unordered streams (FSDP's pattern): the "commd" name, then
  # torch's "nccl" name on commd's library, and on real NCCL (one GPU per rank) as the control.
  run "multi-stream-2-ranks" "${tr[@]}" 2 tests/gpu/multi_stream.py
  mlib=${COMMD_NCCL_LIB:-target/release/libcommd_nccl.so}
  [ -f "$mlib" ] || mlib=.gpu/libcommd_nccl.so
  if [ -f "$mlib" ]; then
    MS_BACKEND=nccl LD_PRELOAD=$(readlink -f "$mlib") run "multi-stream-lib-2-ranks" "${tr[@]}" 2 tests/gpu/multi_stream.py
  fi
  [ "$ngpu" -ge 2 ] && MS_BACKEND=nccl run "multi-stream-nccl-2-gpus" "${tr[@]}" 2 tests/gpu/multi_stream.py
fi
if [ "$what" = tests ] || [ "$what" = graphs ] || [ "$what" = all ]; then
  # Contract 6 (docs/contracts.md): GPU ops captured into CUDA graphs run on every replay (every
  # op and dtype, data changed between replays, against eager results; mismatch), a rank killed
  # during replays, graphs destroyed (their slots come back); replay vs eager latency.
  run "graph-capture-2-ranks" "${tr[@]}" 2 tests/gpu/graph_capture.py
  [ "$ngpu" -ge 4 ] && run "graph-capture-4-ranks" "${tr[@]}" 4 tests/gpu/graph_capture.py
  run "graph-kill-2-ranks" tests/gpu/kill_rank.sh tests/gpu/graph_kill.py
  # Contract 7 (docs/contracts.md; direct captured all-reduce, a GPU per rank): the same kill on
  # that path, and the suite with it turned off (every captured op through the daemon).
  if [ "$ngpu" -ge 2 ]; then
    GRAPH_KILL_ELEMS=65536 GRAPH_CAPTURES=300 run "graph-kill-direct-2-ranks" tests/gpu/kill_rank.sh tests/gpu/graph_kill.py
    COMMD_GRAPH_DIRECT=0 GRAPH_CAPTURES=300 run "graph-kill-daemon-path-2-ranks" tests/gpu/kill_rank.sh tests/gpu/graph_kill.py
    COMMD_GRAPH_DIRECT=0 run "graph-capture-daemon-path-2-ranks" "${tr[@]}" 2 tests/gpu/graph_capture.py
  fi
  # vLLM's decode step (row-parallel layers: bf16 GEMM + TP all-reduce) captured per batch
  # size, replayed with new inputs against eager steps; NCCL beside it with a GPU per rank.
  run "vllm-decode-commd-2-ranks" "${tr[@]}" 2 tests/gpu/vllm_decode.py --backend commd \
    --json "$out/vllm_decode.jsonl"
  if [ "$ngpu" -ge 2 ]; then
    run "vllm-decode-nccl-2-gpus" "${tr[@]}" 2 tests/gpu/vllm_decode.py --backend nccl \
      --json "$out/vllm_decode.jsonl"
  fi
  # The direct protocol with more ranks than GPUs (COMMD_GRAPH_DIRECT=shared: ranks sharing a
  # GPU take it too, slowly): 4 ranks, whatever the GPU count.
  COMMD_GRAPH_DIRECT=shared run "graph-capture-direct-shared-4-ranks" "${tr[@]}" 4 tests/gpu/graph_capture.py
  # Communicators of one rank share the daemon's scratch: concurrent reductions stay right.
  run "shared-scratch-2-ranks" "${tr[@]}" 2 tests/gpu/shared_scratch.py
  run "graph-latency-commd-2-ranks" "${tr[@]}" 2 client-py/benchmarks/graph_latency.py \
    --backend commd --json "$out/graph_latency.jsonl"
  if [ "$ngpu" -ge 2 ]; then
    run "graph-latency-nccl-2-gpus" "${tr[@]}" 2 client-py/benchmarks/graph_latency.py \
      --backend nccl --json "$out/graph_latency.jsonl"
  fi
  if [ "$ngpu" -ge 4 ]; then
    for b in commd nccl; do
      run "graph-latency-$b-4-gpus" "${tr[@]}" 4 client-py/benchmarks/graph_latency.py \
        --backend $b --json "$out/graph_latency.jsonl"
    done
  fi
  # Contract 5 (docs/contracts.md) when the daemon itself dies: a daemon of its own, SIGKILLed
  # while a stream waits on its doorbell; the client's watchdog releases the stream and the next
  # call raises.
  "$bin" serve --socket "$sockdir/kill.sock" --set metrics_listen=off >"$out/daemon-kill.log" 2>&1 &
  kpid=$!
  for _ in $(seq 100); do [ -S "$sockdir/kill.sock" ] && break; sleep 0.1; done
  COMMD_SOCKET=$sockdir/kill.sock COMMD_TEST_DAEMON_PID=$kpid \
    run "kill-daemon-2-ranks" "${tr[@]}" 2 tests/gpu/kill_daemon.py
  wait $kpid 2>/dev/null
fi
if [ "$what" = eager ]; then
  # Eager direct ops (docs/design-gpu.md, direct collectives rule 8), run only by name: the
  # tests of `tests` for it, then per-op eager latency (graph_latency.py's eager column) with it
  # off, with it on, and NCCL's, on 2 GPUs (and 4 where there are 4): eager.jsonl.
  # EAGER_LATENCY=0: the tests alone.
  eager_tests
  [ "${EAGER_LATENCY:-1}" = 0 ] || for n in 2 4; do
    [ "$n" -le "$ngpu" ] || continue
    for op in ${EAGER_OPS:-all_reduce all_gather}; do
      for v in 0 auto; do
        COMMD_EAGER_DIRECT=$v run "eager-latency-$op-$n-gpus-commd-$v" "${tr[@]}" "$n" \
          client-py/benchmarks/graph_latency.py --backend commd --op "$op" \
          --sizes 8K,64K,512K,1M,2M --json "$out/eager.jsonl"
      done
      run "eager-latency-$op-$n-gpus-nccl" "${tr[@]}" "$n" client-py/benchmarks/graph_latency.py \
        --backend nccl --op "$op" --sizes 8K,64K,512K,1M,2M --json "$out/eager.jsonl"
    done
  done
fi
if [ "$what" = p2p ]; then
  # Send/recv as direct ops (COMMD_P2P_DIRECT: on by default; run only by name; the NCCL
  # library's ops only): torch's own "nccl" backend on the library (tests/gpu/nccl_p2p.py:
  # rings, LL and simple sizes, every pair at once, small beside large, single ops, a captured
  # ring; every value checked) by default, asked for by name, and with it off (=0), then
  # nccl-tests' sendrecv and alltoall through the library with and without it; and messages
  # whose sizes differ across the direct limit (tests/gpu/nccl_p2p_mismatch.py, 2 ranks: a
  # mismatch at once, never another message's data); and the library's stream ordering of
  # staged and host-memory ops (tests/gpu/nccl_streams.py: in-place all-to-all on two streams,
  # pinned memory on the NULL stream, a failed call in a group). On one GPU, ranks share it
  # (=shared).
  plib=${COMMD_NCCL_LIB:-target/release/libcommd_nccl.so}
  [ -f "$plib" ] || plib=.gpu/libcommd_nccl.so
  plib=$(readlink -f "$plib")
  if [ "$ngpu" -ge 2 ]; then
    for n in 2 4; do
      [ "$ngpu" -ge "$n" ] || continue
      LD_PRELOAD=$plib run "p2p-lib-default-$n-ranks" "${tr[@]}" "$n" tests/gpu/nccl_p2p.py
      COMMD_P2P_DIRECT=1 LD_PRELOAD=$plib run "p2p-lib-direct-$n-ranks" "${tr[@]}" "$n" tests/gpu/nccl_p2p.py
      COMMD_P2P_DIRECT=0 LD_PRELOAD=$plib run "p2p-lib-daemon-$n-ranks" "${tr[@]}" "$n" tests/gpu/nccl_p2p.py
    done
    COMMD_NCCL_LIB=$plib COMMD_P2P_DIRECT=1 run "p2p-lib-mismatch" "${tr[@]}" 2 \
      tests/gpu/nccl_p2p_mismatch.py
    COMMD_NCCL_LIB=$plib run "nccl-streams" "${tr[@]}" 2 tests/gpu/nccl_streams.py
    run_timeout=1500
    NCCL_PARTS=nccltests NCCL_TESTS_LIST="sendrecv alltoall" NCCL_TESTS_MODES="gpus p2p" \
      NCCL_TESTS_MAX=${NCCL_TESTS_MAX:-16M} run "p2p-nccl" tests/gpu/nccl.sh "$out/nccl"
    run_timeout=$run_limit
  else
    COMMD_P2P_DIRECT=shared LD_PRELOAD=$plib run "p2p-lib-shared-2-ranks" "${tr[@]}" 2 \
      tests/gpu/nccl_p2p.py
    COMMD_NCCL_LIB=$plib COMMD_P2P_DIRECT=shared run "p2p-lib-mismatch-shared" "${tr[@]}" 2 \
      tests/gpu/nccl_p2p_mismatch.py
    COMMD_NCCL_LIB=$plib COMMD_EAGER_DIRECT=shared run "nccl-streams-shared" "${tr[@]}" 2 \
      tests/gpu/nccl_streams.py
  fi
fi
if [ "$what" = rma ]; then
  # Memory windows and one-sided ops of the NCCL library (run only by name): tests/gpu/nccl_rma.py
  # (ping-pong, all-to-all by puts, barrier and counted signals, a put behind a long kernel,
  # windows in a group, NCCL's refusals) on 2 ranks (sharing the GPU on a one-GPU machine) and
  # 4 where there are 4 GPUs; then nccl-tests with symmetric windows (-R 2) and with
  # registration (-R 1), every program -c 1, through the library.
  plib=${COMMD_NCCL_LIB:-target/release/libcommd_nccl.so}
  [ -f "$plib" ] || plib=.gpu/libcommd_nccl.so
  plib=$(readlink -f "$plib")
  COMMD_NCCL_LIB=$plib run "rma-2-ranks" "${tr[@]}" 2 tests/gpu/nccl_rma.py
  [ "$ngpu" -ge 4 ] && COMMD_NCCL_LIB=$plib run "rma-4-ranks" "${tr[@]}" 4 tests/gpu/nccl_rma.py
  run_timeout=1500
  for reg in 2 1; do
    NCCL_PARTS=nccltests NCCL_TESTS_EXTRA="-R $reg ${NCCL_TESTS_EXTRA:-}" \
      NCCL_TESTS_MAX=${NCCL_TESTS_MAX:-16M} run "rma-nccltests-R$reg" tests/gpu/nccl.sh "$out/nccl-R$reg"
  done
  run_timeout=$run_limit
fi
if [ "$what" = nccl ]; then
  run_timeout=3000
  run "nccl" tests/gpu/nccl.sh "$out"
  run_timeout=$run_limit
fi
if [ "$what" = deepspeed ]; then
  if ! python3 -c "import deepspeed" 2>/dev/null && ls .whl/deepspeed-*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/ds-site .whl/*.whl \
      && export PYTHONPATH=$PYTHONPATH:/tmp/ds-site
  fi
  if [ "$ngpu" -lt 2 ]; then
    echo "deepspeed: needs 2 GPUs (NCCL, the reference, refuses ranks sharing one)"; rc=1
  else
    ds=(tests/deepspeed_worker.py)
    dsargs=(--cuda --hidden "${DS_HIDDEN:-4096}" --batch 64 --steps "${DS_STEPS:-30}" --bucket 50000000)
    for stage in ${DS_STAGES:-2 3}; do
      for round in $(seq "${DS_ROUNDS:-2}"); do
        for b in nccl commd; do
          run "deepspeed-z$stage-$b-$round" "${tr[@]}" "$ngpu" "${ds[@]}" $b $stage \
            "$out/ds-z$stage-$b-$round.json" "${dsargs[@]}"
        done
      done
      ctl=()
      if [ "$ngpu" -gt 2 ]; then
        # The control: NCCL with another channel count sums in another order (see
        # deepspeed_compare.py); commd passes within 3x its distance from the reference.
        NCCL_MAX_NCHANNELS=2 run "deepspeed-z$stage-nccl2ch" "${tr[@]}" "$ngpu" "${ds[@]}" nccl \
          $stage "$out/ctl-z$stage-nccl2ch.json" "${dsargs[@]}"
        ctl=(--control "$out/ctl-z$stage-nccl2ch.json")
      fi
      # NCCL's run of another stage: the same training through other collectives (a control
      # where NCCL's channel count leaves the order as it was; deepspeed_compare.py).
      for f in "$out"/ds-z*-nccl-1.json; do
        [ -f "$f" ] && [ "$f" != "$out/ds-z$stage-nccl-1.json" ] && ctl+=(--control "$f")
      done
      run "deepspeed-z$stage-compare" python3 tests/gpu/deepspeed_compare.py \
        --json "$out/deepspeed.jsonl" "${ctl[@]}" "$out/ds-z$stage-nccl-1.json" "$out"/ds-z$stage-*.json
    done
  fi
fi
if [ "$what" = dinov2 ]; then
  if ! python3 -c "import omegaconf, fvcore, iopath, xformers" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dv-site \
      .whl/omegaconf-*.whl .whl/iopath-*.whl .whl/portalocker-*.whl .whl/termcolor-*.whl \
      .whl/tabulate-*.whl .whl/yacs-*.whl .whl/fvcore-*.whl .whl/xformers-*.whl \
      && export PYTHONPATH=$PYTHONPATH:/tmp/dv-site
  fi
  if [ -z "${DINOV2_SRC:-}" ]; then
    mkdir -p /tmp/dinov2-src && tar xzf .gpu/dinov2-src.tar.gz -C /tmp/dinov2-src
    export DINOV2_SRC=/tmp/dinov2-src
  fi
  nlib=${COMMD_NCCL_LIB:-target/release/libcommd_nccl.so}
  [ -f "$nlib" ] || nlib=.gpu/libcommd_nccl.so
  nlib=$(readlink -f "$nlib")
  dv=(tests/gpu/dinov2_accept.py --steps "${DINOV2_STEPS:-10}")
  dvcmp() { # ref, run...: rank 0's total loss per step against the reference run's
    python3 - "$out" "$@" <<'PY'
import json, sys
out, ref, *runs = sys.argv[1:]
load = lambda n: json.load(open(f"{out}/dv-{n}/accept_losses.rank0.json"))
r = load(ref)
bad = False
for n in runs:
    g = load(n)
    d = max(abs(a["total_loss"] - b["total_loss"]) / max(abs(b["total_loss"]), 1e-9)
            for a, b in zip(g, r))
    ms = lambda x: sorted(s["step_time_s"] for s in x[2:] or x)[len(x[2:] or x) // 2] * 1e3
    row = {"bench": "dinov2", "ref": ref, "run": n, "steps": len(g), "loss_max_rel_diff": d,
           "final_loss_ref": r[-1]["total_loss"], "final_loss_run": g[-1]["total_loss"],
           "ref_step_ms": round(ms(r), 2), "run_step_ms": round(ms(g), 2),
           "ok": len(g) == len(r) and d <= 1e-3}
    bad |= not row["ok"]
    print(json.dumps(row))
    open(f"{out}/dinov2.jsonl", "a").write(json.dumps(row) + "\n")
sys.exit(1 if bad else 0)
PY
  }
  if [ "$ngpu" -ge 2 ]; then
    dn=$(( ngpu >= 4 ? 4 : 2 ))
    run "dinov2-nccl" "${tr[@]}" $dn "${dv[@]}" --out "$out/dv-nccl"
    LD_PRELOAD=$nlib run "dinov2-commd-lib" "${tr[@]}" $dn "${dv[@]}" --out "$out/dv-lib"
    DINOV2_TEST_BACKEND=commd run "dinov2-commd-backend" "${tr[@]}" $dn "${dv[@]}" --out "$out/dv-commd"
    echo "== dinov2-compare"
    dvcmp nccl lib commd 2>&1 | tee "$out/dinov2-compare.log" || rc=1
  else
    export DINOV2_SHARE_GPU=1
    LD_PRELOAD=$nlib run "dinov2-commd-lib" "${tr[@]}" 2 "${dv[@]}" --out "$out/dv-lib"
    DINOV2_TEST_BACKEND=commd run "dinov2-commd-backend" "${tr[@]}" 2 "${dv[@]}" --out "$out/dv-commd"
    echo "== dinov2-compare"
    dvcmp lib commd 2>&1 | tee "$out/dinov2-compare.log" || rc=1
    unset DINOV2_SHARE_GPU
  fi
fi
if [ "$what" = jobstart ]; then
  COMMD_BIN=$bin run "jobstart" python3 client-py/benchmarks/job_start.py \
    --json "$out/jobstart.jsonl" --log-dir "$out"
fi
if [ "$what" = tests ] || [ "$what" = tenancy ] || [ "$what" = all ]; then
  tc=${COMMD_TESTCLIENT:-target/release/commd-testclient}
  [ -x "$tc" ] || tc=.gpu/commd-testclient
  run "tenancy" python3 tests/gpu/tenancy.py "$bin" "$tc"
fi
if [ "$what" = tests ] || [ "$what" = dtypes ] || [ "$what" = all ]; then
  kt=${COMMD_CUDA_TESTS:-.gpu/commd-cuda-tests}
  if [ -x "$kt" ]; then
    COMMD_REQUIRE_GPU=1 COMMD_REQUIRE_NVRTC=1 run "kernels-vs-host" "$kt" --exact \
      kernels::tests::gpu_kernels_match_host_reference --nocapture
  else
    echo "no $kt (scripts/gpu-carry build makes it): kernels-vs-host not run"; rc=1
  fi
  run "typed-2-ranks" "${tr[@]}" 2 tests/torch_worker.py typed cuda
  # 3 ranks: the reduction order shows (every rank must reduce in rank order to get the same
  # bits): the fused rounds kernel (default), one launch per round, and direct ops.
  run "typed-3-ranks" "${tr[@]}" 3 tests/torch_worker.py typed cuda
  COMMD_GPU_FUSED_ROUNDS=0 run "typed-3-ranks-per-round" "${tr[@]}" 3 tests/torch_worker.py typed cuda
  COMMD_EAGER_DIRECT=shared run "typed-3-ranks-direct" "${tr[@]}" 3 tests/torch_worker.py typed cuda
fi
if [ "$what" = tests ] || [ "$what" = vmm ] || [ "$what" = all ]; then
  # cuMem memory (expandable segments): POSIX-fd registration, many pieces, remapped pieces;
  # the same test on ordinary (cudaMalloc) memory first, as the reference.
  [ "$ngpu" -ge 2 ] && run "remap-2-gpus-legacy" "${tr[@]}" 2 tests/gpu/vmm_remap.py
  for n in 1 2; do
    [ "$n" -le "$ngpu" ] && PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
      run "vmm-$n-gpus" "${tr[@]}" "$n" tests/gpu/vmm_remap.py
  done
  [ "$ngpu" -ge 2 ] && PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
    run "ops-2-gpus-vmm" "${tr[@]}" 2 tests/gpu/gpu_ops.py
fi
if [ "$what" = tests ] || [ "$what" = all ]; then
  # Reductions in many rounds (scratch buffers alternating, copies issued a phase ahead), with
  # both all-reduce algorithms: a second daemon with a 64 KiB scratch slot.
  sock2=$sockdir/small.sock
  "$bin" serve --socket "$sock2" --set gpu_scratch_slot_bytes=65536 --set metrics_listen=off \
    --set peer_listen=off >"$out/daemon-small-slots.log" 2>&1 &
  d2=$!
  for _ in $(seq 100); do [ -S "$sock2" ] && break; sleep 0.1; done
  # Each once with every round in one launch (the rounds kernel, the default) and once with
  # one launch per round (COMMD_GPU_FUSED_ROUNDS=0); and the rounds kernel on a grid of 3
  # blocks (many grid-stride steps per round).
  for n in 2 4; do
    for algo in rsag oneshot; do
      [ "$n" -le "$ngpu" ] && COMMD_SOCKET=$sock2 COMMD_ALLREDUCE_ALGO=$algo \
        run "rounds-$n-gpus-$algo" "${tr[@]}" "$n" tests/gpu/gpu_rounds.py
    done
    [ "$n" -le "$ngpu" ] && COMMD_SOCKET=$sock2 COMMD_GPU_FUSED_ROUNDS=0 \
      run "rounds-$n-gpus-per-round" "${tr[@]}" "$n" tests/gpu/gpu_rounds.py
    [ "$n" -le "$ngpu" ] && COMMD_SOCKET=$sock2 COMMD_GPU_FUSED_BLOCKS=3 \
      run "rounds-$n-gpus-3-blocks" "${tr[@]}" "$n" tests/gpu/gpu_rounds.py
  done
  kill $d2 2>/dev/null; wait $d2 2>/dev/null
fi
g=$(( ngpu >= 4 ? 4 : ngpu ))
if [ "$what" = tests ] || [ "$what" = multinode ] || [ "$what" = all ]; then
  t_mode=$SECONDS
  nodes=()
  for i in a b; do
    COMMD_DEBUG=${COMMD_NODE_DEBUG:-INFO} COMMD_DEBUG_SUBSYS=${COMMD_NODE_SUBSYS:-NET} \
      "$bin" serve --socket "$sockdir/node-$i.sock" --set peer_listen=127.0.0.1:0 \
      --set metrics_listen=off >"$out/daemon-node-$i.log" 2>&1 &
    nodes+=($!)
  done
  for i in a b; do
    for _ in $(seq 100); do [ -S "$sockdir/node-$i.sock" ] && break; sleep 0.1; done
  done
  export COMMD_NODE_SOCKETS=$sockdir/node-a.sock,$sockdir/node-b.sock
  for n in 2 4; do
    [ "$n" -le "$ngpu" ] && run "multinode-ops-$n-gpus" "${tr[@]}" "$n" tests/gpu/gpu_ops.py
  done
  # A rank killed on one node: the other node's rank gets an error naming it, stream released.
  run multinode-kill-rank tests/gpu/kill_rank.sh
  if [ "$what" = multinode ]; then
    # The host-memory path between the same two kinds of daemons, for reference.
    run multinode-host-bench env -u COMMD_SOCKET "$bin" bench --nodes 2 --ranks 4 --min-bytes 64K --max-bytes 256M \
      --step-factor 4
    timed 300 "multinode-bench-$g-gpus" "${tr[@]}" "$g" client-py/benchmarks/gpu_vs_nccl.py \
      --op all_reduce,all_gather --dtypes float32 --sizes 64K,1M,16M,64M,256M \
      --json "$out/multinode.jsonl"
  fi
  unset COMMD_NODE_SOCKETS
  kill "${nodes[@]}" 2>/dev/null; wait "${nodes[@]}" 2>/dev/null
  echo "-- multinode: $((SECONDS - t_mode)) s"
fi
if [ "$what" = breakdown ]; then
  run breakdown-sendrecv "${tr[@]}" 2 client-py/benchmarks/gpu_op_breakdown.py --op sendrecv --out "$out"
  run breakdown-allgather "${tr[@]}" "$g" client-py/benchmarks/gpu_op_breakdown.py --op all_gather --out "$out"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  for op in ${COMMD_BENCH_OPS:-sendrecv all_gather all_reduce}; do
    n=$g; [ "$op" = sendrecv ] && n=2
    run "bench-$op" "${tr[@]}" "$n" client-py/benchmarks/gpu_vs_nccl.py --op "$op" --json "$out/bench.jsonl"
  done
fi
if [ "$what" = allreduce ]; then
  t_mode=$SECONDS
  for n in 2 4; do
    [ "$n" -le "$ngpu" ] || continue
    timed 300 "allreduce-$n-gpus" "${tr[@]}" "$n" client-py/benchmarks/gpu_vs_nccl.py \
      --op all_reduce,reduce_scatter --dtypes float32,bfloat16 --json "$out/allreduce.jsonl"
  done
  echo "-- allreduce: $((SECONDS - t_mode)) s in all"
fi
if [ "$what" = waitcmp ]; then
  export COMMD_EAGER_DIRECT=0 # the waits of the daemon's path are what is compared
  for r in $(seq "${COMMD_WAITCMP_ROUNDS:-2}"); do
    for w in ${COMMD_WAITCMP_MODES:-memop auto}; do
      COMMD_GPU_WAIT=$w timed 300 "waitcmp-sendrecv-$w-$r" "${tr[@]}" 2 client-py/benchmarks/gpu_vs_nccl.py \
        --op sendrecv --json "$out/waitcmp.jsonl"
      for n in 2 4; do
        [ "$n" -le "$ngpu" ] || continue
        COMMD_GPU_WAIT=$w timed 300 "waitcmp-allreduce-$n-$w-$r" "${tr[@]}" "$n" client-py/benchmarks/gpu_vs_nccl.py \
          --op all_reduce --dtypes float32 --sizes 64K,1M,16M,64M,256M --json "$out/waitcmp.jsonl"
      done
    done
  done
fi
if [ "$what" = interference ]; then
  # INTERFERENCE_GPUS: the GPU counts (default: all up to 4). Per count: NCCL and commd at the
  # pacing caps, then commd uncapped with one reduction launch per round
  # (COMMD_GPU_FUSED_ROUNDS=0, without the rounds kernel) for comparison; then a DDP
  # training step with its bucket all-reduces overlapped with the backward pass, commd against
  # NCCL (client-py/benchmarks/ddp_overlap.py: ddp_overlap.jsonl).
  for n in ${INTERFERENCE_GPUS:-$g}; do
    [ "$n" -le "$ngpu" ] || continue
    timed 300 "interference-$n-gpus" "${tr[@]}" "$n" client-py/benchmarks/gemm_interference.py \
      --pacing "${COMMD_PACING:-0,300,200,100,50,25}" --json "$out/interference.jsonl"
    COMMD_GPU_FUSED_ROUNDS=0 timed 200 "interference-$n-gpus-per-round" "${tr[@]}" "$n" \
      client-py/benchmarks/gemm_interference.py --no-nccl --pacing 0 \
      --json "$out/interference.jsonl"
    timed 300 "ddp-overlap-$n-gpus" "${tr[@]}" "$n" client-py/benchmarks/ddp_overlap.py \
      --json "$out/ddp_overlap.jsonl"
  done
fi
"$bin" status --socket "$COMMD_SOCKET" > "$out/status.txt" 2>&1 || true
tail -50 "$out/daemon-$what.log"
if [ -n "${GPU_CHECK_PACK:-}" ]; then
  # One archive of the results (the device tool brings back at most 8 files of 16 MiB): logs
  # over 2 MiB keep their last 1.5 MiB; nccl-tests' binaries are left out.
  find "$out" -type f -name '*.log' -size +2M | while read -r f; do tail -c 1500000 "$f" >"$f.t" && mv "$f.t" "$f"; done
  tar czf "$GPU_CHECK_PACK" --exclude='nccl-tests-bin.tgz' -C "$(dirname "$out")" "$(basename "$out")" \
    && echo "packed $out into $GPU_CHECK_PACK"
fi
exit $rc
