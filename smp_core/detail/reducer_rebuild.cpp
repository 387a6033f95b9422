// Bucket rebuilds: once after the first synchronized step, from the order gradients
// became ready on dp rank 0 (Note [Bucket rebuild]), and before the first step to
// torch DDP's constructor layout for a comm hook's sake (Note [Hook buckets follow
// torch's]). Part of Reducer::Impl (detail/reducer_impl.h).
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>

#include "smp_core/detail/reducer_impl.h"

namespace smp {

// Note [Bucket rebuild]: the buckets of the first step follow expected_order (or the
// reverse registration order). The order the grad accumulators actually fired in
// during the first step is recorded; at its end dp rank 0's order is broadcast through
// the comm queue (a point every rank reaches in the same sequence) and every rank
// recomputes the same layout from it, once.

// Submits the broadcast of the order every rank rebuilds with, dp rank 0's: the
// gradients it saw become ready first, then the rest in the current layout's order.
void Reducer::Impl::submit_order_locked() {
  std::vector<int64_t> o = ready_order;
  std::vector<char> in(params.size(), 0);
  for (int64_t i : o) in[i] = 1;
  for (int64_t i : layout_order())
    if (!in[i]) o.push_back(i);
  order = at::tensor(o, at::kLong);
  recording = false;
  auto what = "the bucket rebuild order broadcast on " + group;
  order_ticket = queue->submit(what, [g = pg, t = order, s = opts.timeout_s, what] {
    std::vector<at::Tensor> v{t};
    c10d::BroadcastOptions bo;
    bo.rootRank = 0;
    wait_work(g->broadcast(v, bo), s, what);
  });
}

std::vector<int64_t> Reducer::Impl::layout_order() const {
  std::vector<int64_t> o;
  for (const auto& b : layout) o.insert(o.end(), b.begin(), b.end());
  return o;
}

// At the end of the first step: the layout from the broadcast order, if it differs.
// Returns whether the buckets changed.
bool Reducer::Impl::apply_order() {
  rebuild_pending = false;
  if (!order.defined()) return false;
  std::vector<int64_t> o(order.data_ptr<int64_t>(), order.data_ptr<int64_t>() + order.numel());
  order = at::Tensor();
  auto fresh = assign(o);
  if (fresh == layout) return false;
  // Collective: every rank reaches this point in the same sequence (the queue is idle).
  // A fresh segment: the gradients move from the old buckets into the new ones.
  if (arena) make_arena(fresh);
  build_buckets(std::move(fresh));
  rebuilt = true;
  return true;
}

// Note [Hook buckets follow torch's]
// A comm hook may keep state per bucket index (PowerSGD's error feedback and warm-start
// memories). torch's DDP shows hooks its constructor's buckets in the first step and
// the rebuilt ones afterwards; a state saved mid-training and loaded into a fresh
// model therefore meets the constructor's layout in torch's first step. Giving the
// hook the same sequence of layouts is what makes smp land where torch lands after
// such a reload (the seed example of torch's comm-hook docs). smp takes torch's
// constructor layout only where it holds the same buckets as smp's traced one, in
// another order: where torch's groups parameters differently, a state saved from the
// rebuilt layout does not fit torch's first step (torch fails), and smp keeps the
// traced layout, where the state fits and training resumes exactly.
void Reducer::use_torch_initial_layout() {
  auto& im = *impl_;
  std::lock_guard<std::mutex> lock(im.mu);
  if (im.started)
    throw std::logic_error("smp: use_torch_initial_layout must be called before the first step");
  std::vector<int64_t> order(im.params.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
  auto fresh = compute_bucket_assignment(im.params, order, im.opts.bucket_cap_bytes,
                                         im.opts.first_bucket_bytes, im.groups);
  std::reverse(fresh.begin(), fresh.end());
  fresh = im.arranged(std::move(fresh));
  if (fresh == im.layout) return;
  // Only an order within the same buckets: where torch's constructor groups the
  // parameters differently, its saved per-bucket state no longer fits on reload (torch
  // fails there); the traced layout keeps such a state fitting, and resume exact.
  if (fresh.size() != im.layout.size()) return;
  for (size_t b = 0; b < fresh.size(); ++b) {
    auto x = fresh[b], y = im.layout[b];
    std::sort(x.begin(), x.end());
    std::sort(y.begin(), y.end());
    if (x != y) return;
  }
  if (im.arena) im.make_arena(fresh);  // collective, as in apply_order()
  im.build_buckets(std::move(fresh));
}

void Reducer::adopt_layout(std::vector<std::vector<int64_t>> layout) {
  auto& im = *impl_;
  std::lock_guard<std::mutex> lock(im.mu);
  if (im.started) throw std::logic_error("smp: adopt_layout must be called before the first step");
  std::vector<int64_t> all;
  for (const auto& b : layout) {
    if (b.empty()) throw std::invalid_argument("smp: a saved bucket layout has an empty bucket");
    all.insert(all.end(), b.begin(), b.end());
  }
  std::sort(all.begin(), all.end());
  bool every_once = all.size() == im.params.size();
  for (size_t i = 0; every_once && i < all.size(); ++i) every_once = all[i] == static_cast<int64_t>(i);
  if (!every_once)
    throw std::invalid_argument(str_cat("smp: the saved bucket layout does not hold each of this "
                                        "reducer's ", im.params.size(), " parameters exactly once "
                                        "(saved by another model?)"));
  im.rebuild_pending = false;
  im.recording = false;
  im.rebuilt = true;
  layout = im.arranged(std::move(layout));
  if (layout == im.layout) return;
  if (im.arena) im.make_arena(layout);  // collective, as in apply_order()
  im.build_buckets(std::move(layout));
}

}  // namespace smp
