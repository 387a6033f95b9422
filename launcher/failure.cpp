#include "launcher/failure.h"

#include <sys/wait.h>

#include <cstring>
#include <nlohmann/json.hpp>

#include "launcher/line_buffer.h"
#include "launcher/options.h"

namespace smp::launcher {

std::string signal_name(int sig) {
  const char* abbrev = sigabbrev_np(sig);  // glibc >= 2.32
  if (abbrev == nullptr) return "signal " + std::to_string(sig);
  return std::string("SIG") + abbrev;
}

Failure Failure::rank_exit(int node, int rank, int local_rank, int wait_status,
                           std::vector<std::string> tail) {
  Failure f;
  f.kind = FailureKind::kRankExit;
  f.node = node;
  f.rank = rank;
  f.local_rank = local_rank;
  if (WIFSIGNALED(wait_status)) {
    f.signal = WTERMSIG(wait_status);
  } else {
    f.exit_code = WEXITSTATUS(wait_status);
  }
  f.tail = std::move(tail);
  return f;
}

Failure Failure::node_lost(int node, std::string detail, std::string where) {
  Failure f;
  f.kind = FailureKind::kNodeLost;
  f.node = node;
  f.detail = std::move(detail);
  f.where = std::move(where);
  return f;
}

std::string Failure::node_place(const std::string& host, int node, int nproc) {
  const int first = node * nproc, last = first + nproc - 1;
  std::string ranks = first == last ? "rank " + std::to_string(first)
                                    : "ranks " + std::to_string(first) + "-" + std::to_string(last);
  return host.empty() ? ranks : "host '" + host + "', " + ranks;
}

Failure Failure::launcher_signal(int node, int sig) {
  Failure f;
  f.kind = FailureKind::kLauncherSignal;
  f.node = node;
  f.signal = sig;
  return f;
}

int Failure::job_exit_code() const {
  return kind == FailureKind::kLauncherSignal ? 128 + signal : kExitFailure;
}

std::string Failure::describe() const {
  switch (kind) {
    case FailureKind::kRankExit: {
      std::string who = "rank " + std::to_string(rank) + " (node " + std::to_string(node) +
                        ", local rank " + std::to_string(local_rank) + ")";
      if (signal != 0)
        return who + " was killed by signal " + signal_name(signal) + " (" + strsignal(signal) + ")";
      return who + " exited with code " + std::to_string(exit_code);
    }
    case FailureKind::kNodeLost:
      return "the launcher of node " + std::to_string(node) + " was lost (" + detail + ")" +
             (where.empty() ? "" : ": " + where);
    case FailureKind::kLauncherSignal:
      return "the launcher of node " + std::to_string(node) + " received " + signal_name(signal);
  }
  return "unknown failure";
}

std::vector<std::string> Failure::report_lines() const {
  std::vector<std::string> lines;
  if (kind != FailureKind::kRankExit) {
    lines.push_back("smprun: " + describe() + " -- stopping all ranks");
    return lines;
  }
  lines.push_back("smprun: " + describe() + " -- failed first; stopping all ranks");
  if (tail.empty()) {
    lines.push_back("smprun: rank " + std::to_string(rank) + " printed nothing");
    return lines;
  }
  lines.push_back("smprun: last " + std::to_string(tail.size()) + " lines of rank " +
                  std::to_string(rank) + "'s output:");
  for (const auto& line : tail) {
    std::string l = prefixed_line(rank, line);
    l.pop_back();  // report lines carry no '\n'
    lines.push_back(std::move(l));
  }
  return lines;
}

nlohmann::json Failure::to_json() const {
  return {{"kind", static_cast<int>(kind)}, {"node", node},         {"rank", rank},
          {"local_rank", local_rank},       {"exit_code", exit_code}, {"signal", signal},
          {"detail", detail},               {"tail", tail},         {"where", where}};
}

Failure Failure::from_json(const nlohmann::json& j) {
  Failure f;
  int kind = j.at("kind").get<int>();
  if (kind < 0 || kind > static_cast<int>(FailureKind::kLauncherSignal))
    throw nlohmann::json::other_error::create(501, "bad failure kind", &j);
  f.kind = static_cast<FailureKind>(kind);
  f.node = j.at("node").get<int>();
  f.rank = j.at("rank").get<int>();
  f.local_rank = j.at("local_rank").get<int>();
  f.exit_code = j.at("exit_code").get<int>();
  f.signal = j.at("signal").get<int>();
  f.detail = j.at("detail").get<std::string>();
  f.tail = j.at("tail").get<std::vector<std::string>>();
  f.where = j.value("where", std::string());
  return f;
}

}  // namespace smp::launcher
