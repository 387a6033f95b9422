// TiedGradients: the gradients of parameters held on more than one pp rank (a tied
// embedding and head), summed over their holders at the step's end, in C++ (Note
// [Tied gradient sum] in tied_grads.cpp). Python's placement.TiedParameters decides
// which parameters are tied and makes the holders' groups; the dispatcher runs sum()
// as the step ends, before the dp reducer's finalize.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "smp_core/comm.h"

namespace smp {

class TiedGradients {
 public:
  struct Entry {
    std::string name;   // for errors
    at::Tensor param;   // a Parameter this rank holds (a leaf)
    ProcessGroupPtr group;  // its holders' group (this rank among them)
  };

  // `held`: this rank's tied parameters, in the plain module's order (the same order on
  // every holder, so each group sees its collectives in the same order everywhere).
  TiedGradients(std::vector<Entry> held, double timeout_s);

  // Sets each gradient aside, so the step's backward leaves only this step's
  // contribution in .grad; a gradient of zeros (zero_grad(set_to_none=False)) stays
  // in place instead, and the backward adds to it (Note [Zero gradients stay]).
  void begin_step();
  // After the step's backward on every holder: each gradient becomes what it held
  // before the step plus the sum over its holders of this step's contribution
  // (collectives on the holders' groups).
  void sum();
  // Puts back exactly what begin_step() set aside (a step without backward, or a failed
  // one, whose un-summed contribution is dropped); a gradient left in place is zeroed
  // again. Local only.
  void restore();

  size_t size() const { return held_.size(); }

 private:
  std::vector<Entry> held_;
  std::vector<at::Tensor> before_;  // per entry: .grad at begin_step (undefined: none)
  std::vector<char> in_place_;      // per entry: .grad was all zero bits, left in place
  bool stashed_ = false;
  double timeout_s_;
};

}  // namespace smp
