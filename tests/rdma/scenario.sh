#!/bin/sh
# Runs inside the RDMA test VM (tests/rdma/vm-test.sh): two commd daemons = two nodes on the
# same Soft-RoCE device rxe0 (10.0.0.1, distinct peer ports, sockets), four client ranks (two
# per node). Prints "== step" headers, "ok ..."/"not ok ..." lines and SMOKE rows; touches
# /tmp/pass when everything passed.
export COMMD_DEBUG=INFO COMMD_METRICS_LISTEN=127.0.0.1:0
FAILED=0
ok() { echo "ok - $*"; }
bad() { echo "not ok - $*"; FAILED=1; }
now() { cut -d' ' -f1 /proc/uptime; }

start_node() { # index, extra env...
  i=$1; shift
  mkdir -p /tmp/n$i
  env COMMD_PEER_LISTEN=10.0.0.1:740$i "$@" commd serve --socket /tmp/n$i/s.sock > /tmp/n$i/log 2>&1 &
  echo $! > /tmp/n$i/pid
  k=0
  while [ ! -S /tmp/n$i/s.sock ] && [ $k -lt 300 ]; do usleep 100000; k=$((k + 1)); done
  [ -S /tmp/n$i/s.sock ] || { bad "node $i did not start"; cat /tmp/n$i/log; }
}
stop_node() { kill "$(cat /tmp/n$1/pid)" 2>/dev/null; wait "$(cat /tmp/n$1/pid)" 2>/dev/null; }

# rank r on node r/2, steps from /test/$2 (suffix r appended when $3 = per-rank)
run_ranks() { # tag, steps-file-prefix, per-rank(0/1)
  uid=$(commd-testclient uid --socket /tmp/n0/s.sock)
  for r in 0 1 2 3; do
    f=/test/$2.json; [ "$3" = 1 ] && f=/test/$2$r.json
    commd-testclient run --socket /tmp/n$((r / 2))/s.sock --join "$uid:$r:4" --steps "$(cat $f)" \
      > /tmp/$1.r$r.out 2>&1 &
    echo $! > /tmp/$1.r$r.pid
  done
}
wait_ranks() { # tag -> sets RC_r
  for r in 0 1 2 3; do
    wait "$(cat /tmp/$1.r$r.pid)"; eval RC_$r=$?
  done
}

echo "== devices"
cat /sys/class/infiniband/*/ports/1/gids/0 /sys/class/infiniband/*/ports/1/gids/1 2>/dev/null
commd topo --socket /tmp/none.sock 2>/dev/null | sed 's/^/  /'

echo "== forced RDMA: two daemons over rxe0, every collective across nodes"
start_node 0 COMMD_TRANSPORT=rdma
start_node 1 COMMD_TRANSPORT=rdma
t=$(now)
run_ranks coll steps 1
wait_ranks coll
echo "collectives took $(awk "BEGIN{print $(now) - $t}") s"
for r in 0 1 2 3; do
  eval rc=\$RC_$r
  n=$(grep -c '"pass":true' /tmp/coll.r$r.out)
  if [ "$rc" = 0 ]; then ok "rank $r: $n steps passed"; else bad "rank $r exit $rc"; tail -5 /tmp/coll.r$r.out; fi
done
if grep -q "RDMA, 2 RC QP" /tmp/n0/log && grep -q "RDMA, 2 RC QP" /tmp/n1/log; then
  ok "both nodes logged the RDMA path"; grep -h "path to" /tmp/n0/log | sed 's/.*path to/  path to/' | head -2
else
  bad "no RDMA path in the logs"; grep -h "path to\|RDMA" /tmp/n0/log /tmp/n1/log | head
fi
grep -h "RDMA transport" /tmp/n0/log | sed 's/.*RDMA transport/  RDMA transport/' | head -1

echo "== a killed peer daemon fails the survivors naming the node"
run_ranks kill kill 0
# Kill node 1's daemon once the communicator is up (every rank finished its first all_reduce).
k=0
while [ $k -lt 600 ]; do
  n=0; for r in 0 1 2 3; do grep -q '"pass":true,"result":"ok","step":0,' /tmp/kill.r$r.out 2>/dev/null && n=$((n + 1)); done
  [ $n = 4 ] && break
  usleep 100000; k=$((k + 1))
done
kill -9 "$(cat /tmp/n1/pid)"; wait "$(cat /tmp/n1/pid)" 2>/dev/null
t=$(now)
# Time to the first error on the surviving node's ranks (later steps fail at once after it).
k=0
while [ $k -lt 600 ]; do
  grep -q '"result":"peer_lost"\|"result":"aborted"' /tmp/kill.r0.out && grep -q '"result":"peer_lost"\|"result":"aborted"' /tmp/kill.r1.out && break
  usleep 100000; k=$((k + 1))
done
took=$(awk "BEGIN{print $(now) - $t}")
for r in 0 1 2 3; do wait "$(cat /tmp/kill.r$r.pid)" 2>/dev/null; done
for r in 0 1; do
  msg=$(grep '"result":"peer_lost"\|"result":"aborted"' /tmp/kill.r$r.out | head -1)
  if echo "$msg" | grep -q "node 1 (10.0.0.1:7401, ranks 2,3)"; then ok "rank $r failed naming node 1"; else bad "rank $r: no error naming node 1"; tail -3 /tmp/kill.r$r.out; fi
done
echo "first error on the survivors $took s after the kill:"
echo "  $(grep -h '"result":"peer_lost"\|"result":"aborted"' /tmp/kill.r0.out | head -1 | sed 's/.*"message":"\([^"]*\)".*/\1/')"
awk "BEGIN{exit !($took < 15)}" && ok "survivors failed within 15 s" || bad "survivors took $took s"
kill -0 "$(cat /tmp/n0/pid)" 2>/dev/null && ok "node 0 keeps running" || bad "node 0 died"
stop_node 0

echo "== smoke: commd bench --nodes 2 (RDMA vs TCP in the same VM; emulated, not a speed claim)"
for tr in rdma tcp; do
  commd bench --nodes 2 --ranks 2 --min-bytes 64K --max-bytes 4M --step-factor 8 --iters 5 --warmup 2 --set transport=$tr > /tmp/bench.$tr 2>&1 \
    && ok "bench $tr" || { bad "bench $tr"; tail -20 /tmp/bench.$tr; }
  grep -v '^#' /tmp/bench.$tr | grep -E '^ *[0-9]' | sed "s/^/SMOKE $tr /"
  grep '^#' /tmp/bench.$tr | head -2 | sed "s/^/  /"
done

[ $FAILED = 0 ] && touch /tmp/pass
