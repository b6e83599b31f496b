//! mkAllGatherGemm's protocol across nodes on the CPU: a port of kernels/ag_gemm.cu's
//! hierarchical path (copy_own_rows, post_own_rows, push_hier, the producer's chunk waits
//! in NodeOrderRaster / RankRotatedRaster order, agg_epoch_end_hier), each emulated CTA two
//! host threads (its pushing side warps and its GEMM producer), the node's "NVLink" plain
//! shared host memory, driven by the real plan (`ops::ag_gemm::plan`, `node_routes`'s rank
//! table) and the real inter-node path (`start_inter_node` with socket transports, a small
//! host-memory proxy ring per rank, so producers hit back-pressure). Several calls run back
//! to back with no barrier between them, with different inputs, and some readers stall:
//! every row the "GEMM" reads must be this call's row of the right source (a sender that
//! overwrote a buffer still being read, or a flag raised before its data, shows here).
//!
//! Keep it in step with the kernel: each block names the kernel function it mirrors.

use mkernel::bootstrap::{root::start_root, Bootstrap, UniqueId};
use mkernel::error::{MkError, Result};
use mkernel::kernel_abi::{self as abi, ProxyCommand, MK_MAX_PEERS, MK_PROXY_KIND_SIGNAL};
use mkernel::ops::common::node_layout::{node_layout, NodeLayout};
use mkernel::ops::dense::ag_gemm::{chunks_for_rows, plan, AgGemmPlan, AgGemmShape, ROW_BLOCK};
use mkernel::transport::inter_node::{start_inter_node, InterNodeSetup};
use mkernel::transport::proxy::{command_header, put_command, HostProducer, ProxyRing};
use mkernel::transport::topology::{node_of_ranks, Topology};
use mkernel::transport::{MemoryKind, MemoryRegion, NetKind, TransportAuth, Window};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

// The kernel's signal words (src/kernel_abi.rs, generated into the kernels' header).
const AGG_EPOCH: usize = abi::AGG_EPOCH as usize;
const AGG_ARRIVE: usize = abi::AGG_ARRIVE as usize;
const AGG_LOCAL: usize = abi::AGG_LOCAL as usize;
const AGG_DONE: usize = abi::AGG_DONE as usize;
const AGG_NET_DONE: usize = abi::AGG_NET_DONE as usize;
const AGG_CHUNK: usize = abi::AGG_CHUNK as usize;
const AGG_PUSHED: usize = abi::AGG_PUSHED as usize;
const SIGNAL_WORDS: usize = abi::AGG_WORDS_END as usize;

const TIMEOUT: Duration = Duration::from_secs(30);
/// f64 elements per row (the kernel's K; 8-byte elements here so rows hold exact values).
const K: usize = 4;
const ROW_BYTES: usize = K * 8;
/// Emulated CTAs per rank.
const CTAS: usize = 3;

/// A rank's window: the gathered buffer [M, K] (gathered_offset 0) and its signal words.
struct HostWindow {
    data: Box<[AtomicU64]>,
    signals: Box<[AtomicU64]>,
}

impl HostWindow {
    fn new(rows: usize) -> HostWindow {
        HostWindow {
            data: (0..rows * K).map(|_| AtomicU64::new(f64::NAN.to_bits())).collect(),
            signals: (0..SIGNAL_WORDS).map(|_| AtomicU64::new(0)).collect(),
        }
    }
    fn window(&self) -> Window {
        Window {
            data: MemoryRegion {
                base: self.data.as_ptr() as u64,
                bytes: (self.data.len() * 8) as u64,
                kind: MemoryKind::Host,
            },
            signals: MemoryRegion {
                base: self.signals.as_ptr() as u64,
                bytes: (8 * SIGNAL_WORDS) as u64,
                kind: MemoryKind::Host,
            },
        }
    }
    fn get(&self, row: usize, e: usize) -> f64 {
        f64::from_bits(self.data[row * K + e].load(Ordering::Relaxed))
    }
    fn set(&self, row: usize, e: usize, v: f64) {
        self.data[row * K + e].store(v.to_bits(), Ordering::Relaxed)
    }
}

/// Element e of global row `row` in call `call` (the row's source is row / rows_per_rank).
fn value(call: u64, row: usize, e: usize) -> f64 {
    ((call * 7919 + row as u64 * 131 + e as u64 * 3) % 100_003) as f64
}

/// Some readers stall (a pseudo-random quarter of (rank, CTA, call, place) sleeps 1 ms).
fn jitter(rank: usize, b: usize, call: u64, place: u64) {
    let h = ((rank as u64 * 0x9e37_79b9) ^ (b as u64 * 0x85eb_ca6b) ^ (call * 0xc2b2_ae35) ^ (place * 0x27d4_eb2f))
        .wrapping_mul(0x1656_67b1);
    if (h >> 29) & 3 == 0 {
        std::thread::sleep(Duration::from_millis(1));
    }
}

