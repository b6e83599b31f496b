//! cuBLAS's grouped GEMM (`cublasGemmGroupedBatchedEx`, cuBLAS 12.5 and later), loaded at
//! run time, as the MoE bench's baseline: one call computes every local expert's GEMM,
//! each with its own row count, as a program without mkernel would. Per expert, row-major
//! C[rows, N] = A[rows, K]·W[N, K]ᵀ, through the column-major product Cᵀ = W·Aᵀ (the TN
//! case, as src/cublaslt.rs), fp32 accumulation. The pointer arrays live on the device,
//! written once when the call is prepared, and the handle has its own workspace, so a call
//! copies nothing and can be captured in a CUDA graph. cuBLAS decides how the groups run
//! (one kernel for all, or one per group); the bench reports what that costs, whichever.

use mkernel::cuda::memory::DeviceBuffer;
use mkernel::cuda::sys::CUstream;
use mkernel::error::{MkError, Result};
use mkernel::types::mkDataType_t;
use std::ffi::{c_int, c_void};

type Handle = *mut c_void;
type Create = unsafe extern "C" fn(*mut Handle) -> c_int;
type Destroy = unsafe extern "C" fn(Handle) -> c_int;
type SetStream = unsafe extern "C" fn(Handle, CUstream) -> c_int;
type SetWorkspace = unsafe extern "C" fn(Handle, *mut c_void, usize) -> c_int;
/// cublasGemmGroupedBatchedEx: per group (host arrays) transa, transb, m, n, k, alpha, lda,
/// ldb, beta, ldc and size; per problem (device arrays) the A, B and C pointers.
type GroupedBatchedEx = unsafe extern "C" fn(
    Handle,
    *const c_int,
    *const c_int,
    *const c_int,
    *const c_int,
    *const c_int,
    *const c_void,
    *const *const c_void,
    c_int,
    *const c_int,
    *const *const c_void,
    c_int,
    *const c_int,
    *const c_void,
    *const *mut c_void,
    c_int,
    *const c_int,
    c_int,
    *const c_int,
    c_int,
) -> c_int;

const CUBLAS_OP_N: c_int = 0;
const CUBLAS_OP_T: c_int = 1;
const CUBLAS_COMPUTE_32F: c_int = 68;
const CUDA_R_16F: c_int = 2;
const CUDA_R_16BF: c_int = 14;

/// A cuBLAS handle on one stream, with its workspace.
pub struct Cublas {
    handle: Handle,
    destroy: Destroy,
    grouped: GroupedBatchedEx,
    _workspace: DeviceBuffer,
    _lib: libloading::Library,
}

fn status(what: &str, r: c_int) -> Result<()> {
    if r == 0 {
        Ok(())
    } else {
        Err(MkError::system(format!("cuBLAS {what} failed: status {r}")))
    }
}

impl Cublas {
    pub const WORKSPACE_BYTES: usize = 64 << 20;

    /// Loads libcublas and makes a handle in the current context, bound to `stream`. Err
    /// where the library or the grouped GEMM (cuBLAS < 12.5) is missing.
    pub fn new(stream: CUstream) -> Result<Cublas> {
        // SAFETY: loading the CUDA toolkit's cuBLAS, whose initialisers have no preconditions.
        let lib = ["libcublas.so.13", "libcublas.so", "libcublas.so.12"]
            .iter()
            .find_map(|&name| unsafe { libloading::Library::new(name) }.ok())
            .ok_or_else(|| MkError::system("libcublas.so not found on the loader path"))?;
        // SAFETY: the documented signatures of these cuBLAS entry points.
        let (create, destroy, set_stream, set_workspace, grouped) = unsafe {
            let sym = |name: &[u8]| {
                lib.get::<*mut c_void>(name).map(|s| *s).map_err(|e| {
                    MkError::system(format!(
                        "cuBLAS: {} missing ({e}; the grouped GEMM needs cuBLAS 12.5 or later)",
                        String::from_utf8_lossy(&name[..name.len() - 1])
                    ))
                })
            };
            (
                std::mem::transmute::<*mut c_void, Create>(sym(b"cublasCreate_v2\0")?),
                std::mem::transmute::<*mut c_void, Destroy>(sym(b"cublasDestroy_v2\0")?),
                std::mem::transmute::<*mut c_void, SetStream>(sym(b"cublasSetStream_v2\0")?),
                std::mem::transmute::<*mut c_void, SetWorkspace>(sym(b"cublasSetWorkspace_v2\0")?),
                std::mem::transmute::<*mut c_void, GroupedBatchedEx>(sym(b"cublasGemmGroupedBatchedEx\0")?),
            )
        };
        let workspace = DeviceBuffer::alloc(Self::WORKSPACE_BYTES)?;
        let mut handle: Handle = std::ptr::null_mut();
        // SAFETY: cuBLAS calls on a handle made here, a live stream and our own workspace.
        unsafe {
            status("cublasCreate", create(&mut handle))?;
            let bound = status("cublasSetStream", set_stream(handle, stream)).and_then(|_| {
                status("cublasSetWorkspace", set_workspace(handle, workspace.ptr as *mut c_void, Self::WORKSPACE_BYTES))
            });
            if let Err(e) = bound {
                destroy(handle);
                return Err(e);
            }
        }
        Ok(Cublas { handle, destroy, grouped, _workspace: workspace, _lib: lib })
    }
}

