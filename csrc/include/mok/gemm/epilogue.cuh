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
// buffer is reused only after that thread's previous bulk stores have finished reading it.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "mok/gemm/ptx.cuh"
#include "mok/gemm/scheduler.cuh"

namespace mok {
namespace gemm {

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

// The SwiGLU math divides with __fdividef (MUFU.RCP and a multiply), not the IEEE `/`: the
// IEEE division compiles to a branch into a called slow-path subroutine, and with it in the
// epilogue the fused fc1 ran 10-37% slower than the same tile with a plain store (measured on
// the H200, docs/perf-notes.md fourth session). __fdividef is within 2 ulp; for a denominator
// above 2^126 (g < -87) it returns 0, which is the limit of silu and of sigmoid there.
__device__ __forceinline__ float sigmoid(float g) { return __fdividef(1.f, 1.f + __expf(-g)); }
__device__ __forceinline__ float silu(float g) { return __fdividef(g, 1.f + __expf(-g)); }

// ---- staging through shared memory -----------------------------------------------------------

// Writes the bf16 pair (v0, v1) at row r (0..63), column c (even, 0..63) of box `box`.
__device__ __forceinline__ void stage_pair(uint8_t* staging, int box, int r, int c, float v0,
                                           float v1) {
  uint8_t* p = staging + box * 8192 + r * 128 + (((c >> 3) ^ (r & 7)) << 4) + (c & 7) * 2;
  *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(v0, v1);
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
    const Fragment f;
    const int h0 = t.col_block * (bn / 2) + wn * (WGN / 2) + f.col;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int row = t.row0 + wm * 64 + f.row + 8 * j;
      if (row >= p.rows_cap) continue;
      const bool real = row < t.row_end;
      const float w = (p.scale != nullptr && real) ? p.scale[row] : 1.f;
      __nv_bfloat16* hrow = p.h + static_cast<int64_t>(row) * p.inter;
#pragma unroll
      for (int i = 0; i < WGN / 16; ++i) {
        float g0 = acc[4 * i + 2 * j], g1 = acc[4 * i + 2 * j + 1];
        float u0 = acc[4 * (i + WGN / 16) + 2 * j], u1 = acc[4 * (i + WGN / 16) + 2 * j + 1];
        if (!real) g0 = g1 = u0 = u1 = 0.f;
        const int c = h0 + 8 * i;
        *reinterpret_cast<__nv_bfloat162*>(hrow + c) =
            __floats2bfloat162_rn(silu(g0) * u0 * w, silu(g1) * u1 * w);
        if (p.gu != nullptr) {
          __nv_bfloat16* grow = p.gu + static_cast<int64_t>(row) * 2 * p.inter;
          *reinterpret_cast<__nv_bfloat162*>(grow + c) = __floats2bfloat162_rn(g0, g1);
          *reinterpret_cast<__nv_bfloat162*>(grow + p.inter + c) = __floats2bfloat162_rn(u0, u1);
        }
      }
    }
  }
  __device__ __forceinline__ static void finish(int) {}
};

// The same through the staging buffer (WGN * 128 bytes: WGN / 64 boxes). Round one stores h
// and (when kept) the gate half of gu, round two the up half.
struct SwiGLUForwardTmaEpilogue {
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
  struct Params {
    __nv_bfloat16* out;  // [rows_cap, ld]
    int ld;              // N
    int64_t rows_cap;
  };
  template <int WGN>
  __device__ __forceinline__ static void apply(const Params& p, const RowTile& t, int wm, int wn,
                                               int bn, float (&acc)[WGN / 2], uint8_t*, int) {
    const Fragment f;
    const int c0 = t.col_block * bn + wn * WGN + f.col;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int row = t.row0 + wm * 64 + f.row + 8 * j;
      if (row >= p.rows_cap) continue;
      __nv_bfloat16* orow = p.out + static_cast<int64_t>(row) * p.ld;
#pragma unroll
      for (int i = 0; i < WGN / 8; ++i)
        *reinterpret_cast<__nv_bfloat162*>(orow + c0 + 8 * i) =
            __floats2bfloat162_rn(acc[4 * i + 2 * j], acc[4 * i + 2 * j + 1]);
    }
  }
  __device__ __forceinline__ static void finish(int) {}
};