struct RankCtx {
    rank: usize,
    nl: NodeLayout,
    /// The node's windows by local rank (the NVLink view).
    local: Vec<Arc<HostWindow>>,
    producer: HostProducer,
    rows_per_rank: usize,
    plan: AgGemmPlan,
}

impl RankCtx {
    fn own(&self) -> &HostWindow {
        &self.local[self.nl.local_rank]
    }
    fn rank_of(&self, node: usize, local: usize) -> usize {
        self.nl.rank_of[node * MK_MAX_PEERS + local] as usize
    }
    fn chunk_word(&self, src: usize, c: usize) -> usize {
        AGG_CHUNK + src * self.plan.flag_stride + c
    }
    fn wait(&self, word: usize, target: u64, what: &str) -> Result<()> {
        let start = Instant::now();
        while self.own().signals[word].load(Ordering::Acquire) < target {
            if start.elapsed() > TIMEOUT {
                return Err(MkError::timeout(format!(
                    "rank {}: {what} (word {word}) never reached {target}",
                    self.rank
                )));
            }
            std::thread::yield_now();
        }
        Ok(())
    }
    fn chunk_rows(&self, c: usize) -> std::ops::Range<usize> {
        let first = c * self.plan.chunk_rows;
        first..(first + self.plan.chunk_rows).min(self.rows_per_rank)
    }
    /// whole_block_shards: no row block mixes two ranks' rows (NodeOrderRaster applies).
    fn whole_blocks(&self) -> bool {
        self.rows_per_rank % ROW_BLOCK == 0
    }
}

/// The caller's A of this rank in call `call`: its rows_per_rank rows.
fn a_local(ctx: &RankCtx, call: u64) -> Vec<f64> {
    let g = ctx.rank;
    (0..ctx.rows_per_rank).flat_map(|i| (0..K).map(move |e| value(call, g * ctx.rows_per_rank + i, e))).collect()
}

/// copy_own_rows: CTA b's slice of the own rows into the own gathered buffer; the last
/// CTA raises the own chunk flags.
fn copy_own_rows(ctx: &RankCtx, a: &[f64], epoch: u64, b: usize) {
    let (rpr, g) = (ctx.rows_per_rank, ctx.rank);
    let slice = rpr.div_ceil(CTAS);
    for i in (b * slice).min(rpr)..((b + 1) * slice).min(rpr) {
        for e in 0..K {
            ctx.own().set(g * rpr + i, e, a[i * K + e]);
        }
    }
    if ctx.own().signals[AGG_LOCAL].fetch_add(1, Ordering::AcqRel) == CTAS as u64 - 1 {
        ctx.own().signals[AGG_LOCAL].store(0, Ordering::Relaxed);
        for c in 0..ctx.plan.chunks_per_rank {
            ctx.own().signals[ctx.chunk_word(g, c)].store(epoch, Ordering::Release);
        }
    }
}

/// post_own_rows: one put per chunk of the own rows to the GPU-l rank of every other node.
fn post_own_rows(ctx: &RankCtx, epoch: u64) -> Result<Option<u64>> {
    let (g, rpr, n, nodes, l) = (ctx.rank, ctx.rows_per_rank, ctx.nl.node, ctx.nl.nodes, ctx.nl.local_rank);
    for c in 0..ctx.plan.chunks_per_rank {
        ctx.wait(ctx.chunk_word(g, c), epoch, "own chunk copied")?;
    }
    let mut ticket = None;
    for i in 1..nodes {
        let m = (n + i) % nodes;
        let peer = ctx.rank_of(m, l);
        ctx.wait(AGG_NET_DONE + m, epoch - 1, "the other node's rank finished the previous call")?;
        for c in 0..ctx.plan.chunks_per_rank {
            let rows = ctx.chunk_rows(c);
            let at = ((g * rpr + rows.start) * ROW_BYTES) as u64;
            let bytes = (rows.len() * ROW_BYTES) as u32;
            let signal = Some((ctx.chunk_word(g, c) as u32, epoch as u32));
            ticket = Some(ctx.producer.post(&put_command(peer as u32, at, at, bytes, signal))?);
        }
    }
    Ok(ticket)
}

