// The dispatcher's step end and abort (Note [Step end] in dispatch.h): the driver's
// shares of the step's end combined into one kStepEnd, or its first error sent as a
// kAbort to every pp rank; the step's finish that runs where the step ended well (Note
// [Step's finish]); and the arm that runs before the step's first gradient
// accumulation (Note [Arming at the first backward]). Part of Dispatcher::Impl
// (detail/dispatcher_impl.h).
//
// Threads: drive_step() on the driver's step caller, its bodies' shares (and the first
// abort) from the driver's task threads; tell_pp_ranks() on any thread (a task, a
// serving thread leaving the plan, the step's caller); run_finish() on the step's
// caller (drive_step(), serve_step()); arm_once() from gate(), on the autograd thread
// accumulating the step's first gradient, or from arm_now(); the setters
// (arm_at_first_backward(), finish_at_step_end(), disarm()) on the owner's thread
// between steps. State: Arming (this file's), under `arming.mu` (held while the arm
// runs, so a second accumulation waits for it; the finish is taken out under it and
// runs after); `arming.done` and `arming.finish_began` are atomics read without it.
// This file takes no `mu` of its own (drive_step() runs drive(), which does).
#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <vector>

#include "smp_core/detail/dispatcher_impl.h"
#include "smp_core/errors.h"

namespace smp {

void Dispatcher::Impl::Arming::begin_step() {
  finish_began.store(false, std::memory_order_release);
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
void Dispatcher::Impl::run_finish(bool backward) {
  std::function<void(bool)> fn;
  {
    std::lock_guard<std::mutex> lock(arming.mu);
    fn.swap(arming.finish);
  }
  if (!fn) return;
  arming.finish_began.store(true, std::memory_order_release);
  fn(backward);
}

// Note [Arming at the first backward]: runs the step's arm unless it ran.
void Dispatcher::Impl::arm_once() {
  if (arming.done.load(std::memory_order_acquire)) return;
  std::lock_guard<std::mutex> lock(arming.mu);
  if (arming.ran || !arming.arm) return;
  arming.arm();  // a throw leaves it pending: the step fails, disarm() says it did not run
  arming.ran = true;
  arming.done.store(true, std::memory_order_release);
}

// Sends the step-level `msg` (its mb becomes -1) to every other pp rank and, with
// `to_self`, to this one. `best_effort`: a peer that cannot be reached is skipped (its
// own failure ends its step) instead of throwing.
void Dispatcher::Impl::tell_pp_ranks(Message msg, bool to_self, bool best_effort) {
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

bool Dispatcher::drive_step(MicrobatchStepFn run) {
  auto& I = *impl_;
  std::vector<Message> parts(static_cast<size_t>(std::max<int64_t>(I.step.microbatches, 0)));
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
  end.meta = detail::encode_ints(header);
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
  const std::vector<int64_t> words = detail::decode_ints(end.meta.substr(0, head));
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

void Dispatcher::arm_at_first_backward(std::function<void()> arm) {
  auto& I = *impl_;
  std::lock_guard<std::mutex> lock(I.arming.mu);
  I.arming.arm = std::move(arm);
  I.arming.ran = false;
  I.arming.done.store(!I.arming.arm, std::memory_order_release);
}

void Dispatcher::arm_now() { impl_->arm_once(); }

void Dispatcher::finish_at_step_end(std::function<void(bool backward)> finish) {
  auto& I = *impl_;
  std::lock_guard<std::mutex> lock(I.arming.mu);
  I.arming.finish = std::move(finish);
}

bool Dispatcher::finish_began() const {
  return impl_->arming.finish_began.load(std::memory_order_acquire);
}

bool Dispatcher::disarm() {
  auto& I = *impl_;
  std::function<void()> gone;
  std::function<void(bool)> gone_finish;
  std::lock_guard<std::mutex> lock(I.arming.mu);
  const bool ran = I.arming.ran;
  gone.swap(I.arming.arm);
  gone_finish.swap(I.arming.finish);
  I.arming.ran = false;
  I.arming.done.store(true, std::memory_order_release);
  return ran;
}

}  // namespace smp
