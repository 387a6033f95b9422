// The reducer's step: arming a synchronized backward, copying gradients into buckets
// as they become ready, launching buckets in order, and finalize(); and Reducer's
// methods. The rest of Reducer::Impl (detail/reducer_impl.h) is split by concept:
// detail/reducer_build.cpp (construction: checks, buckets, autograd hooks),
// detail/reducer_default_hooks.cpp, detail/reducer_rebuild.cpp,
// detail/reducer_shadow.cpp, detail/reducer_pipeline.cpp.
//
// Threads (reducer.h): prepare() and finalize() on the training thread, on_grad_ready()
// on autograd's thread as each accumulator fires, the buckets' hooks on the comm
// thread; every member under `mu` unless reducer_impl.h says otherwise.
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

#include "smp_core/comm_queue.h"
#include "smp_core/compat/torch_compat.h"
#include "smp_core/detail/autograd_graph.h"
#include "smp_core/detail/reducer_impl.h"
#include "smp_core/detail/shm_allreduce.h"
#include "smp_core/device_sync.h"
#include "smp_core/errors.h"

namespace smp {

namespace detail {

std::string describe_tensor(const at::Tensor& t) {
  std::ostringstream os;
  os << c10::toString(t.scalar_type()) << t.sizes();
  if (!t.device().is_cpu()) os << "@" << t.device();
  return os.str();
}

bool is_view_of(const at::Tensor& grad, const at::Tensor& view) {
  return grad.defined() && grad.is_alias_of(view) && grad.data_ptr() == view.data_ptr() &&
         grad.sizes() == view.sizes() && grad.strides() == view.strides();
}

}  // namespace detail

using detail::align64;
using detail::is_view_of;
using detail::ms_since;
using Clock = detail::Clock;

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
  // Note [Slices reduce over their rdp group]: the batches that contributed.
  const double batches = active_ranks > 0 ? active_ranks : world;
  factor[0] = grad_scale / (default_hook ? batches : 1);
  factor[1] = grad_scale /
              (default_hook ? (opts.prescaled_batch ? batches * slice_world / world : batches) : 1);
  for (int g = 0; g < 2; ++g) {
    scale[g] = c10::scalar_to_tensor(factor[g]);
    scale[g].unsafeGetTensorImpl()->set_wrapped_number(true);
  }
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
  if (pipeline) {
    arm_pipeline_locked(*held);  // Note [Pipeline overlap]
  } else {
    std::vector<char> reachable(params.size(), 0);
    if (!outputs.empty()) detail::mark_reachable(outputs, node_index, reachable);
    for (size_t i = 0; i < params.size(); ++i)
      if (!reachable[i]) mark_ready_locked(static_cast<int64_t>(i));
  }
  if (opts.overlapping) launch_ready_locked();
}

