// The metadata of a remote module call: what a kRequest and its kResponse carry
// besides their tensors. One encoder and one decoder for every call, whatever its
// arguments; the caller's side (call.h) encodes requests and decodes answers, the
// owner's (serve.h) the reverse.
//
// Note [Call metadata]
// ~~~~~~~~~~~~~~~~~~~~
// A request says which module to run and how: its name, the caller's grad mode, the
// train/eval flags of the module's subtree (a byte per module, Note [Mode travels with
// the call] in smp/placement.py), which of the message's tensors require grad, and
// how the tensors make the call's arguments. An answer says which outputs require
// grad and how the tensors make what the module returned. Both layouts have a fast
// form that C++ encodes and decodes alone, and a general form that carries the
// structure pickled by Python (smp/remote_call.py), opaque here:
//   - a request's tensors are the positional arguments, in order, each once; or
//     `skeleton` holds (args, kwargs) with the tensors' places marked;
//   - an answer's one tensor is what the module returned; or `skeleton` holds the
//     outputs' structure.
// Only the pickled part needs Python; the rest is bytes this file writes:
//   request: 'Q', grad (0/1), layout (0 fast, 1 general), u32 n, n bytes of
//            requires_grad (0/1), u32 + name, u32 + mode flags, [u32 + skeleton]
//   answer:  'A', layout (0 fast: n is 1, 1 general), u32 n, n bytes of
//            requires_grad, [u32 + skeleton]
// with u32 little-endian. A call's encoding is the same whichever path made it: a
// general call whose arguments turn out to be distinct tensors passed positionally is
// encoded in the fast form (call_meta_test.cpp checks the bytes). The decoders read
// bytes from a peer: every length is checked against what is left before anything is
// allocated, every flag is 0 or 1, and nothing may follow the last field
// (tests/fuzz/call_meta_fuzz.cpp).
//
// Thread-safety: pure functions.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace smp {

struct RequestMeta {
  std::string module;               // the called module's name on its owner
  bool grad = false;                // the caller's grad mode
  std::string mode_flags;           // the subtree's training flags, one 0/1 byte each
  std::vector<bool> requires_grad;  // per tensor of the message
  std::string skeleton;             // empty: the tensors are the positional arguments
};

struct AnswerMeta {
  std::vector<bool> requires_grad;  // per tensor of the message
  std::string skeleton;             // empty: the one tensor is the module's output
};

// The bytes of `meta`. An AnswerMeta in the fast form (no skeleton) has exactly one
// tensor (SMP_CHECK otherwise).
std::string encode_request(const RequestMeta& meta);
std::string encode_answer(const AnswerMeta& meta);

// `n_tensors` for a decoder that does not know the message's tensors (tools, tests).
constexpr size_t kAnyCount = static_cast<size_t>(-1);

// The meta of `bytes`, a message of `n_tensors` tensors. Throw CommError ("smp:
// pipeline protocol error: <what> ...") on malformed bytes, or when they describe
// another number of tensors.
RequestMeta decode_request(const std::string& bytes, size_t n_tensors, const std::string& what);
AnswerMeta decode_answer(const std::string& bytes, size_t n_tensors, const std::string& what);

}  // namespace smp
