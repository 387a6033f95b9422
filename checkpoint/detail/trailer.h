// The end of an smp checkpoint file, where its zip comment holds smp's trailer:
// the Manifest (Boost text archive), then its length, its XXH3-64 and the magic
// (kFooter bytes). The file helpers are shared with checkpoint.cpp. No torch:
// tests/fuzz/checkpoint_fuzz.cpp fuzzes read_trailer with read_zip_index.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "checkpoint/manifest.h"

namespace smp::checkpoint::detail {

constexpr char kMagic[9] = "SMPCKPT1";
constexpr size_t kFooter = 24;  // manifest length, manifest hash, magic
constexpr size_t kEocd = 22;    // a zip's end record without its comment
constexpr size_t kMaxTrailer = 0xFFFF;  // the zip comment length is 16 bits

// "smp: checkpoint '<path>': <what>: <errno text>".
std::string sys_error(const std::string& what, const std::string& path);

// Owns a file descriptor.
struct Fd {
  int fd = -1;
  explicit Fd(int f) : fd(f) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd();
};

uint64_t le64(const unsigned char* p);
void put64(std::string& s, uint64_t v);

// Reads exactly n bytes at `off`; throws CheckpointError (truncated, or an I/O error).
void pread_all(int fd, void* buf, size_t n, uint64_t off, const std::string& path);

// Writes exactly n bytes at `off`; throws CheckpointError (an I/O error, a full disk).
void pwrite_all(int fd, const void* buf, size_t n, uint64_t off, const std::string& path);

// Appends `m`'s trailer to the zip of `size` bytes in `fd` (ending with a comment-less
// end record): the comment length at size - 2, then manifest and footer. No fsync.
void append_trailer(int fd, uint64_t size, const Manifest& m, const std::string& path);

// The manifest of the file `fd` (`path` for messages), checked against the file: the
// trailer's magic, length and hash, the format version, the payload's size, and the
// zip comment length. Sets *size_out to the file's size. Throws CheckpointError.
Manifest read_trailer(int fd, const std::string& path, uint64_t* size_out);

}  // namespace smp::checkpoint::detail
