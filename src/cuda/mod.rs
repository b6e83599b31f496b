//! A thin layer over the CUDA driver API (cudarc, loaded at run time): the driver check,
//! the current device's primary context, the embedded kernel modules, and launches.
//!
//! Nothing here links CUDA at build time. Every entry point first calls [`driver`], which
//! turns a missing libcuda into `mkSystemError` instead of cudarc's panic.

pub mod memo;
pub mod memory;
pub mod platform;
pub mod pointer;

use crate::error::{MkError, Result};
use cudarc::driver::result as cu;
pub use cudarc::driver::sys;
use parking_lot::Mutex;
use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::sync::OnceLock;

/// The kernel fatbins compiled by build.rs, one per kernels/*.cu: (file stem, bytes), and
/// one constant per kernel entry point (`kernels::MK_GEMM_BF16_BN256_TMA`, ...), generated
/// from kernels/instances.txt, the list the kernel files instantiate from.
pub mod kernels {
    use crate::error::{MkError, Result};
    use crate::types::ElementType;

    include!(concat!(env!("OUT_DIR"), "/kernel_fatbins.rs"));

    /// A kernel entry point: the kernels/*.cu file (fatbin) that holds it and its name.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct Kernel {
        pub file: &'static str,
        pub name: &'static str,
    }

    impl Kernel {
        /// The loaded function in the current context.
        pub fn function(self) -> crate::error::Result<super::sys::CUfunction> {
            super::function(self.file, self.name)
        }
    }

    /// One line of kernels/instances.txt: the kernel, its entry macro and the macro's
    /// arguments after the kernel name.
    #[derive(Clone, Copy, Debug)]
    pub struct Instance {
        pub kernel: Kernel,
        pub entry: &'static str,
        pub args: &'static [&'static str],
        /// A `tool` line: built only into the tools' fatbin (a `_trace` twin, a test kernel).
        pub tool: bool,
    }

    /// One argument a planner asks of an instance, matched against the instance's text.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum Arg<'a> {
        /// The element type's CUDA type (`ElementType::cuda_type`).
        Element,
        Text(&'a str),
        Int(usize),
        Bool(bool),
    }

    impl Arg<'_> {
        fn matches(self, element: &ElementType, text: &str) -> bool {
            match self {
                Arg::Element => text == element.cuda_type,
                Arg::Text(t) => text == t,
                Arg::Int(n) => text.parse::<usize>() == Ok(n),
                Arg::Bool(b) => text == if b { "true" } else { "false" },
            }
        }
    }

    /// The kernel `op` launches: the instance of entry macro `entry` whose arguments are
    /// `args` for `element`. An element type no instance of `entry` is compiled for is
    /// mkInvalidUsage ("no kernel for this dtype"); a missing tile or variant of a compiled
    /// type is a planner's error (mkInternalError).
    pub fn choose(op: &str, element: &ElementType, entry: &str, args: &[Arg]) -> Result<Kernel> {
        let of_entry = || library_instances_of(entry).iter().copied();
        let matches = |i: &&Instance| {
            i.args.len() == args.len() && args.iter().zip(i.args).all(|(a, text)| a.matches(element, text))
        };
        if let Some(i) = of_entry().find(matches) {
            return Ok(i.kernel);
        }
        let position = args.iter().position(|a| *a == Arg::Element);
        let compiled: Vec<&str> = crate::types::ELEMENT_TYPES
            .iter()
            .filter(|t| of_entry().any(|i| position.is_some_and(|p| i.args.get(p) == Some(&t.cuda_type))))
            .map(|t| t.c_name)
            .collect();
        if !compiled.contains(&element.c_name) {
            return Err(MkError::invalid_usage(format!(
                "{op}: no kernel for this dtype ({}): its kernels are compiled for {}",
                element.c_name,
                if compiled.is_empty() { "no type".to_string() } else { compiled.join(", ") }
            )));
        }
        Err(MkError::internal(format!("{op}: no {entry} kernel for {} with {args:?}", element.c_name)))
    }

    /// The library's (not the tools') instances of entry macro `entry`, in list order. Every
    /// op call chooses its kernel (`choose`): grouped once, a choice scans one entry's few
    /// lines instead of the whole list.
    fn library_instances_of(entry: &str) -> &'static [&'static Instance] {
        use std::sync::OnceLock;
        type ByEntry = Vec<(&'static str, Vec<&'static Instance>)>;
        static BY_ENTRY: OnceLock<ByEntry> = OnceLock::new();
        let by_entry = BY_ENTRY.get_or_init(|| {
            let mut groups: ByEntry = Vec::new();
            for i in INSTANCES.iter().filter(|i| !i.tool) {
                match groups.iter_mut().find(|(e, _)| *e == i.entry) {
                    Some((_, group)) => group.push(i),
                    None => groups.push((i.entry, vec![i])),
                }
            }
            groups
        });
        by_entry.iter().find(|(e, _)| *e == entry).map_or(&[], |(_, group)| group.as_slice())
    }

    /// The `_trace` twin of a library kernel (`mkbench --trace`): the tool instance named
    /// `<name>_trace`, compiled with the trace hooks that the library's kernels compile away
    /// (kernels/common/trace.cuh). Loading it needs `cuda::register_tool_kernels`.
    pub fn trace_twin(kernel: Kernel) -> Result<Kernel> {
        let twin = format!("{}_trace", kernel.name);
        INSTANCES.iter().find(|i| i.tool && i.kernel.name == twin).map(|i| i.kernel).ok_or_else(|| {
            MkError::invalid_usage(format!("{} has no traced twin (kernels/instances.txt)", kernel.name))
        })
    }

    include!(concat!(env!("OUT_DIR"), "/kernel_instances.rs"));
}

