//! The proxy ring: kernels post 32-byte `ProxyCommand`s into memory the host can read,
//! and one proxy thread per communicator carries them out through a `Transport`.
//!
//! Protocol (the device side is kernels/common/proxy.cuh; `HostProducer` here is the same
//! protocol for host threads, used by the tests):
//! 1. claim: `ticket = atomic fetch-add(head, 1)`;
//! 2. wait for room: until `tail + capacity > ticket` (the slot's previous command was
//!    taken), bounded by the timeout and cut short when the proxy reports an error;
//! 3. write the body of slot `ticket % capacity`, then its `header` (kind | peer << 8)
//!    last with a release store: a nonzero header publishes the slot.
//!
//! The proxy takes slots strictly in ticket order: it reads slot `tail % capacity`'s header
//! with acquire; nonzero means the command is complete, so it copies it out, stores 0 to
//! the header and advances `tail` (release), freeing the slot. It then posts the put and,
//! as the transport reports puts done, advances `completed` over the finished prefix of
//! tickets. On a failure it writes the error code to `control.error` (producers stop
//! waiting), keeps the first error for `Proxy::error` (the communicator turns it into
//! `mkCommGetAsyncError`'s answer), and keeps draining the ring without executing it, so
//! producers never wait on a proxy that has given up.

use super::{PostId, PutRequest, Transport};
use crate::error::{mkResult_t, MkError, Result};
use crate::kernel_abi::{
    ProxyCommand, ProxyRingControl, ProxyRingView, MK_PROXY_KIND_EMPTY, MK_PROXY_KIND_PUT, MK_PROXY_KIND_SIGNAL,
    MK_PROXY_MAX_PEER, MK_PROXY_NO_SIGNAL, MK_PROXY_PEER_SHIFT,
};
use parking_lot::Mutex;
use std::collections::{HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

const _: () = assert!(std::mem::size_of::<ProxyCommand>() == 32);
const _: () = assert!(std::mem::size_of::<ProxyRingControl>() == 192);
const _: () = assert!(std::mem::offset_of!(ProxyRingControl, completed) == 64);
const _: () = assert!(std::mem::offset_of!(ProxyRingControl, error) == 128);

/// Bytes before the command array: the control block, then (for host producers) the head
/// counter on its own cache line.
const CONTROL_BYTES: usize = 256;
const HOST_HEAD_OFFSET: usize = 192;

/// Bytes of ring memory for `capacity` commands.
pub fn ring_bytes(capacity: u32) -> usize {
    CONTROL_BYTES + capacity as usize * std::mem::size_of::<ProxyCommand>()
}

/// Memory that holds the ring: readable and writable by the host at `host_ptr`, and by the
/// producers at `device_address` (the same address when the producers are host threads).
/// Zeroed when created, at least 256-byte aligned.
pub trait RingMemory: Send + Sync {
    fn host_ptr(&self) -> *mut u8;
    fn device_address(&self) -> u64;
    fn bytes(&self) -> usize;
}

/// Plain aligned host memory: rings whose producers are host threads (tests).
pub struct HostRingMemory {
    ptr: *mut u8,
    layout: std::alloc::Layout,
}

// SAFETY: the allocation is owned and only accessed through atomics or by the ring's
// single-writer protocol; the raw pointer is what keeps the type from being Send/Sync.
unsafe impl Send for HostRingMemory {}
// SAFETY: as above.
unsafe impl Sync for HostRingMemory {}

impl HostRingMemory {
    pub fn new(bytes: usize) -> Result<HostRingMemory> {
        let layout = std::alloc::Layout::from_size_align(bytes.max(CONTROL_BYTES), 4096)
            .map_err(|e| MkError::invalid_argument(format!("ring of {bytes} bytes: {e}")))?;
        // SAFETY: the layout has a nonzero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(MkError::system(format!("cannot allocate a {bytes}-byte proxy ring")));
        }
        Ok(HostRingMemory { ptr, layout })
    }
}

impl RingMemory for HostRingMemory {
    fn host_ptr(&self) -> *mut u8 {
        self.ptr
    }
    fn device_address(&self) -> u64 {
        self.ptr as u64
    }
    fn bytes(&self) -> usize {
        self.layout.size()
    }
}

impl Drop for HostRingMemory {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) };
    }
}

/// Page-locked host memory mapped into the current CUDA context's address space
/// (cuMemHostAlloc with DEVICEMAP): what a GPU's producers write. Needs a current context.
pub struct PinnedRingMemory {
    host: *mut u8,
    device: u64,
    bytes: usize,
}

