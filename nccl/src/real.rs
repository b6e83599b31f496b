//! The mode, chosen once at the first call: interpose over a real NCCL when one is found,
//! else standalone on mkernel alone; and the real NCCL's functions, looked up by name.
//!
//! Where the real NCCL comes from, first match wins: `MK_NCCL_MODE=standalone` (none),
//! `MK_NCCL_LIBRARY` (dlopen of that path), the next `ncclCommInitRank` on the loader's
//! search order after this library (`dlsym(RTLD_NEXT)`: the libnccl.so.2 a program linked
//! while this library is preloaded), then `dlopen("libnccl.so.2")`. A candidate that
//! resolves to this library itself (a copy installed as libnccl.so.2) is skipped.
//! `MK_NCCL_MODE=interpose` makes "none found" an error instead of standalone mode.

use crate::abi::*;
use crate::error::{NcclError, Result};
use std::ffi::{c_void, CStr, CString};
use std::os::raw::c_int;
use std::sync::OnceLock;

/// A real NCCL library: where its symbols are looked up, and what it is.
pub struct RealNccl {
    /// dlopen handle, or RTLD_NEXT.
    handle: usize,
    /// The file the symbols come from (dladdr), for messages.
    pub path: String,
    /// Its ncclGetVersion.
    pub version: c_int,
    /// How it was found.
    pub found_by: &'static str,
}

impl RealNccl {
    fn sym(&self, name: &CStr) -> usize {
        // SAFETY: dlsym on a handle from dlopen (kept open for the process) or RTLD_NEXT.
        unsafe { libc::dlsym(self.handle as *mut c_void, name.as_ptr()) as usize }
    }
}

pub enum Mode {
    /// mkernel only; the string says why no real NCCL is used.
    Standalone(String),
    Interpose(RealNccl),
}

impl Mode {
    pub fn describe(&self) -> String {
        match self {
            Mode::Standalone(why) => format!("standalone mode on mkernel alone ({why})"),
            Mode::Interpose(r) => format!(
                "interpose mode over {} (NCCL {}, found by {}): AllReduce, AllGather and ReduceScatter of mkernel's \
                 types and ops run on mkernel, everything else on NCCL",
                r.path,
                version_string(r.version),
                r.found_by
            ),
        }
    }
}

/// "2.28.9" for an NCCL_VERSION_CODE.
pub fn version_string(code: c_int) -> String {
    if code >= 10000 {
        format!("{}.{}.{}", code / 10000, code / 100 % 100, code % 100)
    } else {
        format!("{}.{}.{}", code / 1000, code / 100 % 10, code % 100)
    }
}

static MODE: OnceLock<std::result::Result<Mode, NcclError>> = OnceLock::new();

/// The mode, selected at the first call and reported once at MK_DEBUG=INFO.
pub fn mode() -> Result<&'static Mode> {
    MODE.get_or_init(|| {
        let m = select(std::env::var("MK_NCCL_MODE").ok().as_deref(), std::env::var("MK_NCCL_LIBRARY").ok().as_deref());
        match &m {
            Ok(m) => mkernel::mk_info!(None, "libmkernel-nccl: {}", m.describe()),
            Err(e) => mkernel::mk_warn!(None, "libmkernel-nccl: {}", e.message),
        }
        m
    })
    .as_ref()
    .map_err(Clone::clone)
}

/// The real NCCL in interpose mode.
pub fn real() -> Option<&'static RealNccl> {
    match mode() {
        Ok(Mode::Interpose(r)) => Some(r),
        _ => None,
    }
}

fn dl_error() -> String {
    // SAFETY: dlerror returns NULL or a NUL-terminated string owned by libc.
    let e = unsafe { libc::dlerror() };
    if e.is_null() {
        "unknown dlopen error".into()
    } else {
        unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
    }
}

