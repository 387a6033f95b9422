// Point-to-point message engine of the pipeline: the transport of remote module calls
// between the ranks of one pp group.
//
// A message is (microbatch, call id, kind, opaque meta bytes, tensors). The ranks of
// the group are connected by plain TCP sockets (a full mesh set up through the c10d
// store; see smp_core/detail/tcp_mesh.h for why not Gloo). A message is one gathered
// write: fixed header words, tensor descriptors, meta, then each tensor's bytes, read by
// the peer's receiver thread straight into fresh tensors. Sends to one peer are
// serialized (a message is never interleaved with another), so the receiver reads
// them in order. Received messages land in a mailbox and are matched by
// (microbatch, call id, kind) — never by arrival order (DESIGN.md invariant).
//
// The engine also owns the rank's compute token: the pipeline runs several microbatch
// tasks as threads, and only the task holding the token computes. A task gives the
// token up while it waits for a message; waiting tasks get it back in priority order
// (see Note [Compute token]).
//
// Thread-safety: every method is thread-safe. Blocking methods must be called without
// the Python GIL (the bindings release it).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

namespace c10d {
class ProcessGroup;
class Store;
}

namespace smp {

// Kinds of message. Kept stable: they are on the wire.
enum MsgKind : int32_t {
  kRequest = 1,           // forward call of a module owned by the receiver
  kResponse = 2,          // its outputs
  kBackwardRequest = 3,   // output gradients of an earlier call
  kBackwardResponse = 4,  // input gradients
  kError = 5,             // the call raised: meta holds the pickled error
  kMicrobatchDone = 6,    // a microbatch's backward work is over (Note [Gradient order]); sticky
  kStepEnd = 7,           // the driver finished the step: meta holds the outputs; sticky
  kAbort = 8,             // the step failed somewhere: meta holds the pickled error
  kPlan = 9,              // the driver executes a plan this step: meta holds its path
  kPlanOff = 10,          // the step left its plan: the token goes by priority again
  kWeightsDone = 11,      // zero_bubble: a serving rank's deferred W are over (meta: its error)
};

// Matches any call id / any microbatch in recv().
constexpr int64_t kAny = -1;

// Which of several matching messages recv() returns (Note [Receive order]).
enum class RecvOrder : int32_t {
  kArrival = 0,        // the earliest
  kBackwardFirst = 1,  // backward kinds first, then the lowest microbatch ("interleaved")
  kForwardFirst = 2,   // forward kinds first, then the lowest microbatch ("simple")
};

struct Message {
  int src = -1;          // pp rank of the sender
  int64_t epoch = 0;     // the sender's step (set by send; see begin_step)
  int64_t mb = 0;        // microbatch (-1 for step-level messages)
  int64_t call_id = 0;   // unique per (sender, microbatch) call
  int32_t kind = 0;      // MsgKind
  std::string meta;      // opaque bytes (pickled structure, module name, error, ...)
  std::vector<at::Tensor> tensors;
  // The microbatch's random stream travelling with a call and its answer (opaque
  // bytes of task_rng.h; empty: none). Note [Microbatch random streams].
  std::string rng;
  // The sender's autocast state (autocast_state.h; 0: off), on requests: the owner runs
  // them under it (Note [Autocast travels]).
  int64_t autocast = 0;
};

// Where a message's tensors travel (Note [Payload transports]).
enum class PayloadTransport : int32_t {
  kTcp = 0,   // inside the message on the TCP mesh (CPU tensors only)
  kC10d = 1,  // every tensor by c10d send/recv on the payload group (Gloo: CPU, NCCL: CUDA)
  kAuto = 2,  // CPU tensors on the mesh, CUDA tensors by c10d send/recv
};

class P2PEngine {
 public:
  // Connects `rank` to the other `size` - 1 ranks of its group. Every rank of the group
  // calls this together with the same `prefix` (unique per engine: it names the store
  // keys the ranks publish their addresses under). `master_addr` picks the interface
  // others reach this rank on (the one routed toward it; env SMP_P2P_ADDR overrides).
  // `timeout_s` bounds the connection and every wait. Starts one receiver thread per
  // peer.
  P2PEngine(c10::intrusive_ptr<c10d::Store> store, const std::string& prefix, int rank, int size,
            double timeout_s, const std::string& master_addr = "127.0.0.1");
  ~P2PEngine();  // aborts pending receives and joins the receiver threads

  int rank() const;
  int size() const;
  double timeout_s() const;  // the bound of every wait

