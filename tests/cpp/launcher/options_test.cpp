// Command-line parsing and validation (launcher/options.h) against real temp files.
#include "launcher/options.h"

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>

#include "launcher/net.h"

namespace smp::launcher {
namespace {

class OptionsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/smprun_options_XXXXXX";
    dir_ = mkdtemp(tmpl);
    script_ = dir_ + "/train.py";
    std::ofstream(script_) << "print('hi')\n";
    exe_ = dir_ + "/tool.sh";
    std::ofstream(exe_) << "#!/bin/sh\nexit 0\n";
    chmod(exe_.c_str(), 0755);
    plain_ = dir_ + "/data.txt";
    std::ofstream(plain_) << "x\n";
    env_ = {{"PATH", "/usr/bin:/bin"}, {"SMP_JOB_SECRET", kSecret}};
  }
  void TearDown() override { std::system(("rm -rf " + dir_).c_str()); }

  ParseResult parse(std::vector<std::string> args) {
    args.insert(args.begin(), "smprun");
    return parse_options(args, env_);
  }
  void expect_error(std::vector<std::string> args, const std::string& fragment) {
    ParseResult r = parse(args);
    EXPECT_EQ(r.status, kExitBadInput) << fragment;
    EXPECT_NE(r.error.find(fragment), std::string::npos) << "error was: " << r.error;
  }

  static constexpr const char* kSecret = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";
  std::string dir_, script_, exe_, plain_;
  EnvMap env_;
};

TEST_F(OptionsTest, SingleNodeDefaults) {
  ParseResult r = parse({script_});
  ASSERT_EQ(r.status, 0) << r.error;
  const LaunchOptions& o = r.options;
  EXPECT_EQ(o.nnodes, 1);
  EXPECT_EQ(o.node_rank, 0);
  EXPECT_EQ(o.nproc_per_node, 1);
  EXPECT_EQ(o.master_addr, "127.0.0.1");
  EXPECT_EQ(o.master_port, 0);  // picked at launch
  EXPECT_FALSE(o.master_port_given);
  EXPECT_EQ(o.config_json, "");
  EXPECT_EQ(o.command, std::vector<std::string>({kDefaultPython, script_}));
}

TEST_F(OptionsTest, ArgumentsAfterProgramAreUntouched) {
  ParseResult r = parse({"--nproc_per_node", "2", script_, "--lr", "3", "--nproc_per_node", "5",
                         "--", "-x"});
  ASSERT_EQ(r.status, 0) << r.error;
  EXPECT_EQ(r.options.nproc_per_node, 2);
  EXPECT_EQ(r.options.command, std::vector<std::string>({kDefaultPython, script_, "--lr", "3",
                                                         "--nproc_per_node", "5", "--", "-x"}));
}

TEST_F(OptionsTest, FlagFormsAndAliases) {
  ParseResult r = parse({"--nproc-per-node=3", "--max_restarts=2", "--tee", "--log_dir", dir_,
                         "--grace_period", "0.5", "--master_port", "1234", exe_, "a"});
  ASSERT_EQ(r.status, 0) << r.error;
  EXPECT_EQ(r.options.nproc_per_node, 3);
  EXPECT_EQ(r.options.max_restarts, 2);
  EXPECT_TRUE(r.options.tee);
  EXPECT_EQ(r.options.log_dir, dir_);
  EXPECT_DOUBLE_EQ(r.options.grace_period_s, 0.5);
  EXPECT_EQ(r.options.master_port, 1234);
  EXPECT_TRUE(r.options.master_port_given);
  EXPECT_EQ(r.options.command, std::vector<std::string>({exe_, "a"}));
}

TEST_F(OptionsTest, ProgramOnPathAndSmpPython) {
  ParseResult r = parse({"sh", "-c", "true"});
  ASSERT_EQ(r.status, 0) << r.error;
  EXPECT_EQ(r.options.command.front(), "/usr/bin/sh");
  env_["SMP_PYTHON"] = "/bin/sh";
  r = parse({script_});
  ASSERT_EQ(r.status, 0) << r.error;
  EXPECT_EQ(r.options.command.front(), "/bin/sh");
}

