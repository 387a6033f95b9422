// Rank environment (pure) and spawn_rank (real fork/exec of /bin/sh).
#include "launcher/rank_process.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>
#include <vector>

namespace smp::launcher {
namespace {

LaunchOptions two_by_two() {
  LaunchOptions o;
  o.nnodes = 2;
  o.node_rank = 1;
  o.nproc_per_node = 2;
  o.master_addr = "10.1.2.3";
  return o;
}

TEST(RankEnvironment, SetsTheRankVariables) {
  EnvMap env = rank_environment({{"HOME", "/root"}}, two_by_two(), 1, 3, 4567, 8);
  EXPECT_EQ(env["HOME"], "/root");
  EXPECT_EQ(env["RANK"], "3");
  EXPECT_EQ(env["WORLD_SIZE"], "4");
  EXPECT_EQ(env["LOCAL_RANK"], "1");
  EXPECT_EQ(env["LOCAL_WORLD_SIZE"], "2");
  EXPECT_EQ(env["NODE_RANK"], "1");
  EXPECT_EQ(env["MASTER_ADDR"], "10.1.2.3");
  EXPECT_EQ(env["MASTER_PORT"], "4567");
  EXPECT_EQ(env["SMP_RESTART_COUNT"], "3");
  EXPECT_EQ(env["OMP_NUM_THREADS"], "4");
  EXPECT_EQ(env["OPENBLAS_NUM_THREADS"], "4");
  EXPECT_EQ(env["PYTHONUNBUFFERED"], "1");
  EXPECT_EQ(env.count("SMP_CONFIG"), 0u);
}

TEST(RankEnvironment, ConfigThreadsAndUserSettings) {
  LaunchOptions o = two_by_two();
  o.config_json = R"({"partitions":2})";
  EnvMap env = rank_environment({{"OMP_NUM_THREADS", "7"}, {"SMP_CONFIG", "old"}}, o, 0, 0, 1, 1);
  EXPECT_EQ(env["SMP_CONFIG"], R"({"partitions":2})");
  EXPECT_EQ(env["OMP_NUM_THREADS"], "7");       // the user's setting wins
  EXPECT_EQ(env["OPENBLAS_NUM_THREADS"], "1");  // max(1, 1 core / 2 ranks)
  o.config_json.clear();
  env = rank_environment({{"SMP_CONFIG", "kept"}}, o, 0, 0, 1, 1);
  EXPECT_EQ(env["SMP_CONFIG"], "kept");  // no --config: an inherited SMP_CONFIG stays
}

TEST(UsableCores, AtLeastOne) { EXPECT_GE(usable_cores(), 1); }

TEST(CoreBinding, ContiguousDisjointBlocksThatCoverTheCpus) {
  const std::vector<int> cpus = {0, 1, 2, 3, 4, 5, 8, 9, 10, 11};  // a gap: 6 and 7 not ours
  std::vector<int> seen;
  for (int l = 0; l < 4; ++l) {
    const std::vector<int> block = rank_cpu_block(cpus, 4, l);
    EXPECT_EQ(block.size(), l < 2 ? 3u : 2u) << "local rank " << l;  // 10 = 3 + 3 + 2 + 2
    seen.insert(seen.end(), block.begin(), block.end());
  }
  EXPECT_EQ(seen, cpus);  // in order, each CPU once
  EXPECT_EQ(rank_cpu_block({0, 1}, 2, 1), std::vector<int>({1}));
  EXPECT_EQ(rank_cpu_block({0, 1}, 1, 0), std::vector<int>({0, 1}));
  EXPECT_TRUE(rank_cpu_block({0, 1}, 3, 0).empty());
  EXPECT_EQ(bind_cores_error({0, 1}, 2), "");
  const std::string e = bind_cores_error({0, 1}, 3);
  EXPECT_NE(e.find("--bind_cores"), std::string::npos) << e;
  EXPECT_NE(e.find("--nproc_per_node 3"), std::string::npos) << e;
  EXPECT_NE(e.find("<= 2"), std::string::npos) << e;
  const std::vector<int> mine = usable_cpu_list();
  EXPECT_EQ(static_cast<int>(mine.size()), usable_cores());
}

std::string read_all(int fd) {
  std::string out;
  char buf[256];
  ssize_t n;
  while ((n = read(fd, buf, sizeof(buf))) > 0) out.append(buf, static_cast<size_t>(n));
  return out;
}

TEST(SpawnRank, OwnProcessGroupEnvAndPipes) {
  int out[2], err[2];
  ASSERT_EQ(pipe(out), 0);
  ASSERT_EQ(pipe(err), 0);
  std::string error;
  pid_t pid = spawn_rank({"/bin/sh", "-c", "echo $FOO; read x; echo \"[$x]\" >&2; exit 3"},
                         {{"FOO", "bar"}}, out[1], err[1], &error);
  ASSERT_GT(pid, 0) << error;
  close(out[1]);
  close(err[1]);
  EXPECT_EQ(getpgid(pid), pid);
  EXPECT_EQ(read_all(out[0]), "bar\n");
  EXPECT_EQ(read_all(err[0]), "[]\n");  // stdin is /dev/null
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 3);
  close(out[0]);
  close(err[0]);
}

TEST(SpawnRank, ExecFailureExits127WithMessage) {
  int out[2], err[2];
  ASSERT_EQ(pipe(out), 0);
  ASSERT_EQ(pipe(err), 0);
  std::string error;
  pid_t pid = spawn_rank({"/nonexistent/prog"}, {}, out[1], err[1], &error);
  ASSERT_GT(pid, 0) << error;
  close(out[1]);
  close(err[1]);
  EXPECT_EQ(read_all(err[0]),
            "smprun: cannot execute '/nonexistent/prog': No such file or directory\n");
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  EXPECT_EQ(WEXITSTATUS(status), 127);
  close(out[0]);
  close(err[0]);
}

TEST(SpawnRank, BindsTheChildToItsCpus) {
  const std::vector<int> mine = usable_cpu_list();
  const std::vector<int> one = {mine.back()};
  int out[2], err[2];
  ASSERT_EQ(pipe(out), 0);
  ASSERT_EQ(pipe(err), 0);
  std::string error;
  // Every thread of the child is bound, not only its first (the kernel's own list).
  pid_t pid = spawn_rank({"/bin/sh", "-c", "grep Cpus_allowed_list /proc/self/status"}, {},
                         out[1], err[1], &error, one);
  ASSERT_GT(pid, 0) << error;
  close(out[1]);
  close(err[1]);
  EXPECT_EQ(read_all(out[0]), "Cpus_allowed_list:\t" + std::to_string(one[0]) + "\n");
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  EXPECT_EQ(WEXITSTATUS(status), 0);
  close(out[0]);
  close(err[0]);
}

}  // namespace
}  // namespace smp::launcher
