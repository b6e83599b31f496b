// Standalone host launcher for the GEMM engine's entry kernels, independent of the Rust
// library: a shared object (cudart static, driver API via cudaGetDriverEntryPoint, so no
// libcuda at link time) that check.py drives through ctypes next to torch/cuBLAS.
// A crash here points at the kernel itself, not at the library around it.
//
// Build (here): scripts/gemm_standalone/build.sh  ->  build/gemm_standalone/libmkgemm_standalone.so
#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>
#include <cstdio>

#include "../../kernels/gemm.cu"

// The fusion hooks together, as a fused op would use them: rank-rotated row order, a
// flag wait before each A row block, TMA reduce-add into C, a per-tile flag after it.
extern "C" __global__ void __launch_bounds__(384, 1)
    mk_gemm_hooks_test(const __grid_constant__ CUtensorMap tma_a, const __grid_constant__ CUtensorMap tma_b,
                       const __grid_constant__ CUtensorMap tma_c, const uint64_t* a_flags, uint64_t* tile_flags,
                       int M, int N, int K, int group_m, int m_block_base, int rows_per_flag) {
  using namespace mk::gemm;
  using Cfg = GemmConfig<__nv_bfloat16, 256, 3>;
  using Epi = TmaEpilogue<LocalDest, TmaAddOp, FlagTileSignal>;
  extern __shared__ __align__(1024) char smem[];
  RasterParams sched{(M + 127) / 128, (N + 255) / 256, group_m, m_block_base};
  FlagAWait::Params wait{a_flags, 1, rows_per_flag, M};
  Epi::Params epi{{&tma_c}, {tile_flags, sched.tiles_n}};
  gemm_persistent<Cfg, RankRotatedRaster, FlagAWait, Epi>(&tma_a, &tma_b, GemmShape{M, N, K}, sched, wait, epi,
                                                           blockIdx.x, gridDim.x, smem);
}

namespace {

PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  if (!fn) {
    cudaDriverEntryPointQueryResult q;
    void* p = nullptr;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      return nullptr;
    fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }
  return fn;
}

// 2-D row-major [rows, cols] tensor, box {box_cols, box_rows}, 128-byte swizzle.
int make_map(CUtensorMap* m, const void* ptr, int dtype, long rows, long cols, int box_rows, int box_cols) {
  auto fn = encode_fn();
  if (!fn) return 100;
  cuuint64_t dims[2] = {(cuuint64_t)cols, (cuuint64_t)rows};
  cuuint64_t strides[1] = {(cuuint64_t)cols * 2};
  cuuint32_t box[2] = {(cuuint32_t)box_cols, (cuuint32_t)box_rows};
  cuuint32_t estr[2] = {1, 1};
  CUresult r = fn(m, dtype == 0 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2,
                  const_cast<void*>(ptr), dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
                  CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? 0 : 200 + (int)r;
}

typedef void (*Entry)(CUtensorMap, CUtensorMap, CUtensorMap, void*, int, int, int, int, int);

Entry pick(int dtype, int bn, int tma) {
#define MK_PICK(D, B, E, F) \
  if (dtype == D && bn == B && tma == E) return F;
  MK_PICK(0, 256, 1, mk_gemm_bf16_bn256_tma)
  MK_PICK(0, 128, 1, mk_gemm_bf16_bn128_tma)
  MK_PICK(0, 64, 1, mk_gemm_bf16_bn64_tma)
  MK_PICK(0, 256, 0, mk_gemm_bf16_bn256_direct)
  MK_PICK(0, 128, 0, mk_gemm_bf16_bn128_direct)
  MK_PICK(0, 64, 0, mk_gemm_bf16_bn64_direct)
  MK_PICK(1, 256, 1, mk_gemm_f16_bn256_tma)
  MK_PICK(1, 128, 1, mk_gemm_f16_bn128_tma)
  MK_PICK(1, 64, 1, mk_gemm_f16_bn64_tma)
  MK_PICK(1, 256, 0, mk_gemm_f16_bn256_direct)
  MK_PICK(1, 128, 0, mk_gemm_f16_bn128_direct)
  MK_PICK(1, 64, 0, mk_gemm_f16_bn64_direct)
#undef MK_PICK
  return nullptr;
}

int smem_bytes(int bn, int tma) {
  using namespace mk::gemm;
#define MK_SMEM(B, E)                                                                                    \
  if (bn == B && tma == E)                                                                               \
    return engine_smem_bytes<GemmConfig<__nv_bfloat16, B, PlainStages<128, B, (bool)E, false>::value>, \
                             std::conditional<E, TmaStoreEpilogue, DirectStoreEpilogue<StoreOp>>::type>();
  MK_SMEM(256, 1) MK_SMEM(128, 1) MK_SMEM(64, 1) MK_SMEM(256, 0) MK_SMEM(128, 0) MK_SMEM(64, 0)
#undef MK_SMEM
  return -1;
}

}  // namespace

