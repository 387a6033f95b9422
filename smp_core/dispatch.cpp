#include "smp_core/dispatch.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <set>

#include "smp_core/compat/torch_compat.h"
#include "smp_core/detail/autograd_graph.h"
#include "smp_core/errors.h"
#include "smp_core/task.h"
#include "smp_core/task_rng.h"

namespace smp {
namespace {

constexpr uint32_t bit(int32_t kind) { return uint32_t{1} << kind; }
constexpr uint32_t kServeMask = bit(kRequest) | bit(kBackwardRequest) | bit(kAbort);

bool is_request(const Message& m) { return m.kind == kRequest || m.kind == kBackwardRequest; }

Phase phase_of(const Message& m) {
  return m.kind == kBackwardRequest ? Phase::kBackward : Phase::kForward;
}

// Puts the default generators back as they were when it was made (`on`), whatever
// the step's tasks left in them.
class RestoreRng {
 public:
  RestoreRng(bool on, bool cuda) : state_(on ? task_rng::capture(cuda) : "") {}
  ~RestoreRng() {
    try {
      task_rng::install(state_);
    } catch (...) {
    }
  }

 private:
  std::string state_;
};

}  // namespace

struct Dispatcher::Impl {
  std::shared_ptr<P2PEngine> p2p;
  Schedule schedule;
  Handler handler;
  Spawn spawn;
  ErrorEncoder encode_error;
  ErrorRaiser raise_error;
  RecvOrder order;
  std::chrono::milliseconds timeout;

  std::mutex mu;  // guards everything below
  std::condition_variable cv;
  // Serving (Note [Serving]).
  bool free = true;   // nobody leads: the next idle serving thread takes the lead
  bool over = false;  // the step ended or failed: serving threads stop
  int idle = 0;       // serving threads waiting for the lead
  int active = 0;     // threads started by this step and not yet returned
  std::exception_ptr error;  // what stopped a thread first
  Message end;               // the step's kStepEnd or kAbort, as a serving thread got it
  // The step.
  int64_t microbatches = 1;
  std::atomic<int64_t> next_mb{0};  // driver: the next microbatch to start
  std::set<int64_t> forwards_done;  // "simple"
  bool rng_streams = false, rng_cuda = false;  // Note [Microbatch random streams]
  uint64_t step_seed = 0;
  // Note [Gradient order].
  std::atomic<bool> ordering{false};  // this step orders gradients
  std::atomic<int64_t> floor{0};      // every microbatch below it is over on this rank
  bool serving = false;               // serve_step() runs this step (not the driver)
  std::vector<int64_t> units, last_units;  // backward requests run, per microbatch
  std::vector<compat::GradAccumulatorPtr> accumulators;
  std::vector<torch::autograd::FunctionPreHook*> gate_hooks;
  Stats stats;

  Impl(std::shared_ptr<P2PEngine> p, Schedule s, Handler h, Spawn sp, ErrorEncoder e)
      : p2p(std::move(p)), schedule(std::move(s)), handler(std::move(h)), spawn(std::move(sp)),
        encode_error(std::move(e)),
        order(schedule.forwards_before_backwards() ? RecvOrder::kForwardFirst
                                                   : RecvOrder::kBackwardFirst),
        timeout(static_cast<int64_t>(p2p->timeout_s() * 1000)) {}

  // The serving thread that leads, per thread (a thread leads at most one dispatcher).
  static thread_local Impl* leading;

  std::atomic<int64_t> crossings{0};  // Stats::crossings
  void crossed(int64_t n = 1) { crossings.fetch_add(n, std::memory_order_relaxed); }

  // Runs `body` on a new thread of the step; `active` counts it until it returns.
  void start(std::function<void()> body) {
    {
      std::lock_guard<std::mutex> lock(mu);
      ++active;
    }
    try {
      crossed();
      spawn([this, body = std::move(body)] {
        try {
          body();
        } catch (...) {
          fail(std::current_exception());
        }
        std::lock_guard<std::mutex> lock(mu);
        --active;
        cv.notify_all();
      });
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu);
      --active;
      throw;
    }
  }

  void fail(std::exception_ptr e) {
    std::lock_guard<std::mutex> lock(mu);
    if (!error) error = e;
    over = true;
    cv.notify_all();
  }

