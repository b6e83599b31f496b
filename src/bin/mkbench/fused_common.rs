//! What the fused-op benches share: shape-list parsing and the timing rule (barrier,
//! warm-up, CUDA-event-timed calls, the slowest rank's median).

use crate::collectives::Events;
use mkernel::comm::Comm;
use mkernel::cuda::sys;
use mkernel::error::{MkError, Result};

pub fn bad(what: &str) -> MkError {
    MkError::invalid_argument(format!("mkbench: bad {what}"))
}

/// Reads the options every fused bench takes (-g ranks, -n iters, -w warm-up) into the
/// given fields; false when `flag` is not one of them.
pub fn common_flag(flag: &str, v: &str, ranks: &mut usize, iters: &mut usize, warmup: &mut usize) -> Result<bool> {
    let target = match flag {
        "-g" => ranks,
        "-n" => iters,
        "-w" => warmup,
        _ => return Ok(false),
    };
    *target = v.parse().map_err(|_| bad(flag))?;
    Ok(true)
}

/// "8192,28672" -> [8192, 28672].
pub fn parse_list(v: &str, what: &str) -> Result<Vec<usize>> {
    v.split(',').map(|x| x.trim().parse().map_err(|_| bad(what))).collect()
}

/// "8192x1024,8192x3584" -> [(8192, 1024), (8192, 3584)].
pub fn parse_pairs(v: &str, what: &str) -> Result<Vec<(usize, usize)>> {
    v.split(',')
        .map(|p| {
            let (a, b) = p.split_once('x').ok_or_else(|| bad(what))?;
            Ok((a.trim().parse().map_err(|_| bad(what))?, b.trim().parse().map_err(|_| bad(what))?))
        })
        .collect()
}

/// Every rank: barrier, `warmup` calls, then one CUDA-event-timed median over the events'
/// calls; returns the slowest rank's median in µs.
pub fn timed_slowest(comm: &Comm, events: &Events, stream: sys::CUstream, warmup: usize, f: &dyn Fn() -> Result<()>) -> Result<f64> {
    comm.bootstrap.barrier()?;
    for _ in 0..warmup {
        f()?;
    }
    let t = events.median_us(stream, f)?;
    let all = comm.bootstrap.allgather(&t.to_le_bytes())?;
    Ok(all.iter().map(|v| f64::from_le_bytes(v[..8].try_into().expect("8 bytes"))).fold(0.0, f64::max))
}
