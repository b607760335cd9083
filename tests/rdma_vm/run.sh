#!/usr/bin/env bash
# Runs a command where a real RDMA device is available.
#
# With an ACTIVE RDMA port on this machine (a real NIC, or rxe already set up)
# the command runs natively. Otherwise it boots Debian's stock kernel in qemu
# with this machine's root filesystem over 9p, brings up a soft-RoCE device
# (rdma_rxe on a dummy interface, address 198.18.0.1), and runs the command
# there in the same working directory, with the same environment and an
# unlimited locked-memory limit. The command's output streams here and its
# exit code is ours.
#
#   tests/rdma_vm/run.sh ibv_devinfo
#   tests/rdma_vm/run.sh ctest -L '^rdma$'        # one boot for a group
#   tests/rdma_vm/run.sh --shell                  # interactive shell in the VM
#
# Settings (environment):
#   RDMARPC_RDMA_VM       auto (default) | always (boot even with a device) |
#                         never (fail unless a device is present)
#   RDMARPC_VM_CACHE      kernel + initramfs cache
#                         (default ${XDG_CACHE_HOME:-~/.cache}/rdmarpc/rdma-vm)
#   RDMARPC_VM_TIMEOUT    seconds before a hung guest is killed (default 1800)
#   RDMARPC_VM_MEM_MB     guest memory (default 6144: the TSan tree's
#                         1 GiB echo needs over 4 GiB with its shadow)
#   RDMARPC_VM_CPUS       guest vCPUs (default: this machine's cores, max 4)
#   RDMARPC_VM_ACCEL      tcg (default) | kvm (opt in where KVM works: on
#                         some hosts /dev/kvm exists but guests hang)
#   RDMARPC_VM_CPU        qemu CPU model under tcg (default max)
#
# Exit code: the command's; 125 when the harness itself failed (the message
# on stderr starts with "rdma_vm:").
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
readonly here
readonly harness_failed=125
readonly guest_addr=198.18.0.1

die() {
  echo "rdma_vm: $*" >&2
  exit "$harness_failed"
}

have_active_rdma_port() {
  local state
  for state in /sys/class/infiniband/*/ports/*/state; do
    [ -r "$state" ] && grep -q ACTIVE "$state" && return 0
  done
  return 1
}

shell_mode=0
if [ "${1:-}" = "--shell" ]; then
  shell_mode=1
  shift
elif [ "${1:-}" = "--" ]; then
  shift
fi
if [ "$shell_mode" -eq 0 ] && [ $# -eq 0 ]; then
  die "usage: run.sh [--] COMMAND [ARGS...] | run.sh --shell"
fi

mode="${RDMARPC_RDMA_VM:-auto}"
case "$mode" in
  auto | always | never) ;;
  *) die "RDMARPC_RDMA_VM='$mode' is not one of auto, always, never" ;;
esac
if [ "$mode" != always ] && have_active_rdma_port; then
  [ "$shell_mode" -eq 1 ] && exec "${SHELL:-/bin/bash}" -i
  exec "$@"
fi
if [ "$mode" = never ]; then
  die "no ACTIVE RDMA port on this machine and RDMARPC_RDMA_VM=never"
fi

# --- Tools -----------------------------------------------------------------
need() {  # need COMMAND PACKAGE
  command -v "$1" >/dev/null 2>&1 || [ -x "$1" ] ||
    die "missing '$1' (Debian package $2); run scripts/install_deps.sh"
}
need qemu-system-x86_64 qemu-system-x86
need /bin/busybox busybox-static
need cpio cpio
need depmod kmod
need modprobe kmod
need rdma iproute2
need ip iproute2
need apt-get apt
need dpkg-deb dpkg
need flock util-linux
need readelf binutils
if ldd /bin/busybox >/dev/null 2>&1; then
  die "/bin/busybox is dynamically linked; the initramfs needs the static one" \
    "(Debian package busybox-static)"
fi

# --- Kernel and initramfs (cached) -------------------------------------------
cache="${RDMARPC_VM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rdmarpc/rdma-vm}"
mkdir -p "$cache" || die "cannot create the cache directory $cache"

# The exact kernel package changes as Debian updates: resolve it now.
kernel_pkg="$(apt-cache depends linux-image-amd64 2>/dev/null |
  awk '/Depends: linux-image-[0-9]/ { print $2; exit }' || true)"
if [ -n "$kernel_pkg" ]; then
  kver="${kernel_pkg#linux-image-}"
else
  # No package lists (offline, or apt-get update never ran): use the newest
  # kernel already cached, if any.
  kver="$(find "$cache" -mindepth 2 -maxdepth 2 -name ready -printf '%h\n' 2>/dev/null |
    xargs -r -n1 basename | sort -V | tail -n 1 || true)"
  [ -n "$kver" ] ||
    die "cannot resolve Debian's kernel package: 'apt-cache depends linux-image-amd64'" \
      "names none. Run 'apt-get update' (as root) and retry."
  echo "rdma_vm: apt cannot resolve the kernel package; using cached $kver" >&2
fi
kdir="$cache/$kver"

