// Line assembly for rank output: bytes read from a rank's pipe come in arbitrary chunks;
// the launcher emits only whole lines, each with a single write(), so lines of different
// ranks never interleave mid-line. Pure data structures, not thread-safe (the launcher is
// single-threaded).
#pragma once

#include <cstddef>
#include <deque>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace smp::launcher {

// A line longer than this is emitted in pieces of this size (bounds launcher memory).
constexpr size_t kMaxLineBytes = 1 << 20;
// Lines of a failed rank's output shown in the failure report.
constexpr size_t kTailLines = 20;
// Each tail line is cut to this many bytes (the tail also travels between nodes).
constexpr size_t kMaxTailLineBytes = 4096;

// Splits one byte stream into lines (without the '\n').
class LineSplitter {
 public:
  using LineFn = std::function<void(std::string_view line)>;

  explicit LineSplitter(size_t max_line = kMaxLineBytes) : max_line_(max_line) {}

  // Appends bytes; calls on_line for every line completed by them, in order.
  void append(std::string_view data, const LineFn& on_line);
  // Emits the unterminated last line, if any (at EOF).
  void flush(const LineFn& on_line);
  // Bytes of the current unterminated line.
  const std::string& pending() const { return pending_; }

 private:
  size_t max_line_;
  std::string pending_;
};

// "[<rank>] <line>\n", the console form of a rank's output line.
std::string prefixed_line(int rank, std::string_view line);

// The last kTailLines lines of one rank's output (stdout and stderr in arrival order).
class OutputTail {
 public:
  explicit OutputTail(size_t max_lines = kTailLines) : max_lines_(max_lines) {}

  void push(std::string_view line);
  void clear() { lines_.clear(); }
  // The stored lines, plus `partial` (an unterminated line) when non-empty.
  std::vector<std::string> snapshot(const std::vector<std::string>& partial = {}) const;

 private:
  size_t max_lines_;
  std::deque<std::string> lines_;
};

// Cuts a line to kMaxTailLineBytes, marking the cut.
std::string clip_tail_line(std::string_view line);

// Writes all of data to fd, retrying on EINTR/EAGAIN; false if the fd is gone (EPIPE...).
bool write_all(int fd, std::string_view data);

}  // namespace smp::launcher
