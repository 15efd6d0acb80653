// The forward megakernel (docs/megakernel.md): pull dispatch, fc1 + SwiGLU, fc2, push combine
// and the fixed-order slot sum of one MoE layer forward in one persistent launch, after the
// schedule kernel (mok/schedule.h).
//
// Peer memory is the symmetric workspace of the cuda backend: `bases[s]` is rank s's region,
// in which `rows_offset` holds its published bf16 tokens [T_cap, H], `scalars_offset` its fp32
// router weights [T_cap, K] and `slots_offset` the bf16 combine slots [T_cap, K, H];
// `signal_bases[s]` is rank s's signal array, uint64 [2P] (mok/common.h): the megakernel uses its
// first P words, the flags mok_barrier uses too (a launch stores rank r's combine-done epoch into
// word r of every rank's array); the P failure words after them are mok_barrier's. The ring
// (x rows, h rows, router weights) and the counters are local device buffers whose size
// the config fixes, whatever the routing.
#pragma once

#include <cuda_runtime.h>

#include "mok/common.h"

// Every field of the structs below is 8 bytes wide (pointers and int64), so their layout is the
// same for any C compiler and for Python's ctypes; the mok_megakernel_*_bytes() functions
// return their sizeof for a check.

// The schedule knobs of a launch. Every rank of an EP group must pass the same values (the
// launches wait on each other's flags; the results do not depend on them: every setting gives
// the same bits). mok_megakernel_default_tunables() gives the defaults; mok_megakernel_forward
// checks the rules before any CUDA call.
typedef struct MokMegakernelTunables {
  int64_t comm_ctas;       // CTAs that pull the first blocks before they compute too, >= 2 (and
                           // even for pair mode); the default, 0, means "the caller chooses it
                           // from the shape" and is not a valid launch value
  int64_t num_ctas;        // CTAs of the launch: 0 (every SM; capped by the occupancy) or above
                           // comm_ctas
  int64_t minibatch_rows;  // rows of a minibatch: a positive multiple of 128 that divides
                           // ring_rows at least twice; the default, 0, means "the caller chooses"
  int64_t pairs;           // 1: clusters of two CTAs that share each weight tile (pair mode) when
                           // the grid allows (even grid and comm_ctas, every CTA resident as a
                           // cluster); 0: single CTAs
  int64_t group_blocks;    // row blocks of a minibatch's column sweep (the CTAs that run
                           // together share the weight tile in L2): even, 2 to 64
} MokMegakernelTunables;

// Fixed sizes and bounds of the kernel, for callers that size buffers or check arguments
// (mok_megakernel_constants()).
typedef struct MokMegakernelConstants {
  int64_t block_rows;              // rows of a row block (the schedule's tile_rows)
  int64_t fc1_cols;                // h columns of an fc1 tile: I must be a multiple
  int64_t fc2_cols;                // output columns of an fc2 tile: H must be a multiple
  int64_t max_experts;             // bound on L, local experts per launch
  int64_t max_topk;                // bound on K
  int64_t max_ranks;               // bound on P
  int64_t first_pull_parts;        // parts of a first block's pull (block_rows / parts rows each)
  int64_t first_pull_minibatches;  // minibatches whose blocks every CTA pulls in parts first
  int64_t tile_arrivals;           // counter arrivals per GEMM tile (one per consumer warpgroup)
  int64_t min_group_blocks;        // MokMegakernelTunables::group_blocks bounds
  int64_t max_group_blocks;
  int64_t trace_fields;            // int64 words of a trace record
  int64_t trace_cta_kind;          // the kind of a CTA's own trace record
  int64_t max_ctas;                // bound on the CTAs of a launch (trace records of the CTAs)
} MokMegakernelConstants;

