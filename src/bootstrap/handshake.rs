//! The handshake every bootstrap and transport connection starts with: mutual proof of a
//! shared key, bound to the connection's direction, purpose and both ends' identities.
//!
//! ```text
//! acceptor -> dialer   Challenge: "MKA2" | status | purpose | acceptor nonce (16)
//! dialer -> acceptor   Proof:     "MKD2" | dialer nonce (16) | dialer id | target id |
//!                                 HMAC(key, "dialer proof" | transcript)
//! acceptor -> dialer   Verdict:   status | HMAC(key, "acceptor proof" | transcript)
//! transcript = purpose | session | acceptor nonce | dialer nonce | dialer id | target id
//! ```
//! Each side's proof carries a label for its own direction and both fresh nonces, so a
//! proof can neither be reflected back to its sender nor replayed on another connection;
//! the ids and purpose bind it to one edge (rank 3 dialing rank 4's ring listener), so it
//! cannot be relayed to a different endpoint either. Frames after the handshake use keys
//! derived from the same transcript (`frames`).
//!
//! A dialer retries until its step's deadline: refused and reset connections, an acceptor
//! that is busy (too many handshakes in flight) or one that dropped it, after a pause with
//! random jitter. It stops at once on an authentication failure, which is never transient.
//! While an acceptor's slots are full, a dialer's connection waits in the kernel's accept
//! queue, and the dialer waits for its challenge (see `acceptor`).

use super::crypto::{hmac_sha256, hmac_sha256_verify, TAG_BYTES};
use super::frames::{FrameKeys, SecureStream};
use super::net::{self, random_bytes, write_all_before, Deadline, ReadBefore};
use crate::error::{mkResult_t, MkError, Result};
use std::net::SocketAddr;
use std::time::Duration;

/// Bound on one accepted connection's handshake (and on the dialer's wait for a verdict).
pub const HANDSHAKE_LIMIT: Duration = Duration::from_secs(5);
/// How timeout messages name `HANDSHAKE_LIMIT`.
pub const HANDSHAKE_LIMIT_NAME: &str = "mkernel's fixed HANDSHAKE_LIMIT";
/// How long an accepted connection keeps its handshake slot without sending its proof
/// while other connections wait for a slot. The proof is one round trip after the
/// challenge; this allows for hundreds of LAN round trips and a dialer descheduled on a
/// busy host. A dialer that misses it is closed and retries.
pub const PROOF_GRACE: Duration = Duration::from_millis(250);
/// A dialer's first pause between attempts; it doubles up to `MAX_RETRY_PAUSE`.
const FIRST_RETRY_PAUSE: Duration = Duration::from_millis(5);
const MAX_RETRY_PAUSE: Duration = Duration::from_millis(200);

const CHALLENGE_MAGIC: &[u8; 4] = b"MKA2";
const PROOF_MAGIC: &[u8; 4] = b"MKD2";
pub const NONCE_BYTES: usize = 16;
pub const CHALLENGE_BYTES: usize = 4 + 1 + 1 + NONCE_BYTES;
pub const PROOF_BYTES: usize = 4 + NONCE_BYTES + 4 + 4 + TAG_BYTES;
pub const VERDICT_BYTES: usize = 1 + TAG_BYTES;
/// The target id a rank uses when it dials the bootstrap root.
pub const ROOT_ID: u32 = u32::MAX;

const DIALER_LABEL: &[u8] = b"mkernel handshake v2: dialer proof";
const ACCEPTOR_LABEL: &[u8] = b"mkernel handshake v2: acceptor proof";
const DIALER_FRAMES_LABEL: &[u8] = b"mkernel handshake v2: frames from dialer";
const ACCEPTOR_FRAMES_LABEL: &[u8] = b"mkernel handshake v2: frames from acceptor";

/// Which listener a connection is for; part of every proof.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Purpose {
    BootstrapRoot = 1,
    BootstrapRing = 2,
    Transport = 3,
}

impl Purpose {
    fn from_u8(b: u8) -> Option<Purpose> {
        match b {
            1 => Some(Purpose::BootstrapRoot),
            2 => Some(Purpose::BootstrapRing),
            3 => Some(Purpose::Transport),
            _ => None,
        }
    }

    pub fn describe(self) -> &'static str {
        match self {
            Purpose::BootstrapRoot => "bootstrap root",
            Purpose::BootstrapRing => "bootstrap ring",
            Purpose::Transport => "socket transport",
        }
    }
}