struct TmaStoreEpilogue {
  struct Params {
    CUtensorMap map;  // out [rows_cap, N], box {64, 64}
  };
  template <int WGN>
  __device__ __forceinline__ static void apply(const Params& p, const RowTile& t, int wm, int wn,
                                               int bn, float (&acc)[WGN / 2], uint8_t* staging,
                                               int cw) {
    const Fragment f;
    staging_acquire(cw);
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int i = 0; i < WGN / 8; ++i)
        stage_pair(staging, i / 8, f.row + 8 * j, (i % 8) * 8 + f.col, acc[4 * i + 2 * j],
                   acc[4 * i + 2 * j + 1]);
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

// acc = dh = dy * D_e for h columns; with the saved pre-activation (g, u) and router weight w of
// the row (1 when absent):
//   d up = w * dh * silu(g),  d gate = w * dh * u * silu'(g),
//   silu'(g) = s + silu(g) * (1 - s), s = sigmoid(g),
// written as dgu [R, 2I] (gate half, then up half: the row order of the fc1 weight). When w was
// applied inside fc1, the row's router-weight gradient is sum_c dh * silu(g) * u: each
// (row, warpgroup column slice) writes its partial sum to partials[slice][row] in a fixed
// order, and sum_partials() adds the slices in order. Optionally recomputes the forward's
// h = w * silu(g) * u (bf16, the fc2 weight gradient's operand). Padding rows get zeros.
// The (g, u) loads are issued a chunk ahead of their use, so their latency overlaps the math.
struct SwiGLUBackwardEpilogue {
  struct Params {
    const __nv_bfloat16* gu;  // [rows_cap, 2I]
    const float* scale;       // [rows_cap] or null
    __nv_bfloat16* dgu;       // [rows_cap, 2I]
    __nv_bfloat16* h;         // [rows_cap, I] or null
    float* partials;          // [I / WGN, rows_cap] when scale != null
    int inter;                // I
    int64_t rows_cap;
  };
  static constexpr int kChunk = 4;  // n8 column blocks per prefetched chunk

  template <int WGN>
  __device__ __forceinline__ static void apply(const Params& p, const RowTile& t, int wm, int wn,
                                               int bn, float (&acc)[WGN / 2], uint8_t*, int) {
    constexpr int kChunks = WGN / 8 / kChunk;
    const Fragment f;
    const int c0 = t.col_block * bn + wn * WGN + f.col;
    const int slice = (t.col_block * bn + wn * WGN) / WGN;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int row = t.row0 + wm * 64 + f.row + 8 * j;
      const bool in_range = row < p.rows_cap;
      const bool real = in_range && row < t.row_end;
      const float w = (p.scale != nullptr && real) ? p.scale[row] : 1.f;
      const unsigned* gsrc =
          reinterpret_cast<const unsigned*>(p.gu + static_cast<int64_t>(row) * 2 * p.inter + c0);
      const unsigned* usrc = gsrc + p.inter / 2;
      __nv_bfloat16* drow = p.dgu + static_cast<int64_t>(row) * 2 * p.inter;
      unsigned gbuf[2][kChunk], ubuf[2][kChunk];
      if (real) {
#pragma unroll
        for (int k = 0; k < kChunk; ++k) {
          gbuf[0][k] = __ldg(gsrc + 4 * k);
          ubuf[0][k] = __ldg(usrc + 4 * k);
        }
      }
      float dw = 0.f;
#pragma unroll
      for (int ch = 0; ch < kChunks; ++ch) {
        if (real && ch + 1 < kChunks) {
#pragma unroll
          for (int k = 0; k < kChunk; ++k) {
            gbuf[(ch + 1) & 1][k] = __ldg(gsrc + 4 * ((ch + 1) * kChunk + k));
            ubuf[(ch + 1) & 1][k] = __ldg(usrc + 4 * ((ch + 1) * kChunk + k));
          }
        }
#pragma unroll
        for (int k = 0; k < kChunk; ++k) {
          const int i = ch * kChunk + k;
          const int c = c0 + 8 * i;
          float dg[2] = {0.f, 0.f}, du[2] = {0.f, 0.f}, hv[2] = {0.f, 0.f};
          if (real) {
            const unsigned gb = gbuf[ch & 1][k], ub = ubuf[ch & 1][k];
            const float2 g = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&gb));
            const float2 u = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&ub));
            const float gv[2] = {g.x, g.y}, uv[2] = {u.x, u.y};
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const float dh = acc[4 * i + 2 * j + e];
              const float s = sigmoid(gv[e]);
              const float act = gv[e] * s;
              dw += dh * act * uv[e];
              hv[e] = act * uv[e] * w;
              const float dhw = dh * w;
              du[e] = dhw * act;
              dg[e] = dhw * uv[e] * (s + act * (1.f - s));
            }
          }
          if (in_range) {
            *reinterpret_cast<__nv_bfloat162*>(drow + c) = __floats2bfloat162_rn(dg[0], dg[1]);
            *reinterpret_cast<__nv_bfloat162*>(drow + p.inter + c) =
                __floats2bfloat162_rn(du[0], du[1]);
            if (p.h != nullptr)
              *reinterpret_cast<__nv_bfloat162*>(p.h + static_cast<int64_t>(row) * p.inter + c) =
                  __floats2bfloat162_rn(hv[0], hv[1]);
          }
        }
      }
      if (p.scale != nullptr) {
        dw += __shfl_xor_sync(0xffffffffu, dw, 1);
        dw += __shfl_xor_sync(0xffffffffu, dw, 2);
        if (in_range && f.col == 0) p.partials[static_cast<int64_t>(slice) * p.rows_cap + row] = dw;
      }
    }
  }
  __device__ __forceinline__ static void finish(int) {}
};

