// libFuzzer target: the checkpoint file reader (checkpoint/detail/trailer.h and
// zip_index.h), which reads files that may be truncated, altered or not smp's at all:
// the trailer in the zip comment, the Manifest's Boost archive, then the zip's
// central directory. Anything must end in records that lie inside the file, or a
// CheckpointError; never a crash, an overflow or an allocation beyond the file.
//
// The input is a file's bytes, with help past the checks a fuzzer cannot guess: the
// first byte's bits say whether the trailer's hash and magic are computed, whether the
// manifest is generated to match the payload (else it is the input's own text after the
// split), and whether the zip comment length is patched to match. Run by `make fuzz`;
// tests/cpp's corpus test replays the corpus.
#include <sys/mman.h>
#include <unistd.h>
#include <xxhash.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "checkpoint/checkpoint_error.h"
#include "checkpoint/detail/trailer.h"
#include "checkpoint/entries.h"
#include "checkpoint/detail/zip_index.h"

namespace ck = smp::checkpoint;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 3) return 0;
  const uint8_t mode = data[0];
  const size_t split = std::min<size_t>(size - 3, data[1] | (data[2] << 8));
  std::string payload(reinterpret_cast<const char*>(data) + 3, split);
  std::string file;
  if (mode & 1) {  // a well-formed trailer around the payload
    std::string text;
    if (mode & 2) {
      text.assign(reinterpret_cast<const char*>(data) + 3 + split, size - 3 - split);
    } else {
      ck::Manifest m;
      m.payload_size = payload.size();
      text = m.encode();
      // The payload size must hold this trailer: found by a fixed point (text grows
      // with the number's digits).
      for (int i = 0; i < 3; ++i) {
        m.payload_size = payload.size();
        text = m.encode();
      }
    }
    std::string trailer = text;
    ck::detail::put64(trailer, text.size());
    ck::detail::put64(trailer, XXH3_64bits(text.data(), text.size()));
    trailer.append(ck::detail::kMagic, 8);
    if ((mode & 4) && payload.size() >= 2) {  // the zip comment length says the trailer
      payload[payload.size() - 2] = static_cast<char>(trailer.size() & 0xFF);
      payload[payload.size() - 1] = static_cast<char>((trailer.size() >> 8) & 0xFF);
    }
    file = payload + trailer;
  } else {
    file.assign(reinterpret_cast<const char*>(data) + 3, size - 3);
  }
  const int fd = memfd_create("ckpt", MFD_CLOEXEC);
  if (fd < 0) std::abort();
  ck::detail::Fd owner(fd);
  if (!file.empty() && ::write(fd, file.data(), file.size()) != static_cast<ssize_t>(file.size()))
    std::abort();
  try {
    uint64_t file_size = 0;
    const ck::Manifest m = ck::detail::read_trailer(fd, "fuzz", &file_size);
    if (file_size != file.size() || m.payload_size < ck::detail::kEocd ||
        m.payload_size > file_size)
      std::abort();
    for (const auto& r : ck::detail::read_zip_index(fd, m.payload_size - ck::detail::kEocd, "fuzz"))
      if (r.offset > m.payload_size || r.size > m.payload_size - r.offset) std::abort();
  } catch (const ck::CheckpointError&) {
  }
  // The entry table of version 2 files: anything decodes or is refused, and every
  // decoded record lies inside the payload with one hash per chunk.
  try {
    const uint64_t chunk = 1 + (mode >> 2);
    for (const auto& e : ck::decode_entries(payload, chunk, 4 * payload.size(), "fuzz")) {
      if (e.offset > 4 * payload.size() || e.size > 4 * payload.size() - e.offset) std::abort();
      if (e.chunk_hashes.size() != (e.size == 0 ? 1 : (e.size + chunk - 1) / chunk)) std::abort();
    }
  } catch (const ck::CheckpointError&) {
  }
  return 0;
}