/// push_hier for pusher `part` of CTAS.
fn push_hier(ctx: &RankCtx, a: &[f64], epoch: u64, part: usize, call: u64) -> Result<()> {
    let (l, n, nodes, local, g, rpr) =
        (ctx.nl.local_rank, ctx.nl.node, ctx.nl.nodes, ctx.nl.local_size, ctx.rank, ctx.rows_per_rank);
    for j in (0..local).filter(|&j| j != l) {
        ctx.wait(AGG_DONE + j, epoch - 1, "a local peer finished the previous call")?;
    }
    let ticket = if part == 0 { post_own_rows(ctx, epoch)? } else { None };
    for i in 0..nodes {
        let m = (n + i) % nodes;
        let s = ctx.rank_of(m, l);
        for c in 0..ctx.plan.chunks_per_rank {
            if s != g {
                ctx.wait(ctx.chunk_word(s, c), epoch, "a chunk from another node")?;
            }
            jitter(g, part, call, (s * 64 + c) as u64);
            let rows = ctx.chunk_rows(c);
            let slice = rows.len().div_ceil(CTAS);
            let mine = (rows.start + part * slice).min(rows.end)..(rows.start + (part + 1) * slice).min(rows.end);
            for jj in 1..local {
                let j = (l + local - jj) % local;
                for i in mine.clone() {
                    for e in 0..K {
                        let v = if s == g { a[i * K + e] } else { ctx.own().get(s * rpr + i, e) };
                        ctx.local[j].set(s * rpr + i, e, v);
                    }
                }
                let pushed = &ctx.own().signals[AGG_PUSHED + (j * nodes + m) * ctx.plan.flag_stride + c];
                if pushed.fetch_add(1, Ordering::AcqRel) == CTAS as u64 - 1 {
                    pushed.store(0, Ordering::Relaxed);
                    ctx.local[j].signals[ctx.chunk_word(s, c)].store(epoch, Ordering::Release);
                }
            }
        }
    }
    if let Some(t) = ticket {
        ctx.producer.wait_complete(t)?;
    }
    Ok(())
}

/// The GEMM producer of CTA b: its tiles' row blocks in the kernel's order, each after the
/// chunk waits (ChunkAWait::before_a_load), reading and checking every row.
#[allow(clippy::manual_checked_ops)] // bpr > 0 is the raster choice, not a division guard
fn gemm_rows(ctx: &RankCtx, epoch: u64, b: usize, call: u64) -> Result<()> {
    let (g, rpr, nranks) = (ctx.rank, ctx.rows_per_rank, ctx.nl.nodes * ctx.nl.local_size);
    let m = rpr * nranks;
    let tiles_m = m.div_ceil(ROW_BLOCK);
    let bpr = if ctx.whole_blocks() { rpr / ROW_BLOCK } else { 0 };
    // Two column tiles per row block, so every row block is read by two CTAs.
    for t in (b..2 * tiles_m).step_by(CTAS) {
        let k = t % tiles_m;
        let m_block = if bpr > 0 {
            // NodeOrderRaster
            let local = ctx.nl.local_size;
            let src = ctx.rank_of(
                (ctx.nl.node + (k / bpr) / local) % ctx.nl.nodes,
                (ctx.nl.local_rank + (k / bpr) % local) % local,
            );
            src * bpr + k % bpr
        } else {
            // RankRotatedRaster from the own first block
            (k + g * rpr / ROW_BLOCK) % tiles_m
        };
        let row0 = m_block * ROW_BLOCK;
        let rows = ROW_BLOCK.min(m - row0);
        // Every row, own rows too, is read from the gathered buffer after its chunk's flag.
        for (src, c) in chunks_for_rows(&ctx.plan, row0, rows) {
            ctx.wait(ctx.chunk_word(src, c), epoch, "a chunk for a tile")?;
        }
        jitter(g, b + 100, call, t as u64);
        for r in row0..row0 + rows {
            for e in 0..K {
                let got = ctx.own().get(r, e);
                if got != value(call, r, e) {
                    return Err(MkError::internal(format!(
                        "rank {g}, call {call}: gathered row {r} element {e} is {got}, expected {}",
                        value(call, r, e)
                    )));
                }
            }
        }
    }
    Ok(())
}

/// agg_epoch_end_hier: the last CTA advances the epoch, tells the local peers (AGG_DONE)
/// and, through the proxy, the GPU-l rank of every other node (AGG_NET_DONE).
fn epoch_end(ctx: &RankCtx, epoch: u64) -> Result<()> {
    let me = ctx.own();
    if me.signals[AGG_ARRIVE].fetch_add(1, Ordering::AcqRel) == CTAS as u64 - 1 {
        me.signals[AGG_ARRIVE].store(0, Ordering::Relaxed);
        me.signals[AGG_EPOCH].store(epoch, Ordering::Release);
        for (j, w) in ctx.local.iter().enumerate().filter(|&(j, _)| j != ctx.nl.local_rank) {
            let _ = j;
            w.signals[AGG_DONE + ctx.nl.local_rank].store(epoch, Ordering::Release);
        }
        for i in 1..ctx.nl.nodes {
            let m = (ctx.nl.node + i) % ctx.nl.nodes;
            let cmd = ProxyCommand {
                header: command_header(MK_PROXY_KIND_SIGNAL, ctx.rank_of(m, ctx.nl.local_rank) as u32),
                bytes: 0,
                src_offset: 0,
                dst_offset: 0,
                signal_id: (AGG_NET_DONE + ctx.nl.node) as u32,
                signal_value: epoch as u32,
            };
            ctx.producer.post(&cmd)?;
        }
    }
    Ok(())
}

