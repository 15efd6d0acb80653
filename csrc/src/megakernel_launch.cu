// The host side of the forward megakernel (see mok/megakernel.h): argument checks, the launch's
// shape (grid, pair mode) from cached occupancy queries, the tensor maps and kernel parameters,
// and the exports of the defaults and constants. The device code is mok/megakernel/kernel.cuh.
#include <cuda.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "mok/cuda_check.cuh"
#include "mok/gemm/host.cuh"
#include "mok/megakernel.h"
#include "mok/megakernel/kernel.cuh"
#include "mok/megakernel/kernel_params.cuh"
#include "mok/megakernel/plan.cuh"
#include "mok/megakernel/slot_sum.cuh"
#include "mok/megakernel/trace.cuh"

using namespace mok::mega;
namespace g = mok::gemm;

namespace {

constexpr int64_t kMaxRanks = 1024;  // P: the barrier and the slot sum wait on P flags
constexpr int64_t kMaxCtas = 1024;   // CTAs of a launch (a trace holds one record per CTA)

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

// A per-device value that costs host time to query (the shared-memory attribute and the
// occupancy queries cost more than the launch itself): `query(int*)` runs once per device and
// returns a cudaError_t; the value (>= 0) is cached as value + 1, so 0 means "not known yet".
constexpr int kMaxDevices = 64;
using DeviceCache = std::atomic<int>[kMaxDevices];

template <class Query>
cudaError_t once_per_device(DeviceCache& cache, int* out, Query query) {
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  const bool cached = dev >= 0 && dev < kMaxDevices;
  if (cached) {
    const int known = cache[dev].load(std::memory_order_relaxed);
    if (known > 0) {
      *out = known - 1;
      return cudaSuccess;
    }
  }
  e = query(out);
  if (e != cudaSuccess) return e;
  if (cached && *out >= 0) cache[dev].store(*out + 1, std::memory_order_relaxed);
  return cudaSuccess;
}

// CTAs of forward_kernel per SM on the current device (0: it does not fit). Sets the kernel's
// shared-memory attribute, which every launch and the cluster query below need, on the first
// call for a device.
DeviceCache g_ctas_per_sm;

cudaError_t ctas_per_sm(int* out) {
  return once_per_device(g_ctas_per_sm, out, [](int* n) {
    const cudaError_t e = cudaFuncSetAttribute(forward_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
    return e != cudaSuccess ? e : cudaOccupancyMaxActiveBlocksPerMultiprocessor(n, forward_kernel, g::kThreads,
                                                                                 kSmemBytes);
  });
}

// A launch of `grid` CTAs of forward_kernel in clusters of two (pair mode); `attr` holds the
// cluster attribute the configuration points to.
cudaLaunchConfig_t pair_launch_config(int64_t grid, cudaStream_t stream, cudaLaunchAttribute* attr) {
  attr->id = cudaLaunchAttributeClusterDimension;
  attr->val.clusterDim.x = 2;
  attr->val.clusterDim.y = 1;
  attr->val.clusterDim.z = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3((unsigned)grid, 1, 1);
  cfg.blockDim = dim3(g::kThreads, 1, 1);
  cfg.dynamicSmemBytes = kSmemBytes;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cfg;
}

// Clusters of two CTAs of forward_kernel that can be resident at once on the current device
// (pair mode); 0 when none fits. After ctas_per_sm (the shared-memory attribute).
DeviceCache g_resident_pairs;

cudaError_t resident_pairs(int sms, int* out) {
  return once_per_device(g_resident_pairs, out, [sms](int* n) {
    cudaLaunchAttribute attr;
    const cudaLaunchConfig_t cfg = pair_launch_config(sms / 2 * 2, nullptr, &attr);
    const cudaError_t e = cudaOccupancyMaxActiveClusters(n, forward_kernel, &cfg);
    if (e == cudaSuccess && *n < 0) *n = 0;
    return e;
  });
}

// The launch's grid and whether it runs in pair mode. One CTA per SM, every CTA resident: the
// grid comes from the occupancy query, never from the work (a fixed share of the SMs when the
// caller asks for fewer). Pair mode (when wanted: MokMegakernelTunables::pairs): clusters of two
// CTAs that run pair tiles and share the weight tile (plan.cuh), taken only when it keeps every
// CTA of that grid: an even grid and comm CTA count, and that many CTAs resident as clusters.
int launch_shape(int64_t comm_ctas, int64_t num_ctas, bool want_pairs, int64_t* grid_out, int* pairs_out) {
  int sms = 0, per_sm = 0;
  MOK_RETURN_IF_CUDA_ERROR(g::sm_count(&sms));
  MOK_RETURN_IF_CUDA_ERROR(ctas_per_sm(&per_sm));
  if (per_sm < 1) return MOK_ERR_UNSUPPORTED;  // the CTA does not fit an SM of this device
  int64_t grid = (int64_t)sms * per_sm;
  if (num_ctas > 0 && num_ctas < grid) grid = num_ctas;
  if (grid > kMaxCtas) return MOK_ERR_UNSUPPORTED;
  if (grid <= comm_ctas) return MOK_ERR_INVALID_ARGUMENT;  // no CTA left to compute
  int pairs = 0;
  if (want_pairs && grid % 2 == 0 && comm_ctas % 2 == 0) {
    MOK_RETURN_IF_CUDA_ERROR(resident_pairs(sms, &pairs));
    pairs = 2 * (int64_t)pairs >= grid ? 1 : 0;
  }
  *grid_out = grid;
  *pairs_out = pairs;
  return MOK_OK;
}

bool valid_group_blocks(int64_t n) { return n >= kMinGroupBlocks && n <= kMaxGroupBlocks && n % 2 == 0; }

// Argument checks (no CUDA call). Returns MOK_OK or MOK_ERR_INVALID_ARGUMENT.
int check_args(const MokMegakernelArgs& a) {
  const MokMegakernelTunables& u = a.tunables;
  MOK_REQUIRE(a.bases && a.signal_bases && a.table && a.offsets && a.counts && a.fc1_weight &&
              a.fc2_weight && a.ring_x && a.ring_h && a.ring_w && a.counters && a.epoch_counter &&
              a.status);
  MOK_REQUIRE(a.T >= 0 && a.T < INT32_MAX && (a.T == 0 || (a.topk_ids && a.y)));
  MOK_REQUIRE(a.P >= 1 && a.P <= kMaxRanks && a.rank >= 0 && a.rank < a.P);
  MOK_REQUIRE(a.L >= 1 && a.L <= g::kMaxExperts && a.K >= 1 && a.K <= kSumMaxK);
  MOK_REQUIRE(a.H > 0 && a.H % kFc2Cols == 0 && a.I > 0 && a.I % kFc1Cols == 0);
  MOK_REQUIRE(a.H <= (1 << 20) && a.I <= (1 << 20));
  MOK_REQUIRE(u.minibatch_rows > 0 && u.minibatch_rows % kBlockRows == 0);
  MOK_REQUIRE(a.ring_rows % u.minibatch_rows == 0 && a.ring_rows >= 2 * u.minibatch_rows);
  MOK_REQUIRE(a.ring_rows <= (1 << 24));
  MOK_REQUIRE(u.comm_ctas >= 2 && u.num_ctas >= 0 && a.timeout_ns > 0);
  MOK_REQUIRE(u.num_ctas == 0 || u.num_ctas > u.comm_ctas);
  MOK_REQUIRE(u.pairs == 0 || u.pairs == 1);
  MOK_REQUIRE(valid_group_blocks(u.group_blocks));
  MOK_REQUIRE(a.rows_offset >= 0 && a.scalars_offset >= 0 && a.slots_offset >= 0);
  MOK_REQUIRE(a.rows_offset % 16 == 0 && a.slots_offset % 16 == 0 && a.scalars_offset % 4 == 0);
  MOK_REQUIRE(aligned16(a.ring_x) && aligned16(a.ring_h) && aligned16(a.fc1_weight) &&
              aligned16(a.fc2_weight) && (a.y == nullptr || aligned16(a.y)));
  MOK_REQUIRE((reinterpret_cast<uintptr_t>(a.counters) & 7u) == 0);
  MOK_REQUIRE((reinterpret_cast<uintptr_t>(a.table) & 7u) == 0);  // fc2's epilogue reads int2 entries
  MOK_REQUIRE(a.trace == nullptr || a.trace_capacity > 0);
  const bool any_save = a.save_x || a.save_w || a.save_gu;
  MOK_REQUIRE(!any_save || (a.save_x && a.save_w && a.save_gu));
  MOK_REQUIRE(!any_save || (aligned16(a.save_x) && aligned16(a.save_gu)));
  MOK_REQUIRE(a.save_rows >= 0 && a.save_rows % kBlockRows == 0 && (any_save || a.save_rows == 0));
  MOK_REQUIRE((a.fc1_weight2 == nullptr) == (a.fc2_weight2 == nullptr));
  MOK_REQUIRE(a.fc1_weight2 == nullptr ? a.L1 == a.L : (a.L1 >= 1 && a.L1 < a.L));
  MOK_REQUIRE(a.fc1_weight2 == nullptr || (aligned16(a.fc1_weight2) && aligned16(a.fc2_weight2)));
  return MOK_OK;
}

}  // namespace

MOK_API int64_t mok_megakernel_args_bytes(void) { return (int64_t)sizeof(MokMegakernelArgs); }
MOK_API int64_t mok_megakernel_tunables_bytes(void) { return (int64_t)sizeof(MokMegakernelTunables); }
MOK_API int64_t mok_megakernel_constants_bytes(void) { return (int64_t)sizeof(MokMegakernelConstants); }

MOK_API int mok_megakernel_default_tunables(MokMegakernelTunables* out) {
  MOK_REQUIRE(out != nullptr);
  *out = MokMegakernelTunables{};
  out->comm_ctas = 0;
  out->num_ctas = 0;
  out->minibatch_rows = 0;
  out->pairs = 1;
  out->group_blocks = kDefaultGroupBlocks;
  return MOK_OK;
}

MOK_API int mok_megakernel_constants(MokMegakernelConstants* out) {
  MOK_REQUIRE(out != nullptr);
  *out = MokMegakernelConstants{};
  out->block_rows = kBlockRows;
  out->fc1_cols = kFc1Cols;
  out->fc2_cols = kFc2Cols;
  out->max_experts = g::kMaxExperts;
  out->max_topk = kSumMaxK;
  out->max_ranks = kMaxRanks;
  out->first_pull_parts = kFirstPullParts;
  out->first_pull_minibatches = kFirstPullMinibatches;
  out->tile_arrivals = kTileArrivals;
  out->min_group_blocks = kMinGroupBlocks;
  out->max_group_blocks = kMaxGroupBlocks;
  out->trace_fields = kTraceWords;
  out->trace_cta_kind = kTraceCtaKind;
  out->max_ctas = kMaxCtas;
  return MOK_OK;
}

MOK_API int mok_megakernel_launch_shape(int64_t comm_ctas, int64_t num_ctas, int64_t want_pairs, int64_t* out) {
  MOK_REQUIRE(out != nullptr && comm_ctas >= 2 && num_ctas >= 0 && (want_pairs == 0 || want_pairs == 1));
  int64_t grid = 0;
  int pairs = 0;
  const int rc = launch_shape(comm_ctas, num_ctas, want_pairs != 0, &grid, &pairs);
  if (rc != MOK_OK) return rc;
  out[0] = grid;
  out[1] = pairs;
  return MOK_OK;
}

MOK_API int mok_megakernel_forward(const MokMegakernelArgs* args, cudaStream_t stream) {
  MOK_REQUIRE(args != nullptr);
  const MokMegakernelArgs& a = *args;
  const int rc_args = check_args(a);
  if (rc_args != MOK_OK) return rc_args;
  const MokMegakernelTunables& u = a.tunables;

  const int slots = (int)(a.ring_rows / kBlockRows);
  KernelParams p{};
  int rc = g::encode_map_2d(&p.ops.fc1.map_a, a.ring_x, a.H, a.ring_rows, g::kBK, kBlockRows);
  if (rc == MOK_OK)
    rc = g::encode_map_2d(&p.ops.fc1.map_b, a.fc1_weight, a.H, a.L1 * 2 * a.I, g::kBK, g::b_box_rows<Fc1Boxes>());
  if (rc == MOK_OK) rc = g::encode_map_2d(&p.ops.fc2.map_a, a.ring_h, a.I, a.ring_rows, g::kBK, kBlockRows);
  if (rc == MOK_OK)
    rc = g::encode_map_2d(&p.ops.fc2.map_b, a.fc2_weight, a.I, a.L1 * a.H, g::kBK, g::b_box_rows<Fc2Boxes>());
  p.ops.fc1_2 = p.ops.fc1;  // A is shared (sizes set below); B is the second segment's, if any
  p.ops.fc2_2 = p.ops.fc2;
  if (rc == MOK_OK && a.fc1_weight2 != nullptr)
    rc = g::encode_map_2d(&p.ops.fc1_2.map_b, a.fc1_weight2, a.H, (a.L - a.L1) * 2 * a.I, g::kBK,
                          g::b_box_rows<Fc1Boxes>());
  if (rc == MOK_OK && a.fc2_weight2 != nullptr)
    rc = g::encode_map_2d(&p.ops.fc2_2.map_b, a.fc2_weight2, a.I, (a.L - a.L1) * a.H, g::kBK,
                          g::b_box_rows<Fc2Boxes>());
  p.ops.L1 = (int)a.L1;
  if (rc == MOK_OK) rc = g::encode_map_2d(&p.ops.fc1_a_half, a.ring_x, a.H, a.ring_rows, g::kBK, kBlockRows / 2);
  if (rc == MOK_OK) rc = g::encode_map_2d(&p.ops.fc2_a_half, a.ring_h, a.I, a.ring_rows, g::kBK, kBlockRows / 2);
  if (rc != MOK_OK) return rc;
  p.ops.fc1.K = (int)a.H;
  p.ops.fc1.N = (int)(2 * a.I);
  p.ops.fc2.K = (int)a.I;
  p.ops.fc2.N = (int)a.H;
  p.ops.fc1_2.K = p.ops.fc1.K;
  p.ops.fc1_2.N = p.ops.fc1.N;
  p.ops.fc2_2.K = p.ops.fc2.K;
  p.ops.fc2_2.N = p.ops.fc2.N;
  p.ops.swiglu = {static_cast<__nv_bfloat16*>(a.ring_h), nullptr, a.ring_w, (int)a.I, a.ring_rows};
  p.ops.save_gu = static_cast<__nv_bfloat16*>(a.save_gu);
  p.ops.save_rows = a.save_rows;
  p.ops.push = PushTargets{a.bases, a.slots_offset, a.table, (int)a.H};
  p.rows = RowSpaces{a.bases, a.rows_offset, a.scalars_offset, a.table,
                     static_cast<uint4*>(a.ring_x), a.ring_w, static_cast<uint4*>(a.save_x), a.save_w,
                     a.save_rows, (int)a.K, (int)(a.H / 8)};
  p.signal_bases = a.signal_bases;
  p.ids = a.topk_ids;
  p.y = static_cast<uint4*>(a.y);
  p.offsets = a.offsets;
  p.counts = a.counts;
  p.counters = a.counters;
  p.status = a.status;
  p.timeout_ns = a.timeout_ns;
  p.trace = Trace{a.trace, a.trace ? a.trace_capacity : 0};
  p.P = (int)a.P;
  p.rank = (int)a.rank;
  p.L = (int)a.L;
  p.T = (int)a.T;
  p.E = (int)(a.P * a.L);
  p.comm_ctas = (int)u.comm_ctas;
  p.mb_blocks = (int)(u.minibatch_rows / kBlockRows);
  p.slots = slots;
  p.n1 = (int)(a.I / kFc1Cols);
  p.n2 = (int)(a.H / kFc2Cols);
  p.group_blocks = (int)u.group_blocks;

  int64_t grid = 0;
  int pairs = 0;
  const int rc_shape = launch_shape(u.comm_ctas, u.num_ctas, u.pairs != 0, &grid, &pairs);
  if (rc_shape != MOK_OK) return rc_shape;
  p.pairs = pairs;

  reset_kernel<<<1, 256, 0, stream>>>(a.counters, counter_words(slots), a.epoch_counter);
  MOK_RETURN_IF_LAUNCH_FAILED();
  if (pairs) {
    cudaLaunchAttribute attr;
    const cudaLaunchConfig_t cfg = pair_launch_config(grid, stream, &attr);
    MOK_RETURN_IF_CUDA_ERROR(cudaLaunchKernelEx(&cfg, forward_kernel, p));
  } else {
    forward_kernel<<<(unsigned)grid, g::kThreads, kSmemBytes, stream>>>(p);
  }
  MOK_RETURN_IF_LAUNCH_FAILED();
  return MOK_OK;
}
