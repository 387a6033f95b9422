// The ranks of this node for one attempt of the job: start, read output, reap, stop.
//
// Single-threaded, driven by the launcher's poll loop: add_poll_fds() / on_readable() for
// output, reap() after SIGCHLD (or every loop turn), tick() for the SIGTERM->SIGKILL timer.
// Each rank's stdout and stderr are pipes read non-blocking; whole lines go to the console
// prefixed "[r] " (stdout to stdout, stderr to stderr) and, with --log_dir, unprefixed to
// DIR/rank_<r>.log. The first rank to exit non-zero or by a signal while the group is not
// stopping is first_failure(); deaths caused by stop() are not failures. When every rank
// has exited, leftover members of their process groups (grandchildren) are stopped too,
// so idle() means nothing this attempt started is still running.
#pragma once

#include <poll.h>
#include <sys/types.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "launcher/failure.h"
#include "launcher/line_buffer.h"
#include "launcher/options.h"

namespace smp::launcher {

class LocalGroup {
 public:
  // master_port is the resolved MASTER_PORT of the ranks.
  LocalGroup(const LaunchOptions& options, const EnvMap& base_env, int master_port);
  ~LocalGroup();

  // Starts every local rank with SMP_RESTART_COUNT=attempt. Log files are truncated on
  // attempt 0 and appended to afterwards. Returns "" or an error (fork/pipe failure).
  std::string start(int attempt);

  // Appends the pipe fds still open (POLLIN).
  void add_poll_fds(std::vector<pollfd>* fds) const;
  // Reads what is available on `fd` (one of the pipe fds).
  void on_readable(int fd);
  // Collects exited children (non-blocking); records the first failure.
  void reap();
  // Sends `sig` to every rank's process group and arms the SIGKILL timer
  // (--grace_period). No-op if already stopping (use kill_now() to escalate).
  void stop(int sig);
  // SIGKILL to every process group now.
  void kill_now();
  // Fires the SIGKILL timer; closes pipes of ranks that are gone; stops leftovers.
  void tick(double now);
  // Seconds until tick() has work (poll timeout); a large value if none.
  double next_timeout(double now) const;

  bool started() const { return !slots_.empty(); }
  bool stopping() const { return stopping_; }
  // Every rank process has been reaped.
  bool all_exited() const;
  // all_exited, process groups empty (or SIGKILLed), all output read and emitted.
  bool idle() const;
  // idle and every rank exited 0.
  bool succeeded() const;
  const std::optional<Failure>& first_failure() const { return first_failure_; }

 private:
  struct Slot;
  void read_pipe(Slot& slot, int which);
  void close_pipe(Slot& slot, int which);
  void emit_line(Slot& slot, int which, std::string_view line);
  bool group_alive(const Slot& slot) const;
  void signal_groups(int sig);

  const LaunchOptions& options_;
  EnvMap base_env_;
  int master_port_;
  std::vector<int> cpus_;  // usable_cpu_list(), read once
  int cores_;
  bool console_;
  std::vector<std::unique_ptr<Slot>> slots_;
  std::vector<int> log_fds_;
  std::optional<Failure> first_failure_;
  bool stopping_ = false;
  bool killed_ = false;
  // Set a while after SIGKILL: members that still linger (D state) are not waited for.
  bool gave_up_ = false;
  double kill_at_ = 0;
  double killed_at_ = 0;
};

}  // namespace smp::launcher
