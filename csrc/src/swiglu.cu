// SwiGLU forward/backward with the router weight inside (see mok/swiglu.h).
// One warp per row, 16-byte vectors of 8 bf16 channels, I % 8 == 0.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "mok/cuda_check.cuh"
#include "mok/swiglu.h"
#include "mok/swiglu_math.cuh"

namespace {

using mok::pack8;
using mok::sigmoid;
using mok::unpack8;

constexpr int kWarp = 32;
constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / kWarp;

__global__ void __launch_bounds__(kThreads) swiglu_forward_kernel(
    const uint4* __restrict__ ab, const float* __restrict__ w, const int32_t* __restrict__ offsets,
    int L, int I, uint4* __restrict__ hw) {
  const int rows = offsets[L];
  const int lane = threadIdx.x % kWarp;
  const int vecs = I / 8;
  for (int r = blockIdx.x * kWarpsPerBlock + threadIdx.x / kWarp; r < rows;
       r += gridDim.x * kWarpsPerBlock) {
    const float scale = w != nullptr ? w[r] : 1.f;
    const uint4* row = ab + (int64_t)r * 2 * vecs;
    for (int v = lane; v < vecs; v += kWarp) {
      float a[8], b[8], h[8];
      unpack8(row[v], a);
      unpack8(row[vecs + v], b);
#pragma unroll
      for (int q = 0; q < 8; ++q) h[q] = scale * (a[q] * sigmoid(a[q])) * b[q];
      hw[(int64_t)r * vecs + v] = pack8(h);
    }
  }
}

__global__ void __launch_bounds__(kThreads) swiglu_backward_kernel(
    const uint4* __restrict__ ab, const float* __restrict__ w, const uint4* __restrict__ g,
    const int32_t* __restrict__ offsets, int L, int I, uint4* __restrict__ d_ab,
    float* __restrict__ dw, uint4* __restrict__ hw) {
  const int rows = offsets[L];
  const int lane = threadIdx.x % kWarp;
  const int vecs = I / 8;
  for (int r = blockIdx.x * kWarpsPerBlock + threadIdx.x / kWarp; r < rows;
       r += gridDim.x * kWarpsPerBlock) {
    const float scale = w != nullptr ? w[r] : 1.f;
    const uint4* row = ab + (int64_t)r * 2 * vecs;
    // dw[r] is summed in the order of the fused fc2 data gradient's epilogue (kernels.cuh):
    // a warp-wide sum per 256 channels, then those sums in channel order.
    float dot = 0.f;
    for (int v0 = 0; v0 < vecs; v0 += kWarp) {
      const int v = v0 + lane;
      float part = 0.f;
      if (v < vecs) {
        uint4 da, db, h;
        part = mok::swiglu_backward8(row[v], row[vecs + v], g[(int64_t)r * vecs + v], scale, da,
                                     db, h);
        d_ab[(int64_t)r * 2 * vecs + v] = da;
        d_ab[(int64_t)r * 2 * vecs + vecs + v] = db;
        if (hw != nullptr) hw[(int64_t)r * vecs + v] = h;
      }
      if (dw != nullptr) dot += mok::warp_sum(part);
    }
    if (dw != nullptr && lane == 0) dw[r] = dot;
  }
}

int grid_blocks() {
  int device = 0, sms = 132;
  if (cudaGetDevice(&device) == cudaSuccess)
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  return 8 * sms;
}

}  // namespace

MOK_API int mok_swiglu_forward(const void* ab, const float* w, const int32_t* offsets, int L,
                               int I, void* hw, cudaStream_t stream) {
  MOK_REQUIRE(ab && offsets && hw && L >= 1 && I > 0 && I % 8 == 0);
  swiglu_forward_kernel<<<grid_blocks(), kThreads, 0, stream>>>(
      static_cast<const uint4*>(ab), w, offsets, L, I, static_cast<uint4*>(hw));
  MOK_RETURN_IF_LAUNCH_FAILED();
  return MOK_OK;
}

MOK_API int mok_swiglu_backward(const void* ab, const float* w, const void* g,
                                const int32_t* offsets, int L, int I, void* d_ab, float* dw,
                                void* hw, cudaStream_t stream) {
  MOK_REQUIRE(ab && g && offsets && d_ab && L >= 1 && I > 0 && I % 8 == 0);
  swiglu_backward_kernel<<<grid_blocks(), kThreads, 0, stream>>>(
      static_cast<const uint4*>(ab), w, static_cast<const uint4*>(g), offsets, L, I,
      static_cast<uint4*>(d_ab), dw, static_cast<uint4*>(hw));
  MOK_RETURN_IF_LAUNCH_FAILED();
  return MOK_OK;
}
