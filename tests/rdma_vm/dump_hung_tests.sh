#!/usr/bin/env bash
# Prints the stacks of every thread of a test that runs too long, once per
# process, so a hang in CI says where it waits instead of only "Timeout".
#
#   tests/rdma_vm/dump_hung_tests.sh [SECONDS] &   # default 240
#
# Watches processes whose executable lies under a build tree's tests/ or
# bench/ folder (build, build-asan, build-tsan). Needs gdb; without it,
# prints one line saying so and exits. Runs until killed.
set -uo pipefail

limit="${1:-240}"
if ! command -v gdb >/dev/null; then
  echo "dump_hung_tests: gdb not found; hung tests will show no stacks" >&2
  exit 0
fi
declare -A dumped=()
while true; do
  for exe in /proc/[0-9]*/exe; do
    pid="${exe#/proc/}"
    pid="${pid%/exe}"
    [ -n "${dumped[$pid]:-}" ] && continue
    path="$(readlink "$exe" 2>/dev/null)" || continue
    case "$path" in
      */build*/tests/* | */build*/bench/*) ;;
      *) continue ;;
    esac
    age="$(ps -o etimes= -p "$pid" 2>/dev/null | tr -d ' ')"
    [ -n "$age" ] && [ "$age" -ge "$limit" ] || continue
    dumped[$pid]=1
    {
      echo "dump_hung_tests: $path (pid $pid) has run ${age} s; its threads:"
      gdb -p "$pid" -batch -nx -ex "set pagination off" \
        -ex "thread apply all bt" 2>&1 | grep -v '^\[New LWP'
      echo "dump_hung_tests: end of pid $pid"
    } >&2
  done
  sleep 10
done
