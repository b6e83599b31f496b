//! cuBLASLt, loaded at run time (cudarc, dynamic loading): the reference and baseline for
//! the GEMM tests (mktest) and benchmarks (mkbench). The library itself never calls it.
//!
//! Row-major C[M,N] = A[M,K]·B[N,K]ᵀ is the column-major product Cᵀ = B·Aᵀ: cuBLAS sees
//! the B buffer as a K×N column-major matrix used transposed and the A buffer as a K×M
//! matrix used as is (the "TN" case cuBLAS is fastest at), writing an N×M result.

use cudarc::cublaslt::{result as lt, sys};
use mkernel::cuda::{memory::DeviceBuffer, sys as cu_sys};
use mkernel::error::{MkError, Result};
use mkernel::types::mkDataType_t;
use std::ffi::c_void;

fn lt_err(what: &str, e: lt::CublasError) -> MkError {
    MkError::cuda(format!("cuBLASLt {what} failed: {:?}", e.0))
}

fn cuda_type(t: mkDataType_t) -> Result<sys::cudaDataType> {
    Ok(match t {
        mkDataType_t::mkBfloat16 => sys::cudaDataType::CUDA_R_16BF,
        mkDataType_t::mkFloat16 => sys::cudaDataType::CUDA_R_16F,
        mkDataType_t::mkFloat32 => sys::cudaDataType::CUDA_R_32F,
        other => return Err(MkError::invalid_argument(format!("cuBLASLt reference: no {} GEMM", other.name()))),
    })
}

/// Why cuBLASLt cannot be used here, or None.
pub fn unavailable_reason() -> Option<String> {
    // SAFETY: only tries to dlopen the library.
    if unsafe { sys::is_culib_present() } {
        None
    } else {
        Some("libcublasLt.so not found on the loader path (add the CUDA lib64 directory to LD_LIBRARY_PATH)".into())
    }
}

/// A cuBLASLt handle with its workspace, in the current context.
pub struct CublasLt {
    handle: sys::cublasLtHandle_t,
    workspace: DeviceBuffer,
}

impl CublasLt {
    pub const WORKSPACE_BYTES: usize = 64 << 20;

    pub fn new() -> Result<Self> {
        if let Some(why) = unavailable_reason() {
            return Err(MkError::system(why));
        }
        let handle = lt::create_handle().map_err(|e| lt_err("cublasLtCreate", e))?;
        Ok(CublasLt { handle, workspace: DeviceBuffer::alloc(Self::WORKSPACE_BYTES)? })
    }

    /// Prepares C[M,N] (of `out`) = A[M,K]·B[N,K]ᵀ (of `input`), fp32 accumulation,
    /// with the heuristic's first algorithm.
    pub fn gemm(&self, m: usize, n: usize, k: usize, input: mkDataType_t, out: mkDataType_t) -> Result<CublasGemm> {
        let (ti, to) = (cuda_type(input)?, cuda_type(out)?);
        let desc = lt::create_matmul_desc(sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, sys::cudaDataType::CUDA_R_32F)
            .map_err(|e| lt_err("cublasLtMatmulDescCreate", e))?;
        let mut g = CublasGemm { desc, layouts: [std::ptr::null_mut(); 3], algo: None, ws: 0 };
        let (op_t, op_n): (i32, i32) = (1, 0); // CUBLAS_OP_T, CUBLAS_OP_N
                                               // SAFETY: desc is live; the attribute values are i32 as cuBLASLt expects.
        unsafe {
            lt::set_matmul_desc_attribute(
                desc,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                (&op_t as *const i32).cast(),
                4,
            )
            .map_err(|e| lt_err("set TRANSA", e))?;
            lt::set_matmul_desc_attribute(
                desc,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB,
                (&op_n as *const i32).cast(),
                4,
            )
            .map_err(|e| lt_err("set TRANSB", e))?;
        }
        g.layouts[0] = lt::create_matrix_layout(ti, k as u64, n as u64, k as i64).map_err(|e| lt_err("layout B", e))?;
        g.layouts[1] = lt::create_matrix_layout(ti, k as u64, m as u64, k as i64).map_err(|e| lt_err("layout A", e))?;
        g.layouts[2] = lt::create_matrix_layout(to, n as u64, m as u64, n as i64).map_err(|e| lt_err("layout C", e))?;
        let pref = lt::create_matmul_pref().map_err(|e| lt_err("cublasLtMatmulPreferenceCreate", e))?;
        let ws = Self::WORKSPACE_BYTES as u64;
        // SAFETY: all descriptors are live; pref is destroyed once below.
        let heur = unsafe {
            let r = lt::set_matmul_pref_attribute(
                pref,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&ws as *const u64).cast(),
                8,
            )
            .and_then(|_| {
                lt::get_matmul_algo_heuristic(
                    self.handle,
                    desc,
                    g.layouts[0],
                    g.layouts[1],
                    g.layouts[2],
                    g.layouts[2],
                    pref,
                )
            });
            let _ = lt::destroy_matmul_pref(pref);
            r.map_err(|e| lt_err(&format!("heuristic for {m}x{n}x{k} {}->{}", input.name(), out.name()), e))?
        };
        g.algo = Some(heur.algo);
        g.ws = heur.workspaceSize;
        Ok(g)
    }
}

impl Drop for CublasLt {
    fn drop(&mut self) {
        // SAFETY: created in new, destroyed once.
        let _ = unsafe { lt::destroy_handle(self.handle) };
    }
}

/// One prepared cuBLASLt GEMM shape (descriptors + chosen algorithm).
pub struct CublasGemm {
    desc: sys::cublasLtMatmulDesc_t,
    layouts: [sys::cublasLtMatrixLayout_t; 3],
    algo: Option<sys::cublasLtMatmulAlgo_t>,
    ws: usize,
}

impl CublasGemm {
    /// C = A·Bᵀ (row-major device pointers) on `stream`.
    pub fn run(&self, lt_handle: &CublasLt, a: u64, b: u64, c: u64, stream: cu_sys::CUstream) -> Result<()> {
        let (alpha, beta) = (1.0f32, 0.0f32);
        let algo = self.algo.as_ref().map(|a| a as *const _).unwrap_or(std::ptr::null());
        // SAFETY: descriptors are live and describe the buffers' shapes (caller's contract).
        unsafe {
            lt::matmul(
                lt_handle.handle,
                self.desc,
                (&alpha as *const f32).cast(),
                (&beta as *const f32).cast(),
                b as *const c_void,
                self.layouts[0],
                a as *const c_void,
                self.layouts[1],
                c as *const c_void,
                self.layouts[2],
                c as *mut c_void,
                self.layouts[2],
                algo,
                lt_handle.workspace.ptr as *mut c_void,
                self.ws.min(CublasLt::WORKSPACE_BYTES),
                stream as sys::cudaStream_t,
            )
        }
        .map_err(|e| lt_err("cublasLtMatmul", e))
    }
}

impl Drop for CublasGemm {
    fn drop(&mut self) {
        // SAFETY: each descriptor was created once and is destroyed once.
        unsafe {
            for l in self.layouts {
                if !l.is_null() {
                    let _ = lt::destroy_matrix_layout(l);
                }
            }
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}
