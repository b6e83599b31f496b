//! `mkConfig_t`: the versioned communicator configuration.

use crate::comm::CommConfig;
use crate::error::{MkError, Result};
use std::os::raw::{c_int, c_longlong, c_uint};
use std::time::Duration;

/// Value of an `int` field of `mkConfig_t` left to the environment or the default.
pub const MK_CONFIG_UNDEF_INT: c_int = c_int::MIN;
/// `mkConfig_t.magic`; set by `MK_CONFIG_INITIALIZER`.
pub const MK_CONFIG_MAGIC: c_uint = 0x6d6b_6366;

/// Communicator configuration for `mkCommInitRankConfig`.
///
/// Always start from `MK_CONFIG_INITIALIZER`, then set the fields you want; fields left
/// at `MK_CONFIG_UNDEF_INT` (or -1 for `workspaceBytes`) take the environment variable or
/// the default. `size`, `magic` and `version` let the library accept structs from older
/// headers: fields beyond `size` count as unset.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
#[allow(non_snake_case)]
pub struct mkConfig_t {
    /// sizeof(mkConfig_t) as the caller compiled it.
    pub size: usize,
    /// Must be MK_CONFIG_MAGIC.
    pub magic: c_uint,
    /// MK_VERSION_CODE of the header the caller compiled against.
    pub version: c_uint,
    /// Bound on every in-kernel wait for a peer, in ms (MK_TIMEOUT_MS).
    pub timeoutMs: c_int,
    /// Bound on each bootstrap step, in ms (MK_BOOTSTRAP_TIMEOUT_MS).
    pub bootstrapTimeoutMs: c_int,
    /// CTAs given to communication roles in fused kernels (MK_COMM_SMS). Unset: each op
    /// plans its own, and the shipped plans give none — the GEMM CTAs move the data
    /// themselves (AllGather+GEMM and the MoE dispatch send from the idle warps of the
    /// producer warpgroup; GEMM+ReduceScatter/AllReduce and the MoE combine reduce or pull
    /// on the consumer warps after their last tile; the MoE dispatch keeps one CTA for the
    /// layout). c >= 1: c dedicated CTAs take those roles instead.
    pub commCtas: c_int,
    /// Cap on any kernel's grid, for several ranks sharing one GPU (MK_MAX_CTAS).
    pub maxCtas: c_int,
    /// Ranks per node; groups ranks into nodes (MK_RANKS_PER_NODE).
    pub ranksPerNode: c_int,
    /// Symmetric workspace per rank allocated at init, in bytes (MK_WORKSPACE_BYTES); -1 unset.
    pub workspaceBytes: c_longlong,
}

/// Fills `*config` with what `MK_CONFIG_INITIALIZER` gives: this library's size, magic and
/// version, and every field unset. For callers that cannot use the macro (cgo, ctypes,
/// Julia's `ccall`): call it, then set the fields you want.
#[no_mangle]
pub unsafe extern "C" fn mkConfigInit(config: *mut mkConfig_t) -> crate::error::mkResult_t {
    super::guard(None, "mkConfigInit", || super::write_out(config, mkConfig_t::initializer(), "config"))
}

impl mkConfig_t {
    /// The value of `MK_CONFIG_INITIALIZER` for this library's header.
    pub fn initializer() -> mkConfig_t {
        mkConfig_t {
            size: std::mem::size_of::<mkConfig_t>(),
            magic: MK_CONFIG_MAGIC,
            version: crate::version_code() as c_uint,
            timeoutMs: MK_CONFIG_UNDEF_INT,
            bootstrapTimeoutMs: MK_CONFIG_UNDEF_INT,
            commCtas: MK_CONFIG_UNDEF_INT,
            maxCtas: MK_CONFIG_UNDEF_INT,
            ranksPerNode: MK_CONFIG_UNDEF_INT,
            workspaceBytes: -1,
        }
    }
}

