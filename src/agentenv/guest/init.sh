#!/bin/sh
# Stage 2 (rootfs, PID 1): the sandbox's own init. Sets up the fixed guest network (every
# sandbox has the same guest address; the host's per-sandbox namespace makes them distinct)
# and supervises the guest agent: if it dies it is started again.
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
mount -t tmpfs -o mode=0755,nosuid,nodev tmpfs /run
mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /tmp
mkdir -p /dev/pts /dev/shm
mount -t devpts -o gid=5,mode=0620,ptmxmode=0666 devpts /dev/pts
mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /dev/shm
[ -e /dev/ptmx ] || ln -s pts/ptmx /dev/ptmx
mount -t cgroup2 cgroup2 /sys/fs/cgroup 2>/dev/null

arg() { sed -n "s/.*\\baenv\\.$1=\\([^ ]*\\).*/\\1/p" /proc/cmdline; }
GIP=$(arg ip); GW=$(arg gw); DNS=$(arg dns)
hostname sandbox
ip link set lo up
if ip link show eth0 >/dev/null 2>&1; then
    ip addr add "${GIP:-169.254.0.21/30}" dev eth0
    ip link set eth0 up
    ip route add default via "${GW:-169.254.0.22}"
fi
[ -n "$DNS" ] && echo "nameserver $DNS" > /etc/resolv.conf

while true; do
    /usr/bin/python3 -u /opt/agentenv/agent.py --host 0.0.0.0 --port 49983 >/dev/console 2>&1
    echo "aenv-init: agent exited with $?, restarting" > /dev/console
    sleep 0.2
done