# Modules rdma_rxe and the 9p root need, and their dependencies. rdma_rxe
# needs crc32_generic at 'rdma link add' time without declaring it, so it
# is named explicitly and loaded first. veth, sch_prio, sch_netem and
# cls_u32 build the fault test's lossy RDMA path.
readonly wanted_modules="crc32_generic 9p 9pnet_virtio virtio_pci rdma_rxe ib_uverbs rdma_ucm dummy veth sch_netem sch_prio cls_u32"

# qemu boots an uncompressed ELF kernel through its PVH entry point, which
# skips the firmware's real-mode loader and the in-guest decompression: about
# 3 s less per boot under TCG. Falls back to the bzImage if that fails.
extract_pvh_kernel() {  # extract_pvh_kernel BZIMAGE OUT
  local magic offset tool
  for magic in 'xz:\xfd7zXZ\x00' 'zstd:\x28\xb5\x2f\xfd' 'gzip:\x1f\x8b\x08\x00'; do
    tool="${magic%%:*}"
    command -v "$tool" >/dev/null || continue
    offset="$(LC_ALL=C grep -obUaP "${magic#*:}" "$1" | head -n 1 | cut -d: -f1 || true)"
    [ -n "$offset" ] || continue
    tail -c +"$((offset + 1))" "$1" | "$tool" -dc >"$2" 2>/dev/null || true
    # Trailing bytes after the stream make the tool complain; what counts is
    # an ELF with the PVH entry note (XEN_ELFNOTE_PHYS32_ENTRY, type 0x12).
    if LC_ALL=C readelf -n "$2" 2>/dev/null | grep -q 'Unknown note type: (0x00000012)'; then
      return 0
    fi
  done
  rm -f "$2"
  echo "rdma_vm: no PVH entry in the kernel; booting the bzImage (slower)" >&2
}

build_kernel_cache() {
  local work deb
  work="$(mktemp -d "$cache/build.XXXXXX")"
  trap 'rm -rf "$work"' RETURN
  echo "rdma_vm: fetching kernel package $kernel_pkg (cached in $cache)" >&2
  if ! (cd "$work" && apt-get download -q "$kernel_pkg" >download.log 2>&1); then
    cat "$work/download.log" >&2
    die "downloading $kernel_pkg with 'apt-get download' failed (output above)." \
      "Check network access to the Debian mirror, or run 'apt-get update'."
  fi
  deb="$(ls "$work"/*.deb)"
  mkdir -p "$work/root"
  dpkg-deb --fsys-tarfile "$deb" | tar -x -C "$work/root" --wildcards \
    "./boot/vmlinuz-$kver" "./lib/modules/$kver/*" ||
    die "unpacking $deb failed"
  depmod -b "$work/root" "$kver" || die "depmod on the unpacked kernel failed"

  local initrd="$work/initrd" m path seen=" "
  mkdir -p "$initrd/bin" "$initrd/lib" "$initrd/proc" "$initrd/sys" \
    "$initrd/dev" "$initrd/newroot"
  cp /bin/busybox "$initrd/bin/busybox"
  : >"$initrd/modules"
  for m in $wanted_modules; do
    local deps
    deps="$(modprobe -d "$work/root" -S "$kver" --show-depends "$m" 2>&1)" ||
      die "module $m not found in kernel $kver: $deps"
    while read -r verb path _; do
      [ "$verb" = insmod ] || continue  # "builtin NAME": nothing to load
      case "$seen" in *" $path "*) continue ;; esac
      seen="$seen$path "
      case "$path" in
        *.ko) cp "$path" "$initrd/lib/" ;;
        *.ko.xz) xz -dc "$path" >"$initrd/lib/$(basename "$path" .xz)" ;;
        *.ko.zst) zstd -qdc "$path" >"$initrd/lib/$(basename "$path" .zst)" ;;
        *) die "unexpected module file $path" ;;
      esac
      basename "${path%.xz}" | sed 's/\.zst$//' >>"$initrd/modules"
    done <<<"$deps"
  done
  cp "$here/initramfs_init.sh" "$initrd/init"
  chmod +x "$initrd/init"
  (cd "$initrd" && find . | cpio -o -H newc --quiet | gzip -1) >"$work/initrd.gz" ||
    die "building the initramfs failed"

  rm -rf "$kdir"
  mkdir -p "$kdir"
  mv "$work/root/boot/vmlinuz-$kver" "$kdir/vmlinuz"
  extract_pvh_kernel "$kdir/vmlinuz" "$kdir/vmlinux"
  mv "$work/initrd.gz" "$kdir/initrd.gz"
  cp "$here/initramfs_init.sh" "$kdir/init.used"
  cp "$here/run.sh" "$kdir/run.used"
  touch "$kdir/ready"
}

(
  # One builder at a time (ctest may start several VMs at once).
  flock 9
  # Rebuilt when the harness that built it changed.
  if [ ! -e "$kdir/ready" ] || ! cmp -s "$here/initramfs_init.sh" "$kdir/init.used" ||
    ! cmp -s "$here/run.sh" "$kdir/run.used"; then
    build_kernel_cache
  fi
) 9>"$cache/lock"
[ -e "$kdir/ready" ] || die "preparing kernel $kver in $kdir failed (see above)"

