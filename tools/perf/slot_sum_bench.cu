// What limits the forward megakernel's slot sum (csrc/include/mok/megakernel/slot_sum.cuh)?
//
// In the megakernel the sum reads T x K bf16 slot rows (4096 x 8 x 7168: 470 MB) and writes T
// rows (59 MB) in ~0.17 ms, ~2.8 TB/s of reads, where a copy reaches ~4.3. This program runs the
// launch's own combine_and_sum alone (one CTA of 384 threads per SM, as in the megakernel, the
// combine-done flag already raised) and, on the same bytes, variants that change one thing each:
//   read     every thread streams its share of the slots, 16 loads in flight, no sum: the ceiling
//   chunkN   a CTA-chunked sum (the design the token-major sum replaced): a CTA takes N tokens
//            per grab (CTA barriers around each grab), each thread 2 (token, vector) pairs in flight
//   pairsN   that loop with N pairs per thread in flight
//   l2hint   that loop with ld.global.nc.L1::no_allocate.L2::256B loads
//   tokmaj   each warp sums a quarter of one token's row (units from a counter), without ids:
//            what the launch's sum does, less its ids mask
// Each variant is timed 20 times with the L2 flushed before every run (the sum reads rows that
// were written long before, except the last few MB); median in us and GB/s of slot reads, and
// whether its y is bitwise the launch's.
//
// Build: nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Icsrc/include
//        tools/perf/slot_sum_bench.cu -o slot_sum_bench
// Run on one GPU: ./slot_sum_bench
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "mok/megakernel/slot_sum.cuh"
#include "mok/swiglu_math.cuh"

#include "bench_check.cuh"

using mok::mega::kSumThreads;

constexpr int kT = 4096, kK = 8, kH = 7168, kVecs = kH / 8, kE = 96;

struct Buffers {
  uint4* slots;
  int64_t* ids;
  uint4* y;
  int32_t* counters;
  int32_t* status;
  uint64_t* flags;
  uint64_t* signal_bases;
  char* flush;
  size_t flush_bytes;
};

// acc[c] += the c-th of the 8 bf16 values in r (fp32), as the launch's sum adds a slot.
__device__ __forceinline__ void add_bf16x8(float (&acc)[8], const uint4& r) {
  const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&r);
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const float2 f = __bfloat1622float2(p[c]);
    acc[2 * c] += f.x;
    acc[2 * c + 1] += f.y;
  }
}

__global__ void product_sum(mok::mega::SumArgs a) {
  __shared__ mok::mega::SumShared sh;
  mok::mega::combine_and_sum(a, sh, threadIdx.x);
}

// The CTA-chunked sum, without the flag wait and the ids mask (every slot valid here), with the
// grab size, the pairs in flight and the load instruction as parameters.
template <int kChunk, int kPairs, bool kHint>
__global__ void variant_sum(const uint4* __restrict__ slots, uint4* __restrict__ y, int32_t* next_token) {
  __shared__ int t0_shared;
  const int tid = threadIdx.x;
  for (;;) {
    if (tid == 0) t0_shared = atomicAdd(next_token, kChunk);
    __syncthreads();
    const int t0 = t0_shared;
    __syncthreads();
    if (t0 >= kT) return;
    const int t1 = min(t0 + kChunk, kT);
    const int pairs = (t1 - t0) * kVecs;
    for (int q0 = tid; q0 < pairs; q0 += kPairs * kSumThreads) {
      float acc[kPairs][8];
      int64_t base[kPairs];
#pragma unroll
      for (int h = 0; h < kPairs; ++h) {
        const int q = q0 + h * kSumThreads;
        const int tok = t0 + (q < pairs ? q / kVecs : 0);
        const int vec = q < pairs ? q % kVecs : 0;
        base[h] = (int64_t)tok * kK * kVecs + vec;
#pragma unroll
        for (int c = 0; c < 8; ++c) acc[h][c] = 0.f;
      }
      uint4 r[kPairs][kK];
#pragma unroll
      for (int h = 0; h < kPairs; ++h)
#pragma unroll
        for (int j = 0; j < kK; ++j) {
          const uint4* p = slots + base[h] + (int64_t)j * kVecs;
          if (kHint) {
            asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
                         : "=r"(r[h][j].x), "=r"(r[h][j].y), "=r"(r[h][j].z), "=r"(r[h][j].w)
                         : "l"(p));
          } else {
            r[h][j] = __ldcg(p);
          }
        }
#pragma unroll
      for (int h = 0; h < kPairs; ++h)
#pragma unroll
        for (int j = 0; j < kK; ++j) add_bf16x8(acc[h], r[h][j]);
#pragma unroll
      for (int h = 0; h < kPairs; ++h) {
        const int q = q0 + h * kSumThreads;
        if (q < pairs) y[(int64_t)(t0 + q / kVecs) * kVecs + q % kVecs] = mok::pack8(acc[h]);
      }
    }
  }
}

