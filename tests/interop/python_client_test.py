#!/usr/bin/env python3
"""Interop: a stock python3-grpcio client calls the hello_tensor server.

The server's gRPC port serves every method as a plain gRPC method too: one
protobuf message per direction, tensor bytes inline in rdmarpc.Tensor.data.
This client uses only grpcio and protoc's --python_out modules (no rdmarpc
code, no grpc python codegen: channel.unary_unary with the message classes'
serializers).

  python_client_test.py --server PATH/hello_tensor_server --pymod DIR

DIR holds rdmarpc/tensor_pb2.py and hello_tensor_pb2.py. Exits 0 when every
check passes, 1 otherwise (2 for a setup problem), printing what it checked.
"""

import argparse
import array
import os
import signal
import subprocess
import sys
import tempfile
import time

PORT_WAIT_S = 30.0
CALL_TIMEOUT_S = 30.0
METHOD = "/hello.TensorService/Scale"


class CheckFailed(Exception):
    pass


def check(cond, what):
    if not cond:
        raise CheckFailed(what)


def f32_bytes(values):
    a = array.array("f", values)
    if sys.byteorder != "little":  # rdmarpc tensors are little endian
        a.byteswap()
    return a.tobytes()


def f32_values(data):
    a = array.array("f")
    a.frombytes(data)
    if sys.byteorder != "little":
        a.byteswap()
    return a


def start_server(server_path, tmpdir):
    port_file = os.path.join(tmpdir, "port")
    log_path = os.path.join(tmpdir, "server.log")
    log = open(log_path, "wb")
    proc = subprocess.Popen(
        [server_path, "--port=0", "--port-file=" + port_file],
        stdout=log, stderr=subprocess.STDOUT)
    log.close()
    return proc, port_file, log_path


def wait_for_port(proc, port_file, log_path):
    deadline = time.monotonic() + PORT_WAIT_S
    while time.monotonic() < deadline:
        rc = proc.poll()
        if rc is not None:
            raise RuntimeError(
                "server exited with status %d before writing its port; its "
                "output:\n%s" % (rc, read_log(log_path)))
        try:
            with open(port_file) as f:
                text = f.read()
            # The server writes "<port>\n"; a partial write lacks the newline.
            if text.endswith("\n") and text.strip().isdigit():
                port = int(text.strip())
                if port > 0:
                    return port
        except FileNotFoundError:
            pass
        time.sleep(0.05)
    raise RuntimeError(
        "server did not write its port to %s within %.0f s; its output:\n%s"
        % (port_file, PORT_WAIT_S, read_log(log_path)))


def read_log(log_path):
    try:
        with open(log_path, "rb") as f:
            return f.read().decode(errors="replace")
    except OSError as e:
        return "(no log: %s)" % e


def stop_server(proc):
    if proc.poll() is not None:
        return proc.returncode
    proc.send_signal(signal.SIGTERM)  # the server shuts down on SIGTERM
    try:
        return proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None


