// The pipeline mesh against strangers (Note [Job secret]): real sockets on loopback, a
// real two-rank mesh, and a process-less stranger that connects to a rank's listener
// with garbage, with a well-formed handshake under another key, and with a handshake
// recorded from an earlier mesh. Each is refused and logged, and the mesh still forms.
#include "smp_core/detail/tcp_mesh.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <future>
#include <string>
#include <thread>

#include "smp_common/auth.h"
#include "smp_core/errors.h"

namespace smp::detail {
namespace {

constexpr int64_t kHelloMagic = 0x736d7068656c6c6f;  // tcp_mesh.cpp's hello
constexpr uint64_t kMeshId = 77;

auth::Key key_of(char c) { return auth::key_from_secret(std::string(64, c), "test"); }

int dial(int port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
  EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa), 0);
  return fd;
}

void send_bytes(int fd, const std::string& b) { write_all(fd, {iovec{const_cast<char*>(b.data()), b.size()}}); }

std::string hello(int64_t rank) {
  const int64_t words[3] = {kHelloMagic, static_cast<int64_t>(kMeshId), rank};
  return std::string(reinterpret_cast<const char*>(words), sizeof words);
}

// True once the peer closed `fd` (what a refused connection sees), false on a timeout.
bool closed_by_peer(int fd) {
  timeval tv{10, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  char buf[256];
  while (true) {
    const ssize_t r = recv(fd, buf, sizeof buf, 0);
    if (r == 0) return true;
    if (r < 0) return errno == ECONNRESET;
  }
}

// What an initiator of an earlier mesh sent: its nonce message and its proof, recorded
// by forwarding a real handshake between two socket pairs.
std::string record_initiator(const auth::Key& key, std::string* proof) {
  int to_i[2], to_r[2];
  socketpair(AF_UNIX, SOCK_STREAM, 0, to_i);
  socketpair(AF_UNIX, SOCK_STREAM, 0, to_r);
  const std::string context = "smp-mesh 77 0 1";
  auto initiator = std::async(std::launch::async, [&] {
    return auth::handshake_initiate(to_i[0], key, "mesh", context, 5);
  });
  auto responder = std::async(std::launch::async, [&] {
    return auth::handshake_respond(to_r[0], key, "mesh", context, 5);
  });
  auto forward = [](int from, int to, size_t n) {
    std::string b(n, '\0');
    EXPECT_TRUE(read_exact(from, b.data(), n));
    send_bytes(to, b);
    return b;
  };
  const std::string first = forward(to_i[1], to_r[1], 4 + auth::kNonceBytes);
  forward(to_r[1], to_i[1], auth::kNonceBytes + auth::kMacBytes);
  *proof = forward(to_i[1], to_r[1], auth::kMacBytes);
  EXPECT_EQ(initiator.get(), "");
  EXPECT_EQ(responder.get(), "");
  for (int fd : {to_i[0], to_i[1], to_r[0], to_r[1]}) close(fd);
  return first;
}

TEST(TcpMesh, StrangersAreRefusedAndTheMeshStillForms) {
  const auth::Key key = key_of('a');
  std::string recorded_proof;
  const std::string recorded_first = record_initiator(key, &recorded_proof);

  Listener l0("127.0.0.1"), l1("127.0.0.1");
  const std::vector<std::string> addresses = {"127.0.0.1:" + std::to_string(l0.port()),
                                              "127.0.0.1:" + std::to_string(l1.port())};
  testing::internal::CaptureStderr();
  auto rank0 = std::async(std::launch::async,
                          [&] { return connect_mesh(l0, 0, addresses, kMeshId, key, 20); });

  // 1. Garbage.
  int fd = dial(l0.port());
  send_bytes(fd, std::string(64, 'x'));
  EXPECT_TRUE(closed_by_peer(fd));
  close(fd);
  // 2. A well-formed hello and handshake, under another key: rank 0 proves its key
  // first, so the stranger learns nothing it can use, and its proof fails.
  fd = dial(l0.port());
  send_bytes(fd, hello(1));
  EXPECT_NE(auth::handshake_initiate(fd, key_of('b'), "mesh", "smp-mesh 77 0 1", 5), "");
  close(fd);
  // 3. The recorded handshake of an earlier mesh, replayed byte for byte.
  fd = dial(l0.port());
  send_bytes(fd, hello(1) + recorded_first);
  std::string challenge(auth::kNonceBytes + auth::kMacBytes, '\0');
  ASSERT_TRUE(read_exact(fd, challenge.data(), challenge.size()));
  send_bytes(fd, recorded_proof);
  EXPECT_TRUE(closed_by_peer(fd));
  close(fd);

  // The real rank 1 then joins, and both ends hold a connection to each other.
  auto fds1 = connect_mesh(l1, 1, addresses, kMeshId, key, 20);
  auto fds0 = rank0.get();
  const std::string log = testing::internal::GetCapturedStderr();
  ASSERT_EQ(fds0.size(), 2u);
  ASSERT_GE(fds0[1], 0);
  ASSERT_GE(fds1[0], 0);
  const char ping = 'p';
  ASSERT_EQ(write(fds1[0], &ping, 1), 1);
  char got = 0;
  ASSERT_TRUE(read_exact(fds0[1], &got, 1));
  EXPECT_EQ(got, 'p');
  // Each stranger was logged with its address, and why.
  EXPECT_NE(log.find("refused a pipeline connection from 127.0.0.1:"), std::string::npos) << log;
  EXPECT_NE(log.find("not an smp pipeline hello"), std::string::npos) << log;
  // (The stranger with another key gave up on rank 0's proof, before sending its own.)
  EXPECT_NE(log.find("the peer closed the connection during the handshake"), std::string::npos) << log;
  EXPECT_NE(log.find("the peer did not prove this job's secret"), std::string::npos) << log;
  close(fds0[1]);
  close(fds1[0]);
}

TEST(TcpMesh, APeerWithAnotherSecretIsNamed) {
  Listener l0("127.0.0.1"), l1("127.0.0.1");
  const std::vector<std::string> addresses = {"127.0.0.1:" + std::to_string(l0.port()),
                                              "127.0.0.1:" + std::to_string(l1.port())};
  testing::internal::CaptureStderr();
  auto rank0 = std::async(std::launch::async, [&] {
    return connect_mesh(l0, 0, addresses, kMeshId, key_of('a'), 1.5);
  });
  try {
    connect_mesh(l1, 1, addresses, kMeshId, key_of('b'), 1.5);
    FAIL() << "a peer with another key was accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("pp rank 0 at " + addresses[0] + " failed authentication"),
              std::string::npos)
        << e.what();
  }
  // Rank 0 never got its peer: a timeout naming it, not a hang.
  try {
    rank0.get();
    FAIL();
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("waiting for the pipeline connections of pp ranks 1"),
              std::string::npos)
        << e.what();
  }
  testing::internal::GetCapturedStderr();
}

