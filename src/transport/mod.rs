//! Inter-node transports: what a proxy thread uses to carry a kernel's puts to a rank on
//! another node. Two implementations share one trait:
//! - `socket`: TCP between proxies, staged through host memory, authenticated like the
//!   bootstrap (always built; the fallback and the emulated multi-node tests);
//! - `rdma`: RDMA writes over InfiniBand/RoCE (RC) and AWS EFA (SRD), with libibverbs and
//!   libefa loaded at run time (always built; used where a device exists).
//!
//! `proxy` holds the device→host command ring and the thread that drains it;
//! `inter_node::start_inter_node` brings the whole path up for a communicator that spans
//! nodes; `staging` moves device-memory windows through pinned buffers for sockets. (The
//! GPU checks of the ring's device side are the tools crate's `device_check`.)
//!
//! Every put is "data, then signal": the destination's signal word changes only after all
//! the put's bytes are in place there, so a kernel spinning on the signal may read the data.
//! The order holds across puts to the same peer too: a signal also follows every earlier
//! put from this rank to that peer (so many unsignalled chunks then one signal is fine).

pub mod inter_node;
pub mod proxy;
pub mod rdma;
pub mod socket;
pub mod staging;
pub mod topology;

use crate::bootstrap::{crypto::hmac_sha256, Bootstrap, UniqueId};
use crate::error::{MkError, Result};

/// Where a registered region lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemoryKind {
    /// Host memory the CPU can address (pinned and device-mapped on a GPU machine).
    Host,
    /// CUDA device memory (RDMA registers it by dmabuf; sockets must stage it).
    Device,
}

/// A range of memory a transport may read from (local) or write into (remote).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryRegion {
    /// Address as the CPU sees it (host) or the device pointer (device).
    pub base: u64,
    pub bytes: u64,
    pub kind: MemoryKind,
}

/// The memory a rank exposes to its peers: a data region puts land in (at a destination
/// offset) and are read from (at a source offset), and an array of u64 signal words.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Window {
    pub data: MemoryRegion,
    pub signals: MemoryRegion,
}

impl Window {
    pub fn signal_words(&self) -> u64 {
        self.signals.bytes / 8
    }
}

/// A put: `bytes` from this rank's data region at `src_offset` to `peer`'s data region at
/// `dst_offset`, then, if `signal` is set, `peer`'s signal word `signal.0` := `signal.1`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PutRequest {
    pub peer: usize,
    pub src_offset: u64,
    pub dst_offset: u64,
    pub bytes: u64,
    pub signal: Option<(u32, u64)>,
}

/// Names one posted put; `Transport::poll` hands it back once the put completed locally
/// (its source bytes may be reused).
pub type PostId = u64;

/// One inter-node transport endpoint of one rank. Used from one thread (the proxy's).
///
/// Lifecycle: `register` this rank's window, exchange `connection_blob`s with every rank
/// (`connect_through_bootstrap`), `connect` to the peers, then `post_put` / `poll`, and
/// `close`. Every wait inside is bounded by the timeout the transport was created with;
/// a peer that died gives `mkRemoteError`, one that stopped responding `mkTimeout`.
pub trait Transport: Send {
    /// "socket" or "ib", for messages.
    fn name(&self) -> &'static str;

    /// Registers this rank's window (once, before `connection_blob`).
    ///
    /// # Safety
    /// The window's memory must stay valid, and not be freed or remapped, until `close`
    /// returns or the transport is dropped: the transport reads and writes it from its own
    /// threads (sockets) or the NIC does (RDMA).
    unsafe fn register(&mut self, window: Window) -> Result<()>;

    /// Bytes the peers need to reach this rank (addresses, keys, region sizes), after
    /// creating whatever per-peer endpoint `peers` need (RDMA: one queue pair each).
    fn connection_blob(&mut self, peers: &[usize]) -> Result<Vec<u8>>;

    /// Connects to `peers` using every rank's blob (`blobs[r]` from rank r). Every listed
    /// peer must list this rank too.
    fn connect(&mut self, blobs: &[Vec<u8>], peers: &[usize]) -> Result<()>;

