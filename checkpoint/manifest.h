// The manifest every smp checkpoint file carries: what was saved, by which job, and
// the hash that verifies the rest of the file. Serialized with Boost.Serialization
// (text archive: portable across architectures, ~300 bytes).
#pragma once

#include <cstdint>
#include <string>

namespace smp::checkpoint {

// Bumped when the file layout or the manifest's fields change. Version 2 adds the
// entry table (checkpoint/entries.h): each record's offset, length and chunk hashes,
// so a reader can read and verify only the records it keeps. Version 1 files (one
// hash over the whole payload) still load.
constexpr uint32_t kFormatVersion = 2;
constexpr uint32_t kOldestFormatVersion = 1;

struct Manifest {
  // Layout version of the file (kFormatVersion when written by this smp).
  uint32_t format_version = kFormatVersion;
  // Identifies one save: every part of one partial save carries the same id.
  uint64_t save_id = 0;
  // Wall-clock time of the save (ns since the epoch): orders generations.
  uint64_t save_time_ns = 0;
  // True: one part of a partial save (file `f_{part}`); false: a full file.
  bool partial = false;
  // This file's part index (the saving rank's pp_rank) and the number of parts.
  int32_t part = 0;
  int32_t parts = 1;
  // Topology of the saving job.
  int32_t world_size = 1;
  int32_t pp_size = 1;
  int32_t dp_size = 1;
  // Hash of the partition plan of the saving job (0: not partitioned yet).
  uint64_t plan_hash = 0;
  // Bytes of the torch zip in front of the trailer, and their XXH3-64 hash (the last
  // two bytes, the zip comment length, are checked against the trailer instead).
  uint64_t payload_size = 0;
  uint64_t payload_hash = 0;
  // Versions of the writer, for messages.
  std::string torch_version;
  // Version 2: where the entry table (a zip record, covered by payload_hash too) lies,
  // its XXH3-64, and the chunk size its per-record hashes use (0: no table, version 1).
  uint64_t entries_offset = 0;
  uint64_t entries_size = 0;
  uint64_t entries_hash = 0;
  uint64_t entry_chunk = 0;

  std::string encode() const;
  // Throws CheckpointError naming `path` when `text` is not a manifest.
  static Manifest decode(const std::string& text, const std::string& path);
  // One line for error messages: "save 0x.. part 1/2 (pp 2 x dp 1)".
  std::string describe() const;
};

}  // namespace smp::checkpoint