// smprun installed into a virtual environment (pip install .) or a conda environment
// runs .py programs with that environment's python; elsewhere (build/bin, /usr/local/bin)
// it names none and the built-in default applies.
TEST_F(OptionsTest, EnvironmentPythonBesideSmprun) {
  const std::string bin = dir_ + "/env/bin";
  ASSERT_EQ(std::system(("mkdir -p " + bin).c_str()), 0);
  std::ofstream(bin + "/python") << "#!/bin/sh\n";
  chmod((bin + "/python").c_str(), 0755);
  EXPECT_EQ(environment_python(bin + "/smprun"), "");  // no pyvenv.cfg: not an environment
  std::ofstream(dir_ + "/env/pyvenv.cfg") << "home = /usr/bin\n";
  EXPECT_EQ(environment_python(bin + "/smprun"), bin + "/python");
  EXPECT_EQ(environment_python(dir_ + "/smprun"), "");
  EXPECT_EQ(environment_python("smprun"), "");
  chmod((bin + "/python").c_str(), 0644);
  EXPECT_EQ(environment_python(bin + "/smprun"), "");  // not executable
}

TEST_F(OptionsTest, HelpNamesEveryFlag) {
  ParseResult r = parse({"--help"});
  EXPECT_EQ(r.status, -1);
  for (const char* flag : {"--nnodes", "--node_rank", "--nproc_per_node", "--master_addr",
                           "--master_port", "--config", "--log_dir", "--tee", "--max_restarts",
                           "--rdzv_timeout", "--grace_period", "--heartbeat_timeout", "--job_id",
                           "PROGRAM [ARGS...]"})
    EXPECT_NE(r.help.find(flag), std::string::npos) << flag;
}

TEST_F(OptionsTest, BadInput) {
  expect_error({"--bogus", script_}, "unknown option '--bogus'");
  expect_error({}, "missing PROGRAM");
  expect_error({"--nproc_per_node", "2"}, "missing PROGRAM");
  expect_error({"--nproc_per_node", "0", script_}, "--nproc_per_node must be >= 1, got 0");
  expect_error({"--nproc_per_node", "x", script_}, "--nproc_per_node");
  expect_error({"--nnodes", "2", "--node_rank", "2", "--master_addr", "h", script_},
               "--node_rank 2 is not in [0, 2)");
  expect_error({"--node_rank", "-1", script_}, "--node_rank -1");
  expect_error({"--max_restarts", "-1", script_}, "--max_restarts must be >= 0");
  expect_error({"--master_port", "70000", script_}, "--master_port 70000");
  expect_error({"--master_port", "0", script_}, "--master_port 0");
  expect_error({"--nnodes", "2", "--node_rank", "1", "--master_addr", "h", "--master_port",
                "65535", script_},
               "not in [1, 65534]");
  expect_error({plain_}, "is not executable (and not a .py script)");
  expect_error({dir_ + "/missing.py"}, "not found");
  expect_error({"no-such-tool-xyz"}, "not found on PATH");
  expect_error({"--nnodes", "2", "--node_rank", "1", script_}, "--master_addr is required");
  expect_error({"--rdzv_timeout", "0", script_}, "--rdzv_timeout must be > 0");
  env_["SMP_PYTHON"] = dir_ + "/nopython";
  expect_error({script_}, "is not executable (set SMP_PYTHON)");
}

TEST_F(OptionsTest, ConfigInlineFileAndErrors) {
  ParseResult r = parse({"--config", R"({ "partitions": 2 })", script_});
  ASSERT_EQ(r.status, 0) << r.error;
  EXPECT_EQ(r.options.config_json, R"({"partitions":2})");
  std::string path = dir_ + "/cfg.json";
  std::ofstream(path) << "{\"ddp\": true}\n";
  r = parse({"--config", path, script_});
  ASSERT_EQ(r.status, 0) << r.error;
  EXPECT_EQ(r.options.config_json, R"({"ddp":true})");
  expect_error({"--config", "{bad", script_}, "--config value is not an existing file nor valid JSON");
  std::ofstream(path) << "{\"ddp\": tru";
  expect_error({"--config", path, script_}, "--config file '" + path + "'");
  expect_error({"--config", "[1, 2]", script_}, "must be a JSON object");
}

