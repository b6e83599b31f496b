//! The collectives bench's check of every output, on the host, in every dtype.
//!
//! Each rank's input is read from a table of `period` random elements per rank, drawn from
//! a seed every rank shares: element i of the input is entry `table_index(i, period)`, the
//! table rotated by `ROTATION` entries in each successive period, so the input does not
//! repeat with the period and a piece written to the wrong place shows. Every rank can
//! rebuild every rank's table, so the expected value of a reduced element is a table entry
//! too: `period` reductions per dtype instead of one per element keep a gigabyte's check to
//! seconds. Values as mktest's collectives suite draws them: floats uniform in [-1, 1)
//! (±[0.75, 1.25) for Prod, so products stay clear of subnormals), signed integers in
//! [-3, 3], unsigned in [1, 4], fp8 any finite code (for Prod, magnitudes in [0.5, 2)). A
//! float Sum, Avg or Prod passes within the bound of the rounding the library states
//! (`testing::Rule`: an fp32 accumulation over the ranks rounded once, plus one rounding per
//! node partial across nodes); an fp8 reduction must equal its f32-then-round-once value
//! (`fp8_reduction`; ±0 equal); everything else (AllGather, Max, Min, integers, whose sums
//! wrap as the kernels' arithmetic does) must match bit for bit. NaN never passes.

use mkernel::ops::collectives::CollectiveKind;
use mkernel::types::{mkDataType_t, mkRedOp_t};
use mkernel_tools::testing::collective_values::{
    exact_reduction, fp8_reduction, is_float, is_fp8, push_element, splitmix,
};
use mkernel_tools::testing::{
    accumulation_unit, f32_to_bf16, f32_to_f16, gamma, to_f64, underflow_floor, unit_roundoff, Rule,
};

/// Entries per rank's table in the bench (a prime, so no piece size divides it).
pub const PERIOD: usize = 1_048_573;

/// How far the table turns in each successive period of an input.
pub const ROTATION: u64 = 7;

/// The table entry of element `i` of an input (or of a reduced vector).
pub fn table_index(i: u64, period: usize) -> usize {
    let p = period as u64;
    ((i % p + ROTATION * (i / p)) % p) as usize
}

/// The runs of consecutive table entries that elements `first..first + len` read, in order:
/// (offset from `first`, first entry, length). A run ends at a period's end or where the
/// rotated table wraps, so there are about two per period.
pub fn table_runs(first: u64, len: u64, period: usize) -> Vec<(u64, usize, u64)> {
    let p = period as u64;
    let mut runs = Vec::with_capacity((len / p) as usize * 2 + 2);
    let mut i = first;
    while i < first + len {
        let t = table_index(i, period) as u64;
        let n = (first + len - i).min(p - i % p).min(p - t);
        runs.push((i - first, t as usize, n));
        i += n;
    }
    runs
}

/// `rank`'s table: `period` random elements of `dtype` (bytes).
fn rank_table(dtype: mkDataType_t, op: mkRedOp_t, seed: u64, rank: usize, period: usize) -> Vec<u8> {
    let base = splitmix(seed ^ (rank as u64 + 1).wrapping_mul(0xd6e8_feb8_6659_fd93));
    let mut bytes = Vec::with_capacity(period * dtype.size());
    for j in 0..period {
        push_element(&mut bytes, dtype, splitmix(base ^ j as u64), op == mkRedOp_t::mkProd);
    }
    bytes
}

