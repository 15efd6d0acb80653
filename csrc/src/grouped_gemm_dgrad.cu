// Data gradients of the expert FFN: fc2's fused with the SwiGLU backward (and the router-weight
// gradient), and fc1's.
#include <cuda_runtime.h>

#include <type_traits>

#include "mok/cuda_check.cuh"
#include "mok/gemm/host.cuh"
#include "mok/grouped_gemm.h"

using namespace mok::gemm;

namespace {

constexpr int kWgn = 256;

template <int BM>
int fc2_dgrad_swiglu(const void* dy, const void* w2, const void* gu, const int32_t* offsets,
                     const int32_t* counts, const float* scale, void* dgu, void* h, float* dscale,
                     float* scratch, int64_t rows_cap, int L, int H, int I, int num_ctas,
                     cudaStream_t stream) {
  using Cfg = RowCfg<BM, kWgn, BLayout::kMNMajor>;
  MOK_REQUIRE(H % kBK == 0 && I % Cfg::BN == 0);
  if (rows_cap < BM) return MOK_OK;  // no full row block: the layout is empty
  RowKernelParams<SwiGLUBackwardEpilogue> p{};
  int rc = encode_map_2d(&p.op.map_a, dy, H, rows_cap, kBK, BM);
  if (rc != MOK_OK) return rc;
  rc = encode_map_2d(&p.op.map_b, w2, I, (uint64_t)L * H, kBK, 64);
  if (rc != MOK_OK) return rc;
  p.op.K = H;
  p.op.N = I;
  p.epi = {static_cast<const __nv_bfloat16*>(gu), scale, static_cast<__nv_bfloat16*>(dgu),
           static_cast<__nv_bfloat16*>(h), scratch, I, rows_cap};
  p.offsets = offsets;
  p.counts = counts;
  p.L = L;
  p.num_cb = I / Cfg::BN;
  p.rows_cap = rows_cap;
  rc = launch_row_gemm<Cfg>(p, num_ctas, stream);
  if (rc != MOK_OK || scale == nullptr) return rc;
  return sum_partials(scratch, I / kWgn, offsets, L, rows_cap, dscale, stream);
}

template <int BM, int WGN, bool kTma>
int fc1_dgrad(const void* dgu, const void* w1, const int32_t* offsets, void* dx, int64_t rows_cap,
              int L, int H, int I, int num_ctas, cudaStream_t stream) {
  using Cfg = RowCfg<BM, WGN, BLayout::kMNMajor, kTma>;
  using Epi = std::conditional_t<kTma, TmaStoreEpilogue, StoreEpilogue>;
  MOK_REQUIRE((2 * I) % kBK == 0 && H % Cfg::BN == 0);
  if (rows_cap < BM) return MOK_OK;  // no full row block: the layout is empty
  RowKernelParams<Epi> p{};
  int rc = encode_map_2d(&p.op.map_a, dgu, 2 * (uint64_t)I, rows_cap, kBK, BM);
  if (rc != MOK_OK) return rc;
  rc = encode_map_2d(&p.op.map_b, w1, H, (uint64_t)L * 2 * I, kBK, 64);
  if (rc != MOK_OK) return rc;
  p.op.K = 2 * I;
  p.op.N = H;
  if constexpr (kTma) {
    rc = encode_map_2d(&p.epi.map, dx, H, rows_cap, 64, 64);
    if (rc != MOK_OK) return rc;
  } else {
    p.epi = {static_cast<__nv_bfloat16*>(dx), H, rows_cap};
  }
  p.offsets = offsets;
  p.counts = nullptr;
  p.L = L;
  p.num_cb = H / Cfg::BN;
  p.rows_cap = rows_cap;
  return launch_row_gemm<Cfg>(p, num_ctas, stream);
}

bool common_ok(int64_t rows_cap, int L, int H, int I) {
  return rows_cap >= 0 && rows_cap < (int64_t)INT32_MAX && L >= 1 && L <= kMaxExperts && H > 0 &&
         I > 0;
}

}  // namespace

MOK_API int mok_gemm_fc2_dgrad_swiglu(const void* dy, const void* fc2_weight, const void* gu,
                                      const int32_t* offsets, const int32_t* counts,
                                      const float* router_weight, void* dgu, void* h,
                                      float* d_router_weight, float* scratch, int64_t rows_cap,
                                      int L, int H, int I, int block_m, int num_ctas,
                                      cudaStream_t stream) {
  MOK_REQUIRE(dy && fc2_weight && gu && offsets && counts && dgu && common_ok(rows_cap, L, H, I));
  MOK_REQUIRE(aligned16(gu) && aligned16(dgu) && (h == nullptr || aligned16(h)));
  MOK_REQUIRE(router_weight == nullptr || (d_router_weight != nullptr && scratch != nullptr));
  if (rows_cap == 0) return MOK_OK;
  if (block_m == 128)
    return fc2_dgrad_swiglu<128>(dy, fc2_weight, gu, offsets, counts, router_weight, dgu, h,
                                 d_router_weight, scratch, rows_cap, L, H, I, num_ctas, stream);
  if (block_m == 64)
    return fc2_dgrad_swiglu<64>(dy, fc2_weight, gu, offsets, counts, router_weight, dgu, h,
                                d_router_weight, scratch, rows_cap, L, H, I, num_ctas, stream);
  return MOK_ERR_UNSUPPORTED;
}

MOK_API int mok_gemm_fc1_dgrad(const void* dgu, const void* fc1_weight, const int32_t* offsets,
                               void* dx, int64_t rows_cap, int L, int H, int I, int block_m,
                               int wg_n, int tma_store, int num_ctas, cudaStream_t stream) {
  MOK_REQUIRE(dgu && fc1_weight && offsets && dx && common_ok(rows_cap, L, H, I) && aligned16(dx));
  if (rows_cap == 0) return MOK_OK;
  if (wg_n == 0) wg_n = 256;
#define MOK_FC1_DGRAD(BM, WGN, TMA)                                                              \
  if (block_m == BM && wg_n == WGN && (tma_store != 0) == TMA)                                  \
    return fc1_dgrad<BM, WGN, TMA>(dgu, fc1_weight, offsets, dx, rows_cap, L, H, I, num_ctas,   \
                                   stream);
  MOK_FC1_DGRAD(128, 256, false)
  MOK_FC1_DGRAD(64, 256, false)
  MOK_FC1_DGRAD(128, 256, true)
  MOK_FC1_DGRAD(64, 128, true)
#undef MOK_FC1_DGRAD
  return MOK_ERR_UNSUPPORTED;
}
