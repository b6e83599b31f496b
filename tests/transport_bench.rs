//! CPU measurement of the inter-node path (proxy ring → proxy thread → socket transport →
//! peer's window), with host threads standing in for the kernels and host memory for the
//! windows: no GPU. Ignored (timing is not a test); run by hand:
//!   cargo test --release --test transport_bench -- --ignored --nocapture --test-threads=1
//! - `latency`: signal-only round trips between two ranks (a grant's path), and 64 KiB
//!   put round trips;
//! - `throughput`: one rank streams puts of 1–64 MiB (1 MiB commands, as big puts go)
//!   to another, both directions at once;
//! - `hier_steps`: the hierarchical collectives' step as the kernel does it (grant, wait
//!   for the peer's grant, put with arrival flag, wait for the peer's put, wait for
//!   completion), C "CTAs" per rank, 4 ranks in 2 emulated nodes — the 1, 4, 16 and
//!   64 MB AllGather cases of `mkbench all_gather -g 4` under MK_RANKS_PER_NODE=2.
//!
//! The staging through pinned memory that device windows add is measured on the GPU only
//! (mkbench with MK_DEBUG=INFO logs where each transport thread's time went).

use mkernel::bootstrap::{root::start_root, Bootstrap, UniqueId};
use mkernel::error::{MkError, Result};
use mkernel::kernel_abi::{ProxyCommand, MK_PROXY_KIND_SIGNAL};
use mkernel::transport::inter_node::{start_inter_node, InterNodeSetup};
use mkernel::transport::proxy::{command_header, put_command, quick_sleeps, HostProducer, Proxy, ProxyRing};
use mkernel::transport::topology::{node_of_ranks, Topology};
use mkernel::transport::{NetKind, TransportAuth};
use std::sync::atomic::Ordering;
use std::sync::Barrier;
use std::time::{Duration, Instant};

mod common;
use common::HostWindow;

const TIMEOUT: Duration = Duration::from_secs(30);
const WORDS: usize = 4096;

/// Waits until the window's signal `word` reaches `target` (bounded).
fn wait(w: &HostWindow, word: usize, target: u64) -> Result<()> {
    let start = Instant::now();
    let mut spins = 0u32;
    while w.signals[word].load(Ordering::Acquire) < target {
        if start.elapsed() > TIMEOUT {
            return Err(MkError::timeout(format!("word {word} never reached {target}")));
        }
        spins += 1;
        if spins > 64 {
            // Sleep, not yield: dozens of emulated CTAs must not starve the transport
            // threads of the CPU (a kernel spins on the GPU, not here).
            quick_sleeps();
            std::thread::sleep(Duration::from_micros(10));
        }
    }
    Ok(())
}

struct Rank {
    boot: Bootstrap,
    topology: Topology,
    window: HostWindow,
    producer: HostProducer,
    proxy: Proxy,
}

fn set_up(id: &UniqueId, rank: usize, nranks: usize, per_node: u32, data_bytes: usize) -> Result<Rank> {
    let boot = Bootstrap::join(id, rank, nranks, TIMEOUT)?;
    let topology = Topology::new(rank, &node_of_ranks(boot.host_hashes(), Some(per_node)))?;
    let window = HostWindow::new(data_bytes, WORDS, 1);
    let setup = InterNodeSetup {
        bootstrap: &boot,
        topology: &topology,
        auth: TransportAuth::from_unique_id(id),
        net: NetKind::Socket,
        window: window.window(),
        timeout: TIMEOUT,
        make_ring: Box::new(|| ProxyRing::in_host_memory(1024, TIMEOUT)),
        cuda_context: None,
        proxy_cpus: None,
    };
    // SAFETY: the window is leaked.
    let inter = unsafe { start_inter_node(setup)? }.expect("the ranks span nodes");
    let producer = inter.ring.host_producer().expect("a host ring");
    Ok(Rank { boot, topology, window, producer, proxy: inter.proxy })
}

fn signal(peer: usize, word: usize, value: u64) -> ProxyCommand {
    ProxyCommand {
        header: command_header(MK_PROXY_KIND_SIGNAL, peer as u32),
        bytes: 0,
        src_offset: 0,
        dst_offset: 0,
        signal_id: word as u32,
        signal_value: value as u32,
    }
}

/// Runs `body` on `nranks` ranks (threads) in nodes of `per_node`.
fn ranks(nranks: usize, per_node: u32, data_bytes: usize, body: impl Fn(&Rank) -> Result<()> + Sync) {
    std::env::set_var("MK_SOCKET_IFNAME", "=lo");
    let id = start_root().unwrap();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..nranks)
            .map(|r| {
                let (id, body) = (&id, &body);
                s.spawn(move || -> Result<()> {
                    let rank = set_up(id, r, nranks, per_node, data_bytes)?;
                    body(&rank)?;
                    rank.boot.barrier()?;
                    rank.proxy.stop()
                })
            })
            .collect();
        for (r, h) in handles.into_iter().enumerate() {
            h.join().unwrap().unwrap_or_else(|e| panic!("rank {r}: {e}"));
        }
    });
}