// SAFETY: as for HostRingMemory; the pinned allocation is process-wide.
unsafe impl Send for PinnedRingMemory {}
// SAFETY: as above.
unsafe impl Sync for PinnedRingMemory {}

impl PinnedRingMemory {
    pub fn new(bytes: usize) -> Result<PinnedRingMemory> {
        use cudarc::driver::sys;
        crate::cuda::driver()?;
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        let mut host: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: cuMemHostAlloc writes the new allocation's address into `host`.
        let r = unsafe { sys::cuMemHostAlloc(&mut host, bytes, flags) };
        crate::cuda::check(&format!("cuMemHostAlloc({bytes} bytes, DEVICEMAP) for the proxy ring"), r)?;
        let mut device: sys::CUdeviceptr = 0;
        // SAFETY: `host` is a DEVICEMAP allocation of the current context.
        let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, host, 0) };
        if let Err(e) = crate::cuda::check("cuMemHostGetDevicePointer for the proxy ring", r) {
            // SAFETY: allocated above, freed once.
            unsafe { sys::cuMemFreeHost(host) };
            return Err(e);
        }
        // SAFETY: `bytes` writable bytes at `host`; the ring protocol needs them zeroed.
        unsafe { std::ptr::write_bytes(host.cast::<u8>(), 0, bytes) };
        Ok(PinnedRingMemory { host: host.cast(), device, bytes })
    }
}

impl RingMemory for PinnedRingMemory {
    fn host_ptr(&self) -> *mut u8 {
        self.host
    }
    fn device_address(&self) -> u64 {
        self.device
    }
    fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for PinnedRingMemory {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemHostAlloc in `new`, freed once.
        unsafe { cudarc::driver::sys::cuMemFreeHost(self.host.cast()) };
    }
}

/// A command ring in some `RingMemory`.
pub struct ProxyRing {
    memory: Box<dyn RingMemory>,
    /// The device-memory head counter, when the ring made it (`on_device`).
    _device_head: Option<crate::cuda::memory::DeviceBuffer>,
    capacity: u32,
    /// Producers' ticket counter as they address it.
    head_address: u64,
    timeout: Duration,
}

impl ProxyRing {
    /// A ring of `capacity` slots (a power of two, 2..=2^20) in `memory`. `head_address`
    /// is where producers find the ticket counter (a zeroed u64 in device memory for GPU
    /// producers); None puts it in the ring memory itself, for host producers.
    /// `timeout` bounds every producer wait (MK_TIMEOUT_MS).
    pub fn new(
        memory: Box<dyn RingMemory>,
        capacity: u32,
        head_address: Option<u64>,
        timeout: Duration,
    ) -> Result<ProxyRing> {
        if !capacity.is_power_of_two() || !(2..=1 << 20).contains(&capacity) {
            return Err(MkError::invalid_argument(format!(
                "proxy ring capacity {capacity} must be a power of two in [2, 2^20]"
            )));
        }
        if memory.bytes() < ring_bytes(capacity) || memory.host_ptr() as usize % 256 != 0 {
            return Err(MkError::invalid_argument(format!(
                "proxy ring memory of {} bytes is too small or not 256-byte aligned for {capacity} slots ({} bytes)",
                memory.bytes(),
                ring_bytes(capacity)
            )));
        }
        let head_address = head_address.unwrap_or(memory.device_address() + HOST_HEAD_OFFSET as u64);
        Ok(ProxyRing { memory, _device_head: None, capacity, head_address, timeout })
    }

    /// A ring for the current CUDA context's kernels: commands and control in pinned,
    /// device-mapped memory, the ticket counter in (zeroed) device memory.
    pub fn on_device(capacity: u32, timeout: Duration) -> Result<ProxyRing> {
        let head = crate::cuda::memory::DeviceBuffer::alloc(8)?;
        // SAFETY: the 8 bytes are this allocation.
        unsafe { cudarc::driver::result::memset_d8_sync(head.ptr, 0, 8) }
            .map_err(|e| crate::cuda::cuda_err("cuMemsetD8 (proxy ring head)", e))?;
        let memory = PinnedRingMemory::new(ring_bytes(capacity.min(1 << 20)))?;
        let mut ring = Self::new(Box::new(memory), capacity, Some(head.ptr), timeout)?;
        ring._device_head = Some(head);
        Ok(ring)
    }

