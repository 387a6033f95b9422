#include "smp_core/config.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <set>

#include <nlohmann/json.hpp>

#include "smp_common/env.h"
#include "smp_common/hash.h"
#include "smp_core/topology.h"

namespace smp {
namespace {

using nlohmann::json;

std::string rank_suffix(int rank) { return rank >= 0 ? str_cat(" (rank ", rank, ")") : ""; }

// Strings quoted, so "'pipeline'='1f1b'" reads as a value, not a syntax.
std::string show(const json& v) {
  return v.is_string() ? str_cat("'", v.get<std::string>(), "'") : v.dump();
}

// Levenshtein distance, for "did you mean".
size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t sub = prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1);
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, sub});
    }
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

// Keys SMP v1 scripts pass that smp accepts only at their neutral value.
struct NeutralKey {
  const char* name;
  json neutral;
};
const std::vector<NeutralKey>& neutral_keys() {
  static const std::vector<NeutralKey> keys = {
      {"sharded_data_parallel_degree", 1},
      {"horovod", false},
      {"fp16_params", false}};
  return keys;
}

// Keys accepted for compatibility whose value smp does not use (any valid type).
const std::vector<std::pair<const char*, json::value_t>>& ignored_keys() {
  static const std::vector<std::pair<const char*, json::value_t>> keys = {
      {"deterministic_server", json::value_t::boolean},
      // SMP v1.10's speed hints (its GPT-2 example sets both): smp's planned pipeline
      // already reuses the last step's calls (Note [Executed plan]), which static_mode
      // promises, and fast_mode has nothing further to skip here.
      {"fast_mode", json::value_t::boolean},
      {"static_mode", json::value_t::boolean},
      {"activation_loading_horizon", json::value_t::number_unsigned},
      {"ddp_port", json::value_t::number_unsigned}};
  return keys;
}

class Parser {
 public:
  Parser(const json& obj, int rank) : obj_(obj), rank_(rank) {}

  [[noreturn]] void fail(const std::string& key, const json& v, const std::string& allowed) {
    throw ConfigError(str_cat("smp: config '", key, "'=", show(v), " is not ", allowed,
                              rank_suffix(rank_)));
  }

  bool has(const std::string& key) const { return obj_.contains(key); }

  int get_int(const std::string& key, int def, int lo, int hi = 1 << 30) {
    if (!has(key)) return def;
    const json& v = obj_.at(key);
    const std::string allowed = str_cat("an integer in [", lo, ", ", hi, "]");
    if (!v.is_number() || v.is_boolean()) fail(key, v, allowed);
    // Compared as a double first: casting one outside int64's range (2e30, found by
    // tests/fuzz/config_fuzz.cpp) is undefined, and so is an unsigned above INT64_MAX.
    const double d = v.get<double>();
    if (!(d >= lo && d <= hi) || d != std::trunc(d)) fail(key, v, allowed);
    const int64_t x = v.is_number_integer() ? v.get<int64_t>() : static_cast<int64_t>(d);
    if (x < lo || x > hi) fail(key, v, allowed);
    return static_cast<int>(x);
  }

  double get_double(const std::string& key, double def, double lo, double hi,
                    bool lo_open = false) {
    if (!has(key)) return def;
    const json& v = obj_.at(key);
    std::string allowed = str_cat("a number in ", lo_open ? "(" : "[", lo, ", ", hi, "]");
    if (!v.is_number() || v.is_boolean()) fail(key, v, allowed);
    double x = v.get<double>();
    if (x > hi || x < lo || (lo_open && x == lo)) fail(key, v, allowed);
    return x;
  }

  bool get_bool(const std::string& key, bool def) {
    if (!has(key)) return def;
    const json& v = obj_.at(key);
    if (!v.is_boolean()) fail(key, v, "one of {true, false}");
    return v.get<bool>();
  }

