// CheckpointError: a checkpoint file that is missing, truncated, altered, from another
// save, or otherwise unusable. Python sees smp.CheckpointError (a RuntimeError). The
// message names the file and what is wrong.
#pragma once

#include <stdexcept>

namespace smp::checkpoint {

class CheckpointError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace smp::checkpoint
