//! The fence between fused ops (kernels/fused_fence.cu) on the CPU: the kernel's own text
//! compiled as host C++, one process per rank (its CTA, whose `__shared__` variables are
//! the process's statics) and one thread per CUDA thread, the ranks' signal regions shared
//! memory, the proxy a function that writes the GPU-l peer's signal word at once, the waits
//! bounded like signals.cuh's (abort word, timeout).
//!
//! The fence's promise: when a rank leaves fence k, the ranks whose regions its next fused
//! op writes (its local peers, its GPU-l peers on other nodes) and every rank that may still
//! read those regions for an earlier op (a GPU-l peer's local peers: GEMM + reduction across
//! nodes reads its local peers' partials and reduced rows) have ended every kernel before
//! fence k. A rank ends its earlier kernels before it enters the fence (stream order), so
//! the check is: every rank of every node entered fence k before any rank left it. Then a
//! rank that never arrives, and a proxy that fails, must end every fence with an error
//! (bounded waits), never a hang.
//!
//! Verdicts about which peer a timeout names are causal, never about how long a step took:
//! the driver stamps each post of a fence number (after the store is visible) and each
//! timed-out wait (before the load that missed the post), so a test can tell a peer that
//! had posted (a wrong name) from one that had not yet, however loaded the machine.

mod common;
use mkernel::error::mkResult_t;
use mkernel::kernel_abi::{MK_MAX_NODES, MK_MAX_PEERS};
use std::collections::HashMap;
use std::path::Path;
use std::process::Command;

/// The CUDA spellings the kernel uses and the device functions it calls
/// (kernels/common/signals.cuh, proxy.cuh), for host processes and threads.
const DRIVER: &str = r#"
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>
#include "mk_kernel_abi.h"
#include "mkernel.h"

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(n)
#define __grid_constant__
#define __shared__ static

struct Dim3 { unsigned x; };
thread_local Dim3 threadIdx;

// __syncthreads_and over the CTA's 32 threads.
struct CtaBarrier {
  std::mutex m;
  std::condition_variable cv;
  int arrived = 0, all = 1, result = 1;
  unsigned generation = 0;
  int sync_and(int predicate) {
    std::unique_lock<std::mutex> lock(m);
    all &= predicate != 0;
    const unsigned g = generation;
    if (++arrived == 32) {
      result = all, all = 1, arrived = 0, ++generation;
      cv.notify_all();
      return result;
    }
    cv.wait(lock, [&] { return generation != g; });
    return result;
  }
};
static CtaBarrier cta;
inline void __syncthreads() { cta.sync_and(1); }
inline int __syncthreads_and(int predicate) { return cta.sync_and(predicate); }

// Shared by every rank's process.
constexpr int kMaxRanks = 64, kMaxFences = 16;
struct World {
  uint64_t signals[kMaxRanks][MK_SIG_SEQ];  // the words below MK_SIG_SEQ: the fence's
  uint32_t error[kMaxRanks];                // each rank's first error word
  uint64_t error_ns[kMaxRanks];             // when it was detected
  int entered[kMaxRanks];                   // the last fence each rank entered
  // posted_ns[from][to][k]: when rank `from`'s post of fence k to rank `to` (a local peer's
  // word, or a GPU-l peer's through the proxy) became visible; 0: never.
  uint64_t posted_ns[kMaxRanks][kMaxRanks][kMaxFences];
};
static World* world;
static int me, nodes, local, proxy_fails;