  std::string get_string(const std::string& key, const std::string& def) {
    if (!has(key)) return def;
    const json& v = obj_.at(key);
    if (!v.is_string()) fail(key, v, "a string");
    return v.get<std::string>();
  }

  std::string get_choice(const std::string& key, const std::string& def,
                         const std::vector<std::string>& choices) {
    if (!has(key)) return def;
    const json& v = obj_.at(key);
    if (v.is_string() &&
        std::find(choices.begin(), choices.end(), v.get<std::string>()) != choices.end())
      return v.get<std::string>();
    std::string allowed = "one of {";
    for (size_t i = 0; i < choices.size(); ++i) allowed += (i ? ", " : "") + choices[i];
    fail(key, v, allowed + "}");
  }

 private:
  const json& obj_;
  int rank_;
};

const std::vector<std::string>& placement_choices() {
  static const std::vector<std::string> c = {"cluster", "spread", "DPT", "DTP", "PDT",
                                             "PTD",     "TDP",    "TPD"};
  return c;
}

}  // namespace

std::vector<std::string> config_keys() {
  std::vector<std::string> keys = {
      "partitions",     "pipeline_parallel_degree", "microbatches", "pipeline", "pipeline_order",
      "checkpoint_dir",
      "ddp",            "placement_strategy",       "optimize",     "auto_partition",
      "default_partition", "memory_weight",         "active_microbatches", "contiguous",
      "backend",        "ddp_dist_backend",         "timeout_s",    "skip_tracing",
      "p2p_transport",  "shard_optimizer_state", "fp16", "bf16", "tensor_parallel_degree",
      "prescaled_batch", "delayed_parameter_initialization", "offload_activations"};
  for (const auto& k : neutral_keys()) keys.push_back(k.name);
  for (const auto& k : ignored_keys()) keys.push_back(k.first);
  std::sort(keys.begin(), keys.end());
  return keys;
}

