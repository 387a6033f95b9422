// Node 0's launcher: rendezvous, then attempts of the job until success, a failure that is
// not restarted, or --max_restarts is used up. See Note [Control protocol].
#include <unistd.h>

#include <csignal>
#include <optional>

#include "launcher/net.h"
#include "launcher/session.h"

namespace smp::launcher {

namespace {

using nlohmann::json;

struct Peer {
  int node = 0;
  std::string host;  // the host name its launcher gave (for messages)
  std::unique_ptr<Channel> channel;
  bool done = false;     // this attempt: all its ranks exited 0
  bool stopped = false;  // this attempt: its ranks are gone after a stop
};

class Coordinator : public Session {
 public:
  using Session::Session;
  int run() override;

 protected:
  std::vector<Channel*> channels() override {
    std::vector<Channel*> out;
    for (auto& p : peers_) out.push_back(p.channel.get());
    return out;
  }

 private:
  int rendezvous();
  // Drops the peers that were lost; "" when none was, else their node ranks ("1, 3").
  std::string drop_lost_peers();
  bool may_restart(const Failure& failure) const {
    return failure.restartable() && !fatal_ && exit_signal_ == 0 &&
           attempt_ < options_.max_restarts;
  }
  std::string check_hello(const json& m) const;
  std::optional<Failure> run_attempt();
  void wait_stopped();
  void broadcast(const json& msg) {
    for (auto& p : peers_) p.channel->send(msg);
  }
  int finish(int code, const std::string& text);
  int abort_all(const std::string& msg, int code);

