//! The device side of the proxy ring on a GPU (kernels/common/proxy.cuh via mk_proxy_test):
//! many CTAs through a small ring to a live proxy, and a full ring timing out. It needs a
//! CUDA device, so it is ignored in a plain `cargo test` (where cargo reports it as ignored,
//! never as passed); on the GPU machine run it with
//! `cargo test --release --test transport_gpu -- --ignored`. Run that way without a usable
//! device it fails, saying why.

use mkernel::cuda::PrimaryContext;
use mkernel_tools::device_check;
use mkernel_tools::testing::gpu_unavailable_reason;

#[test]
#[ignore = "needs a GPU: the device side of the proxy ring runs in a CUDA kernel"]
fn device_producers_through_the_proxy_ring() {
    if let Some(why) = gpu_unavailable_reason() {
        panic!("no usable CUDA device: {why}");
    }
    let ctx = PrimaryContext::retain(0).unwrap();
    let _current = ctx.enter().unwrap();
    let many = device_check::check_many_producers().unwrap_or_else(|e| panic!("{e}"));
    eprintln!("64 CTAs x 40 commands through a 16-slot ring: {} puts in {:?}", many.puts.len(), many.elapsed);
    let full = device_check::check_full_ring_times_out().unwrap_or_else(|e| panic!("{e}"));
    eprintln!("full ring without a proxy: status {:?} after {:?}", full.status, full.elapsed);
}
