// Tile shapes and the shared-memory plan of the grouped GEMM kernels.
//
// A CTA is three warpgroups: warpgroup 0 loads (one thread issues TMA), warpgroups 1 and 2
// multiply (each owns a 64 x WGN accumulator: WGN/2 fp32 registers per thread). A tile is
// BM x BN with BM = 64 * WM and BN = WGN * WN, WM * WN = 2 consumer warpgroups. The K loop
// steps BK = 64 bf16 (128 bytes: one 128-byte swizzle row) per pipeline stage.
#pragma once

#include <cstdint>

namespace mok {
namespace gemm {

constexpr int kBK = 64;                 // K elements per stage
constexpr int kConsumerWarpgroups = 2;
constexpr int kThreads = 128 * (1 + kConsumerWarpgroups);
constexpr int kConsumerWarps = 4 * kConsumerWarpgroups;
constexpr int kOffloadWarps = 3;        // the producer warpgroup's warps besides the TMA thread's
constexpr int kProducerRegisters = 40;
constexpr int kConsumerRegisters = 232;
// With an offloaded epilogue the producer warpgroup's warps run the epilogue's loop too.
constexpr int kOffloadProducerRegisters = 72;
constexpr int kOffloadConsumerRegisters = 216;
// setmaxnreg moves registers within the CTA's allocation: 168 per thread under the launch bound.
static_assert(kProducerRegisters + kConsumerWarpgroups * kConsumerRegisters <= 3 * 168 &&
                  kOffloadProducerRegisters + kConsumerWarpgroups * kOffloadConsumerRegisters <=
                      3 * 168,
              "register split within the launch bound");
constexpr int kMaxExperts = 1024;       // experts per launch (per-CTA tables in shared memory)
constexpr int kSmemLimit = 232448;      // sm_90 opt-in dynamic shared memory per block
// Shared memory after the stages: barriers (2 * kMaxStages + 2) and the per-CTA expert tables.
constexpr int kSmemTail = 1024 + 2 * (kMaxExperts + 1) * 4;
constexpr int kSmemAlign = 1024;        // the 128-byte swizzle pattern repeats every 1024 bytes
constexpr int kMaxStages = 8;

// How the B operand of a row-grouped GEMM sits in global memory.
enum class BLayout {
  kKMajor,   // weight [L, N, K] (a Linear weight: out = A * W^T): fc2 forward
  kSwiGLU,   // weight [L, 2I, K], gate rows then up rows; a tile takes matching gate and up rows
  kMNMajor,  // weight [L, K, N] (out = A * W): the data gradients
};

// kTmaStore: the epilogue stages the tile in shared memory (WGN * 128 bytes per consumer
// warpgroup: 64 rows of WGN bf16) and writes it with TMA bulk stores that drain while the next
// tile's K loop runs (an offloaded epilogue needs the same buffers); this costs the pipeline a
// stage in some shapes.
// kMulticast: CTAs run in clusters of two that take the two row blocks of a row-block pair of
// the same expert and column block; each CTA loads half of the B tile and multicasts it to
// both, halving the L2-to-SM traffic of B (L2 bandwidth, not the tensor cores, is what caps a
// 128 x 256 tile with a CTA of its own).
template <int BM_, int WGN_, BLayout BL_, bool kTmaStore_ = false, bool kMulticast_ = false>
struct RowCfg {
  static constexpr int BM = BM_;
  static constexpr int WGN = WGN_;
  static constexpr BLayout kB = BL_;
  static constexpr bool kTmaStore = kTmaStore_;
  static constexpr int kCluster = kMulticast_ ? 2 : 1;
  static constexpr int WM = BM / 64;
  static constexpr int WN = kConsumerWarpgroups / WM;
  static constexpr int BN = WN * WGN;  // B columns per tile (for kSwiGLU: gate + up columns)
  static constexpr int kAccRegs = WGN / 2;
  static constexpr int kABytes = BM * kBK * 2;
  static constexpr int kBBytes = BN * kBK * 2;
  static constexpr int kStageBytes = kABytes + kBBytes;
  static constexpr int kStagingBytes = kTmaStore ? WGN * 128 : 0;  // per consumer warpgroup
  static constexpr int kStages0 =
      (kSmemLimit - kSmemTail - kSmemAlign - kConsumerWarpgroups * kStagingBytes) / kStageBytes;
  static constexpr int kStages = kStages0 > kMaxStages ? kMaxStages : kStages0;
  static constexpr int kSmemBytes =
      kSmemAlign + kStages * kStageBytes + kConsumerWarpgroups * kStagingBytes + kSmemTail;
  static constexpr int kTransB = BL_ == BLayout::kMNMajor ? 1 : 0;
  static_assert(BM == 64 || BM == 128, "BM is 64 or 128");
  static_assert(WGN == 128 || WGN == 256, "WGN is 128 or 256");
  static_assert(kStages >= 3, "at least three pipeline stages");
  static_assert(kSmemBytes <= kSmemLimit, "shared memory budget");
};

// Weight-gradient tiles: out[e] (M x N) = A_e^T * B_e over the expert's rows; both operands
// are MN-major row-grouped activations. 128 x 256 tiles, one 64-row half per warpgroup.
template <bool kTmaStore_ = false>
struct WgradCfg {
  static constexpr int BM = 128;
  static constexpr int WGN = 256;
  static constexpr int BN = 256;
  static constexpr bool kTmaStore = kTmaStore_;
  static constexpr int kCluster = 1;
  static constexpr int kAccRegs = WGN / 2;
  static constexpr int kABytes = BM * kBK * 2;
  static constexpr int kBBytes = BN * kBK * 2;
  static constexpr int kStageBytes = kABytes + kBBytes;
  static constexpr int kStagingBytes = kTmaStore ? WGN * 128 : 0;
  static constexpr int kStages0 =
      (kSmemLimit - kSmemTail - kSmemAlign - kConsumerWarpgroups * kStagingBytes) / kStageBytes;
  static constexpr int kStages = kStages0 > kMaxStages ? kMaxStages : kStages0;
  static constexpr int kSmemBytes =
      kSmemAlign + kStages * kStageBytes + kConsumerWarpgroups * kStagingBytes + kSmemTail;
  static_assert(kStages >= 3, "at least three pipeline stages");
};

}  // namespace gemm
}  // namespace mok
