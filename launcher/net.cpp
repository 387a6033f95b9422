#include "launcher/net.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>

namespace smp::launcher {

namespace {

struct AddrInfoDeleter {
  void operator()(addrinfo* ai) const { freeaddrinfo(ai); }
};
using AddrInfoPtr = std::unique_ptr<addrinfo, AddrInfoDeleter>;

// Resolves addr:port for a TCP socket; passive=true resolves "" to the wildcard.
AddrInfoPtr resolve(const std::string& addr, int port, bool passive, std::string* error) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  addrinfo* res = nullptr;
  std::string service = std::to_string(port);
  int rc = getaddrinfo(addr.empty() ? nullptr : addr.c_str(), service.c_str(), &hints, &res);
  if (rc != 0) {
    *error = "cannot resolve '" + addr + "': " + gai_strerror(rc);
    return nullptr;
  }
  return AddrInfoPtr(res);
}

int bind_one(const addrinfo* ai, int* err) {
  int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
  if (fd < 0) {
    *err = errno;
    return -1;
  }
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (bind(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
    *err = errno;
    close(fd);
    return -1;
  }
  return fd;
}

}  // namespace

std::string host_port(const std::string& addr, int port) {
  if (addr.find(':') != std::string::npos) return "[" + addr + "]:" + std::to_string(port);
  return addr + ":" + std::to_string(port);
}

void set_nonblocking(int fd) { fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK); }

int bind_tcp(const std::string& addr, int port, std::string* error) {
  auto res = resolve(addr, port, /*passive=*/false, error);
  if (!res) return -1;
  int err = 0;
  for (addrinfo* ai = res.get(); ai; ai = ai->ai_next) {
    int fd = bind_one(ai, &err);
    if (fd >= 0) return fd;
    if (err == EADDRINUSE) break;
  }
  if (err == EADDRNOTAVAIL) {
    // addr names this node but not one of its interfaces (e.g. NAT): listen everywhere.
    auto any = resolve("", port, /*passive=*/true, error);
    if (!any) return -1;
    for (addrinfo* ai = any.get(); ai; ai = ai->ai_next) {
      int fd = bind_one(ai, &err);
      if (fd >= 0) return fd;
    }
  }
  *error = "cannot bind " + host_port(addr, port) + ": " + std::strerror(err) +
           (err == EADDRINUSE ? " (port in use)" : "");
  return -1;
}

int listen_tcp(const std::string& addr, int port, std::string* error) {
  int fd = bind_tcp(addr, port, error);
  if (fd < 0) return -1;
  if (listen(fd, 128) != 0) {
    *error = "cannot listen on " + host_port(addr, port) + ": " + std::strerror(errno);
    close(fd);
    return -1;
  }
  set_nonblocking(fd);
  return fd;
}

int pick_free_port(const std::string& addr, std::string* error) {
  int fd = bind_tcp(addr, 0, error);
  if (fd < 0) return 0;
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  int port = 0;
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) == 0) {
    port = ss.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port)
                                    : ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  } else {
    *error = std::string("getsockname failed: ") + std::strerror(errno);
  }
  close(fd);
  return port;
}

int start_connect(const std::string& addr, int port, std::string* error) {
  auto res = resolve(addr, port, /*passive=*/false, error);
  if (!res) return -1;
  const addrinfo* ai = res.get();
  int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
  if (fd < 0) {
    *error = std::string("socket: ") + std::strerror(errno);
    return -1;
  }
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  if (connect(fd, ai->ai_addr, ai->ai_addrlen) != 0 && errno != EINPROGRESS) {
    *error = std::strerror(errno);
    close(fd);
    return -1;
  }
  return fd;
}

bool finish_connect(int fd, std::string* error) {
  int err = 0;
  socklen_t len = sizeof(err);
  if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
  if (err != 0) {
    *error = std::strerror(err);
    return false;
  }
  return true;
}

}  // namespace smp::launcher
