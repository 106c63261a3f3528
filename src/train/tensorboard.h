// The --tensorboard log: every step's metrics as TensorBoard scalars, beside the JSONL log.
//
// An event file is a sequence of TFRecords, each framed as
//   uint64 length | uint32 masked CRC-32C of the length | payload | uint32 masked CRC-32C of the payload
// (little-endian), whose payloads are serialized Event messages (tensorboard_event.proto). The first
// record names the format version; after it come the run's (re)start marker and one record per step
// holding all of that step's scalars, so a reader sees a step whole or not at all.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "train/metrics.h"

namespace spindle::train {

// CRC-32C (Castagnoli), the checksum of TFRecords.
uint32_t crc32c(std::string_view bytes);
// The CRC as TFRecords store it: rotated and offset, because a CRC over data that itself holds
// CRCs is weak.
uint32_t masked_crc32c(std::string_view bytes);
// One TFRecord: the framing above around `payload`.
std::string tfrecord_frame(std::string_view payload);

struct TensorBoardScalar {
  std::string tag;
  double value = 0;  // stored as float32, TensorBoard's scalar type
};
// The record's values as TensorBoard tags: each metrics.jsonl key under "train/", except the
// eval ones, "eval_X" -> "eval/X" (so TensorBoard groups them in two sections, as transformers'
// TensorBoard callback does).
std::vector<TensorBoardScalar> tensorboard_scalars(const StepMetrics& metrics);

class TensorBoardLog {
 public:
  // A new event file in `dir` (created if missing) for a run that continues after `resumed_step`
  // (0: a new run). It starts with the restart marker at step resumed_step + 1, so TensorBoard
  // drops what earlier files in `dir` recorded from that step on: a killed run's steps after its
  // last checkpoint, or a finished run's that a new run in the same folder replaces.
  static TensorBoardLog start(const std::filesystem::path& dir, int64_t resumed_step);

  TensorBoardLog(TensorBoardLog&& other) noexcept;
  TensorBoardLog& operator=(TensorBoardLog&& other) noexcept;
  TensorBoardLog(const TensorBoardLog&) = delete;
  ~TensorBoardLog();

  // One record with every scalar of the step, handed to the OS before returning (a crash after
  // it keeps the step).
  void append(const StepMetrics& metrics);
  const std::filesystem::path& path() const { return path_; }

 private:
  TensorBoardLog(std::filesystem::path path, int fd) : path_(std::move(path)), fd_(fd) {}
  void write_event(std::string_view serialized_event);

  std::filesystem::path path_;
  int fd_ = -1;
};

}  // namespace spindle::train
