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
    mkFloat8e4m3 = 10,
    mkFloat8e5m2 = 11,
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

/// How mkScaledGemm's scales apply to A and B (fp32 scales in device memory).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)]
pub enum mkScaleMode_t {
    /// One scale for all of A, one for all of B (`scaleA[0]`, `scaleB[0]`).
    mkScaleTensor = 0,
    /// One scale per row of A (`scaleA[M]`) and one per row of B (`scaleB[N]`, a column of C).
    mkScaleRowwise = 1,
    /// DeepSeek-V3's blocks: one scale per row of A per 128 of K (`scaleA[K/128][M]`), one per
    /// 128 × 128 block of B (`scaleB[K/128][ceil(N/128)]`), row-major (the memory of torch's
    /// 1x128 and 128x128 scales); K a multiple of 128.
    mkScaleBlock = 2,
}

/// How a `mkScaleMode_t` crosses the C boundary (the header shows it as `mkScaleMode_t`).
pub type RawScaleMode = c_int;

impl mkScaleMode_t {
    pub const ALL: [mkScaleMode_t; 3] =
        [mkScaleMode_t::mkScaleTensor, mkScaleMode_t::mkScaleRowwise, mkScaleMode_t::mkScaleBlock];

    /// The side of a block scale's square (and its row segment of A) in elements.
    pub const BLOCK: usize = 128;

    pub fn from_raw(v: RawScaleMode) -> Result<Self> {
        Self::ALL.iter().copied().find(|m| *m as c_int == v).ok_or_else(|| {
            MkError::invalid_argument(format!(
                "unknown scale mode {v}: expected a mkScaleMode_t value in 0..=2 (mkScaleTensor, mkScaleRowwise, mkScaleBlock)"
            ))
        })
    }

    /// Scales of A and of B this mode reads for an [M, K] A and an [N, K] B (K a multiple
    /// of [`Self::BLOCK`] for block scales).
    pub fn scale_counts(self, m: usize, n: usize, k: usize) -> (usize, usize) {
        match self {
            mkScaleMode_t::mkScaleTensor => (1, 1),
            mkScaleMode_t::mkScaleRowwise => (m, n),
            mkScaleMode_t::mkScaleBlock => (m * (k / Self::BLOCK), n.div_ceil(Self::BLOCK) * (k / Self::BLOCK)),
        }
    }
}

/// Which ops take an element type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Accepted {
    /// mkAllGather: a byte move, whatever the type.
    pub gather: bool,
    /// mkReduceScatter, mkAllReduce: arithmetic in the type (or, for fp8, in float with
    /// one rounding to the type).
    pub reduce: bool,
    /// The same reductions on a communicator that spans nodes, whose node partials are
    /// stored in the element type (a second rounding that fp8 does not take).
    pub reduce_across_nodes: bool,
    /// Every op built on the GEMM engine: mkGemm, the dense fused ops, ring attention and MoE.
    pub gemm: bool,
    /// The scaled fp8 GEMMs' operands: B of mkScaledGemm, A and B of mkAllGatherScaledGemm,
    /// mkScaledGemmReduceScatter and mkScaledGemmAllReduce.
    pub scaled_gemm: bool,
    /// A of mkScaledGemm: the scaled operands' types and e5m2, the gradient of an fp8
    /// backward (dgrad and wgrad multiply an e5m2 gradient by an e4m3 weight or activation).
    pub scaled_gemm_a: bool,
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

const ALL_OPS: Accepted = Accepted {
    gather: true,
    reduce: true,
    reduce_across_nodes: true,
    gemm: true,
    scaled_gemm: false,
    scaled_gemm_a: false,
};
const COLLECTIVES: Accepted = Accepted { gemm: false, ..ALL_OPS };
/// fp8 e4m3: gathered, reduced within a node in float with one rounding (docs/decisions/0075),
/// multiplied by the scaled GEMMs; no unscaled GEMM (an fp8 product needs its scales).
const FP8_SCALED: Accepted = Accepted {
    gather: true,
    reduce: true,
    reduce_across_nodes: false,
    gemm: false,
    scaled_gemm: true,
    scaled_gemm_a: true,
};
/// fp8 e5m2: gathered and reduced as e4m3 is; mkScaledGemm's A only (its kernels multiply
/// e5m2 A by e4m3 B: docs/decisions/0079).
const FP8_GRADIENT: Accepted = Accepted { scaled_gemm: false, ..FP8_SCALED };

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
pub static ELEMENT_TYPES: [ElementType; 12] = [
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
    element(10, "mkFloat8e4m3", "float8e4m3", 1, "__nv_fp8_e4m3", FP8_SCALED),
    element(11, "mkFloat8e5m2", "float8e5m2", 1, "__nv_fp8_e5m2", FP8_GRADIENT),
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
        Self::names_where(|a| a.gemm)
    }

    /// The C names of the types whose `accepted` passes `takes`, joined with "or".
    pub fn names_where(takes: impl Fn(&Accepted) -> bool) -> String {
        let names: Vec<&str> = ELEMENT_TYPES.iter().filter(|t| takes(&t.accepted)).map(|t| t.c_name).collect();
        names.join(" or ")
    }

    /// The type whose kernels of a family without this type's own instances move its bytes
    /// unchanged: the unsigned integer of the same size where this type does not reduce
    /// across nodes (fp8's AllGather across nodes runs mkUint8's kernel), else itself.
    pub fn moved_across_nodes_as(&'static self) -> &'static ElementType {
        if self.accepted.reduce_across_nodes {
            return self;
        }
        ELEMENT_TYPES
            .iter()
            .find(|t| t.accepted.reduce_across_nodes && t.bytes == self.bytes && t.c_name.starts_with("mkUint"))
            .unwrap_or(self)
    }
}

