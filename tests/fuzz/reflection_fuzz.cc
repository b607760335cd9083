// Fuzz target for the server reflection service's decoder
// (transport/grpc/reflection.h): the input is a ServerReflectionInfo
// request from a peer. Answer must return a Status, never crash, and an
// answer it gives must parse as protobuf.
#include <cstdint>
#include <cstdlib>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_seeds.h"
#include "google/protobuf/unknown_field_set.h"
#include "transport/grpc/reflection.h"

namespace {

const rdmarpc::grpc_transport::ReflectionAnswerer& Answerer() {
  static const auto* answerer = new rdmarpc::grpc_transport::ReflectionAnswerer(
      {"demo.Inference", "grpc.health.v1.Health"});
  return *answerer;
}

std::string Field(int number, const std::string& value) {
  google::protobuf::UnknownFieldSet fields;
  fields.AddLengthDelimited(number, value);
  std::string out;
  fields.SerializeToString(&out);
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::set<std::string> sent;
  auto answer = Answerer().Answer(
      std::string_view(reinterpret_cast<const char*>(data), size), &sent);
  if (answer.ok()) {
    google::protobuf::UnknownFieldSet fields;
    if (!fields.ParseFromString(*answer)) std::abort();
  }
  return 0;
}

std::vector<std::string> FuzzSeeds() {
  google::protobuf::UnknownFieldSet ext;
  ext.AddLengthDelimited(1, "google.protobuf.FieldOptions");
  ext.AddVarint(2, 50000);
  std::string ext_bytes;
  ext.SerializeToString(&ext_bytes);
  return {Field(7, ""),
          Field(1, "host") + Field(4, "google.protobuf.FileDescriptorProto"),
          Field(3, "google/protobuf/descriptor.proto"),
          Field(5, ext_bytes),
          Field(6, "google.protobuf.FieldOptions"),
          Field(4, "no.Such")};
}
