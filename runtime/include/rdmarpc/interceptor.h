// rdmarpc/interceptor.h: code that runs around every call, on the client
// (ChannelOptions::interceptors) and on the server
// (ServerBuilder::AddInterceptor), whatever transport carries the call.
//
// An interceptor can add metadata, refuse a call before it is sent or
// before its handler runs, observe or rewrite the outcome, and read the
// call's CallStats (which transport, why) once it completed. Typical uses:
// auth tokens, logging, metrics, tracing.
//
//   class Auth final : public rdmarpc::ClientInterceptor {
//     rdmarpc::Status BeforeCall(std::string_view, rdmarpc::ClientContext* ctx,
//                                const google::protobuf::Message&) override {
//       ctx->AddMetadata("authorization", "Bearer " + token_);
//       return absl::OkStatus();
//     }
//   };
//   rdmarpc::ChannelOptions options;
//   options.interceptors.push_back(std::make_shared<Auth>());
//
// Order: BeforeCall/BeforeHandler run in the order the interceptors were
// given, AfterCall/AfterHandler in reverse, each After exactly once for
// every interceptor whose Before returned OK (also when a later one
// refused). They run on the threads that run the call (the caller's, a
// transport's, a worker's), so they must be thread-safe, must not block
// and must not throw. The objects must outlive the channel or server.
#ifndef RDMARPC_INTERCEPTOR_H_
#define RDMARPC_INTERCEPTOR_H_

#include <string_view>

#include "rdmarpc/status.h"

namespace google::protobuf {
class Message;
}  // namespace google::protobuf

namespace rdmarpc {

class ClientContext;
class ServerContext;

class ClientInterceptor {
 public:
  virtual ~ClientInterceptor() = default;
  // Before the call is sent (`method` is "/package.Service/Method"). A
  // non-OK status fails the call with it; nothing is sent.
  virtual Status BeforeCall(std::string_view method, ClientContext* ctx,
                            const google::protobuf::Message& request) {
    return Status();
  }
  // Once the call completed, before its caller sees `*status` (which it may
  // rewrite); ctx->stats() is final.
  virtual void AfterCall(std::string_view method, ClientContext* ctx,
                         Status* status) {}
};

class ServerInterceptor {
 public:
  virtual ~ServerInterceptor() = default;
  // Before the handler runs; ctx->method() and ctx->client_metadata() say
  // what the call is. A non-OK status fails the call with it and the
  // handler does not run.
  virtual Status BeforeHandler(ServerContext* ctx,
                               const google::protobuf::Message& request) {
    return Status();
  }
  // After the handler (or a refusal), before the response is sent; may
  // rewrite `*status` (a non-OK status sends no response message).
  virtual void AfterHandler(ServerContext* ctx, Status* status) {}
};

}  // namespace rdmarpc

#endif  // RDMARPC_INTERCEPTOR_H_
