#!/usr/bin/env python3
"""Interop: the health service and server reflection, from stock python3-grpcio.

The client's stubs are generated at build time from Debian's grpc-proto
definitions (grpc/health/v1/health.proto, grpc/reflection/v1{,alpha}/
reflection.proto); it has no rdmarpc code. It checks the hello_tensor
server's health answers, lists its services by reflection, fetches the
descriptors of hello.TensorService and then calls Scale through message
classes built from those descriptors alone, as grpcurl does.

  health_reflection_test.py --server PATH/hello_tensor_server --pymod DIR

DIR holds the generated grpc_proto/health/v1/health_pb2{,_grpc}.py and
grpc_proto/reflection/v1{,alpha}/reflection_pb2{,_grpc}.py (the .proto
files are copied under grpc_proto/ first, so that the generated modules do
not shadow the grpc package itself). Exits 0 when every
check passes, 1 otherwise (2 for a setup problem).
"""

import argparse
import array
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from python_client_test import (CheckFailed, check,  # noqa: E402
                                run_against_server)

CALL_TIMEOUT_S = 30.0
SERVICE = "hello.TensorService"
NOT_FOUND = 5  # google.rpc.Code


def check_health(grpc, health_pb2, health_grpc, channel):
    stub = health_grpc.HealthStub(channel)
    serving = health_pb2.HealthCheckResponse.SERVING
    for name in ("", SERVICE):
        resp = stub.Check(health_pb2.HealthCheckRequest(service=name),
                          timeout=CALL_TIMEOUT_S)
        check(resp.status == serving, "health Check(%r): %s, want SERVING"
              % (name, health_pb2.HealthCheckResponse.ServingStatus.Name(
                  resp.status)))
    print("ok: health Check('') and Check(%r) -> SERVING" % SERVICE)

    try:
        stub.Check(health_pb2.HealthCheckRequest(service="no.SuchService"),
                   timeout=CALL_TIMEOUT_S)
        raise CheckFailed("health Check of an unknown service succeeded")
    except grpc.RpcError as e:
        check(e.code() == grpc.StatusCode.NOT_FOUND,
              "health Check of an unknown service: %s, want NOT_FOUND"
              % e.code())
    print("ok: health Check('no.SuchService') -> NOT_FOUND")

    watch = stub.Watch(health_pb2.HealthCheckRequest(service=SERVICE),
                       timeout=CALL_TIMEOUT_S)
    first = next(watch)
    watch.cancel()
    check(first.status == serving,
          "health Watch(%r): first status %s, want SERVING" % (SERVICE,
                                                               first.status))
    print("ok: health Watch(%r) -> SERVING" % SERVICE)


def ask(reflection_grpc, reflection_pb2, channel, requests):
    stub = reflection_grpc.ServerReflectionStub(channel)
    return list(stub.ServerReflectionInfo(iter(requests),
                                          timeout=CALL_TIMEOUT_S))


def check_reflection(grpc, version, reflection_pb2, reflection_grpc, channel):
    Req = reflection_pb2.ServerReflectionRequest
    answers = ask(reflection_grpc, reflection_pb2, channel, [
        Req(host="test", list_services=""),
        Req(file_containing_symbol=SERVICE),
        Req(file_containing_symbol="no.Such.Symbol"),
    ])
    check(len(answers) == 3, "%s: %d answers to 3 requests" % (version,
                                                                len(answers)))
    listed, files, missing = answers

    names = [s.name for s in listed.list_services_response.service]
    for want in (SERVICE, "grpc.health.v1.Health",
                 "grpc.reflection.%s.ServerReflection" % version):
        check(want in names, "%s: list_services %s lacks %s"
              % (version, names, want))
    check(listed.valid_host == "test",
          "%s: valid_host %r, want 'test'" % (version, listed.valid_host))
    print("ok: %s list_services -> %s" % (version, sorted(names)))

    check(missing.WhichOneof("message_response") == "error_response" and
          missing.error_response.error_code == NOT_FOUND,
          "%s: unknown symbol answered %s, want error_response NOT_FOUND"
          % (version, missing))
    print("ok: %s file_containing_symbol('no.Such.Symbol') -> NOT_FOUND: %s"
          % (version, missing.error_response.error_message))
    return files.file_descriptor_response.file_descriptor_proto


def call_by_reflection(grpc, channel, raw_files):
    from google.protobuf import descriptor_pb2, descriptor_pool
    from google.protobuf import message_factory

    # The answer lists imports before the files that import them.
    pool = descriptor_pool.DescriptorPool()
    names = []
    for raw in raw_files:
        proto = descriptor_pb2.FileDescriptorProto.FromString(raw)
        pool.Add(proto)
        names.append(proto.name)
    service = pool.FindServiceByName(SERVICE)
    method = service.methods_by_name["Scale"]
    factory = message_factory.MessageFactory(pool)
    Request = factory.GetPrototype(method.input_type)
    Response = factory.GetPrototype(method.output_type)
    f32 = pool.FindEnumTypeByName("rdmarpc.DType").values_by_name["DTYPE_F32"]

    values = array.array("f", [1.5, -4.0])
    if sys.byteorder != "little":
        values.byteswap()
    req = Request(name="reflection", factor=3.0)
    req.input.dtype = f32.number
    req.input.shape.append(len(values))
    req.input.data = values.tobytes()
    req.input.byte_size = len(req.input.data)
    scale = channel.unary_unary(
        "/%s/%s" % (SERVICE, method.name),
        request_serializer=Request.SerializeToString,
        response_deserializer=Response.FromString)
    resp = scale(req, timeout=CALL_TIMEOUT_S)
    got = array.array("f")
    got.frombytes(resp.output.data)
    if sys.byteorder != "little":
        got.byteswap()
    check(list(got) == [4.5, -12.0],
          "Scale through reflected descriptors: %s, want [4.5, -12.0]"
          % list(got))
    print("ok: descriptors %s from reflection; Scale([1.5, -4.0], 3) built "
          "from them -> %s" % (names, list(got)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", required=True)
    parser.add_argument("--pymod", required=True,
                        help="folder with the generated health and "
                             "reflection modules")
    args = parser.parse_args()

    sys.path.insert(0, args.pymod)
    try:
        import grpc
        from grpc_proto.health.v1 import health_pb2
        from grpc_proto.health.v1 import health_pb2_grpc as health_grpc
    except ImportError as e:
        print("SETUP ERROR: cannot import grpc or the generated health "
              "modules from %s (%s)" % (args.pymod, e), file=sys.stderr)
        return 2
    reflection = {}
    for version in ("v1alpha", "v1"):
        try:
            pb2 = __import__("grpc_proto.reflection.%s.reflection_pb2" % version,
                             fromlist=["x"])
            pb2_grpc = __import__(
                "grpc_proto.reflection.%s.reflection_pb2_grpc" % version,
                fromlist=["x"])
        except ImportError as e:
            print("SETUP ERROR: cannot import the generated reflection %s "
                  "modules from %s (%s)" % (version, args.pymod, e),
                  file=sys.stderr)
            return 2
        reflection[version] = (pb2, pb2_grpc)

    def checks(port):
        target = "127.0.0.1:%d" % port
        with grpc.insecure_channel(target) as channel:
            check_health(grpc, health_pb2, health_grpc, channel)
            files = None
            for version, (pb2, pb2_grpc) in reflection.items():
                files = check_reflection(grpc, version, pb2, pb2_grpc,
                                         channel)
            call_by_reflection(grpc, channel, files)

    return run_against_server(grpc, args.server, checks)

if __name__ == "__main__":
    sys.exit(main())
