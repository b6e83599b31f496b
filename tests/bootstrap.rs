//! Bootstrap tests on loopback: ranks as separate processes (this test binary re-runs
//! itself as a rank), wrong-secret rejection, a rank that never arrives, duplicate ranks,
//! mismatched sizes, a dead peer and abort.

use mkernel::bootstrap::{net, root::start_root, Bootstrap, UniqueId, UNIQUE_ID_BYTES};
use mkernel::error::mkResult_t;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const ROLE: &str = "MK_TEST_BOOTSTRAP_RANK";

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

fn loopback() {
    // Keep every socket on loopback whatever interfaces the test machine has.
    std::env::set_var("MK_SOCKET_IFNAME", "=lo");
}

/// Entry point of a child rank process (ignored in a normal run; a no-op without its role).
#[test]
#[ignore = "child-process entry point: its parent test runs it with --ignored --exact"]
fn child_rank_entry() {
    let Ok(spec) = std::env::var(ROLE) else { return };
    let mut parts = spec.split(':');
    let id_hex = parts.next().unwrap();
    let rank: usize = parts.next().unwrap().parse().unwrap();
    let nranks: usize = parts.next().unwrap().parse().unwrap();
    let id = UniqueId::from_bytes(&unhex(id_hex).try_into().unwrap()).unwrap();
    let b = Bootstrap::join(&id, rank, nranks, Duration::from_secs(20)).unwrap();
    // Each rank contributes a distinct, rank-dependent payload of a rank-dependent length.
    let mine: Vec<u8> = (0..(rank * 37 + 5)).map(|i| (i * 7 + rank * 13) as u8).collect();
    let all = b.allgather(&mine).unwrap();
    for (r, block) in all.iter().enumerate() {
        let expect: Vec<u8> = (0..(r * 37 + 5)).map(|i| (i * 7 + r * 13) as u8).collect();
        assert_eq!(block, &expect, "rank {rank} got a wrong block from rank {r}");
    }
    let root = nranks - 1;
    let got = b.broadcast(format!("from-{rank}").as_bytes(), root).unwrap();
    assert_eq!(got, format!("from-{root}").as_bytes());
    b.barrier().unwrap();
    println!("CHILD-OK rank {rank}");
}

