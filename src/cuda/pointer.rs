//! Which memory a pointer a caller passes is: every op checks each of its buffers before a
//! kernel can dereference it (a host pointer handed to a kernel would end the context).
//!
//! Asking the driver costs one call per buffer. A communicator asks once per address:
//! [`CheckedPointers`] keeps the addresses the driver has already called device memory of
//! its device (docs/decisions/0082-host-path-per-call.md says what that trusts).

use super::sys;
use crate::error::{MkError, Result};
use parking_lot::Mutex;

/// What the driver says of one address.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PointerFacts {
    /// The driver answered (`cuPointerGetAttributes` succeeded; an address it does not know
    /// is still an answer, with the facts below all zero).
    pub answered: bool,
    /// Device memory (CU_MEMORYTYPE_DEVICE).
    pub device_memory: bool,
    /// Managed memory (usable from every device).
    pub managed: bool,
    /// The device the memory was allocated on (-1 when unknown).
    pub ordinal: i32,
}

/// Asks the driver about `ptr`: one `cuPointerGetAttributes` call (the memory type, whether
/// it is managed and its device, together).
pub fn query(ptr: u64) -> PointerFacts {
    use sys::CUpointer_attribute::{
        CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, CU_POINTER_ATTRIBUTE_IS_MANAGED, CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
    };
    let (mut mem_type, mut managed, mut ordinal) = (0u32, 0u32, -1i32);
    let mut attributes =
        [CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_IS_MANAGED, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL];
    let mut data: [*mut std::ffi::c_void; 3] =
        [(&mut mem_type as *mut u32).cast(), (&mut managed as *mut u32).cast(), (&mut ordinal as *mut i32).cast()];
    // SAFETY: three attributes, each written into its own variable of the type the driver
    // documents (CUmemorytype and a boolean as unsigned int, the ordinal as int). An address
    // the driver does not know is not an error: the attributes stay zero (not device memory).
    let r = unsafe { sys::cuPointerGetAttributes(3, attributes.as_mut_ptr(), data.as_mut_ptr(), ptr) };
    let answered = r == sys::CUresult::CUDA_SUCCESS;
    PointerFacts {
        answered,
        device_memory: answered && mem_type == sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32,
        managed: answered && managed != 0,
        ordinal,
    }
}

/// Whether `facts` make `ptr` a buffer a kernel on `device` may use: managed memory, or
/// device memory of `device`; else mkInvalidArgument naming `what`.
pub fn verdict(ptr: u64, facts: PointerFacts, device: i32, what: &str) -> Result<()> {
    if facts.managed {
        return Ok(());
    }
    if !facts.device_memory {
        return Err(MkError::invalid_argument(format!(
            "{what} ({ptr:#x}) is not device memory (allocate it with cudaMalloc on the communicator's device)"
        )));
    }
    if facts.ordinal != device {
        return Err(MkError::invalid_argument(format!(
            "{what} ({ptr:#x}) is memory of device {}, but the communicator uses device {device}",
            facts.ordinal
        )));
    }
    Ok(())
}

/// Checks that `ptr` is device (or managed) memory of `device`, naming `what` otherwise:
/// one driver call, every time.
pub fn check_device_pointer(ptr: u64, device: i32, what: &str) -> Result<()> {
    verdict(ptr, query(ptr), device, what)
}

/// The most buffers one call checks at once (an op's own buffers: ring attention's backward
/// has nine).
pub const MAX_BUFFERS_PER_CHECK: usize = 16;

/// Addresses the driver has called usable by one device's kernels (device memory of that
/// device, or managed memory), so that a buffer an op saw before costs no driver call.
///
/// An address is remembered exactly (not the allocation around it) and only after the
/// driver approved it; NULL is never looked up here (the ops refuse it first). At
/// [`CheckedPointers::CAPACITY`] addresses the set is emptied before the next one is added,
/// so a program that cycles through more buffers than that pays the driver calls again,
/// never unbounded memory.
pub struct CheckedPointers {
    device: i32,
    /// Sorted, without repeats.
    approved: Mutex<Vec<u64>>,
}

