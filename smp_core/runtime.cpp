#include "smp_core/runtime.h"

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <thread>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "smp_common/env.h"
#include "smp_core/compat/torch_compat.h"
#include "smp_core/errors.h"
#include "smp_core/net_interface.h"

namespace smp {
namespace {

std::unique_ptr<Runtime> g_runtime;

// One variable lookup for both sources: the process's environment or a given map.
class Vars {
 public:
  explicit Vars(const std::map<std::string, std::string>* vars) : vars_(vars) {}
  // The value, or nullptr when unset.
  const char* get(const std::string& name) const {
    if (!vars_) return std::getenv(name.c_str());
    auto it = vars_->find(name);
    return it == vars_->end() ? nullptr : it->second.c_str();
  }
  bool has(const std::string& name) const { return get(name) != nullptr; }
  bool empty(const std::string& name) const {
    const char* v = get(name);
    return !v || !*v;
  }
  const std::map<std::string, std::string>* map() const { return vars_; }

 private:
  const std::map<std::string, std::string>* vars_;
};

// smprun's integer parser (smp_common/env.h), around whitespace the shell may leave.
int parse_int(const std::string& name, const char* value) {
  if (auto x = common::parse_int(common::trim(value))) return *x;
  throw ConfigError(str_cat("smp: environment ", name, "='", value, "' is not an integer"));
}

// A variable that must be set because RANK is.
int required_int(const Vars& vars, const std::string& name, const char* rank) {
  if (vars.empty(name))
    throw ConfigError(str_cat("smp: environment ", name, " is not set, but RANK=", rank, " is"));
  return parse_int(name, vars.get(name));
}

ProcessEnv parse_process_env(const Vars& vars) {
  ProcessEnv e;
  const char* rank = vars.get("RANK");
  if (!rank) {
    // A bare process is a world of 1, but not one of N copies srun or mpirun started:
    // those would each train alone. Python's smp.init derives the world from these
    // variables (python/smp/launch_env.py; Note [Open MPI before SLURM] there).
    for (auto [var, size] : {std::pair{"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"},
                             std::pair{"SLURM_PROCID", "SLURM_NTASKS"}}) {
      if (!vars.has(var)) continue;
      const int n = env_int(size, 1, vars.map());
      if (n > 1)
        throw ConfigError(str_cat("smp: environment RANK is not set, but ", var, "=",
                                  vars.get(var), " and ", size, "=", n,
                                  " say this is one of several ranks; smp::init (C++) reads "
                                  "RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR "
                                  "and MASTER_PORT: export them, or launch with smprun"));
      break;
    }
    return e;
  }
  e.rank = parse_int("RANK", rank);
  e.world_size = required_int(vars, "WORLD_SIZE", rank);
  e.local_rank = env_int("LOCAL_RANK", e.rank, vars.map());
  e.local_size = env_int("LOCAL_WORLD_SIZE", e.world_size, vars.map());
  e.torchelastic = !vars.empty("TORCHELASTIC_RUN_ID");
  if (e.world_size < 1)
    throw ConfigError(str_cat("smp: environment WORLD_SIZE=", e.world_size,
                              " is not an integer >= 1"));
  if (e.rank < 0 || e.rank >= e.world_size)
    throw ConfigError(str_cat("smp: environment RANK=", e.rank, " is not in [0, WORLD_SIZE=",
                              e.world_size, ")"));
  if (e.world_size == 1) return e;  // no rendezvous: MASTER_* are not read
  if (!vars.empty("MASTER_ADDR")) e.master_addr = vars.get("MASTER_ADDR");
  e.master_port = env_int("MASTER_PORT", 0, vars.map());
  if (e.master_port > 65535)
    throw ConfigError(str_cat("smp: environment MASTER_PORT=", e.master_port,
                              " is not a port in [1, 65535]"));
  if (e.master_port <= 0 && !e.torchelastic)
    throw ConfigError(str_cat("smp: environment MASTER_PORT is not set (RANK=", e.rank,
                              ", WORLD_SIZE=", e.world_size,
                              "); set MASTER_ADDR and MASTER_PORT to rank 0's host and a free "
                              "port, or launch with smprun or torchrun"));
  return e;
}

}  // namespace

bool set_malloc_mmap_threshold(size_t bytes) {
#if defined(__GLIBC__)
  if (bytes > static_cast<size_t>(std::numeric_limits<int>::max())) return false;
  const size_t trim = std::min<size_t>(4 * bytes, std::numeric_limits<int>::max());
  return mallopt(M_MMAP_THRESHOLD, static_cast<int>(bytes)) == 1 &&
         mallopt(M_TRIM_THRESHOLD, static_cast<int>(trim)) == 1;
#else
  (void)bytes;
  return false;
#endif
}

int env_int(const std::string& name, int def, const std::map<std::string, std::string>* vars) {
  Vars v(vars);
  if (v.empty(name)) return def;
  return parse_int(name, v.get(name));
}

ProcessEnv ProcessEnv::from_environment() { return parse_process_env(Vars(nullptr)); }

ProcessEnv ProcessEnv::from_variables(const std::map<std::string, std::string>& vars) {
  return parse_process_env(Vars(&vars));
}

std::string config_from_environment() {
  if (const char* c = std::getenv("SMP_CONFIG"); c && *c) return c;
  if (const char* c = std::getenv("SM_HP_MP_PARAMETERS"); c && *c) return c;
  return "{}";
}

Config agree_config(const StorePtr& store, const ProcessEnv& env, const std::string& raw_json) {
  std::string mine;
  double timeout_s = Config().timeout_s;
  std::unique_ptr<Config> parsed;
  try {
    parsed = std::make_unique<Config>(Config::from_json(raw_json));
    timeout_s = parsed->timeout_s;
    mine = parsed->to_json();
  } catch (const ConfigError& e) {
    mine = std::string("error:") + e.what();
  }
  // Note [Job secret]: before anything else is read from the store; the config's
  // exchange below then proves every rank's key to every other.
  establish_job_key(store, env.rank, env.world_size, timeout_s);
  auto all = env.world_size == 1
                 ? std::vector<std::string>{mine}
                 : store_exchange(store, "smp/init/config", env.rank, env.world_size, mine,
                                  timeout_s, "the config of every rank (smp.init)");
  // Rank 0 hosts the store: it must not go on (and perhaps exit on an error) before
  // every rank has read the configs, or they would fail with "connection reset".
  if (env.world_size > 1) {
    const std::string key = "smp/init/config_read";
    if (env.rank != 0) {
      store->add(key, 1);
    } else {
      auto deadline = std::chrono::steady_clock::now() +
                      std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
      while (store->add(key, 0) < env.world_size - 1 &&
             std::chrono::steady_clock::now() < deadline)
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }
  std::string problem = describe_config_disagreement(all);
  if (!problem.empty()) throw ConfigError(problem + str_cat(" (seen on rank ", env.rank, ")"));
  parsed->validate_world(env.world_size);
  return *parsed;
}

Runtime::Runtime(Config config, ProcessEnv env, StorePtr store, Groups groups)
    : config_(std::move(config)),
      env_(std::move(env)),
      topology_(env_.world_size, config_.partitions, config_.placement_strategy,
                config_.tensor_parallel_degree),
      store_(std::move(store)),
      groups_(std::move(groups)),
      mailbox_(std::make_unique<StoreMailbox>(store_, env_.rank, config_.timeout_s)) {}

Runtime::~Runtime() = default;

Runtime& install(Config config, ProcessEnv env, StorePtr store, Groups groups) {
  if (g_runtime) throw std::runtime_error("smp: already initialized");
  g_runtime = std::make_unique<Runtime>(std::move(config), std::move(env), std::move(store),
                                        std::move(groups));
  return *g_runtime;
}

Runtime& init(const Config& config) { return init(config.to_json()); }

namespace {

// A Gloo group of `members` (global ranks) on `store` under "smp/pg/<name>"; null where
// this rank is not a member (only members rendezvous on the prefix). Single-machine
// jobs bind loopback; across hosts the user's GLOO_SOCKET_IFNAME, else Note [Gloo's
// interface] (net_interface.cpp).
ProcessGroupPtr make_member_group(const StorePtr& store, const ProcessEnv& env,
                                  const std::string& name, const std::vector<int>& members,
                                  std::chrono::milliseconds timeout) {
  int my = -1;
  for (size_t i = 0; i < members.size(); ++i)
    if (members[i] == env.rank) my = static_cast<int>(i);
  if (my < 0) return {};
  const bool loopback = env.world_size == 1 || env.master_addr == "localhost" ||
                        env.master_addr.rfind("127.", 0) == 0;
  std::string iface;
  if (!loopback) {
    const char* user = std::getenv("GLOO_SOCKET_IFNAME");
    iface = user && *user ? std::string(user).substr(0, std::string(user).find(','))
                          : choose_gloo_interface(env.master_addr).name;
  }
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>("smp/pg/" + name, store);
  return compat::make_gloo_group(prefixed, my, static_cast<int>(members.size()), timeout,
                                 loopback ? "127.0.0.1" : "", iface);
}

}  // namespace

ProcessGroupPtr Runtime::make_group(const std::string& name,
                                    const std::vector<int>& members) const {
  const auto timeout =
      std::chrono::milliseconds(static_cast<int64_t>(config_.timeout_s * 1000));
  return make_member_group(store_, env_, name, members, timeout);
}

Runtime& init(const std::string& config_json) {
  if (g_runtime) return *g_runtime;
  ProcessEnv env = ProcessEnv::from_environment();
  std::string raw = config_json.empty() ? config_from_environment() : config_json;
  // The store's own timeout bounds rendezvous; use the config's if it parses.
  double timeout_s = Config().timeout_s;
  try {
    timeout_s = Config::from_json(raw).timeout_s;
  } catch (const ConfigError&) {
  }
  auto timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  StorePtr store;
  if (env.world_size == 1) {
    store = c10::make_intrusive<c10d::HashStore>();
  } else {
    // Under torchrun's static rendezvous its agent already hosts the store on
    // MASTER_PORT: connect as a client, under the attempt's prefix, as torch's env://
    // handler does (torch/distributed/rendezvous.py, _create_c10d_store).
    const char* agent = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
    const bool agent_store = agent && std::string(agent) == "True";
    c10d::TCPStoreOptions opts;
    opts.port = static_cast<uint16_t>(env.master_port);
    opts.isServer = env.rank == 0 && !agent_store;
    opts.numWorkers = env.world_size;
    opts.timeout = timeout;
    opts.waitWorkers = false;  // agree_config names any rank that never arrives
    store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, opts);
    if (agent_store) {
      const char* attempt = std::getenv("TORCHELASTIC_RESTART_COUNT");
      store = c10::make_intrusive<c10d::PrefixStore>(
          str_cat("/worker/attempt_", attempt ? attempt : "0"), store);
    }
  }
  Config config = agree_config(store, env, raw);
  Topology topo(env.world_size, config.partitions, config.placement_strategy,
                config.tensor_parallel_degree);
  auto make = [&](const std::string& name, const std::vector<int>& members) {
    return make_member_group(store, env, name, members, timeout);
  };
  Groups groups;
  std::vector<int> all(env.world_size);
  for (int r = 0; r < env.world_size; ++r) all[r] = r;
  groups.world = make("world", all);
  // Only members rendezvous on a group's prefix, so non-members skip it safely.
  for (const auto& g : topo.all_pp_groups()) {
    auto pg = make(str_cat("pp", g[0]), g);
    if (pg) groups.pp = pg;
  }
  for (const auto& g : topo.all_dp_groups()) {
    auto pg = make(str_cat("dp", g[0]), g);
    if (pg) groups.dp = pg;
  }
  return install(std::move(config), std::move(env), std::move(store), std::move(groups));
}

bool is_initialized() { return g_runtime != nullptr; }

Runtime& runtime() {
  if (!g_runtime) throw std::runtime_error("smp: not initialized; call smp.init() first");
  return *g_runtime;
}

void shutdown() { g_runtime.reset(); }

}  // namespace smp
