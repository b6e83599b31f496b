//! The JSON record every bench writes (`--json PATH`; schema in docs/benchmarks.md):
//! the run's identity (bench, command, commit, date, GPU, clocks, driver) and one row per
//! measured case. The crate has no JSON dependency and this writer needs only objects,
//! arrays, strings, numbers and null, so it is written here (about 60 lines) instead of
//! adding serde to the library's dependencies.

use crate::measure::{Measured, Stats, GRAPH_CALLS, GRAPH_SUFFIX};
use mkernel::error::{MkError, Result};
use std::fmt::Write as _;
use std::sync::Mutex;

/// The schema's name and version, the record's first key.
pub const SCHEMA: &str = "mkbench/1";

/// The environment variable through which the parent process hands `--json PATH` to the
/// rank processes it starts (rank 0 writes the file).
pub const ENV_JSON: &str = "MK_BENCH_JSON";

/// A JSON value, enough for the record.
#[derive(Clone, Debug, PartialEq)]
pub enum Json {
    Null,
    Bool(bool),
    Num(f64),
    Str(String),
    Arr(Vec<Json>),
    Obj(Vec<(String, Json)>),
}

impl Json {
    pub fn obj(pairs: &[(&str, Json)]) -> Json {
        Json::Obj(pairs.iter().map(|(k, v)| (k.to_string(), v.clone())).collect())
    }
    pub fn str(s: impl Into<String>) -> Json {
        Json::Str(s.into())
    }
    pub fn num(v: impl Into<f64>) -> Json {
        Json::Num(v.into())
    }
    pub fn opt_num(v: Option<f64>) -> Json {
        v.map_or(Json::Null, Json::Num)
    }

    /// Compact JSON text. Non-finite numbers (which JSON lacks) are written as null.
    pub fn write(&self, out: &mut String) {
        match self {
            Json::Null => out.push_str("null"),
            Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            Json::Num(v) if v.is_finite() => {
                let _ = write!(out, "{v}");
            }
            Json::Num(_) => out.push_str("null"),
            Json::Str(s) => {
                out.push('"');
                for ch in s.chars() {
                    match ch {
                        '"' => out.push_str("\\\""),
                        '\\' => out.push_str("\\\\"),
                        '\n' => out.push_str("\\n"),
                        '\r' => out.push_str("\\r"),
                        '\t' => out.push_str("\\t"),
                        c if (c as u32) < 0x20 => {
                            let _ = write!(out, "\\u{:04x}", c as u32);
                        }
                        c => out.push(c),
                    }
                }
                out.push('"');
            }
            Json::Arr(items) => {
                out.push('[');
                for (i, v) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    v.write(out);
                }
                out.push(']');
            }
            Json::Obj(pairs) => {
                out.push('{');
                for (i, (k, v)) in pairs.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    Json::Str(k.clone()).write(out);
                    out.push(':');
                    v.write(out);
                }
                out.push('}');
            }
        }
    }

    pub fn text(&self) -> String {
        let mut s = String::new();
        self.write(&mut s);
        s
    }
}

/// One contender's result in a row: name, the statistics of its per-call GPU times (µs),
/// and the host's enqueue time per call where measured.
pub fn contender(name: &str, stats: Option<Stats>, host_us: Option<f64>) -> Json {
    let mut pairs = vec![("name", Json::str(name))];
    match stats {
        Some(s) => pairs.extend([
            ("median_us", Json::Num(s.median)),
            ("p10_us", Json::Num(s.p10)),
            ("p90_us", Json::Num(s.p90)),
            ("min_us", Json::Num(s.min)),
            ("samples", Json::num(s.samples as f64)),
        ]),
        None => pairs.push(("median_us", Json::Null)),
    }
    pairs.push(("host_enqueue_us", Json::opt_num(host_us)));
    Json::obj(&pairs)
}

