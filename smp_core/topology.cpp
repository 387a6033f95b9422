#include "smp_core/topology.h"

#include <algorithm>

#include "smp_core/errors.h"

namespace smp {

Topology::Topology(int world_size, int pp_size, const std::string& placement)
    : world_(world_size), pp_(pp_size) {
  if (world_size < 1)
    throw ConfigError(str_cat("smp: world size ", world_size, " is not >= 1"));
  if (pp_size < 1 || world_size % pp_size != 0)
    throw ConfigError(str_cat("smp: config 'partitions'=", pp_size,
                              " does not divide the world size ", world_size,
                              " (allowed: a divisor of ", world_size, ")"));
  dp_ = world_ / pp_;
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
    else if (*it == 'D') dp_stride_ = stride, stride *= dp_;
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

int Topology::dp_rank(int rank) const {
  check_rank(rank);
  return (rank / dp_stride_) % dp_;
}

int Topology::global_rank(int pp_rank, int dp_rank) const {
  if (pp_rank < 0 || pp_rank >= pp_ || dp_rank < 0 || dp_rank >= dp_)
    throw std::out_of_range(str_cat("smp: (pp_rank ", pp_rank, ", dp_rank ", dp_rank,
                                    ") is outside pp=", pp_, " x dp=", dp_));
  return pp_rank * pp_stride_ + dp_rank * dp_stride_;
}

std::vector<int> Topology::pp_group(int rank) const {
  std::vector<int> g;
  for (int p = 0; p < pp_; ++p) g.push_back(global_rank(p, dp_rank(rank)));
  return g;
}

std::vector<int> Topology::dp_group(int rank) const {
  std::vector<int> g;
  for (int d = 0; d < dp_; ++d) g.push_back(global_rank(pp_rank(rank), d));
  return g;
}

std::vector<std::vector<int>> Topology::all_pp_groups() const {
  std::vector<std::vector<int>> gs;
  for (int d = 0; d < dp_; ++d) gs.push_back(pp_group(global_rank(0, d)));
  std::sort(gs.begin(), gs.end());
  return gs;
}

std::vector<std::vector<int>> Topology::all_dp_groups() const {
  std::vector<std::vector<int>> gs;
  for (int p = 0; p < pp_; ++p) gs.push_back(dp_group(global_rank(p, 0)));
  std::sort(gs.begin(), gs.end());
  return gs;
}

std::string Topology::describe() const {
  std::string s = str_cat("world=", world_, " pp=", pp_, " dp=", dp_, ":");
  for (int r = 0; r < world_; ++r) s += str_cat(" ", r, "(pp", pp_rank(r), ",dp", dp_rank(r), ")");
  return s;
}

}  // namespace smp
