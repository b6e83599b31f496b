//! Authenticated frames on a connection that passed the handshake: every frame is
//! `length (u64 LE) | payload | HMAC-SHA256(direction key, sequence | length | payload)`.
//!
//! Each direction has its own key (derived from the handshake transcript), and both sides
//! count frames, so a frame cannot be altered, dropped, replayed, reordered or reflected back
//! to its sender without the receiver refusing it. Every length is checked against the
//! receiver's bound for that step before anything is allocated.

use super::crypto::{hmac_sha256, hmac_sha256_verify, TAG_BYTES};
use super::net::{write_all_before, Deadline, ReadBefore};
use crate::error::{MkError, Result};
use std::net::{SocketAddr, TcpStream};

/// Bytes of a frame's length field.
pub const LENGTH_BYTES: usize = 8;

/// The two keys of one connection, as seen from one end.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct FrameKeys {
    pub send: [u8; 32],
    pub recv: [u8; 32],
}

impl std::fmt::Debug for FrameKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FrameKeys(..)")
    }
}

/// One direction's frame sequence: the key and the number of the next frame.
#[derive(Clone, Copy, Debug)]
pub struct FrameCounter {
    key: [u8; 32],
    next: u64,
}

impl FrameCounter {
    pub fn new(key: [u8; 32]) -> Self {
        FrameCounter { key, next: 0 }
    }

    /// The bytes that carry `payload` as the next frame.
    pub fn seal(&mut self, payload: &[u8]) -> Vec<u8> {
        let len = (payload.len() as u64).to_le_bytes();
        let tag = hmac_sha256(&self.key, &[&self.next.to_le_bytes(), &len, payload]);
        self.next += 1;
        let mut out = Vec::with_capacity(LENGTH_BYTES + payload.len() + TAG_BYTES);
        out.extend_from_slice(&len);
        out.extend_from_slice(payload);
        out.extend_from_slice(&tag);
        out
    }

    /// Reads the next frame from `source`: refuses a length over `max_bytes` before
    /// allocating, and a tag that does not match (`mkRemoteError` naming `what`).
    pub fn open(
        &mut self,
        source: &mut impl ReadBefore,
        max_bytes: usize,
        deadline: &Deadline,
        what: &dyn std::fmt::Display,
    ) -> Result<Vec<u8>> {
        let mut len = [0u8; LENGTH_BYTES];
        source.read_exact_before(&mut len, deadline, what)?;
        let n = u64::from_le_bytes(len);
        if n > max_bytes as u64 {
            return Err(MkError::remote(format!("{what}: peer sent a {n}-byte frame (limit {max_bytes})")));
        }
        let mut payload = vec![0u8; n as usize];
        source.read_exact_before(&mut payload, deadline, what)?;
        let mut tag = [0u8; TAG_BYTES];
        source.read_exact_before(&mut tag, deadline, what)?;
        if !hmac_sha256_verify(&self.key, &[&self.next.to_le_bytes(), &len, &payload], &tag) {
            return Err(MkError::remote(format!(
                "{what}: a frame failed its authentication check (altered, replayed or out of order)"
            )));
        }
        self.next += 1;
        Ok(payload)
    }
}

/// A connection whose frames carry MACs in both directions.
pub struct SecureStream {
    socket: TcpStream,
    peer: SocketAddr,
    sending: FrameCounter,
    receiving: FrameCounter,
}

impl SecureStream {
    pub fn new(socket: TcpStream, peer: SocketAddr, keys: FrameKeys) -> Self {
        SecureStream { socket, peer, sending: FrameCounter::new(keys.send), receiving: FrameCounter::new(keys.recv) }
    }

    pub fn peer(&self) -> SocketAddr {
        self.peer
    }

    pub fn socket(&self) -> &TcpStream {
        &self.socket
    }

    /// The plain socket, for a protocol that carries its own checks after the handshake.
    pub fn into_socket(self) -> TcpStream {
        self.socket
    }

    pub fn send(&mut self, payload: &[u8], deadline: &Deadline, what: &dyn std::fmt::Display) -> Result<()> {
        let bytes = self.sending.seal(payload);
        write_all_before(&mut self.socket, &bytes, deadline, what)
    }

    /// Receives one frame of at most `max_bytes`.
    pub fn recv(&mut self, max_bytes: usize, deadline: &Deadline, what: &dyn std::fmt::Display) -> Result<Vec<u8>> {
        self.receiving.open(&mut self.socket, max_bytes, deadline, what)
    }

    /// Receives with the frame counter already past frames read elsewhere (the acceptor
    /// reads a connection's first frame itself).
    pub fn with_received(mut self, frames: u64) -> Self {
        self.receiving.next += frames;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn deadline() -> Deadline {
        Deadline::bootstrap(Duration::from_secs(1))
    }

    #[test]
    fn frames_round_trip_in_order_and_refuse_tampering() {
        let key = [7u8; 32];
        let (mut tx, mut rx) = (FrameCounter::new(key), FrameCounter::new(key));
        let a = tx.seal(b"first");
        let b = tx.seal(b"");
        let wire: Vec<u8> = [a.clone(), b.clone()].concat();
        let mut src = &wire[..];
        assert_eq!(rx.open(&mut src, 16, &deadline(), &"t").unwrap(), b"first");
        assert_eq!(rx.open(&mut src, 16, &deadline(), &"t").unwrap(), b"");
        // Replaying the first frame, or delivering frames out of order, fails.
        let mut rx2 = FrameCounter::new(key);
        assert!(rx2.open(&mut &b[..], 16, &deadline(), &"t").is_err());
        assert!(rx.open(&mut &a[..], 16, &deadline(), &"t").is_err());
        // A frame under another direction's key fails.
        let mut other = FrameCounter::new([8u8; 32]);
        assert!(other.open(&mut &a[..], 16, &deadline(), &"t").is_err());
        // Every flipped bit fails (length, payload or tag).
        for i in 0..a.len() * 8 {
            let mut bad = a.clone();
            bad[i / 8] ^= 1 << (i % 8);
            assert!(FrameCounter::new(key).open(&mut &bad[..], 64, &deadline(), &"t").is_err(), "bit {i}");
        }
        // Over the receiver's bound: refused before reading the payload.
        let e = FrameCounter::new(key).open(&mut &a[..], 4, &deadline(), &"t").unwrap_err();
        assert!(e.message.contains("limit 4"), "{e}");
    }
}