    /// A ring in plain host memory for host-thread producers.
    pub fn in_host_memory(capacity: u32, timeout: Duration) -> Result<ProxyRing> {
        let memory = HostRingMemory::new(ring_bytes(capacity.min(1 << 20)))?;
        Self::new(Box::new(memory), capacity, None, timeout)
    }

    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    /// What a kernel is given to post commands (see kernels/common/proxy.cuh).
    pub fn view(&self) -> ProxyRingView {
        ProxyRingView {
            commands: self.memory.device_address() + CONTROL_BYTES as u64,
            control: self.memory.device_address(),
            head: self.head_address,
            capacity: self.capacity,
            reserved: 0,
            timeout_ns: self.timeout.as_nanos().min(u64::MAX as u128) as u64,
        }
    }

    fn control_word(&self, offset: usize) -> &AtomicU64 {
        // SAFETY: offset is a field of the ProxyRingControl at the start of the memory,
        // 8-byte aligned, and the memory lives as long as self.
        unsafe { &*(self.memory.host_ptr().add(offset) as *const AtomicU64) }
    }

    fn tail_counter(&self) -> &AtomicU64 {
        self.control_word(std::mem::offset_of!(ProxyRingControl, tail))
    }

    fn completed_counter(&self) -> &AtomicU64 {
        self.control_word(std::mem::offset_of!(ProxyRingControl, completed))
    }

    fn error_word(&self) -> &AtomicI32 {
        // SAFETY: as control_word; `error` is a 4-byte aligned u32 field.
        unsafe { &*(self.memory.host_ptr().add(std::mem::offset_of!(ProxyRingControl, error)) as *const AtomicI32) }
    }

    /// The host-side head counter; only meaningful when the ring was made for host producers.
    fn host_head(&self) -> Option<&AtomicU64> {
        (self.head_address == self.memory.device_address() + HOST_HEAD_OFFSET as u64)
            .then(|| self.control_word(HOST_HEAD_OFFSET))
    }

    fn slot(&self, ticket: u64) -> *mut ProxyCommand {
        let index = (ticket & (self.capacity as u64 - 1)) as usize;
        // SAFETY: index < capacity and the memory holds `capacity` commands after the control.
        unsafe { self.memory.host_ptr().add(CONTROL_BYTES).cast::<ProxyCommand>().add(index) }
    }

    fn header_of(&self, ticket: u64) -> &AtomicU32 {
        // SAFETY: `header` is the 4-byte aligned first field of a live slot.
        unsafe { &*(self.slot(ticket) as *const AtomicU32) }
    }

    /// Slots freed by the proxy so far.
    pub fn tail(&self) -> u64 {
        self.tail_counter().load(Ordering::Acquire)
    }

    /// Commands completed so far (every ticket below it is done).
    pub fn completed(&self) -> u64 {
        self.completed_counter().load(Ordering::Acquire)
    }

    /// The proxy's error code as producers see it (`mkSuccess` while healthy).
    pub fn error_code(&self) -> mkResult_t {
        mkResult_t::from_i32(self.error_word().load(Ordering::Acquire))
    }

    /// A producer for host threads; None when the head counter is not in host memory.
    pub fn host_producer(self: &Arc<Self>) -> Option<HostProducer> {
        self.host_head().map(|_| HostProducer { ring: Arc::clone(self) })
    }
}

/// Builds a command's header word.
pub fn command_header(kind: u32, peer: u32) -> u32 {
    kind | (peer << MK_PROXY_PEER_SHIFT)
}

/// A put command (`signal` None: no signal write).
pub fn put_command(
    peer: u32,
    src_offset: u64,
    dst_offset: u64,
    bytes: u32,
    signal: Option<(u32, u32)>,
) -> ProxyCommand {
    let (signal_id, signal_value) = signal.unwrap_or((MK_PROXY_NO_SIGNAL, 0));
    ProxyCommand {
        header: command_header(MK_PROXY_KIND_PUT, peer),
        bytes,
        src_offset,
        dst_offset,
        signal_id,
        signal_value,
    }
}

/// Decodes a command taken from the ring into a transport request. A malformed command is
/// a kernel bug: `mkInternalError`.
pub fn decode_command(cmd: &ProxyCommand) -> Result<PutRequest> {
    let kind = cmd.header & 0xff;
    let peer = cmd.header >> MK_PROXY_PEER_SHIFT;
    let signal = (cmd.signal_id != MK_PROXY_NO_SIGNAL).then_some((cmd.signal_id, cmd.signal_value as u64));
    match kind {
        MK_PROXY_KIND_PUT => {}
        MK_PROXY_KIND_SIGNAL if signal.is_some() && cmd.bytes == 0 => {}
        _ => {
            return Err(MkError::internal(format!(
                "malformed proxy command {cmd:?} (kind {kind}): a kernel posted a bad command"
            )))
        }
    }
    debug_assert!(peer <= MK_PROXY_MAX_PEER);
    Ok(PutRequest {
        peer: peer as usize,
        src_offset: cmd.src_offset,
        dst_offset: cmd.dst_offset,
        bytes: cmd.bytes as u64,
        signal,
    })
}

