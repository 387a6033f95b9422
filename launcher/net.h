// Small TCP helpers for the launcher (IPv4/IPv6 via getaddrinfo). All sockets returned are
// close-on-exec, so ranks never inherit them; the caller owns and closes each fd. Errors
// come back as a message naming the address and the errno text; nothing throws.
#pragma once

#include <string>

namespace smp::launcher {

// Returns a bound (not listening) TCP socket on addr:port with SO_REUSEADDR, or -1 and
// *error. If addr resolves to no local interface (EADDRNOTAVAIL), binds the wildcard
// address instead, so a node 0 whose public name is not bindable still works.
int bind_tcp(const std::string& addr, int port, std::string* error);

// bind_tcp + listen(); non-blocking.
int listen_tcp(const std::string& addr, int port, std::string* error);

// Asks the kernel for a free ephemeral port on addr (bind to port 0); 0 and *error on failure.
int pick_free_port(const std::string& addr, std::string* error);

// Starts a non-blocking connect to addr:port. Returns the fd (connection may still be in
// progress: wait for POLLOUT, then call finish_connect) or -1 and *error.
int start_connect(const std::string& addr, int port, std::string* error);

// After POLLOUT on a connecting fd: true if connected, else false and *error.
bool finish_connect(int fd, std::string* error);

// Sets O_NONBLOCK on fd.
void set_nonblocking(int fd);

// "host:port" for messages.
std::string host_port(const std::string& addr, int port);

}  // namespace smp::launcher
