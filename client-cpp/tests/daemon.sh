#!/bin/sh
# The ctest fixture's daemon: `daemon.sh start DIR COMMD_BIN` starts `commd serve` on DIR/commd.sock
# and waits until it answers; `daemon.sh stop DIR` sends SIGTERM and checks that it exited 0.
# The daemon's log is DIR/commd.log; it is printed when something goes wrong.
set -eu
cmd=$1
dir=$2

show_log() {
  echo "---- commd log ($dir/commd.log) ----"
  cat "$dir/commd.log" 2>/dev/null || true
}

case $cmd in
start)
  bin=$3
  if [ ! -x "$bin" ]; then
    echo "commd binary $bin not found: run 'cargo build --release' in the workspace" >&2
    exit 1
  fi
  rm -rf "$dir"
  mkdir -p "$dir"
  # A detached wrapper keeps the daemon's exit status in DIR/exit. Its stdio must not be
  # ctest's pipes, or ctest would wait for the daemon to exit.
  setsid sh -c '
    COMMD_DEBUG=${COMMD_DEBUG:-INFO} "$0" serve --socket "$1/commd.sock" >"$1/commd.log" 2>&1 &
    echo $! >"$1/pid"
    wait $!
    echo $? >"$1/exit.tmp"
    mv "$1/exit.tmp" "$1/exit"
  ' "$bin" "$dir" </dev/null >/dev/null 2>&1 &
  i=0
  while [ $i -lt 200 ]; do
    if [ -e "$dir/exit" ]; then
      echo "commd exited with status $(cat "$dir/exit") while starting" >&2
      show_log
      exit 1
    fi
    if [ -S "$dir/commd.sock" ] && "$bin" status --socket "$dir/commd.sock" >/dev/null 2>&1; then
      echo "commd $(cat "$dir/pid") serving on $dir/commd.sock"
      exit 0
    fi
    sleep 0.05
    i=$((i + 1))
  done
  echo "commd did not answer on $dir/commd.sock within 10 s" >&2
  show_log
  [ -f "$dir/pid" ] && kill -KILL "$(cat "$dir/pid")" 2>/dev/null
  exit 1
  ;;
stop)
  if [ ! -f "$dir/pid" ]; then
    echo "no daemon was started in $dir" >&2
    exit 1
  fi
  pid=$(cat "$dir/pid")
  kill -TERM "$pid" 2>/dev/null || true
  i=0
  while [ ! -e "$dir/exit" ] && [ $i -lt 200 ]; do
    sleep 0.05
    i=$((i + 1))
  done
  if [ ! -e "$dir/exit" ]; then
    echo "commd (pid $pid) did not exit within 10 s of SIGTERM; killing it" >&2
    kill -KILL "$pid" 2>/dev/null || true
    show_log
    exit 1
  fi
  code=$(cat "$dir/exit")
  if [ "$code" != 0 ]; then
    echo "commd exited with status $code (expected 0 after SIGTERM)" >&2
    show_log
    exit 1
  fi
  echo "commd exited 0"
  ;;
*)
  echo "usage: $0 start DIR COMMD_BIN | stop DIR" >&2
  exit 2
  ;;
esac
