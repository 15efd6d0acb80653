// Epilogues: what a consumer warpgroup does with its 64 x WGN fp32 accumulator of a tile.
//
// Every epilogue has apply<WGN>(params, tile, wm, wn, bn, acc, staging, cw), called by the
// 128 threads of consumer warpgroup cw after mma_*_tile, and finish(cw), called once after the
// warpgroup's last tile. Each output element belongs to exactly one thread of one tile, so the
// results are deterministic.
//
// Two ways to write: direct stores from registers (each thread its own fragment, see
// wgmma.cuh), or through the warpgroup's shared-memory staging buffer: the fragments are
// written there in the 128-byte swizzled layout of a {64 x 64} TMA box (conflict-free: the 8
// rows a warp touches land in 8 different 16-byte chunks), and one thread issues TMA bulk
// stores that drain while the warpgroup already runs the next tile's K loop. The staging
// buffer is reused only after that thread's previous bulk stores have finished reading it. The
// fp32 accumulation into main_grad also stages, in fp32 halves, and its warps then read, add and
// write whole rows of main_grad (WgradAccumulateEpilogue).
//
// An epilogue with kOffload (the SwiGLU backward) instead has offload<Cfg>(params, tile,
// staging, e): the consumers stage their bf16 tile and go on, and warps 1-3 of the producer
// warpgroup run the epilogue from the staging buffers (row_gemm_kernel in kernels.cuh).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "mok/gemm/config.cuh"
#include "mok/gemm/ptx.cuh"
#include "mok/gemm/scheduler.cuh"
#include "mok/swiglu_math.cuh"

