#include "checkpoint/entries.h"

#include <cstring>

#include "checkpoint/checkpoint_error.h"
#include "smp_core/errors.h"

namespace smp::checkpoint {
namespace {

void put(std::string& s, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}

class Cursor {
 public:
  Cursor(const std::string& b, const std::string& path) : b_(b), path_(path) {}
  uint64_t get(int bytes) {
    need(static_cast<uint64_t>(bytes));
    uint64_t v = 0;
    for (int i = 0; i < bytes; ++i) v |= uint64_t{static_cast<unsigned char>(b_[pos_ + i])} << (8 * i);
    pos_ += static_cast<size_t>(bytes);
    return v;
  }
  std::string str(uint64_t n) {
    need(n);
    std::string s = b_.substr(pos_, static_cast<size_t>(n));
    pos_ += static_cast<size_t>(n);
    return s;
  }
  bool done() const { return pos_ == b_.size(); }
  [[noreturn]] void fail(const std::string& what) const {
    throw CheckpointError(str_cat("smp: checkpoint '", path_, "': entry table damaged (", what, ")"));
  }

 private:
  void need(uint64_t n) const {
    if (n > b_.size() - pos_) fail("truncated");
  }
  const std::string& b_;
  const std::string& path_;
  size_t pos_ = 0;
};

}  // namespace

std::string encode_entries(const std::vector<Entry>& entries) {
  std::string s;
  put(s, entries.size(), 4);
  for (const auto& e : entries) {
    put(s, e.name.size(), 4);
    s += e.name;
    put(s, e.offset, 8);
    put(s, e.size, 8);
    put(s, e.chunk_hashes.size(), 4);
    for (uint64_t h : e.chunk_hashes) put(s, h, 8);
  }
  return s;
}

std::vector<Entry> decode_entries(const std::string& bytes, uint64_t chunk, uint64_t payload_size,
                                  const std::string& path) {
  Cursor c(bytes, path);
  if (chunk == 0) c.fail("chunk size 0");
  const uint64_t n = c.get(4);
  std::vector<Entry> out;
  // Each entry takes at least 28 bytes: a count beyond that is damage, not a reason
  // to reserve gigabytes.
  if (n > bytes.size() / 28 + 1) c.fail("entry count " + std::to_string(n));
  out.reserve(static_cast<size_t>(n));
  for (uint64_t i = 0; i < n; ++i) {
    Entry e;
    e.name = c.str(c.get(4));
    e.offset = c.get(8);
    e.size = c.get(8);
    const uint64_t k = c.get(4);
    const uint64_t want = e.size == 0 ? 1 : (e.size + chunk - 1) / chunk;
    if (k != want || e.offset > payload_size || e.size > payload_size - e.offset) {
      c.fail(str_cat("record '", e.name, "' at ", e.offset, " of ", e.size, " bytes with ", k,
                     " chunk hashes"));
    }
    e.chunk_hashes.reserve(static_cast<size_t>(k));
    for (uint64_t j = 0; j < k; ++j) e.chunk_hashes.push_back(c.get(8));
    out.push_back(std::move(e));
  }
  if (!c.done()) c.fail("trailing bytes");
  return out;
}

}  // namespace smp::checkpoint
