#!/usr/bin/env python3
"""Lock acquisitions per call, from two callgrind profiles of one program.

Counts the calls made to locking functions in each profile (callgrind's
`calls=` lines, over every thread) and prints the difference over CALLS,
so start-up and shut-down cancel out, as for the instruction counts:

  callgrind_locks.py cg.1000 cg.3000 2000 rdma-inline-blocking

prints two CSV rows (experiment, system, param, metric, value, unit):
  locks,rdma-inline-blocking,64,mutex_per_call,V,n
  locks,rdma-inline-blocking,64,provider_spin_per_call,V,n
`mutex` counts blocking locks (pthread mutexes and rwlocks, a condition
variable's re-lock after a wait, absl::Mutex, which gRPC's gpr_mu uses);
`provider_spin` counts pthread spin locks, which the verbs providers (rxe's
included) take inside ibv_post_send, ibv_post_recv and ibv_poll_cq, as
perftest's own loop does.
"""
import re
import sys

MUTEX = re.compile(
    r"^(pthread_mutex_(lock|trylock)|__pthread_mutex_cond_lock|"
    r"pthread_rwlock_(rdlock|wrlock|tryrdlock|trywrlock)|"
    r"absl::[a-z0-9_]+::Mutex::(Lock|ReaderLock|TryLock|ReaderTryLock)\(\))")
SPIN = re.compile(r"^pthread_spin_(lock|trylock)")


def count(path):
    names = {}  # callgrind's compressed names: "(id) name" once, then "(id)"
    callee = ""
    totals = {"mutex": 0, "spin": 0}

    def name_of(field):
        m = re.match(r"\((\d+)\)(?: (.*))?", field)
        if not m:
            return field
        if m.group(2):
            names[m.group(1)] = m.group(2)
        return names.get(m.group(1), "")

    with open(path) as f:
        for line in f:
            if line.startswith("fn="):
                name_of(line[3:].rstrip("\n"))
            elif line.startswith("cfn="):
                callee = name_of(line[4:].rstrip("\n"))
            elif line.startswith("calls="):
                n = int(line[6:].split()[0])
                if MUTEX.match(callee):
                    totals["mutex"] += n
                elif SPIN.match(callee):
                    totals["spin"] += n
    return totals


def main():
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    short, long_, calls, system = sys.argv[1:]
    a, b = count(short), count(long_)
    calls = float(calls)
    for key, metric in (("mutex", "mutex_per_call"),
                        ("spin", "provider_spin_per_call")):
        print(f"locks,{system},64,{metric},{(b[key] - a[key]) / calls:.2f},n")


if __name__ == "__main__":
    main()
