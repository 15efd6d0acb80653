// SwiGLU with the router weight applied inside, forward and backward, over the rows of the
// expert-grouped layout (R_pad = offsets[L], read on the device).
//
// ab: bf16 [R, 2I] = x · fc1^T, columns [0, I) the gate pre-activation a, [I, 2I) the up b.
// w:  fp32 [R] router weight of each row (null: 1).
// Forward:  hw[r, i] = w[r] * silu(a[r, i]) * b[r, i]                       (bf16 [R, I])
// Backward, given g = dL/d(hw) (bf16 [R, I]):
//   dw[r]      = sum_i g[r, i] * silu(a[r, i]) * b[r, i]    (fp32, fixed-order reduction)
//   d_ab[r, i] = g * w * b * silu'(a),  d_ab[r, I + i] = g * w * silu(a)      (bf16 [R, 2I])
//   hw (optional) recomputed exactly as in the forward, for the fc2 weight gradient.
// Rows in [R_pad, R) are not touched.
#pragma once

#include <cuda_runtime.h>

#include "mok/common.h"

MOK_API int mok_swiglu_forward(const void* ab, const float* w, const int32_t* offsets, int L,
                               int I, void* hw, cudaStream_t stream);

MOK_API int mok_swiglu_backward(const void* ab, const float* w, const void* g,
                                const int32_t* offsets, int L, int I, void* d_ab, float* dw,
                                void* hw, cudaStream_t stream);