/// How a `mkDataType_t` crosses the C boundary (the header shows it as `mkDataType_t`).
pub type RawDataType = c_int;
/// How a `mkRedOp_t` crosses the C boundary (the header shows it as `mkRedOp_t`).
pub type RawRedOp = c_int;

impl mkDataType_t {
    pub const ALL: [mkDataType_t; 12] = [
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
        mkDataType_t::mkFloat8e4m3,
        mkDataType_t::mkFloat8e5m2,
    ];

    pub fn from_raw(v: RawDataType) -> Result<Self> {
        Self::ALL.iter().copied().find(|t| *t as c_int == v).ok_or_else(|| {
            MkError::invalid_argument(format!(
                "unknown datatype {v}: expected a mkDataType_t value in 0..=11 (mkInt8 .. mkFloat8e5m2)"
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
        let hint = if dtype.element().accepted.scaled_gemm_a {
            " (an fp8 product needs its scales: mkScaledGemm takes them)"
        } else {
            ""
        };
        crate::ensure_arg!(
            dtype.is_gemm_type(),
            "dtype {} is not supported: {op} takes {}{hint}",
            dtype.name(),
            ElementType::gemm_names()
        );
        Ok(dtype)
    }

    /// `v` as a type a collective takes: any type for a byte move (`reduces` false:
    /// mkAllGather), a type with arithmetic for a reduction; else mkInvalidArgument naming `op`.
    pub fn collective_type_from_raw(v: RawDataType, op: &str, reduces: bool) -> Result<Self> {
        let dtype = Self::from_raw(v)?;
        let accepted = dtype.element().accepted;
        crate::ensure_arg!(
            if reduces { accepted.reduce } else { accepted.gather },
            "dtype {} is not supported: {op} reduces only {} (mkAllGather moves every type)",
            dtype.name(),
            ElementType::names_where(|a| a.reduce)
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
        assert_eq!(mkDataType_t::from_raw(10).unwrap(), mkDataType_t::mkFloat8e4m3);
        assert_eq!(mkDataType_t::from_raw(11).unwrap(), mkDataType_t::mkFloat8e5m2);
        for bad in [-1, 12, 13, 1 << 20, c_int::MIN] {
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
    fn fp8_types_are_one_byte_and_taken_only_where_built() {
        use mkDataType_t::*;
        for t in [mkFloat8e4m3, mkFloat8e5m2] {
            assert_eq!(t.size(), 1);
            assert!(!t.is_gemm_type());
            let e = mkDataType_t::gemm_type_from_raw(t as c_int, "mkAllGatherGemm").unwrap_err();
            assert_eq!(e.code, mkResult_t::mkInvalidArgument);
            assert!(e.message.contains("mkAllGatherGemm takes mkFloat16 or mkBfloat16"), "{}", e.message);
            // Gathered and reduced within a node by its own kernels; across nodes, where
            // partials are stored in the type, only moved (by the one-byte unsigned integer's).
            assert_eq!(mkDataType_t::collective_type_from_raw(t as c_int, "mkAllGather", false).unwrap(), t);
            assert_eq!(mkDataType_t::collective_type_from_raw(t as c_int, "mkAllReduce", true).unwrap(), t);
            assert!(!t.element().accepted.reduce_across_nodes);
            assert_eq!(t.element().moved_across_nodes_as().c_name, "mkUint8");
        }
        assert!(ElementType::names_where(|a| a.reduce).ends_with("mkFloat8e4m3 or mkFloat8e5m2"));
        assert_eq!(ElementType::names_where(|a| a.reduce && !a.reduce_across_nodes), "mkFloat8e4m3 or mkFloat8e5m2");
        let e = mkDataType_t::gemm_type_from_raw(mkFloat8e4m3 as c_int, "mkGemm").unwrap_err();
        assert!(e.message.contains("mkScaledGemm"), "e4m3 points at the scaled GEMM: {}", e.message);
        assert_eq!(ElementType::names_where(|a| a.scaled_gemm), "mkFloat8e4m3");
        assert_eq!(ElementType::names_where(|a| a.scaled_gemm_a), "mkFloat8e4m3 or mkFloat8e5m2");
        // Types that reduce across nodes are moved as themselves.
        assert_eq!(mkBfloat16.element().moved_across_nodes_as().c_name, "mkBfloat16");
        assert_eq!(mkInt8.element().moved_across_nodes_as().c_name, "mkInt8");
    }

    #[test]
    fn scale_modes_map_from_their_values_and_reject_unknown() {
        for m in mkScaleMode_t::ALL {
            assert_eq!(mkScaleMode_t::from_raw(m as c_int).unwrap(), m);
        }
        for bad in [-1, 3, 4, c_int::MAX] {
            let e = mkScaleMode_t::from_raw(bad).unwrap_err();
            assert_eq!(e.code, mkResult_t::mkInvalidArgument);
            assert!(e.message.contains(&format!("unknown scale mode {bad}")), "{}", e.message);
        }
        assert_eq!(mkScaleMode_t::mkScaleTensor.scale_counts(7, 9, 256), (1, 1));
        assert_eq!(mkScaleMode_t::mkScaleRowwise.scale_counts(7, 9, 256), (7, 9));
        assert_eq!(mkScaleMode_t::mkScaleBlock.scale_counts(7, 129, 256), (7 * 2, 2 * 2));
    }

    #[test]
    fn redops_map_from_nccl_numbers_and_reject_unknown() {
        assert_eq!(mkRedOp_t::from_raw(4).unwrap(), mkRedOp_t::mkAvg);
        assert!(mkRedOp_t::from_raw(5).is_err());
        assert!(mkRedOp_t::from_raw(-3).is_err());
    }
}
