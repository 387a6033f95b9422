// smp::checkpoint parts: the files of one partial save named one by one (the merge
// tool, `python -m smp.checkpoint merge PART... OUT`), checked as one save and read
// verified, in part order. A partial save is `f_0 .. f_{n-1}` (one per pp rank of the
// saving job); each part's manifest names its save id, its index and the count.
//
// Threads: safe from any thread on distinct paths; takes no GIL (the binding releases it).
#pragma once

#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"

namespace smp::checkpoint {

// Reads the trailers of `paths` and returns them ordered by part index. Throws
// CheckpointError, naming every file concerned, when: no file is given; a file is
// missing, unreadable or not an smp file; a file is a full checkpoint; the files hold
// different saves (of different checkpoints, or of one checkpoint saved several times:
// mixed save ids); a part is given twice; or a part of the save is missing.
std::vector<std::string> order_parts(const std::vector<std::string>& paths);

// order_parts, then read_verified of every part (every byte checked against its
// manifest's hash) before returning any: a damaged part fails the whole merge.
std::vector<VerifiedFile> read_parts(const std::vector<std::string>& paths);

// The checkpoint name a part's file name implies: `ck.pt_1` and `ck.pt_1.prev` ->
// `ck.pt` (the name given to smp.save); any other name is returned as is.
std::string checkpoint_name(const std::string& path);

}  // namespace smp::checkpoint
