#!/bin/busybox sh
# Stage 1 (initramfs, PID 1): load the virtio modules, mount the sandbox disk and hand over to
# the rootfs init. The Debian cloud kernel has virtio as modules and no virtio_mmio command-line
# devices, so QEMU announces the devices via ACPI and we load the drivers here.
/bin/busybox mount -t proc proc /proc
/bin/busybox mount -t sysfs sysfs /sys
/bin/busybox mount -t devtmpfs devtmpfs /dev
/bin/busybox --install -s /bin
export PATH=/bin
for m in virtio_ring virtio virtio_mmio virtio_blk failover net_failover virtio_net virtio_console virtio-rng; do
    [ -f /lib/modules/$m.ko ] && insmod /lib/modules/$m.ko
done
i=0
while [ ! -b /dev/vda ] && [ $i -lt 400 ]; do usleep 5000; i=$((i+1)); done
if ! mount -t ext4 -o noatime /dev/vda /newroot; then
    echo "aenv-init: cannot mount /dev/vda" > /dev/console
    poweroff -f
fi
mount --move /proc /newroot/proc
mount --move /sys /newroot/sys
mount --move /dev /newroot/dev
exec switch_root /newroot /opt/agentenv/init
