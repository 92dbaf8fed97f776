// What an on-chip merge of split partials would cost (benchmarks/NOTES.md, the column-split MLA kernel): 128
// CTAs (one an SM) each holding a 64 x 512 float32 partial (128 KB) in shared memory. Cluster C: each CTA sums
// its 1/C column slice over the C CTAs of its cluster through distributed shared memory and stores that slice
// (C = 1: every CTA stores its 128 KB, as the split decode does). Times per launch, minus an empty launch.
// nvcc -O3 -arch=sm_90a -o /tmp/dsmem benchmarks/dsmem_merge_probe.cu && /tmp/dsmem
#include <cooperative_groups.h>
#include <cstdio>
#include <cuda_runtime.h>
namespace cg = cooperative_groups;

constexpr int N4 = 128 * 1024 / 16;  // float4s in a 128 KB partial

template <int C, bool WORK>
__global__ void __launch_bounds__(256) reduce_kernel(float4* out) {
  extern __shared__ float4 smem[];
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = C > 1 ? cluster.block_rank() : 0;
  if (WORK) {
    for (int i = threadIdx.x; i < N4; i += blockDim.x) smem[i] = make_float4(rank + i, 1.f, 2.f, 3.f);
  }
  if (C > 1) cluster.sync(); else __syncthreads();
  if (WORK) {
    const int slice = N4 / C, lo = rank * slice;
    float4* dst = out + (size_t)blockIdx.x * slice;
    for (int i = threadIdx.x; i < slice; i += blockDim.x) {
      float4 acc = smem[lo + i];
#pragma unroll
      for (int r = 1; r < C; ++r) {
        const float4* peer = cluster.map_shared_rank(smem, (rank + r) % C);
        float4 v = peer[lo + i];
        acc.x += v.x; acc.y += v.y; acc.z += v.z; acc.w += v.w;
      }
      dst[i] = acc;
    }
  }
  if (C > 1) cluster.sync();
}

template <int C, bool WORK>
float time_launches(float4* out, int reps) {
  auto kern = reduce_kernel<C, WORK>;
  size_t smem = 128 * 1024;
  cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  if (C == 16) cudaFuncSetAttribute(kern, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(128);
  cfg.blockDim = dim3(256);
  cfg.dynamicSmemBytes = smem;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = C; attr[0].val.clusterDim.y = 1; attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr; cfg.numAttrs = 1;
  cudaStream_t s; cudaStreamCreate(&s); cfg.stream = s;
  // a CUDA graph of `reps` launches, as the engine replays them
  cudaGraph_t g; cudaGraphExec_t ge;
  cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal);
  for (int i = 0; i < reps; ++i) cudaLaunchKernelEx(&cfg, kern, out);
  cudaStreamEndCapture(s, &g);
  cudaGraphInstantiate(&ge, g, 0);
  cudaGraphLaunch(ge, s); cudaStreamSynchronize(s);
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  float best = 1e30f;
  for (int t = 0; t < 5; ++t) {
    cudaEventRecord(a, s); cudaGraphLaunch(ge, s); cudaEventRecord(b, s); cudaEventSynchronize(b);
    float ms; cudaEventElapsedTime(&ms, a, b); best = ms < best ? ms : best;
  }
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) { printf("C=%d error %s\n", C, cudaGetErrorString(e)); return -1; }
  return best * 1000.f / reps;
}

template <int C>
void report(float4* out) {
  float full = time_launches<C, true>(out, 200), empty = time_launches<C, false>(out, 200);
  double moved = C > 1 ? 128.0 * 128 * 1024 * (C - 1) / C : 0.0;  // bytes read from peers
  double stored = 128.0 * 128 * 1024 / C;
  printf("{\"cluster\": %d, \"us\": %.2f, \"empty_us\": %.2f, \"net_us\": %.2f, \"dsmem_MB\": %.1f, \"stored_MB\": %.1f}\n",
         C, full, empty, full - empty, moved / 1e6, stored / 1e6);
}

int main() {
  float4* out; cudaMalloc(&out, 128 * 128 * 1024);
  report<1>(out); report<2>(out); report<4>(out); report<8>(out); report<16>(out);
  return 0;
}
