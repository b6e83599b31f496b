//! The C ABI on a live communicator, with MK_TEST_NRANKS ranks: every export that no other
//! suite reaches, and every fused op's argument errors.
//!
//! Per rank: the queries (mkCommCount, mkCommUserRank, mkCommCuDevice, mkCommGetAsyncError)
//! against what the rank knows, and their NULL arguments; count 0 (M = 0 for the fused ops)
//! succeeds, launches nothing and leaves poisoned outputs untouched; argument errors of
//! mkAllGatherGemm, mkGemmReduceScatter, mkGemmAllReduce, mkMoeDispatchGemm and
//! mkMoeGemmCombine come back as mkInvalidArgument with the rule in mkGetLastError, before
//! anything runs; mkCommAbort on a communicator that has run an op; a communicator aborted
//! through the library refuses new work with mkInvalidUsage. With several ranks also: a
//! rank that aborts while its peers are inside an AllReduce makes them stop within the
//! timeout (mkRemoteError or mkTimeout) and refuse new work, and on a communicator whose
//! ranks are each a node of their own (mkConfig_t.ranksPerNode = 1) MoE and ring attention
//! are refused with mkInvalidUsage naming the rule.

use crate::collectives::{
    async_error, check_stopped, config, control_comm, destroy, init_comm, last_error, longest_op_timeout, say,
    timed_sync, Case, Stream, FAULT_TIMEOUT_MS,
};
use crate::outcome::{self, Outcome};
use crate::ranks::{self, RankEnv};
use mkernel::bootstrap::{root::start_root, UniqueId};
use mkernel::comm::{Comm, CommConfig};
use mkernel::cuda::{self, sys, PrimaryContext};
use mkernel::error::{mkResult_t, MkError, Result};
use mkernel::ffi::collectives::{mkAllGather, mkAllReduce, mkReduceScatter};
use mkernel::ffi::comm::mkCommAbort;
use mkernel::ffi::fused::{
    mkAllGatherGemm, mkGemmAllReduce, mkGemmReduceScatter, mkMoeDispatchGemm, mkMoeDispatchGemmWithOptions,
    mkMoeGemmCombine, mkMoeLayoutBytes, mkMoeOptions_t, mkRingAttention,
};
use mkernel::ffi::gemm::mkGemm;
use mkernel::ffi::mkComm_t;
use mkernel::ffi::query::{mkCommCount, mkCommCuDevice, mkCommUserRank};
use mkernel::ops::collectives::CollectiveKind;
use mkernel::ops::moe::MK_MOE_DROP;
use mkernel::types::{mkDataType_t, mkRedOp_t};
use mkernel_tools::testing::TestBuffer;
use std::ffi::c_void;
use std::os::raw::c_int;
use std::time::{Duration, Instant};

/// Unique ids: the control communicator and the main one (the others are made by rank 0
/// and broadcast over the control communicator).
const IDS: usize = 2;

pub fn run() -> Result<Outcome> {
    if let Some(env) = ranks::child_env(IDS)? {
        rank_main(&env)?;
        return Ok(Outcome::Ran);
    }
    let n = ranks::nranks_requested();
    if n > 1 {
        println!("  starting {n} rank processes");
        ranks::spawn(&["api".to_string()], n, IDS, Duration::from_secs(120), |_| 0)?;
        return Ok(Outcome::Spawned { nranks: n });
    }
    let ids: Vec<UniqueId> = (0..IDS).map(|_| start_root()).collect::<Result<_>>()?;
    rank_main(&RankEnv { rank: 0, nranks: 1, ids, device: 0 })?;
    Ok(Outcome::Ran)
}

/// The checks of one rank: each counted, each failure kept with its detail.
struct Tally {
    rank: usize,
    checks: usize,
    failures: Vec<String>,
}

impl Tally {
    fn check(&mut self, what: &str, ok: bool, detail: impl AsRef<str>) {
        self.checks += 1;
        if !ok {
            self.failures.push(format!("{what}: {}", detail.as_ref()));
        }
        if !ok || self.rank == 0 {
            say(self.rank, format!("{what}: {} -> {}", detail.as_ref(), if ok { "ok" } else { "WRONG" }));
        }
    }

