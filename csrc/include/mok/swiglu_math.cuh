// The SwiGLU math, shared by the standalone SwiGLU kernels (swiglu.cu) and the GEMM epilogues
// (gemm/epilogue.cuh), so that a fused kernel computes bitwise what the separate kernel computes
// from the same bf16 inputs.
//
// h = w * silu(a) * b, with a the gate half and b the up half of the fc1 output and w the router
// weight of the row (1 when absent).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace mok {

// Division with __fdividef (MUFU.RCP and a multiply), not the IEEE `/`: the IEEE division
// compiles to a branch into a called slow-path subroutine, and with it in the epilogue the
// fused fc1 ran 10-37% slower than the same tile with a plain store (docs/perf-notes.md).
// __fdividef is within 2 ulp; for a denominator above 2^126 (x < -87) it returns 0,
// which is the limit of silu and of sigmoid there.
__device__ __forceinline__ float sigmoid(float x) { return __fdividef(1.f, 1.f + __expf(-x)); }
__device__ __forceinline__ float silu(float x) { return __fdividef(x, 1.f + __expf(-x)); }

// 8 bf16 channels (one 16-byte vector) to floats and back (round to nearest even).
__device__ __forceinline__ void unpack8(const uint4& v, float (&f)[8]) {
  const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const float2 x = __bfloat1622float2(p[q]);
    f[2 * q] = x.x;
    f[2 * q + 1] = x.y;
  }
}

__device__ __forceinline__ uint4 pack8(const float (&f)[8]) {
  uint4 v;
  __nv_bfloat162* p = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
  for (int q = 0; q < 4; ++q) p[q] = __floats2bfloat162_rn(f[2 * q], f[2 * q + 1]);
  return v;
}

// Backward of h = w * silu(a) * b over 8 channels, for the upstream gradient g = dL/dh:
//   da = w g b silu'(a), silu'(a) = s (1 + a (1 - s)), s = sigmoid(a);   db = w g silu(a);
// and the forward's h recomputed (the fc2 weight gradient's operand). Returns the channels'
// share of the router-weight gradient dL/dw = sum g silu(a) b, summed in channel order.
__device__ __forceinline__ float swiglu_backward8(const uint4& a8, const uint4& b8, const uint4& g8,
                                                  float w, uint4& da8, uint4& db8, uint4& h8) {
  float a[8], b[8], g[8], da[8], db[8], h[8];
  unpack8(a8, a);
  unpack8(b8, b);
  unpack8(g8, g);
  float dot = 0.f;
#pragma unroll
  for (int q = 0; q < 8; ++q) {
    const float s = sigmoid(a[q]);
    const float act = a[q] * s;
    const float gw = g[q] * w;
    dot += g[q] * act * b[q];
    da[q] = gw * b[q] * (s * (1.f + a[q] * (1.f - s)));
    db[q] = gw * act;
    h[q] = w * act * b[q];
  }
  da8 = pack8(da);
  db8 = pack8(db);
  h8 = pack8(h);
  return dot;
}

// Sum over the 32 lanes of a warp in a fixed order (an xor butterfly): every lane gets the sum.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) v += __shfl_xor_sync(0xffffffffu, v, d);
  return v;
}

}  // namespace mok
