//! Helpers shared by the integration tests (each test crate that uses them includes this
//! module): host windows for the transport tests, a CPU mbarrier (`mbarrier`) for the
//! ports of device protocols, device headers compiled as host C++ (`host_cxx`), and the
//! ports this process listens on (`listeners`).
#![allow(dead_code)] // not every test uses every helper

pub mod host_cxx;
pub mod listeners;
pub mod mbarrier;

use mkernel::transport::{MemoryKind, MemoryRegion, Window};
use std::sync::atomic::AtomicU64;

/// A rank's window in leaked host memory: data region (8-byte aligned) and signal words.
/// The transport threads write into it; tests read a range only after the acquire load of
/// the signal that published it.
#[derive(Clone, Copy)]
pub struct HostWindow {
    pub data: *mut u8,
    pub data_bytes: usize,
    pub signals: &'static [AtomicU64],
}

// SAFETY: the memory is leaked (lives forever) and shared by design; see the struct comment
// for the ordering the tests rely on.
unsafe impl Sync for HostWindow {}
// SAFETY: as above.
unsafe impl Send for HostWindow {}

impl HostWindow {
    /// `data_bytes` of data, every byte `fill`, and `signal_words` zeroed signal words.
    pub fn new(data_bytes: usize, signal_words: usize, fill: u8) -> HostWindow {
        let word = u64::from_ne_bytes([fill; 8]);
        let words = Box::leak(vec![word; data_bytes.div_ceil(8)].into_boxed_slice());
        let signals = Box::leak((0..signal_words).map(|_| AtomicU64::new(0)).collect::<Vec<_>>().into_boxed_slice());
        HostWindow { data: words.as_mut_ptr().cast(), data_bytes, signals }
    }

    pub fn window(&self) -> Window {
        Window {
            data: MemoryRegion { base: self.data as u64, bytes: self.data_bytes as u64, kind: MemoryKind::Host },
            signals: MemoryRegion {
                base: self.signals.as_ptr() as u64,
                bytes: 8 * self.signals.len() as u64,
                kind: MemoryKind::Host,
            },
        }
    }

    pub fn slice(&self, offset: usize, len: usize) -> &[u8] {
        assert!(offset + len <= self.data_bytes);
        // SAFETY: in bounds of the leaked allocation.
        unsafe { std::slice::from_raw_parts(self.data.add(offset), len) }
    }

    pub fn fill(&self, offset: usize, bytes: &[u8]) {
        assert!(offset + bytes.len() <= self.data_bytes);
        // SAFETY: in bounds; written before any put reads it.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.data.add(offset), bytes.len()) };
    }

    pub fn read_f64(&self, off: u64) -> f64 {
        assert!(off as usize + 8 <= self.data_bytes && off % 8 == 0);
        // SAFETY: in bounds and aligned (the data region is allocated as u64 words).
        unsafe { std::ptr::read_volatile(self.data.add(off as usize).cast::<f64>()) }
    }

    pub fn write_f64(&self, off: u64, v: f64) {
        assert!(off as usize + 8 <= self.data_bytes && off % 8 == 0);
        // SAFETY: as read_f64.
        unsafe { std::ptr::write_volatile(self.data.add(off as usize).cast::<f64>(), v) }
    }
}
