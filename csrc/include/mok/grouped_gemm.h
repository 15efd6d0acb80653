// Grouped GEMMs of the expert FFN on Hopper (sm_90a): wgmma fed by TMA through mbarrier stages,
// persistent CTAs, per-expert row offsets read on the device (no host synchronisation).
//
// Layout (docs/contract.md): L local experts; expert l owns rows [offsets[l], offsets[l+1]) of
// the expert-grouped activations, the first counts[l] real and the rest padding. Every offset
// must be a multiple of `block_m` (64 or 128; the schedule's tile_rows, or a divisor of it),
// and offsets[L] <= rows_cap. The host passes only rows_cap, the capacity the buffers are
// allocated for; rows outside [offsets[0], offsets[L]) of every output are left untouched.
// offsets[0] may be above 0: offsets + l0 and counts + l0 with a weight tensor of experts
// l0.. l0 + L - 1 run one segment of the experts (the same rows and results as those experts
// in a launch over all of them), so experts whose weights lie in separate tensors (a shared
// expert beside the routed ones) need no copy. All matrices are
// row-major and contiguous; "bf16" pointers are __nv_bfloat16 and 16-byte aligned.
// Shapes: x [R, H]; fc1_weight [L, 2I, H] (gate rows, then up rows); fc2_weight [L, H, I];
// h [R, I]; gu [R, 2I] (fc1 pre-activation: gate columns, then up); y, dy, dx [R, H].
//
// Tiles: block_m x (wg_n * 128 / block_m) for the row-grouped GEMMs (wg_n: B columns per
// consumer warpgroup, 0 = 256), 128 x 256 for the weight gradients.
// tma_store: 0 writes each thread's accumulator fragment straight to global memory; 1 stages
// the tile in shared memory and writes it with TMA bulk stores that overlap the next tile.
// multicast: 1 runs clusters of two CTAs on the two row blocks of a pair (same expert, same
// columns) that share each B tile through TMA multicast (half the L2 traffic of B).
// Built variants (block_m, wg_n, tma_store, multicast):
//   fc1: (128,256,0,0) (64,256,0,0) (64,128,0,0) (128,256,1,0) (64,128,1,0) (128,256,0,1)
//        (128,256,1,1)
//   fc2: (128,256,0,0) (64,256,0,0) (64,128,0,0) (128,256,1,0) (64,128,1,0) (128,256,1,1)
//   fc1 / fc2 plain data gradients: (128,256,0,0) (64,256,0,0) (128,256,1,0) (64,128,1,0)
//        (128,256,1,1)
//   fc2 data gradient + SwiGLU backward (wg_n 256, direct stores): block_m 128 or 64, and
//        128 with multicast
//   fc2 / fc1 data gradient pushed home (block_m, wg_n; direct stores, single CTAs): those of
//        mok_gemm_fc2 / mok_gemm_fc1_dgrad: fc2 (128,256) (64,256) (64,128), fc1 dgrad (128,256)
//        (64,256)
// Others return MOK_ERR_UNSUPPORTED.
// num_ctas: persistent CTAs to launch (0: one per SM; fewer leaves SMs to other work).
// Every function returns MOK_OK, a cudaError_t (> 0) or a MOK_ERR_* code (< 0).
#pragma once

#include <cuda_runtime.h>

#include "mok/common.h"

// h = silu(x G_e^T) * (x U_e^T) [* router_weight[row]], bf16; padding rows are written as 0.
// router_weight: fp32 [R] or null. gu: bf16 [R, 2I] pre-activation output, or null.
// Needs H % 64 == 0 and I % (wg_n * 64 / block_m) == 0.
MOK_API int mok_gemm_fc1_swiglu(const void* x, const void* fc1_weight, const int32_t* offsets,
                                const int32_t* counts, const float* router_weight, void* h,
                                void* gu, int64_t rows_cap, int L, int H, int I, int block_m,
                                int wg_n, int tma_store, int multicast, int num_ctas,
                                cudaStream_t stream);

// y = h D_e^T, bf16. Needs I % 64 == 0 and H % (wg_n * 128 / block_m) == 0.
MOK_API int mok_gemm_fc2(const void* h, const void* fc2_weight, const int32_t* offsets, void* y,
                         int64_t rows_cap, int L, int H, int I, int block_m, int wg_n,
                         int tma_store, int multicast, int num_ctas, cudaStream_t stream);

