// The schedule as data: plans checked without processes.
#include "smp_core/scheduler.h"

#include <gtest/gtest.h>

#include <map>

#include "smp_core/errors.h"

namespace smp {
namespace {

Schedule make(ScheduleKind kind, int64_t mb, int64_t stages, int64_t active = 3) {
  return Schedule(ScheduleOptions{kind, mb, stages, active});
}

// Slot at which `stage` runs (mb, phase, hop); -1 if never.
int64_t slot_of(const std::vector<std::vector<Work>>& plan, int64_t stage, int64_t mb,
                Phase phase, int64_t hop) {
  const auto& row = plan[stage];
  for (size_t t = 0; t < row.size(); ++t)
    if (row[t] == Work{mb, phase, hop}) return static_cast<int64_t>(t);
  return -1;
}

TEST(Schedule, PriorityRule) {
  // interleaved: any backward before any forward, earlier microbatches first.
  EXPECT_LT(schedule_priority(ScheduleKind::kInterleaved, 7, Phase::kBackward),
            schedule_priority(ScheduleKind::kInterleaved, 0, Phase::kForward));
  EXPECT_LT(schedule_priority(ScheduleKind::kInterleaved, 1, Phase::kBackward),
            schedule_priority(ScheduleKind::kInterleaved, 2, Phase::kBackward));
  // simple: any forward before any backward.
  EXPECT_LT(schedule_priority(ScheduleKind::kSimple, 7, Phase::kForward),
            schedule_priority(ScheduleKind::kSimple, 0, Phase::kBackward));
  EXPECT_EQ(make(ScheduleKind::kInterleaved, 8, 2, 4).window(), 4);
  EXPECT_EQ(make(ScheduleKind::kInterleaved, 2, 2, 4).window(), 2);
  EXPECT_EQ(make(ScheduleKind::kSimple, 8, 2, 4).window(), 8);
  // 1f1b: interleaved's order with one microbatch in flight per hop of a microbatch's
  // path, which comes back to the driver: pp ranks + 1 (Note [1F1B's window]).
  EXPECT_EQ(make(ScheduleKind::kOneFOneB, 8, 2, 7).window(), 3);
  EXPECT_EQ(make(ScheduleKind::kOneFOneB, 8, 4, 1).window(), 5);
  EXPECT_EQ(make(ScheduleKind::kOneFOneB, 3, 4, 1).window(), 3);
  EXPECT_EQ(make(ScheduleKind::kZeroBubble, 8, 2, 1).window(), 3);
  EXPECT_EQ(schedule_priority(ScheduleKind::kOneFOneB, 5, Phase::kBackward),
            schedule_priority(ScheduleKind::kInterleaved, 5, Phase::kBackward));
  EXPECT_EQ(schedule_priority(ScheduleKind::kOneFOneB, 5, Phase::kForward),
            schedule_priority(ScheduleKind::kInterleaved, 5, Phase::kForward));
}

TEST(Schedule, InterleavedTwoStagesGrid) {
  EXPECT_EQ(make(ScheduleKind::kInterleaved, 4, 2, 3).grid(),
            "schedule interleaved, 4 microbatches, 2 stages (time runs left to right)\n"
            "pp 0 | F0   F1   F2   B0   F3   B1   .    B2   .    B3\n"
            "pp 1 | .    F0   B0   F1   B1   F2   B2   F3   B3   .\n");
}

TEST(Schedule, SimpleRunsEveryForwardFirst) {
  EXPECT_EQ(make(ScheduleKind::kSimple, 2, 2).grid(),
            "schedule simple, 2 microbatches, 2 stages (time runs left to right)\n"
            "pp 0 | F0   F1   .    .    B0   B1\n"
            "pp 1 | .    F0   F1   B0   B1   .\n");
  auto plan = make(ScheduleKind::kSimple, 5, 3).plan();
  int64_t last_fwd = 0, first_bwd = 1 << 30;
  for (const auto& row : plan)
    for (size_t t = 0; t < row.size(); ++t) {
      if (row[t].mb < 0) continue;
      if (row[t].phase == Phase::kForward) last_fwd = std::max<int64_t>(last_fwd, t);
      else first_bwd = std::min<int64_t>(first_bwd, t);
    }
  EXPECT_LT(last_fwd, first_bwd);
}

TEST(Schedule, EveryUnitRunsOnceOnItsStage) {
  for (auto kind : {ScheduleKind::kInterleaved, ScheduleKind::kSimple})
    for (int64_t stages : {1, 2, 3, 4})
      for (int64_t mb : {1, 2, 5, 8}) {
        auto plan = make(kind, mb, stages, stages + 2).plan();
        std::map<std::tuple<int64_t, int, int64_t>, int> seen;
        for (int64_t s = 0; s < stages; ++s)
          for (const auto& w : plan[s])
            if (w.mb >= 0) {
              EXPECT_EQ(w.hop, s);  // the default path visits stage h at hop h
              seen[{w.mb, static_cast<int>(w.phase), w.hop}]++;
            }
        EXPECT_EQ(seen.size(), static_cast<size_t>(2 * mb * stages));
        for (const auto& [k, n] : seen) EXPECT_EQ(n, 1);
        // Dependencies: forward hop h after hop h-1; backward reversed.
        for (int64_t m = 0; m < mb; ++m)
          for (int64_t h = 1; h < stages; ++h) {
            EXPECT_LT(slot_of(plan, h - 1, m, Phase::kForward, h - 1),
                      slot_of(plan, h, m, Phase::kForward, h));
            EXPECT_LT(slot_of(plan, h, m, Phase::kBackward, h),
                      slot_of(plan, h - 1, m, Phase::kBackward, h - 1));
          }
      }
}

TEST(Schedule, WindowBoundsMicrobatchesInFlight) {
  for (int64_t active : {1, 2, 3}) {
    auto plan = make(ScheduleKind::kInterleaved, 6, 2, active).plan();
    // Microbatch m + active starts only after microbatch m has finished.
    for (int64_t m = 0; m + active < 6; ++m)
      EXPECT_GT(slot_of(plan, 0, m + active, Phase::kForward, 0),
                slot_of(plan, 0, m, Phase::kBackward, 0))
          << "active=" << active << " mb=" << m;
  }
}

TEST(Schedule, NestedCallsBackIntoTheDriverDoNotDeadlock) {
  // Each microbatch visits 0 -> 1 -> 0 -> 1 (a module on rank 1 calls one on rank 0).
  for (auto kind : {ScheduleKind::kInterleaved, ScheduleKind::kSimple})
    for (int64_t active : {1, 2, 4}) {
      auto plan = make(kind, 4, 2, active).plan({0, 1, 0, 1});
      int64_t units0 = 0, units1 = 0;
      for (const auto& w : plan[0]) units0 += w.mb >= 0;
      for (const auto& w : plan[1]) units1 += w.mb >= 0;
      EXPECT_EQ(units0, 4 * 2 * 2);
      EXPECT_EQ(units1, 4 * 2 * 2);
    }
}

TEST(Schedule, FailureTableMarksTheCell) {
  FailedCell failed{1, 2, Phase::kBackward};
  std::string g = make(ScheduleKind::kInterleaved, 4, 2, 3).grid({}, &failed);
  EXPECT_NE(g.find("[B2]"), std::string::npos) << g;
  EXPECT_NE(g.find("pp 1 | .    F0   B0   F1   B1   F2   [B2]"), std::string::npos) << g;
  EXPECT_NE(g.find("failed: pp rank 1, microbatch 2, backward\n"), std::string::npos) << g;
}

TEST(Schedule, BadOptionsNameTheSetting) {
  try {
    make(ScheduleKind::kSimple, 0, 2);
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_STREQ(e.what(), "smp: schedule 'microbatches'=0 is not an integer >= 1");
  }
  EXPECT_THROW(make(ScheduleKind::kSimple, 2, 2).plan({0, 2}), ConfigError);
}

}  // namespace
}  // namespace smp