/// Contenders measured by the shared protocol, named in contender order: each with its
/// statistics and host enqueue time per call; a contender named `<x>_graph` (graph
/// replays) also carries `graph_calls`, the calls captured per graph.
pub fn measured_contenders(names: &[&str], m: &Measured) -> Vec<Json> {
    names
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let c = contender(name, Some(m.stats[i]), Some(m.host_us[i]));
            match c {
                Json::Obj(mut pairs) if name.ends_with(GRAPH_SUFFIX) => {
                    pairs.push(("graph_calls".into(), Json::num(GRAPH_CALLS as f64)));
                    Json::Obj(pairs)
                }
                c => c,
            }
        })
        .collect()
}

/// A fused bench's contenders (`measured_contenders`), then the fused op and `baseline`
/// again with a cold L2 (`cold` holds their statistics, in that order).
pub fn fused_contenders(names: &[&str], m: &Measured, baseline: &str, cold: (Stats, Stats)) -> Vec<Json> {
    let mut v = measured_contenders(names, m);
    v.push(contender("fused_cold_l2", Some(cold.0), None));
    v.push(contender(&format!("{baseline}_cold_l2"), Some(cold.1), None));
    v
}

/// A row's shape from its sizes and named texts (dtype, mode).
pub fn shape(sizes: &[(&str, usize)], texts: &[(&str, &str)]) -> Json {
    let mut pairs: Vec<(&str, Json)> = sizes.iter().map(|&(k, v)| (k, Json::num(v as f64))).collect();
    pairs.extend(texts.iter().map(|&(k, v)| (k, Json::str(v))));
    Json::obj(&pairs)
}

/// The rows this process has recorded, written by `finish`.
static ROWS: Mutex<Vec<Json>> = Mutex::new(Vec::new());
/// Settings of the run (ranks, dtype, protocol) a bench reports once.
static CONFIG: Mutex<Vec<(String, Json)>> = Mutex::new(Vec::new());

/// Set in a process that only starts rank processes: rank 0 among them writes the record.
static PARENT_ONLY: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Called before a process starts the rank processes that measure: it writes no record.
pub fn parent_of_ranks() {
    PARENT_ONLY.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// Records one row: `shape` names the case (e.g. m, n, k, bytes), `contenders` its results,
/// `extra` anything else (errors found, notes on the baseline).
pub fn row(shape: Json, contenders: Vec<Json>, extra: &[(&str, Json)]) {
    let mut pairs = vec![("shape", shape), ("contenders", Json::Arr(contenders))];
    pairs.extend(extra.iter().cloned());
    ROWS.lock().unwrap_or_else(|e| e.into_inner()).push(Json::obj(&pairs));
}

/// Records one setting of the run (shown under "config").
pub fn config(key: &str, value: Json) {
    let mut c = CONFIG.lock().unwrap_or_else(|e| e.into_inner());
    c.retain(|(k, _)| k != key);
    c.push((key.to_string(), value));
}

/// Where the record goes: the path `--json` gave (in this process or, for a rank
/// process, its parent's).
pub fn json_path() -> Option<String> {
    std::env::var(ENV_JSON).ok().filter(|p| !p.is_empty())
}

/// Writes the record of this process's rows to `json_path()`, if any, and only from rank
/// 0 (MK_TEST_RANK unset or "0", and not a parent that only started ranks); `ok` is the
/// bench's verdict.
pub fn finish(bench: &str, ok: bool) -> Result<()> {
    let Some(path) = json_path() else { return Ok(()) };
    if std::env::var("MK_TEST_RANK").is_ok_and(|r| r != "0") || PARENT_ONLY.load(std::sync::atomic::Ordering::Relaxed) {
        return Ok(());
    }
    let rows = std::mem::take(&mut *ROWS.lock().unwrap_or_else(|e| e.into_inner()));
    let config = CONFIG.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let doc = document(bench, ok, Machine::query(), Json::Obj(config), rows);
    std::fs::write(&path, doc.text() + "\n").map_err(|e| MkError::system(format!("writing {path}: {e}")))
}

/// The whole record.
pub fn document(bench: &str, ok: bool, machine: Machine, config: Json, rows: Vec<Json>) -> Json {
    let command: Vec<Json> = std::env::args().map(Json::Str).collect();
    Json::obj(&[
        ("schema", Json::str(SCHEMA)),
        ("bench", Json::str(bench)),
        ("ok", Json::Bool(ok)),
        ("command", Json::Arr(command)),
        ("commit", Json::str(commit())),
        ("date", Json::str(utc_date(std::time::SystemTime::now()))),
        ("machine", machine.json()),
        ("config", config),
        ("rows", Json::Arr(rows)),
    ])
}

/// The GPU the bench ran on, as nvidia-smi reports it at the end of the run (clocks
/// included: a throttled run shows here). Fields are None where nvidia-smi is missing.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Machine {
    pub gpu: Option<String>,
    pub driver: Option<String>,
    pub sm_clock_mhz: Option<f64>,
    pub max_sm_clock_mhz: Option<f64>,
    pub mem_clock_mhz: Option<f64>,
    pub gpu_count: usize,
    pub host: Option<String>,
}