// fp32 elements of the scratch buffer mok_gemm_fc2_dgrad_swiglu needs (router-weight partials).
MOK_API int64_t mok_gemm_fc2_dgrad_scratch_floats(int64_t rows_cap, int I);

// Data gradient of fc2 fused with the SwiGLU backward:
//   dh = dy D_e; dgu[:, :I] = w * dh * u * silu'(g); dgu[:, I:] = w * dh * silu(g)
// with (g, u) = gu[row] and w = router_weight[row] (1 when null). When router_weight is given,
// d_router_weight[row] = sum_i dh[row, i] * silu(g) * u (fp32 [R]) and scratch holds
// mok_gemm_fc2_dgrad_scratch_floats() floats; both may be null otherwise. h (bf16 [R, I], or
// null) receives the forward's w * silu(g) * u recomputed, the operand of fc2's weight
// gradient. Padding rows of dgu, h and d_router_weight are written as 0.
// Needs H % 64 == 0 and I % (256 * 128 / block_m) == 0.
MOK_API int mok_gemm_fc2_dgrad_swiglu(const void* dy, const void* fc2_weight, const void* gu,
                                      const int32_t* offsets, const int32_t* counts,
                                      const float* router_weight, void* dgu, void* h,
                                      float* d_router_weight, float* scratch, int64_t rows_cap,
                                      int L, int H, int I, int block_m, int multicast,
                                      int num_ctas, cudaStream_t stream);

// dx = dgu W1_e (W1_e = fc1_weight[e] as [2I, H]), bf16. Needs I % 32 == 0 and
// H % (wg_n * 128 / block_m) == 0.
MOK_API int mok_gemm_fc1_dgrad(const void* dgu, const void* fc1_weight, const int32_t* offsets,
                               void* dx, int64_t rows_cap, int L, int H, int I, int block_m,
                               int wg_n, int tma_store, int multicast, int num_ctas,
                               cudaStream_t stream);

// dh = dy D_e (D_e = fc2_weight[e] as [H, I]), bf16 [R, I]: the fc2 data gradient alone, for a
// SwiGLU backward run separately. Needs H % 64 == 0 and I % (wg_n * 128 / block_m) == 0.
MOK_API int mok_gemm_fc2_dgrad(const void* dy, const void* fc2_weight, const int32_t* offsets,
                               void* dh, int64_t rows_cap, int L, int H, int I, int block_m,
                               int wg_n, int tma_store, int multicast, int num_ctas,
                               cudaStream_t stream);

// fc2 (y = h D_e^T) and the fc1 data gradient (dx = dgu W1_e) with the output rows pushed home
// from the epilogue instead of written to [R, H]: each layout row i in [offsets[0], offsets[L])
// with table[i] = (s, route), s >= 0, goes to
//   slots[s][route, :H]  (bf16; slots[s] = bases[s] + slots_offset, [T_cap, K, H])
// and, for the fc1 data gradient with row_scalars (fp32 [R], the router-weight gradient),
//   scalar_slots[s][route] = row_scalars[i]  (fp32; bases[s] + scalars_offset, [T_cap, K])
// written by the tiles of column block 0. Rows with s < 0 (padding) push nothing. Bitwise
// mok_gemm_fc2 / mok_gemm_fc1_dgrad with the same (block_m, wg_n) followed by mok_push_rows(bases,
// slots_offset, scalars_offset, table, offsets, ..., rows, row_scalars) (the same K loop and
// rounding; the rows are never materialised). table: int32 [rows_cap, 2], 8-byte aligned, the
// rows of this launch's layout (a chunk's slice of the schedule table for a chunk of the layout,
// with its chunk-relative offsets). bases: device uint64 [P]; slots_offset % 16 == 0,
// scalars_offset % 4 == 0. Direct stores and single CTAs only (tma_store and multicast cannot
// scatter rows to computed addresses); other shape rules as mok_gemm_fc2 / mok_gemm_fc1_dgrad.
// Memory ordering: plain stores, as mok_push_rows's; the peers see them after the mok_barrier
// that follows in the stream (its fence.acq_rel.sys is cumulative over every earlier kernel's
// stores, peer stores included), and a P = 1 slot sum later in the same stream.
MOK_API int mok_gemm_fc2_push(const void* h, const void* fc2_weight, const int32_t* offsets,
                              const int32_t* table, const uint64_t* bases, int64_t slots_offset,
                              int64_t rows_cap, int L, int H, int I, int block_m, int wg_n,
                              int num_ctas, cudaStream_t stream);