/// Reads a caller's config over the environment's values.
///
/// # Safety
/// `cfg` must point to at least `cfg.size` readable bytes when non-NULL.
pub unsafe fn resolve(cfg: *const mkConfig_t) -> Result<CommConfig> {
    let mut out = CommConfig::from_env();
    let Some(c) = cfg.as_ref() else { return Ok(out) };
    let header = std::mem::offset_of!(mkConfig_t, timeoutMs);
    if c.magic != MK_CONFIG_MAGIC {
        return Err(MkError::invalid_argument(
            "config->magic is wrong: initialise mkConfig_t with MK_CONFIG_INITIALIZER before setting fields",
        ));
    }
    if c.size < header {
        return Err(MkError::invalid_argument(format!("config->size = {} is smaller than the config header", c.size)));
    }
    // A field counts only when the caller's struct is big enough to hold it.
    let has = |offset: usize, len: usize| offset + len <= c.size;
    let int_field = |offset: usize, v: c_int, name: &str| -> Result<Option<u32>> {
        if !has(offset, 4) || v == MK_CONFIG_UNDEF_INT {
            return Ok(None);
        }
        if v < 0 {
            return Err(MkError::invalid_argument(format!("config->{name} = {v} is negative")));
        }
        Ok(Some(v as u32))
    };
    if let Some(ms) = int_field(std::mem::offset_of!(mkConfig_t, timeoutMs), c.timeoutMs, "timeoutMs")? {
        out.timeout = Duration::from_millis(ms as u64);
    }
    if let Some(ms) = int_field(std::mem::offset_of!(mkConfig_t, bootstrapTimeoutMs), c.bootstrapTimeoutMs, "bootstrapTimeoutMs")? {
        out.bootstrap_timeout = Duration::from_millis(ms as u64);
    }
    if let Some(v) = int_field(std::mem::offset_of!(mkConfig_t, commCtas), c.commCtas, "commCtas")? {
        out.comm_ctas = Some(v);
    }
    if let Some(v) = int_field(std::mem::offset_of!(mkConfig_t, maxCtas), c.maxCtas, "maxCtas")? {
        if v == 0 {
            return Err(MkError::invalid_argument("config->maxCtas must be at least 1"));
        }
        out.max_ctas = Some(v);
    }
    if let Some(v) = int_field(std::mem::offset_of!(mkConfig_t, ranksPerNode), c.ranksPerNode, "ranksPerNode")? {
        if v == 0 {
            return Err(MkError::invalid_argument("config->ranksPerNode must be at least 1"));
        }
        out.ranks_per_node = Some(v);
    }
    if has(std::mem::offset_of!(mkConfig_t, workspaceBytes), 8) && c.workspaceBytes != -1 {
        if c.workspaceBytes < 0 {
            return Err(MkError::invalid_argument(format!("config->workspaceBytes = {} is negative", c.workspaceBytes)));
        }
        out.workspace_bytes = c.workspaceBytes as u64;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn initializer() -> mkConfig_t {
        mkConfig_t::initializer()
    }

    #[test]
    fn config_init_matches_the_initializer_and_rejects_null() {
        let mut c = std::mem::MaybeUninit::<mkConfig_t>::zeroed();
        assert_eq!(unsafe { mkConfigInit(c.as_mut_ptr()) }, crate::error::mkResult_t::mkSuccess);
        let c = unsafe { c.assume_init() };
        assert_eq!(c.size, std::mem::size_of::<mkConfig_t>());
        assert_eq!(c.magic, MK_CONFIG_MAGIC);
        assert_eq!(c.version as i32, crate::version_code());
        assert_eq!((c.timeoutMs, c.maxCtas, c.workspaceBytes), (MK_CONFIG_UNDEF_INT, MK_CONFIG_UNDEF_INT, -1));
        assert_eq!(unsafe { mkConfigInit(std::ptr::null_mut()) }, crate::error::mkResult_t::mkInvalidArgument);
    }

    #[test]
    fn unset_fields_keep_environment_values() {
        let c = initializer();
        assert_eq!(unsafe { resolve(&c) }.unwrap(), CommConfig::from_env());
        assert_eq!(unsafe { resolve(std::ptr::null()) }.unwrap(), CommConfig::from_env());
    }

    #[test]
    fn set_fields_override_and_bad_ones_are_rejected() {
        let mut c = initializer();
        c.timeoutMs = 1234;
        c.maxCtas = 16;
        c.workspaceBytes = 1 << 20;
        let r = unsafe { resolve(&c) }.unwrap();
        assert_eq!(r.timeout, Duration::from_millis(1234));
        assert_eq!(r.max_ctas, Some(16));
        assert_eq!(r.workspace_bytes, 1 << 20);
        c.commCtas = -5;
        assert!(unsafe { resolve(&c) }.is_err());
        let mut bad = initializer();
        bad.magic = 0;
        assert!(unsafe { resolve(&bad) }.unwrap_err().message.contains("MK_CONFIG_INITIALIZER"));
    }

    #[test]
    fn fields_beyond_an_older_size_are_ignored() {
        let mut c = initializer();
        c.workspaceBytes = 4096;
        c.size = std::mem::offset_of!(mkConfig_t, workspaceBytes);
        assert_eq!(unsafe { resolve(&c) }.unwrap().workspace_bytes, CommConfig::from_env().workspace_bytes);
    }
}
