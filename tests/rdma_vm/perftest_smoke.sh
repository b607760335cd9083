#!/usr/bin/env bash
# RDMA smoke test (label rdma): the device is up and perftest moves data
# through librdmacm (-R) between a server and a client on it. Prints the
# figures; later benchmarks compare against perftest run the same way.
set -euo pipefail

fail() {
  echo "perftest_smoke: FAIL: $*" >&2
  exit 1
}

dev=""
for state in /sys/class/infiniband/*/ports/*/state; do
  if [ -r "$state" ] && grep -q ACTIVE "$state"; then
    dev="$(basename "$(dirname "$(dirname "$(dirname "$state")")")")"
    port="$(basename "$(dirname "$state")")"
    break
  fi
done
[ -n "$dev" ] || fail "no RDMA device with an ACTIVE port (run through tests/rdma_vm/run.sh)"

ibv_devinfo -d "$dev" -i "$port" | tee /dev/stderr | grep -q "state:.*PORT_ACTIVE" ||
  fail "ibv_devinfo does not show $dev port $port ACTIVE"

# The address librdmacm resolves to this device: the harness exports it;
# natively, the first IPv4 address of the device's network interface.
addr="${RDMARPC_RDMA_ADDR:-}"
if [ -z "$addr" ]; then
  ndev="$(cat "/sys/class/infiniband/$dev/ports/$port/gid_attrs/ndevs/0" 2>/dev/null || true)"
  [ -n "$ndev" ] && addr="$(ip -4 -o addr show dev "$ndev" | awk '{ sub("/.*", "", $4); print $4; exit }')"
fi
[ -n "$addr" ] || fail "no IPv4 address for $dev; set RDMARPC_RDMA_ADDR"

# run_pair TOOL ARGS...: the client's output (tests/rdma_vm/perftest_pair.sh
# tries again what a loaded, emulated machine makes fail).
# shellcheck source=tests/rdma_vm/perftest_pair.sh
source "$(dirname "$0")/perftest_pair.sh"
run_pair() {
  local tool="$1" out rc=0
  shift
  out="$(mktemp)"
  perftest_pair "$out" "$addr" "$tool" -d "$dev" -i "$port" "$@" || rc=$?
  if [ "$rc" -ne 0 ]; then
    cat "$out" "$out.server" >&2
    [ "$rc" -eq 2 ] && fail "$tool server failed"
    fail "$tool gave no figures (the client failed, or could not time its report, on every try)"
  fi
  cat "$out"
  rm -f "$out" "$out.server"
}

echo "== ib_write_bw, 1 MiB messages, 200 iterations"
bw_out="$(run_pair ib_write_bw -s 1048576 -n 200)"
echo "$bw_out"
# Result row: bytes iterations BW-peak BW-average MsgRate.
bw="$(awk '$1 == 1048576 && NF >= 5 { print $4 }' <<<"$bw_out")"
[ -n "$bw" ] || fail "no result row in ib_write_bw output"
awk -v b="$bw" 'BEGIN { exit !(b > 0) }' || fail "ib_write_bw average is $bw MB/s"

echo "== ib_send_lat, 2-byte messages, 1000 iterations"
lat_out="$(run_pair ib_send_lat -s 2 -n 1000)"
echo "$lat_out"
# Result row: bytes iterations t_min t_max t_typical t_avg t_stdev 99% 99.9%.
typical="$(awk '$1 == 2 && NF >= 9 { print $5 }' <<<"$lat_out")"
p99="$(awk '$1 == 2 && NF >= 9 { print $8 }' <<<"$lat_out")"
[ -n "$typical" ] || fail "no result row in ib_send_lat output"
awk -v t="$typical" 'BEGIN { exit !(t > 0) }' || fail "ib_send_lat t_typical is $typical us"

echo "perftest_smoke: $dev port $port ($addr): ib_write_bw 1 MiB average ${bw} MB/s;" \
  "ib_send_lat 2 B t_typical ${typical} us, p99 ${p99} us"
