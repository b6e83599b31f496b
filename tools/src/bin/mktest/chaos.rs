//! Chaos: with MK_TEST_NRANKS >= 2 rank processes, one rank (the victim) dies abruptly, as
//! a crash would (`_exit(VICTIM_EXIT)`: no destructor, no handler), at a random moment of a
//! random sequence of collectives and fused ops (mkAllGatherGemm, mkGemmReduceScatter).
//!
//! Run it WITHOUT MPS. Under MPS a client that dies with a kernel in flight poisons the
//! other clients' contexts (their next launch fails with CUDA_ERROR_ILLEGAL_ADDRESS although
//! they were idle), which is MPS's behaviour, not mkernel's; scripts/gpu-run.sh runs this
//! suite after stopping MPS, at 2 and 4 ranks, as it runs the collectives' killed rank.
//!
//! Every op before the death must complete and match its float64 reference on every rank.
//! The victim dies either between ops (op j − 1 completed and checked, op j never launched:
//! every survivor must fail op j) or in flight (it launches op j and exits up to 5 ms later:
//! a survivor whose part of op j had already arrived may complete it, correctly, and must
//! then fail op j + 1). A survivor's failing op must stop with mkTimeout or mkRemoteError
//! within the communicator's timeout (FAULT_TIMEOUT_MS, set in its config) plus FAULT_SLACK
//! of its launch (or be refused at once, when the communicator already knows), never hang
//! and never return a wrong result; the communicator then refuses new work with the same
//! code. At least one survivor must report mkTimeout itself: nobody else can raise the
//! error. Each survivor then ends the broken communicator (mkCommAbort or mkCommDestroy,
//! drawn from the seed), joins a new communicator of the n − 1 survivors, and runs an
//! AllReduce and an mkAllGatherGemm on it, checked against their references.
//!
//! The survivors agree on the new communicator's unique id without the dead rank because it
//! is made at launch with the other: the parent creates both ids (MK_TEST_IDS) and hosts
//! their bootstrap roots, and it outlives every rank. Ranks a launcher started with
//! MK_TEST_ID_FILE get their ids from rank 0, whose process hosts the roots: there the
//! victim is never rank 0.
//!
//! The plan (sequence and shapes, victim, which op, how it dies, abort or destroy) comes
//! from one seed, shared as the soak shares its seed (soak::shared_seed): MK_TEST_SEED
//! replays a run. The parent prints the plan; it expects VICTIM_EXIT from the victim and 0
//! from every survivor. With one rank there is nobody to survive, and MK_TEST_KILL=skip
//! leaves the killed-rank tests out: the suite reports SKIPPED (exit 77), not a pass.

use crate::collectives::{
    async_error, check_stopped, config, destroy, ffi, init_comm, kill_mode, longest_op_timeout, say, timed_sync,
    KillMode, Stream, FAULT_TIMEOUT_MS,
};
use crate::outcome::{self, Outcome};
use crate::ranks::{self, RankEnv, ENV_IDS, VICTIM_EXIT};
use crate::soak::{self, finish, Call, Live, Rng, ENV_SEED};
use mkernel::cuda::PrimaryContext;
use mkernel::error::{mkResult_t, MkError, Result};
use mkernel::ffi::comm::mkCommAbort;
use mkernel::ops::collectives::CollectiveKind;
use mkernel::types::{mkDataType_t, mkRedOp_t};
use std::time::{Duration, Instant};

const IDS: usize = 2; // the communicator that loses a rank, the survivors' communicator
const WORKSPACE_BYTES: i64 = 16 << 20;

pub fn run() -> Result<Outcome> {
    if kill_mode() == KillMode::Skip {
        return Ok(Outcome::Skipped("MK_TEST_KILL=skip leaves the killed-rank tests out, and chaos is one".into()));
    }
    if let Some(env) = ranks::child_env(IDS)? {
        if env.nranks < 2 {
            return Ok(Outcome::Skipped(one_rank()));
        }
        // Ids from MK_TEST_ID_FILE: rank 0 made them, and its process hosts their roots.
        let roots_on_rank0 = std::env::var(ENV_IDS).is_err();
        let plan = ChaosPlan::new(soak::shared_seed(&env)?, env.nranks, roots_on_rank0);
        rank_main(&env, &plan)?;
        return Ok(Outcome::Ran);
    }
    let n = ranks::nranks_requested();
    if n < 2 {
        return Ok(Outcome::Skipped(one_rank()));
    }
    let seed = soak::seed_from_env()?.unwrap_or_else(soak::fresh_seed);
    let plan = ChaosPlan::new(seed, n, false);
    println!("  chaos: seed {seed:#x} ({ENV_SEED}={seed:#x} replays it): {}", plan.describe());
    println!("  starting {n} rank processes");
    ranks::spawn_with_env(
        &["chaos".to_string()],
        n,
        IDS,
        Duration::from_secs(150),
        &[(ENV_SEED, format!("{seed:#x}"))],
        |r| {
            if r == plan.victim {
                VICTIM_EXIT
            } else {
                0
            }
        },
    )?;
    Ok(Outcome::Spawned { nranks: n })
}

