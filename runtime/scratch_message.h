// A protobuf message that one thread reuses call after call: a cleared
// message keeps its strings and repeated elements, so building or parsing
// the next one allocates nothing. The gRPC transport's lean stream builds
// and parses its per-call heads in one.
//
//   internal::ScratchMessage<LeanHead> head;  // cleared
//   head->set_method(method);
//   head->SerializeWithCachedSizesToArray(out);
//
// A nested use on the same thread (an inline callback that starts a call)
// gets a message of its own. The thread's message keeps the capacity of the
// largest one it held: a user whose messages are not bounded small trims
// what it filled before this goes (see the gRPC transport's lean head).
#ifndef RDMARPC_RUNTIME_SCRATCH_MESSAGE_H_
#define RDMARPC_RUNTIME_SCRATCH_MESSAGE_H_

#include <memory>

namespace rdmarpc::internal {

template <typename M>
class ScratchMessage {
 public:
  ScratchMessage() {
    Slot& slot = ThreadSlot();
    if (slot.in_use) {
      fallback_ = std::make_unique<M>();
      message_ = fallback_.get();
      return;
    }
    slot.in_use = true;
    slot.message.Clear();
    message_ = &slot.message;
    slot_ = &slot;
  }
  ~ScratchMessage() {
    if (slot_ != nullptr) slot_->in_use = false;
  }
  ScratchMessage(const ScratchMessage&) = delete;
  ScratchMessage& operator=(const ScratchMessage&) = delete;

  M& operator*() const { return *message_; }
  M* operator->() const { return message_; }

 private:
  struct Slot {
    M message;
    bool in_use = false;
  };
  static Slot& ThreadSlot() {
    thread_local Slot slot;
    return slot;
  }

  M* message_;
  Slot* slot_ = nullptr;  // the thread's, when taken (a TLS look-up saved)
  std::unique_ptr<M> fallback_;
};

}  // namespace rdmarpc::internal

#endif  // RDMARPC_RUNTIME_SCRATCH_MESSAGE_H_
