#!/usr/bin/env python3
"""Where a call's instructions go, from two callgrind profiles of one program.

Sums each function's own instructions (callgrind's cost lines, not those
of the calls it makes) in each profile, over every thread, sorts the
functions into parts of the call's path by their object and name, and
prints each part's difference over CALLS, so start-up and shut-down cancel
out, as for the instruction and lock counts:

  callgrind_breakdown.py cg.1000 cg.3000 2000 rdma-inline-blocking

prints one CSV row per part (experiment, system, param, metric, value,
unit), the parts summing to the instructions per call:
  breakdown,rdma-inline-blocking,64,malloc_free,V,n
The parts are PARTS below, in the order the report lists them.
"""
import re
import sys

# (metric, what it holds); the rules in part_of name them.
PARTS = (
    ("grpc_transport", "rdmarpc's gRPC transport"),
    ("rdma_connection", "RDMA connection: posting, credits, completions"),
    ("rdma_client", "RDMA client endpoint"),
    ("rdma_server", "RDMA server endpoint"),
    ("engine_polling", "engine and completion-queue polling"),
    ("framing_payload", "frames, payload plans and tensor walks"),
    ("channel", "channel, router and client context"),
    ("server_dispatch", "server dispatcher (runs the handler)"),
    ("call_log", "call log (exactly once)"),
    ("fault_points", "fault points (test builds only)"),
    ("library_std", "std and absl templates in the library "
     "(shared_ptr, std::function, containers)"),
    ("library_protobuf", "generated protobuf code of frame heads and "
     "tensors"),
    ("library_other", "the library, other"),
    ("protobuf", "libprotobuf: parsing, serializing, messages"),
    ("malloc_free", "malloc and free"),
    ("mutex", "mutexes and condition variables (libc)"),
    ("memcpy", "memcpy, memset, memmove"),
    ("libc_other", "libc, other (system call stubs, clocks)"),
    ("libstdcxx", "libstdc++ (operator new and delete, ...)"),
    ("absl", "Abseil libraries (Status, Mutex, hashing)"),
    ("verbs_provider", "verbs provider in user space (post, poll, "
     "spin locks)"),
    ("bench", "rpc_bench: its service, calls and generated messages"),
    ("grpc", "gRPC libraries"),
    ("loader", "dynamic loader"),
    ("other", "other"),
)

# Library functions by name, first match wins (std/absl instantiations
# and generated protobuf code are told apart first).
LIBRARY = (
    (r"^rdmarpc::internal::fault::", "fault_points"),
    (r"^(rdmarpc::rdma::(HelloRequest|HelloResponse|Part|Metadata|"
     r"RequestHead|ResponseHead|Region|Grant|Cancel|Ping)|rdmarpc::Tensor|"
     r"google::protobuf)::", "library_protobuf"),
    (r"^(std::|absl::|__gnu_cxx::)", "library_std"),
    (r"^(rdmarpc::grpc_transport|grpc)::", "grpc_transport"),
    (r"CallLog", "call_log"),
    (r"ServerDispatcher|rdmarpc::internal::Server|ServerContext",
     "server_dispatch"),
    (r"ServerEndpoint", "rdma_server"),
    (r"ClientEndpoint|RdmaClientTransport|ClientRecord|GrantTable|"
     r"rdma::Outcome",
     "rdma_client"),
    (r"Channel::|TransportRouter|ClientContext|CallWaiter|CallerPoll",
     "channel"),
    (r"Connection::|CreditWindow|SendPool", "rdma_connection"),
    (r"Engine::|CompletionGroup|Spin|RecordRoundTrip|RecordIdleGap|"
     r"PollerHooks|OnPollerThread|CompletionThread|InlineHandler|"
     r"ThreadPoller|BeforeBlockingCall|^rdmarpc::internal::\{anonymous\}::"
     r"Limits$", "engine_polling"),
    (r"Payload|Frame|Parse(Request|Response|HeadInto)|Check(Parts|Metadata)|"
     r"PlanOutgoing|AcceptIncoming|Walk|CollectTensors|CollectMutableTensors|"
     r"TensorByteSize|CallTensors|TensorBuffer|ExpectedSize|ChooseMover|"
     r"RegisterSources|CheckGrantFits|Landing|MetadataMap|ResponseMetadata|"
     r"CachedLayoutOf|generated::|DTypeSize",
     "framing_payload"),
)
LIBRARY = tuple((re.compile(p), part) for p, part in LIBRARY)

