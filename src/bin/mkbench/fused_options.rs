//! How the fused-op benches (ag_gemm, gemm_rs, gemm_ar, moe, ring_attn, ring_attn_bwd)
//! read their options.

use crate::fused_common::bad;
use mkernel::error::Result;

/// Walks a fused bench's arguments: `flag value` pairs, each handed to `option(flag, value)`
/// (which reads the common ones with `common_flag`), and the lone flags of `lone` (e.g.
/// `--trace`, `--threads`), each setting its bool. A flag without its value is an error.
pub fn for_each_option(
    args: &[String],
    lone: &mut [(&str, &mut bool)],
    mut option: impl FnMut(&str, &str) -> Result<()>,
) -> Result<()> {
    let mut i = 0;
    while i < args.len() {
        if let Some((_, set)) = lone.iter_mut().find(|(flag, _)| *flag == args[i]) {
            **set = true;
            i += 1;
            continue;
        }
        let v = args.get(i + 1).ok_or_else(|| bad(&args[i]))?;
        option(&args[i], v)?;
        i += 2;
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn options_come_in_pairs_and_lone_flags_stand_alone_where_taken() {
        let (mut seen, mut trace, mut threads) = (Vec::new(), false, false);
        let mut lone = [("--trace", &mut trace), ("--threads", &mut threads)];
        for_each_option(&args("-g 2 --trace --rows 128,512"), &mut lone, |f, v| {
            seen.push(format!("{f}={v}"));
            Ok(())
        })
        .unwrap();
        assert!(trace && !threads);
        assert_eq!(seen, ["-g=2", "--rows=128,512"]);
        let mut lone = [("--trace", &mut trace), ("--threads", &mut threads)];
        for_each_option(&args("--threads -g 2"), &mut lone, |_, _| Ok(())).unwrap();
        assert!(threads);
        // Without a lone --trace, it is an ordinary flag (and here lacks its value).
        assert!(for_each_option(&args("--trace"), &mut [], |_, _| Ok(())).is_err());
        assert!(for_each_option(&args("-n"), &mut [], |_, _| Ok(())).is_err());
        let (mut ranks, mut iters, mut warmup) = (1, 1, 1);
        for_each_option(&args("-g 4 -n 7 -w 2"), &mut [], |f, v| {
            assert!(common_flag(f, v, &mut ranks, &mut iters, &mut warmup)?);
            Ok(())
        })
        .unwrap();
        assert_eq!((ranks, iters, warmup), (4, 7, 2));
    }
}
