#!/bin/busybox sh
# PID 1 of the RDMA test VM (tests/rdma/vm-test.sh): Soft-RoCE on a dummy netdev, then the test.
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mount -t tmpfs tmp /tmp
for m in crc32_generic udp_tunnel ip6_udp_tunnel ib_core ib_uverbs rdma_rxe dummy; do
  insmod /lib/modules/$m.ko || echo "FAIL: insmod $m"
done
ip link set lo up
ip link add dummy0 type dummy
ip addr add 10.0.0.1/24 dev dummy0
ip link set dummy0 mtu 4200 up
rdma link add rxe0 type rxe netdev dummy0 || echo "FAIL: rdma link add"
sh /test/scenario.sh
echo "RDMA-VM-RESULT: $([ -f /tmp/pass ] && echo PASS || echo FAIL)"
poweroff -f
