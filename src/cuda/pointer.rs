//! Which memory a pointer a caller passes is: every op checks each of its buffers before a
//! kernel can dereference it (a host pointer handed to a kernel would end the context).

use super::sys;
use crate::error::{MkError, Result};

/// Checks that `ptr` is device (or managed) memory of `device`, naming `what` otherwise.
/// One driver call per pointer (every op call checks each of its buffers): the memory
/// type, whether it is managed and its device, together.
pub fn check_device_pointer(ptr: u64, device: i32, what: &str) -> Result<()> {
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
    let is_device = r == sys::CUresult::CUDA_SUCCESS && mem_type == sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32;
    if managed != 0 && r == sys::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    if !is_device {
        return Err(MkError::invalid_argument(format!(
            "{what} ({ptr:#x}) is not device memory (allocate it with cudaMalloc on the communicator's device)"
        )));
    }
    if ordinal != device {
        return Err(MkError::invalid_argument(format!(
            "{what} ({ptr:#x}) is memory of device {ordinal}, but the communicator uses device {device}"
        )));
    }
    Ok(())
}