namespace mok {
namespace gemm {

using ::mok::sigmoid;
using ::mok::silu;
using ::mok::swiglu_backward8;
using ::mok::warp_sum;

// The rows and the first column a thread's fragment covers.
struct Fragment {
  int row;  // rows `row` and `row + 8` (relative to the warpgroup's 64-row slice)
  int col;  // columns col + 8 * i and col + 8 * i + 1
  __device__ __forceinline__ Fragment() {
    const int t = threadIdx.x % 128;
    row = 16 * (t / 32) + (t % 32) / 4;
    col = 2 * (t % 4);
  }
};

// ---- direct stores ---------------------------------------------------------------------------

__device__ __forceinline__ uint32_t bf16x2_bits(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// The 4 lanes of a quad (lane % 4 = q) share their fragment rows; for 4 consecutive 8-column
// blocks k = 0..3, lane q holds the bf16 pair x[k] at columns 2q, 2q + 1 of block k. A 4 x 4
// transpose over the quad (two xor-shuffle rounds, 4 shuffles) gives lane q the whole block q,
// columns 0..7 in order: one 16-byte store instead of four 4-byte ones, and whole 32-byte
// sectors per row. All 32 lanes must call it (the shuffles take the full warp).
__device__ __forceinline__ uint4 quad_transpose(uint32_t x0, uint32_t x1, uint32_t x2, uint32_t x3) {
  const int q = threadIdx.x % 4;
  const bool b0 = q & 1, b1 = q & 2;
  // Round 1 (lanes q, q ^ 2): keep the blocks with bit 1 = b1, receive the partner's.
  const uint32_t a0 = b1 ? x2 : x0, a1 = b1 ? x3 : x1;  // own, blocks 2 b1 and 2 b1 + 1
  const uint32_t a2 = __shfl_xor_sync(0xffffffffu, b1 ? x0 : x2, 2);  // lane q ^ 2's, block 2 b1
  const uint32_t a3 = __shfl_xor_sync(0xffffffffu, b1 ? x1 : x3, 2);  // ... block 2 b1 + 1
  // Round 2 (lanes q, q ^ 1): keep block q, receive lane q ^ 1's and q ^ 3's pairs of block q.
  const uint32_t z0 = b0 ? a1 : a0;  // from lane q
  const uint32_t z2 = b0 ? a3 : a2;  // from lane q ^ 2
  const uint32_t z1 = __shfl_xor_sync(0xffffffffu, b0 ? a0 : a1, 1);  // from lane q ^ 1
  const uint32_t z3 = __shfl_xor_sync(0xffffffffu, b0 ? a2 : a3, 1);  // from lane q ^ 3
  // Column pair m of block q came from lane m = q ^ d, d = m ^ q.
  const uint32_t u0 = b0 ? z1 : z0, u1 = b0 ? z0 : z1, u2 = b0 ? z3 : z2, u3 = b0 ? z2 : z3;
  return make_uint4(b1 ? u2 : u0, b1 ? u3 : u1, b1 ? u0 : u2, b1 ? u1 : u3);
}

// Fragment row j (0 or 1: rows f.row and f.row + 8) of a warpgroup's 64 x WGN accumulator, rounded
// to bf16 and quad-transposed: store(i0, v) for i0 = 0, 4, .., WGN / 8 - 4 with v the 16 bytes of
// columns c0 + 8 i0 .. c0 + 8 i0 + 7 of that row, c0 = 8 (lane % 4). The one rounding and vector
// layout of every direct bf16 row store (StoreEpilogue, the pushes of gemm/push.cuh), so their
// rows are bitwise the same. All 32 lanes of each warp call it (the shuffles); `store` chooses
// whether to write.
template <int WGN, class Store>
__device__ __forceinline__ void for_each_row_vector(const float (&acc)[WGN / 2], int j, Store&& store) {
#pragma unroll
  for (int i0 = 0; i0 < WGN / 8; i0 += 4) {
    uint32_t x[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) x[k] = bf16x2_bits(acc[4 * (i0 + k) + 2 * j], acc[4 * (i0 + k) + 2 * j + 1]);
    store(i0, quad_transpose(x[0], x[1], x[2], x[3]));
  }
}

// ---- staging through shared memory -----------------------------------------------------------

// Writes the bf16 pair (v0, v1) at row r (0..63), column c (even, 0..63) of box `box`.
__device__ __forceinline__ void stage_pair(uint8_t* staging, int box, int r, int c, float v0,
                                           float v1) {
  uint8_t* p = staging + box * 8192 + r * 128 + (((c >> 3) ^ (r & 7)) << 4) + (c & 7) * 2;
  *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(v0, v1);
}

// A warpgroup's whole 64 x WGN accumulator, rounded to bf16, into its staging buffer (WGN / 64
// boxes of 64 x 64).
template <int WGN>
__device__ __forceinline__ void stage_tile(uint8_t* staging, const float (&acc)[WGN / 2]) {
  const Fragment f;
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int i = 0; i < WGN / 8; ++i)
      stage_pair(staging, i / 8, f.row + 8 * j, (i % 8) * 8 + f.col, acc[4 * i + 2 * j],
                 acc[4 * i + 2 * j + 1]);
}

// The 16-byte vector of the staging buffer that holds row r (0..63), columns 8v .. 8v + 7 of a
// warpgroup's tile.
__device__ __forceinline__ const uint4* staged_vector(const uint8_t* staging, int r, int v) {
  return reinterpret_cast<const uint4*>(staging + (v / 8) * 8192 + r * 128 +
                                        (((v % 8) ^ (r & 7)) << 4));
}

// All 128 threads of warpgroup cw: wait until the staging buffer is free again.
__device__ __forceinline__ void staging_acquire(int cw) {
  if (threadIdx.x % 128 == 0) bulk_wait_read();
  named_barrier_sync(1 + cw, 128);
}

// All 128 threads, after writing the staging buffer: true in the one thread that issues stores.
__device__ __forceinline__ bool staging_publish(int cw) {
  fence_proxy_async_shared();
  named_barrier_sync(1 + cw, 128);
  return threadIdx.x % 128 == 0;
}

__device__ __forceinline__ void staging_finish() {
  if (threadIdx.x % 128 == 0) bulk_wait();
}

// ---- fc1 forward -----------------------------------------------------------------------------

// h = silu(gate) * up (* router weight of the row); gate and up are the two halves of the
// accumulator. Padding rows (>= row_end) get zeros. Optionally stores the pre-activation
// [gate | up] (bf16, the fc1 output the backward needs).
struct SwiGLUForwardEpilogue {
  static constexpr bool kOffload = false;
  struct Params {
    __nv_bfloat16* h;      // [rows_cap, I]
    __nv_bfloat16* gu;     // [rows_cap, 2I] or null
    const float* scale;    // [rows_cap] router weight per row, or null
    int inter;             // I
    int64_t rows_cap;
  };
  template <int WGN>
  __device__ __forceinline__ static void apply(const Params& p, const RowTile& t, int wm, int wn,
                                               int bn, float (&acc)[WGN / 2], uint8_t*, int) {
    constexpr int kBlocks = WGN / 16;  // 8-column blocks of h (and of each gu half)
    const Fragment f;
    const int q = threadIdx.x % 4;
    const int h0 = t.col_block * (bn / 2) + wn * (WGN / 2) + 8 * q;  // this lane's block in a group
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int row = t.row0 + wm * 64 + f.row + 8 * j;
      const bool store = row < p.rows_cap;  // the shuffles need every lane: predicate the stores
      const bool real = row < t.row_end;
      const float w = (p.scale != nullptr && real && store) ? p.scale[row] : 1.f;
      __nv_bfloat16* hrow = p.h + static_cast<int64_t>(row) * p.inter;
#pragma unroll
      for (int i0 = 0; i0 < kBlocks; i0 += 4) {
        uint32_t hx[4], gx[4], ux[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const int i = i0 + k;
          float g0 = acc[4 * i + 2 * j], g1 = acc[4 * i + 2 * j + 1];
          float u0 = acc[4 * (i + kBlocks) + 2 * j], u1 = acc[4 * (i + kBlocks) + 2 * j + 1];
          if (!real) g0 = g1 = u0 = u1 = 0.f;
          hx[k] = bf16x2_bits(silu(g0) * u0 * w, silu(g1) * u1 * w);
          gx[k] = bf16x2_bits(g0, g1);
          ux[k] = bf16x2_bits(u0, u1);
        }
        const int c = h0 + 8 * i0;
        const uint4 hv = quad_transpose(hx[0], hx[1], hx[2], hx[3]);
        if (store) *reinterpret_cast<uint4*>(hrow + c) = hv;
        if (p.gu != nullptr) {
          const uint4 gv = quad_transpose(gx[0], gx[1], gx[2], gx[3]);
          const uint4 uv = quad_transpose(ux[0], ux[1], ux[2], ux[3]);
          if (store) {
            __nv_bfloat16* grow = p.gu + static_cast<int64_t>(row) * 2 * p.inter;
            *reinterpret_cast<uint4*>(grow + c) = gv;
            *reinterpret_cast<uint4*>(grow + p.inter + c) = uv;
          }
        }
      }
    }
  }
  __device__ __forceinline__ static void finish(int) {}
};

// The same through the staging buffer (WGN * 128 bytes: WGN / 64 boxes). Round one stores h
// and (when kept) the gate half of gu, round two the up half.
struct SwiGLUForwardTmaEpilogue {
  static constexpr bool kOffload = false;
  struct Params {
    CUtensorMap map_h;   // h [rows_cap, I], box {64, 64}
    CUtensorMap map_gu;  // gu [rows_cap, 2I], box {64, 64} (unused without gu)
    int has_gu;
    const float* scale;  // [rows_cap] or null
    int inter;
    int64_t rows_cap;
  };
  template <int WGN>
  __device__ __forceinline__ static void apply(const Params& p, const RowTile& t, int wm, int wn,
                                               int bn, float (&acc)[WGN / 2], uint8_t* staging,
                                               int cw) {
    constexpr int kHalfBoxes = WGN / 128;  // boxes of h (and of each gu half) per warpgroup
    const Fragment f;
    const int row0 = t.row0 + wm * 64;
    const int h0 = t.col_block * (bn / 2) + wn * (WGN / 2);
    bool real[2];
    float w[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int row = row0 + f.row + 8 * j;
      real[j] = row < t.row_end && row < p.rows_cap;
      w[j] = (p.scale != nullptr && real[j]) ? p.scale[row] : 1.f;
    }
    staging_acquire(cw);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int r = f.row + 8 * j;
#pragma unroll
      for (int i = 0; i < WGN / 16; ++i) {
        float g0 = acc[4 * i + 2 * j], g1 = acc[4 * i + 2 * j + 1];
        float u0 = acc[4 * (i + WGN / 16) + 2 * j], u1 = acc[4 * (i + WGN / 16) + 2 * j + 1];
        if (!real[j]) g0 = g1 = u0 = u1 = 0.f;
        const int c = (i % 8) * 8 + f.col;
        stage_pair(staging, i / 8, r, c, silu(g0) * u0 * w[j], silu(g1) * u1 * w[j]);
        if (p.has_gu) stage_pair(staging, kHalfBoxes + i / 8, r, c, g0, g1);
      }
    }
    if (staging_publish(cw)) {
#pragma unroll
      for (int b = 0; b < kHalfBoxes; ++b) {
        tma_store_2d(&p.map_h, staging + b * 8192, h0 + b * 64, row0);
        if (p.has_gu) tma_store_2d(&p.map_gu, staging + (kHalfBoxes + b) * 8192, h0 + b * 64, row0);
      }
      bulk_commit();
    }
    if (!p.has_gu) return;
    staging_acquire(cw);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int r = f.row + 8 * j;
#pragma unroll
      for (int i = 0; i < WGN / 16; ++i) {
        float u0 = acc[4 * (i + WGN / 16) + 2 * j], u1 = acc[4 * (i + WGN / 16) + 2 * j + 1];
        if (!real[j]) u0 = u1 = 0.f;
        stage_pair(staging, i / 8, r, (i % 8) * 8 + f.col, u0, u1);
      }
    }
    if (staging_publish(cw)) {
#pragma unroll
      for (int b = 0; b < kHalfBoxes; ++b)
        tma_store_2d(&p.map_gu, staging + b * 8192, p.inter + h0 + b * 64, row0);
      bulk_commit();
    }
  }
  __device__ __forceinline__ static void finish(int) { staging_finish(); }
};

