#!/bin/busybox sh
# Stage 1 (initramfs, PID 1): load the virtio modules, mount the sandbox disk and the tools
# drive, and hand over to the tools drive's init. The Debian cloud kernel has virtio as modules
# and no virtio_mmio command-line devices, so QEMU announces the devices via ACPI and we load
# the drivers here.
/bin/busybox mount -t proc proc /proc
/bin/busybox mount -t sysfs sysfs /sys
/bin/busybox mount -t devtmpfs devtmpfs /dev
/bin/busybox --install -s /bin
export PATH=/bin
for m in virtio_ring virtio virtio_mmio virtio_blk failover net_failover virtio_net virtio_console virtio-rng; do
    [ -f /lib/modules/$m.ko ] && insmod /lib/modules/$m.ko
done
# Two disks, told apart by their serial (not their order): the image's root filesystem (its
# own qcow2 overlay, read-write) and the read-only tools drive with the agent and its Python.
i=0
while [ $i -lt 400 ]; do
    ROOT=; TOOLS=
    for s in /sys/block/vd*/serial; do
        [ -f "$s" ] || continue
        case "$(cat "$s")" in
            aenv-root) ROOT=/dev/$(basename "$(dirname "$s")") ;;
            aenv-tools) TOOLS=/dev/$(basename "$(dirname "$s")") ;;
        esac
    done
    [ -b "$ROOT" ] && [ -b "$TOOLS" ] && break
    usleep 5000; i=$((i+1))
done
fail() { echo "aenv-init: $1" > /dev/console; poweroff -f; }
mount -t ext4 -o noatime "$ROOT" /newroot || fail "cannot mount the root filesystem ($ROOT)"
[ -d /newroot/run ] && [ ! -L /newroot/run ] || { rm -f /newroot/run; mkdir -p /newroot/run; }
for d in proc sys dev; do [ -d /newroot/$d ] || mkdir -p /newroot/$d; done
mount -t tmpfs -o mode=0755,nosuid,nodev tmpfs /newroot/run
mkdir -p /newroot/run/agentenv
mount -t ext4 -o ro,noatime "$TOOLS" /newroot/run/agentenv || fail "cannot mount the tools drive ($TOOLS)"
mount --move /proc /newroot/proc
mount --move /sys /newroot/sys
mount --move /dev /newroot/dev
exec switch_root /newroot /run/agentenv/init
