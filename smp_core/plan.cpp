#include "smp_core/plan.h"

#include <algorithm>
#include <limits>
#include <map>
#include <stdexcept>
#include <tuple>

#include "smp_core/detail/plan_rules.h"
#include "smp_core/errors.h"

namespace smp {
namespace {

using namespace detail::plan_rules;

const char* op_code(Op op) {
  switch (op) {
    case Op::kForward: return "F";
    case Op::kBackward: return "B";
    case Op::kBackwardInput: return "I";
    case Op::kBackwardWeight: return "W";
    case Op::kSendForward: return "SF";
    case Op::kRecvForward: return "RF";
    case Op::kSendBackward: return "SB";
    case Op::kRecvBackward: return "RB";
    case Op::kReduce: return "R";
  }
  return "?";
}

// Note [Last hop's gradients]: a last hop that holds no parameters is the step body's
// loss after the last remote call; it costs nothing in the plan's units.
int64_t cost_of(const Action& a, const PlanOptions& o, int64_t hops) {
  if (!o.last_hop_accumulates && a.hop == hops - 1) return 0;
  const PlanCosts& c = o.costs;
  switch (a.op) {
    case Op::kForward: return c.forward;
    case Op::kBackward: return c.input + c.weight;
    case Op::kBackwardInput: return c.input;
    case Op::kBackwardWeight: return c.weight;
    default: return 0;
  }
}

// Note [Plan rules] (order): a free rank starts its ready action with the smallest key.
// simple: forwards first; interleaved and 1f1b: backward first; zero_bubble: I first,
// then F, and W only when nothing else is ready. Then the earlier microbatch, then the
// later hop (deeper work first). With fused_last the last hop's forward goes before
// all: it is the loss and the start of the microbatch's backward, which the stage
// before it waits for (Note [Last hop's gradients]). `forwards_first`: interleaved and
// 1f1b with forwards first on this rank (Note [Plan search]).
// The rule's class of a compute action (smaller first), shared with the order without a
// list (order_priority).
int order_class(PlanKind kind, Op op, bool forwards_first = false) {
  switch (kind) {
    case PlanKind::kSimple: return op == Op::kForward ? 0 : 1;
    case PlanKind::kInterleaved:
    case PlanKind::k1F1B: return (op == Op::kForward) != forwards_first ? 1 : 0;
    case PlanKind::kZeroBubble:  // B (an unsplit hop) goes with I
      return is_backward_input(op) ? 0 : op == Op::kForward ? 1 : 2;
  }
  return 0;
}

std::tuple<int, int64_t, int64_t> rule_key(const PlanOptions& o, int64_t hops, const Action& a,
                                           bool forwards_first = false) {
  if (o.fused_last && a.op == Op::kForward && a.hop == hops - 1) return {-1, a.mb, -a.hop};
  return {order_class(o.kind, a.op, forwards_first), a.mb, -a.hop};
}

void check_options(const PlanOptions& o) {
  if (o.microbatches < 1)
    throw ConfigError(str_cat("smp: plan 'microbatches'=", o.microbatches,
                              " is not an integer >= 1"));
  if (o.stages < 1)
    throw ConfigError(str_cat("smp: plan 'partitions'=", o.stages, " is not an integer >= 1"));
  if (o.active_microbatches < 1)
    throw ConfigError(str_cat("smp: plan 'active_microbatches'=", o.active_microbatches,
                              " is not an integer >= 1"));
  if (o.unsplit_rank < -1 || o.unsplit_rank >= o.stages)
    throw ConfigError(str_cat("smp: plan 'unsplit_rank'=", o.unsplit_rank,
                              " is not -1 or a pp rank 0 .. ", o.stages - 1));
  // W may cost nothing where it is no action of its own (B = I + W).
  const int64_t min_weight = o.kind == PlanKind::kZeroBubble ? 1 : 0;
  if (o.costs.forward < 1 || o.costs.input < 1 || o.costs.weight < min_weight)
    throw ConfigError(str_cat("smp: plan costs (forward ", o.costs.forward, ", input ",
                              o.costs.input, ", weight ", o.costs.weight, ") must be integers >= 1",
                              min_weight ? "" : " (weight >= 0)"));
}

std::vector<int64_t> resolve_path(const PlanOptions& o) {
  std::vector<int64_t> path = o.path;
  if (path.empty())
    for (int64_t s = 0; s < o.stages; ++s) path.push_back(s);
  for (size_t h = 0; h < path.size(); ++h) {
    if (path[h] < 0 || path[h] >= o.stages)
      throw ConfigError(str_cat("smp: plan path visits pp rank ", path[h], " at hop ", h,
                                "; allowed: 0 .. ", o.stages - 1));
    if (h > 0 && path[h] == path[h - 1])
      throw ConfigError(str_cat("smp: plan path visits pp rank ", path[h],
                                " twice in a row (hops ", h - 1, " and ", h,
                                "): a call to one's own rank is no hop"));
  }
  return path;
}

}  // namespace

PlanKind plan_kind_from_name(const std::string& name) {
  for (PlanKind k : {PlanKind::kSimple, PlanKind::kInterleaved, PlanKind::k1F1B,
                     PlanKind::kZeroBubble})
    if (name == plan_kind_name(k)) return k;
  throw ConfigError(str_cat("smp: config 'pipeline'='", name,
                            "' is not one of {interleaved, simple, 1f1b, zero_bubble}"));
}

const char* plan_kind_name(PlanKind kind) {
  switch (kind) {
    case PlanKind::kSimple: return "simple";
    case PlanKind::kInterleaved: return "interleaved";
    case PlanKind::k1F1B: return "1f1b";
    case PlanKind::kZeroBubble: return "zero_bubble";
  }
  return "?";
}

// Note [Order without a list]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A Plan is compiled from the path a training step's calls took, so the first training
// step, whose calls are not known until they are made, has no list; neither has a step
// that left its plan (Note [Leaving the plan] in detail/plan_execution.cpp), an
// evaluation step, or any step under config 'pipeline_order' "dynamic". Such a step is
// ordered by the rule lists are compiled by (Note [Plan rules]), applied to the work as
// it becomes ready rather than to a model of it: the same class of phase first
// (order_class), then the earlier microbatch. There is no second schedule to keep in
// step with the plans: order_priority() is order_class() with the microbatch, and the
// driver's window is the one executed_plan_options() gives the driver's threads. The
// list such a step runs is recorded (Dispatcher::executed_actions), so its timeline and
// its failure table show what ran, as a planned step's do. The results are the same
// either way (Note [Gradient order], Note [Microbatch random streams]).
int64_t order_priority(PlanKind kind, int64_t mb, Phase phase) {
  // Larger than any microbatch count: the class decides first, the microbatch second.
  constexpr int64_t kClassStride = int64_t{1} << 40;
  const Op op = phase == Phase::kForward ? Op::kForward : Op::kBackward;
  return order_class(kind, op) * kClassStride + mb;
}

// Note [1F1B's window]
// ~~~~~~~~~~~~~~~~~~~~
// 1F1B keeps one microbatch in flight per stage a microbatch visits, so a stage always
// has the next forward to run while the one before waits for its backward. Under smp a
// microbatch's forward comes back to the driver: the step body runs there and computes
// the loss from the last stage's output. So its path is one hop longer than the pp
// ranks (0, 1, ..., S-1, 0), and the window is S + 1, not S: with S, the driver sat
// idle every microbatch while the last stage ran the input half of the backward it had
// just asked for (its next forward was not admitted until the previous microbatch's
// backward was back). Measured on bench/pipeline.py (pp=2, 8 microbatches, 2 cores):
// 1f1b dynamic 65.8-70.8 -> 62.8-65.0 ms, zero_bubble 58.4-61.4 -> 57.3-59.2 ms. The
// cost is one more microbatch's activations held on the driver. A plan (Plan::window())
// takes the same from its recorded path: one microbatch per hop, at most S + 1 (the
// driver's task threads; a path that visits ranks more than once, 0, 1, 0, 1, 0, keeps
// S + 1).
int64_t one_f_one_b_window(int64_t stages, int64_t microbatches) {
  return std::min(stages + (stages > 1 ? 1 : 0), microbatches);
}

int64_t driver_window(PlanKind kind, int64_t microbatches, int64_t stages,
                      int64_t active_microbatches) {
  switch (kind) {
    case PlanKind::kSimple: return microbatches;
    case PlanKind::kInterleaved: return std::min(active_microbatches, microbatches);
    case PlanKind::k1F1B:
    case PlanKind::kZeroBubble: return one_f_one_b_window(stages, microbatches);
  }
  return microbatches;
}

std::string Action::str(bool with_hop) const {
  if (op == Op::kReduce) return "R";
  std::string s = str_cat(op_code(op), mb);
  if (with_hop) s += str_cat(".h", hop);
  if (op == Op::kSendForward || op == Op::kSendBackward) s += str_cat(">", peer);
  if (op == Op::kRecvForward || op == Op::kRecvBackward) s += str_cat("<", peer);
  return s;
}

Plan::Plan(PlanOptions options, std::vector<int64_t> path,
           std::vector<std::vector<Action>> compute)
    : options_(std::move(options)), path_(std::move(path)), compute_(std::move(compute)) {}

PlanOptions step_options(PlanKind kind, int64_t microbatches, int64_t stages,
                         int64_t active_microbatches) {
  PlanOptions o;
  o.kind = kind;
  o.microbatches = microbatches;
  o.stages = stages;
  o.active_microbatches = active_microbatches;
  return o;
}

PlanOptions executed_plan_options(PlanKind kind, int64_t microbatches, int64_t stages,
                                  int64_t active_microbatches, std::vector<int64_t> path,
                                  bool last_hop_accumulates) {
  PlanOptions o = step_options(kind, microbatches, stages, active_microbatches);
  o.path = std::move(path);
  o.gradient_order = true;
  o.fused_last = kind != PlanKind::kSimple;
  o.last_hop_accumulates = last_hop_accumulates;
  if (kind == PlanKind::kZeroBubble) o.unsplit_rank = 0;  // the driver's hops run whole
  // The task threads Dispatcher::drive starts: one per microbatch of the driver's window.
  o.threads = driver_window(kind, microbatches, stages, active_microbatches);
  return o;
}

Plan Plan::from_lists(PlanOptions options, std::vector<std::vector<Action>> compute) {
  check_options(options);
  auto path = resolve_path(options);
  if (static_cast<int64_t>(compute.size()) != options.stages)
    throw ConfigError(str_cat("smp: a plan needs one list per pp rank: got ", compute.size(),
                              " for ", options.stages));
  return Plan(std::move(options), std::move(path), std::move(compute));
}

Plan Plan::from_actions(PlanOptions options, std::vector<std::vector<Action>> actions) {
  std::vector<std::vector<Action>> compute(actions.size());
  for (size_t r = 0; r < actions.size(); ++r)
    for (const Action& a : actions[r])
      if (is_compute(a.op)) compute[r].push_back(a);
  Plan plan = from_lists(std::move(options), std::move(compute));
  plan.actions_ = std::move(actions);
  return plan;
}

int64_t Plan::window() const {
  const auto& o = options_;
  switch (o.kind) {
    case PlanKind::kSimple: return o.microbatches;
    case PlanKind::kInterleaved: return std::min(o.active_microbatches, o.microbatches);
    case PlanKind::k1F1B:
    case PlanKind::kZeroBubble:  // Note [1F1B's window]: one per hop, at most the
      // driver's task threads
      return std::min(static_cast<int64_t>(path_.size()),
                      one_f_one_b_window(o.stages, o.microbatches));
  }
  return o.microbatches;
}

bool Plan::splits(int64_t hop) const {
  return options_.kind == PlanKind::kZeroBubble && path_[hop] != options_.unsplit_rank;
}

std::vector<Op> Plan::hop_ops(int64_t hop) const {
  if (splits(hop)) return {Op::kForward, Op::kBackwardInput, Op::kBackwardWeight};
  return {Op::kForward, Op::kBackward};
}

bool Plan::hop_labels() const {
  std::vector<int> visits(options_.stages, 0);
  for (int64_t r : path_)
    if (++visits[r] > 1) return true;
  return false;
}

// Note [Plan search]
// ~~~~~~~~~~~~~~~~~~
// List scheduling with one fixed rule is greedy: a rank that runs a ready backward
// before a ready forward can leave the next rank without work a moment later. At pp=2,
// 8 microbatches, on the path 0, 1, 0 of a loss on the driver, 1f1b's rule gave 29
// slots where an exhaustive search of every order within 1F1B's window finds 27 (the
// ceiling: each rank's 24 slots of work plus one microbatch's fill and drain).
// interleaved and 1f1b promise a window (memory), not the order within it, so
// compile() also schedules them with forwards first on some ranks (every subset of
// ranks up to 6 pp ranks; each rank alone and all of them beyond) and keeps the list
// of the fewest slots under the plan's costs, the kind's own rule on a tie. The search
// is deterministic: every rank compiles the same plan. simple (forwards first by
// definition) and zero_bubble (whose W fills the bubbles) keep their one rule.
Plan Plan::compile(PlanOptions options) {
  check_options(options);
  Plan best = schedule(options, {});
  if (!options.search ||
      (options.kind != PlanKind::kInterleaved && options.kind != PlanKind::k1F1B))
    return best;
  const int64_t ranks = options.stages;
  std::vector<std::vector<bool>> masks;
  if (ranks <= 6) {
    for (int64_t bits = 1; bits < (int64_t{1} << ranks); ++bits) {
      masks.emplace_back(ranks);
      for (int64_t r = 0; r < ranks; ++r) masks.back()[r] = (bits >> r) & 1;
    }
  } else {
    for (int64_t r = 0; r < ranks; ++r) {
      masks.emplace_back(ranks, false);
      masks.back()[r] = true;
    }
    masks.emplace_back(ranks, true);
  }
  int64_t best_slots = best.simulate().makespan;
  for (const auto& mask : masks) {
    try {
      Plan p = schedule(options, mask);
      const int64_t slots = p.simulate().makespan;
      if (slots < best_slots) {
        best = std::move(p);
        best_slots = slots;
      }
    } catch (const std::logic_error&) {  // this rule deadlocks on the path: not a candidate
    }
  }
  return best;
}

// Note [Plan rules]: list scheduling. Time runs in cost units; whenever a rank is
// free it starts, of its actions whose dependencies are done, the one with the
// smallest rule key. The driver starts microbatches in order and only while fewer
// than window() are in flight (a microbatch leaves when its backward is back at hop 0).
// `forwards_first`: per rank, empty for none (Note [Plan search]).
Plan Plan::schedule(const PlanOptions& options, const std::vector<bool>& forwards_first) {
  const auto path = resolve_path(options);
  const int64_t m = options.microbatches, hops = static_cast<int64_t>(path.size());
  const int64_t ranks = options.stages;
  const bool simple = options.kind == PlanKind::kSimple;
  Plan plan(options, path, std::vector<std::vector<Action>>(ranks));
  const int64_t window = plan.window();

  // Every compute action not yet started, per rank.
  std::vector<std::vector<Action>> pending(ranks);
  for (int64_t mb = 0; mb < m; ++mb)
    for (int64_t h = 0; h < hops; ++h)
      for (Op op : plan.hop_ops(h)) pending[path[h]].push_back({op, mb, h});
  // 1F1B's bound: hop h holds at most hops - h microbatches (pp rank s of a linear
  // path: S - s), so a rank runs a backward before it takes more forwards.
  const bool bounded = options.kind == PlanKind::k1F1B || options.kind == PlanKind::kZeroBubble;
  std::vector<int64_t> held(hops, 0);  // per hop: forward begun, backward not done
  Done done(m, hops);
  // options.gradient_order: per rank and microbatch, accumulating actions (B, W) not
  // yet started and when the last started one finishes (kNever until all started).
  // Note [Last hop's gradients]: the last hop's B accumulates only where it holds
  // parameters.
  auto accumulating = [&](const Action& a) {
    return accumulates(a.op) && (a.hop != hops - 1 || options.last_hop_accumulates);
  };
  std::vector<std::vector<int64_t>> backward_left(ranks, std::vector<int64_t>(m, 0));
  std::vector<std::vector<int64_t>> backward_over(ranks, std::vector<int64_t>(m, kNever));
  for (int64_t r = 0; r < ranks; ++r)
    for (const Action& a : pending[r])
      if (accumulating(a)) ++backward_left[r][a.mb];
  for (int64_t r = 0; r < ranks; ++r)  // no accumulation of the microbatch here: none to wait for
    for (int64_t mb = 0; mb < m; ++mb)
      if (backward_left[r][mb] == 0) backward_over[r][mb] = 0;
  auto waits_for_previous = [&](int64_t r, const Action& a, int64_t now) {
    if (!options.gradient_order || a.mb == 0) return false;
    const bool fused = options.fused_last && a.op == Op::kForward && a.hop == hops - 1;
    if (fused ? !options.last_hop_accumulates : !accumulating(a)) return false;
    return backward_over[r][a.mb - 1] > now;
  };
  std::vector<int64_t> busy_until(ranks, 0);
  std::vector<std::pair<int64_t, Action>> running;  // (finish, action)
  int64_t started = 0, left = 0, t = 0;
  for (const auto& p : pending) left += static_cast<int64_t>(p.size());

  while (left > 0) {
    done.finish_due(running, t, hops);
    int64_t back = 0;  // microbatches whose backward is back at hop 0
    for (int64_t mb = 0; mb < m; ++mb) back += done.b[mb][0] <= t;
    bool started_any = false;
    for (int64_t r = 0; r < ranks; ++r) {
      if (busy_until[r] > t) continue;
      auto best = pending[r].end();
      for (auto it = pending[r].begin(); it != pending[r].end(); ++it) {
        if (ready_at(*it, done, hops, simple) > t) continue;
        if (waits_for_previous(r, *it, t)) continue;
        if (it->op == Op::kForward && it->hop == 0 &&
            (it->mb != started || started - back >= window))
          continue;
        if (bounded && it->op == Op::kForward && held[it->hop] >= hops - it->hop) continue;
        const bool ff = !forwards_first.empty() && forwards_first[r];
        if (best == pending[r].end() ||
            rule_key(options, hops, *it, ff) < rule_key(options, hops, *best, ff))
          best = it;
      }
      if (best == pending[r].end()) continue;
      const Action a = *best;
      pending[r].erase(best);
      --left;
      if (a.op == Op::kForward && a.hop == 0) ++started;
      if (a.op == Op::kForward) ++held[a.hop];
      if (is_backward_input(a.op)) --held[a.hop];  // its activations are free once I runs
      plan.compute_[r].push_back(a);
      busy_until[r] = t + cost_of(a, options, hops);
      if (accumulating(a) && --backward_left[r][a.mb] == 0) backward_over[r][a.mb] = busy_until[r];
      running.emplace_back(busy_until[r], a);
      started_any = true;
    }
    if (running.empty() && !started_any && left > 0) {
      std::string waiting;
      for (int64_t r = 0; r < ranks; ++r)
        for (const auto& a : pending[r])
          waiting += str_cat(waiting.empty() ? "" : ", ", a.str(true), " on pp rank ", r);
      throw std::logic_error(str_cat("smp: plan ", plan_kind_name(options.kind),
                                     " deadlocks: no pp rank can run; waiting: ", waiting));
    }
    int64_t next = kNever;
    for (const auto& [finish, a] : running) next = std::min(next, finish);
    t = next == kNever ? t + 1 : next;
  }
  return plan;
}

std::vector<std::vector<Action>> Plan::lowered() const {
  if (!actions_.empty()) return actions_;
  const int64_t hops = static_cast<int64_t>(path_.size());
  std::vector<std::vector<Action>> out(compute_.size());
  for (size_t r = 0; r < compute_.size(); ++r) {
    const auto rank = static_cast<int64_t>(r);
    auto& list = out[r];
    for (const Action& a : compute_[r]) {
      if (a.op == Op::kForward && a.hop > 0 && path_[a.hop - 1] != rank)
        list.push_back({Op::kRecvForward, a.mb, a.hop, path_[a.hop - 1]});
      if (is_backward_input(a.op) && a.hop < hops - 1 && path_[a.hop + 1] != rank)
        list.push_back({Op::kRecvBackward, a.mb, a.hop, path_[a.hop + 1]});
      list.push_back(a);
      if (a.op == Op::kForward && a.hop < hops - 1 && path_[a.hop + 1] != rank)
        list.push_back({Op::kSendForward, a.mb, a.hop, path_[a.hop + 1]});
      if (is_backward_input(a.op) && a.hop > 0 && path_[a.hop - 1] != rank)
        list.push_back({Op::kSendBackward, a.mb, a.hop, path_[a.hop - 1]});
    }
    list.push_back({Op::kReduce, -1, -1, -1});
  }
  return out;
}

Plan::Timing Plan::simulate() const {
  const int64_t m = options_.microbatches, hops = static_cast<int64_t>(path_.size());
  const int64_t ranks = options_.stages;
  const bool simple = options_.kind == PlanKind::kSimple;
  Done done(m, hops);
  std::vector<size_t> cursor(ranks, 0);
  std::vector<int64_t> busy_until(ranks, 0);
  std::vector<std::pair<int64_t, Action>> running;
  Timing timing;
  timing.busy.assign(ranks, 0);
  timing.timeline.assign(ranks, {});
  const Action idle{Op::kReduce, -1, -1, -1};
  int64_t t = 0;
  auto all_done = [&] {
    for (int64_t r = 0; r < ranks; ++r)
      if (cursor[r] < compute_[r].size()) return false;
    return running.empty();
  };
  while (!all_done()) {
    done.finish_due(running, t, hops);
    if (all_done()) break;
    bool started_any = false;
    for (int64_t r = 0; r < ranks; ++r) {
      if (busy_until[r] > t || cursor[r] >= compute_[r].size()) continue;
      const Action& a = compute_[r][cursor[r]];
      if (ready_at(a, done, hops, simple) > t) continue;
      const int64_t c = cost_of(a, options_, hops);
      ++cursor[r];
      busy_until[r] = t + c;
      timing.busy[r] += c;
      running.emplace_back(t + c, a);
      auto& row = timing.timeline[r];
      row.resize(static_cast<size_t>(t), idle);
      row.insert(row.end(), static_cast<size_t>(c), a);
      started_any = true;
    }
    if (running.empty() && !started_any) {
      std::string heads;
      for (int64_t r = 0; r < ranks; ++r) {
        if (cursor[r] >= compute_[r].size()) continue;
        const Action& a = compute_[r][cursor[r]];
        heads += str_cat(heads.empty() ? "" : "; ", "pp rank ", r, " at ", a.str(true),
                         " waits for ", awaited(a, done, hops, simple));
      }
      throw std::logic_error(str_cat("smp: plan deadlocks: ", heads));
    }
    int64_t next = kNever;
    for (const auto& [finish, a] : running) next = std::min(next, finish);
    if (next != kNever) t = next;
  }
  for (const auto& b : busy_until) timing.makespan = std::max(timing.makespan, b);
  int64_t busy = 0;
  for (int64_t r = 0; r < ranks; ++r) {
    busy += timing.busy[r];
    timing.timeline[r].resize(static_cast<size_t>(timing.makespan), idle);
  }
  if (timing.makespan > 0)
    timing.bubble_fraction =
        1.0 - static_cast<double>(busy) / static_cast<double>(timing.makespan * ranks);
  return timing;
}

namespace {

std::string marked(const std::string& cell, bool mark) { return mark ? "[" + cell + "]" : cell; }

std::string failure_line(const Action* failed, int64_t rank, bool found) {
  if (!failed) return "";
  return str_cat("failed: pp rank ", rank, ", ", failed->str(true),
                 found ? "" : " (not in this plan)", "\n");
}

}  // namespace

std::string Plan::format(const Action* failed, int64_t failed_rank) const {
  const bool hop = hop_labels();
  std::string out = str_cat("plan ", plan_kind_name(options_.kind), ", ", options_.microbatches,
                            " microbatches, ", options_.stages, " pp ranks, window ", window(),
                            "\n");
  bool found = false;
  const auto lists = lowered();
  for (size_t r = 0; r < lists.size(); ++r) {
    std::string line = str_cat("pp ", r, " |");
    for (const Action& a : lists[r]) {
      const bool mark = failed && !found && static_cast<int64_t>(r) == failed_rank &&
                        is_compute(a.op) && a == *failed;
      found = found || mark;
      line += " " + marked(a.str(hop && a.op != Op::kReduce), mark);
    }
    out += line + "\n";
  }
  return out + failure_line(failed, failed_rank, found);
}

std::string Plan::timeline(const Action* failed, int64_t failed_rank) const {
  const bool hop = hop_labels();
  const Timing timing = simulate();
  size_t width = 1;
  for (const auto& row : timing.timeline)
    for (const auto& a : row) width = std::max(width, a.mb < 0 ? 1 : a.str(hop).size());
  width += 2;  // room for the failure mark
  std::string out = str_cat("plan ", plan_kind_name(options_.kind), ", ", options_.microbatches,
                            " microbatches, ", options_.stages, " pp ranks: ", timing.makespan,
                            " slots, bubble ", static_cast<int>(timing.bubble_fraction * 100 + 0.5),
                            "% (time runs left to right)\n");
  bool found = false;
  for (size_t r = 0; r < timing.timeline.size(); ++r) {
    std::string line = str_cat("pp ", r, " |");
    const Action* prev = nullptr;
    for (const auto& a : timing.timeline[r]) {
      std::string c = a.mb < 0 ? "." : a.str(hop);
      // Mark the failing action's first slot only.
      const bool mark = failed && !found && a.mb >= 0 && static_cast<int64_t>(r) == failed_rank &&
                        a == *failed && !(prev && *prev == a);
      found = found || mark;
      c = marked(c, mark);
      line += " " + c + std::string(width - c.size(), ' ');
      prev = &a;
    }
    while (!line.empty() && line.back() == ' ') line.pop_back();
    out += line + "\n";
  }
  return out + failure_line(failed, failed_rank, found);
}

}  // namespace smp
