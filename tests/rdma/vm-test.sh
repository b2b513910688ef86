#!/usr/bin/env bash
# Real verbs in CI: boots Debian's kernel under QEMU (TCG, no KVM needed) with a busybox
# initramfs, loads Soft-RoCE (rdma_rxe) on a dummy netdev, and runs tests/rdma/scenario.sh there:
# two `commd` daemons as two nodes over rxe0 with real `commd-testclient` ranks (every
# collective across nodes through RDMA, results checked by the clients), a killed peer daemon
# that must fail the survivors naming the node, and `commd bench` smoke numbers RDMA vs TCP.
#
# Usage: tests/rdma/vm-test.sh [BIN_DIR]   (default: target/release; needs commd and
#        commd-testclient there). Exit 0: PASS; 1: FAIL; 77: cannot build or boot the VM here
#        (reason printed). Work dir: target/rdma-vm (kernel .debs are cached there).
# Needs: qemu-system-x86_64, busybox (static), cpio, dpkg-deb, apt-get (to download the kernel
#        .deb), rdma (iproute2), libibverbs1 + ibverbs-providers (librxe), python3.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
BIN=$(cd "${1:-$ROOT/target/release}" && pwd)
WORK=${COMMD_VM_WORK:-$ROOT/target/rdma-vm}
TIMEOUT=${COMMD_VM_TIMEOUT:-420}
skip() { echo "rdma-vm: SKIP: $*" >&2; exit 77; }

for t in qemu-system-x86_64 cpio dpkg-deb python3 rdma; do
  command -v "$t" >/dev/null || skip "$t not found (scripts/test installs qemu-system-x86, cpio, iproute2)"
done
BUSYBOX=$(command -v busybox || true)
[ -n "$BUSYBOX" ] && file -L "$BUSYBOX" 2>/dev/null | grep -q "statically linked" || BUSYBOX=/bin/busybox
[ -x "$BUSYBOX" ] || skip "a static busybox is needed (apt-get install busybox-static)"
RXE=$(ls /usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav*.so 2>/dev/null | head -1 || true)
[ -n "$RXE" ] || skip "librxe (ibverbs-providers) not installed"
[ -f /etc/libibverbs.d/rxe.driver ] || skip "/etc/libibverbs.d/rxe.driver missing (ibverbs-providers)"
VERBS=$(ls /usr/lib/x86_64-linux-gnu/libibverbs.so.1 2>/dev/null || true)
[ -n "$VERBS" ] || skip "libibverbs.so.1 not installed (libibverbs1)"
for b in commd commd-testclient; do [ -x "$BIN/$b" ] || skip "$BIN/$b not built"; done

mkdir -p "$WORK/kernel"
# The kernel: Debian's linux-image-amd64 (rdma_rxe is a module there), downloaded, not installed.
KDIR="$WORK/kernel/x"
if [ ! -d "$KDIR/boot" ]; then
  ( cd "$WORK/kernel"
    pkg=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/{print $2; exit}')
    [ -n "$pkg" ] || { apt-get update -qq >/dev/null 2>&1 || true; pkg=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-[0-9]/{print $2; exit}'); }
    [ -n "$pkg" ] || exit 3
    apt-get download -qq "$pkg" >/dev/null 2>&1 \
      || { apt-get update -qq >/dev/null 2>&1; apt-get download -qq "$pkg" >/dev/null 2>&1; } || exit 4
    rm -rf x.tmp && mkdir x.tmp && dpkg-deb -x linux-image-*.deb x.tmp && mv x.tmp x
  ) || skip "cannot download/extract Debian's linux-image-amd64 kernel (no apt sources?)"
fi
VMLINUZ=$(ls "$KDIR"/boot/vmlinuz-* | head -1)
KVER=$(basename "$VMLINUZ" | sed 's/^vmlinuz-//')
MODDIR="$KDIR/lib/modules/$KVER/kernel"

IR="$WORK/initramfs"
rm -rf "$IR" && mkdir -p "$IR"/{bin,sbin,etc,proc,sys,dev,tmp,run,lib/modules,usr/lib/x86_64-linux-gnu/libibverbs,etc/libibverbs.d,test}
cp "$BUSYBOX" "$IR/bin/busybox"
for m in crypto/crc32_generic net/ipv4/udp_tunnel net/ipv6/ip6_udp_tunnel drivers/infiniband/core/ib_core \
         drivers/infiniband/core/ib_uverbs drivers/infiniband/sw/rxe/rdma_rxe drivers/net/dummy; do
  f=$(ls "$MODDIR/$m.ko"* | head -1)
  case "$f" in
    *.xz) xz -dc "$f" > "$IR/lib/modules/$(basename "$m").ko" ;;
    *.zst) zstd -qdc "$f" > "$IR/lib/modules/$(basename "$m").ko" ;;
    *) cp "$f" "$IR/lib/modules/$(basename "$m").ko" ;;
  esac