/// Posts commands from host threads with exactly the device's protocol (proxy.cuh).
pub struct HostProducer {
    ring: Arc<ProxyRing>,
}

impl HostProducer {
    /// Posts one command and returns its ticket. `mkTimeout` when no slot frees within the
    /// ring's timeout (the proxy is stuck or gone); the proxy's own error when it failed.
    /// A producer that times out leaves its claimed slot unpublished, so the ring (like the
    /// communicator) is unusable afterwards, as on the device.
    pub fn post(&self, cmd: &ProxyCommand) -> Result<u64> {
        let ring = &*self.ring;
        if cmd.header & 0xff == MK_PROXY_KIND_EMPTY {
            return Err(MkError::invalid_argument("a proxy command needs a nonzero kind"));
        }
        // A failed proxy takes no more work: refuse before claiming a ticket.
        let code = ring.error_code();
        if code != mkResult_t::mkSuccess {
            return Err(MkError::new(code, "the proxy failed earlier (see mkCommGetAsyncError)"));
        }
        let head = ring.host_head().expect("host producers exist only for host-head rings");
        let ticket = head.fetch_add(1, Ordering::Relaxed);
        self.wait("a free proxy ring slot", || ticket < ring.tail() + ring.capacity as u64)?;
        let slot = ring.slot(ticket);
        // SAFETY: this producer owns the slot: it holds the ticket and the proxy has freed
        // the slot's previous command (tail + capacity > ticket); header stays 0 until the
        // release store below, so the proxy does not read the body meanwhile.
        unsafe {
            std::ptr::addr_of_mut!((*slot).bytes).write_volatile(cmd.bytes);
            std::ptr::addr_of_mut!((*slot).src_offset).write_volatile(cmd.src_offset);
            std::ptr::addr_of_mut!((*slot).dst_offset).write_volatile(cmd.dst_offset);
            std::ptr::addr_of_mut!((*slot).signal_id).write_volatile(cmd.signal_id);
            std::ptr::addr_of_mut!((*slot).signal_value).write_volatile(cmd.signal_value);
        }
        ring.header_of(ticket).store(cmd.header, Ordering::Release);
        Ok(ticket)
    }

    /// Waits until the command with `ticket` (and every earlier one) has completed.
    pub fn wait_complete(&self, ticket: u64) -> Result<()> {
        self.wait("proxy command completion", || self.ring.completed() > ticket)
    }

    fn wait(&self, what: &str, mut ready: impl FnMut() -> bool) -> Result<()> {
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            if ready() {
                return Ok(());
            }
            match self.ring.error_code() {
                mkResult_t::mkSuccess => {}
                code => {
                    return Err(MkError::new(
                        code,
                        format!("waiting for {what}: the proxy failed (see mkCommGetAsyncError)"),
                    ))
                }
            }
            if start.elapsed() >= self.ring.timeout {
                return Err(MkError::timeout(format!(
                    "waited for {what} longer than MK_TIMEOUT_MS={} ms (ring tail {}, completed {}: is the proxy running?)",
                    self.ring.timeout.as_millis(),
                    self.ring.tail(),
                    self.ring.completed()
                )));
            }
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else if start.elapsed() < PROXY_STAY_AWAKE {
                std::thread::yield_now();
            } else {
                std::thread::sleep(PROXY_IDLE_SLEEP);
            }
        }
    }
}

/// How long the proxy keeps polling without sleeping after its last command or completion.
/// Sleeping between the commands of one collective adds a sleep (20 µs asked, ~70 µs
/// with the default 50 µs timer slack) to every network hop.
pub const PROXY_STAY_AWAKE: Duration = Duration::from_millis(5);
/// The idle proxy's (and a waiting host producer's) sleep per poll.
pub const PROXY_IDLE_SLEEP: Duration = Duration::from_micros(20);

/// Makes the calling thread's short sleeps last what they ask for: Linux adds up to the
/// timer slack (50 µs by default) to every sleep, which would make a 20 µs poll ~70 µs.
pub fn quick_sleeps() {
    // SAFETY: PR_SET_TIMERSLACK changes only the calling thread's slack (in ns).
    unsafe {
        libc::prctl(
            libc::PR_SET_TIMERSLACK,
            1000 as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
        )
    };
}