impl Drop for Cublas {
    fn drop(&mut self) {
        // SAFETY: made in new, destroyed once, before the library is unloaded.
        unsafe { (self.destroy)(self.handle) };
    }
}

/// One expert's GEMM: row-major C[rows, N] = A[rows, K]·W[N, K]ᵀ (device pointers).
#[derive(Clone, Copy, Debug)]
pub struct ExpertGemm {
    pub a: u64,
    pub w: u64,
    pub c: u64,
    pub rows: usize,
}

/// A prepared grouped GEMM over experts that share N and K: one group per expert.
pub struct GroupedGemm {
    dtype: c_int,
    transa: Vec<c_int>,
    transb: Vec<c_int>,
    m: Vec<c_int>,
    n: Vec<c_int>,
    k: Vec<c_int>,
    lda: Vec<c_int>,
    ldb: Vec<c_int>,
    ldc: Vec<c_int>,
    alpha: Vec<f32>,
    beta: Vec<f32>,
    size: Vec<c_int>,
    /// The device's pointer arrays: cuBLAS's A (the weights), B (the rows), C (the outputs).
    pointers: Option<DeviceBuffer>,
}

impl GroupedGemm {
    /// The GEMMs of `experts` (those with rows), N and K each, in `dtype` (bf16 or fp16).
    pub fn new(experts: &[ExpertGemm], n: usize, k: usize, dtype: mkDataType_t) -> Result<GroupedGemm> {
        let dtype = match dtype {
            mkDataType_t::mkBfloat16 => CUDA_R_16BF,
            mkDataType_t::mkFloat16 => CUDA_R_16F,
            other => return Err(MkError::invalid_argument(format!("grouped GEMM baseline: no {}", other.name()))),
        };
        let int =
            |v: usize| c_int::try_from(v).map_err(|_| MkError::invalid_argument("grouped GEMM: a size exceeds int"));
        let used: Vec<&ExpertGemm> = experts.iter().filter(|e| e.rows > 0).collect();
        let g = used.len();
        let mut p = GroupedGemm {
            dtype,
            transa: vec![CUBLAS_OP_T; g],
            transb: vec![CUBLAS_OP_N; g],
            m: vec![int(n)?; g],
            n: used.iter().map(|e| int(e.rows)).collect::<Result<_>>()?,
            k: vec![int(k)?; g],
            lda: vec![int(k)?; g],
            ldb: vec![int(k)?; g],
            ldc: vec![int(n)?; g],
            alpha: vec![1.0; g],
            beta: vec![0.0; g],
            size: vec![1; g],
            pointers: None,
        };
        if g > 0 {
            let words: Vec<u64> =
                used.iter().map(|e| e.w).chain(used.iter().map(|e| e.a)).chain(used.iter().map(|e| e.c)).collect();
            let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
            let buf = DeviceBuffer::alloc(bytes.len())?;
            // SAFETY: buf holds bytes.len() bytes.
            unsafe { cudarc::driver::result::memcpy_htod_sync(buf.ptr, &bytes) }
                .map_err(|e| mkernel::cuda::cuda_err("cuMemcpyHtoD", e))?;
            p.pointers = Some(buf);
        }
        Ok(p)
    }

    /// Enqueues the grouped GEMM on `blas`'s stream.
    pub fn run(&self, blas: &Cublas) -> Result<()> {
        let Some(ptrs) = &self.pointers else { return Ok(()) };
        let g = self.size.len();
        let array = |i: usize| (ptrs.ptr + (i * g * 8) as u64) as *const *const c_void;
        // SAFETY: host arrays of g entries, device pointer arrays of g entries each, every
        // pointer a live device buffer of the stated shape (the caller's contract).
        let r = unsafe {
            (blas.grouped)(
                blas.handle,
                self.transa.as_ptr(),
                self.transb.as_ptr(),
                self.m.as_ptr(),
                self.n.as_ptr(),
                self.k.as_ptr(),
                self.alpha.as_ptr().cast(),
                array(0),
                self.dtype,
                self.lda.as_ptr(),
                array(1),
                self.dtype,
                self.ldb.as_ptr(),
                self.beta.as_ptr().cast(),
                array(2) as *const *mut c_void,
                self.dtype,
                self.ldc.as_ptr(),
                g as c_int,
                self.size.as_ptr(),
                CUBLAS_COMPUTE_32F,
            )
        };
        status("cublasGemmGroupedBatchedEx", r)
    }
}
