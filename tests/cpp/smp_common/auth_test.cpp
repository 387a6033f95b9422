// The job secret (smp_common/auth.h, Note [Job secret]) on its own: keys from secrets,
// MACs bound to their label, sealed store values, and the handshake over a real socket
// pair. The pipeline mesh's use of it is tests/cpp/smp_core/tcp_mesh_test.cpp.
#include "smp_common/auth.h"

#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <future>
#include <stdexcept>
#include <string>

namespace smp::auth {
namespace {

std::string message_of(const std::string& secret) {
  try {
    key_from_secret(secret, "SMP_JOB_SECRET");
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

TEST(Auth, KeyFromSecret) {
  EXPECT_EQ(key_from_secret(std::string(32, 'a'), "t"), key_from_secret(std::string(32, 'A'), "t"));
  EXPECT_EQ(key_from_secret(" " + std::string(32, 'a') + "\n", "t"),
            key_from_secret(std::string(32, 'a'), "t"));  // surrounding whitespace dropped
  EXPECT_NE(key_from_secret(std::string(32, 'a'), "t"), key_from_secret(std::string(32, 'b'), "t"));
  EXPECT_EQ(message_of(std::string(30, 'a')),
            "smp: SMP_JOB_SECRET must be an even number of hex digits, at least 32 (got 30 "
            "characters); e.g. `openssl rand -hex 32`");
  EXPECT_EQ(message_of(std::string(31, 'a') + "g"),
            "smp: SMP_JOB_SECRET holds a character that is not a hex digit (at 30); allowed: 0-9, a-f");
  EXPECT_EQ(to_hex(std::string("\x00\xff\x10", 3)), "00ff10");
  EXPECT_EQ(random_bytes(0), "");
  EXPECT_NE(random_bytes(16), random_bytes(16));
}

TEST(Auth, MacIsBoundToKeyAndLabel) {
  const Key k = key_from_secret(std::string(64, 'c'), "t");
  const std::string tag = mac(k, "store:a", "value");
  EXPECT_EQ(tag.size(), kMacBytes);
  EXPECT_TRUE(verify(k, "store:a", "value", tag));
  EXPECT_FALSE(verify(k, "store:b", "value", tag));
  EXPECT_FALSE(verify(k, "store:a", "valuf", tag));
  EXPECT_FALSE(verify(key_from_secret(std::string(64, 'd'), "t"), "store:a", "value", tag));
  EXPECT_FALSE(verify(k, "store:a", "value", tag.substr(1)));
  // The label and the data are separated: ("ab", "c") is not ("a", "bc").
  EXPECT_NE(mac(k, "ab", "c"), mac(k, "a", "bc"));
}

TEST(Auth, SealedStoreValues) {
  set_job_key(key_from_secret(std::string(64, 'e'), "t"), /*from_environment=*/false);
  EXPECT_TRUE(has_job_key());
  EXPECT_FALSE(job_key_from_environment());
  const std::string sealed = seal("k", std::string("v\0w", 3));
  EXPECT_EQ(unseal("k", sealed), std::string("v\0w", 3));
  try {
    unseal("other", sealed);
    ADD_FAILURE() << "unsealed under another store key";
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()),
              "smp: the store value 'other' failed authentication (written by a process without "
              "this job's secret, SMP_JOB_SECRET): refused");
  }
  EXPECT_THROW(unseal("k", "short"), std::runtime_error);
}

// Runs both ends of a handshake over a socket pair; {initiator's answer, responder's}.
std::pair<std::string, std::string> handshake(const Key& ki, const Key& kr,
                                              const std::string& ctx_i, const std::string& ctx_r) {
  int fds[2];
  EXPECT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
  auto responder = std::async(std::launch::async, [&] {
    std::string r = handshake_respond(fds[1], kr, "test", ctx_r, 5);
    close(fds[1]);  // a failed responder hangs up, as its callers do
    return r;
  });
  std::string i = handshake_initiate(fds[0], ki, "test", ctx_i, 5);
  close(fds[0]);  // (what it sent stays readable)
  return {i, responder.get()};
}

TEST(Auth, HandshakeProvesTheSameKeyAndContext) {
  const Key a = key_from_secret(std::string(64, 'a'), "t");
  const Key b = key_from_secret(std::string(64, 'b'), "t");
  EXPECT_EQ(handshake(a, a, "ctx", "ctx"), std::make_pair(std::string(), std::string()));
  const std::string refused =
      "the peer did not prove this job's secret (SMP_JOB_SECRET differs, or not one of this "
      "job's processes)";
  // Another key: the initiator refuses the responder's proof and hangs up.
  EXPECT_EQ(handshake(a, b, "ctx", "ctx"),
            std::make_pair(refused, std::string("the peer closed the connection during the handshake")));
  // The same key but another context (e.g. another mesh): refused too.
  EXPECT_EQ(handshake(a, a, "ctx 1", "ctx 2").first, refused);
}

TEST(Auth, HandshakeTimesOutOnASilentPeer) {
  int fds[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
  EXPECT_EQ(handshake_respond(fds[1], key_from_secret(std::string(64, 'a'), "t"), "test", "c", 0.2),
            "timed out waiting for the peer's handshake");
  close(fds[0]);
  close(fds[1]);
}

}  // namespace
}  // namespace smp::auth
