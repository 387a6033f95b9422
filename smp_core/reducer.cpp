#include "smp_core/reducer.h"

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <numeric>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include "smp_core/comm_queue.h"
#include "smp_core/compat/torch_compat.h"
#include "smp_core/detail/autograd_graph.h"
#include "smp_core/device_sync.h"
#include "smp_core/detail/shm_allreduce.h"
#include "smp_core/errors.h"

namespace smp {
namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

std::string describe(const at::Tensor& t) {
  std::ostringstream os;
  os << c10::toString(t.scalar_type()) << t.sizes();
  if (!t.device().is_cpu()) os << "@" << t.device();
  return os.str();
}

// The default hook: sums the buffer; the 1/world_size factor is fused into the copy
// of each gradient into the bucket (one pass over the gradient instead of two).
class SumAllreduceHook : public CommHook {
 public:
  FuturePtr run(GradBucket& bucket) override {
    return allreduce_flat(bucket.process_group(), bucket.buffer());
  }
  std::string name() const override { return "allreduce"; }
  bool issues_all_in_run() const override { return true; }
};

// The default hook when the ranks share this host: see Note [Shared-memory bucket
// reduction] (detail/shm_allreduce.cpp). Synchronous: the sum is done when run() returns.
class ShmSumHook : public CommHook {
 public:
  ShmSumHook(std::shared_ptr<detail::ShmArena> arena, std::vector<size_t> offsets,
             double timeout_s, std::string group, std::shared_ptr<std::atomic<int64_t>> steps)
      : arena_(std::move(arena)), offsets_(std::move(offsets)), timeout_s_(timeout_s),
        group_(std::move(group)), steps_(std::move(steps)) {}
  FuturePtr run(GradBucket& bucket) override {
    const at::Tensor& buf = bucket.buffer();
    arena_->allreduce(offsets_.at(bucket.index()), buf.numel(), buf.scalar_type(),
                      bucket.is_shadow(), timeout_s_,
                      str_cat("bucket ", bucket.index(), " of ", bucket.bucket_count(),
                              " (shared memory) on ", group_, " in step ",
                              steps_->load() + 1));
    return completed_future(buf);
  }
  std::string name() const override { return "allreduce (shared memory)"; }
  bool issues_all_in_run() const override { return true; }

 private:
  std::shared_ptr<detail::ShmArena> arena_;
  std::vector<size_t> offsets_;  // per bucket, bytes into this rank's slot
  double timeout_s_;
  std::string group_;
  std::shared_ptr<std::atomic<int64_t>> steps_;  // the reducer's steps_run
};

size_t align64(size_t n) { return (n + 63) / 64 * 64; }

// True if `grad` is exactly `view` (same memory, shape and strides).
bool is_view_of(const at::Tensor& grad, const at::Tensor& view) {
  return grad.defined() && grad.is_alias_of(view) && grad.data_ptr() == view.data_ptr() &&
         grad.sizes() == view.sizes() && grad.strides() == view.strides();
}

struct Bucket {
  at::Tensor buffer;               // flat, contiguous
  std::vector<int64_t> params;     // parameter indices, in buffer order
  std::vector<at::Tensor> tensors; // the parameters themselves (for GradBucket)
  std::vector<int64_t> offsets;
  std::vector<at::Tensor> views;   // views[j]: buffer slice shaped like params[j]
  size_t pending = 0;              // gradients not yet ready this step
};

// One bucket's communication in one step; shared with its comm-thread task.
struct BucketRun {
  std::shared_ptr<GradBucket> bucket;
  FuturePtr future;  // the hook's
  at::Tensor result;  // set once the future completed and the hook's result() ran
  Clock::time_point start;
  std::shared_ptr<std::atomic<int64_t>> done_ns = std::make_shared<std::atomic<int64_t>>(0);
  double comm_ms() const {
    int64_t d = done_ns->load();
    auto end = d ? Clock::time_point(Clock::duration(d)) : Clock::now();
    return std::chrono::duration<double, std::milli>(end - start).count();
  }
};

}  // namespace

struct Reducer::Impl : std::enable_shared_from_this<Reducer::Impl> {
  enum class Phase { kIdle, kAccumulate, kSync };

  std::vector<at::Tensor> params;
  ProcessGroupPtr pg;
  ReducerOptions opts;
  int rank = 0, world = 1;
  std::string group;  // "the dp process group (gloo, rank 0 of 2)"

