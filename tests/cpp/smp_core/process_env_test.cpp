// ProcessEnv (smp_core/runtime.h): the one parser of RANK, WORLD_SIZE, LOCAL_RANK,
// LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, used by smp::init and, through
// _C.process_env, by Python's smp.init. Valid, missing and malformed values; every
// error names the variable and its value.
#include "smp_core/runtime.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <initializer_list>
#include <map>
#include <string>

#include "smp_core/errors.h"

namespace smp {
namespace {

using Vars = std::map<std::string, std::string>;

std::string error_of(const Vars& vars) {
  try {
    ProcessEnv::from_variables(vars);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

TEST(ProcessEnv, NoRankIsAWorldOfOne) {
  for (const Vars& vars : {Vars{}, Vars{{"MASTER_PORT", "junk"}, {"WORLD_SIZE", "x"}},
                           Vars{{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}},
                           Vars{{"OMPI_COMM_WORLD_RANK", "0"}}}) {
    ProcessEnv e = ProcessEnv::from_variables(vars);
    EXPECT_EQ(e.rank, 0);
    EXPECT_EQ(e.world_size, 1);
    EXPECT_EQ(e.local_rank, 0);
    EXPECT_EQ(e.local_size, 1);
    EXPECT_EQ(e.master_port, 0);
    EXPECT_FALSE(e.torchelastic);
  }
}

TEST(ProcessEnv, EveryVariableIsRead) {
  ProcessEnv e = ProcessEnv::from_variables({{"RANK", "5"}, {"WORLD_SIZE", "8"},
                                             {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "4"},
                                             {"MASTER_ADDR", "node7"}, {"MASTER_PORT", "29501"}});
  EXPECT_EQ(e.rank, 5);
  EXPECT_EQ(e.world_size, 8);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_size, 4);
  EXPECT_EQ(e.master_addr, "node7");
  EXPECT_EQ(e.master_port, 29501);
  EXPECT_FALSE(e.torchelastic);
}

TEST(ProcessEnv, Defaults) {
  // LOCAL_* default to the global values; MASTER_ADDR to loopback (also when empty).
  for (const char* addr : std::initializer_list<const char*>{"", nullptr}) {
    Vars vars{{"RANK", "1"}, {"WORLD_SIZE", "3"}, {"MASTER_PORT", "1234"}};
    if (addr) vars["MASTER_ADDR"] = addr;
    ProcessEnv e = ProcessEnv::from_variables(vars);
    EXPECT_EQ(e.local_rank, 1);
    EXPECT_EQ(e.local_size, 3);
    EXPECT_EQ(e.master_addr, "127.0.0.1");
    EXPECT_EQ(e.master_port, 1234);
  }
  // A world of 1 needs no rendezvous: MASTER_* are not read, not even a malformed one.
  ProcessEnv one = ProcessEnv::from_variables(
      {{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"MASTER_PORT", "x"}, {"MASTER_ADDR", "h"}});
  EXPECT_EQ(one.world_size, 1);
  EXPECT_EQ(one.master_port, 0);
  EXPECT_EQ(one.master_addr, "127.0.0.1");
}

TEST(ProcessEnv, BlanksAroundIntegersAreAllowed) {
  ProcessEnv e = ProcessEnv::from_variables(
      {{"RANK", " 1"}, {"WORLD_SIZE", "2 "}, {"MASTER_PORT", "\t80\n"}});
  EXPECT_EQ(e.rank, 1);
  EXPECT_EQ(e.world_size, 2);
  EXPECT_EQ(e.master_port, 80);
}

TEST(ProcessEnv, TorchrunNeedsNoMasterPort) {
  // torchrun's agent hosts the store; torch's env:// handler reads MASTER_* itself.
  ProcessEnv e = ProcessEnv::from_variables(
      {{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"TORCHELASTIC_RUN_ID", "none"}});
  EXPECT_TRUE(e.torchelastic);
  EXPECT_EQ(e.master_port, 0);
  EXPECT_FALSE(ProcessEnv::from_variables({{"RANK", "0"}, {"WORLD_SIZE", "1"},
                                           {"TORCHELASTIC_RUN_ID", ""}})
                   .torchelastic);
}

TEST(ProcessEnv, MissingVariablesAreNamed) {
  EXPECT_EQ(error_of({{"RANK", "1"}}), "smp: environment WORLD_SIZE is not set, but RANK=1 is");
  EXPECT_EQ(error_of({{"RANK", "1"}, {"WORLD_SIZE", ""}}),
            "smp: environment WORLD_SIZE is not set, but RANK=1 is");
  EXPECT_EQ(error_of({{"RANK", "1"}, {"WORLD_SIZE", "2"}}),
            "smp: environment MASTER_PORT is not set (RANK=1, WORLD_SIZE=2); set MASTER_ADDR "
            "and MASTER_PORT to rank 0's host and a free port, or launch with smprun or "
            "torchrun");
  EXPECT_EQ(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "0"}}),
            "smp: environment MASTER_PORT is not set (RANK=0, WORLD_SIZE=2); set MASTER_ADDR "
            "and MASTER_PORT to rank 0's host and a free port, or launch with smprun or "
            "torchrun");
}

