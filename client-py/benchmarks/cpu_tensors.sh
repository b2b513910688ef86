#!/usr/bin/env bash
# Issue 65's CPU benchmarks (allreduce_vs_gloo one node and two daemons, the CPU DDP step vs
# gloo) on a host with more cores, e.g. a GPU host (no GPU used): carry .gpu (scripts/gpu-carry
# build) and run `bash client-py/benchmarks/cpu_tensors.sh` there; results under $OUT.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/cpu-tensors}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-index --target /tmp/commd-site .gpu/commd-*.whl
export PYTHONPATH=/tmp/commd-site
cp client-py/python/commd/*.py /tmp/commd-site/commd/
export OMP_NUM_THREADS=1
{ nproc; python3 -c "import torch; print(torch.__version__)"; grep -m1 "model name" /proc/cpuinfo; date -u; } > $OUT/info.txt
( time timeout 240 python3 -m commd._c10d ) > $OUT/shell.txt 2>&1
B=client-py/benchmarks/allreduce_vs_gloo.py
timeout 150 python3 $B --start-daemon .gpu/commd --nranks 4 --min-bytes 1048576 --max-bytes 33554432 --iters 40 --staged --registered --json $OUT/one.json > $OUT/one.txt 2>&1
timeout 150 python3 $B --start-daemon .gpu/commd --nodes 2 --nranks 4 --min-bytes 1048576 --max-bytes 33554432 --iters 30 --registered --json $OUT/two.json > $OUT/two.txt 2>&1
timeout 90 .gpu/commd bench --nodes 2 --ranks 4 -b 1M -e 32M -n 30 --set transport=tcp > $OUT/bench-two.txt 2>&1
D=$(mktemp -d); .gpu/commd serve --socket $D/s.sock > $OUT/daemon.log 2>&1 & dp=$!
sleep 1
COMMD_SOCKET=$D/s.sock timeout 200 python3 -m torch.distributed.run --nproc_per_node 4 --master_port 29533 client-py/benchmarks/ddp_overlap.py --device cpu --threads 4 --layers 4 --dim 1024 --vocab 8192 --batch 1 --seq 32 --steps 10 --warmup 2 --block 2 --json $OUT/ddp.jsonl > $OUT/ddp.txt 2>&1
kill $dp
