#!/usr/bin/env bash
# Runs a two-rank kill test without torchrun (default tests/gpu/kill_rank.py; the first argument
# names another, e.g. tests/gpu/graph_kill.py): the victim SIGKILLs itself, and torchrun would
# then tear down the survivor before it can check its error. Exit status: the survivor's.
set -u
cd "$(dirname "$0")/../.."
script=${1:-tests/gpu/kill_rank.py}
port=$((29500 + RANDOM % 2000))
env MASTER_ADDR=127.0.0.1 MASTER_PORT=$port WORLD_SIZE=2 RANK=1 LOCAL_RANK=1 \
  python3 "$script" &
victim=$!
env MASTER_ADDR=127.0.0.1 MASTER_PORT=$port WORLD_SIZE=2 RANK=0 LOCAL_RANK=0 \
  python3 "$script"
rc=$?
wait $victim 2>/dev/null
exit $rc
