// Reading a version 2 checkpoint file by entry: the trailer and the entry table are
// read and checked, the file is mapped, and each record is a tensor over its mapped
// bytes, read from disk only when touched. `verify(name)` hashes one record against the
// table (once), so a reader that keeps some records reads and verifies only those.
// See Note [Reads by entry] in mapped.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "checkpoint/entries.h"
#include "checkpoint/manifest.h"

namespace smp::checkpoint {

class MappedFile {
 public:
  // Throws CheckpointError naming the file: no trailer, a damaged entry table, or a
  // version 1 file (no table: read it whole with read_verified).
  explicit MappedFile(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const std::string& path() const { return path_; }
  const Manifest& manifest() const { return manifest_; }
  const std::vector<Entry>& entries() const { return entries_; }
  bool has(const std::string& name) const { return index_.count(name) != 0; }

  // The record's bytes (uint8, its own storage over the mapping, which it keeps alive;
  // writes stay private to this process). Not verified.
  at::Tensor record(const std::string& name) const;
  // Hashes the record against the entry table, once (later calls return at once).
  // Throws CheckpointError naming the file and the record on a mismatch.
  void verify(const std::string& name);
  // verify, then record.
  at::Tensor verified(const std::string& name);

  // Bytes this process has verified through MappedFile (each read from the file
  // once), and bytes of trailers and entry tables read: what a load read.
  static uint64_t bytes_read();

 private:
  const Entry& entry(const std::string& name) const;

  std::string path_;
  Manifest manifest_;
  std::vector<Entry> entries_;
  std::map<std::string, size_t> index_;
  std::shared_ptr<void> map_;  // the mapping; munmap when the last tensor over it goes
  uint64_t size_ = 0;
  std::mutex mu_;
  std::vector<bool> verified_;
};

}  // namespace smp::checkpoint