    /// Starts a put. Ranges are checked against both windows: out of range is
    /// `mkInvalidArgument`, and nothing is sent.
    fn post_put(&mut self, put: &PutRequest) -> Result<PostId>;

    /// Appends the ids of puts that completed since the last call to `completed`; an error
    /// once any put failed or a peer was lost.
    fn poll(&mut self, completed: &mut Vec<PostId>) -> Result<()>;

    /// Finishes outstanding sends, tells the peers, and releases everything. Idempotent.
    fn close(&mut self) -> Result<()>;

    /// Releases everything now, dropping outstanding sends (mkCommAbort). The default
    /// closes, for transports whose close cannot block.
    fn abort(&mut self) {
        let _ = self.close();
    }
}

/// Exchanges connection blobs through the bootstrap (every rank must call it, even one
/// with no inter-node peers), connects to `peers`, and waits until every rank has, so no
/// put can reach a peer that is not ready for it.
pub fn connect_through_bootstrap(transport: &mut dyn Transport, bootstrap: &Bootstrap, peers: &[usize]) -> Result<()> {
    let blobs = bootstrap.allgather(&transport.connection_blob(peers)?)?;
    transport.connect(&blobs, peers)?;
    bootstrap.barrier()
}

/// The key transports prove they know when they connect (`bootstrap::handshake`, purpose
/// `Transport`): derived from the unique id's secret, so a transport handshake can never be
/// replayed as a bootstrap one (or back), and the transport never holds the secret itself.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct TransportAuth {
    pub key: [u8; 16],
    pub session: u64,
}

impl TransportAuth {
    pub fn new(secret: &[u8; 16], session: u64) -> TransportAuth {
        let d = hmac_sha256(secret, &[b"mkernel transport key v1", &session.to_le_bytes()]);
        TransportAuth { key: d[..16].try_into().expect("16 bytes"), session }
    }

    pub fn from_unique_id(id: &UniqueId) -> TransportAuth {
        Self::new(&id.secret, id.session)
    }
}

impl std::fmt::Debug for TransportAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransportAuth").field("session", &self.session).finish_non_exhaustive()
    }
}

/// Checks a put against the local window and the peer's, as every transport must before
/// sending anything.
pub fn check_put_ranges(put: &PutRequest, local: &Window, peer_data_bytes: u64, peer_signal_words: u64) -> Result<()> {
    let in_range = |offset: u64, bytes: u64, limit: u64| offset.checked_add(bytes).is_some_and(|end| end <= limit);
    if !in_range(put.src_offset, put.bytes, local.data.bytes) {
        return Err(MkError::invalid_argument(format!(
            "put source [{}, +{}) is outside this rank's {}-byte data region",
            put.src_offset, put.bytes, local.data.bytes
        )));
    }
    if !in_range(put.dst_offset, put.bytes, peer_data_bytes) {
        return Err(MkError::invalid_argument(format!(
            "put destination [{}, +{}) is outside rank {}'s {peer_data_bytes}-byte data region",
            put.dst_offset, put.bytes, put.peer
        )));
    }
    if let Some((id, _)) = put.signal {
        if id as u64 >= peer_signal_words {
            return Err(MkError::invalid_argument(format!(
                "signal {id} is outside rank {}'s {peer_signal_words} signal words",
                put.peer
            )));
        }
    }
    Ok(())
}

/// Checks the peer list handed to `connect`: in range, not this rank, no repeats.
pub fn check_peers(rank: usize, nranks: usize, blobs: usize, peers: &[usize]) -> Result<()> {
    if blobs != nranks {
        return Err(MkError::invalid_argument(format!("got {blobs} connection blobs for {nranks} ranks")));
    }
    for (i, &p) in peers.iter().enumerate() {
        if p >= nranks || p == rank || peers[..i].contains(&p) {
            return Err(MkError::invalid_argument(format!(
                "peer list {peers:?} of rank {rank} (of {nranks}) must name other ranks, each once"
            )));
        }
    }
    Ok(())
}

/// Which transport carries inter-node traffic.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NetKind {
    /// ibverbs (InfiniBand, RoCE, EFA through its verbs provider).
    Ib,
    /// TCP sockets.
    Socket,
}

