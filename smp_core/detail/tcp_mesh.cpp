#include "smp_core/detail/tcp_mesh.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <thread>

#include "smp_common/auth.h"
#include "smp_core/config.h"
#include "smp_core/errors.h"

namespace smp::detail {
namespace {

constexpr int64_t kHelloMagic = 0x736d7068656c6c6f;  // "smphello"
constexpr int kBufferBytes = 8 << 20;                // asked for; the kernel may cap it
// A hello and its handshake must come promptly; anything slower is not one of ours.
constexpr double kHelloTimeout = 5.0;

std::string errno_text() { return std::strerror(errno); }

using Clock = std::chrono::steady_clock;

// What both ends of one mesh connection bind into its handshake: the mesh and the
// two ranks (so that a proof for one pair or mesh is not one for another).
std::string mesh_context(uint64_t mesh_id, int64_t lower, int64_t higher) {
  return str_cat("smp-mesh ", mesh_id, " ", lower, " ", higher);
}

int domain_of(int fd) {
  int domain = AF_UNSPEC;
  socklen_t len = sizeof domain;
  getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &domain, &len);
  return domain;
}

std::string peer_address(int fd) {
  if (domain_of(fd) == AF_UNIX) return "a local socket";
  sockaddr_in sa{};
  socklen_t len = sizeof sa;
  char text[INET_ADDRSTRLEN] = "?";
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&sa), &len) == 0)
    inet_ntop(AF_INET, &sa.sin_addr, text, sizeof text);
  return str_cat(text, ":", ntohs(sa.sin_port));
}

int remaining_ms(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return left.count() < 0 ? 0 : static_cast<int>(left.count());
}

void configure(int fd, double timeout_s) {
  int one = 1;
  if (domain_of(fd) != AF_UNIX) setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  int bytes = kBufferBytes;
  setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &bytes, sizeof bytes);
  setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &bytes, sizeof bytes);
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(timeout_s);
  tv.tv_usec = static_cast<suseconds_t>((timeout_s - static_cast<double>(tv.tv_sec)) * 1e6);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

// An address's TCP part ("ip:port") and its local socket, if any (Listener::address()).
struct Address {
  std::string tcp, local_name, local_host;
};

Address split(const std::string& address) {
  Address a;
  const auto space = address.find(' ');
  a.tcp = address.substr(0, space);
  if (space == std::string::npos) return a;
  const std::string rest = address.substr(space + 1);
  const auto at = rest.rfind('@');
  SMP_CHECK(rest.rfind("local=", 0) == 0 && at != std::string::npos, "p2p: bad address '",
            address, "'");
  a.local_name = rest.substr(6, at - 6);
  a.local_host = rest.substr(at + 1);
  return a;
}

// This host's identity for Note [Local sockets]: its boot id and this process's
// network namespace (an abstract socket is reachable only within one). Empty if either
// is unknown: then no local socket is offered or used.
const std::string& host_identity() {
  static const std::string id = [] {
    std::string boot;
    std::ifstream f("/proc/sys/kernel/random/boot_id");
    if (!(f >> boot)) return std::string();
    char ns[128] = {};
    const ssize_t n = readlink("/proc/self/ns/net", ns, sizeof ns - 1);
    if (n <= 0) return std::string();
    std::string out = boot + "/" + std::string(ns, static_cast<size_t>(n));
    for (char& c : out)
      if (c == ' ' || c == '@') c = '_';
    return out;
  }();
  return id;
}

sockaddr_un abstract_address(const std::string& name, socklen_t* len) {
  sockaddr_un sa{};
  sa.sun_family = AF_UNIX;
  SMP_CHECK(name.size() + 1 < sizeof sa.sun_path, "p2p: local socket name too long");
  std::memcpy(sa.sun_path + 1, name.data(), name.size());  // sun_path[0] = 0: abstract
  *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  return sa;
}

// A connection to a peer's local socket, or -1 (the caller goes on by TCP).
int connect_local(const Address& a) {
  if (a.local_name.empty() || host_identity().empty() || a.local_host != host_identity())
    return -1;
  socklen_t len = 0;
  const sockaddr_un sa = abstract_address(a.local_name, &len);
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  if (connect(fd, reinterpret_cast<const sockaddr*>(&sa), len) == 0) return fd;
  close(fd);
  return -1;
}

