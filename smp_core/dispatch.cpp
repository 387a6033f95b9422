#include "smp_core/dispatch.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <tuple>
#include <utility>

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/engine.h>

#include "smp_core/autocast_state.h"
#include "smp_core/compat/torch_compat.h"
#include "smp_core/detail/autograd_graph.h"
#include "smp_core/detail/split_backward.h"
#include "smp_core/errors.h"
#include "smp_core/remote_call.h"
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

// The compute token, taken at `priority` for the scope of this object.
class HeldToken {
 public:
  HeldToken(P2PEngine& p2p, int64_t priority) : p2p_(p2p) { p2p_.acquire_token(priority); }
  ~HeldToken() { p2p_.release_token(); }
  HeldToken(const HeldToken&) = delete;
  HeldToken& operator=(const HeldToken&) = delete;

 private:
  P2PEngine& p2p_;
};

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

// Note [Executed plan]
// The runtime executes the step's plan (smp_core/plan.h) as written, as
// torch.distributed.pipelining runs its pipeline_order: each rank's compute token goes
// to its planned actions in the plan's order (Note [Planned token order] in p2p.h), so
// the action next in the list waits for its turn even when a later one is ready.
//  - The plan comes from the calls recorded in the driver's previous training step:
//    when every microbatch called the same pp ranks in the same order, with a backward
//    call for each forward call in reverse (no call made from another rank's module),
//    the path is 0, d1, 0, d2, ..., 0 and Plan::compile builds every rank's list for
//    the schedule's kind and window, under the runtime's own constraints (PlanOptions
//    gradient_order and fused_last: a microbatch's backward work on a rank starts
//    after the previous one's is over there, since its gradients would wait for that
//    anyway; Note [Last hop's gradients] for the loss hop). The driver sends the path
//    (kPlan) to every pp rank before its first request, with whether its last hop
//    accumulates; each compiles the same plan.
//  - Admissions: a task takes the token at the start of each compute action: a
//    microbatch's step body (F of hop 0), a served request (F or B), the driver going on
//    after an answer (the next F or B of its microbatch) or, under "simple", starting
//    its backward. Each is the n-th action of (microbatch, phase) on this rank and gets
//    that action's position in the rank's list. On the driver the backward of the last
//    hop follows its forward without a wait (loss.backward() in the step body), so the
//    two are one admission, except under "simple". A task taking the token back in
//    the middle of an action (after Note [Gradient order]'s wait) keeps its position.
//  - Leaving the plan: the driver checks each call of a microbatch against the path,
//    and that the microbatch made them all; any rank checks that each admission is in
//    its list and that nothing else (a nested request) arrives instead of an answer.
//    A step that differs (data-dependent control flow) leaves the plan: the rank that
//    sees it sends kPlanOff to every pp rank, which go on in the dynamic order
//    (priorities and receive order) for the rest of the step; Stats::plan_fallbacks
//    counts it. Numbers do not depend on which: a microbatch's random stream and the
//    order its gradients sum in are fixed either way (Note [Microbatch random streams],
//    Note [Gradient order]).
//  - A step that runs no backward (begin_step's `planned` false) runs without a plan
//    and keeps the recorded path for the next training step.

PlanKind plan_kind_of(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::kSimple: return PlanKind::kSimple;
    case ScheduleKind::kOneFOneB: return PlanKind::k1F1B;
    case ScheduleKind::kZeroBubble: return PlanKind::kZeroBubble;
    case ScheduleKind::kInterleaved: break;
  }
  return PlanKind::kInterleaved;
}

// The driver's calls of a microbatch on `path`: (destination, backward) in order.
std::vector<std::pair<int, bool>> calls_on(const std::vector<int64_t>& path) {
  std::vector<std::pair<int, bool>> calls;
  for (size_t h = 1; h + 1 < path.size(); h += 2) calls.emplace_back(static_cast<int>(path[h]), false);
  for (size_t i = calls.size(); i-- > 0;) calls.emplace_back(calls[i].first, true);
  return calls;
}

// The path a microbatch's calls describe when they are forward calls then the same
// ones' backward calls in reverse; empty otherwise.
std::vector<int64_t> path_of(const std::vector<std::pair<int, bool>>& calls) {
  std::vector<int64_t> path{0};
  for (const auto& [dst, backward] : calls) {
    if (backward) break;
    path.push_back(dst);
    path.push_back(0);
  }
  if (path.size() < 3 || calls_on(path) != calls) return {};
  return path;
}

// The admission phase of a W action (Note [Zero bubble at run time]); F and B/I use
// Phase's values.
constexpr int32_t kWeightPhase = 2;

std::string encode_ints(const std::vector<int64_t>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(int64_t));
}