// ---- plain bf16 output (fc2 forward, fc1 data gradient) --------------------------------------

struct StoreEpilogue {
  static constexpr bool kOffload = false;
  struct Params {
    __nv_bfloat16* out;  // [rows_cap, ld]
    int ld;              // N
    int64_t rows_cap;
  };
  template <int WGN>
  __device__ __forceinline__ static void apply(const Params& p, const RowTile& t, int wm, int wn,
                                               int bn, float (&acc)[WGN / 2], uint8_t*, int) {
    const Fragment f;
    const int c0 = t.col_block * bn + wn * WGN + 8 * (threadIdx.x % 4);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int row = t.row0 + wm * 64 + f.row + 8 * j;
      __nv_bfloat16* orow = p.out + static_cast<int64_t>(row) * p.ld;
      for_each_row_vector<WGN>(acc, j, [&](int i0, uint4 v) {
        if (row < p.rows_cap) *reinterpret_cast<uint4*>(orow + c0 + 8 * i0) = v;
      });
    }
  }
  __device__ __forceinline__ static void finish(int) {}
};

struct TmaStoreEpilogue {
  static constexpr bool kOffload = false;
  struct Params {
    CUtensorMap map;  // out [rows_cap, N], box {64, 64}
  };
  template <int WGN>
  __device__ __forceinline__ static void apply(const Params& p, const RowTile& t, int wm, int wn,
                                               int bn, float (&acc)[WGN / 2], uint8_t* staging,
                                               int cw) {
    staging_acquire(cw);
    stage_tile<WGN>(staging, acc);
    if (staging_publish(cw)) {
      const int row0 = t.row0 + wm * 64;
      const int col0 = t.col_block * bn + wn * WGN;
#pragma unroll
      for (int b = 0; b < WGN / 64; ++b) tma_store_2d(&p.map, staging + b * 8192, col0 + b * 64, row0);
      bulk_commit();
    }
  }
  __device__ __forceinline__ static void finish(int) { staging_finish(); }
};

