// Vector-friendly float math shared by the CPU kernels. The loader (cpu_kernels/build.py) puts
// this file in front of each kernel's source, so a change here rebuilds every kernel.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

namespace hybridkv_cpu {

// exp(x) for x <= 0 (scores minus their row maximum), in plain arithmetic so that the loop over
// a row vectorizes: Cephes' expf (range reduction to [-ln2/2, ln2/2], degree-5 polynomial, 2^n
// from the exponent bits), relative error ~1e-7 like libm's; x = -inf (a masked key) gives 0.
inline float exp_nonpositive(float x) {
  const float lo = -87.3f;
  const bool masked = !(x >= lo);  // also -inf and NaN
  const float xc = masked ? lo : x;
  const float n = std::floor(xc * 1.44269504088896341f + 0.5f);
  float r = xc - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  const float r2 = r * r;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r2 + r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return masked ? 0.f : p * scale;
}

}  // namespace hybridkv_cpu
