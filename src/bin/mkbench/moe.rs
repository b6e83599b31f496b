//! `mkbench moe`: mkMoeDispatchGemm and mkMoeGemmCombine beside the unfused sequences, in
//! the same run:
//!
//!   mkbench moe [-g ranks] [--tokens 4096] [--hidden 7168] [--ffn 2048] [--experts 256] [--topk 8] [-n iters] [-w warmup] [--blocks B] [--trace]
//!
//! Unfused dispatch = the same kernel with its GEMM switched off (the token exchange alone:
//! count exchange, 16-byte-vector copies into the owners' receive buffers, signals), then
//! one GEMM-engine launch per local expert on the received rows (the grouped GEMM as
//! separate launches). Unfused combine = one GEMM launch per local expert into the
//! workspace, then the combine kernel with its GEMM switched off (pull and weighted sum).
//! Uniform routing (k distinct experts per token), bf16, Y' = Y. Medians of CUDA-event-
//! timed calls after warm-up, the slowest rank's. Bandwidth as DeepEP counts it: bytes of
//! the (token, expert) rows a rank sends (dispatch) or receives back (combine) / time of the
//! exchange alone; TFLOP/s per rank = 2·rows·F·H / time, rows = this rank's received rows.
//! `--trace` adds, per direction, one traced call of the fused kernel: per role (GEMM /
//! send or pull CTAs) where the time went (kernels/common/trace.cuh; the pull CTAs' waits
//! are summed over their 12 warps, the GEMM CTAs count 64-row Z slabs as items).

use crate::collectives::Events;
use crate::fused_common::{bad, common_flag, for_each_option, measure_slowest, print_trace, run_ranks};
use crate::measure::Protocol;
use crate::ranks;
use crate::record::{self, Json};
use cudarc::driver::result as cu;
use mkernel::comm::CommConfig;
use mkernel::cuda::{self, PrimaryContext};
use mkernel::error::{mkResult_t, Result};
use mkernel::ops::gemm as engine;
use mkernel::ops::moe::{
    self, device_layout, dispatch_gemm, gemm_combine, validate_combine, validate_dispatch, MoeDims, MoeShape,
};
use mkernel::testing::TestBuffer;
use mkernel::types::mkDataType_t;

struct Options {
    ranks: usize,
    tokens: usize,
    hidden: usize,
    ffn: usize,
    experts: usize,
    top_k: usize,
    iters: usize,
    warmup: usize,
    blocks: usize,
    trace: bool,
}

/// Parses the options without touching a GPU.
pub fn check(_op: &str, args: &[String]) -> Result<()> {
    parse(args).map(|_| ())
}

fn parse(args: &[String]) -> Result<Options> {
    let mut o = Options {
        ranks: ranks::nranks_requested(),
        tokens: 4096,
        hidden: 7168,
        ffn: 2048,
        experts: 256,
        top_k: 8,
        iters: Protocol::DEFAULT.iters,
        warmup: 3,
        blocks: Protocol::DEFAULT.blocks,
        trace: false,
    };
    for_each_option(args, Some(&mut o.trace), |flag, v| {
        let num = || v.parse::<usize>().map_err(|_| bad(flag));
        match flag {
            f if common_flag(f, v, &mut o.ranks, &mut o.iters, &mut o.warmup)? => {}
            "--tokens" => o.tokens = num()?,
            "--hidden" => o.hidden = num()?,
            "--ffn" => o.ffn = num()?,
            "--experts" => o.experts = num()?,
            "--topk" => o.top_k = num()?,
            "--blocks" => o.blocks = num()?,
            other => return Err(bad(other)),
        }
        Ok(())
    })?;
    Protocol { warmup: o.warmup, blocks: o.blocks, iters: o.iters }.validate()?;
    Ok(o)
}

pub fn run(args: &[String]) -> Result<bool> {
    let o = parse(args)?;
    run_ranks("moe", args, o.ranks, &|rank, n, id, device| rank_main(&o, rank, n, id, device))
}

/// Uniform routing: k distinct experts per token, from a per-rank seed.
fn routing(o: &Options, n: usize) -> Vec<Vec<i32>> {
    (0..n)
        .map(|r| {
            let mut s = 0x2545_F491_4F6C_DD1Du64 ^ (r as u64 + 1);
            let mut v = Vec::with_capacity(o.tokens * o.top_k);
            for _ in 0..o.tokens {
                let mut chosen: Vec<i32> = Vec::with_capacity(o.top_k);
                while chosen.len() < o.top_k {
                    s ^= s << 13;
                    s ^= s >> 7;
                    s ^= s << 17;
                    let e = (s % o.experts as u64) as i32;
                    if !chosen.contains(&e) {
                        chosen.push(e);
                    }
                }
                v.extend(chosen);
            }
            v
        })
        .collect()
}

