//! Messages between ranks and the root, in a fixed little-endian layout. Every count and
//! length read here is bounded before it sizes anything.

use super::unique_id::{decode_addr, encode_addr, ENCODED_ADDR_BYTES};
use super::MAX_RANKS;
use crate::error::{mkResult_t, MkError, Result};
use std::net::SocketAddr;

/// What a rank tells the root about itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hello {
    pub rank: u32,
    pub nranks: u32,
    /// Where this rank accepts its ring neighbour.
    pub listen: SocketAddr,
    /// Identifies the host (hostname and boot id), to group ranks into nodes.
    pub host_hash: u64,
    /// The rank's MK_BOOTSTRAP_TIMEOUT_MS; the root bounds the rendezvous by the first one.
    pub timeout_ms: u32,
}

pub const HELLO_BYTES: usize = 8 + ENCODED_ADDR_BYTES + 8 + 4;
/// The longest error message a root reply carries (longer ones are cut).
pub const MAX_ERROR_MESSAGE_BYTES: usize = 4096;
/// The largest root reply: a table of `MAX_RANKS` hellos.
pub const MAX_ROOT_REPLY_BYTES: usize = 5 + MAX_RANKS * HELLO_BYTES;

impl Hello {
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(HELLO_BYTES);
        v.extend_from_slice(&self.rank.to_le_bytes());
        v.extend_from_slice(&self.nranks.to_le_bytes());
        encode_addr(&self.listen, &mut v);
        v.extend_from_slice(&self.host_hash.to_le_bytes());
        v.extend_from_slice(&self.timeout_ms.to_le_bytes());
        v
    }

    pub fn decode(b: &[u8]) -> Result<Hello> {
        if b.len() != HELLO_BYTES {
            return Err(MkError::remote(format!("bootstrap hello has {} bytes, expected {HELLO_BYTES}", b.len())));
        }
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"));
        let o = 8 + ENCODED_ADDR_BYTES;
        Ok(Hello {
            rank: u32_at(0),
            nranks: u32_at(4),
            listen: decode_addr(&b[8..])?,
            host_hash: u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes")),
            timeout_ms: u32_at(o + 8),
        })
    }
}

/// The root's answer: every rank's hello in rank order, or the error that ended the rendezvous.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RootReply {
    Table(Vec<Hello>),
    Error(MkError),
}

impl RootReply {
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::new();
        match self {
            RootReply::Table(t) => {
                v.push(0);
                v.extend_from_slice(&(t.len() as u32).to_le_bytes());
                for h in t {
                    v.extend_from_slice(&h.encode());
                }
            }
            RootReply::Error(e) => {
                v.push(1);
                v.extend_from_slice(&(e.code as i32).to_le_bytes());
                let mut cut = e.message.len().min(MAX_ERROR_MESSAGE_BYTES);
                while !e.message.is_char_boundary(cut) {
                    cut -= 1;
                }
                v.extend_from_slice(&e.message.as_bytes()[..cut]);
            }
        }
        v
    }

    pub fn decode(b: &[u8]) -> Result<RootReply> {
        let bad = || MkError::remote("malformed reply from the bootstrap root");
        match b.first() {
            Some(0) => {
                let n = u32::from_le_bytes(b.get(1..5).ok_or_else(bad)?.try_into().expect("4 bytes")) as usize;
                let body = &b[5..];
                if n > MAX_RANKS || body.len() != n * HELLO_BYTES {
                    return Err(bad());
                }
                body.chunks_exact(HELLO_BYTES).map(Hello::decode).collect::<Result<_>>().map(RootReply::Table)
            }
            Some(1) => {
                let code = i32::from_le_bytes(b.get(1..5).ok_or_else(bad)?.try_into().expect("4 bytes"));
                let msg = &b[5..];
                if msg.len() > MAX_ERROR_MESSAGE_BYTES {
                    return Err(bad());
                }
                let msg = String::from_utf8_lossy(msg).into_owned();
                // An error reply always fails the join, whatever code a peer claims.
                let code = match mkResult_t::from_i32(code) {
                    mkResult_t::mkSuccess | mkResult_t::mkInProgress => mkResult_t::mkRemoteError,
                    c => c,
                };
                Ok(RootReply::Error(MkError::new(code, msg)))
            }
            _ => Err(bad()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hello_and_replies_round_trip() {
        let h = Hello {
            rank: 3,
            nranks: 8,
            listen: "192.168.1.9:3333".parse().unwrap(),
            host_hash: 0xdead_beef,
            timeout_ms: 1500,
        };
        assert_eq!(Hello::decode(&h.encode()).unwrap(), h);
        let t = RootReply::Table(vec![h.clone(), Hello { rank: 4, ..h.clone() }]);
        assert_eq!(RootReply::decode(&t.encode()).unwrap(), t);
        let e = RootReply::Error(MkError::invalid_usage("duplicate rank"));
        assert_eq!(RootReply::decode(&e.encode()).unwrap(), e);
        assert!(RootReply::decode(&[7]).is_err());
        assert!(Hello::decode(&[0; 3]).is_err());
    }
}
