//! mkAllGather / mkReduceScatter / mkAllReduce on the GPU, with MK_TEST_NRANKS ranks
//! (processes of this executable sharing the GPU under MPS, or one per GPU).
//!
//! Per rank: every dtype × op × awkward count × in/out of place through the C ABI, with
//! fresh random inputs, poisoned outputs and a float64 (exact for integers) reference;
//! CUDA-graph capture and replay with fresh inputs; a rank that never calls the op (the
//! others must stop within the timeout with mkTimeout/mkRemoteError, refuse new ops, and
//! the absent rank learns of it at its next call); 100 init/destroy cycles that must leave
//! no device memory and no IPC mapping behind; and, last, a rank killed mid-op. With one
//! rank it also runs two ranks inside this process (mkCommInitAll, same device).
//!
//! MK_TEST_KILL=skip leaves the killed-rank test out, MK_TEST_KILL=only runs nothing else.
//! Run it without MPS: under MPS a client that dies with a kernel in flight poisons the other
//! clients' contexts (observed on the H200: their next launch fails with
//! CUDA_ERROR_ILLEGAL_ADDRESS although they were idle), which is MPS's behaviour, not ours;
//! scripts/gpu-run.sh runs it after stopping MPS.

use crate::outcome::{self, Outcome};
use crate::ranks::{self, RankEnv, VICTIM_EXIT};
use cudarc::driver::result as cu;
use mkernel::bootstrap::{root::start_root, UniqueId, UNIQUE_ID_BYTES};
use mkernel::comm::workspace::{LIVE_WORKSPACES, OPEN_IPC_MAPPINGS};
use mkernel::comm::{Comm, CommConfig};
use mkernel::cuda::{self, sys, PrimaryContext};
use mkernel::error::{mkResult_t, MkError, Result};
use mkernel::ffi::collectives::{mkAllGather, mkAllReduce, mkReduceScatter};
use mkernel::ffi::comm::{mkCommDestroy, mkCommGetAsyncError, mkCommInitAll, mkCommInitRankConfig, mkUniqueId};
use mkernel::ffi::config::{mkConfig_t, MK_CONFIG_MAGIC, MK_CONFIG_UNDEF_INT};
use mkernel::ffi::mkComm_t;
use mkernel::ffi::query::mkGetLastError;
use mkernel::ops::collectives::CollectiveKind;
use mkernel::types::{mkDataType_t, mkRedOp_t, Element};
use mkernel_tools::testing::collective_values::{
    exact_reduction, fp8_reduction, is_float, is_fp8, push_element, splitmix,
};
use mkernel_tools::testing::{
    accumulation_unit, check_close, check_exact, check_exact_or_nan, gamma, to_f64, tolerance, underflow_floor,
    unit_roundoff, CapturedGraph, Rule, TestBuffer, Verdict,
};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

const IDS: usize = 5; // control, main, graph, absent-rank test, killed-rank test
pub(crate) const FAULT_TIMEOUT_MS: i32 = 2000;
pub(crate) const FAULT_SLACK: Duration = Duration::from_secs(3);
/// The suites' main communicators' timeout unless MK_TEST_TIMEOUT_MS sets it: a stall that
/// the kernels' bounded waits end shows up sooner with a shorter one.
const SUITE_TIMEOUT_MS: i32 = 30_000;
/// How long past its communicator's timeout an op may run before the harness calls it a
/// hang: a wait notices the clock within microseconds, then its CTA leaves and the others
/// stop at their next wait; the margin covers that, the host's polling and a GPU slowed
/// many times by compute-sanitizer. Equal bounds would race: a stall that the kernels end
/// at their timeout must read as the kernels' mkTimeout, never as a harness timeout.
pub(crate) const STOP_MARGIN: Duration = Duration::from_secs(15);

/// The timeout of the suites' main communicators (MK_TEST_TIMEOUT_MS, default 30 s).
pub(crate) fn suite_timeout_ms() -> i32 {
    std::env::var("MK_TEST_TIMEOUT_MS")
        .ok()
        .and_then(|v| v.trim().parse::<i32>().ok())
        .filter(|&ms| ms > 0)
        .unwrap_or(SUITE_TIMEOUT_MS)
}

/// The longest timeout of any communicator the suites create: what `timed_sync` is given.
pub(crate) fn longest_op_timeout() -> Duration {
    Duration::from_millis(suite_timeout_ms().max(SUITE_TIMEOUT_MS) as u64)
}

pub fn run() -> Result<Outcome> {
    if let Some(env) = ranks::child_env(IDS)? {
        rank_main(&env)?;
        return Ok(Outcome::Ran);
    }
    let n = ranks::nranks_requested();
    if n == 1 {
        let ids: Vec<UniqueId> = (0..IDS).map(|_| start_root()).collect::<Result<_>>()?;
        rank_main(&RankEnv { rank: 0, nranks: 1, ids, device: 0 })?;
        in_process_ranks()?;
        return Ok(Outcome::Ran);
    }
    println!("  starting {n} rank processes");
    let victim = kill_mode() != KillMode::Skip;
    ranks::spawn(&["collectives".to_string()], n, IDS, Duration::from_secs(180), |r| {
        if victim && r == n - 1 {
            VICTIM_EXIT
        } else {
            0
        }
    })?;
    Ok(Outcome::Spawned { nranks: n })
}

// ---------------------------------------------------------------- helpers

#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum KillMode {
    Run,
    Skip,
    Only,
}

