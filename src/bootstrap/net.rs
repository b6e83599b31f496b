//! Sockets for the bootstrap: interface choice (`MK_SOCKET_IFNAME`), length-framed messages
//! with deadlines, and the challenge-response every accepted connection must pass.

use super::sha256::{constant_time_eq, hmac_sha256};
use crate::error::{MkError, Result};
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

/// Largest bootstrap message accepted; anything bigger is a protocol error, not an allocation.
pub const MAX_MESSAGE_BYTES: usize = 64 << 20;
const HANDSHAKE_MAGIC: &[u8; 4] = b"MKB1";
const PROOF_CONTEXT: &[u8] = b"mkernel bootstrap join v1";

/// Fills `buf` from the kernel's random source.
pub fn random_bytes(buf: &mut [u8]) -> Result<()> {
    let mut filled = 0;
    while filled < buf.len() {
        // SAFETY: the pointer and length describe the unfilled tail of `buf`.
        let n = unsafe { libc::getrandom(buf[filled..].as_mut_ptr().cast(), buf.len() - filled, 0) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(MkError::system(format!("getrandom failed: {e}")));
        }
        filled += n as usize;
    }
    Ok(())
}

/// A deadline shared by the steps of one bootstrap operation.
#[derive(Clone, Copy, Debug)]
pub struct Deadline {
    at: Instant,
    total: Duration,
}

impl Deadline {
    pub fn after(total: Duration) -> Self {
        Deadline { at: Instant::now() + total, total }
    }
    /// Time left, or `mkTimeout` naming what was being waited for.
    pub fn remaining(&self, what: &dyn std::fmt::Display) -> Result<Duration> {
        let left = self.at.saturating_duration_since(Instant::now());
        if left.is_zero() {
            Err(MkError::timeout(format!(
                "{what} did not complete within MK_BOOTSTRAP_TIMEOUT_MS={} ms",
                self.total.as_millis()
            )))
        } else {
            Ok(left)
        }
    }
    pub fn total(&self) -> Duration {
        self.total
    }
}

struct Interface {
    name: String,
    addr: IpAddr,
    loopback: bool,
}

fn interfaces() -> Result<Vec<Interface>> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs allocates a list we free below with freeifaddrs.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Err(MkError::system(format!("getifaddrs failed: {}", std::io::Error::last_os_error())));
    }
    let mut out = Vec::new();
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: cur is a node of the list getifaddrs returned and is not freed yet.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_flags & libc::IFF_UP as u32 == 0 {
            continue;
        }
        // SAFETY: ifa_name is a NUL-terminated string owned by the list.
        let name = unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) }.to_string_lossy().into_owned();
        // SAFETY: the family field says which sockaddr variant ifa_addr points to.
        let addr = unsafe {
            match (*ifa.ifa_addr).sa_family as i32 {
                libc::AF_INET => {
                    let sin = &*(ifa.ifa_addr as *const libc::sockaddr_in);
                    IpAddr::V4(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)))
                }
                libc::AF_INET6 => {
                    let sin6 = &*(ifa.ifa_addr as *const libc::sockaddr_in6);
                    let a = Ipv6Addr::from(sin6.sin6_addr.s6_addr);
                    if a.segments()[0] & 0xffc0 == 0xfe80 {
                        continue; // link-local needs a scope id; not worth supporting
                    }
                    IpAddr::V6(a)
                }
                _ => continue,
            }
        };
        let loopback = ifa.ifa_flags & libc::IFF_LOOPBACK as u32 != 0;
        out.push(Interface { name, addr, loopback });
    }
    // SAFETY: head came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(head) };
    Ok(out)
}

/// Whether `name` passes an `MK_SOCKET_IFNAME` filter, NCCL style: comma-separated prefixes,
/// `^` in front to exclude them instead, `=` in front to match names exactly.
pub fn interface_matches(filter: &str, name: &str) -> bool {
    let (exclude, rest) = match filter.strip_prefix('^') {
        Some(r) => (true, r),
        None => (false, filter),
    };
    let (exact, rest) = match rest.strip_prefix('=') {
        Some(r) => (true, r),
        None => (false, rest),
    };
    let hit = rest
        .split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .any(|p| if exact { name == p } else { name.starts_with(p) });
    hit != exclude
}