// Each warp takes (token, quarter of the row) units from a counter: lanes walk the quarter's
// vectors 2 at a time, 8 slots each; no CTA-wide barrier.
__global__ void token_major_sum(const uint4* __restrict__ slots, uint4* __restrict__ y, int32_t* next_unit) {
  const int lane = threadIdx.x % 32;
  constexpr int kParts = 4, kPartVecs = kVecs / kParts;  // 224
  for (;;) {
    int unit = 0;
    if (lane == 0) unit = atomicAdd(next_unit, 1);
    unit = __shfl_sync(0xffffffffu, unit, 0);
    if (unit >= kT * kParts) return;
    const int tok = unit / kParts, v0 = (unit % kParts) * kPartVecs;
    for (int v = v0 + lane; v < v0 + kPartVecs; v += 64) {
      const bool second = v + 32 < v0 + kPartVecs;
      uint4 r[2][kK];
#pragma unroll
      for (int j = 0; j < kK; ++j) {
        r[0][j] = __ldcg(slots + ((int64_t)tok * kK + j) * kVecs + v);
        if (second) r[1][j] = __ldcg(slots + ((int64_t)tok * kK + j) * kVecs + v + 32);
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (h == 1 && !second) continue;
        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int j = 0; j < kK; ++j) add_bf16x8(acc, r[h][j]);
        y[(int64_t)tok * kVecs + v + 32 * h] = mok::pack8(acc);
      }
    }
  }
}

// The ceiling: every thread streams a contiguous share of the slots, 16 loads in flight.
__global__ void read_only(const uint4* __restrict__ slots, int64_t n, uint4* __restrict__ sink) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  uint32_t x = 0;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += 16 * stride) {
    uint4 r[16];
#pragma unroll
    for (int u = 0; u < 16; ++u) r[u] = i + u * stride < n ? __ldcg(slots + i + u * stride) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int u = 0; u < 16; ++u) x ^= r[u].x ^ r[u].w;
  }
  if (x == 0x12345678u) sink[0] = make_uint4(x, 0, 0, 0);  // keeps the loads
}

__global__ void fill_slots(__nv_bfloat16* s, int64_t n) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    s[i] = __float2bfloat16((float)((i * 2654435761ull >> 7) % 1000) / 1000.f - 0.5f);
}

int sms() {
  int dev = 0, n = 0;
  CHECK(cudaGetDevice(&dev));
  CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
  return n;
}

