//! `mkUniqueId`: 128 opaque bytes carrying the root's address and port, a random 128-bit
//! secret every joining connection must prove it knows, a random session number, and when
//! the root stops waiting for its first rank.

use super::net::random_bytes;
use crate::error::{MkError, Result};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::{Duration, SystemTime};

pub const UNIQUE_ID_BYTES: usize = 128;
const MAGIC: &[u8; 4] = b"MKU1";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UniqueId {
    pub root: SocketAddr,
    pub secret: [u8; 16],
    pub session: u64,
    /// When the root closes if no rank has joined by then, in ms since the Unix epoch on
    /// the root's clock (0: unknown). A rank that finds no root uses it to say truthfully
    /// whether that limit can be why.
    pub root_idle_until_ms: u64,
}

/// Writes a socket address as family (1 byte), port (2), address (16).
pub fn encode_addr(a: &SocketAddr, out: &mut Vec<u8>) {
    match a.ip() {
        IpAddr::V4(v4) => {
            out.push(4);
            out.extend_from_slice(&a.port().to_le_bytes());
            let mut b = [0u8; 16];
            b[..4].copy_from_slice(&v4.octets());
            out.extend_from_slice(&b);
        }
        IpAddr::V6(v6) => {
            out.push(6);
            out.extend_from_slice(&a.port().to_le_bytes());
            out.extend_from_slice(&v6.octets());
        }
    }
}

pub const ENCODED_ADDR_BYTES: usize = 19;

pub fn decode_addr(b: &[u8]) -> Result<SocketAddr> {
    if b.len() < ENCODED_ADDR_BYTES {
        return Err(MkError::remote("truncated socket address in bootstrap message"));
    }
    let port = u16::from_le_bytes([b[1], b[2]]);
    let ip = match b[0] {
        4 => IpAddr::V4(Ipv4Addr::new(b[3], b[4], b[5], b[6])),
        6 => IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(&b[3..19]).expect("16 bytes"))),
        f => return Err(MkError::remote(format!("unknown address family {f} in bootstrap message"))),
    };
    Ok(SocketAddr::new(ip, port))
}

fn unix_time() -> Duration {
    SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default()
}

impl UniqueId {
    pub fn new(root: SocketAddr) -> Result<Self> {
        let mut secret = [0u8; 16];
        random_bytes(&mut secret)?;
        let mut session = [0u8; 8];
        random_bytes(&mut session)?;
        Ok(UniqueId { root, secret, session: u64::from_le_bytes(session), root_idle_until_ms: 0 })
    }

    /// This id, recording that its root closes `idle` from now if no rank joins.
    pub fn with_root_idle_limit(self, idle: Duration) -> Self {
        let until = unix_time().saturating_add(idle);
        UniqueId { root_idle_until_ms: until.as_millis().min(u128::from(u64::MAX)) as u64, ..self }
    }

    /// Whether the root's wait for its first rank is over (true when unknown).
    pub fn root_idle_limit_passed(&self) -> bool {
        unix_time().as_millis() >= u128::from(self.root_idle_until_ms)
    }

    pub fn to_bytes(self) -> [u8; UNIQUE_ID_BYTES] {
        let mut v = Vec::with_capacity(UNIQUE_ID_BYTES);
        v.extend_from_slice(MAGIC);
        encode_addr(&self.root, &mut v);
        v.extend_from_slice(&self.secret);
        v.extend_from_slice(&self.session.to_le_bytes());
        v.extend_from_slice(&self.root_idle_until_ms.to_le_bytes());
        let mut out = [0u8; UNIQUE_ID_BYTES];
        out[..v.len()].copy_from_slice(&v);
        out
    }

    pub fn from_bytes(b: &[u8; UNIQUE_ID_BYTES]) -> Result<Self> {
        if &b[..4] != MAGIC {
            return Err(MkError::invalid_argument(
                "the unique id was not made by mkGetUniqueId (bad magic): pass the bytes rank 0 got, unchanged",
            ));
        }
        let root = decode_addr(&b[4..]).map_err(|e| MkError::invalid_argument(e.message))?;
        let o = 4 + ENCODED_ADDR_BYTES;
        let secret: [u8; 16] = b[o..o + 16].try_into().expect("16 bytes");
        let session = u64::from_le_bytes(b[o + 16..o + 24].try_into().expect("8 bytes"));
        let root_idle_until_ms = u64::from_le_bytes(b[o + 24..o + 32].try_into().expect("8 bytes"));
        Ok(UniqueId { root, secret, session, root_idle_until_ms })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_v4_and_v6() {
        for root in ["10.1.2.3:4567".parse().unwrap(), "[2001:db8::7]:9".parse().unwrap()] {
            let id = UniqueId::new(root).unwrap().with_root_idle_limit(Duration::from_secs(60));
            let back = UniqueId::from_bytes(&id.to_bytes()).unwrap();
            assert_eq!(back, id);
        }
    }

    #[test]
    fn the_root_idle_limit_is_known_to_have_passed_only_once_it_has() {
        let root = "127.0.0.1:1".parse().unwrap();
        let fresh = UniqueId::new(root).unwrap();
        assert!(fresh.root_idle_limit_passed(), "unknown counts as passed");
        assert!(!fresh.with_root_idle_limit(Duration::from_secs(60)).root_idle_limit_passed());
        assert!(fresh.with_root_idle_limit(Duration::ZERO).root_idle_limit_passed());
    }

    #[test]
    fn two_ids_have_different_secrets() {
        let root = "127.0.0.1:1".parse().unwrap();
        assert_ne!(UniqueId::new(root).unwrap().secret, UniqueId::new(root).unwrap().secret);
    }

    #[test]
    fn garbage_is_rejected_as_invalid_argument() {
        let e = UniqueId::from_bytes(&[0u8; UNIQUE_ID_BYTES]).unwrap_err();
        assert_eq!(e.code, crate::error::mkResult_t::mkInvalidArgument);
        let mut b = UniqueId::new("127.0.0.1:1".parse().unwrap()).unwrap().to_bytes();
        b[4] = 9; // unknown address family
        assert!(UniqueId::from_bytes(&b).is_err());
    }
}
