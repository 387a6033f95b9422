// Plain TCP sockets for the pipeline transport (smp_core/p2p): a listener, a full mesh
// of connections among the ranks of a group, and exact reads / gathered writes.
//
// Why not Gloo's send/recv: a Gloo message wakes Gloo's event-loop thread, which then
// wakes the waiting receiver; on loopback a 96 KiB message cost ~210 us of CPU and a
// round trip ~190 us. A blocking socket read in the receiver thread itself cost ~20 us
// and ~40 us (measured on the 2-core CI machine, bench/pipeline.py's message size).
// The pipeline sends a few dozen such messages per step, each waking a thread on a
// core that another microbatch computes on, so every wakeup saved is compute time.
//
// Thread-safety: functions are reentrant; one fd must not be written by two threads
// at once (callers serialize writes per peer).
#pragma once

#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "smp_core/detail/auth.h"

namespace smp::detail {

// The local IPv4 address this host uses to reach `host` (the route's source address;
// nothing is sent). 127.0.0.1 when `host` is a loopback name or cannot be resolved.
std::string local_address_toward(const std::string& host);

// A listening TCP socket on the IPv4 address `host` (only there: a rank publishing
// 127.0.0.1 is not reachable from other machines) and an ephemeral port.
class Listener {
 public:
  explicit Listener(const std::string& host);
  ~Listener();
  Listener(const Listener&) = delete;
  Listener& operator=(const Listener&) = delete;
  int fd() const { return fd_; }
  int port() const { return port_; }

 private:
  int fd_ = -1;
  int port_ = 0;
};

// Connects rank `rank` to every other rank of a group of addresses.size() ranks
// ("ip:port" of each rank's listener; all ranks call this together). Lower ranks
// accept, higher ranks connect. A hello (magic, `nonce` naming the mesh, rank) says
// who connects, then both ends prove `key` (Note [Job secret] in auth.h), bound to
// the mesh and the two ranks. A connection that fails either is closed before any
// byte of it is decoded and logged on stderr with its address, and the wait goes on.
// Returns one connected fd per rank (-1 for `rank` itself), with TCP_NODELAY, large
// buffers and a send timeout of `timeout_s`. Throws CommError/TimeoutError naming the
// ranks that never connected, or a peer this rank connected to that failed to prove
// the key.
std::vector<int> connect_mesh(Listener& listener, int rank,
                              const std::vector<std::string>& addresses, uint64_t nonce,
                              const auth::Key& key, double timeout_s);

// Reads exactly `n` bytes. Returns false if the peer closed the connection before the
// first byte (a clean end); throws CommError on any other failure or a short read.
bool read_exact(int fd, void* buf, size_t n);

// Writes every byte of `iov` (gathered), retrying partial writes. Throws CommError
// (TimeoutError if the peer stopped reading for longer than the send timeout).
void write_all(int fd, std::vector<iovec> iov);

}  // namespace smp::detail