/// Settings of a proxy thread.
#[derive(Clone, Debug)]
pub struct ProxyOptions {
    /// This rank, for log messages.
    pub rank: usize,
    /// Puts outstanding in the transport at most; the proxy stops taking commands at this
    /// many (EFA's send queue fails well before its nominal depth: stay well under it).
    pub max_in_flight: usize,
    /// Bound on waiting for an outstanding put to complete (MK_TIMEOUT_MS).
    pub timeout: Duration,
    /// CPUs to run the proxy thread on (`cpus_near_cuda_device`): polling the ring and
    /// touching the NIC from the GPU's NUMA node. None: wherever the scheduler likes.
    pub cpus: Option<Vec<usize>>,
}

impl ProxyOptions {
    pub fn new(rank: usize, timeout: Duration) -> ProxyOptions {
        ProxyOptions { rank, max_in_flight: 64, timeout, cpus: None }
    }
}

/// Parses a Linux CPU list ("0-3,8,10-11"); None when malformed.
pub fn parse_cpu_list(list: &str) -> Option<Vec<usize>> {
    let mut cpus = Vec::new();
    for part in list.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b) = (a.trim().parse::<usize>().ok()?, b.trim().parse::<usize>().ok()?);
                if a > b || b - a > 1 << 16 {
                    return None;
                }
                cpus.extend(a..=b);
            }
            None => cpus.push(part.trim().parse().ok()?),
        }
    }
    Some(cpus)
}

/// The CPUs of the NUMA node closest to a PCI device ("0000:3b:00.0", any case), from sysfs.
pub fn cpus_near_pci_device(bus_id: &str) -> Option<Vec<usize>> {
    let path = format!("/sys/bus/pci/devices/{}/local_cpulist", bus_id.trim().to_ascii_lowercase());
    parse_cpu_list(&std::fs::read_to_string(path).ok()?).filter(|c| !c.is_empty())
}

/// The CPUs closest to CUDA device `device` (where the proxy thread should run, as mKernel
/// pins its proxy to the GPU's NUMA node); None when unknown.
pub fn cpus_near_cuda_device(device: i32) -> Option<Vec<usize>> {
    crate::cuda::driver().ok()?;
    let mut bus = [0 as std::ffi::c_char; 32];
    // SAFETY: writes a NUL-terminated bus id of at most 32 bytes.
    let r = unsafe { cudarc::driver::sys::cuDeviceGetPCIBusId(bus.as_mut_ptr(), bus.len() as i32, device) };
    crate::cuda::check("cuDeviceGetPCIBusId", r).ok()?;
    // SAFETY: NUL-terminated by the driver within the buffer.
    let id = unsafe { std::ffi::CStr::from_ptr(bus.as_ptr()) }.to_string_lossy().into_owned();
    cpus_near_pci_device(&id)
}

/// Restricts the calling thread to `cpus` (intersected with what it may use already, so
/// taskset and cgroup limits win); returns false when nothing was changed.
fn pin_current_thread(cpus: &[usize]) -> bool {
    // SAFETY: cpu_set_t is plain data; the calls read and write only the set given.
    unsafe {
        let mut allowed: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut allowed) != 0 {
            return false;
        }
        let mut wanted: libc::cpu_set_t = std::mem::zeroed();
        let mut any = false;
        for &c in cpus.iter().filter(|&&c| c < libc::CPU_SETSIZE as usize) {
            if libc::CPU_ISSET(c, &allowed) {
                libc::CPU_SET(c, &mut wanted);
                any = true;
            }
        }
        any && libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &wanted) == 0
    }
}

/// The first error of a proxy, shared with its thread.
#[derive(Default)]
struct ErrorSlot(Mutex<Option<MkError>>);

impl ErrorSlot {
    fn record(&self, e: MkError) -> bool {
        let mut slot = self.0.lock();
        if slot.is_none() {
            *slot = Some(e);
            true
        } else {
            false
        }
    }
}

/// A running proxy thread. Dropping it stops the thread and closes the transport.
pub struct Proxy {
    ring: Arc<ProxyRing>,
    stop: Arc<AtomicBool>,
    aborting: Arc<AtomicBool>,
    error: Arc<ErrorSlot>,
    thread: Option<JoinHandle<Box<dyn Transport>>>,
}

