// Failure descriptions, reports and their JSON form (launcher/failure.h).
#include "launcher/failure.h"

#include <gtest/gtest.h>
#include <sys/wait.h>

#include <csignal>
#include <nlohmann/json.hpp>

namespace smp::launcher {
namespace {

TEST(Failure, ExitCode) {
  Failure f = Failure::rank_exit(1, 5, 1, 7 << 8, {"a", "b"});
  EXPECT_EQ(f.exit_code, 7);
  EXPECT_EQ(f.signal, 0);
  EXPECT_EQ(f.describe(), "rank 5 (node 1, local rank 1) exited with code 7");
  EXPECT_TRUE(f.restartable());
  EXPECT_EQ(f.job_exit_code(), 1);
  auto lines = f.report_lines();
  ASSERT_EQ(lines.size(), 4u);
  EXPECT_EQ(lines[0], "smprun: rank 5 (node 1, local rank 1) exited with code 7 -- failed first; "
                      "stopping all ranks");
  EXPECT_EQ(lines[1], "smprun: last 2 lines of rank 5's output:");
  EXPECT_EQ(lines[2], "[5] a");
  EXPECT_EQ(lines[3], "[5] b");
}

TEST(Failure, KilledBySignal) {
  Failure f = Failure::rank_exit(0, 2, 2, SIGKILL, {});
  EXPECT_EQ(f.signal, SIGKILL);
  EXPECT_EQ(f.describe(), "rank 2 (node 0, local rank 2) was killed by signal SIGKILL (Killed)");
  EXPECT_EQ(f.report_lines().back(), "smprun: rank 2 printed nothing");
}

TEST(Failure, NodeLostAndLauncherSignal) {
  Failure lost = Failure::node_lost(1, "connection closed");
  EXPECT_EQ(lost.describe(), "the launcher of node 1 was lost (connection closed)");
  EXPECT_TRUE(lost.restartable());  // once it joins again (Note [Rejoining after a lost node])
  EXPECT_EQ(lost.job_exit_code(), 1);
  // With the node's place: its host name and ranks, carried through the control channel.
  Failure placed = Failure::node_lost(1, "no heartbeat for 5 s", Failure::node_place("h1", 1, 2));
  EXPECT_EQ(placed.describe(),
            "the launcher of node 1 was lost (no heartbeat for 5 s): host 'h1', ranks 2-3");
  EXPECT_EQ(Failure::from_json(placed.to_json()).describe(), placed.describe());
  EXPECT_EQ(Failure::node_place("", 3, 1), "rank 3");
  Failure sig = Failure::launcher_signal(0, SIGTERM);
  EXPECT_EQ(sig.describe(), "the launcher of node 0 received SIGTERM");
  EXPECT_FALSE(sig.restartable());
  EXPECT_EQ(sig.job_exit_code(), 143);
  EXPECT_EQ(sig.report_lines(),
            std::vector<std::string>({"smprun: the launcher of node 0 received SIGTERM -- "
                                      "stopping all ranks"}));
  EXPECT_EQ(Failure::launcher_signal(0, SIGINT).job_exit_code(), 130);
}

TEST(Failure, JsonRoundTrip) {
  Failure f = Failure::rank_exit(3, 13, 1, SIGSEGV, {"x", "\xff invalid utf8"});
  nlohmann::json j = nlohmann::json::parse(
      f.to_json().dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
  Failure g = Failure::from_json(j);
  EXPECT_EQ(g.describe(), f.describe());
  EXPECT_EQ(g.tail.size(), 2u);
  EXPECT_EQ(g.tail[0], "x");
  EXPECT_THROW(Failure::from_json(nlohmann::json{{"kind", 0}}), nlohmann::json::exception);
  EXPECT_THROW(Failure::from_json(nlohmann::json{{"kind", 9}}), nlohmann::json::exception);
}

TEST(SignalName, KnownAndUnknown) {
  EXPECT_EQ(signal_name(SIGKILL), "SIGKILL");
  EXPECT_EQ(signal_name(SIGTERM), "SIGTERM");
  EXPECT_EQ(signal_name(200), "signal 200");
}

}  // namespace
}  // namespace smp::launcher
