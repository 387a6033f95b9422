// compute_bucket_assignment and broadcast_coalesced (declared in smp_core/reducer.h):
// the pure layout rule of the reducer's buckets, and the coalesced broadcast that
// syncs replicas from dp rank 0.
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>
#include <deque>
#include <map>
#include <numeric>
#include <string>
#include <tuple>

#include "smp_core/errors.h"
#include "smp_core/reducer.h"

namespace smp {
namespace {

size_t nbytes(const at::Tensor& t) { return static_cast<size_t>(t.numel()) * t.element_size(); }

}  // namespace

std::vector<std::vector<int64_t>> compute_bucket_assignment(
    const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& order,
    size_t bucket_cap_bytes, size_t first_bucket_bytes, const std::vector<int>& groups) {
  struct Open {
    std::vector<int64_t> members;
    size_t bytes = 0;
    bool first = true;  // the next bucket of this key is its first
  };
  // (group, dtype, device) -> running bucket
  std::map<std::tuple<int, int, std::string>, Open> open;
  std::vector<std::vector<int64_t>> done;
  for (int64_t i : order) {
    const auto& t = tensors.at(i);
    const int group = groups.empty() ? 0 : groups.at(i);
    Open& o = open[{group, static_cast<int>(t.scalar_type()), t.device().str()}];
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

// The chunks of `tensors`: grouped per dtype/device in the given order, each at most
// `bucket_bytes` (a larger tensor alone), sorted by first index (identical on every rank).
static std::vector<std::vector<int64_t>> coalesced_chunks(const std::vector<at::Tensor>& tensors,
                                                          size_t bucket_bytes) {
  std::vector<std::vector<int64_t>> chunks;
  std::map<std::pair<int, std::string>, std::pair<std::vector<int64_t>, size_t>> open;
  for (int64_t i = 0; i < static_cast<int64_t>(tensors.size()); ++i) {
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
  std::sort(chunks.begin(), chunks.end());
  return chunks;
}

struct ShareExchange::Pending {
  std::vector<at::Tensor> tensors;  // the chunk's, filled from `flat` unless in place
  at::Tensor flat;
  c10::intrusive_ptr<c10d::Work> work;
  std::string what;
  int root = 0;
};

ShareExchange::ShareExchange(ProcessGroupPtr pg, size_t bucket_bytes, double timeout_s)
    : pg_(std::move(pg)), bucket_bytes_(bucket_bytes), timeout_s_(timeout_s) {}

ShareExchange::~ShareExchange() {
  // Never leave a broadcast reading or writing memory that goes away: wait (bounded,
  // as every wait), quietly: the caller is already raising.
  for (auto& round : rounds_)
    for (auto& p : round) {
      try {
        if (p.work) wait_work(p.work, timeout_s_, p.what);
      } catch (...) {
      }
    }
}

void ShareExchange::start(const std::vector<at::Tensor>& tensors, int root) {
  at::NoGradGuard no_grad;
  if (rounds_.empty()) rounds_.emplace_back();
  for (const auto& chunk : coalesced_chunks(tensors, bucket_bytes_)) {
    Pending p;
    std::vector<at::Tensor> parts;
    for (int64_t i : chunk) {
      p.tensors.push_back(tensors[i].detach());
      parts.push_back(p.tensors.back().reshape({-1}));
    }
    p.flat = parts.size() == 1 && parts[0].is_contiguous() ? parts[0] : at::cat(parts);
    p.root = root;
    p.what = str_cat("the parameter broadcast of ", chunk.size(), " tensors from rank ", root);
    std::vector<at::Tensor> v{p.flat};
    c10d::BroadcastOptions bo;
    bo.rootRank = root;
    p.work = pg_->broadcast(v, bo);
    rounds_.back().push_back(std::move(p));
  }
}

void ShareExchange::end_round() { rounds_.emplace_back(); }

void ShareExchange::wait(size_t leave) {
  at::NoGradGuard no_grad;
  while (!rounds_.empty() && rounds_.size() > leave) {
    for (auto& p : rounds_.front()) {
      wait_work(p.work, timeout_s_, p.what);
      p.work.reset();
      if (pg_->getRank() == p.root) continue;  // its tensors hold the values
      int64_t off = 0;
      for (auto& t : p.tensors) {
        if (t.data_ptr() == p.flat.data_ptr()) break;  // broadcast in place
        t.copy_(p.flat.narrow(0, off, t.numel()).view(t.sizes()));
        off += t.numel();
      }
    }
    rounds_.pop_front();
  }
}

void broadcast_coalesced(const ProcessGroupPtr& pg, const std::vector<at::Tensor>& tensors,
                         int root, size_t bucket_bytes, double timeout_s) {
  // One chunk at a time (each cat'ed buffer goes before the next is made).
  at::NoGradGuard no_grad;
  for (const auto& chunk : coalesced_chunks(tensors, bucket_bytes)) {
    std::vector<at::Tensor> part;
    for (int64_t i : chunk) part.push_back(tensors[i]);
    ShareExchange one(pg, bucket_bytes, timeout_s);
    one.start(part, root);
    one.wait(0);
  }
}

}  // namespace smp
