#!/bin/busybox sh
# shellcheck shell=dash
# /init of the soft-RoCE VM's initramfs (built by run.sh). Loads the kernel
# modules for virtio, 9p and rdma_rxe, mounts the host's root filesystem
# over 9p and hands over to guest.sh from the host's tree.
bb=/bin/busybox

fail() {
  echo "rdma_vm guest: $*"
  [ -n "$job" ] && [ -d "/newroot$job" ] && echo "$*" >"/newroot$job/harness_error"
  $bb sync
  $bb poweroff -f
}

$bb mount -t proc proc /proc
$bb mount -t sysfs sysfs /sys
$bb mount -t devtmpfs devtmpfs /dev

guest=""
job=""
for arg in $($bb cat /proc/cmdline); do
  case "$arg" in
    rdmarpc.guest=*) guest="${arg#rdmarpc.guest=}" ;;
    rdmarpc.job=*) job="${arg#rdmarpc.job=}" ;;
  esac
done

for m in $($bb cat /modules); do
  $bb insmod "/lib/$m" || fail "insmod $m failed"
done

# The host root with the guest's page cache on (programs start several times
# faster under TCG); nothing on the host changes it while the guest runs.
# The job directory (output, exit code) uncached, so output streams out.
$bb mount -t 9p -o trans=virtio,version=9p2000.L,msize=524288,cache=loose hostroot /newroot ||
  fail "cannot mount the host root over 9p"
[ -n "$job" ] && $bb mount -t 9p -o trans=virtio,version=9p2000.L,msize=524288 job "/newroot$job" ||
  fail "cannot mount the job directory '$job' over 9p"
[ -n "$guest" ] && [ -x "/newroot$guest" ] || fail "guest script '$guest' missing"
$bb umount /proc /sys /dev
exec $bb switch_root /newroot /bin/bash "$guest" "$job"