std::vector<int64_t> decode_ints(const std::string& s) {
  std::vector<int64_t> v(s.size() / sizeof(int64_t));
  std::memcpy(v.data(), s.data(), v.size() * sizeof(int64_t));
  return v;
}

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
  // Note [Forward order]: driver, dynamic order: forward actions started and forwards
  // over, per microbatch.
  bool forward_order = false;
  std::vector<int64_t> fwd_started;
  std::vector<char> fwd_over;
  bool rng_streams = false, rng_cuda = false;  // Note [Microbatch random streams]
  uint64_t step_seed = 0;
  // Note [Gradient order].
  std::atomic<bool> ordering{false};  // this step orders gradients
  std::atomic<int64_t> floor{0};      // every microbatch below it is over on this rank
  std::set<int64_t> done;             // microbatches known over here (raise `floor`)
  bool serving = false;               // serve_step() runs this step (not the driver)
  std::vector<int64_t> units, last_units;  // backward requests run, per microbatch
  std::vector<compat::GradAccumulatorPtr> accumulators;
  std::vector<torch::autograd::FunctionPreHook*> gate_hooks;
  Stats stats;
  // Note [Executed plan].
  bool plan_wanted = false;     // begin_step's `planned`
  bool plan_on = false;         // this step executes `plan` (until it leaves it)
  std::optional<Plan> plan;     // this (or the last planned) step's
  std::vector<Action> admissions;  // this rank's, in order
  std::map<std::tuple<int64_t, int32_t, int64_t>, int64_t> position;  // (mb, phase, n) ->
  std::map<std::pair<int64_t, int32_t>, int64_t> admitted;            // (mb, phase) -> n
  std::vector<std::pair<int, bool>> expected_calls;  // driver: each microbatch's
  std::vector<std::vector<std::pair<int, bool>>> calls;  // driver: this step's, per mb
  std::vector<int64_t> recorded_path;  // driver: the last training step's, if uniform
  // Note [Last hop's gradients]: driver, sticky: some microbatch's last hop accumulated.
  bool last_hop_grads = false;
  bool nested_seen = false;            // driver: served a request this step
  // Note [Served backward].
  struct Kept {
    std::vector<at::Tensor> inputs;
    // The outputs' gradient edges, not the outputs: the graph stays, the tensors go
    // once sent (a served head's logits are not held until their backward).
    std::vector<torch::autograd::Edge> outputs;
  };
  std::map<std::tuple<int, int64_t, int64_t>, Kept> kept;  // (src, mb, call id) ->
  // Note [Zero bubble at run time].
  bool split_step = false;  // this step's plan is zero_bubble (driver and serving ranks)
  // A W to run later, under the autocast state of its request (Note [Autocast travels]).
  struct PendingWeight {
    detail::WeightHalf half;
    int64_t autocast = 0;
  };
  std::map<int64_t, std::deque<PendingWeight>> weights;  // serving: mb -> pending W
  int64_t weights_left = 0;   // serving: W of the plan not yet run
  bool weights_owed = false;  // serving: the driver awaits this step's kWeightsDone
  std::string weight_error;   // serving: the first W that failed (its encoded error)
  FailureEncoder encode_failure;
  bool spans_on = false;
  std::vector<std::tuple<int64_t, double, double>> spans;
  // Note [Arming at the first backward]: `arm_mu` is held while the arm runs, so a
  // second task's accumulation waits until the first one's arm is done.
  std::mutex arm_mu;
  std::function<void()> arm;
  std::atomic<bool> arm_done{true};  // no arm pending (the fast path of every gate)
  bool arm_ran = false;
  // Note [Step's finish]: set by finish_at_step_end(), taken by run_finish().
  std::function<void(bool)> finish;
  std::atomic<bool> finish_began{false};

  Impl(std::shared_ptr<P2PEngine> p, Schedule s, Handler h, Spawn sp, ErrorEncoder e)
      : p2p(std::move(p)), schedule(std::move(s)), handler(std::move(h)), spawn(std::move(sp)),
        encode_error(std::move(e)),
        order(schedule.forwards_before_backwards() ? RecvOrder::kForwardFirst
                                                   : RecvOrder::kBackwardFirst),
        timeout(static_cast<int64_t>(p2p->timeout_s() * 1000)) {}

  // The serving thread that leads, per thread (a thread leads at most one dispatcher).
  static thread_local Impl* leading;

  std::atomic<int64_t> crossings{0};  // Stats::crossings
  bool spawn_crosses = true;
  void crossed(int64_t n = 1) { crossings.fetch_add(n, std::memory_order_relaxed); }

  // Runs `body` on a new thread of the step; `active` counts it until it returns.
  void start(std::function<void()> body) {
    {
      std::lock_guard<std::mutex> lock(mu);
      ++active;
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
  // hand-over already did) and its answer carries the stream on. It runs under the
  // caller's autocast state (Note [Autocast travels]).
  void run_held(const Message& msg, bool installed = false) {
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

  std::optional<Kept> take_kept(const Message& msg) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = kept.find({msg.src, msg.mb, msg.call_id});
    if (it == kept.end()) return std::nullopt;
    Kept k = std::move(it->second);
    kept.erase(it);
    return k;
  }

  static double seconds(std::chrono::steady_clock::time_point t) {
    return std::chrono::duration<double>(t.time_since_epoch()).count();
  }

  // Note [Served backward]: the backward of a kept call, in C++ (the token is held).
  // A failure becomes the caller's kError answer; the rank goes on serving, as with a
  // module that raised in the handler. `split`: only its input half (Note [Split
  // backward]); the weight half waits for its W.
  Message serve_backward(const Message& msg, Kept k, bool split) {
    Message answer;
    const auto t0 = std::chrono::steady_clock::now();
    double autograd_s = 0;  // torch's own work (Stats::backward_s), not smp's around it
    try {
      const std::vector<bool> flags =
          parse_gradient_flags(msg.meta, k.outputs.size(), "a backward request");
      std::vector<torch::autograd::Edge> outs;
      std::vector<at::Tensor> grads;
      size_t j = 0;
      for (size_t i = 0; i < flags.size(); ++i) {
        if (!flags[i]) continue;
        if (j >= msg.tensors.size()) break;
        outs.push_back(k.outputs[i]);
        grads.push_back(msg.tensors[j++]);
      }
      if (j != msg.tensors.size() || outs.size() != grads.size() ||
          static_cast<size_t>(std::count(flags.begin(), flags.end(), true)) != j)
        throw CommError(str_cat("smp: pipeline protocol error: a backward request of microbatch ",
                                msg.mb, " (call ", msg.call_id, ") flags ",
                                std::count(flags.begin(), flags.end(), true),
                                " gradients and carries ", msg.tensors.size()));
      std::vector<at::Tensor> in_grads(k.inputs.size());
      detail::WeightHalf weight;
      const auto a = std::chrono::steady_clock::now();
      if (split) {
        if (!outs.empty()) in_grads = detail::backward_input_half(outs, grads, k.inputs, &weight);
      } else {
        if (!outs.empty()) {
          for (size_t i = 0; i < outs.size(); ++i)
            if (!outs[i].function)
              throw std::runtime_error(str_cat(
                  "smp: a backward request of microbatch ", msg.mb, " (call ", msg.call_id,
                  ") carries a gradient for output ", i, ", which does not require grad"));
          // torch::autograd::backward's engine call, from the edges (the engine checks
          // each gradient's shape, dtype and device against its edge).
          torch::autograd::Engine::get_default_engine().execute(
              outs, grads, /*keep_graph=*/false, /*create_graph=*/false,
              /*accumulate_grad=*/true, {});
        }
        for (size_t i = 0; i < k.inputs.size(); ++i) {
          const at::Tensor& t = k.inputs[i];
          if (t.defined() && t.requires_grad()) in_grads[i] = t.grad();
        }
      }
      autograd_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count();
      std::vector<bool> present;
      for (at::Tensor& g : in_grads) {
        present.push_back(g.defined());
        if (g.defined()) answer.tensors.push_back(std::move(g));
      }
      if (split) {  // even an empty one: its W counts the call's backward as over
        std::lock_guard<std::mutex> lock(mu);
        weights[msg.mb].push_back({std::move(weight), msg.autocast});
        stats.split_backwards++;
      }
      answer.kind = kBackwardResponse;
      answer.meta = gradient_flags(present);
    } catch (...) {
      answer = Message();
      answer.kind = kError;
      answer.meta = failure_meta(std::current_exception(), msg.mb, false);
    }
    k = Kept();  // the call's graph goes now, not with the step
    const auto t1 = std::chrono::steady_clock::now();
    std::lock_guard<std::mutex> lock(mu);
    stats.native_backwards++;
    stats.backward_s += autograd_s;
    if (spans_on) spans.emplace_back(msg.mb, seconds(t0), seconds(t1));
    return answer;
  }

  std::string failure_meta(std::exception_ptr error, int64_t mb, bool weight) noexcept {
    if (encode_failure) {
      try {
        return encode_failure(error, mb, weight);
      } catch (...) {
      }
    }
    std::string text = "unknown error";
    try {
      std::rethrow_exception(error);
    } catch (const std::exception& e) {
      text = e.what();
    } catch (...) {
    }
    text = str_cat("smp: pp rank ", p2p->rank(), " failed a served backward: ", text);
    if (encode_error) {
      try {
        return encode_error(text);
      } catch (...) {
      }
    }
    return text;
  }

  // Note [Step's finish]
  // ~~~~~~~~~~~~~~~~~~~~
  // What a synchronized step does after its last backward, on every pp rank, belongs
  // to the step's owner: the tied gradients' sum over their holders (Note [Tied
  // gradient sum]), then the dp reducer's finalize (buckets not yet launched go, the
  // reduced gradients are written back). The driver runs it right after sending the
  // step's end, a serving rank as soon as it arrives, so every rank's reduction starts
  // at once, in C++, with the GIL released: a Python comm hook takes it on the
  // reducer's comm thread. Whether a backward ran comes with the step's end (each
  // microbatch's share says so in its call id; the combined end carries the OR), so
  // a rank with no backward work of its own still takes part. A failed or aborted step
  // never runs it: the caller restores the tied gradients and tells the other replicas
  // (Replica.fail_step).
  void run_finish(bool backward) {
    std::function<void(bool)> fn;
    {
      std::lock_guard<std::mutex> lock(arm_mu);
      fn.swap(finish);
    }
    if (!fn) return;
    finish_began.store(true, std::memory_order_release);
    fn(backward);
  }

  // Note [Arming at the first backward]: runs the step's arm unless it ran.
  void arm_once() {
    if (arm_done.load(std::memory_order_acquire)) return;
    std::lock_guard<std::mutex> lock(arm_mu);
    if (arm_ran || !arm) return;
    arm();  // a throw leaves it pending: the step fails, disarm() says it did not run
    arm_ran = true;
    arm_done.store(true, std::memory_order_release);
  }

  void drop_kept() {
    // Destroyed after the lock: a graph may hold Python nodes, whose end takes the GIL.
    std::map<std::tuple<int, int64_t, int64_t>, Kept> gone;
    std::map<int64_t, std::deque<PendingWeight>> gone_weights;
    std::lock_guard<std::mutex> lock(mu);
    gone.swap(kept);
    gone_weights.swap(weights);
  }

  // Note [Zero bubble at run time]
  // Under zero_bubble a step with a plan splits every served backward (the serving
  // ranks' hops; the driver's run whole, PlanOptions::unsplit_rank): the answer carries
  // the input gradients of I, and the call's W waits in `weights` until the serving
  // leader reaches that W in the plan, where it runs it with the token at the W's
  // position. W is the call's gradient work on this rank, so Note [Gradient order]
  // counts the call's backward over when its W has run, and the plan keeps each rank's
  // W in microbatch order. A step that leaves its plan runs every W still pending at
  // once, in microbatch order, before any backward whole. Each serving rank of such a
  // step tells the driver once that its W are over (kWeightsDone, carrying the first
  // W's error if one failed): after its last planned W, or after the W it ran when the
  // step left its plan; and the driver ends the step only then, so the step's end and
  // its gradients (the reducer's, the optimizer's) come after every W, and a W that
  // failed fails the step on every rank (the driver aborts it with that error).
  bool splitting_now() {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (!split_step || !plan_on) return false;
    }
    // A kPlanOff that arrived turned the token's order off before the leader saw it.
    return p2p->token_ordered();
  }

  // Runs one W as the token's holder, its microbatch the task's meanwhile (the gate's).
  void run_one_weight(int64_t mb, PendingWeight w) {
    TaskContext* task = current_task();
    const int64_t saved = task ? task->mb.load() : -1;
    if (task) task->mb = mb;
    const auto t0 = std::chrono::steady_clock::now();
    bool failed = false;
    try {
      const autocast_state::Scope autocast(w.autocast);
      w.half.run();
    } catch (...) {
      failed = true;
      weight_failed(std::current_exception(), mb);
    }
    w.half = detail::WeightHalf();  // the graph goes now
    const auto t1 = std::chrono::steady_clock::now();
    if (task) task->mb = saved;
    {
      std::lock_guard<std::mutex> lock(mu);
      stats.weight_actions++;
      stats.backward_s += std::chrono::duration<double>(t1 - t0).count();
      if (spans_on) spans.emplace_back(mb, seconds(t0), seconds(t1));
    }
    if (!failed) backward_unit_over(mb);
  }

  // The oldest pending W of microbatch `mb` (kAny: of the lowest microbatch pending).
  std::optional<std::pair<int64_t, PendingWeight>> take_weight(int64_t mb) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = mb == kAny ? weights.begin() : weights.find(mb);
    if (it == weights.end()) return std::nullopt;
    std::pair<int64_t, PendingWeight> w{it->first, std::move(it->second.front())};
    it->second.pop_front();
    if (it->second.empty()) weights.erase(it);
    return w;
  }

  // Every pending W, microbatch by microbatch (the caller holds the token).
  void run_weights_held() {
    while (auto w = take_weight(kAny)) run_one_weight(w->first, std::move(w->second));
  }

  // The serving leader, at a W's turn in the plan.
  void run_planned_weight(int64_t mb) {
    TaskContext task;
    task.mb = mb;
    TaskScope scope(&task);
    const HeldToken held(*p2p, admit(mb, kWeightPhase));
    // None pending: its I failed, and the step is failing.
    if (auto w = take_weight(mb)) run_one_weight(mb, std::move(w->second));
    bool last = false;
    {
      std::lock_guard<std::mutex> lock(mu);
      last = --weights_left == 0;
    }
    if (last) report_weights();
  }

  // The serving leader, once the step left its plan: the W still pending, then the word.
  bool weights_to_flush() {
    std::lock_guard<std::mutex> lock(mu);
    return !plan_on && (!weights.empty() || weights_owed);
  }

  void flush_weights() {
    int64_t first = -1;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (!weights.empty()) first = weights.begin()->first;
    }
    if (first >= 0) {
      TaskContext task;
      task.mb = first;
      TaskScope scope(&task);
      const HeldToken held(*p2p, schedule.priority(first, Phase::kBackward));
      run_weights_held();
    }
    report_weights();
  }

  void weight_failed(std::exception_ptr error, int64_t mb) {
    std::string meta = failure_meta(error, mb, /*weight=*/true);
    std::map<int64_t, std::deque<PendingWeight>> gone;  // the step fails: no more W
    {
      std::lock_guard<std::mutex> lock(mu);
      if (!weight_error.empty()) return;
      weight_error = std::move(meta);
      gone.swap(weights);
    }
    report_weights();
  }

  // Sends the step-level `msg` (its mb becomes -1) to every other pp rank and, with
  // `to_self`, to this one. `best_effort`: a peer that cannot be reached is skipped (its
  // own failure ends its step) instead of throwing.
  void tell_pp_ranks(Message msg, bool to_self, bool best_effort) {
    msg.mb = -1;
    for (int r = 0; r < p2p->size(); ++r) {
      if (r == p2p->rank() && !to_self) continue;
      try {
        p2p->send(r, msg);
      } catch (...) {
        if (!best_effort) throw;
      }
    }
  }

  // Serving: this step's kWeightsDone to the driver, once.
  void report_weights() noexcept {
    Message m;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (!weights_owed) return;
      weights_owed = false;
      m.meta = weight_error;
    }
    m.mb = -1;
    m.call_id = p2p->rank();
    m.kind = kWeightsDone;
    try {
      p2p->send(0, m);
    } catch (...) {  // the driver gone: the step fails on its own
    }
  }

  // Driver, every microbatch returned: each serving rank's kWeightsDone (the first that
  // carries an error, if any), or nothing when the step was aborted meanwhile.
  std::optional<Message> await_weights() {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (!split_step || error) return std::nullopt;
    }
    std::optional<Message> failed;
    for (int r = 1; r < p2p->size(); ++r) {
      Message m = p2p->recv(kAny, r, bit(kWeightsDone) | bit(kAbort),
                            str_cat("the end of pp rank ", r, "'s weight-gradient actions (W, "
                                    "'pipeline'='zero_bubble') of this step"));
      if (m.kind == kAbort) return std::nullopt;
      if (!m.meta.empty() && !failed) failed = std::move(m);
    }
    return failed;
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
    const HeldToken held(*p2p, admit(msg.mb, phase_of(msg)));
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
                                false, 0, order);
        if (msg.kind == kPlanOff) {  // another rank left the plan: so does this one
          leave_plan_on_word();
          continue;
        }
        if (msg.kind == kPlan) {  // Note [Executed plan]: the driver's, before its requests
          const std::vector<int64_t> words = decode_ints(msg.meta);
          if (schedule.options().kind == ScheduleKind::kZeroBubble) {
            std::lock_guard<std::mutex> lock(mu);
            weights_owed = true;  // the driver waits for this step's kWeightsDone
          }
          // The driver's words: microbatches, whether its last hop accumulates, the path.
          const bool ok = words.size() >= 3 &&
                          install_plan(words[0], std::vector<int64_t>(words.begin() + 2, words.end()),
                                       words[1] != 0);
          if (ok) p2p->order_token(true);
          else leave_plan();
          bool none_deferred;
          {
            std::lock_guard<std::mutex> lock(mu);
            none_deferred = !ok || weights_left == 0;
          }
          if (none_deferred) report_weights();
          continue;
        }
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
    mark_done(mb);  // this rank's own gates need no message for it
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

  // Note [Gradient order]: microbatch `mb`'s backward work on this rank is over; raises
  // `floor` past every microbatch known over. Only here (under `mu`): it only grows.
  void mark_done(int64_t mb) {
    std::lock_guard<std::mutex> lock(mu);
    done.insert(mb);
    int64_t f = floor.load();
    while (done.count(f)) ++f;
    floor.store(f);
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
    arm_once();  // Note [Arming at the first backward]: before this accumulation
    if (!ordering) return;
    const int64_t mb = p2p->token_microbatch();
    bool unplanned_wait = false;
    if (p2p->rank() == 0) {
      backward_begins(mb);
      unplanned_wait = last_hop_accumulation(mb);
    }
    int64_t below = floor.load();
    if (mb <= below) return;  // also: no task holds the token (-1)
    if (unplanned_wait) leave_plan();  // Note [Last hop's gradients]
    {
      std::lock_guard<std::mutex> lock(mu);
      stats.ordered_waits++;
    }
    // Taken back at the position it had: the action goes on (Note [Executed plan]).
    const int64_t held = p2p->token_priority();
    const auto priority = p2p->token_ordered() && held >= 0 ? held
                                                             : schedule.priority(mb, Phase::kBackward);
    resign();  // a serving leader: the earlier microbatch's requests must still be served
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
      mark_done(below);
      below = floor.load();
    }
  }

  // Note [Last hop's gradients]
  // ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
  // On the driver a microbatch's backward begins with its last hop: loss.backward()
  // in the step body runs the modules after the last remote call, then sends the first
  // backward request. Most models' last hop is the loss alone, which accumulates no
  // gradient there; a head or a tied embedding on the driver does. The plan needs to
  // know (PlanOptions::last_hop_accumulates): under Note [Gradient order] an
  // accumulating last hop waits for the previous microbatch's backward on the driver,
  // so its fused forward must come after it in the plan; one that accumulates nothing
  // need not, and the next loss is not held back behind a whole backward through the
  // driver's first stage (it was: the last stage sat idle for it in the drain). The
  // driver learns it here, at the first accumulation of a microbatch that has made no
  // backward call yet; it is sticky. A planned step whose last hop accumulates where
  // its plan said it would not (the first step that shows it) leaves the plan before
  // it waits: the action it waits for may come after actions that wait for it.
  // Returns whether this accumulation is such a surprise.
  bool last_hop_accumulation(int64_t mb) {
    std::lock_guard<std::mutex> lock(mu);
    if (mb < 0 || mb >= static_cast<int64_t>(calls.size())) return false;
    for (const auto& c : calls[mb])
      if (c.second) return false;  // a backward call made: past the last hop
    last_hop_grads = true;
    return plan_on && plan && !plan->options().last_hop_accumulates;
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

  // Note [Executed plan]: makes `path` this step's plan on this rank; false if the
  // plan cannot be built (then the step runs in the dynamic order).
  bool install_plan(int64_t microbatches, const std::vector<int64_t>& path,
                    bool last_hop_accumulates) {
    const auto& so = schedule.options();
    std::optional<Plan> p;
    {  // the last step's, again (Note [Plan search] may take milliseconds to compile)
      std::lock_guard<std::mutex> lock(mu);
      if (plan && plan->options().path == path && plan->options().microbatches == microbatches &&
          plan->options().last_hop_accumulates == last_hop_accumulates)
        p = plan;
    }
    if (!p) {
      try {
        p = Plan::compile(executed_plan_options(plan_kind_of(so.kind), microbatches, so.stages,
                                                so.active_microbatches, path,
                                                last_hop_accumulates));
      } catch (const std::exception&) {
        return false;
      }
    }
    const int64_t me = p2p->rank();
    const int64_t last = static_cast<int64_t>(path.size()) - 1;
    const bool absorb = me == path[last] && so.kind != ScheduleKind::kSimple;
    std::vector<Action> mine;
    std::map<std::tuple<int64_t, int32_t, int64_t>, int64_t> pos;
    std::map<std::pair<int64_t, int32_t>, int64_t> count;
    int64_t weight_actions = 0;
    for (const Action& a : p->compute()[me]) {
      if (absorb && a.op == Op::kBackward && a.hop == last) continue;
      // I is what a backward request runs under zero_bubble (Note [Zero bubble at run time]).
      const int32_t phase = a.op == Op::kForward          ? static_cast<int32_t>(Phase::kForward)
                            : a.op == Op::kBackwardWeight ? kWeightPhase
                                                          : static_cast<int32_t>(Phase::kBackward);
      weight_actions += a.op == Op::kBackwardWeight;
      pos[{a.mb, phase, count[{a.mb, phase}]++}] = static_cast<int64_t>(mine.size());
      mine.push_back(a);
    }
    std::lock_guard<std::mutex> lock(mu);
    if (!plan || plan->path() != p->path() ||
        plan->options().microbatches != p->options().microbatches)
      stats.new_plans++;
    split_step = p->options().kind == PlanKind::kZeroBubble;
    weights_left = weight_actions;
    plan = std::move(p);
    admissions = std::move(mine);
    position = std::move(pos);
    admitted.clear();
    expected_calls = calls_on(path);
    plan_on = true;
    stats.planned_steps++;
    return true;
  }

  bool planned_now() {
    std::lock_guard<std::mutex> lock(mu);
    return plan_on;
  }

  // Note [Forward order]
  // ~~~~~~~~~~~~~~~~~~~~
  // A module whose forward changes its own state (BatchNorm's running statistics, a
  // counter) gives a result that depends on the order its microbatches reach it. A
  // plan fixes that order; the dynamic order would leave it to timing, since a task
  // takes the token when its answer arrives. So in a deterministic step the driver,
  // outside a plan, starts microbatch k's j-th forward action (a stretch of its step
  // body between two remote calls) only once microbatch k-1 has started its j-th, or
  // its forward is over (its backward began, or its task ended). The token is held
  // by one action at a time, so every module, local or remote, runs its microbatches'
  // forwards in microbatch order: a remote one gets their requests over one ordered
  // connection, in that order. Microbatch k-1 never waits for k, so this cannot
  // deadlock; the cost is a wait when an answer for k arrives before k-1's.
  bool forward_ordered() {
    return forward_order && p2p->rank() == 0 && !plan_on;  // (mu held)
  }

  // Gives the compute token up until `ready()` holds (checked with mu held, woken by
  // cv), then takes it back at `priority()`. Throws TimeoutError naming `what()` when
  // the config's timeout passes first (the token is taken back either way).
  template <class Ready, class Priority, class What>
  void wait_without_token(Ready ready, Priority priority, What what) {
    p2p->release_token();
    bool ok;
    {
      std::unique_lock<std::mutex> lock(mu);
      ok = cv.wait_for(lock, timeout, ready);
    }
    p2p->acquire_token(priority());
    if (!ok)
      throw TimeoutError(str_cat("smp: timed out after ", timeout.count() / 1000.0,
                                 " s waiting for ", what()));
  }

  // Driver, task thread, token held: `mb` starts a forward action (its first at its
  // task's start); waits, token given up, until it may (Note [Forward order]).
  void start_forward_action(int64_t mb, int64_t priority) {
    int64_t j = 0;
    auto may = [&] {  // (mu held)
      return mb == 0 || fwd_over[mb - 1] || fwd_started[mb - 1] > j || over;
    };
    bool wait = false;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (!forward_ordered() || mb < 0 || mb >= static_cast<int64_t>(fwd_started.size())) return;
      j = fwd_started[mb];
      wait = !may();
      if (wait) stats.forward_order_waits++;
    }
    if (wait)
      wait_without_token(may, [priority] { return priority; }, [mb, j] {
        return str_cat("microbatch ", mb - 1, " to start its forward action ", j,
                       " before microbatch ", mb, " (Note [Forward order], pp rank 0)");
      });
    std::lock_guard<std::mutex> lock(mu);
    fwd_started[mb]++;
    cv.notify_all();
  }

  // Driver: microbatch `mb`'s forward is over (Note [Forward order]).
  void forward_over(int64_t mb) {
    std::lock_guard<std::mutex> lock(mu);
    if (mb < 0 || mb >= static_cast<int64_t>(fwd_over.size()) || fwd_over[mb]) return;
    fwd_over[mb] = 1;
    cv.notify_all();
  }

  // The token priority of a task starting its next action of (mb, phase) here.
  int64_t admit(int64_t mb, Phase phase) { return admit(mb, static_cast<int32_t>(phase)); }
  int64_t admit(int64_t mb, int32_t action_phase) {
    const Phase phase = action_phase == static_cast<int32_t>(Phase::kForward) ? Phase::kForward
                                                                              : Phase::kBackward;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (!plan_on) return schedule.priority(mb, phase);
      const auto key = std::make_pair(mb, action_phase);
      const int64_t n = admitted[key]++;
      auto it = position.find({mb, key.second, n});
      if (it != position.end()) return it->second;
    }
    leave_plan();
    return schedule.priority(mb, phase);
  }

  // The step differs from its plan: this rank and every other go on in the dynamic order.
  void leave_plan() noexcept {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (!plan_on) return;
      plan_on = false;
      stats.plan_fallbacks++;
    }
    p2p->order_token(false);
    Message off;
    off.kind = kPlanOff;
    tell_pp_ranks(std::move(off), /*to_self=*/false, /*best_effort=*/true);
  }

  // A serving leader: the microbatch and request kind of the action whose turn it is
  // (kOwnWeight: a W this rank runs of itself), while this rank executes a plan.
  static constexpr int32_t kOwnWeight = -1;
  std::optional<std::pair<int64_t, int32_t>> next_planned_request() {
    const int64_t next = p2p->next_planned();
    std::lock_guard<std::mutex> lock(mu);
    if (!plan_on || next < 0 || next >= static_cast<int64_t>(admissions.size())) return {};
    const Action& a = admissions[next];
    return std::make_pair(a.mb, a.op == Op::kForward          ? kRequest
                                : a.op == Op::kBackwardWeight ? kOwnWeight
                                                              : kBackwardRequest);
  }

  // Another rank's kPlanOff: this rank leaves the plan too (counted here as well).
  void leave_plan_on_word() {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (!plan_on) return;
      plan_on = false;
      stats.plan_fallbacks++;
    }
    p2p->order_token(false);
  }

  // The step is over: the token goes by priority (nothing counted).
  void leave_plan_quietly() {
    {
      std::lock_guard<std::mutex> lock(mu);
      plan_on = false;
    }
    p2p->order_token(false);
  }

  // Driver: microbatch `mb` calls `dst` (a forward or backward call).
  void record_call(int64_t mb, int dst, bool backward) {
    bool off = false;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (mb < 0 || mb >= static_cast<int64_t>(calls.size())) return;
      auto& mine = calls[mb];
      mine.emplace_back(dst, backward);
      const size_t k = mine.size() - 1;
      off = plan_on && (k >= expected_calls.size() || expected_calls[k] != mine.back());
    }
    if (off) leave_plan();
  }

  // Driver: microbatch `mb` begins its backward (its gradients are about to
  // accumulate, or "simple"'s barrier). A microbatch that made fewer forward calls
  // than planned ends its forward here: the ranks waiting for the rest must hear it
  // now, before this task waits for anything (Note [Executed plan]).
  void backward_begins(int64_t mb) {
    forward_over(mb);  // Note [Forward order]
    bool off = false;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (!plan_on || mb < 0 || mb >= static_cast<int64_t>(calls.size())) return;
      size_t planned_forward = 0;
      for (const auto& c : expected_calls) planned_forward += !c.second;
      size_t made = 0;
      for (const auto& c : calls[mb]) made += !c.second;
      off = made < planned_forward;
    }
    if (off) leave_plan();
  }

  // Driver: microbatch `mb`'s step body returned.
  void microbatch_over(int64_t mb) {
    bool off = false;
    {
      std::lock_guard<std::mutex> lock(mu);
      off = plan_on && mb >= 0 && mb < static_cast<int64_t>(calls.size()) &&
            calls[mb] != expected_calls;
    }
    if (off) leave_plan();
  }

  // Driver, after a step: the path its calls describe, for the next training step.
  void record_path() {
    std::lock_guard<std::mutex> lock(mu);
    if (!plan_wanted) return;  // an evaluation step says nothing about training steps
    std::vector<int64_t> path;
    if (!nested_seen && !calls.empty()) {
      path = path_of(calls[0]);
      for (const auto& c : calls)
        if (c != calls[0]) path.clear();
    }
    recorded_path = std::move(path);
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

void Dispatcher::set_spawn_crosses(bool crosses) { impl_->spawn_crosses = crosses; }

void Dispatcher::set_error_raiser(ErrorRaiser raise) { impl_->raise_error = std::move(raise); }

void Dispatcher::raise_answer(const Message& answer) const {
  if (impl_->raise_error) impl_->raise_error(answer);
  throw CommError(str_cat("smp: pp rank ", answer.src, " answered call ", answer.call_id,
                          " of microbatch ", answer.mb, " with an error: ", answer.meta));
}

void Dispatcher::begin_step(int64_t microbatches, bool deterministic, bool rng_cuda,
                            bool planned) {
  impl_->crossed();
  impl_->drop_kept();  // an aborted step's calls
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->stats.microbatches += std::max<int64_t>(microbatches, 0);
  impl_->rng_streams = deterministic;
  impl_->rng_cuda = rng_cuda;
  // Every rank draws (only the driver's seed is used), so the ranks' own generators
  // stay in step with each other, as scripts that seed every rank alike expect.
  if (deterministic) impl_->step_seed = task_rng::draw_step_seed();
  impl_->ordering = deterministic && !impl_->accumulators.empty();
  impl_->floor = 0;
  impl_->done.clear();
  impl_->serving = false;
  impl_->units.assign(static_cast<size_t>(std::max<int64_t>(microbatches, 0)), 0);
  impl_->microbatches = microbatches;
  impl_->next_mb = 0;
  impl_->forwards_done.clear();
  impl_->forward_order = deterministic;
  impl_->fwd_started.assign(static_cast<size_t>(std::max<int64_t>(microbatches, 0)), 0);
  impl_->fwd_over.assign(static_cast<size_t>(std::max<int64_t>(microbatches, 0)), 0);
  impl_->free = true;
  impl_->over = false;
  impl_->idle = 0;
  impl_->error = nullptr;
  impl_->end = Message();
  impl_->finish_began.store(false, std::memory_order_release);  // Note [Step's finish]
  // Note [Executed plan]: the plan of this step is installed by drive() (the driver)
  // or by the driver's kPlan (a serving rank).
  impl_->plan_wanted = planned;
  impl_->plan_on = false;
  impl_->split_step = false;  // Note [Zero bubble at run time]
  impl_->weights_left = 0;
  impl_->weights_owed = false;
  impl_->weight_error.clear();
  impl_->admitted.clear();
  impl_->calls.assign(static_cast<size_t>(std::max<int64_t>(microbatches, 0)), {});
  impl_->nested_seen = false;
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
  // Note [Autocast travels]: the step's caller's, on every task thread.
  const int64_t autocast = autocast_state::capture();
  // Note [Executed plan]: the path the last training step's calls took, as this step's
  // plan, announced to every pp rank before any request.
  std::vector<int64_t> path;
  bool last_hop_grads = true;
  {
    std::lock_guard<std::mutex> lock(I.mu);
    if (I.plan_wanted) path = I.recorded_path;
    last_hop_grads = I.last_hop_grads;
  }
  if (!path.empty() && I.install_plan(n, path, last_hop_grads)) {
    std::vector<int64_t> words{n, last_hop_grads ? 1 : 0};
    words.insert(words.end(), path.begin(), path.end());
    Message announce;
    announce.mb = -1;
    announce.kind = kPlan;
    announce.meta = encode_ints(words);
    for (int r = 1; r < I.p2p->size(); ++r) I.p2p->send(r, announce);
    I.p2p->order_token(true);
  }
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
      int64_t mb = claim_first ? I.next_mb.fetch_add(1) : I.next_mb.load();
      if (claim_first && mb >= n) return;
      TaskContext task;
      task.mb = mb;
      if (streams) task.rng = task_rng::derive(seed, mb, I.rng_cuda);
      TaskScope scope(&task);
      I.p2p->acquire_token(claim_first ? I.admit(mb, Phase::kForward)
                                       : I.schedule.priority(mb, Phase::kForward));
      if (!claim_first) {
        const int64_t expected = mb;
        mb = I.next_mb.fetch_add(1);
        if (mb >= n) {
          I.p2p->release_token();
          return;
        }
        task.mb = mb;
        if (streams && mb != expected) task_rng::install(task_rng::derive(seed, mb, I.rng_cuda));
      }
      struct Done {
        Dispatcher::Impl& I;
        int64_t mb;
        ~Done() {
          I.p2p->release_token();
          I.forward_over(mb);     // Note [Forward order]
          I.microbatch_over(mb);  // Note [Executed plan]
          if (I.ordering) I.announce_done(mb, true);  // Note [Gradient order]
          std::lock_guard<std::mutex> lock(I.mu);  // a failed or eval microbatch must not block
          I.forwards_done.insert(mb);
          I.cv.notify_all();
        }
      } done{I, mb};
      if (!claim_first) I.start_forward_action(mb, I.schedule.priority(mb, Phase::kForward));
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

bool Dispatcher::drive_step(MicrobatchStepFn run) {
  auto& I = *impl_;
  std::vector<Message> parts(static_cast<size_t>(std::max<int64_t>(I.microbatches, 0)));
  std::atomic<bool> aborted{false}, told{false};
  drive([&](int64_t mb) {
    Message part = run(mb);
    if (part.kind == kAbort) {
      aborted = true;
      if (!part.meta.empty() && !told.exchange(true)) tell_pp_ranks(std::move(part), /*to_self=*/true);
      return;
    }
    SMP_CHECK(part.kind == kStepEnd, "drive_step: microbatch ", mb,
              "'s body returned a message of kind ", part.kind, " (kStepEnd or kAbort)");
    parts.at(static_cast<size_t>(mb)) = std::move(part);
  });
  if (aborted) return false;
  // Meta: the count, then per part its meta's length and tensor count, then the metas.
  std::vector<int64_t> header{static_cast<int64_t>(parts.size())};
  Message end;
  end.kind = kStepEnd;
  bool backward = false;  // Note [Step's finish]: a part's call id 1 says a backward ran
  for (const Message& p : parts) {
    header.push_back(static_cast<int64_t>(p.meta.size()));
    header.push_back(static_cast<int64_t>(p.tensors.size()));
    backward = backward || p.call_id != 0;
  }
  end.call_id = backward ? 1 : 0;
  end.meta = encode_ints(header);
  for (Message& p : parts) {
    end.meta += p.meta;
    for (at::Tensor& t : p.tensors) end.tensors.push_back(std::move(t));
  }
  tell_pp_ranks(std::move(end));
  I.run_finish(backward);
  return true;
}

std::vector<Message> Dispatcher::step_end_parts(const Message& end) {
  auto bad = [&](const char* what) {
    return CommError(str_cat("smp: pipeline protocol error: a step end of ", end.meta.size(),
                             " bytes and ", end.tensors.size(), " tensors: ", what));
  };
  if (end.meta.size() < sizeof(int64_t)) throw bad("no header");
  int64_t n = 0;
  std::memcpy(&n, end.meta.data(), sizeof(n));
  if (n < 0 || static_cast<uint64_t>(n) > end.meta.size() / (2 * sizeof(int64_t)))
    throw bad("a short header");
  const size_t head = sizeof(int64_t) * (1 + 2 * static_cast<size_t>(n));
  if (end.meta.size() < head) throw bad("a short header");
  const std::vector<int64_t> words = decode_ints(end.meta.substr(0, head));
  std::vector<Message> parts;
  size_t at = head, tensor = 0;
  for (int64_t i = 0; i < n; ++i) {
    const auto len = static_cast<size_t>(words[1 + 2 * i]);
    const auto count = static_cast<size_t>(words[2 + 2 * i]);
    if (end.meta.size() - at < len || end.tensors.size() - tensor < count)
      throw bad("a part beyond the message");
    Message p;
    p.mb = i;
    p.kind = kStepEnd;
    p.meta = end.meta.substr(at, len);
    p.tensors.assign(end.tensors.begin() + static_cast<std::ptrdiff_t>(tensor),
                     end.tensors.begin() + static_cast<std::ptrdiff_t>(tensor + count));
    at += len;
    tensor += count;
    parts.push_back(std::move(p));
  }
  if (at != end.meta.size() || tensor != end.tensors.size()) throw bad("bytes left over");
  return parts;
}

void Dispatcher::tell_pp_ranks(Message msg, bool to_self) {
  impl_->tell_pp_ranks(std::move(msg), to_self, /*best_effort=*/false);
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
  I.drop_kept();
  if (I.ordering && I.end.kind == kStepEnd && !I.error) I.record_units();
  Message end;
  {
    std::lock_guard<std::mutex> lock(I.mu);
    if (I.error) std::rethrow_exception(I.error);  // this rank's own failure: the cause
    SMP_CHECK(I.end.kind != 0, "serving stopped without the step's end");
    end = std::move(I.end);
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
  if (I.rng_streams) request.rng = task_rng::capture(I.rng_cuda);
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
      {
        std::lock_guard<std::mutex> lock(I.mu);
        I.nested_seen = true;
      }
      I.leave_plan();  // no plan has nested calls
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

void Dispatcher::keep_for_backward(int src, int64_t mb, int64_t call_id,
                                   std::vector<at::Tensor> inputs,
                                   std::vector<at::Tensor> outputs) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto edges = detail::gradient_edges(outputs);
  outputs.clear();
  impl_->kept[{src, mb, call_id}] = Impl::Kept{std::move(inputs), std::move(edges)};
}

void Dispatcher::set_failure_encoder(FailureEncoder encode) {
  impl_->encode_failure = std::move(encode);
}

void Dispatcher::record_spans(bool on) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->spans_on = on;
  if (!on) impl_->spans.clear();
}

std::vector<std::tuple<int64_t, double, double>> Dispatcher::take_spans() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return std::exchange(impl_->spans, {});
}

void Dispatcher::arm_at_first_backward(std::function<void()> arm) {
  auto& I = *impl_;
  std::lock_guard<std::mutex> lock(I.arm_mu);
  I.arm = std::move(arm);
  I.arm_ran = false;
  I.arm_done.store(!I.arm, std::memory_order_release);
}

void Dispatcher::arm_now() { impl_->arm_once(); }

void Dispatcher::finish_at_step_end(std::function<void(bool backward)> finish) {
  auto& I = *impl_;
  std::lock_guard<std::mutex> lock(I.arm_mu);
  I.finish = std::move(finish);
}

bool Dispatcher::finish_began() const {
  return impl_->finish_began.load(std::memory_order_acquire);
}

bool Dispatcher::disarm() {
  auto& I = *impl_;
  std::function<void()> gone;
  std::function<void(bool)> gone_finish;
  std::lock_guard<std::mutex> lock(I.arm_mu);
  const bool ran = I.arm_ran;
  gone.swap(I.arm);
  gone_finish.swap(I.finish);
  I.arm_ran = false;
  I.arm_done.store(true, std::memory_order_release);
  return ran;
}

Dispatcher::Stats Dispatcher::stats() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  Stats s = impl_->stats;
  s.crossings = impl_->crossings.load();
  return s;
}

