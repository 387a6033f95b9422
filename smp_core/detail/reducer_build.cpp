// Building the reducer: the parameters' and options' checks (every rank against the
// others, so all raise the same message), the bucket layout (Note [Reduce to owner]
// groups each bucket by owner), the shared-memory arena, the buckets themselves with
// their default hook, and the hooks on the gradients' accumulators. Part of
// Reducer::Impl (detail/reducer_impl.h).
//
// Threads: init() runs once on the constructing thread (Reducer's constructor), on
// every rank of the group (verify_across_ranks() and make_arena() are collectives);
// build_buckets() and make_arena() run again for a rebuild (detail/reducer_rebuild.cpp)
// on the training thread, between steps, with `mu` held by the caller (finalize(),
// use_torch_initial_layout(), adopt_layout()). Nothing here takes `mu`: during init()
// no hook is installed yet and no other thread knows the reducer.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>
#include <memory>
#include <sstream>
#include <string>
#include <unordered_set>
#include <vector>

#include "smp_core/comm_queue.h"
#include "smp_core/detail/autograd_graph.h"
#include "smp_core/detail/reducer_impl.h"
#include "smp_core/detail/shm_allreduce.h"
#include "smp_core/errors.h"

namespace smp {

using detail::align64;

// Note [Slices reduce over their rdp group]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Under tensor parallelism (docs/tensor_parallel.md, "the contract") the dp group
// spans tp x rdp ranks. A replicated parameter is the same tensor on all of them: its
// gradients are summed over the dp group, as without tp. A distributed parameter
// (`_smp_tp_dim`) is a different slice on each tp rank: only the ranks with the same tp
// rank, its rdp group, hold the same slice, so its gradients are summed over the rdp
// group alone (ReducerOptions::sliced, slice_group). One reducer does both:
// - Buckets are keyed by group as well as dtype/device (compute_bucket_assignment's
//   `groups`; arranged() splits a saved mixed bucket), so each bucket has one group,
//   and its GradBucket carries that group's process group.
// - Every bucket, of either group, goes through the one comm queue in bucket order, as
//   before: the layout is the same on every rank of the dp group (checked with the
//   marks in verify_across_ranks; the tp ranks' slices have equal shapes), so every
//   rank issues the same collectives on each group in the same order, and the rdp
//   groups (disjoint subsets of the dp group) never wait on one another.
// - Divisors (prepare()): a gradient is averaged over the batches that contributed.
//   Replicated: the dp group's size (each rank's own batch). Slices: without
//   prescaled_batch each tp rank's slice gradient already sums its tp group's
//   batches (the module gathered them), so the rdp sum covers dp-size batches: also the
//   dp size; with prescaled_batch the tp ranks share one batch and the rdp sum covers
//   rdp-size batches: the rdp size. Join's active ranks scale both alike.
// - Slice buckets live outside the shared-memory arena and are summed by allreduce over
//   the rdp group (make_slice_routed_hook): the arena sums over every rank of the dp
//   group. The used bitmap and the rebuild order stay on the dp group.
// - Optimizer-state sharding (Note [Reduce to owner]): a slice's owner is a rank of
//   its rdp group (ReducerOptions::owners gives rdp ranks for slices, dp ranks for the
//   rest; python/smp/optimizer_sharding.py divides them so), so a slice bucket's
//   segments are reduced to their owners over the rdp group, through the process group
//   (never the arena), and keeps() compares a slice's owner with this rank's rdp rank.
//   The stepped slices go back over the rdp group too (Note [Sharded optimizer state]).
// - A comm hook (PowerSGD, compression) reduces whole buckets over one group with its
//   own state: not made for slices yet, so check_slices refuses it, naming both.
// With tp = 1 the rdp group is the dp group and the marks change nothing.

void Reducer::check_slices(bool sliced, const std::string& hook) {
  if (!sliced || hook.empty()) return;
  throw ConfigError(str_cat(
      "smp: the comm hook '", hook, "' reduces whole buckets over the dp group, but "
      "tensor-parallel slices (parameters with _smp_tp_dim, from distributed modules under "
      "config 'tensor_parallel_degree' > 1) must be reduced over their rdp group; not "
      "supported yet together: register no comm hook, or use no distributed modules"));
}

void Reducer::Impl::init() {
  SMP_CHECK(pg, "Reducer: process group is null");
  rank = pg->getRank();
  world = pg->getSize();
  group = str_cat("the ", opts.group_name, " process group (", pg->getBackendName(), ", rank ",
                  rank, " of ", world, ")");
  const int64_t n = static_cast<int64_t>(params.size());
  std::unordered_set<const void*> distinct;
  for (int64_t i = 0; i < n; ++i) {
    const auto& p = params[i];
    if (!p.defined() || !p.requires_grad() || !p.is_leaf())
      throw ConfigError(str_cat("smp: Reducer: parameter ", i, " is not a leaf tensor that "
                                "requires grad (only those have gradients to reduce)"));
    if (p.is_sparse())
      throw ConfigError(str_cat("smp: Reducer: parameter ", i, " (", detail::describe_tensor(p),
                                ") is sparse; only dense parameters are supported"));
    if (!distinct.insert(p.unsafeGetTensorImpl()).second)
      throw ConfigError(str_cat("smp: Reducer: parameter ", i, " is given twice"));
  }
  std::vector<int64_t> order = opts.expected_order;
  if (order.empty()) {
    order.resize(n);
    for (int64_t i = 0; i < n; ++i) order[i] = n - 1 - i;
  } else {
    std::vector<char> hit(n, 0);
    bool ok = static_cast<int64_t>(order.size()) == n;
    for (int64_t i : order) ok = ok && i >= 0 && i < n && !hit[i]++;
    if (!ok)
      throw ConfigError(str_cat("smp: Reducer: expected_order (", order.size(),
                                " entries) is not a permutation of the ", n,
                                " parameter indices"));
  }
  if (!opts.sliced.empty()) {  // Note [Slices reduce over their rdp group]
    if (static_cast<int64_t>(opts.sliced.size()) != n)
      throw ConfigError(str_cat("smp: Reducer: sliced (", opts.sliced.size(),
                                " entries) must mark each of the ", n, " parameters"));
    const bool any = std::any_of(opts.sliced.begin(), opts.sliced.end(),
                                 [](int s) { return s != 0; });
    if (any && !opts.slice_group)
      throw ConfigError("smp: Reducer: parameters are marked sliced but no slice_group "
                        "(the rdp process group) reduces them");
    if (any) {
      slice_pg = opts.slice_group;
      slice_world = slice_pg->getSize();
      slice_rank = slice_pg->getRank();
      if (slice_world > world || world % slice_world != 0)
        throw ConfigError(str_cat("smp: Reducer: the slice group's size ", slice_world,
                                  " does not divide the size ", world, " of ", group));
      // tp = 1: the rdp group is the dp group, and a slice is a whole parameter.
      if (slice_world < world) {
        groups.assign(n, 0);
        for (int64_t i = 0; i < n; ++i) groups[i] = opts.sliced[i] != 0;
        slice_group = str_cat("the rdp process group (", slice_pg->getBackendName(), ", rank ",
                              slice_pg->getRank(), " of ", slice_world, ")");
      }
    }
  }
  if (sharded()) {  // after the slices: a slice's owner is a rank of its rdp group
    bool ok = static_cast<int64_t>(opts.owners.size()) == n;
    for (int64_t i = 0; ok && i < n; ++i) {
      const int o = opts.owners[i];
      ok = o >= -1 && o < (slicing() && groups[i] ? slice_world : world);
    }
    if (!ok)
      throw ConfigError(str_cat("smp: Reducer: owners (", opts.owners.size(),
                                " entries) must give each of the ", n,
                                " parameters a rank of the group (0..", world - 1,
                                "; a tp slice: of the slice group, 0..", slice_world - 1,
                                ") or -1 (every rank)"));
  }
  verify_across_ranks(order);
  bitmap_slots = detail::UsedBitmap(params.size(), world);
  rebuild_pending = opts.rebuild_buckets;
  recording = opts.rebuild_buckets;
  seen.assign(n, 0);
  ready.assign(n, 0);
  used.assign(n, 0);
  auto first_layout = assign(order);
  bool cpu = true;
  for (const auto& p : params) cpu = cpu && p.device().is_cpu();
  links = detail::make_host_links(pg, opts.shared_memory && cpu, opts.timeout_s,
                                  opts.group_name + " group");
  make_arena(first_layout);
  build_buckets(std::move(first_layout));
  queue = std::make_unique<CommQueue>(opts.group_name + "-reducer");

  std::weak_ptr<Impl> weak = shared_from_this();
  for (int64_t i = 0; i < n; ++i) {
    auto acc = torch::autograd::impl::grad_accumulator(params[i]);
    SMP_CHECK(acc, "Reducer: parameter ", i, " has no grad accumulator");
    hook_keys.push_back(acc->add_post_hook(std::make_unique<detail::GradReadyHook>([weak, i] {
      if (auto self = weak.lock()) self->on_grad_ready(i);
    })));
    node_index[acc.get()] = i;
    accumulators.push_back(std::move(acc));
  }
}

// Every rank describes its parameters and options; all compare against each other
// with the same data, so all raise the same message (none hangs in a later collective).
void Reducer::Impl::verify_across_ranks(const std::vector<int64_t>& order) {
  std::ostringstream os;
  os << "options: bucket_cap_bytes=" << opts.bucket_cap_bytes
     << " first_bucket_bytes=" << opts.first_bucket_bytes
     << " rebuild_buckets=" << opts.rebuild_buckets
     << " shared_memory=" << opts.shared_memory << " slice_group_size=" << slice_world
     << " prescaled_batch=" << opts.prescaled_batch << " expected_order=";
  for (size_t k = 0; k < order.size(); ++k) os << (k ? "," : "") << order[k];
  os << " owners=";
  for (size_t k = 0; k < opts.owners.size(); ++k) os << (k ? "," : "") << opts.owners[k];
  for (size_t i = 0; i < params.size(); ++i)
    os << "\n" << detail::describe_tensor(params[i]) << (slicing() && groups[i] ? " (tp slice)" : "");
  auto all = allgather_bytes(pg, os.str(), opts.timeout_s,
                             "the parameter check of the Reducer on " + group);
  auto lines = [](const std::string& s) {
    std::vector<std::string> out;
    std::istringstream is(s);
    for (std::string l; std::getline(is, l);) out.push_back(l);
    return out;
  };
  auto mine0 = lines(all[0]);
  for (int r = 1; r < static_cast<int>(all.size()); ++r) {
    auto other = lines(all[r]);
    if (other.size() != mine0.size())
      throw CommError(str_cat("smp: Reducer: ", opts.group_name, " rank 0 has ",
                              mine0.size() - 1, " parameters but ", opts.group_name, " rank ",
                              r, " has ", other.size() - 1,
                              " (every rank must pass the same parameters in the same order)"));
    if (other[0] != mine0[0])
      throw CommError(str_cat("smp: Reducer: ", opts.group_name, " ranks 0 and ", r,
                              " differ in the reducer's settings (", mine0[0], " vs ",
                              other[0], ")"));
    for (size_t k = 1; k < other.size(); ++k)
      if (other[k] != mine0[k])
        throw CommError(str_cat("smp: Reducer: parameter ", k - 1, " is ", mine0[k], " on ",
                                opts.group_name, " rank 0 but ", other[k], " on ",
                                opts.group_name, " rank ", r,
                                " (every rank must pass the same parameters in the same "
                                "order)"));
  }
}

std::vector<std::vector<int64_t>> Reducer::Impl::arranged(
    std::vector<std::vector<int64_t>> layout) const {
  if (slicing()) {  // Note [Slices reduce over their rdp group]: one group per bucket
    std::vector<std::vector<int64_t>> split;
    for (auto& b : layout) {
      std::vector<int64_t> slices;
      std::vector<int64_t> replicated;
      for (int64_t i : b) (groups[i] ? slices : replicated).push_back(i);
      if (!replicated.empty()) split.push_back(std::move(replicated));
      if (!slices.empty()) split.push_back(std::move(slices));
    }
    layout = std::move(split);
  }
  if (!sharded()) return layout;
  auto key = [&](int64_t i) { return opts.owners[i] < 0 ? world : opts.owners[i]; };
  for (auto& b : layout)
    std::stable_sort(b.begin(), b.end(), [&](int64_t x, int64_t y) { return key(x) < key(y); });
  return layout;
}

std::vector<std::vector<int64_t>> Reducer::Impl::assign(const std::vector<int64_t>& order) const {
  return arranged(compute_bucket_assignment(params, order, opts.bucket_cap_bytes,
                                            opts.first_bucket_bytes, groups));
}

// The shared-memory segment for `for_layout` (collective; null on every rank when the
// ranks do not share this host, see detail::ShmArena::create).
void Reducer::Impl::make_arena(const std::vector<std::vector<int64_t>>& for_layout) {
  arena = nullptr;
  bool cpu = true;
  for (const auto& p : params) cpu = cpu && p.device().is_cpu();
  if (!opts.shared_memory || world < 2 || !cpu) return;
  size_t bytes = 0;
  for (const auto& b : for_layout) {
    if (slicing() && groups[b.front()]) continue;  // reduced over the slice group
    size_t bucket = 0;
    for (int64_t i : b) bucket += params[i].numel() * params[i].element_size();
    bytes += align64(bucket);
  }
  bytes += align64(bitmap_slots.size() * sizeof(int32_t));  // Note [Used bitmap]
  arena = detail::ShmArena::create(pg, bytes, opts.timeout_s,
                                   "the shared-memory segment of the reducer on " + group, links);
  // Links between hosts work only with an arena on every host: all or none, as the
  // arena is (a failed segment anywhere leaves every rank flat).
  if (!arena) links = nullptr;
}

// The registered hook as the buckets call it: on the hosts' means over the hosts group
// when the reduction is hierarchical (Note [Hooks between hosts]), else as it is.
void Reducer::Impl::wrap_user_hook() {
  hook = arena && arena->links()
             ? detail::make_hosts_hook(user_hook, arena, opts.timeout_s, group, steps_done)
             : user_hook;
}

// Allocates the buckets of `new_layout` (in the arena, if any). With
// gradient_as_bucket_view, each defined .grad is copied into its slice and replaced by
// an alias of it.
void Reducer::Impl::build_buckets(std::vector<std::vector<int64_t>> new_layout) {
  at::NoGradGuard no_grad;
  std::vector<Bucket> fresh(new_layout.size());
  where.assign(params.size(), {-1, -1});
  std::vector<size_t> offsets;  // of each bucket in the arena slot
  size_t slot_used = 0;
  for (size_t b = 0; b < new_layout.size(); ++b) {
    Bucket& bk = fresh[b];
    bk.params = new_layout[b];
    int64_t total = 0;
    for (int64_t i : bk.params) {
      bk.offsets.push_back(total);
      total += params[i].numel();
    }
    const auto& first = params[bk.params.front()];
    bk.group = slicing() ? groups[bk.params.front()] : 0;
    if (bk.group) {  // Note [Slices reduce over their rdp group]: never in the arena
      offsets.push_back(0);
      bk.buffer = at::zeros({total}, first.options().requires_grad(false));
    } else if (arena) {
      offsets.push_back(slot_used);
      bk.buffer = arena->slot_tensor(slot_used, total, first.scalar_type());
      slot_used += align64(total * first.element_size());
    } else {
      bk.buffer = at::zeros({total}, first.options().requires_grad(false));
    }
    for (size_t j = 0; j < bk.params.size(); ++j) {
      const auto& p = params[bk.params[j]];
      bk.tensors.push_back(p);
      // An alias of the slice, not an autograd view: libtorch's Optimizer::zero_grad()
      // calls grad.detach_(), which refuses views.
      at::Tensor alias = at::empty({0}, bk.buffer.options());
      alias.set_(bk.buffer.storage(), bk.buffer.storage_offset() + bk.offsets[j], p.sizes());
      bk.views.push_back(std::move(alias));
      where[bk.params[j]] = {static_cast<int64_t>(b), static_cast<int64_t>(j)};
      if (sharded()) {  // Note [Reduce to owner]: one segment per owner
        const int owner = opts.owners[bk.params[j]];
        const int64_t end = bk.offsets[j] + p.numel();
        if (!bk.segments.empty() && bk.segments.back().owner == owner)
          bk.segments.back().end = end;
        else
          bk.segments.push_back({bk.offsets[j], end, owner});
      }
    }
  }
  if (opts.gradient_as_bucket_view) {
    for (size_t b = 0; b < fresh.size(); ++b) {
      for (size_t j = 0; j < fresh[b].params.size(); ++j) {
        at::Tensor& grad = params[fresh[b].params[j]].mutable_grad();
        if (!grad.defined()) continue;
        fresh[b].views[j].copy_(grad);
        grad = fresh[b].views[j];
      }
    }
  }
  const auto slots = static_cast<int64_t>(bitmap_slots.size());  // Note [Used bitmap]
  if (arena) {
    bitmap_offset = slot_used;
    bitmap = arena->slot_tensor(bitmap_offset, slots, at::kInt);
  } else {
    bitmap = at::zeros({slots}, at::kInt);
  }
  CommHookPtr slice_hook;  // null: allreduce (Note [Slices reduce over their rdp group])
  if (sharded()) {
    detail::BucketSegments segments;
    for (const auto& bk : fresh) segments.push_back(bk.segments);
    if (slicing())  // a slice bucket's owners are rdp ranks: reduced over the rdp group
      slice_hook = detail::make_owner_reduce_hook(nullptr, offsets, segments, opts.timeout_s,
                                                  slice_group, steps_done);
    hook = detail::make_owner_reduce_hook(arena, offsets, std::move(segments), opts.timeout_s,
                                          group, steps_done);
  } else if (default_hook) {
    hook = arena ? detail::make_shm_sum_hook(arena, offsets, opts.timeout_s, group, steps_done)
                 : detail::make_sum_allreduce_hook();
  } else {
    wrap_user_hook();
  }
  if (slicing() && default_hook) {  // Note [Slices reduce over their rdp group]
    std::vector<char> sliced_bucket;
    for (const auto& bk : fresh) sliced_bucket.push_back(static_cast<char>(bk.group));
    hook = detail::make_slice_routed_hook(hook, slice_hook, std::move(sliced_bucket));
  }
  buckets = std::move(fresh);
  layout = std::move(new_layout);
  runs.assign(buckets.size(), nullptr);
  tickets.assign(buckets.size(), nullptr);
}

}  // namespace smp
