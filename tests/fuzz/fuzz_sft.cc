// Fuzzes `loom data prepare --sft --chat-template chatml`: the input is a JSONL file of
// prompt-completion examples and conversations.
// Properties: a refusal is a loom::Error (naming the file and line); an accepted file gives
// shards whose tokens are the counted bytes, each with a loss mask of its count that counts at
// least the completions' bytes, and `loom data inspect` reads them.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "data/dataset.h"
#include "data/inspect.h"
#include "data/shard.h"
#include "fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace loom;
  const auto input = fuzz::scratch_dir() / "examples.jsonl";
  fuzz::write_file(input, std::string_view(reinterpret_cast<const char*>(data), size));
  const std::string out = (fuzz::scratch_dir() / "sft").string();
  PrepareOptions options;
  options.val_fraction = 0.25;
  options.shard_tokens = 64;
  options.chat_template = "chatml";  // conversations too (TRL's "messages")
  PrepareResult result;
  if (!fuzz::accepts([&] { result = prepare_sft_dataset({input.string()}, out, options, 10); }))
    return 0;
  fuzz::require(!result.train_shards.empty(), "an accepted file trains on something");
  int64_t tokens = 0;
  for (const auto* split : {&result.train_shards, &result.val_shards}) {
    for (const std::string& shard : *split) {
      const int64_t n = read_shard_header(shard).num_tokens;
      tokens += n;
      fuzz::require(has_loss_mask(shard, n), "every shard has its loss mask");
      std::vector<uint8_t> counts(static_cast<size_t>(n));
      LossMaskFile(loss_mask_path(shard)).read(0, n, counts.data());
    }
  }
  fuzz::require(tokens == result.train_tokens + result.val_tokens, "the shards hold the tokens");
  const CorpusSummary summary = inspect_corpus(out + "/train_*.bin", 0, 256, 10);
  fuzz::require(summary.masked_shards() == static_cast<int64_t>(result.train_shards.size()),
                "inspect sees every mask");
  return 0;
}
