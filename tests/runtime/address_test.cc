// Listening addresses and targets (runtime/address.h).
#include "runtime/address.h"

#include <gtest/gtest.h>

#include <string>

namespace rdmarpc::internal {
namespace {

TEST(AddressTest, WellFormedAddressesPass) {
  for (const char* ok :
       {"0.0.0.0:0", "127.0.0.1:50051", "[::]:0", "[::1]:65535", "localhost:1",
        "unix:/tmp/sock", "dns:///example.com:443"}) {
    EXPECT_TRUE(CheckListenAddress(ok).ok()) << ok;
  }
  for (const char* ok : {"127.0.0.1:50051", "[::1]:1", "host.example:65535",
                         "unix:/tmp/sock", "ipv4:10.0.0.1:80"}) {
    EXPECT_TRUE(CheckTarget(ok).ok()) << ok;
  }
}

TEST(AddressTest, MalformedOnesSayWhatIsWrong) {
  struct Case {
    const char* address;
    bool listen;
    const char* reason;
  };
  const Case cases[] = {
      {"", true, "empty"},
      {"nohost", true, "no port"},
      {":notaport", true, "no host"},
      {"host:notaport", true, "'notaport' is not a number"},
      {"127.0.0.1:99999", true, "port 99999 is out of range (0-65535)"},
      {"127.0.0.1:99999", false, "port 99999 is out of range (1-65535)"},
      {"127.0.0.1:0", false, "out of range"},
      {"127.0.0.1:", false, "the port is empty"},
      {"::1:50051", false, "brackets"},
      {"[::1", false, "no ']'"},
      {"[::1]50051", false, "no port after ']'"},
      {"host name:1", false, "white space"},
      {"unix:", false, "nothing after the scheme"},
  };
  for (const Case& c : cases) {
    Status s =
        c.listen ? CheckListenAddress(c.address) : CheckTarget(c.address);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << c.address;
    EXPECT_NE(s.message().find(c.reason), std::string::npos)
        << c.address << ": " << s;
    EXPECT_NE(s.message().find(c.listen ? "listening address" : "target"),
              std::string::npos)
        << s;
  }
}

}  // namespace
}  // namespace rdmarpc::internal
