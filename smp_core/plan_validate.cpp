// Plan::validate: whether a plan, compiled or written by hand, can run as written.
//
// Note [Plan validation]
// ~~~~~~~~~~~~~~~~~~~~~~
// The runtime walks a plan's lists as printed (Note [Executed plan]), so a list that
// cannot run must be refused when it is installed, with the plan's text, rather than
// found out as a hang. validate() checks, in order:
//  - the compute actions: each (microbatch, hop) runs F and B, or F, I and W under
//    zero_bubble, once, on the rank its hop runs on;
//  - the window: the driver starts microbatches in order, holds at most window() in
//    flight, and window() fits the driver's task threads (PlanOptions::threads: each
//    microbatch in flight holds one, so a larger window waits forever for a thread);
//  - the whole lists (lowered(): as given to from_actions(), else derived): every send
//    has its receive on the peer and every receive its send; every hop that changes
//    rank has both, for the activations and for the gradients; a send comes after the
//    compute action whose output it moves and a receive before the one that needs it;
//    one reduction (R) ends each list;
//  - the order across ranks: the lists are walked with each rank's receive blocking
//    until the peer's send has run and each compute action until the work it depends
//    on is done (Note [Plan rules]); a plan where no rank can move is a deadlock, named
//    by each rank's next action and what it waits for;
//  - the timing model (simulate()) on the compute lists alone.
// Each refusal is a std::logic_error naming the action, its rank and what is wrong.
//
// Thread-safety: const members of an immutable Plan.
#include <map>
#include <set>
#include <stdexcept>
#include <tuple>

#include "smp_core/detail/plan_rules.h"
#include "smp_core/errors.h"
#include "smp_core/plan.h"

