//! What the listener tests ask of this process's own sockets (Linux /proc).

use std::collections::HashSet;

/// Ports this process listens on (its socket inodes matched against /proc/net/tcp).
pub fn listening_ports() -> HashSet<u16> {
    let inodes: HashSet<String> = std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter_map(|l| l.to_str()?.strip_prefix("socket:[")?.strip_suffix(']').map(str::to_string))
        .collect();
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap()
        + &std::fs::read_to_string("/proc/net/tcp6").unwrap_or_default();
    table
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let port = u16::from_str_radix(f.get(1)?.split(':').nth(1)?, 16).ok()?;
            (f.get(3) == Some(&"0A") && inodes.contains(*f.get(9)?)).then_some(port)
        })
        .collect()
}