/// Chooses the transport: `MK_NET` when set (`ib` or `socket`), otherwise ib when
/// libibverbs loaded and a usable device exists, else sockets.
/// `requested` is `MK_NET`; `verbs_loaded` whether libibverbs.so.1 could be loaded;
/// `usable_ib_devices` how many devices passed `MK_IB_HCA` with an active port.
pub fn select_net(requested: Option<&str>, verbs_loaded: bool, usable_ib_devices: usize) -> Result<NetKind> {
    match requested.map(|s| s.trim().to_ascii_lowercase()).as_deref() {
        None | Some("") => Ok(if verbs_loaded && usable_ib_devices > 0 { NetKind::Ib } else { NetKind::Socket }),
        Some("socket") => Ok(NetKind::Socket),
        Some("ib") if !verbs_loaded => Err(MkError::system(
            "MK_NET=ib, but libibverbs.so.1 could not be loaded (install rdma-core / libibverbs, or put it on the \
             loader path); or set MK_NET=socket",
        )),
        Some("ib") if usable_ib_devices == 0 => Err(MkError::system(
            "MK_NET=ib, but no RDMA device with an active port matches MK_IB_HCA (or none exists); \
             check ibv_devinfo or set MK_NET=socket",
        )),
        Some("ib") => Ok(NetKind::Ib),
        Some(other) => Err(MkError::invalid_argument(format!("MK_NET={other:?} is not one of: ib, socket"))),
    }
}

/// The transport for this process: `MK_NET`, libibverbs and the devices present.
pub fn select_net_from_env() -> Result<NetKind> {
    let loaded = rdma::ibverbs::library().is_ok();
    let usable = if loaded { rdma::usable_device_count() } else { 0 };
    select_net(crate::env::net().as_deref(), loaded, usable)
}

/// A parsed `MK_IB_HCA`, NCCL_IB_HCA style: comma-separated `name[:port]` entries matched
/// as name prefixes, `=` in front for exact names, `^` in front to exclude the entries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HcaFilter {
    exclude: bool,
    exact: bool,
    entries: Vec<(String, Option<u32>)>,
}

impl HcaFilter {
    pub fn parse(spec: &str) -> Result<HcaFilter> {
        let (exclude, rest) = match spec.trim().strip_prefix('^') {
            Some(r) => (true, r),
            None => (false, spec.trim()),
        };
        let (exact, rest) = match rest.strip_prefix('=') {
            Some(r) => (true, r),
            None => (false, rest),
        };
        let mut entries = Vec::new();
        for item in rest.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (name, port) = match item.split_once(':') {
                Some((n, p)) => {
                    let port = p.trim().parse::<u32>().ok().filter(|&p| p > 0).ok_or_else(|| {
                        MkError::invalid_argument(format!("MK_IB_HCA entry {item:?}: port must be a positive integer"))
                    })?;
                    (n.trim(), Some(port))
                }
                None => (item, None),
            };
            if name.is_empty() {
                return Err(MkError::invalid_argument(format!("MK_IB_HCA entry {item:?} has no device name")));
            }
            entries.push((name.to_string(), port));
        }
        if entries.is_empty() {
            return Err(MkError::invalid_argument(format!("MK_IB_HCA={spec:?} names no device")));
        }
        Ok(HcaFilter { exclude, exact, entries })
    }

    /// Whether port `port` of device `name` may be used.
    pub fn allows(&self, name: &str, port: u32) -> bool {
        let hit = self.entries.iter().any(|(n, p)| {
            let name_ok = if self.exact { name == n } else { name.starts_with(n.as_str()) };
            name_ok && p.is_none_or(|p| p == port)
        });
        hit != self.exclude
    }
}

