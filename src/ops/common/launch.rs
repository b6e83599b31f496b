//! The one launch path of the ops. Each op plans in plain Rust (a `*Plan` from the shape,
//! the [`DeviceCaps`] and the tuning) and hands the result here: the grid cap, the TMA
//! descriptors, and one [`KernelLaunch`] that runs a planned kernel, singly or in
//! clusters, and names the op in a failed launch's error.

use crate::comm::Comm;
use crate::cuda::kernels::Kernel;
use crate::cuda::memo::Memo;
use crate::cuda::{self, sys, LaunchConfig};
use crate::error::{MkError, Result};
use crate::types::mkDataType_t;
use std::ffi::c_void;

/// What the planners take from the device: its SM count, and the grid cap a communicator
/// was configured with (MK_MAX_CTAS / mkConfig_t.maxCtas; ranks sharing a GPU set it so
/// that every persistent grid is co-resident).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceCaps {
    pub sms: u32,
    pub max_ctas: Option<u32>,
}

impl DeviceCaps {
    /// The caps of `comm`'s device and configuration.
    pub fn of(comm: &Comm) -> Result<DeviceCaps> {
        let sms = cuda::sm_count(comm.context.device)? as u32;
        Ok(DeviceCaps { sms, max_ctas: comm.config.max_ctas })
    }

    /// The grid of a persistent kernel: one CTA per SM (the fused kernels' shared memory
    /// leaves room for one), within the cap.
    pub fn grid_cap(self) -> u32 {
        self.max_ctas.map_or(self.sms, |c| c.min(self.sms))
    }
}

/// The SM count of the current context's device.
pub fn current_sm_count() -> Result<usize> {
    Ok(cuda::sm_count(cuda::current_device()?)? as usize)
}

/// A 2-D TMA descriptor for a row-major [rows, cols] matrix of `dtype` at `ptr` (any
/// device-visible address, a peer's mapped buffer too), box {box_cols, box_rows}, 128-byte
/// swizzle, zero fill out of bounds. The GEMM engine's maps: A (BM, BK), B (bn, BK), C (64, 64).
/// Needs ptr % 16 == 0 and rows of a multiple of 16 bytes (cols % 8 == 0 for 16-bit types,
/// cols % 16 == 0 for fp8).
pub fn tensor_map(
    ptr: u64,
    dtype: mkDataType_t,
    rows: usize,
    cols: usize,
    box_rows: usize,
    box_cols: usize,
) -> Result<sys::CUtensorMap> {
    tiled_tensor_map(
        ptr,
        dtype,
        &[cols as u64, rows as u64],
        &[dtype.size() as u64 * cols as u64],
        &[box_cols as u32, box_rows as u32],
        "cuTensorMapEncodeTiled",
    )
}

/// A TMA descriptor of any rank (up to 5) over a bf16, fp16 or fp8 tensor at `ptr`: `dims`
/// innermost first, the byte `strides` of dims 1.., one box extent per dim; 128-byte
/// swizzle, 256-byte L2 promotion, zero fill out of bounds. `what` names the caller in errors.
pub fn tiled_tensor_map(
    ptr: u64,
    dtype: mkDataType_t,
    dims: &[u64],
    strides: &[u64],
    boxes: &[u32],
    what: &str,
) -> Result<sys::CUtensorMap> {
    let rank = dims.len();
    if !(1..=5).contains(&rank) || strides.len() + 1 != rank || boxes.len() != rank {
        return Err(MkError::internal(format!(
            "{what}: a tensor map of {rank} dims with {} strides and {} boxes",
            strides.len(),
            boxes.len()
        )));
    }
    // The encoding is a pure function of these inputs: every op encodes the same maps on
    // every call with the same buffers and shapes, so they are remembered.
    static ENCODED: Memo<TensorMapKey, sys::CUtensorMap> = Memo::new(4096);
    let mut key = TensorMapKey { ptr, dtype: dtype as i32, rank: rank as u8, ..TensorMapKey::default() };
    key.dims[..rank].copy_from_slice(dims);
    key.strides[..rank - 1].copy_from_slice(strides);
    key.boxes[..rank].copy_from_slice(boxes);
    ENCODED.get_or_try(key, |key| encode_tiled(key, dtype, what))
}