    /// `r` must be `want` with a message containing `needle` (any message when empty).
    fn expect_error(&mut self, what: &str, r: mkResult_t, want: mkResult_t, comm: mkComm_t, needle: &str) {
        let msg = last_error(comm);
        let ok = r == want && !msg.is_empty() && msg.contains(needle);
        self.check(what, ok, format!("{r:?} \"{msg}\""));
    }
}

fn sync_all() -> Result<()> {
    // SAFETY: synchronises the current context.
    cuda::check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
}

/// A fresh unique id made by rank 0 and broadcast over the control communicator.
fn fresh_id(control: &Comm, rank: usize) -> Result<UniqueId> {
    let bytes =
        control.bootstrap.broadcast(&if rank == 0 { start_root()?.to_bytes().to_vec() } else { Vec::new() }, 0)?;
    UniqueId::from_bytes(&bytes.try_into().map_err(|_| MkError::internal("a broadcast unique id has the wrong size"))?)
}

/// Whether every byte of `b` is still the poison 0xFF and its guard bands are intact.
fn untouched(b: &TestBuffer) -> Result<bool> {
    Ok(b.download()?.iter().all(|&x| x == 0xff) && b.guards_intact()?.is_none())
}

fn rank_main(env: &RankEnv) -> Result<()> {
    let (rank, n) = (env.rank, env.nranks);
    let ctx = PrimaryContext::retain(env.device)?;
    let _g = ctx.enter()?;
    let control = control_comm(env)?;
    let mut t = Tally { rank, checks: 0, failures: Vec::new() };
    let comm = init_comm(env, &env.ids[1], &config(10_000, 64 << 20))?;
    let result = (|| -> Result<()> {
        queries(comm, env, &mut t);
        count_zero(comm, n, &mut t)?;
        fused_argument_errors(comm, n, &mut t)?;
        Ok(())
    })();
    control.bootstrap.barrier()?;
    destroy(comm)?;
    result?;
    abort_after_use(env, &control, &mut t)?;
    refusal_after_abort(env, &control, &mut t)?;
    if n > 1 {
        abort_stops_peers(env, &control, &mut t)?;
        cross_node_refusals(env, &control, &mut t)?;
    }
    control.bootstrap.barrier()?;
    outcome::count(t.checks);
    say(rank, format!("api: {} checks, {} wrong", t.checks, t.failures.len()));
    if !t.failures.is_empty() {
        return Err(MkError::internal(format!(
            "{} of {} API checks wrong: {}",
            t.failures.len(),
            t.checks,
            t.failures.join("; ")
        )));
    }
    Ok(())
}

fn queries(comm: mkComm_t, env: &RankEnv, t: &mut Tally) {
    let mut v: c_int = -1;
    // SAFETY (this function): a live communicator and valid out-pointers, or NULL where the
    // call must refuse it.
    let r = unsafe { mkCommCount(comm, &mut v) };
    t.check(
        "mkCommCount",
        r == mkResult_t::mkSuccess && v == env.nranks as c_int,
        format!("{r:?}, {v} (expected {})", env.nranks),
    );
    v = -1;
    let r = unsafe { mkCommUserRank(comm, &mut v) };
    t.check(
        "mkCommUserRank",
        r == mkResult_t::mkSuccess && v == env.rank as c_int,
        format!("{r:?}, {v} (expected {})", env.rank),
    );
    v = -1;
    let r = unsafe { mkCommCuDevice(comm, &mut v) };
    t.check(
        "mkCommCuDevice",
        r == mkResult_t::mkSuccess && v == env.device,
        format!("{r:?}, {v} (expected {})", env.device),
    );
    let code = async_error(comm);
    t.check("mkCommGetAsyncError on a healthy communicator", code == mkResult_t::mkSuccess, format!("{code:?}"));
    let r = unsafe { mkCommCount(comm, std::ptr::null_mut()) };
    t.expect_error("mkCommCount(comm, NULL)", r, mkResult_t::mkInvalidArgument, comm, "");
    let r = unsafe { mkCommUserRank(comm, std::ptr::null_mut()) };
    t.expect_error("mkCommUserRank(comm, NULL)", r, mkResult_t::mkInvalidArgument, comm, "");
    let r = unsafe { mkCommCuDevice(comm, std::ptr::null_mut()) };
    t.expect_error("mkCommCuDevice(comm, NULL)", r, mkResult_t::mkInvalidArgument, comm, "");
    let r = unsafe { mkCommCount(std::ptr::null_mut(), &mut v) };
    t.expect_error("mkCommCount(NULL, &count)", r, mkResult_t::mkInvalidArgument, std::ptr::null_mut(), "");
}

