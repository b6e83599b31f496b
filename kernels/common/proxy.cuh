// Device side of the proxy ring (host side and protocol: src/transport/proxy.rs).
//
// A communication CTA hands an inter-node put to its rank's proxy thread:
//   uint64_t ticket;
//   int rc = mk_proxy_put(ring, peer, src_offset, dst_offset, bytes, signal_id, epoch, &ticket);
//   ...                                       // later, before reusing the source bytes:
//   rc = mk_proxy_wait_complete(ring, ticket);
// Both return 0, or an mkResult_t code: 8 (mkTimeout) when the ring stayed full / the put
// did not complete within ring.timeout_ns, or the proxy's own failure (6 mkRemoteError,
// 2 mkSystemError, ...) as soon as the proxy reports one. The caller records the code in
// the communicator's error word and stops, like every other bounded wait in a kernel.
//
// Call them from ONE thread (a lane of the communication warp): the release store that
// publishes a command orders only that thread's earlier writes. Data written by other
// threads of the CTA must be made visible first (__syncthreads() + __threadfence_system()
// by the writers, or the data is already in the registered window from an earlier step).
// A producer that times out leaves its claimed slot unpublished: the ring is unusable
// afterwards, as the communicator is after any timeout.
#pragma once
#include <stddef.h>
#include <stdint.h>
#include "mk_kernel_abi.h"
#include "mkernel.h"

// The protocol relies on these (src/transport/proxy.rs asserts the same on the Rust side).
static_assert(sizeof(ProxyCommand) == 32, "a proxy command is 32 bytes");
static_assert(offsetof(ProxyCommand, header) == 0, "the header word comes first");
static_assert(offsetof(ProxyRingControl, tail) == 0 && offsetof(ProxyRingControl, completed) == 64 &&
                  offsetof(ProxyRingControl, error) == 128,
              "one cache line per control word");

// These functions return mkResult_t codes (mkernel.h): mkSuccess, mkTimeout, or the proxy's error.

__device__ __forceinline__ uint64_t mk_proxy_now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint64_t mk_proxy_load_acquire_u64(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint32_t mk_proxy_load_acquire_u32(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void mk_proxy_store_release_u32(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.u32 [%0], %1;" : : "l"(p), "r"(v) : "memory");
}

// How often a waiter reads the proxy's error word, and the longest pause between reads of
// the counter it waits for. Both live in host memory, so every read crosses PCIe: dozens
// of CTAs reading two words every microsecond slow everything else on the link (the
// staging copies of this very path; MkWaitChecks in signals.cuh gives the GEMM's case).
#define MK_PROXY_ERROR_CHECK_NS 1000000ull
#define MK_PROXY_MAX_BACKOFF_NS 4096u

// Spins until counter (tail or completed) exceeds `ticket` - `slack`, i.e. counter + slack > ticket.
// Returns 0, the proxy's error, or mkTimeout.
__device__ __forceinline__ int mk_proxy_wait_counter(const ProxyRingView& ring, const uint64_t* counter,
                                                     uint64_t ticket, uint64_t slack) {
  const ProxyRingControl* control = reinterpret_cast<const ProxyRingControl*>(ring.control);
  uint64_t start = 0, next_error_check = 0;
  uint32_t backoff = 32;
  while (mk_proxy_load_acquire_u64(counter) + slack <= ticket) {
    uint64_t now = mk_proxy_now_ns();
    if (now >= next_error_check) {
      // The first time round too: a proxy that failed may never move the counter.
      uint32_t proxy_error = mk_proxy_load_acquire_u32(&control->error);
      if (proxy_error != 0) return (int)proxy_error;
      next_error_check = now + MK_PROXY_ERROR_CHECK_NS;
    }
    if (start == 0) start = now;
    else if (now - start > ring.timeout_ns) return mkTimeout;
    __nanosleep(backoff);
    if (backoff < MK_PROXY_MAX_BACKOFF_NS) backoff *= 2;
  }
  return mkSuccess;
}

// Posts one command; *ticket_out gets its ticket (for mk_proxy_wait_complete).
__device__ __forceinline__ int mk_proxy_post(const ProxyRingView& ring, uint32_t kind, uint32_t peer,
                                             uint64_t src_offset, uint64_t dst_offset, uint32_t bytes,
                                             uint32_t signal_id, uint32_t signal_value, uint64_t* ticket_out) {
  // A failed proxy takes no more work: refuse before claiming a ticket.
  uint32_t proxy_error = mk_proxy_load_acquire_u32(&reinterpret_cast<const ProxyRingControl*>(ring.control)->error);
  if (proxy_error != 0) return (int)proxy_error;
  // The head lives in device memory (see ProxyRingView::head): a device-scope atomic
  // orders this GPU's producers, and no host thread ever adds to it.
  uint64_t ticket = atomicAdd(reinterpret_cast<unsigned long long*>(ring.head), 1ull);
  *ticket_out = ticket;
  ProxyRingControl* control = reinterpret_cast<ProxyRingControl*>(ring.control);
  // Back-pressure: the slot is free once the proxy has taken the command `capacity` tickets back.
  int rc = mk_proxy_wait_counter(ring, &control->tail, ticket, ring.capacity);
  if (rc != mkSuccess) return rc;
  ProxyCommand* slot = reinterpret_cast<ProxyCommand*>(ring.commands) + (ticket & (uint64_t)(ring.capacity - 1));
  volatile ProxyCommand* body = slot;
  body->bytes = bytes;
  body->src_offset = src_offset;
  body->dst_offset = dst_offset;
  body->signal_id = signal_id;
  body->signal_value = signal_value;
  // Publish last: the proxy reads the header with acquire, so it sees the body above.
  mk_proxy_store_release_u32(&slot->header, kind | (peer << MK_PROXY_PEER_SHIFT));
  return mkSuccess;
}

// A put of `bytes` from this rank's window at src_offset to `peer`'s window at dst_offset,
// then peer's signal word `signal_id` := signal_value (MK_PROXY_NO_SIGNAL: none), visible
// there only after the data.
__device__ __forceinline__ int mk_proxy_put(const ProxyRingView& ring, uint32_t peer, uint64_t src_offset,
                                            uint64_t dst_offset, uint32_t bytes, uint32_t signal_id,
                                            uint32_t signal_value, uint64_t* ticket_out) {
  return mk_proxy_post(ring, MK_PROXY_KIND_PUT, peer, src_offset, dst_offset, bytes, signal_id, signal_value,
                       ticket_out);
}

// Only the signal write (ordered after every earlier put to the same peer by the transport).
__device__ __forceinline__ int mk_proxy_signal(const ProxyRingView& ring, uint32_t peer, uint32_t signal_id,
                                               uint32_t signal_value, uint64_t* ticket_out) {
  return mk_proxy_post(ring, MK_PROXY_KIND_SIGNAL, peer, 0, 0, 0, signal_id, signal_value, ticket_out);
}

// Waits until the command `ticket` and every earlier one completed (their source bytes may
// be overwritten).
__device__ __forceinline__ int mk_proxy_wait_complete(const ProxyRingView& ring, uint64_t ticket) {
  const ProxyRingControl* control = reinterpret_cast<const ProxyRingControl*>(ring.control);
  return mk_proxy_wait_counter(ring, &control->completed, ticket, 0);
}
