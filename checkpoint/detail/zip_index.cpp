#include "checkpoint/detail/zip_index.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "checkpoint/checkpoint_error.h"
#include "smp_core/errors.h"

namespace smp::checkpoint::detail {
namespace {

uint64_t le(const unsigned char* p, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

std::vector<unsigned char> read_at(int fd, uint64_t off, size_t n, const std::string& path) {
  std::vector<unsigned char> buf(n);
  size_t got = 0;
  while (got < n) {
    ssize_t r = ::pread(fd, buf.data() + got, n - got, static_cast<off_t>(off + got));
    if (r <= 0) {
      throw CheckpointError(str_cat("smp: checkpoint '", path, "': zip directory unreadable at byte ",
                                    off + got, " (truncated?)"));
    }
    got += static_cast<size_t>(r);
  }
  return buf;
}

[[noreturn]] void bad(const std::string& path, const std::string& what) {
  throw CheckpointError(str_cat("smp: checkpoint '", path, "': ", what));
}

}  // namespace

std::vector<ZipRecord> read_zip_index(int fd, uint64_t eocd_offset, const std::string& path) {
  auto eocd = read_at(fd, eocd_offset, 22, path);
  if (le(eocd.data(), 4) != 0x06054b50) bad(path, "no zip end record where the manifest says");
  uint64_t entries = le(&eocd[10], 2);
  uint64_t cd_size = le(&eocd[12], 4);
  uint64_t cd_off = le(&eocd[16], 4);
  if (entries == 0xFFFF || cd_size == 0xFFFFFFFFu || cd_off == 0xFFFFFFFFu) {
    if (eocd_offset < 20) bad(path, "zip64 locator missing");
    auto loc = read_at(fd, eocd_offset - 20, 20, path);
    if (le(loc.data(), 4) != 0x07064b50) bad(path, "zip64 locator missing");
    auto z = read_at(fd, le(&loc[8], 8), 56, path);
    if (le(z.data(), 4) != 0x06064b50) bad(path, "zip64 end record missing");
    entries = le(&z[32], 8);
    cd_size = le(&z[40], 8);
    cd_off = le(&z[48], 8);
  }
  // Written as subtractions: a zip64 record's 64-bit fields could wrap a sum around.
  if (cd_off > eocd_offset || cd_size > eocd_offset - cd_off)
    bad(path, "zip directory lies past its end record");
  auto cd = read_at(fd, cd_off, cd_size, path);
  std::vector<ZipRecord> out;
  size_t p = 0;
  for (uint64_t i = 0; i < entries; ++i) {
    if (p + 46 > cd.size() || le(&cd[p], 4) != 0x02014b50) bad(path, "zip directory entry damaged");
    uint64_t method = le(&cd[p + 10], 2);
    uint64_t csize = le(&cd[p + 20], 4);
    uint64_t usize = le(&cd[p + 24], 4);
    size_t nlen = le(&cd[p + 28], 2), xlen = le(&cd[p + 30], 2), clen = le(&cd[p + 32], 2);
    uint64_t lh = le(&cd[p + 42], 4);
    if (p + 46 + nlen + xlen + clen > cd.size()) bad(path, "zip directory entry damaged");
    std::string name(reinterpret_cast<const char*>(&cd[p + 46]), nlen);
    // zip64 extra field: the 0xFFFFFFFF fields, in order usize, csize, offset.
    size_t x = p + 46 + nlen, xend = x + xlen;
    while (x + 4 <= xend) {
      uint64_t id = le(&cd[x], 2), sz = le(&cd[x + 2], 2);
      if (id == 1) {
        size_t q = x + 4;
        if (usize == 0xFFFFFFFFu && q + 8 <= xend) { usize = le(&cd[q], 8); q += 8; }
        if (csize == 0xFFFFFFFFu && q + 8 <= xend) { csize = le(&cd[q], 8); q += 8; }
        if (lh == 0xFFFFFFFFu && q + 8 <= xend) { lh = le(&cd[q], 8); q += 8; }
      }
      x += 4 + sz;
    }
    if (method != 0 || csize != usize) bad(path, str_cat("record '", name, "' is compressed"));
    if (lh > cd_off) bad(path, str_cat("record '", name, "' lies past the directory"));
    auto hdr = read_at(fd, lh, 30, path);
    if (le(hdr.data(), 4) != 0x04034b50) bad(path, str_cat("record '", name, "' header damaged"));
    const uint64_t data = lh + 30 + le(&hdr[26], 2) + le(&hdr[28], 2);  // lh < 2^64 - 2^17
    if (data > cd_off || usize > cd_off - data)
      bad(path, str_cat("record '", name, "' overlaps the directory"));
    out.push_back({std::move(name), data, usize});
    p += 46 + nlen + xlen + clen;
  }
  std::sort(out.begin(), out.end(),
            [](const ZipRecord& a, const ZipRecord& b) { return a.offset < b.offset; });
  for (size_t i = 1; i < out.size(); ++i) {
    if (out[i].offset - out[i - 1].offset < out[i - 1].size) bad(path, "zip records overlap");
  }
  return out;
}

}  // namespace smp::checkpoint::detail
