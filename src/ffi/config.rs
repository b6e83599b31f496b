//! `mkConfig_t`: the versioned communicator configuration.

use super::versioned::VersionedStruct;
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
/// Always start from `MK_CONFIG_INITIALIZER` (or mkConfigInit), then set the fields you
/// want; fields left at `MK_CONFIG_UNDEF_INT` (or -1 for `workspaceBytes`) take the
/// environment variable or the default.
///
/// `size`, `magic` and `version` let one library accept structs from other headers of its
/// major version. The library reads `size` first, then only the first `size` bytes:
/// - a smaller struct (an older header): the fields it lacks count as unset;
/// - a larger struct (a newer header, at most 1024 bytes): accepted when every field beyond
///   this library's struct is unset (each 4-byte word 0, MK_CONFIG_UNDEF_INT or -1), else
///   mkInvalidArgument names the first one set (this library cannot honour it);
/// - `size` below 16 (the three header fields), a wrong `magic`, `version` 0 or of another
///   major version than the library's: mkInvalidArgument.
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
    /// layout). c >= 1: c dedicated CTAs take those roles instead. Every rank must give the
    /// same value (creation fails with mkInvalidUsage on every rank otherwise).
    pub commCtas: c_int,
    /// Cap on any kernel's grid, for several ranks sharing one GPU (MK_MAX_CTAS). Ranks may
    /// differ: the communicator takes the smallest cap any rank set.
    pub maxCtas: c_int,
    /// Ranks per node; groups ranks into nodes (MK_RANKS_PER_NODE). Every rank must give the
    /// same value (creation fails with mkInvalidUsage on every rank otherwise).
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

/// How a caller's `mkConfig_t` of any version is read (`versioned`): its fields after
/// `size` as (offset, bytes), in order; an unset word of a newer field is 0,
/// MK_CONFIG_UNDEF_INT or -1.
const CONFIG: VersionedStruct = VersionedStruct {
    arg: "config",
    type_name: "mkConfig_t",
    initializer: "MK_CONFIG_INITIALIZER",
    init_fn: "mkConfigInit",
    magic: MK_CONFIG_MAGIC,
    fields: &[
        (std::mem::offset_of!(mkConfig_t, magic), 4),
        (std::mem::offset_of!(mkConfig_t, version), 4),
        (std::mem::offset_of!(mkConfig_t, timeoutMs), 4),
        (std::mem::offset_of!(mkConfig_t, bootstrapTimeoutMs), 4),
        (std::mem::offset_of!(mkConfig_t, commCtas), 4),
        (std::mem::offset_of!(mkConfig_t, maxCtas), 4),
        (std::mem::offset_of!(mkConfig_t, ranksPerNode), 4),
        (std::mem::offset_of!(mkConfig_t, workspaceBytes), 8),
    ],
    unset_word: |w| w == 0 || w == MK_CONFIG_UNDEF_INT as u32 || w == u32::MAX,
};
const _: () = assert!(std::mem::offset_of!(mkConfig_t, timeoutMs) == super::versioned::HEADER_BYTES);

/// Reads a caller's `mkConfig_t` of any version (`versioned`) into a struct whose fields
/// start unset.
///
/// # Safety
/// `cfg` must be non-NULL and point to at least `cfg->size` readable bytes.
pub unsafe fn read_config(cfg: *const mkConfig_t) -> Result<mkConfig_t> {
    CONFIG.read(cfg, mkConfig_t::initializer())
}

