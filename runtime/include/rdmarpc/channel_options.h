// rdmarpc/channel_options.h: how a channel picks and tunes its transports,
// and what it reports about them. Shared by the Channel (rdmarpc/channel.h)
// and the transports it builds.
//
//   rdmarpc::ChannelOptions options;
//   options.policy = rdmarpc::TransportPolicy::kRdma;  // never fall back
//   options.rdma_peer_timeout = std::chrono::seconds(1);
//   auto channel = rdmarpc::CreateChannel("10.0.0.7:50051", options);
//   std::cout << channel->transport_stats().ToString();
#ifndef RDMARPC_CHANNEL_OPTIONS_H_
#define RDMARPC_CHANNEL_OPTIONS_H_

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "rdmarpc/interceptor.h"
#include "rdmarpc/memory.h"
#include "rdmarpc/status.h"

namespace rdmarpc {

enum class TransportPolicy {
  kAuto,  // RDMA when both sides can, else gRPC (the default)
  kRdma,  // RDMA only: calls fail with UNAVAILABLE when it cannot be used
  kGrpc,  // gRPC only
};
const char* PolicyName(TransportPolicy policy);  // "auto", "rdma", "grpc"
// Parses "auto", "rdma" or "grpc".
StatusOr<TransportPolicy> ParsePolicy(std::string_view name);

// TLS on the channel's gRPC connection (ChannelOptions::tls), which also
// carries the RDMA handshake: with it, only a client the server's TLS
// accepts gets the one-time token that admits an RDMA connection. PEM text,
// not file names.
struct TlsChannelCredentials {
  // CAs that sign the server's certificate; empty: the system's roots.
  std::string root_certs_pem;
  // For a server that asks for client certificates (mutual TLS): this
  // client's certificate chain and its private key; both or neither.
  std::string cert_chain_pem;
  std::string private_key_pem;
  // The name to check the server's certificate against, when the target's
  // host is not that name (an IP address, a test certificate).
  std::string server_name_override;
};

struct ChannelOptions {
  TransportPolicy policy = TransportPolicy::kAuto;
  // TLS to the server (its ServerBuilder::UseTls); unset: plaintext.
  std::optional<TlsChannelCredentials> tls;
  // Run around every call of the channel (rdmarpc/interceptor.h), in this
  // order.
  std::vector<std::shared_ptr<ClientInterceptor>> interceptors;
  // Out-of-band tensor bytes on the gRPC transport go in chunks of this size.
  size_t grpc_chunk_bytes = size_t{1} << 20;
  // A response whose tensors add up to more than this fails with
  // RESOURCE_EXHAUSTED instead of allocating landing memory for them.
  uint64_t max_response_tensor_bytes = uint64_t{64} << 30;
  // Handshake plus RDMA connect, before 'auto' settles for gRPC (and calls
  // made meanwhile wait for the outcome).
  std::chrono::milliseconds rdma_connect_timeout{5000};
  // Request tensors up to this size go inside the RDMA SEND (when they fit
  // the server's receive buffers) instead of by RDMA WRITE. 0: the
  // threshold the server advertises.
  uint64_t rdma_inline_threshold = 0;
  // A call over RDMA that makes no progress this long (beyond the time its
  // tensor bytes may take at 64 MiB/s) while its handler is not running on
  // the server is taken for stuck: the server's RDMA side went silent, or
  // the path loses packets. The connection is dropped and its calls re-sent
  // over gRPC (each runs once). Slow handlers never trip it. 0: never.
  // Keep it well under the server's call log window (30 s): a call re-sent
  // later than that after it was first sent is refused with UNAVAILABLE
  // (the server can no longer tell whether it ran).
  std::chrono::milliseconds rdma_peer_timeout{3000};
  // Degraded: the first probe waits this long, then each wait doubles up
  // to the maximum; every wait is jittered by +-25%. A connection lost
  // within 10 s of coming up (a lossy path, a flapping port) does not start
  // the next round over from the initial wait: it keeps doubling, so a
  // channel does not keep returning to a bad path.
  std::chrono::milliseconds rdma_probe_initial_backoff{100};
  std::chrono::milliseconds rdma_probe_max_backoff{5000};
  // true (the default): CallAsync's callbacks run on the thread that
  // completes the call, without a hand-off to the runtime's callback
  // thread (a futex wake-up and a thread switch per call): over RDMA the
  // RDMA completion thread, over gRPC the channel's gRPC completion thread
  // (`rdmarpc-grpc-cq`). Such a callback must not block: it holds up every
  // call that thread completes (over RDMA, one that holds the thread 1 ms
  // or more counts in ChannelTransportStats::rdma_callback_stalls), and a
  // blocking Channel::Call made in it fails with FAILED_PRECONDITION (it
  // may wait for the thread it runs on). It may start calls with
  // CallAsync. A thread blocked in Channel::Call on the same channel polls
  // the RDMA connection too, so such a callback may also run there, under
  // the same rules.
  // false: callbacks run on the runtime's callback threads
  // (`rdmarpc-done`), where they may block.
  bool run_callbacks_inline = true;

