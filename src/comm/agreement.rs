//! The settings the ranks of a communicator must share, checked when it is created.
//!
//! Each rank resolves its `CommConfig` from its own `mkConfig_t` and environment, but some
//! settings decide what both ends of a transfer do: the node grouping, the CTAs of the
//! fused ops' communication roles, and the internal tuning (which protocol a collective
//! runs, which path GEMM + AllReduce takes, how MoE bands and sends its rows). Ranks that
//! differ there would run different protocols against each other and end in a timeout or
//! a wrong result. So every rank sends its values through the bootstrap allgather, and a
//! difference fails the creation on every rank alike, with mkInvalidUsage naming the
//! setting and the ranks' values.
//!
//! The grid cap is reconciled instead: each rank's cap keeps its own kernels co-resident
//! on its share of a GPU, so the communicator takes the smallest (as the workspace takes
//! the smallest size, `workspace::SymmetricWorkspace::create`). The timeouts may differ.

use super::CommConfig;
use crate::bootstrap::Bootstrap;
use crate::error::{MkError, Result};
use crate::tuning::Reducers;

/// A setting's name in messages (the environment variable and the `mkConfig_t` field that
/// set it) and its value as a number.
type Setting = (&'static str, u64);

/// Encodes `None` as a value no setting takes.
const UNSET: u64 = u64::MAX;

/// The settings every rank must hold equal, in a fixed order.
fn shared(config: &CommConfig) -> [Setting; 7] {
    let t = &config.tuning;
    [
        ("MK_RANKS_PER_NODE (mkConfig_t.ranksPerNode)", config.ranks_per_node.map_or(UNSET, u64::from)),
        ("MK_COMM_SMS (mkConfig_t.commCtas)", config.comm_ctas.map_or(UNSET, u64::from)),
        (
            "MK_INTERNAL_GEMM_REDUCERS",
            match t.gemm_reducers {
                Reducers::Early => 0,
                Reducers::After => 1,
            },
        ),
        ("MK_INTERNAL_GEMM_AR_ONESHOT_MAX_M", t.gemm_ar_one_shot_max_m as u64),
        ("MK_INTERNAL_MOE_BANDS", t.moe_bands as u64),
        ("MK_INTERNAL_MOE_BURST", t.moe_burst.map_or(UNSET, u64::from)),
        ("MK_INTERNAL_COLLECTIVE_LL_MAX_BYTES", t.collective_ll_max_bytes),
    ]
}

/// This rank's record: the shared settings, then its grid cap.
fn encode(config: &CommConfig) -> Vec<u8> {
    let cap = config.max_ctas.map_or(UNSET, u64::from);
    shared(config).iter().map(|s| s.1).chain([cap]).flat_map(u64::to_le_bytes).collect()
}

/// `config` as every rank holds it after comparing the records of all ranks (`records[q]`
/// from rank q): an error naming the first setting on which ranks differ, else `config`
/// with the smallest grid cap any rank set.
pub fn reconcile(config: &CommConfig, records: &[Vec<u8>]) -> Result<CommConfig> {
    let names = shared(config).map(|s| s.0);
    let words = names.len() + 1;
    let mut values = Vec::with_capacity(records.len());
    for (q, record) in records.iter().enumerate() {
        if record.len() != 8 * words {
            return Err(MkError::invalid_usage(format!(
                "rank {q} sent {} bytes of communicator settings where {} were expected: every rank must run the \
                 same mkernel library",
                record.len(),
                8 * words
            )));
        }
        let v: Vec<u64> = record.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().unwrap())).collect();
        values.push(v);
    }
    let show = |v: u64| if v == UNSET { "unset".to_string() } else { v.to_string() };
    for (i, name) in names.iter().enumerate() {
        if let Some(q) = values.iter().position(|v| v[i] != values[0][i]) {
            return Err(MkError::invalid_usage(format!(
                "the ranks of this communicator disagree on {name}: rank 0 has {}, rank {q} has {}; every rank must \
                 set it alike (it decides what both ends of a transfer do)",
                show(values[0][i]),
                show(values[q][i])
            )));
        }
    }
    let cap = values.iter().map(|v| v[words - 1]).min().unwrap_or(UNSET);
    Ok(CommConfig { max_ctas: (cap != UNSET).then_some(cap as u32), ..config.clone() })
}