impl Proxy {
    /// Starts the thread draining `ring` into `transport` (already connected).
    pub fn start(ring: Arc<ProxyRing>, transport: Box<dyn Transport>, options: ProxyOptions) -> Result<Proxy> {
        let stop = Arc::new(AtomicBool::new(false));
        let aborting = Arc::new(AtomicBool::new(false));
        let error = Arc::new(ErrorSlot::default());
        let worker = Worker {
            ring: Arc::clone(&ring),
            transport,
            stop: Arc::clone(&stop),
            aborting: Arc::clone(&aborting),
            error: Arc::clone(&error),
            in_flight: VecDeque::new(),
            done: HashSet::new(),
            completed_ids: Vec::new(),
            last_progress: Instant::now(),
            failed: false,
            options,
        };
        let thread = std::thread::Builder::new()
            .name(format!("mk-proxy-{}", worker.options.rank))
            .spawn(move || worker.run())
            .map_err(|e| MkError::system(format!("cannot start the proxy thread: {e}")))?;
        Ok(Proxy { ring, stop, aborting, error, thread: Some(thread) })
    }

    /// The first failure (transport, timeout, malformed command), for
    /// `Comm::record_async_error` → `mkCommGetAsyncError`.
    pub fn error(&self) -> Option<MkError> {
        self.error.0.lock().clone()
    }

    pub fn ring(&self) -> &Arc<ProxyRing> {
        &self.ring
    }

    /// Stops the thread after it has executed every command published so far, waits for
    /// their completion (bounded), and closes the transport. Returns the proxy's first error.
    pub fn stop(mut self) -> Result<()> {
        self.shutdown(false)
    }

    /// Stops at once (mkCommAbort): producers see `mkInvalidUsage` in the error word,
    /// outstanding puts are dropped and the connections cut without waiting for peers.
    pub fn abort(mut self) {
        self.aborting.store(true, Ordering::Release);
        let _ = self.shutdown(true);
    }

    fn shutdown(&mut self, abort: bool) -> Result<()> {
        let Some(thread) = self.thread.take() else { return Ok(()) };
        self.stop.store(true, Ordering::Release);
        match thread.join() {
            Ok(mut transport) if abort => transport.abort(),
            Ok(mut transport) => {
                if let Err(e) = transport.close() {
                    self.error.record(e.context("closing the inter-node transport"));
                }
            }
            Err(_) => {
                self.error.record(MkError::internal("the proxy thread panicked"));
            }
        }
        match self.error() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        let _ = self.shutdown(false);
    }
}

struct Worker {
    ring: Arc<ProxyRing>,
    transport: Box<dyn Transport>,
    stop: Arc<AtomicBool>,
    aborting: Arc<AtomicBool>,
    error: Arc<ErrorSlot>,
    /// (ticket, post id) of puts handed to the transport, in ticket order.
    in_flight: VecDeque<(u64, PostId)>,
    /// Post ids reported done but not yet at the front of `in_flight`.
    done: HashSet<PostId>,
    completed_ids: Vec<PostId>,
    last_progress: Instant,
    failed: bool,
    options: ProxyOptions,
}

impl Worker {
    fn run(mut self) -> Box<dyn Transport> {
        if let Some(cpus) = &self.options.cpus {
            if !pin_current_thread(cpus) {
                crate::mk_info!(Some(self.options.rank), "proxy thread not pinned: none of CPUs {cpus:?} is available");
            }
        }
        quick_sleeps();
        let mut idle_rounds = 0u32;
        let mut last_busy = Instant::now();
        loop {
            if self.aborting.load(Ordering::Acquire) {
                self.fail(MkError::invalid_usage("the communicator was aborted"));
                break;
            }
            let stopping = self.stop.load(Ordering::Acquire);
            let took = self.take_published();
            let finished = self.poll_transport();
            if stopping && took == 0 && (self.in_flight.is_empty() || self.failed) {
                break;
            }
            if took == 0 && finished == 0 {
                idle_rounds = idle_rounds.saturating_add(1);
                if idle_rounds < 256 {
                    std::hint::spin_loop();
                } else if !self.in_flight.is_empty() || last_busy.elapsed() < PROXY_STAY_AWAKE {
                    // Transfers in progress, or a collective's next command due any moment
                    // (a step's grant and put are a network round trip apart): stay
                    // responsive, but let the transport's own threads have the core.
                    std::thread::yield_now();
                } else {
                    // Idle: ~20 µs of latency added to the first command after a pause,
                    // instead of a core burnt per communicator.
                    std::thread::sleep(PROXY_IDLE_SLEEP);
                }
            } else {
                idle_rounds = 0;
                last_busy = Instant::now();
            }
        }
        self.transport
    }