LIBC = (
    (re.compile(r"malloc|free|_int_|tcache|arena|realloc|calloc"),
     "malloc_free"),
    (re.compile(r"pthread_mutex|pthread_cond|__lll|futex|_mutex_|"
                r"pthread_rwlock"), "mutex"),
    (re.compile(r"pthread_spin"), "verbs_provider"),
    (re.compile(r"mem(cpy|set|move|cmp)|__memmove|__memset|__memcpy"),
     "memcpy"),
)


# An operator's own name, which may hold brackets (operator<<, operator(),
# operator->) or a type (operator bool, operator std::string_view<...>).
OPERATOR = re.compile(r"operator(\(\)|\[\]|->\*?|<=>|<<=?|>>=?|[<>!=]=|"
                      r"[-+*/%^&|~!=<>,]=?|&&|\|\||\+\+|--|"
                      r" ?(new|delete)(\[\])?|\s+[^(]+)")


def qualified_name(fn):
    """`fn` without its parameters and return type: what it is a member of
    decides its part, not the types it takes."""
    fn = fn.replace("(anonymous namespace)", "{anonymous}")
    fn = OPERATOR.sub("operator@", fn)
    depth = 0
    space = -1
    for i, c in enumerate(fn):
        if c == "<":
            depth += 1
        elif c == ">":
            depth -= 1
        elif depth == 0 and c == " ":
            space = i
        elif depth == 0 and c == "(":
            return fn[space + 1:i]
    return fn[space + 1:]


# Other objects by a piece of their path, first match wins.
OBJECTS = (
    ("libprotobuf", "protobuf"),
    ("libstdc++", "libstdcxx"),
    ("libabsl", "absl"),
    ("librxe", "verbs_provider"),
    ("libibverbs", "verbs_provider"),
    ("libmlx", "verbs_provider"),
    ("libgrpc", "grpc"),
    ("libgpr", "grpc"),
    ("libaddress_sorting", "grpc"),
    ("ld-linux", "loader"),
)


def part_of(ob, fn):
    if "librdmarpc" in ob:
        rules, name, rest = LIBRARY, qualified_name(fn), "library_other"
    elif "/libc.so" in ob:
        rules, name, rest = LIBC, fn, "libc_other"
    elif ob.endswith("/rpc_bench"):
        return "bench"
    else:
        return next((part for piece, part in OBJECTS if piece in ob), "other")
    return next((part for pattern, part in rules if pattern.search(name)),
                rest)


def exclusive(path):
    """Instructions per part, each function's own (not its callees')."""
    names = {"ob": {}, "fl": {}, "fn": {}}

    def name_of(kind, field):
        m = re.match(r"\((\d+)\)(?: (.*))?$", field)
        if not m:
            return field
        if m.group(2) is not None:
            names[kind][m.group(1)] = m.group(2)
        return names[kind].get(m.group(1), "")

    parts = {}
    ob = fn = ""
    part = "other"
    positions = 1  # columns before the events (callgrind's default: line)
    ir = 1  # the Ir column
    total = None
    call_cost_next = False
    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            if call_cost_next:
                # The line after calls= is the call's inclusive cost.
                call_cost_next = False
                continue
            key, _, value = line.partition("=")
            if key == "ob":
                ob = name_of("ob", value)
                part = part_of(ob, fn)
            elif key == "fn":
                fn = name_of("fn", value)
                part = part_of(ob, fn)
            elif key == "cob":
                name_of("ob", value)
            elif key == "cfn":
                name_of("fn", value)
            elif key in ("fl", "fi", "fe", "cfi", "cfl"):
                name_of("fl", value)
            elif key == "calls":
                call_cost_next = True
            elif line.startswith("positions:"):
                positions = len(line.split()) - 1
            elif line.startswith("events:"):
                ir = positions + line.split()[1:].index("Ir")
            elif line.startswith("totals:"):
                total = int(line.split()[1 + ir - positions])
            elif line[:1].isdigit() or line[:1] in "+-*":
                fields = line.split()
                if len(fields) > ir:
                    parts[part] = parts.get(part, 0) + int(fields[ir])
    # A format this does not read must not pass for a breakdown.
    if total is not None and sum(parts.values()) != total:
        sys.exit(f"{path}: the functions' own instructions sum to "
                 f"{sum(parts.values())}, not the profile's {total}")
    return parts


def main():
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    short, long_, calls, system = sys.argv[1:]
    a, b = exclusive(short), exclusive(long_)
    calls = float(calls)
    for metric, _ in PARTS:
        value = (b.get(metric, 0) - a.get(metric, 0)) / calls
        print(f"breakdown,{system},64,{metric},{round(value)},n")


if __name__ == "__main__":
    main()
