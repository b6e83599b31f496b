//! CPU timing of the plain-Rust part of one mkRingAttention / mkRingAttentionBackward call
//! (validation, planning, the kernel's name, the memo lookups a call makes): no GPU, so the
//! driver calls are left out (docs/decisions/0082-host-path-per-call.md counts them).
//! Ignored (timing is not a test); run by hand:
//!   cargo test --release --test host_path_timing -- --ignored --nocapture --test-threads=1

use mkernel::cuda::memo::Memo;
use mkernel::cuda::pointer::{CheckedPointers, PointerFacts};
use mkernel::ops::attention::{ring_attention as fwd, ring_attention_backward as bwd};
use mkernel::types::mkDataType_t;
use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;

/// Median over 21 blocks of the ns per call of `f`, 20000 calls a block.
fn ns_per_call(mut f: impl FnMut()) -> f64 {
    const CALLS: u32 = 20000;
    for _ in 0..CALLS {
        f();
    }
    let mut blocks: Vec<f64> = (0..21)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..CALLS {
                f();
            }
            t.elapsed().as_nanos() as f64 / CALLS as f64
        })
        .collect();
    blocks.sort_by(f64::total_cmp);
    blocks[blocks.len() / 2]
}

const BF16: i32 = mkDataType_t::mkBfloat16 as i32;

fn forward_args(nranks: usize) -> fwd::RingArgs {
    fwd::validate_args(
        0x7f00_0000_0000,
        0x7f00_1000_0000,
        0x7f00_2000_0000,
        0x7f00_3000_0000,
        0x7f00_4000_0000,
        1,
        8192 / nranks,
        32,
        32,
        128,
        0.088,
        1,
        BF16,
        nranks,
        0,
    )
    .unwrap()
}

#[test]
#[ignore]
fn pieces() {
    let report = |what: &str, ns: f64| println!("{what:<58} {ns:8.1} ns");
    report(
        "forward validate_args",
        ns_per_call(|| {
            black_box(forward_args(black_box(1)));
        }),
    );
    let a = forward_args(1);
    report(
        "forward plan",
        ns_per_call(|| {
            black_box(fwd::plan(black_box(&a.shape), 132, false));
        }),
    );
    report(
        "forward kernel_for (instance list scan)",
        ns_per_call(|| {
            black_box(fwd::kernel_for(black_box(mkDataType_t::mkBfloat16), 128, false).unwrap());
        }),
    );
    let s = a.shape;
    let engine = mkernel::tuning::RingBackwardEngine::OnePass;
    report(
        "backward choose_engine + plan_for + workspace_layout",
        ns_per_call(|| {
            let e = bwd::choose_engine(None, black_box(&s), 132, mkDataType_t::mkBfloat16, 1 << 29);
            let p = bwd::plan_for(&s, 132, e);
            black_box(bwd::workspace_layout(&s, &p, mkDataType_t::mkBfloat16));
        }),
    );
    report(
        "backward kernel_for",
        ns_per_call(|| {
            black_box(bwd::kernel_for(engine, black_box(mkDataType_t::mkBfloat16), 128).unwrap());
        }),
    );
    // A tensor-map memo hit: the key is the size of launch.rs's TensorMapKey, the value a
    // 128-byte CUtensorMap.
    let maps: Memo<[u64; 14], [u64; 16]> = Memo::new(4096);
    let key = |i: u64| [0x7f00_0000_0000 + i, 9, 4, 128, 32, 8192, 1, 0, 256, 8192, 1 << 20, 0, 64 | (128 << 32), 1];
    for i in 0..64 {
        maps.get_or_try(key(i), |_| Ok::<_, ()>([i; 16])).unwrap();
    }
    report(
        "one tensor-map memo hit (Mutex + SipHash of a 112-byte key)",
        ns_per_call(|| {
            black_box(maps.get_or_try(black_box(key(7)), |_| Ok::<_, ()>([0; 16])).unwrap());
        }),
    );
    let sms: Memo<i32, i32> = Memo::new(64);
    sms.get_or_try(0, |_| Ok::<_, ()>(132)).unwrap();
    report(
        "SM count memo hit",
        ns_per_call(|| {
            black_box(sms.get_or_try(black_box(0), |_| Ok::<_, ()>(0)).unwrap());
        }),
    );
    let checked = CheckedPointers::new(0);
    let device = PointerFacts { answered: true, device_memory: true, managed: false, ordinal: 0 };
    let nine: Vec<(u64, &str)> = (0..9).map(|i| (0x7f00_0000_0000 + (i << 28), "x")).collect();
    checked.check_with(&nine, |_| device).unwrap();
    for i in 0..500u64 {
        checked.check_with(&[(0x7e00_0000_0000 + (i << 20), "x")], |_| device).unwrap();
    }
    report(
        "pointer check of 5 buffers seen before (509 remembered)",
        ns_per_call(|| {
            checked.check_with(black_box(&nine[..5]), |_| unreachable!()).unwrap();
        }),
    );
    report(
        "pointer check of 9 buffers seen before",
        ns_per_call(|| {
            checked.check_with(black_box(&nine), |_| unreachable!()).unwrap();
        }),
    );
    // The prepared-launch memo hit that replaces planning, the kernel's name, the function
    // lookup and the descriptor lookups: key and value of the sizes of the forward's
    // CallKey (128 bytes) and PreparedLaunch (17 CUtensorMaps and the parameters, about
    // 2.7 KB), and of the backward's (160 bytes, about 2.9 KB).
    // Kept behind an Arc, copied once to the caller's stack, as the ops do.
    let forward: Memo<[u64; 16], Arc<[u64; 340]>> = Memo::new(256);
    let backward: Memo<[u64; 20], Arc<[u64; 365]>> = Memo::new(256);
    for i in 0..64u64 {
        forward.get_or_try([i; 16], |_| Ok::<_, ()>(Arc::new([i; 340]))).unwrap();
        backward.get_or_try([i; 20], |_| Ok::<_, ()>(Arc::new([i; 365]))).unwrap();
    }
    report(
        "forward prepared-launch memo hit (128 B key, 2.7 KB value)",
        ns_per_call(|| {
            black_box(*forward.get_or_try(black_box([7; 16]), |_| Ok::<_, ()>(Arc::new([0; 340]))).unwrap());
        }),
    );
    report(
        "backward prepared-launch memo hit (160 B key, 2.9 KB value)",
        ns_per_call(|| {
            black_box(*backward.get_or_try(black_box([7; 20]), |_| Ok::<_, ()>(Arc::new([0; 365]))).unwrap());
        }),
    );
}