/// The (device, port) pairs to use, in the order given, from every active one found.
pub fn select_hcas(filter: Option<&HcaFilter>, active_ports: &[(String, u32)]) -> Vec<(String, u32)> {
    active_ports.iter().filter(|(n, p)| filter.is_none_or(|f| f.allows(n, *p))).cloned().collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::mkResult_t;

    #[test]
    fn net_selection_follows_mk_net_then_devices() {
        assert_eq!(select_net(None, false, 0).unwrap(), NetKind::Socket);
        assert_eq!(select_net(None, true, 0).unwrap(), NetKind::Socket);
        assert_eq!(select_net(None, false, 2).unwrap(), NetKind::Socket);
        assert_eq!(select_net(None, true, 1).unwrap(), NetKind::Ib);
        assert_eq!(select_net(Some("socket"), true, 4).unwrap(), NetKind::Socket);
        assert_eq!(select_net(Some(" IB "), true, 1).unwrap(), NetKind::Ib);
        assert_eq!(select_net(Some("ib"), false, 1).unwrap_err().code, mkResult_t::mkSystemError);
        assert_eq!(select_net(Some("ib"), true, 0).unwrap_err().code, mkResult_t::mkSystemError);
        assert_eq!(select_net(Some("tcp"), true, 1).unwrap_err().code, mkResult_t::mkInvalidArgument);
    }

    #[test]
    fn hca_filter_prefix_exact_exclude_and_ports() {
        let ports: Vec<(String, u32)> = [("mlx5_0", 1), ("mlx5_1", 1), ("mlx5_10", 1), ("mlx5_10", 2), ("efa_0", 1)]
            .iter()
            .map(|(n, p)| (n.to_string(), *p))
            .collect();
        let pick = |spec: &str| select_hcas(Some(&HcaFilter::parse(spec).unwrap()), &ports);
        assert_eq!(select_hcas(None, &ports).len(), 5);
        assert_eq!(pick("mlx5_1").len(), 3, "prefix mlx5_1 matches mlx5_1 and both ports of mlx5_10");
        assert_eq!(pick("=mlx5_1"), vec![("mlx5_1".to_string(), 1)]);
        assert_eq!(pick("mlx5_10:2"), vec![("mlx5_10".to_string(), 2)]);
        assert_eq!(pick("^mlx5"), vec![("efa_0".to_string(), 1)]);
        assert_eq!(pick("^=mlx5_10:1").len(), 4);
        assert_eq!(pick("efa, mlx5_0").len(), 2);
        for bad in ["", "^", ":1", "mlx5_0:x", "mlx5_0:0"] {
            assert_eq!(HcaFilter::parse(bad).unwrap_err().code, mkResult_t::mkInvalidArgument, "{bad:?}");
        }
    }

    #[test]
    fn transport_key_differs_from_secret_and_by_session() {
        let a = TransportAuth::new(&[3; 16], 1);
        assert_ne!(a.key, [3; 16]);
        assert_ne!(a.key, TransportAuth::new(&[3; 16], 2).key);
        assert_ne!(a.key, TransportAuth::new(&[4; 16], 1).key);
        assert_eq!(a.key, TransportAuth::new(&[3; 16], 1).key);
    }

    #[test]
    fn put_ranges_are_checked_on_both_sides() {
        let region = |bytes| MemoryRegion { base: 0x1000, bytes, kind: MemoryKind::Host };
        let local = Window { data: region(100), signals: region(64) };
        let put = PutRequest { peer: 1, src_offset: 90, dst_offset: 0, bytes: 10, signal: Some((7, 1)) };
        assert!(check_put_ranges(&put, &local, 10, 8).is_ok());
        let bad = [
            PutRequest { src_offset: 91, ..put },
            PutRequest { dst_offset: 1, ..put },
            PutRequest { signal: Some((8, 1)), ..put },
            PutRequest { src_offset: u64::MAX, ..put },
            PutRequest { dst_offset: u64::MAX - 2, ..put },
        ];
        for b in bad {
            assert_eq!(check_put_ranges(&b, &local, 10, 8).unwrap_err().code, mkResult_t::mkInvalidArgument, "{b:?}");
        }
    }

    #[test]
    fn peer_lists_are_checked() {
        assert!(check_peers(1, 4, 4, &[0, 3]).is_ok());
        assert!(check_peers(1, 4, 4, &[]).is_ok());
        for bad in [&[1][..], &[4], &[0, 0]] {
            assert_eq!(check_peers(1, 4, 4, bad).unwrap_err().code, mkResult_t::mkInvalidArgument);
        }
        assert!(check_peers(1, 4, 3, &[0]).is_err());
    }
}