    /// Takes every published command (up to the in-flight cap), frees the slots, and posts
    /// the puts. Returns how many commands it took.
    fn take_published(&mut self) -> usize {
        let ring = Arc::clone(&self.ring);
        let mut tail = ring.tail_counter().load(Ordering::Relaxed);
        let mut taken = 0;
        while self.failed || self.in_flight.len() < self.options.max_in_flight {
            let header = ring.header_of(tail).load(Ordering::Acquire);
            if header == MK_PROXY_KIND_EMPTY {
                break;
            }
            // SAFETY: the acquire load of a nonzero header makes the producer's body writes
            // visible; the producer does not touch the slot again until tail passes it.
            let cmd = unsafe { std::ptr::read_volatile(ring.slot(tail)) };
            ring.header_of(tail).store(MK_PROXY_KIND_EMPTY, Ordering::Relaxed);
            let ticket = tail;
            tail += 1;
            // Release: the header's reset is visible before a producer can claim the slot.
            ring.tail_counter().store(tail, Ordering::Release);
            taken += 1;
            if self.failed {
                // Drain without executing: producers keep finding free slots, and any
                // waiter sees the error word rather than a timeout.
                continue;
            }
            let posted = decode_command(&cmd).and_then(|put| {
                self.transport.post_put(&put).map_err(|e| {
                    if e.code == mkResult_t::mkInvalidArgument {
                        MkError::internal(format!("a kernel posted an out-of-range proxy command: {}", e.message))
                    } else {
                        e
                    }
                })
            });
            match posted {
                Ok(id) => {
                    if self.in_flight.is_empty() {
                        self.last_progress = Instant::now();
                    }
                    self.in_flight.push_back((ticket, id));
                }
                Err(e) => self
                    .fail(e.context(format!("proxy command {ticket} (to rank {})", cmd.header >> MK_PROXY_PEER_SHIFT))),
            }
        }
        taken
    }

    /// Collects completions and advances `completed` over the finished prefix. Returns how
    /// many commands it completed.
    fn poll_transport(&mut self) -> usize {
        if self.failed {
            return 0;
        }
        self.completed_ids.clear();
        if let Err(e) = self.transport.poll(&mut self.completed_ids) {
            self.fail(e);
            return 0;
        }
        let finished = self.advance_completed();
        if finished > 0 {
            self.last_progress = Instant::now();
        } else if !self.in_flight.is_empty() && self.last_progress.elapsed() >= self.options.timeout {
            let (ticket, _) = self.in_flight[0];
            // The ring's state in the message: what a hang investigation needs first.
            self.fail(MkError::timeout(format!(
                "proxy command {ticket} did not complete within MK_TIMEOUT_MS={} ms over the {} transport \
                 ({} puts in flight; ring tail {}, completed {})",
                self.options.timeout.as_millis(),
                self.transport.name(),
                self.in_flight.len(),
                self.ring.tail(),
                self.ring.completed()
            )));
        }
        finished
    }

    /// Moves `completed_ids` into the done set and advances `completed` over the finished
    /// prefix of tickets. Returns how many commands that completed.
    fn advance_completed(&mut self) -> usize {
        self.done.extend(self.completed_ids.drain(..));
        let mut finished = 0;
        let mut completed = self.ring.completed_counter().load(Ordering::Relaxed);
        while let Some(&(ticket, id)) = self.in_flight.front() {
            if !self.done.remove(&id) {
                break;
            }
            self.in_flight.pop_front();
            completed = ticket + 1;
            finished += 1;
        }
        if finished > 0 {
            self.ring.completed_counter().store(completed, Ordering::Release);
        }
        finished
    }

