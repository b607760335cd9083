// protoc-gen-rdmarpc: run by protoc as `--rdmarpc_out=DIR`.
#include "codegen/generator.h"
#include "google/protobuf/compiler/plugin.h"

int main(int argc, char* argv[]) {
  rdmarpc::codegen::Generator generator;
  return google::protobuf::compiler::PluginMain(argc, argv, &generator);
}
