// Turns off Abseil's debug-build deadlock detector, which Debian 12's Abseil
// (built without NDEBUG) runs on every absl::Mutex that gRPC takes.
//
// The detector keeps a lock-order graph and updates it on each acquisition:
// callgrind counts about 20k instructions of it in each 64 B gRPC call
// (both ends; docs/design.md, "gRPC transport"). A release build of Abseil
// leaves it off, and so does rdmarpc, from the first gRPC transport a
// process starts; RDMARPC_ABSL_DEADLOCK_DETECTION=1 keeps it on.
//
//   UseReleaseModeMutexes();  // in each transport's constructor: once per
//                             // process, the later calls do nothing
#ifndef RDMARPC_TRANSPORT_GRPC_RELEASE_MUTEXES_H_
#define RDMARPC_TRANSPORT_GRPC_RELEASE_MUTEXES_H_

namespace rdmarpc::grpc_transport {

void UseReleaseModeMutexes();

}  // namespace rdmarpc::grpc_transport

#endif  // RDMARPC_TRANSPORT_GRPC_RELEASE_MUTEXES_H_