/// Reads a caller's config over the environment's values.
///
/// # Safety
/// `cfg`, when non-NULL, must point to at least `cfg->size` readable bytes.
pub unsafe fn resolve(cfg: *const mkConfig_t) -> Result<CommConfig> {
    let mut out = CommConfig::from_env();
    if cfg.is_null() {
        return Ok(out);
    }
    let c = read_config(cfg)?;
    let int_field = |v: c_int, name: &str| -> Result<Option<u32>> {
        if v == MK_CONFIG_UNDEF_INT {
            return Ok(None);
        }
        if v < 0 {
            return Err(MkError::invalid_argument(format!("config->{name} = {v} is negative")));
        }
        Ok(Some(v as u32))
    };
    if let Some(ms) = int_field(c.timeoutMs, "timeoutMs")? {
        out.timeout = Duration::from_millis(ms as u64);
    }
    if let Some(ms) = int_field(c.bootstrapTimeoutMs, "bootstrapTimeoutMs")? {
        out.bootstrap_timeout = Duration::from_millis(ms as u64);
    }
    if let Some(v) = int_field(c.commCtas, "commCtas")? {
        out.comm_ctas = Some(v);
    }
    if let Some(v) = int_field(c.maxCtas, "maxCtas")? {
        if v == 0 {
            return Err(MkError::invalid_argument("config->maxCtas must be at least 1"));
        }
        out.max_ctas = Some(v);
    }
    if let Some(v) = int_field(c.ranksPerNode, "ranksPerNode")? {
        if v == 0 {
            return Err(MkError::invalid_argument("config->ranksPerNode must be at least 1"));
        }
        out.ranks_per_node = Some(v);
    }
    if c.workspaceBytes != -1 {
        if c.workspaceBytes < 0 {
            return Err(MkError::invalid_argument(format!(
                "config->workspaceBytes = {} is negative",
                c.workspaceBytes
            )));
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

    /// A page of readable memory followed by an inaccessible one: bytes placed at the end of
    /// the first are the last the process may read there.
    struct GuardedPage {
        base: *mut u8,
        page: usize,
    }

    impl GuardedPage {
        fn new() -> Self {
            // SAFETY: a fresh anonymous mapping of two pages; the second is made inaccessible.
            unsafe {
                let page = libc::sysconf(libc::_SC_PAGESIZE) as usize;
                let base = libc::mmap(
                    std::ptr::null_mut(),
                    2 * page,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                );
                assert_ne!(base, libc::MAP_FAILED);
                assert_eq!(libc::mprotect(base.cast::<u8>().add(page).cast(), page, libc::PROT_NONE), 0);
                GuardedPage { base: base.cast(), page }
            }
        }

        /// Copies the first `len` bytes of `c` to the end of the readable page.
        fn place(&self, c: &mkConfig_t, len: usize) -> *const mkConfig_t {
            // SAFETY: len <= size_of::<mkConfig_t>() bytes inside the readable page.
            unsafe {
                let at = self.base.add(self.page - len);
                std::ptr::copy_nonoverlapping((c as *const mkConfig_t).cast::<u8>(), at, len);
                at.cast()
            }
        }
    }

    impl Drop for GuardedPage {
        fn drop(&mut self) {
            // SAFETY: the mapping made in `new`.
            unsafe { libc::munmap(self.base.cast(), 2 * self.page) };
        }
    }

    #[test]
    fn an_older_smaller_struct_at_the_end_of_a_page_is_read_within_its_size() {
        let guarded = GuardedPage::new();
        // A header with only timeoutMs and bootstrapTimeoutMs (24 bytes, 8-byte aligned at the page end).
        let len = std::mem::offset_of!(mkConfig_t, commCtas);
        let mut c = initializer();
        c.size = len;
        c.timeoutMs = 777;
        c.bootstrapTimeoutMs = 888;
        let r = unsafe { resolve(guarded.place(&c, len)) }.unwrap();
        assert_eq!((r.timeout, r.bootstrap_timeout), (Duration::from_millis(777), Duration::from_millis(888)));
        let env = CommConfig::from_env();
        assert_eq!((r.max_ctas, r.workspace_bytes), (env.max_ctas, env.workspace_bytes), "absent fields are unset");
        // The header alone, and a field cut by the size (counts as absent).
        c.size = 16;
        assert_eq!(unsafe { resolve(guarded.place(&c, 16)) }.unwrap().timeout, env.timeout);
        c.size = 18;
        assert_eq!(unsafe { resolve(guarded.place(&c, 18)) }.unwrap().timeout, env.timeout);
        // A size too small for the header is refused after reading only `size` itself.
        c.size = 8;
        assert!(unsafe { resolve(guarded.place(&c, 8)) }.unwrap_err().message.contains("config->size = 8"));
    }

    #[test]
    fn version_zero_and_other_majors_are_refused() {
        let mut c = initializer();
        c.version = 0;
        assert!(unsafe { resolve(&c) }.unwrap_err().message.contains("config->version = 0"));
        c.version = (crate::version_code() + 10000) as c_uint;
        let e = unsafe { resolve(&c) }.unwrap_err();
        assert_eq!(e.code, crate::error::mkResult_t::mkInvalidArgument);
        assert!(e.message.contains("major version"), "{}", e.message);
        // A later minor or patch of the same major is fine.
        c.version = (crate::version_code() / 10000 * 10000 + 99 * 100 + 7) as c_uint;
        assert!(unsafe { resolve(&c) }.is_ok());
    }

    #[test]
    fn a_newer_larger_struct_is_accepted_only_with_its_new_fields_unset() {
        #[repr(C)]
        struct Newer {
            base: mkConfig_t,
            future_int: c_int,
            future_flag: c_int,
            future_bytes: c_longlong,
        }
        let fresh = || Newer {
            base: mkConfig_t { size: std::mem::size_of::<Newer>(), ..initializer() },
            future_int: MK_CONFIG_UNDEF_INT,
            future_flag: 0,
            future_bytes: -1,
        };
        let n = fresh();
        let mut expected = CommConfig::from_env();
        expected.max_ctas = Some(3);
        let mut with_base = fresh();
        with_base.base.maxCtas = 3;
        assert_eq!(unsafe { resolve((&with_base as *const Newer).cast()) }.unwrap(), expected);
        assert!(unsafe { resolve((&n as *const Newer).cast()) }.is_ok());
        let mut set = fresh();
        set.future_flag = 1;
        let e = unsafe { resolve((&set as *const Newer).cast()) }.unwrap_err().message;
        assert!(
            e.contains("newer header")
                && e.contains(&format!("byte offset {}", std::mem::offset_of!(Newer, future_flag))),
            "{e}"
        );
        let mut huge = initializer();
        huge.size = 1 << 40;
        assert!(unsafe { resolve(&huge) }.unwrap_err().message.contains("larger than any mkConfig_t"));
    }

    #[test]
    fn fields_beyond_an_older_size_are_ignored() {
        let mut c = initializer();
        c.workspaceBytes = 4096;
        c.size = std::mem::offset_of!(mkConfig_t, workspaceBytes);
        assert_eq!(unsafe { resolve(&c) }.unwrap().workspace_bytes, CommConfig::from_env().workspace_bytes);
    }
}
