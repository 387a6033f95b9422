#include "launcher/local_group.h"

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstring>

#include "launcher/control_channel.h"
#include "launcher/net.h"
#include "launcher/rank_process.h"

namespace smp::launcher {

namespace {

// Bytes read from one pipe per loop turn, so one chatty rank cannot starve the others.
constexpr size_t kReadBudget = 1 << 20;
// After SIGKILL, how long lingering group members are waited for.
constexpr double kKillWaitS = 1.0;

}  // namespace

struct LocalGroup::Slot {
  int local_rank = 0;
  int rank = 0;
  pid_t pid = -1;
  bool exited = false;
  int status = 0;
  bool group_gone = false;
  int fds[2] = {-1, -1};  // read ends of stdout, stderr
  LineSplitter split[2];
  OutputTail tail;
};

LocalGroup::LocalGroup(const LaunchOptions& options, const EnvMap& base_env, int master_port)
    : options_(options),
      base_env_(base_env),
      master_port_(master_port),
      cpus_(usable_cpu_list()),
      cores_(static_cast<int>(cpus_.size())),
      console_(options.log_dir.empty() || options.tee) {}

LocalGroup::~LocalGroup() {
  for (auto& slot : slots_) {
    if (!slot->exited) kill(-slot->pid, SIGKILL);
    for (int fd : slot->fds) {
      if (fd >= 0) close(fd);
    }
  }
  for (int fd : log_fds_) close(fd);
}

std::string LocalGroup::start(int attempt) {
  slots_.clear();
  first_failure_.reset();
  stopping_ = killed_ = gave_up_ = false;
  if (!options_.log_dir.empty() && log_fds_.empty()) {
    for (int l = 0; l < options_.nproc_per_node; ++l) {
      std::string path =
          options_.log_dir + "/rank_" + std::to_string(global_rank(options_, l)) + ".log";
      int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_APPEND | O_CLOEXEC, 0644);
      if (fd < 0) return "cannot open log file '" + path + "': " + std::strerror(errno);
      log_fds_.push_back(fd);
    }
  }
  for (int l = 0; l < options_.nproc_per_node; ++l) {
    auto slot = std::make_unique<Slot>();
    slot->local_rank = l;
    slot->rank = global_rank(options_, l);
    int out[2], err[2];
    if (pipe2(out, O_CLOEXEC) != 0) return std::string("pipe failed: ") + std::strerror(errno);
    if (pipe2(err, O_CLOEXEC) != 0) {
      close(out[0]);
      close(out[1]);
      return std::string("pipe failed: ") + std::strerror(errno);
    }
    EnvMap env = rank_environment(base_env_, options_, l, attempt, master_port_, cores_);
    std::string error;
    const std::vector<int> cpus =
        options_.bind_cores ? rank_cpu_block(cpus_, options_.nproc_per_node, l)
                            : std::vector<int>();
    slot->pid = spawn_rank(options_.command, env, out[1], err[1], &error, cpus);
    close(out[1]);
    close(err[1]);
    slot->fds[0] = out[0];
    slot->fds[1] = err[0];
    set_nonblocking(out[0]);
    set_nonblocking(err[0]);
    if (slot->pid < 0) {
      slot->exited = true;
      slot->group_gone = true;
      slots_.push_back(std::move(slot));
      return error;
    }
    slots_.push_back(std::move(slot));
  }
  return "";
}

void LocalGroup::add_poll_fds(std::vector<pollfd>* fds) const {
  for (const auto& slot : slots_) {
    for (int fd : slot->fds) {
      if (fd >= 0) fds->push_back({fd, POLLIN, 0});
    }
  }
}

void LocalGroup::on_readable(int fd) {
  for (auto& slot : slots_) {
    for (int which = 0; which < 2; ++which) {
      if (slot->fds[which] == fd) return read_pipe(*slot, which);
    }
  }
}

void LocalGroup::emit_line(Slot& slot, int which, std::string_view line) {
  slot.tail.push(line);
  if (console_) write_all(which == 0 ? STDOUT_FILENO : STDERR_FILENO, prefixed_line(slot.rank, line));
  if (!log_fds_.empty()) {
    std::string plain(line);
    plain += '\n';
    write_all(log_fds_[slot.local_rank], plain);
  }
}

void LocalGroup::read_pipe(Slot& slot, int which) {
  char buf[65536];
  size_t budget = kReadBudget;
  auto on_line = [&](std::string_view line) { emit_line(slot, which, line); };
  while (slot.fds[which] >= 0 && budget > 0) {
    ssize_t n = read(slot.fds[which], buf, sizeof(buf));
    if (n > 0) {
      slot.split[which].append(std::string_view(buf, static_cast<size_t>(n)), on_line);
      budget -= std::min(budget, static_cast<size_t>(n));
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0 && errno == EAGAIN) {
      return;
    } else {
      close_pipe(slot, which);  // EOF: every writer is gone
    }
  }
}