  std::vector<compat::GradAccumulatorPtr> accumulators;  // kept alive
  std::vector<uintptr_t> hook_keys;
  std::unordered_map<const torch::autograd::Node*, int64_t> node_index;

  CommHookPtr hook = std::make_shared<SumAllreduceHook>();
  bool default_hook = true;
  std::unique_ptr<CommQueue> queue;
  std::shared_ptr<detail::ShmArena> arena;  // null: reduce through the process group
  size_t bitmap_offset = 0;                 // of the bitmap in this rank's arena slot

  mutable std::mutex mu;
  std::vector<std::vector<int64_t>> layout;
  std::vector<Bucket> buckets;
  std::vector<std::pair<int64_t, int64_t>> where;  // param -> (bucket, position)
  Phase phase = Phase::kIdle;
  bool started = false;
  std::string broken;  // first failure; the reducer refuses further steps

  // The step in flight.
  at::Tensor scale;  // wrapped-number scalar of the copy-in factor
  double factor = 1.0;
  std::vector<char> ready, used;
  size_t next_launch = 0;
  bool tail_launched = false;
  std::vector<std::shared_ptr<BucketRun>> runs;
  std::vector<CommQueue::TicketPtr> tickets;
  at::Tensor bitmap;
  CommQueue::TicketPtr bitmap_ticket;
  at::Tensor order;
  CommQueue::TicketPtr order_ticket;
  double copy_in_ms = 0;
  int64_t early_buckets = 0;
  double first_launch_s = 0;

  // Pipeline steps (Note [Pipeline overlap]).
  bool pipeline = false;                  // this sync step is a pipeline step
  bool finalizing = false;                // finalize() has begun (the tail may launch)
  std::vector<int64_t> fires;             // accumulator fires this step
  std::vector<int64_t> expected_fires;    // fires of the last pipeline step (empty: none)
  std::vector<char> hold;                 // ready only in finalize (tied weights)
  int64_t stale = 0;                      // fires after a parameter was copied out
  int active_ranks = 0;  // 0: divide by world (see set_active_ranks)
  // Synchronized + shadow steps finished or failed; shared with ShmSumHook's errors.
  std::shared_ptr<std::atomic<int64_t>> steps_done = std::make_shared<std::atomic<int64_t>>(0);

  // Gradient order of the first step (Note [Bucket rebuild]).
  bool recording = true;
  std::vector<char> seen;
  std::vector<int64_t> ready_order;
  bool rebuild_pending = true;
  bool rebuilt = false;
  ReducerStats stats;

  Impl(std::vector<at::Tensor> ps, ProcessGroupPtr g, ReducerOptions o)
      : params(std::move(ps)), pg(std::move(g)), opts(std::move(o)) {}

  void init();
  void verify_across_ranks(const std::vector<int64_t>& order);
  void build_buckets(std::vector<std::vector<int64_t>> new_layout);
  void make_arena(const std::vector<std::vector<int64_t>>& for_layout);
  void on_grad_ready(int64_t i);
  void mark_ready_locked(int64_t i);
  void launch_ready_locked();
  void launch_locked(size_t b, bool shadow);
  void await_bucket(size_t b, const CommQueue::TicketPtr& ticket);
  void write_back(size_t b, const int32_t* global);
  void submit_order_locked();
  std::vector<int64_t> layout_order() const;
  bool apply_order();
  void prepare(bool sync, double grad_scale, const std::vector<at::Tensor>& outputs,
               const std::vector<int64_t>* held = nullptr);
  void prepare_pipeline(double grad_scale, const std::vector<int64_t>& held);
  void redo_all_locked();
  ReducerStats finalize();
  void shadow_step(bool failed = false);
  void shutdown();

  // Note [Failed rank]: the last slot of the used bitmap carries, below bit 20, the
  // count of late gradients (Note [Pipeline overlap]) and, from bit 20 up, one bit per
  // rank (ranks < 11) that could not run its step; any other rank then fails alike.
  static constexpr int kFailedShift = 20;
  static int32_t failed_flag(int r) { return r < 11 ? (int32_t{1} << (kFailedShift + r)) : (int32_t{1} << 30); }
  static int32_t stale_count(int32_t slot) { return slot & ((int32_t{1} << kFailedShift) - 1); }
  void check_failed_ranks() {
    const int32_t slot = bitmap.data_ptr<int32_t>()[params.size()];
    if ((slot >> kFailedShift) == 0) return;
    std::string who;
    for (int r = 0; r < 11 && r < world; ++r)
      if (slot & failed_flag(r)) who += str_cat(who.empty() ? "" : ",", r);
    if (who.empty()) who = ">= 11";
    throw CommError(str_cat("smp: ", opts.group_name, " rank(s) ", who, " of ", group,
                            " could not run step ", steps_done->load() + 1,
                            " (see the error raised there, e.g. a bad input); every rank "
                            "of the group stops here"));
  }