inline uint64_t now_ns() {
  return (uint64_t)std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch()).count();
}
inline uint64_t load(const uint64_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
inline void store(uint64_t* p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

// kernels/common/signals.cuh
inline uint32_t mk_error_word(uint32_t code, uint32_t peer, uint32_t what, uint32_t op) {
  return (code & 0xff) | ((peer & 0xff) << 8) | ((what & 0xff) << 16) | ((op & 0xff) << 24);
}
inline uint64_t* mk_signal_word(const WorkspaceView& ws, int rank, uint32_t index) {
  if (rank < 0 || rank >= ws.nranks || index >= MK_SIG_SEQ) {
    std::printf("bad %d word %d %u\n", me, rank, index);
    std::fflush(stdout);
    std::_Exit(3);
  }
  return reinterpret_cast<uint64_t*>(ws.signals[rank]) + index;
}
// Stamps a post after its store is visible to every rank (the fence orders the clock read
// after it), so a wait that missed the post began its last look before the stamp.
inline void stamp_post(int to, uint64_t fence) {
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (fence < (uint64_t)kMaxFences) __atomic_store_n(&world->posted_ns[me][to][fence], now_ns(), __ATOMIC_RELEASE);
}
inline void mk_signal_store(uint64_t* flag, uint64_t value) {
  store(flag, value);
  stamp_post((int)((flag - &world->signals[0][0]) / MK_SIG_SEQ), value);
}
inline void record(uint32_t word, uint64_t at_ns) {
  uint32_t none = 0;
  if (__atomic_compare_exchange_n(&world->error[me], &none, word, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
    __atomic_store_n(&world->error_ns[me], at_ns, __ATOMIC_RELEASE);
}
inline void raise_abort(const WorkspaceView& ws) {
  for (int r = 0; r < ws.nranks; ++r) store(mk_signal_word(ws, r, MK_SIG_ABORT), (uint64_t)ws.rank + 1);
}
inline void mk_fail(const WorkspaceView& ws, uint32_t word) {
  record(word, now_ns());
  raise_abort(ws);
}
inline bool mk_wait_geq(const WorkspaceView& ws, const uint64_t* flag, uint64_t target, int peer, uint32_t what,
                        uint32_t op) {
  const uint64_t* aborted = mk_signal_word(ws, ws.rank, MK_SIG_ABORT);
  const uint64_t start = now_ns();
  for (;;) {
    // The clock first: a post this look misses is stamped after `now`.
    const uint64_t now = now_ns();
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (load(flag) >= target) return true;
    if (const uint64_t raised = load(aborted)) {
      // Stamped after the load that saw the abort: after the raiser's own stamp.
      record(mk_error_word(mkRemoteError, (uint32_t)(raised - 1), what, op), now_ns());
      return false;
    }
    if (now - start > ws.timeout_ns) {
      record(mk_error_word(mkTimeout, (uint32_t)peer, what, op), now);
      raise_abort(ws);
      return false;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

// kernels/common/proxy.cuh: the transport writes the peer's signal word (it only ever
// reaches this rank's GPU-l peers).
inline int mk_proxy_signal(const ProxyRingView&, uint32_t peer, uint32_t signal_id, uint32_t signal_value,
                           uint64_t* ticket_out) {
  *ticket_out = 0;
  if (proxy_fails) return mkRemoteError;
  if ((int)peer >= nodes * local || (int)peer % local != me % local || signal_id >= MK_SIG_SEQ) {
    std::printf("bad %d proxy %u %u\n", me, peer, signal_id);
    std::fflush(stdout);
    std::_Exit(3);
  }
  store(&world->signals[peer][signal_id], signal_value);
  stamp_post((int)peer, signal_value);
  return mkSuccess;
}

#include "fused_fence.cu"

// Rank me's part: `fences` fences, each entered after a random pause (its previous
// kernel still running); `held` enters its first one late; `absent` never comes.
void rank_main(int fences, int held, int absent, uint64_t timeout_ns) {
  if (me == absent) return;
  FusedFenceParams p{};
  p.nodes = nodes;
  p.node = me / local;
  for (int m = 0; m < nodes; ++m)
    for (int l = 0; l < local; ++l) p.rank_of[m * MK_MAX_PEERS + l] = m * local + l;
  p.ws.rank = me % local;
  p.ws.nranks = local;
  p.ws.timeout_ns = timeout_ns;
  for (int l = 0; l < local; ++l) p.ws.signals[l] = (uint64_t)world->signals[p.node * local + l];
  std::mt19937 pause(1234 + me);
  const int total = nodes * local;
  for (int k = 1; k <= fences; ++k) {
    std::this_thread::sleep_for(std::chrono::microseconds(pause() % 2000));
    if (me == held && k == 1) std::this_thread::sleep_for(std::chrono::milliseconds(300));
    __atomic_store_n(&world->entered[me], k, __ATOMIC_RELEASE);
    std::vector<std::thread> threads;
    for (unsigned t = 0; t < 32; ++t)
      threads.emplace_back([&, t] {
        threadIdx.x = t;
        mk_fused_fence(p);
      });
    for (auto& t : threads) t.join();
    for (int h = 0; h < total; ++h)
      if (h != absent && __atomic_load_n(&world->entered[h], __ATOMIC_ACQUIRE) < k)
        std::printf("left %d %d %d\n", me, k, h);
    const uint64_t seq = load(mk_signal_word(p.ws, p.ws.rank, MK_SIG_FENCE_SEQ));
    std::printf("done %d %d %llu %u %llu\n", me, k, (unsigned long long)seq,
                __atomic_load_n(&world->error[me], __ATOMIC_ACQUIRE),
                (unsigned long long)__atomic_load_n(&world->error_ns[me], __ATOMIC_ACQUIRE));
    std::fflush(stdout);
    if (seq != (uint64_t)k) return;
  }
}

// driver NODES LOCAL FENCES HELD ABSENT PROXY_FAILS TIMEOUT_MS (-1: none)
int main(int argc, char** argv) {
  if (argc != 8) return 2;
  nodes = std::atoi(argv[1]), local = std::atoi(argv[2]);
  const int fences = std::atoi(argv[3]), held = std::atoi(argv[4]), absent = std::atoi(argv[5]);
  const int failing = std::atoi(argv[6]);
  const uint64_t timeout_ns = (uint64_t)std::atoll(argv[7]) * 1000000ull;
  if (nodes * local > kMaxRanks || fences >= kMaxFences) return 2;
  void* shared = mmap(nullptr, sizeof(World), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (shared == MAP_FAILED) return 2;
  world = static_cast<World*>(shared);
  std::fflush(stdout);
  std::vector<pid_t> pids;
  for (int r = 0; r < nodes * local; ++r) {
    const pid_t pid = fork();
    if (pid == 0) {
      me = r;
      proxy_fails = r == failing;
      alarm(60);  // a hang ends the process, and the parent reports it
      rank_main(fences, held, absent, timeout_ns);
      std::fflush(stdout);
      std::_Exit(0);
    }
    pids.push_back(pid);
  }
  for (int r = 0; r < nodes * local; ++r) {
    int status = 0;
    waitpid(pids[r], &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) std::printf("abnormal %d\n", r);
  }
  for (int from = 0; from < nodes * local; ++from)
    for (int to = 0; to < nodes * local; ++to)
      for (int k = 1; k <= fences; ++k)
        if (const uint64_t at = world->posted_ns[from][to][k])
          std::printf("post %d %d %d %llu\n", from, to, k, (unsigned long long)at);
  return 0;
}
"#;

/// Builds the driver around the kernel's text, the stubs standing in for the device headers
/// it includes (the quoted includes find the driver's folder first).
fn driver() -> &'static Path {
    static EXE: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    EXE.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("fused_fence_protocol");
        std::fs::create_dir_all(dir.join("common")).unwrap();
        let files = [
            ("fused_fence.cu", include_str!("../kernels/fused_fence.cu")),
            ("mk_kernel_abi.h", include_str!(concat!(env!("OUT_DIR"), "/mk_kernel_abi.h"))),
            ("mkernel.h", include_str!("../include/mkernel.h")),
            ("common/signals.cuh", "#pragma once\n// Defined by the driver.\n"),
            ("common/proxy.cuh", "#pragma once\n// Defined by the driver.\n"),
        ];
        for (name, text) in files {
            std::fs::write(dir.join(name), text).unwrap();
        }
        common::host_cxx::build_driver("fused_fence_protocol", DRIVER)
    })
}

/// What one run printed, by kind of line.
#[derive(Debug, Default)]
struct Run {
    /// (rank, fence, rank not yet in it)
    left_early: Vec<(usize, usize, usize)>,
    /// (rank, fence, its fence count after it, its error word, when the error was detected)
    done: Vec<(usize, usize, u64, u32, u64)>,
    /// Ranks whose process did not exit cleanly: a hang the alarm ended, a bad signal word.
    abnormal: Vec<usize>,
    /// (from, to, fence) -> when that post became visible (steady clock, ns).
    posted: HashMap<(usize, usize, usize), u64>,
}

fn run(
    nodes: usize,
    local: usize,
    fences: usize,
    held: Option<usize>,
    absent: Option<usize>,
    failing: Option<usize>,
    timeout_ms: u64,
) -> Run {
    let arg = |v: Option<usize>| v.map_or("-1".to_string(), |v| v.to_string());
    let out = Command::new(driver())
        .args([
            nodes.to_string(),
            local.to_string(),
            fences.to_string(),
            arg(held),
            arg(absent),
            arg(failing),
            timeout_ms.to_string(),
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "driver failed:\n{}", String::from_utf8_lossy(&out.stderr));
    let mut run = Run::default();
    for line in String::from_utf8(out.stdout).unwrap().lines() {
        let w: Vec<&str> = line.split(' ').collect();
        let n = |i: usize| w[i].parse::<u64>().unwrap();
        match w[0] {
            "left" => run.left_early.push((n(1) as usize, n(2) as usize, n(3) as usize)),
            "done" => run.done.push((n(1) as usize, n(2) as usize, n(3), n(4) as u32, n(5))),
            "post" => _ = run.posted.insert((n(1) as usize, n(2) as usize, n(3) as usize), n(4)),
            "abnormal" => run.abnormal.push(n(1) as usize),
            _ => panic!("{nodes} nodes of {local}: {line}"),
        }
    }
    run
}

/// The (nodes, ranks per node) layouts the runs cover: one node, one rank per node, both.
const LAYOUTS: [(usize, usize); 5] = [(1, 3), (3, 1), (2, 2), (2, 3), (3, 2)];

#[test]
fn no_rank_leaves_a_fence_before_every_rank_entered_it() {
    const _: () = assert!(MK_MAX_PEERS >= 3 && MK_MAX_NODES >= 3);
    for (nodes, local) in LAYOUTS {
        let ranks = nodes * local;
        // The last rank enters the first fence 300 ms late: a rank of another node that
        // left before it would have let its next op write where the late rank's node
        // still reads.
        let r = run(nodes, local, 12, Some(ranks - 1), None, None, 20_000);
        assert!(r.abnormal.is_empty(), "{nodes}x{local}: abnormal exits {:?}", r.abnormal);
        assert!(r.left_early.is_empty(), "{nodes}x{local}: (rank, fence, rank not yet in it) {:?}", r.left_early);
        assert_eq!(r.done.len(), ranks * 12, "{nodes}x{local}: {:?}", r.done);
        for &(rank, k, seq, error, _) in &r.done {
            assert_eq!((seq, error), (k as u64, 0), "{nodes}x{local}: rank {rank} fence {k}");
        }
    }
}

#[test]
fn a_missing_rank_or_a_failed_proxy_ends_every_fence_with_an_error() {
    use mkernel::kernel_abi::{MkOp, MkWait};
    let (timeout, remote) = (mkResult_t::mkTimeout as u32, mkResult_t::mkRemoteError as u32);
    for (nodes, local) in LAYOUTS {
        let ranks = nodes * local;
        // A proxy is used only across nodes.
        let failing = (nodes > 1).then_some(0);
        for (absent, failing) in [(Some(ranks - 1), None), (None, failing)] {
            if absent.is_none() && failing.is_none() {
                continue;
            }
            let r = run(nodes, local, 3, None, absent, failing, 300);
            let what = format!("{nodes}x{local}, absent {absent:?}, failing proxy {failing:?}");
            assert!(r.abnormal.is_empty(), "{what}: abnormal exits {:?}", r.abnormal);
            // Each rank's last fence: (fence, error word, when the error was detected).
            let mut ended = HashMap::new();
            // Every rank that came ends a fence uncounted with the fence's error (a rank
            // may pass one fence first: its peers had entered it), and no fence after it.
            for rank in (0..ranks).filter(|&r| Some(r) != absent) {
                let mine: Vec<_> = r.done.iter().filter(|d| d.0 == rank).collect();
                let (&&(_, last, seq, error, error_ns), passed) = mine.split_last().expect("the rank ran a fence");
                assert!(
                    passed.iter().enumerate().all(|(i, d)| (d.1, d.2, d.3) == (i + 1, i as u64 + 1, 0)),
                    "{what}: {mine:?}"
                );
                assert_eq!((last, seq), (passed.len() + 1, passed.len() as u64), "{what}: {mine:?}");
                let (code, op) = (error & 0xff, error >> 24);
                assert!(op == MkOp::FusedFence as u32 && (code == timeout || code == remote), "{what}: {mine:?}");
                ended.insert(rank, (last, error, error_ns));
            }
            for (&rank, &(last, error, error_ns)) in &ended {
                let (code, waited) = (error & 0xff, (error >> 16) & 0xff);
                let peer = ((error >> 8) & 0xff) as usize;
                let node = rank / local;
                // A timeout names the global rank whose post it waited for: a local peer, or
                // the GPU-l peer of another node. That rank had not posted this fence to this
                // one when the wait gave up: it never came, it was stuck in an earlier fence,
                // or it was slower than the timeout (a loaded machine). A rank that had posted
                // before is a wrong name.
                if code == timeout && waited != MkWait::Proxy as u32 {
                    let named_right = if waited == MkWait::OpFlag as u32 {
                        peer / local == node && peer != rank
                    } else {
                        waited == MkWait::Net as u32 && peer % local == rank % local && peer / local != node
                    };
                    assert!(named_right, "{what}: rank {rank}: {error:#x}");
                    let posted = r.posted.get(&(peer, rank, last));
                    assert!(
                        posted.is_none_or(|&at| at > error_ns),
                        "{what}: rank {rank} timed out on rank {peer} at {error_ns} ns, which had posted fence \
                         {last} at {posted:?}: {error:#x}"
                    );
                }
                // The failing rank names its proxy, unless a wait of its node gave up first
                // (only a timeout or the proxy's failure raises the node's abort).
                if Some(rank) == failing && waited != MkWait::Proxy as u32 {
                    let gave_up_first = ended
                        .iter()
                        .any(|(&other, &(_, e, at))| other / local == node && e & 0xff == timeout && at <= error_ns);
                    assert!(gave_up_first, "{what}: the failing rank names its proxy: {error:#x} ({ended:?})");
                }
            }
        }
    }
}
