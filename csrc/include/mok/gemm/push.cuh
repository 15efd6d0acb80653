// Pushing a row GEMM's output rows home from its epilogue: each row of the expert-grouped layout
// goes to its (token, slot) row of the bf16 slots [T_cap, K, H] on the rank that owns the token
// (peer memory through the symmetric-memory bases), as mok_push_rows (comm.cu) copies them, so
// the rows are never written to the layout and read back.
//
// Shared by the standalone row GEMMs (PushEpilogue: fc2 forward and the fc1 data gradient of the
// cuda backend, csrc/src/grouped_gemm_push.cu) and the forward megakernel's fc2 epilogue
// (megakernel/push.cuh). The fragments, the rounding and the 16-byte vectors (a quad transpose)
// are gemm::StoreEpilogue's (one helper, for_each_row_vector), so a pushed row is bitwise the row
// the GEMM writes and mok_push_rows copies.
//
// Memory ordering is the caller's: these are plain weak stores, like mok_push_rows's. The
// standalone kernels rely on the stream order (the barrier kernel that follows them; see
// grouped_gemm.h), the megakernel on its delivery count and flags (megakernel/push.cuh).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "mok/gemm/epilogue.cuh"
#include "mok/gemm/scheduler.cuh"

namespace mok {
namespace gemm {

// Where a launch's output rows go.
struct PushTargets {
  const uint64_t* bases;  // device [P]: every rank's workspace region
  int64_t slots_offset;   // byte offset of the bf16 slots [T_cap, K, H] in a region
  const int32_t* table;   // schedule rows of the launch's layout rows [rows, 2]: (source rank or
                          // -1 for padding, token * K + slot)
  int H;                  // row length: the GEMM's N
};

// Rank s's workspace region.
__device__ __forceinline__ char* push_region(const PushTargets& p, int s) {
  return reinterpret_cast<char*>(__ldg(p.bases + s));
}

// The table entry of layout row `row`; source -1 (padding, or, kBounded, a row at or past
// rows_end, which the table does not hold) pushes nothing.
template <bool kBounded>
__device__ __forceinline__ int2 push_entry(const PushTargets& p, int64_t row, int64_t rows_end) {
  if (kBounded && row >= rows_end) return make_int2(-1, 0);
  return __ldg(reinterpret_cast<const int2*>(p.table) + row);
}

// Consumer warpgroup's 64 x WGN fp32 accumulator, rounded to bf16, into the home rows of layout
// rows row0 .. row0 + 63, columns col0 .. col0 + WGN - 1 (rows whose entry is -1, or at or past
// rows_end: nothing; kBounded false: the caller knows every row is inside the table). Called by
// the 128 threads of the warpgroup (the quad transpose shuffles across each warp).
template <int WGN, bool kBounded = true>
__device__ __forceinline__ void push_fragment(const PushTargets& p, int64_t row0, int col0,
                                              int64_t rows_end, const float (&acc)[WGN / 2]) {
  const Fragment f;
  const int c0 = col0 + 8 * (threadIdx.x % 4);
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int2 entry = push_entry<kBounded>(p, row0 + f.row + 8 * j, rows_end);
    __nv_bfloat16* home = nullptr;
    if (entry.x >= 0)
      home = reinterpret_cast<__nv_bfloat16*>(push_region(p, entry.x) + p.slots_offset) + (int64_t)entry.y * p.H;
    for_each_row_vector<WGN>(acc, j, [&](int i0, uint4 v) {  // every lane: shuffles
      if (home != nullptr) *reinterpret_cast<uint4*>(home + c0 + 8 * i0) = v;
    });
  }
}

// One fp32 value per layout row, values[row], into the home rank's fp32 [T_cap, K] scalar slots
// (bases[s] + scalars_offset) for rows row0 .. row0 + 63: the fragment's row owners (lane % 4 ==
// 0) store their two rows. Called by the 128 threads of a warpgroup.
__device__ __forceinline__ void push_row_scalars(const PushTargets& p, int64_t scalars_offset,
                                                 const float* values, int64_t row0, int64_t rows_end) {
  if (threadIdx.x % 4 != 0) return;
  const Fragment f;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int64_t row = row0 + f.row + 8 * j;
    const int2 entry = push_entry<true>(p, row, rows_end);
    if (entry.x < 0) continue;
    reinterpret_cast<float*>(push_region(p, entry.x) + scalars_offset)[entry.y] = __ldg(values + row);
  }
}

// The standalone row GEMMs' push epilogue: direct stores into the home rows (a TMA store cannot
// scatter rows to computed addresses). Rows are the launch's layout rows (a chunk's, with the
// chunk's table slice). With `scalars`, the tiles of column block 0 (wn = 0: every row once)
// also push the row's fp32 value (the router-weight gradient dw in the backward): 4 bytes a row
// next to 2H, with the table entry already in L1, instead of a second launch that reads the
// table again and costs a launch and a tail.
struct PushEpilogue {
  static constexpr bool kOffload = false;
  struct Params {
    PushTargets to;          // to.H = N
    int64_t scalars_offset;  // byte offset of the fp32 scalar slots [T_cap, K] (with scalars)
    const float* scalars;    // fp32 [rows_cap], a value per layout row, or null
    int64_t rows_cap;        // rows of the layout (and of the table slice)
  };
  template <int WGN>
  __device__ __forceinline__ static void apply(const Params& p, const RowTile& t, int wm, int wn, int bn,
                                               float (&acc)[WGN / 2], uint8_t*, int) {
    const int64_t row0 = static_cast<int64_t>(t.row0) + wm * 64;
    push_fragment<WGN>(p.to, row0, t.col_block * bn + wn * WGN, p.rows_cap, acc);
    if (p.scalars != nullptr && t.col_block == 0 && wn == 0)
      push_row_scalars(p.to, p.scalars_offset, p.scalars, row0, p.rows_cap);
  }
  __device__ __forceinline__ static void finish(int) {}
};

}  // namespace gemm
}  // namespace mok
