// A strided copy of 16-byte vectors, shared by the kernels that move rows through registers
// (the `cuda` backend's pulls and pushes, comm.cu; the forward prologue's copy of x,
// prologue.cu).
#pragma once

#include <cuda_runtime.h>

namespace mok {

// dst[i] = src[i] for i = first, first + stride, ... below n: each thread keeps kUnroll loads in
// flight before its stores (one round trip per kUnroll vectors rather than per vector).
// Index is the type of the positions (int for a row, int64_t for a whole tensor).
template <int kUnroll, class Index>
__device__ __forceinline__ void copy_vecs_strided(const uint4* __restrict__ src, uint4* __restrict__ dst, Index n,
                                                  Index first, Index stride) {
  Index i = first;
  for (; i + (kUnroll - 1) * stride < n; i += kUnroll * stride) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = src[i + u * stride];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) dst[i + u * stride] = v[u];
  }
  for (; i < n; i += stride) dst[i] = src[i];
}

}  // namespace mok
