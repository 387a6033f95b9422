// Error types of smp. One type per kind of fault, so bindings can map each to a
// Python exception (ConfigError -> smp.ConfigError, a ValueError).
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace smp {

// A bad setting: names the key, the value and what is allowed.
class ConfigError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// A communication fault: a peer vanished, a wait timed out, ranks disagree.
class CommError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A wait that ran past `timeout_s`; the message names what was awaited.
class TimeoutError : public CommError {
 public:
  using CommError::CommError;
};

namespace detail {
inline void concat(std::ostringstream&) {}
template <typename T, typename... Rest>
void concat(std::ostringstream& os, const T& v, const Rest&... rest) {
  os << v;
  concat(os, rest...);
}
}  // namespace detail

// Joins its arguments with operator<< into one string.
template <typename... Args>
std::string str_cat(const Args&... args) {
  std::ostringstream os;
  detail::concat(os, args...);
  return os.str();
}

}  // namespace smp

// SMP_CHECK(cond, msg...): throws std::runtime_error "smp: <msg> (file:line)".
#define SMP_CHECK(cond, ...)                                                          \
  do {                                                                                \
    if (!(cond)) {                                                                    \
      throw std::runtime_error(::smp::str_cat("smp: ", __VA_ARGS__, " (", __FILE__, \
                                              ":", __LINE__, ")"));                   \
    }                                                                                 \
  } while (0)