/// Converts a driver error into `mkUnhandledCudaError`, naming the call that failed.
pub fn cuda_err(what: &str, e: cudarc::driver::DriverError) -> MkError {
    let name = e.error_name().map(|c| c.to_string_lossy().into_owned()).unwrap_or_else(|_| format!("{:?}", e.0));
    let text = e.error_string().map(|c| c.to_string_lossy().into_owned()).unwrap_or_default();
    MkError::cuda(format!("{what} failed: {name} ({text})"))
}

/// Checks a raw `CUresult`.
pub fn check(what: &str, r: sys::CUresult) -> Result<()> {
    r.result().map_err(|e| cuda_err(what, e))
}

/// Loads libcuda and initialises the driver once; later calls return the same outcome.
pub fn driver() -> Result<()> {
    static INIT: OnceLock<Result<()>> = OnceLock::new();
    INIT.get_or_init(|| {
        // SAFETY: only tries to dlopen the library; never calls into it.
        if !unsafe { sys::is_culib_present() } {
            return Err(MkError::system(
                "the CUDA driver library (libcuda.so.1) could not be loaded: this machine has no NVIDIA driver \
                 or it is not on the loader path (LD_LIBRARY_PATH)",
            ));
        }
        cu::init().map_err(|e| cuda_err("cuInit", e))
    })
    .clone()
}

/// The device of the calling thread's current context, or device 0 when there is none
/// (the same default `cudaGetDevice` reports).
pub fn current_device() -> Result<i32> {
    driver()?;
    match cu::ctx::get_current().map_err(|e| cuda_err("cuCtxGetCurrent", e))? {
        Some(_) => {
            let mut dev: sys::CUdevice = 0;
            // SAFETY: writes one CUdevice.
            check("cuCtxGetDevice", unsafe { sys::cuCtxGetDevice(&mut dev) })?;
            Ok(dev)
        }
        None => Ok(0),
    }
}

pub fn device_count() -> Result<i32> {
    driver()?;
    cu::device::get_count().map_err(|e| cuda_err("cuDeviceGetCount", e))
}

pub fn device_attribute(dev: i32, attr: sys::CUdevice_attribute) -> Result<i32> {
    // SAFETY: reads one attribute of a valid device ordinal.
    unsafe { cu::device::get_attribute(dev, attr) }.map_err(|e| cuda_err("cuDeviceGetAttribute", e))
}

/// The SM count of device `dev`, read from the driver once per device (it cannot change
/// while the process runs): every op call plans with it.
pub fn sm_count(dev: i32) -> Result<i32> {
    static KNOWN: crate::cuda::memo::Memo<i32, i32> = crate::cuda::memo::Memo::new(64);
    KNOWN.get_or_try(dev, |&d| device_attribute(d, sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT))
}