fn one_rank() -> String {
    "chaos kills one rank of several: it needs MK_TEST_NRANKS >= 2 (without MPS); scripts/gpu-run.sh runs it at 2 and 4 ranks"
        .into()
}

/// How the victim dies at op `kill_at`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Death {
    /// After op `kill_at` − 1 completed and was checked, `delay_ms` later, before launching
    /// op `kill_at`.
    Between { delay_ms: u64 },
    /// `delay_us` after launching op `kill_at`.
    InFlight { delay_us: u64 },
}

/// Everything the ranks must agree on, drawn from one seed.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ChaosPlan {
    pub(crate) victim: usize,
    pub(crate) ops: Vec<Call>,
    /// The op the victim dies at: at least one op before it, and one after it.
    pub(crate) kill_at: usize,
    pub(crate) death: Death,
    /// Survivors end the broken communicator with mkCommAbort (else mkCommDestroy).
    pub(crate) abort: bool,
    /// Op i's inputs come from seed `data_seed + i`.
    pub(crate) data_seed: u64,
}

impl ChaosPlan {
    /// `roots_on_rank0`: rank 0's process hosts the bootstrap roots, so it must survive.
    pub(crate) fn new(seed: u64, nranks: usize, roots_on_rank0: bool) -> ChaosPlan {
        assert!(nranks >= 2, "chaos needs a survivor");
        let mut rng = Rng::new(seed ^ 0xc4a0_5000_0000_0001);
        let victim = if roots_on_rank0 { rng.range(1, nranks - 1) } else { rng.below(nranks) };
        let len = rng.range(4, 10);
        let mut ops = Vec::with_capacity(len);
        for _ in 0..len {
            let fused = rng.below(3) == 0;
            ops.push(chaos_call(&mut rng, nranks, fused));
        }
        // Collectives and at least one fused op, whatever the draws.
        if !ops.iter().any(Call::is_fused) {
            let i = rng.below(len);
            ops[i] = chaos_call(&mut rng, nranks, true);
        }
        if ops.iter().all(Call::is_fused) {
            let i = rng.below(len);
            ops[i] = chaos_call(&mut rng, nranks, false);
        }
        let kill_at = rng.range(1, len - 2);
        let death = if rng.coin() {
            Death::Between { delay_ms: rng.range(0, 200) as u64 }
        } else {
            Death::InFlight { delay_us: rng.range(0, 5000) as u64 }
        };
        let abort = rng.coin();
        ChaosPlan { victim, ops, kill_at, death, abort, data_seed: 1 + (rng.next() >> 32) }
    }

    pub(crate) fn describe(&self) -> String {
        let names: Vec<&str> = self.ops.iter().map(|c| c.ops()[0]).collect();
        format!(
            "rank {} dies {:?} at op {} ({}) of [{}]; the survivors then {} the communicator",
            self.victim,
            self.death,
            self.kill_at,
            names[self.kill_at],
            names.join(", "),
            if self.abort { "abort" } else { "destroy" }
        )
    }
}

/// A small collective (float and integer types) or fused op: calls of milliseconds, so the
/// death lands inside one or between two of them.
fn chaos_call(rng: &mut Rng, nranks: usize, fused: bool) -> Call {
    let dtype = rng.pick(&[mkDataType_t::mkBfloat16, mkDataType_t::mkFloat16]);
    if !fused {
        let kind = rng.pick(&[CollectiveKind::AllGather, CollectiveKind::ReduceScatter, CollectiveKind::AllReduce]);
        return Call::Collective {
            kind,
            dtype: rng.pick(&[
                mkDataType_t::mkFloat32,
                mkDataType_t::mkBfloat16,
                mkDataType_t::mkFloat16,
                mkDataType_t::mkInt32,
            ]),
            op: if kind == CollectiveKind::AllGather {
                mkRedOp_t::mkSum
            } else {
                rng.pick(&[mkRedOp_t::mkSum, mkRedOp_t::mkMax, mkRedOp_t::mkAvg])
            },
            count: rng.sized(1, 1 << 16),
            in_place: rng.coin(),
        };
    }
    if rng.coin() {
        Call::AllGatherGemm {
            dtype,
            rows: rng.sized(1, 64),
            n: 8 * rng.sized(1, 32),
            k: 8 * rng.sized(1, 32),
            with_gathered: rng.coin(),
        }
    } else {
        Call::GemmReduce {
            scatter: true,
            dtype,
            m: nranks * rng.sized(1, 64),
            n: 8 * rng.sized(1, 32),
            k: 8 * rng.sized(1, 32),
        }
    }
}