/// The exact float64 reduction of one element over the ranks' values (integers wrap; an
/// integer Avg is the wrapped sum divided by the ranks, truncating), and for a float Sum,
/// Avg or Prod the largest error the library's rounding allows (None: exact). `node_size`
/// is the ranks per node (`vals.len()` on one node).
pub fn reference(vals: &[f64], op: mkRedOp_t, dtype: mkDataType_t, node_size: usize) -> (f64, Option<f64>) {
    let n = vals.len();
    if is_fp8(dtype) {
        // The rule is exact (one rounding of an f32 accumulation): a bound of zero compares
        // values, so +0 and -0 are equal and NaN is wrong.
        return (fp8_reduction(vals, op, dtype), Some(0.0));
    }
    let exact = exact_reduction(vals, op, dtype);
    if !is_float(dtype) {
        return (exact, None);
    }
    if matches!(op, mkRedOp_t::mkMax | mkRedOp_t::mkMin) {
        return (exact, None);
    }
    let u = unit_roundoff(dtype);
    let node_roundings = if node_size < n { 1.0 } else { 0.0 };
    let abs_sum: f64 = vals.iter().map(|v| v.abs()).sum();
    let bound = match op {
        mkRedOp_t::mkSum => Rule::reduction(dtype, n).bound(exact, abs_sum) + node_roundings * u * abs_sum,
        // The sum's bound divided by n (the division's own rounding is the extra term).
        mkRedOp_t::mkAvg => {
            (Rule::reduction(dtype, n + 1).bound(exact * n as f64, abs_sum) + node_roundings * u * abs_sum) / n as f64
        }
        // n − 1 multiplications in the accumulator, one rounding at the end (and one per
        // node partial): relative bounds.
        _ => {
            let rel = u * (1.0 + node_roundings * (n / node_size.max(1)) as f64) + gamma(n, accumulation_unit(dtype));
            1.01 * (underflow_floor(dtype) + rel * exact.abs())
        }
    };
    (exact, Some(bound))
}

/// A value of `dtype` known to be exactly representable in it, as its bytes.
fn encode(dtype: mkDataType_t, v: f64) -> Vec<u8> {
    use mkDataType_t::*;
    match dtype {
        mkFloat16 => f32_to_f16(v as f32).to_le_bytes().to_vec(),
        mkBfloat16 => f32_to_bf16(v as f32).to_le_bytes().to_vec(),
        mkFloat32 => (v as f32).to_le_bytes().to_vec(),
        mkFloat64 => v.to_le_bytes().to_vec(),
        mkInt8 => vec![v as i64 as i8 as u8],
        mkUint8 => vec![v as i64 as u8],
        mkInt32 => (v as i64 as i32).to_le_bytes().to_vec(),
        mkUint32 => (v as i64 as u32).to_le_bytes().to_vec(),
        mkInt64 => (v as i64).to_le_bytes().to_vec(),
        mkUint64 => (v as u64).to_le_bytes().to_vec(),
        mkFloat8e4m3 => vec![mkernel_tools::testing::fp8::f32_to_e4m3(v as f32)],
        mkFloat8e5m2 => vec![mkernel_tools::testing::fp8::f32_to_e5m2(v as f32)],
    }
}

/// What every output element of one collective in one dtype must be, for one rank.
pub struct Expectation {
    kind: CollectiveKind,
    dtype: mkDataType_t,
    rank: usize,
    period: usize,
    /// Every rank's input table (bytes).
    inputs: Vec<Vec<u8>>,
    /// A reduction checked bit for bit: the expected bytes per table entry.
    exact: Option<Vec<u8>>,
    /// A reduction checked within a bound: the float64 value and bound per table entry.
    value: Vec<f64>,
    bound: Vec<f64>,
}

impl Expectation {
    /// The tables for `rank` of `nranks` (`node_size` ranks per node), from `seed`; the
    /// bench uses `period` = `PERIOD`.
    pub fn new(
        kind: CollectiveKind,
        dtype: mkDataType_t,
        op: mkRedOp_t,
        seed: u64,
        rank: usize,
        nranks: usize,
        node_size: usize,
        period: usize,
    ) -> Expectation {
        let inputs: Vec<Vec<u8>> = (0..nranks).map(|r| rank_table(dtype, op, seed, r, period)).collect();
        let mut e =
            Expectation { kind, dtype, rank, period, inputs, exact: None, value: Vec::new(), bound: Vec::new() };
        if kind == CollectiveKind::AllGather {
            return e;
        }
        let decoded: Vec<Vec<f64>> = e.inputs.iter().map(|t| to_f64(t, dtype)).collect();
        let mut vals = vec![0.0; nranks];
        let mut exact = Vec::new();
        for j in 0..period {
            for (v, t) in vals.iter_mut().zip(&decoded) {
                *v = t[j];
            }
            match reference(&vals, op, dtype, node_size) {
                (v, Some(b)) => {
                    e.value.push(v);
                    e.bound.push(b);
                }
                (v, None) => exact.extend(encode(dtype, v)),
            }
        }
        if e.value.is_empty() {
            e.exact = Some(exact);
        }
        e
    }