def run_checks(grpc, tensor_pb2, hello_pb2, port):
    target = "127.0.0.1:%d" % port
    # gRPC's default max receive message length is 4 MB (4194304 bytes); the
    # 5 MiB response below would fail with RESOURCE_EXHAUSTED without
    # raising it. -1 means unlimited. (The send side is unlimited by default,
    # and the rdmarpc server accepts requests of any size.)
    options = [("grpc.max_receive_message_length", -1)]
    with grpc.insecure_channel(target, options=options) as channel:
        grpc.channel_ready_future(channel).result(timeout=CALL_TIMEOUT_S)
        scale = channel.unary_unary(
            METHOD,
            request_serializer=hello_pb2.ScaleRequest.SerializeToString,
            response_deserializer=hello_pb2.ScaleResponse.FromString)

        def scale_request(values, factor, name):
            req = hello_pb2.ScaleRequest(name=name, factor=factor)
            req.input.dtype = tensor_pb2.DTYPE_F32
            req.input.shape.append(len(values))
            req.input.data = f32_bytes(values)
            req.input.byte_size = len(req.input.data)
            return req

        def check_scaled(resp, values, factor, what):
            out = resp.output
            check(out.dtype == tensor_pb2.DTYPE_F32,
                  "%s: dtype %s, want DTYPE_F32"
                  % (what, tensor_pb2.DType.Name(out.dtype)))
            check(list(out.shape) == [len(values)],
                  "%s: shape %s, want [%d]" % (what, list(out.shape), len(values)))
            want = f32_bytes([v * factor for v in values])
            check(len(out.data) == len(want),
                  "%s: %d data bytes, want %d" % (what, len(out.data), len(want)))
            if out.data != want:
                got = f32_values(out.data)
                exp = f32_values(want)
                first = next(i for i in range(len(exp)) if got[i] != exp[i])
                raise CheckFailed("%s: element %d is %r, want %r"
                                  % (what, first, got[first], exp[first]))

        # 1. A small tensor, every byte compared.
        values = [1.0, -2.5, 3.25, 1e6]
        resp, call = scale.with_call(scale_request(values, 2.0, "python"),
                                     timeout=CALL_TIMEOUT_S)
        check_scaled(resp, values, 2.0, "4-element f32 * 2")
        check("python" in resp.greeting,
              "greeting %r does not name the caller" % resp.greeting)
        print("ok: Scale of a 4-element f32 tensor by 2 -> dtype F32, shape [4], "
              "values %s; greeting %r" % (list(f32_values(resp.output.data)),
                                         resp.greeting))
        # The handler's metadata, as gRPC carries it.
        initial = dict(call.initial_metadata())
        trailing = dict(call.trailing_metadata())
        device = initial.get("x-input-device", "")
        check(device == "host" or device.startswith("cuda:"),
              "initial metadata %r lacks x-input-device (host or cuda:N)"
              % initial)
        check(trailing.get("x-served-over") == "grpc",
              "trailing metadata %r lacks x-served-over: grpc" % trailing)
        print("ok: initial metadata x-input-device=%s, trailing metadata "
              "x-served-over=%s" % (initial["x-input-device"],
                                    trailing["x-served-over"]))

        # 2. A 5 MiB tensor: request and response both over gRPC's 4 MB
        # default message size.
        n = (5 << 20) // 4
        values = [float(i % 1000) for i in range(n)]
        resp = scale(scale_request(values, 2.0, "python-big"),
                     timeout=CALL_TIMEOUT_S)
        check_scaled(resp, values, 2.0, "5 MiB f32 * 2")
        print("ok: Scale of a 5 MiB f32 tensor (%d elements) by 2 -> %d bytes, "
              "byte-exact" % (n, len(resp.output.data)))

        # 3. A malformed request: the shape says 10 floats (40 bytes), the
        # inline data has 3 bytes.
        req = hello_pb2.ScaleRequest(name="python-bad", factor=2.0)
        req.input.dtype = tensor_pb2.DTYPE_F32
        req.input.shape.append(10)
        req.input.data = b"\x01\x02\x03"
        try:
            scale(req, timeout=CALL_TIMEOUT_S)
            raise CheckFailed("malformed request (shape [10] f32, 3 data bytes) "
                              "succeeded; want INVALID_ARGUMENT")
        except grpc.RpcError as e:
            check(e.code() == grpc.StatusCode.INVALID_ARGUMENT,
                  "malformed request: got %s (%r), want INVALID_ARGUMENT"
                  % (e.code(), e.details()))
            check(bool(e.details()),
                  "malformed request: INVALID_ARGUMENT without a message")
            print("ok: malformed request (shape [10] f32, 3 data bytes) -> "
                  "INVALID_ARGUMENT: %s" % e.details())

        # 4. A method the server does not serve.
        unknown = channel.unary_unary(
            "/hello.TensorService/NoSuchMethod",
            request_serializer=hello_pb2.ScaleRequest.SerializeToString,
            response_deserializer=hello_pb2.ScaleResponse.FromString)
        try:
            unknown(hello_pb2.ScaleRequest(name="python"), timeout=CALL_TIMEOUT_S)
            raise CheckFailed("unknown method succeeded; want UNIMPLEMENTED")
        except grpc.RpcError as e:
            check(e.code() == grpc.StatusCode.UNIMPLEMENTED,
                  "unknown method: got %s (%r), want UNIMPLEMENTED"
                  % (e.code(), e.details()))
            print("ok: unknown method /hello.TensorService/NoSuchMethod -> "
                  "UNIMPLEMENTED: %s" % e.details())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", required=True,
                        help="path to the hello_tensor_server binary")
    parser.add_argument("--pymod", required=True,
                        help="folder with rdmarpc/tensor_pb2.py and "
                             "hello_tensor_pb2.py")
    args = parser.parse_args()

    try:
        import grpc
    except ImportError as e:
        print("SETUP ERROR: cannot import grpc (%s) with %s; install "
              "python3-grpcio" % (e, sys.executable), file=sys.stderr)
        return 2
    sys.path.insert(0, args.pymod)
    try:
        from rdmarpc import tensor_pb2
        import hello_tensor_pb2 as hello_pb2
    except ImportError as e:
        print("SETUP ERROR: cannot import the generated modules from %s (%s); "
              "build the interop_python_protos target" % (args.pymod, e),
              file=sys.stderr)
        return 2
    if not os.access(args.server, os.X_OK):
        print("SETUP ERROR: server %s is not an executable file" % args.server,
              file=sys.stderr)
        return 2
    print("python %s, grpcio %s, server %s"
          % (sys.version.split()[0], grpc.__version__, args.server))

    return run_against_server(grpc, args.server, lambda port: run_checks(
        grpc, tensor_pb2, hello_pb2, port))


def run_against_server(grpc, server_path, checks):
    """Starts the server, runs checks(port), stops it; the exit code."""
    with tempfile.TemporaryDirectory(prefix="rdmarpc-interop-") as tmpdir:
        proc, port_file, log_path = start_server(server_path, tmpdir)
        failed = None
        try:
            port = wait_for_port(proc, port_file, log_path)
            print("server started (pid %d) on port %d" % (proc.pid, port))
            checks(port)
        except CheckFailed as e:
            failed = "CHECK FAILED: %s" % e
        except grpc.RpcError as e:
            failed = "RPC FAILED: %s: %s" % (e.code(), e.details())
        except Exception as e:  # setup errors, timeouts
            failed = "ERROR: %s: %s" % (type(e).__name__, e)
        finally:
            rc = stop_server(proc)
            if rc is None:
                print("server ignored SIGTERM for 10 s; killed it")
            else:
                print("server stopped, exit status %d" % rc)
        if failed is not None:
            print(failed)
            print("server output:\n" + read_log(log_path))
            return 1
        if rc != 0:
            print("FAILED: server exited with status %s after SIGTERM; its "
                  "output:\n%s" % (rc, read_log(log_path)))
            return 1
    print("PASS: all checks passed")
    return 0

if __name__ == "__main__":
    sys.exit(main())
