// The dispatcher's serving and driving (Note [Serving] in dispatch.h): the serving
// loop and its threads, the driver's microbatch tasks (drive()), calls and waits, and
// begin_step(), which starts every concept's step. The other concepts of
// Dispatcher::Impl live beside it (detail/dispatcher_impl.h says which file owns what).
//
// Threads: serve_loop() runs on the serving threads this file starts through `spawn`
// (serve_step() starts two; a leader about to wait starts another, resign()); drive()'s
// workers on the driver's task threads, also through `spawn`; call(), request_native()
// and wait() on a task's thread (a driver's task, a serving thread running a request,
// or autograd's device thread working for the token's holder); begin_step(),
// serve_step(), drive() on the step's caller. State: Serving and StepState (this file's)
// under `mu`, `step.next_mb` atomic; the rest only through the owning files' methods.
#include "smp_core/dispatch.h"

#include <algorithm>

#include "smp_core/autocast_state.h"
#include "smp_core/detail/dispatcher_impl.h"
#include "smp_core/errors.h"
#include "smp_core/runtime.h"
#include "smp_core/task.h"
#include "smp_core/task_rng.h"

namespace smp {

namespace {
// The tp degree (1 before smp.init): its ranks keep one order of actions (Note [One
// microbatch at a time under tp], Note [Leaving a plan under tp]).
int tp_degree() { return is_initialized() ? runtime().topology().tp_size() : 1; }
}  // namespace
namespace {

using detail::bit;
using detail::is_request;
using detail::kServeMask;

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

thread_local Dispatcher::Impl* Dispatcher::Impl::leading = nullptr;

void Dispatcher::Impl::Serving::begin_step() {
  free = true;
  over = false;
  idle = 0;
  error = nullptr;
  end = Message();
}

void Dispatcher::Impl::StepState::begin_step(int64_t n, bool deterministic, bool cuda) {
  rng_streams = deterministic;
  rng_cuda = cuda;
  // Every rank draws (only the driver's seed is used), so the ranks' own generators
  // stay in step with each other, as scripts that seed every rank alike expect.
  if (deterministic) step_seed = task_rng::draw_step_seed();
  microbatches = n;
  next_mb = 0;
  forwards_done.clear();
  bodies_over.clear();
}

int64_t Dispatcher::Impl::StepState::lowest_running() const {
  const int64_t started = std::min(next_mb.load(), microbatches);
  for (int64_t mb = 0; mb < started; ++mb)
    if (!bodies_over.count(mb)) return mb;
  return started;
}

void Dispatcher::Impl::start(std::function<void()> body) {
  {
    std::lock_guard<std::mutex> lock(mu);
    ++serve.active;
  }
  try {
    if (spawn_crosses) crossed();
    spawn([this, body = std::move(body)] {
      try {
        body();
      } catch (...) {
        fail(std::current_exception());
      }
      std::lock_guard<std::mutex> lock(mu);
      --serve.active;
      cv.notify_all();
    });
  } catch (...) {
    std::lock_guard<std::mutex> lock(mu);
    --serve.active;
    throw;
  }
}

void Dispatcher::Impl::fail(std::exception_ptr e) {
  std::lock_guard<std::mutex> lock(mu);
  if (!serve.error) serve.error = e;
  serve.over = true;
  cv.notify_all();
}

void Dispatcher::Impl::end_serving() {
  std::lock_guard<std::mutex> lock(mu);
  serve.over = true;
  cv.notify_all();
}

// Each thread's own waits are bounded (a serving thread's by the timeout; the driver's
// tasks by theirs), so this one is too.
void Dispatcher::Impl::join() {
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return serve.active == 0; });
}