    /// This rank's input of `elements` elements (bytes).
    pub fn input(&self, elements: u64) -> Vec<u8> {
        let es = self.dtype.size();
        let table = &self.inputs[self.rank];
        let mut bytes = Vec::with_capacity(elements as usize * es);
        for (_, t, n) in table_runs(0, elements, self.period) {
            bytes.extend_from_slice(&table[t * es..(t + n as usize) * es]);
        }
        bytes
    }

    /// Wrong elements among `out`, output elements `first..` of a call with `count`
    /// elements per rank segment (out may be any piece of the output, for a check in
    /// chunks).
    pub fn wrong(&self, count: u64, first: u64, out: &[u8]) -> u64 {
        let es = self.dtype.size();
        let elements = (out.len() / es) as u64;
        // Elements of `got` (bytes) against entries of `table` from `t`, bit for bit: one
        // comparison for the run, element by element only where it differs.
        let differ = |got: &[u8], table: &[u8], t: usize| -> u64 {
            let want = &table[t * es..t * es + got.len()];
            if got == want {
                return 0;
            }
            got.chunks_exact(es).zip(want.chunks_exact(es)).filter(|(g, w)| g != w).count() as u64
        };
        let piece = |off: u64, n: u64| &out[off as usize * es..(off + n) as usize * es];
        let mut wrong = 0;
        match (self.kind, &self.exact) {
            (CollectiveKind::AllGather, _) => {
                // Output element j is element j % count of rank j / count's input.
                let mut j = first;
                while j < first + elements {
                    let n = (first + elements - j).min(count - j % count);
                    let table = &self.inputs[(j / count) as usize];
                    for (off, t, len) in table_runs(j % count, n, self.period) {
                        wrong += differ(piece(j - first + off, len), table, t);
                    }
                    j += n;
                }
            }
            (kind, exact) => {
                let global = if kind == CollectiveKind::ReduceScatter { self.rank as u64 * count } else { 0 };
                for (off, t, len) in table_runs(global + first, elements, self.period) {
                    let got = piece(off, len);
                    wrong += match exact {
                        Some(table) => differ(got, table, t),
                        None => {
                            let values = to_f64(got, self.dtype);
                            let want = self.value[t..t + len as usize].iter().zip(&self.bound[t..t + len as usize]);
                            // Written so that NaN is wrong: every comparison with NaN is false.
                            #[allow(clippy::neg_cmp_op_on_partial_ord)]
                            let bad = values.iter().zip(want).filter(|(g, (v, b))| !((*g - *v).abs() <= **b)).count();
                            bad as u64
                        }
                    };
                }
            }
        }
        wrong
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mkernel_tools::testing::{bf16_to_f32, f16_to_f32};

    const SMALL: usize = 61;

    /// A model of the device: each output element from the ranks' inputs as the kernels
    /// compute it (fp32 accumulation in rank order rounded once; integers wrap; float64 in
    /// float64), independent of `reference`.
    fn device_model(
        kind: CollectiveKind,
        dtype: mkDataType_t,
        op: mkRedOp_t,
        inputs: &[Vec<u8>],
        rank: usize,
    ) -> Vec<u8> {
        let n = inputs.len();
        let es = dtype.size();
        let count = inputs[0].len() / es / if kind == CollectiveKind::ReduceScatter { n } else { 1 };
        if kind == CollectiveKind::AllGather {
            return inputs.concat();
        }
        let vals: Vec<Vec<f64>> = inputs.iter().map(|b| to_f64(b, dtype)).collect();
        let first = if kind == CollectiveKind::ReduceScatter { rank * count } else { 0 };
        let mut out = Vec::new();
        for i in first..first + count {
            let xs: Vec<f64> = vals.iter().map(|v| v[i]).collect();
            let v = if is_fp8(dtype) {
                use mkernel_tools::testing::fp8::{e4m3_to_f32, e5m2_to_f32, f32_to_e4m3, f32_to_e5m2};
                let f: Vec<f32> = xs.iter().map(|&x| x as f32).collect();
                let r = match op {
                    mkRedOp_t::mkSum => f[1..].iter().fold(f[0], |a, b| a + b),
                    mkRedOp_t::mkAvg => f[1..].iter().fold(f[0], |a, b| a + b) / n as f32,
                    mkRedOp_t::mkProd => f[1..].iter().fold(f[0], |a, b| a * b),
                    mkRedOp_t::mkMax => f[1..].iter().fold(f[0], |a, &b| a.max(b)),
                    mkRedOp_t::mkMin => f[1..].iter().fold(f[0], |a, &b| a.min(b)),
                };
                match dtype {
                    mkDataType_t::mkFloat8e4m3 => e4m3_to_f32(f32_to_e4m3(r)) as f64,
                    _ => e5m2_to_f32(f32_to_e5m2(r)) as f64,
                }
            } else if is_float(dtype) && dtype != mkDataType_t::mkFloat64 {
                let f: Vec<f32> = xs.iter().map(|&x| x as f32).collect();
                let r = match op {
                    mkRedOp_t::mkSum => f.iter().fold(0.0f32, |a, b| a + b),
                    mkRedOp_t::mkAvg => f.iter().fold(0.0f32, |a, b| a + b) / n as f32,
                    mkRedOp_t::mkProd => f.iter().fold(1.0f32, |a, b| a * b),
                    mkRedOp_t::mkMax => f.iter().copied().fold(f32::MIN, f32::max),
                    mkRedOp_t::mkMin => f.iter().copied().fold(f32::MAX, f32::min),
                };
                match dtype {
                    mkDataType_t::mkBfloat16 => bf16_to_f32(f32_to_bf16(r)) as f64,
                    mkDataType_t::mkFloat16 => f16_to_f32(f32_to_f16(r)) as f64,
                    _ => r as f64,
                }
            } else if dtype == mkDataType_t::mkFloat64 {
                match op {
                    mkRedOp_t::mkSum => xs.iter().sum(),
                    mkRedOp_t::mkAvg => xs.iter().sum::<f64>() / n as f64,
                    mkRedOp_t::mkProd => xs.iter().product(),
                    mkRedOp_t::mkMax => xs.iter().copied().fold(f64::MIN, f64::max),
                    mkRedOp_t::mkMin => xs.iter().copied().fold(f64::MAX, f64::min),
                }
            } else {
                reference(&xs, op, dtype, n).0
            };
            out.extend(encode(dtype, v));
        }
        out
    }

    fn cases() -> Vec<(CollectiveKind, mkDataType_t, mkRedOp_t)> {
        let mut v = Vec::new();
        for dtype in mkDataType_t::ALL {
            v.push((CollectiveKind::AllGather, dtype, mkRedOp_t::mkSum));
            for op in mkRedOp_t::ALL {
                v.push((CollectiveKind::ReduceScatter, dtype, op));
                v.push((CollectiveKind::AllReduce, dtype, op));
            }
        }
        v
    }

    fn send_elements(kind: CollectiveKind, count: u64, n: usize) -> u64 {
        if kind == CollectiveKind::ReduceScatter {
            count * n as u64
        } else {
            count
        }
    }

    #[test]
    fn the_device_model_passes_in_every_dtype_op_and_rank_count() {
        for n in [1, 3, 8] {
            for (kind, dtype, op) in cases() {
                // 200 elements per segment: several periods of the small table.
                let count = 200u64;
                let exps: Vec<Expectation> =
                    (0..n).map(|r| Expectation::new(kind, dtype, op, 42, r, n, n, SMALL)).collect();
                let inputs: Vec<Vec<u8>> = exps.iter().map(|e| e.input(send_elements(kind, count, n))).collect();
                for (r, e) in exps.iter().enumerate() {
                    let out = device_model(kind, dtype, op, &inputs, r);
                    assert_eq!(e.wrong(count, 0, &out), 0, "{kind:?} {} {op:?} n {n} rank {r}", dtype.name());
                    // In two chunks at an odd split, the same verdict.
                    let es = dtype.size();
                    let split = 77 * es;
                    let (a, b) = out.split_at(split);
                    assert_eq!(e.wrong(count, 0, a) + e.wrong(count, 77, b), 0);
                }
            }
        }
    }

    #[test]
    fn a_wrong_element_a_misplaced_piece_and_poison_are_counted() {
        let n = 4;
        let count = 300u64;
        for (kind, dtype, op) in cases() {
            let exps: Vec<Expectation> = (0..n).map(|r| Expectation::new(kind, dtype, op, 7, r, n, n, SMALL)).collect();
            let inputs: Vec<Vec<u8>> = exps.iter().map(|e| e.input(send_elements(kind, count, n))).collect();
            let e = &exps[1];
            let good = device_model(kind, dtype, op, &inputs, 1);
            let es = dtype.size();
            let label = format!("{kind:?} {} {op:?}", dtype.name());
            // One element changed: a float to 2v + 1.5 (never v, far outside any bound), an
            // fp8 value to 1 of the other sign (2v + 1.5 may saturate back to v), an integer
            // by one.
            let mut one = good.clone();
            let at = 123 * es;
            let v = to_f64(&one[at..at + es], dtype)[0];
            let changed = match dtype {
                t if is_fp8(t) => {
                    if v > 0.0 {
                        -1.0
                    } else {
                        1.0
                    }
                }
                t if is_float(t) => v * 2.0 + 1.5,
                _ => v + 1.0,
            };
            one[at..at + es].copy_from_slice(&encode(dtype, changed));
            assert_eq!(e.wrong(count, 0, &one), 1, "{label}: one changed element");
            // A 16-element piece written one period later than its place.
            let mut moved = good.clone();
            let (from, to) = (10 * es, (10 + SMALL) * es);
            let piece = good[from..from + 16 * es].to_vec();
            moved[to..to + 16 * es].copy_from_slice(&piece);
            assert!(e.wrong(count, 0, &moved) > 0, "{label}: a piece one period off");
            // Poison (every byte 0xFF) in place of the output: NaN in the floats, every element
            // wrong; −1 or the largest value in the integers, which some expected values equal.
            let poison = vec![0xffu8; good.len()];
            let all = good.len() as u64 / es as u64;
            let least = if is_float(dtype) || is_fp8(dtype) { all } else { all / 2 };
            assert!(e.wrong(count, 0, &poison) >= least, "{label}: poison passed");
        }
    }

    #[test]
    fn table_runs_cover_the_range_in_order_and_match_table_index() {
        for (first, len) in [(0u64, 1u64), (0, 200), (5, 61), (60, 3), (1000, 777), (61 * 61 - 3, 130)] {
            let runs = table_runs(first, len, SMALL);
            let mut next = 0;
            for &(off, t, n) in &runs {
                assert_eq!(off, next, "runs are contiguous");
                assert!(n > 0 && t + n as usize <= SMALL);
                for e in 0..n {
                    assert_eq!(table_index(first + off + e, SMALL), t + e as usize);
                }
                next += n;
            }
            assert_eq!(next, len);
            assert!(runs.len() as u64 <= 2 * len.div_ceil(SMALL as u64) + 1);
        }
    }

    #[test]
    fn inputs_do_not_repeat_with_the_period() {
        let e =
            Expectation::new(CollectiveKind::AllReduce, mkDataType_t::mkFloat32, mkRedOp_t::mkSum, 3, 0, 2, 2, SMALL);
        let v = to_f64(&e.input(3 * SMALL as u64), mkDataType_t::mkFloat32);
        let same = (0..SMALL).filter(|&i| v[i] == v[i + SMALL]).count();
        assert!(same < SMALL / 4, "{same} of {SMALL} repeat one period on");
        // Rotated by ROTATION per period: element i + P is table entry i + 7.
        assert_eq!(table_index(SMALL as u64 + 2, SMALL), 2 + ROTATION as usize);
        assert_eq!(table_index(2 * SMALL as u64 - 1, SMALL), (SMALL - 1 + ROTATION as usize) % SMALL);
        // Another seed draws other inputs.
        let f =
            Expectation::new(CollectiveKind::AllReduce, mkDataType_t::mkFloat32, mkRedOp_t::mkSum, 4, 0, 2, 2, SMALL);
        assert_ne!(e.input(SMALL as u64), f.input(SMALL as u64));
    }

    #[test]
    fn integer_sums_and_products_wrap_as_the_kernels_do() {
        assert_eq!(reference(&[4.0; 8], mkRedOp_t::mkProd, mkDataType_t::mkUint8, 8).0, 0.0);
        assert_eq!(reference(&[3.0; 8], mkRedOp_t::mkProd, mkDataType_t::mkUint8, 8).0, (6561 % 256) as f64);
        assert_eq!(reference(&[-3.0, -3.0, 1.0], mkRedOp_t::mkAvg, mkDataType_t::mkInt32, 3).0, -1.0);
        assert!(reference(&[1.0, 2.0], mkRedOp_t::mkSum, mkDataType_t::mkFloat32, 2).1.is_some());
        assert_eq!(reference(&[1.0, 2.0], mkRedOp_t::mkMax, mkDataType_t::mkFloat32, 2), (2.0, None));
    }
}
