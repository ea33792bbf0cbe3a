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
# The namespace sends DNS for the gateway to the host's forwarder (network/dns.py).
DNS=${DNS:-${GW:-169.254.0.22}}
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

# The agent (and agent-loop, which restarts it) runs in a mount namespace of its own, the only one
# with the tools drive. PID 1 stays in the original namespace, where the drive is then
# unmounted: user processes (started by the agent in PID 1's namespace, guest/spawn.c) see only
# the image plus /proc, /dev, /sys, /tmp and /run. Mounts made later in the user's namespace
# (outside /run) propagate to the agent's (slave), so its file API sees them too.
# /run and the drive stay private: unmounting the drive here must not propagate to the agent.
$bb mount --make-rshared /
$bb mount --make-private /run
$bb mount --make-private $T
$bb unshare -m --propagation slave $T/agent-loop >/dev/console 2>&1 &
AGENT=$!
# Unmount only once the agent's namespace exists (it is a copy of this one at that moment).
while [ "$($bb readlink /proc/$AGENT/ns/mnt)" = "$($bb readlink /proc/1/ns/mnt)" ]; do $bb usleep 1000; done
$bb umount -l $T
# Only shell builtins from here on: the drive is gone from this namespace.
while true; do wait; done
