// Certificates for the TLS tests, made with the openssl command when the
// test runs: a CA, a server certificate for "rdmarpc.test" (and
// 127.0.0.1) and a client certificate signed by it, and a second CA with a
// client certificate of its own that the first CA's server must refuse.
#ifndef RDMARPC_TESTS_E2E_TEST_PKI_H_
#define RDMARPC_TESTS_E2E_TEST_PKI_H_

#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

namespace rdmarpc_test {

struct TestPki {
  std::string ca_cert;
  std::string server_cert, server_key;
  std::string client_cert, client_key;
  // Signed by a CA the server does not trust.
  std::string stranger_ca_cert, stranger_cert, stranger_key;
  std::string error;  // set when openssl failed
};

inline std::string ReadPem(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// Made once per process (a few openssl runs), in a fresh temporary folder.
inline const TestPki& GetTestPki() {
  static const TestPki pki = [] {
    TestPki p;
    char dir_template[] = "/tmp/rdmarpc-pki-XXXXXX";
    const char* dir = mkdtemp(dir_template);
    if (dir == nullptr) {
      p.error = "mkdtemp failed";
      return p;
    }
    const std::string d = dir;
    std::ofstream(d + "/server.ext")
        << "subjectAltName=DNS:rdmarpc.test,IP:127.0.0.1\n";
    const std::string key =
        " -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
    const std::string script =
        "cd " + d + " && " + "openssl req -x509" + key +
        " -keyout ca.key -out ca.crt -days 2 -subj /CN=rdmarpc-test-ca && " +
        "openssl req" + key +
        " -keyout server.key -out server.csr -subj /CN=rdmarpc.test && " +
        "openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key "
        "-CAcreateserial -out server.crt -days 2 -extfile server.ext && " +
        "openssl req" + key +
        " -keyout client.key -out client.csr -subj /CN=rdmarpc-client && " +
        "openssl x509 -req -in client.csr -CA ca.crt -CAkey ca.key "
        "-CAcreateserial -out client.crt -days 2 && " +
        "openssl req -x509" + key +
        " -keyout stranger-ca.key -out stranger-ca.crt -days 2 "
        "-subj /CN=stranger-ca && " +
        "openssl req" + key +
        " -keyout stranger.key -out stranger.csr -subj /CN=stranger && " +
        "openssl x509 -req -in stranger.csr -CA stranger-ca.crt "
        "-CAkey stranger-ca.key -CAcreateserial -out stranger.crt -days 2";
    if (std::system(
            ("(" + script + ") > " + d + "/openssl.log 2>&1").c_str()) != 0) {
      p.error = "openssl failed: " + ReadPem(d + "/openssl.log");
      return p;
    }
    p.ca_cert = ReadPem(d + "/ca.crt");
    p.server_cert = ReadPem(d + "/server.crt");
    p.server_key = ReadPem(d + "/server.key");
    p.client_cert = ReadPem(d + "/client.crt");
    p.client_key = ReadPem(d + "/client.key");
    p.stranger_ca_cert = ReadPem(d + "/stranger-ca.crt");
    p.stranger_cert = ReadPem(d + "/stranger.crt");
    p.stranger_key = ReadPem(d + "/stranger.key");
    (void)std::system(("rm -rf " + d).c_str());
    return p;
  }();
  return pki;
}

}  // namespace rdmarpc_test

#endif  // RDMARPC_TESTS_E2E_TEST_PKI_H_