/// Count 0 (M = 0): success, nothing launched, poisoned outputs untouched.
fn count_zero(comm: mkComm_t, n: usize, t: &mut Tally) -> Result<()> {
    let stream = Stream::new()?;
    let send = TestBuffer::new(1024, mkDataType_t::mkFloat32)?;
    let recv = TestBuffer::new(1024, mkDataType_t::mkFloat32)?;
    send.randomize(1, 1.0, std::ptr::null_mut())?;
    recv.poison(std::ptr::null_mut())?;
    sync_all()?;
    let (s, r) = (send.ptr() as *const c_void, recv.ptr() as *mut c_void);
    let (null_s, null_r) = (std::ptr::null::<c_void>(), std::ptr::null_mut::<c_void>());
    let f32_ = mkDataType_t::mkFloat32 as i32;
    let sum = mkRedOp_t::mkSum as i32;
    let succeeds = |t: &mut Tally, what: &str, rc: mkResult_t| {
        t.check(
            what,
            rc == mkResult_t::mkSuccess,
            format!("{rc:?} {}", if rc == mkResult_t::mkSuccess { String::new() } else { last_error(comm) }),
        );
    };
    // SAFETY (the calls below): count 0 touches no memory; the buffers are valid anyway.
    unsafe {
        succeeds(t, "mkAllGather count 0, NULL buffers", mkAllGather(null_s, null_r, 0, f32_, comm, stream.0));
        succeeds(
            t,
            "mkReduceScatter count 0, NULL buffers",
            mkReduceScatter(null_s, null_r, 0, f32_, sum, comm, stream.0),
        );
        succeeds(t, "mkAllReduce count 0, NULL buffers", mkAllReduce(null_s, null_r, 0, f32_, sum, comm, stream.0));
        succeeds(t, "mkAllGather count 0", mkAllGather(s, r, 0, f32_, comm, stream.0));
        succeeds(t, "mkReduceScatter count 0", mkReduceScatter(s, r, 0, f32_, sum, comm, stream.0));
        succeeds(t, "mkAllReduce count 0", mkAllReduce(s, r, 0, f32_, sum, comm, stream.0));
    }
    let bf16 = mkDataType_t::mkBfloat16;
    let (a, b, c) = (TestBuffer::new(64 * 64, bf16)?, TestBuffer::new(64 * 64, bf16)?, TestBuffer::new(64 * 64, bf16)?);
    a.randomize(2, 1.0, std::ptr::null_mut())?;
    b.randomize(3, 1.0, std::ptr::null_mut())?;
    c.poison(std::ptr::null_mut())?;
    sync_all()?;
    let (ap, bp, cp) = (a.ptr() as *const c_void, b.ptr() as *const c_void, c.ptr() as *mut c_void);
    let d = bf16 as i32;
    // SAFETY: M = 0: nothing is read or written.
    unsafe {
        succeeds(
            t,
            "mkAllGatherGemm M = 0",
            mkAllGatherGemm(ap, bp, cp, std::ptr::null_mut(), 0, 64, 64, d, comm, stream.0),
        );
        succeeds(t, "mkGemmReduceScatter M = 0", mkGemmReduceScatter(ap, bp, cp, 0, 64, 64, d, comm, stream.0));
        succeeds(t, "mkGemmAllReduce M = 0", mkGemmAllReduce(ap, bp, cp, 0, 64, 64, d, comm, stream.0));
        succeeds(t, "mkGemm M = 0", mkGemm(ap, bp, cp, 0, 64, 64, d, stream.0));
    }
    stream.sync()?;
    t.check(
        "count 0 leaves the outputs untouched",
        untouched(&recv)? && untouched(&c)?,
        "recvbuff and C still poisoned, guard bands intact",
    );
    let code = async_error(comm);
    t.check("no asynchronous error after count 0", code == mkResult_t::mkSuccess, format!("{code:?}"));
    let _ = n;
    Ok(())
}

