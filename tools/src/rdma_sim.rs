//! An in-memory verbs layer for tests: ranks of one process (threads) exchange RDMA writes
//! through a shared `SimFabric`, which copies bytes between registered host memory the way
//! a NIC would, with the semantics that matter to the transport's protocol:
//! - RC: a queue pair's messages land in posting order (queue pairs interleave at random);
//!   an error moves the queue pair to the error state and flushes what follows.
//! - SRD: messages land in random order, completions come back in random order, an
//!   immediate needs a posted receive (without one the message waits, as under RNR retry).
//! - Either: a queue pair accepts fewer work requests than the depth it reports (ENOMEM,
//!   as EFA does), keys and ranges are checked (remote access errors), and a rank can
//!   vanish (`kill`): messages to it fail, its own are lost.
//!
//! Delivery happens inside `poll` calls (a few messages per call, any rank's), so the
//! proxies' polling drives the fabric and the receiver observes writes concurrently.

use mkernel::error::{MkError, Result};
use mkernel::transport::rdma::verbs::{
    Completion, CompletionKind, MemoryKeys, PortAddress, PostError, SignalOrdering, Verbs, WorkOp, WorkRequest,
    SIGNAL_MESSAGE_BYTES,
};
use mkernel::transport::rdma::RdmaBlob;
use mkernel::transport::{MemoryKind, MemoryRegion};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{fence, AtomicU64, Ordering};
use std::sync::Arc;

/// A small deterministic generator (splitmix64) for the fabric's choices and the tests.
#[derive(Clone, Debug)]
pub struct SimRng(u64);

impl SimRng {
    pub fn new(seed: u64) -> SimRng {
        SimRng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            items.swap(i, self.below(i as u64 + 1) as usize);
        }
    }
}

/// How the simulated device behaves.
#[derive(Clone, Copy, Debug)]
pub struct SimConfig {
    pub ordering: SignalOrdering,
    /// The send queue depth the device reports.
    pub send_queue_depth: u32,
    /// Work requests a queue pair holds before `post_send` answers ENOMEM.
    pub accepts: u32,
    pub receive_queue_depth: u32,
    /// Most messages delivered per `poll` call (a random number from 1 to this).
    pub deliveries_per_poll: u32,
    /// Largest write the device takes (small, so tests' puts span several writes).
    pub max_write: u64,
    pub seed: u64,
}

impl SimConfig {
    /// InfiniBand/RoCE-like: ordered queue pairs, ENOMEM exactly at the reported depth.
    pub fn rc(seed: u64) -> SimConfig {
        SimConfig {
            ordering: SignalOrdering::WriteThenFlag,
            send_queue_depth: 32,
            accepts: 32,
            receive_queue_depth: 0,
            deliveries_per_poll: 4,
            max_write: 2048,
            seed,
        }
    }

    /// EFA-like: unordered, ENOMEM well before the reported depth.
    pub fn srd(seed: u64) -> SimConfig {
        SimConfig {
            ordering: SignalOrdering::Sequenced,
            send_queue_depth: 64,
            accepts: 12,
            receive_queue_depth: 16,
            deliveries_per_poll: 4,
            max_write: 1024,
            seed,
        }
    }
}

struct Message {
    from: usize,
    to: usize,
    wr: WorkRequest,
    /// Posting order across the fabric.
    order: u64,
}

#[derive(Default)]
struct SimQueuePair {
    connected: bool,
    /// Work requests posted and not yet delivered.
    posted: u32,
    receives: u32,
    errored: bool,
}

struct Node {
    alive: bool,
    regions: Vec<(MemoryRegion, MemoryKeys)>,
    queue_pairs: HashMap<usize, SimQueuePair>,
    completions: Vec<Completion>,
}

struct Fabric {
    config: SimConfig,
    rng: SimRng,
    nodes: HashMap<usize, Node>,
    in_flight: Vec<Message>,
    next_order: u64,
    next_number: u32,
}

/// The simulated network joining the ranks of one test.
#[derive(Clone)]
pub struct SimFabric(Arc<Mutex<Fabric>>);

