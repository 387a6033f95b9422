// compute_bucket_assignment and broadcast_coalesced (declared in smp_core/reducer.h):
// the pure layout rule of the reducer's buckets, and the coalesced broadcast that
// syncs replicas from dp rank 0.
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>
#include <map>
#include <numeric>
#include <string>

#include "smp_core/errors.h"
#include "smp_core/reducer.h"

namespace smp {
namespace {

size_t nbytes(const at::Tensor& t) { return static_cast<size_t>(t.numel()) * t.element_size(); }

}  // namespace

std::vector<std::vector<int64_t>> compute_bucket_assignment(
    const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& order,
    size_t bucket_cap_bytes, size_t first_bucket_bytes) {
  struct Open {
    std::vector<int64_t> members;
    size_t bytes = 0;
    bool first = true;  // the next bucket of this key is its first
  };
  std::map<std::pair<int, std::string>, Open> open;  // (dtype, device) -> running bucket
  std::vector<std::vector<int64_t>> done;
  for (int64_t i : order) {
    const auto& t = tensors.at(i);
    Open& o = open[{static_cast<int>(t.scalar_type()), t.device().str()}];
    o.members.push_back(i);
    o.bytes += nbytes(t);
    size_t cap = o.first ? std::min(first_bucket_bytes, bucket_cap_bytes) : bucket_cap_bytes;
    if (o.bytes >= cap) {
      done.push_back(std::move(o.members));
      o.members.clear();
      o.bytes = 0;
      o.first = false;
    }
  }
  for (auto& [key, o] : open)
    if (!o.members.empty()) done.push_back(std::move(o.members));
  std::vector<size_t> pos(tensors.size(), 0);
  for (size_t k = 0; k < order.size(); ++k) pos[order[k]] = k;
  std::stable_sort(done.begin(), done.end(), [&](const auto& a, const auto& b) {
    return pos[a.front()] < pos[b.front()];
  });
  return done;
}

void broadcast_coalesced(const ProcessGroupPtr& pg, const std::vector<at::Tensor>& tensors,
                         int root, size_t bucket_bytes, double timeout_s) {
  at::NoGradGuard no_grad;
  std::vector<int64_t> order(tensors.size());
  std::iota(order.begin(), order.end(), 0);
  // Same grouping as gradient buckets (no small first chunk), in the given order.
  std::vector<std::vector<int64_t>> chunks;
  {
    std::map<std::pair<int, std::string>, std::pair<std::vector<int64_t>, size_t>> open;
    for (int64_t i : order) {
      const auto& t = tensors[i];
      if (t.numel() == 0) continue;
      auto& [members, bytes] = open[{static_cast<int>(t.scalar_type()), t.device().str()}];
      if (!members.empty() && bytes + nbytes(t) > bucket_bytes) {
        chunks.push_back(std::move(members));
        members.clear();
        bytes = 0;
      }
      members.push_back(i);
      bytes += nbytes(t);
    }
    for (auto& [key, mb] : open)
      if (!mb.first.empty()) chunks.push_back(std::move(mb.first));
  }
  std::sort(chunks.begin(), chunks.end());  // by first index: identical on every rank
  for (const auto& chunk : chunks) {
    std::vector<at::Tensor> parts;
    for (int64_t i : chunk) parts.push_back(tensors[i].detach().reshape({-1}));
    std::vector<at::Tensor> flat{parts.size() == 1 ? parts[0].contiguous() : at::cat(parts)};
    c10d::BroadcastOptions bo;
    bo.rootRank = root;
    wait_work(pg->broadcast(flat, bo), timeout_s,
              str_cat("broadcast_coalesced of ", chunk.size(), " tensors from rank ", root));
    if (pg->getRank() == root) continue;
    int64_t off = 0;
    for (int64_t i : chunk) {
      auto& t = tensors[i];
      if (t.data_ptr() == flat[0].data_ptr()) break;  // broadcast in place already
      t.detach().copy_(flat[0].narrow(0, off, t.numel()).view(t.sizes()));
      off += t.numel();
    }
  }
}

}  // namespace smp