/// Exchanges this rank's record through `bootstrap` and reconciles (see [`reconcile`]).
pub fn agree(bootstrap: &Bootstrap, config: &CommConfig) -> Result<CommConfig> {
    reconcile(config, &bootstrap.allgather(&encode(config))?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::mkResult_t;

    fn config() -> CommConfig {
        CommConfig {
            timeout: std::time::Duration::from_secs(30),
            bootstrap_timeout: std::time::Duration::from_secs(30),
            comm_ctas: None,
            max_ctas: None,
            workspace_bytes: 1 << 26,
            ranks_per_node: None,
            tuning: crate::tuning::Tuning::default(),
        }
    }

    #[test]
    fn equal_settings_agree_and_the_smallest_grid_cap_wins() {
        let a = config();
        let b = CommConfig { max_ctas: Some(66), timeout: std::time::Duration::from_secs(5), ..config() };
        let c = CommConfig { max_ctas: Some(33), ..config() };
        let records = [encode(&a), encode(&b), encode(&c)];
        for mine in [&a, &b, &c] {
            let agreed = reconcile(mine, &records).unwrap();
            assert_eq!(agreed.max_ctas, Some(33));
            assert_eq!(agreed.timeout, mine.timeout, "the timeouts may differ");
        }
        assert_eq!(reconcile(&a, &[encode(&a), encode(&a)]).unwrap().max_ctas, None, "no rank set a cap");
    }

    #[test]
    fn each_shared_setting_that_differs_is_named() {
        let mut variants = Vec::new();
        let mut v = config();
        v.ranks_per_node = Some(2);
        variants.push((v, "MK_RANKS_PER_NODE"));
        let mut v = config();
        v.comm_ctas = Some(0);
        variants.push((v, "MK_COMM_SMS"));
        let mut v = config();
        v.tuning.gemm_reducers = Reducers::After;
        variants.push((v, "MK_INTERNAL_GEMM_REDUCERS"));
        let mut v = config();
        v.tuning.gemm_ar_one_shot_max_m += 1;
        variants.push((v, "MK_INTERNAL_GEMM_AR_ONESHOT_MAX_M"));
        let mut v = config();
        v.tuning.moe_bands += 1;
        variants.push((v, "MK_INTERNAL_MOE_BANDS"));
        let mut v = config();
        v.tuning.moe_burst = Some(false);
        variants.push((v, "MK_INTERNAL_MOE_BURST"));
        let mut v = config();
        v.tuning.collective_ll_max_bytes = 0;
        variants.push((v, "MK_INTERNAL_COLLECTIVE_LL_MAX_BYTES"));
        assert_eq!(variants.len(), shared(&config()).len(), "a variant for every shared setting");
        for (other, name) in variants {
            // The odd rank out may be any rank; every rank reaches the same verdict.
            let records = [encode(&config()), encode(&config()), encode(&other)];
            for mine in [config(), other.clone()] {
                let e = reconcile(&mine, &records).unwrap_err();
                assert_eq!(e.code, mkResult_t::mkInvalidUsage);
                assert!(e.message.contains(name) && e.message.contains("rank 2"), "{name}: {e}");
            }
        }
    }

    #[test]
    fn a_record_of_another_size_is_refused() {
        let mut short = encode(&config());
        short.truncate(16);
        let e = reconcile(&config(), &[encode(&config()), short]).unwrap_err();
        assert!(e.message.contains("rank 1 sent 16 bytes"), "{e}");
    }
}
