#!/usr/bin/env python3
"""bench/callgrind_breakdown.py on small hand-written callgrind profiles.

A call's inclusive cost line must not count for its caller, compressed
names must resolve to what they named first, and the parts must add up to
the profile's own instructions.
"""
import os
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                "..", "..", "bench"))
import callgrind_breakdown as cb  # noqa: E402

LIB = "/build/runtime/librdmarpc.so.0.1.0"
LIBC = "/usr/lib/x86_64-linux-gnu/libc.so.6"

# Connection::SendFrame costs 30 of its own and calls malloc (7) once; the
# line after calls= is that call's inclusive cost and not SendFrame's.
# ServerEndpoint::OnRequest's name then comes compressed, as does libc.
SHORT = f"""# callgrind format
version: 1
positions: line
events: Ir
summary: 57

ob=(1) {LIB}
fl=(1) /src/connection.cc
fn=(1) rdmarpc::rdma::Connection::SendFrame(std::span<int const>)
10 20
+2 10
cob=(2) {LIBC}
cfi=(2) ./malloc/malloc.c
cfn=(2) malloc
calls=1 0
12 7
fn=(3) rdmarpc::rdma::ServerEndpoint::OnRequest(rdmarpc::rdma::FrameView const&)
5 13
ob=(2)
fl=(2)
fn=(2)
0 7
ob=(1)
fn=(4) absl::debian3::Status rdmarpc::rdma::(anonymous namespace)::ParseHeadInto<rdmarpc::rdma::Grant>(std::string_view)
1 7
totals: 57
"""

# The same program after one more call: each function once more.
LONG = SHORT.replace("10 20", "10 40").replace("+2 10", "+2 20").replace(
    "5 13", "5 26").replace("0 7\nob=(1)", "0 14\nob=(1)").replace(
        "1 7\ntotals", "1 14\ntotals")


class BreakdownTest(unittest.TestCase):

    def write(self, text):
        f = tempfile.NamedTemporaryFile("w", suffix=".cg", delete=False)
        f.write(text)
        f.close()
        self.addCleanup(os.unlink, f.name)
        return f.name

    def test_parts_are_each_functions_own_instructions(self):
        parts = cb.exclusive(self.write(SHORT))
        self.assertEqual(parts, {"rdma_connection": 30, "rdma_server": 13,
                                 "malloc_free": 7, "framing_payload": 7})
        self.assertEqual(sum(parts.values()), 57)

    def test_a_function_is_placed_by_its_own_name_not_its_parameters(self):
        self.assertEqual(cb.qualified_name(
            "rdmarpc::rdma::Connection::SendFrame(std::span<int const>)"),
            "rdmarpc::rdma::Connection::SendFrame")
        self.assertEqual(cb.qualified_name(
            "std::_Function_handler<void (absl::Status), "
            "rdmarpc::rdma::X::F()::{lambda(absl::Status)#1}>::_M_invoke("
            "std::_Any_data const&)"),
            "std::_Function_handler<void (absl::Status), "
            "rdmarpc::rdma::X::F()::{lambda(absl::Status)#1}>::_M_invoke")
        self.assertEqual(cb.part_of(LIB, "std::_Function_handler<void (int), "
                                    "rdmarpc::rdma::ServerEndpoint::F()"
                                    "::{lambda(int)#1}>::_M_invoke(int)"),
                         "library_std")
        self.assertEqual(cb.part_of(LIB, "rdmarpc::rdma::RequestHead::"
                                    "ByteSizeLong() const"),
                         "library_protobuf")

    def test_difference_over_calls(self):
        short, long_ = self.write(SHORT), self.write(LONG)
        out = subprocess.run(
            [sys.executable, cb.__file__, short, long_, "1", "sys-style"],
            check=True, capture_output=True, text=True).stdout.splitlines()
        rows = {line.split(",")[3]: int(line.split(",")[4]) for line in out}
        self.assertEqual(len(rows), len(cb.PARTS))
        self.assertEqual(rows["rdma_connection"], 30)
        self.assertEqual(rows["rdma_server"], 13)
        self.assertEqual(rows["malloc_free"], 7)
        self.assertEqual(rows["framing_payload"], 7)
        self.assertEqual(sum(rows.values()), 57)


if __name__ == "__main__":
    unittest.main()
