//! What the embedded kernels need from the machine, checked when a communicator is created
//! so that a wrong GPU or an old driver is named at init instead of failing as a module
//! load at the first operation.

use super::{check, device_attribute, sys};
use crate::error::{MkError, Result};

/// The compute capability the kernels are compiled for (sm_90a: its `a` features run on 9.0
/// only, not on later GPUs).
pub const REQUIRED_COMPUTE_CAPABILITY: (i32, i32) = (9, 0);
/// The oldest driver that loads the kernels: CUDA 13.0 (cuDriverGetVersion's encoding,
/// 1000·major + 10·minor).
pub const MIN_DRIVER_VERSION: i32 = 13000;

/// What was found on the machine for one device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Platform {
    pub device: i32,
    pub name: String,
    pub compute_capability: (i32, i32),
    /// cuDriverGetVersion.
    pub driver_version: i32,
}

fn version_text(v: i32) -> String {
    format!("{}.{}", v / 1000, v % 1000 / 10)
}

/// The decision, apart from the driver calls: an old driver is `mkSystemError` (the
/// machine's software must change), a GPU of another compute capability `mkInvalidUsage`
/// (the program must run elsewhere). The driver is judged first: with an old driver the
/// kernels load on no GPU at all.
pub fn judge(p: &Platform) -> Result<()> {
    if p.driver_version < MIN_DRIVER_VERSION {
        return Err(MkError::system(format!(
            "the CUDA driver is version {} (cuDriverGetVersion = {}); mkernel's kernels need a driver for CUDA {} or newer \
             (cuDriverGetVersion >= {MIN_DRIVER_VERSION}): update the NVIDIA driver",
            version_text(p.driver_version),
            p.driver_version,
            version_text(MIN_DRIVER_VERSION)
        )));
    }
    let (major, minor) = REQUIRED_COMPUTE_CAPABILITY;
    if p.compute_capability != REQUIRED_COMPUTE_CAPABILITY {
        return Err(MkError::invalid_usage(format!(
            "CUDA device {} ({}) has compute capability {}.{}; mkernel's kernels are built for compute capability {major}.{minor} \
             only (sm_90a: H100, H200, GH200)",
            p.device, p.name, p.compute_capability.0, p.compute_capability.1
        )));
    }
    Ok(())
}

/// Reads `device`'s compute capability and name and the driver's version.
pub fn probe(device: i32) -> Result<Platform> {
    super::driver()?;
    let mut driver_version = 0;
    // SAFETY: writes one int.
    check("cuDriverGetVersion", unsafe { sys::cuDriverGetVersion(&mut driver_version) })?;
    use sys::CUdevice_attribute::{
        CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
    };
    let compute_capability = (
        device_attribute(device, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
        device_attribute(device, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
    );
    let name = cudarc::driver::result::device::get_name(device).unwrap_or_else(|_| "unnamed GPU".into());
    Ok(Platform { device, name, compute_capability, driver_version })
}

/// Fails with the reason when `device` cannot run the kernels.
pub fn check_device(device: i32) -> Result<()> {
    judge(&probe(device)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::mkResult_t;

    fn platform(cc: (i32, i32), driver_version: i32) -> Platform {
        Platform { device: 1, name: "Test GPU".into(), compute_capability: cc, driver_version }
    }

    #[test]
    fn only_compute_capability_9_0_with_a_cuda_13_driver_passes() {
        for (cc, driver, want) in [
            ((9, 0), 13000, None),
            ((9, 0), 13020, None),
            ((9, 0), 14000, None),
            ((9, 0), 12090, Some(mkResult_t::mkSystemError)),
            ((9, 0), 12080, Some(mkResult_t::mkSystemError)),
            ((8, 0), 13000, Some(mkResult_t::mkInvalidUsage)),
            ((8, 9), 13000, Some(mkResult_t::mkInvalidUsage)),
            ((10, 0), 13000, Some(mkResult_t::mkInvalidUsage)),
            ((12, 0), 13010, Some(mkResult_t::mkInvalidUsage)),
            ((9, 1), 13000, Some(mkResult_t::mkInvalidUsage)),
            ((8, 0), 12000, Some(mkResult_t::mkSystemError)),
        ] {
            assert_eq!(judge(&platform(cc, driver)).err().map(|e| e.code), want, "cc {cc:?}, driver {driver}");
        }
    }

    #[test]
    fn messages_say_what_was_found_and_what_is_required() {
        let old = judge(&platform((9, 0), 12080)).unwrap_err().message;
        assert!(
            old.contains("version 12.8") && old.contains("CUDA 13.0 or newer") && old.contains(">= 13000"),
            "{old}"
        );
        let gpu = judge(&platform((8, 0), 13000)).unwrap_err().message;
        assert!(
            gpu.contains("device 1 (Test GPU) has compute capability 8.0") && gpu.contains("compute capability 9.0"),
            "{gpu}"
        );
    }
}