Config Config::from_json(const std::string& text, int rank) {
  json obj;
  try {
    obj = json::parse(text.empty() ? "{}" : text);
  } catch (const json::exception& e) {  // a syntax error, or a number out of range (1e999)
    throw ConfigError(str_cat("smp: config is not valid JSON: ", e.what(), rank_suffix(rank)));
  }
  if (!obj.is_object())
    throw ConfigError(str_cat("smp: config must be a JSON object, got ", obj.dump(),
                              rank_suffix(rank)));

  const std::vector<std::string> known = config_keys();
  for (auto it = obj.begin(); it != obj.end(); ++it) {
    if (std::binary_search(known.begin(), known.end(), it.key())) continue;
    std::string best;
    size_t best_d = 4;
    for (const auto& k : known) {
      size_t d = edit_distance(it.key(), k);
      if (d < best_d) best_d = d, best = k;
    }
    throw ConfigError(str_cat("smp: config key '", it.key(), "' is unknown",
                              best.empty() ? "" : str_cat(" (did you mean '", best, "'?)"),
                              rank_suffix(rank)));
  }

  Parser p(obj, rank);
  Config c;
  if (p.has("partitions") && p.has("pipeline_parallel_degree") &&
      obj["partitions"] != obj["pipeline_parallel_degree"])
    throw ConfigError(str_cat("smp: config 'partitions'=", show(obj["partitions"]),
                              " and its alias 'pipeline_parallel_degree'=",
                              show(obj["pipeline_parallel_degree"]), " disagree",
                              rank_suffix(rank)));
  c.partitions = p.has("partitions") ? p.get_int("partitions", 1, 1)
                                     : p.get_int("pipeline_parallel_degree", 1, 1);
  c.microbatches = p.get_int("microbatches", 1, 1);
  c.pipeline = p.get_choice("pipeline", "interleaved", {"interleaved", "simple", "1f1b", "zero_bubble"});
  // Every schedule executes its plan by default (Note [Executed plan] in
  // smp_core/detail/plan_execution.cpp): with the loss hop planned as free (Note [Last
  // hop's gradients]) the plans beat the dynamic order at pp=2, mb=8 (bench/pipeline.py).
  // zero_bubble's weight-gradient actions go where its plan puts them, so "dynamic" is
  // refused for it rather than silently run as 1f1b.
  if (c.pipeline == "zero_bubble" && p.has("pipeline_order") && obj["pipeline_order"] == "dynamic")
    p.fail("pipeline_order", obj["pipeline_order"],
           "usable with 'pipeline'='zero_bubble', which places its weight-gradient actions "
           "by its plan; use \"planned\" or leave 'pipeline_order' unset");
  c.pipeline_order = p.get_choice("pipeline_order", "planned", {"dynamic", "planned"});
  c.ddp = p.get_bool("ddp", false);
  c.tensor_parallel_degree = p.get_int("tensor_parallel_degree", 1, 1);
  c.prescaled_batch = p.get_bool("prescaled_batch", false);
  c.delayed_parameter_initialization = p.get_bool("delayed_parameter_initialization", false);
  c.offload_activations = p.get_bool("offload_activations", false);
  // SMP's rule: the tp ranks of a stage are replicas of its non-distributed parameters,
  // which only the reducer keeps equal.
  if (c.tensor_parallel_degree > 1 && !c.ddp)
    p.fail("ddp", obj.contains("ddp") ? obj["ddp"] : json(false),
           str_cat("allowed with 'tensor_parallel_degree'=", c.tensor_parallel_degree,
                   " (tensor parallelism needs 'ddp': true)"));
  c.placement_strategy = p.get_choice("placement_strategy", "cluster", placement_choices());
  c.optimize = p.get_choice("optimize", "speed", {"speed", "memory"});
  c.auto_partition = p.get_bool("auto_partition", true);
  c.default_partition = p.get_int("default_partition", 0, 0, c.partitions - 1);
  c.memory_weight = p.get_double("memory_weight", c.optimize == "speed" ? 0.2 : 0.8, 0.0, 1.0);
  c.active_microbatches = p.get_int("active_microbatches", c.partitions + 2, 1);
  c.contiguous = p.get_bool("contiguous", true);
  if (!c.contiguous) p.fail("contiguous", false, "supported: partitions are always contiguous (true)");
  const std::vector<std::string> backends = {"auto", "gloo", "nccl"};
  c.backend = p.get_choice("backend", "auto", backends);
  if (!p.has("backend")) c.backend = p.get_choice("ddp_dist_backend", "auto", backends);
  c.timeout_s = p.get_double("timeout_s", 300.0, 0.0, 1e7, /*lo_open=*/true);
  c.skip_tracing = p.get_bool("skip_tracing", false);
  c.shard_optimizer_state = p.get_bool("shard_optimizer_state", false);
  c.fp16 = p.get_bool("fp16", false);
  c.bf16 = p.get_bool("bf16", false);
  if (c.fp16 && c.bf16)
    p.fail("bf16", true, "allowed together with 'fp16'=true (one half-precision dtype per "
           "job: set one of them)");
  c.checkpoint_dir = p.get_string("checkpoint_dir", "");
  c.p2p_transport = p.get_choice("p2p_transport", "auto", {"auto", "tcp", "c10d"});
  for (const auto& k : neutral_keys()) {
    if (p.has(k.name) && obj[k.name] != k.neutral)
      p.fail(k.name, obj[k.name], str_cat("supported by smp (only ", k.neutral.dump(), ")"));
  }
  json ignored = json::object();
  for (const auto& [name, type] : ignored_keys()) {
    if (!p.has(name)) continue;
    const json& v = obj[name];
    bool ok = type == json::value_t::boolean ? v.is_boolean()
                                             : (v.is_number_integer() && v.get<int64_t>() >= 0);
    if (!ok) p.fail(name, v, type == json::value_t::boolean ? "one of {true, false}" : "an integer >= 0");
    ignored[name] = v;
  }
  c.ignored_json = ignored.dump();
  return c;
}

