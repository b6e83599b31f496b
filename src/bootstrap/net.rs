//! Sockets for the bootstrap and the socket transport: interface choice (`MK_SOCKET_IFNAME`),
//! deadlines that name the variable governing them, and reads and writes bounded by them.

use crate::error::{MkError, Result};
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

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

/// The variable that bounds every bootstrap step (rendezvous, ring, collectives).
pub const BOOTSTRAP_TIMEOUT_VAR: &str = "MK_BOOTSTRAP_TIMEOUT_MS";
/// The variable that bounds the transports' waits (connecting, sends, closing).
pub const TRANSPORT_TIMEOUT_VAR: &str = "MK_TIMEOUT_MS";

/// A deadline shared by the steps of one operation. It knows which variable or constant set
/// it, so every timeout message names what a user would change.
#[derive(Clone, Copy, Debug)]
pub struct Deadline {
    at: Instant,
    total: Duration,
    governed_by: &'static str,
}

impl Deadline {
    /// `governed_by` names the variable or constant that `total` came from.
    pub fn after(total: Duration, governed_by: &'static str) -> Self {
        Deadline { at: Instant::now() + total, total, governed_by }
    }

    /// A deadline bounded by `MK_BOOTSTRAP_TIMEOUT_MS`.
    pub fn bootstrap(total: Duration) -> Self {
        Self::after(total, BOOTSTRAP_TIMEOUT_VAR)
    }

    /// The earlier of this deadline and one `limit` from now set by `governed_by`.
    pub fn capped(&self, limit: Duration, governed_by: &'static str) -> Deadline {
        let other = Deadline::after(limit, governed_by);
        if other.at < self.at {
            other
        } else {
            *self
        }
    }

    /// The `mkTimeout` for `what` not finishing before this deadline.
    pub fn expired(&self, what: &dyn std::fmt::Display) -> MkError {
        MkError::timeout(format!("{what} did not complete within {}={} ms", self.governed_by, self.total.as_millis()))
    }

    /// Time left, or `mkTimeout` naming what was being waited for.
    pub fn remaining(&self, what: &dyn std::fmt::Display) -> Result<Duration> {
        let left = self.left();
        if left.is_zero() {
            Err(self.expired(what))
        } else {
            Ok(left)
        }
    }

    /// Time left (zero once passed).
    pub fn left(&self) -> Duration {
        self.at.saturating_duration_since(Instant::now())
    }

    pub fn at(&self) -> Instant {
        self.at
    }

    pub fn total(&self) -> Duration {
        self.total
    }

    pub fn governed_by(&self) -> &'static str {
        self.governed_by
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
    let hit = rest.split(',').map(str::trim).filter(|p| !p.is_empty()).any(|p| {
        if exact {
            name == p
        } else {
            name.starts_with(p)
        }
    });
    hit != exclude
}

