// The pipeline plan: what each pp rank runs in a step, in order, as a list of actions.
//
// A microbatch's forward visits the stages of its `path` in turn (hop h runs on pp rank
// path[h]; {0, 1, 0} is a model whose middle lives on pp rank 1 and whose head is back
// on the driver); its backward visits them in reverse. A Plan holds, per pp rank, the
// compute actions of a step in the order that rank runs them:
//   F  forward of (microbatch, hop)
//   B  backward of (microbatch, hop): input and weight gradients together
//   I  the input-gradient half of a backward (zero_bubble): what the previous hop waits for
//   W  the weight-gradient half (zero_bubble): nobody waits for it, so it fills the bubbles
// and lowered() adds the communication a compute action implies: a receive before it
// (RF: activations, RB: gradients), a send after it (SF, SB), and each rank's reduction
// of its gradient buckets (R) after its last backward work.
//
// Plans are compiled by list scheduling: time advances in units of work (`costs`), and
// whenever a rank is free it starts its ready action of highest rank under the kind's
// rule (Note [Plan rules]); interleaved and 1f1b keep the shortest of several rules'
// lists (Note [Plan search]). validate() runs any plan, compiled or written by hand, with
// processes modelled as cursors over the lists and says what is wrong: an action run
// twice, missing, on the wrong rank, before what it needs (a deadlock: every rank's
// next action waits on another's), more microbatches in flight than the window, or a
// window larger than the driver's threads; and in the whole lists a send without its
// receive, a communication before what it moves, or a receive whose wait deadlocks
// (Note [Plan validation]).
// format() prints the lists; timeline() the slots as a grid; both can mark the action
// that failed.
//
// This is the vocabulary of torch.distributed.pipelining's _Action (F, B, I, W, sends,
// receives) over smp's calls: a "stage" is a pp rank, and a path may visit it more than
// once.
//
// Thread-safety: a Plan is immutable after compile().
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace smp {

enum class PlanKind : int32_t {
  kSimple = 0,       // GPipe: every forward, then every backward
  kInterleaved = 1,  // SMP's: backward first, at most active_microbatches in flight
  k1F1B = 2,         // interleaved with the window that 1F1B keeps: one per hop of the path
  kZeroBubble = 3,   // 1F1B with each backward split into I and W; W fills bubbles (ZB-H1)
};

// "simple", "interleaved", "1f1b", "zero_bubble"; throws ConfigError naming the allowed.
PlanKind plan_kind_from_name(const std::string& name);
const char* plan_kind_name(PlanKind kind);

enum class Phase : int32_t { kForward = 0, kBackward = 1 };

// Note [Order without a list] (plan.cpp): a step that has no installed list (the first
// training step, whose calls are not known yet; one that left its plan; evaluation;
// config 'pipeline_order' "dynamic") is ordered by the same rule Plan::compile lists
// by (Note [Plan rules]), applied as the work becomes ready: the compute token goes to
// the waiting task with the smallest priority, a serving rank takes the pending request
// with the smallest first (Note [Receive order] in p2p.h), and the driver keeps at most
// driver_window() microbatches in flight. What such a step ran is recorded as its
// executed list (Dispatcher::executed_actions), in the plan's vocabulary.
// Lower runs first: the kind's class of the phase, then the earlier microbatch.
// zero_bubble without a list runs as 1f1b (its W needs a plan to be placed).
int64_t order_priority(PlanKind kind, int64_t mb, Phase phase);
// Whether backward waits for every microbatch's forward ("simple").
inline bool forwards_before_backwards(PlanKind kind) { return kind == PlanKind::kSimple; }
// Microbatches the driver keeps in flight, one task thread each: every one under
// "simple", active_microbatches under "interleaved", 1F1B's window under "1f1b" and
// "zero_bubble" (Note [1F1B's window]). A Plan's window() is at most this.
int64_t driver_window(PlanKind kind, int64_t microbatches, int64_t stages,
                      int64_t active_microbatches);
// 1F1B's window: pp ranks + 1 where there is a pipeline (Note [1F1B's window]).
int64_t one_f_one_b_window(int64_t stages, int64_t microbatches);

// A cell of a failed step to mark in its table: (pp rank, microbatch, phase).
struct FailedCell {
  int64_t stage = -1;
  int64_t mb = -1;
  Phase phase = Phase::kForward;
  bool weight = false;  // zero_bubble: the backward's W failed
};

enum class Op : int32_t {
  kForward = 0,
  kBackward = 1,
  kBackwardInput = 2,
  kBackwardWeight = 3,
  kSendForward = 4,
  kRecvForward = 5,
  kSendBackward = 6,
  kRecvBackward = 7,
  kReduce = 8,
};

struct Action {
  Op op = Op::kForward;
  int64_t mb = -1;   // -1 for kReduce
  int64_t hop = -1;  // the hop of the microbatch's path; -1 for kReduce
  int64_t peer = -1;  // sends and receives: the other pp rank
  bool operator==(const Action& o) const {
    return op == o.op && mb == o.mb && hop == o.hop && peer == o.peer;
  }
  // "F3", "B3", "I3", "W3", "RF3<0", "SF3>1", "R"; with ".h2" after the microbatch where
  // the path visits the rank more than once (so the hop is not implied by the rank).
  std::string str(bool with_hop = false) const;
};

// Relative durations of the compute actions (B = I + W; W >= 1 under zero_bubble, where
// it is an action of its own, else >= 0).
struct PlanCosts {
  int64_t forward = 1;
  int64_t input = 1;   // I
  int64_t weight = 1;  // W
};

struct PlanOptions {
  PlanKind kind = PlanKind::kInterleaved;
  int64_t microbatches = 1;
  int64_t stages = 1;               // pp ranks
  int64_t active_microbatches = 3;  // interleaved's window
  std::vector<int64_t> path;        // empty: 0, 1, ..., stages-1
  PlanCosts costs;
  // The runtime's constraints (Note [Executed plan] in
  // smp_core/detail/plan_execution.cpp), for a plan it executes. `gradient_order`: a
  // rank starts a microbatch's backward work only
  // once the previous microbatch's is over there (Note [Gradient order]: its gradients
  // wait for it anyway). `fused_last`: on the last hop's rank a microbatch's forward is
  // followed by its backward without a pause (loss.backward() in the step body), so
  // the forward waits as that backward would.
  bool gradient_order = false;
  bool fused_last = false;
  // Note [Last hop's gradients]: whether the last hop's backward accumulates gradients
  // on its rank (the step body's modules after the last remote call hold parameters).
  // With gradient_order, a last hop that accumulates none neither waits for the
  // previous microbatch's backward nor counts as backward work there: the loss of
  // microbatch k + 1 may come before microbatch k's backward through the driver's
  // first stage.
  bool last_hop_accumulates = true;
  // zero_bubble: the hops of this pp rank run B, not I and W (-1: every hop splits). At
  // run time the driver's (0): its backward is one autograd call through its modules and
  // the remote calls' nodes (Note [Split backward] in smp_core/detail/split_backward.h
  // splits a served call only). With gradient_order, only what accumulates (B, W)
  // waits for the previous microbatch's; I does not.
  int64_t unsplit_rank = -1;
  // Note [Plan search] (plan.cpp): interleaved and 1f1b keep the shortest of several
  // rules' lists; false: the kind's own rule alone.
  bool search = true;
  // The driver's task threads: each microbatch in flight there holds one (Note [Task
  // threads] in smp_core/detail/task_pool.h), so validate() refuses a window larger
  // than this. 0: not checked (a plan for printing only).
  int64_t threads = 0;
};

// A step's kind, microbatches, stages and interleaved's window, the rest default: what
// a Dispatcher orders its steps by (Note [Order without a list]).
PlanOptions step_options(PlanKind kind, int64_t microbatches, int64_t stages,
                         int64_t active_microbatches);

// The options of the plan the runtime executes (Note [Executed plan] in
// smp_core/detail/plan_execution.cpp) for a `path` of the driver's calls: unit costs
// and the runtime's constraints
// (gradient order; the loss fused with its backward, except under simple; the driver's
// hops unsplit under zero_bubble; Note [Last hop's gradients]).
PlanOptions executed_plan_options(PlanKind kind, int64_t microbatches, int64_t stages,
                                  int64_t active_microbatches, std::vector<int64_t> path,
                                  bool last_hop_accumulates);

class Plan {
 public:
  // Throws ConfigError naming the bad option, or std::logic_error if the kind's rule
  // deadlocks on this path (naming the waiting work).
  static Plan compile(PlanOptions options);
  // A plan given as lists (one per pp rank), e.g. written by hand or read back; not
  // validated until validate().
  static Plan from_lists(PlanOptions options, std::vector<std::vector<Action>> compute);
  // The same from whole lists (what lowered() returns: compute, sends, receives and
  // the reduction), which lowered() then returns as given and validate() checks as
  // written (Note [Plan validation] in plan_validate.cpp).
  static Plan from_actions(PlanOptions options, std::vector<std::vector<Action>> actions);

  const PlanOptions& options() const { return options_; }
  const std::vector<int64_t>& path() const { return path_; }
  // Per pp rank, the compute actions (F, B, I, W) in order.
  const std::vector<std::vector<Action>>& compute() const { return compute_; }
  // Per pp rank, every action: compute, sends, receives and the final reduction (as
  // given to from_actions(), else each compute action with the communication it
  // implies).
  std::vector<std::vector<Action>> lowered() const;
  // Microbatches the driver (path[0]) may hold in flight: forward begun, backward not
  // yet back at hop 0.
  int64_t window() const;

  // Throws std::logic_error saying what is wrong (see the file comment and Note [Plan
  // validation] in plan_validate.cpp).
  void validate() const;

  // Runs the lists with the costs, each rank in its order, each action when what it
  // needs is done: the slots every rank spends, per rank, and the bubble fraction
  // (idle slots over all slots up to the makespan). Throws std::logic_error on a
  // deadlock.
  struct Timing {
    int64_t makespan = 0;
    std::vector<int64_t> busy;  // per rank
    double bubble_fraction = 0;
    // timeline[rank][slot]: the action running, or op kReduce with mb -1 for idle.
    std::vector<std::vector<Action>> timeline;
  };
  Timing simulate() const;

  // One line per pp rank with its lowered actions ("pp 1 | RF0<0 F0 SF0>0 ..."); with
  // `failed`, the first compute action equal to it on `failed_rank` is shown as
  // "[F3]" and a line below says what failed.
  std::string format(const Action* failed = nullptr, int64_t failed_rank = -1) const;
  // The slots as a grid (compute only; "." idle), one row per pp rank.
  std::string timeline(const Action* failed = nullptr, int64_t failed_rank = -1) const;

 private:
  Plan(PlanOptions options, std::vector<int64_t> path, std::vector<std::vector<Action>> compute);
  // One list scheduling of `options` (Note [Plan rules]), with forwards first on the
  // ranks `forwards_first` marks (Note [Plan search]).
  static Plan schedule(const PlanOptions& options, const std::vector<bool>& forwards_first);
  bool hop_labels() const;  // some rank is visited more than once
  bool splits(int64_t hop) const;  // zero_bubble runs I and W at this hop
  std::vector<Op> hop_ops(int64_t hop) const;  // a microbatch's compute actions at `hop`

  // validate()'s checks of the whole lists (plan_validate.cpp).
  void validate_lowered() const;

  PlanOptions options_;
  std::vector<int64_t> path_;
  std::vector<std::vector<Action>> compute_;
  std::vector<std::vector<Action>> actions_;  // from_actions()'s lists; empty: derived
};

}  // namespace smp