fn rank_main(o: &Options, rank: usize, n: usize, id: &mkernel::bootstrap::UniqueId, device: i32) -> Result<bool> {
    let ctx = PrimaryContext::retain(device)?;
    let _g = ctx.enter()?;
    let dtype = mkDataType_t::mkBfloat16;
    let (t, h, f, k, e) = (o.tokens, o.hidden, o.ffn, o.top_k, o.experts);
    let el = e / n;
    let ids = routing(o, n);
    let layout = device_layout(&MoeShape { tokens: t, top_k: k, experts: e, nranks: n }, &ids, rank)?;
    let cap = layout.rows_needed;
    let dims = MoeDims { tokens: t, hidden: h, ffn: f, top_k: k, experts: e, capacity: cap, nranks: n };
    let mut cfg = CommConfig::from_env();
    cfg.workspace_bytes = cfg.workspace_bytes.max((moe::COUNTS_BYTES + cap * h * 2) as u64);
    let comm = crate::fused_common::init_comm(id, n, rank, device, cfg)?;
    let stream =
        cu::stream::create(cu::stream::StreamKind::NonBlocking).map_err(|e| cuda::cuda_err("cuStreamCreate", e))?;
    let x = TestBuffer::new(t * h, dtype)?;
    let w1 = TestBuffer::new(el * f * h, dtype)?;
    let w2 = TestBuffer::new(el * h * f, dtype)?;
    let y = TestBuffer::new(cap * f, dtype)?;
    let out = TestBuffer::new(t * h, dtype)?;
    let idx = TestBuffer::new(t * k, mkDataType_t::mkInt32)?;
    let wts = TestBuffer::new(t * k, mkDataType_t::mkFloat32)?;
    let counts = TestBuffer::new(el + 1, mkDataType_t::mkInt32)?;
    let lay = TestBuffer::new(moe::layout_offsets(t, k, cap).words, mkDataType_t::mkInt32)?;
    x.randomize(5 + rank as u64, 1.0, stream)?;
    w1.randomize(50 + rank as u64, 0.05, stream)?;
    w2.randomize(80 + rank as u64, 0.05, stream)?;
    wts.randomize(90 + rank as u64, 1.0, stream)?;
    idx.upload(&ids[rank].iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>())?;
    let dargs = validate_dispatch(x.ptr(), idx.ptr(), w1.ptr(), y.ptr(), counts.ptr(), lay.ptr(), dims, dtype as i32)?;
    let cargs = validate_combine(y.ptr(), w2.ptr(), wts.ptr(), lay.ptr(), out.ptr(), dims, dtype as i32)?;
    let recv = moe::region_buffer(&comm).expect("data plane");
    // The unfused grouped GEMMs: one engine launch per local expert with rows.
    let sms = cuda::sm_count(device)? as usize;
    let grid = comm.config.max_ctas.map_or(sms, |v| v as usize);
    let mut g1 = Vec::new();
    let mut g2 = Vec::new();
    for le in 0..el {
        let rows = layout.recv_counts[le];
        if rows == 0 {
            continue;
        }
        let base = layout.expert_base[le];
        let a1 = engine::validate(
            recv + (base * h * 2) as u64,
            w1.ptr() + (le * f * h * 2) as u64,
            y.ptr() + (base * f * 2) as u64,
            rows,
            f,
            h,
            dtype as i32,
        )?;
        let p1 = engine::plan(
            rows,
            f,
            grid,
            a1.tma_epilogue_ok(),
            engine::PlanOverrides { max_ctas: Some(grid), ..Default::default() },
        );
        g1.push((a1, p1));
        let a2 = engine::validate(
            y.ptr() + (base * f * 2) as u64,
            w2.ptr() + (le * h * f * 2) as u64,
            recv + (base * h * 2) as u64,
            rows,
            h,
            f,
            dtype as i32,
        )?;
        let p2 = engine::plan(
            rows,
            h,
            grid,
            a2.tma_epilogue_ok(),
            engine::PlanOverrides { max_ctas: Some(grid), ..Default::default() },
        );
        g2.push((a2, p2));
    }
    let events = Events::new(o.iters)?;
    let gemm1 = || g1.iter().try_for_each(|(a, p)| engine::launch(a, p, stream));
    let gemm2 = || g2.iter().try_for_each(|(a, p)| engine::launch(a, p, stream));
    // The dispatch leaves the layout the combines read; a combine may be repeated on it.
    // Every contender in the shared protocol. Each dispatch rebuilds the same layout the
    // combines read (the warm-up runs the fused dispatch first), so any order is valid.
    let fused_dispatch = || dispatch_gemm(&comm, &dargs, true, stream);
    let exchange_dispatch = || dispatch_gemm(&comm, &dargs, false, stream);
    let unfused_dispatch = || exchange_dispatch().and_then(|_| gemm1());
    let fused_combine = || gemm_combine(&comm, &cargs, true, stream);
    let exchange_combine = || gemm_combine(&comm, &cargs, false, stream);
    let unfused_combine = || gemm2().and_then(|_| exchange_combine());
    let contenders: [&dyn Fn() -> Result<()>; 8] = [
        &fused_dispatch,
        &exchange_dispatch,
        &unfused_dispatch,
        &gemm1,
        &fused_combine,
        &gemm2,
        &exchange_combine,
        &unfused_combine,
    ];
    let protocol = Protocol { warmup: o.warmup.max(1), blocks: o.blocks, iters: o.iters };
    let stats = measure_slowest(&comm, &events, stream, protocol, &contenders)?;
    let [t_fd, t_xd, t_ud, t_g1, t_fc, t_g2, t_xc, t_uc] = [0, 1, 2, 3, 4, 5, 6, 7].map(|i| stats[i].median);
    if o.trace {
        print_trace(&comm, stream, "moe dispatch", &|buf| {
            dispatch_gemm(&comm, &moe::DispatchArgs { trace: buf, ..dargs }, true, stream)
        })?;
        print_trace(&comm, stream, "moe combine", &|buf| {
            gemm_combine(&comm, &moe::CombineArgs { trace: buf, ..cargs }, true, stream)
        })?;
    }
    let err = comm.async_error();
    let rows: usize = layout.recv_counts.iter().sum();
    let sent_rows: usize = layout
        .slots
        .iter()
        .enumerate()
        .filter(|(i, s)| s.is_some() && !ids[rank][i / k * k..*i].contains(&ids[rank][*i]))
        .count();
    let all = comm.bootstrap.allgather(&[(rows as u64).to_le_bytes(), (sent_rows as u64).to_le_bytes()].concat())?;
    let max_rows = all.iter().map(|v| u64::from_le_bytes(v[..8].try_into().unwrap())).max().unwrap_or(0) as f64;
    if rank == 0 {
        let tf = |us: f64| 2.0 * max_rows * f as f64 * h as f64 / (us * 1e-6) / 1e12;
        let gbs = |us: f64| sent_rows as f64 * h as f64 * 2.0 / (us * 1e-6) / 1e9;
        println!(
            "# mkbench moe: {n} rank(s), bf16, T={t}/rank, H={h}, F={f}, E={e}, k={k}, {sms} SMs, MK_MAX_CTAS={}, recvCapacity={cap}, rows/rank <= {max_rows}, warm-up {} then {} interleaved blocks of {} calls (median of the slowest rank per call); outputs not verified here (mktest moe checks them)",
            comm.config.max_ctas.map_or("-".into(), |v| v.to_string()),
            o.warmup,
            o.blocks,
            o.iters
        );
        println!(
            "# {:<9} | {:>10} {:>7} | {:>10} {:>7} | {:>9} | {:>10} {:>7} | {:>9} {:>8}",
            "direction",
            "fused us",
            "TF/s",
            "unfused us",
            "TF/s",
            "fused/unf",
            "exchange us",
            "GB/s",
            "GEMMs us",
            "GEMM TF/s"
        );
        println!(
            "  {:<9} | {:>10.1} {:>7.1} | {:>10.1} {:>7.1} | {:>9.3} | {:>10.1} {:>7.1} | {:>9.1} {:>8.1}",
            "dispatch",
            t_fd,
            tf(t_fd),
            t_ud,
            tf(t_ud),
            t_fd / t_ud,
            t_xd,
            gbs(t_xd),
            t_g1,
            tf(t_g1)
        );
        println!(
            "  {:<9} | {:>10.1} {:>7.1} | {:>10.1} {:>7.1} | {:>9.3} | {:>10.1} {:>7.1} | {:>9.1} {:>8.1}{}",
            "combine",
            t_fc,
            tf(t_fc),
            t_uc,
            tf(t_uc),
            t_fc / t_uc,
            t_xc,
            gbs(t_xc),
            t_g2,
            tf(t_g2),
            if err == mkResult_t::mkSuccess { String::new() } else { format!("  ASYNC ERROR {err:?}") }
        );
        let c = |name: &str, i: usize| record::contender(name, Some(stats[i]), None);
        let shape = |direction: &str| {
            record::shape(
                &[("ranks", n), ("tokens", t), ("hidden", h), ("ffn", f), ("experts", e), ("topk", k)],
                &[("direction", direction)],
            )
        };
        let extra = |baseline: &str| {
            [
                ("async_error", Json::Bool(err != mkResult_t::mkSuccess)),
                ("baseline", Json::str(baseline)),
                ("verified", Json::Bool(false)),
            ]
        };
        record::row(
            shape("dispatch"),
            vec![c("fused", 0), c("exchange+per_expert_gemms", 2), c("exchange", 1), c("per_expert_gemms", 3)],
            &extra("exchange+per_expert_gemms (one GEMM launch per expert; no grouped GEMM)"),
        );
        record::row(
            shape("combine"),
            vec![c("fused", 4), c("per_expert_gemms+exchange", 7), c("exchange", 6), c("per_expert_gemms", 5)],
            &extra("per_expert_gemms+exchange (one GEMM launch per expert; no grouped GEMM)"),
        );
    }
    // SAFETY: live stream.
    unsafe { cu::stream::synchronize(stream) }.map_err(|e| cuda::cuda_err("cuStreamSynchronize", e))?;
    Ok(err == mkResult_t::mkSuccess)
}
