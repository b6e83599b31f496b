//! The hierarchical collectives' protocol on the CPU: a line-by-line port of the step loop
//! of kernels/hier_collectives.cu (each emulated CTA a host thread, the node's "NVLink"
//! plain shared host memory), driven by the real plan (`ops::hier_collectives::plan`), the
//! real signal-word layout (kernels/common/signals.cuh), and the real inter-node path:
//! `start_inter_node` with socket transports between ranks, a host-memory proxy ring per
//! rank (small, so producers hit back-pressure), a proxy thread draining it. Several calls
//! run back to back with no barrier between them, through tiny slots (many steps per CTA,
//! both slot parities, grants, completions across calls), at 4 ranks in 2 nodes, 6 in 3
//! and 4 in 4. What it checks is the protocol (grants, arrival flags, completion before
//! reuse, the step counters, who sends what where); the CUDA itself runs first in
//! `mktest nodes` on the GPU.
//!
//! Keep it in step with the kernel: each block below names the kernel step it mirrors.

use mkernel::bootstrap::{root::start_root, Bootstrap, UniqueId};
use mkernel::error::{MkError, Result};
use mkernel::kernel_abi::{self as abi, ProxyCommand, MK_MAX_NODES, MK_MAX_PEERS, MK_PROXY_KIND_SIGNAL};
use mkernel::ops::collectives::hier::{plan, HierPlan};
use mkernel::ops::collectives::CollectiveKind;
use mkernel::ops::common::node_layout::{node_layout, NodeLayout};
use mkernel::transport::inter_node::{start_inter_node, InterNodeSetup};
use mkernel::transport::proxy::{command_header, put_command, HostProducer, ProxyRing};
use mkernel::transport::topology::{node_of_ranks, Topology};
use mkernel::transport::{NetKind, TransportAuth};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod common;
use common::HostWindow;

// The kernels' signal words (src/kernel_abi.rs, generated into the kernels' header).
const SIG_SEQ: usize = abi::MK_SIG_SEQ as usize;
const SIG_READY: usize = abi::MK_SIG_READY as usize;
const SIG_READY2: usize = abi::MK_SIG_READY2 as usize;
const SIG_FREE: usize = abi::MK_SIG_FREE as usize;
const SIG_NET_GRANT: usize = abi::MK_SIG_NET_GRANT as usize;
const SIG_NET_READY: usize = abi::MK_SIG_NET_READY as usize;
const SIG_NET_READY2: usize = abi::MK_SIG_NET_READY2 as usize;
const SIGNAL_WORDS: usize = abi::MK_SIG_OP_BASE as usize;

const TIMEOUT: Duration = Duration::from_secs(30);

/// One rank as its kernel sees it.
struct RankCtx {
    rank: usize,
    nranks: usize,
    nl: NodeLayout,
    /// The node's windows by local rank (the NVLink view).
    local: Vec<Arc<HostWindow>>,
    producer: HostProducer,
}

