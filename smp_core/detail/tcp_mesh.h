// Plain sockets for the pipeline transport (smp_core/p2p): a listener, a full mesh of
// connections among the ranks of a group, and exact reads / gathered writes. Two ranks
// on one host (and one network namespace) connect by a local socket, others by TCP:
// Note [Local sockets].
//
// Why not Gloo's send/recv: a Gloo message wakes Gloo's event-loop thread, which then
// wakes the waiting receiver; on loopback a 96 KiB message cost ~210 us of CPU and a
// round trip ~190 us. A blocking socket read in the receiver thread itself cost ~20 us
// and ~40 us (measured on the 2-core CI machine, bench/pipeline.py's message size).
// The pipeline sends a few dozen such messages per step, each waking a thread on a
// core that another microbatch computes on, so every wakeup saved is compute time.
//
// Note [Local sockets]: on loopback a TCP send runs the whole TCP/IP stack of both ends
// in the sender's system call. Measured on the 2-core CI machine with P2PEngine, one
// rank per core: a 4 B message took 18.5 us to send and 77 us a round trip over TCP,
// 5 us and 52 us over a Unix-domain stream socket (96 KiB: 25 and 101 us, 11.5 and
// 83 us). A serving rank sends its answers while it holds the compute token, so that
// time is the pipeline's. So a listener also listens on an abstract Unix socket, its
// address names it with this host's identity (boot id and network namespace, which
// bound who can reach an abstract socket), and a peer of the same identity connects
// there; any other peer, or a local connect that fails, uses TCP. The hello and the
// handshake are the same on both (Note [Job secret]): a local socket is no more open to
// strangers than the TCP port on loopback. SMP_P2P_LOCAL_SOCKET=0 keeps every
// connection on TCP.
//
// Thread-safety: functions are reentrant; one fd must not be written by two threads
// at once (callers serialize writes per peer).
#pragma once

#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "smp_common/auth.h"

namespace smp::detail {

// The local IPv4 address this host uses to reach `host` (the route's source address;
// nothing is sent). 127.0.0.1 when `host` is a loopback name or cannot be resolved.
std::string local_address_toward(const std::string& host);

// Whether SMP_P2P_LOCAL_SOCKET allows local sockets (unset or "1": yes, "0": no);
// throws ConfigError naming the variable, its value and the allowed values otherwise.
bool local_sockets_enabled();

// A listening TCP socket on the IPv4 address `host` (only there: a rank publishing
// 127.0.0.1 is not reachable from other machines) and an ephemeral port, and with
// `local`, an abstract Unix socket beside it (Note [Local sockets]; none where the
// system refuses one).
class Listener {
 public:
  explicit Listener(const std::string& host, bool local = false);
  ~Listener();
  Listener(const Listener&) = delete;
  Listener& operator=(const Listener&) = delete;
  int fd() const { return fd_; }
  int local_fd() const { return local_fd_; }  // -1: none
  int port() const { return port_; }
  // What peers connect to: "ip:port", and with a local socket " local=<name>@<host id>".
  std::string address() const;

 private:
  std::string host_;
  int fd_ = -1;
  int port_ = 0;
  int local_fd_ = -1;
  std::string local_name_;
};

// Connects rank `rank` to every other rank of a group of addresses.size() ranks
// (each rank's Listener::address(), or "ip:port"; all ranks call this together).
// Lower ranks accept, higher ranks connect. A hello (magic, `nonce` naming the mesh,
// rank) says who connects, then both ends prove `key` (Note [Job secret] in auth.h),
// bound to the mesh and the two ranks. A connection that fails either is closed before
// any byte of it is decoded and logged on stderr with its address, and the wait goes
// on. Returns one connected fd per rank (-1 for `rank` itself): a local socket where
// the peer's address offers one on this host (Note [Local sockets]), else TCP with
// TCP_NODELAY; large buffers and a send timeout of `timeout_s` either way. Throws
// CommError/TimeoutError naming the ranks that never connected, or a peer this rank
// connected to that failed to prove the key.
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