#[test]
#[ignore]
fn latency() {
    const ROUNDS: u64 = 2000;
    for bytes in [0u32, 64 << 10] {
        ranks(2, 1, 1 << 20, |r| {
            let me = r.topology.rank;
            let peer = 1 - me;
            let cmd = |i: u64| {
                if bytes == 0 {
                    signal(peer, 0, i)
                } else {
                    put_command(peer as u32, 0, 0, bytes, Some((0, i as u32)))
                }
            };
            r.boot.barrier()?;
            let start = Instant::now();
            for i in 1..=ROUNDS {
                if me == 0 {
                    r.producer.post(&cmd(i))?;
                    wait(&r.window, 0, i)?;
                } else {
                    wait(&r.window, 0, i)?;
                    r.producer.post(&cmd(i))?;
                }
            }
            if me == 0 {
                let rt = start.elapsed().as_secs_f64() / ROUNDS as f64;
                println!("round trip, {bytes:>6}-byte puts: {:7.1} us ({:.1} us per hop)", rt * 1e6, rt * 5e5);
            }
            Ok(())
        });
    }
}

#[test]
#[ignore]
fn throughput() {
    const PUT: u64 = 1 << 20;
    for total in [1u64 << 20, 4 << 20, 16 << 20, 64 << 20] {
        ranks(2, 1, 64 << 20, |r| {
            let peer = 1 - r.topology.rank;
            let reps = (256u64 << 20).div_ceil(total).min(64);
            r.boot.barrier()?;
            let start = Instant::now();
            let mut last = 0;
            for rep in 1..=reps {
                for k in 0..total / PUT {
                    let signal = (k + 1 == total / PUT).then_some((0u32, rep as u32));
                    last = r.producer.post(&put_command(peer as u32, k * PUT, k * PUT, PUT as u32, signal))?;
                }
                wait(&r.window, 0, rep)?;
            }
            r.producer.wait_complete(last)?;
            let t = start.elapsed().as_secs_f64() / reps as f64;
            if r.topology.rank == 0 {
                println!(
                    "{:>3} MiB each way at once: {:8.1} us, {:5.2} GB/s per direction",
                    total >> 20,
                    t * 1e6,
                    total as f64 / t / 1e9
                );
            }
            Ok(())
        });
    }
}

/// Signal words: grants at 0.., arrivals at 1024.. (one per CTA).
const ARRIVE: usize = 1024;

#[test]
#[ignore]
fn hier_steps() {
    // (CTAs, put bytes): mkbench all_gather -g 4 at 1, 4, 16, 64 MB, MK_MAX_CTAS=16.
    for (ctas, put) in [(4usize, 64u64 << 10), (16, 64 << 10), (16, 256 << 10), (16, 1 << 20)] {
        const CALLS: u64 = 50;
        ranks(4, 2, ctas * (1 << 20), |r| {
            let peer = r.topology.inter_node_peers()[0];
            let barrier = Barrier::new(ctas);
            let start = std::sync::Mutex::new(None);
            std::thread::scope(|s| -> Result<()> {
                let hs: Vec<_> = (0..ctas)
                    .map(|b| {
                        let (barrier, start) = (&barrier, &start);
                        s.spawn(move || -> Result<()> {
                            for step in 1..=CALLS + 3 {
                                if step == 4 && barrier.wait().is_leader() {
                                    *start.lock().unwrap() = Some(Instant::now());
                                }
                                r.producer.post(&signal(peer, b, step))?;
                                wait(&r.window, b, step)?;
                                let at = b as u64 * (1 << 20);
                                let t = r.producer.post(&put_command(
                                    peer as u32,
                                    at,
                                    at,
                                    put as u32,
                                    Some(((ARRIVE + b) as u32, step as u32)),
                                ))?;
                                wait(&r.window, ARRIVE + b, step)?;
                                r.producer.wait_complete(t)?;
                            }
                            Ok(())
                        })
                    })
                    .collect();
                hs.into_iter().try_for_each(|h| h.join().unwrap())
            })?;
            if r.topology.rank == 0 {
                let t = start.lock().unwrap().unwrap().elapsed().as_secs_f64() / CALLS as f64;
                println!(
                    "{ctas:>2} CTAs x {:>4} KiB puts (all_gather {:>2} MB): {:7.1} us per call, {:5.2} GB/s per rank",
                    put >> 10,
                    (ctas as u64 * put * 4) >> 20,
                    t * 1e6,
                    (ctas as u64 * put) as f64 / t / 1e9
                );
            }
            Ok(())
        });
    }
}
