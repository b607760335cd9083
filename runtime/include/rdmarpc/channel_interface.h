// rdmarpc/channel_interface.h: what generated stubs call, so that client
// code can be tested without a server.
//
// rdmarpc::Channel implements it; a test can pass its own implementation
// to `Service::NewStub` (or mock the generated `Service::StubInterface`
// with gMock instead):
//
//   class FakeChannel : public rdmarpc::ChannelInterface {
//    public:
//     void CallAsync(std::string_view method, rdmarpc::ClientContext* ctx,
//                    const google::protobuf::Message& request,
//                    google::protobuf::Message* response,
//                    std::function<void(rdmarpc::Status)> done) override {
//       response->CopyFrom(canned_);      // or inspect `request`
//       done(absl::OkStatus());           // exactly once
//     }
//     ...Call and CallFuture likewise...
//   };
//   auto stub = demo::Model::NewStub(std::make_shared<FakeChannel>());
//
// Ownership: the context, request, response and the buffers bound in
// ctx->tensors() are borrowed until the call completes; `done` runs exactly
// once.
#ifndef RDMARPC_CHANNEL_INTERFACE_H_
#define RDMARPC_CHANNEL_INTERFACE_H_

#include <functional>
#include <future>
#include <string_view>

#include "google/protobuf/message.h"
#include "rdmarpc/client_context.h"
#include "rdmarpc/status.h"

namespace rdmarpc {

class ChannelInterface {
 public:
  virtual ~ChannelInterface() = default;

  // Calls `method` ("/package.Service/Method"); `done` runs exactly once,
  // after which the response (and ctx->tensors().Get() on its tensors) is
  // ready.
  virtual void CallAsync(std::string_view method, ClientContext* ctx,
                         const google::protobuf::Message& request,
                         google::protobuf::Message* response,
                         std::function<void(Status)> done) = 0;
  // Blocking form of CallAsync.
  virtual Status Call(std::string_view method, ClientContext* ctx,
                      const google::protobuf::Message& request,
                      google::protobuf::Message* response) = 0;
  // Future form of CallAsync: ready when the call completes.
  virtual std::future<Status> CallFuture(
      std::string_view method, ClientContext* ctx,
      const google::protobuf::Message& request,
      google::protobuf::Message* response) = 0;
};

}  // namespace rdmarpc

#endif  // RDMARPC_CHANNEL_INTERFACE_H_