/// The challenge's status byte.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum ChallengeStatus {
    Ready = 0,
    /// Too many handshakes in flight: try again shortly. mkernel's acceptors queue
    /// newcomers instead (`acceptor`), but a dialer still treats it as a reason to retry.
    Busy = 1,
}

/// The verdict's status byte.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum VerdictStatus {
    Accepted = 0,
    /// The dialer's proof does not match the acceptor's key.
    WrongProof = 1,
    /// The proof is good, but this acceptor is not the target or does not expect this dialer.
    UnexpectedPeer = 2,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Challenge {
    pub status: ChallengeStatus,
    pub purpose: Purpose,
    pub nonce: [u8; NONCE_BYTES],
}

impl Challenge {
    pub fn encode(&self) -> [u8; CHALLENGE_BYTES] {
        let mut b = [0u8; CHALLENGE_BYTES];
        b[..4].copy_from_slice(CHALLENGE_MAGIC);
        b[4] = self.status as u8;
        b[5] = self.purpose as u8;
        b[6..].copy_from_slice(&self.nonce);
        b
    }

    pub fn decode(b: &[u8]) -> Result<Challenge> {
        if b.len() != CHALLENGE_BYTES || &b[..4] != CHALLENGE_MAGIC {
            return Err(MkError::remote("the peer is not an mkernel endpoint (no handshake challenge)"));
        }
        let status = match b[4] {
            0 => ChallengeStatus::Ready,
            1 => ChallengeStatus::Busy,
            s => return Err(MkError::remote(format!("handshake challenge with unknown status {s}"))),
        };
        let purpose = Purpose::from_u8(b[5])
            .ok_or_else(|| MkError::remote(format!("handshake challenge with unknown purpose {}", b[5])))?;
        Ok(Challenge { status, purpose, nonce: b[6..].try_into().expect("16 bytes") })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Proof {
    pub nonce: [u8; NONCE_BYTES],
    pub dialer: u32,
    pub target: u32,
    pub tag: [u8; TAG_BYTES],
}

impl Proof {
    pub fn encode(&self) -> [u8; PROOF_BYTES] {
        let mut b = [0u8; PROOF_BYTES];
        b[..4].copy_from_slice(PROOF_MAGIC);
        b[4..20].copy_from_slice(&self.nonce);
        b[20..24].copy_from_slice(&self.dialer.to_le_bytes());
        b[24..28].copy_from_slice(&self.target.to_le_bytes());
        b[28..].copy_from_slice(&self.tag);
        b
    }

    pub fn decode(b: &[u8]) -> Result<Proof> {
        if b.len() != PROOF_BYTES || &b[..4] != PROOF_MAGIC {
            return Err(MkError::remote("the peer is not an mkernel endpoint (no handshake proof)"));
        }
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"));
        Ok(Proof {
            nonce: b[4..20].try_into().expect("16 bytes"),
            dialer: u32_at(20),
            target: u32_at(24),
            tag: b[28..].try_into().expect("32 bytes"),
        })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Verdict {
    pub status: VerdictStatus,
    pub tag: [u8; TAG_BYTES],
}

impl Verdict {
    pub fn encode(&self) -> [u8; VERDICT_BYTES] {
        let mut b = [0u8; VERDICT_BYTES];
        b[0] = self.status as u8;
        b[1..].copy_from_slice(&self.tag);
        b
    }

    pub fn decode(b: &[u8]) -> Result<Verdict> {
        if b.len() != VERDICT_BYTES {
            return Err(MkError::remote(format!("handshake verdict has {} bytes, expected {VERDICT_BYTES}", b.len())));
        }
        let status = match b[0] {
            0 => VerdictStatus::Accepted,
            1 => VerdictStatus::WrongProof,
            2 => VerdictStatus::UnexpectedPeer,
            s => return Err(MkError::remote(format!("handshake verdict with unknown status {s}"))),
        };
        Ok(Verdict { status, tag: b[1..].try_into().expect("32 bytes") })
    }
}

/// Everything both proofs and the frame keys are computed over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Transcript {
    pub purpose: Purpose,
    pub session: u64,
    pub acceptor_nonce: [u8; NONCE_BYTES],
    pub dialer_nonce: [u8; NONCE_BYTES],
    pub dialer: u32,
    pub target: u32,
}

impl Transcript {
    fn bytes(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(1 + 8 + 2 * NONCE_BYTES + 8);
        v.push(self.purpose as u8);
        v.extend_from_slice(&self.session.to_le_bytes());
        v.extend_from_slice(&self.acceptor_nonce);
        v.extend_from_slice(&self.dialer_nonce);
        v.extend_from_slice(&self.dialer.to_le_bytes());
        v.extend_from_slice(&self.target.to_le_bytes());
        v
    }

    pub fn dialer_proof(&self, key: &[u8]) -> [u8; TAG_BYTES] {
        hmac_sha256(key, &[DIALER_LABEL, &self.bytes()])
    }

    pub fn acceptor_proof(&self, key: &[u8]) -> [u8; TAG_BYTES] {
        hmac_sha256(key, &[ACCEPTOR_LABEL, &self.bytes()])
    }

    /// The frame keys as the dialer uses them (the acceptor swaps send and receive).
    pub fn dialer_frame_keys(&self, key: &[u8]) -> FrameKeys {
        let t = self.bytes();
        FrameKeys {
            send: hmac_sha256(key, &[DIALER_FRAMES_LABEL, &t]),
            recv: hmac_sha256(key, &[ACCEPTOR_FRAMES_LABEL, &t]),
        }
    }

    pub fn acceptor_frame_keys(&self, key: &[u8]) -> FrameKeys {
        let k = self.dialer_frame_keys(key);
        FrameKeys { send: k.recv, recv: k.send }
    }
}

/// Why an acceptor refused a proof; logged by the acceptor, told to the dialer by the verdict.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    WrongProof,
    WrongTarget { target: u32 },
    UnexpectedDialer { dialer: u32 },
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::WrongProof => f.write_str("its proof does not match the unique id's secret"),
            Refusal::WrongTarget { target } => write!(f, "it proved the secret but was meant for id {target}"),
            Refusal::UnexpectedDialer { dialer } => {
                write!(f, "it proved the secret as rank {dialer}, which is not expected here")
            }
        }
    }
}

