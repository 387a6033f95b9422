#include "launcher/line_buffer.h"

#include <poll.h>
#include <unistd.h>

#include <cerrno>

namespace smp::launcher {

void LineSplitter::append(std::string_view data, const LineFn& on_line) {
  while (!data.empty()) {
    size_t nl = data.find('\n');
    std::string_view piece = nl == std::string_view::npos ? data : data.substr(0, nl);
    if (pending_.size() + piece.size() >= max_line_) {
      // Too long for one line: emit max_line_ bytes and keep going.
      size_t take = max_line_ - pending_.size();
      pending_.append(piece.substr(0, take));
      on_line(pending_);
      pending_.clear();
      data.remove_prefix(take);
      continue;
    }
    if (nl == std::string_view::npos) {
      pending_.append(piece);
      return;
    }
    if (pending_.empty()) {
      on_line(piece);
    } else {
      pending_.append(piece);
      on_line(pending_);
      pending_.clear();
    }
    data.remove_prefix(nl + 1);
  }
}

void LineSplitter::flush(const LineFn& on_line) {
  if (pending_.empty()) return;
  on_line(pending_);
  pending_.clear();
}

std::string prefixed_line(int rank, std::string_view line) {
  std::string out;
  out.reserve(line.size() + 16);
  out += '[';
  out += std::to_string(rank);
  out += "] ";
  out.append(line);
  out += '\n';
  return out;
}

std::string clip_tail_line(std::string_view line) {
  if (line.size() <= kMaxTailLineBytes) return std::string(line);
  return std::string(line.substr(0, kMaxTailLineBytes)) + " [... " +
         std::to_string(line.size() - kMaxTailLineBytes) + " more bytes]";
}

void OutputTail::push(std::string_view line) {
  if (max_lines_ == 0) return;
  if (lines_.size() == max_lines_) lines_.pop_front();
  lines_.push_back(clip_tail_line(line));
}

std::vector<std::string> OutputTail::snapshot(const std::vector<std::string>& partial) const {
  std::vector<std::string> out(lines_.begin(), lines_.end());
  for (const auto& p : partial) {
    if (!p.empty()) out.push_back(clip_tail_line(p));
  }
  while (out.size() > max_lines_) out.erase(out.begin());
  return out;
}

bool write_all(int fd, std::string_view data) {
  while (!data.empty()) {
    ssize_t n = write(fd, data.data(), data.size());
    if (n > 0) {
      data.remove_prefix(static_cast<size_t>(n));
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0 && errno == EAGAIN) {
      // A non-blocking console (inherited O_NONBLOCK): wait until it drains.
      pollfd p{fd, POLLOUT, 0};
      poll(&p, 1, 100);
    } else {
      return false;
    }
  }
  return true;
}

}  // namespace smp::launcher
