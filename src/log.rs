//! `MK_DEBUG=WARN|INFO` logging to stderr, prefixed `host:pid:tid [rank] MK LEVEL`.

use std::fmt::Arguments;
use std::io::Write;
use std::sync::OnceLock;

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
pub enum Level {
    Warn = 1,
    Info = 2,
}

fn enabled_level() -> Option<Level> {
    match crate::env::debug_level().as_deref() {
        Some("INFO") | Some("TRACE") => Some(Level::Info),
        Some("WARN") => Some(Level::Warn),
        _ => None,
    }
}

/// Whether `MK_DEBUG` asks for INFO (read now: callers on a hot path cache it).
pub fn info_enabled() -> bool {
    enabled_level() == Some(Level::Info)
}

fn hostname() -> &'static str {
    static HOST: OnceLock<String> = OnceLock::new();
    HOST.get_or_init(|| {
        let mut buf = [0u8; 256];
        // SAFETY: buf is writable for its length; gethostname NUL-terminates on success.
        let ok = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } == 0;
        let len = buf.iter().position(|&b| b == 0).unwrap_or(0);
        if ok {
            String::from_utf8_lossy(&buf[..len]).into_owned()
        } else {
            "?".into()
        }
    })
}

pub fn log(level: Level, rank: Option<usize>, args: Arguments<'_>) {
    match enabled_level() {
        Some(l) if level <= l => {}
        _ => return,
    }
    // SAFETY: plain syscalls without arguments.
    let (pid, tid) = unsafe { (libc::getpid(), libc::gettid()) };
    let rank = rank.map(|r| format!("[{r}]")).unwrap_or_else(|| "[-]".into());
    let tag = if level == Level::Warn { "WARN" } else { "INFO" };
    let line = format!("{}:{pid}:{tid} {rank} MK {tag} {args}\n", hostname());
    let _ = std::io::stderr().write_all(line.as_bytes());
}

pub fn warn(rank: Option<usize>, args: Arguments<'_>) {
    log(Level::Warn, rank, args)
}

pub fn info(rank: Option<usize>, args: Arguments<'_>) {
    log(Level::Info, rank, args)
}

#[macro_export]
macro_rules! mk_info {
    ($rank:expr, $($fmt:tt)+) => { $crate::log::info($rank, format_args!($($fmt)+)) };
}

#[macro_export]
macro_rules! mk_warn {
    ($rank:expr, $($fmt:tt)+) => { $crate::log::warn($rank, format_args!($($fmt)+)) };
}