/// Each fused op's rules through the C ABI on a live communicator: mkInvalidArgument, the
/// rule in mkGetLastError, nothing launched.
fn fused_argument_errors(comm: mkComm_t, n: usize, t: &mut Tally) -> Result<()> {
    let stream = Stream::new()?;
    let bf16 = mkDataType_t::mkBfloat16;
    let buf = |count| TestBuffer::new(count, bf16);
    let (a, b, c) = (buf(1 << 16)?, buf(1 << 16)?, buf(1 << 16)?);
    a.randomize(4, 1.0, std::ptr::null_mut())?;
    b.randomize(5, 1.0, std::ptr::null_mut())?;
    c.poison(std::ptr::null_mut())?;
    sync_all()?;
    let (ap, bp, cp) = (a.ptr() as *const c_void, b.ptr() as *const c_void, c.ptr() as *mut c_void);
    let odd = |p: *const c_void| (p as u64 + 2) as *const c_void;
    let null = std::ptr::null::<c_void>();
    let host = vec![0u16; 1 << 16];
    let hp = host.as_ptr() as *const c_void;
    let (d, f32_, unknown) = (bf16 as i32, mkDataType_t::mkFloat32 as i32, 99);
    let m = 16 * n;
    let ag = |a: *const c_void, b: *const c_void, c: *mut c_void, m: usize, nn: usize, k: usize, dt: i32| {
        // SAFETY: every call here breaks a rule and must return before touching memory.
        unsafe { mkAllGatherGemm(a, b, c, std::ptr::null_mut(), m, nn, k, dt, comm, stream.0) }
    };
    let rs = |a: *const c_void, b: *const c_void, c: *mut c_void, m: usize, nn: usize, k: usize, dt: i32| {
        // SAFETY: as above.
        unsafe { mkGemmReduceScatter(a, b, c, m, nn, k, dt, comm, stream.0) }
    };
    let ar = |a: *const c_void, b: *const c_void, c: *mut c_void, m: usize, nn: usize, k: usize, dt: i32| {
        // SAFETY: as above.
        unsafe { mkGemmAllReduce(a, b, c, m, nn, k, dt, comm, stream.0) }
    };
    // Each call, then its message (mkGetLastError holds the last failure only).
    let rejects = |t: &mut Tally, what: &str, r: mkResult_t, needle: &str| {
        t.expect_error(what, r, mkResult_t::mkInvalidArgument, comm, needle)
    };
    rejects(t, "mkAllGatherGemm K = 12", ag(ap, bp, cp, m, 64, 12, d), "K = 12");
    rejects(t, "mkAllGatherGemm N = 12", ag(ap, bp, cp, m, 12, 64, d), "N = 12");
    rejects(t, "mkAllGatherGemm dtype float32", ag(ap, bp, cp, m, 64, 64, f32_), "not supported");
    rejects(t, "mkAllGatherGemm unknown dtype", ag(ap, bp, cp, m, 64, 64, unknown), "99");
    rejects(t, "mkAllGatherGemm misaligned A", ag(odd(ap), bp, cp, m, 64, 64, d), "aligned");
    rejects(t, "mkAllGatherGemm NULL B", ag(ap, null, cp, m, 64, 64, d), "NULL");
    rejects(t, "mkGemmReduceScatter K = 12", rs(ap, bp, cp, m, 64, 12, d), "K = 12");
    rejects(t, "mkGemmReduceScatter N = 12", rs(ap, bp, cp, m, 12, 64, d), "N = 12");
    rejects(t, "mkGemmReduceScatter dtype float32", rs(ap, bp, cp, m, 64, 64, f32_), "not supported");
    rejects(t, "mkGemmReduceScatter misaligned C", rs(ap, bp, odd(cp).cast_mut(), m, 64, 64, d), "aligned");
    rejects(t, "mkGemmReduceScatter NULL A", rs(null, bp, cp, m, 64, 64, d), "NULL");
    rejects(t, "mkGemmAllReduce K = 0", ar(ap, bp, cp, 5, 64, 0, d), "K = 0");
    rejects(t, "mkGemmAllReduce N = 4", ar(ap, bp, cp, 5, 4, 64, d), "N = 4");
    rejects(t, "mkGemmAllReduce unknown dtype", ar(ap, bp, cp, 5, 64, 64, unknown), "99");
    rejects(t, "mkGemmAllReduce NULL B", ar(ap, null, cp, 5, 64, 64, d), "NULL");
    rejects(t, "mkGemmAllReduce misaligned A", ar(odd(ap), bp, cp, 5, 64, 64, d), "aligned");
    if n > 1 {
        // Host memory is refused by the device-pointer check of the multi-rank path; at one
        // rank the ops take the GEMM engine's path, which does not make that check, so a
        // host pointer would reach the kernel: checked with several ranks only.
        rejects(t, "mkAllGatherGemm host A", ag(hp, bp, cp, m, 64, 64, d), "");
        rejects(t, "mkGemmReduceScatter host B", rs(ap, hp, cp, m, 64, 64, d), "");
        rejects(t, "mkAllGatherGemm M not divisible by nranks", ag(ap, bp, cp, m + 1, 64, 64, d), "divisible");
        rejects(t, "mkGemmReduceScatter M not divisible by nranks", rs(ap, bp, cp, m + 1, 64, 64, d), "divisible");
    }

    // MoE: valid sizes are tokens 8, H = F = 128, k = 2, E = 2·nranks, recvCapacity 128.
    let experts = 2 * n;
    let (x, w, y, out) = (buf(8 * 128)?, buf(2 * 128 * 128)?, buf(128 * 128)?, buf(8 * 128)?);
    let idx = TestBuffer::new(16, mkDataType_t::mkInt32)?;
    idx.upload(&[0i32; 16].iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>())?;
    let weights = TestBuffer::new(16, mkDataType_t::mkFloat32)?;
    let counts = TestBuffer::new(experts + 1, mkDataType_t::mkInt32)?;
    let drops = TestBuffer::new(experts, mkDataType_t::mkInt32)?;
    let mut layout_bytes = 0usize;
    // SAFETY: valid out-pointer.
    let r = unsafe { mkMoeLayoutBytes(8, 2, 128, &mut layout_bytes) };
    t.check("mkMoeLayoutBytes", r == mkResult_t::mkSuccess && layout_bytes > 0, format!("{r:?}, {layout_bytes} bytes"));
    let layout = TestBuffer::new(layout_bytes.div_ceil(4), mkDataType_t::mkInt32)?;
    for o in [&y, &out, &counts, &drops, &layout] {
        o.poison(std::ptr::null_mut())?;
    }
    sync_all()?;
    let dispatch = |x: *const c_void, layout: *mut c_void, h: usize, k: usize, e: usize, cap: usize, dt: i32| {
        // SAFETY: every call here breaks a rule and must return before touching memory.
        unsafe {
            mkMoeDispatchGemm(
                x,
                idx.ptr() as *const i32,
                w.ptr() as *const _,
                y.ptr() as *mut _,
                counts.ptr() as *mut i32,
                layout,
                8,
                h,
                128,
                k,
                e,
                cap,
                dt,
                comm,
                stream.0,
            )
        }
    };
    let combine = |out: *mut c_void, h: usize, k: usize, e: usize, cap: usize, dt: i32| {
        // SAFETY: as above.
        unsafe {
            mkMoeGemmCombine(
                y.ptr() as *const _,
                w.ptr() as *const _,
                weights.ptr() as *const f32,
                layout.ptr() as *const _,
                out,
                8,
                h,
                128,
                k,
                e,
                cap,
                dt,
                comm,
                stream.0,
            )
        }
    };
    let (xp, lp, op) = (x.ptr() as *const c_void, layout.ptr() as *mut c_void, out.ptr() as *mut c_void);
    rejects(t, "mkMoeDispatchGemm H = 100", dispatch(xp, lp, 100, 2, experts, 128, d), "H = 100");
    rejects(t, "mkMoeDispatchGemm recvCapacity = 100", dispatch(xp, lp, 128, 2, experts, 100, d), "recvCapacity = 100");
    rejects(t, "mkMoeDispatchGemm k = 33", dispatch(xp, lp, 128, 33, experts, 128, d), "k = 33");
    rejects(t, "mkMoeDispatchGemm E = 2048", dispatch(xp, lp, 128, 2, 2048, 128, d), "E = 2048");
    rejects(t, "mkMoeDispatchGemm dtype float32", dispatch(xp, lp, 128, 2, experts, 128, f32_), "not supported");
    rejects(t, "mkMoeDispatchGemm misaligned x", dispatch(odd(xp), lp, 128, 2, experts, 128, d), "aligned");
    rejects(t, "mkMoeDispatchGemm NULL layout", dispatch(xp, std::ptr::null_mut(), 128, 2, experts, 128, d), "NULL");
    rejects(t, "mkMoeGemmCombine H = 100", combine(op, 100, 2, experts, 128, d), "H = 100");
    rejects(t, "mkMoeGemmCombine recvCapacity = 100", combine(op, 128, 2, experts, 100, d), "recvCapacity = 100");
    rejects(t, "mkMoeGemmCombine unknown dtype", combine(op, 128, 2, experts, 128, unknown), "99");
    rejects(t, "mkMoeGemmCombine NULL out", combine(std::ptr::null_mut(), 128, 2, experts, 128, d), "NULL");
    if n > 1 {
        rejects(t, "mkMoeDispatchGemm E not a multiple of nranks", dispatch(xp, lp, 128, 2, 2 * n + 1, 128, d), "");
    }
    // The options' rules (ops::moe::CapacityPolicy::from_raw), each before any launch.
    let with_options = |options: mkMoeOptions_t, drops: *mut i32| {
        // SAFETY: as above; `options` lives across the call.
        unsafe {
            mkMoeDispatchGemmWithOptions(
                xp,
                idx.ptr() as *const i32,
                w.ptr() as *const _,
                y.ptr() as *mut _,
                counts.ptr() as *mut i32,
                drops,
                lp,
                8,
                128,
                128,
                2,
                experts,
                128,
                d,
                &options,
                comm,
                stream.0,
            )
        }
    };
    let (init, dp) = (mkMoeOptions_t::initializer(), drops.ptr() as *mut i32);
    let drop_mode = |cap| mkMoeOptions_t { capacityPolicy: MK_MOE_DROP, expertCapacity: cap, ..init };
    rejects(t, "drop mode with expertCapacity 0", with_options(drop_mode(0), dp), "expertCapacity = 0");
    rejects(t, "drop mode without dropCounts", with_options(drop_mode(4), std::ptr::null_mut()), "dropCounts is NULL");
    rejects(
        t,
        "capacityPolicy 7",
        with_options(mkMoeOptions_t { capacityPolicy: 7, ..init }, dp),
        "capacityPolicy = 7",
    );
    rejects(t, "options with a wrong magic", with_options(mkMoeOptions_t { magic: 1, ..init }, dp), "options->magic");
    stream.sync()?;
    let untouched_all = untouched(&c)?
        && untouched(&y)?
        && untouched(&out)?
        && untouched(&counts)?
        && untouched(&layout)?
        && untouched(&drops)?;
    t.check(
        "rejected calls launch nothing",
        untouched_all,
        "C, y, out, recvCounts, layout and dropCounts still poisoned, guard bands intact",
    );
    let code = async_error(comm);
    t.check("no asynchronous error after the rejected calls", code == mkResult_t::mkSuccess, format!("{code:?}"));
    Ok(())
}

