// Serving and request dispatch of the pipeline: which thread runs which piece of a
// step's work, when, and holding what. Python only runs a module's forward or backward
// (or, on the driver, the step body of one microbatch) when a Dispatcher asks it to.
//
// Note [Serving]: a rank other than the driver serves the requests of every microbatch
// with ONE thread at a time, the leader. The leader takes the next request in the
// step's order (Note [Receive order] in p2p.h), acquires the compute token at the
// request's priority, runs it through the handler and sends the answer. Running every
// microbatch on a thread of its own instead costs a thread switch per request and cold
// per-thread state. Only when the request being run makes a nested remote call and
// must wait (wait() on a leader thread) does the leader hand the lead to an idle
// serving thread, starting one if there is none; so other microbatches keep being
// served while it waits. Every waiting task, leader or not, runs the requests of its
// own microbatch that arrive meanwhile (a nested call back into this rank).
//
// The driver (pp rank 0) runs the step body once per microbatch, at most
// driver_window() microbatches in flight, each started in microbatch order with the
// token held at its forward priority (drive()).
//
// Threads: the Dispatcher does not create threads. It asks `spawn` to run a body on a
// thread of the caller's; the Python bindings hand the body to persistent Python
// threads, so a handler runs on a thread whose interpreter state is warm.
//
// Thread-safety: every method is thread-safe. Methods block; call them without the
// Python GIL (the bindings release it).
#pragma once

#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/core/Tensor.h>

#include "smp_core/p2p.h"
#include "smp_core/plan.h"

namespace smp {

class Dispatcher {
 public:
  // Runs a request (kRequest or kBackwardRequest) and returns the answer: kind
  // kResponse, kBackwardResponse or kError, with its meta and tensors (microbatch and
  // call id are filled in from the request). Called with the compute token held. An
  // error of the module belongs in a kError answer; a handler that throws anyway gets
  // its caller a kError answer (encode_error) and ends the step on this rank.
  using Handler = std::function<Message(const Message&)>;
  // Runs `body` on another thread, soon; must not wait for it.
  using Spawn = std::function<void(std::function<void()>)>;
  // Driver: runs microbatch `mb`'s step body (token held). Reports its own errors.
  using MicrobatchFn = std::function<void(int64_t mb)>;
  // The meta of a kError answer carrying `what` (a handler that threw): the caller
  // raises it. Default: the text itself.
  using ErrorEncoder = std::function<std::string(const std::string& what)>;
  // Throws the exception a kError answer or a kAbort carries (the owner's, rebuilt).
  // Default: CommError with the meta as text.
  using ErrorRaiser = std::function<void(const Message& answer)>;

  // `options`: the step's kind, microbatches, stages (pp ranks) and active_microbatches
  // (smp_core/plan.h): the plans this rank compiles, and the order of a step without one
  // (Note [Order without a list] in plan.cpp). Throws ConfigError on a bad option.
  Dispatcher(std::shared_ptr<P2PEngine> p2p, PlanOptions options, Handler handler, Spawn spawn,
             ErrorEncoder encode_error = nullptr);
  ~Dispatcher();

  Dispatcher(const Dispatcher&) = delete;
  Dispatcher& operator=(const Dispatcher&) = delete;

  const PlanOptions& options() const;

  // Whether running `spawn` enters Python (a Python thread pool; the default) and so
  // counts as a crossing in Stats; false for C++ threads (Note [Task threads] in
  // smp_core/detail/task_pool.h).
  void set_spawn_crosses(bool crosses);

  // Set once, before the first step: how raise_answer() rebuilds an error answer.
  void set_error_raiser(ErrorRaiser raise);
  // Throws the error `answer` (kError or kAbort) carries; never returns.
  [[noreturn]] void raise_answer(const Message& answer) const;

  // Starts a step of `microbatches` microbatches ("simple": no forward has finished).
  // `deterministic`: the step's results do not depend on timing. Every microbatch
  // draws from a random stream of its own (Note [Microbatch random streams] in
  // task_rng.h; the CUDA generator too with `rng_cuda`), leaving the default
  // generators outside the step as they were (the CPU generator advanced once on
  // every rank, by the step's seed); and the gradients of the parameters given to
  // order_gradients() accumulate in microbatch order (Note [Gradient order]).
  // `planned`: the driver may execute a plan this step (Note [Executed plan]); pass
  // false for a step that runs no backward (evaluation).
  void begin_step(int64_t microbatches, bool deterministic = false, bool rng_cuda = false,
                  bool planned = true);