// ---- fc2 data gradient + SwiGLU backward -----------------------------------------------------

// Offloaded: the consumer warpgroups only round dh = dy * D_e to bf16 into their staging buffers
// (stage_tile) and go on with the next tile's K loop; the producer warpgroup's three idle warps
// then run the SwiGLU backward on the staged tile (offload), overlapped with that K loop. With
// the saved pre-activation (a, b) = (gate, up) and the router weight w of the row (1 when
// absent) they write dgu [R, 2I] (da, then db: the row order of the fc1 weight),
// optionally the forward's h = w silu(a) b (the fc2 weight gradient's operand), and when w was
// applied inside fc1 the row's router-weight gradient: each (row, 256-column slice) writes its
// warp sum to partials[slice][row], and sum_partials() adds the slices in order. The math and
// the summation order are those of the separate kernel (mok_swiglu_backward on the plain fc2
// data gradient's dh), so the two paths agree bitwise. Padding rows get zeros.
//
// Not in the consumers, on their fp32 accumulators: the loads of (a, b) and the three stores
// there stall the tensor cores (the fused kernel ran at 0.81-1.12x of torch._grouped_mm plus
// the separate kernel that way, docs/perf-notes.md).
struct SwiGLUBackwardEpilogue {
  static constexpr bool kOffload = true;
  struct Params {
    const __nv_bfloat16* gu;  // [rows_cap, 2I]
    const float* scale;       // [rows_cap] or null
    __nv_bfloat16* dgu;       // [rows_cap, 2I]
    __nv_bfloat16* h;         // [rows_cap, I] or null
    float* partials;          // [I / 256, rows_cap] when scale != null
    int inter;                // I
    int64_t rows_cap;
  };

