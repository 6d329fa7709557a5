// The part of torch the CPU kernels use, put in front of every kernel source by the loader
// (cpu_kernels/build.py) in place of <torch/extension.h>. That header is all of libtorch's C++ API
// (autograd, nn, optim, serialization), and parsing it is most of a small module's build time:
// a module with one trivial function took ~24 s with it and ~15 s with these (2-core Zen 4 EPYC).
// `torch::` names the kernels use (Tensor, empty, kFloat, IntArrayRef, ...) are ATen's own.
#pragma once
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/utils/pybind.h>

namespace torch {
using namespace at;
// The width-named dtypes of torch/types.h.
constexpr auto kInt8 = at::kChar;
constexpr auto kInt16 = at::kShort;
constexpr auto kInt32 = at::kInt;
constexpr auto kInt64 = at::kLong;
constexpr auto kFloat16 = at::kHalf;
constexpr auto kFloat32 = at::kFloat;
constexpr auto kFloat64 = at::kDouble;
}  // namespace torch