typedef struct MokMegakernelArgs {
  const uint64_t* bases;         // device [P]: every rank's workspace region
  const uint64_t* signal_bases;  // device [P]: every rank's signal array (uint64 [2P]; flags first)
  int64_t rows_offset;           // byte offset of the published tokens in a region
  int64_t scalars_offset;        // byte offset of the published router weights
  int64_t slots_offset;          // byte offset of the combine slots
  const int32_t* table;          // schedule: int32 [R_cap, 2] (source rank, token * K + slot), 8-byte aligned
  const int32_t* offsets;        // int32 [L + 1], multiples of 128
  const int32_t* counts;         // int32 [L]
  const int64_t* topk_ids;       // this rank's int64 [T, K] ids (null when T == 0)
  const void* fc1_weight;        // bf16 [L1, 2I, H] (gate rows, then up rows); L1 = L unless
                                 // a second segment (below) holds the last experts
  const void* fc2_weight;        // bf16 [L1, H, I]
  void* ring_x;                  // bf16 [ring_rows, H]: pulled x rows
  void* ring_h;                  // bf16 [ring_rows, I]: w * silu(x G^T) * (x U^T)
  float* ring_w;                 // fp32 [ring_rows]: router weight of each ring row
  int32_t* counters;             // int32 [mok_megakernel_counter_words(ring_rows / 128)]
  void* y;                       // bf16 [T, H] output (null when T == 0)
  uint64_t* epoch_counter;       // the workspace's barrier epoch counter (device, uint64)
  int32_t* status;               // the workspace's status word, int32 [MOK_STATUS_WORDS]
  int64_t timeout_ns;            // deadline of every wait
  int64_t P, rank, L, H, I, K, T;
  int64_t ring_rows;             // a multiple of tunables.minibatch_rows, at least two minibatches
  int64_t* trace;                // optional timeline, int64 [trace_capacity, 6] (null: off;
                                 // mok/megakernel/trace.cuh says what each record holds)
  int64_t trace_capacity;        // records of `trace`
  // For training (all three or none): the activations the cuda backend's backward reads, at
  // their expert-grouped layout rows (padding rows zero), for layout rows 0 .. save_rows - 1
  // only: the pulled rows bf16 [save_rows, H], their router weights fp32 [save_rows] and the
  // fc1 pre-activation bf16 [save_rows, 2I] (gate | up). Nothing at or past save_rows is
  // written (the backward recomputes those rows); rows past the layout's end (offsets[L]) are
  // never reached, so any save_rows at or past it keeps every row.
  void* save_x;
  float* save_w;
  void* save_gu;
  int64_t save_rows;  // >= 0, a multiple of 128 (a row block is kept whole or not at all); 0
                      // when the three pointers are null. Pointers with save_rows 0 save nothing.
  // A second weight segment, for experts whose weights lie in tensors of their own (a shared
  // expert next to the routed ones, without a copy): local experts L1 .. L - 1 take their
  // weights from fc1_weight2 bf16 [L - L1, 2I, H] and fc2_weight2 bf16 [L - L1, H, I]; the
  // first two weight tensors then hold experts 0 .. L1 - 1. Both null and L1 = L otherwise.
  const void* fc1_weight2;
  const void* fc2_weight2;
  int64_t L1;
  MokMegakernelTunables tunables;  // the schedule knobs (above)
} MokMegakernelArgs;

MOK_API int64_t mok_megakernel_args_bytes(void);
MOK_API int64_t mok_megakernel_tunables_bytes(void);
MOK_API int64_t mok_megakernel_constants_bytes(void);

// The default tunables: comm_ctas, num_ctas and minibatch_rows 0 (the caller chooses them from
// the shape and the device), pairs 1, group_blocks 8. Returns MOK_OK, or
// MOK_ERR_INVALID_ARGUMENT for a null pointer. No CUDA call.
MOK_API int mok_megakernel_default_tunables(MokMegakernelTunables* out);

// The kernel's fixed sizes and bounds. Returns MOK_OK, or MOK_ERR_INVALID_ARGUMENT for a null
// pointer. No CUDA call.
MOK_API int mok_megakernel_constants(MokMegakernelConstants* out);

// int32 words of the counter buffer for a ring of `ring_slots` = ring_rows / 128 slots.
MOK_API int64_t mok_megakernel_counter_words(int ring_slots);

// The work plan, for tests: item `index` of queue `queue` (0 compute, 1 pull, 2 first pull)
// for a layout of n_blocks row blocks, mb_blocks blocks per minibatch, `slots` ring slots,
// n1 = I / 128 fc1 and n2 = H / 256 fc2 column blocks. Writes out[0..5] = kind (1 fc1, 2 fc2,
// 3 pull, 6 part of a first block's pull: column block = the part), row block, column block,
// the counter it waits on (0 x_ready, 1 h_ready, 2 fc2_done), that counter's slot, and the
// value to wait for (<= 0: none).
// pairs = 1: the plan of a launch in clusters of two (compute items are pair tiles: out[1] is
// the pair's first block, the second is out[1] + 1 when it lies in the same minibatch; the
// wait is the first block's, the second CTA waits for its own block the same way).
// group_blocks: row blocks of a group (MokMegakernelTunables::group_blocks), even, 2 to 64.
// Returns MOK_OK, or MOK_ERR_INVALID_ARGUMENT for sizes or an index out of range.
MOK_API int mok_megakernel_plan_item(int queue, int index, int n_blocks, int mb_blocks, int slots,
                                     int n1, int n2, int pairs, int group_blocks, int32_t* out);

