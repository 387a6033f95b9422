// A data-parallel model's part of each Join iteration (uneven inputs), decided in C++
// beside the reducer it drives: Note [Join step] in join_step.cpp. The generic Join
// context (smp.join.Join, with any Joinables' Python hooks) stays in Python and calls
// these for the model.
#pragma once

#include <vector>

#include <ATen/core/Tensor.h>

namespace smp {

class JoinProtocol;
class Reducer;

// Active rank, after its notify_not_joined(): the 'sync' allreduce (1 if this step
// reduces gradients); the reducer then divides by the ranks that reduce, or by the
// initial world size (`divide_by_initial_world_size`). Returns `sync_step`.
bool join_announce_step(JoinProtocol& proto, Reducer& reducer, bool sync_step,
                        bool divide_by_initial_world_size);

// Active rank, after the step's body: a step that announced a reduction but ran no
// synchronized backward (an evaluation step) shadows it, so the group's collectives
// match the other ranks'.
void join_end_step(Reducer& reducer, bool announced, bool reduced);

// Joined rank, once per iteration after its count_not_joined() (and the buffers'
// join_sync_buffers, when the model broadcasts buffers): the 'sync' allreduce with 0,
// and the reducer's shadow step when any active rank reduces.
void join_shadow_step(JoinProtocol& proto, Reducer& reducer);

// torch DDP under join: the buffers come from the highest group rank among those
// passing `candidate` (the active ranks).
void join_sync_buffers(JoinProtocol& proto, const std::vector<at::Tensor>& buffers,
                       bool candidate);

// The post hook, once every rank joined: every rank takes `tensors` (parameters and
// buffers) from the highest rank among the last joiners; the reducer (may be null)
// divides by the world size again.
void join_sync_final(JoinProtocol& proto, Reducer* reducer,
                     const std::vector<at::Tensor>& tensors, bool is_last_joiner);

}  // namespace smp
