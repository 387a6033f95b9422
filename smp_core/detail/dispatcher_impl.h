// Dispatcher::Impl (smp_core/dispatch.h's pimpl) and what the dispatcher's sources
// share. Included only from the files below; its state is grouped by concept, one
// struct each, and each file owns its concept's struct (and defines the methods listed
// under it):
//   dispatch.cpp                Serving, StepState: the serving loop (Note [Serving] in
//                               dispatch.h), its threads, driving the microbatches,
//                               calls and waits, begin_step().
//   detail/plan_execution.cpp   PlanExecution, ForwardOrder: installing and walking the
//                               plan, admissions and their token positions (Note
//                               [Executed plan]), the forward order (Note [Forward
//                               order]).
//   detail/gradient_order.cpp   GradientOrder: the gates on the parameters' accumulators
//                               (Note [Gradient order], Note [Last hop's gradients]).
//   detail/served_backward.cpp  ServedBackward, ZeroBubble: kept calls' backward in C++
//                               (Note [Served backward]) and their W (Note [Zero bubble
//                               at run time]).
//   detail/step_end.cpp         Arming: the step's end and abort (Note [Step end] in
//                               dispatch.h), its finish (Note [Step's finish]) and arm
//                               (Note [Arming at the first backward]).
//   detail/dispatch_stats.cpp   Stats, crossings and spans.
//
// Threads: the driver's task threads, the serving threads, autograd's threads (a
// parameter's gate) and the caller's (Python's, through the bindings) all call in;
// which ones call what is said in each file's comment.
//
// Lock discipline: `mu` guards every struct's state below unless a member says
// otherwise (atomics read without it on fast paths; Arming's members under
// `arming.mu`; the construction-time members, never written after). `mu` is a leaf
// lock: it is never held across a call into P2PEngine, the handler, spawn, autograd's
// engine or a callback (arm, finish, encoders), and no other lock is taken under it.
// `arming.mu` is held while the arm or the finish is swapped or runs, never with `mu`.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <torch/csrc/autograd/edge.h>
#include <torch/csrc/autograd/function_hook.h>

#include "smp_core/compat/torch_compat.h"
#include "smp_core/detail/split_backward.h"
#include "smp_core/dispatch.h"
#include "smp_core/errors.h"

namespace smp {
namespace detail {

constexpr uint32_t bit(int32_t kind) { return uint32_t{1} << kind; }
// What a serving thread or a waiting task runs or stops for.
constexpr uint32_t kServeMask = bit(kRequest) | bit(kBackwardRequest) | bit(kAbort);

inline bool is_request(const Message& m) {
  return m.kind == kRequest || m.kind == kBackwardRequest;
}

inline Phase phase_of(const Message& m) {
  return m.kind == kBackwardRequest ? Phase::kBackward : Phase::kForward;
}

// The admission phase of a W action (Note [Zero bubble at run time]); F and B/I use
// Phase's values.
constexpr int32_t kWeightPhase = 2;

// int64 words as message meta (a kPlan's, a kStepEnd's header), and back.
inline std::string encode_ints(const std::vector<int64_t>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(int64_t));
}

inline std::vector<int64_t> decode_ints(const std::string& s) {
  std::vector<int64_t> v(s.size() / sizeof(int64_t));
  std::memcpy(v.data(), s.data(), v.size() * sizeof(int64_t));
  return v;
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

}  // namespace detail

struct Dispatcher::Impl {
  Impl(std::shared_ptr<P2PEngine> p, PlanOptions o, Handler h, Spawn sp, ErrorEncoder e)
      : p2p(std::move(p)), opts(checked(std::move(o))), handler(std::move(h)),
        spawn(std::move(sp)), encode_error(std::move(e)),
        order(forwards_before_backwards(opts.kind) ? RecvOrder::kForwardFirst
                                                   : RecvOrder::kBackwardFirst),
        timeout(static_cast<int64_t>(p2p->timeout_s() * 1000)) {}

  // Set at construction (raise_error: once, before the first step).
  std::shared_ptr<P2PEngine> p2p;
  // The step's kind, microbatches, stages and window (Dispatcher's `options`).
  PlanOptions opts;
  Handler handler;
  Spawn spawn;
  ErrorEncoder encode_error;
  ErrorRaiser raise_error;
  RecvOrder order;
  std::chrono::milliseconds timeout;

  static PlanOptions checked(PlanOptions o);
  // Note [Order without a list] (plan.cpp): the token priority of (mb, phase) in a step
  // with no installed list.
  int64_t priority(int64_t mb, Phase phase) const { return order_priority(opts.kind, mb, phase); }

  std::mutex mu;  // see the file comment
  std::condition_variable cv;

