// The line-delimited JSON control channel over a real socketpair (launcher/control_channel.h).
#include "launcher/control_channel.h"

#include <gtest/gtest.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

namespace smp::launcher {
namespace {

// Polls `c` until pred() or ~2 s.
template <typename Pred>
void drive(Channel& c, Pred pred) {
  double deadline = now_s() + 2;
  while (!pred() && now_s() < deadline) {
    pollfd p{c.fd(), c.poll_events(), 0};
    if (poll(&p, 1, 50) > 0) c.on_poll(p.revents);
  }
}

class ChannelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int sv[2];
    ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
    a_ = std::make_unique<Channel>(sv[0], "a");
    b_ = std::make_unique<Channel>(sv[1], "b");
  }
  std::unique_ptr<Channel> a_, b_;
};

TEST_F(ChannelTest, MessagesArriveInOrderHeartbeatsAreHidden) {
  a_->send({{"t", "start"}, {"attempt", 0}});
  a_->send({{"t", "hb"}});
  a_->send({{"t", "stop"}, {"attempt", 0}, {"failure", {{"tail", {"l1", "l2"}}}}});
  std::vector<nlohmann::json> got;
  drive(*b_, [&] {
    while (b_->has_message()) got.push_back(b_->pop());
    return got.size() >= 2;
  });
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[0]["t"], "start");
  EXPECT_EQ(got[1]["t"], "stop");
  EXPECT_EQ(got[1]["failure"]["tail"][1], "l2");
  EXPECT_FALSE(b_->has_message());
  EXPECT_FALSE(b_->lost());
}

TEST_F(ChannelTest, LargeMessagePassesThroughPartialWrites) {
  std::string big(1 << 20, 'q');
  a_->send({{"t", "fail"}, {"blob", big}});
  drive(*b_, [&] {
    pollfd p{a_->fd(), a_->poll_events(), 0};
    if (poll(&p, 1, 0) > 0) a_->on_poll(p.revents);
    return b_->has_message();
  });
  ASSERT_TRUE(b_->has_message());
  EXPECT_EQ(b_->pop()["blob"].get<std::string>().size(), big.size());
}

TEST_F(ChannelTest, PeerCloseIsLoss) {
  a_.reset();
  drive(*b_, [&] { return b_->lost(); });
  EXPECT_TRUE(b_->lost());
  EXPECT_EQ(b_->lost_reason(), "connection closed");
}

TEST_F(ChannelTest, MalformedMessageIsLoss) {
  ASSERT_EQ(write(a_->fd(), "not json\n", 9), 9);
  drive(*b_, [&] { return b_->lost(); });
  EXPECT_NE(b_->lost_reason().find("malformed message"), std::string::npos);
}

TEST_F(ChannelTest, SilenceIsLossAfterTheHeartbeatTimeout) {
  b_->keep_alive(now_s(), 0.2);
  EXPECT_FALSE(b_->lost());
  b_->keep_alive(now_s() + 0.5, 0.2);
  EXPECT_TRUE(b_->lost());
  EXPECT_EQ(b_->lost_reason(), "no heartbeat for 0.2 s");
}

TEST_F(ChannelTest, KeepAliveSendsHeartbeatsThatCountAsTraffic) {
  usleep(300 * 1000);
  a_->keep_alive(now_s() + kHeartbeatInterval + 0.1, 10);  // idle for > 1 s: sends hb
  double t0 = now_s();
  drive(*b_, [&] { return now_s() > t0 + 0.1; });
  EXPECT_FALSE(b_->has_message());  // heartbeats are not delivered
  b_->keep_alive(now_s(), 0.25);     // but they reset the silence timer
  EXPECT_FALSE(b_->lost());
}

}  // namespace
}  // namespace smp::launcher