  // Warp e (0 .. kOffloadWarps - 1) of the offload warps, on the staged tile t. A warp takes one
  // (row, 256-column slice) item at a time, 8 columns per lane, and loads the next item's
  // (a, b) before it works on the current one.
  template <class Cfg>
  __device__ __forceinline__ static void offload(const Params& p, const RowTile& t,
                                                 const uint8_t* staging, int e) {
    constexpr int kSlice = 256;  // columns per item: 32 lanes x 8
    static_assert(Cfg::BN % kSlice == 0, "whole slices per tile");
    constexpr int kItems = Cfg::BM * (Cfg::BN / kSlice);
    const int lane = threadIdx.x % 32;
    const int64_t ld = 2 * static_cast<int64_t>(p.inter);
    auto load = [&](int item, uint4& a, uint4& b) {
      const int row = t.row0 + item % Cfg::BM;
      const int col = t.col_block * Cfg::BN + (item / Cfg::BM) * kSlice + 8 * lane;
      if (row < t.row_end && row < p.rows_cap) {
        const uint4* src = reinterpret_cast<const uint4*>(p.gu + row * ld + col);
        a = __ldg(src);
        b = __ldg(src + p.inter / 8);
      }
    };
    uint4 a_next = {}, b_next = {};
    load(e, a_next, b_next);
    for (int item = e; item < kItems; item += kOffloadWarps) {
      const uint4 a = a_next, b = b_next;
      if (item + kOffloadWarps < kItems) load(item + kOffloadWarps, a_next, b_next);
      const int r = item % Cfg::BM;
      const int row = t.row0 + r;
      if (row >= p.rows_cap) continue;
      const int tile_col = (item / Cfg::BM) * kSlice + 8 * lane;  // column within the tile
      const int col = t.col_block * Cfg::BN + tile_col;
      uint4 da = {}, db = {}, hv = {};
      float part = 0.f;
      if (row < t.row_end) {
        const int cw = (tile_col / Cfg::WGN) * Cfg::WM + r / 64;  // the warpgroup that staged it
        const uint4 g = *staged_vector(staging + cw * Cfg::kStagingBytes, r % 64,
                                       (tile_col % Cfg::WGN) / 8);
        const float w = p.scale != nullptr ? p.scale[row] : 1.f;
        part = swiglu_backward8(a, b, g, w, da, db, hv);
      }
      uint4* drow = reinterpret_cast<uint4*>(p.dgu + row * ld + col);
      drow[0] = da;
      drow[p.inter / 8] = db;
      if (p.h != nullptr)
        *reinterpret_cast<uint4*>(p.h + row * static_cast<int64_t>(p.inter) + col) = hv;
      if (p.scale != nullptr) {
        part = warp_sum(part);
        if (lane == 0) p.partials[static_cast<int64_t>(col / kSlice) * p.rows_cap + row] = part;
      }
    }
  }
};

// ---- weight gradients ------------------------------------------------------------------------

// The fp32 accumulator of consumer warpgroup wm of tile t, stored to or loaded from a row-major
// fp32 [M, ld] matrix at the tile's place (t.m0, t.n0): acc[4i + 2j] and acc[4i + 2j + 1] are
// row t.m0 + 64 wm + f.row + 8j, columns t.n0 + f.col + 8i and + 1. The store and the load use
// the same mapping, so a partial sum carried between launches comes back into the very
// registers it left (and an fp32 round trip is exact).
template <int WGN>
__device__ __forceinline__ void store_wgrad_fp32(float* dst, int ld, const WgradTile& t, int wm,
                                                 const float (&acc)[WGN / 2]) {
  const Fragment f;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int m = t.m0 + wm * 64 + f.row + 8 * j;
    float* o = dst + static_cast<int64_t>(m) * ld + t.n0 + f.col;
#pragma unroll
    for (int i = 0; i < WGN / 8; ++i)
      *reinterpret_cast<float2*>(o + 8 * i) = make_float2(acc[4 * i + 2 * j], acc[4 * i + 2 * j + 1]);
  }
}

