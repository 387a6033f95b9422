// One smprun process running its node's part of a job. Coordinator (node 0, also the only
// role of a single-node job) and Worker (nodes 1..N-1) share this base: a single-threaded
// poll loop over the signal pipe, the local ranks' output pipes, a listening socket and
// the control channels (see Note [Control protocol] in control_channel.h).
//
// pump() waits for one batch of events and handles the mechanical part (reading output,
// reaping, heartbeats, timers); the roles then inspect the resulting state (signals taken
// with take_signal(), messages popped from channels, group_.first_failure()). run() never
// throws; it returns smprun's exit status.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "launcher/control_channel.h"
#include "launcher/failure.h"
#include "launcher/local_group.h"
#include "launcher/options.h"
#include "smp_common/auth.h"

namespace smp::launcher {

class Session {
 public:
  // master_port: the resolved MASTER_PORT (picked already if options.master_port == 0).
  Session(const LaunchOptions& options, const EnvMap& env, int master_port);
  virtual ~Session() = default;

  // Runs the job to completion; returns the exit status of smprun.
  virtual int run() = 0;

 protected:
  // Waits up to max_wait_s (less if a timer is due) and handles what happened.
  void pump(double max_wait_s);
  // The control channels to poll and keep alive (empty on a single node).
  virtual std::vector<Channel*> channels() = 0;
  // The oldest terminating signal not yet taken, or 0.
  int take_signal();
  // Pumps until the local ranks are idle. A signal meanwhile escalates to SIGKILL and is
  // remembered in exit_signal_.
  void wait_idle();

  // "smprun: <text>" on stderr, one write.
  static void say(const std::string& text);
  // This machine's host name (for the other launchers' messages about this node).
  static std::string this_host();
  // The report of the failure that stopped the job (what failed first, its output tail).
  static void report(const Failure& failure);
  // The final line: how the job ended and how many restarts it used.
  std::string summary(const Failure* failure) const;

  LaunchOptions options_;
  int master_port_;
  LocalGroup group_;
  // Current attempt (restart count).
  int attempt_ = 0;
  // First terminating signal received by this launcher (0 if none).
  int exit_signal_ = 0;
  // A listening socket polled by pump(); accepted connections land in accepted_.
  int listen_fd_ = -1;
  std::vector<std::unique_ptr<Channel>> accepted_;
  // Note [Job secret]: the key of options_.secret, which the launchers prove to each
  // other (label "control", context kControlContext) before a control line is read.
  auth::Key job_key_;
  static constexpr const char* kControlContext = "smp-control";
  // A launcher answers in milliseconds; a stranger that stalls holds the rendezvous
  // loop this long at most (well under --heartbeat_timeout).
  static constexpr double kHandshakeTimeoutS = 2.0;
  // A rendezvous still incomplete after this long says who is missing and why, once,
  // then waits on until --rdzv_timeout (nodes may start minutes apart; a host that is
  // unreachable is named well before that).
  static constexpr double kRendezvousNoticeS = 10.0;

 private:
  std::vector<int> signals_;
};

// Node 0: runs its ranks and decides for the job (failure, restart, exit).
std::unique_ptr<Session> make_coordinator(const LaunchOptions& options, const EnvMap& env,
                                          int master_port);
// Nodes 1..N-1: run their ranks as node 0 says.
std::unique_ptr<Session> make_worker(const LaunchOptions& options, const EnvMap& env,
                                     int master_port);

}  // namespace smp::launcher
