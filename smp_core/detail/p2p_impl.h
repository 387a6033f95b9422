// P2PEngine::Impl (smp_core/p2p.h's pimpl), shared by its two sources:
//   p2p.cpp                    the transport and the mailbox: the mesh's sockets, send(),
//                              the receiver threads (Note [Wire format], Note [Layout
//                              travels]), recv() and the step epochs.
//   detail/compute_token.cpp   the compute token (Note [Compute token], Note [Planned
//                              token order] in p2p.h): its waiters, grants and order.
//
// Threads: the receiver threads (one per peer) deliver into the mailbox; any task thread
// sends, receives and takes or gives back the token. Lock discipline: `mu` guards the
// mailbox, the waiters, the token and the stats; functions named *_locked expect the
// caller to hold it. The sockets are written under their peer's `send_mu` (never with
// `mu` held) and read only by their receiver thread; `fds`, `send_mu`, `rank`, `size`
// and `timeout_s` are set at construction and only read after.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "smp_core/p2p.h"
#include "smp_core/task.h"

namespace smp {

struct P2PEngine::Impl {
  double timeout_s;
  int rank, size;

  std::vector<int> fds;                              // one socket per peer (-1: self)
  std::vector<std::unique_ptr<std::mutex>> send_mu;  // one per peer
  std::vector<std::thread> receivers;

  std::mutex mu;  // guards everything below
  std::deque<Message> mailbox;
  // Note [Targeted wakeups]: every waiting task has its own condition variable, and a
  // new message or a released token wakes only the tasks it concerns: with a dozen
  // microbatch tasks per rank, waking all of them on every event costs real CPU.
  struct MailWaiter {
    int64_t mb, call_id;
    uint32_t mask;
    std::condition_variable cv;
  };
  std::vector<MailWaiter*> mail_waiters;
  std::string fatal;  // set when a receiver failed: every wait throws it
  // When. Note [Late messages after a peer left]: a wait throws `fatal` only once
  // kFatalGrace has passed with nothing for it arriving.
  std::chrono::steady_clock::time_point fatal_since;
  bool stopping = false;
  int64_t epoch = 0;  // current step (Note [Step epochs])

  // Compute token (detail/compute_token.cpp).
  bool token_held = false;
  std::thread::id token_owner;  // the thread holding the token
  // The holder's task (task.h): its random stream is installed when it takes the
  // token and saved when it gives it up (Note [Microbatch random streams]); nullptr:
  // a thread with no task, nothing to swap.
  TaskContext* token_task = nullptr;
  std::chrono::steady_clock::time_point token_since;
  struct TokenWaiter {
    int64_t priority;
    uint64_t ticket;
    std::condition_variable cv;
    TaskContext* task;  // the task it takes the token for (nullptr: none)
  };
  std::vector<TokenWaiter*> token_waiters;
  uint64_t next_ticket = 0;
  int64_t token_priority = -1;  // the holder's
  std::chrono::steady_clock::time_point last_grant = std::chrono::steady_clock::now();
  // Note [Planned token order].
  bool ordered = false;
  int64_t next_planned = 0;
  std::vector<int64_t> grants;  // planned positions granted, in order
  // Note [Leaving a plan under tp]: armed by the driver for its step; on once the step
  // leaves its plan (serial_on); then only tasks of microbatches <= serial_floor (the
  // driver's lowest unfinished one) may take the token.
  bool serial_armed = false;
  // ... and on a serving rank: a kPlanOff turns the order off when the serving leader
  // takes it (order_token(false)), in its place among the requests, not on arrival.
  bool plan_off_deferred = false;
  bool serial_on = false;
  int64_t serial_floor = 0;

  Stats stats;

  // Note [Payload transports] in p2p.h.
  c10::intrusive_ptr<c10d::ProcessGroup> payload_pg;
  PayloadTransport transport = PayloadTransport::kTcp;
  at::Device device{at::kCPU};
  std::condition_variable payload_set;

  // --- p2p.cpp: the transport and the mailbox ------------------------------------------
  bool by_c10d(const at::Tensor& t) const;
  // The payload group; a peer may send before this rank has set it (every rank sets it
  // right after the engine's construction), so the receiver waits for it.
  c10::intrusive_ptr<c10d::ProcessGroup> payload_group(int peer);
  void wait_payload(const c10::intrusive_ptr<c10d::Work>& work, const std::string& what);
  void receive_loop(int peer);
  // A peer is gone: every wait from now on throws `why` (the first reason wins; none
  // while this engine is shutting down itself).
  void fail(const std::string& why);
  // Appends `m` and wakes the waiters it matches. Holds mu.
  void deliver_locked(Message m);
  // A message after which this step's token order must be off (kept in the mailbox
  // like them, so that order_token(true) after it arrived stays off too).
  bool ends_order(const Message& m) const;
  bool matches(const Message& m, int64_t mb, int64_t call_id, uint32_t mask) const;

  // --- detail/compute_token.cpp: the token; `lock` holds mu ----------------------------
  // Wakes the waiter that gets the token next. Holds mu.
  void wake_token_locked();
  void unorder_locked();
  // Note [Planned token order]: whether `w` may take the free token now.
  bool may_take_locked(TokenWaiter* w);
  // Note [Leaving a plan under tp]: whether `w` may take it at all now.
  bool serial_allows_locked(const TokenWaiter* w) const;
  void go_serial_locked();
  void end_serial_locked();
  TokenWaiter* best_token_waiter();
  // `task`: the task taking the token (its thread's, or the holder's when a thread
  // works for the holder).
  void acquire_locked(std::unique_lock<std::mutex>& lock, int64_t priority, TaskContext* task);
  bool holds_token_locked() const;
  // Only the holder gives the token back: a task whose wait failed (and so did not
  // take the token back) must not release another task's token on its way out.
  void release_locked();
};

}  // namespace smp