pub(crate) fn kill_mode() -> KillMode {
    match std::env::var("MK_TEST_KILL").as_deref() {
        Ok("skip") => KillMode::Skip,
        Ok("only") => KillMode::Only,
        _ => KillMode::Run,
    }
}

pub(crate) fn say(rank: usize, msg: impl AsRef<str>) {
    println!("  [rank {rank}] {}", msg.as_ref());
}

pub(crate) fn ffi(what: &str, r: mkResult_t, comm: mkComm_t) -> Result<()> {
    if r == mkResult_t::mkSuccess {
        return Ok(());
    }
    // SAFETY: the comm handle is live (or NULL, which mkGetLastError accepts).
    let msg = unsafe { std::ffi::CStr::from_ptr(mkGetLastError(comm)) }.to_string_lossy().into_owned();
    Err(MkError::new(r, format!("{what}: {msg}")))
}

pub(crate) fn config(timeout_ms: i32, workspace: i64) -> mkConfig_t {
    mkConfig_t {
        size: std::mem::size_of::<mkConfig_t>(),
        magic: MK_CONFIG_MAGIC,
        version: mkernel::version_code() as u32,
        timeoutMs: timeout_ms,
        bootstrapTimeoutMs: MK_CONFIG_UNDEF_INT,
        commCtas: MK_CONFIG_UNDEF_INT,
        maxCtas: MK_CONFIG_UNDEF_INT,
        ranksPerNode: MK_CONFIG_UNDEF_INT,
        workspaceBytes: workspace,
    }
}

/// The control communicator of a rank's tests (the first id): host barriers, broadcasts and
/// allgathers between the checks, with no device workspace.
pub(crate) fn control_comm(env: &RankEnv) -> Result<Comm> {
    let mut cfg = CommConfig::from_env();
    cfg.workspace_bytes = 0;
    Comm::init(&env.ids[0], env.nranks as i32, env.rank as i32, Some(env.device), cfg)
}

pub(crate) fn init_comm(env: &RankEnv, id: &UniqueId, cfg: &mkConfig_t) -> Result<mkComm_t> {
    let mut uid = mkUniqueId { internal: [0; UNIQUE_ID_BYTES] };
    for (d, s) in uid.internal.iter_mut().zip(id.to_bytes()) {
        *d = s as std::os::raw::c_char;
    }
    let mut comm: mkComm_t = std::ptr::null_mut();
    // SAFETY: out-pointer and config are valid.
    ffi(
        "mkCommInitRankConfig",
        unsafe { mkCommInitRankConfig(&mut comm, env.nranks as i32, uid, env.rank as i32, cfg) },
        comm,
    )?;
    Ok(comm)
}

pub(crate) fn destroy(comm: mkComm_t) -> Result<()> {
    // SAFETY: a live handle, destroyed once.
    ffi("mkCommDestroy", unsafe { mkCommDestroy(comm) }, std::ptr::null_mut())
}

pub(crate) fn async_error(comm: mkComm_t) -> mkResult_t {
    let mut e = mkResult_t::mkInternalError;
    // SAFETY: live handle, valid out-pointer.
    unsafe { mkCommGetAsyncError(comm, &mut e) };
    e
}

/// The communicator's last failure message (mkGetLastError), an asynchronous error's
/// included: which wait stopped, on which peer.
pub(crate) fn last_error(comm: mkComm_t) -> String {
    // SAFETY: a live communicator (or NULL); the string stays valid until its next call.
    unsafe { std::ffi::CStr::from_ptr(mkernel::ffi::query::mkGetLastError(comm)) }.to_string_lossy().into_owned()
}

/// A stream: owned (destroyed on drop) or a rank thread's stream, lent (`for_rank`).
pub(crate) struct Stream(pub(crate) sys::CUstream, bool);

thread_local! {
    /// This rank thread's stream (`Stream::lend_to_this_thread`), as an address: none in a
    /// rank process.
    static RANK_STREAM: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
}