// Runs `msg` with the token held (the caller holds it) and sends the answer. A
// request that carries a random stream runs from it (`installed`: the token's
// hand-over already did) and its answer carries the stream on. It runs under the
// caller's autocast state (Note [Autocast travels]).
void Dispatcher::Impl::run_held(const Message& msg, bool installed) {
  auto t0 = std::chrono::steady_clock::now();
  if (!installed) task_rng::install(msg.rng);
  std::optional<autocast_state::Scope> autocast;
  try {
    autocast.emplace(msg.autocast);
  } catch (const std::exception& e) {
    answer_error(msg, e.what());
    throw;
  }
  Message answer;
  std::optional<Kept> mine = msg.kind == kBackwardRequest ? take_kept(msg) : std::nullopt;
  // Note [Zero bubble at run time]: I now, W at its turn; a backward run whole comes
  // after the W still pending (the step left its plan), as microbatch order wants.
  const bool split = mine && splitting_now();
  if (msg.kind == kBackwardRequest && !split) run_weights_held();
  if (mine) {
    answer = serve_backward(msg, std::move(*mine), split);
  } else {
    try {
      crossed();
      answer = handler(msg);
    } catch (const std::exception& e) {
      answer_error(msg, e.what());
      throw;
    }
  }
  answer.mb = msg.mb;
  answer.call_id = msg.call_id;
  if (!msg.rng.empty() && answer.kind != kError) answer.rng = task_rng::capture_like(msg.rng);
  auto t1 = std::chrono::steady_clock::now();
  p2p->send(msg.src, answer);
  auto t2 = std::chrono::steady_clock::now();
  if (msg.kind == kBackwardRequest && !split) backward_unit_over(msg.mb);  // split: at its W
  std::lock_guard<std::mutex> lock(mu);
  stats.requests++;
  stats.handler_s += std::chrono::duration<double>(t1 - t0).count();
  stats.send_s += std::chrono::duration<double>(t2 - t1).count();
}

