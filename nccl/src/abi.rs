//! NCCL's C types as nccl.h of NCCL 2.28.9 (the `nvidia-nccl-cu13==2.28.9` wheel) defines
//! them. Enums cross the boundary as `c_int` under NCCL's type names, so a value C passes
//! that no variant names is mapped (never transmuted), and the prototypes cbindgen reads
//! from this crate name NCCL's types (nccl/tests/nccl_header.rs compiles them against the
//! real header).
#![allow(non_camel_case_types, non_upper_case_globals, non_snake_case)]

use std::os::raw::{c_char, c_int, c_uint};

/// `ncclResult_t`: the result of every call.
pub type ncclResult_t = c_int;
pub const ncclSuccess: ncclResult_t = 0;
pub const ncclUnhandledCudaError: ncclResult_t = 1;
pub const ncclSystemError: ncclResult_t = 2;
pub const ncclInternalError: ncclResult_t = 3;
pub const ncclInvalidArgument: ncclResult_t = 4;
pub const ncclInvalidUsage: ncclResult_t = 5;
pub const ncclRemoteError: ncclResult_t = 6;
pub const ncclInProgress: ncclResult_t = 7;
pub const ncclNumResults: ncclResult_t = 8;

/// `ncclDataType_t`; mkernel's `mkDataType_t` numbers its twelve types the same way.
pub type ncclDataType_t = c_int;
pub const ncclFloat8e4m3: ncclDataType_t = 10;
pub const ncclFloat8e5m2: ncclDataType_t = 11;
pub const ncclNumTypes: ncclDataType_t = 12;

/// `ncclRedOp_t`; values from `ncclNumOps` up are operators made by ncclRedOpCreate*.
pub type ncclRedOp_t = c_int;
pub const ncclSum: ncclRedOp_t = 0;
pub const ncclNumOps: ncclRedOp_t = 5;

/// `ncclScalarResidence_t` (ncclRedOpCreatePreMulSum).
pub type ncclScalarResidence_t = c_int;

/// CUDA stream handle (`cudaStream_t`, the same type as the driver's `CUstream`).
pub type cudaStream_t = *mut CUstream_st;
/// The opaque CUDA stream object.
#[repr(C)]
pub struct CUstream_st {
    _private: [u8; 0],
}

/// `NCCL_UNIQUE_ID_BYTES`.
pub const NCCL_UNIQUE_ID_BYTES: usize = 128;

/// `ncclUniqueId`: 128 opaque bytes.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ncclUniqueId {
    pub internal: [c_char; NCCL_UNIQUE_ID_BYTES],
}

/// The opaque communicator object behind `ncclComm_t`.
#[repr(C)]
pub struct ncclComm {
    _private: [u8; 0],
}
/// `ncclComm_t`.
pub type ncclComm_t = *mut ncclComm;

/// The opaque window object behind `ncclWindow_t`.
#[repr(C)]
pub struct ncclWindow_vidmem {
    _private: [u8; 0],
}
/// `ncclWindow_t` (ncclCommWindowRegister).
pub type ncclWindow_t = *mut ncclWindow_vidmem;

/// `NCCL_CONFIG_UNDEF_INT`.
pub const NCCL_CONFIG_UNDEF_INT: c_int = c_int::MIN;
/// `ncclConfig_t.magic` as NCCL_CONFIG_INITIALIZER sets it.
pub const NCCL_CONFIG_MAGIC: c_uint = 0xcafe_beef;

/// `ncclConfig_t` (`struct ncclConfig_v22800`), field for field.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ncclConfig_t {
    pub size: usize,
    pub magic: c_uint,
    pub version: c_uint,
    pub blocking: c_int,
    pub cgaClusterSize: c_int,
    pub minCTAs: c_int,
    pub maxCTAs: c_int,
    pub netName: *const c_char,
    pub splitShare: c_int,
    pub trafficClass: c_int,
    pub commName: *const c_char,
    pub collnetEnable: c_int,
    pub CTAPolicy: c_int,
    pub shrinkShare: c_int,
    pub nvlsCTAs: c_int,
    pub nChannelsPerNetPeer: c_int,
    pub nvlinkCentricSched: c_int,
}

/// `ncclSimInfo_t` (`struct ncclSimInfo_v22200`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ncclSimInfo_t {
    pub size: usize,
    pub magic: c_uint,
    pub version: c_uint,
    pub estimatedTime: f32,
}

/// The NCCL release whose nccl.h this library implements, and the version standalone mode
/// reports: NCCL_VERSION(2, 28, 9).
pub const NCCL_MAJOR: c_int = 2;
pub const NCCL_MINOR: c_int = 28;
pub const NCCL_PATCH: c_int = 9;
pub const NCCL_VERSION_CODE: c_int = NCCL_MAJOR * 10000 + NCCL_MINOR * 100 + NCCL_PATCH;

/// NCCL's name of a data type value, for messages.
pub fn datatype_name(t: ncclDataType_t) -> String {
    const NAMES: [&str; 12] = [
        "ncclInt8",
        "ncclUint8",
        "ncclInt32",
        "ncclUint32",
        "ncclInt64",
        "ncclUint64",
        "ncclFloat16",
        "ncclFloat32",
        "ncclFloat64",
        "ncclBfloat16",
        "ncclFloat8e4m3",
        "ncclFloat8e5m2",
    ];
    usize::try_from(t).ok().and_then(|i| NAMES.get(i)).map_or_else(|| format!("datatype {t}"), |s| s.to_string())
}

/// Bytes of one element of a data type NCCL defines.
pub fn datatype_size(t: ncclDataType_t) -> Option<usize> {
    match t {
        0 | 1 | 10 | 11 => Some(1),
        6 | 9 => Some(2),
        2 | 3 | 7 => Some(4),
        4 | 5 | 8 => Some(8),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    #[test]
    fn config_layout_is_ncclconfig_v22800_on_lp64() {
        // The header check (tests/nccl_header.rs) compares these with the real nccl.h; this
        // pins them where no header is at hand.
        assert_eq!(size_of::<ncclConfig_t>(), 80);
        assert_eq!(offset_of!(ncclConfig_t, blocking), 16);
        assert_eq!(offset_of!(ncclConfig_t, netName), 32);
        assert_eq!(offset_of!(ncclConfig_t, commName), 48);
        assert_eq!(offset_of!(ncclConfig_t, nvlinkCentricSched), 76);
        assert_eq!(size_of::<ncclUniqueId>(), 128);
        assert_eq!(NCCL_VERSION_CODE, 22809);
    }

    #[test]
    fn datatype_sizes_and_names() {
        assert_eq!(datatype_size(9), Some(2));
        assert_eq!(datatype_size(8), Some(8));
        assert_eq!(datatype_size(12), None);
        assert_eq!(datatype_name(10), "ncclFloat8e4m3");
        assert_eq!(datatype_name(-1), "datatype -1");
    }
}
