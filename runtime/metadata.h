// What a metadata entry may be, checked where it enters the runtime, so a
// call fails with the reason on the side that made the mistake instead of
// as a broken connection on the peer's.
//
//   RDMARPC_RETURN_IF_ERROR(internal::CheckMetadataEntry("x-trace", "abc"));
//
// The rules are gRPC's, so an entry means the same over either transport:
// a key is 1 or more of [0-9a-z-_.], not starting with "grpc-" (gRPC's)
// or "rdmarpc-" (ours); a value is printable ASCII unless its key ends in
// "-bin", when it may hold any bytes. A call (or a response, initial and
// trailing together) carries at most kMaxMetadataEntries entries of at
// most kMaxMetadataBytes, keys and values together: what the RDMA wire
// accepts (transport/rdma/wire.h).
#ifndef RDMARPC_RUNTIME_METADATA_H_
#define RDMARPC_RUNTIME_METADATA_H_

#include <cstddef>
#include <map>
#include <string>

#include "absl/strings/string_view.h"
#include "rdmarpc/status.h"

namespace rdmarpc::internal {

inline constexpr size_t kMaxMetadataEntries = 64;
inline constexpr size_t kMaxMetadataBytes = 16 << 10;
// gRPC counts 32 bytes per entry beyond its key and value, adds its own
// headers and the status message, and refuses more than 8 KiB by default
// (grpc.max_metadata_size): both ends of the gRPC transport raise that to
// this, which holds the largest metadata plus a 16 KiB message.
inline constexpr int kGrpcMetadataLimitBytes = 64 << 10;

using MetadataMap = std::multimap<std::string, std::string>;

// INVALID_ARGUMENT naming the key and what is wrong with it.
Status CheckMetadataEntry(absl::string_view key, absl::string_view value);

// Every entry of `metadata`, and their count and size. `whose` names them
// in the error ("request metadata").
Status CheckMetadata(const MetadataMap& metadata, absl::string_view whose);

// RESOURCE_EXHAUSTED naming the limit when `entries` entries of `bytes`
// are more than one call carries.
Status CheckMetadataSize(size_t entries, size_t bytes, absl::string_view whose);

// Keys and values of `metadata`, in bytes.
size_t MetadataBytes(const MetadataMap& metadata);

}  // namespace rdmarpc::internal

#endif  // RDMARPC_RUNTIME_METADATA_H_