// The backward megakernel's work plan (mok/megakernel/bwd_plan.cuh, docs/training.md section 2),
// for tests. Its tables: for local experts of expert_blocks[0 .. L) row blocks of 128 rows,
// minibatches of mb_blocks blocks, `slots` backward slots, units of up to unit_blocks blocks of
// one expert (32 in the kernel), blocks below n_keep kept (the rest replayed), h_cols = H / 256,
// i_cols = I / 256, W strips of up to strip_tiles tiles (4 in the kernel; at most 8) and column
// sweeps over group_blocks blocks (even, 2 to 64), in single CTAs (pairs = 0) or clusters of two
// (pairs = 1: an R, D2 or D1 item is a pair tile, the same column of two consecutive blocks of its
// sweep, row block and row block + 1 when both lie in its minibatch, else the first alone, whose
// waits and signals are the first block's, then the second's; a W item is still one strip, whose
// tiles the cluster's CTAs take alternately). Writes the int32 words the tables take into
// *words_needed and, when `tables` is not null, the tables (words at least that many). Returns
// MOK_OK, or MOK_ERR_INVALID_ARGUMENT for sizes out of range (or past int32 positions) or pairs
// other than 0 or 1.
MOK_API int mok_megakernel_backward_tables(const int32_t* expert_blocks, int L, int mb_blocks, int slots,
                                           int unit_blocks, int n_keep, int h_cols, int i_cols, int strip_tiles,
                                           int group_blocks, int pairs, int32_t* tables, int64_t words,
                                           int64_t* words_needed);

// The training ring's compact rows (docs/training.md section 3): kept rows stored by 64-row halves
// in queue order, each block taking the halves that hold a real row (an expert of n rows takes
// ceil(n / 64) * 64 ring rows). For local experts that received counts[0 .. L) rows and a ring of
// ring_rows rows: *n_keep = the largest prefix of queue blocks whose rows fit; out[2b] = the first
// ring row of block b and out[2b + 1] its halves (1 or 2), for every one of the n_blocks = sum of
// ceil(counts[l] / 128) blocks (out_len at least 2 * n_blocks; blocks at or past *n_keep would
// continue past the ring's end). Returns MOK_OK or MOK_ERR_INVALID_ARGUMENT. No CUDA call.
MOK_API int mok_megakernel_training_ring_rows_of(const int32_t* counts, int L, int64_t ring_rows, int32_t* n_keep,
                                                 int32_t* out, int64_t out_len);

// Sizes of the backward plan whose tables (`words` int32) mok_megakernel_backward_tables built:
// out[0..7] = items of the compute, pull and first-pull queues, units, minibatches,
// weight-gradient tiles per unit, W strips per unit, blocks pulled in parts first. Returns MOK_OK
// or MOK_ERR_INVALID_ARGUMENT.
MOK_API int mok_megakernel_backward_plan_sizes(const int32_t* tables, int64_t words, int64_t* out);

// Item `index` of queue `queue` (0 compute, 1 pull, 2 first pull) of the backward plan whose
// tables are `tables`. Writes out[0..7] = kind (3 pull, 6 part of a first block's pull, 7 R,
// 8 D2, 9 D1, 10 W), row block (W: its unit's last block), column block (part; W: strip), unit,
// W's first weight-gradient tile and tile count (else 0), the number of waits nw and of signals
// ns; then nw (counter, index, target) triples, the item starts once every counter[index] >=
// target; then ns (counter, index, amount) triples, what it adds when done (D2: its offload).
// Counters: 0 dy_ready, 1 gu_ready, 2 dgu_ready, 3 d1_done (by slot), 4 unit_ready, 5 w_done (by
// unit), 6 carry_done (by weight-gradient tile). out_len: at least 62. Returns MOK_OK, or
// MOK_ERR_INVALID_ARGUMENT for bad tables or sizes or an index out of range.
MOK_API int mok_megakernel_backward_plan_item(int queue, int index, const int32_t* tables, int64_t words,
                                              int32_t* out, int out_len);

