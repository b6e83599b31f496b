//! What one op call costs the host, piece by piece, on one rank: the driver calls an op
//! call makes (reading the current context, checking a buffer is device memory, which a
//! communicator asks the driver once per buffer and then answers itself, the stream capture
//! query of a fused op on more than one rank, a kernel launch with a small parameter block,
//! the copy call a user could make instead), then whole calls for reference (`mkAllReduce`
//! of 8 bytes, `mkGemm` at M = 1). Each piece runs `-n` times back to back per sample, timed
//! on the host clock; the pieces take turns in interleaved blocks (measure.rs), the stream
//! is synchronised between blocks (outside the timing) so no launch queue fills. A call's
//! host time is roughly its pieces' sum: what is left above them is the library's own
//! work (validation, planning, parameters).

use crate::measure::{measure_interleaved, Protocol, Stats};
use crate::record;
use mkernel::comm::{Comm, CommConfig};
use mkernel::cuda::{self, memory::DeviceBuffer, sys, PrimaryContext};
use mkernel::error::{MkError, Result};
use mkernel::types::mkDataType_t;
use std::time::Instant;

struct Options {
    protocol: Protocol,
}

fn parse(args: &[String]) -> Result<Options> {
    let mut protocol = Protocol { warmup: 200, blocks: 21, iters: 500 };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = |what: &str| -> Result<usize> {
            it.next()
                .and_then(|v| v.parse::<usize>().ok())
                .ok_or_else(|| MkError::invalid_argument(format!("{what} needs a number")))
        };
        match a.as_str() {
            "-n" => protocol.iters = value("-n")?,
            "-w" => protocol.warmup = value("-w")?,
            "--blocks" => protocol.blocks = value("--blocks")?,
            other => {
                return Err(MkError::invalid_argument(format!(
                    "unknown option {other:?} (see src/bin/mkbench/host.rs)"
                )))
            }
        }
    }
    protocol.validate()?;
    Ok(Options { protocol })
}

pub fn check(_op: &str, args: &[String]) -> Result<()> {
    parse(args).map(|_| ())
}

/// One piece: its name, what it stands for, and one call of it.
type Piece<'a> = (&'a str, &'a str, Box<dyn Fn() -> Result<()> + 'a>);

