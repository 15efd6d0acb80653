// Host-side helpers shared by the grouped GEMM translation units: TMA descriptors (encoded
// through the driver entry point, so the library does not link libcuda), the SM count, and
// the launch of the persistent kernels.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "mok/cuda_check.cuh"
#include "mok/gemm/kernels.cuh"

namespace mok {
namespace gemm {

// A 2-D bf16 tensor map over a row-major [outer, inner] matrix with a {box_inner, box_outer}
// box and 128-byte swizzle (box_inner must be 64). Returns MOK_OK or a MOK_ERR_* code.
int encode_map_2d(CUtensorMap* map, const void* base, uint64_t inner, uint64_t outer,
                  uint32_t box_inner, uint32_t box_outer);

// Multiprocessors of the current device.
cudaError_t sm_count(int* out);

// out[r] = sum over s in order of partials[s * rows_cap + r], for offsets[0] <= r <
// min(offsets[L], rows_cap).
int sum_partials(const float* partials, int slices, const int32_t* offsets, int L,
                 int64_t rows_cap, float* out, cudaStream_t stream);

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

template <class Kernel, class Params>
int launch_persistent(Kernel kernel, const Params& p, int64_t max_tiles, int smem_bytes,
                      int num_ctas, cudaStream_t stream) {
  if (max_tiles <= 0) return MOK_OK;
  int sms = 0;
  MOK_RETURN_IF_CUDA_ERROR(sm_count(&sms));
  int64_t grid = num_ctas > 0 ? num_ctas : sms;
  if (grid > max_tiles) grid = max_tiles;
  MOK_RETURN_IF_CUDA_ERROR(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
  kernel<<<static_cast<unsigned>(grid), kThreads, smem_bytes, stream>>>(p);
  MOK_RETURN_IF_LAUNCH_FAILED();
  return MOK_OK;
}

// Clusters of kCluster CTAs, as many as can be resident at once (the tile schedule is static:
// a cluster that had to wait for a free GPC would finish its share a whole share late).
template <int kCluster, class Kernel, class Params>
int launch_clustered(Kernel kernel, const Params& p, int64_t max_cluster_tiles, int smem_bytes,
                     int num_ctas, cudaStream_t stream) {
  if (max_cluster_tiles <= 0) return MOK_OK;
  MOK_RETURN_IF_CUDA_ERROR(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = kCluster;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.blockDim = dim3(kThreads, 1, 1);
  cfg.dynamicSmemBytes = smem_bytes;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  int sms = 0;
  MOK_RETURN_IF_CUDA_ERROR(sm_count(&sms));
  cfg.gridDim = dim3(static_cast<unsigned>(sms / kCluster * kCluster), 1, 1);
  int resident = 0;
  MOK_RETURN_IF_CUDA_ERROR(cudaOccupancyMaxActiveClusters(&resident, kernel, &cfg));
  int64_t clusters = num_ctas > 0 ? num_ctas / kCluster : resident;
  if (clusters > resident) clusters = resident;
  if (clusters > max_cluster_tiles) clusters = max_cluster_tiles;
  if (clusters < 1) return MOK_ERR_INVALID_ARGUMENT;  // the cluster does not fit on an SM pair
  cfg.gridDim = dim3(static_cast<unsigned>(clusters * kCluster), 1, 1);
  MOK_RETURN_IF_CUDA_ERROR(cudaLaunchKernelEx(&cfg, kernel, p));
  MOK_RETURN_IF_LAUNCH_FAILED();
  return MOK_OK;
}

template <class Cfg, class Epi>
int launch_row_gemm(const RowKernelParams<Epi>& p, int num_ctas, cudaStream_t stream) {
  if constexpr (Cfg::kCluster == 1) {
    const int64_t max_tiles = (p.rows_cap / Cfg::BM) * p.num_cb;
    return launch_persistent(row_gemm_kernel<Cfg, Epi>, p, max_tiles, Cfg::kSmemBytes, num_ctas,
                             stream);
  } else {
    const int64_t max_pair_tiles = (p.rows_cap / Cfg::BM / 2 + p.L) * p.num_cb;
    return launch_clustered<Cfg::kCluster>(row_gemm_kernel<Cfg, Epi>, p, max_pair_tiles,
                                           Cfg::kSmemBytes, num_ctas, stream);
  }
}

}  // namespace gemm
}  // namespace mok