impl Machine {
    pub fn query() -> Machine {
        let out = std::process::Command::new("nvidia-smi")
            .args([
                "--query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem",
                "--format=csv,noheader,nounits",
            ])
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        let mut m = Machine::from_nvidia_smi(&out);
        m.host = std::fs::read_to_string("/proc/sys/kernel/hostname").ok().map(|h| h.trim().to_string());
        m
    }

    /// Parses nvidia-smi's CSV (one line per GPU; the first GPU's fields are kept).
    pub fn from_nvidia_smi(csv: &str) -> Machine {
        let lines: Vec<&str> = csv.lines().filter(|l| !l.trim().is_empty()).collect();
        let Some(first) = lines.first() else { return Machine::default() };
        let f: Vec<&str> = first.split(',').map(str::trim).collect();
        let text = |i: usize| f.get(i).filter(|s| !s.is_empty()).map(|s| s.to_string());
        let num = |i: usize| f.get(i).and_then(|s| s.parse::<f64>().ok());
        Machine {
            gpu: text(0),
            driver: text(1),
            sm_clock_mhz: num(2),
            max_sm_clock_mhz: num(3),
            mem_clock_mhz: num(4),
            gpu_count: lines.len(),
            host: None,
        }
    }

    pub fn json(&self) -> Json {
        let s = |v: &Option<String>| v.clone().map_or(Json::Null, Json::Str);
        Json::obj(&[
            ("gpu", s(&self.gpu)),
            ("driver", s(&self.driver)),
            ("sm_clock_mhz", Json::opt_num(self.sm_clock_mhz)),
            ("max_sm_clock_mhz", Json::opt_num(self.max_sm_clock_mhz)),
            ("mem_clock_mhz", Json::opt_num(self.mem_clock_mhz)),
            ("gpu_count", Json::num(self.gpu_count as f64)),
            ("host", s(&self.host)),
        ])
    }
}