namespace smp {
namespace {

using namespace detail::plan_rules;

bool is_send(Op op) { return op == Op::kSendForward || op == Op::kSendBackward; }
bool is_recv(Op op) { return op == Op::kRecvForward || op == Op::kRecvBackward; }

// The action on the peer that meets communication `a` of pp rank `rank`: a send's
// receive, a receive's send.
Action partner(const Action& a, int64_t rank) {
  switch (a.op) {
    case Op::kSendForward: return {Op::kRecvForward, a.mb, a.hop + 1, rank};
    case Op::kRecvForward: return {Op::kSendForward, a.mb, a.hop - 1, rank};
    case Op::kSendBackward: return {Op::kRecvBackward, a.mb, a.hop - 1, rank};
    case Op::kRecvBackward: return {Op::kSendBackward, a.mb, a.hop + 1, rank};
    default: return a;
  }
}

// The hop on the other side of communication `a`, and the compute op at `a`'s own hop
// that it follows (a send) or feeds (a receive).
int64_t other_hop(const Action& a) {
  return a.op == Op::kSendForward || a.op == Op::kRecvBackward ? a.hop + 1 : a.hop - 1;
}
bool moves_forward(Op op) { return op == Op::kSendForward || op == Op::kRecvForward; }

using Key = std::tuple<int, int64_t, int64_t, int64_t>;  // op, mb, hop, peer
Key key_of(const Action& a) { return {static_cast<int>(a.op), a.mb, a.hop, a.peer}; }

}  // namespace

void Plan::validate() const {
  const int64_t m = options_.microbatches, hops = static_cast<int64_t>(path_.size());
  // Each action once, on the rank its hop runs on.
  std::map<std::tuple<int, int64_t, int64_t>, int> seen;
  for (size_t r = 0; r < compute_.size(); ++r)
    for (const Action& a : compute_[r]) {
      if (!is_compute(a.op))
        throw std::logic_error(str_cat("smp: plan: ", a.str(), " on pp rank ", r,
                                       " is no compute action (lists hold F, B, I, W)"));
      if (a.mb < 0 || a.mb >= m || a.hop < 0 || a.hop >= hops)
        throw std::logic_error(str_cat("smp: plan: ", a.str(true), " on pp rank ", r,
                                       " is outside the step (", m, " microbatches, ", hops,
                                       " hops)"));
      const bool split = splits(a.hop);
      if (split ? a.op == Op::kBackward
                : a.op == Op::kBackwardInput || a.op == Op::kBackwardWeight)
        throw std::logic_error(str_cat("smp: plan: ", a.str(true), " on pp rank ", r, ": ",
                                       plan_kind_name(options_.kind), " runs ",
                                       split ? "I and W, not B" : "B, not I and W",
                                       options_.kind == PlanKind::kZeroBubble
                                           ? str_cat(" at hop ", a.hop, " (unsplit_rank ",
                                                     options_.unsplit_rank, ")")
                                           : std::string()));
      if (path_[a.hop] != static_cast<int64_t>(r))
        throw std::logic_error(str_cat("smp: plan: ", a.str(true), " is on pp rank ", r,
                                       " but hop ", a.hop, " runs on pp rank ", path_[a.hop]));
      if (++seen[{static_cast<int>(a.op), a.mb, a.hop}] > 1)
        throw std::logic_error(str_cat("smp: plan: ", a.str(true), " runs twice on pp rank ", r));
    }
  for (int64_t mb = 0; mb < m; ++mb)
    for (int64_t h = 0; h < hops; ++h)
      for (Op op : hop_ops(h))
        if (!seen.count({static_cast<int>(op), mb, h}))
          throw std::logic_error(str_cat("smp: plan: ", Action{op, mb, h}.str(true),
                                         " is missing on pp rank ", path_[h]));
  // The driver starts microbatches in order, at most window() in flight, and each of
  // them holds one of its task threads.
  if (options_.threads > 0 && window() > options_.threads)
    throw std::logic_error(str_cat("smp: plan: the window is ", window(),
                                   " microbatches but the driver (pp rank ", path_[0], ") has ",
                                   options_.threads,
                                   " task threads; each microbatch in flight holds one"));
  const auto& driver = compute_[path_[0]];
  int64_t next = 0, in_flight = 0;
  for (const Action& a : driver) {
    if (a.op == Op::kForward && a.hop == 0) {
      if (a.mb != next)
        throw std::logic_error(str_cat("smp: plan: the driver (pp rank ", path_[0], ") starts ",
                                       a.str(), " before F", next,
                                       ": microbatches start in order"));
      ++next;
      if (++in_flight > window())
        throw std::logic_error(str_cat("smp: plan: ", in_flight, " microbatches in flight at ",
                                       a.str(), " on the driver (pp rank ", path_[0],
                                       "); the window is ", window()));
    }
    if (is_backward_input(a.op) && a.hop == 0) --in_flight;
  }
  simulate();  // throws on a deadlock, naming each rank's next action and its wait
  validate_lowered();
}

void Plan::validate_lowered() const {
  const auto lists = lowered();
  const int64_t m = options_.microbatches, hops = static_cast<int64_t>(path_.size());
  const int64_t ranks = options_.stages;
  const bool hop_label = hop_labels();
  auto name = [&](const Action& a) { return a.str(hop_label && a.op != Op::kReduce); };
  if (static_cast<int64_t>(lists.size()) != ranks)
    throw std::logic_error(str_cat("smp: plan: ", lists.size(), " lists for ", ranks,
                                   " pp ranks"));
  // Each rank's actions by key, with their positions.
  std::vector<std::map<Key, size_t>> at(ranks);
  for (int64_t r = 0; r < ranks; ++r) {
    const auto& list = lists[r];
    size_t reductions = 0;
    for (size_t i = 0; i < list.size(); ++i) {
      const Action& a = list[i];
      if (a.op == Op::kReduce) {
        if (++reductions > 1 || i + 1 != list.size())
          throw std::logic_error(str_cat("smp: plan: pp rank ", r, "'s reduction R is not its ",
                                         "last action, once"));
        continue;
      }
      if (!is_compute(a.op)) {
        const int64_t there = other_hop(a);
        if (a.mb < 0 || a.mb >= m || a.hop < 0 || a.hop >= hops || there < 0 || there >= hops ||
            path_[a.hop] != r || path_[there] != a.peer || a.peer == r)
          throw std::logic_error(str_cat(
              "smp: plan: ", name(a), " on pp rank ", r, " is no communication of this path (",
              hops, " hops: ", a.hop >= 0 && a.hop < hops
                                    ? str_cat("hop ", a.hop, " runs on pp rank ", path_[a.hop])
                                    : str_cat("no hop ", a.hop),
              there >= 0 && there < hops
                  ? str_cat(", hop ", there, " on pp rank ", path_[there])
                  : std::string(), ")"));
      }
      if (!at[r].emplace(key_of(a), i).second)
        throw std::logic_error(str_cat("smp: plan: ", name(a), " runs twice on pp rank ", r));
    }
    if (reductions == 0)
      throw std::logic_error(str_cat("smp: plan: pp rank ", r, "'s list has no reduction R"));
  }
  // Every send meets its receive, and each sits on the right side of its compute.
  auto compute_at = [&](const Action& comm) {
    if (moves_forward(comm.op)) return Action{Op::kForward, comm.mb, comm.hop};
    return Action{splits(comm.hop) ? Op::kBackwardInput : Op::kBackward, comm.mb, comm.hop};
  };
  for (int64_t r = 0; r < ranks; ++r)
    for (const auto& [key, i] : at[r]) {
      const Action& a = lists[r][i];
      if (is_compute(a.op)) continue;
      const Action meet = partner(a, r);
      if (!at[a.peer].count(key_of(meet)))
        throw std::logic_error(str_cat("smp: plan: ", name(a), " on pp rank ", r, " has no ",
                                       is_send(a.op) ? "receive" : "send", ": pp rank ", a.peer,
                                       "'s list has no ", name(meet)));
      const Action c = compute_at(a);
      const size_t ci = at[r].at(key_of(c));
      if (is_send(a.op) && i < ci)
        throw std::logic_error(str_cat("smp: plan: ", name(a), " on pp rank ", r,
                                       " comes before ", name(c), ", whose output it sends"));
      if (is_recv(a.op) && i > ci)
        throw std::logic_error(str_cat("smp: plan: ", name(a), " on pp rank ", r,
                                       " comes after ", name(c), ", which needs it"));
    }
  for (int64_t mb = 0; mb < m; ++mb)
    for (int64_t h = 1; h < hops; ++h) {
      if (path_[h] == path_[h - 1]) continue;
      for (const Action need : {Action{Op::kRecvForward, mb, h, path_[h - 1]},
                                Action{Op::kRecvBackward, mb, h - 1, path_[h]}}) {
        const int64_t r = path_[need.hop];
        if (!at[r].count(key_of(need)))
          throw std::logic_error(str_cat("smp: plan: ", name(need), " is missing on pp rank ", r,
                                         ": ", name(compute_at(need)), " receives nothing"));
      }
    }
  // Walk the lists: a receive waits for its send, a compute action for its
  // dependencies (Note [Plan rules]).
  const bool simple = options_.kind == PlanKind::kSimple;
  Done done(m, hops);
  std::set<Key> sent;  // keys of the receives whose send has run
  std::vector<size_t> cursor(ranks, 0);
  for (bool moved = true; moved;) {
    moved = false;
    for (int64_t r = 0; r < ranks; ++r)
      for (; cursor[r] < lists[r].size(); ++cursor[r]) {
        const Action& a = lists[r][cursor[r]];
        if (is_recv(a.op) ? !sent.count(key_of(a))
                          : is_compute(a.op) && ready_at(a, done, hops, simple) == kNever)
          break;
        if (is_send(a.op)) sent.insert(key_of(partner(a, r)));
        if (is_compute(a.op)) done.finish(a, 0, hops);
        moved = true;
      }
  }
  std::string heads;
  for (int64_t r = 0; r < ranks; ++r) {
    if (cursor[r] >= lists[r].size()) continue;
    const Action& a = lists[r][cursor[r]];
    const std::string wait = is_recv(a.op) ? str_cat(name(partner(a, r)), " on pp rank ", a.peer)
                                           : awaited(a, done, hops, simple);
    heads += str_cat(heads.empty() ? "" : "; ", "pp rank ", r, " at ", name(a), " waits for ",
                     wait);
  }
  if (!heads.empty()) throw std::logic_error(str_cat("smp: plan deadlocks: ", heads));
}

}  // namespace smp