sockaddr_in parse(const std::string& address) {
  auto colon = address.rfind(':');
  SMP_CHECK(colon != std::string::npos, "p2p: bad address '", address, "'");
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(std::stoi(address.substr(colon + 1))));
  SMP_CHECK(inet_pton(AF_INET, address.substr(0, colon).c_str(), &sa.sin_addr) == 1,
            "p2p: bad address '", address, "'");
  return sa;
}

// Connects to `address`, retrying while the peer is not listening yet: by its local
// socket where it offers one on this host (Note [Local sockets]), else by TCP.
int connect_to(const std::string& full_address, bool local, Clock::time_point deadline) {
  const Address parts = split(full_address);
  if (local) {
    const int fd = connect_local(parts);
    if (fd >= 0) return fd;
  }
  const std::string& address = parts.tcp;
  sockaddr_in sa = parse(address);
  while (true) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) throw CommError("smp: p2p: socket() failed: " + errno_text());
    if (connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) == 0) return fd;
    int err = errno;
    close(fd);
    if (Clock::now() >= deadline)
      throw TimeoutError(str_cat("smp: p2p: could not connect to ", address, ": ",
                                 std::strerror(err)));
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

}  // namespace

std::string local_address_toward(const std::string& host) {
  if (host.empty() || host == "localhost" || host.rfind("127.", 0) == 0) return "127.0.0.1";
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.c_str(), "9", &hints, &res) != 0 || res == nullptr) return "127.0.0.1";
  std::string out = "127.0.0.1";
  int fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd >= 0 && connect(fd, res->ai_addr, res->ai_addrlen) == 0) {  // picks a route only
    sockaddr_in local{};
    socklen_t len = sizeof local;
    char text[INET_ADDRSTRLEN];
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0 &&
        inet_ntop(AF_INET, &local.sin_addr, text, sizeof text) != nullptr)
      out = text;
  }
  if (fd >= 0) close(fd);
  freeaddrinfo(res);
  return out;
}

bool local_sockets_enabled() {
  return env_flag("SMP_P2P_LOCAL_SOCKET", true,
                  "ranks on one host connect by a local socket; 0: every pipeline "
                  "connection uses TCP");
}

Listener::Listener(const std::string& host, bool local) : host_(host) {
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  if (inet_pton(AF_INET, host.c_str(), &sa.sin_addr) != 1)
    throw CommError("smp: p2p: '" + host + "' is not an IPv4 address (SMP_P2P_ADDR?)");
  fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd_ < 0) throw CommError("smp: p2p: socket() failed: " + errno_text());
  socklen_t len = sizeof sa;
  if (bind(fd_, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0 || listen(fd_, 128) != 0 ||
      getsockname(fd_, reinterpret_cast<sockaddr*>(&sa), &len) != 0) {
    std::string why = errno_text();
    close(fd_);
    throw CommError("smp: p2p: cannot listen for pipeline connections on " + host + ": " + why);
  }
  port_ = ntohs(sa.sin_port);
  if (!local || host_identity().empty()) return;
  // Unique on this host: the pid, and this process's count of listeners.
  static std::atomic<int64_t> count{0};
  local_name_ = str_cat("smp-mesh-", getpid(), "-", count++, "-", port_);
  socklen_t ulen = 0;
  const sockaddr_un ua = abstract_address(local_name_, &ulen);
  local_fd_ = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (local_fd_ >= 0 && (bind(local_fd_, reinterpret_cast<const sockaddr*>(&ua), ulen) != 0 ||
                         listen(local_fd_, 128) != 0)) {
    close(local_fd_);  // none offered: peers connect by TCP
    local_fd_ = -1;
  }
  if (local_fd_ < 0) local_name_.clear();
}

Listener::~Listener() {
  if (fd_ >= 0) close(fd_);
  if (local_fd_ >= 0) close(local_fd_);
}

std::string Listener::address() const {
  std::string out = str_cat(host_, ":", port_);
  if (local_fd_ >= 0) out += str_cat(" local=", local_name_, "@", host_identity());
  return out;
}

