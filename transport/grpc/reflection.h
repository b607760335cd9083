// gRPC server reflection (grpc.reflection.v1 and v1alpha) for the services
// an rdmarpc server runs, so that grpcurl, grpc_cli or a python client can
// list them and fetch their descriptors.
//
// gRPC's own reflection library lists only services registered as
// grpc::Service, and rdmarpc serves its methods through one generic service,
// so it would list none of them. This one lists the services it is given and
// answers descriptor requests from the process's generated descriptor pool.
// It handles the protocol's bytes without generated classes of
// reflection.proto, so it cannot clash with libgrpc++_reflection when a
// program links both.
//
//   ReflectionAnswerer answerer({"demo.Inference", "grpc.health.v1.Health"});
//   std::set<std::string> sent;  // per stream: files already sent on it
//   StatusOr<std::string> response = answerer.Answer(request_bytes, &sent);
#ifndef RDMARPC_TRANSPORT_GRPC_REFLECTION_H_
#define RDMARPC_TRANSPORT_GRPC_REFLECTION_H_

#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "google/protobuf/descriptor.h"
#include "rdmarpc/status.h"

namespace rdmarpc::grpc_transport {

class ReflectionAnswerer {
 public:
  // `services`: the full names ListServices returns. Descriptors come from
  // `pool` (default: every .proto linked into the process).
  explicit ReflectionAnswerer(
      std::vector<std::string> services,
      const google::protobuf::DescriptorPool* pool =
          google::protobuf::DescriptorPool::generated_pool());

  // Answers one serialized ServerReflectionRequest with a serialized
  // ServerReflectionResponse. A symbol or file that is not found is an
  // error_response in the answer, as in gRPC; bytes that are not a request
  // are INVALID_ARGUMENT (the stream ends with it). `files_sent` holds the
  // files this stream already sent: a file and its imports go out once per
  // stream, as clients expect.
  StatusOr<std::string> Answer(std::string_view request,
                               std::set<std::string>* files_sent) const;

 private:
  std::vector<std::string> services_;
  const google::protobuf::DescriptorPool* pool_;
};

}  // namespace rdmarpc::grpc_transport

#endif  // RDMARPC_TRANSPORT_GRPC_REFLECTION_H_