/// The address bootstrap sockets bind to: the first interface passing `MK_SOCKET_IFNAME`,
/// or without it the first non-loopback IPv4 interface, then any, then loopback.
pub fn local_address() -> Result<IpAddr> {
    let ifs = interfaces()?;
    if let Some(filter) = crate::env::socket_ifname() {
        return ifs
            .iter()
            .find(|i| interface_matches(&filter, &i.name))
            .map(|i| i.addr)
            .ok_or_else(|| {
                let names: Vec<_> = ifs.iter().map(|i| i.name.as_str()).collect();
                MkError::system(format!(
                    "MK_SOCKET_IFNAME={filter:?} matches no interface that is up (have: {})",
                    names.join(", ")
                ))
            });
    }
    let pick = ifs
        .iter()
        .find(|i| !i.loopback && i.addr.is_ipv4())
        .or_else(|| ifs.iter().find(|i| !i.loopback))
        .map(|i| i.addr);
    Ok(pick.unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST)))
}

pub fn bind_listener(addr: IpAddr) -> Result<TcpListener> {
    let l = TcpListener::bind(SocketAddr::new(addr, 0))
        .map_err(|e| MkError::system(format!("cannot listen on {addr}: {e}")))?;
    l.set_nonblocking(true)?;
    Ok(l)
}