std::vector<std::string> Dispatcher::planned_actions() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  std::vector<std::string> out;
  for (const Action& a : impl_->admissions) out.push_back(a.str(/*with_hop=*/true));
  return out;
}

std::vector<std::string> Dispatcher::executed_actions() const {
  std::vector<int64_t> granted = impl_->p2p->planned_grants();
  std::lock_guard<std::mutex> lock(impl_->mu);
  std::vector<std::string> out;
  for (int64_t i : granted)
    if (i >= 0 && i < static_cast<int64_t>(impl_->admissions.size()))
      out.push_back(impl_->admissions[i].str(/*with_hop=*/true));
  return out;
}

std::string Dispatcher::plan_text(const FailedCell* failed) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (!impl_->plan) return "";
  const Plan& p = *impl_->plan;
  if (!failed || failed->stage < 0 || failed->stage >= static_cast<int64_t>(p.compute().size()))
    return p.format();
  // The failed cell's first action of its phase on its rank.
  const Op op = failed->phase == Phase::kForward ? Op::kForward
                : failed->weight                 ? Op::kBackwardWeight
                                                 : Op::kBackward;
  for (const Action& a : p.compute().at(failed->stage))
    if (a.mb == failed->mb && (a.op == op || (op == Op::kBackward && a.op == Op::kBackwardInput)))
      return p.format(&a, failed->stage);
  return p.format();
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
  if (I.p2p->rank() == 0) I.backward_begins(mb);
  I.wait_without_token(
      [&I] { return static_cast<int64_t>(I.forwards_done.size()) >= I.microbatches; },
      [&I, mb] { return I.admit(mb, Phase::kBackward); },
      [&I] {
        return str_cat("every microbatch's forward ('simple' pipeline) before backward (pp rank ",
                       I.p2p->rank(), ")");
      });
}

}  // namespace smp