/// Everything `cuTensorMapEncodeTiled` reads for one of the maps above.
#[derive(Clone, Copy, Default, Hash, PartialEq, Eq)]
struct TensorMapKey {
    ptr: u64,
    dtype: i32,
    rank: u8,
    dims: [u64; 5],
    strides: [u64; 4],
    boxes: [u32; 5],
}

/// Encodes the map `key` describes (`dtype` is its element type, `what` names the caller).
fn encode_tiled(key: &TensorMapKey, dtype: mkDataType_t, what: &str) -> Result<sys::CUtensorMap> {
    let dt = match dtype {
        mkDataType_t::mkFloat16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
        // fp8: the TMA unit moves bytes (zero fill is +0 in e4m3 and e5m2); wgmma reads them.
        mkDataType_t::mkFloat8e4m3 | mkDataType_t::mkFloat8e5m2 => {
            sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8
        }
        _ => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
    };
    let elem = [1u32; 5];
    let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::zeroed();
    // SAFETY: the key's arrays hold at least `rank` dims, boxes and elem entries and rank - 1
    // strides (rank <= 5, checked by tiled_tensor_map); the map is written by the call.
    cuda::check(what, unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            dt,
            key.rank as u32,
            key.ptr as *mut c_void,
            key.dims.as_ptr(),
            key.strides.as_ptr(),
            key.boxes.as_ptr(),
            elem.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    })?;
    // SAFETY: initialised by the successful call.
    Ok(unsafe { map.assume_init() })
}

/// How a kernel's CTAs are grouped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Clusters {
    /// Each CTA on its own.
    None,
    /// Clusters of n CTAs (cluster dims (n,1,1), 2 <= n <= 8); the grid is a multiple of
    /// n, and lowered at launch to as many clusters as the GPU can hold at once (a
    /// persistent grid must be co-resident).
    Of(u32),
}

/// One planned launch: the entry kernel, a one-dimensional grid and block, and the dynamic
/// shared memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelLaunch {
    pub kernel: Kernel,
    pub grid: u32,
    pub block: u32,
    pub smem_bytes: u32,
    pub clusters: Clusters,
}

impl KernelLaunch {
    /// A launch of single CTAs.
    pub fn new(kernel: Kernel, grid: u32, block: u32, smem_bytes: u32) -> KernelLaunch {
        KernelLaunch { kernel, grid, block, smem_bytes, clusters: Clusters::None }
    }

    /// Loads the kernel in the current context (on its first use) and launches it on
    /// `stream`. A failed launch's error says `launching {op}` when `op` is given; a
    /// kernel that cannot be loaded, or a cluster that does not fit, is reported as is.
    ///
    /// # Safety
    /// `params` must match the kernel's signature exactly (one pointer per parameter), and
    /// every pointer the kernel dereferences must be valid for the launch.
    pub unsafe fn launch(&self, stream: sys::CUstream, params: &mut [*mut c_void], op: Option<&str>) -> Result<()> {
        self.launch_loaded(self.kernel.function()?, stream, params, op)
    }

    /// [`launch`](Self::launch) with the kernel's function in the current context already
    /// at hand (`Kernel::function`'s value, which stays valid for the process): a caller
    /// that keeps it skips the lookup.
    ///
    /// # Safety
    /// As for [`launch`](Self::launch); `f` must be `self.kernel` in the current context.
    pub unsafe fn launch_loaded(
        &self,
        f: sys::CUfunction,
        stream: sys::CUstream,
        params: &mut [*mut c_void],
        op: Option<&str>,
    ) -> Result<()> {
        let mut cfg =
            LaunchConfig { grid: (self.grid, 1, 1), block: (self.block, 1, 1), shared_mem_bytes: self.smem_bytes };
        let launched = match self.clusters {
            Clusters::None => cuda::launch(f, cfg, stream, params),
            Clusters::Of(n) => {
                let resident = max_active_clusters(f, self.kernel.name, self.block, self.smem_bytes, n)?;
                cfg.grid.0 = cfg.grid.0.min(n * resident as u32).max(n);
                launch_clusters(f, cfg, n, stream, params)
            }
        };
        launched.map_err(|e| match op {
            Some(op) => e.context(format!("launching {op}")),
            None => e,
        })
    }
}

