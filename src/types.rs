//! Element types and reduction operators, numbered as NCCL numbers them.
//!
//! Values arriving from C are plain integers (`RawDataType`, `RawRedOp`): a C caller can
//! pass any int, and an out-of-range value must become `mkInvalidArgument`, not undefined
//! behaviour, so they are mapped here and never transmuted.

use crate::error::{MkError, Result};
use std::os::raw::c_int;

/// Element type of a buffer. Numbering mirrors `ncclDataType_t`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)]
pub enum mkDataType_t {
    mkInt8 = 0,
    mkUint8 = 1,
    mkInt32 = 2,
    mkUint32 = 3,
    mkInt64 = 4,
    mkUint64 = 5,
    mkFloat16 = 6,
    mkFloat32 = 7,
    mkFloat64 = 8,
    mkBfloat16 = 9,
}

/// Reduction operator. Numbering mirrors `ncclRedOp_t`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)]
pub enum mkRedOp_t {
    mkSum = 0,
    mkProd = 1,
    mkMax = 2,
    mkMin = 3,
    mkAvg = 4,
}

/// How a `mkDataType_t` crosses the C boundary (the header shows it as `mkDataType_t`).
pub type RawDataType = c_int;
/// How a `mkRedOp_t` crosses the C boundary (the header shows it as `mkRedOp_t`).
pub type RawRedOp = c_int;

impl mkDataType_t {
    pub const ALL: [mkDataType_t; 10] = [
        mkDataType_t::mkInt8,
        mkDataType_t::mkUint8,
        mkDataType_t::mkInt32,
        mkDataType_t::mkUint32,
        mkDataType_t::mkInt64,
        mkDataType_t::mkUint64,
        mkDataType_t::mkFloat16,
        mkDataType_t::mkFloat32,
        mkDataType_t::mkFloat64,
        mkDataType_t::mkBfloat16,
    ];

    pub fn from_raw(v: RawDataType) -> Result<Self> {
        Self::ALL.iter().copied().find(|t| *t as c_int == v).ok_or_else(|| {
            MkError::invalid_argument(format!(
                "unknown datatype {v}: expected a mkDataType_t value in 0..=9 (mkInt8 .. mkBfloat16)"
            ))
        })
    }

    /// Size of one element in bytes.
    pub fn size(self) -> usize {
        use mkDataType_t::*;
        match self {
            mkInt8 | mkUint8 => 1,
            mkFloat16 | mkBfloat16 => 2,
            mkInt32 | mkUint32 | mkFloat32 => 4,
            mkInt64 | mkUint64 | mkFloat64 => 8,
        }
    }

    pub fn name(self) -> &'static str {
        use mkDataType_t::*;
        match self {
            mkInt8 => "int8",
            mkUint8 => "uint8",
            mkInt32 => "int32",
            mkUint32 => "uint32",
            mkInt64 => "int64",
            mkUint64 => "uint64",
            mkFloat16 => "half",
            mkFloat32 => "float",
            mkFloat64 => "double",
            mkBfloat16 => "bfloat16",
        }
    }

    /// The 16-bit floating types the GEMM-based ops accept.
    pub fn is_gemm_type(self) -> bool {
        matches!(self, mkDataType_t::mkFloat16 | mkDataType_t::mkBfloat16)
    }

    /// `v` as a type `op` accepts (one of the GEMM types), else mkInvalidArgument naming `op`.
    pub fn gemm_type_from_raw(v: RawDataType, op: &str) -> Result<Self> {
        let dtype = Self::from_raw(v)?;
        crate::ensure_arg!(
            dtype.is_gemm_type(),
            "dtype {} is not supported: {op} takes mkBfloat16 or mkFloat16",
            dtype.name()
        );
        Ok(dtype)
    }
}

impl mkRedOp_t {
    pub const ALL: [mkRedOp_t; 5] =
        [mkRedOp_t::mkSum, mkRedOp_t::mkProd, mkRedOp_t::mkMax, mkRedOp_t::mkMin, mkRedOp_t::mkAvg];

    pub fn from_raw(v: RawRedOp) -> Result<Self> {
        Self::ALL.iter().copied().find(|o| *o as c_int == v).ok_or_else(|| {
            MkError::invalid_argument(format!(
                "unknown reduction op {v}: expected a mkRedOp_t value in 0..=4 (mkSum .. mkAvg)"
            ))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::mkResult_t;

    #[test]
    fn datatypes_map_from_nccl_numbers_and_reject_unknown() {
        assert_eq!(mkDataType_t::from_raw(6).unwrap(), mkDataType_t::mkFloat16);
        assert_eq!(mkDataType_t::from_raw(9).unwrap(), mkDataType_t::mkBfloat16);
        for t in mkDataType_t::ALL {
            assert_eq!(mkDataType_t::from_raw(t as c_int).unwrap(), t);
        }
        for bad in [-1, 10, 11, 1 << 20, c_int::MIN] {
            let e = mkDataType_t::from_raw(bad).unwrap_err();
            assert_eq!(e.code, mkResult_t::mkInvalidArgument);
            assert!(e.message.contains(&bad.to_string()));
        }
    }

    #[test]
    fn redops_map_from_nccl_numbers_and_reject_unknown() {
        assert_eq!(mkRedOp_t::from_raw(4).unwrap(), mkRedOp_t::mkAvg);
        assert!(mkRedOp_t::from_raw(5).is_err());
        assert!(mkRedOp_t::from_raw(-3).is_err());
    }
}
