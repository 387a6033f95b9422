// CommQueue: one worker thread that runs the communication tasks of one process group
// strictly in submission order, each to completion before the next starts.
//
// Note [Ordered bucket communication]
// Every collective on a process group must be issued in the same order on every rank.
// A comm hook may chain several collectives for one bucket (PowerSGD: allreduce P,
// compute, allreduce Q). torch's DDP runs each bucket's hook as soon as the bucket is
// ready and PowerSGD issues the second collective from the first one's completion
// callback on a Gloo thread; with two or more buckets the buckets' chains then
// interleave differently on each rank and Gloo aborts (FACTS.md). Here one thread per
// reducer runs bucket k's hook and waits for its future (the whole chain) before it
// runs bucket k+1's hook, and every rank submits buckets in index order, then the
// unused-parameter bitmap, then (first step only) the rebuild order. So the sequence of
// collectives is a function of the submission order alone, identical on all ranks.
// Backward compute still overlaps with communication: autograd runs on its own thread
// and only submits. Completion callbacks only notify; they never issue collectives.
// A Join shadow step (a rank without data) submits the same sequence with zero
// buffers, so it matches its peers' collectives one for one.
//
// Failure: once a task throws (or times out), the group's order is lost on this rank,
// so every later task fails at once with that first error instead of issuing
// collectives that would pair with the wrong ones on other ranks.
//
// Thread-safety: submit/wait from any thread.
#pragma once

#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>

#include <c10/util/intrusive_ptr.h>

namespace c10d {
class ProcessGroup;
}  // namespace c10d

namespace smp {

class CommQueue {
 public:
  // The completion of one task.
  struct Ticket {
    std::string what;       // names the task in errors
    bool done = false;      // guarded by the queue's mutex
    std::exception_ptr error;
    double run_ms = 0;      // wall time the task ran on the worker
  };
  using TicketPtr = std::shared_ptr<Ticket>;

  // `name` appears in errors and in the worker thread's name.
  explicit CommQueue(std::string name);
  // Fails tasks not yet started, waits up to `shutdown_wait_s` for the running one,
  // then joins (or, if it is stuck in a collective, detaches) the worker.
  ~CommQueue();

  CommQueue(const CommQueue&) = delete;
  CommQueue& operator=(const CommQueue&) = delete;

  // Appends `task`; it runs on the worker after every earlier task has finished.
  TicketPtr submit(std::string what, std::function<void()> task);

  // Blocks until `ticket`'s task ran; rethrows its exception. Throws TimeoutError
  // naming the task and the queue after `timeout_s`.
  void wait(const TicketPtr& ticket, double timeout_s);

  // The first error of any task ("" if none).
  std::string first_error() const;
  const std::string& name() const;

  // Seconds the destructor waits for a running task before detaching the worker.
  double shutdown_wait_s = 5.0;

 private:
  struct State;
  std::shared_ptr<State> state_;
};

// The process-wide queue of `pg`, created on first use and never destroyed (it lives
// as long as the process, like the group's users). Comm hooks that run under torch's
// DistributedDataParallel (smp's built-ins called through torch's GradBucket) put
// each bucket's chain of collectives here: torch's reducer launches buckets in index
// order from one thread, so submission order, and with it collective order, is the
// same on every rank. See Note [Ordered bucket communication].
CommQueue& group_queue(const c10::intrusive_ptr<c10d::ProcessGroup>& pg);

}  // namespace smp
