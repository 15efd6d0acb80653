// Forward grouped GEMMs of the expert FFN: fc1 with the SwiGLU epilogue fused, and fc2.
#include <cuda_runtime.h>

#include <type_traits>

#include "mok/cuda_check.cuh"
#include "mok/gemm/host.cuh"
#include "mok/grouped_gemm.h"

using namespace mok::gemm;

namespace {

template <int BM, int WGN, bool kTma, bool kMc>
int fc1_swiglu(const void* x, const void* w1, const int32_t* offsets, const int32_t* counts,
               const float* scale, void* h, void* gu, int64_t rows_cap, int L, int H, int I,
               int num_ctas, cudaStream_t stream) {
  using Cfg = RowCfg<BM, WGN, BLayout::kSwiGLU, kTma, kMc>;
  using Epi = std::conditional_t<kTma, SwiGLUForwardTmaEpilogue, SwiGLUForwardEpilogue>;
  MOK_REQUIRE(H % kBK == 0 && I % (Cfg::BN / 2) == 0);
  if (rows_cap < BM) return MOK_OK;  // no full row block: the layout is empty
  RowKernelParams<Epi> p{};
  int rc = encode_map_2d(&p.op.map_a, x, H, rows_cap, kBK, BM);
  if (rc != MOK_OK) return rc;
  rc = encode_map_2d(&p.op.map_b, w1, H, (uint64_t)L * 2 * I, kBK, b_box_rows<Cfg>());
  if (rc != MOK_OK) return rc;
  p.op.K = H;
  p.op.N = 2 * I;
  if constexpr (kTma) {
    rc = encode_map_2d(&p.epi.map_h, h, I, rows_cap, 64, 64);
    if (rc == MOK_OK && gu != nullptr) rc = encode_map_2d(&p.epi.map_gu, gu, 2 * (uint64_t)I, rows_cap, 64, 64);
    if (rc != MOK_OK) return rc;
    p.epi.has_gu = gu != nullptr;
    p.epi.scale = scale;
    p.epi.inter = I;
    p.epi.rows_cap = rows_cap;
  } else {
    p.epi = {static_cast<__nv_bfloat16*>(h), static_cast<__nv_bfloat16*>(gu), scale, I, rows_cap};
  }
  p.offsets = offsets;
  p.counts = counts;
  p.L = L;
  p.num_cb = I / (Cfg::BN / 2);
  p.rows_cap = rows_cap;
  return launch_row_gemm<Cfg>(p, num_ctas, stream);
}

template <int BM, int WGN, bool kTma, bool kMc>
int fc2(const void* h, const void* w2, const int32_t* offsets, void* y, int64_t rows_cap, int L,
        int H, int I, int num_ctas, cudaStream_t stream) {
  using Cfg = RowCfg<BM, WGN, BLayout::kKMajor, kTma, kMc>;
  using Epi = std::conditional_t<kTma, TmaStoreEpilogue, StoreEpilogue>;
  MOK_REQUIRE(I % kBK == 0 && H % Cfg::BN == 0);
  if (rows_cap < BM) return MOK_OK;  // no full row block: the layout is empty
  RowKernelParams<Epi> p{};
  int rc = encode_map_2d(&p.op.map_a, h, I, rows_cap, kBK, BM);
  if (rc != MOK_OK) return rc;
  rc = encode_map_2d(&p.op.map_b, w2, I, (uint64_t)L * H, kBK, b_box_rows<Cfg>());
  if (rc != MOK_OK) return rc;
  p.op.K = I;
  p.op.N = H;
  if constexpr (kTma) {
    rc = encode_map_2d(&p.epi.map, y, H, rows_cap, 64, 64);
    if (rc != MOK_OK) return rc;
  } else {
    p.epi = {static_cast<__nv_bfloat16*>(y), H, rows_cap};
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

MOK_API int mok_gemm_fc1_swiglu(const void* x, const void* fc1_weight, const int32_t* offsets,
                                const int32_t* counts, const float* router_weight, void* h,
                                void* gu, int64_t rows_cap, int L, int H, int I, int block_m,
                                int wg_n, int tma_store, int multicast, int num_ctas,
                                cudaStream_t stream) {
  MOK_REQUIRE(x && fc1_weight && offsets && counts && h && common_ok(rows_cap, L, H, I));
  MOK_REQUIRE(aligned16(h) && (gu == nullptr || aligned16(gu)));
  if (rows_cap == 0) return MOK_OK;
  if (wg_n == 0) wg_n = 256;
#define MOK_FC1(BM, WGN, TMA, MC)                                                                \
  if (block_m == BM && wg_n == WGN && (tma_store != 0) == TMA && (multicast != 0) == MC)        \
    return fc1_swiglu<BM, WGN, TMA, MC>(x, fc1_weight, offsets, counts, router_weight, h, gu,   \
                                        rows_cap, L, H, I, num_ctas, stream);
  MOK_FC1(128, 256, false, false)
  MOK_FC1(64, 256, false, false)
  MOK_FC1(64, 128, false, false)
  MOK_FC1(128, 256, true, false)
  MOK_FC1(64, 128, true, false)
  MOK_FC1(128, 256, false, true)
  MOK_FC1(128, 256, true, true)
#undef MOK_FC1
  return MOK_ERR_UNSUPPORTED;
}

MOK_API int mok_gemm_fc2(const void* h, const void* fc2_weight, const int32_t* offsets, void* y,
                         int64_t rows_cap, int L, int H, int I, int block_m, int wg_n,
                         int tma_store, int multicast, int num_ctas, cudaStream_t stream) {
  MOK_REQUIRE(h && fc2_weight && offsets && y && common_ok(rows_cap, L, H, I) && aligned16(y));
  if (rows_cap == 0) return MOK_OK;
  if (wg_n == 0) wg_n = 256;
#define MOK_FC2(BM, WGN, TMA, MC)                                                                \
  if (block_m == BM && wg_n == WGN && (tma_store != 0) == TMA && (multicast != 0) == MC)        \
    return fc2<BM, WGN, TMA, MC>(h, fc2_weight, offsets, y, rows_cap, L, H, I, num_ctas, stream);
  MOK_FC2(128, 256, false, false)
  MOK_FC2(64, 256, false, false)
  MOK_FC2(64, 128, false, false)
  MOK_FC2(128, 256, true, false)
  MOK_FC2(64, 128, true, false)
  MOK_FC2(128, 256, true, true)
#undef MOK_FC2
  return MOK_ERR_UNSUPPORTED;
}
