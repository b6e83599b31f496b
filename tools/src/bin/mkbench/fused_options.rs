//! The options every fused-op bench takes (ag_gemm, gemm_rs, gemm_ar, moe, ring_attn,
//! ring_attn_bwd), read by one parser that hands each bench its own options:
//!
//!   -g ranks   -n calls per block   -w warm-up calls   --blocks blocks   --threads   [--trace]
//!
//! A value that does not parse, a flag without its value and a flag no one takes are
//! refused with an error naming the flag.

use crate::fused_common::bad;
use crate::measure::Protocol;
use crate::ranks;
use mkernel::error::Result;
use mkernel::types::mkDataType_t;

/// The common options of one fused bench's run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FusedOptions {
    /// `-g`: how many ranks (default: MK_TEST_NRANKS, else 1).
    pub ranks: usize,
    /// `-w` warm-up calls, then `--blocks` interleaved blocks of `-n` timed calls (measure.rs).
    pub protocol: Protocol,
    /// `--threads`: the ranks as threads of this process (fused_common::run_ranks).
    pub threads: bool,
    /// `--trace`: one more traced call per case (fused_common::print_trace).
    pub trace: bool,
}

/// What a bench sets of the common options: its default warm-up and whether it takes
/// `--trace` (where it does not, `--trace` is refused as an unknown flag).
#[derive(Clone, Copy, Debug)]
pub struct FusedDefaults {
    pub warmup: usize,
    pub takes_trace: bool,
}

impl FusedOptions {
    /// Reads `args`: the common options into the result, every other `flag value` pair
    /// handed to `own(flag, value)`, which reads it into the bench's own options and says
    /// false for a flag it does not take. The protocol must time at least one call.
    pub fn parse(
        args: &[String],
        defaults: FusedDefaults,
        mut own: impl FnMut(&str, &str) -> Result<bool>,
    ) -> Result<FusedOptions> {
        let mut o = FusedOptions {
            ranks: ranks::nranks_requested(),
            protocol: Protocol { warmup: defaults.warmup, ..Protocol::DEFAULT },
            threads: false,
            trace: false,
        };
        let mut lone = vec![("--threads", &mut o.threads)];
        if defaults.takes_trace {
            lone.push(("--trace", &mut o.trace));
        }
        let (ranks, p) = (&mut o.ranks, &mut o.protocol);
        for_each_option(args, &mut lone, |flag, v| {
            let target = match flag {
                "-g" => &mut *ranks,
                "-n" => &mut p.iters,
                "-w" => &mut p.warmup,
                "--blocks" => &mut p.blocks,
                _ if own(flag, v)? => return Ok(()),
                _ => return Err(bad(flag)),
            };
            *target = v.parse().map_err(|_| bad(flag))?;
            Ok(())
        })?;
        o.protocol.validate()?;
        Ok(o)
    }
}

/// Walks a bench's arguments: `flag value` pairs, each handed to `option(flag, value)`,
/// and the lone flags of `lone` (e.g. `--trace`, `--threads`), each setting its bool. A
/// flag without its value is an error.
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

/// `--dtype bf16|fp16`, the 16-bit float types the fused benches that take `--dtype` run in.
pub fn parse_half_dtype(v: &str) -> Result<mkDataType_t> {
    match v {
        "bf16" => Ok(mkDataType_t::mkBfloat16),
        "fp16" => Ok(mkDataType_t::mkFloat16),
        _ => Err(bad("--dtype (bf16 or fp16)")),
    }
}

/// The name `--dtype` takes for `dtype` ("bf16", "fp16"), as headers and records print it;
/// any other type by its library name.
pub fn half_dtype_name(dtype: mkDataType_t) -> &'static str {
    match dtype {
        mkDataType_t::mkBfloat16 => "bf16",
        mkDataType_t::mkFloat16 => "fp16",
        other => other.name(),
    }
}

/// A command line's words, for tests: "-g 2 --rows 8" -> ["-g", "2", "--rows", "8"].
#[cfg(test)]
pub fn command_line(s: &str) -> Vec<String> {
    s.split_whitespace().map(String::from).collect()
}

#[cfg(test)]
mod tests {
    use super::command_line as args;
    use super::*;

    const TRACED: FusedDefaults = FusedDefaults { warmup: 3, takes_trace: true };
    const UNTRACED: FusedDefaults = FusedDefaults { warmup: 2, takes_trace: false };

    /// The common options alone (the bench takes no flag of its own).
    fn common(s: &str, defaults: FusedDefaults) -> Result<FusedOptions> {
        FusedOptions::parse(&args(s), defaults, |_, _| Ok(false))
    }

