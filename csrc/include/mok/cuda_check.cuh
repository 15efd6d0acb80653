// Internal helpers (not part of the ABI): return-on-error checks for CUDA calls and launches.
#pragma once

#include <cuda_runtime.h>

#include "mok/common.h"

#define MOK_RETURN_IF_CUDA_ERROR(expr)                 \
  do {                                                 \
    cudaError_t mok_err_ = (expr);                     \
    if (mok_err_ != cudaSuccess) return (int)mok_err_; \
  } while (0)

// After a <<<>>> launch: a bad configuration shows up in cudaGetLastError.
#define MOK_RETURN_IF_LAUNCH_FAILED() MOK_RETURN_IF_CUDA_ERROR(cudaGetLastError())

#define MOK_REQUIRE(cond)                                  \
  do {                                                     \
    if (!(cond)) return (int)MOK_ERR_INVALID_ARGUMENT;     \
  } while (0)

namespace mok {

__host__ __device__ inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
__host__ __device__ inline int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// Record a problem in the status word (first value wins for the value fields).
__device__ inline void report_status(int32_t* status, int flag, int value, int rank) {
  if (status == nullptr) return;
  int old = atomicOr(&status[MOK_STATUS_FLAGS], flag);
  if ((old & flag) == 0) {
    atomicExch(&status[MOK_STATUS_VALUE], value);
    atomicExch(&status[MOK_STATUS_RANK], rank);
  }
}

}  // namespace mok
