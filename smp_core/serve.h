// The owner's side of a remote module call: Server::serve runs every forward request
// this rank gets, whatever its arguments, and returns the answer the Dispatcher sends.
//
// Note [Known forward requests]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A served forward request repeats every microbatch, and on a serving rank it is the
// only time Python runs (a backward request is served in C++: Note [Served backward]
// in dispatch.h). Server::serve is the one serving path, for every request: the usual
// one (tensors passed positionally, one tensor back) and any other (keyword
// arguments, other objects, nesting, several outputs). It decodes the request's
// metadata (Note [Call metadata] in call_meta.h), makes the received tensors leaves
// that require grad as flagged (views of them under autocast: Note [Received inputs
// are not weights] in autocast_state.h), sets the caller's grad mode, runs the module
// through the `run` hook, encodes the answer's metadata, and keeps the call's leaves
// and outputs for its backward (Dispatcher::keep_for_backward). Any error in it
// becomes the kError answer `encode_failure` makes, so the caller raises it.
//
// The hooks are what only Python can do, one crossing per request: `run` applies the
// subtree's train/eval flags, unpickles a general request's skeleton, calls the
// module with the thread's microbatch set for its nested calls, and flattens what it
// returned unless that is one tensor (smp/pipeline.py _Modules.run); `encode_failure`
// pickles an exception. The usual request costs Python only the module's own call and
// a few lines around it.
//
// Known requests: the subtree's flags need applying once per step and request
// metadata, not per request; the user may switch modes between steps, and applying
// another module's flags may switch modules this one shares. So the Server remembers
// the metadata it served this step (at most kMaxKnown of them; past that every
// request applies its flags), passes no flags for a request it knows, and forgets
// them all when a step begins and whenever `run` reports that applying flags switched
// a module's mode. `served` counts the requests run as known.
//
// Thread-safety: serve() runs on the thread that holds the compute token (one at a
// time, but any of the serving threads); every method is thread-safe. The hooks are
// called without any lock held here.
#pragma once

#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "smp_core/p2p.h"

namespace smp {

class Dispatcher;

// One run of a module, as the `run` hook gets it.
struct ModuleCall {
  const std::string& module;        // its name on this rank
  int64_t mb;                       // the request's microbatch
  const std::string* mode_flags;    // apply these first; nullptr: already applied
  std::vector<at::Tensor> args;     // the positional arguments, or the skeleton's tensors
  const std::string& skeleton;      // empty: `args` are the positional arguments
};

// What the module returned, as the `run` hook gives it back.
struct ModuleResult {
  std::vector<at::Tensor> outputs;
  std::string skeleton;         // empty: outputs[0] is what the module returned
  bool modes_changed = false;   // applying `mode_flags` switched a module's mode
};

struct ServeHooks {
  // Runs the module under the grad mode set by serve(); throws what it raised.
  std::function<ModuleResult(const ModuleCall& call)> run;
  // The meta of the kError answer to a request of microbatch `mb` that failed with
  // `error` (the module's exception, or a C++ one); `backward`: a kBackwardRequest
  // (one whose forward kept no graph). Default: the error's text.
  std::function<std::string(std::exception_ptr error, int64_t mb, bool backward)> encode_failure;
};

class Server {
 public:
  // Known request metadata kept per step (Note [Known forward requests]).
  static constexpr size_t kMaxKnown = 1024;

  // `pp_rank`: this rank's, for messages.
  Server(ServeHooks hooks, int pp_rank);
  ~Server();

  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // The Dispatcher whose handler calls serve(): it keeps the calls' graphs. Set once,
  // before the first request.
  void attach(std::weak_ptr<Dispatcher> dispatcher);

  // Runs forward request `request` (its tensors, metadata and sender) and returns the
  // answer: a kResponse, or a kError. Never throws for the module's or the request's
  // fault; throws only if encode_failure does.
  Message serve(const Message& request);

  // A step begins: forgets the known requests.
  void begin_step();

  // Requests run as known (Note [Known forward requests]).
  int64_t served() const;
  // Known request metadata held now.
  size_t known() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace smp
