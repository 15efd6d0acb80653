// Data gradients of the expert FFN: fc2's fused with the SwiGLU backward (and the router-weight
// gradient), and the plain ones: fc1's (dx = dgu W1_e) and fc2's (dh = dy D_e).
#include <cuda_runtime.h>

#include <type_traits>

#include "mok/cuda_check.cuh"
#include "mok/gemm/host.cuh"
#include "mok/grouped_gemm.h"

using namespace mok::gemm;

namespace {

constexpr int kSlice = 256;  // columns per router-weight partial sum (SwiGLUBackwardEpilogue)

// 128 x 256 tiles (64 x 256 for BM = 64: two warpgroups of 128 columns, so that the staging
// buffers leave four pipeline stages).
template <int BM, bool kMc>
int fc2_dgrad_swiglu(const void* dy, const void* w2, const void* gu, const int32_t* offsets,
                     const int32_t* counts, const float* scale, void* dgu, void* h, float* dscale,
                     float* scratch, int64_t rows_cap, int L, int H, int I, int num_ctas,
                     cudaStream_t stream) {
  // Staging buffers on (the offloaded epilogue reads the bf16 dh tile from them).
  using Cfg = RowCfg<BM, BM == 128 ? 256 : 128, BLayout::kMNMajor, true, kMc>;
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
  return sum_partials(scratch, I / kSlice, offsets, L, rows_cap, dscale, stream);
}

// out[R, N] = a[R, K] * W_e with W_e = w[e] as [K, N] (MN-major B).
template <int BM, int WGN, bool kTma, bool kMc>
int dgrad(const void* a, const void* w, const int32_t* offsets, void* out, int64_t rows_cap, int L,
          int K, int N, int num_ctas, cudaStream_t stream) {
  using Cfg = RowCfg<BM, WGN, BLayout::kMNMajor, kTma, kMc>;
  using Epi = std::conditional_t<kTma, TmaStoreEpilogue, StoreEpilogue>;
  MOK_REQUIRE(K % kBK == 0 && N % Cfg::BN == 0);
  if (rows_cap < BM) return MOK_OK;  // no full row block: the layout is empty
  RowKernelParams<Epi> p{};
  int rc = encode_map_2d(&p.op.map_a, a, K, rows_cap, kBK, BM);
  if (rc != MOK_OK) return rc;
  rc = encode_map_2d(&p.op.map_b, w, N, (uint64_t)L * K, kBK, 64);
  if (rc != MOK_OK) return rc;
  p.op.K = K;
  p.op.N = N;
  if constexpr (kTma) {
    rc = encode_map_2d(&p.epi.map, out, N, rows_cap, 64, 64);
    if (rc != MOK_OK) return rc;
  } else {
    p.epi = {static_cast<__nv_bfloat16*>(out), N, rows_cap};
  }
  p.offsets = offsets;
  p.counts = nullptr;
  p.L = L;
  p.num_cb = N / Cfg::BN;
  p.rows_cap = rows_cap;
  return launch_row_gemm<Cfg>(p, num_ctas, stream);
}

int dgrad_variant(const void* a, const void* w, const int32_t* offsets, void* out,
                  int64_t rows_cap, int L, int K, int N, int block_m, int wg_n, int tma_store,
                  int multicast, int num_ctas, cudaStream_t stream) {
  if (wg_n == 0) wg_n = 256;
#define MOK_DGRAD(BM, WGN, TMA, MC)                                                              \
  if (block_m == BM && wg_n == WGN && (tma_store != 0) == TMA && (multicast != 0) == MC)        \
    return dgrad<BM, WGN, TMA, MC>(a, w, offsets, out, rows_cap, L, K, N, num_ctas, stream);
  MOK_DGRAD(128, 256, false, false)
  MOK_DGRAD(64, 256, false, false)
  MOK_DGRAD(128, 256, true, false)
  MOK_DGRAD(64, 128, true, false)
  MOK_DGRAD(128, 256, true, true)
#undef MOK_DGRAD
  return MOK_ERR_UNSUPPORTED;
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
                                      int L, int H, int I, int block_m, int multicast,
                                      int num_ctas, cudaStream_t stream) {
  MOK_REQUIRE(dy && fc2_weight && gu && offsets && counts && dgu && common_ok(rows_cap, L, H, I));
  MOK_REQUIRE(aligned16(gu) && aligned16(dgu) && (h == nullptr || aligned16(h)));
  MOK_REQUIRE(router_weight == nullptr || (d_router_weight != nullptr && scratch != nullptr));
  if (rows_cap == 0) return MOK_OK;
  if (block_m == 128 && !multicast)
    return fc2_dgrad_swiglu<128, false>(dy, fc2_weight, gu, offsets, counts, router_weight, dgu, h,
                                        d_router_weight, scratch, rows_cap, L, H, I, num_ctas,
                                        stream);
  if (block_m == 64 && !multicast)
    return fc2_dgrad_swiglu<64, false>(dy, fc2_weight, gu, offsets, counts, router_weight, dgu, h,
                                       d_router_weight, scratch, rows_cap, L, H, I, num_ctas,
                                       stream);
  if (block_m == 128 && multicast)
    return fc2_dgrad_swiglu<128, true>(dy, fc2_weight, gu, offsets, counts, router_weight, dgu, h,
                                       d_router_weight, scratch, rows_cap, L, H, I, num_ctas,
                                       stream);
  return MOK_ERR_UNSUPPORTED;
}

MOK_API int mok_gemm_fc1_dgrad(const void* dgu, const void* fc1_weight, const int32_t* offsets,
                               void* dx, int64_t rows_cap, int L, int H, int I, int block_m,
                               int wg_n, int tma_store, int multicast, int num_ctas,
                               cudaStream_t stream) {
  MOK_REQUIRE(dgu && fc1_weight && offsets && dx && common_ok(rows_cap, L, H, I) && aligned16(dx));
  if (rows_cap == 0) return MOK_OK;
  return dgrad_variant(dgu, fc1_weight, offsets, dx, rows_cap, L, 2 * I, H, block_m, wg_n,
                       tma_store, multicast, num_ctas, stream);
}

MOK_API int mok_gemm_fc2_dgrad(const void* dy, const void* fc2_weight, const int32_t* offsets,
                               void* dh, int64_t rows_cap, int L, int H, int I, int block_m,
                               int wg_n, int tma_store, int multicast, int num_ctas,
                               cudaStream_t stream) {
  MOK_REQUIRE(dy && fc2_weight && offsets && dh && common_ok(rows_cap, L, H, I) && aligned16(dh));
  if (rows_cap == 0) return MOK_OK;
  return dgrad_variant(dy, fc2_weight, offsets, dh, rows_cap, L, H, I, block_m, wg_n, tma_store,
                       multicast, num_ctas, stream);
}