  std::vector<Peer> peers_;
  // The job ends, no restart: a launcher was signalled, a message was malformed, or a
  // node did not confirm that its ranks stopped.
  bool fatal_ = false;
};

std::string Coordinator::check_hello(const json& m) const {
  if (m.value("t", "") != "hello") return "expected hello, got '" + m.value("t", "") + "'";
  int node = m.at("node").get<int>();
  std::string who = "node " + std::to_string(node);
  if (m.at("v").get<int>() != kProtocolVersion)
    return who + " speaks control protocol v" + std::to_string(m.at("v").get<int>()) +
           " but node 0 speaks v" + std::to_string(kProtocolVersion) + " (mixed smprun versions)";
  if (m.at("job").get<std::string>() != options_.job_id)
    return who + " has job id '" + m.at("job").get<std::string>() + "' but node 0 has '" +
           options_.job_id + "' (--job_id)";
  if (m.at("nnodes").get<int>() != options_.nnodes)
    return who + " has --nnodes " + std::to_string(m.at("nnodes").get<int>()) +
           " but node 0 has " + std::to_string(options_.nnodes);
  if (m.at("nproc").get<int>() != options_.nproc_per_node)
    return who + " has --nproc_per_node " + std::to_string(m.at("nproc").get<int>()) +
           " but node 0 has " + std::to_string(options_.nproc_per_node);
  // A worker decides alone whether to rejoin after losing node 0, so the counts must agree.
  if (m.value("max_restarts", options_.max_restarts) != options_.max_restarts)
    return who + " has --max_restarts " + std::to_string(m.value("max_restarts", 0)) +
           " but node 0 has " + std::to_string(options_.max_restarts);
  if (node < 1 || node >= options_.nnodes)
    return "a launcher connected with --node_rank " + std::to_string(node) + ", expected 1.." +
           std::to_string(options_.nnodes - 1);
  for (const auto& p : peers_) {
    if (p.node == node) return "two launchers claim --node_rank " + std::to_string(node);
  }
  return "";
}

int Coordinator::abort_all(const std::string& msg, int code) {
  say("error: " + msg);
  json abort = {{"t", "abort"}, {"msg", msg}, {"code", code}};
  for (auto& p : peers_) p.channel->send(abort);
  for (auto& c : accepted_) c->send(abort);
  for (auto& p : peers_) p.channel->close_gracefully(1.0);
  for (auto& c : accepted_) c->close_gracefully(1.0);
  return code;
}

int Coordinator::rendezvous() {
  std::string error;
  int port = master_port_ + 1;
  listen_fd_ = listen_tcp(options_.master_addr, port, &error);
  if (listen_fd_ < 0) {
    say("error: control port (--master_port + 1): " + error);
    return kExitBadInput;
  }
  const double start = now_s();
  double deadline = start + options_.rdzv_timeout_s;
  bool noticed = false;
  auto missing_nodes = [&] {
    std::string missing;
    for (int n = 1; n < options_.nnodes; ++n) {
      bool joined = false;
      for (auto& p : peers_) joined = joined || p.node == n;
      if (!joined) missing += (missing.empty() ? "" : ", ") + std::to_string(n);
    }
    return missing;
  };
  while (static_cast<int>(peers_.size()) < options_.nnodes - 1) {
    if (!noticed && now_s() - start >= kRendezvousNoticeS) {
      noticed = true;
      char secs[64];
      snprintf(secs, sizeof(secs), "%.0f s (waiting until %g s, --rdzv_timeout)", now_s() - start,
               options_.rdzv_timeout_s);
      say("waiting for node ranks " + missing_nodes() + " to join on " +
          host_port(options_.master_addr, port) + ": " + std::to_string(peers_.size() + 1) +
          " of " + std::to_string(options_.nnodes) + " nodes after " + secs);
    }
    pump(0.2);
    if (int sig = take_signal())
      return abort_all("rendezvous interrupted: node 0's launcher received " + signal_name(sig),
                       128 + sig);
    for (size_t i = 0; i < accepted_.size();) {
      Channel& c = *accepted_[i];
      if (c.has_message()) {
        json m = c.pop();
        std::string problem;
        try {
          problem = check_hello(m);
        } catch (const json::exception& e) {
          problem = "malformed hello from " + c.peer() + ": " + e.what();
        }
        if (!problem.empty()) return abort_all(problem, kExitBadInput);
        Peer peer;
        peer.node = m["node"].get<int>();
        peer.host = m.value("host", std::string());
        c.set_peer("node " + std::to_string(peer.node) + " (" + c.peer() + ")");
        c.send({{"t", "welcome"}, {"host", this_host()}});
        peer.channel = std::move(accepted_[i]);
        accepted_.erase(accepted_.begin() + static_cast<long>(i));
        peers_.push_back(std::move(peer));
      } else if (c.lost()) {
        accepted_.erase(accepted_.begin() + static_cast<long>(i));  // a probe went away
      } else {
        ++i;
      }
    }
    for (auto& p : peers_) {
      if (p.channel->lost())
        return abort_all("node " + std::to_string(p.node) + " left during the rendezvous (" +
                             p.channel->lost_reason() + ")",
                         kExitFailure);
    }
    if (now_s() > deadline) {
      const std::string missing = missing_nodes();
      char secs[32];
      snprintf(secs, sizeof(secs), "%g", options_.rdzv_timeout_s);
      return abort_all("only " + std::to_string(peers_.size() + 1) + " of " +
                           std::to_string(options_.nnodes) + " nodes joined within " + secs +
                           " s (missing node ranks: " + missing + "); node 0 listens on " +
                           host_port(options_.master_addr, port) + " (--rdzv_timeout)",
                       kExitFailure);
    }
  }
  close(listen_fd_);
  listen_fd_ = -1;
  accepted_.clear();
  say("all " + std::to_string(options_.nnodes) + " nodes joined (" +
      std::to_string(options_.nnodes * options_.nproc_per_node) + " ranks)");
  return -1;
}

std::optional<Failure> Coordinator::run_attempt() {
  for (;;) {
    pump(1.0);
    if (int sig = take_signal()) {
      fatal_ = true;
      return Failure::launcher_signal(0, sig);
    }
    if (group_.first_failure()) return group_.first_failure();
    for (auto& p : peers_) {
      while (p.channel->has_message()) {
        json m = p.channel->pop();
        try {
          if (m.value("attempt", -1) != attempt_) continue;  // stale
          std::string t = m["t"];
          if (t == "done") p.done = true;
          if (t == "fail") {
            Failure f = Failure::from_json(m.at("failure"));
            if (!f.restartable()) fatal_ = true;
            return f;
          }
        } catch (const json::exception& e) {
          fatal_ = true;
          return Failure::node_lost(p.node, std::string("malformed message: ") + e.what(),
                                    Failure::node_place(p.host, p.node, options_.nproc_per_node));
        }
      }
      if (p.channel->lost()) {
        return Failure::node_lost(p.node, p.channel->lost_reason(),
                                  Failure::node_place(p.host, p.node, options_.nproc_per_node));
      }
    }
    bool all_done = group_.succeeded();
    for (auto& p : peers_) all_done = all_done && p.done;
    if (all_done) return std::nullopt;
  }
}

void Coordinator::wait_stopped() {
  // Workers stop within their grace period; allow for slow nodes on top.
  double deadline = now_s() + options_.grace_period_s + 10;
  for (;;) {
    bool all = group_.idle();
    for (auto& p : peers_) all = all && (p.stopped || p.channel->lost());
    if (all) return;
    pump(0.1);
    if (take_signal() != 0) {
      group_.kill_now();
      fatal_ = true;
    }
    for (auto& p : peers_) {
      while (p.channel->has_message()) {
        json m = p.channel->pop();
        if (m.value("t", "") == "stopped" && m.value("attempt", -1) == attempt_) p.stopped = true;
      }
    }
    if (now_s() > deadline) {
      for (auto& p : peers_) {
        if (!p.stopped && !p.channel->lost())
          say("node " + std::to_string(p.node) + " did not confirm that its ranks stopped");
      }
      fatal_ = true;
      wait_idle();
      return;
    }
  }
}

// Note [Rejoining after a lost node]
// A node whose launcher is lost (its host died, or its link was cut for longer than
// --heartbeat_timeout) is a failure like a rank's: with restarts left, node 0 stops the
// other nodes' ranks and its own, forgets the lost launcher, and listens again as at the
// start, until --rdzv_timeout, for a launcher with the same --node_rank. The lost node's
// launcher, if it is alive (a cut link), has stopped its own ranks on losing node 0 and
// connects again by itself; a host that restarted runs smprun again. Then node 0 starts
// the next attempt everywhere, which resumes from the newest checkpoint
// (Note [Automatic resume]). Both sides count the restart: hello carries --max_restarts
// and node 0 refuses a node whose count differs. Without restarts left a lost node ends
// the job, as before.
std::string Coordinator::drop_lost_peers() {
  std::string lost;
  for (size_t i = 0; i < peers_.size();) {
    if (peers_[i].channel->lost()) {
      lost += (lost.empty() ? "" : ", ") + std::to_string(peers_[i].node);
      peers_.erase(peers_.begin() + static_cast<long>(i));
    } else {
      ++i;
    }
  }
  return lost;
}

int Coordinator::finish(int code, const std::string& text) {
  say(text);
  broadcast({{"t", "exit"}, {"code", code}, {"summary", text}});
  for (auto& p : peers_) p.channel->close_gracefully(2.0);
  return code;
}

int Coordinator::run() {
  if (options_.nnodes > 1) {
    int rc = rendezvous();
    if (rc >= 0) return rc;
  }
  for (attempt_ = 0;; ++attempt_) {
    for (auto& p : peers_) p.done = p.stopped = false;
    broadcast({{"t", "start"}, {"attempt", attempt_}});
    std::string error = group_.start(attempt_);
    if (!error.empty()) {
      say("error: cannot start the ranks of node 0: " + error);
      group_.kill_now();
      wait_idle();
      return finish(kExitFailure, "job failed: cannot start the ranks of node 0 (" + error + ")");
    }
    std::optional<Failure> failure = run_attempt();
    if (!failure) return finish(0, summary(nullptr));
    broadcast({{"t", "stop"}, {"attempt", attempt_}, {"failure", failure->to_json()}});
    report(*failure);
    bool own_signal = failure->kind == FailureKind::kLauncherSignal && failure->node == 0;
    group_.stop(own_signal ? failure->signal : SIGTERM);
    wait_stopped();
    if (may_restart(*failure)) {
      const std::string restart = "restart " + std::to_string(attempt_ + 1) + " of " +
                                  std::to_string(options_.max_restarts);
      const std::string lost = drop_lost_peers();
      if (!lost.empty()) {
        say("waiting for node ranks " + lost + " to join again before " + restart +
            " (until --rdzv_timeout)");
        int rc = rendezvous();
        if (rc >= 0) return rc;
      }
      say("restarting the job (" + restart + ")");
      continue;
    }
    int code = exit_signal_ != 0 ? 128 + exit_signal_ : failure->job_exit_code();
    return finish(code, summary(&*failure));
  }
}

}  // namespace

std::unique_ptr<Session> make_coordinator(const LaunchOptions& options, const EnvMap& env,
                                          int master_port) {
  return std::make_unique<Coordinator>(options, env, master_port);
}

}  // namespace smp::launcher
