#include "runtime/metadata.h"

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace rdmarpc::internal {

Status CheckMetadataEntry(absl::string_view key, absl::string_view value) {
  if (key.empty()) return absl::InvalidArgumentError("empty metadata key");
  for (char c : key) {
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' ||
          c == '_' || c == '.')) {
      return absl::InvalidArgumentError(absl::StrCat(
          "metadata key '", absl::CHexEscape(key),
          "' has a character gRPC does not allow (keys are lower case "
          "letters, digits, '-', '_' and '.')"));
    }
  }
  if (absl::StartsWith(key, "grpc-") || absl::StartsWith(key, "rdmarpc-")) {
    return absl::InvalidArgumentError(absl::StrCat(
        "metadata key '", key,
        "' is reserved (keys starting with 'grpc-' or 'rdmarpc-' belong to "
        "the runtime)"));
  }
  if (absl::EndsWith(key, "-bin")) return absl::OkStatus();
  for (char c : value) {
    if (c < 0x20 || c > 0x7e) {
      return absl::InvalidArgumentError(absl::StrCat(
          "metadata '", key,
          "' has a value that is not printable ASCII; name the key with a "
          "'-bin' suffix to send bytes"));
    }
  }
  return absl::OkStatus();
}

size_t MetadataBytes(const MetadataMap& metadata) {
  size_t bytes = 0;
  for (const auto& [k, v] : metadata) bytes += k.size() + v.size();
  return bytes;
}

Status CheckMetadataSize(size_t entries, size_t bytes,
                         absl::string_view whose) {
  if (entries > kMaxMetadataEntries) {
    return absl::ResourceExhaustedError(
        absl::StrCat(whose, " has ", entries,
                     " entries; a call carries at most ", kMaxMetadataEntries));
  }
  if (bytes > kMaxMetadataBytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat(whose, " is ", bytes, " bytes; a call carries at most ",
                     kMaxMetadataBytes, " (keys and values together)"));
  }
  return absl::OkStatus();
}

Status CheckMetadata(const MetadataMap& metadata, absl::string_view whose) {
  for (const auto& [k, v] : metadata) {
    Status s = CheckMetadataEntry(k, v);
    if (!s.ok())
      return absl::InvalidArgumentError(absl::StrCat(whose, ": ", s.message()));
  }
  return CheckMetadataSize(metadata.size(), MetadataBytes(metadata), whose);
}

}  // namespace rdmarpc::internal
