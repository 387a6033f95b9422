// Scheduler environment mappings (launcher/scheduler_env.h), pure functions over an EnvMap.
#include "launcher/scheduler_env.h"

#include <gtest/gtest.h>

namespace smp::launcher {
namespace {

using Hosts = std::vector<std::string>;

TEST(SlurmNodelist, ExpandsPlainAndBracketedHosts) {
  EXPECT_EQ(expand_slurm_nodelist("gpu5"), Hosts({"gpu5"}));
  EXPECT_EQ(expand_slurm_nodelist("a,b,c"), Hosts({"a", "b", "c"}));
  EXPECT_EQ(expand_slurm_nodelist("node[01-04,07],gpu5"),
            Hosts({"node01", "node02", "node03", "node04", "node07", "gpu5"}));
  EXPECT_EQ(expand_slurm_nodelist("n[8-11]"), Hosts({"n8", "n9", "n10", "n11"}));
  EXPECT_EQ(expand_slurm_nodelist("n[098-101]"), Hosts({"n098", "n099", "n100", "n101"}));
  EXPECT_EQ(expand_slurm_nodelist("rack[1-2]-n[1,3]"),
            Hosts({"rack1-n1", "rack1-n3", "rack2-n1", "rack2-n3"}));
  EXPECT_EQ(expand_slurm_nodelist("c[3]x"), Hosts({"c3x"}));
}

TEST(SlurmNodelist, RejectsMalformedLists) {
  EXPECT_TRUE(expand_slurm_nodelist("a,,b").empty());
  for (const char* bad : {"", "node[01-04", "node01-04]", "n[]", "n[4-2]", "n[a-b]", "n[1-]"}) {
    EXPECT_TRUE(expand_slurm_nodelist(bad).empty()) << bad;
    EXPECT_EQ(first_slurm_host(bad), "") << bad;
  }
}

TEST(SlurmNodelist, FirstHost) {
  EXPECT_EQ(first_slurm_host("node[01-04,07],gpu5"), "node01");
  EXPECT_EQ(first_slurm_host("gpu5,node[01-04]"), "gpu5");
  EXPECT_EQ(first_slurm_host("ip-10-0-0-[5-9]"), "ip-10-0-0-5");
}

TEST(SlurmDefaults, MapsEveryField) {
  EnvMap env = {{"SLURM_JOB_ID", "4242"},
                {"SLURM_NNODES", "4"},
                {"SLURM_NODEID", "2"},
                {"SLURM_NTASKS_PER_NODE", "8(x4)"},
                {"SLURM_JOB_NODELIST", "node[01-04,07],gpu5"}};
  SchedulerDefaults d = slurm_defaults(env);
  EXPECT_EQ(d.source, "slurm");
  EXPECT_EQ(d.nnodes, 4);
  EXPECT_EQ(d.node_rank, 2);
  EXPECT_EQ(d.nproc_per_node, 8);
  EXPECT_EQ(d.master_addr, "node01");
  EXPECT_EQ(d.job_id, "4242");
  EXPECT_FALSE(d.master_port);
  EXPECT_EQ(d.error, "");
}

TEST(SlurmDefaults, FallbackNamesAndAbsence) {
  EXPECT_TRUE(slurm_defaults({}).empty());
  EXPECT_TRUE(slurm_defaults({{"PATH", "/bin"}}).source.empty());
  SchedulerDefaults d = slurm_defaults(
      {{"SLURM_JOB_NUM_NODES", "2"}, {"SLURM_NODEID", "0"}, {"SLURM_NODELIST", "gpu[7-8]"}});
  EXPECT_EQ(d.nnodes, 2);
  EXPECT_EQ(d.master_addr, "gpu7");
  EXPECT_FALSE(d.nproc_per_node);
  SchedulerDefaults bad = slurm_defaults({{"SLURM_NODEID", "0"}, {"SLURM_JOB_NODELIST", "n[1-"}});
  EXPECT_NE(bad.error.find("SLURM_JOB_NODELIST='n[1-'"), std::string::npos) << bad.error;
}

TEST(OpenMpiDefaults, OneLauncherPerNode) {
  EnvMap env = {{"OMPI_COMM_WORLD_SIZE", "3"},
                {"OMPI_COMM_WORLD_RANK", "1"},
                {"OMPI_COMM_WORLD_LOCAL_SIZE", "1"},
                {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
                {"OMPI_COMM_WORLD_NODE_RANK", "0"},
                {"OMPI_MCA_ess_base_jobid", "77"}};
  SchedulerDefaults d = openmpi_defaults(env);
  EXPECT_EQ(d.source, "openmpi");
  EXPECT_EQ(d.nnodes, 3);
  EXPECT_EQ(d.node_rank, 1);
  EXPECT_FALSE(d.nproc_per_node);
  EXPECT_FALSE(d.master_addr);
  EXPECT_EQ(d.job_id, "77");
  EXPECT_EQ(d.error, "");
}

TEST(OpenMpiDefaults, SeveralLaunchersPerNodeIsAnError) {
  SchedulerDefaults d = openmpi_defaults({{"OMPI_COMM_WORLD_SIZE", "8"},
                                          {"OMPI_COMM_WORLD_RANK", "5"},
                                          {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}});
  EXPECT_NE(d.error.find("OMPI_COMM_WORLD_LOCAL_SIZE=4"), std::string::npos) << d.error;
  EXPECT_TRUE(openmpi_defaults({{"OMPI_COMM_WORLD_SIZE", "8"}}).source.empty());
}

TEST(SageMakerDefaults, SortedHostsGpusFirst) {
  EnvMap env = {{"SM_HOSTS", R"(["algo-2","algo-1","algo-3"])"},
                {"SM_CURRENT_HOST", "algo-2"},
                {"SM_NUM_GPUS", "8"},
                {"SM_NUM_CPUS", "96"},
                {"TRAINING_JOB_NAME", "job-x"}};
  SchedulerDefaults d = sagemaker_defaults(env);
  EXPECT_EQ(d.source, "sagemaker");
  EXPECT_EQ(d.nnodes, 3);
  EXPECT_EQ(d.node_rank, 1);
  EXPECT_EQ(d.master_addr, "algo-1");
  EXPECT_EQ(d.nproc_per_node, 8);
  EXPECT_EQ(d.job_id, "job-x");
  env["SM_NUM_GPUS"] = "0";
  EXPECT_EQ(sagemaker_defaults(env).nproc_per_node, 96);
}

TEST(SageMakerDefaults, Errors) {
  EXPECT_NE(sagemaker_defaults({{"SM_HOSTS", "algo-1"}}).error.find("not a JSON list"),
            std::string::npos);
  EXPECT_NE(sagemaker_defaults({{"SM_HOSTS", "[]"}}).error.find("empty"), std::string::npos);
  auto d = sagemaker_defaults({{"SM_HOSTS", R"(["a","b"])"}, {"SM_CURRENT_HOST", "c"}});
  EXPECT_NE(d.error.find("SM_CURRENT_HOST='c' is not in SM_HOSTS"), std::string::npos) << d.error;
}

TEST(GenericDefaults, MasterAddrAndPort) {
  auto d = generic_defaults({{"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "1234"}});
  EXPECT_EQ(d.source, "env");
  EXPECT_EQ(d.master_addr, "10.0.0.1");
  EXPECT_EQ(d.master_port, 1234);
  EXPECT_NE(generic_defaults({{"MASTER_PORT", "12x"}}).error.find("MASTER_PORT='12x'"),
            std::string::npos);
  EXPECT_TRUE(generic_defaults({}).empty());
}

TEST(MergedDefaults, PrecedenceIsGenericSlurmOpenMpiSageMaker) {
  EnvMap env = {{"MASTER_ADDR", "explicit"},   {"SLURM_JOB_ID", "1"},
                {"SLURM_NNODES", "2"},         {"SLURM_NODEID", "1"},
                {"SLURM_JOB_NODELIST", "s[1-2]"}, {"SM_HOSTS", R"(["x","y","z"])"},
                {"SM_CURRENT_HOST", "z"},      {"SM_NUM_GPUS", "4"}};
  SchedulerDefaults d = merged_defaults(env);
  EXPECT_EQ(d.source, "env+slurm+sagemaker");
  EXPECT_EQ(d.master_addr, "explicit");
  EXPECT_EQ(d.nnodes, 2);
  EXPECT_EQ(d.node_rank, 1);
  EXPECT_EQ(d.nproc_per_node, 4);  // SLURM gave none: SageMaker's fills it
  EXPECT_EQ(d.job_id, "1");
  EXPECT_TRUE(merged_defaults({}).source.empty());
}

TEST(SlurmTasksOnNode, CompressedCountsPerNode) {
  // SLURM_TASKS_PER_NODE "2(x3),1": nodes 0-2 run 2 tasks, node 3 runs 1.
  for (int node = 0; node < 3; ++node) EXPECT_EQ(slurm_tasks_on_node("2(x3),1", node), 2);
  EXPECT_EQ(slurm_tasks_on_node("2(x3),1", 3), 1);
  EXPECT_EQ(slurm_tasks_on_node("4", 0), 4);
  EXPECT_FALSE(slurm_tasks_on_node("2(x3),1", 4));  // outside the list
  EXPECT_FALSE(slurm_tasks_on_node("4", -1));
  for (const char* bad : {"", "x", "2(x", "2(x0)", "2(3)", "2,,1", "-1"})
    EXPECT_FALSE(slurm_tasks_on_node(bad, 0)) << bad;
  // smprun takes this node's count, not the first node's.
  SchedulerDefaults d = slurm_defaults(
      {{"SLURM_JOB_ID", "1"}, {"SLURM_NODEID", "3"}, {"SLURM_NTASKS_PER_NODE", "2(x3),1"}});
  EXPECT_EQ(d.nproc_per_node, 1);
}

}  // namespace
}  // namespace smp::launcher