fn file_of(addr: usize) -> String {
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: dladdr only reads the loader's tables for this address.
    if unsafe { libc::dladdr(addr as *const c_void, &mut info) } != 0 && !info.dli_fname.is_null() {
        unsafe { CStr::from_ptr(info.dli_fname) }.to_string_lossy().into_owned()
    } else {
        "(unknown file)".into()
    }
}

/// Checks a candidate: it must define ncclGetVersion (not ours) and answer it.
fn probe(handle: usize, found_by: &'static str) -> std::result::Result<RealNccl, String> {
    let r = RealNccl { handle, path: String::new(), version: 0, found_by };
    let get_version = r.sym(c"ncclGetVersion");
    if get_version == 0 {
        return Err("it has no ncclGetVersion".into());
    }
    if get_version == crate::exports::ncclGetVersion as *const () as usize {
        return Err("it is this library (libmkernel-nccl) itself".into());
    }
    let mut version: c_int = 0;
    // SAFETY: ncclGetVersion(int*) as nccl.h declares it.
    let f: unsafe extern "C" fn(*mut c_int) -> ncclResult_t = unsafe { std::mem::transmute(get_version) };
    if unsafe { f(&mut version) } != ncclSuccess {
        return Err("its ncclGetVersion failed".into());
    }
    Ok(RealNccl { path: file_of(get_version), version, ..r })
}

fn open(path: &str) -> std::result::Result<usize, String> {
    let c = CString::new(path).map_err(|_| "the path holds a NUL byte".to_string())?;
    // SAFETY: dlopen of a path; the handle is kept for the life of the process.
    let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if h.is_null() {
        Err(dl_error())
    } else {
        Ok(h as usize)
    }
}

/// Selects the mode from MK_NCCL_MODE and MK_NCCL_LIBRARY (see the module comment).
pub fn select(mode: Option<&str>, library: Option<&str>) -> Result<Mode> {
    let mode = mode.map(|m| m.trim().to_ascii_lowercase()).filter(|m| !m.is_empty());
    match mode.as_deref() {
        None | Some("auto") | Some("interpose") | Some("standalone") => {}
        Some(other) => {
            return Err(NcclError::invalid_usage(format!(
                "MK_NCCL_MODE={other:?} is not one of auto, interpose, standalone"
            )))
        }
    }
    if mode.as_deref() == Some("standalone") {
        return Ok(Mode::Standalone("MK_NCCL_MODE=standalone".into()));
    }
    let mut tried = Vec::new();
    if let Some(path) = library.filter(|p| !p.trim().is_empty()) {
        // An explicit library that cannot be used is an error, never a silent fallback.
        let real = open(path).and_then(|h| probe(h, "MK_NCCL_LIBRARY"));
        return real
            .map(Mode::Interpose)
            .map_err(|e| NcclError::system(format!("MK_NCCL_LIBRARY={path} cannot be used as the real NCCL: {e}")));
    }
    match probe(libc::RTLD_NEXT as usize, "the loader's search order after libmkernel-nccl (RTLD_NEXT)") {
        Ok(r) => return Ok(Mode::Interpose(r)),
        Err(e) => tried.push(format!("no NCCL loaded after this library ({e})")),
    }
    match open("libnccl.so.2").and_then(|h| probe(h, "dlopen(\"libnccl.so.2\")")) {
        Ok(r) => return Ok(Mode::Interpose(r)),
        Err(e) => tried.push(format!("libnccl.so.2 not usable ({e})")),
    }
    if mode.as_deref() == Some("interpose") {
        return Err(NcclError::system(format!(
            "MK_NCCL_MODE=interpose but no real NCCL was found: {}",
            tried.join("; ")
        )));
    }
    Ok(Mode::Standalone(tried.join("; ")))
}

