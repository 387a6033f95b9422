// libFuzzer target: the config parser (smp_core/config.h, Config::from_json), which
// reads text users and launchers supply (SMP_CONFIG, --config, smp.init's dict).
// Anything it is given must end in a Config or a ConfigError, never a crash, a hang
// or another exception. Run by `make fuzz`; tests/cpp's corpus test replays the corpus.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "smp_core/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    smp::Config c = smp::Config::from_json(text);
    // What it resolves to reads back as itself.
    if (smp::Config::from_json(c.to_json()).to_json() != c.to_json()) std::abort();
  } catch (const smp::ConfigError&) {
  }
  return 0;
}
