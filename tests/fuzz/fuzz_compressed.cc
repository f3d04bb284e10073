// Fuzzes the readers of compressed corpora (`loom data prepare` on .gz and .zst files,
// data/input_file.h). The first byte picks the compression (even: gzip, odd: zstd) and the
// buffer size the file is read with (1..64 bytes, so every refill boundary is met); the rest is
// the file.
// Properties: a refusal is a loom::Error naming the file; a gzip file is refused or read alike
// whatever the buffer (1 MiB or the small one); an accepted file reads as the same bytes either
// way, and LineReader's lines joined by '\n' are those bytes (less a final '\n').
#include <cstddef>
#include <cstdint>
#include <string>

#include "data/input_file.h"
#include "fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace loom;
  if (size == 0) return 0;
  const uint8_t pick = data[0];
  const auto path = fuzz::scratch_dir() / ((pick & 1) != 0 ? "corpus.jsonl.zst" : "corpus.txt.gz");
  fuzz::write_file(path, std::string_view(reinterpret_cast<const char*>(data + 1), size - 1));
  const size_t small = 1 + (pick >> 2) % 64;
  std::string whole, pieces;
  const bool whole_read = fuzz::accepts([&] { whole = read_input_file(path.string()); });
  const bool pieces_read = fuzz::accepts([&] {
    InputFile file(path.string(), small);
    char block[64];
    while (const size_t n = file.read(block, 1 + (pick >> 1) % sizeof(block)))
      pieces.append(block, n);
  });
  // zlib decodes the same whatever the pieces. libzstd checks some damage only in a frame that
  // arrives whole (a frame of empty blocks: regress_zstd_verdict_by_buffer), so there a buffer
  // may refuse what another passes: what passes is still what the frame declares (InputFile
  // checks the content size) and the same bytes.
  if ((pick & 1) == 0)
    fuzz::require(whole_read == pieces_read, "gzip: the same verdict whatever the buffer");
  if (!whole_read || !pieces_read) return 0;
  fuzz::require(pieces == whole, "small buffers read the same bytes");
  std::string joined;
  const bool lines_read = fuzz::accepts([&] {
    LineReader lines(path.string(), small);
    std::string line;
    int64_t count = 0;
    while (lines.next(line)) {
      if (count++ > 0) joined += '\n';
      joined += line;
      fuzz::require(lines.line_number() == count, "lines are numbered from 1");
    }
  });
  fuzz::require(lines_read, "an accepted file's lines are read");
  const bool final_newline = !whole.empty() && whole.back() == '\n';
  fuzz::require(joined == (final_newline ? whole.substr(0, whole.size() - 1) : whole),
                "the lines joined are the content");
  return 0;
}