  void end_serving() {
    std::lock_guard<std::mutex> lock(mu);
    over = true;
    cv.notify_all();
  }

  // Waits until every thread of the step has returned. Each one's own waits are
  // bounded (a serving thread's by the timeout; the driver's tasks by theirs), so this
  // one is too.
  void join() {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return active == 0; });
  }

  // Runs `msg` with the token held (the caller holds it) and sends the answer. A
  // request that carries a random stream runs from it (`installed`: the token's
  // hand-over already did) and its answer carries the stream on.
  void run_held(const Message& msg, bool installed = false) {
    auto t0 = std::chrono::steady_clock::now();
    if (!installed) task_rng::install(msg.rng);
    Message answer;
    try {
      crossed();
      answer = handler(msg);
    } catch (const std::exception& e) {
      answer_error(msg, e.what());
      throw;
    }
    answer.mb = msg.mb;
    answer.call_id = msg.call_id;
    if (!msg.rng.empty() && answer.kind != kError) answer.rng = task_rng::capture_like(msg.rng);
    auto t1 = std::chrono::steady_clock::now();
    p2p->send(msg.src, answer);
    auto t2 = std::chrono::steady_clock::now();
    if (msg.kind == kBackwardRequest) backward_unit_over(msg.mb);
    std::lock_guard<std::mutex> lock(mu);
    stats.requests++;
    stats.handler_s += std::chrono::duration<double>(t1 - t0).count();
    stats.send_s += std::chrono::duration<double>(t2 - t1).count();
  }

  // Tells the caller of `msg` that running it failed (best effort: it may be gone).
  void answer_error(const Message& msg, const std::string& what) noexcept {
    try {
      Message err;
      err.mb = msg.mb;
      err.call_id = msg.call_id;
      err.kind = kError;
      const std::string text =
          str_cat("smp: pp rank ", p2p->rank(), " could not run a request: ", what);
      err.meta = encode_error ? encode_error(text) : text;
      p2p->send(msg.src, err);
    } catch (...) {
    }
  }

  bool over_now() {
    std::lock_guard<std::mutex> lock(mu);
    return over;
  }

  // The leader: takes the token at `msg`'s priority, runs it, gives the token back.
  // The request is the thread's task while it runs (it may wait, nested): its
  // microbatch and its random stream.
  void run(const Message& msg) {
    TaskContext task;
    task.mb = msg.mb;
    task.rng = msg.rng;
    TaskScope scope(&task);
    p2p->acquire_token(schedule.priority(msg.mb, phase_of(msg)));
    struct Release {
      P2PEngine& p;
      ~Release() { p.release_token(); }
    } release{*p2p};
    run_held(msg, /*installed=*/true);
  }

  // Body of a serving thread (Note [Serving]).
  void serve_loop() {
    struct NotLeading {
      Impl* me;
      ~NotLeading() {
        if (leading == me) leading = nullptr;
      }
    } not_leading{this};
    while (true) {
      {
        std::unique_lock<std::mutex> lock(mu);
        ++idle;
        // No deadline of its own: a step may rightly take longer than the timeout while
        // one thread leads. Bounded all the same: a leader's receive is bounded and every
        // way out of it sets `over` (the step's end or abort, an error via fail()), and a
        // leader that must wait frees the lead (resign).
        cv.wait(lock, [&] { return free || over; });
        --idle;
        if (over) return;
        free = false;
      }
      leading = this;
      while (leading == this && !over_now()) {
        Message msg = p2p->recv(kAny, kAny, kServeMask | bit(kStepEnd),
                                "work from the pipeline driver (pp rank 0)", false, 0, order);
        if (!is_request(msg)) {  // the step's end or abort: serve_step returns it
          std::lock_guard<std::mutex> lock(mu);
          if (end.kind == 0) end = std::move(msg);
          over = true;
          cv.notify_all();
          return;
        }
        run(msg);
      }
    }
  }

  // A leader about to wait hands the lead on (Note [Serving]).
  void resign() {
    if (leading != this) return;
    leading = nullptr;
    bool need_thread;
    {
      std::lock_guard<std::mutex> lock(mu);
      free = true;
      need_thread = idle == 0 && !over;
      cv.notify_all();
    }
    if (need_thread) start([this] { serve_loop(); });  // every serving thread waits on a nested call
  }

  // Note [Gradient order]: a microbatch's backward work on this rank is over. The
  // word goes out as a kMicrobatchDone, sticky in the mailbox until the step ends:
  // the driver sends it to every pp rank when a microbatch's step body returns; a
  // serving rank sends it to itself once it has run as many backward requests of the
  // microbatch as in the step before (until it knows that, the driver's word does).
  void announce_done(int64_t mb, bool everyone) noexcept {
    Message m;
    m.mb = mb;
    m.kind = kMicrobatchDone;
    for (int r = 0; r < p2p->size(); ++r) {
      if (!everyone && r != p2p->rank()) continue;
      try {
        p2p->send(r, m);
      } catch (...) {  // a peer gone: the step fails on its own
      }
    }
  }

  void backward_unit_over(int64_t mb) {
    if (!ordering) return;
    bool over = false;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (mb < 0 || mb >= static_cast<int64_t>(units.size())) return;
      ++units[mb];
      over = serving && last_units.size() == units.size() && units[mb] == last_units[mb];
    }
    if (over) announce_done(mb, false);
  }

  // Called by a parameter's AccumulateGrad (pre hook) with the token held by the task
  // whose gradient it is: waits, token given up, until every earlier microbatch's
  // backward work on this rank is over.
  void gate() {
    if (!ordering) return;
    const int64_t mb = p2p->token_microbatch();
    int64_t below = floor.load();
    if (mb <= below) return;  // also: no task holds the token (-1)
    {
      std::lock_guard<std::mutex> lock(mu);
      stats.ordered_waits++;
    }
    resign();  // a serving leader: the earlier microbatch's requests must still be served
    const auto priority = schedule.priority(mb, Phase::kBackward);
    while (below < mb) {
      Message m = p2p->recv(below, kAny, bit(kMicrobatchDone) | bit(kAbort) | bit(kStepEnd),
                            str_cat("the end of microbatch ", below, "'s backward work, before "
                                    "microbatch ", mb, "'s gradients accumulate (Note [Gradient "
                                    "order])"),
                            /*yield_token=*/true, priority, RecvOrder::kArrival,
                            /*for_holder=*/true);
      if (m.kind != kMicrobatchDone)
        throw CommError(str_cat("smp: the step ended while microbatch ", mb,
                                "'s gradients waited for microbatch ", below, "'s"));
      int64_t seen = below;
      while (seen < below + 1 && !floor.compare_exchange_weak(seen, below + 1)) {
      }
      below = floor.load();
    }
  }

  // After a step that ran backward work: whether it matched the step before (Note
  // [Gradient order]); the next step expects this one's.
  void record_units() {
    std::lock_guard<std::mutex> lock(mu);
    int64_t total = 0;
    for (int64_t u : units) total += u;
    if (total == 0) return;  // an evaluation step says nothing about training steps
    if (!last_units.empty() && last_units != units) stats.unplanned_steps++;
    last_units = units;
  }

  void rethrow_error() {
    std::exception_ptr e;
    {
      std::lock_guard<std::mutex> lock(mu);
      e = error;
      error = nullptr;
    }
    if (e) std::rethrow_exception(e);
  }
};

