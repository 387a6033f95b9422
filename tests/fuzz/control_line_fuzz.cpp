// libFuzzer target: the launcher's control-channel decoder (launcher/control_channel.h,
// take_messages), which reads the bytes another launcher sends. The input arrives in
// pieces, split where its first byte says, as a socket delivers it. Anything must end
// in messages or an error, never a crash, a hang or an unbounded buffer. Run by
// `make fuzz`; tests/cpp's corpus test replays the corpus.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <string>

#include "launcher/control_channel.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const size_t piece = size ? 1 + data[0] % 64 : 1;
  std::string in;
  std::deque<nlohmann::json> inbox;
  for (size_t at = size ? 1 : 0; at < size; at += piece) {
    in.append(reinterpret_cast<const char*>(data) + at, std::min(piece, size - at));
    if (!smp::launcher::take_messages(in, inbox).empty()) return 0;  // the peer is dropped
    if (in.size() > smp::launcher::kMaxMessageBytes) std::abort();  // never kept
  }
  for (const auto& m : inbox)
    if (!m.is_object() || !m.contains("t") || !m["t"].is_string() || m["t"] == "hb") std::abort();
  return 0;
}