std::vector<int> connect_mesh(Listener& listener, int rank,
                              const std::vector<std::string>& addresses, uint64_t nonce,
                              const auth::Key& key, double timeout_s) {
  const int size = static_cast<int>(addresses.size());
  const auto deadline = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  std::vector<int> fds(size, -1);
  auto close_all = [&] {
    for (int& fd : fds)
      if (fd >= 0) close(fd), fd = -1;
  };
  try {
    for (int peer = 0; peer < rank; ++peer) {
      int fd = connect_to(addresses[peer], listener.local_fd() >= 0, deadline);
      fds[peer] = fd;
      configure(fd, timeout_s);
      int64_t hello[3] = {kHelloMagic, static_cast<int64_t>(nonce), rank};
      write_all(fd, {iovec{hello, sizeof hello}});
      // Note [Job secret]: the peer proves the job's key before this rank trusts it.
      const std::string why = auth::handshake_initiate(
          fd, key, "mesh", mesh_context(nonce, peer, rank),
          std::max(0.001, remaining_ms(deadline) / 1000.0));
      if (!why.empty())
        throw CommError(str_cat("smp: p2p: pp rank ", peer, " at ", split(addresses[peer]).tcp,
                                domain_of(fd) == AF_UNIX ? " (by its local socket)" : "",
                                " failed authentication (on pp rank ", rank, "): ", why));
    }
    int missing = size - 1 - rank;
    while (missing > 0) {
      pollfd p[2] = {{listener.fd(), POLLIN, 0}, {listener.local_fd(), POLLIN, 0}};
      int ready = poll(p, listener.local_fd() >= 0 ? 2 : 1, remaining_ms(deadline));
      if (ready < 0 && errno == EINTR) continue;
      if (ready <= 0) {
        std::string who;
        for (int r = rank + 1; r < size; ++r)
          if (fds[r] < 0) who += (who.empty() ? "" : ", ") + std::to_string(r);
        throw TimeoutError(str_cat("smp: timed out after ", timeout_s,
                                   " s waiting for the pipeline connections of pp ranks ", who,
                                   " (pp rank ", rank, ")"));
      }
      const int from = (p[0].revents & POLLIN) || listener.local_fd() < 0 ? listener.fd()
                                                                          : listener.local_fd();
      int fd = accept4(from, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) continue;
      // A hello must come promptly; anything else is not one of ours.
      timeval tv{static_cast<time_t>(kHelloTimeout), 0};
      setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
      int64_t hello[3] = {0, 0, -1};
      bool ok = false;
      try {
        ok = read_exact(fd, hello, sizeof hello);
      } catch (const CommError&) {
      }
      const int64_t peer = hello[2];
      std::string why;
      if (!ok || hello[0] != kHelloMagic) {
        why = "not an smp pipeline hello";
      } else if (hello[1] != static_cast<int64_t>(nonce) || peer <= rank || peer >= size ||
                 fds[peer] >= 0) {
        why = str_cat("a hello for another mesh or rank (", peer, ")");
      } else {
        why = auth::handshake_respond(fd, key, "mesh", mesh_context(nonce, rank, peer),
                                      kHelloTimeout);
      }
      if (!why.empty()) {
        // Refused before any byte of it is decoded; said on stderr with its address,
        // and the wait goes on for the real peers.
        std::fprintf(stderr, "smp: pp rank %d refused a pipeline connection from %s: %s\n", rank,
                     peer_address(fd).c_str(), why.c_str());
        close(fd);
        continue;
      }
      timeval none{0, 0};
      setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &none, sizeof none);
      configure(fd, timeout_s);
      fds[peer] = fd;
      --missing;
    }
  } catch (...) {
    close_all();
    throw;
  }
  return fds;
}

bool read_exact(int fd, void* buf, size_t n) {
  auto* p = static_cast<char*>(buf);
  size_t got = 0;
  while (got < n) {
    ssize_t r = recv(fd, p + got, n - got, MSG_WAITALL);
    if (r > 0) {
      got += static_cast<size_t>(r);
      continue;
    }
    if (r < 0 && errno == EINTR) continue;
    if (r == 0 && got == 0) return false;
    throw CommError(r == 0 ? std::string("connection closed in the middle of a message")
                           : errno_text());
  }
  return true;
}

void write_all(int fd, std::vector<iovec> iov) {
  size_t first = 0;
  while (first < iov.size()) {
    msghdr msg{};
    msg.msg_iov = iov.data() + first;
    msg.msg_iovlen = std::min<size_t>(iov.size() - first, IOV_MAX);
    ssize_t w = sendmsg(fd, &msg, MSG_NOSIGNAL);
    if (w < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK)
        throw TimeoutError("the peer stopped reading (send timed out)");
      throw CommError(errno_text());
    }
    auto left = static_cast<size_t>(w);
    while (first < iov.size() && left >= iov[first].iov_len) left -= iov[first++].iov_len;
    if (left > 0) {
      iov[first].iov_base = static_cast<char*>(iov[first].iov_base) + left;
      iov[first].iov_len -= left;
    }
  }
}

}  // namespace smp::detail
