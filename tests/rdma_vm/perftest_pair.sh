# shellcheck shell=bash
# Sourced (bash): runs one perftest server and client pair through
# librdmacm (-R), trying again what a loaded, emulated machine makes fail.
# Used by the smoke test (perftest_smoke.sh) and the bench's references
# (bench/experiments.sh), so that both measure perftest the same way.
#
#   source tests/rdma_vm/perftest_pair.sh
#   perftest_pair /tmp/lat 198.18.0.1 ib_send_lat -d rxe0 -i 1 -s 2 -n 1000
#   # 0: /tmp/lat holds the client's output (its figures);
#   # /tmp/lat.server the server's.
#
# Returns 0 when a client completed with figures and its server ended well
# or failed only to time its report; 2 when the client did but its server
# failed otherwise; 1 when no try gave figures: no client completed, or
# the last ones could not time their report or read "inf" (both outputs
# of the last try kept).
#
# Why it tries again:
# - a client that comes before its server listens fails (perftest 4.5 may
#   segfault) and can leave the server stuck on the half-made connection,
#   so it waits for the server's listening cm_id; a client that still
#   fails or hangs (300 s) gets a fresh server, three times;
# - before it reports, perftest times the cycle counter against the clock,
#   which on a loaded emulated machine can fail after the transfer worked
#   ("Correlation coefficient r^2: ... < 0.9", "Can't produce a report") or
#   come out 0, every latency then "inf": such a run is measured again, up
#   to eight times apart from the three.

# perftest_pair OUT ADDR TOOL ARGS...
perftest_pair() {
  local out="$1" addr="$2" tool="$3"
  shift 3
  local server ids tries=0 uncalibrated=0
  command -v rdma >/dev/null ||
    echo "perftest_pair: no 'rdma' tool (iproute2): the client waits 30 s for each server" >&2
  while [ "$tries" -lt 3 ] && [ "$uncalibrated" -lt 8 ]; do
    "$tool" -R "$@" >"$out.server" 2>&1 &
    server=$!
    for _ in $(seq 1 150); do
      # Read whole before grep: an early grep exit must not fail `rdma` by
      # SIGPIPE under pipefail, which would read as "not listening".
      ids="$(rdma res show cm_id 2>/dev/null)" || true
      grep -q "state LISTEN.* pid $server " <<<"$ids" && break
      kill -0 "$server" 2>/dev/null || break
      sleep 0.2
    done
    if timeout 300 "$tool" -R "$@" "$addr" >"$out" 2>&1; then
      # A result row (its first field a size) with a latency of "inf".
      if ! grep -Eq '^[[:space:]]*[0-9]+[[:space:]].*[[:space:]]inf([[:space:]]|$)' "$out"; then
        # The client has the figures: a server that only failed to time
        # its report is no failure.
        wait "$server" && return 0
        grep -q "Can't produce a report" "$out.server" && return 0
        return 2
      fi
      uncalibrated=$((uncalibrated + 1))
    elif grep -q "Can't produce a report" "$out"; then
      uncalibrated=$((uncalibrated + 1))
    else
      tries=$((tries + 1))
    fi
    kill "$server" 2>/dev/null || true
    wait "$server" 2>/dev/null || true
  done
  return 1
}
