// TensorBoard event files, written without TensorFlow (`metrics.tensorboard`): the step metrics
// as scalars under RUN_DIR/tensorboard/, for `tensorboard --logdir RUN_DIR/tensorboard`.
//
// The file is a sequence of TFRecords — u64 length, u32 masked CRC-32C of the length, the data,
// u32 masked CRC-32C of the data, all little-endian — each holding one Event protocol buffer,
// encoded here by hand: the first {wall_time, file_version: "brain.Event:2"}, then one per step
// {wall_time, step, summary: {value: [{tag, simple_value}, ...]}}. The tags are the record's
// field names (loss, lr, grad_norm, tokens_per_s, mfu, ...); a per-axis object gives one tag
// per axis ("comm_ms/dp"). TensorBoard groups tags by what precedes the first '/'.
#pragma once

#include <cstdint>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>

namespace loom {

// CRC-32C (Castagnoli), as TFRecord uses it; crc32c("123456789") = 0xE3069283.
uint32_t crc32c(const void* data, size_t bytes);

class TensorBoardWriter {
 public:
  // Creates `dir` and events.out.tfevents.<unix seconds>.<host>.<pid>.<n> in it (a new file per
  // writer, as TensorBoard expects; a resumed run adds one, and TensorBoard reads them all).
  explicit TensorBoardWriter(const std::string& dir);
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  // One event with every number of `record` as a scalar at `step`, flushed.
  void scalars(int64_t step, const nlohmann::json& record);
  const std::string& path() const { return path_; }

 private:
  void write_record(const std::string& data);
  std::string path_;
  std::FILE* file_ = nullptr;
};

}  // namespace loom
