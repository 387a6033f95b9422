#include "smp_core/config.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

namespace smp {
namespace {

std::string error_of(const std::string& json, int rank = -1) {
  try {
    Config::from_json(json, rank);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

TEST(Config, DefaultsMatchApi) {
  Config c = Config::from_json("{}");
  EXPECT_EQ(c.partitions, 1);
  EXPECT_EQ(c.microbatches, 1);
  EXPECT_EQ(c.pipeline, "interleaved");
  EXPECT_FALSE(c.ddp);
  EXPECT_EQ(c.placement_strategy, "cluster");
  EXPECT_EQ(c.optimize, "speed");
  EXPECT_TRUE(c.auto_partition);
  EXPECT_EQ(c.default_partition, 0);
  EXPECT_DOUBLE_EQ(c.memory_weight, 0.2);  // SMP: 0.2 for speed
  EXPECT_EQ(c.active_microbatches, 3);     // partitions + 2
  EXPECT_TRUE(c.contiguous);
  EXPECT_EQ(c.backend, "auto");
  EXPECT_DOUBLE_EQ(c.timeout_s, 300.0);
  EXPECT_EQ(Config::from_json("").to_json(), c.to_json());
}

TEST(Config, EveryKeyParses) {
  Config c = Config::from_json(R"({"partitions": 4, "microbatches": 8, "pipeline": "simple",
      "ddp": true, "placement_strategy": "spread", "optimize": "memory",
      "auto_partition": false, "default_partition": 3, "active_microbatches": 2,
      "contiguous": true, "backend": "gloo", "timeout_s": 1.5, "skip_tracing": true,
      "tensor_parallel_degree": 2, "prescaled_batch": true, "deterministic_server": true,
      "ddp_port": 1234, "activation_loading_horizon": 4, "fp16_params": false,
      "fast_mode": true, "static_mode": false})");
  EXPECT_EQ(c.partitions, 4);
  EXPECT_EQ(c.tensor_parallel_degree, 2);
  EXPECT_TRUE(c.prescaled_batch);
  EXPECT_NE(c.ignored_json.find("\"fast_mode\":true"), std::string::npos) << c.ignored_json;
  EXPECT_EQ(c.microbatches, 8);
  EXPECT_EQ(c.pipeline, "simple");
  EXPECT_TRUE(c.ddp);
  EXPECT_EQ(c.placement_strategy, "spread");
  EXPECT_DOUBLE_EQ(c.memory_weight, 0.8);  // optimize=memory
  EXPECT_FALSE(c.auto_partition);
  EXPECT_EQ(c.default_partition, 3);
  EXPECT_EQ(c.active_microbatches, 2);
  EXPECT_EQ(c.backend, "gloo");
  EXPECT_DOUBLE_EQ(c.timeout_s, 1.5);
  EXPECT_TRUE(c.skip_tracing);
}

TEST(Config, DependentDefaults) {
  EXPECT_EQ(Config::from_json(R"({"partitions": 5})").active_microbatches, 7);
  EXPECT_DOUBLE_EQ(Config::from_json(R"({"optimize": "memory", "memory_weight": 0.3})").memory_weight, 0.3);
  EXPECT_EQ(Config::from_json(R"({"ddp_dist_backend": "gloo"})").backend, "gloo");
}

TEST(Config, PipelineParallelDegreeIsAnAlias) {
  EXPECT_EQ(Config::from_json(R"({"pipeline_parallel_degree": 2})").partitions, 2);
  EXPECT_EQ(Config::from_json(R"({"pipeline_parallel_degree": 2, "partitions": 2})").partitions, 2);
  EXPECT_EQ(error_of(R"({"pipeline_parallel_degree": 2, "partitions": 4})"),
            "smp: config 'partitions'=4 and its alias 'pipeline_parallel_degree'=2 disagree");
}

TEST(Config, BadValuesNameKeyValueAndAllowed) {
  EXPECT_EQ(error_of(R"({"pipeline": "gpipe"})", 3),
            "smp: config 'pipeline'='gpipe' is not one of {interleaved, simple, 1f1b, zero_bubble} "
            "(rank 3)");
  EXPECT_EQ(Config::from_json(R"({"pipeline": "1f1b"})").pipeline, "1f1b");
  EXPECT_EQ(error_of(R"({"pipeline_order": "static"})"),
            "smp: config 'pipeline_order'='static' is not one of {dynamic, planned}");
  EXPECT_EQ(Config::from_json(R"({"pipeline_order": "dynamic"})").pipeline_order, "dynamic");
  EXPECT_EQ(Config::from_json("{}").pipeline_order, "planned");  // every schedule's default
  EXPECT_EQ(error_of(R"({"checkpoint_dir": 3})"), "smp: config 'checkpoint_dir'=3 is not a string");
  EXPECT_EQ(Config::from_json(R"({"checkpoint_dir": "/ckpt"})").checkpoint_dir, "/ckpt");
  EXPECT_EQ(Config().checkpoint_dir, "");
  // zero_bubble runs its plan: "planned" by default, "dynamic" refused by name.
  EXPECT_EQ(Config::from_json(R"({"pipeline": "zero_bubble"})").pipeline_order, "planned");
  EXPECT_EQ(Config::from_json(R"({"pipeline": "zero_bubble", "pipeline_order": "planned"})")
                .pipeline_order, "planned");
  EXPECT_EQ(error_of(R"({"pipeline": "zero_bubble", "pipeline_order": "dynamic"})"),
            "smp: config 'pipeline_order'='dynamic' is not usable with 'pipeline'='zero_bubble', "
            "which places its weight-gradient actions by its plan; use \"planned\" or leave "
            "'pipeline_order' unset");
  EXPECT_EQ(error_of(R"({"partitions": 0})"),
            "smp: config 'partitions'=0 is not an integer in [1, 1073741824]");
  EXPECT_EQ(error_of(R"({"partitions": 2.5})"),
            "smp: config 'partitions'=2.5 is not an integer in [1, 1073741824]");
  EXPECT_EQ(error_of(R"({"partitions": "2"})"),
            "smp: config 'partitions'='2' is not an integer in [1, 1073741824]");  // a string, quoted
  EXPECT_EQ(error_of(R"({"microbatches": -1})"),
            "smp: config 'microbatches'=-1 is not an integer in [1, 1073741824]");
  EXPECT_EQ(error_of(R"({"ddp": "yes"})"), "smp: config 'ddp'='yes' is not one of {true, false}");
  EXPECT_EQ(error_of(R"({"ddp": 1})"), "smp: config 'ddp'=1 is not one of {true, false}");
  EXPECT_EQ(error_of(R"({"placement_strategy": "far"})"),
            "smp: config 'placement_strategy'='far' is not one of {cluster, spread, DPT, DTP, "
            "PDT, PTD, TDP, TPD}");
  EXPECT_EQ(error_of(R"({"optimize": "fast"})"),
            "smp: config 'optimize'='fast' is not one of {speed, memory}");
  EXPECT_EQ(error_of(R"({"auto_partition": null})"),
            "smp: config 'auto_partition'=null is not one of {true, false}");
  EXPECT_EQ(error_of(R"({"partitions": 2, "default_partition": 2})"),
            "smp: config 'default_partition'=2 is not an integer in [0, 1]");
  EXPECT_EQ(error_of(R"({"memory_weight": 1.5})"),
            "smp: config 'memory_weight'=1.5 is not a number in [0, 1]");
  EXPECT_EQ(error_of(R"({"active_microbatches": 0})"),
            "smp: config 'active_microbatches'=0 is not an integer in [1, 1073741824]");
  EXPECT_EQ(error_of(R"({"contiguous": false})"),
            "smp: config 'contiguous'=false is not supported: partitions are always contiguous (true)");
  EXPECT_EQ(error_of(R"({"backend": "mpi"})"),
            "smp: config 'backend'='mpi' is not one of {auto, gloo, nccl}");
  EXPECT_EQ(error_of(R"({"timeout_s": 0})"), "smp: config 'timeout_s'=0 is not a number in (0, 1e+07]");
  EXPECT_EQ(error_of(R"({"skip_tracing": 0})"),
            "smp: config 'skip_tracing'=0 is not one of {true, false}");
  EXPECT_EQ(error_of(R"({"tensor_parallel_degree": 2})"),
            "smp: config 'ddp'=false is not allowed with 'tensor_parallel_degree'=2 (tensor "
            "parallelism needs 'ddp': true)");
  EXPECT_EQ(error_of(R"({"tensor_parallel_degree": 0, "ddp": true})"),
            "smp: config 'tensor_parallel_degree'=0 is not an integer in [1, 1073741824]");
  EXPECT_EQ(error_of(R"({"ddp_port": "x"})"), "smp: config 'ddp_port'='x' is not an integer >= 0");
}

TEST(Config, UnknownKeysSuggest) {
  EXPECT_EQ(error_of(R"({"microbatch": 2})"),
            "smp: config key 'microbatch' is unknown (did you mean 'microbatches'?)");
  EXPECT_EQ(error_of(R"({"partitons": 2})"),
            "smp: config key 'partitons' is unknown (did you mean 'partitions'?)");
  EXPECT_EQ(error_of(R"({"zzzzzzzzzzzz": 2})"), "smp: config key 'zzzzzzzzzzzz' is unknown");
}

TEST(Config, NotJsonOrNotObject) {
  EXPECT_NE(error_of("{partitions: 2").find("smp: config is not valid JSON"), std::string::npos);
  EXPECT_EQ(error_of("[1, 2]"), "smp: config must be a JSON object, got [1,2]");
}

TEST(Config, CanonicalJsonAndHash) {
  Config a = Config::from_json(R"({"microbatches": 2, "partitions": 2})");
  Config b = Config::from_json(R"({"partitions": 2, "microbatches": 2.0})");
  EXPECT_EQ(a.to_json(), b.to_json());
  EXPECT_EQ(a.hash(), b.hash());
  EXPECT_NE(a.hash(), Config::from_json(R"({"partitions": 2})").hash());
  // Round trip: the canonical form parses to itself.
  EXPECT_EQ(Config::from_json(a.to_json()).to_json(), a.to_json());
}

// SMP clients read every accepted key back under SMP's name (smp.state.cfg).
TEST(Config, CanonicalJsonHasSmpNames) {
  Config c = Config::from_json(R"({"partitions": 2, "ddp_port": 1234, "backend": "gloo"})");
  const std::string j = c.to_json();
  for (const char* kv : {"\"pipeline_parallel_degree\":2", "\"ddp_port\":1234",
                         "\"ddp_dist_backend\":\"gloo\"", "\"prescaled_batch\":false",
                         "\"tensor_parallel_degree\":1", "\"fp16\":false"})
    EXPECT_NE(j.find(kv), std::string::npos) << kv << " not in " << j;
  EXPECT_EQ(Config::from_json(j).to_json(), j);  // still a fixed point
  // Without the key, an ignored key is absent (it has no meaningful default).
  EXPECT_EQ(Config::from_json("{}").to_json().find("ddp_port"), std::string::npos);
}

// Mixed precision (SMP v1.10): fp16 or bf16, never both.
TEST(Config, OneHalfPrecisionDtype) {
  EXPECT_TRUE(Config::from_json(R"({"fp16": true})").fp16);
  EXPECT_TRUE(Config::from_json(R"({"bf16": true})").bf16);
  try {
    Config::from_json(R"({"fp16": true, "bf16": true})", 2);
    FAIL();
  } catch (const ConfigError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("'bf16'=true"), std::string::npos) << m;
    EXPECT_NE(m.find("'fp16'=true"), std::string::npos) << m;
    EXPECT_NE(m.find("(rank 2)"), std::string::npos) << m;
  }
  EXPECT_THROW(Config::from_json(R"({"fp16": 1})"), ConfigError);
}

TEST(Config, ValidateWorld) {
  Config c = Config::from_json(R"({"partitions": 3})");
  EXPECT_NO_THROW(c.validate_world(6));
  try {
    c.validate_world(4, 1);
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_STREQ(e.what(), "smp: config 'partitions'=3 does not divide the world size 4 "
                           "(allowed: a divisor of 4) (rank 1)");
  }
}

// Every on/off switch of the environment reads the same words (smp_common parse_flag):
// unset or empty is the default, "1" and "0", and anything else names the variable,
// the value and what 1 does.
TEST(Config, EnvironmentSwitchesReadOneWay) {
  constexpr const char* kName = "SMP_TEST_SWITCH";
  unsetenv(kName);
  EXPECT_TRUE(env_flag(kName, true, "x"));
  EXPECT_FALSE(env_flag(kName, false, "x"));
  setenv(kName, "", 1);
  EXPECT_TRUE(env_flag(kName, true, "x"));
  setenv(kName, "0", 1);
  EXPECT_FALSE(env_flag(kName, true, "x"));
  setenv(kName, "1", 1);
  EXPECT_TRUE(env_flag(kName, false, "x"));
  for (const char* bad : {"yes", "true", " 1", "2"}) {
    setenv(kName, bad, 1);
    try {
      env_flag(kName, true, "it is on");
      ADD_FAILURE() << bad << " was accepted";
    } catch (const ConfigError& e) {
      EXPECT_EQ(std::string(e.what()), std::string("smp: environment variable SMP_TEST_SWITCH='") +
                                           bad + "' is not one of {0, 1} (1: it is on)");
    }
  }
  unsetenv(kName);
}

TEST(Config, DisagreementNamesKeyAndRanks) {
  std::string a = Config::from_json(R"({"microbatches": 2})").to_json();
  std::string b = Config::from_json(R"({"microbatches": 4})").to_json();
  EXPECT_EQ(describe_config_disagreement({a, a, a}), "");
  EXPECT_EQ(describe_config_disagreement({a, a, a, b}),
            "smp: config 'microbatches' differs across ranks: 2 on ranks 0,1,2; 4 on rank 3");
  EXPECT_EQ(describe_config_disagreement({a, "error:smp: bad", a}),
            "smp: invalid config on rank 1: smp: bad");
}

}  // namespace
}  // namespace smp