// The backward's counter buffer (mok/megakernel/bwd_plan.cuh, BwdCounterLayout): for `slots`
// backward slots, layouts of at most max_blocks row blocks over L local experts in units of
// unit_blocks, minibatches of mb_blocks, h_cols = H / 256 and i_cols = I / 256. Writes out[0..6]
// = the first word of each counter array (0 dy_ready, 1 gu_ready, 2 dgu_ready, 3 d1_done by slot;
// 4 unit_ready, 5 w_done by unit; 6 carry_done by weight-gradient tile), out[7..13] = their
// lengths, out[14] = the first word of the plan tables, out[15] = the buffer's int32 words (the
// forward's header words first). out_len: at least 16. Returns MOK_OK or
// MOK_ERR_INVALID_ARGUMENT. No CUDA call.
MOK_API int mok_megakernel_backward_counter_layout(int slots, int max_blocks, int L, int unit_blocks, int mb_blocks,
                                                   int h_cols, int i_cols, int64_t* out, int out_len);

// The layout block each block of the queues stands for (mok/megakernel/plan.cuh, block order:
// each expert's blocks from the front and the back in turn), for a rank whose local experts
// received counts[0 .. L) rows: out[b] for the n_blocks = sum of ceil(counts[l] / 128) blocks
// (out_len at least that). Returns MOK_OK or MOK_ERR_INVALID_ARGUMENT. No CUDA call.
MOK_API int mok_megakernel_layout_blocks(const int32_t* counts, int L, int32_t* out, int64_t out_len);

// The grid mok_megakernel_forward launches on the current device for these comm_ctas, num_ctas
// (0: every SM) and pairs (MokMegakernelTunables): out[0] = CTAs, out[1] = 1 when they run in
// clusters of two (pair mode), else 0. Queries the device; returns MOK_OK, a cudaError_t,
// MOK_ERR_INVALID_ARGUMENT or MOK_ERR_UNSUPPORTED as the forward would.
MOK_API int mok_megakernel_launch_shape(int64_t comm_ctas, int64_t num_ctas, int64_t pairs, int64_t* out);

// Runs the forward megakernel on `stream`: a small kernel resets the counters and takes the
// next epoch from *epoch_counter, then the persistent kernel computes, for this rank's T
// tokens, y[t] = sum_{j ascending, valid ids} w[t, j] FFN_{ids[t, j]}(x[t]) (fp32 sum, bf16),
// with the routes to this rank's experts pulled from their source ranks and the expert
// outputs pushed to their home ranks' slots. Every wait has the deadline timeout_ns; a
// timeout is recorded in `status` (MOK_STATUS_TIMEOUT, the site, the peer) and the launch
// finishes; y is NaN whenever any status flag is set. No host synchronisation; CUDA-graph
// capturable. Needs H % 256 == 0, I % 128 == 0, 1 <= L <= 1024, offsets padded to 128 rows,
// and tunables within their rules (MokMegakernelTunables). Returns MOK_OK, a cudaError_t (> 0),
// MOK_ERR_INVALID_ARGUMENT (argument checks come first, before any CUDA call; also when the grid
// leaves no CTA beside the comm CTAs) or MOK_ERR_UNSUPPORTED (the CTA's shared memory does not
// fit an SM of this device, or the device has more than max_ctas SMs).
MOK_API int mok_megakernel_forward(const MokMegakernelArgs* args, cudaStream_t stream);

// Timeout sites of the megakernel's waits (MOK_STATUS_WHERE); 1-4 are the cuda backend's
// barriers, 5-6 the megakernel backward's extra barriers (Python side). 12-18 are the backward
// megakernel's waits (docs/training.md 2.5).
enum MokMegakernelSite {
  MOK_SITE_MK_FC1_WAITS_PULL = 7,
  MOK_SITE_MK_FC2_WAITS_FC1 = 8,
  MOK_SITE_MK_PULL_WAITS_SLOT = 10,  // (9 is unused)
  MOK_SITE_MK_COMBINE_DONE = 11,
  MOK_SITE_MK_D2_WAITS_DY = 12,          // D2: its block's dY rows (and a replayed block's gate|up)
  MOK_SITE_MK_R_WAITS_PULL = 13,         // R: its block's pulled rows
  MOK_SITE_MK_D1_WAITS_D2 = 14,          // D1: its block's dgu (every D2 tile's offload)
  MOK_SITE_MK_W_WAITS_UNIT = 15,         // W: every D2 tile's offload of its unit
  MOK_SITE_MK_BWD_PULL_WAITS_SLOT = 16,  // backward pull: the slot's previous block's D1 and W tiles
  MOK_SITE_MK_W_WAITS_CARRY = 17,        // W: the previous carrying unit's carry of its tiles
  MOK_SITE_MK_BWD_COMBINE_DONE = 18,     // backward: every rank's combine-done flag (names the peer)
};