/// A retained primary context of one device; released on drop.
pub struct PrimaryContext {
    pub device: i32,
    pub ctx: sys::CUcontext,
}

// SAFETY: a CUcontext handle may be used from any thread.
unsafe impl Send for PrimaryContext {}
unsafe impl Sync for PrimaryContext {}

impl PrimaryContext {
    pub fn retain(device: i32) -> Result<Self> {
        driver()?;
        let n = device_count()?;
        if device < 0 || device >= n {
            return Err(MkError::invalid_argument(format!(
                "CUDA device {device} does not exist (this machine has {n})"
            )));
        }
        // SAFETY: device is a valid ordinal.
        let ctx = unsafe { cu::primary_ctx::retain(device) }.map_err(|e| cuda_err("cuDevicePrimaryCtxRetain", e))?;
        Ok(PrimaryContext { device, ctx })
    }

    /// Makes this context current until the guard drops, then restores the caller's. Where
    /// it is current already (a torch program's thread, every call after the first), nothing
    /// is pushed or popped: reading the current context is thread-local, while a push and a
    /// pop are two more driver calls per op call.
    pub fn enter(&self) -> Result<ContextGuard> {
        let mut current: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: writes the calling thread's current context (or null).
        check("cuCtxGetCurrent", unsafe { sys::cuCtxGetCurrent(&mut current) })?;
        if current == self.ctx {
            return Ok(ContextGuard { pushed: false });
        }
        // SAFETY: pushes a valid, retained context.
        check("cuCtxPushCurrent", unsafe { sys::cuCtxPushCurrent_v2(self.ctx) })?;
        Ok(ContextGuard { pushed: true })
    }
}

impl Drop for PrimaryContext {
    fn drop(&mut self) {
        // SAFETY: balances the retain in `retain`.
        let _ = unsafe { cu::primary_ctx::release(self.device) };
    }
}

pub struct ContextGuard {
    /// `enter` pushed the context (it was not current), so the drop pops it.
    pushed: bool,
}

impl Drop for ContextGuard {
    fn drop(&mut self) {
        if self.pushed {
            let mut old: sys::CUcontext = std::ptr::null_mut();
            // SAFETY: pops the context pushed by `enter`.
            let _ = unsafe { sys::cuCtxPopCurrent_v2(&mut old) };
        }
    }
}

struct LoadedModule {
    module: sys::CUmodule,
    functions: HashMap<String, sys::CUfunction>,
}

// SAFETY: module and function handles are process-wide and usable from any thread.
unsafe impl Send for LoadedModule {}

/// Modules loaded so far, per (context, kernels/*.cu stem).
static MODULES: Mutex<Option<HashMap<(usize, &'static str), LoadedModule>>> = Mutex::new(None);

/// The fatbins of the `tool` kernels (kernels/instances.txt), once [`register_tool_kernels`]
/// has run. Only mkbench and mktest call it, and nothing the C ABI reaches does, so the
/// linker leaves `kernels::TOOL_FATBINS` out of libmkernel.so.
static TOOL_IMAGES: OnceLock<&'static [(&'static str, &'static [u8])]> = OnceLock::new();

/// Makes the `tool` kernels (e.g. ring attention's `_trace` twins) loadable by [`function`]
/// in this process.
pub fn register_tool_kernels() {
    let _ = TOOL_IMAGES.set(kernels::TOOL_FATBINS);
}

/// The fatbin image named `module`: the library's, or a registered tool fatbin.
fn fatbin_image(module: &str) -> Result<&'static [u8]> {
    let tools: &[(&str, &[u8])] = TOOL_IMAGES.get().copied().unwrap_or(&[]);
    kernels::FATBINS.iter().chain(tools).find(|(name, _)| *name == module).map(|(_, bytes)| *bytes).ok_or_else(|| {
        if module.ends_with("_tools") {
            MkError::internal(format!("{module} holds tool kernels: call cuda::register_tool_kernels first"))
        } else {
            MkError::internal(format!("no embedded kernel module named {module}"))
        }
    })
}