void Reducer::Impl::on_grad_ready(int64_t i) {
  std::lock_guard<std::mutex> lock(mu);
  if (recording && !seen[i]) {
    seen[i] = 1;
    ready_order.push_back(i);
  }
  if (phase != Phase::kSync) return;
  if (pipeline) {
    on_pipeline_fire_locked(i);  // Note [Pipeline overlap]
    return;
  }
  if (ready[i])
    throw std::logic_error(str_cat(
        "smp: Reducer: the gradient of parameter ", i, " (", detail::describe_tensor(params[i]),
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
    const double f = factor[bk.group];
    const at::Tensor& scale_by = scale[bk.group];
    if (opts.gradient_as_bucket_view && is_view_of(grad, view)) {
      if (f != 1.0) view.mul_(scale_by);
    } else {
      if (f != 1.0) {
        at::mul_out(view, grad, scale_by);
      } else {
        view.copy_(grad);
      }
      if (opts.gradient_as_bucket_view) grad = view;
    }
    // Note [Reduce to owner]: another rank keeps this gradient; its local sum is in the
    // bucket now (a pipeline step may still redo it from .grad: freed in write_back).
    if (!keeps(i) && !pipeline && !opts.gradient_as_bucket_view) grad = at::Tensor();
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
  // After the buckets, in the same queue: the used bitmap (every step, Note [Used
  // bitmap]) and the first step's gradient order. Every gradient is final by now.
  bitmap_slots.pack_step(bitmap.data_ptr<int32_t>(), used, stale);
  if (abandoning) bitmap_slots.mark_failed(bitmap.data_ptr<int32_t>(), rank);
  bitmap_ticket = submit_bitmap_locked(str_cat("the used-parameter allreduce on ", group,
                                               " in step ", steps_done->load() + 1));
  if (rebuild_pending) submit_order_locked();
}

CommQueue::TicketPtr Reducer::Impl::submit_bitmap_locked(const std::string& what) {
  return queue->submit(what, [g = pg, a = arena, off = bitmap_offset, t = bitmap,
                              s = opts.timeout_s, what] {
    if (a) {
      a->allreduce(off, t.numel(), at::kInt, /*shadow=*/false, s, what);
    } else {
      std::vector<at::Tensor> v{t};
      wait_work(g->allreduce(v), s, what);
    }
  });
}

void Reducer::Impl::launch_locked(size_t b, bool shadow) {
  Bucket& bk = buckets[b];
  if (!shadow && !finalizing) {
    if (early_buckets++ == 0)
      first_launch_s = std::chrono::duration<double>(Clock::now().time_since_epoch()).count();
  }
  auto run = std::make_shared<detail::BucketRun>();
  run->bucket = std::make_shared<GradBucket>(
      b, buckets.size(), shadow ? at::zeros_like(bk.buffer) : bk.buffer, bk.tensors,
      bk.offsets, bk.group ? slice_pg : pg, shadow);
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
  wait_ticket(ticket);
  detail::BucketRun& run = *runs[b];
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

// Note [Failed peer]: a replica whose failure has no collective to travel in (a step
// that does not reduce, with backward_passes_per_step > 1) posts it to the store under
// the step its peers will wait in (smp.step's failure path, Reducer::set_peer_probe).
// A wait here that lasts beyond kProbeEvery_s asks the probe between slices, so the
// peers raise naming that replica instead of waiting out timeout_s. A wait that ends in
// time never asks: no cost to a healthy step.
void Reducer::Impl::wait_ticket(const CommQueue::TicketPtr& t) {
  const double total = opts.timeout_s + 1.0;
  if (!peer_probe) return queue->wait(t, total);
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(total));
  while (true) {
    const double left = std::chrono::duration<double>(deadline - Clock::now()).count();
    try {
      queue->wait(t, std::max(0.0, std::min(kProbeEvery_s, left)));
      return;
    } catch (const TimeoutError&) {
      if (left <= kProbeEvery_s) throw;
    }
    const std::string why = peer_probe(steps_done->load() + 1);
    if (!why.empty()) throw CommError(why);
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
                            r.defined() ? detail::describe_tensor(r) : "no tensor", " for ", bucket_what(b),
                            ", which holds ", bk.buffer.numel(), " elements"));
  const bool same =
      r.data_ptr() == bk.buffer.data_ptr() && r.scalar_type() == bk.buffer.scalar_type();
  if (opts.gradient_as_bucket_view && !same && global == nullptr) bk.buffer.copy_(r.reshape({-1}));
  at::Tensor flat = (same || opts.gradient_as_bucket_view) ? at::Tensor() : r.reshape({-1});
  for (size_t j = 0; j < bk.params.size(); ++j) {
    const int64_t i = bk.params[j];
    if (!keeps(i)) {  // Note [Reduce to owner]: another rank keeps it
      if (global == nullptr) params[i].mutable_grad() = at::Tensor();
      continue;
    }
    if (global == nullptr ? !used[i] : (used[i] || bitmap_slots.used_count(global, i) == 0))
      continue;
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
    if (pipeline)  // Note [Pipeline overlap]: empties `waits`
      finalize_pipeline(lock, waits, bitmap_t, st);
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
    wait_ticket(bitmap_t);
    if (order_t) wait_ticket(order_t);
    check_failed_ranks();
    st.wait_ms += ms_since(t0);

    t0 = Clock::now();
    const int32_t* global = bitmap.data_ptr<int32_t>();
    st.unused_local = st.unused_global = 0;
    for (size_t i = 0; i < params.size(); ++i) {
      st.unused_local += !used[i];
      st.unused_global += bitmap_slots.used_count(global, i) == 0;
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

void Reducer::Impl::shutdown() {
  for (size_t i = 0; i < accumulators.size(); ++i) accumulators[i]->del_post_hook(hook_keys[i]);
  queue.reset();
}

void Reducer::Impl::rethrow_with_hint(const std::exception& e) {
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

// --- Reducer ----------------------------------------------------------------------

Reducer::Reducer(std::vector<at::Tensor> params, ProcessGroupPtr pg, ReducerOptions options)
    : impl_(std::make_shared<Impl>(std::move(params), std::move(pg), std::move(options))) {
  impl_->init();
}

Reducer::~Reducer() { impl_->shutdown(); }

void Reducer::register_comm_hook(CommHookPtr hook) {
  if (!hook) throw ConfigError("smp: register_comm_hook: the hook is null");
  std::lock_guard<std::mutex> lock(impl_->mu);
  check_slices(impl_->slicing(), hook->name());
  if (impl_->sharded())
    throw ConfigError(str_cat(
        "smp: register_comm_hook(hook='", hook->name(), "'): with optimizer-state sharding "
        "(config 'shard_optimizer_state'=true) each gradient is reduced to the one rank that "
        "steps it (a reduce-scatter), and a comm hook reduces whole buckets; allowed with "
        "sharding: no hook (the default reduction). Set 'shard_optimizer_state' to false to "
        "use this hook"));
  if (!impl_->default_hook || impl_->started)
    throw std::logic_error("smp: register_comm_hook must be called once, before the first step");
  impl_->user_hook = std::move(hook);
  impl_->default_hook = false;
  impl_->wrap_user_hook();
}

void Reducer::prepare_for_backward(bool sync, double grad_scale,
                                   const std::vector<at::Tensor>& outputs) {
  impl_->prepare(sync, grad_scale, outputs);
}

ReducerStats Reducer::finalize() { return impl_->finalize(); }
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

void Reducer::set_peer_probe(std::function<std::string(int64_t)> probe) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->peer_probe = std::move(probe);
}

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

std::string Reducer::hierarchy() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->arena && impl_->arena->links() ? impl_->arena->links()->shape : "";
}

ProcessGroupPtr Reducer::hosts_group() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (!impl_->arena || !impl_->arena->links() || impl_->arena->rank() != 0) return {};
  return impl_->arena->links()->cross;
}

ReducerStats Reducer::stats() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->stats;
}

bool Reducer::sliced() const { return impl_->slicing(); }

size_t Reducer::num_params() const { return impl_->params.size(); }

const ProcessGroupPtr& Reducer::process_group() const { return impl_->pg; }

}  // namespace smp