template <class Launch>
float median_us(const Buffers& b, Launch launch) {
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  std::vector<float> ms;
  for (int it = 0; it < 22; ++it) {
    CHECK(cudaMemsetAsync(b.flush, it & 0xff, b.flush_bytes));  // evicts the slots from L2
    CHECK(cudaMemsetAsync(b.counters, 0, 64 * sizeof(int32_t)));
    CHECK(cudaEventRecord(e0));
    launch();
    CHECK(cudaGetLastError());
    CHECK(cudaEventRecord(e1));
    CHECK(cudaEventSynchronize(e1));
    float t = 0.f;
    CHECK(cudaEventElapsedTime(&t, e0, e1));
    if (it >= 2) ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  CHECK(cudaEventDestroy(e0));
  CHECK(cudaEventDestroy(e1));
  return ms[ms.size() / 2] * 1000.f;
}

// y of a variant against the product's y, bit for bit (every variant sums j ascending in fp32).
bool same_y(const Buffers& b, const std::vector<uint16_t>& want) {
  std::vector<uint16_t> got(want.size());
  CHECK(cudaMemcpy(got.data(), b.y, got.size() * 2, cudaMemcpyDeviceToHost));
  return std::memcmp(got.data(), want.data(), got.size() * 2) == 0;
}

int main() {
  const int64_t slot_elems = (int64_t)kT * kK * kH;
  const double slot_bytes = 2.0 * slot_elems;
  Buffers b{};
  b.flush_bytes = 256ull << 20;
  CHECK(cudaMalloc(&b.slots, slot_elems * 2));
  CHECK(cudaMalloc(&b.ids, (size_t)kT * kK * 8));
  CHECK(cudaMalloc(&b.y, (size_t)kT * kH * 2));
  CHECK(cudaMalloc(&b.counters, 64 * sizeof(int32_t)));
  CHECK(cudaMalloc(&b.status, 64 * sizeof(int32_t)));
  CHECK(cudaMalloc(&b.flags, 8 * sizeof(uint64_t)));
  CHECK(cudaMalloc(&b.signal_bases, sizeof(uint64_t)));
  CHECK(cudaMalloc(&b.flush, b.flush_bytes));
  fill_slots<<<1024, 256>>>(reinterpret_cast<__nv_bfloat16*>(b.slots), slot_elems);
  CHECK(cudaGetLastError());
  std::vector<int64_t> ids((size_t)kT * kK);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = (int64_t)((i * 7919) % kE);
  CHECK(cudaMemcpy(b.ids, ids.data(), ids.size() * 8, cudaMemcpyHostToDevice));
  CHECK(cudaMemset(b.status, 0, 64 * sizeof(int32_t)));
  const uint64_t epoch = 1;
  CHECK(cudaMemcpy(b.flags, &epoch, sizeof(epoch), cudaMemcpyHostToDevice));
  const uint64_t base = reinterpret_cast<uint64_t>(b.flags);
  CHECK(cudaMemcpy(b.signal_bases, &base, sizeof(base), cudaMemcpyHostToDevice));

  const int grid = sms();
  mok::mega::SumArgs a{};
  a.signal_bases = b.signal_bases;
  a.slots = b.slots;
  a.ids = b.ids;
  a.y = b.y;
  a.counters = b.counters;
  a.deadline = mok::mega::Deadline{b.status, 2000000000ll, 0};
  a.epoch = epoch;
  a.P = 1;
  a.rank = 0;
  a.T = kT;
  a.K = kK;
  a.E = kE;
  a.vecs = kVecs;
  a.trace = mok::mega::Trace{nullptr, 0};
  a.trace_record = -1;

  std::printf("slot sum, T %d K %d H %d: %.1f MB of slots, %d CTAs x %d threads\n", kT, kK, kH, slot_bytes / 1e6, grid,
              kSumThreads);
  auto report = [&](const char* name, float us, int ok) {
    std::printf("%-10s %8.1f us  %6.0f GB/s of slot reads%s\n", name, us, slot_bytes / (us * 1e3),
                ok < 0 ? "" : (ok ? "  (y bitwise = product)" : "  (y DIFFERS from product)"));
  };
  int32_t* next = b.counters + mok::mega::kSumNext;
  report("product", median_us(b, [&] { product_sum<<<grid, kSumThreads>>>(a); }), -1);
  std::vector<uint16_t> want((size_t)kT * kH);
  CHECK(cudaMemcpy(want.data(), b.y, want.size() * 2, cudaMemcpyDeviceToHost));
  report("read", median_us(b, [&] { read_only<<<grid, kSumThreads>>>(b.slots, slot_elems / 8, b.y); }), -1);
  report("chunk8", median_us(b, [&] { variant_sum<8, 2, false><<<grid, kSumThreads>>>(b.slots, b.y, next); }),
         same_y(b, want));
  report("chunk4", median_us(b, [&] { variant_sum<4, 2, false><<<grid, kSumThreads>>>(b.slots, b.y, next); }),
         same_y(b, want));
  report("chunk16", median_us(b, [&] { variant_sum<16, 2, false><<<grid, kSumThreads>>>(b.slots, b.y, next); }),
         same_y(b, want));
  report("pairs1", median_us(b, [&] { variant_sum<8, 1, false><<<grid, kSumThreads>>>(b.slots, b.y, next); }),
         same_y(b, want));
  report("pairs4", median_us(b, [&] { variant_sum<8, 4, false><<<grid, kSumThreads>>>(b.slots, b.y, next); }),
         same_y(b, want));
  report("l2hint", median_us(b, [&] { variant_sum<8, 2, true><<<grid, kSumThreads>>>(b.slots, b.y, next); }),
         same_y(b, want));
  report("tokmaj", median_us(b, [&] { token_major_sum<<<grid, kSumThreads>>>(b.slots, b.y, next); }),
         same_y(b, want));
  report("tokmaj4x", median_us(b, [&] { token_major_sum<<<4 * grid, kSumThreads>>>(b.slots, b.y, next); }),
         same_y(b, want));
  report("memcpy", median_us(b, [&] { CHECK(cudaMemcpyAsync(b.flush, b.slots, b.flush_bytes, cudaMemcpyDeviceToDevice)); }) *
                       (float)(slot_bytes / b.flush_bytes), -1);
  std::printf("(memcpy: a 256 MB device copy scaled to the slots' bytes, reads and writes both)\n");
  return 0;
}