TEST_F(OptionsTest, SchedulerDefaultsAndFlagsWin) {
  env_ = {{"PATH", "/usr/bin:/bin"},    {"SLURM_JOB_ID", "99"},
          {"SLURM_NNODES", "2"},        {"SLURM_NODEID", "1"},
          {"SLURM_NTASKS_PER_NODE", "4"}, {"SLURM_JOB_NODELIST", "node[01-02]"},
          {"SMP_JOB_SECRET", kSecret}};
  ParseResult r = parse({script_});
  ASSERT_EQ(r.status, 0) << r.error;
  EXPECT_EQ(r.options.nnodes, 2);
  EXPECT_EQ(r.options.node_rank, 1);
  EXPECT_EQ(r.options.nproc_per_node, 4);
  EXPECT_EQ(r.options.master_addr, "node01");
  EXPECT_EQ(r.options.master_port, common::kDefaultMasterPort);
  EXPECT_EQ(r.options.job_id, "99");
  EXPECT_EQ(r.options.defaults_source, "slurm");
  r = parse({"--nnodes", "1", "--node_rank", "0", "--nproc_per_node", "2", "--job_id", "j",
             script_});
  ASSERT_EQ(r.status, 0) << r.error;
  EXPECT_EQ(r.options.nnodes, 1);
  EXPECT_EQ(r.options.nproc_per_node, 2);
  EXPECT_EQ(r.options.master_addr, "127.0.0.1");  // one node: loopback, not node01
  EXPECT_EQ(r.options.master_port, 0);
  EXPECT_EQ(r.options.job_id, "j");
  env_["SLURM_JOB_NODELIST"] = "node[01-";
  expect_error({script_}, "SLURM_JOB_NODELIST");
}

TEST_F(OptionsTest, EnvironmentMasterPortCountsAsGiven) {
  env_["MASTER_PORT"] = "23456";
  ParseResult r = parse({script_});
  ASSERT_EQ(r.status, 0) << r.error;
  EXPECT_EQ(r.options.master_port, 23456);
  EXPECT_TRUE(r.options.master_port_given);
}

TEST(CheckMasterPort, ReportsPortInUse) {
  std::string error;
  int port = pick_free_port("127.0.0.1", &error);
  ASSERT_GT(port, 0) << error;
  LaunchOptions o;
  o.master_port = port;
  o.master_port_given = true;
  EXPECT_EQ(check_master_port(o), "");
  int fd = listen_tcp("127.0.0.1", port, &error);
  ASSERT_GE(fd, 0) << error;
  std::string problem = check_master_port(o);
  EXPECT_NE(problem.find("--master_port " + std::to_string(port)), std::string::npos) << problem;
  EXPECT_NE(problem.find("in use"), std::string::npos) << problem;
  o.node_rank = 1;  // only node 0 checks
  o.nnodes = 2;
  EXPECT_EQ(check_master_port(o), "");
  close(fd);
}

// Note [Job secret]: where the secret comes from, and what is refused.
TEST_F(OptionsTest, JobSecretIsDrawnOnOneNodeAndRequiredAcrossNodes) {
  env_.erase("SMP_JOB_SECRET");
  ParseResult a = parse({script_}), b = parse({script_});
  ASSERT_EQ(a.status, 0) << a.error;
  EXPECT_TRUE(a.options.secret_drawn);
  EXPECT_EQ(a.options.secret.size(), 64u);
  EXPECT_NE(a.options.secret, b.options.secret);  // one per job
  expect_error({"--nnodes", "2", "--node_rank", "1", "--master_addr", "h", script_},
               "a job on 2 nodes needs a secret shared by every node's smprun");
}

TEST_F(OptionsTest, JobSecretFromEnvironmentOrFile) {
  ParseResult r = parse({"--nnodes", "2", "--node_rank", "1", "--master_addr", "h", script_});
  ASSERT_EQ(r.status, 0) << r.error;
  EXPECT_EQ(r.options.secret, kSecret);
  EXPECT_FALSE(r.options.secret_drawn);
  const std::string file = dir_ + "/secret";
  std::ofstream(file) << "ffeeddccbbaa99887766554433221100ffeeddccbbaa99887766554433221100\n";
  r = parse({"--secret_file", file, script_});  // the flag wins over the environment
  ASSERT_EQ(r.status, 0) << r.error;
  EXPECT_EQ(r.options.secret, "ffeeddccbbaa99887766554433221100ffeeddccbbaa99887766554433221100");
  env_.erase("SMP_JOB_SECRET");
  env_["SMP_JOB_SECRET_FILE"] = file;
  r = parse({script_});
  ASSERT_EQ(r.status, 0) << r.error;
  EXPECT_EQ(r.options.secret.substr(0, 4), "ffee");
}

TEST_F(OptionsTest, MalformedJobSecretsNameTheirSource) {
  env_["SMP_JOB_SECRET"] = "not-hex-not-hex-not-hex-not-hex-not-hex!";
  expect_error({script_}, "SMP_JOB_SECRET holds a character that is not a hex digit");
  env_["SMP_JOB_SECRET"] = "abcd";
  expect_error({script_}, "SMP_JOB_SECRET must be an even number of hex digits, at least 32");
  env_.erase("SMP_JOB_SECRET");
  expect_error({"--secret_file", dir_ + "/missing", script_}, "--secret_file '" + dir_ + "/missing' cannot be read");
}

}  // namespace
}  // namespace smp::launcher