impl RankCtx {
    fn own(&self) -> &HostWindow {
        &self.local[self.nl.local_rank]
    }
    fn rank_of(&self, node: usize, local: usize) -> usize {
        self.nl.rank_of[node * MK_MAX_PEERS + local] as usize
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
    // hier_wait_local: every local peer's word first + j.
    fn wait_local(&self, first: usize, target: u64, what: &str) -> Result<()> {
        for j in (0..self.nl.local_size).filter(|&j| j != self.nl.local_rank) {
            self.wait(first + j, target, what)?;
        }
        Ok(())
    }
    // hier_wait_net: every other node's word first + m.
    fn wait_net(&self, first: usize, target: u64, what: &str) -> Result<()> {
        for m in (0..self.nl.nodes).filter(|&m| m != self.nl.node) {
            self.wait(first + m, target, what)?;
        }
        Ok(())
    }
    // mk_cta_signal_peers: word first + l at every local peer.
    fn signal_local(&self, first: usize, value: u64) {
        for (j, w) in self.local.iter().enumerate().filter(|&(j, _)| j != self.nl.local_rank) {
            let _ = j;
            w.signals[first + self.nl.local_rank].store(value, Ordering::Release);
        }
    }
    // hier_grant
    fn grant(&self, b: usize, step: u64) -> Result<u64> {
        let mut ticket = 0;
        for m in (0..self.nl.nodes).filter(|&m| m != self.nl.node) {
            let peer = self.rank_of(m, self.nl.local_rank) as u32;
            let cmd = ProxyCommand {
                header: command_header(MK_PROXY_KIND_SIGNAL, peer),
                bytes: 0,
                src_offset: 0,
                dst_offset: 0,
                signal_id: (SIG_NET_GRANT + b * MK_MAX_NODES + self.nl.node) as u32,
                signal_value: step as u32,
            };
            ticket = self.producer.post(&cmd)?;
        }
        Ok(ticket)
    }
    // hier_send: wait for m's grant, put part(m), flag word first + n at the peer.
    fn send(&self, b: usize, step: u64, first: usize, part: impl Fn(usize) -> (u64, u64, u64)) -> Result<Option<u64>> {
        let mut ticket = None;
        for m in (0..self.nl.nodes).filter(|&m| m != self.nl.node) {
            let peer = self.rank_of(m, self.nl.local_rank);
            self.wait(SIG_NET_GRANT + b * MK_MAX_NODES + m, step, "a grant")?;
            let (src, dst, bytes) = part(m);
            let signal = Some(((first + self.nl.node) as u32, step as u32));
            ticket = Some(self.producer.post(&put_command(peer as u32, src, dst, bytes as u32, signal))?);
        }
        Ok(ticket)
    }
}

/// Some readers are slow (a pseudo-random quarter of (rank, CTA, step, place) stalls 2 ms
/// before reading): a writer that ignored the flow control would overwrite a slot they
/// are still reading, and the result would be wrong.
fn jitter(rank: usize, b: usize, step: u64, place: u64) {
    let h = ((rank as u64 * 0x9e37_79b9) ^ (b as u64 * 0x85eb_ca6b) ^ (step * 0xc2b2_ae35) ^ (place * 0x27d4_eb2f))
        .wrapping_mul(0x1656_67b1);
    if (h >> 29) & 3 == 0 {
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// One call's inputs and output of one rank (f64 values, exact sums).
struct Call {
    kind: CollectiveKind,
    count: u64,
    plan: HierPlan,
    send: Vec<f64>,
    recv: Vec<AtomicU64>,
}

fn input(call: u64, rank: usize, i: usize) -> f64 {
    ((call * 7919 + rank as u64 * 131 + i as u64 * 3) % 1000) as f64 - 500.0
}

/// The step loop of one CTA (kernels/hier_collectives.cu `hier_collective`), sum only.
fn cta(ctx: &RankCtx, call: &Call, b: usize) -> Result<()> {
    let p = &call.plan;
    let (l, n, nodes, local) = (ctx.nl.local_rank, ctx.nl.node, ctx.nl.nodes, ctx.nl.local_size);
    let r = ctx.nranks;
    let es = 8u64;
    let sub = p.sub_bytes;
    let chunk = p.chunk;
    let npieces = call.count.div_ceil(chunk);
    let ready = SIG_READY + b * MK_MAX_PEERS;
    let ready2 = SIG_READY2 + b * MK_MAX_PEERS;
    let freed = SIG_FREE + b * MK_MAX_PEERS;
    let net_ready = SIG_NET_READY + b * MK_MAX_NODES;
    let net_ready2 = SIG_NET_READY2 + b * MK_MAX_NODES;
    let me = ctx.own();
    let set_recv = |i: u64, v: f64| call.recv[i as usize].store(v.to_bits(), Ordering::Relaxed);
    let mut step = me.signals[SIG_SEQ + b].load(Ordering::Relaxed);
    let mut last_ticket: [Option<u64>; 2] = [None, None];
    let mut final_ticket = None;
    let mut g = b as u64;
    while g < npieces {
        step += 1;
        let par = (step & 1) as usize;
        let off = g * chunk;
        let nel = chunk.min(call.count - off);
        let slot_off = b as u64 * p.region_bytes + par as u64 * p.slot_bytes;
        // 1. drain, local FREE, grant
        if let Some(t) = last_ticket[par] {
            ctx.producer.wait_complete(t)?;
        }
        if step > 2 {
            ctx.wait_local(freed, step - 2, "FREE")?;
        }
        last_ticket[par] = Some(ctx.grant(b, step)?);
        let slice = |q: usize| ((q as u64 * p.slice).min(nel), ((q as u64 * p.slice).min(nel) + p.slice).min(nel));
        match call.kind {
            CollectiveKind::AllGather => {
                let gather = slot_off + p.gather_off;
                for i in 0..nel {
                    let v = call.send[(off + i) as usize];
                    me.write_f64(gather + n as u64 * sub + i * es, v);
                    set_recv(ctx.rank as u64 * call.count + off + i, v);
                }
                let at = gather + n as u64 * sub;
                if let Some(t) = ctx.send(b, step, net_ready, |_| (at, at, nel * es))? {
                    last_ticket[par] = Some(t);
                }
                ctx.wait_net(net_ready, step, "AG arrivals")?;
                ctx.signal_local(ready, step);
                ctx.wait_local(ready, step, "READY")?;
                jitter(ctx.rank, b, step, 1);
                for i in 0..local {
                    let j = (l + i) % local;
                    for m in 0..nodes {
                        if j == l && m == n {
                            continue;
                        }
                        let q = ctx.rank_of(m, j) as u64;
                        for e in 0..nel {
                            set_recv(q * call.count + off + e, ctx.local[j].read_f64(gather + m as u64 * sub + e * es));
                        }
                    }
                }
                ctx.signal_local(freed, step);
            }
            CollectiveKind::ReduceScatter => {
                for q in 0..r as u64 {
                    for e in 0..nel {
                        me.write_f64(
                            slot_off + p.stage_off + q * sub + e * es,
                            call.send[(q * call.count + off + e) as usize],
                        );
                    }
                }
                ctx.signal_local(ready, step);
                ctx.wait_local(ready, step, "READY")?;
                jitter(ctx.rank, b, step, 2);
                for m in 0..nodes {
                    let o = ctx.rank_of(m, l) as u64;
                    let dst =
                        slot_off + if m == n { p.inbox_off + n as u64 * sub } else { p.outbox_off + m as u64 * sub };
                    for e in 0..nel {
                        let s: f64 =
                            (0..local).map(|j| ctx.local[j].read_f64(slot_off + p.stage_off + o * sub + e * es)).sum();
                        me.write_f64(dst + e * es, s);
                    }
                }
                ctx.signal_local(freed, step);
                let t = ctx.send(b, step, net_ready, |m| {
                    (slot_off + p.outbox_off + m as u64 * sub, slot_off + p.inbox_off + n as u64 * sub, nel * es)
                })?;
                if let Some(t) = t {
                    last_ticket[par] = Some(t);
                }
                ctx.wait_net(net_ready, step, "RS partials")?;
                jitter(ctx.rank, b, step, 3);
                for e in 0..nel {
                    let s: f64 =
                        (0..nodes).map(|m| me.read_f64(slot_off + p.inbox_off + m as u64 * sub + e * es)).sum();
                    set_recv(off + e, s);
                }
            }
            CollectiveKind::AllReduce => {
                for e in 0..nel {
                    me.write_f64(slot_off + p.stage_off + e * es, call.send[(off + e) as usize]);
                }
                ctx.signal_local(ready, step);
                ctx.wait_local(ready, step, "READY")?;
                jitter(ctx.rank, b, step, 4);
                for m in 0..nodes {
                    let (lo, hi) = slice(ctx.rank_of(m, l));
                    let dst =
                        slot_off + if m == n { p.inbox_off + n as u64 * sub } else { p.outbox_off + m as u64 * sub };
                    for e in lo..hi {
                        let s: f64 = (0..local).map(|j| ctx.local[j].read_f64(slot_off + p.stage_off + e * es)).sum();
                        me.write_f64(dst + (e - lo) * es, s);
                    }
                }
                let t = ctx.send(b, step, net_ready, |m| {
                    let (lo, hi) = slice(ctx.rank_of(m, l));
                    (slot_off + p.outbox_off + m as u64 * sub, slot_off + p.inbox_off + n as u64 * sub, (hi - lo) * es)
                })?;
                if let Some(t) = t {
                    last_ticket[par] = Some(t);
                }
                ctx.wait_net(net_ready, step, "AR partials")?;
                jitter(ctx.rank, b, step, 5);
                let (lo, hi) = slice(ctx.rank);
                for e in lo..hi {
                    let s: f64 =
                        (0..nodes).map(|m| me.read_f64(slot_off + p.inbox_off + m as u64 * sub + (e - lo) * es)).sum();
                    set_recv(off + e, s);
                    me.write_f64(slot_off + p.gather_off + n as u64 * sub + (e - lo) * es, s);
                }
                let at = slot_off + p.gather_off + n as u64 * sub;
                if let Some(t) = ctx.send(b, step, net_ready2, |_| (at, at, (hi - lo) * es))? {
                    last_ticket[par] = Some(t);
                }
                ctx.wait_net(net_ready2, step, "AR slices")?;
                ctx.signal_local(ready2, step);
                ctx.wait_local(ready2, step, "READY2")?;
                jitter(ctx.rank, b, step, 6);
                for i in 0..local {
                    let j = (l + i) % local;
                    for m in 0..nodes {
                        if j == l && m == n {
                            continue;
                        }
                        let (qlo, qhi) = slice(ctx.rank_of(m, j));
                        for e in qlo..qhi {
                            set_recv(
                                off + e,
                                ctx.local[j].read_f64(slot_off + p.gather_off + m as u64 * sub + (e - qlo) * es),
                            );
                        }
                    }
                }
                ctx.signal_local(freed, step);
            }
        }
        final_ticket = last_ticket[par];
        g += p.ctas as u64;
    }
    if let Some(t) = final_ticket {
        ctx.producer.wait_complete(t)?;
    }
    me.signals[SIG_SEQ + b].store(step, Ordering::Relaxed);
    Ok(())
}

fn expected(kind: CollectiveKind, call: u64, rank: usize, nranks: usize, count: u64) -> Vec<f64> {
    let c = count as usize;
    match kind {
        CollectiveKind::AllGather => (0..nranks).flat_map(|q| (0..c).map(move |i| input(call, q, i))).collect(),
        CollectiveKind::ReduceScatter => {
            (0..c).map(|i| (0..nranks).map(|q| input(call, q, rank * c + i)).sum()).collect()
        }
        CollectiveKind::AllReduce => (0..c).map(|i| (0..nranks).map(|q| input(call, q, i)).sum()).collect(),
    }
}

const DATA_BYTES: u64 = 8192;
const CTA_SLOTS: u32 = 2;

fn rank_main(id: &UniqueId, rank: usize, nranks: usize, rpn: u32, windows: &[Arc<HostWindow>]) -> Result<()> {
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
    // SAFETY: the windows are leaked.
    let inter = unsafe { start_inter_node(setup)? }.expect("the ranks span nodes");
    let ctx = RankCtx {
        rank,
        nranks,
        nl: node_layout(&topology, &nodes, "test")?,
        local: topology.node_ranks.iter().map(|&r| Arc::clone(&windows[r])).collect(),
        producer: inter.ring.host_producer().expect("a host ring"),
    };
    // Back to back, no barrier: the protocol alone keeps the calls apart.
    let calls = [
        (CollectiveKind::AllGather, 1000u64),
        (CollectiveKind::ReduceScatter, 300),
        (CollectiveKind::AllReduce, 1001),
        (CollectiveKind::AllGather, 77),
        (CollectiveKind::AllReduce, 5),
        (CollectiveKind::ReduceScatter, 129),
    ];
    for (c, &(kind, count)) in calls.iter().enumerate() {
        let mut p = plan(kind, count, 8, ctx.nl.nodes as u64, ctx.nl.local_size as u64, CTA_SLOTS, DATA_BYTES)?;
        // Every CTA slot in use, as a large message would (the plan gives small ones one CTA).
        p.ctas = (CTA_SLOTS as u64).min(count.div_ceil(p.chunk)) as u32;
        let send_len = if kind == CollectiveKind::ReduceScatter { nranks as u64 * count } else { count };
        let recv_len = if kind == CollectiveKind::AllGather { nranks as u64 * count } else { count };
        let call = Call {
            kind,
            count,
            plan: p,
            send: (0..send_len as usize).map(|i| input(c as u64, rank, i)).collect(),
            recv: (0..recv_len).map(|_| AtomicU64::new(f64::NAN.to_bits())).collect(),
        };
        std::thread::scope(|s| {
            let ctas: Vec<_> = (0..p.ctas as usize)
                .map(|b| {
                    s.spawn({
                        let (ctx, call) = (&ctx, &call);
                        move || cta(ctx, call, b)
                    })
                })
                .collect();
            ctas.into_iter().try_for_each(|h| h.join().map_err(|_| MkError::internal("a CTA thread panicked"))?)
        })
        .map_err(|e| e.context(format!("rank {rank}, call {c} ({kind:?}, count {count}, plan {p:?})")))?;
        let want = expected(kind, c as u64, rank, nranks, count);
        let got: Vec<f64> = call.recv.iter().map(|v| f64::from_bits(v.load(Ordering::Relaxed))).collect();
        if let Some(i) = (0..want.len()).find(|&i| got[i] != want[i]) {
            return Err(MkError::internal(format!(
                "rank {rank}, call {c} ({kind:?}, count {count}): element {i} is {}, expected {} ({p:?})",
                got[i], want[i]
            )));
        }
    }
    boot.barrier()?;
    inter.proxy.stop()
}

fn run(nranks: usize, rpn: u32) {
    std::env::set_var("MK_SOCKET_IFNAME", "=lo");
    let id = start_root().unwrap();
    let windows: Vec<Arc<HostWindow>> =
        (0..nranks).map(|_| Arc::new(HostWindow::new(DATA_BYTES as usize, SIGNAL_WORDS, 0))).collect();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..nranks)
            .map(|r| {
                let (id, windows) = (&id, &windows);
                s.spawn(move || rank_main(id, r, nranks, rpn, windows))
            })
            .collect();
        for (r, h) in handles.into_iter().enumerate() {
            h.join().unwrap().unwrap_or_else(|e| panic!("{nranks} ranks, {rpn} per node, rank {r}: {e}"));
        }
    });
}

#[test]
fn two_nodes_of_two() {
    run(4, 2);
}

#[test]
fn three_nodes_of_two() {
    run(6, 2);
}

#[test]
fn four_nodes_of_one() {
    run(4, 1);
}
