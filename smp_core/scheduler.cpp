#include "smp_core/scheduler.h"

#include <algorithm>
#include <stdexcept>

#include "smp_core/errors.h"

namespace smp {
namespace {

// Larger than any microbatch count: the phase decides first, the microbatch second.
constexpr int64_t kPhaseStride = int64_t{1} << 40;

const char* phase_name(Phase p) { return p == Phase::kForward ? "forward" : "backward"; }

std::string cell(const Work& w) {
  if (w.mb < 0) return ".";
  return str_cat(w.phase == Phase::kForward ? "F" : "B", w.mb);
}

}  // namespace

const char* schedule_kind_name(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::kInterleaved: return "interleaved";
    case ScheduleKind::kSimple: return "simple";
    case ScheduleKind::kOneFOneB: return "1f1b";
    case ScheduleKind::kZeroBubble: return "zero_bubble";
  }
  return "?";
}

int64_t schedule_priority(ScheduleKind kind, int64_t mb, Phase phase) {
  const bool backward = phase == Phase::kBackward;
  const bool first = kind == ScheduleKind::kSimple ? !backward : backward;
  return (first ? 0 : kPhaseStride) + mb;
}

Schedule::Schedule(ScheduleOptions options) : options_(options) {
  if (options_.microbatches < 1)
    throw ConfigError(str_cat("smp: schedule 'microbatches'=", options_.microbatches,
                              " is not an integer >= 1"));
  if (options_.stages < 1)
    throw ConfigError(str_cat("smp: schedule 'partitions'=", options_.stages,
                              " is not an integer >= 1"));
  if (options_.active_microbatches < 1)
    throw ConfigError(str_cat("smp: schedule 'active_microbatches'=",
                              options_.active_microbatches, " is not an integer >= 1"));
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

int64_t Schedule::window() const {
  if (options_.kind == ScheduleKind::kSimple) return options_.microbatches;
  if (options_.kind == ScheduleKind::kOneFOneB || options_.kind == ScheduleKind::kZeroBubble)
    return one_f_one_b_window(options_.stages, options_.microbatches);
  return std::min(options_.active_microbatches, options_.microbatches);
}

// Note [Schedule simulation]: each time slot, every stage runs the ready unit with the
// smallest priority; results become visible in the next slot. A microbatch's forward
// hop h is ready when hop h-1 is done (hop 0: when it is the next microbatch to start
// and fewer than window() are in flight); its backward hop h when backward hop h+1 is
// done (the last hop: when the whole forward is done, and under "simple" when every
// microbatch's forward is done). A microbatch leaves the window when its backward
// reaches hop 0. This is what the runtime does with the compute token, the receive
// order and the driver's worker threads; a waiting task holds no token, so units are
// atomic here.
std::vector<std::vector<Work>> Schedule::plan(const std::vector<int64_t>& path_in) const {
  std::vector<int64_t> path = path_in;
  if (path.empty())
    for (int64_t s = 0; s < options_.stages; ++s) path.push_back(s);
  for (int64_t s : path)
    if (s < 0 || s >= options_.stages)
      throw ConfigError(str_cat("smp: schedule path visits stage ", s, " of ", options_.stages));
  const int64_t hops = static_cast<int64_t>(path.size());
  const int64_t m = options_.microbatches;
  std::vector<int64_t> fwd(m, 0), bwd(m, 0);  // hops done per microbatch
  int64_t started = 0, finished = 0, fwd_complete = 0;
  std::vector<std::vector<Work>> grid(options_.stages);
  const Work idle{-1, Phase::kForward, -1};

  while (finished < m) {
    std::vector<Work> chosen(options_.stages, idle);
    for (int64_t stage = 0; stage < options_.stages; ++stage) {
      Work best = idle;
      int64_t best_prio = 0;
      auto offer = [&](const Work& w) {
        int64_t p = priority(w.mb, w.phase);
        if (best.mb < 0 || p < best_prio) best = w, best_prio = p;
      };
      for (int64_t mb = 0; mb < m; ++mb) {
        if (fwd[mb] < hops && path[fwd[mb]] == stage) {
          bool ready = fwd[mb] > 0 || (mb == started && started - finished < window());
          if (ready) offer({mb, Phase::kForward, fwd[mb]});
        }
        const int64_t bh = hops - 1 - bwd[mb];
        if (fwd[mb] == hops && bh >= 0 && path[bh] == stage &&
            (!forwards_before_backwards() || fwd_complete == m))
          offer({mb, Phase::kBackward, bh});
      }
      chosen[stage] = best;
    }
    bool progress = false;
    for (int64_t stage = 0; stage < options_.stages; ++stage) {
      const Work& w = chosen[stage];
      grid[stage].push_back(w);
      if (w.mb < 0) continue;
      progress = true;
      if (w.phase == Phase::kForward) {
        if (w.hop == 0) ++started;
        if (++fwd[w.mb] == hops) ++fwd_complete;
      } else if (++bwd[w.mb] == hops) {
        ++finished;
      }
    }
    if (!progress) {
      std::string stuck;
      for (int64_t mb = 0; mb < m; ++mb)
        if (bwd[mb] < hops)
          stuck += str_cat(stuck.empty() ? "" : ", ", "microbatch ", mb, " (forward hops ",
                           fwd[mb], "/", hops, ", backward hops ", bwd[mb], "/", hops, ")");
      throw std::logic_error("smp: schedule deadlocks: no stage can run; waiting: " + stuck);
    }
  }
  return grid;
}

std::string Schedule::grid(const std::vector<int64_t>& path, const FailedCell* failed) const {
  auto rows = plan(path);
  size_t width = 1;
  for (const auto& row : rows)
    for (const auto& w : row) width = std::max(width, cell(w).size());
  width += 2;  // room for the failure mark
  std::string out = str_cat("schedule ", schedule_kind_name(options_.kind),
                            ", ", options_.microbatches, " microbatches, ", options_.stages,
                            " stages (time runs left to right)\n");
  bool marked = false;
  for (size_t s = 0; s < rows.size(); ++s) {
    std::string line = str_cat("pp ", s, " |");
    for (const auto& w : rows[s]) {
      std::string c = cell(w);
      if (failed && !marked && w.mb >= 0 && failed->stage == static_cast<int64_t>(s) &&
          failed->mb == w.mb && failed->phase == w.phase) {
        c = "[" + c + "]";
        marked = true;
      }
      line += " " + c + std::string(width - c.size(), ' ');
    }
    while (!line.empty() && line.back() == ' ') line.pop_back();
    out += line + "\n";
  }
  if (failed)
    out += str_cat("failed: pp rank ", failed->stage, ", microbatch ", failed->mb, ", ",
                   phase_name(failed->phase), marked ? "" : " (not in this plan)", "\n");
  return out;
}

}  // namespace smp