thread_local Dispatcher::Impl* Dispatcher::Impl::leading = nullptr;

Dispatcher::Dispatcher(std::shared_ptr<P2PEngine> p2p, Schedule schedule, Handler handler,
                       Spawn spawn, ErrorEncoder encode_error)
    : impl_(std::make_unique<Impl>(std::move(p2p), std::move(schedule), std::move(handler),
                                   std::move(spawn), std::move(encode_error))) {}

Dispatcher::~Dispatcher() {
  // The accumulators outlive this Dispatcher (the parameters hold them): take the
  // gates off, they point here.
  auto& I = *impl_;
  for (size_t i = 0; i < I.accumulators.size(); ++i) {
    auto& hooks = I.accumulators[i]->pre_hooks();
    hooks.erase(std::remove_if(hooks.begin(), hooks.end(),
                               [&](const auto& h) { return h.get() == I.gate_hooks[i]; }),
                hooks.end());
  }
}

const Schedule& Dispatcher::schedule() const { return impl_->schedule; }

void Dispatcher::set_error_raiser(ErrorRaiser raise) { impl_->raise_error = std::move(raise); }

void Dispatcher::raise_answer(const Message& answer) const {
  if (impl_->raise_error) impl_->raise_error(answer);
  throw CommError(str_cat("smp: pp rank ", answer.src, " answered call ", answer.call_id,
                          " of microbatch ", answer.mb, " with an error: ", answer.meta));
}