    #[test]
    fn defaults_are_the_protocol_with_the_bench_warmup() {
        let o = common("", TRACED).unwrap();
        assert_eq!(o.ranks, ranks::nranks_requested());
        assert_eq!(o.protocol, Protocol { warmup: 3, ..Protocol::DEFAULT });
        assert!(!o.threads && !o.trace);
        assert_eq!(common("", UNTRACED).unwrap().protocol.warmup, 2);
    }

    #[test]
    fn every_common_flag_sets_its_field() {
        let o = common("-g 4 -n 7 -w 0 --blocks 3 --threads --trace", TRACED).unwrap();
        let want = FusedOptions {
            ranks: 4,
            protocol: Protocol { warmup: 0, blocks: 3, iters: 7 },
            threads: true,
            trace: true,
        };
        assert_eq!(o, want);
        // Any order; lone flags between pairs.
        assert_eq!(common("--trace --blocks 3 --threads -w 0 -g 4 -n 7", TRACED).unwrap(), want);
        let o = common("--threads -g 2", UNTRACED).unwrap();
        assert_eq!((o.ranks, o.threads, o.trace), (2, true, false));
    }

    #[test]
    fn the_bench_gets_every_other_pair_and_a_flag_it_refuses_is_named() {
        let mut seen = Vec::new();
        let o = FusedOptions::parse(&args("--rows 128,512 -g 2 --trace --nk 8x8"), TRACED, |f, v| {
            seen.push(format!("{f}={v}"));
            Ok(f != "--nk")
        });
        assert_eq!(o.unwrap_err().message, "mkbench: bad --nk");
        assert_eq!(seen, ["--rows=128,512", "--nk=8x8"]);
        // The bench's own error stands as it gave it.
        let e = FusedOptions::parse(&args("--rows x"), TRACED, |_, v| parse_list(v, "--rows").map(|_| true));
        assert_eq!(e.unwrap_err().message, "mkbench: bad --rows");
    }

    #[test]
    fn a_bad_value_names_its_flag() {
        for (s, flag) in [
            ("-g two", "-g"),
            ("-n -1", "-n"),
            ("-w 1.5", "-w"),
            ("--blocks x", "--blocks"),
            ("-n", "-n"),
            ("-g 2 --blocks", "--blocks"),
            ("--no-such-option 1", "--no-such-option"),
        ] {
            let e = common(s, TRACED).unwrap_err();
            assert_eq!(e.message, format!("mkbench: bad {flag}"), "{s}");
        }
    }

    #[test]
    fn trace_is_a_flag_only_where_the_bench_takes_it() {
        assert!(common("--trace", TRACED).unwrap().trace);
        assert_eq!(common("--trace", UNTRACED).unwrap_err().message, "mkbench: bad --trace");
        assert_eq!(common("--trace 1", UNTRACED).unwrap_err().message, "mkbench: bad --trace");
    }

    #[test]
    fn a_protocol_without_a_timed_call_is_refused() {
        for s in ["-n 0", "--blocks 0"] {
            assert!(common(s, TRACED).unwrap_err().message.contains("at least one block"), "{s}");
        }
    }

    #[test]
    fn lists_and_pairs_parse_and_refuse_what_is_not_a_number() {
        assert_eq!(parse_list("8192, 28672", "--m").unwrap(), [8192, 28672]);
        assert_eq!(parse_pairs("8192x1024,8x3", "--nk").unwrap(), [(8192, 1024), (8, 3)]);
        assert_eq!(parse_list("1,,2", "--m").unwrap_err().message, "mkbench: bad --m");
        assert_eq!(parse_pairs("8192", "--nk").unwrap_err().message, "mkbench: bad --nk");
        assert_eq!(parse_pairs("8x", "--nk").unwrap_err().message, "mkbench: bad --nk");
    }

    #[test]
    fn half_dtypes_parse_by_their_short_names_and_print_back() {
        for (name, dtype) in [("bf16", mkDataType_t::mkBfloat16), ("fp16", mkDataType_t::mkFloat16)] {
            assert_eq!(parse_half_dtype(name).unwrap(), dtype);
            assert_eq!(half_dtype_name(dtype), name);
        }
        for v in ["fp8", "float16", "BF16", "", "fp32"] {
            assert_eq!(parse_half_dtype(v).unwrap_err().message, "mkbench: bad --dtype (bf16 or fp16)", "{v}");
        }
        assert_eq!(half_dtype_name(mkDataType_t::mkFloat32), mkDataType_t::mkFloat32.name());
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
    }
}