    fn fail(&mut self, e: MkError) {
        // Count what finished before the failure (including completions the failing poll
        // handed back with its error), so `completed` stays exact.
        let _ = self.transport.poll(&mut self.completed_ids);
        self.advance_completed();
        self.failed = true;
        self.in_flight.clear();
        crate::log::warn(Some(self.options.rank), format_args!("proxy: {e}"));
        if self.error.record(e.clone()) {
            self.ring.error_word().store(e.code as i32, Ordering::Release);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn command_encoding_round_trips() {
        let c = put_command(5, 64, 128, 4096, Some((3, 9)));
        assert_eq!(c.header, 1 | 5 << 8);
        let p = decode_command(&c).unwrap();
        assert_eq!(p, PutRequest { peer: 5, src_offset: 64, dst_offset: 128, bytes: 4096, signal: Some((3, 9)) });
        let quiet = decode_command(&put_command(MK_PROXY_MAX_PEER, 0, 0, 1, None)).unwrap();
        assert_eq!((quiet.peer, quiet.signal), (MK_PROXY_MAX_PEER as usize, None));
    }

    #[test]
    fn malformed_commands_are_internal_errors() {
        let bad_kind = ProxyCommand { header: 7 | 1 << 8, ..Default::default() };
        let signal_without_id = ProxyCommand {
            header: command_header(MK_PROXY_KIND_SIGNAL, 1),
            signal_id: MK_PROXY_NO_SIGNAL,
            ..Default::default()
        };
        let signal_with_bytes = ProxyCommand {
            header: command_header(MK_PROXY_KIND_SIGNAL, 1),
            bytes: 4,
            signal_id: 0,
            ..Default::default()
        };
        for c in [bad_kind, signal_without_id, signal_with_bytes] {
            assert_eq!(decode_command(&c).unwrap_err().code, mkResult_t::mkInternalError, "{c:?}");
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::test_runner::Config {
            cases: 4000,
            failure_persistence: None,
            ..Default::default()
        })]

        /// Any command a kernel could leave in a slot decodes to a put to a peer within
        /// MK_PROXY_MAX_PEER, or to mkInternalError; never a panic.
        #[test]
        fn any_command_decodes_or_is_an_internal_error(
            header in proptest::prelude::any::<u32>(),
            small_kind in proptest::prelude::any::<bool>(),
            bytes in proptest::prelude::any::<u32>(),
            src_offset in proptest::prelude::any::<u64>(),
            dst_offset in proptest::prelude::any::<u64>(),
            signal_id in proptest::prelude::any::<u32>(),
            signal_value in proptest::prelude::any::<u32>(),
        ) {
            let header = if small_kind { header & !0xfc } else { header };
            let cmd = ProxyCommand { header, bytes, src_offset, dst_offset, signal_id, signal_value };
            match decode_command(&cmd) {
                Ok(put) => {
                    proptest::prop_assert!(put.peer <= MK_PROXY_MAX_PEER as usize);
                    proptest::prop_assert_eq!(put.bytes, u64::from(bytes));
                    proptest::prop_assert_eq!(put.signal.is_some(), signal_id != MK_PROXY_NO_SIGNAL);
                }
                Err(e) => proptest::prop_assert_eq!(e.code, mkResult_t::mkInternalError),
            }
        }
    }

    /// Without a GPU (no libcuda) a device ring is a clear error, never a panic (cudarc
    /// panics when libcuda is missing and it is called); with one, it is made.
    #[test]
    fn device_ring_without_a_gpu_is_an_error() {
        if crate::cuda::gpu_unavailable_reason().is_some() {
            let e = ProxyRing::on_device(8, Duration::from_secs(1)).err().expect("no GPU, no device ring");
            assert!(matches!(e.code, mkResult_t::mkSystemError | mkResult_t::mkUnhandledCudaError), "{e}");
            assert!(PinnedRingMemory::new(4096).is_err());
        } else {
            let ctx = crate::cuda::PrimaryContext::retain(0).unwrap();
            let _current = ctx.enter().unwrap();
            ProxyRing::on_device(8, Duration::from_secs(1))
                .unwrap_or_else(|e| panic!("a GPU is present but no device ring: {e}"));
        }
    }

    #[test]
    fn cpu_lists_parse_like_sysfs() {
        assert_eq!(parse_cpu_list("0-3,8,10-11\n"), Some(vec![0, 1, 2, 3, 8, 10, 11]));
        assert_eq!(parse_cpu_list("5"), Some(vec![5]));
        assert_eq!(parse_cpu_list(""), Some(vec![]));
        for bad in ["3-1", "a", "1-", "0-99999999"] {
            assert_eq!(parse_cpu_list(bad), None, "{bad:?}");
        }
        assert_eq!(cpus_near_pci_device("not-a-device"), None);
    }

    #[test]
    fn capacity_and_memory_are_checked() {
        for cap in [0, 1, 3, 1 << 21] {
            assert!(ProxyRing::in_host_memory(cap, Duration::from_secs(1)).is_err(), "capacity {cap}");
        }
        let small = HostRingMemory::new(ring_bytes(4)).unwrap();
        assert!(ProxyRing::new(Box::new(small), 8, None, Duration::from_secs(1)).is_err());
    }

    #[test]
    fn view_points_into_the_ring_memory() {
        let ring = ProxyRing::in_host_memory(16, Duration::from_millis(1500)).unwrap();
        let v = ring.view();
        assert_eq!(v.commands, v.control + CONTROL_BYTES as u64);
        assert_eq!(v.head, v.control + HOST_HEAD_OFFSET as u64);
        assert_eq!((v.capacity, v.timeout_ns), (16, 1_500_000_000));
        let memory = HostRingMemory::new(ring_bytes(16)).unwrap();
        let device_head = ProxyRing::new(Box::new(memory), 16, Some(0xdead_0000), Duration::from_secs(1)).unwrap();
        assert_eq!(device_head.view().head, 0xdead_0000);
        assert!(Arc::new(device_head).host_producer().is_none());
    }
}