// Where `load`, acc is replaced by src's elements (src may be null otherwise). Predicated loads,
// not a branch: accumulator registers defined under control flow before the K loop make ptxas
// serialise the tile's wgmmas (C7515).
template <int WGN>
__device__ __forceinline__ void load_wgrad_fp32(bool load, const float* src, int ld,
                                                const WgradTile& t, int wm, float (&acc)[WGN / 2]) {
  const Fragment f;
  const uint32_t pred = load ? 1u : 0u;
  const uint64_t base = reinterpret_cast<uint64_t>(src);
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int64_t m = t.m0 + wm * 64 + f.row + 8 * j;
    const uint64_t row = base + 4 * static_cast<uint64_t>(m * ld + t.n0 + f.col);
#pragma unroll
    for (int i = 0; i < WGN / 8; ++i)
      asm volatile(
          "{\n\t.reg .pred p;\n\tsetp.ne.u32 p, %2, 0;\n\t@p ld.global.v2.f32 {%0, %1}, [%3];\n\t}"
          : "+f"(acc[4 * i + 2 * j]), "+f"(acc[4 * i + 2 * j + 1])
          : "r"(pred), "l"(row + 32 * i));
  }
}

// out[e][m][n] (fp32 or bf16), written directly; a carry-out tile (its expert's segment goes on
// past the launch's rows) stores its fp32 partial sum to carry_out [M, N] instead. Params are also
// WgradAccumulateEpilogue's (out_table, accumulate).
struct WgradEpilogue {
  struct Params {
    void* out;                  // [L, M, N] fp32 or bf16
    const uint64_t* out_table;  // accumulate only: expert e's [M, N] fp32 at out_table[e], or null (out)
    int out_bf16;               // 1: bf16, 0: fp32
    int accumulate;             // fp32 only: out += acc (WgradAccumulateEpilogue)
    int M, N;
    float* carry_out;           // [M, N] fp32, or null
  };
  __device__ __forceinline__ static float* accumulate_base(const Params& p, int expert) {
    return p.out_table != nullptr ? reinterpret_cast<float*>(__ldg(p.out_table + expert))
                                  : static_cast<float*>(p.out) + static_cast<int64_t>(expert) * p.M * p.N;
  }
  template <int WGN>
  __device__ __forceinline__ static void apply(const Params& p, const WgradTile& t, int wm,
                                               float (&acc)[WGN / 2], uint8_t*, int) {
    if (t.carry_out) {
      store_wgrad_fp32<WGN>(p.carry_out, p.N, t, wm, acc);
      return;
    }
    const Fragment f;
    const int64_t base = static_cast<int64_t>(t.expert) * p.M * p.N;
    if (!p.out_bf16) {
      store_wgrad_fp32<WGN>(static_cast<float*>(p.out) + base, p.N, t, wm, acc);
      return;
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int m = t.m0 + wm * 64 + f.row + 8 * j;
      __nv_bfloat16* o = static_cast<__nv_bfloat16*>(p.out) + base + static_cast<int64_t>(m) * p.N + t.n0 + f.col;
#pragma unroll
      for (int i = 0; i < WGN / 8; ++i)
        *reinterpret_cast<__nv_bfloat162*>(o + 8 * i) =
            __floats2bfloat162_rn(acc[4 * i + 2 * j], acc[4 * i + 2 * j + 1]);
    }
  }
  __device__ __forceinline__ static void finish(int) {}
};

// ---- fp32 main_grad += weight gradient, through the staging buffer ------------------------------
// A warp reads and writes one row of 128 fp32 columns per instruction (512 contiguous bytes), where
// the fragments' own accesses touch 8 rows x 32 bytes: the read-modify-write of main_grad, which
// bounds the accumulating weight gradients, measured 8% faster (docs/perf-notes.md).

// fp32 staging of 64 rows x 128 columns (32 KB): row r's 16-byte unit u (columns 4u .. 4u + 3)
// at r * 512 + ((u ^ (r & 7)) << 4).
__device__ __forceinline__ int staged_f32_offset(int r, int u) { return r * 512 + ((u ^ (r & 7)) << 4); }