/// Ends the process at once, as a crash would.
fn die(rank: usize, how: &str) -> ! {
    say(rank, format!("chaos: the victim exits {how}"));
    use std::io::Write;
    let _ = std::io::stdout().flush();
    // SAFETY: ends the process without running destructors or exit handlers.
    unsafe { libc::_exit(VICTIM_EXIT) }
}

fn rank_main(env: &RankEnv, plan: &ChaosPlan) -> Result<()> {
    let (rank, n) = (env.rank, env.nranks);
    let ctx = PrimaryContext::retain(env.device)?;
    let _g = ctx.enter()?;
    let comm = init_comm(env, &env.ids[0], &config(FAULT_TIMEOUT_MS, WORKSPACE_BYTES))?;
    let stream = Stream::new()?;
    let victim = rank == plan.victim;
    if rank == 0 {
        say(rank, format!("chaos: {}", plan.describe()));
    }
    let mut checks = 0usize;
    let mut stopped = None;
    for (i, call) in plan.ops.iter().enumerate() {
        let what = format!("op {i} ({} {call:?})", call.ops()[0]);
        let mut live = Live::new(call, rank, n)?;
        live.prepare(plan.data_seed + i as u64)?;
        if victim && i == plan.kill_at {
            if let Death::Between { delay_ms } = plan.death {
                std::thread::sleep(Duration::from_millis(delay_ms));
                die(rank, &format!("between ops, {delay_ms} ms after op {} completed", i - 1));
            }
        }
        let t = Instant::now();
        let launched = live.launch(comm, stream.0);
        if victim && i == plan.kill_at {
            if let Death::InFlight { delay_us } = plan.death {
                std::thread::sleep(Duration::from_micros(delay_us));
                die(rank, &format!("{delay_us} µs after launching {what}"));
            }
        }
        let code = match launched {
            Ok(()) => {
                timed_sync(&stream, longest_op_timeout()).map_err(|e| e.context(what.clone()))?;
                async_error(comm)
            }
            // Refused: the communicator already knows of a failure.
            Err(e) if matches!(e.code, mkResult_t::mkTimeout | mkResult_t::mkRemoteError) => e.code,
            Err(e) => return Err(e.context(what)),
        };
        if code == mkResult_t::mkSuccess {
            let (ok, detail, _) = live.verify()?;
            checks += 1;
            if !ok {
                return Err(MkError::internal(format!("{what} completed with a wrong result: {detail}")));
            }
            let too_late = i > plan.kill_at || (i == plan.kill_at && matches!(plan.death, Death::Between { .. }));
            if !victim && too_late {
                return Err(MkError::internal(format!(
                    "{what} completed although rank {} died at op {}: the survivors missed its absence",
                    plan.victim, plan.kill_at
                )));
            }
            continue;
        }
        if victim || i < plan.kill_at {
            return Err(MkError::new(code, format!("{what} stopped with {code:?} while every rank was alive")));
        }
        // The stop: the right code, within the timeout plus slack, new work refused.
        check_stopped(rank, comm, t.elapsed(), &format!("chaos {what}"))?;
        checks += 1;
        stopped = Some(code);
        break;
    }
    let Some(code) = stopped else {
        return Err(MkError::internal(format!(
            "the sequence ended without an error although rank {} died at op {}",
            plan.victim, plan.kill_at
        )));
    };
    if plan.abort {
        // SAFETY: a live handle, not used again.
        ffi("mkCommAbort", unsafe { mkCommAbort(comm) }, std::ptr::null_mut())?;
    } else {
        destroy(comm)?;
    }
    checks += survivors(env, plan, &stream, code)?;
    outcome::count(checks);
    say(rank, format!("chaos: {checks} checks passed"));
    Ok(())
}