/// Accepts one connection before the deadline (the listener is non-blocking).
pub fn accept_before(listener: &TcpListener, deadline: &Deadline, what: &dyn std::fmt::Display) -> Result<(TcpStream, SocketAddr)> {
    loop {
        match listener.accept() {
            Ok((s, a)) => {
                s.set_nonblocking(false)?;
                s.set_nodelay(true)?;
                return Ok((s, a));
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                deadline.remaining(what)?;
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(MkError::system(format!("accept failed: {e}"))),
        }
    }
}

/// Connects, retrying refused connections (the peer may not be listening yet) until the deadline.
pub fn connect_before(addr: SocketAddr, deadline: &Deadline, what: &dyn std::fmt::Display) -> Result<TcpStream> {
    loop {
        let left = deadline.remaining(what)?;
        match TcpStream::connect_timeout(&addr, left.min(Duration::from_secs(1))) {
            Ok(s) => {
                s.set_nodelay(true)?;
                return Ok(s);
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock
                ) =>
            {
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => return Err(MkError::system(format!("cannot connect to {addr} for {what}: {e}"))),
        }
    }
}

fn io_err(e: std::io::Error, what: &dyn std::fmt::Display, deadline: &Deadline) -> MkError {
    match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => MkError::timeout(format!(
            "{what} did not complete within MK_BOOTSTRAP_TIMEOUT_MS={} ms",
            deadline.total().as_millis()
        )),
        _ => MkError::from(e).context(what),
    }
}

pub fn write_all_before(s: &mut TcpStream, bytes: &[u8], deadline: &Deadline, what: &dyn std::fmt::Display) -> Result<()> {
    s.set_write_timeout(Some(deadline.remaining(what)?))?;
    s.write_all(bytes).map_err(|e| io_err(e, what, deadline))
}

pub fn read_exact_before(s: &mut TcpStream, buf: &mut [u8], deadline: &Deadline, what: &dyn std::fmt::Display) -> Result<()> {
    let mut got = 0;
    while got < buf.len() {
        s.set_read_timeout(Some(deadline.remaining(what)?))?;
        match s.read(&mut buf[got..]) {
            Ok(0) => return Err(MkError::remote(format!("{what}: peer closed the connection"))),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(io_err(e, what, deadline)),
        }
    }
    Ok(())
}

pub fn send_frame(s: &mut TcpStream, payload: &[u8], deadline: &Deadline, what: &dyn std::fmt::Display) -> Result<()> {
    let mut buf = Vec::with_capacity(8 + payload.len());
    buf.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    buf.extend_from_slice(payload);
    write_all_before(s, &buf, deadline, what)
}

pub fn recv_frame(s: &mut TcpStream, deadline: &Deadline, what: &dyn std::fmt::Display) -> Result<Vec<u8>> {
    let mut len = [0u8; 8];
    read_exact_before(s, &mut len, deadline, what)?;
    let len = u64::from_le_bytes(len) as usize;
    if len > MAX_MESSAGE_BYTES {
        return Err(MkError::remote(format!("{what}: peer sent a {len}-byte frame (limit {MAX_MESSAGE_BYTES})")));
    }
    let mut buf = vec![0u8; len];
    read_exact_before(s, &mut buf, deadline, what)?;
    Ok(buf)
}

/// The proof a joining side sends for a challenge: HMAC(secret, context | session | nonce).
pub fn join_proof(secret: &[u8; 16], session: u64, nonce: &[u8; 16]) -> [u8; 32] {
    hmac_sha256(secret, &[PROOF_CONTEXT, &session.to_le_bytes(), nonce])
}

/// Accepting side: sends a fresh challenge and checks the proof that comes back.
/// A wrong, missing or late proof is an error the caller logs before dropping the socket.
pub fn challenge(s: &mut TcpStream, secret: &[u8; 16], session: u64, deadline: &Deadline) -> Result<()> {
    let mut nonce = [0u8; 16];
    random_bytes(&mut nonce)?;
    let mut hello = Vec::from(&HANDSHAKE_MAGIC[..]);
    hello.extend_from_slice(&nonce);
    write_all_before(s, &hello, deadline, &"bootstrap challenge")?;
    let mut proof = [0u8; 32];
    read_exact_before(s, &mut proof, deadline, &"bootstrap join proof")?;
    if !constant_time_eq(&proof, &join_proof(secret, session, &nonce)) {
        return Err(MkError::invalid_usage("bootstrap join proof does not match the unique id's secret"));
    }
    Ok(())
}

/// Joining side: answers the challenge with the proof of the secret.
pub fn respond(s: &mut TcpStream, secret: &[u8; 16], session: u64, deadline: &Deadline) -> Result<()> {
    let mut hello = [0u8; 20];
    read_exact_before(s, &mut hello, deadline, &"bootstrap challenge")?;
    if &hello[..4] != HANDSHAKE_MAGIC {
        return Err(MkError::remote("bootstrap peer is not an mkernel bootstrap endpoint (bad magic)"));
    }
    let nonce: [u8; 16] = hello[4..].try_into().expect("16-byte slice");
    write_all_before(s, &join_proof(secret, session, &nonce), deadline, &"bootstrap join proof")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ifname_filters_follow_nccl_rules() {
        assert!(interface_matches("eth", "eth0"));
        assert!(interface_matches("ib,eth", "eth1"));
        assert!(!interface_matches("ib", "eth0"));
        assert!(!interface_matches("^eth", "eth0"));
        assert!(interface_matches("^eth", "lo"));
        assert!(interface_matches("=lo", "lo"));
        assert!(!interface_matches("=eth", "eth0"));
        assert!(!interface_matches("^=lo", "lo"));
    }

    #[test]
    fn proof_depends_on_secret_session_and_nonce() {
        let s1 = [1u8; 16];
        let s2 = [2u8; 16];
        let n = [7u8; 16];
        let p = join_proof(&s1, 5, &n);
        assert_ne!(p, join_proof(&s2, 5, &n));
        assert_ne!(p, join_proof(&s1, 6, &n));
        assert_ne!(p, join_proof(&s1, 5, &[8u8; 16]));
        assert_eq!(p, join_proof(&s1, 5, &n));
    }

    #[test]
    fn random_bytes_are_not_constant() {
        let mut a = [0u8; 32];
        let mut b = [0u8; 32];
        random_bytes(&mut a).unwrap();
        random_bytes(&mut b).unwrap();
        assert_ne!(a, b);
    }
}
