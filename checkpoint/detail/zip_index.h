// Reads the central directory of a zip (as torch.save writes it: stored entries, zip64
// when large) to find where each record's bytes lie. Internal to smp::checkpoint.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace smp::checkpoint::detail {

struct ZipRecord {
  std::string name;
  uint64_t offset = 0;  // first byte of the record's data
  uint64_t size = 0;
};

// Reads with pread from `fd`; the end-of-central-directory record sits at `eocd_offset`.
// Returns the records sorted by offset. Throws CheckpointError naming `path`.
std::vector<ZipRecord> read_zip_index(int fd, uint64_t eocd_offset, const std::string& path);

}  // namespace smp::checkpoint::detail
