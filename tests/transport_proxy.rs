//! Proxy ring protocol with host threads as producers (the same protocol as
//! kernels/common/proxy.cuh) and a scripted transport: ordering, wrap-around, many
//! producers, back-pressure, timeouts, completion accounting, failures.

use mkernel::error::{mkResult_t, MkError, Result};
use mkernel::kernel_abi::{ProxyCommand, MK_PROXY_KIND_SIGNAL};
use mkernel::transport::proxy::{command_header, put_command, HostProducer, Proxy, ProxyOptions, ProxyRing};
use mkernel::transport::{PostId, PutRequest, Transport, Window};
use parking_lot::Mutex;
use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How the scripted transport completes puts.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Completion {
    /// Every posted put completes at the next poll.
    Immediate,
    /// Only ids the test releases complete.
    Gated,
}

struct Script {
    puts: Vec<PutRequest>,
    pending: Vec<PostId>,
    released: HashSet<PostId>,
    completion: Completion,
    /// post_put fails with this error once this many puts were posted.
    fail_after: Option<(usize, MkError)>,
    closed: bool,
}

#[derive(Clone)]
struct ScriptedTransport(Arc<Mutex<Script>>);

impl ScriptedTransport {
    fn new(completion: Completion) -> Self {
        ScriptedTransport(Arc::new(Mutex::new(Script {
            puts: Vec::new(),
            pending: Vec::new(),
            released: HashSet::new(),
            completion,
            fail_after: None,
            closed: false,
        })))
    }
    fn puts(&self) -> Vec<PutRequest> {
        self.0.lock().puts.clone()
    }
    fn release(&self, id: PostId) {
        self.0.lock().released.insert(id);
    }
}

impl Transport for ScriptedTransport {
    fn name(&self) -> &'static str {
        "scripted"
    }
    unsafe fn register(&mut self, _window: Window) -> Result<()> {
        Ok(())
    }
    fn connection_blob(&mut self, _peers: &[usize]) -> Result<Vec<u8>> {
        Ok(Vec::new())
    }
    fn connect(&mut self, _blobs: &[Vec<u8>], _peers: &[usize]) -> Result<()> {
        Ok(())
    }
    fn post_put(&mut self, put: &PutRequest) -> Result<PostId> {
        let mut s = self.0.lock();
        if let Some((n, e)) = &s.fail_after {
            if s.puts.len() >= *n {
                return Err(e.clone());
            }
        }
        let id = s.puts.len() as PostId;
        s.puts.push(*put);
        s.pending.push(id);
        Ok(id)
    }
    fn poll(&mut self, completed: &mut Vec<PostId>) -> Result<()> {
        let mut s = self.0.lock();
        let pending = std::mem::take(&mut s.pending);
        for id in pending {
            if s.completion == Completion::Immediate || s.released.contains(&id) {
                completed.push(id);
            } else {
                s.pending.push(id);
            }
        }
        Ok(())
    }
    fn close(&mut self) -> Result<()> {
        self.0.lock().closed = true;
        Ok(())
    }
}

fn ring(capacity: u32, timeout: Duration) -> (Arc<ProxyRing>, HostProducer) {
    let ring = Arc::new(ProxyRing::in_host_memory(capacity, timeout).unwrap());
    let producer = ring.host_producer().unwrap();
    (ring, producer)
}

fn start(ring: &Arc<ProxyRing>, transport: &ScriptedTransport, timeout: Duration) -> Proxy {
    Proxy::start(Arc::clone(ring), Box::new(transport.clone()), ProxyOptions::new(0, timeout)).unwrap()
}

/// A command whose fields encode `(producer, index)` so the executed put identifies it.
fn numbered(producer: u32, index: u32) -> ProxyCommand {
    put_command(
        producer + 1,
        index as u64 * 64,
        (producer as u64) << 32 | index as u64,
        64 + index,
        Some((producer, index)),
    )
}