/// The acceptor's side of one handshake: its key, identity and nonce.
pub struct AcceptorSide<'k> {
    pub key: &'k [u8],
    pub session: u64,
    pub purpose: Purpose,
    pub me: u32,
    pub nonce: [u8; NONCE_BYTES],
}

impl<'k> AcceptorSide<'k> {
    pub fn new(key: &'k [u8], session: u64, purpose: Purpose, me: u32) -> Result<Self> {
        let mut nonce = [0u8; NONCE_BYTES];
        random_bytes(&mut nonce)?;
        Ok(AcceptorSide { key, session, purpose, me, nonce })
    }

    pub fn challenge(&self) -> [u8; CHALLENGE_BYTES] {
        Challenge { status: ChallengeStatus::Ready, purpose: self.purpose, nonce: self.nonce }.encode()
    }

    /// Checks the dialer's proof message. Returns the verdict to send and, when accepted,
    /// the dialer's id and this side's frame keys. `wanted` says whether a dialer id is
    /// expected here. The acceptor's own proof is sent only to a dialer that proved the key.
    pub fn check(
        &self,
        proof: &[u8],
        wanted: &dyn Fn(u32) -> bool,
    ) -> ([u8; VERDICT_BYTES], std::result::Result<(u32, FrameKeys), Refusal>) {
        let refuse = |status: VerdictStatus, why: Refusal| (Verdict { status, tag: [0; TAG_BYTES] }.encode(), Err(why));
        let Ok(p) = Proof::decode(proof) else {
            return refuse(VerdictStatus::WrongProof, Refusal::WrongProof);
        };
        let t = Transcript {
            purpose: self.purpose,
            session: self.session,
            acceptor_nonce: self.nonce,
            dialer_nonce: p.nonce,
            dialer: p.dialer,
            target: p.target,
        };
        if !hmac_sha256_verify(self.key, &[DIALER_LABEL, &t.bytes()], &p.tag) {
            return refuse(VerdictStatus::WrongProof, Refusal::WrongProof);
        }
        if p.target != self.me {
            return refuse(VerdictStatus::UnexpectedPeer, Refusal::WrongTarget { target: p.target });
        }
        if !wanted(p.dialer) {
            return refuse(VerdictStatus::UnexpectedPeer, Refusal::UnexpectedDialer { dialer: p.dialer });
        }
        let verdict = Verdict { status: VerdictStatus::Accepted, tag: t.acceptor_proof(self.key) };
        (verdict.encode(), Ok((p.dialer, t.acceptor_frame_keys(self.key))))
    }
}

