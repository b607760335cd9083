// Tells ThreadSanitizer that a completion-queue tag carries what the thread
// that started its operation wrote to the thread that gets it back: gRPC,
// not built with TSan, hands tags over where TSan cannot see it.
#ifndef RDMARPC_TRANSPORT_GRPC_TSAN_TAGS_H_
#define RDMARPC_TRANSPORT_GRPC_TSAN_TAGS_H_

#if defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define RDMARPC_TSAN 1
#endif
#endif
#if defined(__SANITIZE_THREAD__)
#define RDMARPC_TSAN 1
#endif

#ifdef RDMARPC_TSAN
extern "C" void __tsan_acquire(void* addr);
extern "C" void __tsan_release(void* addr);
#endif

namespace rdmarpc::grpc_transport {

// Before an operation with this tag starts.
inline void TsanRelease(void* addr) {
#ifdef RDMARPC_TSAN
  __tsan_release(addr);
#else
  (void)addr;
#endif
}

// Once its tag came back.
inline void TsanAcquire(void* addr) {
#ifdef RDMARPC_TSAN
  __tsan_acquire(addr);
#else
  (void)addr;
#endif
}

}  // namespace rdmarpc::grpc_transport

#endif  // RDMARPC_TRANSPORT_GRPC_TSAN_TAGS_H_