int domain(int fd) {
  int d = AF_UNSPEC;
  socklen_t len = sizeof d;
  getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &d, &len);
  return d;
}

// The abstract name a listener's address offers (Note [Local sockets]).
std::string local_name(const Listener& l) {
  const std::string a = l.address();
  const auto start = a.find(" local=");
  EXPECT_NE(start, std::string::npos) << a;
  return a.substr(start + 7, a.rfind('@') - start - 7);
}

int dial_local(const std::string& name) {
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un sa{};
  sa.sun_family = AF_UNIX;
  std::memcpy(sa.sun_path + 1, name.data(), name.size());
  const auto len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&sa), len), 0) << name;
  return fd;
}

// Forms a two-rank mesh of `a0` and `a1` (rank 1 connects to a0) and checks a byte
// goes across; returns the socket domain of each end.
std::pair<int, int> mesh_domains(Listener& l0, Listener& l1, const std::string& a0,
                                 const std::string& a1) {
  const std::vector<std::string> addresses = {a0, a1};
  auto rank0 = std::async(std::launch::async,
                          [&] { return connect_mesh(l0, 0, addresses, kMeshId, key_of('a'), 20); });
  auto fds1 = connect_mesh(l1, 1, addresses, kMeshId, key_of('a'), 20);
  auto fds0 = rank0.get();
  const char ping = 'p';
  EXPECT_EQ(write(fds1[0], &ping, 1), 1);
  char got = 0;
  EXPECT_TRUE(read_exact(fds0[1], &got, 1));
  EXPECT_EQ(got, 'p');
  const std::pair<int, int> out{domain(fds0[1]), domain(fds1[0])};
  close(fds0[1]);
  close(fds1[0]);
  return out;
}

