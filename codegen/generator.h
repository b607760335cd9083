// protoc-gen-rdmarpc: writes x.rdmarpc.pb.h and x.rdmarpc.pb.cc (a Service
// base class and a Stub per service) for each x.proto.
#ifndef RDMARPC_CODEGEN_GENERATOR_H_
#define RDMARPC_CODEGEN_GENERATOR_H_

#include <cstdint>
#include <string>

#include "google/protobuf/compiler/code_generator.h"
#include "google/protobuf/descriptor.h"

namespace rdmarpc::codegen {

class Generator final : public google::protobuf::compiler::CodeGenerator {
 public:
  // Fails, with a message naming the offending element, on streaming
  // methods, tensors inside map values, rdmarpc.Tensor used as a whole
  // request or response, and generated-name collisions.
  bool Generate(const google::protobuf::FileDescriptor* file,
                const std::string& parameter,
                google::protobuf::compiler::GeneratorContext* context,
                std::string* error) const override;

  // Proto3 `optional` fields are fine for us: we only name message types.
  uint64_t GetSupportedFeatures() const override {
    return FEATURE_PROTO3_OPTIONAL;
  }
};

}  // namespace rdmarpc::codegen

#endif  // RDMARPC_CODEGEN_GENERATOR_H_
