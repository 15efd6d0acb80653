// Weight gradients of the expert FFN: out[e] = a_e^T b_e over each expert's rows.
#include <cuda_runtime.h>

#include <type_traits>

#include "mok/cuda_check.cuh"
#include "mok/gemm/host.cuh"
#include "mok/grouped_gemm.h"

using namespace mok::gemm;

namespace {

template <bool kTma>
int weight_grad(const void* a, const void* b, const int32_t* offsets, void* out, int out_bf16,
                int accumulate, int64_t rows_cap, int L, int M, int N, int num_ctas,
                cudaStream_t stream) {
  using Cfg = WgradCfg<kTma>;
  using Epi = std::conditional_t<kTma, WgradTmaEpilogue, WgradEpilogue>;
  WgradKernelParams<Epi> p{};
  int rc = encode_map_2d(&p.op.map_a, a, M, rows_cap, kBK, 64);
  if (rc != MOK_OK) return rc;
  rc = encode_map_2d(&p.op.map_b, b, N, rows_cap, kBK, 64);
  if (rc != MOK_OK) return rc;
  p.op.M = M;
  p.op.N = N;
  if constexpr (kTma) {
    rc = encode_map_2d(&p.epi.map, out, N, (uint64_t)L * M, 64, 64);
    if (rc != MOK_OK) return rc;
    p.epi.M = M;
  } else {
    p.epi = {out, out_bf16 ? 1 : 0, accumulate ? 1 : 0, M, N};
  }
  p.offsets = offsets;
  p.L = L;
  const int64_t tiles = (int64_t)L * (M / Cfg::BM) * (N / Cfg::BN);
  return launch_persistent(wgrad_kernel<Cfg, Epi>, p, tiles, Cfg::kSmemBytes, num_ctas, stream);
}

}  // namespace

MOK_API int mok_gemm_weight_grad(const void* a, const void* b, const int32_t* offsets, void* out,
                                 int out_bf16, int accumulate, int tma_store, int64_t rows_cap,
                                 int L, int M, int N, int num_ctas, cudaStream_t stream) {
  MOK_REQUIRE(a && b && offsets && out && aligned16(out));
  MOK_REQUIRE(rows_cap >= 0 && rows_cap < (int64_t)INT32_MAX && L >= 1 && L <= kMaxExperts);
  MOK_REQUIRE(M > 0 && N > 0 && M % 128 == 0 && N % 256 == 0);
  MOK_REQUIRE(!(out_bf16 && accumulate));
  MOK_REQUIRE(!tma_store || out_bf16);  // the staged epilogue writes bf16
  MOK_REQUIRE((int64_t)L * (M / 128) * (N / 256) < (int64_t)INT32_MAX);
  if (rows_cap < kBK) {
    // Not one 64-row block: every expert is empty and its gradient zero.
    if (accumulate) return MOK_OK;
    MOK_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(out, 0, (size_t)L * M * N * (out_bf16 ? 2 : 4), stream));
    return MOK_OK;
  }
  if (tma_store)
    return weight_grad<true>(a, b, offsets, out, out_bf16, accumulate, rows_cap, L, M, N, num_ctas,
                             stream);
  return weight_grad<false>(a, b, offsets, out, out_bf16, accumulate, rows_cap, L, M, N, num_ctas,
                            stream);
}