/// The launch configuration of a kernel in clusters of `n` CTAs (never above the portable
/// 8: no opt-in to larger clusters); `attr` receives the cluster dimension the
/// configuration points at.
fn clusters_config(
    cfg: LaunchConfig,
    n: u32,
    stream: sys::CUstream,
    attr: &mut sys::CUlaunchAttribute,
) -> sys::CUlaunchConfig {
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    attr.value.clusterDim = sys::CUlaunchAttributeValue_union__bindgen_ty_1 { x: n, y: 1, z: 1 };
    sys::CUlaunchConfig {
        gridDimX: cfg.grid.0,
        gridDimY: 1,
        gridDimZ: 1,
        blockDimX: cfg.block.0,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: cfg.shared_mem_bytes,
        hStream: stream,
        attrs: attr,
        numAttrs: 1,
    }
}

/// How many clusters of `n` CTAs of `f` can be resident at once (cached per function,
/// block, shared memory size and cluster size).
fn max_active_clusters(f: sys::CUfunction, name: &str, block: u32, smem: u32, n: u32) -> Result<usize> {
    static RESIDENT: Memo<(usize, u32, u32, u32), usize> = Memo::new(256);
    RESIDENT.get_or_try((f as usize, block, smem, n), |_| {
        // SAFETY: an all-zero attribute is valid plain data; it is filled in by clusters_config.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        let cfg = LaunchConfig { grid: (n, 1, 1), block: (block, 1, 1), shared_mem_bytes: smem };
        let lc = clusters_config(cfg, n, std::ptr::null_mut(), &mut attr);
        let mut c: i32 = 0;
        // SAFETY: lc points at attr, alive for the call.
        cuda::check("cuOccupancyMaxActiveClusters", unsafe { sys::cuOccupancyMaxActiveClusters(&mut c, f, &lc) })?;
        if c < 1 {
            return Err(MkError::internal(format!(
                "no {n}-CTA cluster of {name} fits on this GPU ({smem} bytes of shared memory)"
            )));
        }
        Ok(c as usize)
    })
}

/// Launches a kernel with cluster dims (n,1,1).
///
/// # Safety
/// As for [`cuda::launch`]; `cfg.grid.0` must be a multiple of `n`.
unsafe fn launch_clusters(
    f: sys::CUfunction,
    cfg: LaunchConfig,
    n: u32,
    stream: sys::CUstream,
    params: &mut [*mut c_void],
) -> Result<()> {
    let mut attr: sys::CUlaunchAttribute = std::mem::zeroed();
    let lc = clusters_config(cfg, n, stream, &mut attr);
    cuda::check("cuLaunchKernelEx (clusters)", sys::cuLaunchKernelEx(&lc, f, params.as_mut_ptr(), std::ptr::null_mut()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_grid_is_one_cta_per_sm_within_the_cap() {
        let caps = |sms, max_ctas| DeviceCaps { sms, max_ctas };
        assert_eq!(caps(132, None).grid_cap(), 132);
        assert_eq!(caps(132, Some(32)).grid_cap(), 32);
        assert_eq!(caps(132, Some(1000)).grid_cap(), 132, "never more CTAs than SMs");
        assert_eq!(caps(114, Some(114)).grid_cap(), 114);
        assert_eq!(caps(78, None).grid_cap(), 78);
    }

    #[test]
    fn tensor_map_rank_mismatches_are_errors_before_any_driver_call() {
        let bf16 = mkDataType_t::mkBfloat16;
        for (dims, strides, boxes) in [
            (&[8u64, 8][..], &[][..], &[8u32, 8][..]),
            (&[8, 8], &[16], &[8]),
            (&[], &[], &[]),
            (&[1; 6], &[2; 5], &[1; 6]),
        ] {
            let e = tiled_tensor_map(0, bf16, dims, strides, boxes, "test").unwrap_err();
            assert_eq!(e.code, crate::error::mkResult_t::mkInternalError, "{dims:?} {strides:?} {boxes:?}");
        }
    }
}
