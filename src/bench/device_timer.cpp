#include "bench/device_timer.h"

#include <chrono>
#include <vector>

#include "core/error.h"

#if SPINDLE_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace spindle::bench {
namespace {

class HostClockTimer final : public DeviceTimer {
 public:
  int mark(Stream) override {
    marks_.push_back(std::chrono::steady_clock::now());
    return static_cast<int>(marks_.size()) - 1;
  }
  double elapsed_ms(int from, int to) override {
    return std::chrono::duration<double, std::milli>(marks_.at(to) - marks_.at(from)).count();
  }
  void clear() override { marks_.clear(); }

 private:
  std::vector<std::chrono::steady_clock::time_point> marks_;
};

#if SPINDLE_WITH_CUDA
void check(cudaError_t e, const char* call) {
  if (e != cudaSuccess) fail("CUDA error {} ({}) in {}", cudaGetErrorName(e), cudaGetErrorString(e), call);
}

class CudaEventTimer final : public DeviceTimer {
 public:
  explicit CudaEventTimer(int device) : device_(device) {}
  ~CudaEventTimer() override {
    cudaSetDevice(device_);
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
  }
  int mark(Stream stream) override {
    if (used_ == events_.size()) {
      cudaEvent_t e;
      check(cudaEventCreate(&e), "cudaEventCreate");
      events_.push_back(e);
    }
    check(cudaEventRecord(events_[used_], static_cast<cudaStream_t>(stream.handle)), "cudaEventRecord");
    return static_cast<int>(used_++);
  }
  double elapsed_ms(int from, int to) override {
    float ms = 0;
    check(cudaEventElapsedTime(&ms, events_.at(from), events_.at(to)), "cudaEventElapsedTime");
    return ms;
  }
  void clear() override { used_ = 0; }

 private:
  int device_;
  std::vector<cudaEvent_t> events_;
  size_t used_ = 0;
};
#endif

}  // namespace

std::unique_ptr<DeviceTimer> make_device_timer(Backend& backend) {
  const Device device = backend.device();
  if (device.kind == DeviceKind::CPU) return std::make_unique<HostClockTimer>();
#if SPINDLE_WITH_CUDA
  if (device.kind == DeviceKind::CUDA) return std::make_unique<CudaEventTimer>(device.index);
#endif
  fail("no timer for backend '{}' in this build", backend.name());
}

DeviceInfo describe_device(Backend& backend) {
  DeviceInfo info;
  const Device device = backend.device();
  if (device.kind == DeviceKind::CPU) {
    info.name = "CPU";
    return info;
  }
#if SPINDLE_WITH_CUDA
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, device.index), "cudaGetDeviceProperties");
  info.name = prop.name;
  // Dense BF16 tensor-core peaks from NVIDIA's datasheets (SXM parts; no sparsity).
  const std::string n = info.name;
  if (n.find("H200") != std::string::npos || (n.find("H100") != std::string::npos && n.find("PCIe") == std::string::npos))
    info.bf16_dense_tflops = 989.4;
  else if (n.find("H100") != std::string::npos)
    info.bf16_dense_tflops = 756.0;
  else if (n.find("A100") != std::string::npos)
    info.bf16_dense_tflops = 312.0;
#endif
  return info;
}

}  // namespace spindle::bench
