#include "smp_core/join_step.h"

#include <algorithm>

#include <ATen/ATen.h>

#include "smp_core/errors.h"
#include "smp_core/join.h"
#include "smp_core/reducer.h"

namespace smp {

// Note [Join step]
// ~~~~~~~~~~~~~~~~
// With uneven inputs, every rank of the dp group must issue the same collectives each
// iteration, whether it still has batches (active) or ran out (joined). After the
// Join context's "not joined" allreduce (JoinProtocol), a DistributedModel's iteration
// is, in this order, on the dp group:
//   1. its buffers (broadcast_buffers): from the highest active rank;
//   2. the reducer, made at the same point on every rank (its construction compares
//      the ranks' parameters), then the 'sync' allreduce: how many ranks reduce
//      gradients this step (1 each);
//   3. the reducer's step: an active rank's real one, a joined rank's shadow step
//      (every bucket through the hook chain with zeros) when any rank reduces.
// An active step that announced a reduction but ran no synchronized backward (an
// evaluation step) shadows it at its end. The decisions live here, beside the reducer
// they drive; Python's Join context calls them in its loop (smp/join.py), and with
// partitions > 1 each pp rank runs them on its own dp group as its driver does (Note
// [Join with pipeline parallelism] there). Every call is on the training thread,
// between steps (Note [Join collective order] in join.h), with the GIL released.
bool join_announce_step(JoinProtocol& proto, Reducer& reducer, bool sync_step,
                        bool divide_by_initial_world_size) {
  const int64_t n = proto.allreduce_sum(sync_step ? 1 : 0, "the join 'sync' allreduce");
  reducer.set_active_ranks(divide_by_initial_world_size
                               ? 0
                               : static_cast<int>(std::max<int64_t>(n, 1)));
  return sync_step;
}

void join_end_step(Reducer& reducer, bool announced, bool reduced) {
  if (announced && !reduced) reducer.run_shadow_step();
}

void join_shadow_step(JoinProtocol& proto, Reducer& reducer) {
  const int64_t n = proto.allreduce_sum(0, "the join 'sync' allreduce");
  if (n > 0) reducer.run_shadow_step();
}

void join_sync_buffers(JoinProtocol& proto, const std::vector<at::Tensor>& buffers,
                       bool candidate) {
  const int64_t root = proto.find_common_rank(candidate);
  SMP_CHECK(root >= 0, "smp.join: no active rank to take the buffers from (a bug)");
  at::NoGradGuard no_grad;
  broadcast_coalesced(proto.process_group(), buffers, static_cast<int>(root),
                      kDefaultBucketBytesCap, proto.timeout_s());
}

void join_sync_final(JoinProtocol& proto, Reducer* reducer,
                     const std::vector<at::Tensor>& tensors, bool is_last_joiner) {
  const int64_t root = proto.find_common_rank(is_last_joiner);
  SMP_CHECK(root >= 0, "smp.join: no rank reported itself as the last joiner (a bug)");
  {
    at::NoGradGuard no_grad;
    broadcast_coalesced(proto.process_group(), tensors, static_cast<int>(root),
                        kDefaultBucketBytesCap, proto.timeout_s());
  }
  if (reducer) reducer->set_active_ranks(0);
}

}  // namespace smp