/// mkCommAbort on a communicator that has just run (and finished) an AllReduce.
fn abort_after_use(env: &RankEnv, control: &Comm, t: &mut Tally) -> Result<()> {
    let (rank, n) = (env.rank, env.nranks);
    let comm = init_comm(env, &fresh_id(control, rank)?, &config(10_000, 16 << 20))?;
    let stream = Stream::new()?;
    let mut case =
        Case::new(CollectiveKind::AllReduce, mkDataType_t::mkFloat32, mkRedOp_t::mkSum, 4099, false, rank, n)?;
    case.prepare(31)?;
    case.launch(comm, stream.0)?;
    stream.sync()?;
    let (ok, detail) = case.verify()?;
    t.check("AllReduce before mkCommAbort", ok, detail);
    control.bootstrap.barrier()?;
    // SAFETY: a live handle; invalid afterwards and not used again.
    let r = unsafe { mkCommAbort(comm) };
    t.check("mkCommAbort on a live communicator", r == mkResult_t::mkSuccess, format!("{r:?}"));
    control.bootstrap.barrier()
}

/// A communicator aborted through the library refuses every new op with mkInvalidUsage.
fn refusal_after_abort(env: &RankEnv, control: &Comm, t: &mut Tally) -> Result<()> {
    let (rank, n) = (env.rank, env.nranks);
    let id = fresh_id(control, rank)?;
    let mut cfg = CommConfig::from_env();
    cfg.workspace_bytes = 16 << 20;
    cfg.timeout = Duration::from_secs(10);
    let comm = Comm::init(&id, n as i32, rank as i32, Some(env.device), cfg)?;
    control.bootstrap.barrier()?;
    comm.abort();
    let (send, recv) = (TestBuffer::new(16, mkDataType_t::mkFloat32)?, TestBuffer::new(16, mkDataType_t::mkFloat32)?);
    let r = mkernel::ops::collectives::collective(
        &comm,
        CollectiveKind::AllReduce,
        send.ptr(),
        recv.ptr(),
        16,
        mkDataType_t::mkFloat32 as i32,
        Some(0),
        std::ptr::null_mut(),
    );
    let ok = matches!(&r, Err(e) if e.code == mkResult_t::mkInvalidUsage && e.message.contains("aborted"));
    t.check("an AllReduce after abort", ok, format!("{:?}", r.as_ref().err().map(|e| (e.code, e.message.clone()))));
    let usable = comm.check_usable();
    t.check(
        "check_usable after abort",
        usable.as_ref().is_err_and(|e| e.code == mkResult_t::mkInvalidUsage),
        format!("{:?}", usable.err().map(|e| e.code)),
    );
    control.bootstrap.barrier()?;
    drop(comm);
    Ok(())
}

