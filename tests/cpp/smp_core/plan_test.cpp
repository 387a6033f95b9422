// The pipeline plans as data: compiled, lowered, validated and run without processes.
#include "smp_core/plan.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>
#include <stdexcept>

#include "smp_core/errors.h"

namespace smp {
namespace {

PlanOptions opts(PlanKind kind, int64_t mb, int64_t stages, std::vector<int64_t> path = {},
                 int64_t active = 3) {
  PlanOptions o = step_options(kind, mb, stages, active);
  o.path = std::move(path);
  return o;
}

const std::vector<PlanKind> kKinds = {PlanKind::kSimple, PlanKind::kInterleaved, PlanKind::k1F1B,
                                      PlanKind::kZeroBubble};

// Microbatches the rank holds activations of after each of its actions: forward begun
// on one of its hops, backward (B or I) of the microbatch not yet back through it.
int64_t peak_in_flight(const Plan& plan, int64_t rank) {
  std::map<int64_t, int64_t> open;  // mb -> hops with activations held
  int64_t peak = 0;
  for (const Action& a : plan.compute()[rank]) {
    if (a.op == Op::kForward) open[a.mb]++;
    if (a.op == Op::kBackward || a.op == Op::kBackwardInput)
      if (--open[a.mb] == 0) open.erase(a.mb);
    peak = std::max<int64_t>(peak, static_cast<int64_t>(open.size()));
  }
  return peak;
}

TEST(Plan, KindNames) {
  for (PlanKind k : kKinds) EXPECT_EQ(plan_kind_from_name(plan_kind_name(k)), k);
  try {
    plan_kind_from_name("gpipe");
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_STREQ(e.what(),
                 "smp: config 'pipeline'='gpipe' is not one of {interleaved, simple, 1f1b, "
                 "zero_bubble}");
  }
}

// The runtime's constraints (PlanOptions::gradient_order, fused_last; Note [Executed
// plan]): on every rank a microbatch's accumulating backward work (B, W) starts only
// after the previous microbatch's is over, and on the last hop's rank so does its
// fused forward; a last hop that accumulates nothing (Note [Last hop's gradients])
// neither waits nor counts, and I never does.
TEST(Plan, GradientOrderKeepsEachRanksBackwardInMicrobatchOrder) {
  for (PlanKind kind : kKinds)
    for (bool last_accumulates : {true, false})
      for (const auto& path : std::vector<std::vector<int64_t>>{
               {0, 1, 0}, {0, 1, 0, 1, 0, 1, 0}, {0, 1, 2, 3, 2, 1, 0}})
        for (int64_t mb : {1, 2, 4, 7}) {
          const int64_t stages = *std::max_element(path.begin(), path.end()) + 1;
          PlanOptions o = opts(kind, mb, stages, path);
          o.gradient_order = true;
          o.fused_last = kind != PlanKind::kSimple;
          o.last_hop_accumulates = last_accumulates;
          if (kind == PlanKind::kZeroBubble) o.unsplit_rank = 0;
          const Plan plan = Plan::compile(o);
          EXPECT_NO_THROW(plan.validate());
          EXPECT_NO_THROW(plan.simulate());
          const int64_t last = static_cast<int64_t>(path.size()) - 1;
          auto counts = [&](const Action& a) {
            return (a.op == Op::kBackward || a.op == Op::kBackwardWeight) &&
                   (a.hop != last || last_accumulates);
          };
          for (int64_t r = 0; r < stages; ++r) {
            std::map<int64_t, int64_t> left;  // mb -> accumulating actions not yet seen
            for (const Action& a : plan.compute()[r])
              if (counts(a)) left[a.mb]++;
            for (const Action& a : plan.compute()[r]) {
              const bool fused = o.fused_last && a.op == Op::kForward && a.hop == last;
              const bool waits = fused ? last_accumulates : counts(a);
              if (waits && a.mb > 0)
                EXPECT_EQ(left[a.mb - 1], 0)
                    << plan_kind_name(kind) << " mb " << mb << " rank " << r << ": "
                    << a.str(true) << " before microbatch " << a.mb - 1
                    << "'s backward is over\n" << plan.format();
              if (counts(a)) left[a.mb]--;
            }
          }
        }
}

// Note [Last hop's gradients]: the runtime's plans (path 0, 1, 0) when the driver's
// last hop is the loss alone. Its forward (the loss and the start of the backward)
// goes first and costs nothing, so microbatch k + 1's loss may come before microbatch
// k's backward through pp rank 0, and the modelled bubble shrinks; with a last hop
// that accumulates, the loss of k + 1 always waits for k's backward there.
TEST(Plan, LastHopWithoutGradientsGoesFirstAndCostsNothing) {
  for (PlanKind kind : {PlanKind::kInterleaved, PlanKind::k1F1B, PlanKind::kZeroBubble}) {
    double bubble[2] = {0, 0};
    for (bool last_accumulates : {true, false}) {
      PlanOptions o = opts(kind, 8, 2, {0, 1, 0});
      o.gradient_order = o.fused_last = true;
      o.last_hop_accumulates = last_accumulates;
      if (kind == PlanKind::kZeroBubble) o.unsplit_rank = 0;
      const Plan plan = Plan::compile(o);
      bubble[last_accumulates] = plan.simulate().bubble_fraction;
      std::map<std::string, size_t> at;
      const auto& driver = plan.compute()[0];
      for (size_t i = 0; i < driver.size(); ++i) at[driver[i].str(true)] = i;
      bool early_loss = false;  // some F(k+1).h2 before Bk.h0
      for (int k = 0; k + 1 < 8; ++k) {
        const bool early = at.at("F" + std::to_string(k + 1) + ".h2") <
                           at.at("B" + std::to_string(k) + ".h0");
        early_loss = early_loss || early;
        if (last_accumulates) EXPECT_FALSE(early) << plan_kind_name(kind) << "\n" << plan.format();
      }
      if (!last_accumulates) EXPECT_TRUE(early_loss) << plan_kind_name(kind) << "\n" << plan.format();
      // The loss hop costs nothing: the driver's busy time is its first stage's work.
      const int64_t per_mb = 3;  // hop 0: F 1 + B (I 1 + W 1); the driver runs it whole
      if (!last_accumulates) EXPECT_EQ(plan.simulate().busy[0], 8 * per_mb) << plan_kind_name(kind);
    }
    EXPECT_LT(bubble[false], bubble[true]) << plan_kind_name(kind);
  }
}

TEST(Plan, BadOptionsNameTheSetting) {
  EXPECT_THROW(Plan::compile(opts(PlanKind::k1F1B, 0, 2)), ConfigError);
  EXPECT_THROW(Plan::compile(opts(PlanKind::k1F1B, 2, 0)), ConfigError);
  try {
    Plan::compile(opts(PlanKind::k1F1B, 2, 2, {0, 2}));
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("visits pp rank 2 at hop 1; allowed: 0 .. 1"),
              std::string::npos) << e.what();
  }
  EXPECT_THROW(Plan::compile(opts(PlanKind::k1F1B, 2, 2, {0, 1, 1})), ConfigError);
}

// Every compiled plan of every kind, on linear and nested paths, is valid: each action
// once on its rank, dependencies kept, no deadlock, the window kept.
TEST(Plan, EveryCompiledPlanValidates) {
  const std::vector<std::vector<int64_t>> paths = {{}, {0, 1, 0}, {0, 1, 2, 1, 0}};
  for (PlanKind kind : kKinds)
    for (int64_t stages : {1, 2, 3, 4})
      for (int64_t mb : {1, 2, 3, 8})
        for (const auto& path : paths) {
          bool fits = true;
          for (int64_t r : path) fits = fits && r < stages;
          if (!fits || (stages == 1 && !path.empty())) continue;
          Plan plan = Plan::compile(opts(kind, mb, stages, path, 2));
          SCOPED_TRACE(plan.format());
          EXPECT_NO_THROW(plan.validate());
          int64_t hops = static_cast<int64_t>(plan.path().size());
          size_t actions = 0;
          for (const auto& l : plan.compute()) actions += l.size();
          EXPECT_EQ(actions, static_cast<size_t>(
                                 mb * hops * (kind == PlanKind::kZeroBubble ? 3 : 2)));
          EXPECT_LE(peak_in_flight(plan, plan.path()[0]), plan.window());
        }
}

// Note [Order without a list] (plan.cpp): a step without a list runs each rank's ready
// work by order_priority(); with unit costs, one slot per action, that is what every rank
// runs in every slot (the readiness rules of Note [Plan rules]; a microbatch starts in
// order while fewer than driver_window() are in flight). Returns the compute actions
// per rank.
std::vector<std::vector<Action>> order_without_a_list(PlanKind kind, int64_t m, int64_t stages,
                                                      int64_t active) {
  const int64_t hops = stages;  // path 0, 1, ..., stages - 1
  const int64_t window = driver_window(kind, m, stages, active);
  std::vector<int64_t> fwd(m, 0), bwd(m, 0);  // hops done per microbatch
  int64_t started = 0, finished = 0, forwards_done = 0;
  std::vector<std::vector<Action>> ran(stages);
  while (finished < m) {
    std::vector<Action> chosen(stages, Action{Op::kReduce});
    for (int64_t s = 0; s < stages; ++s) {
      int64_t best = -1;
      for (int64_t mb = 0; mb < m; ++mb) {
        auto offer = [&](Phase phase, int64_t hop) {
          const int64_t p = order_priority(kind, mb, phase);
          if (best < 0 || p < best) {
            best = p;
            chosen[s] = {phase == Phase::kForward ? Op::kForward : Op::kBackward, mb, hop};
          }
        };
        if (fwd[mb] < hops && fwd[mb] == s &&
            (s > 0 || (mb == started && started - finished < window)))
          offer(Phase::kForward, s);
        const int64_t bh = hops - 1 - bwd[mb];
        if (fwd[mb] == hops && bh == s && (!forwards_before_backwards(kind) || forwards_done == m))
          offer(Phase::kBackward, s);
      }
    }
    bool progress = false;
    for (int64_t s = 0; s < stages; ++s) {
      const Action& a = chosen[s];
      if (a.op == Op::kReduce) continue;
      progress = true;
      ran[s].push_back(a);
      if (a.op == Op::kForward) {
        started += a.hop == 0;
        forwards_done += ++fwd[a.mb] == hops;
      } else {
        finished += ++bwd[a.mb] == hops;
      }
    }
    if (!progress) throw std::logic_error("order_without_a_list: no rank can run");
  }
  return ran;
}

TEST(Plan, OrderWithoutAListIsThePlanRule) {
  // interleaved, 1f1b and zero_bubble (which runs as 1f1b without a list): backward
  // before a new forward; simple: every forward first; then the earlier microbatch.
  for (PlanKind k : {PlanKind::kInterleaved, PlanKind::k1F1B, PlanKind::kZeroBubble}) {
    EXPECT_LT(order_priority(k, 7, Phase::kBackward), order_priority(k, 0, Phase::kForward));
    EXPECT_LT(order_priority(k, 1, Phase::kBackward), order_priority(k, 2, Phase::kBackward));
    EXPECT_LT(order_priority(k, 1, Phase::kForward), order_priority(k, 2, Phase::kForward));
  }
  EXPECT_LT(order_priority(PlanKind::kSimple, 7, Phase::kForward),
            order_priority(PlanKind::kSimple, 0, Phase::kBackward));
  EXPECT_TRUE(forwards_before_backwards(PlanKind::kSimple));
  EXPECT_FALSE(forwards_before_backwards(PlanKind::kInterleaved));
  // The driver's window: interleaved's active_microbatches, every one under simple,
  // 1F1B's pp ranks + 1 (Note [1F1B's window]), never more than the microbatches.
  EXPECT_EQ(driver_window(PlanKind::kInterleaved, 8, 2, 4), 4);
  EXPECT_EQ(driver_window(PlanKind::kInterleaved, 2, 2, 4), 2);
  EXPECT_EQ(driver_window(PlanKind::kSimple, 8, 2, 4), 8);
  EXPECT_EQ(driver_window(PlanKind::k1F1B, 8, 2, 7), 3);
  EXPECT_EQ(driver_window(PlanKind::k1F1B, 8, 4, 1), 5);
  EXPECT_EQ(driver_window(PlanKind::k1F1B, 3, 4, 1), 3);
  EXPECT_EQ(driver_window(PlanKind::kZeroBubble, 8, 2, 1), 3);
  // The runtime's order and the compiler's lists are one rule: with a backward costing
  // one slot, the compiled interleaved and simple plans are what the order without a
  // list runs.
  for (PlanKind kind : {PlanKind::kInterleaved, PlanKind::kSimple})
    for (int64_t stages : {2, 3, 4})
      for (int64_t mb : {1, 4, 8})
        for (int64_t active : {1, 2, 3}) {
          PlanOptions o = opts(kind, mb, stages, {}, active);
          o.costs = {1, 1, 0};
          Plan plan = Plan::compile(o);
          EXPECT_EQ(plan.compute(), order_without_a_list(kind, mb, stages, active))
              << plan.format();
        }
}

TEST(Plan, SimpleRunsEveryForwardBeforeAnyBackward) {
  Plan plan = Plan::compile(opts(PlanKind::kSimple, 5, 3));
  for (const auto& list : plan.compute()) {
    bool backward = false;
    for (const Action& a : list) {
      if (a.op == Op::kBackward) backward = true;
      else EXPECT_FALSE(backward) << plan.format();
    }
  }
  EXPECT_EQ(plan.window(), 5);
}

// Note [1F1B's window]: a microbatch's forward comes back to the driver for its loss
// (path 0, 1, 0), so 1F1B keeps one microbatch per hop in flight: the driver runs the
// forward of microbatch k + 2 while the last stage runs the input half of k's backward,
// instead of waiting for it.
TEST(Plan, OneFOneBWindowCountsTheHopBackToTheDriver) {
  for (PlanKind kind : {PlanKind::k1F1B, PlanKind::kZeroBubble}) {
    PlanOptions o = opts(kind, 8, 2, {0, 1, 0});
    o.gradient_order = true;
    o.fused_last = true;
    if (kind == PlanKind::kZeroBubble) o.unsplit_rank = 0;
    Plan plan = Plan::compile(o);
    SCOPED_TRACE(plan.format());
    EXPECT_EQ(plan.window(), 3);
    plan.validate();
    const auto& driver = plan.compute()[0];
    auto at = [&](Op op, int64_t mb, int64_t hop) {
      for (size_t i = 0; i < driver.size(); ++i)
        if (driver[i].op == op && driver[i].mb == mb && driver[i].hop == hop) return i;
      ADD_FAILURE() << "no action";
      return driver.size();
    };
    for (int64_t k = 0; k + 2 < 8; ++k) {  // the loss of k, then the forward of k + 2, then k's backward
      EXPECT_LT(at(Op::kForward, k, 2), at(Op::kForward, k + 2, 0)) << "microbatch " << k;
      EXPECT_LT(at(Op::kForward, k + 2, 0), at(Op::kBackward, k, 0)) << "microbatch " << k;
    }
  }
}

// Note [Plan search]: with the loss on the driver (path 0, 1, 0), 1f1b's own rule (a
// ready backward first, everywhere) leaves each rank idle mid-step. The search keeps
// 1F1B's window and finds the ceiling: pp rank 1 cannot start before the driver's
// first forward, runs all its work, and the driver's last backward follows its last.
TEST(Plan, SearchReachesTheCeilingWithinTheWindow) {
  for (PlanKind kind : {PlanKind::k1F1B, PlanKind::kInterleaved}) {
    PlanOptions o = opts(kind, 8, 2, {0, 1, 0}, 4);
    o.gradient_order = o.fused_last = true;
    o.last_hop_accumulates = false;
    const Plan searched = Plan::compile(o);
    o.search = false;
    const Plan rule = Plan::compile(o);
    SCOPED_TRACE(searched.format());
    searched.validate();
    const auto timing = searched.simulate();
    const int64_t backward = o.costs.input + o.costs.weight;
    EXPECT_EQ(timing.makespan, o.costs.forward + timing.busy[1] + backward);
    EXPECT_LE(timing.makespan, rule.simulate().makespan);
    if (kind == PlanKind::k1F1B) EXPECT_LT(timing.makespan, rule.simulate().makespan);
    EXPECT_EQ(searched.window(), rule.window());
    for (int64_t r = 0; r < 2; ++r) EXPECT_LE(peak_in_flight(searched, r), peak_in_flight(rule, r));
  }
}

// The defining shape of 1F1B (Narayanan et al., PipeDream-Flush): pp rank s runs
// min(S - s, M) forwards, then alternates one backward and one forward while forwards
// are left, then the remaining backwards; so it holds at most S - s microbatches.
TEST(Plan, OneFOneBHasWarmupSteadyStateAndCooldown) {
  for (int64_t stages : {2, 3, 4})
    for (int64_t mb : {1, 2, 4, 8, 9}) {
      Plan plan = Plan::compile(opts(PlanKind::k1F1B, mb, stages));
      SCOPED_TRACE(plan.format());
      EXPECT_EQ(plan.window(), std::min(stages, mb));
      for (int64_t s = 0; s < stages; ++s) {
        const auto& list = plan.compute()[s];
        const int64_t warmup = std::min(stages - s, mb);
        std::string shape;
        for (const Action& a : list) shape += a.op == Op::kForward ? "F" : "B";
        std::string expected(static_cast<size_t>(warmup), 'F');
        for (int64_t i = warmup; i < mb; ++i) expected += "BF";
        expected += std::string(static_cast<size_t>(warmup), 'B');
        EXPECT_EQ(shape, expected) << "pp rank " << s;
        EXPECT_LE(peak_in_flight(plan, s), stages - s);
        // Microbatches in order within each phase.
        int64_t f = 0, b = 0;
        for (const Action& a : list) EXPECT_EQ(a.mb, a.op == Op::kForward ? f++ : b++);
      }
    }
}

// Zero bubble (ZB-H1, Qi et al.): splitting each backward into I and W lets W fill the
// slots 1F1B leaves idle, with the same activations held.
TEST(Plan, ZeroBubbleHasLessBubbleThanOneFOneB) {
  for (int64_t stages : {2, 4})
    for (int64_t mb : {4, 8, 16}) {
      PlanOptions o = opts(PlanKind::k1F1B, mb, stages);
      Plan ofob = Plan::compile(o);
      o.kind = PlanKind::kZeroBubble;
      Plan zb = Plan::compile(o);
      auto t1 = ofob.simulate(), tz = zb.simulate();
      SCOPED_TRACE(zb.timeline());
      EXPECT_LT(tz.bubble_fraction, t1.bubble_fraction);
      EXPECT_LT(tz.makespan, t1.makespan);
      for (int64_t s = 0; s < stages; ++s) {
        EXPECT_EQ(tz.busy[s], t1.busy[s]);  // the same work, less idle
        EXPECT_LE(peak_in_flight(zb, s), stages - s);
      }
      // W only after its I, on the same rank.
      for (const auto& list : zb.compute()) {
        std::set<std::pair<int64_t, int64_t>> inputs;
        for (const Action& a : list) {
          if (a.op == Op::kBackwardInput) inputs.insert({a.mb, a.hop});
          if (a.op == Op::kBackwardWeight) EXPECT_TRUE(inputs.count({a.mb, a.hop}));
        }
      }
    }
}

// The plan the runtime executes under zero_bubble (Note [Zero bubble at run time] in
// smp_core/detail/served_backward.cpp): the driver's hops run B whole, the serving
// ranks' split; only what accumulates keeps microbatch order; and it is no slower than
// 1F1B's runtime plan.
TEST(Plan, ZeroBubbleAtRunTimeSplitsTheServingRanksOnly) {
  for (const auto& path : std::vector<std::vector<int64_t>>{{0, 1, 0}, {0, 1, 0, 2, 0, 3, 0}})
    for (int64_t mb : {2, 4, 8}) {
      const int64_t stages = *std::max_element(path.begin(), path.end()) + 1;
      PlanOptions o = opts(PlanKind::k1F1B, mb, stages, path);
      o.gradient_order = true;
      o.fused_last = true;
      o.unsplit_rank = 0;
      const Plan ofob = Plan::compile(o);
      o.kind = PlanKind::kZeroBubble;
      o.costs = {1, 1, 1};
      const Plan zb = Plan::compile(o);
      SCOPED_TRACE(zb.format());
      EXPECT_NO_THROW(zb.validate());
      for (int64_t r = 0; r < stages; ++r) {
        std::map<int64_t, int64_t> accumulating;  // mb -> B/W seen
        std::set<std::pair<int64_t, int64_t>> inputs;
        int64_t last_mb = -1;
        for (const Action& a : zb.compute()[r]) {
          if (r == 0) EXPECT_TRUE(a.op == Op::kForward || a.op == Op::kBackward) << a.str(true);
          else EXPECT_NE(a.op, Op::kBackward) << a.str(true);
          if (a.op == Op::kBackwardInput) inputs.insert({a.mb, a.hop});
          if (a.op == Op::kBackwardWeight) EXPECT_TRUE(inputs.count({a.mb, a.hop})) << a.str(true);
          if (a.op == Op::kBackward || a.op == Op::kBackwardWeight) {
            EXPECT_GE(a.mb, last_mb) << "rank " << r << ": " << a.str(true);
            last_mb = a.mb;
          }
        }
      }
      const auto tz = zb.simulate(), t1 = ofob.simulate();
      EXPECT_LE(tz.makespan, t1.makespan) << ofob.timeline() << zb.timeline();
      if (mb >= 4) EXPECT_LT(tz.bubble_fraction, t1.bubble_fraction) << ofob.timeline() << zb.timeline();
    }
  // The option names its bounds.
  PlanOptions bad = opts(PlanKind::kZeroBubble, 2, 2);
  bad.unsplit_rank = 2;
  try {
    Plan::compile(bad);
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_STREQ(e.what(), "smp: plan 'unsplit_rank'=2 is not -1 or a pp rank 0 .. 1");
  }
}

TEST(Plan, LoweredSendsMeetReceives) {
  for (PlanKind kind : kKinds)
    for (const std::vector<int64_t>& path :
         {std::vector<int64_t>{}, std::vector<int64_t>{0, 1, 2, 1, 0}}) {
      Plan plan = Plan::compile(opts(kind, 4, 3, path));
      auto lists = plan.lowered();
      std::multiset<std::tuple<int, int64_t, int64_t, int64_t, int64_t>> sends, recvs;
      for (size_t r = 0; r < lists.size(); ++r) {
        ASSERT_FALSE(lists[r].empty());
        EXPECT_EQ(lists[r].back().op, Op::kReduce);
        for (size_t i = 0; i < lists[r].size(); ++i) {
          const Action& a = lists[r][i];
          const auto rank = static_cast<int64_t>(r);
          if (a.op == Op::kSendForward) sends.insert({0, a.mb, a.hop + 1, rank, a.peer});
          if (a.op == Op::kRecvForward) recvs.insert({0, a.mb, a.hop, a.peer, rank});
          if (a.op == Op::kSendBackward) sends.insert({1, a.mb, a.hop - 1, rank, a.peer});
          if (a.op == Op::kRecvBackward) recvs.insert({1, a.mb, a.hop, a.peer, rank});
          // A receive comes right before the compute it feeds.
          if (a.op == Op::kRecvForward || a.op == Op::kRecvBackward) {
            ASSERT_LT(i + 1, lists[r].size());
            EXPECT_EQ(lists[r][i + 1].mb, a.mb);
            EXPECT_EQ(lists[r][i + 1].hop, a.hop);
          }
        }
      }
      EXPECT_EQ(sends, recvs) << plan.format();
      EXPECT_EQ(sends.size(), static_cast<size_t>(4 * 2 * (plan.path().size() - 1)));
    }
}

PlanOptions two_stage_one_mb() { return opts(PlanKind::k1F1B, 1, 2); }

std::string validate_error(const Plan& plan) {
  try {
    plan.validate();
  } catch (const std::logic_error& e) {
    return e.what();
  }
  return "";
}

TEST(Plan, ValidateNamesWhatIsWrong) {
  const Action f0{Op::kForward, 0, 0}, f1{Op::kForward, 0, 1};
  const Action b0{Op::kBackward, 0, 0}, b1{Op::kBackward, 0, 1};
  auto from = [](std::vector<std::vector<Action>> l, PlanOptions o = two_stage_one_mb()) {
    return Plan::from_lists(o, std::move(l));
  };
  EXPECT_EQ(validate_error(from({{f0, b0}, {f1, b1}})), "");
  EXPECT_EQ(validate_error(from({{f0, b0}, {f1, b1, b1}})),
            "smp: plan: B0.h1 runs twice on pp rank 1");
  EXPECT_EQ(validate_error(from({{f0, b0}, {f1}})), "smp: plan: B0.h1 is missing on pp rank 1");
  EXPECT_EQ(validate_error(from({{f0, b0, b1}, {f1}})),
            "smp: plan: B0.h1 is on pp rank 0 but hop 1 runs on pp rank 1");
  EXPECT_EQ(validate_error(from({{f0, Action{Op::kBackwardInput, 0, 0}}, {f1, b1}})),
            "smp: plan: I0.h0 on pp rank 0: 1f1b runs B, not I and W");
  // A backward listed before the forward it follows: every rank waits on the other.
  EXPECT_EQ(validate_error(from({{b0, f0}, {f1, b1}})),
            "smp: plan deadlocks: pp rank 0 at B0.h0 waits for B/I0 hop 1; pp rank 1 at F0.h1 "
            "waits for F0 hop 0");
  // Microbatches start in order, within the window.
  PlanOptions two = opts(PlanKind::k1F1B, 2, 2);
  const Action g0{Op::kForward, 1, 0}, g1{Op::kForward, 1, 1};
  const Action c0{Op::kBackward, 1, 0}, c1{Op::kBackward, 1, 1};
  EXPECT_EQ(validate_error(from({{g0, f0, b0, c0}, {f1, g1, b1, c1}}, two)),
            "smp: plan: the driver (pp rank 0) starts F1 before F0: microbatches start in order");
  two.kind = PlanKind::kInterleaved;
  two.active_microbatches = 1;
  EXPECT_EQ(validate_error(from({{f0, g0, b0, c0}, {f1, g1, b1, c1}}, two)),
            "smp: plan: 2 microbatches in flight at F1 on the driver (pp rank 0); the window is 1");
  EXPECT_EQ(validate_error(from({{f0, b0, g0, c0}, {f1, b1, g1, c1}}, two)), "");
}

// Note [Plan validation]: the whole lists, as from_actions() takes them.
TEST(Plan, WholeListsAsGivenValidate) {
  for (PlanKind kind : kKinds)
    for (const std::vector<int64_t>& path :
         {std::vector<int64_t>{}, std::vector<int64_t>{0, 1, 0}, std::vector<int64_t>{0, 1, 2, 1, 0}}) {
      PlanOptions o = opts(kind, 4, 3, path);
      const Plan compiled = Plan::compile(o);
      const Plan given = Plan::from_actions(o, compiled.lowered());
      EXPECT_EQ(validate_error(given), "") << given.format();
      EXPECT_EQ(given.format(), compiled.format());
      EXPECT_EQ(given.compute(), compiled.compute());
    }
}

void erase(std::vector<Action>& list, const Action& a) {
  auto it = std::find(list.begin(), list.end(), a);
  ASSERT_NE(it, list.end()) << a.str(true);
  list.erase(it);
}

void move_before(std::vector<Action>& list, const Action& a, const Action& before) {
  erase(list, a);
  auto it = std::find(list.begin(), list.end(), before);
  ASSERT_NE(it, list.end()) << before.str(true);
  list.insert(it, a);
}

TEST(Plan, ValidateRefusesASendWithoutItsReceive) {
  Plan plan = Plan::compile(opts(PlanKind::k1F1B, 1, 2));
  auto lists = plan.lowered();
  const PlanOptions o = plan.options();
  erase(lists[1], {Op::kRecvForward, 0, 1, 0});
  EXPECT_EQ(validate_error(Plan::from_actions(o, lists)),
            "smp: plan: SF0>1 on pp rank 0 has no receive: pp rank 1's list has no RF0<0");
  lists = plan.lowered();
  erase(lists[0], {Op::kSendForward, 0, 0, 1});
  EXPECT_EQ(validate_error(Plan::from_actions(o, lists)),
            "smp: plan: RF0<0 on pp rank 1 has no send: pp rank 0's list has no SF0>1");
  lists = plan.lowered();
  erase(lists[0], {Op::kRecvBackward, 0, 0, 1});
  erase(lists[1], {Op::kSendBackward, 0, 1, 0});
  EXPECT_EQ(validate_error(Plan::from_actions(o, lists)),
            "smp: plan: RB0<1 is missing on pp rank 0: B0 receives nothing");
  lists = plan.lowered();
  lists[0].insert(lists[0].begin() + 1, Action{Op::kSendForward, 0, 0, 0});
  EXPECT_EQ(validate_error(Plan::from_actions(o, lists)),
            "smp: plan: SF0>0 on pp rank 0 is no communication of this path (2 hops: hop 0 "
            "runs on pp rank 0, hop 1 on pp rank 1)");
}

TEST(Plan, ValidateRefusesAnOutOfOrderDependency) {
  Plan plan = Plan::compile(opts(PlanKind::k1F1B, 1, 2));
  const PlanOptions o = plan.options();
  // On one rank: a send before the compute whose output it moves, a receive after the
  // compute that needs it.
  auto lists = plan.lowered();
  move_before(lists[0], {Op::kSendForward, 0, 0, 1}, {Op::kForward, 0, 0});
  EXPECT_EQ(validate_error(Plan::from_actions(o, lists)),
            "smp: plan: SF0>1 on pp rank 0 comes before F0, whose output it sends");
  lists = plan.lowered();
  move_before(lists[1], {Op::kForward, 0, 1}, {Op::kRecvForward, 0, 1, 0});
  EXPECT_EQ(validate_error(Plan::from_actions(o, lists)),
            "smp: plan: RF0<0 on pp rank 1 comes after F0, which needs it");
  // Across ranks: the driver waits for microbatch 0's gradient before it sends
  // microbatch 0's activations on; the compute order alone is fine.
  const Plan loop = Plan::compile(opts(PlanKind::k1F1B, 2, 2, {0, 1, 0}));
  lists = loop.lowered();
  move_before(lists[0], {Op::kRecvBackward, 0, 0, 1}, {Op::kSendForward, 0, 0, 1});
  EXPECT_EQ(validate_error(Plan::from_actions(loop.options(), lists)),
            "smp: plan deadlocks: pp rank 0 at RB0.h0<1 waits for SB0.h1>0 on pp rank 1; "
            "pp rank 1 at RF0.h1<0 waits for SF0.h0>1 on pp rank 0");
}

TEST(Plan, ValidateRefusesAWindowLargerThanTheThreads) {
  for (PlanKind kind : kKinds) {
    PlanOptions o = executed_plan_options(kind, 8, 2, 3, {0, 1, 0}, true);
    EXPECT_EQ(validate_error(Plan::compile(o)), "") << plan_kind_name(kind);
  }
  PlanOptions o = opts(PlanKind::kInterleaved, 8, 2, {}, 4);
  o.threads = 2;
  EXPECT_EQ(validate_error(Plan::compile(o)),
            "smp: plan: the window is 4 microbatches but the driver (pp rank 0) has 2 task "
            "threads; each microbatch in flight holds one");
  o.threads = 4;
  EXPECT_EQ(validate_error(Plan::compile(o)), "");
}

TEST(Plan, FormatAndTimelineMarkTheFailedAction) {
  Plan plan = Plan::compile(opts(PlanKind::k1F1B, 2, 2));
  EXPECT_EQ(plan.format(),
            "plan 1f1b, 2 microbatches, 2 pp ranks, window 2\n"
            "pp 0 | F0 SF0>1 F1 SF1>1 RB0<1 B0 RB1<1 B1 R\n"
            "pp 1 | RF0<0 F0 B0 SB0>0 RF1<0 F1 B1 SB1>0 R\n");
  const Action failed{Op::kBackward, 1, 1};
  const std::string text = plan.format(&failed, 1);
  EXPECT_NE(text.find("RF1<0 F1 [B1] SB1>0"), std::string::npos) << text;
  EXPECT_NE(text.find("failed: pp rank 1, B1.h1\n"), std::string::npos) << text;
  const std::string grid = plan.timeline(&failed, 1);
  EXPECT_NE(grid.find("[B1]"), std::string::npos) << grid;
  EXPECT_EQ(grid.find("[B1]"), grid.rfind("[B1]")) << "marked once: " << grid;
  const Action absent{Op::kForward, 7, 0};
  EXPECT_NE(plan.format(&absent, 0).find("(not in this plan)"), std::string::npos);
  // A path that visits a rank twice labels hops.
  Plan nested = Plan::compile(opts(PlanKind::k1F1B, 1, 2, {0, 1, 0}));
  EXPECT_NE(nested.format().find("F0.h2"), std::string::npos) << nested.format();
}

}  // namespace
}  // namespace smp
