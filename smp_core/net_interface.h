// Which network interface Gloo binds when the user has not said (issue 42, "the right
// interface without being told"). See Note [Gloo's interface] in net_interface.cpp.
#pragma once

#include <string>

namespace smp {

struct InterfaceChoice {
  std::string name;  // the interface to bind ("" : leave Gloo's default)
  std::string why;   // one line for the log
};

// With GLOO_SOCKET_IFNAME set: nothing (the user's setting wins). With only
// NCCL_SOCKET_IFNAME set: that one. Else, when this host's name resolves to a
// non-loopback address of this host: nothing (Gloo's default works). Else the
// interface whose address routes to `master_addr`, unless that is loopback.
InterfaceChoice choose_gloo_interface(const std::string& master_addr);

}  // namespace smp