impl SimFabric {
    pub fn new(config: SimConfig) -> SimFabric {
        SimFabric(Arc::new(Mutex::new(Fabric {
            rng: SimRng::new(config.seed),
            config,
            nodes: HashMap::new(),
            in_flight: Vec::new(),
            next_order: 0,
            next_number: 1,
        })))
    }

    /// The device of `rank` on this fabric.
    pub fn endpoint(&self, rank: usize) -> SimVerbs {
        let mut f = self.0.lock();
        f.nodes.insert(
            rank,
            Node { alive: true, regions: Vec::new(), queue_pairs: HashMap::new(), completions: Vec::new() },
        );
        SimVerbs { fabric: self.clone(), rank, config: f.config }
    }

    /// `rank` vanishes: its undelivered messages are lost and messages to it fail.
    pub fn kill(&self, rank: usize) {
        let mut f = self.0.lock();
        if let Some(n) = f.nodes.get_mut(&rank) {
            n.alive = false;
        }
        f.in_flight.retain(|m| m.from != rank);
    }

    /// Messages posted and not yet delivered.
    pub fn in_flight(&self) -> usize {
        self.0.lock().in_flight.len()
    }
}

fn find_region(node: &Node, key: impl Fn(&MemoryKeys) -> bool, addr: u64, bytes: u64) -> bool {
    node.regions
        .iter()
        .any(|(r, k)| key(k) && addr >= r.base && addr.checked_add(bytes).is_some_and(|e| e <= r.base + r.bytes))
}

impl Fabric {
    fn complete(&mut self, rank: usize, c: Completion) {
        if let Some(n) = self.nodes.get_mut(&rank) {
            n.completions.push(c);
        }
    }

    /// Fails message `m` at its sender; RC queue pairs enter the error state and flush.
    fn fail(&mut self, m: &Message, why: &str) {
        self.complete(
            m.from,
            Completion { peer: m.to, kind: CompletionKind::Sent { id: m.wr.id }, status: Err(why.into()) },
        );
        if let Some(qp) = self.nodes.get_mut(&m.from).and_then(|n| n.queue_pairs.get_mut(&m.to)) {
            qp.posted = qp.posted.saturating_sub(1);
            if self.config.ordering == SignalOrdering::WriteThenFlag {
                qp.errored = true;
            }
        }
        if self.config.ordering == SignalOrdering::WriteThenFlag {
            let (from, to) = (m.from, m.to);
            let flushed: Vec<Message> = {
                let (flushed, kept) =
                    std::mem::take(&mut self.in_flight).into_iter().partition(|x| x.from == from && x.to == to);
                self.in_flight = kept;
                flushed
            };
            for x in flushed {
                self.complete(
                    from,
                    Completion {
                        peer: to,
                        kind: CompletionKind::Sent { id: x.wr.id },
                        status: Err("work request flushed".into()),
                    },
                );
            }
            if let Some(qp) = self.nodes.get_mut(&from).and_then(|n| n.queue_pairs.get_mut(&to)) {
                qp.posted = 0;
            }
        }
    }

