// Host helpers of the grouped GEMMs (see mok/gemm/host.cuh) and the router-weight gradient
// reduction.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include "mok/cuda_check.cuh"
#include "mok/gemm/host.cuh"
#include "mok/grouped_gemm.h"

namespace mok {
namespace gemm {

namespace {

PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = []() -> PFN_cuTensorMapEncodeTiled_v12000 {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult status;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault,
                                         &status) != cudaSuccess ||
        status != cudaDriverEntryPointSuccess) {
      cudaGetLastError();  // leave no sticky error behind for the caller's next check
      return nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

__global__ void sum_partials_kernel(const float* partials, int slices, const int32_t* offsets,
                                    int L, int64_t rows_cap, float* out) {
  int64_t rows = offsets[L];
  if (rows > rows_cap) rows = rows_cap;
  // offsets[0] > 0 for a launch over a segment of the experts: only its rows.
  for (int64_t r = offsets[0] + blockIdx.x * (int64_t)blockDim.x + threadIdx.x; r < rows;
       r += (int64_t)gridDim.x * blockDim.x) {
    float s = 0.f;
    for (int k = 0; k < slices; ++k) s += partials[k * rows_cap + r];
    out[r] = s;
  }
}

}  // namespace

int encode_map_2d(CUtensorMap* map, const void* base, uint64_t inner, uint64_t outer,
                  uint32_t box_inner, uint32_t box_outer) {
  PFN_cuTensorMapEncodeTiled_v12000 fn = encode_fn();
  if (fn == nullptr) return MOK_ERR_UNSUPPORTED;
  if (base == nullptr || !aligned16(base) || inner == 0 || outer == 0 || box_inner != 64 ||
      box_outer == 0 || box_outer > 256 || (inner * 2) % 16 != 0)
    return MOK_ERR_INVALID_ARGUMENT;
  const cuuint64_t dims[2] = {inner, outer};
  const cuuint64_t strides[1] = {inner * 2};
  const cuuint32_t box[2] = {box_inner, box_outer};
  const cuuint32_t elem_strides[2] = {1, 1};
  CUresult r = fn(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(base), dims, strides,
                  box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                  CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? MOK_OK : MOK_ERR_INVALID_ARGUMENT;
}

cudaError_t sm_count(int* out) {
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  return cudaDeviceGetAttribute(out, cudaDevAttrMultiProcessorCount, dev);
}

int sum_partials(const float* partials, int slices, const int32_t* offsets, int L,
                 int64_t rows_cap, float* out, cudaStream_t stream) {
  if (rows_cap <= 0) return MOK_OK;
  const int threads = 256;
  int64_t blocks = (rows_cap + threads - 1) / threads;
  if (blocks > 4096) blocks = 4096;
  sum_partials_kernel<<<(unsigned)blocks, threads, 0, stream>>>(partials, slices, offsets, L,
                                                                 rows_cap, out);
  MOK_RETURN_IF_LAUNCH_FAILED();
  return MOK_OK;
}

}  // namespace gemm
}  // namespace mok

MOK_API int64_t mok_gemm_fc2_dgrad_scratch_floats(int64_t rows_cap, int I) {
  return rows_cap * (I / 256 > 0 ? I / 256 : 1);
}
