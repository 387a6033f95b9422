#include "smp_core/net_interface.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <unistd.h>

#include <cstdlib>
#include <set>

#include "smp_core/detail/tcp_mesh.h"
#include "smp_core/errors.h"

namespace smp {
namespace {

// Note [Gloo's interface]
// ~~~~~~~~~~~~~~~~~~~~~~~
// Gloo binds the address its host name resolves to. In a container (or a network
// namespace) whose host name resolves to nothing, or only to loopback, it falls back
// to loopback, and a job across hosts cannot connect ("timed out connecting ...
// remote=[127.0.0.1]"; torch's own init fails the same way). smp knows where the
// master is: the interface that routes to it is the one every rank can be reached on
// from there (the pipeline mesh already advertises that address, local_address_toward).
// The choice is made only where Gloo's default would fail, a user's GLOO_SOCKET_IFNAME
// always wins, and NCCL_SOCKET_IFNAME, when it is the only one set, says the same.

struct LocalAddrs {
  std::set<std::string> all;         // every IPv4 address of this host's interfaces
  std::string name_of(const std::string& addr) const {
    ifaddrs* ifs = nullptr;
    std::string out;
    if (getifaddrs(&ifs) != 0) return out;
    for (ifaddrs* i = ifs; i != nullptr; i = i->ifa_next) {
      if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET) continue;
      char text[INET_ADDRSTRLEN];
      auto* sin = reinterpret_cast<sockaddr_in*>(i->ifa_addr);
      if (inet_ntop(AF_INET, &sin->sin_addr, text, sizeof text) != nullptr && addr == text) {
        out = i->ifa_name;
        break;
      }
    }
    freeifaddrs(ifs);
    return out;
  }
};

LocalAddrs local_addrs() {
  LocalAddrs out;
  ifaddrs* ifs = nullptr;
  if (getifaddrs(&ifs) != 0) return out;
  for (ifaddrs* i = ifs; i != nullptr; i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET) continue;
    char text[INET_ADDRSTRLEN];
    auto* sin = reinterpret_cast<sockaddr_in*>(i->ifa_addr);
    if (inet_ntop(AF_INET, &sin->sin_addr, text, sizeof text) != nullptr) out.all.insert(text);
  }
  freeifaddrs(ifs);
  return out;
}

bool loopback(const std::string& addr) { return addr.rfind("127.", 0) == 0; }

}  // namespace

InterfaceChoice choose_gloo_interface(const std::string& master_addr) {
  if (const char* g = std::getenv("GLOO_SOCKET_IFNAME"); g != nullptr && *g) {
    return {"", str_cat("GLOO_SOCKET_IFNAME=", g, " (set by the user)")};
  }
  if (const char* n = std::getenv("NCCL_SOCKET_IFNAME"); n != nullptr && *n) {
    return {n, str_cat("NCCL_SOCKET_IFNAME=", n, " (set by the user) for Gloo too")};
  }
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  const LocalAddrs mine = local_addrs();
  addrinfo hints{};
  hints.ai_family = AF_INET;
  addrinfo* res = nullptr;
  std::string resolved;
  if (getaddrinfo(host, nullptr, &hints, &res) == 0) {
    for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
      char text[INET_ADDRSTRLEN];
      auto* sin = reinterpret_cast<sockaddr_in*>(a->ai_addr);
      if (inet_ntop(AF_INET, &sin->sin_addr, text, sizeof text) == nullptr) continue;
      if (resolved.empty()) resolved = text;
      if (!loopback(text) && mine.all.count(text)) {
        freeaddrinfo(res);
        return {"", str_cat("host name '", host, "' resolves to ", text, " of this host")};
      }
    }
    freeaddrinfo(res);
  }
  const std::string toward = detail::local_address_toward(master_addr);
  if (loopback(toward)) {
    return {"", str_cat("the master ", master_addr, " is reached over loopback")};
  }
  const std::string name = mine.name_of(toward);
  if (name.empty()) return {"", str_cat("no interface holds ", toward)};
  const std::string what = resolved.empty() ? std::string("to nothing")
                           : loopback(resolved) ? str_cat("only to loopback (", resolved, ")")
                                                : str_cat("to ", resolved, ", not an address of this host");
  return {name, str_cat("host name '", host, "' resolves ", what, "; ", name, " (", toward,
                        ") routes to the master ", master_addr)};
}

}  // namespace smp
