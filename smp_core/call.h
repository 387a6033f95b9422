// The caller's side of a remote module call: Caller::call makes every call of a
// module another pp rank owns, whatever its arguments.
//
// Note [Known calls]
// ~~~~~~~~~~~~~~~~~~
// On the driver every call of a module another pp rank owns is on the critical path,
// and it repeats every microbatch and every step. Caller::call is the one calling path,
// for every kind of call (the caller's side of Note [Known forward requests] in
// serve.h): it numbers the call, encodes the request's metadata (Note [Call
// metadata] in call_meta.h), sends it and waits for the answer through the Dispatcher
// (which runs the microbatch's nested requests meanwhile), raises an error answer
// through the Dispatcher's ErrorRaiser, decodes the answer's metadata and, under grad
// mode, makes the outputs those of the call's autograd node (Note [Remote call node]
// in remote_call.h). What only Python can do is done before and after, by the
// caller of this function (Engine.call in smp/pipeline.py, python/csrc/bind_calls.cpp
// and smp/remote_call.py): reading the called subtree's train/eval flags, pickling the
// structure of arguments that are not distinct tensors passed positionally (keyword
// arguments, other objects, nesting, a tensor passed twice) and rebuilding a
// structured answer. The usual call, tensors passed positionally and one tensor back,
// pickles nothing, and its metadata is encoded here per call (well under a
// microsecond; nothing is cached).
//
// Call ids: per microbatch, from 0 each step, offset by `id_base` (the pp rank times a
// stride, so ids are unique per caller and microbatch: Note [Remote call node]).
//
// Thread-safety: call() is called by several tasks at once (one per microbatch in
// flight); it blocks while it waits for the answer, so call it without the Python GIL.
// Every other method is thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

namespace smp {

class Dispatcher;

// A call's arguments as they travel: tensors by value, the rest pickled by Python.
struct CallArgs {
  std::vector<at::Tensor> tensors;  // each tensor once
  std::string skeleton;             // empty: `tensors` are the positional arguments
};

// What the owner answered, on the caller: the outputs (differentiable where the owner's
// required grad, under grad mode) and, unless the module returned one tensor, their
// structure pickled by Python.
struct CallOutputs {
  std::vector<at::Tensor> tensors;
  std::string skeleton;  // empty: tensors[0] is what the module returned
};

class Caller {
 public:
  Caller(std::shared_ptr<Dispatcher> dispatcher, int64_t id_base);
  ~Caller();

  Caller(const Caller&) = delete;
  Caller& operator=(const Caller&) = delete;

  // Runs module `module` on pp rank `owner` for the calling task's microbatch, with
  // `args`, the subtree's train/eval flags `mode_flags` and the thread's grad mode.
  // Throws std::runtime_error if the thread runs no microbatch (a call outside an
  // @smp.step function) or the caller was closed; whatever the Dispatcher's
  // ErrorRaiser throws for an error answer; CommError for a malformed answer.
  CallOutputs call(const std::string& module, int owner, CallArgs args, std::string mode_flags);

  // A step begins: call ids start from 0 again.
  void begin_step();
  // Drops the Dispatcher (the engine shuts down); a later call() throws.
  void close();

  // Calls made with positional tensor arguments (no pickled skeleton).
  int64_t fast_calls() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace smp