  // --- Serving (Note [Serving]): dispatch.cpp ------------------------------------------
  struct Serving {
    bool free = true;   // nobody leads: the next idle serving thread takes the lead
    bool over = false;  // the step ended or failed: serving threads stop
    int idle = 0;       // serving threads waiting for the lead
    int active = 0;     // threads started by this step and not yet returned
    std::exception_ptr error;  // what stopped a thread first
    Message end;               // the step's kStepEnd or kAbort, as a serving thread got it
    void begin_step();
  } serve;

  // The step (dispatch.cpp).
  struct StepState {
    int64_t microbatches = 1;
    std::atomic<int64_t> next_mb{0};  // driver: the next microbatch to start
    std::set<int64_t> forwards_done;  // "simple"
    std::set<int64_t> bodies_over;    // driver: microbatches whose step body returned
    bool rng_streams = false, rng_cuda = false;  // Note [Microbatch random streams]
    uint64_t step_seed = 0;
    void begin_step(int64_t microbatches, bool deterministic, bool rng_cuda);
    // Note [Leaving a plan under tp]: the lowest microbatch whose body has not returned
    // (the next to start when all started ones have). Under `mu`.
    int64_t lowest_running() const;
  } step;

  // The serving thread that leads, per thread (a thread leads at most one dispatcher).
  static thread_local Impl* leading;

  // Runs `body` on a new thread of the step; `serve.active` counts it until it returns.
  void start(std::function<void()> body);
  void fail(std::exception_ptr e);
  void end_serving();
  // Waits until every thread of the step has returned.
  void join();
  void run_held(const Message& msg, bool installed = false);
  void answer_error(const Message& msg, const std::string& what) noexcept;
  bool over_now();
  void run(const Message& msg);
  void serve_loop();
  void resign();
  void rethrow_error();

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

  // --- Note [Executed plan]: detail/plan_execution.cpp ---------------------------------
  struct PlanExecution {
    bool wanted = false;     // begin_step's `planned`
    bool on = false;         // this step executes `plan` (until it leaves it)
    std::optional<Plan> plan;     // this (or the last planned) step's
    std::vector<Action> admissions;  // this rank's, in order
    std::map<std::tuple<int64_t, int32_t, int64_t>, int64_t> position;  // (mb, phase, n) ->
    std::map<std::pair<int64_t, int32_t>, int64_t> admitted;            // (mb, phase) -> n
    std::vector<std::pair<int, bool>> expected_calls;  // driver: each microbatch's
    std::vector<std::vector<std::pair<int, bool>>> calls;  // driver: this step's, per mb
    std::vector<int64_t> recorded_path;  // driver: the last training step's, if uniform
    bool nested_seen = false;            // driver: served a request this step
    bool evaluation = false;  // driver: a microbatch made only the plan's forward calls
    bool installed = false;              // this step installed `plan`
    // Note [Order without a list]: the actions this rank began while the step had no
    // list (all of them, or those after it left its plan), in token order.
    std::vector<Action> ran;
    // Note [Leaving the plan]: why a step last left its plan on this rank's word (empty:
    // none did, or another rank saw it), and how many steps left it so far.
    std::string departure;
    int64_t departures = 0;
    void begin_step(int64_t microbatches, bool planned);
  } exec;

  // Note [Forward order] (detail/plan_execution.cpp): driver, order without a list: forward
  // actions started and forwards over, per microbatch.
  struct ForwardOrder {
    bool on = false;
    std::vector<int64_t> started;
    std::vector<char> over;
    void begin_step(int64_t microbatches, bool deterministic);
  } fwd;

  // Makes `path` this step's plan on this rank. Throws std::logic_error with the plan's
  // text
  // if the plan cannot be compiled or does not validate (Note [Plan validation]).
  void install_plan(int64_t microbatches, const std::vector<int64_t>& path,
                    bool last_hop_accumulates);
  // Driver, drive(): installs the recorded path as this step's plan and announces it.
  void announce_plan(int64_t microbatches);
  // Serving leader: the driver's kPlan.
  void plan_arrived(const Message& msg);
  bool planned_now();
  bool forward_ordered();  // (mu held)
  void start_forward_action(int64_t mb, int64_t priority);
  void forward_over(int64_t mb);
  int64_t admit(int64_t mb, Phase phase);
  int64_t admit(int64_t mb, int32_t action_phase);
  // The task holding the token begins its admitted action: recorded as executed where
  // the step has no list (Note [Order without a list]; a planned grant is recorded by
  // the token itself).
  void took(int64_t mb, int32_t action_phase);
  // Dispatcher::plan_text() of a step without a list (mu held).
  std::string ran_text(const FailedCell* failed) const;
  // Note [Leaving the plan]: `why` names what departed from it.
  // report: counted and kept as the step's departure (false: an evaluation step that
  // began as a training one, Note [Evaluation inside a step]).
  void leave_plan(const std::string& why, bool report = true) noexcept;
  static constexpr int32_t kOwnWeight = -1;
  std::optional<std::pair<int64_t, int32_t>> next_planned_request();
  void leave_plan_on_word();
  void leave_plan_quietly();
  void record_call(int64_t mb, int dst, bool backward);
  void backward_begins(int64_t mb);
  void microbatch_over(int64_t mb);
  void record_path();

