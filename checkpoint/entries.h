// The entry table of a version 2 checkpoint file: for each zip record, where its
// bytes lie and the XXH3-64 of each `chunk`-sized piece of them, so a reader verifies
// only the records it keeps (a rank its own parameters of a resharded save). The
// table is itself a record of the zip (kEntriesRecord), located and hashed by the
// manifest. No torch: tests/fuzz can feed decode_entries anything.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace smp::checkpoint {

// The record's name inside the zip (after the archive's "<name>/" prefix).
constexpr char kEntriesRecord[] = ".smp/entries";
// Chunk size of the per-record hashes: a 1 GB tensor carries 64 hashes.
constexpr uint64_t kEntryChunk = uint64_t{16} << 20;

struct Entry {
  std::string name;   // as in the zip, e.g. "archive/data/0"
  uint64_t offset = 0;
  uint64_t size = 0;
  std::vector<uint64_t> chunk_hashes;  // ceil(size / chunk) of them (one for size 0)
};

// Little-endian: u32 count, then per entry u32 name length, name, u64 offset, u64 size,
// u32 chunk count, u64 hashes.
std::string encode_entries(const std::vector<Entry>& entries);

// Throws CheckpointError naming `path` when `bytes` is not a well-formed table, or an
// entry lies outside [0, payload_size) or has the wrong number of chunk hashes.
std::vector<Entry> decode_entries(const std::string& bytes, uint64_t chunk, uint64_t payload_size,
                                  const std::string& path);

}  // namespace smp::checkpoint