    /// Delivers one message, if one can go; false when none could.
    fn deliver_one(&mut self) -> bool {
        if self.in_flight.is_empty() {
            return false;
        }
        let mut i = self.rng.below(self.in_flight.len() as u64) as usize;
        if self.config.ordering == SignalOrdering::WriteThenFlag {
            // The oldest message of the chosen queue pair.
            let (from, to) = (self.in_flight[i].from, self.in_flight[i].to);
            i = (0..self.in_flight.len())
                .filter(|&j| self.in_flight[j].from == from && self.in_flight[j].to == to)
                .min_by_key(|&j| self.in_flight[j].order)
                .expect("the chosen message qualifies");
        }
        let m = &self.in_flight[i];
        let needs_receive = matches!(m.wr.op, WorkOp::Send { .. } | WorkOp::Write { imm: Some(_), .. });
        let target_alive = self.nodes.get(&m.to).is_some_and(|n| n.alive);
        if target_alive && needs_receive {
            let receives = self.nodes[&m.to].queue_pairs.get(&m.from).map_or(0, |q| q.receives);
            if receives == 0 {
                return false; // receiver not ready: the message waits (RNR retry)
            }
        }
        let m = self.in_flight.swap_remove(i);
        if !target_alive {
            self.fail(&m, "transport retry counter exceeded (the peer does not answer)");
            return true;
        }
        let (from_node, to_node) = (&self.nodes[&m.from], &self.nodes[&m.to]);
        let copied = match m.wr.op {
            WorkOp::Write { local_addr, lkey, bytes, remote_addr, rkey, .. } => {
                if bytes as u64 > self.config.max_write {
                    Err("local length error")
                } else if !find_region(from_node, |k| k.lkey == lkey, local_addr, bytes as u64) {
                    Err("local protection error")
                } else if !find_region(to_node, |k| k.rkey == rkey, remote_addr, bytes as u64) {
                    Err("remote access error")
                } else {
                    // SAFETY: both ranges lie inside regions registered with the sim, whose
                    // owners keep them valid (Verbs::register's contract).
                    unsafe { std::ptr::copy(local_addr as *const u8, remote_addr as *mut u8, bytes as usize) };
                    fence(Ordering::Release);
                    Ok(())
                }
            }
            WorkOp::WriteValue { value, remote_addr, rkey } => {
                if remote_addr % 8 != 0 || !find_region(to_node, |k| k.rkey == rkey, remote_addr, 8) {
                    Err("remote access error")
                } else {
                    // SAFETY: inside a registered region, 8-byte aligned.
                    unsafe { AtomicU64::from_ptr(remote_addr as *mut u64) }.store(value, Ordering::Release);
                    Ok(())
                }
            }
            WorkOp::Send { .. } => Ok(()),
        };
        if let Err(why) = copied {
            self.fail(&m, why);
            return true;
        }
        if let Some(qp) = self.nodes.get_mut(&m.from).and_then(|n| n.queue_pairs.get_mut(&m.to)) {
            qp.posted = qp.posted.saturating_sub(1);
        }
        if m.wr.signaled {
            self.complete(
                m.from,
                Completion { peer: m.to, kind: CompletionKind::Sent { id: m.wr.id }, status: Ok(()) },
            );
        }
        let received = match m.wr.op {
            WorkOp::Write { imm: Some(imm), .. } => Some(CompletionKind::ReceivedWrite { imm }),
            WorkOp::Send { payload, imm } => Some(CompletionKind::ReceivedSend { imm, payload }),
            _ => None,
        };
        if let Some(kind) = received {
            if let Some(qp) = self.nodes.get_mut(&m.to).and_then(|n| n.queue_pairs.get_mut(&m.from)) {
                qp.receives -= 1;
            }
            self.complete(m.to, Completion { peer: m.from, kind, status: Ok(()) });
        }
        true
    }
}

/// One rank's simulated device.
pub struct SimVerbs {
    fabric: SimFabric,
    rank: usize,
    config: SimConfig,
}

impl SimVerbs {
    fn with_node<T>(&self, f: impl FnOnce(&mut Node, &mut u32) -> Result<T>) -> Result<T> {
        let mut fabric = self.fabric.0.lock();
        let fabric = &mut *fabric;
        let node = fabric.nodes.get_mut(&self.rank).expect("endpoint registered its node");
        if !node.alive {
            return Err(MkError::system(format!("simulated device of rank {} is gone", self.rank)));
        }
        f(node, &mut fabric.next_number)
    }
}

impl Verbs for SimVerbs {
    fn device(&self) -> &str {
        match self.config.ordering {
            SignalOrdering::WriteThenFlag => "sim_rc",
            SignalOrdering::Sequenced => "sim_srd",
        }
    }

    fn ordering(&self) -> SignalOrdering {
        self.config.ordering
    }

    fn address(&self) -> PortAddress {
        PortAddress { lid: self.rank as u16 + 1, gid: [0; 16], mtu: 5, psn: 0 }
    }

