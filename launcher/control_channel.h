// The control connection between two launchers of a multi-node job.
//
// Note [Control protocol]
// Node 0's launcher (the coordinator) listens on master_addr:(master_port + 1); every
// other node's launcher (a worker) connects, retrying until --rdzv_timeout. Each message
// is one JSON object on one line, field "t" is its type:
//   worker -> coord  hello {v, job, nnodes, nproc, node, max_restarts}
//                                                        first message; must match node 0
//   coord -> worker  welcome {}                            handshake accepted
//   coord -> worker  abort {msg, code}                     fatal (mismatch, timeout): print, exit
//   coord -> worker  start {attempt}                       start local ranks, SMP_RESTART_COUNT
//   worker -> coord  done {attempt}                        all local ranks exited 0
//   worker -> coord  fail {attempt, failure}               a local rank failed (or SIGTERM)
//   coord -> worker  stop {attempt, failure}               stop ranks; failure = first failure
//   worker -> coord  stopped {attempt}                     local ranks are all gone
//   coord -> worker  exit {code, summary}                  job over: print summary, exit code
//   both ways        hb {}                                 heartbeat, sent after 1 s of silence
// A peer silent for --heartbeat_timeout seconds, or whose socket reaches EOF, is lost. The
// coordinator alone decides: the first failure it learns of (its own ranks or a worker's
// fail) is broadcast with stop; after every node answers stopped it sends start n+1
// (restart) or exit. A lost node is a failure too: with restarts left, node 0 waits for
// it to join again first (Note [Rejoining after a lost node], coordinator.cpp). A worker
// stops its own ranks on a local failure without waiting for
// stop, so a failure stops the job in one round trip.
#pragma once

#include <deque>
#include <string>

#include <nlohmann/json.hpp>

namespace smp::launcher {

// Bumped when a message changes; hello carries it and node 0 rejects other versions.
constexpr int kProtocolVersion = 1;
// Seconds of send silence after which a heartbeat is sent.
constexpr double kHeartbeatInterval = 1.0;
// Longest accepted message line (a failure carries kTailLines clipped lines).
constexpr size_t kMaxMessageBytes = 4 << 20;

// Monotonic clock in seconds.
double now_s();

// The decoder of the bytes a peer sent (Note [Control protocol]): moves every complete
// line of `in` that is a JSON object with a string "t" into `inbox` (heartbeats
// dropped), keeps the incomplete rest in `in`, and returns "" or what is wrong (a
// malformed line, or more than kMaxMessageBytes without a newline); the caller then
// drops the connection. Fuzzed by tests/fuzz/control_line_fuzz.cpp.
std::string take_messages(std::string& in, std::deque<nlohmann::json>& inbox);

// One non-blocking TCP connection carrying line-delimited JSON. Owns the fd. Not
// thread-safe; driven by the launcher's poll loop (poll_events / on_poll).
class Channel {
 public:
  // `peer` names the other side in messages ("node 1 at 10.0.0.2:4242").
  Channel(int fd, std::string peer);
  ~Channel();
  Channel(const Channel&) = delete;
  Channel& operator=(const Channel&) = delete;

  int fd() const { return fd_; }
  const std::string& peer() const { return peer_; }
  void set_peer(std::string peer) { peer_ = std::move(peer); }

  // Queues a message and writes as much as the socket takes now. No-op once closed.
  void send(const nlohmann::json& msg);
  // POLLIN, plus POLLOUT while output is queued.
  short poll_events() const;
  // Handles poll revents: writes queued output, reads complete messages into the inbox.
  void on_poll(short revents);
  // Sends a heartbeat if idle, and marks the channel lost if the peer was silent too long.
  void keep_alive(double now, double heartbeat_timeout_s);

  // Next received message, or a null json if none.
  nlohmann::json pop();
  bool has_message() const { return !inbox_.empty(); }
  // True once the peer closed, an I/O error occurred, a message was malformed, or the
  // heartbeat timed out; lost_reason() says which.
  bool lost() const { return lost_; }
  const std::string& lost_reason() const { return lost_reason_; }

  // Blocks up to timeout_s to write queued output, then half-closes (SHUT_WR) and waits
  // for the peer's EOF, so the last message is read before the socket goes away.
  void close_gracefully(double timeout_s);

 private:
  void mark_lost(const std::string& reason);
  void flush_some();

  int fd_;
  std::string peer_;
  std::string out_;
  std::string in_;
  std::deque<nlohmann::json> inbox_;
  bool lost_ = false;
  std::string lost_reason_;
  double last_rx_;
  double last_tx_;
};

}  // namespace smp::launcher
