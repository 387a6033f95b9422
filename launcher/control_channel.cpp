#include "launcher/control_channel.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>

#include "launcher/net.h"

namespace smp::launcher {

double now_s() {
  using namespace std::chrono;
  return duration<double>(steady_clock::now().time_since_epoch()).count();
}

Channel::Channel(int fd, std::string peer)
    : fd_(fd), peer_(std::move(peer)), last_rx_(now_s()), last_tx_(now_s()) {
  set_nonblocking(fd_);
}

Channel::~Channel() {
  if (fd_ >= 0) close(fd_);
}

void Channel::mark_lost(const std::string& reason) {
  if (lost_) return;
  lost_ = true;
  lost_reason_ = reason;
  out_.clear();
}

void Channel::send(const nlohmann::json& msg) {
  if (lost_) return;
  // Rank output in a failure's tail may be invalid UTF-8: replace, never throw.
  out_ += msg.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  out_ += '\n';
  flush_some();
}

void Channel::flush_some() {
  while (!out_.empty() && !lost_) {
    ssize_t n = ::send(fd_, out_.data(), out_.size(), MSG_NOSIGNAL);
    if (n > 0) {
      out_.erase(0, static_cast<size_t>(n));
      last_tx_ = now_s();
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      return;
    } else {
      mark_lost(std::string("send failed: ") + std::strerror(errno));
    }
  }
}

std::string take_messages(std::string& in, std::deque<nlohmann::json>& inbox) {
  size_t start = 0;
  for (size_t nl; (nl = in.find('\n', start)) != std::string::npos; start = nl + 1) {
    try {
      auto msg = nlohmann::json::parse(in.begin() + start, in.begin() + nl);
      if (!msg.is_object() || !msg.contains("t") || !msg["t"].is_string())
        throw std::runtime_error("no message type");
      if (msg["t"] != "hb") inbox.push_back(std::move(msg));
    } catch (const std::exception& e) {
      return std::string("malformed message: ") + e.what();
    }
  }
  in.erase(0, start);
  if (in.size() > kMaxMessageBytes) return "message longer than 4 MiB";
  return "";
}

short Channel::poll_events() const { return POLLIN | (out_.empty() ? 0 : POLLOUT); }

void Channel::on_poll(short revents) {
  if (lost_) return;
  if (revents & POLLOUT) flush_some();
  if (!(revents & (POLLIN | POLLHUP | POLLERR))) return;
  char buf[65536];
  while (!lost_) {
    ssize_t n = recv(fd_, buf, sizeof(buf), 0);
    if (n > 0) {
      last_rx_ = now_s();
      in_.append(buf, static_cast<size_t>(n));
      const std::string error = take_messages(in_, inbox_);
      if (!error.empty()) {
        mark_lost(error);
        return;
      }
    } else if (n == 0) {
      mark_lost("connection closed");
    } else if (errno == EINTR) {
      continue;
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      return;
    } else {
      mark_lost(std::string("receive failed: ") + std::strerror(errno));
    }
  }
}

void Channel::keep_alive(double now, double heartbeat_timeout_s) {
  if (lost_) return;
  if (now - last_rx_ > heartbeat_timeout_s) {
    char text[64];
    snprintf(text, sizeof(text), "no heartbeat for %.3g s", heartbeat_timeout_s);
    mark_lost(text);
    return;
  }
  if (now - last_tx_ >= kHeartbeatInterval && out_.empty()) send({{"t", "hb"}});
}

nlohmann::json Channel::pop() {
  if (inbox_.empty()) return nullptr;
  nlohmann::json msg = std::move(inbox_.front());
  inbox_.pop_front();
  return msg;
}

void Channel::close_gracefully(double timeout_s) {
  double deadline = now_s() + timeout_s;
  while (!lost_ && !out_.empty() && now_s() < deadline) {
    pollfd p{fd_, POLLOUT, 0};
    poll(&p, 1, 50);
    flush_some();
  }
  if (lost_) return;
  shutdown(fd_, SHUT_WR);
  char buf[4096];
  while (now_s() < deadline) {
    pollfd p{fd_, POLLIN, 0};
    if (poll(&p, 1, 50) <= 0) continue;
    ssize_t n = recv(fd_, buf, sizeof(buf), 0);
    if (n == 0 || (n < 0 && errno != EINTR && errno != EAGAIN)) break;
  }
  mark_lost("closed");
}

}  // namespace smp::launcher
