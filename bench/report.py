#!/usr/bin/env python3
"""Writes summary.md and PNG plots from the CSV files of bench/run_all.sh.

    python3 bench/report.py RESULTS_DIR

Ratios compare rows measured in the same run: rdmarpc over RDMA against
perftest on the same device, rdmarpc's gRPC fallback against stock gRPC on
the same machine.
"""
import csv
import datetime
import os
import statistics
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from callgrind_breakdown import PARTS as BREAKDOWN_PARTS  # noqa: E402


def load(out):
    rows = []
    for name in sorted(os.listdir(out)):
        if name.endswith(".csv"):
            with open(os.path.join(out, name), newline="") as f:
                rows.extend(csv.DictReader(f))
    return rows


def index(rows):
    """(experiment, system, metric) -> {param: value}; a row measured in
    several rounds counts with its median."""
    values = defaultdict(lambda: defaultdict(list))
    for r in rows:
        try:
            param = int(r["param"])
        except ValueError:
            param = r["param"]
        values[(r["experiment"], r["system"], r["metric"])][param].append(
            float(r["value"]))
    return {key: {p: statistics.median(v) for p, v in points.items()}
            for key, points in values.items()}


def size_text(n):
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def fmt(v):
    return "-" if v is None else (f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}")


def ratio(a, b):
    return None if a is None or b in (None, 0) else a / b


def worst_ratio(series, reference):
    """The largest series / reference over the points both have, or None."""
    return max((ratio(v, reference[p]) for p, v in series.items()
                if p in reference), default=None)


def plot(path, title, xlabel, ylabel, series, logx=True, logy=False):
    if not any(points for _, points in series):
        return
    plt.figure(figsize=(7, 4.2))
    for label, points in series:
        if points:
            xs = sorted(points)
            plt.plot(xs, [points[x] for x in xs], marker="o", label=label)
    if logx:
        plt.xscale("log", base=2)
    if logy:
        plt.yscale("log")
    plt.title(title)
    plt.xlabel(xlabel)
    plt.ylabel(ylabel)
    plt.grid(True, alpha=0.3)
    plt.legend()
    plt.tight_layout()
    plt.savefig(path, dpi=110)
    plt.close()