  // Note [Payload transports]: the header, the meta bytes and (by default) the tensors
  // of a message travel on the TCP mesh. With a payload group (the same ranks as this
  // engine's group, in the same order; a group of its own, so no collective shares its
  // tags), tensors can go by c10d send/recv instead: CUDA tensors never touch host
  // memory when the group is NCCL. The header still goes first on the mesh and tells
  // the receiver which tensors follow by c10d and on which device type; received CUDA
  // tensors are allocated on `device` (this rank's GPU). Call once, before any send,
  // on every rank of the group with the same `transport`.
  void set_payload_group(c10::intrusive_ptr<c10d::ProcessGroup> group,
                         PayloadTransport transport, const std::string& device = "cpu");

  // Sends `msg` to pp rank `dst` (blocking until the bytes are in the kernel's socket
  // buffer). Sending to oneself delivers into the own mailbox.
  void send(int dst, const Message& msg);

  // Blocks until a message with microbatch `mb` (kAny: any), call id `call_id`
  // (kAny: any) and a kind in `kind_mask` (bit 1 << kind) is in the mailbox, removes
  // and returns it. Step-level kinds (kStepEnd, kAbort, kPlanOff) match any `mb` and
  // stay (a kPlanOff too); an abort is
  // returned to every waiter, and so is the step's end (they stay until the next
  // begin_step()), and so is a microbatch's kMicrobatchDone. With `yield_token`, the caller's compute token (if this thread
  // holds it) is released while waiting and re-acquired with `priority` before
  // returning; a recv that throws returns without it. With `for_holder` as well, a
  // thread working for the token's holder (autograd's device thread running a node of
  // the task's backward while the task waits for it) yields the holder's token and
  // takes it back for the holder. `order` picks among several matching messages.
  // Throws TimeoutError naming `what`, or CommError if a peer's connection broke or its
  // engine closed.
  Message recv(int64_t mb, int64_t call_id, uint32_t kind_mask, const std::string& what,
               bool yield_token = false, int64_t priority = 0,
               RecvOrder order = RecvOrder::kArrival, bool for_holder = false);

  // Note [Compute token]: one task at a time computes on a rank. acquire() blocks until
  // the token is free and no waiting task has a smaller priority value (ties: first
  // come). Priorities encode the schedule (interleaved: backward work before new
  // forwards, earlier microbatches first).
  // release_token() gives the token back if the calling thread holds it, else does
  // nothing (a task whose yielding recv() failed does not hold it).
  void acquire_token(int64_t priority);
  void release_token();

  // Note [Planned token order]: with the order on, priorities are positions in this
  // rank's list of planned actions (Dispatcher, Note [Executed plan]) and the token
  // goes only to a waiter whose position is at most the next planned one: the action
  // next in the list waits for its turn even when a later one is ready, and granting
  // the next one moves the turn on. A smaller position is an action already begun
  // (a task taking the token back after a wait): it goes first. The order goes off
  // with order_token(false), at begin_step(), when a peer's connection fails, and when
  // a kAbort, kStepEnd or kPlanOff of the step arrives (before order_token(true) too:
  // it then stays off): a failed or changed step never waits for an action that will
  // not come.
  void order_token(bool on);
  bool token_ordered() const;
  // The priority the token's holder took it with (-1: not held).
  int64_t token_priority() const;
  // The position whose turn it is (-1: the order is off).
  int64_t next_planned() const;
  // The planned positions granted since the order last went on, in grant order.
  std::vector<int64_t> planned_grants() const;

  // Note [Leaving a plan under tp] (detail/compute_token.cpp). The driver arms it for
  // its step when tp > 1 (off: disarmed, and at begin_step(), a kAbort or a failure);
  // go_serial() turns it on when the step leaves its plan (so does a kPlanOff that
  // arrives); then the token goes only to tasks of microbatches <= the floor, which
  // the driver moves up as its microbatches end.
  void arm_serial(bool armed);
  // A serving rank under tp: a kPlanOff that arrives leaves the token's order on until
  // the serving leader takes it (order_token(false)), so the plan ends at the same
  // request on every tp rank.
  void defer_plan_off(bool on);
  void go_serial();
  void set_serial_floor(int64_t mb);
  bool serial_now() const;

  // The microbatch of the task holding the token (task.h), or -1 (none holds it, or a
  // thread with no task does).
  int64_t token_microbatch() const;

  // Note [Step epochs]: every message carries the sender's step number. A rank may
  // receive messages of the next step before it has finished the current one (the
  // driver runs ahead), so messages are matched only within the current epoch: later
  // ones wait in the mailbox, and begin_step(e) drops those of earlier steps (e.g. the
  // leftovers of an aborted step). Every rank of the group calls begin_step with the
  // same sequence of epochs.
  void begin_step(int64_t epoch);

  // Per-message timing counters (for the timeline and profiling).
  struct Stats {
    int64_t messages_sent = 0, messages_received = 0, bytes_sent = 0, bytes_received = 0;
    double wait_s = 0;
    double token_held_s = 0;  // time some task held the compute token
  };
  Stats stats() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace smp