TEST(TcpMesh, RanksOnOneHostConnectByALocalSocket) {
  Listener l0("127.0.0.1", true), l1("127.0.0.1", true);
  ASSERT_GE(l0.local_fd(), 0) << "no local socket on this machine";
  EXPECT_EQ(mesh_domains(l0, l1, l0.address(), l1.address()), std::make_pair(AF_UNIX, AF_UNIX));
}

TEST(TcpMesh, WithoutALocalSocketTheMeshUsesTcp) {
  // A listener without one (SMP_P2P_LOCAL_SOCKET=0 on that rank) offers only TCP.
  Listener l0("127.0.0.1", false), l1("127.0.0.1", true);
  EXPECT_EQ(l0.address(), "127.0.0.1:" + std::to_string(l0.port()));
  EXPECT_EQ(mesh_domains(l0, l1, l0.address(), l1.address()), std::make_pair(AF_INET, AF_INET));
  // One offered under another host's identity (another machine or network namespace),
  // or whose socket is gone, is passed over for TCP.
  Listener l2("127.0.0.1", true), l3("127.0.0.1", true);
  std::string elsewhere = l2.address();
  elsewhere.replace(elsewhere.rfind('@') + 1, std::string::npos, "another-host");
  EXPECT_EQ(mesh_domains(l2, l3, elsewhere, l3.address()), std::make_pair(AF_INET, AF_INET));
  Listener l4("127.0.0.1", true), l5("127.0.0.1", true);
  std::string gone = l4.address();
  gone.replace(gone.find(" local=") + 7, local_name(l4).size(), "smp-mesh-no-such-socket");
  EXPECT_EQ(mesh_domains(l4, l5, gone, l5.address()), std::make_pair(AF_INET, AF_INET));
}

TEST(TcpMesh, AStrangerOnTheLocalSocketIsRefused) {
  Listener l0("127.0.0.1", true), l1("127.0.0.1", true);
  const std::vector<std::string> addresses = {l0.address(), l1.address()};
  testing::internal::CaptureStderr();
  auto rank0 = std::async(std::launch::async,
                          [&] { return connect_mesh(l0, 0, addresses, kMeshId, key_of('a'), 20); });
  int fd = dial_local(local_name(l0));
  send_bytes(fd, std::string(64, 'x'));
  EXPECT_TRUE(closed_by_peer(fd));
  close(fd);
  fd = dial_local(local_name(l0));
  send_bytes(fd, hello(1));
  EXPECT_NE(auth::handshake_initiate(fd, key_of('b'), "mesh", "smp-mesh 77 0 1", 5), "");
  close(fd);
  auto fds1 = connect_mesh(l1, 1, addresses, kMeshId, key_of('a'), 20);
  auto fds0 = rank0.get();
  const std::string log = testing::internal::GetCapturedStderr();
  EXPECT_EQ(domain(fds0[1]), AF_UNIX);
  EXPECT_NE(log.find("refused a pipeline connection from a local socket: "
                     "not an smp pipeline hello"),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("the peer closed the connection during the handshake"), std::string::npos)
      << log;
  close(fds0[1]);
  close(fds1[0]);
}

TEST(TcpMesh, LocalSocketSettingIsChecked) {
  const char* before = std::getenv("SMP_P2P_LOCAL_SOCKET");
  const std::string saved = before ? before : "";
  setenv("SMP_P2P_LOCAL_SOCKET", "0", 1);
  EXPECT_FALSE(local_sockets_enabled());
  setenv("SMP_P2P_LOCAL_SOCKET", "1", 1);
  EXPECT_TRUE(local_sockets_enabled());
  setenv("SMP_P2P_LOCAL_SOCKET", "yes", 1);
  try {
    local_sockets_enabled();
    FAIL() << "SMP_P2P_LOCAL_SOCKET=yes was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("SMP_P2P_LOCAL_SOCKET='yes' is not one of {0, 1}"),
              std::string::npos) << e.what();
  }
  if (before)
    setenv("SMP_P2P_LOCAL_SOCKET", saved.c_str(), 1);
  else
    unsetenv("SMP_P2P_LOCAL_SOCKET");
}

}  // namespace
}  // namespace smp::detail
