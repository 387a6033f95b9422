#include "launcher/session.h"

#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstring>

#include "launcher/line_buffer.h"
#include "launcher/signals.h"

namespace smp::launcher {

Session::Session(const LaunchOptions& options, const EnvMap& env, int master_port)
    : options_(options),
      master_port_(master_port),
      group_(options_, env, master_port),
      // parse_options always sets a secret; a Session built by hand (tests) draws one.
      job_key_(auth::key_from_secret(
          options.secret.empty() ? auth::to_hex(auth::random_bytes(auth::kKeyBytes)) : options.secret,
          "the job secret")) {}

std::string Session::this_host() {
  char name[256] = {0};
  if (::gethostname(name, sizeof name - 1) != 0) return "";
  return name;
}

void Session::say(const std::string& text) { write_all(STDERR_FILENO, "smprun: " + text + "\n"); }

void Session::report(const Failure& failure) {
  std::string text;
  for (const auto& line : failure.report_lines()) text += line + "\n";
  write_all(STDERR_FILENO, text);
}

std::string Session::summary(const Failure* failure) const {
  std::string restarts = "restarts used: " + std::to_string(attempt_) + " of " +
                         std::to_string(options_.max_restarts);
  int world = options_.nnodes * options_.nproc_per_node;
  if (failure == nullptr)
    return "job succeeded: all " + std::to_string(world) + " ranks exited 0 (" + restarts + ")";
  return "job failed: " + failure->describe() + " (" + restarts + ")";
}

int Session::take_signal() {
  if (signals_.empty()) return 0;
  int sig = signals_.front();
  signals_.erase(signals_.begin());
  return sig;
}

void Session::pump(double max_wait_s) {
  std::vector<pollfd> fds;
  fds.push_back({SignalPipe::fd(), POLLIN, 0});
  size_t listen_at = fds.size();
  if (listen_fd_ >= 0) fds.push_back({listen_fd_, POLLIN, 0});
  size_t group_at = fds.size();
  group_.add_poll_fds(&fds);
  size_t chan_at = fds.size();
  std::vector<Channel*> chans = channels();
  for (auto& c : accepted_) chans.push_back(c.get());  // connections awaiting hello
  for (Channel* c : chans) fds.push_back({c->lost() ? -1 : c->fd(), c->poll_events(), 0});

  double now = now_s();
  double wait = std::min({max_wait_s, kHeartbeatInterval, group_.next_timeout(now)});
  int timeout_ms = static_cast<int>(std::ceil(std::max(0.0, wait) * 1000));
  int n = poll(fds.data(), fds.size(), timeout_ms);
  if (n < 0 && errno != EINTR) say(std::string("poll failed: ") + std::strerror(errno));

  PendingSignals pending = SignalPipe::drain();
  for (int sig : pending.terminating) {
    if (exit_signal_ == 0) exit_signal_ = sig;
    signals_.push_back(sig);
  }
  for (size_t i = group_at; i < chan_at; ++i) {
    if (fds[i].revents != 0) group_.on_readable(fds[i].fd);
  }
  group_.reap();  // every turn: cheap, and robust to a coalesced SIGCHLD
  now = now_s();
  group_.tick(now);

  if (listen_fd_ >= 0 && (fds[listen_at].revents & POLLIN)) {
    for (;;) {
      sockaddr_storage ss{};
      socklen_t len = sizeof(ss);
      int fd = accept4(listen_fd_, reinterpret_cast<sockaddr*>(&ss), &len, SOCK_CLOEXEC);
      if (fd < 0) break;
      char host[NI_MAXHOST] = "?";
      getnameinfo(reinterpret_cast<sockaddr*>(&ss), len, host, sizeof(host), nullptr, 0,
                  NI_NUMERICHOST);
      // Note [Job secret]: the connecting launcher proves the job's secret before a
      // line of it is read; a stranger is refused and named, and the rendezvous goes on.
      const std::string why = auth::handshake_respond(fd, job_key_, "control", kControlContext,
                                                      kHandshakeTimeoutS);
      if (!why.empty()) {
        say(std::string("refused a control connection from ") + host + ": " + why);
        close(fd);
        continue;
      }
      accepted_.push_back(std::make_unique<Channel>(fd, std::string("a launcher at ") + host));
    }
  }
  for (size_t i = chan_at; i < fds.size(); ++i) {
    if (fds[i].revents != 0) chans[i - chan_at]->on_poll(fds[i].revents);
  }
  for (Channel* c : chans) c->keep_alive(now, options_.heartbeat_timeout_s);
}

void Session::wait_idle() {
  while (!group_.idle()) {
    pump(0.1);
    if (take_signal() != 0) group_.kill_now();
  }
}

}  // namespace smp::launcher