void Dispatcher::begin_step(int64_t microbatches, bool deterministic, bool rng_cuda) {
  impl_->crossed();
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->stats.microbatches += std::max<int64_t>(microbatches, 0);
  impl_->rng_streams = deterministic;
  impl_->rng_cuda = rng_cuda;
  // Every rank draws (only the driver's seed is used), so the ranks' own generators
  // stay in step with each other, as scripts that seed every rank alike expect.
  if (deterministic) impl_->step_seed = task_rng::draw_step_seed();
  impl_->ordering = deterministic && !impl_->accumulators.empty();
  impl_->floor = 0;
  impl_->serving = false;
  impl_->units.assign(static_cast<size_t>(std::max<int64_t>(microbatches, 0)), 0);
  impl_->microbatches = microbatches;
  impl_->next_mb = 0;
  impl_->forwards_done.clear();
  impl_->free = true;
  impl_->over = false;
  impl_->idle = 0;
  impl_->error = nullptr;
  impl_->end = Message();
}

void Dispatcher::drive(MicrobatchFn run) {
  auto& I = *impl_;
  I.crossed();
  const int64_t n = I.microbatches;
  // Note [Microbatch random streams]: one seed per step from the default generator
  // (begin_step); outside the step the generators are as they were after drawing it.
  const bool streams = I.rng_streams;
  const uint64_t seed = I.step_seed;
  const RestoreRng outer(streams, I.rng_cuda);
  auto worker = [&I, n, run, streams, seed] {
    while (true) {
      // Claim the next microbatch while holding the token, so microbatches start in
      // order (the priority asked for is that of the one next when it was asked). The
      // stream is the one of the microbatch expected; if another thread claimed that
      // one meanwhile, the one claimed gets its own before any work runs.
      const int64_t expected = I.next_mb.load();
      TaskContext task;
      task.mb = expected;
      if (streams) task.rng = task_rng::derive(seed, expected, I.rng_cuda);
      TaskScope scope(&task);
      I.p2p->acquire_token(I.schedule.priority(expected, Phase::kForward));
      const int64_t mb = I.next_mb.fetch_add(1);
      if (mb >= n) {
        I.p2p->release_token();
        return;
      }
      task.mb = mb;
      if (streams && mb != expected) task_rng::install(task_rng::derive(seed, mb, I.rng_cuda));
      struct Done {
        Dispatcher::Impl& I;
        int64_t mb;
        ~Done() {
          I.p2p->release_token();
          if (I.ordering) I.announce_done(mb, true);  // Note [Gradient order]
          std::lock_guard<std::mutex> lock(I.mu);  // a failed or eval microbatch must not block
          I.forwards_done.insert(mb);
          I.cv.notify_all();
        }
      } done{I, mb};
      I.crossed();
      run(mb);
    }
  };
  const int64_t threads = std::min<int64_t>(I.schedule.window(), n);
  std::exception_ptr start_error;
  for (int64_t i = 0; i < threads && !start_error; ++i) {
    try {
      I.start(worker);
    } catch (...) {
      start_error = std::current_exception();
      I.next_mb = n;  // the started ones finish what is left of theirs, no more
    }
  }
  I.join();
  if (start_error) std::rethrow_exception(start_error);
  I.rethrow_error();
}