def main():
    out = sys.argv[1]
    rows = load(out)
    t = index(rows)
    get = lambda e, s, m: t.get((e, s, m), {})  # noqa: E731
    machine = rows[0]["machine"] if rows else "?"
    rdma_kind = next((r["rdma"] for r in rows if r["rdma"] != "none"), "none")
    md = [f"# rdmarpc benchmarks, {datetime.date.today().isoformat()}", "",
          f"Machine: {machine}. RDMA: {rdma_kind}. Command: "
          "`bench/run_all.sh`. Every row's exact command is in the CSV "
          "files.", ""]
    if "soft-RoCE" in rdma_kind:
        md += ["Soft-RoCE is emulated (in a VM here): read its figures only "
               "as ratios to perftest on the same device in the same boot. "
               "The RDMA rows, perftest and the micro-benchmarks ran in the "
               "VM; the gRPC rows on the machine itself: compare each path "
               "with its own reference, not across.", ""]
    targets = []

    # RDMA vs perftest, then the gRPC fallback vs stock gRPC, small calls:
    # with each system's callback API and with its blocking stubs.
    send = get("perftest", "ib_send_lat", "t_typical")
    styles = (("latency", "callback API", ""),
              ("blocking", "blocking stubs", ", blocking stubs"))
    for exp, style, tag in styles:
        lat = get(exp, "rdma", "p50")
        lat99 = get(exp, "rdma", "p99")
        lat_inline = get(exp, "rdma-inline", "p50")
        if not lat:
            continue
        md += [f"## RDMA small calls vs 2 x ib_send_lat ({style})", "",
               "Handlers run inline on the thread that received the call "
               "(the default, `SetRunHandlersInline`) or on the server's "
               "worker pool (`SetRunHandlersInline(false)`, the first "
               "columns). Each figure is the median of the "
               "rounds in which the systems took turns; ib_send_lat takes "
               "a turn in each round too, and its figure is the median of "
               "those and its run with the other perftest figures.", "",
               "| size | rdmarpc p50 (us) | p99 (us) | inline handlers p50 "
               "(us) | 2 x ib_send_lat (us) | ratio | ratio, inline |",
               "|---|---|---|---|---|---|---|"]
        for s in sorted(lat):
            ref = 2 * send[s] if s in send else None
            md.append(f"| {size_text(s)} | {fmt(lat[s])} | "
                      f"{fmt(lat99.get(s))} | {fmt(lat_inline.get(s))} | "
                      f"{fmt(ref)} | {fmt(ratio(lat[s], ref))} | "
                      f"{fmt(ratio(lat_inline.get(s), ref))} |")
        round_trip = {s: 2 * v for s, v in send.items()}
        for label, series in (("", lat), (", inline handlers", lat_inline)):
            worst = worst_ratio(series, round_trip)
            if worst is None:
                continue
            targets.append(("RDMA small-call round trip <= 1.5 x "
                            f"(2 x ib_send_lat){tag}{label}",
                            worst, worst <= 1.5))
        md.append("")
    # Issue 14's 64 B round-trip targets, each against 2 x ib_send_lat.
    ref64 = 2 * send[64] if 64 in send else None
    for exp, system, label, bound in (
            ("blocking", "rdma-inline", "blocking stub, inline handlers", 3),
            ("blocking", "rdma", "blocking stub, worker-pool handlers", 5),
            ("latency", "rdma-inline", "callback API, inline handlers", 4)):
        r = ratio(get(exp, system, "p50").get(64), ref64)
        if r is not None:
            targets.append((f"RDMA 64 B round trip, {label} <= {bound} x "
                            "(2 x ib_send_lat)", r, r <= bound))
    # The callback API again, without the bench's hop back to its waiting
    # thread: each call issued from the previous one's callback.
    r = ratio(get("apart", "rdma-inline", "p50").get("chained"), ref64)
    if r is not None:
        targets.append(("RDMA 64 B round trip, callback API chained (next "
                        "call from the callback), inline handlers <= 4 x "
                        "(2 x ib_send_lat)", r, r <= 4))
    together = {m: get("apart", "rdma-inline", m) for m in ("p50", "p99")}
    apart = {m: get("apart", "rdma-inline-apart", m) for m in ("p50", "p99")}
    if apart["p50"]:
        md += ["## RDMA 64 B calls, server in its own process", "",
               "The other RDMA rows run client and server in one process, "
               "where one engine polls for both; a deployment runs them "
               "apart (`rpc_bench serve`, then `RDMARPC_BENCH_SERVER_PORT`). "
               "Inline handlers. Blocking stubs, or callback calls chained "
               "(each issued from the previous one's callback: `inflight "
               "1`). Medians of 3 rounds.", "",
               "| calls | one process p50 (us) | p99 (us) | apart p50 (us) "
               "| p99 (us) | ratio, one process | ratio, apart |",
               "|---|---|---|---|---|---|---|"]
        for style in ("blocking", "chained"):
            one, two = together["p50"].get(style), apart["p50"].get(style)
            md.append(f"| {style} | {fmt(one)} | "
                      f"{fmt(together['p99'].get(style))} | {fmt(two)} | "
                      f"{fmt(apart['p99'].get(style))} | "
                      f"{fmt(ratio(one, ref64))} | {fmt(ratio(two, ref64))} |")
        md += ["", "Ratios: to 2 x ib_send_lat at 64 B.", ""]
    bw = get("throughput", "rdma", "throughput")
    wbw = get("perftest", "ib_write_bw", "bw_average")
    if bw:
        md += ["## RDMA tensor throughput vs ib_write_bw", "",
               "| size | rdmarpc (MB/s) | ib_write_bw (MB/s) | ratio |",
               "|---|---|---|---|"]
        for s in sorted(bw):
            md.append(f"| {size_text(s)} | {fmt(bw[s])} | {fmt(wbw.get(s))} "
                      f"| {fmt(ratio(bw[s], wbw.get(s)))} |")
        md.append("")
    piped = get("pipelined", "rdma", "throughput")
    if piped:
        md += ["## RDMA tensors, 16 calls in flight, vs ib_write_bw", "",
               "| size | rdmarpc (MB/s) | calls/s | ib_write_bw (MB/s) | "
               "ratio |", "|---|---|---|---|---|"]
        piped_calls = get("pipelined", "rdma", "calls_per_s")
        for s in sorted(piped):
            md.append(f"| {size_text(s)} | {fmt(piped[s])} | "
                      f"{fmt(piped_calls.get(s))} | {fmt(wbw.get(s))} | "
                      f"{fmt(ratio(piped[s], wbw.get(s)))} |")
        md.append("")
        r = ratio(piped.get(64 << 10), wbw.get(64 << 10))
        if r is not None:
            targets.append(("64 KiB tensors, 16 in flight >= 0.8 x "
                            "ib_write_bw", r, r >= 0.8))
    # The target from alternating rounds: the median of each side.
    t_rdma = get("target64", "rdma", "throughput")
    t_ref = get("target64", "ib_write_bw", "throughput")
    if t_rdma and t_ref:
        md += ["## 64 MiB over RDMA: alternating rounds", "",
               "| round | rdmarpc (MB/s) | ib_write_bw (MB/s) |",
               "|---|---|---|"]
        for r in sorted(t_rdma):
            md.append(f"| {r} | {fmt(t_rdma[r])} | {fmt(t_ref.get(r))} |")
        m_rdma = statistics.median(t_rdma.values())
        m_ref = statistics.median(t_ref.values())
        r = ratio(m_rdma, m_ref)
        md += [f"| median | {fmt(m_rdma)} | {fmt(m_ref)} |", ""]
        targets.append(("64 MiB over RDMA >= 0.95 x ib_write_bw (medians of "
                        f"{len(t_rdma)} alternating rounds)", r, r >= 0.95))

    for exp, style, tag in styles:
        g50, s50 = get(exp, "grpc", "p50"), get(exp, "stock", "p50")
        g50_inline = get(exp, "grpc-inline", "p50")
        if not g50:
            continue
        md += [f"## gRPC fallback vs stock gRPC: small calls ({style})", "",
               "Stock gRPC's synchronous server runs the handler on the "
               "thread that read the request; rdmarpc's server runs it "
               "inline (the default, `SetRunHandlersInline`) or hands it to "
               "a worker (`SetRunHandlersInline(false)`, the first "
               "columns). Each figure is the median of the "
               "rounds in which the systems took turns.", "",
               "| size | fallback p50 / p99 / p999 (us) | inline handlers "
               "p50 (us) | stock p50 / p99 / p999 (us) | p50 ratio | "
               "ratio, inline |", "|---|---|---|---|---|---|"]
        for s in sorted(g50):
            fb = "/".join(fmt(get(exp, "grpc", m).get(s))
                          for m in ("p50", "p99", "p999"))
            st = "/".join(fmt(get(exp, "stock", m).get(s))
                          for m in ("p50", "p99", "p999"))
            md.append(f"| {size_text(s)} | {fb} | "
                      f"{fmt(g50_inline.get(s))} | {st} | "
                      f"{fmt(ratio(g50[s], s50.get(s)))} | "
                      f"{fmt(ratio(g50_inline.get(s), s50.get(s)))} |")
        for label, series in (("", g50), (", inline handlers", g50_inline)):
            worst = worst_ratio(series, s50)
            if worst is None:
                continue
            targets.append(("gRPC fallback small-call p50 <= 1.1 x stock "
                            f"gRPC{tag}{label}", worst, worst <= 1.1))
        r = ratio(get(exp, "grpc", "cpu_per_million_calls").get(64),
                  get(exp, "stock", "cpu_per_million_calls").get(64))
        if r is not None:
            targets.append(("gRPC fallback 64 B CPU per call <= 1.2 x stock "
                            f"gRPC{tag}", r, r <= 1.2))
        md.append("")
    gbw, sbw = (get("throughput", "grpc", "throughput"),
                get("throughput", "stock", "throughput"))
    if gbw:
        md += ["## gRPC fallback vs stock gRPC: tensor throughput", "",
               "Stock gRPC runs with its message limits raised (-1): by "
               "default it refuses messages over 4 MB.", "",
               "| size | fallback (MB/s) | stock (MB/s) | ratio | CPU s/GB "
               "fallback | CPU s/GB stock |", "|---|---|---|---|---|---|"]
        gcpu = get("throughput", "grpc", "cpu_per_gb")
        scpu = get("throughput", "stock", "cpu_per_gb")
        for s in sorted(gbw):
            md.append(f"| {size_text(s)} | {fmt(gbw[s])} | {fmt(sbw.get(s))} "
                      f"| {fmt(ratio(gbw[s], sbw.get(s)))} | "
                      f"{fmt(gcpu.get(s))} | {fmt(scpu.get(s))} |")
        r = ratio(gbw.get(64 << 20), sbw.get(64 << 20))
        targets.append(("64 MiB over the gRPC fallback >= 1.3 x stock gRPC",
                        r, r is not None and r >= 1.3))
        md.append("")

    # Tail latency at steady load, every path.
    for system in ("rdma", "rdma-inline", "grpc", "grpc-inline", "stock"):
        p50, p99 = (get("latency", system, "p50"),
                    get("latency", system, "p99"))
        if p50:
            worst = max((p99[s] / p50[s] for s in p50 if s in p99),
                        default=None)
            if worst is None:
                continue
            targets.append((f"p99 <= 3 x p50 for small calls ({system})",
                            worst, worst <= 3))

    # Concurrency, fan-out, CPU cost.
    for exp, label, metric, unit in (
            ("inflight", "calls in flight on one connection", "calls_per_s",
             "calls/s"),
            ("connections", "connections, one call in flight each",
             "calls_per_s", "calls/s"),
            ("fanout", "servers receiving the same 16 MiB tensor",
             "throughput", "MB/s")):
        systems = [s for s in ("rdma-inline", "rdma-pollers2-inline", "rdma",
                               "grpc-inline", "grpc", "stock")
                   if get(exp, s, metric)]
        if not systems:
            continue
        md += [f"## {label}", "",
               "`-inline`: the server's handlers run inline (its default); "
               "without: on its worker pool. `rdma-pollers2-inline`: "
               "RDMARPC_RDMA_POLLERS=2, the client's and the server's "
               "connections on two engines.", "",
               "| " + exp + " | " +
               " | ".join(f"{s} ({unit})" for s in systems) + " |",
               "|---" * (len(systems) + 1) + "|"]
        params = sorted({p for s in systems for p in get(exp, s, metric)})
        for p in params:
            md.append(f"| {p} | " + " | ".join(
                fmt(get(exp, s, metric).get(p)) for s in systems) + " |")
        md.append("")
        plot(os.path.join(out, f"{exp}.png"), label, exp, unit,
             [(s, get(exp, s, metric)) for s in systems])
    # System calls per call, both ends, beside ib_send_lat's per round trip.
    sc = {r["system"]: {} for r in rows if r["experiment"] == "syscalls"}
    for r in rows:
        if r["experiment"] == "syscalls":
            sc[r["system"]][r["metric"]] = float(r["value"])
    if sc:
        md += ["## System calls per 64 B call (both ends, perf stat)", "",
               "Counted as the difference of two runs (500 and 2500 calls; "
               "ib_send_lat 1000 and 1001000 iterations), client and server "
               "together; ib_send_lat's server and client summed per round "
               "trip. Under a VM whose clock source is HPET every clock read "
               "is a system call; rpc_bench does not time its calls while "
               "it counts.", "",
               "| path | system calls per call | futex calls per call | "
               "context switches per call |",
               "|---|---|---|---|"]
        for name in sorted(sc):
            md.append(f"| {name} | {fmt(sc[name].get('per_call'))} | "
                      f"{fmt(sc[name].get('futex_per_call'))} | "
                      f"{fmt(sc[name].get('switches_per_call'))} |")
        md.append("")
        ref = sc.get("ib_send_lat", {}).get("per_call")
        fast = sc.get("rdma-inline-blocking", {})
        # 0 within 0.1: perftest's own count swings with its start-up
        # (experiments.sh, ib_send_lat's system calls).
        if ref is not None and "per_call" in fast:
            extra = fast["per_call"] - ref
            targets.append(("system calls per call beyond ib_send_lat's, "
                            "RDMA, blocking stub, inline handlers: 0",
                            extra, extra <= 0.1))
        # Our own count (no perftest start-up in it): 0 means 0.00.
        if "futex_per_call" in fast:
            targets.append(("futex calls per call, RDMA, blocking stub, "
                            "inline handlers: 0", fast["futex_per_call"],
                            fast["futex_per_call"] < 0.005))

    # Messages per second: calls in flight on one connection against
    # ib_send_bw's 64 B message rate (a call is two messages).
    rate = get("perftest", "ib_send_bw", "msg_rate").get(64)
    for system, how in (("rdma-inline", "inline handlers (the default)"),
                        ("rdma", "worker-pool handlers"),
                        ("rdma-pollers2-inline",
                         "inline handlers, 2 pollers")):
        cps = get("inflight", system, "calls_per_s")
        if rate and cps.get(32):
            r = cps[32] / rate
            targets.append(("RDMA calls/s with 32 in flight >= 0.25 x "
                            f"ib_send_bw 64 B messages/s, {how}", r,
                            r >= 0.25))
    idle = {s: get("idle", s, "cpu_percent").get(32)
            for s in ("rdma", "grpc")}
    rest = {s: get("idle", s, "rest_s").get(32) for s in ("rdma", "grpc")}
    if any(v is not None for v in idle.values()):
        md += ["## Idle: 32 connected channels, no calls, 5 s", "",
               "Measured once the channels are at rest: the engines' spins "
               "have ended and each RDMA watcher, which wakes every 50 ms "
               "for a second after its channel's last call, sleeps until "
               "the next one.", "",
               "| path | CPU, % of a core (both ends) | at rest after (s) |",
               "|---|---|---|"]
        md += [f"| {s} | {fmt(v)} | {fmt(rest.get(s))} |"
               for s, v in idle.items() if v is not None]
        md.append("")
        if idle.get("rdma") is not None:
            targets.append(("idle server, 32 RDMA connections: < 1% of a "
                            "core", idle["rdma"], idle["rdma"] < 1))
    pinned = {s: get("idle", s, "pinned_mib").get(32)
              for s in ("rdma", "rdma-own-receives", "rdma-own-sends")}
    if all(pinned[s] is not None and pinned[s] >= 0
           for s in ("rdma", "rdma-own-receives")):
        md += ["Pinned memory of both ends with 32 idle RDMA connections "
               "(VmPin: control buffers and receive pools): "
               f"{fmt(pinned['rdma'])} MiB with shared receive queues, "
               f"{fmt(pinned['rdma-own-receives'])} MiB with each "
               "connection's own receives "
               f"({fmt(pinned['rdma'] / pinned['rdma-own-receives'])}x).", ""]
    if (pinned["rdma"] is not None and pinned["rdma-own-sends"] is not None
            and pinned["rdma-own-sends"] > 0):
        md += ["With send buffers lent by each completion group's pool, "
               f"{fmt(pinned['rdma'])} MiB; with each connection's own "
               f"first chunk, {fmt(pinned['rdma-own-sends'])} MiB "
               f"({fmt(pinned['rdma'] / pinned['rdma-own-sends'])}x).", ""]
    landed = get("idle", "rdma", "pinned_mib_landed").get(32)
    if landed is not None and landed >= 0:
        md += ["After a 64 KiB echo on each of those channels (landing in "
               "the landing arena on both ends, registered once per "
               f"protection domain): {fmt(landed)} MiB pinned.", ""]
    crowd = {m: get("crowded", "rdma-inline", m)
             for m in ("p50", "p99", "cpu_per_million_calls")}
    if crowd["p50"]:
        alone_ins = get("instructions", "rdma-inline-blocking",
                        "per_call").get(64)
        crowd_ins = get("instructions", "rdma-inline-crowded",
                        "per_call").get(32)
        md += ["## A busy connection beside idle ones (RDMA, inline handlers)",
               "",
               "64 B blocking calls on one channel while COUNT other "
               "channels to the same server stay connected and make no "
               "calls (`rpc_bench crowded`): what the idle ones cost each "
               "pass of the pollers. Instructions per call (callgrind, both "
               "ends): alone from the instructions rows' "
               "rdma-inline-blocking, beside 32 from `crowded "
               "rdma-inline 32`.", "",
               "| idle connections | p50 (us) | p99 (us) | CPU per call (us) "
               "| instructions per call |", "|---|---|---|---|---|"]
        for count in sorted(crowd["p50"]):
            cpu = crowd["cpu_per_million_calls"].get(count)
            ins = {0: alone_ins, 32: crowd_ins}.get(count)
            md.append(f"| {count} | {fmt(crowd['p50'][count])} | "
                      f"{fmt(crowd['p99'].get(count))} | "
                      f"{fmt(cpu)} | {fmt(ins)} |")
        p50_ratio = ratio(crowd["p50"].get(32), crowd["p50"].get(0))
        ins_ratio = ratio(crowd_ins, alone_ins)
        md += ["", f"Beside 32 idle connections: p50 {fmt(p50_ratio)}x, "
               f"instructions {fmt(ins_ratio)}x of the call alone.", ""]
    phases = ("idle_p50", "idle_p99", "loaded_p50", "loaded_p99")
    lo = {m: get("interference", "rdma", m) for m in phases}
    ref = {m: get("interference", "ib_send_lat", m) for m in phases}
    if lo["idle_p99"]:
        md += ["## 64 B calls on one connection while another moves a "
               "large tensor", "",
               "The reference: `ib_send_lat` alone and while `ib_write_bw` "
               "moves messages of the same size on a second connection "
               "(what the wire itself does to small messages).", "",
               "| path | bulk size | alone p50 (us) | p99 | loaded p50 (us) "
               "| p99 | p99 loaded / alone |", "|---|---|---|---|---|---|---|"]
        for name, d in (("rdmarpc", lo), ("ib_send_lat", ref)):
            for b in sorted(d["idle_p99"]):
                md.append(
                    f"| {name} | {size_text(b)} | "
                    f"{fmt(d['idle_p50'].get(b))} | "
                    f"{fmt(d['idle_p99'].get(b))} | "
                    f"{fmt(d['loaded_p50'].get(b))} | "
                    f"{fmt(d['loaded_p99'].get(b))} | "
                    f"{fmt(ratio(d['loaded_p99'].get(b), d['idle_p99'].get(b)))} |")
        for b in sorted(lo["idle_p99"]):
            r = ratio(lo["loaded_p99"].get(b), lo["idle_p99"].get(b))
            if r is not None:
                wire = ratio(ref["loaded_p99"].get(b), ref["idle_p99"].get(b))
                note = (f" (ib_send_lat's own: {wire:.1f}x)"
                        if wire is not None else "")
                targets.append((f"small-call p99 while another connection "
                                f"moves {size_text(b)} <= 3 x its idle "
                                f"p99{note}", r, r <= 3))
        md.append("")

    cpu = [(s, get("latency", s, "cpu_per_million_calls").get(64))
           for s in ("rdma", "grpc", "stock")]
    if any(v for _, v in cpu):
        md += ["## CPU cost (client and server in one process, getrusage)",
               "", "| path | CPU s per million 64 B calls | CPU s per GB at "
               "64 MiB |", "|---|---|---|"]
        for s, v in cpu:
            if v is None:
                continue
            md.append(f"| {s} | {fmt(v)} | "
                      f"{fmt(get('throughput', s, 'cpu_per_gb').get(64 << 20))} |")
        md.append("")
    ins = {r["system"]: float(r["value"]) for r in rows
           if r["experiment"] == "instructions"}
    if ins:
        md += ["## Instructions per 64 B call (both ends, callgrind)", "",
               "Blocking stubs; the difference of two runs (1000 and 3000 "
               "calls) over 2000, client and server together. Under the "
               "VM's CPU emulation time goes with instructions. perftest "
               "busy-polls, so it has no comparable count. "
               "stock-release-mutexes is stock gRPC with Abseil's debug "
               "deadlock detector off, as rdmarpc's gRPC transports turn it "
               "off (Debian's Abseil runs it on every absl::Mutex).", "",
               "| path | instructions per call | vs stock gRPC | "
               "vs stock-release-mutexes |",
               "|---|---|---|---|"]
        refs = (ins.get("stock-blocking"),
                ins.get("stock-release-mutexes-blocking"))
        for name in sorted(ins):
            ratios = [f"{ins[name] / ref:.2f}x"
                      if ref and not name.startswith("rdma") else ""
                      for ref in refs]
            md.append(f"| {name} | {ins[name]:.0f} | {ratios[0]} | "
                      f"{ratios[1]} |")
        md.append("")
    locks = {}
    for r in rows:
        if r["experiment"] == "locks":
            locks.setdefault(r["system"], {})[r["metric"]] = float(r["value"])
    if locks:
        md += ["## Lock acquisitions per 64 B call (both ends, callgrind)", "",
               "From the same two profiles as the instructions "
               "(bench/callgrind_locks.py). Mutexes: pthread mutexes and "
               "rwlocks, a condition variable's re-lock, absl::Mutex (gRPC's "
               "gpr_mu). Provider spin locks: pthread spin locks, taken by "
               "the verbs provider inside its post and poll calls, as in "
               "perftest's own loop.", "",
               "| path | mutexes per call | provider spin locks per call |",
               "|---|---|---|"]
        for name in sorted(locks):
            m = locks[name]
            md.append(f"| {name} | {fmt(m.get('mutex_per_call'))} | "
                      f"{fmt(m.get('provider_spin_per_call'))} |")
        md.append("")
        fast = locks.get("rdma-inline-blocking", {}).get("mutex_per_call")
        if fast is not None:
            targets.append(("mutexes per call, RDMA, blocking stub, inline "
                            "handlers (both ends): 0", fast, fast <= 0.1))
    parts = {}
    for r in rows:
        if r["experiment"] == "breakdown":
            parts.setdefault(r["system"], {})[r["metric"]] = float(r["value"])
    if parts:
        systems = sorted(parts)
        md += ["## Where a 64 B call's instructions go (both ends, callgrind)",
               "", "From the same two profiles as the instructions "
               "(bench/callgrind_breakdown.py): each function's own "
               "instructions, by the part of the path it belongs to (its "
               "library, and in rdmarpc's library its class or file; a "
               "lambda called through std::function counts with the "
               "std templates). The parts, each rounded, add up to the "
               "instructions per call. The bench's own part holds its "
               "service and messages and its harness (call loop, malloc "
               "counter, percentile sort); fault points are compiled in "
               "because the bench runs the test build.", "",
               "| part | " + " | ".join(systems) + " |",
               "|---|" + "---|" * len(systems)]
        for metric, what in BREAKDOWN_PARTS:
            values = [parts[s].get(metric) for s in systems]
            if not any(values):
                continue
            md.append(f"| {what} | " +
                      " | ".join(str(round(v)) if v is not None else ""
                                 for v in values) + " |")
        md.append("")
    allocs = {(exp, s): get(exp, s, "allocations_per_call").get(64)
              for exp in ("latency", "blocking")
              for s in ("rdma", "rdma-inline", "grpc", "grpc-inline", "stock")}
    if any(v is not None for v in allocs.values()):
        md += ["## Heap allocations per 64 B call (both ends, whole process)",
               "", "Counted by interposing malloc in rpc_bench (operator new "
               "allocates through it), over every call of the run.", "",
               "| path | callback API | blocking stub |", "|---|---|---|"]
        for s in ("rdma", "rdma-inline", "grpc", "grpc-inline", "stock"):
            md.append(f"| {s} | {fmt(allocs[('latency', s)])} | "
                      f"{fmt(allocs[('blocking', s)])} |")
        md.append("")
    inl, wr = (get("threshold", "rdma", "inline_p50"),
               get("threshold", "rdma", "written_p50"))
    if inl:
        md += ["## RDMA inline threshold: tensor in the SEND vs written", "",
               "| size | in the SEND p50 (us) | written p50 (us) |",
               "|---|---|---|"]
        for s in sorted(inl):
            md.append(f"| {size_text(s)} | {fmt(inl[s])} | {fmt(wr.get(s))} |")
        md.append("")
    micro = [r for r in rows if r["experiment"] == "micro"]
    if micro:
        md += ["## Micro-benchmarks (Google Benchmark, CPU time)", "",
               "| case | arg | time |", "|---|---|---|"]
        for r in micro:
            md.append(f"| {r['system']} | {r['param']} | {r['value']} "
                      f"{r['unit']} |")
        md.append("")

    plot(os.path.join(out, "latency.png"), "small-call round trip (p50)",
         "request bytes", "us",
         [("rdmarpc RDMA", get("latency", "rdma", "p50")),
          ("2 x ib_send_lat", {k: 2 * v for k, v in send.items()}),
          ("rdmarpc RDMA, inline handlers",
           get("latency", "rdma-inline", "p50")),
          ("rdmarpc gRPC fallback", get("latency", "grpc", "p50")),
          ("rdmarpc gRPC fallback, inline handlers",
           get("latency", "grpc-inline", "p50")),
          ("stock gRPC", get("latency", "stock", "p50"))], logy=True)
    plot(os.path.join(out, "throughput.png"), "tensor throughput",
         "tensor bytes", "MB/s",
         [("rdmarpc RDMA", bw), ("ib_write_bw", wbw),
          ("rdmarpc gRPC fallback", gbw), ("stock gRPC", sbw)], logy=True)

    md[4:4] = ["## Targets", "", "| target | measured | met |",
               "|---|---|---|"] + [
        f"| {name} | {fmt(v)} | {'yes' if ok else 'NO'} |"
        for name, v, ok in targets] + [""]
    md += ["Plots: " + ", ".join(
        f"![{p}]({p})" for p in sorted(os.listdir(out))
        if p.endswith(".png"))]
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md[:4 + 4 + len(targets)]))


if __name__ == "__main__":
    main()