# --- The job: what the guest runs, shared with it through the 9p root --------
job="$(mktemp -d "${TMPDIR:-/tmp}/rdmarpc-vm.XXXXXX")"
qemu_pid=""
tail_pid=""
keep_job=0  # kept for the post-mortem when the harness fails
cleanup() {
  [ -n "$qemu_pid" ] && kill "$qemu_pid" 2>/dev/null || true
  [ -n "$tail_pid" ] && kill "$tail_pid" 2>/dev/null || true
  [ "$keep_job" -eq 1 ] || rm -rf "$job"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# Environment: everything exported here, minus what describes this shell.
export -p | grep -Ev '^declare -[a-z]*x (BASH|BASHOPTS|SHELLOPTS|SHLVL|PWD|OLDPWD|HOSTNAME|_)(=|$)' \
  >"$job/env"
printf '%s\n' "$PWD" >"$job/cwd"
if [ "$shell_mode" -eq 1 ]; then
  : >"$job/shell"
else
  printf '%q ' "$@" >"$job/cmd"
fi
: >"$job/output"

cpus="${RDMARPC_VM_CPUS:-$(nproc)}"
[ "$cpus" -gt 4 ] && cpus=4
timeout_s="${RDMARPC_VM_TIMEOUT:-1800}"
accel="${RDMARPC_VM_ACCEL:-tcg}"
case "$accel" in
  # qemu64, TCG's default model, lacks instructions TSan's runtime uses
  # (its binaries die with SIGILL there); "max" is every feature TCG has.
  tcg) accel_args=(-accel tcg -cpu "${RDMARPC_VM_CPU:-max}") ;;
  kvm)
    [ -w /dev/kvm ] || die "RDMARPC_VM_ACCEL=kvm but /dev/kvm is not usable by $(id -un)"
    accel_args=(-accel kvm -cpu host)
    ;;
  *) die "RDMARPC_VM_ACCEL='$accel' is not tcg or kvm" ;;
esac
# Passthrough keeps file ownership right, but needs root; others get 'none'.
security_model=none
[ "$(id -u)" -eq 0 ] && security_model=passthrough

kernel_image="$kdir/vmlinuz"
[ -s "$kdir/vmlinux" ] && kernel_image="$kdir/vmlinux"
qemu_args=(
  "${accel_args[@]}" -m "${RDMARPC_VM_MEM_MB:-6144}" -smp "$cpus"
  -nic none -nographic -no-reboot
  -kernel "$kernel_image" -initrd "$kdir/initrd.gz"
  -virtfs "local,path=/,mount_tag=hostroot,security_model=$security_model,id=hostroot,multidevs=remap"
  -virtfs "local,path=$job,mount_tag=job,security_model=$security_model,id=job"
  -append "console=ttyS0 quiet loglevel=3 panic=-1 rdmarpc.guest=$here/guest.sh rdmarpc.job=$job rdmarpc.addr=$guest_addr"
)

start_ms=$(($(date +%s%N) / 1000000))
if [ "$shell_mode" -eq 1 ]; then
  timeout -k 10 "$timeout_s" qemu-system-x86_64 "${qemu_args[@]}"
  exit 0
fi

timeout -k 10 "$timeout_s" qemu-system-x86_64 "${qemu_args[@]}" \
  </dev/null >"$job/console.log" 2>&1 &
qemu_pid=$!
tail -n +1 -f -s 0.2 --pid="$qemu_pid" "$job/output" &
tail_pid=$!
set +e
wait "$qemu_pid"
qemu_status=$?
set -e
qemu_pid=""
wait "$tail_pid" 2>/dev/null || true
tail_pid=""
elapsed_ms=$(($(date +%s%N) / 1000000 - start_ms))

console_tail() {
  keep_job=1
  echo "rdma_vm: last lines of the guest console ($job/console.log):" >&2
  tail -n 30 "$job/console.log" | sed 's/\r$//; s/^/  | /' >&2
}

if [ -s "$job/harness_error" ]; then
  echo "rdma_vm: the guest could not run the command: $(cat "$job/harness_error")" >&2
  console_tail
  exit "$harness_failed"
fi
if [ ! -s "$job/rc" ]; then
  if [ "$qemu_status" -eq 124 ]; then
    echo "rdma_vm: guest timed out after ${timeout_s} s (RDMARPC_VM_TIMEOUT); qemu was killed" >&2
  else
    echo "rdma_vm: qemu exited (status $qemu_status) before the command in the guest" \
      "finished: the VM was killed or crashed, the command's result is unknown" >&2
  fi
  console_tail
  exit "$harness_failed"
fi
rc="$(cat "$job/rc")"
if [ -n "${RDMARPC_VM_VERBOSE:-}" ]; then
  echo "rdma_vm: guest boot to command $(cat "$job/boot_s" 2>/dev/null || echo ?) s," \
    "whole VM run $((elapsed_ms / 1000)).$((elapsed_ms % 1000 / 100)) s, exit code $rc" >&2
fi
exit "$rc"
