#include "smp_core/topology.h"

#include <algorithm>

#include "smp_core/errors.h"

namespace smp {

// Note [Groups under tensor parallelism]
// SMP v1.6+ splits the world three ways: pp (pipeline stages), tp (slices of a stage's
// distributed modules) and rdp (replicas of one slice). A parameter of a distributed
// module is one slice, held by the rdp group of its tp rank, so it is reduced over the
// rdp group; any other parameter is held whole by every tp rank of its stage, which
// read different batches (unless prescaled_batch), so it is reduced over the dp group,
// tp x rdp. Without distributed modules a tp group therefore trains as more data
// parallelism, and with tp = 1 every group is what it was: dp == rdp, mp == pp.
Topology::Topology(int world_size, int pp_size, const std::string& placement, int tp_size)
    : world_(world_size), pp_(pp_size), tp_(tp_size), placement_(placement) {
  if (world_size < 1)
    throw ConfigError(str_cat("smp: world size ", world_size, " is not >= 1"));
  if (pp_size < 1 || world_size % pp_size != 0)
    throw ConfigError(str_cat("smp: config 'partitions'=", pp_size,
                              " does not divide the world size ", world_size,
                              " (allowed: a divisor of ", world_size, ")"));
  if (tp_size < 1 || (world_size / pp_size) % tp_size != 0)
    throw ConfigError(str_cat("smp: config 'tensor_parallel_degree'=", tp_size,
                              " does not divide the world size ", world_size, " / 'partitions'=",
                              pp_size, " = ", world_size / pp_size, " (allowed: a divisor of ",
                              world_size / pp_size, ")"));
  rdp_ = world_ / (pp_ * tp_);
  std::string order = placement == "cluster" ? "DPT" : placement == "spread" ? "TPD" : placement;
  std::string sorted = order;
  std::sort(sorted.begin(), sorted.end());
  if (sorted != "DPT")
    throw ConfigError(str_cat("smp: config 'placement_strategy'=", placement,
                              " is not one of {cluster, spread} or a permutation of DPT"));
  // Rightmost letter is fastest: walk from the right, multiplying strides.
  int stride = 1;
  for (auto it = order.rbegin(); it != order.rend(); ++it) {
    if (*it == 'P') pp_stride_ = stride, stride *= pp_;
    else if (*it == 'T') tp_stride_ = stride, stride *= tp_;
    else rdp_stride_ = stride, stride *= rdp_;
  }
}

// Note [A tp group on one host]
// A tp group runs a collective in every distributed block, forward and backward, so
// it belongs on one host's fast links: SMP's "cluster" placement (tp fastest over
// consecutive ranks) exists for that. When the hosts' rank counts do not allow it
// (3 ranks a host with tp = 2), a group would silently cross the network each block;
// smp.init says so on every rank instead (the hosts are exchanged through the store,
// so every rank checks the same list). "spread" and the orders without T last ask for
// nothing of the kind.
void Topology::check_tp_hosts(const std::vector<std::string>& host_of_rank) const {
  if (tp_ <= 1 || tp_stride_ != 1) return;
  if (static_cast<int>(host_of_rank.size()) != world_)
    throw std::invalid_argument(str_cat("smp: check_tp_hosts: ", host_of_rank.size(),
                                        " hosts for a world of ", world_));
  for (const std::vector<int>& g : all_tp_groups()) {
    std::vector<std::string> seen;
    for (int r : g)
      if (std::find(seen.begin(), seen.end(), host_of_rank[r]) == seen.end())
        seen.push_back(host_of_rank[r]);
    if (seen.size() < 2) continue;
    std::string members;
    for (int r : g) members += str_cat(members.empty() ? "" : ", ", r);
    std::string where;
    for (int r : g) where += str_cat(where.empty() ? "" : "; ", "rank ", r, " on ",
                                     host_of_rank[r]);
    throw ConfigError(str_cat(
        "smp: config 'placement_strategy'='", placement_, "' keeps each tp group on one host, "
        "but with 'tensor_parallel_degree'=", tp_, " tp group [", members, "] spans ",
        seen.size(), " hosts (", where, "); allowed: a tensor_parallel_degree that divides "
        "every host's rank count, or 'placement_strategy'='spread' (tp across hosts)"));
  }
}

void Topology::check_rank(int rank) const {
  if (rank < 0 || rank >= world_)
    throw std::out_of_range(str_cat("smp: rank ", rank, " is outside the world [0, ", world_, ")"));
}

int Topology::pp_rank(int rank) const {
  check_rank(rank);
  return (rank / pp_stride_) % pp_;
}

int Topology::tp_rank(int rank) const {
  check_rank(rank);
  return (rank / tp_stride_) % tp_;
}

int Topology::rdp_rank(int rank) const {
  check_rank(rank);
  return (rank / rdp_stride_) % rdp_;
}

int Topology::dp_rank(int rank) const {
  const std::vector<int> g = dp_group(rank);
  return static_cast<int>(std::find(g.begin(), g.end(), rank) - g.begin());
}

int Topology::mp_rank(int rank) const {
  const std::vector<int> g = mp_group(rank);
  return static_cast<int>(std::find(g.begin(), g.end(), rank) - g.begin());
}

int Topology::global_rank_of(int pp_rank, int tp_rank, int rdp_rank) const {
  if (pp_rank < 0 || pp_rank >= pp_ || tp_rank < 0 || tp_rank >= tp_ || rdp_rank < 0 ||
      rdp_rank >= rdp_)
    throw std::out_of_range(str_cat("smp: (pp_rank ", pp_rank, ", tp_rank ", tp_rank,
                                    ", rdp_rank ", rdp_rank, ") is outside pp=", pp_, " x tp=",
                                    tp_, " x rdp=", rdp_));
  return pp_rank * pp_stride_ + tp_rank * tp_stride_ + rdp_rank * rdp_stride_;
}

int Topology::global_rank(int pp_rank, int dp_rank) const {
  if (pp_rank < 0 || pp_rank >= pp_ || dp_rank < 0 || dp_rank >= dp_size())
    throw std::out_of_range(str_cat("smp: (pp_rank ", pp_rank, ", dp_rank ", dp_rank,
                                    ") is outside pp=", pp_, " x dp=", dp_size()));
  return dp_group(global_rank_of(pp_rank, 0, 0))[dp_rank];
}

std::vector<int> Topology::pp_group(int rank) const {
  std::vector<int> g;
  for (int p = 0; p < pp_; ++p) g.push_back(global_rank_of(p, tp_rank(rank), rdp_rank(rank)));
  return g;
}

std::vector<int> Topology::tp_group(int rank) const {
  std::vector<int> g;
  for (int t = 0; t < tp_; ++t) g.push_back(global_rank_of(pp_rank(rank), t, rdp_rank(rank)));
  std::sort(g.begin(), g.end());
  return g;
}

std::vector<int> Topology::rdp_group(int rank) const {
  std::vector<int> g;
  for (int d = 0; d < rdp_; ++d) g.push_back(global_rank_of(pp_rank(rank), tp_rank(rank), d));
  std::sort(g.begin(), g.end());
  return g;
}

std::vector<int> Topology::dp_group(int rank) const {
  std::vector<int> g;
  for (int t = 0; t < tp_; ++t)
    for (int d = 0; d < rdp_; ++d) g.push_back(global_rank_of(pp_rank(rank), t, d));
  std::sort(g.begin(), g.end());
  return g;
}

std::vector<int> Topology::mp_group(int rank) const {
  std::vector<int> g;
  for (int p = 0; p < pp_; ++p)
    for (int t = 0; t < tp_; ++t) g.push_back(global_rank_of(p, t, rdp_rank(rank)));
  std::sort(g.begin(), g.end());
  return g;
}

template <typename F>
std::vector<std::vector<int>> Topology::all_groups(F group_of) const {
  std::vector<std::vector<int>> gs;
  for (int r = 0; r < world_; ++r) {
    std::vector<int> g = group_of(r);
    if (*std::min_element(g.begin(), g.end()) == r) gs.push_back(std::move(g));
  }
  std::sort(gs.begin(), gs.end(), [](const std::vector<int>& a, const std::vector<int>& b) {
    return *std::min_element(a.begin(), a.end()) < *std::min_element(b.begin(), b.end());
  });
  return gs;
}

std::vector<std::vector<int>> Topology::all_pp_groups() const {
  return all_groups([this](int r) { return pp_group(r); });
}
std::vector<std::vector<int>> Topology::all_tp_groups() const {
  return all_groups([this](int r) { return tp_group(r); });
}
std::vector<std::vector<int>> Topology::all_rdp_groups() const {
  return all_groups([this](int r) { return rdp_group(r); });
}
std::vector<std::vector<int>> Topology::all_dp_groups() const {
  return all_groups([this](int r) { return dp_group(r); });
}
std::vector<std::vector<int>> Topology::all_mp_groups() const {
  return all_groups([this](int r) { return mp_group(r); });
}

std::string Topology::describe() const {
  std::string s = tp_ > 1 ? str_cat("world=", world_, " pp=", pp_, " tp=", tp_, " rdp=", rdp_, ":")
                          : str_cat("world=", world_, " pp=", pp_, " dp=", dp_size(), ":");
  for (int r = 0; r < world_; ++r) {
    s += tp_ > 1 ? str_cat(" ", r, "(pp", pp_rank(r), ",tp", tp_rank(r), ",rdp", rdp_rank(r), ")")
                 : str_cat(" ", r, "(pp", pp_rank(r), ",dp", dp_rank(r), ")");
  }
  return s;
}

}  // namespace smp