extern "C" int mk_standalone_hooks_test(const void* A, const void* B, void* C, const void* a_flags, void* tile_flags,
                                        int M, int N, int K, int group_m, int m_block_base, int rows_per_flag,
                                        int num_ctas, void* stream) {
  using namespace mk::gemm;
  CUtensorMap ta, tb, tc;
  int e;
  if ((e = make_map(&ta, A, 0, M, K, 128, 64))) return e;
  if ((e = make_map(&tb, B, 0, N, K, 256, 64))) return e;
  if ((e = make_map(&tc, C, 0, M, N, 64, 64))) return e;
  const int smem = engine_smem_bytes<GemmConfig<__nv_bfloat16, 256, 3>, TmaEpilogue<LocalDest, TmaAddOp, FlagTileSignal>>();
  cudaError_t r = cudaFuncSetAttribute(reinterpret_cast<const void*>(mk_gemm_hooks_test),
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (r != cudaSuccess) return 1000 + (int)r;
  mk_gemm_hooks_test<<<num_ctas, 384, smem, reinterpret_cast<cudaStream_t>(stream)>>>(
      ta, tb, tc, (const uint64_t*)a_flags, (uint64_t*)tile_flags, M, N, K, group_m, m_block_base, rows_per_flag);
  r = cudaGetLastError();
  return r == cudaSuccess ? 0 : 1000 + (int)r;
}

extern "C" int mk_standalone_smem_bytes(int bn, int tma) { return smem_bytes(bn, tma); }

// dtype 0 = bf16, 1 = fp16. Returns 0 or an error code (cudaError_t of the launch + 1000).
extern "C" int mk_standalone_gemm(const void* A, const void* B, void* C, int M, int N, int K, int dtype, int bn,
                                  int tma_epi, int group_m, int num_ctas, void* stream) {
  Entry f = pick(dtype, bn, tma_epi);
  if (!f) return 1;
  CUtensorMap ta, tb, tc;
  int e;
  // A boxed as the library boxes it: min(M, 128) rows (ops::gemm::GemmPlan::a_box_rows),
  // the box height the kernel is told.
  const int a_box_rows = M < 128 ? M : 128;
  if ((e = make_map(&ta, A, dtype, M, K, a_box_rows, 64))) return e;
  if ((e = make_map(&tb, B, dtype, N, K, bn, 64))) return e;
  if (tma_epi) {
    if ((e = make_map(&tc, C, dtype, M, N, 64, 64))) return e;
  } else {
    tc = ta;
  }
  const int smem = smem_bytes(bn, tma_epi);
  static bool attr_done[2][3][2] = {};
  bool& done = attr_done[dtype][bn == 256 ? 0 : bn == 128 ? 1 : 2][tma_epi];
  if (!done) {
    cudaError_t r = cudaFuncSetAttribute(reinterpret_cast<const void*>(f), cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         smem);
    if (r != cudaSuccess) return 1000 + (int)r;
    done = true;
  }
  const int tiles = ((M + 127) / 128) * ((N + bn - 1) / bn);
  int grid = num_ctas < tiles ? num_ctas : tiles;
  if (grid < 1) grid = 1;
  f<<<grid, 384, smem, reinterpret_cast<cudaStream_t>(stream)>>>(ta, tb, tc, C, M, N, K, group_m, a_box_rows);
  cudaError_t r = cudaGetLastError();
  return r == cudaSuccess ? 0 : 1000 + (int)r;
}
