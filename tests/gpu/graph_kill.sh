#!/usr/bin/env bash
# Runs tests/gpu/graph_kill.py as two ranks without torchrun: the victim SIGKILLs itself, and
# torchrun would then tear down the survivor before it can check its error. Exit status: the
# survivor's.
set -u
cd "$(dirname "$0")/../.."
port=$((29500 + RANDOM % 2000))
env MASTER_ADDR=127.0.0.1 MASTER_PORT=$port WORLD_SIZE=2 RANK=1 LOCAL_RANK=1 \
  python3 tests/gpu/graph_kill.py &
victim=$!
env MASTER_ADDR=127.0.0.1 MASTER_PORT=$port WORLD_SIZE=2 RANK=0 LOCAL_RANK=0 \
  python3 tests/gpu/graph_kill.py
rc=$?
wait $victim 2>/dev/null
exit $rc
