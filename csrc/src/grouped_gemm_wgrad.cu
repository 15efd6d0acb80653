// Weight gradients of the expert FFN: out[e] = a_e^T b_e over each expert's rows, or over the
// part of them inside a range of the layout's rows with an fp32 partial sum carried between
// consecutive ranges.
#include <cuda_runtime.h>

#include <type_traits>

#include "mok/cuda_check.cuh"
#include "mok/gemm/host.cuh"
#include "mok/grouped_gemm.h"

using namespace mok::gemm;

namespace {

// kEpi: 0 direct stores (WgradEpilogue), 1 TMA-staged bf16 (WgradTmaEpilogue), 2 fp32 accumulated
// through the staging buffer (WgradAccumulateEpilogue).
template <int kEpi>
int weight_grad(const void* a, const void* b, const int32_t* offsets, const int32_t* counts,
                void* out, const uint64_t* out_table, int out_bf16,
                int accumulate, int64_t rows_cap, int L, int M, int N, int row0, int row1,
                const float* carry_in, float* carry_out, int num_ctas, cudaStream_t stream) {
  constexpr bool kTma = kEpi == 1;
  using Cfg = WgradCfg<kEpi != 0>;
  using Epi = std::conditional_t<kEpi == 1, WgradTmaEpilogue,
                                 std::conditional_t<kEpi == 2, WgradAccumulateEpilogue, WgradEpilogue>>;
  WgradKernelParams<Epi> p{};
  // A range without a whole 64-row block has no K loop at all: a and b are never read (and
  // tensor maps of fewer rows than a box are not encoded).
  if (row1 > row0) {
    int rc = encode_map_2d(&p.op.map_a, a, M, rows_cap, kBK, 64);
    if (rc != MOK_OK) return rc;
    rc = encode_map_2d(&p.op.map_b, b, N, rows_cap, kBK, 64);
    if (rc != MOK_OK) return rc;
  }
  p.op.M = M;
  p.op.N = N;
  p.op.carry_in = carry_in;
  if constexpr (kTma) {
    const int rc = encode_map_2d(&p.epi.map, out, N, (uint64_t)L * M, 64, 64);
    if (rc != MOK_OK) return rc;
    p.epi.M = M;
    p.epi.N = N;
    p.epi.carry_out = carry_out;
  } else {
    p.epi = {out, out_table, out_bf16 ? 1 : 0, accumulate ? 1 : 0, M, N, carry_out};
  }
  p.offsets = offsets;
  p.counts = counts;
  p.L = L;
  p.row0 = row0;
  p.row1 = row1;
  const int64_t tiles = (int64_t)L * (M / Cfg::BM) * (N / Cfg::BN);
  return launch_persistent(wgrad_kernel<Cfg, Epi>, p, tiles, Cfg::kSmemBytes, num_ctas, stream);
}

bool overlap(const void* x, const void* y, size_t bytes) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(x), b = reinterpret_cast<uintptr_t>(y);
  return a < b + bytes && b < a + bytes;
}

}  // namespace

MOK_API int mok_gemm_weight_grad(const void* a, const void* b, const int32_t* offsets,
                                 const int32_t* counts, void* out, const uint64_t* out_table,
                                 int out_bf16, int accumulate, int tma_store, int64_t rows_cap, int L, int M, int N, int64_t row0, int64_t row1,
                                 const float* carry_in, float* carry_out, int num_ctas,
                                 cudaStream_t stream) {
  // out_table (accumulate only): expert e's fp32 [M, N] at out_table[e], each 16-byte aligned;
  // out is then not read.
  MOK_REQUIRE(offsets && (rows_cap == 0 || (a && b)));
  MOK_REQUIRE(out_table ? (accumulate && !out_bf16 && !tma_store) : (out && aligned16(out)));
  MOK_REQUIRE(rows_cap >= 0 && rows_cap < (int64_t)INT32_MAX && L >= 1 && L <= kMaxExperts);
  MOK_REQUIRE(M > 0 && N > 0 && M % 128 == 0 && N % 256 == 0);
  MOK_REQUIRE(!(out_bf16 && accumulate));
  MOK_REQUIRE(!tma_store || out_bf16);  // the TMA-staged epilogue writes bf16
  MOK_REQUIRE((int64_t)L * (M / 128) * (N / 256) < (int64_t)INT32_MAX);
  // The range: row0 a multiple of 64; row1 a multiple of 64 above row0 within the rows a and b
  // hold, or exactly row0 + rows_cap (all of them, the last range).
  MOK_REQUIRE(row0 >= 0 && row0 % kBK == 0 && row0 + rows_cap < (int64_t)INT32_MAX);
  MOK_REQUIRE(row1 == row0 + rows_cap || (row1 % kBK == 0 && row0 < row1 && row1 - row0 <= rows_cap));
  MOK_REQUIRE(row0 == 0 || carry_in != nullptr);
  MOK_REQUIRE(!carry_in || aligned16(carry_in));
  MOK_REQUIRE(!carry_out || aligned16(carry_out));
  MOK_REQUIRE(!(carry_in && carry_out && overlap(carry_in, carry_out, (size_t)M * N * 4)));
  // Rows past the last multiple of 64 cannot belong to a segment (offsets are multiples of 64).
  const int64_t row1_blocks = row0 + (row1 - row0) / kBK * kBK;
  // Accumulation goes through the staging buffer (WgradAccumulateEpilogue); bf16 is TMA-staged
  // or direct as asked; a plain fp32 out is stored directly.
  if (tma_store)
    return weight_grad<1>(a, b, offsets, counts, out, out_table, out_bf16, accumulate, rows_cap, L, M, N,
                          (int)row0, (int)row1_blocks, carry_in, carry_out, num_ctas, stream);
  if (accumulate)
    return weight_grad<2>(a, b, offsets, counts, out, out_table, out_bf16, accumulate, rows_cap, L, M, N,
                          (int)row0, (int)row1_blocks, carry_in, carry_out, num_ctas, stream);
  return weight_grad<0>(a, b, offsets, counts, out, out_table, out_bf16, accumulate, rows_cap, L, M, N, (int)row0,
                        (int)row1_blocks, carry_in, carry_out, num_ctas, stream);
}