  void check_usable() const {
    if (!broken.empty())
      throw CommError(str_cat("smp: the reducer of ", group,
                              " is unusable after an earlier failure: ", broken));
  }
  // A rank that ran out of data while its peers go on leaves them waiting, or exits
  // under them: a timeout of a step, or a peer that exited or closed its connections
  // in one, says what to do about uneven inputs.
  [[noreturn]] static void rethrow_with_hint(const std::exception& e) {
    static const char* kHint =
        " (if the ranks have different numbers of batches (uneven inputs), train inside "
        "`with model.join():` or `with smp.join.Join([model, optimizer]):`)";
    if (dynamic_cast<const TimeoutError*>(&e) != nullptr)
      throw TimeoutError(str_cat(e.what(), kHint));
    const std::string msg = e.what();
    if (dynamic_cast<const CommError*>(&e) != nullptr &&
        (msg.find(" exited without reaching it") != std::string::npos ||
         msg.find("Connection closed") != std::string::npos ||
         msg.find("Connection reset") != std::string::npos))
      throw CommError(str_cat(msg, kHint));
    throw;
  }
  std::string bucket_what(size_t b) const {
    return str_cat("bucket ", b, " of ", buckets.size(), " (comm hook '", hook->name(),
                   "') on ", group, " in step ", steps_done->load() + 1);
  }
};

