// Marks points in a stream's work and reads the time between them: CUDA events on a CUDA backend
// (the marks cost a cudaEventRecord each, no synchronisation), the host clock on the CPU backend
// (whose ops run synchronously inside the call).
#pragma once

#include <memory>
#include <string>

#include "backend/backend.h"

namespace spindle::bench {

class DeviceTimer {
 public:
  virtual ~DeviceTimer() = default;
  // Records a point after all work queued on `stream` so far; returns its index (0, 1, ...).
  virtual int mark(Stream stream) = 0;
  // Milliseconds from mark `from` to mark `to`; the stream must have been synchronized past both.
  virtual double elapsed_ms(int from, int to) = 0;
  // Forgets all marks (their resources are reused by the next ones).
  virtual void clear() = 0;
};

std::unique_ptr<DeviceTimer> make_device_timer(Backend& backend);

}  // namespace spindle::bench

namespace spindle::bench {

struct DeviceInfo {
  std::string name;                // "NVIDIA H200", "CPU (16 threads)"
  double bf16_dense_tflops = 0;    // datasheet peak for MFU; 0 when unknown
};
DeviceInfo describe_device(Backend& backend);

}  // namespace spindle::bench
