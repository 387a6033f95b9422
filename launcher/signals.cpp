#include "launcher/signals.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>

namespace smp::launcher {

namespace {

int g_pipe[2] = {-1, -1};

void on_signal(int sig) {
  int saved = errno;
  unsigned char byte = static_cast<unsigned char>(sig);
  // A full pipe drops the byte; SIGCHLD is re-checked every loop turn anyway.
  ssize_t ignored = write(g_pipe[1], &byte, 1);
  (void)ignored;
  errno = saved;
}

}  // namespace

void SignalPipe::install() {
  if (g_pipe[0] >= 0) return;
  if (pipe2(g_pipe, O_CLOEXEC | O_NONBLOCK) != 0) g_pipe[0] = g_pipe[1] = -1;
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  for (int sig : {SIGCHLD, SIGINT, SIGTERM, SIGHUP}) sigaction(sig, &sa, nullptr);
  signal(SIGPIPE, SIG_IGN);
}

int SignalPipe::fd() { return g_pipe[0]; }

PendingSignals SignalPipe::drain() {
  PendingSignals p;
  unsigned char buf[64];
  for (;;) {
    ssize_t n = read(g_pipe[0], buf, sizeof(buf));
    if (n <= 0) break;
    for (ssize_t i = 0; i < n; ++i) {
      if (buf[i] == SIGCHLD) {
        p.child = true;
      } else {
        p.terminating.push_back(buf[i]);
      }
    }
  }
  return p;
}

}  // namespace smp::launcher