// Columns 128h .. 128h + 127 of a warpgroup's 64 x WGN fp32 accumulator into the fp32 staging.
template <int WGN>
__device__ __forceinline__ void stage_half_f32(uint8_t* staging, const float (&acc)[WGN / 2], int h) {
  const Fragment f;
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int i = 16 * h; i < 16 * h + 16; ++i) {
      const int c = 8 * i + f.col - 128 * h, r = f.row + 8 * j;
      *reinterpret_cast<float2*>(staging + staged_f32_offset(r, c / 4) + (c % 4) * 4) =
          make_float2(acc[4 * i + 2 * j], acc[4 * i + 2 * j + 1]);
    }
}

// out[r * ld + c] += staged (r < 64, c < 128), in fp32: a warp reads and writes one row per step,
// eight 16-byte loads in flight per thread before the adds.
__device__ __forceinline__ void add_staged_f32(const uint8_t* staging, float* out, int64_t ld) {
  const int t = threadIdx.x % 128;
#pragma unroll
  for (int k0 = 0; k0 < 16; k0 += 8) {
    float4 g[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int q = (k0 + k) * 128 + t;
      g[k] = *reinterpret_cast<const float4*>(out + (q / 32) * ld + 4 * (q % 32));
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int q = (k0 + k) * 128 + t, r = q / 32, u = q % 32;
      const float4 a = *reinterpret_cast<const float4*>(staging + staged_f32_offset(r, u));
      g[k].x += a.x;
      g[k].y += a.y;
      g[k].z += a.z;
      g[k].w += a.w;
      *reinterpret_cast<float4*>(out + r * ld + 4 * u) = g[k];
    }
  }
}

// out[e] += acc in fp32 (Megatron's main_grad), through the warpgroup's 32 KB staging buffer in two
// rounds of 128 columns; a carry-out tile stores its fp32 partial sum to carry_out as
// WgradEpilogue's does. Params: WgradEpilogue's, with accumulate set.
struct WgradAccumulateEpilogue {
  using Params = WgradEpilogue::Params;
  template <int WGN>
  __device__ __forceinline__ static void apply(const Params& p, const WgradTile& t, int wm,
                                               float (&acc)[WGN / 2], uint8_t* staging, int cw) {
    static_assert(WGN == 256, "two rounds of 64 x 128 fp32 through a 32 KB staging buffer");
    if (t.carry_out) {
      store_wgrad_fp32<WGN>(p.carry_out, p.N, t, wm, acc);
      return;
    }
    if (t.k_rows <= 0 && !t.carry_in) return;  // an empty expert adds zeros: main_grad stays
    float* out = WgradEpilogue::accumulate_base(p, t.expert) + static_cast<int64_t>(t.m0 + wm * 64) * p.N + t.n0;
#pragma unroll
    for (int h = 0; h < WGN / 128; ++h) {
      named_barrier_sync(1 + cw, 128);  // every thread has read what the staging held before
      stage_half_f32<WGN>(staging, acc, h);
      named_barrier_sync(1 + cw, 128);
      add_staged_f32(staging, out + 128 * h, p.N);
    }
  }
  __device__ __forceinline__ static void finish(int) {}
};

// bf16 weight gradient through the staging buffer: out viewed as [L * M, N], box {64, 64}. A
// carry-out tile stores its fp32 partial sum directly (store_wgrad_fp32) and leaves the staging
// buffer alone: the flag is the same for the whole tile, so all 128 threads of the warpgroup
// skip the staging barriers together, and the next staged tile still waits for the previous
// bulk stores in staging_acquire.
struct WgradTmaEpilogue {
  struct Params {
    CUtensorMap map;
    int M, N;
    float* carry_out;  // [M, N] fp32, or null
  };
  template <int WGN>
  __device__ __forceinline__ static void apply(const Params& p, const WgradTile& t, int wm,
                                               float (&acc)[WGN / 2], uint8_t* staging, int cw) {
    if (t.carry_out) {
      store_wgrad_fp32<WGN>(p.carry_out, p.N, t, wm, acc);
      return;
    }
    staging_acquire(cw);
    stage_tile<WGN>(staging, acc);
    if (staging_publish(cw)) {
      const int row0 = t.expert * p.M + t.m0 + wm * 64;
#pragma unroll
      for (int b = 0; b < WGN / 64; ++b) tma_store_2d(&p.map, staging + b * 8192, t.n0 + b * 64, row0);
      bulk_commit();
    }
  }
  __device__ __forceinline__ static void finish(int) { staging_finish(); }
};

}  // namespace gemm
}  // namespace mok
