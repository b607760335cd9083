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


def profile(n):
    """A program that made `n` calls: each function's own cost is `n`
    times its cost per call. Connection::SendFrame costs 30 of its own per
    call (lines "10", "+2" and "-1", then "*": the same line again) and
    calls malloc (7) once; the line after calls= is that call's inclusive
    cost (which also holds its instructions before the first call) and not
    SendFrame's. ServerEndpoint::OnRequest's name then comes compressed, as
    does libc. Three events: Ir is the second column after the position."""
    return f"""# callgrind format
version: 1
positions: line
events: Dr Ir Dw
summary: {57 * n}

ob=(1) {LIB}
fl=(1) /src/connection.cc
fn=(1) rdmarpc::rdma::Connection::SendFrame(std::span<int const>)
10 99 {14 * n} 5
+2 99 {10 * n} 5
-1 99 {4 * n} 5
* 99 {2 * n} 5
cob=(2) {LIBC}
cfi=(2) ./malloc/malloc.c
cfn=(2) malloc
calls={n} 0
12 99 {7 * n + 100} 5
fn=(3) rdmarpc::rdma::ServerEndpoint::OnRequest(rdmarpc::rdma::FrameView const&)
5 99 {13 * n} 5
ob=(2)
fl=(2)
fn=(2)
0 99 {7 * n} 5
ob=(1)
fn=(4) absl::debian3::Status rdmarpc::rdma::(anonymous namespace)::ParseHeadInto<rdmarpc::rdma::Grant>(std::string_view)
1 99 {7 * n} 5
totals: 0 {57 * n} 40
"""


class BreakdownTest(unittest.TestCase):

    def write(self, text):
        f = tempfile.NamedTemporaryFile("w", suffix=".cg", delete=False)
        f.write(text)
        f.close()
        self.addCleanup(os.unlink, f.name)
        return f.name

    def test_parts_are_each_functions_own_instructions(self):
        parts = cb.exclusive(self.write(profile(1)))
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
        # Operators may hold brackets or a type.
        self.assertEqual(cb.qualified_name(
            "std::ostream& rdmarpc::operator<<(std::ostream&, int)"),
            "rdmarpc::operator@")
        self.assertEqual(cb.qualified_name(
            "rdmarpc::Ref<rdmarpc::X>::operator->() const"),
            "rdmarpc::Ref<rdmarpc::X>::operator@")
        self.assertEqual(cb.part_of(
            LIB, "rdmarpc::rdma::Connection::operator std::basic_string_view"
            "<char, std::char_traits<char> >() const"), "rdma_connection")
        self.assertEqual(cb.part_of(LIB, "std::_Function_handler<void (int), "
                                    "rdmarpc::rdma::ServerEndpoint::F()"
                                    "::{lambda(int)#1}>::_M_invoke(int)"),
                         "library_std")
        self.assertEqual(cb.part_of(LIB, "rdmarpc::rdma::RequestHead::"
                                    "ByteSizeLong() const"),
                         "library_protobuf")

    def test_difference_over_calls(self):
        short, long_ = self.write(profile(1)), self.write(profile(3))
        out = subprocess.run(
            [sys.executable, cb.__file__, short, long_, "2", "sys-style"],
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