// --- construction -----------------------------------------------------------------

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
      throw ConfigError(str_cat("smp: Reducer: parameter ", i, " (", describe(p),
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
  verify_across_ranks(order);
  rebuild_pending = opts.rebuild_buckets;
  recording = opts.rebuild_buckets;
  seen.assign(n, 0);
  ready.assign(n, 0);
  used.assign(n, 0);
  auto first_layout = compute_bucket_assignment(params, order, opts.bucket_cap_bytes,
                                                opts.first_bucket_bytes);
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
     << " shared_memory=" << opts.shared_memory << " expected_order=";
  for (size_t k = 0; k < order.size(); ++k) os << (k ? "," : "") << order[k];
  for (const auto& p : params) os << "\n" << describe(p);
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

// The shared-memory segment for `for_layout` (collective; null on every rank when the
// ranks do not share this host, see detail::ShmArena::create).
void Reducer::Impl::make_arena(const std::vector<std::vector<int64_t>>& for_layout) {
  arena = nullptr;
  bool cpu = true;
  for (const auto& p : params) cpu = cpu && p.device().is_cpu();
  if (!opts.shared_memory || world < 2 || !cpu) return;
  size_t bytes = 0;
  for (const auto& b : for_layout) {
    size_t bucket = 0;
    for (int64_t i : b) bucket += params[i].numel() * params[i].element_size();
    bytes += align64(bucket);
  }
  bytes += align64((params.size() + 1) * sizeof(int32_t));  // used bitmap + stale count
  arena = detail::ShmArena::create(pg, bytes, opts.timeout_s,
                                   "the shared-memory segment of the reducer on " + group);
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
    if (arena) {
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
  const int64_t n = static_cast<int64_t>(params.size());
  if (arena) {
    bitmap_offset = slot_used;
    bitmap = arena->slot_tensor(bitmap_offset, n + 1, at::kInt);
  } else {
    bitmap = at::zeros({n + 1}, at::kInt);  // the last slot: Note [Pipeline overlap]
  }
  if (default_hook)
    hook = arena ? CommHookPtr(std::make_shared<ShmSumHook>(arena, offsets, opts.timeout_s, group,
                                                             steps_done))
                 : CommHookPtr(std::make_shared<SumAllreduceHook>());
  buckets = std::move(fresh);
  layout = std::move(new_layout);
  runs.assign(buckets.size(), nullptr);
  tickets.assign(buckets.size(), nullptr);
}

// --- one step ---------------------------------------------------------------------

void Reducer::Impl::prepare(bool sync, double grad_scale, const std::vector<at::Tensor>& outputs,
                            const std::vector<int64_t>* held) {
  std::lock_guard<std::mutex> lock(mu);
  check_usable();
  if (phase == Phase::kSync)
    throw std::logic_error(
        "smp: Reducer.prepare_for_backward was called again after a synchronized backward "
        "(sync=True) without finalize(); call finalize() once after the last backward of "
        "each step");
  started = true;
  if (opts.gradient_as_bucket_view) {
    // Re-point gradients that zero_grad(set_to_none=True) or an accumulation into a
    // fresh tensor detached from the bucket. Undefined ones stay None until ready.
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) {
      at::Tensor& grad = params[i].mutable_grad();
      const auto& view = buckets[where[i].first].views[where[i].second];
      if (grad.defined() && !is_view_of(grad, view)) {
        view.copy_(grad);
        grad = view;
      }
    }
  }
  if (!sync) {
    phase = Phase::kAccumulate;
    return;
  }
  phase = Phase::kSync;
  factor = grad_scale / (default_hook ? (active_ranks > 0 ? active_ranks : world) : 1);
  scale = c10::scalar_to_tensor(factor);
  scale.unsafeGetTensorImpl()->set_wrapped_number(true);
  std::fill(ready.begin(), ready.end(), 0);
  std::fill(used.begin(), used.end(), 0);
  for (auto& bk : buckets) bk.pending = bk.params.size();
  next_launch = 0;
  tail_launched = false;
  copy_in_ms = 0;
  std::fill(runs.begin(), runs.end(), nullptr);
  std::fill(tickets.begin(), tickets.end(), nullptr);
  bitmap_ticket = order_ticket = nullptr;
  pipeline = held != nullptr;
  finalizing = false;
  early_buckets = 0;
  first_launch_s = 0;
  if (pipeline) {  // Note [Pipeline overlap]
    stale = 0;
    fires.assign(params.size(), 0);
    hold.assign(params.size(), opts.gradient_as_bucket_view ? 1 : 0);
    for (int64_t i : *held) {
      SMP_CHECK(i >= 0 && i < static_cast<int64_t>(params.size()), "Reducer: held parameter ",
                i, " out of range");
      hold[i] = 1;
    }
    // A parameter that no backward of the last step touched is final already.
    if (!expected_fires.empty())
      for (size_t i = 0; i < params.size(); ++i)
        if (!hold[i] && expected_fires[i] == 0) mark_ready_locked(static_cast<int64_t>(i));
  } else {
    std::vector<char> reachable(params.size(), 0);
    if (!outputs.empty()) detail::mark_reachable(outputs, node_index, reachable);
    for (size_t i = 0; i < params.size(); ++i)
      if (!reachable[i]) mark_ready_locked(static_cast<int64_t>(i));
  }
  if (opts.overlapping) launch_ready_locked();
}

// Note [Pipeline overlap]: with partitions > 1 a rank runs the backward of each
// microbatch's calls separately, so a parameter's accumulator fires once per call of
// its module per microbatch, and its gradient is final after the last of them. The
// reducer counts the fires of each synchronized pipeline step and, from the next one
// on, takes a parameter as ready when its count reaches the last step's: its bucket
// then launches while the rest of the pipeline's backward runs. The tail (the
// used-parameter bitmap) waits for finalize(); its last slot carries the number of
// fires that came after their parameter was copied out (a module called more often
// than in the step before). If any rank saw one, every rank discards the step's
// results and reduces every gradient again from .grad, which still holds the local
// sums (results are written back only after that check). Held parameters (tied
// weights, summed across pp ranks after the step) are ready only in finalize(), as
// is everything with gradient_as_bucket_view (the bucket would alias .grad).
void Reducer::Impl::prepare_pipeline(double grad_scale, const std::vector<int64_t>& held) {
  prepare(true, grad_scale, {}, &held);
}

// Every bucket again from .grad (the tail is not sent again). Holds mu.
void Reducer::Impl::redo_all_locked() {
  std::fill(ready.begin(), ready.end(), 0);
  std::fill(used.begin(), used.end(), 0);
  for (auto& bk : buckets) bk.pending = bk.params.size();
  next_launch = 0;
  for (size_t i = 0; i < params.size(); ++i) mark_ready_locked(static_cast<int64_t>(i));
  while (next_launch < buckets.size()) launch_locked(next_launch++, false);
}

void Reducer::Impl::on_grad_ready(int64_t i) {
  std::lock_guard<std::mutex> lock(mu);
  if (recording && !seen[i]) {
    seen[i] = 1;
    ready_order.push_back(i);
  }
  if (phase != Phase::kSync) return;
  if (pipeline) {  // Note [Pipeline overlap]
    ++fires[i];
    if (ready[i]) {
      ++stale;
    } else if (!hold[i] && !expected_fires.empty() && fires[i] == expected_fires[i]) {
      mark_ready_locked(i);
      if (opts.overlapping) launch_ready_locked();
    }
    return;
  }
  if (ready[i])
    throw std::logic_error(str_cat(
        "smp: Reducer: the gradient of parameter ", i, " (", describe(params[i]),
        ") became ready twice in one synchronized backward: run one backward per "
        "prepare_for_backward(sync=True), and pass it every output the backward starts "
        "from"));
  mark_ready_locked(i);
  if (opts.overlapping) launch_ready_locked();
}

// Scales the gradient of parameter i into its slice (or zeros it if there is none).
void Reducer::Impl::mark_ready_locked(int64_t i) {
  auto t0 = Clock::now();
  at::NoGradGuard no_grad;
  auto [b, j] = where[i];
  Bucket& bk = buckets[b];
  at::Tensor& view = bk.views[j];
  at::Tensor& grad = params[i].mutable_grad();
  if (!grad.defined()) {
    view.zero_();
  } else {
    if (grad.is_sparse())
      throw std::runtime_error(str_cat("smp: Reducer: parameter ", i,
                                       " has a sparse gradient; only dense ones are supported"));
    used[i] = 1;
    if (opts.gradient_as_bucket_view && is_view_of(grad, view)) {
      if (factor != 1.0) view.mul_(scale);
    } else {
      if (factor != 1.0) {
        at::mul_out(view, grad, scale);
      } else {
        view.copy_(grad);
      }
      if (opts.gradient_as_bucket_view) grad = view;
    }
  }
  ready[i] = 1;
  --bk.pending;
  copy_in_ms += ms_since(t0);
}

void Reducer::Impl::launch_ready_locked() {
  while (next_launch < buckets.size() && buckets[next_launch].pending == 0)
    launch_locked(next_launch++, false);
  if (next_launch < buckets.size() || tail_launched) return;
  if (pipeline && !finalizing) return;  // a late fire may still come (stale count)
  tail_launched = true;
  // After the buckets, in the same queue: the used-parameter bitmap (every step) and
  // the first step's gradient order. Every gradient is final by now.
  int32_t* d = bitmap.data_ptr<int32_t>();
  for (size_t i = 0; i < params.size(); ++i) d[i] = used[i];
  d[params.size()] = static_cast<int32_t>(stale);
  auto what = str_cat("the used-parameter allreduce on ", group, " in step ",
                      steps_done->load() + 1);
  bitmap_ticket = queue->submit(what, [g = pg, a = arena, off = bitmap_offset, t = bitmap,
                                       s = opts.timeout_s, what] {
    if (a) {
      a->allreduce(off, t.numel(), at::kInt, false, s, what);
    } else {
      std::vector<at::Tensor> v{t};
      wait_work(g->allreduce(v), s, what);
    }
  });
  if (rebuild_pending) submit_order_locked();
}

void Reducer::Impl::launch_locked(size_t b, bool shadow) {
  Bucket& bk = buckets[b];
  if (!shadow && !finalizing) {
    if (early_buckets++ == 0)
      first_launch_s = std::chrono::duration<double>(Clock::now().time_since_epoch()).count();
  }
  auto run = std::make_shared<BucketRun>();
  run->bucket = std::make_shared<GradBucket>(
      b, buckets.size(), shadow ? at::zeros_like(bk.buffer) : bk.buffer, bk.tensors,
      bk.offsets, pg, shadow);
  runs[b] = run;
  std::string what = bucket_what(b);
  // See Note [Streams across threads]: the copies into the bucket were queued on this
  // thread's stream; the comm thread's stream waits for them.
  auto produced = device::StreamPoint::record(run->bucket->buffer().device());
  // See Note [Ordered bucket communication]: a hook that issues all its collectives in
  // run() lets the comm thread go on at once; any other is waited for here.
  tickets[b] = queue->submit(what, [run, h = hook, s = opts.timeout_s, what, produced] {
    run->start = Clock::now();
    produced.block_current();
    device::record_current_stream(run->bucket->buffer());
    try {
      FuturePtr fut = h->run(*run->bucket);
      SMP_CHECK(fut, "comm hook '", h->name(), "' returned no future");
      run->future = fut;
      fut->addCallback([done = run->done_ns](c10::ivalue::Future&) {
        done->store(Clock::now().time_since_epoch().count());
      });
      if (!h->issues_all_in_run()) {
        wait_future(fut, s, what);
        run->result = h->result(*run->bucket, fut->value());
      }
    } catch (const CommError&) {
      throw;
    } catch (const std::exception& e) {
      throw CommError(str_cat("smp: ", what, " failed: ", e.what()));
    }
  });
}

// Waits until bucket b's task ran and its future completed; sets its result.
void Reducer::Impl::await_bucket(size_t b, const CommQueue::TicketPtr& ticket) {
  // Each task bounds its own waits by timeout_s and names what it awaited; the slack
  // lets that message win.
  queue->wait(ticket, opts.timeout_s + 1.0);
  BucketRun& run = *runs[b];
  if (run.result.defined()) return;
  std::string what = bucket_what(b);
  try {
    wait_future(run.future, opts.timeout_s, what);
    run.result = hook->result(*run.bucket, run.future->value());
  } catch (const CommError&) {
    throw;
  } catch (const std::exception& e) {
    throw CommError(str_cat("smp: ", what, " failed: ", e.what()));
  }
}

// Writes bucket b's result into .grad: first (global == nullptr) for the parameters
// used on this rank, which are then used globally; then, once the bitmap is known,
// for those unused here but used elsewhere. Unused everywhere: .grad stays as it was.
void Reducer::Impl::write_back(size_t b, const int32_t* global) {
  Bucket& bk = buckets[b];
  const at::Tensor& r = runs[b]->result;
  if (!r.defined() || r.numel() != bk.buffer.numel())
    throw CommError(str_cat("smp: comm hook '", hook->name(), "' returned ",
                            r.defined() ? describe(r) : "no tensor", " for ", bucket_what(b),
                            ", which holds ", bk.buffer.numel(), " elements"));
  const bool same =
      r.data_ptr() == bk.buffer.data_ptr() && r.scalar_type() == bk.buffer.scalar_type();
  if (opts.gradient_as_bucket_view && !same && global == nullptr) bk.buffer.copy_(r.reshape({-1}));
  at::Tensor flat = (same || opts.gradient_as_bucket_view) ? at::Tensor() : r.reshape({-1});
  for (size_t j = 0; j < bk.params.size(); ++j) {
    const int64_t i = bk.params[j];
    if (global == nullptr ? !used[i] : (used[i] || global[i] == 0)) continue;
    at::Tensor& grad = params[i].mutable_grad();
    if (opts.gradient_as_bucket_view) {
      if (!is_view_of(grad, bk.views[j])) grad = bk.views[j];
      continue;
    }
    const auto& p = params[i];
    at::Tensor src =
        flat.defined() ? flat.narrow(0, bk.offsets[j], p.numel()).view(p.sizes()) : bk.views[j];
    if (!grad.defined()) grad = at::empty(p.sizes(), p.options().requires_grad(false));
    grad.copy_(src);
  }
}

// The order every rank rebuilds with is dp rank 0's: the gradients it saw become
// ready first, then the rest in the current layout's order.
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

// Note [Bucket rebuild]: the buckets of the first step follow expected_order (or the
// reverse registration order). The order the grad accumulators actually fired in
// during the first step is recorded; at its end dp rank 0's order is broadcast through
// the comm queue (a point every rank reaches in the same sequence) and every rank
// recomputes the same layout from it, once.
bool Reducer::Impl::apply_order() {
  rebuild_pending = false;
  if (!order.defined()) return false;
  std::vector<int64_t> o(order.data_ptr<int64_t>(), order.data_ptr<int64_t>() + order.numel());
  order = at::Tensor();
  auto fresh = compute_bucket_assignment(params, o, opts.bucket_cap_bytes,
                                         opts.first_bucket_bytes);
  if (fresh == layout) return false;
  // Collective: every rank reaches this point in the same sequence (the queue is idle).
  // A fresh segment: the gradients move from the old buckets into the new ones.
  if (arena) make_arena(fresh);
  build_buckets(std::move(fresh));
  rebuilt = true;
  return true;
}

ReducerStats Reducer::Impl::finalize() {
  std::unique_lock<std::mutex> lock(mu);
  check_usable();
  if (phase != Phase::kSync)
    throw std::logic_error(
        "smp: Reducer.finalize() was called without prepare_for_backward(sync=True) "
        "before the step's last backward");
  ReducerStats st = stats;
  try {
    finalizing = true;
    st.redone = false;
    st.early_buckets = early_buckets;
    st.first_launch_s = first_launch_s;
    // Reachable parameters whose accumulator never fired count as ready now.
    for (size_t i = 0; i < params.size(); ++i)
      if (!ready[i]) mark_ready_locked(static_cast<int64_t>(i));
    launch_ready_locked();
    st.copy_in_ms = copy_in_ms;
    auto waits = tickets;
    auto bitmap_t = bitmap_ticket, order_t = order_ticket;
    lock.unlock();

    at::NoGradGuard no_grad;
    st.wait_ms = st.write_back_ms = st.comm_ms = 0;
    if (pipeline) {  // Note [Pipeline overlap]: check the stale count before writing back
      auto t0 = Clock::now();
      for (size_t b = 0; b < waits.size(); ++b) await_bucket(b, waits[b]);
      queue->wait(bitmap_t, opts.timeout_s + 1.0);
      check_failed_ranks();
      if (stale_count(bitmap.data_ptr<int32_t>()[params.size()]) > 0) {
        lock.lock();
        st.redone = true;
        redo_all_locked();
        waits = tickets;
        lock.unlock();
        for (size_t b = 0; b < waits.size(); ++b) await_bucket(b, waits[b]);
      }
      for (size_t b = 0; b < waits.size(); ++b) st.comm_ms += runs[b]->comm_ms();
      st.wait_ms += ms_since(t0);
      auto t1 = Clock::now();
      for (size_t b = 0; b < waits.size(); ++b) write_back(b, nullptr);
      st.write_back_ms += ms_since(t1);
      expected_fires = fires;
      waits.clear();  // done: the loop below has nothing left
    }
    // Bucket b is written back while later buckets are still being reduced.
    for (size_t b = 0; b < waits.size(); ++b) {
      auto t0 = Clock::now();
      await_bucket(b, waits[b]);
      st.comm_ms += runs[b]->comm_ms();
      auto t1 = Clock::now();
      write_back(b, nullptr);
      st.wait_ms += std::chrono::duration<double, std::milli>(t1 - t0).count();
      st.write_back_ms += ms_since(t1);
    }
    auto t0 = Clock::now();
    queue->wait(bitmap_t, opts.timeout_s + 1.0);
    if (order_t) queue->wait(order_t, opts.timeout_s + 1.0);
    check_failed_ranks();
    st.wait_ms += ms_since(t0);

    t0 = Clock::now();
    const int32_t* global = bitmap.data_ptr<int32_t>();
    st.unused_local = st.unused_global = 0;
    for (size_t i = 0; i < params.size(); ++i) {
      st.unused_local += !used[i];
      st.unused_global += global[i] == 0;
    }
    if (st.unused_local > st.unused_global)
      for (size_t b = 0; b < buckets.size(); ++b) write_back(b, global);
    st.write_back_ms += ms_since(t0);
    lock.lock();
    std::fill(runs.begin(), runs.end(), nullptr);
    st.rebuilt = rebuild_pending && apply_order();
  } catch (const std::exception& e) {
    if (!lock.owns_lock()) lock.lock();
    broken = e.what();
    phase = Phase::kIdle;
    ++*steps_done;
    rethrow_with_hint(e);
  }
  ++*steps_done;
  phase = Phase::kIdle;
  st.steps = stats.steps + 1;
  st.buckets = static_cast<int64_t>(buckets.size());
  stats = st;
  return st;
}

void Reducer::Impl::shadow_step(bool failed) {
  std::unique_lock<std::mutex> lock(mu);
  check_usable();
  if (phase != Phase::kIdle)
    throw std::logic_error("smp: Reducer.run_shadow_step() was called inside a step "
                           "(after prepare_for_backward)");
  started = true;
  std::vector<CommQueue::TicketPtr> waits;
  try {
    for (size_t b = 0; b < buckets.size(); ++b) {
      launch_locked(b, true);
      waits.push_back(tickets[b]);
    }
    // Zeros from this rank; the sum comes back, so a late-gradient redo by the ranks
    // still training (its last slot, Note [Pipeline overlap]) is shadowed too. A failed
    // step adds kFailedRank + this rank's bit to the last slot (Note [Failed rank]).
    bitmap.zero_();
    if (failed) bitmap.data_ptr<int32_t>()[params.size()] = failed_flag(rank);
    auto what = "the used-parameter allreduce (shadow step) on " + group;
    waits.push_back(queue->submit(what, [g = pg, a = arena, off = bitmap_offset, t = bitmap,
                                         s = opts.timeout_s, what] {
      if (a) {
        a->allreduce(off, t.numel(), at::kInt, /*shadow=*/false, s, what);
      } else {
        std::vector<at::Tensor> v{t};
        wait_work(g->allreduce(v), s, what);
      }
    }));
    if (rebuild_pending) {
      submit_order_locked();
      waits.push_back(order_ticket);
    }
    lock.unlock();
    for (size_t b = 0; b < buckets.size(); ++b) await_bucket(b, waits[b]);
    for (size_t k = buckets.size(); k < waits.size(); ++k) queue->wait(waits[k], opts.timeout_s + 1.0);
    lock.lock();
    if (!failed) check_failed_ranks();
    if (stale_count(bitmap.data_ptr<int32_t>()[params.size()]) > 0) {  // the others redo
      for (size_t b = 0; b < buckets.size(); ++b) launch_locked(b, true);
      auto again = tickets;
      lock.unlock();
      for (size_t b = 0; b < buckets.size(); ++b) await_bucket(b, again[b]);
      lock.lock();
    }
    std::fill(runs.begin(), runs.end(), nullptr);
    if (rebuild_pending) apply_order();
  } catch (const std::exception& e) {
    if (!lock.owns_lock()) lock.lock();
    broken = e.what();
    ++*steps_done;
    rethrow_with_hint(e);
  }
  ++*steps_done;
}

void Reducer::Impl::shutdown() {
  for (size_t i = 0; i < accumulators.size(); ++i) accumulators[i]->del_post_hook(hook_keys[i]);
  queue.reset();
}

// --- Reducer ----------------------------------------------------------------------

Reducer::Reducer(std::vector<at::Tensor> params, ProcessGroupPtr pg, ReducerOptions options)
    : impl_(std::make_shared<Impl>(std::move(params), std::move(pg), std::move(options))) {
  impl_->init();
}

Reducer::~Reducer() { impl_->shutdown(); }

void Reducer::register_comm_hook(CommHookPtr hook) {
  if (!hook) throw ConfigError("smp: register_comm_hook: the hook is null");
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (!impl_->default_hook || impl_->started)
    throw std::logic_error("smp: register_comm_hook must be called once, before the first step");
  impl_->hook = std::move(hook);
  impl_->default_hook = false;
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
                                         im.opts.first_bucket_bytes);
  std::reverse(fresh.begin(), fresh.end());
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

void Reducer::prepare_for_pipeline_backward(double grad_scale,
                                            const std::vector<int64_t>& hold) {
  impl_->prepare_pipeline(grad_scale, hold);
}

void Reducer::prepare_for_backward(bool sync, double grad_scale,
                                   const std::vector<at::Tensor>& outputs) {
  impl_->prepare(sync, grad_scale, outputs);
}

ReducerStats Reducer::finalize() { return impl_->finalize(); }

void Reducer::run_shadow_step() { impl_->shadow_step(); }
void Reducer::fail_step() { impl_->shadow_step(/*failed=*/true); }

void Reducer::set_active_ranks(int n) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (n < 0 || n > impl_->world)
    throw ConfigError(str_cat("smp: Reducer.set_active_ranks(", n, "): allowed 0..",
                              impl_->world, " (the size of ", impl_->group, ")"));
  if (impl_->phase == Impl::Phase::kSync)
    throw std::logic_error("smp: Reducer.set_active_ranks() was called inside a synchronized "
                           "step; call it before prepare_for_backward(sync=True)");
  impl_->active_ranks = n;
}

int64_t Reducer::steps_run() const { return impl_->steps_done->load(); }

std::vector<std::vector<int64_t>> Reducer::bucket_indices() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->layout;
}

bool Reducer::rebuilt() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->rebuilt;
}

bool Reducer::shared_memory() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->arena != nullptr;
}

ReducerStats Reducer::stats() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->stats;
}

size_t Reducer::num_params() const { return impl_->params.size(); }

const ProcessGroupPtr& Reducer::process_group() const { return impl_->pg; }

}  // namespace smp