/// Who dials whom, and with which key.
#[derive(Clone, Copy)]
pub struct DialSpec<'k> {
    pub key: &'k [u8],
    pub session: u64,
    pub purpose: Purpose,
    pub dialer: u32,
    pub target: u32,
}

/// The dialer's side after reading a challenge: the proof to send, and how to check the
/// verdict. Pure, so tests can drive it with any bytes.
pub struct DialerSide<'k> {
    spec: DialSpec<'k>,
    transcript: Transcript,
}

impl<'k> DialerSide<'k> {
    /// `Ok(None)`: the acceptor is busy, try again.
    pub fn answer(
        spec: DialSpec<'k>,
        challenge: &[u8],
        dialer_nonce: [u8; NONCE_BYTES],
    ) -> Result<Option<(Self, [u8; PROOF_BYTES])>> {
        let c = Challenge::decode(challenge)?;
        if c.purpose != spec.purpose {
            return Err(MkError::remote(format!(
                "the peer is a {} endpoint, not the {} this rank dialed",
                c.purpose.describe(),
                spec.purpose.describe()
            )));
        }
        if c.status == ChallengeStatus::Busy {
            return Ok(None);
        }
        let transcript = Transcript {
            purpose: spec.purpose,
            session: spec.session,
            acceptor_nonce: c.nonce,
            dialer_nonce,
            dialer: spec.dialer,
            target: spec.target,
        };
        let proof = Proof {
            nonce: dialer_nonce,
            dialer: spec.dialer,
            target: spec.target,
            tag: transcript.dialer_proof(spec.key),
        };
        Ok(Some((DialerSide { spec, transcript }, proof.encode())))
    }

    /// Checks the verdict: the frame keys when the acceptor accepted and proved the key.
    pub fn finish(&self, verdict: &[u8], peer: SocketAddr) -> Result<FrameKeys> {
        let v = Verdict::decode(verdict)?;
        let name = self.spec.purpose.describe();
        match v.status {
            VerdictStatus::WrongProof => Err(MkError::invalid_usage(format!(
                "authentication failed: the {name} at {peer} refused this rank's proof of the unique id's secret \
                 (every rank must pass the same mkUniqueId bytes, unchanged, that mkGetUniqueId gave for this \
                 communicator)"
            ))),
            VerdictStatus::UnexpectedPeer => Err(MkError::remote(format!(
                "the {name} at {peer} knows the unique id's secret but does not expect rank {} to dial it as id {} \
                 (ranks disagree on the layout)",
                self.spec.dialer, self.spec.target
            ))),
            VerdictStatus::Accepted
                if hmac_sha256_verify(self.spec.key, &[ACCEPTOR_LABEL, &self.transcript.bytes()], &v.tag) =>
            {
                Ok(self.transcript.dialer_frame_keys(self.spec.key))
            }
            VerdictStatus::Accepted => Err(MkError::remote(format!(
                "authentication failed: the {name} at {peer} did not prove it knows the unique id's secret \
                 (another program is listening there, or the unique ids differ)"
            ))),
        }
    }
}

/// A handshake attempt's failure: worth another try before the deadline, or final.
enum AttemptError {
    Retry(MkError),
    Fatal(MkError),
}

fn attempt(
    addr: SocketAddr,
    spec: DialSpec<'_>,
    deadline: &Deadline,
    what: &str,
) -> std::result::Result<SecureStream, AttemptError> {
    use AttemptError::*;
    let retry = Retry;
    let mut s = net::connect_once(addr, deadline, &what).map_err(retry)?;
    // The acceptor may not be accepting yet: wait for its challenge up to the step's deadline.
    let mut challenge = [0u8; CHALLENGE_BYTES];
    s.read_exact_before(&mut challenge, deadline, &format!("{what}: waiting for the handshake challenge"))
        .map_err(retry)?;
    let mut nonce = [0u8; NONCE_BYTES];
    random_bytes(&mut nonce).map_err(Fatal)?;
    let (side, proof) = match DialerSide::answer(spec, &challenge, nonce).map_err(Fatal)? {
        Some(x) => x,
        None => {
            return Err(Retry(MkError::remote(format!(
                "the {} at {addr} was busy with other handshakes",
                spec.purpose.describe()
            ))))
        }
    };
    let hs = deadline.capped(HANDSHAKE_LIMIT, HANDSHAKE_LIMIT_NAME);
    let step = format!("{what}: handshake");
    write_all_before(&mut s, &proof, &hs, &step).map_err(retry)?;
    let mut verdict = [0u8; VERDICT_BYTES];
    s.read_exact_before(&mut verdict, &hs, &step).map_err(retry)?;
    let keys = side.finish(&verdict, addr).map_err(Fatal)?;
    Ok(SecureStream::new(s, addr, keys))
}