pub fn run(args: &[String]) -> Result<bool> {
    let Options { protocol } = parse(args)?;
    let ctx = PrimaryContext::retain(0)?;
    let _g = ctx.enter()?;
    let stream = cudarc::driver::result::stream::create(cudarc::driver::result::stream::StreamKind::NonBlocking)
        .map_err(|e| cuda::cuda_err("cuStreamCreate", e))?;
    let sync = || {
        // SAFETY: a live stream of this context.
        unsafe { cudarc::driver::result::stream::synchronize(stream) }
            .map_err(|e| cuda::cuda_err("cuStreamSynchronize", e))
    };
    let small_a = DeviceBuffer::alloc(4096)?;
    let small_b = DeviceBuffer::alloc(4096)?;
    let id = mkernel::bootstrap::root::start_root()?;
    let comm = Comm::init(&id, 1, 0, Some(0), CommConfig::from_env())?;
    let (n, k) = (8192usize, 8192usize);
    let weights = DeviceBuffer::alloc(n * k * 2)?;
    let bf16 = mkDataType_t::mkBfloat16;
    mkernel_tools::testing::fill::fill_random(weights.ptr, (n * k) as u64, bf16, 7, 1.0, stream)?;
    mkernel_tools::testing::fill::fill_random(small_a.ptr, 2048, bf16, 8, 1.0, stream)?;
    sync()?;

    let pieces: Vec<Piece> = vec![
        (
            "ctx_get_current",
            "cuCtxGetCurrent (every call: is the communicator's context current?)",
            Box::new(|| {
                let mut c: sys::CUcontext = std::ptr::null_mut();
                // SAFETY: writes the calling thread's current context.
                cuda::check("cuCtxGetCurrent", unsafe { sys::cuCtxGetCurrent(&mut c) })
            }),
        ),
        (
            "pointer_check",
            "one buffer's cuPointerGetAttributes (a buffer's first call on a communicator)",
            Box::new(|| mkernel::cuda::pointer::check_device_pointer(small_a.ptr, 0, "x")),
        ),
        (
            "pointer_known",
            "a buffer its communicator checked before (Comm::check_buffers: no driver call)",
            Box::new(|| comm.check_buffers(&[(small_a.ptr, "x")])),
        ),
        (
            "capture_query",
            "cuStreamGetCaptureInfo (every fused-op call)",
            Box::new(|| mkernel::ops::common::fused_fence::capture_of(stream).map(|_| ())),
        ),
        (
            "small_launch",
            "a one-CTA kernel launch with a 32-byte parameter block (mk_fill_random)",
            Box::new(|| mkernel_tools::testing::fill::fill_random(small_b.ptr, 256, bf16, 9, 1.0, stream)),
        ),
        (
            "copy_call",
            "cuMemcpyDtoDAsync of 8 bytes (what a user could call instead)",
            Box::new(|| {
                // SAFETY: both buffers hold 4096 bytes.
                unsafe { cudarc::driver::result::memcpy_dtod_async(small_b.ptr, small_a.ptr, 8, stream) }
                    .map_err(|e| cuda::cuda_err("cuMemcpyDtoDAsync", e))
            }),
        ),
        (
            "all_reduce_8B",
            "mkAllReduce of 2 floats on one rank (Rust entry, below the C ABI's handle lookup)",
            Box::new(|| {
                mkernel::ops::collectives::collective(
                    &comm,
                    mkernel::ops::collectives::CollectiveKind::AllReduce,
                    small_a.ptr,
                    small_b.ptr,
                    2,
                    mkDataType_t::mkFloat32 as i32,
                    Some(mkernel::types::mkRedOp_t::mkSum as i32),
                    stream,
                )
            }),
        ),
        (
            "gemm_m1",
            "mkGemm 1 x 8192 x 8192 bf16 (three memoised TMA descriptors)",
            Box::new(|| {
                mkernel::ops::gemm::op::gemm(small_a.ptr, weights.ptr, small_b.ptr, 1, n, k, bf16 as i32, stream)
            }),
        ),
    ];

    println!(
        "# mkbench host: µs of host time per call, one rank, device 0 ({} SMs); {} warm-up calls, then {} interleaved blocks of {} calls per piece; median, p10, p90 over blocks",
        cuda::sm_count(0)?,
        protocol.warmup,
        protocol.blocks,
        protocol.iters
    );
    let samples = measure_interleaved(
        pieces.len(),
        protocol,
        |c| {
            for _ in 0..protocol.warmup {
                (pieces[c].2)()?;
            }
            sync()
        },
        |c, iters| {
            let t = Instant::now();
            for _ in 0..iters {
                (pieces[c].2)()?;
            }
            let us = t.elapsed().as_secs_f64() * 1e6 / iters as f64;
            sync()?;
            Ok(vec![us])
        },
    )?;
    println!("# {:<16} {:>8} {:>8} {:>8}  what", "piece", "median", "p10", "p90");
    let mut ok = true;
    for ((name, what, _), s) in pieces.iter().zip(&samples) {
        let Some(st) = Stats::of(s) else {
            ok = false;
            continue;
        };
        println!("  {name:<16} {:>8.2} {:>8.2} {:>8.2}  {what}", st.median, st.p10, st.p90);
        record::row(
            record::shape(&[], &[("piece", name), ("what", what)]),
            vec![record::contender(name, Some(st), Some(st.median))],
            &[],
        );
    }
    println!("{}", if ok { "OK" } else { "FAILED" });
    Ok(ok)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn options_parse_and_refuse_what_they_should() {
        let p = parse(&args(&["-n", "100", "--blocks", "5", "-w", "10"])).unwrap().protocol;
        assert_eq!(p, Protocol { warmup: 10, blocks: 5, iters: 100 });
        assert_eq!(parse(&[]).unwrap().protocol, Protocol { warmup: 200, blocks: 21, iters: 500 });
        assert!(parse(&args(&["-n"])).is_err());
        assert!(parse(&args(&["-n", "x"])).is_err());
        assert!(parse(&args(&["--blocks", "0"])).is_err());
        assert!(parse(&args(&["--size", "8"])).is_err());
    }
}