std::string Config::to_json() const {
  json j = {{"partitions", partitions},
            {"microbatches", microbatches},
            {"pipeline", pipeline},
            {"pipeline_order", pipeline_order},
            {"ddp", ddp},
            {"placement_strategy", placement_strategy},
            {"optimize", optimize},
            {"auto_partition", auto_partition},
            {"default_partition", default_partition},
            {"memory_weight", memory_weight},
            {"active_microbatches", active_microbatches},
            {"contiguous", contiguous},
            {"backend", backend},
            {"timeout_s", timeout_s},
            {"skip_tracing", skip_tracing},
            {"shard_optimizer_state", shard_optimizer_state},
            {"fp16", fp16},
            {"bf16", bf16},
            {"checkpoint_dir", checkpoint_dir},
            {"p2p_transport", p2p_transport},
            {"tensor_parallel_degree", tensor_parallel_degree},
            {"prescaled_batch", prescaled_batch},
            {"delayed_parameter_initialization", delayed_parameter_initialization},
            {"offload_activations", offload_activations},
            {"pipeline_parallel_degree", partitions},
            {"ddp_dist_backend", backend}};
  for (const auto& k : neutral_keys()) j[k.name] = k.neutral;
  const json ignored = json::parse(ignored_json);  // outlives the loop over its items
  for (auto it = ignored.begin(); it != ignored.end(); ++it) j[it.key()] = it.value();
  return j.dump();  // nlohmann::json objects keep keys sorted
}

uint64_t Config::hash() const { return common::fnv1a(to_json()); }

void Config::validate_world(int world_size, int rank) const {
  // The layout's own checks (partitions, then tensor_parallel_degree, divide the world),
  // with the rank named.
  try {
    Topology(world_size, partitions, placement_strategy, tensor_parallel_degree);
  } catch (const ConfigError& e) {
    throw ConfigError(str_cat(e.what(), rank_suffix(rank)));
  }
}

std::string describe_config_disagreement(const std::vector<std::string>& per_rank) {
  for (size_t r = 0; r < per_rank.size(); ++r) {
    if (per_rank[r].rfind("error:", 0) == 0)
      return str_cat("smp: invalid config on rank ", r, ": ", per_rank[r].substr(6));
  }
  if (std::all_of(per_rank.begin(), per_rank.end(),
                  [&](const std::string& s) { return s == per_rank[0]; }))
    return "";
  std::vector<json> parsed;
  for (const auto& s : per_rank) parsed.push_back(json::parse(s));
  for (auto it = parsed[0].begin(); it != parsed[0].end(); ++it) {
    // Group ranks by value of this key, in rank order of first appearance.
    std::vector<std::pair<std::string, std::vector<size_t>>> groups;
    for (size_t r = 0; r < parsed.size(); ++r) {
      std::string v = parsed[r][it.key()].dump();
      auto g = std::find_if(groups.begin(), groups.end(), [&](auto& e) { return e.first == v; });
      if (g == groups.end()) groups.push_back({v, {r}});
      else g->second.push_back(r);
    }
    if (groups.size() == 1) continue;
    std::string msg = str_cat("smp: config '", it.key(), "' differs across ranks:");
    for (size_t i = 0; i < groups.size(); ++i) {
      msg += str_cat(i ? ";" : "", " ", groups[i].first, " on rank",
                     groups[i].second.size() > 1 ? "s " : " ");
      for (size_t k = 0; k < groups[i].second.size(); ++k)
        msg += str_cat(k ? "," : "", groups[i].second[k]);
    }
    return msg;
  }
  return "smp: config differs across ranks";
}

bool env_flag(const char* name, bool fallback, const char* meaning) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  if (auto on = common::parse_flag(v)) return *on;
  throw ConfigError(str_cat("smp: environment variable ", name, "='", v,
                            "' is not one of {0, 1} (1: ", meaning, ")"));
}

}  // namespace smp
