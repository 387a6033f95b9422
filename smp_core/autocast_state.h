// The autocast state of a pipelined call: what torch.autocast set on the caller's
// thread, as one word that travels with the request (Message::autocast).
//
// Note [Autocast travels]
// ~~~~~~~~~~~~~~~~~~~~~~~
// torch.autocast is per thread, and at pp > 1 a module runs on the thread that serves
// its request on its owner, and a step body on a task thread of the driver (Note
// [Task threads] in detail/task_pool.h), so on its own autocast would reach neither: a
// `with torch.autocast(...)` in the step body would run the other stages in their
// parameters' dtype (or fail on a dtype mismatch), and one around the step call would
// reach no module at all. So the state goes where the work goes, as in one process:
//   - every request (a forward call or a call's backward, Dispatcher::request_native)
//     carries the calling thread's state, one header word of the message; the owner
//     runs it (the module, the served backward, the deferred weight half of a split
//     backward) under that state and puts its own back after (Dispatcher's run_held);
//     a nested call takes the state of the thread that makes it, whichever rank;
//   - a step's task threads run the step body under the state of the thread that
//     called the step (Dispatcher::drive), so autocast around `train_step(...)`
//     covers every microbatch, as it covers the microbatches at pp = 1 and the first
//     step's trace, which run on the caller's thread.
// Installing a state is what `with torch.autocast(...)` does: the autocast nesting
// count goes up and, on the way out, its last exit clears the thread's cache of cast
// weights (a parameter an optimizer then updates in place must not be served from a
// stale bfloat16 copy). A backward runs as autograd runs it in one process: under the
// state of the thread that called backward() (autograd's graph task carries it to
// the remote call's node, whose request carries it on); activation checkpointing
// recomputes under the forward's state, which torch's checkpoint saves itself.
// The word covers cpu and cuda (enabled, dtype) and the cache flag; 0 is a thread's
// default (autocast off on both), so a call without autocast costs two reads and a
// compare on each side (see docs/pipeline.md for the measurement).
//
// Note [Received inputs are not weights]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// On its owner a call's received tensors become leaves that require grad (their
// gradients go back to the caller). torch's autocast takes a float32 leaf that requires
// grad for a weight: it casts it once per autocast block and caches the cast, so the
// lower-precision gradients of its uses are summed in that precision before the one
// cast back. In one process the same tensor is an activation, cast for each use and
// each use's gradient cast back to float32 before the sum. So while autocast is on, a
// served module gets a view of each such leaf (a view is never cached) and its
// gradients sum as in one process (without it BERT's layer input, used by the query,
// key and value projections, gets gradients ~1e-6 off, in bfloat16). The one serving
// path does it (Server::serve, Note [Known forward requests] in serve.h), for ~1 us
// per such input. (A step input that
// requires grad is a leaf in one process too, whose cast is cached there and not on
// its owner here: a difference in rounding left as it is.)
//
// Thread-safety: every function reads or writes the calling thread's state only.
#pragma once

#include <cstdint>

namespace smp::autocast_state {

// The calling thread's autocast state; 0 when autocast is off for cpu and cuda.
int64_t capture();

// Runs the scope under `word`'s state, as a `with torch.autocast(...)` block would,
// and restores the thread's own state at its end. Nothing changes (and nothing is
// restored) when the thread is in that state already: the usual case. Throws
// CommError if `word` is not a state capture() makes.
class Scope {
 public:
  explicit Scope(int64_t word);
  ~Scope();
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  bool changed_ = false;
  int64_t saved_[5] = {};  // cpu on, cpu dtype, cuda on, cuda dtype, cache
};

}  // namespace smp::autocast_state