  // Note [Gradient order]: the parameters this rank holds (leaves that require grad).
  // In a deterministic step a microbatch's gradient is added to a parameter's .grad
  // only after every earlier microbatch's backward work on this rank is over, so the
  // sum is taken in microbatch order whatever order requests arrive in. Call once,
  // before the first step; the hooks stay until the Dispatcher goes.
  void order_gradients(const std::vector<at::Tensor>& params);

  // Driver: runs `run` for microbatches 0 .. microbatches-1 (begin_step's count) on
  // at most driver_window() threads, in microbatch order, under the calling
  // thread's autocast state (Note [Autocast travels] in autocast_state.h); returns
  // when every one has returned. Rethrows the first exception a `run` let escape.
  void drive(MicrobatchFn run);

  // Note [Step end]: the driver's step from its start to its end. As drive(), with
  // each microbatch's body returning its share of the step's end: a kStepEnd message
  // (its outputs, as meta and tensors) or a kAbort (its error, encoded; empty from a
  // body that knows another failed first). The first kAbort with an error goes at once
  // to every pp rank, this one too (its other tasks waiting for a message see it). When every microbatch returned a kStepEnd (and, under
  // zero_bubble, every serving rank's W are over), one kStepEnd carrying every share
  // in microbatch order goes to every other pp rank; serve_step() returns it there
  // (step_end_parts() splits it). Returns false if the step was aborted.
  using MicrobatchStepFn = std::function<Message(int64_t mb)>;
  bool drive_step(MicrobatchStepFn run);
  // The microbatches' shares of a kStepEnd that drive_step() sent, in order.
  static std::vector<Message> step_end_parts(const Message& end);
  // Sends the step-level `msg` (its mb becomes -1) to every other pp rank and, with
  // `to_self`, to this one: an abort, a join state (smp/join.py).
  void tell_pp_ranks(Message msg, bool to_self = false);

  // Any other rank: serves the step's requests (Note [Serving]) until the driver ends
  // or aborts the step, and returns that kStepEnd or kAbort message once every serving
  // thread has stopped. Throws TimeoutError if the driver goes silent for the timeout,
  // or the error that stopped a serving thread.
  Message serve_step();

  // Sends `request` (a kRequest or kBackwardRequest of the calling task's microbatch)
  // to pp rank `dst` and waits for its answer (`kind`) as wait() does. With random
  // streams on, the request carries the task's stream and the task continues from the
  // one the answer brings back. The request carries the calling thread's autocast
  // state, which its owner runs it under (Note [Autocast travels]).
  Message call(int dst, Message request, int32_t kind, bool backward, const std::string& what,
               bool for_holder = false);
  // call() from C++ (a remote call's backward node, remote_call.h): the same, not counted
  // as a crossing, since no Python is involved.
  Message request_native(int dst, Message request, int32_t kind, bool backward,
                         const std::string& what, bool for_holder = false);

  // A task waiting for the answer (`kind`) of its call `call_id` of microbatch `mb`.
  // Gives up the lead (a serving leader) and the compute token while waiting, runs
  // requests of `mb` that arrive meanwhile, and re-acquires the token at `mb`'s
  // forward or `backward` priority. Returns the answer, a kError answer or the step's
  // kAbort (the caller raises those). Throws TimeoutError naming `what`. `for_holder`:
  // the calling thread is not a task but works for the token's holder (autograd's
  // device thread); it yields and retakes the holder's token (P2PEngine::recv).
  Message wait(int64_t mb, int64_t call_id, int32_t kind, bool backward, const std::string& what,
               bool for_holder = false);

  // "simple" (GPipe): every microbatch's forward finishes before any backward starts.
  // A finished (or failed) microbatch's forward is reported by forward_finished();
  // wait_all_forwards() gives up the token until every forward of the step finished,
  // then takes it back at `mb`'s backward priority. A no-op under "interleaved".
  void forward_finished(int64_t mb);
  void wait_all_forwards(int64_t mb);

