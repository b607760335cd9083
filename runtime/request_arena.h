// A server's request message on an arena whose first block comes in one
// allocation with the arena and the message's shared owner. A small
// request, with its tensor fields, their shapes and strings, then takes no
// allocation of its own (four per call of the bench's 64 B echo), and all
// of it is freed at once when the last owner lets go (the handler, tensor
// bindings that view its bytes). A bigger request grows the arena from the
// heap. Handlers see a message like any other.
//
//   std::shared_ptr<Message> request =
//       internal::RequestArena::New(*method.descriptor.request_prototype);
//   request->ParseFromArray(bytes, size);
#ifndef RDMARPC_RUNTIME_REQUEST_ARENA_H_
#define RDMARPC_RUNTIME_REQUEST_ARENA_H_

#include <cstddef>
#include <memory>

#include "google/protobuf/arena.h"
#include "google/protobuf/message.h"

namespace rdmarpc::internal {

class RequestArena {
 public:
  // Default options but the first block: protobuf's cheaper set-up.
  RequestArena() : arena_(first_block_, kFirstBlockBytes) {}
  RequestArena(const RequestArena&) = delete;
  RequestArena& operator=(const RequestArena&) = delete;

  // An empty message of `prototype`'s type on a new arena it owns.
  static std::shared_ptr<google::protobuf::Message> New(
      const google::protobuf::Message& prototype) {
    auto holder = std::make_shared<RequestArena>();
    google::protobuf::Message* request = prototype.New(&holder->arena_);
    return std::shared_ptr<google::protobuf::Message>(std::move(holder),
                                                      request);
  }

 private:
  // With the arena and the shared owner, still within glibc's per-thread
  // cache (blocks up to about 1 KiB).
  static constexpr size_t kFirstBlockBytes = 512;
  alignas(16) char first_block_[kFirstBlockBytes];
  google::protobuf::Arena arena_;  // declared after its block: goes first
};

}  // namespace rdmarpc::internal

#endif  // RDMARPC_RUNTIME_REQUEST_ARENA_H_
