//! NCCL, loaded at run time with dlopen (libnccl.so.2), as the collectives' baseline when
//! the ranks sit on several GPUs (NCCL refuses two ranks on one GPU). NVLink SHARP /
//! multicast stays off (NCCL_NVLS_ENABLE=0): it can take a shared host's GPUs out of service.
//! The enum numbering (ncclFloat32 = 7, ncclSum = 0, ncclAvg = 4) is mkernel's own.

use mkernel::bootstrap::Bootstrap;
use mkernel::cuda::sys::CUstream;
use mkernel::error::{MkError, Result};
use std::ffi::{c_char, c_int, c_void, CStr};

type NcclComm = *mut c_void;

#[repr(C)]
#[derive(Clone, Copy)]
struct NcclUniqueId {
    internal: [c_char; 128],
}

type GetUniqueId = unsafe extern "C" fn(*mut NcclUniqueId) -> c_int;
type CommInitRank = unsafe extern "C" fn(*mut NcclComm, c_int, NcclUniqueId, c_int) -> c_int;
type AllGather = unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, NcclComm, CUstream) -> c_int;
type Reduce = unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, NcclComm, CUstream) -> c_int;
type CommDestroy = unsafe extern "C" fn(NcclComm) -> c_int;
type GetErrorString = unsafe extern "C" fn(c_int) -> *const c_char;

/// One NCCL communicator over the same ranks as the mkernel one.
pub struct Nccl {
    comm: NcclComm,
    all_gather: AllGather,
    reduce_scatter: Reduce,
    all_reduce: Reduce,
    destroy: CommDestroy,
    error_string: GetErrorString,
}

unsafe fn sym<T>(lib: *mut c_void, name: &str) -> Result<T> {
    let c = std::ffi::CString::new(name).unwrap();
    let p = libc::dlsym(lib, c.as_ptr());
    if p.is_null() {
        return Err(MkError::system(format!("NCCL: symbol {name} not found")));
    }
    Ok(std::mem::transmute_copy::<*mut c_void, T>(&p))
}

impl Nccl {
    /// Loads NCCL and creates a communicator (rank 0 makes the id; the bootstrap carries it).
    /// Err when the library is missing or init fails: the bench then reports no baseline.
    pub fn init(bootstrap: &Bootstrap, rank: usize, nranks: usize) -> Result<Nccl> {
        std::env::set_var("NCCL_NVLS_ENABLE", "0");
        // SAFETY: dlopen/dlsym of a C library with the documented NCCL signatures.
        unsafe {
            let mut lib = std::ptr::null_mut();
            for name in ["libnccl.so.2", "libnccl.so"] {
                let c = std::ffi::CString::new(name).unwrap();
                lib = libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL);
                if !lib.is_null() {
                    break;
                }
            }
            if lib.is_null() {
                return Err(MkError::system("NCCL: libnccl.so.2 not found on the loader path"));
            }
            let get_id: GetUniqueId = sym(lib, "ncclGetUniqueId")?;
            let init: CommInitRank = sym(lib, "ncclCommInitRank")?;
            let error_string: GetErrorString = sym(lib, "ncclGetErrorString")?;
            let mut id = NcclUniqueId { internal: [0; 128] };
            if rank == 0 {
                let r = get_id(&mut id);
                if r != 0 {
                    return Err(MkError::system(format!("ncclGetUniqueId: {r}")));
                }
            }
            let bytes: Vec<u8> = id.internal.iter().map(|&c| c as u8).collect();
            let got = bootstrap.broadcast(&bytes, 0)?;
            for (d, s) in id.internal.iter_mut().zip(got) {
                *d = s as c_char;
            }
            let mut comm: NcclComm = std::ptr::null_mut();
            let r = init(&mut comm, nranks as c_int, id, rank as c_int);
            if r != 0 {
                let msg = CStr::from_ptr(error_string(r)).to_string_lossy().into_owned();
                return Err(MkError::system(format!("ncclCommInitRank: {msg}")));
            }
            Ok(Nccl {
                comm,
                all_gather: sym(lib, "ncclAllGather")?,
                reduce_scatter: sym(lib, "ncclReduceScatter")?,
                all_reduce: sym(lib, "ncclAllReduce")?,
                destroy: sym(lib, "ncclCommDestroy")?,
                error_string,
            })
        }
    }

    /// One call of the collective with mkernel's argument conventions (kind 1 AllGather,
    /// 2 ReduceScatter, 3 AllReduce; count per rank segment as mkernel's ops take it).
    pub fn call(
        &self,
        kind: i32,
        send: u64,
        recv: u64,
        count: usize,
        dtype: i32,
        op: i32,
        stream: CUstream,
    ) -> Result<()> {
        // SAFETY: device buffers sized as for the mkernel call.
        let r = unsafe {
            match kind {
                1 => (self.all_gather)(send as *const c_void, recv as *mut c_void, count, dtype, self.comm, stream),
                2 => (self.reduce_scatter)(
                    send as *const c_void,
                    recv as *mut c_void,
                    count,
                    dtype,
                    op,
                    self.comm,
                    stream,
                ),
                _ => (self.all_reduce)(send as *const c_void, recv as *mut c_void, count, dtype, op, self.comm, stream),
            }
        };
        if r != 0 {
            // SAFETY: NCCL returns a static string.
            let msg = unsafe { CStr::from_ptr((self.error_string)(r)) }.to_string_lossy().into_owned();
            return Err(MkError::system(format!("NCCL collective: {msg}")));
        }
        Ok(())
    }
}

impl Drop for Nccl {
    fn drop(&mut self) {
        // SAFETY: created by init, destroyed once.
        unsafe { (self.destroy)(self.comm) };
    }
}