  // Note [Served backward]: the forward of a request that recorded an autograd graph
  // leaves the call's input leaves and outputs here (from the handler, before its answer
  // goes out). The call's kBackwardRequest is then served in C++, with no Python: the
  // output gradients the request carries (its flags, Note [Remote call node]) go
  // through torch's autograd engine, and the answer carries the inputs' gradients. A
  // backward request with nothing kept goes to the handler as before. Kept calls are
  // dropped at the next begin_step() and when the step's serving or driving ends.
  void keep_for_backward(int src, int64_t mb, int64_t call_id, std::vector<at::Tensor> inputs,
                         std::vector<at::Tensor> outputs);
  // The meta of the kError answer of a served backward of microbatch `mb` that threw
  // `error` (Python: the pickled exception, kept for Note [One traceback per error]).
  // Default: the text. `weight`: the call's W failed (Note [Zero bubble at run time] in
  // detail/served_backward.cpp), after its answer went out.
  using FailureEncoder =
      std::function<std::string(std::exception_ptr error, int64_t mb, bool weight)>;
  void set_failure_encoder(FailureEncoder encode);
  // With `on`, each served backward's span (microbatch, start and end in seconds of the
  // steady clock, which is Python's perf_counter clock) is kept until take_spans().
  void record_spans(bool on);
  std::vector<std::tuple<int64_t, double, double>> take_spans();

  // Note [Arming at the first backward]: `arm` runs once in the current step, just
  // before this rank's first gradient accumulation of a parameter given to
  // order_gradients() (the dp reducer of a synchronized step arms itself there: Note
  // [Pipeline overlap]), or at arm_now(), whichever comes first. Set it after
  // begin_step(), before the step's work; begin_step() clears it.
  void arm_at_first_backward(std::function<void()> arm);
  // Runs the step's arm now unless it ran (a rank with no backward work of its own).
  void arm_now();
  // Takes the step's arm off; returns whether it had run. Drops the step's finish too.
  bool disarm();
  // Note [Step's finish]: `finish(backward)` runs once, in C++, when this step ends well
  // on this rank: in drive_step() after the step's end went out, in serve_step() once it
  // arrived; `backward`: a backward ran in the step (on any pp rank). It sums the tied
  // gradients and finalizes the dp reducer. Not run for a failed or aborted step.
  // Set it before the step's work, each step (running takes it off).
  void finish_at_step_end(std::function<void(bool backward)> finish);
  // Whether this step's finish began (a step that raises after it began failed in its
  // finish, not in its work); begin_step() resets it.
  bool finish_began() const;

  // Where a served request's time goes (the compute token is held throughout; compare
  // P2PEngine::Stats::token_held_s).
  struct Stats {
    int64_t requests = 0;  // requests run by this rank
    double handler_s = 0;  // inside the handler (Python: the module's work and its glue)
    double send_s = 0;     // sending the answers
    // Note [Gradient order]: accumulations that waited for an earlier microbatch, and
    // steps whose backward work on this rank differed from the step before (the
    // first such step waits for the driver's word on each microbatch instead).
    int64_t ordered_waits = 0;
    // Note [Forward order]: forward actions that waited for the previous microbatch's.
    int64_t forward_order_waits = 0;
    int64_t unplanned_steps = 0;
    // Python<->C++ crossings through this Dispatcher: each entry from Python (call,
    // begin_step, drive, serve_step, forward_finished, wait_all_forwards) and each
    // callback into Python (a request's handler, a microbatch's step body, a thread
    // asked of spawn); and the microbatches of the steps begun, to count them per
    // microbatch (issue 21's target: at most 3).
    int64_t crossings = 0;
    int64_t microbatches = 0;
    // Note [Executed plan]: steps begun with a plan (on a serving rank: the driver's),
    // and those of them that left it (their calls differed from the recorded ones).
    int64_t planned_steps = 0;
    int64_t plan_fallbacks = 0;
    // Plans installed that differ from the one before (another path or microbatch
    // count): the driver logs the plan when this moves, not every planned step.
    int64_t new_plans = 0;
    // Note [Served backward]: backward requests served in C++, and the time spent in
    // torch's autograd engine for them.
    int64_t native_backwards = 0;
    double backward_s = 0;
    // zero_bubble (Note [Split backward]): served backwards split into I and W, and the W
    // this rank ran (at their planned turn, or all at once where the step left its plan).
    int64_t split_backwards = 0;
    int64_t weight_actions = 0;
  };
  Stats stats() const;

  // Note [Executed plan]: this rank's planned actions of the current (or last) step in
  // order (empty when the step had no plan), and those it ran, in the order their tasks
  // took the token ("F3", "B3", with ".h2" where the path visits the rank twice; a step
  // without a plan records its actions without hops: Note [Order without a list]).
  // plan_text(): every rank's lists (Plan::format) with `failed` marked, or "".
  std::vector<std::string> planned_actions() const;
  std::vector<std::string> executed_actions() const;
  std::string plan_text(const FailedCell* failed = nullptr) const;
  // Note [Leaving the plan]: what last made a step leave its plan on this rank's word
  // ("" if none did here; Stats::plan_fallbacks counts every departure).
  std::string plan_departure() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace smp