/// The survivors' communicator: an AllReduce and an mkAllGatherGemm checked on it, and the
/// survivors' codes compared. Returns the checks made.
fn survivors(env: &RankEnv, plan: &ChaosPlan, stream: &Stream, code: mkResult_t) -> Result<usize> {
    let survivor = RankEnv {
        rank: env.rank - usize::from(env.rank > plan.victim),
        nranks: env.nranks - 1,
        ids: Vec::new(),
        device: env.device,
    };
    let t = Instant::now();
    let comm = init_comm(&survivor, &env.ids[1], &config(10_000, WORKSPACE_BYTES))?;
    say(
        env.rank,
        format!(
            "chaos: rank {} of the {} survivors' new communicator after {:.2} s",
            survivor.rank,
            survivor.nranks,
            t.elapsed().as_secs_f64()
        ),
    );
    let mut checks = 0;
    let calls = [
        Call::Collective {
            kind: CollectiveKind::AllReduce,
            dtype: mkDataType_t::mkFloat32,
            op: mkRedOp_t::mkSum,
            count: 65_537,
            in_place: false,
        },
        Call::AllGatherGemm { dtype: mkDataType_t::mkBfloat16, rows: 64, n: 264, k: 136, with_gathered: true },
    ];
    for (i, call) in calls.iter().enumerate() {
        let what = format!("survivors' {} {call:?}", call.ops()[0]);
        let mut live = Live::new(call, survivor.rank, survivor.nranks)?;
        live.prepare(plan.data_seed + 100 + i as u64)?;
        live.launch(comm, stream.0).map_err(|e| e.context(what.clone()))?;
        finish(comm, stream, &what)?;
        let (ok, detail, _) = live.verify()?;
        checks += 1;
        say(env.rank, format!("chaos: {what}: {detail} -> {}", if ok { "ok" } else { "WRONG" }));
        if !ok {
            return Err(MkError::internal(format!("{what} on the survivors' communicator: wrong result")));
        }
    }
    // The first survivor to stop cannot have been told by anyone: it timed out itself.
    // SAFETY (both): a live handle made by init_comm; the borrow ends with the statement.
    let codes = unsafe { (*comm).comm() }.bootstrap.allgather(&(code as i32).to_le_bytes())?;
    if survivor.rank == 0 {
        checks += 1;
        let timeouts = codes.iter().filter(|c| c[..] == (mkResult_t::mkTimeout as i32).to_le_bytes()).count();
        if timeouts == 0 {
            return Err(MkError::internal("no survivor reported mkTimeout: who raised the error?"));
        }
    }
    unsafe { (*comm).comm() }.bootstrap.barrier()?;
    destroy(comm)?;
    Ok(checks)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_are_legal_and_place_the_death_inside_the_sequence() {
        for nranks in 2..=8 {
            for seed in 0..300u64 {
                for roots_on_rank0 in [false, true] {
                    let plan = ChaosPlan::new(seed, nranks, roots_on_rank0);
                    assert!(plan.victim < nranks);
                    assert!(!roots_on_rank0 || plan.victim != 0);
                    assert!(plan.kill_at >= 1 && plan.kill_at + 1 < plan.ops.len(), "{plan:?}");
                    assert!(plan.ops.iter().any(Call::is_fused) && !plan.ops.iter().all(Call::is_fused));
                    for (i, call) in plan.ops.iter().enumerate() {
                        soak::check_legal(call, nranks, plan.data_seed + i as u64)
                            .unwrap_or_else(|e| panic!("{nranks} ranks: {call:?}: {}", e.message));
                        assert!(call.reference_cost(nranks) <= soak::REFERENCE_BUDGET, "{call:?}");
                    }
                    assert_eq!(plan, ChaosPlan::new(seed, nranks, roots_on_rank0));
                }
            }
        }
    }

    #[test]
    fn the_victim_deaths_and_endings_vary_with_the_seed() {
        let plans: Vec<ChaosPlan> = (0..200).map(|s| ChaosPlan::new(s, 4, false)).collect();
        for v in 0..4 {
            assert!(plans.iter().any(|p| p.victim == v), "rank {v} never the victim");
        }
        assert!(plans.iter().any(|p| matches!(p.death, Death::Between { .. })));
        assert!(plans.iter().any(|p| matches!(p.death, Death::InFlight { .. })));
        assert!(plans.iter().any(|p| p.abort) && plans.iter().any(|p| !p.abort));
        assert!(plans.iter().any(|p| p.ops[p.kill_at].is_fused()));
        assert!(plans.iter().any(|p| !p.ops[p.kill_at].is_fused()));
    }
}
