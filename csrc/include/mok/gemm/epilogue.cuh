// Epilogues: what a consumer warpgroup does with its 64 x WGN fp32 accumulator of a tile.
// Each thread writes its own fragment (see wgmma.cuh for which rows and columns it holds)
// straight to global memory; every output element belongs to exactly one thread of one tile,
// so the results are deterministic.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

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

__device__ __forceinline__ float silu(float g) { return g / (1.f + __expf(-g)); }

// fc1 forward: h = silu(gate) * up (* router weight of the row); gate and up are the two halves
// of the accumulator. Padding rows (>= row_end) get zeros. Optionally stores the
// pre-activation [gate | up] (bf16, the fc1 output Megatron keeps for the backward).
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
                                               int bn, float (&acc)[WGN / 2]) {
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
};

// out[R, N] = acc in bf16 (fc2 forward, fc1 data gradient).
struct StoreEpilogue {
  struct Params {
    __nv_bfloat16* out;  // [rows_cap, ld]
    int ld;              // N
    int64_t rows_cap;
  };
  template <int WGN>
  __device__ __forceinline__ static void apply(const Params& p, const RowTile& t, int wm, int wn,
                                               int bn, float (&acc)[WGN / 2]) {
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
};

// fc2 data gradient fused with the SwiGLU backward. acc = dh = dy * D_e for h columns; with
// the saved pre-activation (g, u) and router weight w of the row (1 when absent):
//   d up = w * dh * silu(g),  d gate = w * dh * u * silu'(g),
//   silu'(g) = s + silu(g) * (1 - s), s = sigmoid(g),
// written as dgu [R, 2I] (gate half, then up half: the row order of the fc1 weight). When w was
// applied inside fc1, the row's router-weight gradient is sum_c dh * silu(g) * u: each
// (row, warpgroup column slice) writes its partial sum to partials[slice][row] in a fixed
// order, and sum_partials() adds the slices in order. Optionally recomputes the forward's
// h = w * silu(g) * u (bf16, the fc2 weight gradient's operand). Padding rows get zeros.
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
  template <int WGN>
  __device__ __forceinline__ static void apply(const Params& p, const RowTile& t, int wm, int wn,
                                               int bn, float (&acc)[WGN / 2]) {
    const Fragment f;
    const int c0 = t.col_block * bn + wn * WGN + f.col;
    const int slice = (t.col_block * bn + wn * WGN) / WGN;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int row = t.row0 + wm * 64 + f.row + 8 * j;
      const bool in_range = row < p.rows_cap;
      const bool real = in_range && row < t.row_end;
      const float w = (p.scale != nullptr && real) ? p.scale[row] : 1.f;
      const __nv_bfloat16* grow = p.gu + static_cast<int64_t>(row) * 2 * p.inter;
      __nv_bfloat16* drow = p.dgu + static_cast<int64_t>(row) * 2 * p.inter;
      float dw = 0.f;
#pragma unroll
      for (int i = 0; i < WGN / 8; ++i) {
        const int c = c0 + 8 * i;
        float dg[2] = {0.f, 0.f}, du[2] = {0.f, 0.f}, hv[2] = {0.f, 0.f};
        if (real) {
          const float2 g = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(grow + c));
          const float2 u =
              __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(grow + p.inter + c));
          const float gv[2] = {g.x, g.y}, uv[2] = {u.x, u.y};
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float dh = acc[4 * i + 2 * j + e];
            const float s = 1.f / (1.f + __expf(-gv[e]));
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
          *reinterpret_cast<__nv_bfloat162*>(drow + p.inter + c) = __floats2bfloat162_rn(du[0], du[1]);
          if (p.h != nullptr)
            *reinterpret_cast<__nv_bfloat162*>(p.h + static_cast<int64_t>(row) * p.inter + c) =
                __floats2bfloat162_rn(hv[0], hv[1]);
        }
      }
      if (p.scale != nullptr) {
        dw += __shfl_xor_sync(0xffffffffu, dw, 1);
        dw += __shfl_xor_sync(0xffffffffu, dw, 2);
        if (in_range && f.col == 0) p.partials[static_cast<int64_t>(slice) * p.rows_cap + row] = dw;
      }
    }
  }
};

// Weight gradient tile: out[e][m][n] (fp32, optionally accumulated, or bf16).
struct WgradEpilogue {
  struct Params {
    void* out;        // [L, M, N] fp32 or bf16
    int out_bf16;     // 1: bf16, 0: fp32
    int accumulate;   // fp32 only: out += acc
    int M, N;
  };
  template <int WGN>
  __device__ __forceinline__ static void apply(const Params& p, const WgradTile& t, int wm,
                                               float (&acc)[WGN / 2]) {
    const Fragment f;
    const int64_t base = static_cast<int64_t>(t.expert) * p.M * p.N;
    const bool skip = p.accumulate && t.k_rows <= 0;  // adding zeros: leave main_grad as is
    if (skip) return;
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
        for (int i = 0; i < WGN / 8; ++i) {
          float2 v = *reinterpret_cast<float2*>(o + 8 * i);
          v.x += acc[4 * i + 2 * j];
          v.y += acc[4 * i + 2 * j + 1];
          *reinterpret_cast<float2*>(o + 8 * i) = v;
        }
      } else {
        float* o = static_cast<float*>(p.out) + off;
#pragma unroll
        for (int i = 0; i < WGN / 8; ++i)
          *reinterpret_cast<float2*>(o + 8 * i) = make_float2(acc[4 * i + 2 * j], acc[4 * i + 2 * j + 1]);
      }
    }
  }
};

}  // namespace gemm
}  // namespace mok
