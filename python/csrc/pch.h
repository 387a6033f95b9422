// Precompiled header of the bindings (Python + torch's pybind11 glue).
#pragma once
#include <torch/extension.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <pybind11/functional.h>
#include <pybind11/stl.h>
