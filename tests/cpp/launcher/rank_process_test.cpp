// Rank environment (pure) and spawn_rank (real fork/exec of /bin/sh).
#include "launcher/rank_process.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>

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

}  // namespace
}  // namespace smp::launcher