    unsafe fn register(&mut self, region: MemoryRegion) -> Result<MemoryKeys> {
        if region.kind != MemoryKind::Host {
            return Err(MkError::invalid_usage("the simulated RDMA device registers host memory only"));
        }
        self.with_node(|node, next| {
            let keys = MemoryKeys { lkey: *next, rkey: *next + 1 };
            *next += 2;
            node.regions.push((region, keys));
            Ok(keys)
        })
    }

    fn create_queue_pair(&mut self, peer: usize) -> Result<u32> {
        self.with_node(|node, next| {
            let number = *next;
            *next += 1;
            node.queue_pairs.insert(peer, SimQueuePair::default());
            Ok(number)
        })
    }

    fn connect(&mut self, peer: usize, _remote: &RdmaBlob, _remote_qp: u32) -> Result<()> {
        self.with_node(|node, _| {
            let qp = node.queue_pairs.get_mut(&peer).ok_or_else(|| MkError::invalid_usage("connect before create"))?;
            qp.connected = true;
            Ok(())
        })
    }

    fn max_write_bytes(&self) -> u64 {
        self.config.max_write
    }

    fn send_queue_depth(&self) -> u32 {
        self.config.send_queue_depth
    }

    fn receive_queue_depth(&self) -> u32 {
        self.config.receive_queue_depth
    }

    fn post_send(&mut self, peer: usize, wr: &WorkRequest) -> std::result::Result<(), PostError> {
        let mut fabric = self.fabric.0.lock();
        let accepts = fabric.config.accepts;
        let Some(node) = fabric.nodes.get_mut(&self.rank).filter(|n| n.alive) else {
            return Err(PostError::Failed(MkError::system("simulated device is gone")));
        };
        let Some(qp) = node.queue_pairs.get_mut(&peer).filter(|q| q.connected) else {
            return Err(PostError::Failed(MkError::invalid_usage(format!("no connected queue pair to rank {peer}"))));
        };
        if qp.errored {
            return Err(PostError::Failed(MkError::remote(format!("queue pair to rank {peer} is in the error state"))));
        }
        if qp.posted >= accepts {
            return Err(PostError::QueueFull);
        }
        qp.posted += 1;
        if let WorkOp::Send { payload, .. } = wr.op {
            debug_assert_eq!(payload.len(), SIGNAL_MESSAGE_BYTES);
        }
        let order = fabric.next_order;
        fabric.next_order += 1;
        fabric.in_flight.push(Message { from: self.rank, to: peer, wr: *wr, order });
        Ok(())
    }

    fn post_receives(&mut self, peer: usize, count: u32) -> Result<()> {
        let depth = self.config.receive_queue_depth;
        self.with_node(|node, _| {
            let qp = node.queue_pairs.get_mut(&peer).ok_or_else(|| MkError::invalid_usage("receives before create"))?;
            if qp.receives + count > depth {
                return Err(MkError::internal(format!(
                    "{} receives exceed the receive queue's {depth}",
                    qp.receives + count
                )));
            }
            qp.receives += count;
            Ok(())
        })
    }

    fn poll(&mut self, out: &mut Vec<Completion>) -> Result<()> {
        let mut fabric = self.fabric.0.lock();
        let most = fabric.config.deliveries_per_poll.max(1) as u64;
        let steps = 1 + fabric.rng.below(most);
        for _ in 0..steps {
            // A blocked pick (receiver without receives) costs the step, as time would.
            fabric.deliver_one();
        }
        let shuffle = fabric.config.ordering == SignalOrdering::Sequenced;
        let fabric = &mut *fabric;
        let node = fabric.nodes.get_mut(&self.rank).expect("endpoint registered its node");
        if !node.alive {
            return Err(MkError::system(format!("simulated device of rank {} is gone", self.rank)));
        }
        let start = out.len();
        out.append(&mut node.completions);
        if shuffle {
            fabric.rng.shuffle(&mut out[start..]);
        }
        Ok(())
    }
}