fn rank_main(
    id: &UniqueId,
    rank: usize,
    nranks: usize,
    rpn: u32,
    rows_per_rank: usize,
    windows: &[Arc<HostWindow>],
) -> Result<()> {
    let boot = Bootstrap::join(id, rank, nranks, Duration::from_secs(30))?;
    let nodes = node_of_ranks(boot.host_hashes(), Some(rpn));
    let topology = Topology::new(rank, &nodes)?;
    let setup = InterNodeSetup {
        bootstrap: &boot,
        topology: &topology,
        auth: TransportAuth::from_unique_id(id),
        net: NetKind::Socket,
        window: windows[rank].window(),
        timeout: TIMEOUT,
        // Small: producers must wait for free slots.
        make_ring: Box::new(|| ProxyRing::in_host_memory(4, TIMEOUT)),
        cuda_context: None,
        proxy_cpus: None,
    };
    // SAFETY: the windows outlive the proxy (stopped below, before the scope ends).
    let inter = unsafe { start_inter_node(setup)? }.expect("the ranks span nodes");
    let shape = AgGemmShape { m: rows_per_rank * nranks, n: 64, k: K * 4, nranks, rank };
    let ctx = RankCtx {
        rank,
        nl: node_layout(&topology, &nodes, "test")?,
        local: topology.node_ranks.iter().map(|&r| Arc::clone(&windows[r])).collect(),
        producer: inter.ring.host_producer().expect("a host ring"),
        rows_per_rank,
        plan: plan(&shape, CTAS as u32, None)?,
    };
    // Back to back, no barrier: the protocol alone keeps the calls apart.
    for call in 0..5u64 {
        let a = a_local(&ctx, call);
        let epoch = ctx.own().signals[AGG_EPOCH].load(Ordering::Acquire) + 1;
        std::thread::scope(|s| {
            let ctas: Vec<_> = (0..CTAS)
                .map(|b| {
                    let (ctx, a) = (&ctx, &a);
                    s.spawn(move || -> Result<()> {
                        copy_own_rows(ctx, a, epoch, b);
                        std::thread::scope(|s2| {
                            let side = s2.spawn(|| push_hier(ctx, a, epoch, b, call));
                            let producer = s2.spawn(|| gemm_rows(ctx, epoch, b, call));
                            let r1 = side.join().map_err(|_| MkError::internal("a pusher panicked"))?;
                            let r2 = producer.join().map_err(|_| MkError::internal("a producer panicked"))?;
                            r1.and(r2)
                        })?;
                        epoch_end(ctx, epoch)
                    })
                })
                .collect();
            ctas.into_iter().try_for_each(|h| h.join().map_err(|_| MkError::internal("a CTA thread panicked"))?)
        })
        .map_err(|e| e.context(format!("rank {rank}, call {call} ({:?})", ctx.plan)))?;
    }
    boot.barrier()?;
    inter.proxy.stop()
}

fn run(nranks: usize, rpn: u32, rows_per_rank: usize) {
    std::env::set_var("MK_SOCKET_IFNAME", "=lo");
    let id = start_root().unwrap();
    let windows: Vec<Arc<HostWindow>> =
        (0..nranks).map(|_| Arc::new(HostWindow::new(rows_per_rank * nranks))).collect();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..nranks)
            .map(|r| {
                let (id, windows) = (&id, &windows);
                s.spawn(move || rank_main(id, r, nranks, rpn, rows_per_rank, windows))
            })
            .collect();
        for (r, h) in handles.into_iter().enumerate() {
            h.join()
                .unwrap()
                .unwrap_or_else(|e| panic!("{nranks} ranks, {rpn} per node, {rows_per_rank} rows/rank, rank {r}: {e}"));
        }
    });
}

#[test]
fn two_nodes_of_two_whole_blocks() {
    run(4, 2, 256);
}

#[test]
fn two_nodes_of_two_straddling_blocks() {
    run(4, 2, 100);
}

#[test]
fn three_nodes_of_two() {
    run(6, 2, 128);
}

#[test]
fn four_nodes_of_one() {
    run(4, 1, 384);
}
