// What an exported HuggingFace directory holds, said before any value is read: each tensor by
// its name and where its values come from in a Loom checkpoint, and config.json. The export
// (checkpoint/export.cc) then reads the checkpoint one parameter at a time and writes each
// tensor as it comes, so a model of tens of GB is exported with one parameter in memory.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace loom {

struct HfTensor {
  // As it is; transposed (GPT-2's Conv1D weights are in × out); a Gemma gain (Gemma's RMSNorm
  // scales by 1 + w, Loom's by its gain: w = gain − 1).
  enum class Op { kCopy, kTranspose, kGain };
  std::string name;            // HuggingFace's
  std::string source;          // Loom's parameter
  int64_t row = 0, rows = -1;  // rows [row, row + rows) of it (a fused weight's piece); -1: all
  Op op = Op::kCopy;
};

struct HfFiles {
  std::vector<HfTensor> tensors;  // in the order they are written
  nlohmann::json config;          // config.json
};

}  // namespace loom
