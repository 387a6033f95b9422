// Routes the launcher's signals into its poll loop (the self-pipe trick).
//
// install() sets handlers for SIGCHLD, SIGINT, SIGTERM and SIGHUP that only write the
// signal number to a non-blocking close-on-exec pipe, and ignores SIGPIPE (a closed
// console must not kill the launcher). Ranks get default dispositions back in
// rank_process.cpp. Process-wide state: call install() once, from the main thread.
#pragma once

#include <vector>

namespace smp::launcher {

struct PendingSignals {
  // A child changed state: call waitpid.
  bool child = false;
  // SIGINT/SIGTERM/SIGHUP received since the last drain, in arrival order.
  std::vector<int> terminating;
};

class SignalPipe {
 public:
  static void install();
  // Read end of the pipe, for poll().
  static int fd();
  // Reads everything pending without blocking.
  static PendingSignals drain();
};

}  // namespace smp::launcher
