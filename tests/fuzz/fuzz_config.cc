// Fuzzes the config: TOML text (`loom train CONFIG.toml`), then --set assignments, then the
// parallel degrees resolved for a world size and validate(). Input: the TOML, then optionally a
// NUL byte and NUL-separated "section.key=value" assignments; the last byte picks the world size.
// Properties: every refusal is a loom::Error; an accepted config written by to_toml (a run
// directory's config.toml, which a resume reads back) parses again to the same text, and, when
// it validates, to the same config.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "config/config.h"
#include "fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace loom;
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  const int world = size == 0 ? 1 : 1 + data[size - 1] % 8;
  const size_t toml_end = std::min(input.find('\0'), input.size());
  const std::string_view toml = input.substr(0, toml_end);
  std::vector<std::string_view> overrides;
  for (size_t at = toml_end + 1; at < input.size();) {
    const size_t end = std::min(input.find('\0', at), input.size());
    overrides.push_back(input.substr(at, end - at));
    at = end + 1;
  }

  Config config;
  if (!fuzz::accepts([&] { config = parse_config(toml, "fuzz.toml"); })) return 0;
  for (const std::string_view assignment : overrides)
    if (!fuzz::accepts([&] { apply_override(config, assignment); })) return 0;

  const std::string written = to_toml(config);
  Config reread;
  fuzz::require(fuzz::accepts([&] { reread = parse_config(written, "config.toml"); }),
                "to_toml's text parses again");
  fuzz::require(to_toml(reread) == written, "to_toml(parse_config(to_toml(c))) == to_toml(c)");

  if (!fuzz::accepts([&] { resolve_parallel_degrees(config.parallel, world); })) return 0;
  if (!fuzz::accepts([&] { validate(config); })) return 0;
  resolve_parallel_degrees(reread.parallel, world);
  fuzz::require(reread == config, "a valid config reads back equal from its to_toml");
  return 0;
}