impl CheckedPointers {
    pub const CAPACITY: usize = 4096;

    pub fn new(device: i32) -> CheckedPointers {
        CheckedPointers { device, approved: Mutex::new(Vec::new()) }
    }

    /// Checks each `(address, name)` of `buffers` (at most MAX_BUFFERS_PER_CHECK) as
    /// [`check_device_pointer`] does, asking the driver only about addresses not approved
    /// before. The error is the first failing buffer's, in the order given.
    pub fn check(&self, buffers: &[(u64, &str)]) -> Result<()> {
        self.check_with(buffers, query)
    }

    /// [`check`](Self::check) with `ask` standing for the driver.
    pub fn check_with(&self, buffers: &[(u64, &str)], mut ask: impl FnMut(u64) -> PointerFacts) -> Result<()> {
        if buffers.len() > MAX_BUFFERS_PER_CHECK {
            return Err(MkError::internal(format!(
                "{} buffers checked at once, more than {MAX_BUFFERS_PER_CHECK}",
                buffers.len()
            )));
        }
        // Which buffers are new, read under the lock; the driver is asked outside it.
        let mut new = [false; MAX_BUFFERS_PER_CHECK];
        {
            let approved = self.approved.lock();
            for (i, &(ptr, _)) in buffers.iter().enumerate() {
                new[i] = approved.binary_search(&ptr).is_err();
            }
        }
        if !new.contains(&true) {
            return Ok(());
        }
        for (i, &(ptr, what)) in buffers.iter().enumerate() {
            if new[i] {
                verdict(ptr, ask(ptr), self.device, what)?;
            }
        }
        let mut approved = self.approved.lock();
        for (i, &(ptr, _)) in buffers.iter().enumerate() {
            if !new[i] {
                continue;
            }
            if let Err(at) = approved.binary_search(&ptr) {
                if approved.len() >= Self::CAPACITY {
                    approved.clear();
                    approved.push(ptr);
                } else {
                    approved.insert(at, ptr);
                }
            }
        }
        Ok(())
    }

