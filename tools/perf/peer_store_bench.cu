// How the shape of a warp's 16-byte stores into a peer GPU's memory sets their throughput.
//
// fc2's push epilogue (csrc/include/mok/megakernel/push.cuh) stores each output row's 256
// columns (512 bytes) of a tile into a (token, slot) row of the home rank, half of them over
// NVLink at P = 2. With the wgmma accumulator layout one warp store instruction covers 8 rows x
// 64 bytes. This program times the same bytes stored as 8 rows x 64 B, 4 rows x 128 B, 2 rows x
// 256 B and 1 row x 512 B per instruction, into scattered 512-byte row segments of the peer's
// memory and of local memory, from every SM.
//
// Build: nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a tools/perf/peer_store_bench.cu -o peer_store_bench
// Run on a machine with two GPUs that can reach each other: ./peer_store_bench
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

#include "bench_check.cuh"

constexpr int kSegmentBytes = 512;  // one output row's share of a 256-column bf16 tile
constexpr int kRowBytes = 14336;    // H = 7168 bf16: the distance between destination rows
constexpr int kRows = 4096 * 8;     // T x K destination rows
constexpr int kColumnBlocks = 4;    // segments per row stored (of the 28 an fc2 row has)

// Each warp writes `segments_per_warp` row segments, 8 at a time (as one warp's rows of an fc2
// fragment): per instruction RPI rows x (512 / (32 / RPI * ... )) bytes; every lane stores 16 B.
// RPI = rows per instruction: 8 -> 64 B per row per instruction (the epilogue today), 1 -> 512 B.
template <int RPI>
__global__ void store_segments(char* dst, const int* dest_row, int segments_per_warp, int total_segments) {
  const int lane = threadIdx.x % 32;
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  constexpr int kLanesPerRow = 32 / RPI;             // lanes covering one row in one instruction
  constexpr int kBytesPerInst = kLanesPerRow * 16;   // contiguous bytes of a row per instruction
  constexpr int kInstPerRow = kSegmentBytes / kBytesPerInst;
  const uint4 v = make_uint4(lane, warp, 1, 2);
  for (int s0 = warp * segments_per_warp; s0 < (warp + 1) * segments_per_warp; s0 += 8) {
    // 8 segments per group, as 8 rows of a warp's fragment; RPI of them per instruction.
#pragma unroll
    for (int g = 0; g < 8; g += RPI) {
      const int seg = s0 + g + lane / kLanesPerRow;
      if (seg >= total_segments) continue;
      char* row = dst + (size_t)dest_row[seg % kRows] * kRowBytes + (seg / kRows) * kSegmentBytes;
#pragma unroll
      for (int i = 0; i < kInstPerRow; ++i)
        *reinterpret_cast<uint4*>(row + i * kBytesPerInst + (lane % kLanesPerRow) * 16) = v;
    }
  }
}

template <int RPI>
float time_pattern(char* dst, const int* dest_row, int segments, int blocks, int threads) {
  const int warps = blocks * threads / 32;
  const int per_warp = (segments / warps + 7) / 8 * 8;
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  store_segments<RPI><<<blocks, threads>>>(dst, dest_row, per_warp, segments);
  CHECK(cudaGetLastError());
  float best = 1e30f;
  for (int rep = 0; rep < 5; ++rep) {
    CHECK(cudaEventRecord(a));
    store_segments<RPI><<<blocks, threads>>>(dst, dest_row, per_warp, segments);
    CHECK(cudaGetLastError());
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    if (ms < best) best = ms;
  }
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  return best;
}

int main() {
  int n = 0;
  CHECK(cudaGetDeviceCount(&n));
  const int rows = kRows;
  const int segments = rows * kColumnBlocks;
  std::vector<int> perm(rows);
  for (int i = 0; i < rows; ++i) perm[i] = i;
  srand(7);
  for (int i = rows - 1; i > 0; --i) std::swap(perm[i], perm[rand() % (i + 1)]);
  char* local = nullptr;
  char* peer = nullptr;
  int* dest_row = nullptr;
  CHECK(cudaSetDevice(0));
  CHECK(cudaMalloc(&local, (size_t)rows * kRowBytes));
  CHECK(cudaMalloc(&dest_row, rows * sizeof(int)));
  CHECK(cudaMemcpy(dest_row, perm.data(), rows * sizeof(int), cudaMemcpyHostToDevice));
  if (n >= 2) {
    int can = 0;
    CHECK(cudaDeviceCanAccessPeer(&can, 0, 1));
    if (can) {
      CHECK(cudaDeviceEnablePeerAccess(1, 0));
      CHECK(cudaSetDevice(1));
      CHECK(cudaMalloc(&peer, (size_t)rows * kRowBytes));
      CHECK(cudaSetDevice(0));
    }
  }
  const double bytes = (double)segments * kSegmentBytes;
  std::printf("%d segments of %d B (%.1f MB) into scattered rows %d B apart\n", segments, kSegmentBytes,
              bytes / 1e6, kRowBytes);
  for (int blocks : {8, 32, 132}) {
    for (int target = 0; target < 2; ++target) {
      char* dst = target ? peer : local;
      if (dst == nullptr) continue;
      const float t8 = time_pattern<8>(dst, dest_row, segments, blocks, 256);
      const float t4 = time_pattern<4>(dst, dest_row, segments, blocks, 256);
      const float t2 = time_pattern<2>(dst, dest_row, segments, blocks, 256);
      const float t1 = time_pattern<1>(dst, dest_row, segments, blocks, 256);
      std::printf("%3d CTAs %-5s: GB/s with rows x bytes per instruction: 8x64 %6.1f | 4x128 %6.1f | "
                  "2x256 %6.1f | 1x512 %6.1f\n",
                  blocks, target ? "peer" : "local", bytes / t8 / 1e6, bytes / t4 / 1e6, bytes / t2 / 1e6,
                  bytes / t1 / 1e6);
    }
  }
  return 0;
}