// ---- weight gradients ------------------------------------------------------------------------

// out[e][m][n] (fp32, optionally accumulated, or bf16), written directly.
struct WgradEpilogue {
  struct Params {
    void* out;        // [L, M, N] fp32 or bf16
    int out_bf16;     // 1: bf16, 0: fp32
    int accumulate;   // fp32 only: out += acc
    int M, N;
  };
  template <int WGN>
  __device__ __forceinline__ static void apply(const Params& p, const WgradTile& t, int wm,
                                               float (&acc)[WGN / 2], uint8_t*, int) {
    const Fragment f;
    const int64_t base = static_cast<int64_t>(t.expert) * p.M * p.N;
    if (p.accumulate && t.k_rows <= 0) return;  // adding zeros: leave main_grad as it is
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int m = t.m0 + wm * 64 + f.row + 8 * j;
      const int64_t off = base + static_cast<int64_t>(m) * p.N + t.n0 + f.col;
      if (p.out_bf16) {
        __nv_bfloat16* o = static_cast<__nv_bfloat16*>(p.out) + off;
#pragma unroll
        for (int i = 0; i < WGN / 8; ++i)
          *reinterpret_cast<__nv_bfloat162*>(o + 8 * i) =
              __floats2bfloat162_rn(acc[4 * i + 2 * j], acc[4 * i + 2 * j + 1]);
      } else if (p.accumulate) {
        float* o = static_cast<float*>(p.out) + off;
#pragma unroll
        for (int i0 = 0; i0 < WGN / 8; i0 += 8) {  // 8 loads in flight before the adds
          float2 v[8];
#pragma unroll
          for (int k = 0; k < 8; ++k) v[k] = *reinterpret_cast<const float2*>(o + 8 * (i0 + k));
#pragma unroll
          for (int k = 0; k < 8; ++k) {
            v[k].x += acc[4 * (i0 + k) + 2 * j];
            v[k].y += acc[4 * (i0 + k) + 2 * j + 1];
            *reinterpret_cast<float2*>(o + 8 * (i0 + k)) = v[k];
          }
        }
      } else {
        float* o = static_cast<float*>(p.out) + off;
#pragma unroll
        for (int i = 0; i < WGN / 8; ++i)
          *reinterpret_cast<float2*>(o + 8 * i) = make_float2(acc[4 * i + 2 * j], acc[4 * i + 2 * j + 1]);
      }
    }
  }
  __device__ __forceinline__ static void finish(int) {}
};

// bf16 weight gradient through the staging buffer: out viewed as [L * M, N], box {64, 64}.
struct WgradTmaEpilogue {
  struct Params {
    CUtensorMap map;
    int M;
  };
  template <int WGN>
  __device__ __forceinline__ static void apply(const Params& p, const WgradTile& t, int wm,
                                               float (&acc)[WGN / 2], uint8_t* staging, int cw) {
    const Fragment f;
    staging_acquire(cw);
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int i = 0; i < WGN / 8; ++i)
        stage_pair(staging, i / 8, f.row + 8 * j, (i % 8) * 8 + f.col, acc[4 * i + 2 * j],
                   acc[4 * i + 2 * j + 1]);
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
