// The host side of the backward megakernel's compute launch (mok/megakernel.h,
// mok_megakernel_backward_compute): argument checks, the counter buffer's size, the tensor maps,
// and the three launches (reset + plan tables, the persistent kernel, zeros for empty experts).
// The device code is mok/megakernel/bwd_kernel.cuh.
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "mok/cuda_check.cuh"
#include "mok/gemm/host.cuh"
#include "mok/megakernel.h"
#include "mok/megakernel/bwd_kernel.cuh"
#include "mok/megakernel/bwd_plan.cuh"

using namespace mok::mega;
namespace g = mok::gemm;

namespace {

constexpr int kMbBlocks = 16;  // minibatches of 2048 rows: the phases of the compute queue

// The plan's sizes for a layout of `rows` rows: one slot per row block, one unit per expert.
struct ComputeShape {
  int blocks, unit_blocks, h_cols, i_cols;
  BwdCounterLayout layout;
  int64_t max_items;  // compute-queue positions this layout can have
  int64_t entries;    // word of the BwdEntry table (16-byte aligned), after the plan tables
  int64_t words;      // the counter buffer
};

ComputeShape compute_shape(int64_t rows, int L, int H, int I) {
  ComputeShape s;
  s.blocks = (int)(rows / kBlockRows);
  s.unit_blocks = s.blocks > 0 ? s.blocks : 1;
  s.h_cols = H / 256;
  s.i_cols = I / 256;
  BwdPlan p{};
  p.h_cols = s.h_cols;
  p.i_cols = s.i_cols;
  const int max_units = bwd_max_units(s.blocks, L, s.unit_blocks);
  s.layout = bwd_counter_layout(s.blocks > 0 ? s.blocks : 1, max_units, wgrad_tiles(p),
                                bwd_table_words(s.blocks, kMbBlocks, max_units));
  p.strip_tiles = kWgradStripTiles;
  s.max_items = (int64_t)s.blocks * (s.h_cols + s.i_cols) + (int64_t)max_units * w_strips(p);
  s.entries = (s.layout.words + 3) / 4 * 4;
  s.words = s.entries + (int64_t)(sizeof(BwdEntry) / 4) * s.max_items;
  return s;
}

bool shape_ok(int64_t rows, int L, int H, int I) {
  return rows >= 0 && rows % kBlockRows == 0 && rows < (int64_t)INT32_MAX / 2 && L >= 1 && L <= g::kMaxExperts &&
         H > 0 && H % 256 == 0 && I > 0 && I % 256 == 0 && (int64_t)L * 2 * I < (int64_t)INT32_MAX &&
         (int64_t)L * H < (int64_t)INT32_MAX;
}

}  // namespace

MOK_API int64_t mok_megakernel_backward_compute_counter_words(int64_t rows, int L, int H, int I) {
  if (!shape_ok(rows, L, H, I)) return -1;
  return compute_shape(rows, L, H, I).words;
}