/// Returns a kernel of the embedded module `module` (a kernels/*.cu stem, or `<stem>_tools`
/// once registered) in the current context, loading the module and the kernel's code on first
/// use. Kernels are
/// `extern "C"` so names are plain.
pub fn function(module: &'static str, kernel: &str) -> Result<sys::CUfunction> {
    driver()?;
    let ctx = cu::ctx::get_current()
        .map_err(|e| cuda_err("cuCtxGetCurrent", e))?
        .ok_or_else(|| MkError::internal("no current CUDA context while loading a kernel"))?;
    let mut guard = MODULES.lock();
    let modules = guard.get_or_insert_with(HashMap::new);
    if let Some(f) = modules.get(&(ctx as usize, module)).and_then(|m| m.functions.get(kernel)) {
        return Ok(*f);
    }
    // A first load, maybe inside a capture: see RelaxedCapture.
    let _relaxed = RelaxedCapture::enter()?;
    let loaded = match modules.entry((ctx as usize, module)) {
        Entry::Occupied(entry) => entry.into_mut(),
        Entry::Vacant(entry) => {
            let image = fatbin_image(module)?;
            // The driver wants the image at an address that stays valid; copy it to aligned memory.
            let aligned: Vec<u64> = image
                .chunks(8)
                .map(|c| {
                    let mut b = [0u8; 8];
                    b[..c.len()].copy_from_slice(c);
                    u64::from_le_bytes(b)
                })
                .collect();
            // SAFETY: `aligned` holds a complete fatbin image for the duration of the call.
            let m = unsafe { cu::module::load_data(aligned.as_ptr().cast()) }
                .map_err(|e| cuda_err(&format!("loading kernel module {module} (needs an sm_90 GPU)"), e))?;
            // The cache is keyed by context pointer: keep this device's primary context alive
            // for the life of the process (one extra retain, never released), so a context
            // destroyed when the last communicator lets go of it cannot be recreated at the
            // same address with this cache's handles gone stale (CUDA_ERROR_INVALID_HANDLE).
            let mut dev: sys::CUdevice = 0;
            // SAFETY: writes one CUdevice of the current context.
            if unsafe { sys::cuCtxGetDevice(&mut dev) } == sys::CUresult::CUDA_SUCCESS {
                // SAFETY: retains a valid device's primary context.
                let _ = unsafe { cu::primary_ctx::retain(dev) };
            }
            entry.insert(LoadedModule { module: m, functions: HashMap::new() })
        }
    };
    let cname = CString::new(kernel).map_err(|_| MkError::internal("kernel name contains NUL"))?;
    // SAFETY: the module is loaded in the current context.
    let f = unsafe { cu::module::get_function(loaded.module, cname) }
        .map_err(|e| cuda_err(&format!("looking up kernel {kernel} in module {module}"), e))?;
    // Under lazy loading a function's code is placed at its first attribute read or launch:
    // read one here, inside the relaxed window (this is also what `preload` relies on).
    let static_smem = function_attribute(f, kernel, sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)?;
    allow_all_dynamic_smem(f, kernel, static_smem)?;
    loaded.functions.insert(kernel.to_string(), f);
    Ok(f)
}

fn function_attribute(f: sys::CUfunction, kernel: &str, attribute: sys::CUfunction_attribute) -> Result<i32> {
    let mut value = 0i32;
    // SAFETY: writes one int attribute of a function of the current context.
    check(&format!("cuFuncGetAttribute({kernel})"), unsafe { sys::cuFuncGetAttribute(&mut value, attribute, f) })?;
    Ok(value)
}

