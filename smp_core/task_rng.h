// Random streams of a pipelined step's microbatches.
//
// Note [Microbatch random streams]: at pp > 1 several microbatches are in flight on a
// rank at once, each a task that computes only while it holds the compute token
// (p2p.h, Note [Compute token]). torch's default generators are process-wide, so
// without care a Dropout mask would depend on which task happened to draw first: the
// arrival order of requests, i.e. timing. Two identical runs would differ.
//
// So each microbatch has a stream of its own, and the stream follows the microbatch's
// program order across ranks:
//   - at the start of a step every rank draws one 64-bit seed from its default CPU
//     generator (so torch.manual_seed governs it, every step differs, and ranks
//     seeded alike stay alike); the driver's seeds the step: microbatch `mb` starts
//     from a generator seeded with mix(seed, mb);
//   - a remote call carries the caller's generator state with the request; the owner
//     runs the module from that state and returns the advanced state with the
//     answer, which the caller continues from (Message::rng);
//   - whenever the compute token changes hands, the outgoing task's generator state is
//     saved in its TaskContext (task.h) and the incoming task's installed (P2PEngine
//     does this for the task of the thread taking the token, set by the Dispatcher).
// A module's random numbers then depend on the seed, the step, the microbatch and the
// program, not on timing, the schedule or which rank owns which module: any
// partitioning at pp > 1 draws the same masks. pp = 1 keeps torch's own single stream,
// exactly as the plain module does (it runs microbatches one after another).
//
// The state covers the default CPU generator and, when `cuda` was asked for, the
// current CUDA device's default generator.
//
// Thread-safety: the functions touch process-wide generators; call them only from the
// thread holding the compute token (or with no pipeline running).
#pragma once

#include <cstdint>
#include <string>

namespace smp::task_rng {

// The default generators' state, as opaque bytes (empty: nothing captured).
std::string capture(bool cuda);

// The same parts as `like` holds (CPU; CUDA if `like` has it), as they are now.
std::string capture_like(const std::string& like);

// Installs a state made by capture() or derive(); empty bytes do nothing.
void install(const std::string& state);

// A fresh stream for microbatch `mb` of the step whose seed is `step_seed`.
std::string derive(uint64_t step_seed, int64_t mb, bool cuda);

// Draws a step's seed from the default CPU generator (advancing it).
uint64_t draw_step_seed();

}  // namespace smp::task_rng
