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

/// Which ops take an element type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Accepted {
    /// mkAllGather, mkReduceScatter, mkAllReduce (and the NCCL library's collectives).
    pub collectives: bool,
    /// Every op built on the GEMM engine: mkGemm, the dense fused ops, ring attention and MoE.
    pub gemm: bool,
}

/// Everything the library knows of one element type. Byte sizes, argument checks and the
/// kernel a planner launches (the instance of kernels/instances.txt whose CUDA type is
/// `cuda_type`) derive from it, so a new type is a new entry here and its instance lines.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ElementType {
    /// Its value in the C enum (NCCL's numbering).
    pub code: c_int,
    /// Its name in the C header.
    pub c_name: &'static str,
    /// Its name in messages (NCCL's).
    pub name: &'static str,
    pub bytes: usize,
    /// The CUDA type the kernels are instantiated with.
    pub cuda_type: &'static str,
    pub accepted: Accepted,
}

const ALL_OPS: Accepted = Accepted { collectives: true, gemm: true };
const COLLECTIVES: Accepted = Accepted { collectives: true, gemm: false };

const fn element(
    code: c_int,
    c_name: &'static str,
    name: &'static str,
    bytes: usize,
    cuda_type: &'static str,
    accepted: Accepted,
) -> ElementType {
    ElementType { code, c_name, name, bytes, cuda_type, accepted }
}

/// Every element type of `mkDataType_t`, in the order of its values.
pub static ELEMENT_TYPES: [ElementType; 10] = [
    element(0, "mkInt8", "int8", 1, "int8_t", COLLECTIVES),
    element(1, "mkUint8", "uint8", 1, "uint8_t", COLLECTIVES),
    element(2, "mkInt32", "int32", 4, "int32_t", COLLECTIVES),
    element(3, "mkUint32", "uint32", 4, "uint32_t", COLLECTIVES),
    element(4, "mkInt64", "int64", 8, "int64_t", COLLECTIVES),
    element(5, "mkUint64", "uint64", 8, "uint64_t", COLLECTIVES),
    element(6, "mkFloat16", "half", 2, "__half", ALL_OPS),
    element(7, "mkFloat32", "float", 4, "float", COLLECTIVES),
    element(8, "mkFloat64", "double", 8, "double", COLLECTIVES),
    element(9, "mkBfloat16", "bfloat16", 2, "__nv_bfloat16", ALL_OPS),
];

/// What the planners take as an element type: a `mkDataType_t`, or a description itself
/// (a type the C enum does not have yet).
pub trait Element: Copy {
    fn element(self) -> &'static ElementType;
}

impl Element for mkDataType_t {
    fn element(self) -> &'static ElementType {
        &ELEMENT_TYPES[self as usize]
    }
}

impl Element for &'static ElementType {
    fn element(self) -> &'static ElementType {
        self
    }
}

impl ElementType {
    /// Bytes of `count` elements.
    pub fn bytes_of(&self, count: usize) -> usize {
        count * self.bytes
    }

    /// The C names of the types the GEMM-based ops take, for messages: "mkFloat16 or mkBfloat16".
    pub fn gemm_names() -> String {
        let names: Vec<&str> = ELEMENT_TYPES.iter().filter(|t| t.accepted.gemm).map(|t| t.c_name).collect();
        names.join(" or ")
    }
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
        Element::element(self).bytes
    }

    pub fn name(self) -> &'static str {
        Element::element(self).name
    }

    /// Whether the GEMM-based ops take it.
    pub fn is_gemm_type(self) -> bool {
        Element::element(self).accepted.gemm
    }

    /// `v` as a type `op` accepts (one of the GEMM types), else mkInvalidArgument naming `op`.
    pub fn gemm_type_from_raw(v: RawDataType, op: &str) -> Result<Self> {
        let dtype = Self::from_raw(v)?;
        crate::ensure_arg!(
            dtype.is_gemm_type(),
            "dtype {} is not supported: {op} takes {}",
            dtype.name(),
            ElementType::gemm_names()
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
    fn each_type_is_described_at_its_value() {
        for t in mkDataType_t::ALL {
            let e = t.element();
            assert_eq!(e.code, t as c_int);
            assert_eq!(format!("{t:?}"), e.c_name);
        }
        assert_eq!(ElementType::gemm_names(), "mkFloat16 or mkBfloat16");
        let e = mkDataType_t::gemm_type_from_raw(mkDataType_t::mkFloat32 as c_int, "mkGemm").unwrap_err();
        assert!(e.message.contains("mkGemm takes mkFloat16 or mkBfloat16"), "{}", e.message);
    }

    #[test]
    fn redops_map_from_nccl_numbers_and_reject_unknown() {
        assert_eq!(mkRedOp_t::from_raw(4).unwrap(), mkRedOp_t::mkAvg);
        assert!(mkRedOp_t::from_raw(5).is_err());
        assert!(mkRedOp_t::from_raw(-3).is_err());
    }
}