/// Declares, per real NCCL function, its exact C type and a getter that looks it up once.
macro_rules! real_functions {
    ($($name:ident : fn($($arg:ty),*) -> $ret:ty;)*) => {
        /// The real NCCL's function types, as nccl.h declares them.
        #[allow(non_camel_case_types)]
        pub mod types {
            use super::*;
            $(pub type $name = unsafe extern "C" fn($($arg),*) -> $ret;)*
        }
        $(
            /// The real NCCL's function of this name; `ncclInvalidUsage` when it has none
            /// (an older NCCL) or there is no real NCCL.
            #[allow(non_snake_case)]
            pub fn $name() -> Result<types::$name> {
                static ADDR: OnceLock<usize> = OnceLock::new();
                let real = real().ok_or_else(|| NcclError::internal("no real NCCL in standalone mode"))?;
                let addr = *ADDR.get_or_init(|| {
                    real.sym(&CString::new(stringify!($name)).expect("no NUL"))
                });
                if addr == 0 {
                    return Err(NcclError::invalid_usage(format!(
                        "{} (NCCL {}) has no {}", real.path, version_string(real.version), stringify!($name)
                    )));
                }
                // SAFETY: the symbol of this name in a real NCCL has the type nccl.h declares.
                Ok(unsafe { std::mem::transmute::<usize, types::$name>(addr) })
            }
        )*
    };
}

use std::os::raw::c_char;

