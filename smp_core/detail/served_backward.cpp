// The dispatcher's served backward (Note [Served backward] in dispatch.h): the calls a
// request's forward kept, their backward run in C++ through torch's engine, and under
// zero_bubble their split into I, answered at once, and W, run at its turn in the plan
// (Note [Zero bubble at run time]). Part of Dispatcher::Impl
// (detail/dispatcher_impl.h).
//
// Threads: keep_for_backward() runs on the thread running the request's forward (the
// handler's); serve_backward(), the W (run_one_weight() and the rest) and
// weight_failed() on a serving thread holding the compute token (the leader, or a task
// running a nested request); report_weights() there and on the serving leader when the
// driver's kPlan arrives; await_weights() on the driver's step caller after its tasks
// returned; drop_kept() on the step's caller. State: ServedBackward and ZeroBubble
// (this file's), under `mu`; a kept call's graph and a W's are taken out under it and
// run or destroyed after it is let go (a graph may hold Python nodes, whose end takes
// the GIL).
#include <algorithm>
#include <chrono>
#include <deque>
#include <map>
#include <optional>
#include <utility>
#include <vector>

#include <torch/csrc/autograd/engine.h>

#include "smp_core/autocast_state.h"
#include "smp_core/detail/dispatcher_impl.h"
#include "smp_core/errors.h"
#include "smp_core/remote_call.h"
#include "smp_core/task.h"

namespace smp {

using detail::bit;

void Dispatcher::Impl::ZeroBubble::begin_step() {
  split_step = false;
  weights_left = 0;
  weights_owed = false;
  weight_error.clear();
}

std::optional<Dispatcher::Impl::Kept> Dispatcher::Impl::take_kept(const Message& msg) {
  std::lock_guard<std::mutex> lock(mu);
  auto it = served.kept.find({msg.src, msg.mb, msg.call_id});
  if (it == served.kept.end()) return std::nullopt;
  Kept k = std::move(it->second);
  served.kept.erase(it);
  return k;
}

double Dispatcher::Impl::seconds(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(t.time_since_epoch()).count();
}

// The backward of a kept call, in C++ (the token is held). A failure becomes the
// caller's kError answer; the rank goes on serving, as with a module that raised in the
// handler. `split`: only its input half (Note [Split backward]); the weight half waits
// for its W.
Message Dispatcher::Impl::serve_backward(const Message& msg, Kept k, bool split) {
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
      zb.weights[msg.mb].push_back({std::move(weight), msg.autocast});
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

std::string Dispatcher::Impl::failure_meta(std::exception_ptr error, int64_t mb,
                                           bool weight) noexcept {
  if (served.encode_failure) {
    try {
      return served.encode_failure(error, mb, weight);
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

void Dispatcher::Impl::drop_kept() {
  // Destroyed after the lock: a graph may hold Python nodes, whose end takes the GIL.
  std::map<std::tuple<int, int64_t, int64_t>, Kept> gone;
  std::map<int64_t, std::deque<PendingWeight>> gone_weights;
  std::lock_guard<std::mutex> lock(mu);
  gone.swap(served.kept);
  gone_weights.swap(zb.weights);
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
bool Dispatcher::Impl::splitting_now() {
  {
    std::lock_guard<std::mutex> lock(mu);
    if (!zb.split_step || !exec.on) return false;
  }
  // A kPlanOff that arrived turned the token's order off before the leader saw it.
  return p2p->token_ordered();
}

// Runs one W as the token's holder, its microbatch the task's meanwhile (the gate's).
void Dispatcher::Impl::run_one_weight(int64_t mb, PendingWeight w) {
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
std::optional<std::pair<int64_t, Dispatcher::Impl::PendingWeight>>
Dispatcher::Impl::take_weight(int64_t mb) {
  std::lock_guard<std::mutex> lock(mu);
  auto it = mb == kAny ? zb.weights.begin() : zb.weights.find(mb);
  if (it == zb.weights.end()) return std::nullopt;
  std::pair<int64_t, PendingWeight> w{it->first, std::move(it->second.front())};
  it->second.pop_front();
  if (it->second.empty()) zb.weights.erase(it);
  return w;
}

// Every pending W, microbatch by microbatch (the caller holds the token).
void Dispatcher::Impl::run_weights_held() {
  while (auto w = take_weight(kAny)) run_one_weight(w->first, std::move(w->second));
}

// The serving leader, at a W's turn in the plan.
void Dispatcher::Impl::run_planned_weight(int64_t mb) {
  TaskContext task;
  task.mb = mb;
  TaskScope scope(&task);
  const detail::HeldToken held(*p2p, admit(mb, detail::kWeightPhase));
  took(mb, detail::kWeightPhase);
  // None pending: its I failed, and the step is failing.
  if (auto w = take_weight(mb)) run_one_weight(mb, std::move(w->second));
  bool last = false;
  {
    std::lock_guard<std::mutex> lock(mu);
    last = --zb.weights_left == 0;
  }
  if (last) report_weights();
}

// The serving leader, once the step left its plan: the W still pending, then the word.
bool Dispatcher::Impl::weights_to_flush() {
  std::lock_guard<std::mutex> lock(mu);
  return !exec.on && (!zb.weights.empty() || zb.weights_owed);
}

void Dispatcher::Impl::flush_weights() {
  int64_t first = -1;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (!zb.weights.empty()) first = zb.weights.begin()->first;
  }
  if (first >= 0) {
    TaskContext task;
    task.mb = first;
    TaskScope scope(&task);
    const detail::HeldToken held(*p2p, priority(first, Phase::kBackward));
    run_weights_held();
  }
  report_weights();
}

void Dispatcher::Impl::weight_failed(std::exception_ptr error, int64_t mb) {
  std::string meta = failure_meta(error, mb, /*weight=*/true);
  std::map<int64_t, std::deque<PendingWeight>> gone;  // the step fails: no more W
  {
    std::lock_guard<std::mutex> lock(mu);
    if (!zb.weight_error.empty()) return;
    zb.weight_error = std::move(meta);
    gone.swap(zb.weights);
  }
  report_weights();
}

// Serving: this step's kWeightsDone to the driver, once.
void Dispatcher::Impl::report_weights() noexcept {
  Message m;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (!zb.weights_owed) return;
    zb.weights_owed = false;
    m.meta = zb.weight_error;
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
std::optional<Message> Dispatcher::Impl::await_weights() {
  {
    std::lock_guard<std::mutex> lock(mu);
    if (!zb.split_step || serve.error) return std::nullopt;
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

void Dispatcher::keep_for_backward(int src, int64_t mb, int64_t call_id,
                                   std::vector<at::Tensor> inputs,
                                   std::vector<at::Tensor> outputs) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto edges = detail::gradient_edges(outputs);
  outputs.clear();
  impl_->served.kept[{src, mb, call_id}] = Impl::Kept{std::move(inputs), std::move(edges)};
}

void Dispatcher::set_failure_encoder(FailureEncoder encode) {
  impl_->served.encode_failure = std::move(encode);
}

}  // namespace smp