Message Dispatcher::serve_step() {
  auto& I = *impl_;
  I.crossed();
  const RestoreRng outer(I.rng_streams, I.rng_cuda);  // requests run from their own streams
  if (I.ordering) {  // Note [Gradient order]: microbatches with no backward work here
    std::vector<int64_t> idle;
    {
      std::lock_guard<std::mutex> lock(I.mu);
      I.serving = true;
      if (I.last_units.size() == I.units.size())
        for (size_t mb = 0; mb < I.units.size(); ++mb)
          if (I.last_units[mb] == 0) idle.push_back(static_cast<int64_t>(mb));
    }
    for (int64_t mb : idle) I.announce_done(mb, false);
  }
  // The serving threads receive the step's end themselves (it is sticky: every
  // waiter sees it), so a thread that fails ends the step at once, not at a timeout.
  try {
    I.start([&I] { I.serve_loop(); });  // one leads,
    I.start([&I] { I.serve_loop(); });  // one stands by
  } catch (...) {
    I.end_serving();
    I.join();
    throw;
  }
  I.join();
  if (I.ordering && I.end.kind == kStepEnd && !I.error) I.record_units();
  std::lock_guard<std::mutex> lock(I.mu);
  if (I.error) std::rethrow_exception(I.error);  // this rank's own failure: the cause
  SMP_CHECK(I.end.kind != 0, "serving stopped without the step's end");
  return std::move(I.end);
}

Message Dispatcher::call(int dst, Message request, int32_t kind, bool backward,
                         const std::string& what, bool for_holder) {
  impl_->crossed();
  return request_native(dst, std::move(request), kind, backward, what, for_holder);
}

Message Dispatcher::request_native(int dst, Message request, int32_t kind, bool backward,
                                   const std::string& what, bool for_holder) {
  auto& I = *impl_;
  if (I.rng_streams) request.rng = task_rng::capture(I.rng_cuda);
  const int64_t mb = request.mb, call_id = request.call_id;
  I.p2p->send(dst, request);
  Message answer = wait(mb, call_id, kind, backward, what, for_holder);
  task_rng::install(answer.rng);  // the stream continues where the callee left it
  return answer;
}

Message Dispatcher::wait(int64_t mb, int64_t call_id, int32_t kind, bool backward,
                         const std::string& what, bool for_holder) {
  auto& I = *impl_;
  I.resign();
  const uint32_t mask = bit(kind) | bit(kError) | kServeMask;
  const int64_t priority = I.schedule.priority(mb, backward ? Phase::kBackward : Phase::kForward);
  while (true) {
    Message msg = I.p2p->recv(mb, kAny, mask, what, /*yield_token=*/true, priority,
                              RecvOrder::kArrival, for_holder);
    if (is_request(msg)) {  // a nested call back into this rank: run it here
      I.run_held(msg);
      continue;
    }
    if (msg.kind == kAbort) return msg;
    if (msg.call_id != call_id)
      throw CommError(str_cat("smp: pipeline protocol error: got a message of kind ", msg.kind,
                              " for call ", msg.call_id, " while waiting for call ", call_id,
                              " (", what, ")"));
    return msg;
  }
}

void Dispatcher::order_gradients(const std::vector<at::Tensor>& params) {
  auto& I = *impl_;
  SMP_CHECK(I.accumulators.empty(), "order_gradients: called twice");
  for (const at::Tensor& p : params) {
    if (!p.defined() || !p.requires_grad() || !p.is_leaf()) continue;
    auto acc = torch::autograd::impl::grad_accumulator(p);
    if (!acc) continue;
    auto hook = std::make_unique<detail::GradGateHook>([&I] { I.gate(); });
    I.gate_hooks.push_back(hook.get());
    acc->add_pre_hook(std::move(hook));
    I.accumulators.push_back(std::move(acc));
  }
}

Dispatcher::Stats Dispatcher::stats() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  Stats s = impl_->stats;
  s.crossings = impl_->crossings.load();
  return s;
}

void Dispatcher::forward_finished(int64_t mb) {
  impl_->crossed();
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->forwards_done.insert(mb);
  impl_->cv.notify_all();
}

void Dispatcher::wait_all_forwards(int64_t mb) {
  auto& I = *impl_;
  I.crossed();
  if (!I.schedule.forwards_before_backwards()) return;
  I.p2p->release_token();
  bool done;
  {
    std::unique_lock<std::mutex> lock(I.mu);
    done = I.cv.wait_for(lock, I.timeout, [&] {
      return static_cast<int64_t>(I.forwards_done.size()) >= I.microbatches;
    });
  }
  I.p2p->acquire_token(I.schedule.priority(mb, Phase::kBackward));
  if (!done)
    throw TimeoutError(str_cat("smp: timed out after ", I.timeout.count() / 1000.0,
                               " s waiting for every microbatch's forward ('simple' pipeline) "
                               "before backward (pp rank ", I.p2p->rank(), ")"));
}

}  // namespace smp