  // --- Note [Gradient order]: detail/gradient_order.cpp --------------------------------
  struct GradientOrder {
    std::atomic<bool> ordering{false};  // this step orders gradients
    std::atomic<int64_t> floor{0};      // every microbatch below it is over on this rank
    std::set<int64_t> done;             // microbatches known over here (raise `floor`)
    bool serving = false;               // serve_step() runs this step (not the driver)
    std::vector<int64_t> units, last_units;  // backward requests run, per microbatch
    // Set by order_gradients(), before the first step; read without `mu` after.
    std::vector<compat::GradAccumulatorPtr> accumulators;
    std::vector<torch::autograd::FunctionPreHook*> gate_hooks;
    // Note [Last hop's gradients]: driver, sticky: some microbatch's last hop accumulated.
    bool last_hop_grads = false;
    void begin_step(int64_t microbatches, bool deterministic);
  } grad;

  void announce_done(int64_t mb, bool everyone) noexcept;
  void mark_done(int64_t mb);
  void backward_unit_over(int64_t mb);
  void gate();
  bool last_hop_accumulation(int64_t mb);
  void record_units();
  // Serving rank, serve_step(): the microbatches with no backward work here are over.
  void announce_idle();
  // ~Dispatcher: takes the gates off the accumulators (they outlive the Dispatcher).
  void remove_gates();

  // --- Note [Served backward]: detail/served_backward.cpp ------------------------------
  struct Kept {
    std::vector<at::Tensor> inputs;
    // The outputs' gradient edges, not the outputs: the graph stays, the tensors go
    // once sent (a served head's logits are not held until their backward).
    std::vector<torch::autograd::Edge> outputs;
  };
  struct ServedBackward {
    std::map<std::tuple<int, int64_t, int64_t>, Kept> kept;  // (src, mb, call id) ->
    FailureEncoder encode_failure;  // set before the first step
  } served;

  // Note [Zero bubble at run time].
  // A W to run later, under the autocast state of its request (Note [Autocast travels]).
  struct PendingWeight {
    detail::WeightHalf half;
    int64_t autocast = 0;
  };
  struct ZeroBubble {
    bool split_step = false;  // this step's plan is zero_bubble (driver and serving ranks)
    std::map<int64_t, std::deque<PendingWeight>> weights;  // serving: mb -> pending W
    int64_t weights_left = 0;   // serving: W of the plan not yet run
    bool weights_owed = false;  // serving: the driver awaits this step's kWeightsDone
    std::string weight_error;   // serving: the first W that failed (its encoded error)
    void begin_step();
  } zb;

  std::optional<Kept> take_kept(const Message& msg);
  static double seconds(std::chrono::steady_clock::time_point t);
  Message serve_backward(const Message& msg, Kept k, bool split);
  std::string failure_meta(std::exception_ptr error, int64_t mb, bool weight) noexcept;
  void drop_kept();
  bool splitting_now();
  void run_one_weight(int64_t mb, PendingWeight w);
  std::optional<std::pair<int64_t, PendingWeight>> take_weight(int64_t mb);
  void run_weights_held();
  void run_planned_weight(int64_t mb);
  bool weights_to_flush();
  void flush_weights();
  void weight_failed(std::exception_ptr error, int64_t mb);
  void report_weights() noexcept;
  std::optional<Message> await_weights();

  // --- The step's end, finish and arm: detail/step_end.cpp -----------------------------
  struct Arming {
    // Note [Arming at the first backward]: `mu` is held while the arm runs, so a
    // second task's accumulation waits until the first one's arm is done. It guards
    // `arm`, `ran` and `finish`.
    std::mutex mu;
    std::function<void()> arm;
    std::atomic<bool> done{true};  // no arm pending (the fast path of every gate)
    bool ran = false;
    // Note [Step's finish]: set by finish_at_step_end(), taken by run_finish().
    std::function<void(bool)> finish;
    std::atomic<bool> finish_began{false};
    void begin_step();
  } arming;

  void run_finish(bool backward);
  void arm_once();
  void tell_pp_ranks(Message msg, bool to_self, bool best_effort);

  // --- Stats: detail/dispatch_stats.cpp ------------------------------------------------
  Stats stats;
  // record_spans(): each served backward's and W's (microbatch, start, end).
  bool spans_on = false;
  std::vector<std::tuple<int64_t, double, double>> spans;
  std::atomic<int64_t> crossings{0};  // Stats::crossings
  bool spawn_crosses = true;
  void crossed(int64_t n = 1) { crossings.fetch_add(n, std::memory_order_relaxed); }
};

}  // namespace smp
