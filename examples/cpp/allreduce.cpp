// Hello all-reduce in C++: one rank per GPU in one process (mkCommInitAll), two to eight
// (both on GPU 0 when there is one GPU), each rank's resources in RAII objects. Rank r holds
// (r+1)·(1 + i%5) at element i; after mkAllReduce(sum) every rank holds
// (n(n+1)/2)·(1 + i%5). Exit 0: correct; 77: no GPU.
#include <mkernel.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda_min.h"

namespace {

// A failed mkernel call: its result code and the library's message (which names the
// function and the rule it broke).
struct MkError : std::runtime_error {
  mkResult_t code;
  MkError(const std::string& what, mkResult_t r) : std::runtime_error(what), code(r) {}
};

void check(mkResult_t r, mkComm_t comm = nullptr) {
  if (r != mkSuccess) throw MkError(mkGetLastError(comm), r);
}

void check_cuda(int failed) {
  if (failed) throw std::runtime_error("a CUDA driver call failed (see above)");
}

// One rank: its device, an in-place buffer and a stream.
class Rank {
 public:
  Rank(int device, size_t count) : device_(device), bytes_(count * sizeof(float)) {
    check_cuda(cuda_min_set_device(device_));
    check_cuda(CU(cuda_min.cuMemAlloc(&buf_, bytes_)));
    check_cuda(CU(cuda_min.cuStreamCreate(&stream_, CU_STREAM_NON_BLOCKING)));
  }
  ~Rank() {
    cuda_min_set_device(device_);
    if (stream_) cuda_min.cuStreamDestroy(stream_);
    if (buf_) cuda_min.cuMemFree(buf_);
  }
  Rank(const Rank&) = delete;
  Rank& operator=(const Rank&) = delete;

  void upload(const std::vector<float>& host) {
    check_cuda(cuda_min_set_device(device_) || CU(cuda_min.cuMemcpyHtoD(buf_, host.data(), bytes_)));
  }
  std::vector<float> download() {
    std::vector<float> host(bytes_ / sizeof(float));
    check_cuda(cuda_min_set_device(device_) || CU(cuda_min.cuStreamSynchronize(stream_)) ||
               CU(cuda_min.cuMemcpyDtoH(host.data(), buf_, bytes_)));
    return host;
  }
  void* data() const { return reinterpret_cast<void*>(buf_); }
  CUstream stream() const { return stream_; }

 private:
  int device_;
  size_t bytes_;
  CUdeviceptr buf_ = 0;
  CUstream stream_ = nullptr;
};

// The communicators of mkCommInitAll, destroyed together.
class Comms {
 public:
  explicit Comms(const std::vector<int>& devices) : comms_(devices.size()) {
    check(mkCommInitAll(comms_.data(), static_cast<int>(devices.size()), devices.data()));
  }
  ~Comms() {
    for (mkComm_t c : comms_)
      if (c) mkCommDestroy(c);
  }
  Comms(const Comms&) = delete;
  Comms& operator=(const Comms&) = delete;
  mkComm_t operator[](size_t r) const { return comms_[r]; }

 private:
  std::vector<mkComm_t> comms_;
};

}  // namespace

int main() {
  const size_t count = size_t{1} << 20;
  const char* why = "";
  const int ngpus = cuda_min_gpu_count(&why);
  const int nranks = std::clamp(ngpus, 2, 8);
  std::vector<int> devices;
  for (int r = 0; r < nranks; r++) devices.push_back(ngpus > 1 ? r : 0);
  try {
    Comms comms(devices);
    std::vector<std::unique_ptr<Rank>> ranks;
    for (int r = 0; r < nranks; r++) {
      ranks.push_back(std::make_unique<Rank>(devices[r], count));
      std::vector<float> host(count);
      for (size_t i = 0; i < count; i++) host[i] = static_cast<float>((r + 1) * (1 + i % 5));
      ranks.back()->upload(host);
    }
    for (int r = 0; r < nranks; r++)  // every rank enqueues before any waits
      check(mkAllReduce(ranks[r]->data(), ranks[r]->data(), count, mkFloat32, mkSum, comms[r], ranks[r]->stream()), comms[r]);
    size_t wrong = 0;
    const int weight = nranks * (nranks + 1) / 2;
    for (int r = 0; r < nranks; r++) {
      std::vector<float> out = ranks[r]->download();
      mkResult_t async = mkSuccess;
      check(mkCommGetAsyncError(comms[r], &async), comms[r]);
      if (async != mkSuccess) throw MkError("rank " + std::to_string(r) + ": a kernel stopped: " + mkGetErrorString(async), async);
      for (size_t i = 0; i < count; i++) wrong += out[i] != static_cast<float>(weight * (1 + i % 5));
    }
    std::printf("allreduce_cpp: %s: %d ranks on %d GPU(s) summed %zu floats, %zu wrong\n", wrong ? "FAILED" : "OK", nranks,
                ngpus, count, wrong);
    return wrong ? 1 : 0;
  } catch (const MkError& e) {
    std::fprintf(stderr, "%s\n", e.what());
    if (ngpus == 0) std::printf("allreduce_cpp: SKIPPED (%s)\n", why);
    return ngpus == 0 ? EXIT_SKIPPED : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "allreduce_cpp: %s\n", e.what());
    return 1;
  }
}