// Tells the caller of `msg` that running it failed (best effort: it may be gone).
void Dispatcher::Impl::answer_error(const Message& msg, const std::string& what) noexcept {
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

bool Dispatcher::Impl::over_now() {
  std::lock_guard<std::mutex> lock(mu);
  return serve.over;
}

// The leader: takes the token at `msg`'s priority, runs it, gives the token back.
// The request is the thread's task while it runs (it may wait, nested): its
// microbatch and its random stream.
void Dispatcher::Impl::run(const Message& msg) {
  TaskContext task;
  task.mb = msg.mb;
  task.rng = msg.rng;
  TaskScope scope(&task);
  const detail::HeldToken held(*p2p, admit(msg.mb, detail::phase_of(msg)));
  took(msg.mb, static_cast<int32_t>(detail::phase_of(msg)));
  run_held(msg, /*installed=*/true);
}

// Body of a serving thread (Note [Serving]).
void Dispatcher::Impl::serve_loop() {
  // Note [Leaving a plan under tp]: requests are served as they came from the driver.
  const bool tp = tp_degree() > 1;
  struct NotLeading {
    Impl* me;
    ~NotLeading() {
      if (leading == me) leading = nullptr;
    }
  } not_leading{this};
  while (true) {
    {
      std::unique_lock<std::mutex> lock(mu);
      ++serve.idle;
      // No deadline of its own: a step may rightly take longer than the timeout while
      // one thread leads. Bounded all the same: a leader's receive is bounded and every
      // way out of it sets `over` (the step's end or abort, an error via fail()), and a
      // leader that must wait frees the lead (resign).
      cv.wait(lock, [&] { return serve.free || serve.over; });
      --serve.idle;
      if (serve.over) return;
      serve.free = false;
    }
    leading = this;
    while (leading == this && !over_now()) {
      // Under a plan the leader takes the request whose turn it is and no other, so
      // that it never waits for the token holding a request while the one next in the
      // plan sits in the mailbox (Note [Executed plan]).
      if (weights_to_flush()) {  // Note [Zero bubble at run time]: the step left its plan
        flush_weights();
        continue;
      }
      int64_t want_mb = kAny;
      // Under a plan whose token order already went off (p2p.h: a kPlanOff that
      // arrived does that), the kPlanOff is taken here too, once (it is sticky).
      uint32_t mask = kServeMask | bit(kStepEnd) | bit(kPlan) | (planned_now() ? bit(kPlanOff) : 0);
      if (const auto next = next_planned_request()) {
        if (next->second == kOwnWeight) {
          run_planned_weight(next->first);
          continue;
        }
        want_mb = next->first;
        mask = bit(next->second) | bit(kAbort) | bit(kStepEnd) | bit(kPlanOff);
      }
      Message msg = p2p->recv(want_mb, kAny, mask, "work from the pipeline driver (pp rank 0)",
                              false, 0, tp ? RecvOrder::kArrival : order);
      if (msg.kind == kPlanOff) {  // another rank left the plan: so does this one
        leave_plan_on_word();
        continue;
      }
      if (msg.kind == kPlan) {  // Note [Executed plan]: the driver's, before its requests
        plan_arrived(msg);
        continue;
      }
      if (!is_request(msg)) {  // the step's end or abort: serve_step returns it
        std::lock_guard<std::mutex> lock(mu);
        if (serve.end.kind == 0) serve.end = std::move(msg);
        serve.over = true;
        cv.notify_all();
        return;
      }
      run(msg);
    }
  }
}

// A leader about to wait hands the lead on (Note [Serving]).
void Dispatcher::Impl::resign() {
  if (leading != this) return;
  leading = nullptr;
  bool need_thread;
  {
    std::lock_guard<std::mutex> lock(mu);
    serve.free = true;
    need_thread = serve.idle == 0 && !serve.over;
    cv.notify_all();
  }
  if (need_thread) start([this] { serve_loop(); });  // every serving thread waits on a nested call
}

void Dispatcher::Impl::rethrow_error() {
  std::exception_ptr e;
  {
    std::lock_guard<std::mutex> lock(mu);
    e = serve.error;
    serve.error = nullptr;
  }
  if (e) std::rethrow_exception(e);
}

PlanOptions Dispatcher::Impl::checked(PlanOptions o) {
  for (auto [name, value] : {std::pair{"microbatches", o.microbatches},
                             std::pair{"partitions", o.stages},
                             std::pair{"active_microbatches", o.active_microbatches}})
    if (value < 1)
      throw ConfigError(str_cat("smp: pipeline '", name, "'=", value, " is not an integer >= 1"));
  return o;
}

Dispatcher::Dispatcher(std::shared_ptr<P2PEngine> p2p, PlanOptions options, Handler handler,
                       Spawn spawn, ErrorEncoder encode_error)
    : impl_(std::make_unique<Impl>(std::move(p2p), std::move(options), std::move(handler),
                                   std::move(spawn), std::move(encode_error))) {}

Dispatcher::~Dispatcher() { impl_->remove_gates(); }

const PlanOptions& Dispatcher::options() const { return impl_->opts; }

void Dispatcher::set_error_raiser(ErrorRaiser raise) { impl_->raise_error = std::move(raise); }

void Dispatcher::raise_answer(const Message& answer) const {
  if (impl_->raise_error) impl_->raise_error(answer);
  throw CommError(str_cat("smp: pp rank ", answer.src, " answered call ", answer.call_id,
                          " of microbatch ", answer.mb, " with an error: ", answer.meta));
}

void Dispatcher::begin_step(int64_t microbatches, bool deterministic, bool rng_cuda,
                            bool planned) {
  auto& I = *impl_;
  I.crossed();
  I.drop_kept();  // an aborted step's calls
  std::lock_guard<std::mutex> lock(I.mu);
  const int64_t n = std::max<int64_t>(microbatches, 0);
  I.stats.microbatches += n;
  I.step.begin_step(microbatches, deterministic, rng_cuda);
  I.grad.begin_step(n, deterministic);  // Note [Gradient order]
  I.fwd.begin_step(n, deterministic);   // Note [Forward order]
  I.serve.begin_step();
  I.arming.begin_step();  // Note [Step's finish]
  // Note [Executed plan]: the plan of this step is installed by drive() (the driver)
  // or by the driver's kPlan (a serving rank).
  I.exec.begin_step(n, planned);
  I.zb.begin_step();  // Note [Zero bubble at run time]
}

void Dispatcher::drive(MicrobatchFn run) {
  auto& I = *impl_;
  I.crossed();
  const int64_t n = I.step.microbatches;
  // Note [Microbatch random streams]: one seed per step from the default generator
  // (begin_step); outside the step the generators are as they were after drawing it.
  const bool streams = I.step.rng_streams;
  const uint64_t seed = I.step.step_seed;
  const RestoreRng outer(streams, I.step.rng_cuda);
  // Note [Autocast travels]: the step's caller's, on every task thread.
  const int64_t autocast = autocast_state::capture();
  // Note [Executed plan]: the path the last training step's calls took, as this step's
  // plan, announced to every pp rank before any request.
  I.announce_plan(n);
  auto worker = [&I, n, run, streams, seed, autocast] {
    const autocast_state::Scope caller(autocast);
    while (true) {
      // Under a plan a microbatch is claimed first and starts at its planned turn.
      // Otherwise the next microbatch is claimed while holding the token, so
      // microbatches start in order (the priority asked for is that of the one next
      // when it was asked). The stream is the one of the microbatch expected; if
      // another thread claimed that one meanwhile, the one claimed gets its own before
      // any work runs.
      const bool claim_first = I.planned_now();
      int64_t mb = claim_first ? I.step.next_mb.fetch_add(1) : I.step.next_mb.load();
      // (Every microbatch started: without a claim too, as Note [Leaving a plan under
      // tp] holds back a task waiting for a microbatch beyond the last.)
      if (mb >= n) return;
      TaskContext task;
      task.mb = mb;
      if (streams) task.rng = task_rng::derive(seed, mb, I.step.rng_cuda);
      TaskScope scope(&task);
      I.p2p->acquire_token(claim_first ? I.admit(mb, Phase::kForward)
                                       : I.priority(mb, Phase::kForward));
      if (!claim_first) {
        const int64_t expected = mb;
        mb = I.step.next_mb.fetch_add(1);
        if (mb >= n) {
          I.p2p->release_token();
          return;
        }
        task.mb = mb;
        if (streams && mb != expected)
          task_rng::install(task_rng::derive(seed, mb, I.step.rng_cuda));
        if (mb != expected && I.p2p->serial_now()) {
          // Note [Leaving a plan under tp]: another thread started the microbatch this
          // one waited for; this one's waits for its own turn.
          I.p2p->release_token();
          I.p2p->acquire_token(I.priority(mb, Phase::kForward));
        }
      }
      struct Done {
        Dispatcher::Impl& I;
        int64_t mb;
        ~Done() {
          // A body that returned without its backward leaves the plan here, while its
          // task still holds the token: the same point on every tp rank (Note [Leaving
          // a plan under tp]).
          I.microbatch_over(mb);  // Note [Executed plan]
          I.p2p->release_token();
          I.forward_over(mb);     // Note [Forward order]
          if (I.grad.ordering) I.announce_done(mb, true);  // Note [Gradient order]
          int64_t floor;
          {
            std::lock_guard<std::mutex> lock(I.mu);  // a failed or eval microbatch must not block
            I.step.forwards_done.insert(mb);
            I.step.bodies_over.insert(mb);
            floor = I.step.lowest_running();
            I.cv.notify_all();
          }
          I.p2p->set_serial_floor(floor);
        }
      } done{I, mb};
      if (!claim_first) I.start_forward_action(mb, I.priority(mb, Phase::kForward));
      I.took(mb, static_cast<int32_t>(Phase::kForward));
      I.crossed();
      run(mb);
    }
  };
  int64_t window =
      driver_window(I.opts.kind, I.opts.microbatches, I.opts.stages, I.opts.active_microbatches);
  {
    // Note [One microbatch at a time under tp]: a stage's tp ranks run collectives in
    // every distributed block, forward and backward, so each must run its actions in
    // the same order as its tp peers. A plan fixes that order on every rank (Note
    // [Executed plan]); without one, the order of a microbatch's backward against the
    // next one's forward would follow timing, and two tp ranks could pair different
    // microbatches' tensors in one collective (a hang, or with equal shapes a silently
    // wrong result). So a step without a plan drives one microbatch at a time there:
    // each rank then sees one chain of actions, the program's, on every tp rank alike.
    // The first training step pays the pipeline bubble; a planned step that leaves its
    // plan goes on one microbatch at a time from there (Note [Leaving a plan under tp]
    // in detail/compute_token.cpp).
    const bool tp = tp_degree() > 1;
    bool planned;
    {
      std::lock_guard<std::mutex> lock(I.mu);
      planned = I.exec.on;
    }
    if (!planned && tp) window = 1;
    // Note [Leaving a plan under tp]: a planned step that leaves its plan goes on one
    // microbatch at a time.
    I.p2p->arm_serial(planned && tp);
  }
  const int64_t threads = std::min<int64_t>(window, n);
  std::exception_ptr start_error;
  for (int64_t i = 0; i < threads && !start_error; ++i) {
    try {
      I.start(worker);
    } catch (...) {
      start_error = std::current_exception();
      I.step.next_mb = n;  // the started ones finish what is left of theirs, no more
    }
  }
  I.join();
  I.p2p->arm_serial(false);
  // Note [Zero bubble at run time]: the step ends once every serving rank's W are over.
  std::optional<Message> weight_failure;
  if (!start_error) weight_failure = I.await_weights();
  I.leave_plan_quietly();
  I.drop_kept();
  if (start_error) std::rethrow_exception(start_error);
  I.rethrow_error();
  if (weight_failure) {  // every pp rank raises it, the driver too
    Message abort;
    abort.kind = kAbort;
    abort.meta = weight_failure->meta;
    I.tell_pp_ranks(std::move(abort), /*to_self=*/false, /*best_effort=*/true);
    weight_failure->kind = kError;
    raise_answer(*weight_failure);
  }
  I.record_path();
}

Message Dispatcher::serve_step() {
  auto& I = *impl_;
  I.crossed();
  // Requests run from their own streams.
  const RestoreRng outer(I.step.rng_streams, I.step.rng_cuda);
  if (I.grad.ordering) I.announce_idle();  // Note [Gradient order]
  // Note [Leaving a plan under tp].
  I.p2p->defer_plan_off(tp_degree() > 1);
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
  I.drop_kept();
  if (I.grad.ordering && I.serve.end.kind == kStepEnd && !I.serve.error) I.record_units();
  Message end;
  {
    std::lock_guard<std::mutex> lock(I.mu);
    if (I.serve.error) std::rethrow_exception(I.serve.error);  // this rank's own failure: the cause
    SMP_CHECK(I.serve.end.kind != 0, "serving stopped without the step's end");
    end = std::move(I.serve.end);
  }
  if (end.kind == kStepEnd) I.run_finish(end.call_id != 0);  // Note [Step's finish]
  return end;
}

Message Dispatcher::call(int dst, Message request, int32_t kind, bool backward,
                         const std::string& what, bool for_holder) {
  impl_->crossed();
  return request_native(dst, std::move(request), kind, backward, what, for_holder);
}

Message Dispatcher::request_native(int dst, Message request, int32_t kind, bool backward,
                                   const std::string& what, bool for_holder) {
  auto& I = *impl_;
  if (I.p2p->rank() == 0) I.record_call(request.mb, dst, backward);  // Note [Executed plan]
  if (I.step.rng_streams) request.rng = task_rng::capture(I.step.rng_cuda);
  request.autocast = autocast_state::capture();  // Note [Autocast travels]
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
  const Phase phase = backward ? Phase::kBackward : Phase::kForward;
  while (true) {
    // The answer starts this task's next action (Note [Executed plan]).
    const int64_t priority = I.admit(mb, phase);
    Message msg = I.p2p->recv(mb, kAny, mask, what, /*yield_token=*/true, priority,
                              RecvOrder::kArrival, for_holder);
    if (is_request(msg)) {  // a nested call back into this rank: run it here
      bool planned;
      {
        std::lock_guard<std::mutex> lock(I.mu);
        I.exec.nested_seen = true;
        planned = I.exec.on;
      }
      // Note [Leaving a plan under tp]: seen first here, while other tasks may have gone
      // on in the plan, a call back would leave the plan at a point that differs
      // between tp ranks.
      if (planned && tp_degree() > 1)
        throw ConfigError(str_cat(
            "smp: pp rank ", msg.src, " called back into pp rank ", I.p2p->rank(),
            " (microbatch ", msg.mb, ") in a step planned from a training step without "
            "nested calls; with 'tensor_parallel_degree'=", tp_degree(),
            " a step cannot leave its plan at a nested call (its tp ranks could pair different "
            "microbatches in one collective). Make every training step call the same modules "
            "(a step with nested calls is never planned, so the steps after it run unplanned)"));
      I.leave_plan(str_cat("pp rank ", msg.src, " called back into pp rank ", I.p2p->rank(),
                           " (microbatch ", msg.mb, ") while it awaited an answer: no plan has "
                           "nested calls"));
      I.took(msg.mb, static_cast<int32_t>(detail::phase_of(msg)));
      I.run_held(msg);
      continue;
    }
    if (msg.kind == kAbort) return msg;
    if (msg.call_id != call_id)
      throw CommError(str_cat("smp: pipeline protocol error: got a message of kind ", msg.kind,
                              " for call ", msg.call_id, " while waiting for call ", call_id,
                              " (", what, ")"));
    if (backward)
      I.forward_over(mb);  // Note [Forward order]
    else if (!for_holder && msg.kind != kError)
      I.start_forward_action(mb, priority);
    if (msg.kind != kError) I.took(mb, static_cast<int32_t>(phase));
    return msg;
  }
}

void Dispatcher::forward_finished(int64_t mb) {
  impl_->crossed();
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->step.forwards_done.insert(mb);
  impl_->cv.notify_all();
}

void Dispatcher::wait_all_forwards(int64_t mb) {
  auto& I = *impl_;
  I.crossed();
  if (!forwards_before_backwards(I.opts.kind)) return;
  if (I.p2p->rank() == 0) I.backward_begins(mb);
  I.wait_without_token(
      [&I] { return static_cast<int64_t>(I.step.forwards_done.size()) >= I.step.microbatches; },
      [&I, mb] { return I.admit(mb, Phase::kBackward); },
      [&I] {
        return str_cat("every microbatch's forward ('simple' pipeline) before backward (pp rank ",
                       I.p2p->rank(), ")");
      });
  I.took(mb, static_cast<int32_t>(Phase::kBackward));
}

}  // namespace smp