done
copy_with_libs() {
  local f=$1 dest=$2
  cp -L "$f" "$IR$dest"
  # Debug info makes the initramfs (unpacked into the VM's RAM) needlessly large.
  if command -v strip >/dev/null; then strip --strip-debug "$IR$dest" 2>/dev/null || true; fi
  ldd "$f" 2>/dev/null | awk '/=> \//{print $3} /^\t\/lib/{print $1}' | while read -r l; do
    mkdir -p "$IR$(dirname "$l")"; cp -Ln "$l" "$IR$l" 2>/dev/null || true
  done
}
copy_with_libs "$BIN/commd" /bin/commd
copy_with_libs "$BIN/commd-testclient" /bin/commd-testclient
copy_with_libs "$(command -v rdma)" /bin/rdma
# Loaded at run time (dlopen), so ldd does not list them.
copy_with_libs "$VERBS" /usr/lib/x86_64-linux-gnu/libibverbs.so.1
copy_with_libs "$RXE" "/usr/lib/x86_64-linux-gnu/libibverbs/$(basename "$RXE")"
cp /etc/libibverbs.d/rxe.driver "$IR/etc/libibverbs.d/"
mkdir -p "$IR/lib64"; cp -Ln /lib64/ld-linux-x86-64.so.2 "$IR/lib64/" 2>/dev/null || true
echo "root:x:0:0:root:/:/bin/sh" > "$IR/etc/passwd"
cp "$ROOT/tests/rdma/init.sh" "$IR/init"; chmod +x "$IR/init"
# COMMD_VM_SCENARIO: another script to run instead (debugging).
cp "${COMMD_VM_SCENARIO:-$ROOT/tests/rdma/scenario.sh}" "$IR/test/scenario.sh"
# Steps for the clients: every collective and reduction (from the pytest suite's list) plus
# large chunked ops that wrap the registered rings, and cross-node send/recv.
python3 - "$IR/test" <<'PY'
import json, sys
sys.path.insert(0, "tests")
from test_collectives import steps_for
out = sys.argv[1]
n = 4
# Every collective and reduction on two dtypes (float, integer): TCG emulation
# runs ~0.5 s per step, so the full 8-dtype list (288 steps) would not fit the time budget.
coll = [s for s in steps_for(n, 1001) if s["dtype"] in ("f32", "i32")]
# Larger than a 4 MiB registered ring: chunked, pipelined, wrapping the rings.
big = [{"op": "all_reduce", "dtype": "f32", "count": 1_500_001, "redop": "sum", "seed": 91},
       {"op": "all_gather", "dtype": "bf16", "count": 300_003, "seed": 92},
       {"op": "broadcast", "dtype": "i64", "count": 600_001, "root": 3, "seed": 93},
       {"op": "reduce_scatter", "dtype": "f64", "count": 200_001, "redop": "max", "seed": 94}]
for r in range(n):
    other = (r + 2) % n
    p2p = [{"group": [{"op": "send", "dtype": "i32", "count": 100_001, "peer": other, "seed": 10 + r},
                      {"op": "recv", "dtype": "i32", "count": 100_001, "peer": other, "seed": 10 + other}]}]
    with open(f"{out}/steps{r}.json", "w") as f:
        # The final all_reduce keeps every rank in the communicator until all p2p is done.
        json.dump(coll + big + p2p + [{"op": "all_reduce", "dtype": "f32", "count": 7}], f)
kill = [{"op": "all_reduce", "dtype": "f32", "count": 1000},
        {"op": "all_reduce", "dtype": "f32", "count": 100_000, "expect": "any", "repeat": 150}]
with open(f"{out}/kill.json", "w") as f:
    json.dump(kill, f)
PY
( cd "$IR" && find . | cpio -o -H newc --quiet | gzip -1 > "$WORK/initramfs.gz" )

LOG="$WORK/console.log"
rm -f "$LOG"
echo "rdma-vm: booting $KVER under qemu (TCG) with $(du -h "$WORK/initramfs.gz" | cut -f1) initramfs; console: $LOG"
t0=$(date +%s)
set +e
timeout "$TIMEOUT" qemu-system-x86_64 -accel tcg,thread=multi -m 1024 -smp 2 -no-reboot \
  -kernel "$VMLINUZ" -initrd "$WORK/initramfs.gz" \
  -append "console=ttyS0 panic=-1 quiet loglevel=3" \
  -display none -serial "file:$LOG" -monitor none -net none
qrc=$?
set -e
t1=$(date +%s)
echo "rdma-vm: VM ran $((t1 - t0)) s (qemu exit $qrc)"
sed -n '/^==/p;/^PASS\|^FAIL\|^SMOKE\|^ok \|^not ok/p' "$LOG" | tail -60
if grep -q "^RDMA-VM-RESULT: PASS" "$LOG"; then
  echo "rdma-vm: PASS"
  exit 0
fi
echo "rdma-vm: FAIL (full console log follows)" >&2
cat "$LOG" >&2
if [ $qrc -eq 124 ]; then echo "rdma-vm: timed out after ${TIMEOUT}s" >&2; fi
exit 1