/// The commit measured: MK_COMMIT (gpu-run.sh sets it from the packed binaries' commit),
/// else the COMMIT file `scripts/pack-bins.sh` puts beside the binaries, else `git
/// rev-parse HEAD` where a checkout is at hand, else "unknown". The packed file goes
/// before git: on the GPU machine the run's checkout may be another commit than the one
/// the binaries were built from.
fn commit() -> String {
    if let Ok(c) = std::env::var("MK_COMMIT") {
        return c;
    }
    let exe_dir = std::env::current_exe().ok().and_then(|p| p.parent().map(|d| d.to_path_buf()));
    if let Some(c) = exe_dir.and_then(|d| packed_commit(&d)) {
        return c;
    }
    std::process::Command::new("git")
        .args(["rev-parse", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".into())
}

/// The commit in `dir/COMMIT` (one line of hex digits, as `git rev-parse HEAD` writes it).
fn packed_commit(dir: &std::path::Path) -> Option<String> {
    let text = std::fs::read_to_string(dir.join("COMMIT")).ok()?;
    let c = text.trim();
    (c.len() >= 7 && c.chars().all(|ch| ch.is_ascii_hexdigit())).then(|| c.to_string())
}

/// ISO 8601 UTC, seconds precision ("2026-12-05T02:10:00Z").
pub fn utc_date(t: std::time::SystemTime) -> String {
    let secs = t.duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs()) as i64;
    let (days, rem) = (secs.div_euclid(86400), secs.rem_euclid(86400));
    // Days since 1970-01-01 to a civil date (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, UNIX_EPOCH};

    /// A contender known only by a median (the schema allows it).
    fn contender_median(name: &str, median_us: f64) -> Json {
        Json::obj(&[("name", Json::str(name)), ("median_us", Json::Num(median_us))])
    }

    #[test]
    fn dates_are_utc_iso_8601() {
        assert_eq!(utc_date(UNIX_EPOCH), "1970-01-01T00:00:00Z");
        // 2000-02-29 (a leap day of a year divisible by 400), 12:34:56.
        assert_eq!(utc_date(UNIX_EPOCH + Duration::from_secs(951_827_696)), "2000-02-29T12:34:56Z");
        // 2100-03-01 (2100 is not a leap year): 4107542400 s.
        assert_eq!(utc_date(UNIX_EPOCH + Duration::from_secs(4_107_542_400)), "2100-03-01T00:00:00Z");
        // Day by day over four centuries, the date advances by exactly one calendar day.
        let mut prev = utc_date(UNIX_EPOCH);
        for d in 1..146_097u64 {
            let cur = utc_date(UNIX_EPOCH + Duration::from_secs(d * 86400));
            let (py, pm, pd) = ymd(&prev);
            let (y, m, dd) = ymd(&cur);
            let leap = (py % 4 == 0 && py % 100 != 0) || py % 400 == 0;
            let len = [31, if leap { 29 } else { 28 }, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31][pm as usize - 1];
            let expect = if pd < len {
                (py, pm, pd + 1)
            } else if pm < 12 {
                (py, pm + 1, 1)
            } else {
                (py + 1, 1, 1)
            };
            assert_eq!((y, m, dd), expect, "after {prev}");
            prev = cur;
        }
    }

    fn ymd(s: &str) -> (i64, i64, i64) {
        (s[0..4].parse().unwrap(), s[5..7].parse().unwrap(), s[8..10].parse().unwrap())
    }

    #[test]
    fn fused_contenders_carry_host_times_graph_calls_and_cold_rows() {
        let st = |m: f64| Stats::of(&[m, m + 1.0, m + 2.0]).unwrap();
        let m = Measured { stats: vec![st(1.0), st(2.0), st(3.0)], host_us: vec![4.5, 6.5, 0.5] };
        let rows = fused_contenders(&["fused", "base", "fused_graph"], &m, "base", (st(7.0), st(8.0)));
        let text: Vec<String> = rows.iter().map(|r| r.text()).collect();
        assert_eq!(text.len(), 5);
        assert!(text[0].contains(r#""name":"fused""#) && text[0].contains(r#""host_enqueue_us":4.5"#), "{}", text[0]);
        assert!(!text[0].contains("graph_calls"), "{}", text[0]);
        assert!(text[1].contains(r#""name":"base""#) && text[1].contains(r#""host_enqueue_us":6.5"#), "{}", text[1]);
        assert!(text[2].contains(r#""name":"fused_graph""#) && text[2].contains(r#""graph_calls":10"#), "{}", text[2]);
        assert!(text[3].contains(r#""name":"fused_cold_l2""#) && text[3].contains(r#""median_us":8"#), "{}", text[3]);
        assert!(text[3].contains(r#""host_enqueue_us":null"#), "{}", text[3]);
        assert!(text[4].contains(r#""name":"base_cold_l2""#) && text[4].contains(r#""median_us":9"#), "{}", text[4]);
    }

    #[test]
    fn json_text_escapes_strings_and_nulls_non_finite_numbers() {
        let v = Json::obj(&[
            ("s", Json::str("a\"b\\c\nd\u{1}é")),
            ("n", Json::num(1.5)),
            ("inf", Json::num(f64::INFINITY)),
            ("arr", Json::Arr(vec![Json::Null, Json::Bool(true), Json::num(3.0)])),
        ]);
        assert_eq!(v.text(), r#"{"s":"a\"b\\c\nd\u0001é","n":1.5,"inf":null,"arr":[null,true,3]}"#);
    }

    #[test]
    fn nvidia_smi_csv_fills_the_machine_and_absent_fields_stay_null() {
        let m = Machine::from_nvidia_smi(
            "NVIDIA H200, 570.86.15, 1980, 1980, 3201\nNVIDIA H200, 570.86.15, 345, 1980, 3201\n",
        );
        assert_eq!(m.gpu.as_deref(), Some("NVIDIA H200"));
        assert_eq!(m.driver.as_deref(), Some("570.86.15"));
        assert_eq!((m.sm_clock_mhz, m.max_sm_clock_mhz, m.mem_clock_mhz), (Some(1980.0), Some(1980.0), Some(3201.0)));
        assert_eq!(m.gpu_count, 2);
        let none = Machine::from_nvidia_smi("");
        assert_eq!(none, Machine::default());
        assert!(none.json().text().contains("\"gpu\":null"));
        let partial = Machine::from_nvidia_smi("GPU X, 1.0, [N/A], 1980, 3201");
        assert_eq!(partial.sm_clock_mhz, None);
    }

    /// A whole record as the benches write it. scripts/test-bench.sh sets MK_BENCH_SAMPLE
    /// to a path and validates the file written there against the schema checker
    /// (benches/plot.py --check), so the writer and the documented schema cannot drift.
    #[test]
    fn a_record_has_the_documented_top_level_keys() {
        let machine = Machine::from_nvidia_smi("NVIDIA H200, 570.86.15, 1980, 1980, 3201");
        let s = Stats::of(&[10.0, 11.0, 12.0, 13.0, 30.0]).unwrap();
        let graph = Stats::of(&[8.0, 8.5, 9.0]).unwrap();
        let measured = Measured { stats: vec![s, graph], host_us: vec![5.0, 0.4] };
        let mut contenders = measured_contenders(&["fused", "fused_graph"], &measured);
        contenders.push(contender_median("cublaslt", 9.5));
        let rows = vec![Json::obj(&[
            ("shape", shape(&[("m", 256), ("n", 8192), ("k", 8192)], &[("dtype", "bf16")])),
            ("contenders", Json::Arr(contenders)),
        ])];
        let doc = document("ag_gemm", true, machine, Json::obj(&[("ranks", Json::num(2.0))]), rows);
        let Json::Obj(pairs) = &doc else { panic!("not an object") };
        let keys: Vec<&str> = pairs.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(keys, ["schema", "bench", "ok", "command", "commit", "date", "machine", "config", "rows"]);
        if let Ok(path) = std::env::var("MK_BENCH_SAMPLE") {
            std::fs::write(path, doc.text()).unwrap();
        }
    }

    #[test]
    fn a_contender_carries_its_statistics() {
        let s = Stats::of(&[1.0, 2.0, 3.0, 4.0, 5.0]).unwrap();
        let t = contender("fused", Some(s), Some(7.5)).text();
        assert_eq!(
            t,
            r#"{"name":"fused","median_us":3,"p10_us":1,"p90_us":5,"min_us":1,"samples":5,"host_enqueue_us":7.5}"#
        );
        assert_eq!(contender("x", None, None).text(), r#"{"name":"x","median_us":null,"host_enqueue_us":null}"#);
    }

    #[test]
    fn the_packed_commit_file_names_the_binaries_commit() {
        let dir = std::env::temp_dir().join(format!("mkbench-commit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert_eq!(packed_commit(&dir), None, "no file");
        std::fs::write(dir.join("COMMIT"), "3f3b7db5c7400e7d31a24a694bc5df387f10a60b\n").unwrap();
        assert_eq!(packed_commit(&dir).as_deref(), Some("3f3b7db5c7400e7d31a24a694bc5df387f10a60b"));
        std::fs::write(dir.join("COMMIT"), "not a commit\n").unwrap();
        assert_eq!(packed_commit(&dir), None, "anything but hex digits is ignored");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
