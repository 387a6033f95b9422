// Rank heartbeats through the c10d store, for jobs across hosts that smprun did not
// start (torchrun, srun, mpirun): Note [Rank heartbeat] in liveness.cpp.
#pragma once

#include <string>

namespace smp {

// Collective over the runtime's world group (every rank, once, after init): exchanges
// host names and each rank's SMP_RANK_HEARTBEAT_S; where the job spans hosts and the
// setting is > 0, starts this rank's heartbeat thread. Throws ConfigError on every
// rank when the ranks' settings differ. Returns a line for the log ("" : not started).
std::string start_liveness();

// Stops the thread (if any) and marks this rank done, so that no peer reports it
// (smp.shutdown, before the runtime goes; at the process's exit in any case).
void stop_liveness();

}  // namespace smp
