// smp::checkpoint: atomic, verified checkpoint files.
//
// A file is the zip that torch.save writes (so torch.load reads a full file as is),
// whose zip comment carries a trailer: the Manifest (Boost text archive), then a
// 24-byte footer {u64 manifest length, u64 XXH3-64 of the manifest, "SMPCKPT1"}.
// The manifest holds the XXH3-64 of every payload byte but the comment length.
// See docs/checkpoint.md and Note [Generations] in checkpoint.cpp.
//
// Threads: every function is safe to call from any thread on distinct paths; none
// takes the GIL (the bindings release it).
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <utility>
#include <vector>

#include "checkpoint/checkpoint_error.h"
#include "checkpoint/manifest.h"

namespace smp::checkpoint {

// Seals the torch zip at `tmp_path` (just written, in the target's directory): hashes
// it, stores size and hash in `m`, appends the manifest as the zip comment and fsyncs.
// The file has the version 1 layout (no entry table: read whole); smp's own saves use
// write_sealed (writer.h), which writes the zip itself with its entry table.
// Throws CheckpointError if the file is not a comment-less zip.
void seal(const std::string& tmp_path, Manifest& m);

// Commits `tmp_path` as `final_path`: rename, then fsync of the directory. With
// `keep_previous` an existing `final_path` is first hard-linked to `final_path.prev`
// (itself replaced atomically), so a multi-file save interrupted between its renames
// still leaves one whole generation. See Note [Generations].
void publish(const std::string& tmp_path, const std::string& final_path, bool keep_previous);

// Removes `final_path.prev` if present (the save it guarded is complete).
void drop_previous(const std::string& final_path);

// Writes `bytes` to `path` atomically (temporary, fsync, rename, fsync directory).
void write_file_atomic(const std::string& path, const std::string& bytes);

// Reads and checks the trailer only (cheap: the last bytes of the file).
// Throws CheckpointError naming the file: missing, truncated, no smp trailer.
Manifest read_manifest(const std::string& path);

// True if `path` ends with an smp trailer (false for a plain torch.save file).
bool has_manifest(const std::string& path);

struct Record {
  std::string name;  // as in the zip, e.g. "archive/data/0"
  at::Tensor bytes;  // uint8, CPU, owns its memory
};

struct VerifiedFile {
  Manifest manifest;
  std::vector<Record> records;
};

// Reads every record of `path` into its own tensor and checks the whole payload
// against the manifest's hash before returning. Throws CheckpointError naming the
// file and the fault (truncated, checksum mismatch, damaged directory).
VerifiedFile read_verified(const std::string& path);

// Checks the whole payload of `path` against its manifest's hash without keeping any
// of it (a streaming pass through one scratch buffer), so a caller can then map the
// file and read only the records it needs. Throws as read_verified.
Manifest verify(const std::string& path);

// One candidate file of a partial save and what its trailer said.
struct Candidate {
  std::string path;
  bool ok = false;
  Manifest manifest;   // valid when ok
  std::string error;   // why not, when !ok
};

// The newest save of which every part is among `by_part[p]` (the current file `f_p`
// and `f_p.prev`); returns the path of each part. With no such save, throws
// CheckpointError describing every candidate (missing part, mixed saves).
std::vector<std::string> choose_generation(const std::string& base,
                                           const std::vector<std::vector<Candidate>>& by_part);

// Lists `base_p` and `base_p.prev` for p = 0.. (until neither exists) with their
// manifests, then choose_generation. Returns the parts' paths and part 0's manifest.
std::pair<std::vector<std::string>, Manifest> resolve_partial(const std::string& base);

}  // namespace smp::checkpoint
