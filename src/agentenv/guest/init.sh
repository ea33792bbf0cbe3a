#!/run/agentenv/bin/busybox sh
# PID 1 of every sandbox, run from the read-only tools drive mounted at /run/agentenv (the
# initramfs mounted it and switched into the image's root). Everything it runs comes from the
# tools drive, so the image needs no shell, no iproute2 and no Python. It sets up the fixed guest
# network (every sandbox has the same guest address; the host's per-sandbox namespace makes them
# distinct), the usual mounts, and supervises the guest agent: if it dies it is started again.
T=/run/agentenv
bb=$T/bin/busybox
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
$bb mkdir -p /tmp /dev/pts /dev/shm
$bb mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /tmp
$bb mount -t devpts -o gid=5,mode=0620,ptmxmode=0666 devpts /dev/pts
$bb mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /dev/shm
[ -e /dev/ptmx ] || $bb ln -s pts/ptmx /dev/ptmx
$bb mount -t cgroup2 cgroup2 /sys/fs/cgroup 2>/dev/null

arg() { $bb sed -n "s/.*\\baenv\\.$1=\\([^ ]*\\).*/\\1/p" /proc/cmdline; }
GIP=$(arg ip); GW=$(arg gw); DNS=$(arg dns)
$bb hostname sandbox
$bb ip link set lo up
if $bb ip link show eth0 >/dev/null 2>&1; then
    $bb ip addr add "${GIP:-169.254.0.21/30}" dev eth0
    $bb ip link set eth0 up
    $bb ip route add default via "${GW:-169.254.0.22}"
fi
# Images often ship these as symlinks into /run (systemd-resolved) or not at all.
[ -L /etc/resolv.conf ] && $bb rm -f /etc/resolv.conf
[ -n "$DNS" ] && echo "nameserver $DNS" > /etc/resolv.conf
[ -f /etc/hosts ] || printf '127.0.0.1 localhost\n127.0.1.1 sandbox\n' > /etc/hosts

while true; do
    $T/python/bin/python3 -E -s -S -u $T/agent/agent.py --host 0.0.0.0 --port 49983 --tools $T >/dev/console 2>&1
    echo "aenv-init: agent exited with $?, restarting" > /dev/console
    $bb sleep 0.2
done