void LocalGroup::close_pipe(Slot& slot, int which) {
  if (slot.fds[which] < 0) return;
  slot.split[which].flush([&](std::string_view line) { emit_line(slot, which, line); });
  close(slot.fds[which]);
  slot.fds[which] = -1;
}

void LocalGroup::reap() {
  for (;;) {
    int status = 0;
    pid_t pid = waitpid(-1, &status, WNOHANG);
    if (pid <= 0) break;
    auto it = std::find_if(slots_.begin(), slots_.end(),
                           [&](const auto& s) { return s->pid == pid && !s->exited; });
    if (it == slots_.end()) continue;  // an orphaned grandchild we adopted as subreaper
    Slot& slot = **it;
    slot.exited = true;
    slot.status = status;
    // Everything the rank wrote before dying is in its pipes now: read it for the tail.
    read_pipe(slot, 0);
    read_pipe(slot, 1);
    bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
    if (!ok && !stopping_ && !first_failure_) {
      first_failure_ = Failure::rank_exit(
          options_.node_rank, slot.rank, slot.local_rank, status,
          slot.tail.snapshot({slot.split[0].pending(), slot.split[1].pending()}));
    }
  }
}

bool LocalGroup::group_alive(const Slot& slot) const {
  if (slot.group_gone) return false;
  return kill(-slot.pid, 0) == 0 || errno == EPERM;
}

void LocalGroup::signal_groups(int sig) {
  for (auto& slot : slots_) {
    if (slot->group_gone) continue;
    if (kill(-slot->pid, sig) != 0 && errno == ESRCH) {
      if (!slot->exited) kill(slot->pid, sig);  // not yet in its own group
      if (slot->exited) slot->group_gone = true;
    }
  }
}

void LocalGroup::stop(int sig) {
  if (stopping_) return;
  stopping_ = true;
  kill_at_ = now_s() + options_.grace_period_s;
  signal_groups(sig);
}

void LocalGroup::kill_now() {
  stopping_ = true;
  if (killed_) return;
  killed_ = true;
  killed_at_ = now_s();
  signal_groups(SIGKILL);
}

void LocalGroup::tick(double now) {
  if (stopping_ && !killed_ && now >= kill_at_) kill_now();
  if (killed_ && !gave_up_ && now - killed_at_ > kKillWaitS) gave_up_ = true;
  for (auto& slot : slots_) {
    if (!slot->exited) continue;
    if (!slot->group_gone && !group_alive(*slot)) slot->group_gone = true;
    if (slot->group_gone || gave_up_) {
      // Nobody in the rank's group can write any more: read what is left and close.
      for (int which = 0; which < 2; ++which) {
        read_pipe(*slot, which);
        close_pipe(*slot, which);
      }
    }
  }
  // Every rank is gone: stop what they left behind in their process groups.
  if (all_exited() && !stopping_) {
    bool leftovers = std::any_of(slots_.begin(), slots_.end(),
                                 [](const auto& s) { return !s->group_gone; });
    if (leftovers) stop(SIGTERM);
  }
}

double LocalGroup::next_timeout(double now) const {
  double t = 1e9;
  if (stopping_ && !killed_) t = std::max(0.0, kill_at_ - now);
  for (const auto& slot : slots_) {
    bool pending = slot->exited && (!slot->group_gone || slot->fds[0] >= 0 || slot->fds[1] >= 0);
    if (pending) t = std::min(t, (stopping_ || all_exited()) ? 0.02 : 0.25);
  }
  if (killed_ && !gave_up_) t = std::min(t, 0.05);
  return t;
}

bool LocalGroup::all_exited() const {
  return std::all_of(slots_.begin(), slots_.end(), [](const auto& s) { return s->exited; });
}

bool LocalGroup::idle() const {
  return std::all_of(slots_.begin(), slots_.end(), [&](const auto& s) {
    return s->exited && (s->group_gone || gave_up_) && s->fds[0] < 0 && s->fds[1] < 0;
  });
}

bool LocalGroup::succeeded() const {
  return !first_failure_ && idle() &&
         std::all_of(slots_.begin(), slots_.end(), [](const auto& s) {
           return WIFEXITED(s->status) && WEXITSTATUS(s->status) == 0;
         });
}

}  // namespace smp::launcher