fn wait_until(what: &str, limit: Duration, mut ready: impl FnMut() -> bool) {
    let start = Instant::now();
    while !ready() {
        assert!(start.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn single_producer_wraps_around_in_order() {
    let (ring, producer) = ring(8, Duration::from_secs(10));
    let transport = ScriptedTransport::new(Completion::Immediate);
    let proxy = start(&ring, &transport, Duration::from_secs(10));
    let n = 100u32; // 12 laps of an 8-slot ring
    let mut last = 0;
    for i in 0..n {
        last = producer.post(&numbered(0, i)).unwrap();
        assert_eq!(last, i as u64, "tickets are handed out in order");
    }
    producer.wait_complete(last).unwrap();
    assert_eq!((ring.tail(), ring.completed()), (n as u64, n as u64));
    let puts = transport.puts();
    assert_eq!(puts.len(), n as usize);
    for (i, p) in puts.iter().enumerate() {
        let i = i as u32;
        assert_eq!(
            *p,
            PutRequest {
                peer: 1,
                src_offset: i as u64 * 64,
                dst_offset: i as u64,
                bytes: 64 + i as u64,
                signal: Some((0, i as u64))
            }
        );
    }
    proxy.stop().unwrap();
    assert!(transport.0.lock().closed, "stopping the proxy closes its transport");
}

#[test]
fn many_producers_each_command_executed_once_in_per_producer_order() {
    let (ring, _) = ring(16, Duration::from_secs(20));
    let transport = ScriptedTransport::new(Completion::Immediate);
    let proxy = start(&ring, &transport, Duration::from_secs(20));
    let (producers, per) = (4u32, 300u32);
    std::thread::scope(|s| {
        for p in 0..producers {
            let producer = ring.host_producer().unwrap();
            s.spawn(move || {
                let mut last = 0;
                for i in 0..per {
                    last = producer.post(&numbered(p, i)).unwrap();
                }
                producer.wait_complete(last).unwrap();
            });
        }
    });
    let total = (producers * per) as u64;
    assert_eq!(ring.completed(), total);
    let puts = transport.puts();
    assert_eq!(puts.len() as u64, total);
    let mut next = vec![0u32; producers as usize];
    for put in puts {
        let (p, i) = ((put.dst_offset >> 32) as u32, put.dst_offset as u32);
        assert_eq!(put.peer as u32, p + 1, "body and header of one command stayed together");
        assert_eq!(put.signal, Some((p, i as u64)));
        assert_eq!(i, next[p as usize], "producer {p}'s commands ran out of order or twice");
        next[p as usize] += 1;
    }
    assert!(next.iter().all(|&c| c == per));
    proxy.stop().unwrap();
}

#[test]
fn full_ring_without_consumer_times_out() {
    let timeout = Duration::from_millis(300);
    let (ring, producer) = ring(4, timeout);
    for i in 0..4 {
        producer.post(&numbered(0, i)).unwrap();
    }
    let start = Instant::now();
    let e = producer.post(&numbered(0, 4)).unwrap_err();
    let waited = start.elapsed();
    assert_eq!(e.code, mkResult_t::mkTimeout, "{e}");
    assert!(waited >= timeout && waited < timeout + Duration::from_secs(3), "waited {waited:?}");
    assert_eq!(ring.tail(), 0);
}

#[test]
fn full_ring_blocks_until_the_proxy_frees_a_slot() {
    let (ring, producer) = ring(4, Duration::from_secs(10));
    for i in 0..4 {
        producer.post(&numbered(0, i)).unwrap();
    }
    let transport = ScriptedTransport::new(Completion::Immediate);
    std::thread::scope(|s| {
        let blocked = s.spawn(|| producer.post(&numbered(0, 4)));
        std::thread::sleep(Duration::from_millis(100));
        assert!(!blocked.is_finished(), "a post into a full ring must wait for a free slot");
        let proxy = start(&ring, &transport, Duration::from_secs(10));
        let ticket = blocked.join().unwrap().unwrap();
        assert_eq!(ticket, 4);
        producer.wait_complete(ticket).unwrap();
        proxy.stop().unwrap();
    });
    assert_eq!(transport.puts().len(), 5);
}

#[test]
fn completed_counts_only_the_finished_prefix() {
    let (ring, producer) = ring(8, Duration::from_secs(10));
    let transport = ScriptedTransport::new(Completion::Gated);
    let proxy = start(&ring, &transport, Duration::from_secs(10));
    for i in 0..4 {
        producer.post(&numbered(0, i)).unwrap();
    }
    wait_until("the proxy to take all four", Duration::from_secs(5), || transport.puts().len() == 4);
    assert_eq!(ring.tail(), 4, "slots are freed as soon as commands are taken");
    transport.release(3);
    transport.release(1);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(ring.completed(), 0, "puts 1 and 3 finished, but put 0 has not");
    transport.release(0);
    wait_until("completed to reach 2", Duration::from_secs(5), || ring.completed() == 2);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(ring.completed(), 2, "put 2 is still outstanding");
    transport.release(2);
    producer.wait_complete(3).unwrap();
    assert_eq!(ring.completed(), 4);
    proxy.stop().unwrap();
}

#[test]
fn stuck_transport_fails_the_proxy_with_timeout() {
    let timeout = Duration::from_millis(300);
    let (ring, producer) = ring(8, Duration::from_secs(20));
    let transport = ScriptedTransport::new(Completion::Gated); // never released
    let proxy = start(&ring, &transport, timeout);
    let ticket = producer.post(&numbered(0, 0)).unwrap();
    let start = Instant::now();
    let e = producer.wait_complete(ticket).unwrap_err();
    assert_eq!(e.code, mkResult_t::mkTimeout, "{e}");
    assert!(start.elapsed() < Duration::from_secs(5), "the proxy's own bound, not the producer's 20 s, ended the wait");
    assert_eq!(ring.error_code(), mkResult_t::mkTimeout);
    let recorded = proxy.error().unwrap();
    assert_eq!(recorded.code, mkResult_t::mkTimeout);
    assert!(recorded.message.contains("1 puts in flight; ring tail 1, completed 0"), "{recorded}");
    assert_eq!(
        producer.post(&numbered(0, 1)).unwrap_err().code,
        mkResult_t::mkTimeout,
        "a failed proxy refuses new work"
    );
    assert_eq!(proxy.stop().unwrap_err().code, mkResult_t::mkTimeout);
}

#[test]
fn transport_failure_surfaces_as_remote_error() {
    let (ring, producer) = ring(8, Duration::from_secs(10));
    let transport = ScriptedTransport::new(Completion::Immediate);
    transport.0.lock().fail_after = Some((2, MkError::remote("rank 1 closed its connection (did it exit?)")));
    let proxy = start(&ring, &transport, Duration::from_secs(10));
    producer.post(&numbered(0, 0)).unwrap();
    producer.post(&numbered(0, 1)).unwrap();
    let third = producer.post(&numbered(0, 2)).unwrap();
    let e = producer.wait_complete(third).unwrap_err();
    assert_eq!(e.code, mkResult_t::mkRemoteError, "{e}");
    let recorded = proxy.error().unwrap();
    assert_eq!(recorded.code, mkResult_t::mkRemoteError);
    assert!(recorded.message.contains("rank 1"), "{}", recorded.message);
    assert_eq!(ring.completed(), 2, "the two puts before the failure completed");
    assert_eq!(producer.post(&numbered(0, 3)).unwrap_err().code, mkResult_t::mkRemoteError);
    assert_eq!(proxy.stop().unwrap_err().code, mkResult_t::mkRemoteError);
}

#[test]
fn malformed_command_is_an_internal_error() {
    let (ring, producer) = ring(8, Duration::from_secs(10));
    let transport = ScriptedTransport::new(Completion::Immediate);
    let proxy = start(&ring, &transport, Duration::from_secs(10));
    let bad =
        ProxyCommand { header: command_header(MK_PROXY_KIND_SIGNAL, 1), bytes: 8, signal_id: 0, ..Default::default() };
    let ticket = producer.post(&bad).unwrap();
    assert_eq!(producer.wait_complete(ticket).unwrap_err().code, mkResult_t::mkInternalError);
    assert!(transport.puts().is_empty(), "nothing is sent for a malformed command");
    assert_eq!(proxy.error().unwrap().code, mkResult_t::mkInternalError);
    let empty = ProxyCommand::default();
    assert_eq!(producer.post(&empty).unwrap_err().code, mkResult_t::mkInvalidArgument, "kind 0 would never publish");
}

#[test]
fn stop_executes_everything_published_first() {
    let (ring, producer) = ring(64, Duration::from_secs(10));
    let transport = ScriptedTransport::new(Completion::Immediate);
    for i in 0..40 {
        producer.post(&numbered(0, i)).unwrap();
    }
    let proxy = start(&ring, &transport, Duration::from_secs(10));
    proxy.stop().unwrap();
    assert_eq!(transport.puts().len(), 40);
    assert_eq!(ring.completed(), 40);
}

#[test]
fn stopping_with_a_stuck_transport_is_bounded() {
    let (ring, producer) = ring(8, Duration::from_secs(10));
    let transport = ScriptedTransport::new(Completion::Gated);
    let proxy = start(&ring, &transport, Duration::from_millis(200));
    producer.post(&numbered(0, 0)).unwrap();
    wait_until("the proxy to take the command", Duration::from_secs(5), || transport.puts().len() == 1);
    let start = Instant::now();
    assert_eq!(proxy.stop().unwrap_err().code, mkResult_t::mkTimeout);
    assert!(start.elapsed() < Duration::from_secs(5));
}

#[test]
fn pinned_proxy_thread_still_serves_the_ring() {
    let (ring, producer) = ring(8, Duration::from_secs(10));
    let transport = ScriptedTransport::new(Completion::Immediate);
    let mut options = ProxyOptions::new(0, Duration::from_secs(10));
    options.cpus = Some(vec![0, 1, 100_000]); // the impossible CPU is ignored
    let proxy = Proxy::start(Arc::clone(&ring), Box::new(transport.clone()), options).unwrap();
    let t = producer.post(&numbered(0, 0)).unwrap();
    producer.wait_complete(t).unwrap();
    proxy.stop().unwrap();
    assert_eq!(transport.puts().len(), 1);
}

#[test]
fn abort_is_prompt_and_stops_producers() {
    let (ring, producer) = ring(8, Duration::from_secs(10));
    let transport = ScriptedTransport::new(Completion::Gated); // puts never complete
    let proxy = start(&ring, &transport, Duration::from_secs(10));
    let ticket = producer.post(&numbered(0, 0)).unwrap();
    wait_until("the proxy to take the command", Duration::from_secs(5), || transport.puts().len() == 1);
    let start = Instant::now();
    proxy.abort();
    assert!(start.elapsed() < Duration::from_secs(2), "abort waited {:?}", start.elapsed());
    assert!(transport.0.lock().closed, "the transport was released");
    assert_eq!(ring.error_code(), mkResult_t::mkInvalidUsage);
    assert_eq!(producer.wait_complete(ticket).unwrap_err().code, mkResult_t::mkInvalidUsage);
    assert_eq!(producer.post(&numbered(0, 1)).unwrap_err().code, mkResult_t::mkInvalidUsage);
}