/// The address bootstrap sockets bind to: the first interface passing `MK_SOCKET_IFNAME`,
/// or without it the first non-loopback IPv4 interface, then any, then loopback.
pub fn local_address() -> Result<IpAddr> {
    let ifs = interfaces()?;
    if let Some(filter) = crate::env::socket_ifname() {
        return ifs.iter().find(|i| interface_matches(&filter, &i.name)).map(|i| i.addr).ok_or_else(|| {
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

/// Connections a listener's kernel queue holds while every handshake slot is taken; they
/// wait there in arrival order (see `acceptor`). The kernel caps it at
/// `net.core.somaxconn`.
pub const LISTEN_BACKLOG: i32 = 1024;

/// A non-blocking listener on `addr`, on a port the kernel picks, with a `LISTEN_BACKLOG`
/// queue.
pub fn bind_listener(addr: IpAddr) -> Result<TcpListener> {
    let l = TcpListener::bind(SocketAddr::new(addr, 0))
        .map_err(|e| MkError::system(format!("cannot listen on {addr}: {e}")))?;
    // listen(2) again on a listening socket only sets its queue's length.
    // SAFETY: a plain syscall on a descriptor `l` owns.
    if unsafe { libc::listen(l.as_raw_fd(), LISTEN_BACKLOG) } != 0 {
        let e = std::io::Error::last_os_error();
        return Err(MkError::system(format!("cannot listen on {addr}: {e}")));
    }
    l.set_nonblocking(true)?;
    Ok(l)
}

/// Waits until one of `fds` is ready for what its `events` ask, or `timeout` passes.
/// Returns how many are ready (0 on timeout). Blocks in `poll(2)`: no busy waiting.
pub fn poll_fds(fds: &mut [libc::pollfd], timeout: Duration) -> Result<usize> {
    // Round up, so a wait of a fraction of a millisecond does not spin at zero.
    let ms = timeout.as_nanos().div_ceil(1_000_000).min(i32::MAX as u128) as i32;
    loop {
        // SAFETY: `fds` is a valid, writable array of `fds.len()` pollfd entries.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(MkError::system(format!("poll failed: {e}")));
        }
    }
}

/// Connects once, bounded by the deadline (and by one second, so a dropped SYN is retried).
pub fn connect_once(addr: SocketAddr, deadline: &Deadline, what: &dyn std::fmt::Display) -> Result<TcpStream> {
    let left = deadline.remaining(what)?;
    let s = TcpStream::connect_timeout(&addr, left.min(Duration::from_secs(1)))
        .map_err(|e| MkError::from(e).context(format!("cannot connect to {addr} for {what}")))?;
    s.set_nodelay(true)?;
    Ok(s)
}

fn io_err(e: std::io::Error, what: &dyn std::fmt::Display, deadline: &Deadline) -> MkError {
    match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => deadline.expired(what),
        _ => MkError::from(e).context(what),
    }
}

pub fn write_all_before(
    s: &mut TcpStream,
    bytes: &[u8],
    deadline: &Deadline,
    what: &dyn std::fmt::Display,
) -> Result<()> {
    s.set_write_timeout(Some(deadline.remaining(what)?))?;
    s.write_all(bytes).map_err(|e| io_err(e, what, deadline))
}

/// A byte source whose reads are bounded by a deadline: a socket, or a byte slice (the
/// parsers' tests feed them arbitrary bytes this way).
pub trait ReadBefore {
    /// Fills `buf`, or fails: `mkTimeout` at the deadline, `mkRemoteError` at end of stream.
    fn read_exact_before(&mut self, buf: &mut [u8], deadline: &Deadline, what: &dyn std::fmt::Display) -> Result<()>;
}

impl ReadBefore for TcpStream {
    fn read_exact_before(&mut self, buf: &mut [u8], deadline: &Deadline, what: &dyn std::fmt::Display) -> Result<()> {
        let mut got = 0;
        while got < buf.len() {
            self.set_read_timeout(Some(deadline.remaining(what)?))?;
            match self.read(&mut buf[got..]) {
                Ok(0) => return Err(MkError::remote(format!("{what}: peer closed the connection"))),
                Ok(n) => got += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(io_err(e, what, deadline)),
            }
        }
        Ok(())
    }
}

impl ReadBefore for &[u8] {
    fn read_exact_before(&mut self, buf: &mut [u8], _deadline: &Deadline, what: &dyn std::fmt::Display) -> Result<()> {
        if self.len() < buf.len() {
            return Err(MkError::remote(format!("{what}: peer closed the connection")));
        }
        let (head, tail) = self.split_at(buf.len());
        buf.copy_from_slice(head);
        *self = tail;
        Ok(())
    }
}

pub fn read_exact_before(
    s: &mut TcpStream,
    buf: &mut [u8],
    deadline: &Deadline,
    what: &dyn std::fmt::Display,
) -> Result<()> {
    s.read_exact_before(buf, deadline, what)
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
    fn deadlines_name_their_variable_and_cap_to_the_earlier() {
        let long = Deadline::bootstrap(Duration::from_secs(60));
        let capped = long.capped(Duration::from_millis(1), "mkernel's HANDSHAKE_LIMIT");
        std::thread::sleep(Duration::from_millis(5));
        let e = capped.remaining(&"a step").unwrap_err();
        assert_eq!(e.code, crate::error::mkResult_t::mkTimeout);
        assert!(e.message.contains("HANDSHAKE_LIMIT=1 ms"), "{e}");
        assert!(long.remaining(&"x").is_ok());
        let short = Deadline::after(Duration::ZERO, TRANSPORT_TIMEOUT_VAR);
        let e = short.capped(Duration::from_secs(5), "other").remaining(&"y").unwrap_err();
        assert!(e.message.contains("MK_TIMEOUT_MS=0 ms"), "{e}");
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
