#include "transport/rdma/handshake.h"

#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"
#include "transport/rdma/connection_setup.h"
#include "transport/rdma/wire.h"

namespace rdmarpc::rdma {

StatusOr<HelloAnswer> ParseHelloAnswer(std::string_view bytes, bool* no_rdma) {
  *no_rdma = false;
  HelloResponse server;
  if (!server.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) {
    return absl::UnavailableError("RDMA handshake answer does not parse");
  }
  if (!server.unavailable_reason().empty()) {
    *no_rdma = true;
    return absl::UnavailableError(
        absl::StrCat("the server has no RDMA: ", server.unavailable_reason()));
  }
  if (server.version() != kWireVersion) {
    *no_rdma = true;
    return absl::UnavailableError(
        absl::StrCat("the server speaks RDMA wire version ", server.version(),
                     ", this client ", kWireVersion));
  }
  if (server.cm_port() == 0 || server.cm_port() > 65535 ||
      server.token().size() != kTokenBytes) {
    return absl::UnavailableError("RDMA handshake answer is malformed");
  }
  if (Status offered =
          CheckReceives(server.receives(), server.receive_bytes(),
                        "the server's RDMA receives", server.first_receives());
      !offered.ok() || server.first_receives() == 0) {
    return absl::UnavailableError(
        offered.ok() ? "the server's RDMA handshake names no first receives"
                     : offered.message());
  }
  if (server.inline_threshold() > server.receive_bytes()) {
    return absl::UnavailableError(absl::StrCat(
        "the server's inline threshold (", server.inline_threshold(),
        " bytes) exceeds its receive buffers (", server.receive_bytes(),
        " bytes)"));
  }
  HelloAnswer answer;
  answer.cm_address = server.cm_address();
  answer.cm_port = static_cast<uint16_t>(server.cm_port());
  answer.token = server.token();
  answer.receives = server.receives();
  answer.first_receives = server.first_receives();
  answer.receive_bytes = server.receive_bytes();
  answer.inline_threshold = server.inline_threshold();
  answer.server_instance = server.server_instance();
  return answer;
}

StatusOr<HelloRequest> ParseHelloRequest(std::string_view bytes) {
  HelloRequest hello;
  if (!hello.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) {
    return absl::InvalidArgumentError("RDMA hello does not parse");
  }
  return hello;
}

namespace {

// At most this many tokens wait for their connect at once.
constexpr size_t kMaxWaitingTokens = 4096;

}  // namespace

StatusOr<std::string> TokenTable::Issue(uint64_t client_id) {
  static thread_local std::random_device random;
  std::string token(kTokenBytes, '\0');
  for (size_t i = 0; i < kTokenBytes; i += 4) {
    uint32_t v = random();
    std::memcpy(token.data() + i, &v, 4);
  }
  const auto now = std::chrono::steady_clock::now();
  std::lock_guard<std::mutex> lock(mu_);
  std::erase_if(tokens_,
                [now](const auto& t) { return t.second.expires < now; });
  if (tokens_.size() >= kMaxWaitingTokens) {
    return absl::ResourceExhaustedError(
        "too many RDMA handshakes waiting for their connect");
  }
  tokens_[token] = Entry{now + lifetime_, client_id};
  return token;
}

std::optional<uint64_t> TokenTable::Redeem(const std::string& token) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = tokens_.find(token);
  if (it == tokens_.end()) return std::nullopt;
  Entry entry = it->second;
  tokens_.erase(it);
  if (entry.expires < std::chrono::steady_clock::now()) return std::nullopt;
  return entry.client_id;
}

void TokenTable::Clear() {
  std::lock_guard<std::mutex> lock(mu_);
  tokens_.clear();
}

}  // namespace rdmarpc::rdma