/// Dials `addr` and completes the handshake, retrying until `deadline` (see the module
/// comment). The timeout message names the deadline's variable and the last failure.
pub fn dial(addr: SocketAddr, spec: DialSpec<'_>, deadline: &Deadline, what: &str) -> Result<SecureStream> {
    let mut pause = FIRST_RETRY_PAUSE;
    // The latest failure that says more than "the deadline passed": an attempt that the
    // deadline itself cut short would hide why the ones before it failed.
    let mut last_failure: Option<MkError> = None;
    loop {
        match attempt(addr, spec, deadline, what) {
            Ok(s) => return Ok(s),
            Err(AttemptError::Fatal(e)) => return Err(e),
            Err(AttemptError::Retry(e)) => {
                if e.code != mkResult_t::mkTimeout || !e.message.contains(deadline.governed_by()) {
                    last_failure = Some(e);
                }
                if deadline.left() <= pause {
                    let mut out = deadline.expired(&what);
                    if let Some(e) = last_failure {
                        out.message.push_str(&format!(" (last failure: {})", e.message));
                    }
                    return Err(out);
                }
                std::thread::sleep(jittered(pause));
                pause = (pause * 2).min(MAX_RETRY_PAUSE);
            }
        }
    }
}

/// A pause drawn uniformly from [pause / 2, pause], so dialers that failed together do not
/// come back together.
fn jittered(pause: Duration) -> Duration {
    let mut r = [0u8; 4];
    if random_bytes(&mut r).is_err() {
        return pause;
    }
    let half = pause / 2;
    half + half.mul_f64(f64::from(u32::from_le_bytes(r)) / f64::from(u32::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_pauses_are_jittered_within_half_to_whole() {
        let pause = Duration::from_millis(200);
        let pauses: Vec<Duration> = (0..64).map(|_| jittered(pause)).collect();
        assert!(pauses.iter().all(|p| (pause / 2..=pause).contains(p)), "{pauses:?}");
        assert!(pauses.iter().any(|p| *p != pauses[0]), "64 equal pauses: no jitter");
    }

    fn spec(key: &[u8]) -> DialSpec<'_> {
        DialSpec { key, session: 42, purpose: Purpose::BootstrapRing, dialer: 3, target: 4 }
    }

    fn peer() -> SocketAddr {
        "127.0.0.1:1".parse().unwrap()
    }

    /// Runs the three messages in memory; returns both sides' outcomes.
    fn exchange(
        acceptor_key: &[u8],
        dialer: DialSpec<'_>,
        me: u32,
    ) -> (std::result::Result<(u32, FrameKeys), Refusal>, Result<FrameKeys>) {
        let a = AcceptorSide::new(acceptor_key, 42, Purpose::BootstrapRing, me).unwrap();
        let (side, proof) = DialerSide::answer(dialer, &a.challenge(), [9; NONCE_BYTES]).unwrap().unwrap();
        let (verdict, accepted) = a.check(&proof, &|d| d == 3);
        (accepted, side.finish(&verdict, peer()))
    }

    #[test]
    fn matching_keys_agree_on_frame_keys_both_ways() {
        let (a, d) = exchange(&[1; 16], spec(&[1; 16]), 4);
        let (dialer, ak) = a.unwrap();
        let dk = d.unwrap();
        assert_eq!(dialer, 3);
        assert_eq!((ak.send, ak.recv), (dk.recv, dk.send));
        assert_ne!(dk.send, dk.recv, "each direction has its own key");
    }

    #[test]
    fn a_wrong_secret_is_an_authentication_failure_on_the_dialer() {
        let (a, d) = exchange(&[1; 16], spec(&[2; 16]), 4);
        assert_eq!(a.unwrap_err(), Refusal::WrongProof);
        let e = d.unwrap_err();
        assert_eq!(e.code, mkResult_t::mkInvalidUsage);
        assert!(e.message.contains("authentication failed"), "{e}");
    }

    #[test]
    fn wrong_target_or_unexpected_dialer_is_refused() {
        let (a, d) = exchange(&[1; 16], spec(&[1; 16]), 5);
        assert_eq!(a.unwrap_err(), Refusal::WrongTarget { target: 4 });
        assert_eq!(d.unwrap_err().code, mkResult_t::mkRemoteError);
        let (a, _) = exchange(&[1; 16], DialSpec { dialer: 2, ..spec(&[1; 16]) }, 4);
        assert_eq!(a.unwrap_err(), Refusal::UnexpectedDialer { dialer: 2 });
    }

    /// An acceptor's proof is not a dialer's proof for the same transcript, and a proof
    /// made for one pair of nonces or one edge fails for any other.
    #[test]
    fn proofs_are_bound_to_direction_nonces_and_edge() {
        let key = [5u8; 16];
        let t = Transcript {
            purpose: Purpose::Transport,
            session: 1,
            acceptor_nonce: [1; 16],
            dialer_nonce: [2; 16],
            dialer: 1,
            target: 0,
        };
        assert_ne!(t.dialer_proof(&key), t.acceptor_proof(&key));
        let variants = [
            Transcript { purpose: Purpose::BootstrapRing, ..t },
            Transcript { session: 2, ..t },
            Transcript { acceptor_nonce: [3; 16], ..t },
            Transcript { dialer_nonce: [3; 16], ..t },
            Transcript { dialer: 0, target: 1, ..t },
            Transcript { acceptor_nonce: t.dialer_nonce, dialer_nonce: t.acceptor_nonce, ..t },
        ];
        for v in variants {
            assert_ne!(v.dialer_proof(&key), t.dialer_proof(&key), "{v:?}");
        }
    }

    /// Reflection: an attacker without the key sends the acceptor's own challenge nonce and
    /// proof material back; a dialer's proof built from an acceptor's verdict never passes.
    #[test]
    fn a_reflected_proof_is_refused() {
        let key = [6u8; 16];
        let a = AcceptorSide::new(&key, 7, Purpose::Transport, 0).unwrap();
        // A second handshake where the attacker plays acceptor toward an honest dialer,
        // reusing `a`'s nonce, collects the honest acceptor-side proof of another session...
        let honest = AcceptorSide { nonce: a.nonce, ..AcceptorSide::new(&key, 7, Purpose::Transport, 1).unwrap() };
        let (side, proof) = DialerSide::answer(
            DialSpec { key: &key, session: 7, purpose: Purpose::Transport, dialer: 0, target: 1 },
            &honest.challenge(),
            [4; NONCE_BYTES],
        )
        .unwrap()
        .unwrap();
        let (verdict, _) = honest.check(&proof, &|_| true);
        assert!(side.finish(&verdict, peer()).is_ok());
        // ...and replays the acceptor's verdict tag to `a` as a dialer proof (rank 1 -> 0).
        let v = Verdict::decode(&verdict).unwrap();
        let reflected = Proof { nonce: [4; NONCE_BYTES], dialer: 1, target: 0, tag: v.tag }.encode();
        assert_eq!(a.check(&reflected, &|_| true).1.unwrap_err(), Refusal::WrongProof);
        // Relaying the honest dialer's proof (same nonces) to `a` fails: it names another edge.
        assert_eq!(a.check(&proof, &|_| true).1.unwrap_err(), Refusal::WrongTarget { target: 1 });
    }

    #[test]
    fn busy_and_foreign_challenges() {
        let busy =
            Challenge { status: ChallengeStatus::Busy, purpose: Purpose::BootstrapRing, nonce: [0; 16] }.encode();
        assert!(DialerSide::answer(spec(&[1; 16]), &busy, [0; 16]).unwrap().is_none());
        let root =
            Challenge { status: ChallengeStatus::Ready, purpose: Purpose::BootstrapRoot, nonce: [0; 16] }.encode();
        assert!(DialerSide::answer(spec(&[1; 16]), &root, [0; 16]).is_err());
        assert!(DialerSide::answer(spec(&[1; 16]), b"HTTP/1.1 400 Bad Request\r\n", [0; 16]).is_err());
    }
}
