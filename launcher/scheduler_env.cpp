#include "launcher/scheduler_env.h"

#include <algorithm>

#include <nlohmann/json.hpp>

namespace smp::launcher {

using common::parse_int;

namespace {

std::optional<std::string> get(const EnvMap& env, const std::string& key) {
  auto it = env.find(key);
  if (it == env.end() || it->second.empty()) return std::nullopt;
  return it->second;
}

std::optional<int> get_int(const EnvMap& env, const std::string& key) {
  auto value = get(env, key);
  return value ? parse_int(*value) : std::nullopt;
}

// Splits at commas that are not inside [...]; nullopt on unbalanced brackets.
std::optional<std::vector<std::string>> split_top_level(const std::string& text) {
  std::vector<std::string> parts;
  std::string cur;
  int depth = 0;
  for (char c : text) {
    if (c == '[') ++depth;
    if (c == ']' && --depth < 0) return std::nullopt;
    if (c == ',' && depth == 0) {
      parts.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  if (depth != 0) return std::nullopt;
  parts.push_back(cur);
  return parts;
}

// Expands one hostlist item ("rack[1-2]-n[01,03]"); false if malformed.
bool expand_item(const std::string& item, std::vector<std::string>* out) {
  size_t open = item.find('[');
  if (open == std::string::npos) {
    if (item.empty() || item.find(']') != std::string::npos) return false;
    out->push_back(item);
    return true;
  }
  size_t close = item.find(']', open);
  if (close == std::string::npos || close == open + 1) return false;
  std::string prefix = item.substr(0, open);
  std::string rest = item.substr(close + 1);
  std::vector<std::string> tails;
  if (rest.empty()) {
    tails.push_back("");
  } else if (!expand_item(rest, &tails)) {
    return false;
  }
  std::string body = item.substr(open + 1, close - open - 1);
  size_t start = 0;
  while (start <= body.size()) {
    size_t comma = body.find(',', start);
    std::string range = body.substr(start, comma == std::string::npos ? std::string::npos
                                                                      : comma - start);
    size_t dash = range.find('-');
    std::string lo_text = range.substr(0, dash);
    std::string hi_text = dash == std::string::npos ? lo_text : range.substr(dash + 1);
    auto lo = parse_int(lo_text);
    auto hi = parse_int(hi_text);
    if (!lo || !hi || *lo < 0 || *hi < *lo || lo_text.empty()) return false;
    for (int v = *lo; v <= *hi; ++v) {
      std::string num = std::to_string(v);
      // SLURM pads to the width of the lower bound ("01-10" -> 01 ... 10).
      if (num.size() < lo_text.size()) num.insert(0, lo_text.size() - num.size(), '0');
      for (const auto& tail : tails) out->push_back(prefix + num + tail);
    }
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return true;
}

}  // namespace

std::vector<std::string> expand_slurm_nodelist(const std::string& nodelist) {
  std::vector<std::string> hosts;
  auto items = split_top_level(nodelist);
  if (!items) return {};
  for (const auto& item : *items) {
    if (!expand_item(item, &hosts)) return {};
  }
  return hosts;
}

std::optional<int> slurm_tasks_on_node(const std::string& counts, int node) {
  // The whole list is checked, not only the part up to `node`.
  std::optional<int> found;
  long first = 0;  // index of the first node of the current item
  size_t pos = 0;
  while (pos <= counts.size()) {
    size_t end = counts.find(',', pos);
    if (end == std::string::npos) end = counts.size();
    std::string item = counts.substr(pos, end - pos);
    size_t paren = item.find("(x");
    auto tasks = parse_int(item.substr(0, paren));
    std::optional<int> times = 1;
    if (paren != std::string::npos) {
      if (item.back() != ')') return std::nullopt;
      times = parse_int(item.substr(paren + 2, item.size() - paren - 3));
    }
    if (!tasks || !times || *tasks < 0 || *times < 1) return std::nullopt;
    if (node >= first && node < first + *times) found = tasks;
    first += *times;
    pos = end + 1;
  }
  return found;
}

std::string first_slurm_host(const std::string& nodelist) {
  auto items = split_top_level(nodelist);
  if (!items || items->empty()) return "";
  std::vector<std::string> hosts;
  if (!expand_item(items->front(), &hosts) || hosts.empty()) return "";
  return hosts.front();
}

SchedulerDefaults slurm_defaults(const EnvMap& env) {
  SchedulerDefaults d;
  if (!get(env, "SLURM_JOB_ID") && !get(env, "SLURM_NNODES") && !get(env, "SLURM_NODEID"))
    return d;
  d.source = "slurm";
  d.nnodes = get_int(env, "SLURM_NNODES");
  if (!d.nnodes) d.nnodes = get_int(env, "SLURM_JOB_NUM_NODES");
  d.node_rank = get_int(env, "SLURM_NODEID");
  // A plain "4" holds for every node; a compressed "4(x2),2" gives 2 on node 2.
  if (auto tasks = get(env, "SLURM_NTASKS_PER_NODE")) {
    d.nproc_per_node = parse_int(*tasks);
    if (!d.nproc_per_node) d.nproc_per_node = slurm_tasks_on_node(*tasks, d.node_rank.value_or(0));
  }
  auto nodelist = get(env, "SLURM_JOB_NODELIST");
  if (!nodelist) nodelist = get(env, "SLURM_NODELIST");
  if (nodelist) {
    std::string host = first_slurm_host(*nodelist);
    if (host.empty()) {
      d.error = "cannot parse SLURM_JOB_NODELIST='" + *nodelist + "' (expected e.g. node[01-04],gpu5)";
    } else {
      d.master_addr = host;
    }
  }
  d.job_id = get(env, "SLURM_JOB_ID");
  return d;
}

SchedulerDefaults openmpi_defaults(const EnvMap& env) {
  SchedulerDefaults d;
  auto size = get_int(env, "OMPI_COMM_WORLD_SIZE");
  auto rank = get_int(env, "OMPI_COMM_WORLD_RANK");
  if (!size || !rank) return d;
  d.source = "openmpi";
  int local_size = get_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE").value_or(1);
  if (local_size != 1) {
    d.error = "Open MPI started " + std::to_string(local_size) +
              " launchers on this node (OMPI_COMM_WORLD_LOCAL_SIZE=" + std::to_string(local_size) +
              "); start one smprun per node (mpirun --map-by ppr:1:node) and set --nproc_per_node";
    return d;
  }
  d.nnodes = *size;
  d.node_rank = *rank;
  d.job_id = get(env, "OMPI_MCA_ess_base_jobid");
  return d;
}

SchedulerDefaults sagemaker_defaults(const EnvMap& env) {
  SchedulerDefaults d;
  auto hosts_text = get(env, "SM_HOSTS");
  if (!hosts_text) return d;
  d.source = "sagemaker";
  std::vector<std::string> hosts;
  try {
    hosts = nlohmann::json::parse(*hosts_text).get<std::vector<std::string>>();
  } catch (const std::exception&) {
    d.error = "SM_HOSTS='" + *hosts_text + "' is not a JSON list of host names";
    return d;
  }
  if (hosts.empty()) {
    d.error = "SM_HOSTS is an empty list";
    return d;
  }
  // Every node sorts the same list, so all agree on node ranks and on the master.
  std::sort(hosts.begin(), hosts.end());
  d.nnodes = static_cast<int>(hosts.size());
  d.master_addr = hosts.front();
  if (auto current = get(env, "SM_CURRENT_HOST")) {
    auto it = std::find(hosts.begin(), hosts.end(), *current);
    if (it == hosts.end()) {
      d.error = "SM_CURRENT_HOST='" + *current + "' is not in SM_HOSTS=" + *hosts_text;
      return d;
    }
    d.node_rank = static_cast<int>(it - hosts.begin());
  }
  auto gpus = get_int(env, "SM_NUM_GPUS");
  if (gpus && *gpus > 0) {
    d.nproc_per_node = gpus;
  } else {
    d.nproc_per_node = get_int(env, "SM_NUM_CPUS");
  }
  d.job_id = get(env, "TRAINING_JOB_NAME");
  return d;
}

SchedulerDefaults generic_defaults(const EnvMap& env) {
  SchedulerDefaults d;
  d.master_addr = get(env, "MASTER_ADDR");
  if (auto port = get(env, "MASTER_PORT")) {
    d.master_port = parse_int(*port);
    if (!d.master_port) d.error = "MASTER_PORT='" + *port + "' is not a port number";
  }
  if (!d.empty()) d.source = "env";
  return d;
}

SchedulerDefaults merged_defaults(const EnvMap& env) {
  SchedulerDefaults out;
  for (const auto& d : {generic_defaults(env), slurm_defaults(env), openmpi_defaults(env),
                        sagemaker_defaults(env)}) {
    if (d.source.empty()) continue;
    out.source += (out.source.empty() ? "" : "+") + d.source;
    if (out.error.empty() && !d.error.empty()) out.error = d.source + ": " + d.error;
    if (!out.nnodes) out.nnodes = d.nnodes;
    if (!out.node_rank) out.node_rank = d.node_rank;
    if (!out.nproc_per_node) out.nproc_per_node = d.nproc_per_node;
    if (!out.master_addr) out.master_addr = d.master_addr;
    if (!out.master_port) out.master_port = d.master_port;
    if (!out.job_id) out.job_id = d.job_id;
  }
  return out;
}

}  // namespace smp::launcher
