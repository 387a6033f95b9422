// libFuzzer target: the decoders of a remote call's metadata (smp_core/call_meta.h,
// Note [Call metadata]), which read what a pipeline peer put in a request or an answer.
// Anything must decode or throw CommError; whatever decodes is in its one encoding (it
// encodes back to the same bytes), so no two byte strings mean the same call. Run by
// `make fuzz`; tests/cpp's corpus test replays the corpus.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "smp_core/call_meta.h"
#include "smp_core/errors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  try {
    const smp::RequestMeta m = smp::decode_request(bytes, smp::kAnyCount, "a fuzzed request");
    if (smp::encode_request(m) != bytes) std::abort();
    smp::decode_request(bytes, m.requires_grad.size(), "a fuzzed request");
  } catch (const smp::CommError&) {
  }
  try {
    const smp::AnswerMeta m = smp::decode_answer(bytes, smp::kAnyCount, "a fuzzed answer");
    if (smp::encode_answer(m) != bytes) std::abort();
  } catch (const smp::CommError&) {
  }
  return 0;
}