real_functions! {
    ncclMemAlloc: fn(*mut *mut c_void, usize) -> ncclResult_t;
    ncclMemFree: fn(*mut c_void) -> ncclResult_t;
    ncclGetVersion: fn(*mut c_int) -> ncclResult_t;
    ncclGetUniqueId: fn(*mut ncclUniqueId) -> ncclResult_t;
    ncclCommInitRankConfig: fn(*mut ncclComm_t, c_int, ncclUniqueId, c_int, *mut ncclConfig_t) -> ncclResult_t;
    ncclCommInitRank: fn(*mut ncclComm_t, c_int, ncclUniqueId, c_int) -> ncclResult_t;
    ncclCommInitAll: fn(*mut ncclComm_t, c_int, *const c_int) -> ncclResult_t;
    ncclCommFinalize: fn(ncclComm_t) -> ncclResult_t;
    ncclCommDestroy: fn(ncclComm_t) -> ncclResult_t;
    ncclCommAbort: fn(ncclComm_t) -> ncclResult_t;
    ncclCommRevoke: fn(ncclComm_t, c_int) -> ncclResult_t;
    ncclCommSplit: fn(ncclComm_t, c_int, c_int, *mut ncclComm_t, *mut ncclConfig_t) -> ncclResult_t;
    ncclCommShrink: fn(ncclComm_t, *mut c_int, c_int, *mut ncclComm_t, *mut ncclConfig_t, c_int) -> ncclResult_t;
    ncclCommInitRankScalable: fn(*mut ncclComm_t, c_int, c_int, c_int, *mut ncclUniqueId, *mut ncclConfig_t) -> ncclResult_t;
    ncclGetErrorString: fn(ncclResult_t) -> *const c_char;
    ncclGetLastError: fn(ncclComm_t) -> *const c_char;
    ncclResetDebugInit: fn() -> ();
    ncclCommGetAsyncError: fn(ncclComm_t, *mut ncclResult_t) -> ncclResult_t;
    ncclCommCount: fn(ncclComm_t, *mut c_int) -> ncclResult_t;
    ncclCommCuDevice: fn(ncclComm_t, *mut c_int) -> ncclResult_t;
    ncclCommUserRank: fn(ncclComm_t, *mut c_int) -> ncclResult_t;
    ncclCommRegister: fn(ncclComm_t, *mut c_void, usize, *mut *mut c_void) -> ncclResult_t;
    ncclCommDeregister: fn(ncclComm_t, *mut c_void) -> ncclResult_t;
    ncclCommWindowRegister: fn(ncclComm_t, *mut c_void, usize, *mut ncclWindow_t, c_int) -> ncclResult_t;
    ncclCommWindowDeregister: fn(ncclComm_t, ncclWindow_t) -> ncclResult_t;
    ncclRedOpCreatePreMulSum: fn(*mut ncclRedOp_t, *mut c_void, ncclDataType_t, ncclScalarResidence_t, ncclComm_t) -> ncclResult_t;
    ncclRedOpDestroy: fn(ncclRedOp_t, ncclComm_t) -> ncclResult_t;
    ncclReduce: fn(*const c_void, *mut c_void, usize, ncclDataType_t, ncclRedOp_t, c_int, ncclComm_t, cudaStream_t) -> ncclResult_t;
    ncclBcast: fn(*mut c_void, usize, ncclDataType_t, c_int, ncclComm_t, cudaStream_t) -> ncclResult_t;
    ncclBroadcast: fn(*const c_void, *mut c_void, usize, ncclDataType_t, c_int, ncclComm_t, cudaStream_t) -> ncclResult_t;
    ncclAllReduce: fn(*const c_void, *mut c_void, usize, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t) -> ncclResult_t;
    ncclReduceScatter: fn(*const c_void, *mut c_void, usize, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t) -> ncclResult_t;
    ncclAllGather: fn(*const c_void, *mut c_void, usize, ncclDataType_t, ncclComm_t, cudaStream_t) -> ncclResult_t;
    ncclAlltoAll: fn(*const c_void, *mut c_void, usize, ncclDataType_t, ncclComm_t, cudaStream_t) -> ncclResult_t;
    ncclGather: fn(*const c_void, *mut c_void, usize, ncclDataType_t, c_int, ncclComm_t, cudaStream_t) -> ncclResult_t;
    ncclScatter: fn(*const c_void, *mut c_void, usize, ncclDataType_t, c_int, ncclComm_t, cudaStream_t) -> ncclResult_t;
    ncclSend: fn(*const c_void, usize, ncclDataType_t, c_int, ncclComm_t, cudaStream_t) -> ncclResult_t;
    ncclRecv: fn(*mut c_void, usize, ncclDataType_t, c_int, ncclComm_t, cudaStream_t) -> ncclResult_t;
    ncclGroupStart: fn() -> ncclResult_t;
    ncclGroupEnd: fn() -> ncclResult_t;
    ncclGroupSimulateEnd: fn(*mut ncclSimInfo_t) -> ncclResult_t;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_strings_follow_nccl_version() {
        assert_eq!(version_string(22809), "2.28.9");
        assert_eq!(version_string(2708), "2.7.8");
    }

    #[test]
    fn mode_selection_without_any_nccl() {
        // This test binary links no NCCL, and the CI machine has no libnccl.so.2.
        assert!(matches!(select(Some("standalone"), Some("/nonexistent")), Ok(Mode::Standalone(_))));
        let e = select(None, Some("/nonexistent/libnccl.so.2")).err().unwrap();
        assert_eq!(e.code, ncclSystemError);
        assert!(e.message.contains("MK_NCCL_LIBRARY=/nonexistent/libnccl.so.2 cannot be used"), "{}", e.message);
        assert_eq!(select(Some("fast"), None).err().unwrap().code, ncclInvalidUsage);
        if open("libnccl.so.2").is_err() {
            match select(None, None).unwrap() {
                Mode::Standalone(why) => assert!(why.contains("libnccl.so.2 not usable"), "{why}"),
                Mode::Interpose(_) => panic!("interpose without an NCCL"),
            }
            let e = select(Some("interpose"), None).err().unwrap();
            assert!(e.message.contains("MK_NCCL_MODE=interpose but no real NCCL was found"), "{}", e.message);
        }
        // A library without NCCL's symbols is refused by name.
        let e = select(None, Some("libc.so.6")).err().unwrap();
        assert!(e.message.contains("it has no ncclGetVersion"), "{}", e.message);
    }
}
