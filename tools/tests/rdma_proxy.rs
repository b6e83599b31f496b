//! The proxy path over RDMA: host threads post put commands into each rank's proxy ring
//! (the protocol the kernels use), the proxy thread drives the RDMA transport, and the
//! simulated verbs layer (RC-like and SRD-like) carries the writes between ranks. Checks
//! that signals arrive after their data through the whole path, that the ring's tickets
//! complete, and that a vanished peer fails the producer with mkRemoteError, not a hang.

// The integration tests' shared helpers (HostWindow), from the library's tests/.
#[path = "../../tests/common/mod.rs"]
mod common;
use common::HostWindow;
use mkernel::error::mkResult_t;
use mkernel::transport::proxy::{put_command, Proxy, ProxyOptions, ProxyRing};
use mkernel::transport::rdma::RdmaTransport;
use mkernel::transport::Transport;
use mkernel_tools::rdma_sim::{SimConfig, SimFabric, SimRng};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

const TIMEOUT: Duration = Duration::from_secs(20);
const SLOT: usize = 4096;

/// Fills a source slot with seeded bytes (before the puts that read it are posted).
fn fill_slot(w: &HostWindow, offset: usize, len: usize, seed: u64) {
    let mut bytes = vec![0u8; len];
    fill(seed, &mut bytes);
    w.fill(offset, &bytes);
}

fn fill(seed: u64, buf: &mut [u8]) {
    let mut rng = SimRng::new(seed);
    buf.iter_mut().for_each(|b| *b = rng.next_u64() as u8);
}

/// Proxies for two ranks over `fabric`, windows of `puts` source and `puts` destination slots.
fn start(fabric: &SimFabric, puts: usize) -> Vec<(Proxy, Arc<ProxyRing>, Arc<HostWindow>)> {
    let windows: Vec<Arc<HostWindow>> = (0..2).map(|_| Arc::new(HostWindow::new(2 * puts * SLOT, 4, 0))).collect();
    let mut transports: Vec<RdmaTransport> =
        (0..2).map(|r| RdmaTransport::over(r, 2, Box::new(fabric.endpoint(r)))).collect();
    for (t, w) in transports.iter_mut().zip(&windows) {
        // SAFETY: the windows are leaked.
        unsafe { t.register(w.window()).unwrap() };
    }
    let blobs: Vec<Vec<u8>> =
        transports.iter_mut().enumerate().map(|(r, t)| t.connection_blob(&[1 - r]).unwrap()).collect();
    for (r, t) in transports.iter_mut().enumerate() {
        t.connect(&blobs, &[1 - r]).unwrap();
    }
    transports
        .into_iter()
        .zip(windows)
        .enumerate()
        .map(|(r, (t, w))| {
            let ring = Arc::new(ProxyRing::in_host_memory(64, TIMEOUT).unwrap());
            let proxy = Proxy::start(Arc::clone(&ring), Box::new(t), ProxyOptions::new(r, TIMEOUT)).unwrap();
            (proxy, ring, w)
        })
        .collect()
}

#[test]
fn puts_through_the_proxy_land_before_their_signals() {
    for config in [SimConfig::rc(21), SimConfig::srd(21)] {
        let puts = 150;
        let fabric = SimFabric::new(config);
        let ranks = start(&fabric, puts);
        let threads: Vec<_> = ranks
            .iter()
            .enumerate()
            .map(|(me, (_, ring, w))| {
                let (ring, w, peer_w) = (Arc::clone(ring), Arc::clone(w), Arc::clone(&ranks[1 - me].2));
                std::thread::spawn(move || {
                    let producer = ring.host_producer().unwrap();
                    let len = |j: usize| 1 + (j * 977) % SLOT;
                    for j in 0..puts {
                        fill_slot(&w, j * SLOT, len(j), (me * puts + j) as u64);
                    }
                    // What the peer put into this rank, checked as each signal is seen,
                    // while this rank's own puts are still being posted.
                    let mut verified = 0;
                    let mut expected = vec![0u8; SLOT];
                    let mut check = |verified: &mut usize| {
                        let seen = w.signals.iter().map(|s| s.load(Ordering::Acquire) as usize).max().unwrap();
                        while *verified < seen {
                            let n = len(*verified);
                            fill(((1 - me) * puts + *verified) as u64, &mut expected[..n]);
                            assert!(
                                w.slice((puts + *verified) * SLOT, n) == &expected[..n],
                                "rank {me}: signal {seen} before the data of put {verified}"
                            );
                            *verified += 1;
                        }
                    };
                    let mut last = 0;
                    for j in 0..puts {
                        let cmd = put_command(
                            1 - me as u32,
                            (j * SLOT) as u64,
                            ((puts + j) * SLOT) as u64,
                            len(j) as u32,
                            Some(((j % 4) as u32, j as u32 + 1)),
                        );
                        last = producer.post(&cmd).unwrap();
                        check(&mut verified);
                    }
                    // Bounded from the last signal seen, not overall: a loaded machine slows
                    // the whole exchange, a hang stops it.
                    let (mut seen, mut moved) = (verified, Instant::now());
                    while verified < puts {
                        assert!(moved.elapsed() < TIMEOUT, "rank {me}: signals stopped at {verified}");
                        check(&mut verified);
                        if verified != seen {
                            (seen, moved) = (verified, Instant::now());
                        }
                    }
                    producer.wait_complete(last).unwrap();
                    drop(peer_w);
                })
            })
            .collect();
        for t in threads {
            t.join().expect("rank thread");
        }
        for (proxy, ring, _) in ranks {
            assert_eq!(ring.error_code(), mkResult_t::mkSuccess);
            proxy.stop().unwrap();
        }
    }
}

#[test]
fn a_vanished_peer_fails_the_producer_with_a_remote_error() {
    for config in [SimConfig::rc(22), SimConfig::srd(22)] {
        let fabric = SimFabric::new(config);
        let ranks = start(&fabric, 64);
        fabric.kill(1);
        let (proxy, ring, _) = &ranks[0];
        let producer = ring.host_producer().unwrap();
        let start = Instant::now();
        let e = loop {
            let r = producer
                .post(&put_command(1, 0, 64 * SLOT as u64, 100, Some((0, 1))))
                .and_then(|t| producer.wait_complete(t));
            if let Err(e) = r {
                break e;
            }
            assert!(start.elapsed() < TIMEOUT, "{:?}: the dead peer never surfaced", config.ordering);
        };
        assert!(start.elapsed() < TIMEOUT);
        assert_eq!(e.code, mkResult_t::mkRemoteError, "{:?}: {e}", config.ordering);
        let async_error = proxy.error().expect("the proxy records its failure");
        assert_eq!(async_error.code, mkResult_t::mkRemoteError);
        assert!(async_error.message.contains("rank 1"), "{async_error}");
        for (proxy, _, _) in ranks {
            proxy.abort();
        }
    }
}
