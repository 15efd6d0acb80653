// The row GEMMs whose epilogue pushes the output rows home (mok/gemm/push.cuh): fc2 of the
// forward and the fc1 data gradient of the backward, as the cuda backend runs them outside the
// megakernel. Bitwise mok_gemm_fc2 / mok_gemm_fc1_dgrad followed by mok_push_rows.
#include <cuda_runtime.h>

#include "mok/cuda_check.cuh"
#include "mok/gemm/host.cuh"
#include "mok/gemm/push.cuh"
#include "mok/grouped_gemm.h"

using namespace mok::gemm;

namespace {

// out[R, N] = a[R, K] * B_e pushed home: kKMajor B = w[e] as [N, K] (fc2: N = H, K = I),
// kMNMajor B = w[e] as [K, N] (fc1 data gradient: K = 2I, N = H). The tile shape and the K loop
// are those of the unfused kernel of the same (BM, WGN), so every element is accumulated in the
// same order; the epilogue rounds it as StoreEpilogue / TmaStoreEpilogue do.
template <BLayout kB, int BM, int WGN>
int row_gemm_push(const void* a, const void* w, const int32_t* offsets, const PushEpilogue::Params& epi,
                  int64_t rows_cap, int L, int K, int N, int num_ctas, cudaStream_t stream) {
  using Cfg = RowCfg<BM, WGN, kB, false, false>;
  MOK_REQUIRE(K % kBK == 0 && N % Cfg::BN == 0);
  if (rows_cap < BM) return MOK_OK;  // no full row block: the layout is empty
  RowKernelParams<PushEpilogue> p{};
  int rc = encode_map_2d(&p.op.map_a, a, K, rows_cap, kBK, BM);
  if (rc != MOK_OK) return rc;
  if constexpr (kB == BLayout::kKMajor)
    rc = encode_map_2d(&p.op.map_b, w, K, (uint64_t)L * N, kBK, b_box_rows<Cfg>());
  else
    rc = encode_map_2d(&p.op.map_b, w, N, (uint64_t)L * K, kBK, 64);
  if (rc != MOK_OK) return rc;
  p.op.K = K;
  p.op.N = N;
  p.epi = epi;
  p.offsets = offsets;
  p.counts = nullptr;  // padding rows are told by the table (source -1), as mok_push_rows does
  p.L = L;
  p.num_cb = N / Cfg::BN;
  p.rows_cap = rows_cap;
  return launch_row_gemm<Cfg>(p, num_ctas, stream);
}

bool common_ok(int64_t rows_cap, int L, int H, int I) {
  return rows_cap >= 0 && rows_cap < (int64_t)INT32_MAX && L >= 1 && L <= kMaxExperts && H > 0 &&
         I > 0;
}

// The push arguments both entry points share: the table is read as int2 (8-byte aligned), the
// slots with 16-byte vectors, the scalar slots as floats.
bool push_ok(const int32_t* table, const uint64_t* bases, int64_t slots_offset, const float* row_scalars,
             int64_t scalars_offset) {
  return table != nullptr && bases != nullptr && (reinterpret_cast<uintptr_t>(table) & 7u) == 0 &&
         slots_offset >= 0 && slots_offset % 16 == 0 &&
         (row_scalars == nullptr || (scalars_offset >= 0 && scalars_offset % 4 == 0));
}

PushEpilogue::Params push_params(const int32_t* table, const uint64_t* bases, int64_t slots_offset,
                                 const float* row_scalars, int64_t scalars_offset, int64_t rows_cap, int H) {
  PushEpilogue::Params e{};
  e.to = PushTargets{bases, slots_offset, table, H};
  e.scalars_offset = scalars_offset;
  e.scalars = row_scalars;
  e.rows_cap = rows_cap;
  return e;
}

}  // namespace

MOK_API int mok_gemm_fc2_push(const void* h, const void* fc2_weight, const int32_t* offsets,
                              const int32_t* table, const uint64_t* bases, int64_t slots_offset,
                              int64_t rows_cap, int L, int H, int I, int block_m, int wg_n,
                              int num_ctas, cudaStream_t stream) {
  MOK_REQUIRE(h && fc2_weight && offsets && common_ok(rows_cap, L, H, I));
  MOK_REQUIRE(push_ok(table, bases, slots_offset, nullptr, 0));
  if (rows_cap == 0) return MOK_OK;
  if (wg_n == 0) wg_n = 256;
  const PushEpilogue::Params epi = push_params(table, bases, slots_offset, nullptr, 0, rows_cap, H);
#define MOK_FC2_PUSH(BM, WGN)                                                                 \
  if (block_m == BM && wg_n == WGN)                                                           \
    return row_gemm_push<BLayout::kKMajor, BM, WGN>(h, fc2_weight, offsets, epi, rows_cap, L, I, H, \
                                                    num_ctas, stream);
  MOK_FC2_PUSH(128, 256)
  MOK_FC2_PUSH(64, 256)
  MOK_FC2_PUSH(64, 128)
#undef MOK_FC2_PUSH
  return MOK_ERR_UNSUPPORTED;
}

MOK_API int mok_gemm_fc1_dgrad_push(const void* dgu, const void* fc1_weight, const int32_t* offsets,
                                    const int32_t* table, const uint64_t* bases, int64_t slots_offset,
                                    const float* row_scalars, int64_t scalars_offset, int64_t rows_cap,
                                    int L, int H, int I, int block_m, int wg_n, int num_ctas,
                                    cudaStream_t stream) {
  MOK_REQUIRE(dgu && fc1_weight && offsets && common_ok(rows_cap, L, H, I));
  MOK_REQUIRE(push_ok(table, bases, slots_offset, row_scalars, scalars_offset));
  if (rows_cap == 0) return MOK_OK;
  if (wg_n == 0) wg_n = 256;
  const PushEpilogue::Params epi =
      push_params(table, bases, slots_offset, row_scalars, scalars_offset, rows_cap, H);
#define MOK_DGRAD_PUSH(BM, WGN)                                                                  \
  if (block_m == BM && wg_n == WGN)                                                              \
    return row_gemm_push<BLayout::kMNMajor, BM, WGN>(dgu, fc1_weight, offsets, epi, rows_cap, L, \
                                                     2 * I, H, num_ctas, stream);
  MOK_DGRAD_PUSH(128, 256)
  MOK_DGRAD_PUSH(64, 256)
#undef MOK_DGRAD_PUSH
  return MOK_ERR_UNSUPPORTED;
}
