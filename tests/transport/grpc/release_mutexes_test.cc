// A channel turns off Abseil's debug deadlock detector, which Debian's
// Abseil runs on every absl::Mutex (transport/grpc/release_mutexes.h), and
// RDMARPC_ABSL_DEADLOCK_DETECTION=1 keeps it on.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <memory>

#include "absl/synchronization/mutex.h"
#include "rdmarpc/rdmarpc.h"

namespace {

// Takes two mutexes in both orders on one thread: no deadlock, but the
// detector, where it runs, sees a lock-order cycle and aborts.
void LockInBothOrders() {
  absl::Mutex a;
  absl::Mutex b;
  {
    absl::MutexLock first(&a);
    absl::MutexLock second(&b);
  }
  absl::MutexLock first(&b);
  absl::MutexLock second(&a);
}

// Whether this process's Abseil runs the detector by default (a debug
// build of Abseil, as Debian's): LockInBothOrders then aborts.
bool DetectorRunsByDefault() {
  const pid_t child = fork();
  if (child == 0) {
    dup2(open("/dev/null", O_WRONLY), STDERR_FILENO);  // the abort's report
    LockInBothOrders();
    _exit(0);
  }
  int status = 0;
  waitpid(child, &status, 0);
  return WIFSIGNALED(status);
}

std::shared_ptr<rdmarpc::Channel> GrpcChannel() {
  rdmarpc::ChannelOptions options;
  options.policy = rdmarpc::TransportPolicy::kGrpc;
  return rdmarpc::CreateChannel("127.0.0.1:1", options);
}

// Each death test runs in a fresh process, before any channel made the
// choice for it.
class ReleaseMutexesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    GTEST_FLAG_SET(death_test_style, "threadsafe");
    if (!DetectorRunsByDefault()) {
      GTEST_SKIP() << "this Abseil is a release build: no detector to turn off";
    }
  }
};

TEST_F(ReleaseMutexesTest, AChannelTurnsTheDetectorOff) {
  EXPECT_EXIT(
      {
        auto channel = GrpcChannel();
        LockInBothOrders();
        _exit(0);
      },
      ::testing::ExitedWithCode(0), "");
}

TEST_F(ReleaseMutexesTest, TheEnvironmentKeepsTheDetectorWhereItRuns) {
  EXPECT_DEATH(
      {
        setenv("RDMARPC_ABSL_DEADLOCK_DETECTION", "1", 1);
        auto channel = GrpcChannel();
        LockInBothOrders();
      },
      "[Dd]eadlock");
}

}  // namespace