/// The last rank aborts its communicator while the others are inside an AllReduce that
/// waits for it: they stop within the timeout and refuse new work.
fn abort_stops_peers(env: &RankEnv, control: &Comm, t: &mut Tally) -> Result<()> {
    let (rank, n) = (env.rank, env.nranks);
    let comm = init_comm(env, &fresh_id(control, rank)?, &config(FAULT_TIMEOUT_MS, 16 << 20))?;
    let stream = Stream::new()?;
    let mut case =
        Case::new(CollectiveKind::AllReduce, mkDataType_t::mkFloat32, mkRedOp_t::mkSum, 1 << 20, false, rank, n)?;
    case.prepare(41)?;
    control.bootstrap.barrier()?;
    if rank == n - 1 {
        std::thread::sleep(Duration::from_millis(300));
        // SAFETY: a live handle, not used again.
        let r = unsafe { mkCommAbort(comm) };
        t.check("mkCommAbort while the peers wait", r == mkResult_t::mkSuccess, format!("{r:?}"));
    } else {
        let start = Instant::now();
        case.launch(comm, stream.0)?;
        let stopped = timed_sync(&stream, longest_op_timeout())
            .and_then(|_| check_stopped(rank, comm, start.elapsed(), "a peer aborted"));
        t.check(
            "peers of an aborted rank stop and refuse new work",
            stopped.is_ok(),
            format!("{:?}", stopped.map_err(|e| e.message)),
        );
        destroy(comm)?;
    }
    control.bootstrap.barrier()
}

