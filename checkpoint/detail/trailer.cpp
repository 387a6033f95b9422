#include "checkpoint/detail/trailer.h"

#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "checkpoint/checkpoint_error.h"
#include "smp_core/errors.h"

namespace smp::checkpoint::detail {

std::string sys_error(const std::string& what, const std::string& path) {
  return str_cat("smp: checkpoint '", path, "': ", what, ": ", std::strerror(errno));
}

Fd::~Fd() {
  if (fd >= 0) ::close(fd);
}

uint64_t le64(const unsigned char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

void put64(std::string& s, uint64_t v) {
  for (int i = 0; i < 8; ++i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}

void pread_all(int fd, void* buf, size_t n, uint64_t off, const std::string& path) {
  auto* p = static_cast<char*>(buf);
  while (n > 0) {
    ssize_t r = ::pread(fd, p, std::min<size_t>(n, 1 << 30), static_cast<off_t>(off));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) throw CheckpointError(sys_error("read failed", path));
    if (r == 0) throw CheckpointError(str_cat("smp: checkpoint '", path, "': truncated at byte ", off));
    p += r;
    off += static_cast<uint64_t>(r);
    n -= static_cast<size_t>(r);
  }
}

void pwrite_all(int fd, const void* buf, size_t n, uint64_t off, const std::string& path) {
  auto* p = static_cast<const char*>(buf);
  while (n > 0) {
    ssize_t r = ::pwrite(fd, p, std::min<size_t>(n, 1 << 30), static_cast<off_t>(off));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) throw CheckpointError(sys_error("write failed", path));
    p += r;
    off += static_cast<uint64_t>(r);
    n -= static_cast<size_t>(r);
  }
}

void append_trailer(int fd, uint64_t size, const Manifest& m, const std::string& path) {
  std::string trailer = m.encode();
  const uint64_t mhash = XXH3_64bits(trailer.data(), trailer.size());
  const uint64_t mlen = trailer.size();
  put64(trailer, mlen);
  put64(trailer, mhash);
  trailer.append(kMagic, 8);
  if (trailer.size() > kMaxTrailer) {
    throw CheckpointError(str_cat("smp: checkpoint '", path, "': manifest of ", trailer.size(),
                                  " bytes exceeds the zip comment limit ", kMaxTrailer));
  }
  unsigned char clen[2] = {static_cast<unsigned char>(trailer.size() & 0xFF),
                           static_cast<unsigned char>(trailer.size() >> 8)};
  pwrite_all(fd, clen, 2, size - 2, path);
  pwrite_all(fd, trailer.data(), trailer.size(), size, path);
}

// The trailer of `fd`: manifest, with its payload bounds checked against the size.
Manifest read_trailer(int fd, const std::string& path, uint64_t* size_out) {
  struct stat st;
  if (::fstat(fd, &st) != 0) throw CheckpointError(sys_error("stat failed", path));
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  *size_out = size;
  if (size < kFooter + kEocd) {
    throw CheckpointError(str_cat("smp: checkpoint '", path, "': only ", size,
                                  " bytes, no smp trailer (truncated, or not written by smp.save)"));
  }
  unsigned char foot[kFooter];
  pread_all(fd, foot, kFooter, size - kFooter, path);
  if (std::memcmp(foot + 16, kMagic, 8) != 0) {
    throw CheckpointError(str_cat("smp: checkpoint '", path, "': no smp trailer at the end of its ",
                                  size, " bytes (truncated, or not written by smp.save)"));
  }
  const uint64_t mlen = le64(foot), mhash = le64(foot + 8);
  // mlen is bounded first: a length near 2^64 (found by tests/fuzz/checkpoint_fuzz.cpp)
  // wrapped mlen + kFooter around below the limit.
  if (mlen > kMaxTrailer - kFooter || mlen + kFooter + kEocd > size) {
    throw CheckpointError(str_cat("smp: checkpoint '", path, "': trailer damaged (manifest length ",
                                  mlen, ")"));
  }
  std::string text(mlen, '\0');
  pread_all(fd, text.data(), mlen, size - kFooter - mlen, path);
  if (XXH3_64bits(text.data(), text.size()) != mhash) {
    throw CheckpointError(str_cat("smp: checkpoint '", path, "': manifest checksum mismatch (file altered)"));
  }
  Manifest m = Manifest::decode(text, path);
  if (m.format_version < kOldestFormatVersion || m.format_version > kFormatVersion) {
    throw CheckpointError(str_cat("smp: checkpoint '", path, "': format version ", m.format_version,
                                  " is not supported (this smp reads versions ",
                                  kOldestFormatVersion, " to ", kFormatVersion, ")"));
  }
  const uint64_t trailer = mlen + kFooter;
  // Compared as size - trailer (>= kEocd, checked above): payload_size + trailer could
  // wrap around to `size` for a manifest that claims 2^64 - trailer + size bytes.
  if (m.payload_size != size - trailer) {
    throw CheckpointError(str_cat("smp: checkpoint '", path, "': ", size, " bytes but the manifest says ",
                                  m.payload_size + trailer, " (truncated or extended)"));
  }
  unsigned char clen[2];
  pread_all(fd, clen, 2, m.payload_size - 2, path);
  if (static_cast<uint64_t>(clen[0] | (clen[1] << 8)) != trailer) {
    throw CheckpointError(str_cat("smp: checkpoint '", path, "': zip comment length does not match the trailer"));
  }
  return m;
}

}  // namespace smp::checkpoint::detail