TEST(ProcessEnv, MalformedValuesAreNamedWithTheirValue) {
  EXPECT_EQ(error_of({{"RANK", "one"}, {"WORLD_SIZE", "2"}}),
            "smp: environment RANK='one' is not an integer");
  EXPECT_EQ(error_of({{"RANK", ""}, {"WORLD_SIZE", "2"}}),
            "smp: environment RANK='' is not an integer");
  EXPECT_EQ(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2x"}}),
            "smp: environment WORLD_SIZE='2x' is not an integer");
  EXPECT_EQ(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "1.5"}}),
            "smp: environment LOCAL_RANK='1.5' is not an integer");
  EXPECT_EQ(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_WORLD_SIZE", "two"}}),
            "smp: environment LOCAL_WORLD_SIZE='two' is not an integer");
  EXPECT_EQ(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "29500:1"}}),
            "smp: environment MASTER_PORT='29500:1' is not an integer");
  EXPECT_EQ(error_of({{"RANK", "0"}, {"WORLD_SIZE", "99999999999"}}),
            "smp: environment WORLD_SIZE='99999999999' is not an integer");
}

TEST(ProcessEnv, OutOfRangeValuesAreNamedWithTheirValue) {
  EXPECT_EQ(error_of({{"RANK", "2"}, {"WORLD_SIZE", "2"}}),
            "smp: environment RANK=2 is not in [0, WORLD_SIZE=2)");
  EXPECT_EQ(error_of({{"RANK", "-1"}, {"WORLD_SIZE", "2"}}),
            "smp: environment RANK=-1 is not in [0, WORLD_SIZE=2)");
  EXPECT_EQ(error_of({{"RANK", "0"}, {"WORLD_SIZE", "0"}}),
            "smp: environment WORLD_SIZE=0 is not an integer >= 1");
  EXPECT_EQ(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "70000"}}),
            "smp: environment MASTER_PORT=70000 is not a port in [1, 65535]");
}

TEST(ProcessEnv, OneOfSeveralRanksWithoutRankIsRefused) {
  EXPECT_EQ(error_of({{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "2"}}),
            "smp: environment RANK is not set, but SLURM_PROCID=1 and SLURM_NTASKS=2 say this "
            "is one of several ranks; smp::init (C++) reads RANK, WORLD_SIZE, LOCAL_RANK, "
            "LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT: export them, or launch with smprun");
  // Note [Open MPI before SLURM] (python/smp/launch_env.py): mpirun's variables win.
  EXPECT_EQ(error_of({{"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "4"},
                      {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}}),
            "smp: environment RANK is not set, but OMPI_COMM_WORLD_RANK=3 and "
            "OMPI_COMM_WORLD_SIZE=4 say this is one of several ranks; smp::init (C++) reads "
            "RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT: "
            "export them, or launch with smprun");
  EXPECT_EQ(error_of({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "many"}}),
            "smp: environment SLURM_NTASKS='many' is not an integer");
}

TEST(ProcessEnv, EnvIntReadsOneVariable) {
  const Vars vars{{"A", "7"}, {"E", ""}, {"B", "x7"}};
  EXPECT_EQ(env_int("A", 3, &vars), 7);
  EXPECT_EQ(env_int("E", 3, &vars), 3);
  EXPECT_EQ(env_int("MISSING", -2, &vars), -2);
  try {
    env_int("B", 0, &vars);
    FAIL() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_STREQ(e.what(), "smp: environment B='x7' is not an integer");
  }
}

// The process's own environment takes the same path (smp::init's).
TEST(ProcessEnv, FromTheProcessEnvironment) {
  const char* names[] = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                         "MASTER_PORT", "TORCHELASTIC_RUN_ID", "OMPI_COMM_WORLD_RANK",
                         "SLURM_PROCID"};
  std::map<std::string, std::string> saved;
  for (const char* n : names) {
    if (const char* v = std::getenv(n)) saved[n] = v;
    unsetenv(n);
  }
  setenv("RANK", "1", 1);
  setenv("WORLD_SIZE", "2", 1);
  setenv("MASTER_PORT", "4567", 1);
  ProcessEnv e = ProcessEnv::from_environment();
  EXPECT_EQ(e.rank, 1);
  EXPECT_EQ(e.world_size, 2);
  EXPECT_EQ(e.local_size, 2);
  EXPECT_EQ(e.master_addr, "127.0.0.1");
  EXPECT_EQ(e.master_port, 4567);
  EXPECT_EQ(env_int("MASTER_PORT", 0), 4567);
  setenv("WORLD_SIZE", "zwei", 1);
  std::string error;
  try {
    ProcessEnv::from_environment();
  } catch (const ConfigError& x) {
    error = x.what();
  }
  EXPECT_EQ(error, "smp: environment WORLD_SIZE='zwei' is not an integer");
  for (const char* n : names) unsetenv(n);
  for (const auto& [n, v] : saved) setenv(n.c_str(), v.c_str(), 1);
}

}  // namespace
}  // namespace smp