  // How RDMA reaches tensors in GPU memory (see GpuRdmaMode in
  // rdmarpc/memory.h); CallStats::gpu_rdma_mode says what each call used.
  GpuRdmaMode gpu_rdma_mode = GpuRdmaMode::kAuto;

  // gRPC keepalive on the channel's gRPC connection, as gRPC's
  // GRPC_ARG_KEEPALIVE_TIME_MS / _TIMEOUT_MS: after `keepalive_time`
  // without traffic the client pings, and a ping unanswered for
  // `keepalive_timeout` closes the connection, failing its calls with
  // UNAVAILABLE instead of leaving them waiting on a server that went away
  // silently (a host that froze or dropped off the network). 0: off (the
  // default, as in gRPC). The server must allow pings that often
  // (ServerBuilder::SetKeepalivePermit) or it closes the connection with
  // "too_many_pings". Calls over RDMA have their own watch
  // (rdma_peer_timeout).
  std::chrono::milliseconds keepalive_time{0};
  std::chrono::milliseconds keepalive_timeout{20000};
  // The least time one attempt to open the channel's gRPC connection (TCP,
  // then TLS and HTTP/2's handshake) gets before it is given up, as gRPC's
  // GRPC_ARG_MIN_RECONNECT_BACKOFF_MS. The RDMA handshake runs over this
  // connection, so a host too slow to connect in time (a process under
  // valgrind, an emulated VM) fails its first calls with UNAVAILABLE
  // ("tcp handshaker shutdown"): raise it there. A refused connect still
  // fails at once. 0 or less: gRPC's own default (20 s); gRPC raises
  // anything under 100 ms to 100 ms.
  std::chrono::milliseconds grpc_connect_attempt_timeout{5000};
};

// A channel's RDMA health; see the diagram at the top of this file.
enum class RdmaHealth {
  kNotTried,    // no call yet
  kConnecting,  // first handshake in progress; calls wait for it
  kReady,       // calls go over RDMA
  kDegraded,    // calls go over gRPC; a probe retries RDMA in the background
  kGrpcOnly,    // no RDMA possible (policy grpc, or a side without RDMA)
};
// "not-tried", "connecting", "rdma-ready", "degraded", "grpc-only".
const char* RdmaHealthName(RdmaHealth health);

// How a channel's transports are doing; see Channel::transport_stats().
struct ChannelTransportStats {
  RdmaHealth health = RdmaHealth::kNotTried;
  // "ready: RDMA connection to 198.18.0.1:41234 (rxe0)", "connecting",
  // "not tried yet", or why RDMA is not used.
  std::string rdma;
  // Times new calls moved from RDMA to gRPC or back.
  uint64_t switches = 0;
  // What last took RDMA away ("work-completion error", "port error event",
  // "device removed", "server silent on RDMA", "connect failed", ...) and
  // its error text; empty while nothing has.
  std::string last_trigger;
  std::string last_error;
  // Probes made while degraded, the last one's error, and the wait before
  // the next one (before jitter) while degraded.
  uint64_t probes = 0;
  std::string last_probe_error;
  std::chrono::milliseconds probe_backoff{0};
  // Calls started over each transport (a re-send counts on gRPC too), and
  // calls re-sent over gRPC after their RDMA connection failed.
  uint64_t calls_rdma = 0;
  uint64_t calls_grpc = 0;
  uint64_t calls_resent = 0;
  // One line per field, for logs and the example's --verbose.
  std::string ToString() const;
  // The RDMA connection's frames, writes, credit-only frames, and how
  // often a frame or write had to wait for the peer's credits. A received
  // frame counts once it was handled and its receive re-posted, so a call
  // that completed may not count its response yet.
  uint64_t rdma_frames_sent = 0;
  uint64_t rdma_frames_received = 0;
  uint64_t rdma_writes_posted = 0;
  // Of the writes, those posted by the poster thread rather than the one
  // polling the connection: large writes on a software device (rxe, siw),
  // whose post moves the bytes before it returns.
  uint64_t rdma_writes_posted_aside = 0;
  uint64_t rdma_credit_frames_sent = 0;
  // Credits this side granted the server beyond the first receives it
  // starts with, when it ran low (docs/design.md, "Flow control").
  uint64_t rdma_credits_granted = 0;
  uint64_t rdma_waits_for_credit = 0;
  // Frames sent without a completion of their own (a later one covers
  // them), and zero-length writes posted to complete such frames when the
  // connection went quiet.
  uint64_t rdma_frames_unsignaled = 0;
  uint64_t rdma_flush_writes = 0;
  // Memory windows bound to grant response landings: one per response
  // over the block its host landings share (of the landing arena, or of
  // its own when the arena is off or full), one more per other landing (a
  // buffer given with SetResponseTensorBuffer, say).
  uint64_t rdma_landing_windows = 0;
  // Registrations made for one response (pinning its pages per call): its
  // block where that is not in an arena segment the connection has
  // registered (one for all of its host landings), and each other
  // landing.
  uint64_t rdma_landing_registrations = 0;
  // Responses whose grant waited for windows the connection's other
  // grants held (each connection has 32), rather than registering their
  // landings for remote write.
  uint64_t rdma_landing_window_waits = 0;
  // Times the channel's RDMA watcher woke: every 50 ms while calls are
  // outstanding and for a second after the last one, then only for the
  // next call or a connection event (the server disconnecting, say).
  uint64_t rdma_watch_wakeups = 0;
  // Times a caller blocked in Channel::Call on this channel found
  // completions itself while it waited, polling the completion queue its
  // connection shares with the engine's other client connections on that
  // device (its response then completed on its own thread, not handed
  // over by the completion engine; completions of other channels' calls
  // it found count too).
  uint64_t rdma_caller_polls = 0;
  // Times the completion engine armed the queue the channel's RDMA
  // connection shares (as above), to sleep until its next completion: on
  // a software device (rxe) each arm is a system call, and the event a
  // wake-up of the engine. It arms the queue only while calls await
  // completions that no caller polls for: blocking calls made one after
  // another leave it unarmed.
  uint64_t rdma_queue_arms = 0;
  // Callbacks run on the completion thread (run_callbacks_inline) that
  // held it for 1 ms or more: each stalled every RDMA connection that
  // thread serves. A channel that counts them should block less in its
  // callbacks, or set run_callbacks_inline to false.
  uint64_t rdma_callback_stalls = 0;
};

}  // namespace rdmarpc

#endif  // RDMARPC_CHANNEL_OPTIONS_H_