/// On a communicator whose every rank is a node of its own, the ops that run within one
/// node only are refused with mkInvalidUsage naming the rule (the arguments are valid).
fn cross_node_refusals(env: &RankEnv, control: &Comm, t: &mut Tally) -> Result<()> {
    let (rank, n) = (env.rank, env.nranks);
    let mut cfg = config(10_000, 16 << 20);
    cfg.ranksPerNode = 1;
    let comm = init_comm(env, &fresh_id(control, rank)?, &cfg)?;
    let stream = Stream::new()?;
    let bf16 = mkDataType_t::mkBfloat16;
    let d = bf16 as i32;
    let experts = 2 * n;
    let buf = |count| TestBuffer::new(count, bf16);
    let (x, w, y, out) = (buf(8 * 128)?, buf(2 * 128 * 128)?, buf(128 * 128)?, buf(8 * 128)?);
    let idx = TestBuffer::new(16, mkDataType_t::mkInt32)?;
    idx.upload(&[0i32; 16].iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>())?;
    let weights = TestBuffer::new(16, mkDataType_t::mkFloat32)?;
    let counts = TestBuffer::new(experts + 1, mkDataType_t::mkInt32)?;
    let mut layout_bytes = 0usize;
    // SAFETY: valid out-pointer.
    unsafe { mkMoeLayoutBytes(8, 2, 128, &mut layout_bytes) };
    let layout = TestBuffer::new(layout_bytes.div_ceil(4), mkDataType_t::mkInt32)?;
    let (q, k, v, o) = (buf(16 * 4 * 64)?, buf(16 * 4 * 64)?, buf(16 * 4 * 64)?, buf(16 * 4 * 64)?);
    let lse = TestBuffer::new(4 * 16, mkDataType_t::mkFloat32)?;
    for b in [&y, &out, &o] {
        b.poison(std::ptr::null_mut())?;
    }
    sync_all()?;
    // SAFETY (the three calls): valid device buffers of the sizes the ops expect; each call
    // must be refused before it touches them. Each message is read right after its call.
    let r = unsafe {
        mkMoeDispatchGemm(
            x.ptr() as *const _,
            idx.ptr() as *const i32,
            w.ptr() as *const _,
            y.ptr() as *mut _,
            counts.ptr() as *mut i32,
            layout.ptr() as *mut _,
            8,
            128,
            128,
            2,
            experts,
            128,
            d,
            comm,
            stream.0,
        )
    };
    t.expect_error("mkMoeDispatchGemm across nodes", r, mkResult_t::mkInvalidUsage, comm, "across nodes");
    let r = unsafe {
        mkMoeGemmCombine(
            y.ptr() as *const _,
            w.ptr() as *const _,
            weights.ptr() as *const f32,
            layout.ptr() as *const _,
            out.ptr() as *mut _,
            8,
            128,
            128,
            2,
            experts,
            128,
            d,
            comm,
            stream.0,
        )
    };
    t.expect_error("mkMoeGemmCombine across nodes", r, mkResult_t::mkInvalidUsage, comm, "across nodes");
    let r = unsafe {
        mkRingAttention(
            q.ptr() as *const _,
            k.ptr() as *const _,
            v.ptr() as *const _,
            o.ptr() as *mut _,
            lse.ptr() as *mut f32,
            1,
            16,
            4,
            4,
            64,
            0.125,
            0,
            d,
            comm,
            stream.0,
        )
    };
    t.expect_error("mkRingAttention across nodes", r, mkResult_t::mkInvalidUsage, comm, "across nodes");
    stream.sync()?;
    t.check(
        "refused calls launch nothing",
        untouched(&y)? && untouched(&out)? && untouched(&o)?,
        "y, out and attention out still poisoned",
    );
    control.bootstrap.barrier()?;
    destroy(comm)
}
