#include "runtime/address.h"

#include <cctype>
#include <cstring>
#include <optional>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace rdmarpc::internal {
namespace {

constexpr const char* kSchemes[] = {
    "unix:", "unix-abstract:", "vsock:", "dns:", "ipv4:", "ipv6:"};

// What is wrong with `address` as host:port, or nullopt when nothing is.
std::optional<std::string> HostPortProblem(const std::string& address,
                                           bool listen) {
  const std::string example =
      listen ? "0.0.0.0:50051 (port 0 picks a free port)" : "host:50051";
  if (address.empty()) return absl::StrCat("it is empty; write ", example);
  for (char c : address) {
    if (absl::ascii_isspace(static_cast<unsigned char>(c))) {
      return std::string("it contains white space");
    }
  }
  std::string host;
  std::string port;
  if (address.front() == '[') {
    size_t close = address.find(']');
    if (close == std::string::npos) {
      return std::string("an IPv6 address opened with '[' has no ']'");
    }
    host = address.substr(1, close - 1);
    std::string rest = address.substr(close + 1);
    if (rest.empty() || rest.front() != ':') {
      return absl::StrCat("no port after ']'; write [", host, "]:50051");
    }
    port = rest.substr(1);
  } else {
    size_t colon = address.rfind(':');
    if (colon == std::string::npos) {
      return absl::StrCat("no port; write ", address, ":50051");
    }
    host = address.substr(0, colon);
    port = address.substr(colon + 1);
    if (host.find(':') != std::string::npos) {
      return absl::StrCat("an IPv6 address needs brackets: [", host,
                          "]:", port);
    }
  }
  if (host.empty()) {
    return listen ? std::string(
                        "no host; write 0.0.0.0:PORT or [::]:PORT to listen "
                        "on every interface")
                  : std::string("no host before the port");
  }
  if (port.empty()) return std::string("the port is empty");
  uint64_t value = 0;
  for (char c : port) {
    if (!std::isdigit(static_cast<unsigned char>(c))) {
      return absl::StrCat("port '", port, "' is not a number");
    }
    value = value * 10 + static_cast<uint64_t>(c - '0');
    if (value > 65535) break;
  }
  const uint64_t lowest = listen ? 0 : 1;
  if (value < lowest || value > 65535) {
    return absl::StrCat("port ", port, " is out of range (", lowest, "-65535)");
  }
  return std::nullopt;
}

Status Check(const std::string& address, bool listen) {
  const char* what = listen ? "listening address" : "target";
  for (const char* scheme : kSchemes) {
    if (!absl::StartsWith(address, scheme)) continue;
    if (address.size() == std::strlen(scheme)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "invalid ", what, " '", address, "': nothing after the scheme"));
    }
    return absl::OkStatus();
  }
  if (auto problem = HostPortProblem(address, listen)) {
    return absl::InvalidArgumentError(
        absl::StrCat("invalid ", what, " '", address, "': ", *problem));
  }
  return absl::OkStatus();
}

}  // namespace

Status CheckListenAddress(const std::string& address) {
  return Check(address, /*listen=*/true);
}

Status CheckTarget(const std::string& target) {
  return Check(target, /*listen=*/false);
}

}  // namespace rdmarpc::internal
