// The reducer's core: construction (checks, buckets, autograd hooks), arming a
// synchronized backward, copying gradients into buckets as they become ready,
// launching buckets in order, and finalize(). The rest of Reducer::Impl
// (detail/reducer_impl.h) is split by concept: detail/reducer_default_hooks.cpp,
// detail/reducer_rebuild.cpp, detail/reducer_shadow.cpp, detail/reducer_pipeline.cpp.
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
  if (sharded()) {
    bool ok = static_cast<int64_t>(opts.owners.size()) == n;
    for (int o : opts.owners) ok = ok && o >= -1 && o < world;
    if (!ok)
      throw ConfigError(str_cat("smp: Reducer: owners (", opts.owners.size(),
                                " entries) must give each of the ", n,
                                " parameters a rank of the group (0..", world - 1,
                                ") or -1 (every rank)"));
  }
  verify_across_ranks(order);
  bitmap_slots = detail::UsedBitmap(params.size(), world);
  rebuild_pending = opts.rebuild_buckets;
  recording = opts.rebuild_buckets;
  seen.assign(n, 0);
  ready.assign(n, 0);
  used.assign(n, 0);
  auto first_layout = arranged(compute_bucket_assignment(params, order, opts.bucket_cap_bytes,
                                                         opts.first_bucket_bytes));
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
  os << " owners=";
  for (size_t k = 0; k < opts.owners.size(); ++k) os << (k ? "," : "") << opts.owners[k];
  for (const auto& p : params) os << "\n" << detail::describe_tensor(p);
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
  if (!sharded()) return layout;
  auto key = [&](int64_t i) { return opts.owners[i] < 0 ? world : opts.owners[i]; };
  for (auto& b : layout)
    std::stable_sort(b.begin(), b.end(), [&](int64_t x, int64_t y) { return key(x) < key(y); });
  return layout;
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
  bytes += align64(bitmap_slots.size() * sizeof(int32_t));  // Note [Used bitmap]
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
  if (sharded()) {
    detail::BucketSegments segments;
    for (const auto& bk : fresh) segments.push_back(bk.segments);
    hook = detail::make_owner_reduce_hook(arena, offsets, std::move(segments), opts.timeout_s,
                                          group, steps_done);
  } else if (default_hook) {
    hook = arena ? detail::make_shm_sum_hook(arena, offsets, opts.timeout_s, group, steps_done)
                 : detail::make_sum_allreduce_hook();
  }
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
  if (impl_->sharded())
    throw ConfigError(str_cat(
        "smp: register_comm_hook(hook='", hook->name(), "'): with optimizer-state sharding "
        "(config 'shard_optimizer_state'=true) each gradient is reduced to the one rank that "
        "steps it (a reduce-scatter), and a comm hook reduces whole buckets; allowed with "
        "sharding: no hook (the default reduction). Set 'shard_optimizer_state' to false to "
        "use this hook"));
  if (!impl_->default_hook || impl_->started)
    throw std::logic_error("smp: register_comm_hook must be called once, before the first step");
  impl_->hook = std::move(hook);
  impl_->default_hook = false;
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

ReducerStats Reducer::stats() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->stats;
}

size_t Reducer::num_params() const { return impl_->params.size(); }

const ProcessGroupPtr& Reducer::process_group() const { return impl_->pg; }

}  // namespace smp