fn spawn_ranks(id: &UniqueId, nranks: usize, ranks: impl Iterator<Item = usize>) -> Vec<std::process::Child> {
    let exe = std::env::current_exe().unwrap();
    ranks
        .map(|r| {
            Command::new(&exe)
                .args(["--ignored", "--exact", "child_rank_entry", "--nocapture", "--test-threads=1"])
                .env(ROLE, format!("{}:{r}:{nranks}", hex(&id.to_bytes())))
                .env("MK_SOCKET_IFNAME", "=lo")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect()
}

#[test]
fn ranks_as_processes_form_and_run_collectives() {
    loopback();
    for nranks in 2..=8 {
        let id = start_root().unwrap();
        let children = spawn_ranks(&id, nranks, 0..nranks);
        for (r, c) in children.into_iter().enumerate() {
            let out = c.wait_with_output().unwrap();
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert!(
                out.status.success() && stdout.contains(&format!("CHILD-OK rank {r}")),
                "nranks={nranks} rank {r} failed: {stdout}\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
}

fn join_threads_within(id: UniqueId, specs: Vec<(usize, usize)>, timeout: Duration) -> Vec<mkernel::Result<Bootstrap>> {
    let handles: Vec<_> = specs
        .into_iter()
        .map(|(rank, nranks)| std::thread::spawn(move || Bootstrap::join(&id, rank, nranks, timeout)))
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn join_threads(id: UniqueId, specs: Vec<(usize, usize)>) -> Vec<mkernel::Result<Bootstrap>> {
    join_threads_within(id, specs, Duration::from_secs(20))
}

#[test]
fn wrong_or_missing_secret_is_refused_and_real_ranks_still_form() {
    loopback();
    let id = start_root().unwrap();
    // An intruder with the right address but a guessed secret.
    let mut forged = id;
    forged.secret = [0x5a; 16];
    let intruder = std::thread::spawn(move || Bootstrap::join(&forged, 0, 2, Duration::from_secs(3)));
    // Another that connects and never proves anything.
    let silent = std::net::TcpStream::connect(id.root).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let results = join_threads(id, vec![(0, 2), (1, 2)]);
    for r in &results {
        assert!(r.is_ok(), "real rank failed: {:?}", r.as_ref().err());
    }
    let [b0, b1]: [Bootstrap; 2] = results.into_iter().map(Result::unwrap).collect::<Vec<_>>().try_into().ok().unwrap();
    let other = std::thread::spawn(move || b1.allgather(b"one").unwrap());
    let all = b0.allgather(b"zero").unwrap();
    assert_eq!(all, vec![b"zero".to_vec(), b"one".to_vec()]);
    assert_eq!(other.join().unwrap(), all);
    // The intruder never got a rank table: the root refused its proof and told it so.
    let e = intruder.join().unwrap().err().expect("intruder must not join");
    assert_eq!(e.code, mkResult_t::mkInvalidUsage, "{e}");
    assert!(e.message.contains("authentication failed") && e.message.contains("unique id's secret"), "{e}");
    drop(silent);
}

#[test]
fn a_rank_that_never_arrives_times_out_everywhere() {
    loopback();
    let id = start_root().unwrap();
    let t = Instant::now();
    let results = join_threads_within(id, vec![(0, 3), (1, 3)], Duration::from_millis(1500));
    let elapsed = t.elapsed();
    for r in results {
        let e = r.err().expect("must time out");
        assert_eq!(e.code, mkResult_t::mkTimeout, "{e}");
        assert!(e.message.contains("[2]"), "the message names the missing rank: {e}");
    }
    assert!(elapsed < Duration::from_secs(10), "took {elapsed:?}");
}

#[test]
fn duplicate_rank_and_mismatched_nranks_are_invalid_usage() {
    loopback();
    let id = start_root().unwrap();
    let results = join_threads(id, vec![(0, 2), (0, 2)]);
    assert!(results.iter().all(|r| r.as_ref().err().map(|e| e.code) == Some(mkResult_t::mkInvalidUsage)));
    assert!(results.iter().any(|r| r.as_ref().err().unwrap().message.contains("duplicate rank")));

    let id = start_root().unwrap();
    let results = join_threads(id, vec![(0, 2), (1, 3)]);
    assert!(results.iter().all(|r| r.as_ref().err().map(|e| e.code) == Some(mkResult_t::mkInvalidUsage)));
    assert!(results.iter().any(|r| r.as_ref().err().unwrap().message.contains("mismatched nranks")));
}

#[test]
fn dead_peer_gives_remote_error_and_abort_unblocks() {
    loopback();
    let id = start_root().unwrap();
    let mut results = join_threads(id, vec![(0, 3), (1, 3), (2, 3)]);
    let b2 = results.pop().unwrap().unwrap();
    let b1 = results.pop().unwrap().unwrap();
    let b0 = results.pop().unwrap().unwrap();
    // Rank 2 dies: rank 0 (its successor) sees the connection close.
    drop(b2);
    let e = b0.allgather(b"hello").unwrap_err();
    assert_eq!(e.code, mkResult_t::mkRemoteError, "{e}");
    // Rank 1 is blocked waiting for rank 0, which will never send; abort unblocks it.
    let b1 = std::sync::Arc::new(b1);
    let waiter = {
        let b1 = b1.clone();
        std::thread::spawn(move || b1.allgather(b"x"))
    };
    std::thread::sleep(Duration::from_millis(200));
    let t = Instant::now();
    b1.abort();
    let r = waiter.join().unwrap();
    assert!(r.is_err());
    assert!(t.elapsed() < Duration::from_secs(5));
}

#[test]
fn unique_id_is_128_bytes_and_rejects_garbage() {
    assert_eq!(UNIQUE_ID_BYTES, 128);
    assert!(UniqueId::from_bytes(&[7u8; 128]).is_err());
    let _ = net::Deadline::bootstrap(Duration::from_millis(1));
}

/// Runs the forged-secret scenario in a child process with MK_DEBUG=WARN; a no-op otherwise.
#[test]
#[ignore = "child-process entry point: its parent test runs it with --ignored --exact"]
fn child_forged_secret_entry() {
    if std::env::var("MK_TEST_FORGED_CHILD").is_err() {
        return;
    }
    let id = start_root().unwrap();
    let mut forged = id;
    forged.secret[0] ^= 1;
    let e = Bootstrap::join(&forged, 0, 1, Duration::from_secs(2)).err().expect("forged join must fail");
    println!("INTRUDER-REFUSED {:?}", e.code);
    let b = Bootstrap::join(&id, 0, 1, Duration::from_secs(5)).unwrap();
    assert_eq!(b.nranks(), 1);
    println!("REAL-RANK-OK");
}

#[test]
fn refused_joins_are_logged() {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "child_forged_secret_entry", "--nocapture", "--test-threads=1"])
        .env("MK_TEST_FORGED_CHILD", "1")
        .env("MK_DEBUG", "WARN")
        .env("MK_SOCKET_IFNAME", "=lo")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("INTRUDER-REFUSED") && stdout.contains("REAL-RANK-OK"), "{stdout}");
    assert!(
        stderr.contains("MK WARN refused bootstrap root connection")
            && stderr.contains("does not match the unique id's secret"),
        "the refusal must be logged: {stderr}"
    );
}

#[test]
fn ranks_that_disagree_on_a_shared_setting_all_fail_alike() {
    use mkernel::comm::{agreement, CommConfig};
    loopback();
    let id = start_root().unwrap();
    let boots = join_threads(id, vec![(0, 3), (1, 3), (2, 3)]);
    let handles: Vec<_> = boots
        .into_iter()
        .enumerate()
        .map(|(rank, b)| {
            std::thread::spawn(move || {
                let mut config = CommConfig::from_env();
                // Rank 1 alone sends every collective through the simple protocol.
                if rank == 1 {
                    config.tuning.collective_ll_max_bytes = 0;
                }
                config.max_ctas = Some(40 + rank as u32);
                agreement::agree(&b.unwrap(), &config)
            })
        })
        .collect();
    for r in handles.into_iter().map(|h| h.join().unwrap()) {
        let e = r.expect_err("a difference in a shared setting fails on every rank");
        assert_eq!(e.code, mkResult_t::mkInvalidUsage);
        assert!(e.message.contains("MK_INTERNAL_COLLECTIVE_LL_MAX_BYTES") && e.message.contains("rank 1"), "{e}");
    }

    // Alike, they agree, and every rank takes the smallest grid cap.
    let id = start_root().unwrap();
    let boots = join_threads(id, vec![(0, 2), (1, 2)]);
    let handles: Vec<_> = boots
        .into_iter()
        .enumerate()
        .map(|(rank, b)| {
            std::thread::spawn(move || {
                let config = CommConfig { max_ctas: Some(66 - rank as u32), ..CommConfig::from_env() };
                agreement::agree(&b.unwrap(), &config)
            })
        })
        .collect();
    for r in handles.into_iter().map(|h| h.join().unwrap()) {
        assert_eq!(r.unwrap().max_ctas, Some(65));
    }
}
