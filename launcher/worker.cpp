// The launcher of nodes 1..N-1: joins node 0, then starts and stops its ranks as node 0
// says, reporting its own failures. See Note [Control protocol].
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>

#include "launcher/net.h"
#include "launcher/rank_process.h"
#include "launcher/session.h"
#include "launcher/signals.h"

namespace smp::launcher {

namespace {

using nlohmann::json;

// Pause between connection attempts while node 0 is not up yet.
constexpr double kConnectRetryS = 0.25;

class Worker : public Session {
 public:
  using Session::Session;
  int run() override;

 protected:
  std::vector<Channel*> channels() override {
    if (!channel_) return {};
    return {channel_.get()};
  }

 private:
  int join();
  int run_attempt();
  // After losing node 0: -1 to join again (restarts left, Note [Rejoining after a lost
  // node] in coordinator.cpp), else the exit status. The ranks are stopped already.
  int after_losing_coordinator();
  int stop_and_exit(int code, const std::string& text);
  std::string coordinator() const { return host_port(options_.master_addr, master_port_ + 1); }

  std::unique_ptr<Channel> channel_;
  std::string coordinator_host_;  // node 0's host name, from its welcome
};

int Worker::join() {
  const double start = now_s();
  double deadline = start + options_.rdzv_timeout_s;
  bool noticed = false;
  std::string last_error;
  while (!channel_) {
    std::string error;
    int fd = start_connect(options_.master_addr, master_port_ + 1, &error);
    if (fd >= 0) {
      pollfd p[2] = {{fd, POLLOUT, 0}, {SignalPipe::fd(), POLLIN, 0}};
      double left = std::max(0.0, deadline - now_s());
      poll(p, 2, static_cast<int>(std::min(1.0, left) * 1000) + 1);
      if (p[0].revents != 0 && finish_connect(fd, &error)) {
        // Note [Job secret]: node 0 proves the job's secret, and so does this node.
        const std::string why = auth::handshake_initiate(
            fd, job_key_, "control", kControlContext,
            std::max(0.1, std::min(kHandshakeTimeoutS, deadline - now_s())));
        if (why.empty()) {
          channel_ = std::make_unique<Channel>(fd, "node 0 at " + coordinator());
          break;
        }
        close(fd);
        say("error: node 0 at " + coordinator() + " failed authentication: " + why +
            " (every node's smprun needs the same SMP_JOB_SECRET or --secret_file)");
        return kExitFailure;
      }
      if (p[0].revents == 0) error = "connection timed out";
      close(fd);
    }
    last_error = error;
    if (!noticed && now_s() - start >= kRendezvousNoticeS) {
      noticed = true;
      char secs[64];
      snprintf(secs, sizeof(secs), "%.0f s (until %g s, --rdzv_timeout)", now_s() - start,
               options_.rdzv_timeout_s);
      say("node " + std::to_string(options_.node_rank) + " (host '" + this_host() +
          "') cannot reach the coordinator (node 0) at " + coordinator() + ": " + error +
          "; still trying after " + secs);
    }
    pump(kConnectRetryS);
    if (int sig = take_signal()) {
      say("received " + signal_name(sig) + " while waiting for node 0 at " + coordinator());
      return 128 + sig;
    }
    if (now_s() > deadline) {
      char secs[32];
      snprintf(secs, sizeof(secs), "%g", options_.rdzv_timeout_s);
      say("error: cannot reach the coordinator (node 0) at " + coordinator() + " within " + secs +
          " s: " + last_error + " (is smprun --node_rank 0 running there with --master_port " +
          std::to_string(master_port_) + "? see --rdzv_timeout)");
      return kExitFailure;
    }
  }
  channel_->send({{"t", "hello"},
                  {"v", kProtocolVersion},
                  {"job", options_.job_id},
                  {"nnodes", options_.nnodes},
                  {"nproc", options_.nproc_per_node},
                  {"node", options_.node_rank},
                  {"max_restarts", options_.max_restarts},
                  {"host", this_host()}});
  for (;;) {
    pump(0.5);
    if (int sig = take_signal()) {
      say("received " + signal_name(sig) + " during the rendezvous");
      return 128 + sig;
    }
    while (channel_->has_message()) {
      json m = channel_->pop();
      std::string t = m.value("t", "");
      if (t == "welcome") {
        coordinator_host_ = m.value("host", std::string());
        return -1;
      }
      if (t == "abort") {
        say("error: " + m.value("msg", std::string("node 0 aborted the job")));
        return m.value("code", kExitFailure);
      }
    }
    if (channel_->lost()) {
      say("error: the coordinator at " + coordinator() +
          " dropped the connection during the handshake (" + channel_->lost_reason() + ")");
      return kExitFailure;
    }
  }
}

int Worker::stop_and_exit(int code, const std::string& text) {
  group_.stop(SIGTERM);
  wait_idle();
  say(text);
  channel_->close_gracefully(2.0);
  return code;
}

int Worker::run_attempt() {
  std::string error = group_.start(attempt_);
  if (!error.empty()) {
    say("error: cannot start the ranks of node " + std::to_string(options_.node_rank) + ": " +
        error);
    group_.kill_now();
    wait_idle();
    Failure f = Failure::rank_exit(options_.node_rank, global_rank(options_, 0), 0, 127 << 8,
                                   {"smprun: " + error});
    channel_->send({{"t", "fail"}, {"attempt", attempt_}, {"failure", f.to_json()}});
  }
  bool reported = !error.empty();
  for (;;) {
    pump(1.0);
    if (int sig = take_signal()) {
      group_.stop(sig);  // forward the signal to the ranks
      Failure f = Failure::launcher_signal(options_.node_rank, sig);
      channel_->send({{"t", "fail"}, {"attempt", attempt_}, {"failure", f.to_json()}});
      report(f);
      wait_idle();
      say(summary(&f));
      channel_->close_gracefully(1.0);
      return 128 + sig;
    }
    while (channel_->has_message()) {
      json m = channel_->pop();
      std::string t = m.value("t", "");
      if (t == "stop" && m.value("attempt", -1) == attempt_) {
        group_.stop(SIGTERM);
        report(Failure::from_json(m.at("failure")));
        wait_idle();
        channel_->send({{"t", "stopped"}, {"attempt", attempt_}});
        return -1;
      }
      if (t == "exit")
        return stop_and_exit(m.value("code", kExitFailure), m.value("summary", std::string()));
      if (t == "abort")
        return stop_and_exit(m.value("code", kExitFailure),
                             "error: " + m.value("msg", std::string("node 0 aborted the job")));
    }
    if (channel_->lost()) {
      group_.stop(SIGTERM);
      const std::string place = Failure::node_place(coordinator_host_, 0, options_.nproc_per_node);
      say("error: lost the coordinator (node 0) at " + coordinator() + " (" +
          channel_->lost_reason() + "): " + place + "; stopping the ranks of node " +
          std::to_string(options_.node_rank));
      if (group_.first_failure()) report(*group_.first_failure());
      wait_idle();
      return after_losing_coordinator();
    }
    if (reported) continue;
    if (group_.first_failure()) {
      // Stop at once; node 0 answers with stop naming the job's first failure.
      group_.stop(SIGTERM);
      channel_->send({{"t", "fail"},
                      {"attempt", attempt_},
                      {"failure", group_.first_failure()->to_json()}});
      reported = true;
    } else if (group_.succeeded()) {
      channel_->send({{"t", "done"}, {"attempt", attempt_}});
      reported = true;
    }
  }
}

int Worker::after_losing_coordinator() {
  if (exit_signal_ == 0 && attempt_ < options_.max_restarts) {
    say("joining node 0 at " + coordinator() + " again for restart " +
        std::to_string(attempt_ + 1) + " of " + std::to_string(options_.max_restarts) +
        " (until --rdzv_timeout)");
    channel_.reset();
    return -1;
  }
  Failure f = Failure::node_lost(
      0, channel_->lost_reason(),
      Failure::node_place(coordinator_host_, 0, options_.nproc_per_node));
  say(summary(&f));
  return exit_signal_ != 0 ? 128 + exit_signal_ : kExitFailure;
}

int Worker::run() {
  int rc = -1;
  for (;;) {
    if (!channel_) {
      rc = join();
      if (rc >= 0) return rc;
    }
    if (exit_signal_ != 0) {
      say("received " + signal_name(exit_signal_) + "; leaving the job");
      channel_->close_gracefully(1.0);
      return 128 + exit_signal_;
    }
    pump(channel_->has_message() ? 0 : 1.0);  // start may have come with welcome
    if (int sig = take_signal()) {
      Failure f = Failure::launcher_signal(options_.node_rank, sig);
      channel_->send({{"t", "fail"}, {"attempt", attempt_}, {"failure", f.to_json()}});
      continue;  // exit_signal_ is set: leave at the top of the loop
    }
    while (channel_->has_message()) {
      json m = channel_->pop();
      std::string t = m.value("t", "");
      if (t == "start") {
        attempt_ = m.at("attempt").get<int>();
        rc = run_attempt();
        if (rc >= 0) return rc;
        break;
      }
      if (t == "stop") channel_->send({{"t", "stopped"}, {"attempt", m.value("attempt", -1)}});
      if (t == "exit") return stop_and_exit(m.value("code", kExitFailure), m.value("summary", ""));
      if (t == "abort")
        return stop_and_exit(m.value("code", kExitFailure), "error: " + m.value("msg", ""));
    }
    if (channel_ && channel_->lost()) {
      say("error: lost the coordinator (node 0) at " + coordinator() + " (" +
          channel_->lost_reason() + ") between attempts");
      rc = after_losing_coordinator();
      if (rc >= 0) return rc;
    }
  }
}

}  // namespace

std::unique_ptr<Session> make_worker(const LaunchOptions& options, const EnvMap& env,
                                     int master_port) {
  return std::make_unique<Worker>(options, env, master_port);
}

}  // namespace smp::launcher
