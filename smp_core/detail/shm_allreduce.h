// Shared-memory reduction for a process group whose ranks all run on this host: the
// reducer's default path. See Note [Shared-memory bucket reduction] in the .cpp.
// Included only from smp_core .cpp files.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "smp_core/comm.h"

namespace smp::detail {

// Elements [begin, end) of a bucket, and the group rank that keeps their sum: -1 for
// every rank (Note [Reduce to owner], detail/reducer_default_hooks.cpp).
struct Segment {
  int64_t begin = 0, end = 0;
  int owner = -1;
  bool operator==(const Segment& o) const {
    return begin == o.begin && end == o.end && owner == o.owner;
  }
};

// Host name, boot id and pid namespace: processes with equal identities can look each
// other up by pid (and share memory).
std::string host_identity();
// True if process `pid` of this host has exited (gone, or a zombie not reaped yet).
bool process_exited(int64_t pid);

class ShmArena : public std::enable_shared_from_this<ShmArena> {
 public:
  // Collective over `pg` (two allgathers and a broadcast, from the calling thread):
  // every rank gets an arena with a slot of `slot_bytes` per rank, or every rank gets
  // null: world size 1, a rank on another host (hostname and boot id differ),
  // SMP_REDUCER_SHM=0 on any rank, or the segment could not be created (/dev/shm full).
  static std::shared_ptr<ShmArena> create(const ProcessGroupPtr& pg, size_t slot_bytes,
                                          double timeout_s, const std::string& what);
  ~ShmArena();

  ShmArena(const ShmArena&) = delete;
  ShmArena& operator=(const ShmArena&) = delete;

  // A flat tensor over bytes [offset, offset + numel * itemsize) of this rank's slot;
  // it keeps the mapping alive.
  at::Tensor slot_tensor(size_t offset, int64_t numel, at::ScalarType dtype);

  // Sets that region of every rank's slot to the sum over ranks. A `shadow` rank counts
  // as zeros and its slot is left as it is. Every rank calls it in the same order (one
  // comm thread each); blocks until all ranks have finished; a rank that does not
  // arrive within `timeout_s` makes it throw TimeoutError naming `what` and the ranks.
  void allreduce(size_t offset, int64_t numel, at::ScalarType dtype, bool shadow,
                 double timeout_s, const std::string& what);
  // The same, by segment of the region (elements from `offset`): a segment with an
  // owner is summed into that rank's slot only (the other slots keep their own
  // values); one with owner -1 into every slot. One round: as costly as allreduce.
  void reduce_segments(size_t offset, const std::vector<Segment>& segments,
                       at::ScalarType dtype, bool shadow, double timeout_s,
                       const std::string& what);

  int rank() const { return rank_; }
  int world() const { return world_; }

 private:
  ShmArena() = default;
  std::atomic<uint64_t>* word(int array, int r) const;
  std::atomic<uint32_t>* bell() const;
  char* slot(int r) const;
  void post(int array, uint64_t op);
  void wait_all(int array, uint64_t op, double timeout_s, const std::string& what);

  char* base_ = nullptr;
  size_t bytes_ = 0;
  size_t header_bytes_ = 0;
  size_t slot_bytes_ = 0;
  int rank_ = 0;
  int world_ = 1;
  uint64_t op_ = 0;  // operations issued by this rank (the same sequence everywhere)
  std::vector<int> global_;  // group rank -> global rank (errors name global ranks)
};

}  // namespace smp::detail