    /// Addresses remembered now.
    pub fn len(&self) -> usize {
        self.approved.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::mkResult_t;
    use std::cell::RefCell;

    const DEVICE: i32 = 1;

    /// A stand-in for the driver: device memory of DEVICE at 0x1000.., of device 0 at
    /// 0x2000.., managed at 0x3000.., host memory elsewhere; records every address asked.
    struct Driver {
        asked: RefCell<Vec<u64>>,
    }

    impl Driver {
        fn new() -> Driver {
            Driver { asked: RefCell::new(Vec::new()) }
        }

        fn ask(&self, ptr: u64) -> PointerFacts {
            self.asked.borrow_mut().push(ptr);
            match ptr >> 12 {
                1 => PointerFacts { answered: true, device_memory: true, managed: false, ordinal: DEVICE },
                2 => PointerFacts { answered: true, device_memory: true, managed: false, ordinal: 0 },
                3 => PointerFacts { answered: true, device_memory: false, managed: true, ordinal: -1 },
                _ => PointerFacts { answered: true, ..Default::default() },
            }
        }

        fn calls(&self) -> usize {
            self.asked.borrow().len()
        }
    }

    #[test]
    fn verdicts_name_the_buffer_and_the_rule() {
        let device = PointerFacts { answered: true, device_memory: true, managed: false, ordinal: 3 };
        assert!(verdict(0x10, device, 3, "q").is_ok());
        let other = verdict(0x10, device, 2, "q").unwrap_err();
        assert_eq!(other.code, mkResult_t::mkInvalidArgument);
        assert!(other.message.contains("q (0x10) is memory of device 3, but the communicator uses device 2"));
        let host = verdict(0x20, PointerFacts { answered: true, ..Default::default() }, 2, "dout").unwrap_err();
        assert!(host.message.contains("dout (0x20) is not device memory"), "{}", host.message);
        let failed = verdict(0x20, PointerFacts { ordinal: -1, ..Default::default() }, 2, "k").unwrap_err();
        assert!(failed.message.contains("k (0x20) is not device memory"), "a failed query is not device memory");
        let managed = PointerFacts { answered: true, managed: true, ..Default::default() };
        assert!(verdict(0x30, managed, 2, "v").is_ok(), "managed memory serves every device");
    }

    #[test]
    fn the_driver_is_asked_once_per_address() {
        let (checked, driver) = (CheckedPointers::new(DEVICE), Driver::new());
        let call = [(0x1000, "q"), (0x1100, "k"), (0x1200, "v"), (0x3000, "out"), (0x1300, "lse")];
        checked.check_with(&call, |p| driver.ask(p)).unwrap();
        assert_eq!(driver.calls(), 5, "first sight: one query per buffer");
        for _ in 0..3 {
            checked.check_with(&call, |p| driver.ask(p)).unwrap();
        }
        assert_eq!(driver.calls(), 5, "every buffer seen before: no query");
        checked.check_with(&[(0x1000, "q"), (0x1400, "k"), (0x1000, "v")], |p| driver.ask(p)).unwrap();
        assert_eq!(*driver.asked.borrow(), [0x1000, 0x1100, 0x1200, 0x3000, 0x1300, 0x1400], "only the new one");
        assert_eq!(checked.len(), 6);
    }

    #[test]
    fn refused_buffers_are_never_remembered_and_the_first_refusal_is_reported() {
        let (checked, driver) = (CheckedPointers::new(DEVICE), Driver::new());
        for _ in 0..2 {
            let e = checked.check_with(&[(0x1000, "q"), (0x2000, "k"), (0x5000, "v")], |p| driver.ask(p)).unwrap_err();
            assert_eq!(e.code, mkResult_t::mkInvalidArgument);
            assert!(e.message.contains("k (0x2000) is memory of device 0"), "{}", e.message);
        }
        assert_eq!(driver.calls(), 4, "a refused call remembers nothing, so q is asked again");
        assert!(checked.is_empty());
        let e = checked.check_with(&[(0x1000, "q"), (0x5000, "v")], |p| driver.ask(p)).unwrap_err();
        assert!(e.message.contains("v (0x5000) is not device memory"), "{}", e.message);
        // An approved address stays approved; a host address next to it is still asked about.
        checked.check_with(&[(0x1000, "q")], |p| driver.ask(p)).unwrap();
        let before = driver.calls();
        assert!(checked.check_with(&[(0x1000, "q"), (0x1001 << 12, "k")], |p| driver.ask(p)).is_err());
        assert_eq!(driver.calls(), before + 1);
    }

    #[test]
    fn the_set_is_bounded() {
        let (checked, driver) = (CheckedPointers::new(DEVICE), Driver::new());
        for i in 0..CheckedPointers::CAPACITY as u64 {
            checked.check_with(&[(0x1000 + 16 * (i % 256), "x")], |p| driver.ask(p)).unwrap();
        }
        assert_eq!(checked.len(), 256);
        let mut fresh = 0x1000_0000u64;
        while checked.len() < CheckedPointers::CAPACITY {
            checked.check_with(&[(fresh, "x")], |_| driver.ask(0x1000)).unwrap();
            fresh += 16;
        }
        checked.check_with(&[(fresh, "x")], |_| driver.ask(0x1000)).unwrap();
        assert_eq!(checked.len(), 1, "a full set is emptied before the next address");
        let before = driver.calls();
        checked.check_with(&[(0x1000, "x")], |p| driver.ask(p)).unwrap();
        assert_eq!(driver.calls(), before + 1, "forgotten addresses are asked about again");
    }

    #[test]
    fn more_buffers_than_a_check_takes_is_an_internal_error() {
        let checked = CheckedPointers::new(DEVICE);
        let many = [(0x1000u64, "x"); MAX_BUFFERS_PER_CHECK + 1];
        assert_eq!(checked.check_with(&many, |_| unreachable!()).unwrap_err().code, mkResult_t::mkInternalError);
    }
}