impl Stream {
    pub(crate) fn new() -> Result<Self> {
        let mut s: sys::CUstream = std::ptr::null_mut();
        // SAFETY: creates a stream in the current context.
        cuda::check("cuStreamCreate", unsafe {
            sys::cuStreamCreate(&mut s, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
        })?;
        Ok(Stream(s, true))
    }
    /// The stream for this rank's ops: in a rank thread the one its process made for the
    /// rank before the threads started (fused_common::run_rank_threads says why), else a
    /// new one.
    pub(crate) fn for_rank() -> Result<Self> {
        match RANK_STREAM.with(|c| c.get()) {
            Some(address) => Ok(Stream(address as sys::CUstream, false)),
            None => Self::new(),
        }
    }
    /// Its address, for `lend_to_this_thread` in another thread (a raw stream is not Send).
    pub(crate) fn address(&self) -> usize {
        self.0 as usize
    }
    /// Makes the stream at `address` what `for_rank` gives in this thread; the stream's
    /// owner outlives the thread.
    pub(crate) fn lend_to_this_thread(address: usize) {
        RANK_STREAM.with(|c| c.set(Some(address)));
    }
    pub(crate) fn sync(&self) -> Result<()> {
        // SAFETY: live stream.
        cuda::check("cuStreamSynchronize", unsafe { sys::cuStreamSynchronize(self.0) })
    }
}
impl Drop for Stream {
    fn drop(&mut self) {
        if self.1 {
            // SAFETY: created by new.
            unsafe { sys::cuStreamDestroy_v2(self.0) };
        }
    }
}

/// `n` random elements of `dtype` (bytes, and their exact values), in the ranges
/// `push_element` documents.
fn random_input(dtype: mkDataType_t, n: usize, seed: u64, for_prod: bool) -> (Vec<u8>, Vec<f64>) {
    let mut bytes = Vec::with_capacity(n * dtype.size());
    for i in 0..n {
        push_element(&mut bytes, dtype, splitmix(seed.wrapping_mul(0x2545_f491_4f6c_dd1d) ^ i as u64), for_prod);
    }
    let vals = to_f64(&bytes, dtype);
    (bytes, vals)
}

/// One fp8 input element in this many is NaN in a reduction's inputs, so that NaN's rule
/// (Sum, Prod, Avg give NaN; Max, Min ignore it) is checked at every rank count.
const FP8_NAN_ONE_IN: u64 = 53;

/// Replaces about one element in `FP8_NAN_ONE_IN` of an fp8 input by NaN (both signs' NaN
/// codes: 0x7F and 0xFF in e4m3 and e5m2 alike), in the bytes and in their values.
fn inject_fp8_nans(bytes: &mut [u8], vals: &mut [f64], seed: u64) {
    for (i, (b, v)) in bytes.iter_mut().zip(vals.iter_mut()).enumerate() {
        let r = splitmix(seed ^ 0x6e61_6e73 ^ (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
        if r % FP8_NAN_ONE_IN == 0 {
            *b = if r & (1 << 40) != 0 { 0xFF } else { 0x7F };
            *v = f64::NAN;
        }
    }
}

fn upload_at(ptr: u64, bytes: &[u8]) -> Result<()> {
    // SAFETY: the caller's buffer holds bytes.len() bytes at ptr.
    unsafe { cu::memcpy_htod_sync(ptr, bytes) }.map_err(|e| cuda::cuda_err("cuMemcpyHtoD", e))
}

fn download_at(ptr: u64, bytes: usize) -> Result<Vec<u8>> {
    let mut host = vec![0u8; bytes];
    // SAFETY: the caller's buffer holds `bytes` bytes at ptr.
    unsafe { cu::memcpy_dtoh_sync(&mut host, ptr) }.map_err(|e| cuda::cuda_err("cuMemcpyDtoH", e))?;
    Ok(host)
}

/// One collective call with its own buffers, fresh inputs on every `prepare`.
pub(crate) struct Case {
    kind: CollectiveKind,
    dtype: mkDataType_t,
    op: mkRedOp_t,
    count: usize,
    in_place: bool,
    rank: usize,
    nranks: usize,
    _bufs: Vec<TestBuffer>,
    send: u64,
    recv: u64,
    expected: Vec<f64>,
    /// Per element, the largest |out − expected| accepted (None: exact comparison).
    bounds: Option<Vec<f64>>,
    /// Ranks per node whose partial the library rounds to the element type before the
    /// nodes' partials are combined (the hierarchical path, see mkReduceScatter in the
    /// header); `nranks` (one node) means a single rounding at the end.
    node_size: usize,
}

impl Case {
    pub(crate) fn new(
        kind: CollectiveKind,
        dtype: mkDataType_t,
        op: mkRedOp_t,
        count: usize,
        in_place: bool,
        rank: usize,
        nranks: usize,
    ) -> Result<Case> {
        let es = dtype.size() as u64;
        let (send_n, recv_n) = kind.buffer_counts(count as u64, nranks as u64).unwrap();
        let (bufs, send, recv) = if in_place {
            let b = TestBuffer::new(send_n.max(recv_n) as usize, dtype)?;
            let base = b.ptr();
            let (s, r) = match kind {
                CollectiveKind::AllGather => (base + rank as u64 * count as u64 * es, base),
                CollectiveKind::ReduceScatter => (base, base + rank as u64 * count as u64 * es),
                CollectiveKind::AllReduce => (base, base),
            };
            (vec![b], s, r)
        } else {
            let s = TestBuffer::new(send_n as usize, dtype)?;
            let r = TestBuffer::new(recv_n as usize, dtype)?;
            let (sp, rp) = (s.ptr(), r.ptr());
            (vec![s, r], sp, rp)
        };
        Ok(Case {
            kind,
            dtype,
            op,
            count,
            in_place,
            rank,
            nranks,
            _bufs: bufs,
            send,
            recv,
            expected: Vec::new(),
            bounds: None,
            node_size: nranks,
        })
    }

    /// The communicator spans nodes of `ranks_per_node` ranks: each node's partial (ranks
    /// `[k·ranks_per_node, (k+1)·ranks_per_node)`) is rounded to the element type once more.
    pub(crate) fn across_nodes(mut self, ranks_per_node: usize) -> Case {
        self.node_size = ranks_per_node.clamp(1, self.nranks);
        self
    }

    /// The exact float64 result of one element from every rank's value and, for an op that
    /// rounds (Sum, Avg, Prod of floats), the largest error the library's stated rounding
    /// allows: an fp32 reduction over the ranks rounded once (testing::Rule), plus one
    /// rounding per node partial across nodes. Max, Min and integers are exact (None), and
    /// so is fp8, whose rule (f32 in rank order, one saturating rounding) fixes every bit.
    fn reference(&self, vals: &[f64]) -> (f64, Option<f64>) {
        if is_fp8(self.dtype) {
            return (fp8_reduction(vals, self.op, self.dtype), None);
        }
        let exact = exact_reduction(vals, self.op, self.dtype);
        if !is_float(self.dtype) || matches!(self.op, mkRedOp_t::mkMax | mkRedOp_t::mkMin) {
            return (exact, None);
        }
        let n = vals.len();
        let u = unit_roundoff(self.dtype);
        let node_roundings = if self.node_size < n { 1.0 } else { 0.0 };
        let abs_sum: f64 = vals.iter().map(|v| v.abs()).sum();
        let bound = match self.op {
            mkRedOp_t::mkSum => Rule::reduction(self.dtype, n).bound(exact, abs_sum) + node_roundings * u * abs_sum,
            // The sum's bound, divided by n (the division's own rounding is the extra term).
            mkRedOp_t::mkAvg => {
                (Rule::reduction(self.dtype, n + 1).bound(exact * n as f64, abs_sum) + node_roundings * u * abs_sum)
                    / n as f64
            }
            // n − 1 multiplications in the accumulator, one rounding at the end (and one per
            // node partial): relative bounds.
            _ => {
                let rel =
                    u * (1.0 + node_roundings * (n / self.node_size) as f64) + gamma(n, accumulation_unit(self.dtype));
                1.01 * (underflow_floor(self.dtype) + rel * exact.abs())
            }
        };
        (exact, Some(bound))
    }

    pub(crate) fn label(&self) -> String {
        let op = if self.kind == CollectiveKind::AllGather { String::new() } else { format!(" {:?}", self.op) };
        format!(
            "{}{op} {} count={} {}",
            self.kind.name(),
            self.dtype.name(),
            self.count,
            if self.in_place { "in-place" } else { "out-of-place" }
        )
    }

    /// Poisons the output, uploads this rank's fresh input, computes the expected output.
    pub(crate) fn prepare(&mut self, seed: u64) -> Result<()> {
        let es = self.dtype.size();
        let (send_n, recv_n) = self.kind.buffer_counts(self.count as u64, self.nranks as u64).unwrap();
        let inputs: Vec<Vec<f64>> = (0..self.nranks)
            .map(|p| {
                let rank_seed = seed ^ ((p as u64 + 1) * 0x9e37_79b9);
                let (mut bytes, mut vals) =
                    random_input(self.dtype, send_n as usize, rank_seed, self.op == mkRedOp_t::mkProd);
                if is_fp8(self.dtype) && self.kind != CollectiveKind::AllGather {
                    inject_fp8_nans(&mut bytes, &mut vals, rank_seed);
                }
                if p == self.rank {
                    // poison the whole output first (in place: then the input goes in)
                    // SAFETY: recv holds recv_n elements.
                    unsafe { cu::memset_d8_sync(self.recv, 0xff, recv_n as usize * es) }
                        .map_err(|e| cuda::cuda_err("cuMemsetD8", e))?;
                    upload_at(self.send, &bytes)?;
                }
                Ok(vals)
            })
            .collect::<Result<_>>()?;
        // The copies above may still be in flight (pageable uploads return early) and our
        // ops run on non-blocking streams: wait for them.
        // SAFETY: synchronises the current context.
        cuda::check("cuCtxSynchronize (after uploading inputs)", unsafe { sys::cuCtxSynchronize() })?;
        let c = self.count;
        let elements: Vec<(f64, Option<f64>)> = match self.kind {
            CollectiveKind::AllGather => inputs.concat().into_iter().map(|v| (v, None)).collect(),
            CollectiveKind::ReduceScatter => (0..c)
                .map(|i| self.reference(&inputs.iter().map(|v| v[self.rank * c + i]).collect::<Vec<_>>()))
                .collect(),
            CollectiveKind::AllReduce => {
                (0..c).map(|i| self.reference(&inputs.iter().map(|v| v[i]).collect::<Vec<_>>())).collect()
            }
        };
        self.expected = elements.iter().map(|e| e.0).collect();
        self.bounds = if elements.iter().any(|e| e.1.is_some()) {
            Some(elements.iter().map(|e| e.1.unwrap_or(0.0)).collect())
        } else {
            None
        };
        Ok(())
    }

    pub(crate) fn launch(&self, comm: mkComm_t, stream: sys::CUstream) -> Result<()> {
        let (s, r) = (self.send as *const _, self.recv as *mut _);
        let (t, o) = (self.dtype as i32, self.op as i32);
        // SAFETY: buffers sized by Case::new on this comm's device.
        let rc = unsafe {
            match self.kind {
                CollectiveKind::AllGather => mkAllGather(s, r, self.count, t, comm, stream),
                CollectiveKind::ReduceScatter => mkReduceScatter(s, r, self.count, t, o, comm, stream),
                CollectiveKind::AllReduce => mkAllReduce(s, r, self.count, t, o, comm, stream),
            }
        };
        ffi(self.kind.name(), rc, comm)
    }

    /// Element by element: within each element's bound where the op rounds, exactly
    /// otherwise (AllGather, Max, Min, integers); the output buffer's guard bands intact.
    pub(crate) fn verify(&self) -> Result<(bool, String)> {
        let got = to_f64(&download_at(self.recv, self.expected.len() * self.dtype.size())?, self.dtype);
        let verdict: Verdict = match &self.bounds {
            Some(bounds) => check_close(&got, &self.expected, bounds, tolerance(self.dtype)),
            // An fp8 reduction's NaN inputs make NaN its defined result in places.
            None if is_fp8(self.dtype) && self.kind != CollectiveKind::AllGather => {
                check_exact_or_nan(&got, &self.expected)
            }
            None => check_exact(&got, &self.expected),
        };
        let mut guards = None;
        for b in &self._bufs {
            if let Some(what) = b.guards_intact()? {
                guards = Some(what);
            }
        }
        let ok = verdict.passed() && guards.is_none();
        Ok((ok, format!("{verdict}{}", guards.map_or(String::new(), |w| format!("; GUARD {w}")))))
    }
}

// ---------------------------------------------------------------- the rank's tests

fn rank_main(env: &RankEnv) -> Result<()> {
    let (rank, n) = (env.rank, env.nranks);
    let ctx = PrimaryContext::retain(env.device)?;
    let _g = ctx.enter()?;
    // The control communicator: host barriers and id broadcasts between the tests.
    let control = control_comm(env)?;
    if rank == 0 {
        say(
            rank,
            format!("peers mapped by: {}", control.workspace.as_ref().map_or("-".to_string(), |w| w.transport.clone())),
        );
    }
    let mode = kill_mode();
    let result = (|| {
        if mode != KillMode::Only {
            correctness(env)?;
            graph_replay(env)?;
            if n > 1 {
                absent_rank(env, &control)?;
            }
            init_destroy_leaks(env, &control)?;
        }
        if n > 1 && mode != KillMode::Skip {
            killed_rank(env, &control)?;
        }
        Ok(())
    })();
    drop(control);
    result
}

/// The collectives' case matrix: every dtype × AllGather / ReduceScatter (every op) /
/// AllReduce (every op) × counts of 1, 3, 1000, 16,001 and 70,001, and four dtypes at
/// counts large enough to pipeline through many workspace steps. Within a node the first
/// three take the low-latency protocol (at most 64 KiB per segment), and 16,001 too for
/// types of up to 4 bytes (spread over several LL CTAs, ending in a partial line); the rest
/// the simple one. fp8's reductions (in float, rounded once) are among them.
pub(crate) fn case_matrix() -> Vec<(CollectiveKind, mkDataType_t, mkRedOp_t, usize)> {
    let mut cases = Vec::new();
    for dtype in mkDataType_t::ALL {
        for count in [1usize, 3, 1000, 16_001, 70_001] {
            cases.push((CollectiveKind::AllGather, dtype, mkRedOp_t::mkSum, count));
            let reduces = if dtype.element().accepted.reduce { &mkRedOp_t::ALL[..] } else { &[] };
            for &op in reduces {
                cases.push((CollectiveKind::ReduceScatter, dtype, op, count));
                cases.push((CollectiveKind::AllReduce, dtype, op, count));
            }
        }
    }
    let large = [mkDataType_t::mkFloat32, mkDataType_t::mkBfloat16, mkDataType_t::mkInt32, mkDataType_t::mkFloat8e4m3];
    for dtype in large {
        cases.push((CollectiveKind::AllGather, dtype, mkRedOp_t::mkSum, 1_000_003));
        cases.push((CollectiveKind::AllReduce, dtype, mkRedOp_t::mkSum, 1_000_003));
        cases.push((CollectiveKind::ReduceScatter, dtype, mkRedOp_t::mkSum, 250_007));
    }
    cases
}

/// Runs every case of `case_matrix()` out of place and in place on `comm`, each with fresh
/// inputs (seeds from `seed`), a bounded wait, and the element-wise check; `ranks_per_node`
/// when the communicator spans nodes. Returns (checks, failures).
pub(crate) fn run_matrix(
    comm: mkComm_t,
    rank: usize,
    n: usize,
    ranks_per_node: Option<usize>,
    mut seed: u64,
) -> Result<(usize, usize)> {
    let stream = Stream::new()?;
    let (mut checks, mut failures) = (0usize, 0usize);
    for (kind, dtype, op, count) in case_matrix() {
        for in_place in [false, true] {
            let mut case = Case::new(kind, dtype, op, count, in_place, rank, n)?;
            if let Some(rpn) = ranks_per_node {
                case = case.across_nodes(rpn);
            }
            seed += 1;
            case.prepare(seed)?;
            if ranks_per_node.is_some()
                && kind != CollectiveKind::AllGather
                && !dtype.element().accepted.reduce_across_nodes
            {
                // fp8 is not reduced across nodes: refused before anything is enqueued.
                checks += 1;
                if !refused_across_nodes(case.launch(comm, stream.0), &case) {
                    failures += 1;
                }
                continue;
            }
            case.launch(comm, stream.0)?;
            // Bounded: a hung kernel must fail the test, not the whole run.
            timed_sync(&stream, longest_op_timeout()).map_err(|e| e.context(case.label()))?;
            let code = async_error(comm);
            if code != mkResult_t::mkSuccess {
                return Err(MkError::new(code, format!("{}: asynchronous error {code:?}", case.label())));
            }
            let (ok, detail) = case.verify()?;
            checks += 1;
            if !ok {
                failures += 1;
                say(rank, format!("{} -> WRONG ({detail})", case.label()));
            } else if count >= 70_001 && rank == 0 {
                say(rank, format!("{} -> ok ({detail})", case.label()));
            }
        }
    }
    Ok((checks, failures))
}

/// Whether `launched` is the refusal of a reduction across nodes of a type that reduces only
/// within a node (mkInvalidUsage naming the op and the type); says what came instead.
fn refused_across_nodes(launched: Result<()>, case: &Case) -> bool {
    let want = format!("{} of {} across nodes is not supported", case.kind.name(), case.dtype.element().c_name);
    match launched {
        Err(e) if e.code == mkResult_t::mkInvalidUsage && e.message.contains(&want) => true,
        other => {
            say(case.rank, format!("{} -> WRONG (expected mkInvalidUsage \"{want}\", got {other:?})", case.label()));
            false
        }
    }
}

fn correctness(env: &RankEnv) -> Result<()> {
    let (rank, n) = (env.rank, env.nranks);
    // A 4 MiB workspace makes the large counts pipeline through many steps per CTA.
    let comm = init_comm(env, &env.ids[1], &config(10_000, 4 << 20))?;
    let stream = Stream::new()?;
    let (mut checks, mut failures) = run_matrix(comm, rank, n, None, 0x1234_5678)?;
    // Bad arguments come back as codes with messages, before anything runs.
    let bad = unsafe { mkAllReduce(std::ptr::null(), 0x1000 as *mut _, 10, 7, 0, comm, stream.0) };
    checks += 1;
    if bad != mkResult_t::mkInvalidArgument {
        failures += 1;
        say(rank, format!("NULL sendbuff gave {bad:?}"));
    }
    let host = [0f32; 16];
    let bad = unsafe { mkAllGather(host.as_ptr().cast(), host.as_ptr() as *mut _, 1, 7, comm, stream.0) };
    checks += 1;
    if bad != mkResult_t::mkInvalidArgument {
        failures += 1;
        say(rank, format!("host memory gave {bad:?}"));
    }
    destroy(comm)?;
    outcome::count(checks);
    say(rank, format!("correctness: {checks} checks, {failures} failed"));
    if failures > 0 {
        return Err(MkError::internal(format!("{failures} of {checks} collective checks failed")));
    }
    Ok(())
}

fn graph_replay(env: &RankEnv) -> Result<()> {
    let (rank, n) = (env.rank, env.nranks);
    let comm = init_comm(env, &env.ids[2], &config(10_000, 64 << 20))?;
    let r = graph_replay_on(comm, rank, n, None);
    destroy(comm)?;
    r
}

/// `ranks_per_node` when the communicator spans nodes (the node partials' rounding is allowed for).
pub(crate) fn graph_replay_on(comm: mkComm_t, rank: usize, n: usize, ranks_per_node: Option<usize>) -> Result<()> {
    let stream = Stream::new()?;
    let nodes = |c: Case| if let Some(rpn) = ranks_per_node { c.across_nodes(rpn) } else { c };
    let mut cases = vec![
        nodes(Case::new(
            CollectiveKind::AllReduce,
            mkDataType_t::mkFloat32,
            mkRedOp_t::mkSum,
            100_003,
            false,
            rank,
            n,
        )?),
        nodes(Case::new(
            CollectiveKind::AllGather,
            mkDataType_t::mkBfloat16,
            mkRedOp_t::mkSum,
            50_001,
            false,
            rank,
            n,
        )?),
        nodes(Case::new(
            CollectiveKind::ReduceScatter,
            mkDataType_t::mkFloat16,
            mkRedOp_t::mkAvg,
            30_001,
            true,
            rank,
            n,
        )?),
        nodes(Case::new(CollectiveKind::AllReduce, mkDataType_t::mkBfloat16, mkRedOp_t::mkMax, 4_097, true, rank, n)?),
    ];
    let mut interleaved =
        nodes(Case::new(CollectiveKind::AllReduce, mkDataType_t::mkFloat32, mkRedOp_t::mkSum, 7_777, false, rank, n)?);
    for c in cases.iter_mut() {
        c.prepare(1)?;
    }
    let graph = CapturedGraph::capture(stream.0, |s| cases.iter().try_for_each(|c| c.launch(comm, s)))?;
    let mut failures = 0;
    for replay in 0..4u64 {
        for (i, c) in cases.iter_mut().enumerate() {
            c.prepare(1000 + replay * 10 + i as u64)?;
        }
        graph.launch(stream.0)?;
        stream.sync()?;
        if async_error(comm) != mkResult_t::mkSuccess {
            return Err(MkError::new(async_error(comm), "asynchronous error during graph replay"));
        }
        for c in &cases {
            let (ok, detail) = c.verify()?;
            outcome::count(1);
            if !ok {
                failures += 1;
                say(rank, format!("graph replay {replay}: {} -> WRONG ({detail})", c.label()));
            }
        }
        // An op outside the graph between replays: the device-side step counters keep agreeing.
        interleaved.prepare(5000 + replay)?;
        interleaved.launch(comm, stream.0)?;
        stream.sync()?;
        let (ok, detail) = interleaved.verify()?;
        outcome::count(1);
        if !ok {
            failures += 1;
            say(rank, format!("op between replays -> WRONG ({detail})"));
        }
    }
    say(rank, format!("graph capture: 4 ops × 4 replays with fresh inputs, {failures} wrong"));
    if failures > 0 {
        return Err(MkError::internal("graph replay gave wrong results"));
    }
    Ok(())
}

/// Waits for the stream with a bound of its own: `op_timeout` (at least the timeout of the
/// communicator whose ops are in flight) plus STOP_MARGIN, so the kernels' timeout fires first.
pub(crate) fn timed_sync(stream: &Stream, op_timeout: Duration) -> Result<Duration> {
    let start = Instant::now();
    // The kernels' own bound: 17/16 of the timeout (the MoE prep's downstream waits get a
    // sixteenth more, kernels/common/signals.cuh MkWaitChecks).
    let limit = op_timeout + op_timeout / 16 + STOP_MARGIN;
    loop {
        // SAFETY: live stream.
        let r = unsafe { sys::cuStreamQuery(stream.0) };
        if r == sys::CUresult::CUDA_SUCCESS {
            return Ok(start.elapsed());
        }
        if r != sys::CUresult::CUDA_ERROR_NOT_READY {
            cuda::check("cuStreamQuery", r)?;
        }
        if start.elapsed() > limit {
            return Err(MkError::timeout(format!(
                "the op did not stop within {} s (17/16 of its communicator's timeout of at most {} s, plus {} s): \
                 its bounded waits did not fire",
                limit.as_secs(),
                op_timeout.as_secs(),
                STOP_MARGIN.as_secs()
            )));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

pub(crate) fn check_stopped(rank: usize, comm: mkComm_t, elapsed: Duration, what: &str) -> Result<mkResult_t> {
    let code = async_error(comm);
    let limit = Duration::from_millis(FAULT_TIMEOUT_MS as u64) + FAULT_SLACK;
    say(rank, format!("{what}: stopped after {:.2} s with {code:?}", elapsed.as_secs_f64()));
    if code != mkResult_t::mkTimeout && code != mkResult_t::mkRemoteError {
        return Err(MkError::internal(format!("{what}: expected mkTimeout or mkRemoteError, got {code:?}")));
    }
    // A device wait that timed out names the flag it polled (its word, the value read and
    // the value awaited), so a stall can be told apart from an absent peer.
    let message = last_error(comm);
    if message.contains("timed out waiting for") && !message.contains("the wait polled") {
        return Err(MkError::internal(format!("{what}: the timeout's message names no flag: {message}")));
    }
    if code == mkResult_t::mkTimeout {
        say(rank, format!("{what}: {message}"));
    }
    if elapsed > limit {
        return Err(MkError::internal(format!(
            "{what}: took {:.2} s, more than the timeout plus {} s",
            elapsed.as_secs_f64(),
            FAULT_SLACK.as_secs()
        )));
    }
    // After the timeout the communicator refuses new work with the same code and a message.
    let host_probe = TestBuffer::new(16, mkDataType_t::mkFloat32)?;
    // SAFETY: valid device buffer.
    let again = unsafe {
        mkAllReduce(host_probe.ptr() as *const _, host_probe.ptr() as *mut _, 16, 7, 0, comm, std::ptr::null_mut())
    };
    if again != code {
        return Err(MkError::internal(format!(
            "{what}: a new op after the failure returned {again:?}, expected {code:?}"
        )));
    }
    Ok(code)
}

fn absent_rank(env: &RankEnv, control: &Comm) -> Result<()> {
    let (rank, n) = (env.rank, env.nranks);
    let comm = init_comm(env, &env.ids[3], &config(FAULT_TIMEOUT_MS, 16 << 20))?;
    let stream = Stream::new()?;
    let mut case =
        Case::new(CollectiveKind::AllReduce, mkDataType_t::mkFloat32, mkRedOp_t::mkSum, 1 << 20, false, rank, n)?;
    case.prepare(77)?;
    let absent = n - 1;
    let mut outcome = Ok(());
    let mut code = mkResult_t::mkSuccess;
    if rank != absent {
        let t = Instant::now();
        case.launch(comm, stream.0)?;
        outcome = timed_sync(&stream, longest_op_timeout())
            .and_then(|_| check_stopped(rank, comm, t.elapsed(), "absent rank").map(|c| code = c));
    }
    // Every survivor has stopped; at least one of them must have timed out itself.
    let codes = control.bootstrap.allgather(&[code as i32 as u8])?;
    if rank == 0 && !codes.iter().take(absent).any(|c| c[0] as i32 == mkResult_t::mkTimeout as i32) {
        outcome = outcome.and(Err(MkError::internal("no surviving rank reported mkTimeout")));
    }
    if rank == absent {
        // The absent rank learns at its next call: the peers raised its abort word.
        let t = Instant::now();
        case.launch(comm, stream.0)?;
        let elapsed = timed_sync(&stream, longest_op_timeout())?;
        let c = async_error(comm);
        say(rank, format!("absent rank's late call: stopped after {:.3} s with {c:?}", elapsed.as_secs_f64()));
        if c != mkResult_t::mkRemoteError || t.elapsed() > Duration::from_millis(FAULT_TIMEOUT_MS as u64) {
            outcome =
                Err(MkError::internal(format!("absent rank's late call: expected a prompt mkRemoteError, got {c:?}")));
        }
    }
    control.bootstrap.barrier()?;
    destroy(comm)?;
    outcome
}

fn device_free() -> Result<usize> {
    cu::mem_get_info().map(|(free, _)| free).map_err(|e| cuda::cuda_err("cuMemGetInfo", e))
}

fn init_destroy_leaks(env: &RankEnv, control: &Comm) -> Result<()> {
    let (rank, n) = (env.rank, env.nranks);
    let ctx = PrimaryContext::retain(env.device)?;
    let mut cfg = CommConfig::from_env();
    cfg.workspace_bytes = 16 << 20;
    cfg.timeout = Duration::from_secs(10);
    let cycle = |i: usize| -> Result<()> {
        let id_bytes =
            control.bootstrap.broadcast(&if rank == 0 { start_root()?.to_bytes().to_vec() } else { Vec::new() }, 0)?;
        let id = UniqueId::from_bytes(&id_bytes.try_into().map_err(|_| MkError::internal("id size"))?)?;
        let comm = Comm::init(&id, n as i32, rank as i32, Some(env.device), cfg.clone())?;
        if i % 25 == 0 {
            // use it: a small AllReduce through the Rust entry point
            let mut case =
                Case::new(CollectiveKind::AllReduce, mkDataType_t::mkFloat32, mkRedOp_t::mkSum, 1001, false, rank, n)?;
            case.prepare(i as u64)?;
            mkernel::ops::collectives::collective(
                &comm,
                CollectiveKind::AllReduce,
                case.send,
                case.recv,
                1001,
                7,
                Some(0),
                std::ptr::null_mut(),
            )?;
            cuda::check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })?;
            let (ok, detail) = case.verify()?;
            if !ok {
                return Err(MkError::internal(format!("init/destroy cycle {i}: AllReduce wrong ({detail})")));
            }
        }
        let _g = ctx.enter()?;
        drop(comm);
        Ok(())
    };
    cycle(0)?;
    control.bootstrap.barrier()?;
    let (free0, ipc0, live0) =
        (device_free()?, OPEN_IPC_MAPPINGS.load(Ordering::Acquire), LIVE_WORKSPACES.load(Ordering::Acquire));
    control.bootstrap.barrier()?;
    let t = Instant::now();
    for i in 1..=100 {
        cycle(i)?;
    }
    control.bootstrap.barrier()?;
    let (free1, ipc1, live1) =
        (device_free()?, OPEN_IPC_MAPPINGS.load(Ordering::Acquire), LIVE_WORKSPACES.load(Ordering::Acquire));
    control.bootstrap.barrier()?;
    let lost = free0 as i64 - free1 as i64;
    say(rank, format!("100 init/destroy cycles in {:.1} s: device memory {lost:+} bytes, IPC mappings {ipc0} -> {ipc1}, workspaces {live0} -> {live1}", t.elapsed().as_secs_f64()));
    // 100 leaked workspaces would be 1.6 GB per rank; allow 4 MiB of allocator noise.
    if lost > 4 << 20 || ipc1 != ipc0 || live1 != live0 {
        return Err(MkError::internal("init/destroy leaked device memory, IPC mappings or workspaces"));
    }
    Ok(())
}

fn killed_rank(env: &RankEnv, control: &Comm) -> Result<()> {
    let (rank, n) = (env.rank, env.nranks);
    let comm = init_comm(env, &env.ids[4], &config(FAULT_TIMEOUT_MS, 16 << 20))?;
    let stream = Stream::new()?;
    let mut case =
        Case::new(CollectiveKind::AllReduce, mkDataType_t::mkFloat32, mkRedOp_t::mkSum, 4 << 20, false, rank, n)?;
    case.prepare(99)?;
    control.bootstrap.barrier()?;
    if rank == n - 1 {
        // Enter the op (it waits for the others, who start later), then die inside it.
        case.launch(comm, stream.0)?;
        std::thread::sleep(Duration::from_millis(300));
        say(rank, "killed rank: exiting in the middle of mkAllReduce");
        use std::io::Write;
        let _ = std::io::stdout().flush();
        // SAFETY: ends the process at once, as a crash would.
        unsafe { libc::_exit(VICTIM_EXIT) };
    }
    std::thread::sleep(Duration::from_millis(800));
    let t = Instant::now();
    case.launch(comm, stream.0)?;
    timed_sync(&stream, longest_op_timeout())?;
    check_stopped(rank, comm, t.elapsed(), "killed rank")?;
    outcome::count(1);
    destroy(comm)?;
    Ok(())
}

/// Two ranks of one communicator in this process on device 0 (plain pointers, no IPC).
fn in_process_ranks() -> Result<()> {
    let mut comms: [mkComm_t; 2] = [std::ptr::null_mut(); 2];
    let devs = [0i32, 0];
    // SAFETY: room for two handles and two device ordinals.
    ffi("mkCommInitAll", unsafe { mkCommInitAll(comms.as_mut_ptr(), 2, devs.as_ptr()) }, std::ptr::null_mut())?;
    let ctx = PrimaryContext::retain(0)?;
    let _g = ctx.enter()?;
    let streams = [Stream::new()?, Stream::new()?];
    let mut failures = 0;
    for (kind, dtype, op, count) in [
        (CollectiveKind::AllReduce, mkDataType_t::mkFloat32, mkRedOp_t::mkSum, 300_007usize),
        (CollectiveKind::AllGather, mkDataType_t::mkBfloat16, mkRedOp_t::mkSum, 123_457),
        (CollectiveKind::ReduceScatter, mkDataType_t::mkInt32, mkRedOp_t::mkMax, 65_539),
    ] {
        let mut cases =
            [Case::new(kind, dtype, op, count, false, 0, 2)?, Case::new(kind, dtype, op, count, false, 1, 2)?];
        for c in cases.iter_mut() {
            c.prepare(4242)?;
        }
        for (i, c) in cases.iter().enumerate() {
            c.launch(comms[i], streams[i].0)?;
        }
        for s in &streams {
            timed_sync(s, longest_op_timeout())?;
        }
        for (i, c) in cases.iter().enumerate() {
            let (ok, detail) = c.verify()?;
            outcome::count(1);
            println!("  [in-process rank {i}] {} -> {} ({detail})", c.label(), if ok { "ok" } else { "WRONG" });
            if !ok {
                failures += 1;
            }
        }
    }
    for c in comms {
        destroy(c)?;
    }
    if failures > 0 {
        return Err(MkError::internal("in-process ranks gave wrong results"));
    }
    Ok(())
}
