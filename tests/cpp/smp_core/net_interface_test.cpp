// choose_gloo_interface's rules that hold on any machine: the user's setting wins, a
// master on loopback changes nothing. The choice by route is tested across real
// namespaces in tests/hosts/test_hosts.py.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "smp_core/net_interface.h"

namespace {

class EnvGuard {
 public:
  explicit EnvGuard(const char* name) : name_(name) {
    if (const char* v = std::getenv(name)) old_ = v, had_ = true;
  }
  ~EnvGuard() {
    if (had_) ::setenv(name_, old_.c_str(), 1);
    else ::unsetenv(name_);
  }

 private:
  const char* name_;
  std::string old_;
  bool had_ = false;
};

TEST(NetInterface, UsersSettingWinsAndLoopbackMasterChangesNothing) {
  EnvGuard g("GLOO_SOCKET_IFNAME"), n("NCCL_SOCKET_IFNAME");
  ::setenv("GLOO_SOCKET_IFNAME", "ethX", 1);
  ::setenv("NCCL_SOCKET_IFNAME", "ethY", 1);
  auto c = smp::choose_gloo_interface("10.1.2.3");
  EXPECT_EQ(c.name, "");  // Gloo reads the user's own variable
  EXPECT_NE(c.why.find("GLOO_SOCKET_IFNAME=ethX"), std::string::npos) << c.why;
  ::unsetenv("GLOO_SOCKET_IFNAME");
  c = smp::choose_gloo_interface("10.1.2.3");
  EXPECT_EQ(c.name, "ethY");
  ::unsetenv("NCCL_SOCKET_IFNAME");
  c = smp::choose_gloo_interface("127.0.0.1");
  EXPECT_EQ(c.name, "") << c.why;
}

}  // namespace