/// Lets `f` launch with as much dynamic shared memory as the device gives a block beside
/// the function's static shared memory. Above 48 KiB a function must opt in
/// (cuFuncSetAttribute), and that call may wait for work in flight in the context (copies,
/// reportedly): on a launch path, where ranks sharing a context have kernels waiting for
/// this rank's launch, it is a deadlock hazard. So every function opts in once, when it is
/// loaded (with the communicator, for ranks sharing a context: `ops::preload_all`), as NCCL
/// does at initialisation; a launch never calls it, and one that asks for more than the
/// device has fails in cuLaunchKernel with the driver's error.
fn allow_all_dynamic_smem(f: sys::CUfunction, kernel: &str, static_smem: i32) -> Result<()> {
    let mut dev: sys::CUdevice = 0;
    // SAFETY: writes one CUdevice of the current context.
    check("cuCtxGetDevice", unsafe { sys::cuCtxGetDevice(&mut dev) })?;
    let optin = device_attribute(dev, sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?;
    // The driver refuses more than the per-block limit less the static shared memory.
    let dynamic = (optin - static_smem).max(0);
    if dynamic <= 48 * 1024 {
        return Ok(()); // every function may take this much without opting in
    }
    // SAFETY: sets one attribute of a loaded function.
    check(&format!("cuFuncSetAttribute({kernel}, MAX_DYNAMIC_SHARED_SIZE_BYTES = {dynamic})"), unsafe {
        sys::cuFuncSetAttribute(f, sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, dynamic)
    })
}

/// The calling thread's stream-capture mode set to relaxed until dropped, then restored
/// (cuThreadExchangeStreamCaptureMode, in the push-pop fashion CUDA advises for library
/// code). Loading a kernel module places its code in device memory: one of the potentially
/// unsafe calls (as cuMemAlloc) that CUDA may refuse while this thread captures in global or
/// thread-local mode, or while another thread captures in global mode, invalidating that
/// capture. A load enqueues no work, so the capture stays what the caller enqueued, and an
/// op's first call may be captured like any other.
struct RelaxedCapture(sys::CUstreamCaptureMode);

impl RelaxedCapture {
    fn enter() -> Result<RelaxedCapture> {
        let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: swaps the calling thread's mode with a valid one; restored on drop.
        check("cuThreadExchangeStreamCaptureMode", unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) })?;
        Ok(RelaxedCapture(mode))
    }
}

impl Drop for RelaxedCapture {
    fn drop(&mut self) {
        // SAFETY: puts back the mode `enter` swapped out; a guard lives on one thread's stack.
        let _ = unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut self.0) };
    }
}

/// Loads `kernels` in the current context now (module, function, and its code: `function`
/// reads an attribute on a first load, as NCCL does; `cuFuncLoad` would need a 12.4 driver),
/// instead of at their first launch. Under CUDA's lazy loading (the default)
/// a first launch can wait for the context to go idle; across nodes a kernel in flight
/// waits for its proxy's CUDA copies, which such a load holds up, so the kernels that run
/// across nodes are loaded when the communicator is created.
pub fn preload(kernels: &[kernels::Kernel]) -> Result<()> {
    for k in kernels {
        k.function()?;
    }
    Ok(())
}

/// Loads every kernel of the library (the tools' fatbins aside) in the current context:
/// see [`preload`]. For ranks that share one CUDA context (threads of one process on
/// one device): there a kernel's first load can wait for the context to go idle, that is
/// for a peer's op in flight, which waits for this rank's launch — a deadlock until the
/// timeout. The communicator's creation loads them before any of its ranks can launch.
pub fn preload_all() -> crate::error::Result<()> {
    use kernels::{ALL, FATBINS};
    let kernels: Vec<_> = ALL.iter().copied().filter(|k| FATBINS.iter().any(|(file, _)| *file == k.file)).collect();
    preload(&kernels)
}

/// Loads the kernels that run across nodes (hierarchical collectives, the dense fused ops) in
/// the current context: see [`preload`].
pub fn preload_across_nodes() -> crate::error::Result<()> {
    let files = ["hier_collectives", "ag_gemm", "gemm_reduce"];
    let kernels: Vec<_> = kernels::ALL.iter().copied().filter(|k| files.contains(&k.file)).collect();
    preload(&kernels)
}

/// Why GPU work cannot run here, or None when a CUDA device is usable.
pub fn gpu_unavailable_reason() -> Option<String> {
    if let Err(e) = driver() {
        return Some(e.message);
    }
    match device_count() {
        Ok(0) => Some("no CUDA device".into()),
        Ok(_) => None,
        Err(e) => Some(e.message),
    }
}

/// Launch geometry of one kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchConfig {
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    pub shared_mem_bytes: u32,
}

/// Launches `f` on `stream` with the given parameter pointers (one per kernel parameter).
///
/// # Safety
/// `params` must match the kernel's signature exactly, and every pointer the kernel
/// dereferences must be valid for the launch.
pub unsafe fn launch(
    f: sys::CUfunction,
    cfg: LaunchConfig,
    stream: sys::CUstream,
    params: &mut [*mut c_void],
) -> Result<()> {
    cu::launch_kernel(f, cfg.grid, cfg.block, cfg.shared_mem_bytes, stream, params)
        .map_err(|e| cuda_err("cuLaunchKernel", e))
}
