// Fuzzes what reads token shards and their loss masks (data.train / data.val files, SHARD.mask):
// the header checks, the mapped reader, the loader with its loss masks and the vocabulary check,
// a resumed position, the shuffled sequence reader, and `loom data inspect`.
// Input: [flags] [shard length: u16 little endian] [position: 3 signed bytes] [shard] [mask]
//   flags bit 0: the rest after the shard is its loss mask; bit 1: the sequence reader shuffles;
//   bits 2-3: the sequence length - 1.
// Properties: a refusal is a loom::Error; an accepted shard gives the loader exactly its tokens
// (inputs the window, targets the window shifted by one, or kIgnoredTarget where the mask says 0).
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "data/inspect.h"
#include "data/loader.h"
#include "data/sequence_reader.h"
#include "data/shard.h"
#include "fuzz_common.h"
#include "kernels/targets.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace loom;
  if (size < 6) return 0;
  const bool masked = data[0] & 1;
  const bool shuffle = data[0] & 2;
  const int64_t seq_len = 1 + ((data[0] >> 2) & 3);
  const size_t shard_len = std::min<size_t>(data[1] | (data[2] << 8), size - 6);
  const LoaderState position{static_cast<int8_t>(data[3]), static_cast<int8_t>(data[4]),
                             static_cast<int8_t>(data[5])};
  const std::string_view bytes(reinterpret_cast<const char*>(data) + 6, size - 6);
  const std::string shard = (fuzz::scratch_dir() / "train_000000.bin").string();
  const std::string mask = loss_mask_path(shard);
  fuzz::write_file(shard, bytes.substr(0, shard_len));
  std::filesystem::remove(mask);
  if (masked) fuzz::write_file(mask, bytes.substr(shard_len));

  constexpr int64_t kVocab = 200;
  fuzz::accepts([&] { inspect_corpus(shard, seq_len, kVocab, /*eot=*/10); });
  std::vector<uint32_t> tokens;
  if (!fuzz::accepts([&] { tokens = read_shard32(shard); })) return 0;
  fuzz::require(static_cast<int64_t>(tokens.size()) == read_shard_header(shard).num_tokens,
                "read_shard32 reads the header's count");

  std::optional<DataLoader> loader;
  if (!fuzz::accepts([&] { loader.emplace(std::vector<std::string>{shard}, 1, seq_len); }))
    return 0;
  loader->set_vocab_size(kVocab);
  int64_t masks = 0;
  if (!fuzz::accepts([&] { masks = loader->use_loss_masks(); })) return 0;
  fuzz::require(masks == (masked ? 1 : 0), "a mask that was accepted is used");
  // The mask's entries are checked as they are read (a bad one refused then, naming it); the
  // windows' values are compared where every entry is good.
  std::vector<uint8_t> counts(tokens.size(), 1);
  const bool entries_good = !masked || fuzz::accepts([&] {
    LossMaskFile(mask).read(0, static_cast<int64_t>(tokens.size()), counts.data());
  });
  std::vector<int32_t> inputs(seq_len), targets(seq_len);
  for (int step = 0; step < 3; ++step) {
    const int64_t at = loader->state().offset;
    if (!fuzz::accepts([&] { loader->next_batch(inputs.data(), targets.data()); })) break;
    for (int64_t t = 0; entries_good && t < seq_len; ++t) {
      fuzz::require(inputs[t] == static_cast<int32_t>(tokens[at + t]), "inputs are the window");
      const int32_t want =
          counts[at + t + 1] ? static_cast<int32_t>(tokens[at + t + 1]) : kIgnoredTarget;
      fuzz::require(targets[t] == want, "targets are the next tokens, masked by the mask");
    }
  }
  if (fuzz::accepts([&] { loader->set_state(position); }))
    fuzz::accepts([&] { loader->next_batch(inputs.data(), targets.data()); });

  std::optional<SequenceReader> reader;
  if (!fuzz::accepts([&] {
        reader.emplace(std::vector<std::string>{shard}, seq_len,
                       shuffle ? std::optional<uint64_t>(7) : std::nullopt);
      }))
    return 0;
  reader->set_vocab_size(kVocab);
  if (masked) reader->use_loss_masks();
  if (fuzz::accepts([&] { reader->set_state(position); }))
    for (int i = 0; i < 3; ++i)
      if (!fuzz::accepts([&] { reader->next(inputs.data(), targets.data()); })) break;
  return 0;
}