MOK_API int mok_gemm_fc1_dgrad_push(const void* dgu, const void* fc1_weight, const int32_t* offsets,
                                    const int32_t* table, const uint64_t* bases, int64_t slots_offset,
                                    const float* row_scalars, int64_t scalars_offset, int64_t rows_cap,
                                    int L, int H, int I, int block_m, int wg_n, int num_ctas,
                                    cudaStream_t stream);

// Weight gradient per expert: out[e] = a_e^T b_e over the expert's rows [offsets[e],
// offsets[e+1]) (offsets multiples of 64): a bf16 [R, M], b bf16 [R, N], out [L, M, N] fp32
// (accumulate: out += ..., e.g. into Megatron's main_grad) or bf16 (out_bf16 = 1, no
// accumulate). fc1: a = dgu, b = x (M = 2I, N = H); fc2: a = dy, b = h (M = H, N = I).
// Experts without rows get zeros (or are left as they are when accumulating). tma_store needs
// the bf16 output. Needs M % 128 == 0 and N % 256 == 0. Deterministic: fp32 accumulation over
// the segment's 64-row blocks in ascending row order. counts (int32 [L], or null): the real
// rows of each expert; given, the K loop stops after the 64-row block holding the expert's
// last real row: the 64-row blocks of padding past it (at most one of a 128-row-padded
// segment) are neither read nor multiplied. Padding rows are zeros and add exact zeros, so the
// result is bitwise that of the whole segment. out_table (device uint64 [L], or null): with
// accumulate, expert e's fp32 [M, N] lies at out_table[e] (16-byte aligned) instead of in out,
// which is then not read: Megatron's per-expert main_grad, wherever its buffer put each one.
//
// Over a range of rows [row0, row1) of the layout (a chunk of it), with a and b holding only
// those rows: layout row r is row r - row0 of a and b (rows_cap rows). offsets are the whole
// layout's. row0 is a multiple of 64; row1 is a multiple of 64 with row0 < row1 <= row0 +
// rows_cap, or exactly row0 + rows_cap (any value: the range takes all rows a and b hold; rows
// past the last multiple of 64 are never read, no segment holds them). The whole layout in one
// call: row0 = 0, row1 = rows_cap, no carries. Expert e with segment [g0, g1) takes part when
// g0 < row1 && g1 > row0, or, empty (g0 == g1), when row0 <= g0 <= row1; the tiles of the
// others write nothing. A non-empty expert runs its rows inside the range, and:
//   - g0 < row0: its accumulator starts from carry_in (fp32 [M, N], the partial sum an earlier
//     range carried out) instead of zero; carry_in must not be null when row0 > 0;
//   - g1 > row1 and carry_out != null: its fp32 accumulator goes to carry_out ([M, N]) and out
//     is not written; carry_out null means the range is the last one (row1 >= offsets[L]);
//   - otherwise out[e] is written as by the whole-layout call.
// At most one expert spans row0 and one spans row1 (possibly the same). carry_in and carry_out
// must not overlap (consecutive ranges ping-pong two buffers). Any partition of the layout into
// consecutive ranges, called range by range with each carry_out the next carry_in, gives out
// bitwise equal to the whole-layout call (the fp32 round trip of the carry is exact and the K
// blocks run in the same order).
MOK_API int mok_gemm_weight_grad(const void* a, const void* b, const int32_t* offsets,
                                 const int32_t* counts, void* out, const uint64_t* out_table,
                                 int out_bf16, int accumulate, int tma_store, int64_t rows_cap,
                                 int L, int M, int N, int64_t row0, int64_t row1,
                                 const float* carry_in, float* carry_out, int num_ctas,
                                 cudaStream_t stream);