MOK_API int mok_megakernel_backward_compute(const MokBackwardComputeArgs* a, cudaStream_t stream) {
  MOK_REQUIRE(a != nullptr);
  const int64_t rows = a->rows;
  const int L = (int)a->L, H = (int)a->H, I = (int)a->I;
  MOK_REQUIRE(a->L == L && a->H == H && a->I == I && shape_ok(rows, L, H, I));
  MOK_REQUIRE(a->offsets && a->counts && a->table && a->bases && a->counters && a->status);
  MOK_REQUIRE(a->fc1_weight && a->fc2_weight && a->d_fc1 && a->d_fc2);
  MOK_REQUIRE(g::aligned16(a->fc1_weight) && g::aligned16(a->fc2_weight) && g::aligned16(a->d_fc1) &&
              g::aligned16(a->d_fc2) && (reinterpret_cast<uintptr_t>(a->table) & 7u) == 0);
  MOK_REQUIRE(a->trace == nullptr || (a->trace_capacity > 0 && g::aligned16(a->trace)));
  MOK_REQUIRE(a->slots_offset >= 0 && a->slots_offset % 16 == 0 && a->scalars_offset >= 0 &&
              a->scalars_offset % 4 == 0 && a->timeout_ns > 0 && a->rank >= 0);
  const ComputeShape s = compute_shape(rows, L, H, I);
  MOK_REQUIRE(a->counter_words >= s.words);
  if (rows > 0) {
    MOK_REQUIRE(a->dy && a->x && a->gu && a->router_weights && a->h && a->partials);
    MOK_REQUIRE(g::aligned16(a->dy) && g::aligned16(a->x) && g::aligned16(a->gu) && g::aligned16(a->h) &&
                g::aligned16(a->partials));
  }
  if (rows > 0) {
    BwdParams p{};
    BwdOperands& o = p.ops;
    int rc = g::encode_map_2d(&o.d2.map_a, a->dy, H, rows, g::kBK, kBlockRows);
    if (rc == MOK_OK) rc = g::encode_map_2d(&o.d2.map_b, a->fc2_weight, I, (uint64_t)L * H, g::kBK, 64);
    if (rc == MOK_OK) rc = g::encode_map_2d(&o.d1.map_a, a->gu, 2 * I, rows, g::kBK, kBlockRows);
    if (rc == MOK_OK) rc = g::encode_map_2d(&o.d1.map_b, a->fc1_weight, H, (uint64_t)L * 2 * I, g::kBK, 64);
    if (rc == MOK_OK) rc = g::encode_map_2d(&o.w1.map_a, a->gu, 2 * I, rows, g::kBK, 64);
    if (rc == MOK_OK) rc = g::encode_map_2d(&o.w1.map_b, a->x, H, rows, g::kBK, 64);
    if (rc == MOK_OK) rc = g::encode_map_2d(&o.w2.map_a, a->dy, H, rows, g::kBK, 64);
    if (rc == MOK_OK) rc = g::encode_map_2d(&o.w2.map_b, a->h, I, rows, g::kBK, 64);
    if (rc == MOK_OK) rc = g::encode_map_2d(&o.out1.map, a->d_fc1, H, (uint64_t)L * 2 * I, 64, 64);
    if (rc == MOK_OK) rc = g::encode_map_2d(&o.out2.map, a->d_fc2, I, (uint64_t)L * H, 64, 64);
    if (rc != MOK_OK) return rc;
    o.d2.K = H;
    o.d2.N = I;
    o.d1.K = 2 * I;
    o.d1.N = H;
    o.w1.M = 2 * I;
    o.w1.N = H;
    o.w1.carry_in = nullptr;
    o.w2.M = H;
    o.w2.N = I;
    o.w2.carry_in = nullptr;
    auto* gu = static_cast<__nv_bfloat16*>(a->gu);
    o.swiglu = {gu, static_cast<const float*>(a->router_weights), gu, static_cast<__nv_bfloat16*>(a->h),
                static_cast<float*>(a->partials), I, rows};
    o.out1 = {o.out1.map, 2 * I, H, nullptr};
    o.out2 = {o.out2.map, H, I, nullptr};
    o.push = g::PushTargets{static_cast<const uint64_t*>(a->bases), a->slots_offset,
                            static_cast<const int32_t*>(a->table), H};
    o.scalars_offset = a->scalars_offset;
    o.rows = rows;
    p.offsets = static_cast<const int32_t*>(a->offsets);
    p.counts = static_cast<const int32_t*>(a->counts);
    p.counters = static_cast<int32_t*>(a->counters);
    p.layout = s.layout;
    p.status = static_cast<int32_t*>(a->status);
    p.timeout_ns = a->timeout_ns;
    p.rank = (int)a->rank;
    p.L = L;
    p.trace = Trace{a->trace, a->trace ? a->trace_capacity : 0};
    p.entries = p.counters + s.entries;
    backward_reset_kernel<<<1, 1024, 0, stream>>>(p.counters, s.layout, p.offsets, L, kMbBlocks, s.blocks,
                                                  s.unit_blocks, s.h_cols, s.i_cols, kWgradStripTiles,
                                                  kDefaultGroupBlocks);
    MOK_RETURN_IF_LAUNCH_FAILED();
    backward_entries_kernel<<<(int)((s.max_items + 255) / 256), 256, 0, stream>>>(p);
    MOK_RETURN_IF_LAUNCH_FAILED();
    int sms = 0;
    MOK_RETURN_IF_CUDA_ERROR(g::sm_count(&sms));
    int grid = a->num_ctas > 0 && a->num_ctas < sms ? (int)a->num_ctas : sms;
    const int smem = (int)(BwdRowCfg::kSmemBytes + sizeof(BwdShared));
    MOK_RETURN_IF_CUDA_ERROR(
        cudaFuncSetAttribute(backward_compute_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    backward_compute_kernel<<<grid, g::kThreads, smem, stream>>>(p);
    MOK_RETURN_IF_LAUNCH_FAILED();
  }
  const int64_t fc1_vecs = (int64_t)2 * I * H / 8, fc2_vecs = (int64_t)H * I / 8;
  zero_empty_experts_kernel<<<dim3(64, L), 256, 0, stream>>>(static_cast<const int32_t*>(a->counts), L,
                                                              static_cast<uint4*>(a->d_fc1), fc1_vecs,
                                                              static_cast<uint4*>(a->d_fc2), fc2_vecs);
  MOK_RETURN_IF_LAUNCH_FAILED();
  return MOK_OK;
}
