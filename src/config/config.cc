// Config parsing, --set overrides and TOML output, all driven by one key table (kKeys).
#include "config/config.h"

#include <toml++/toml.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>
#include <variant>
#include <vector>

#include "base/check.h"
#include "base/error.h"
#include "base/utf8.h"
#include "config/format.h"

namespace loom {
namespace {

// ---- the key table ------------------------------------------------------------------------------

// Where a key's value lives in a Config; the alternative says the key's type.
using FieldRef = std::variant<int*, int64_t*, double*, std::string*, bool*>;

struct Key {
  std::string_view name;  // "section.key"
  FieldRef (*field)(Config& config);
};

// One line per key: the dotted name is spelled from the member, so the two cannot drift apart.
// clang-format off
#define LOOM_KEY(section, member) \
  Key{#section "." #member, [](Config& c) -> FieldRef { return &c.section.member; }}
// clang-format on

constexpr Key kKeys[] = {
    LOOM_KEY(model, arch),
    LOOM_KEY(model, vocab_size),
    LOOM_KEY(model, seq_len),
    LOOM_KEY(model, d_model),
    LOOM_KEY(model, n_layers),
    LOOM_KEY(model, n_heads),
    LOOM_KEY(model, max_seq_len),
    LOOM_KEY(model, init_std),
    LOOM_KEY(model, tie_embeddings),
    LOOM_KEY(model, n_kv_heads),
    LOOM_KEY(model, qkv_bias),
    LOOM_KEY(model, head_dim),
    LOOM_KEY(model, qk_norm),
    LOOM_KEY(model, qk_norm_scope),
    LOOM_KEY(model, query_pre_attn_scalar),
    LOOM_KEY(model, norm_placement),
    LOOM_KEY(model, ffn_activation),
    LOOM_KEY(model, embedding_multiplier),
    LOOM_KEY(model, rope_local_theta),
    LOOM_KEY(model, sliding_window),
    LOOM_KEY(model, full_attention_every),
    LOOM_KEY(model, ffn_hidden),
    LOOM_KEY(model, rope_theta),
    LOOM_KEY(model, rope_scaling),
    LOOM_KEY(model, rope_scaling_factor),
    LOOM_KEY(model, rope_low_freq_factor),
    LOOM_KEY(model, rope_high_freq_factor),
    LOOM_KEY(model, rope_original_max_seq_len),
    LOOM_KEY(model, norm_eps),
    LOOM_KEY(model, moe_experts),
    LOOM_KEY(model, moe_top_k),
    LOOM_KEY(model, moe_aux_loss_coef),
    LOOM_KEY(model, moe_router_z_loss_coef),
    LOOM_KEY(model, moe_shared_experts),
    LOOM_KEY(model, moe_bias_update_rate),
    LOOM_KEY(model, moe_capacity_factor),
    LOOM_KEY(model, moe_token_drop_policy),
    LOOM_KEY(model, moe_router_score_function),
    LOOM_KEY(model, moe_router_num_groups),
    LOOM_KEY(model, moe_router_group_topk),
    LOOM_KEY(model, moe_router_topk_scaling_factor),
    LOOM_KEY(model, moe_router_norm_topk_prob),
    LOOM_KEY(data, train),
    LOOM_KEY(data, val),
    LOOM_KEY(data, blend),
    LOOM_KEY(data, shuffle),
    LOOM_KEY(data, val_sets),
    LOOM_KEY(data, document_mask),
    LOOM_KEY(data, eot_token),
    LOOM_KEY(data, eod_mask_loss),
    LOOM_KEY(data, reset_position_ids),
    LOOM_KEY(data, loss_mask),
    LOOM_KEY(data, seed),
    LOOM_KEY(train, steps),
    LOOM_KEY(train, batch_size),
    LOOM_KEY(train, micro_batch_size),
    LOOM_KEY(train, batch_rampup),
    LOOM_KEY(train, lr),
    LOOM_KEY(train, warmup_steps),
    LOOM_KEY(train, lr_schedule),
    LOOM_KEY(train, min_lr_ratio),
    LOOM_KEY(train, lr_decay_fraction),
    LOOM_KEY(train, init_from),
    LOOM_KEY(train, weight_decay),
    LOOM_KEY(train, beta1),
    LOOM_KEY(train, beta2),
    LOOM_KEY(train, eps),
    LOOM_KEY(train, grad_clip),
    LOOM_KEY(train, z_loss),
    LOOM_KEY(train, loss_scale),
    LOOM_KEY(train, loss_scale_init),
    LOOM_KEY(train, loss_scale_window),
    LOOM_KEY(train, loss_scale_min),
    LOOM_KEY(train, seed),
    LOOM_KEY(train, eval_every),
    LOOM_KEY(train, eval_batches),
    LOOM_KEY(train, save_every),
    LOOM_KEY(train, keep_checkpoints),
    LOOM_KEY(train, async_checkpoint),
    LOOM_KEY(train, checkpoint_format),
    LOOM_KEY(train, log_every),
    LOOM_KEY(train, recompute),
    LOOM_KEY(parallel, dp),
    LOOM_KEY(parallel, tp),
    LOOM_KEY(parallel, pp),
    LOOM_KEY(parallel, cp),
    LOOM_KEY(parallel, cp_comm),
    LOOM_KEY(parallel, ep),
    LOOM_KEY(parallel, ep_dispatch),
    LOOM_KEY(parallel, zero),
    LOOM_KEY(parallel, dp_shard),
    LOOM_KEY(parallel, bucket_mb),
    LOOM_KEY(parallel, grad_reduce_dtype),
    LOOM_KEY(parallel, param_gather_dtype),
    LOOM_KEY(parallel, pp_send_dtype),
    LOOM_KEY(parallel, schedule),
    LOOM_KEY(parallel, virtual_stages),
    LOOM_KEY(parallel, layer_split),
    LOOM_KEY(parallel, sequence_parallel),
    LOOM_KEY(parallel, tp_backward_overlap),
    LOOM_KEY(parallel, recompute),
    LOOM_KEY(runtime, ranks),
    LOOM_KEY(runtime, backend),
    LOOM_KEY(runtime, device),
    LOOM_KEY(runtime, matmul_precision),
    LOOM_KEY(runtime, fp8_block),
    LOOM_KEY(runtime, threads_per_rank),
    LOOM_KEY(metrics, tensorboard),
    LOOM_KEY(metrics, prometheus_textfile),
    LOOM_KEY(metrics, prometheus_port),
    LOOM_KEY(metrics, peak_tflops),
    LOOM_KEY(metrics, trace_from_step),
    LOOM_KEY(metrics, trace_steps),
};

#undef LOOM_KEY

template <typename... Fs>
struct Overloaded : Fs... {
  using Fs::operator()...;
};
// Clang < 17 has no aggregate deduction (the sanitizer CI builds use Clang 14).
template <typename... Fs>
Overloaded(Fs...) -> Overloaded<Fs...>;

std::string_view section_of(std::string_view name) {
  return name.substr(0, name.find('.'));
}
std::string_view leaf_of(std::string_view name) {
  const size_t dot = name.rfind('.');
  return dot == std::string_view::npos ? name : name.substr(dot + 1);
}

// Section names in table order, each once.
const std::vector<std::string_view>& sections() {
  static const std::vector<std::string_view> list = [] {
    std::vector<std::string_view> out;
    for (const Key& k : kKeys)
      if (std::find(out.begin(), out.end(), section_of(k.name)) == out.end())
        out.push_back(section_of(k.name));
    return out;
  }();
  return list;
}

const Key* find_key(std::string_view name) {
  for (const Key& k : kKeys)
    if (k.name == name) return &k;
  return nullptr;
}

// ---- "did you mean" -----------------------------------------------------------------------------

// Optimal-string-alignment distance: Levenshtein plus adjacent transpositions ("lr" / "rl").
size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::vector<size_t>> d(a.size() + 1, std::vector<size_t>(b.size() + 1));
  for (size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (size_t i = 1; i <= a.size(); ++i)
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1])
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  return d[a.size()][b.size()];
}

// Short names tolerate fewer edits, or "tp" would suggest "pp".
size_t max_typo(std::string_view leaf) {
  return leaf.size() <= 4 ? 1 : 2;
}

// A hint for an unknown dotted key (or a key outside any section): the closest known key within
// two edits, else a key with the same name in another section ("train.dp" -> "parallel.dp").
std::string key_hint(std::string_view name) {
  const Key* best = nullptr;
  size_t best_distance = max_typo(leaf_of(name)) + 1;
  for (const Key& k : kKeys) {
    const size_t dist = name.find('.') == std::string_view::npos
                            ? edit_distance(name, leaf_of(k.name))
                            : edit_distance(name, k.name);
    if (dist < best_distance) best = &k, best_distance = dist;
  }
  if (!best)
    for (const Key& k : kKeys)
      if (leaf_of(k.name) == leaf_of(name)) best = &k;
  return best ? detail::concat(" (did you mean '", best->name, "'?)") : "";
}

std::string section_hint(std::string_view name) {
  for (std::string_view s : sections())
    if (edit_distance(name, s) <= max_typo(name))
      return detail::concat(" (did you mean [", s, "]?)");
  return "";
}

std::string section_list() {
  std::string out;
  for (size_t i = 0; i < sections().size(); ++i)
    out += detail::concat(i == 0                       ? ""
                          : i + 1 == sections().size() ? " or "
                                                       : ", ",
                          "[", sections()[i], "]");
  return out;
}

// ---- reading values -----------------------------------------------------------------------------

std::string_view expected_type(const FieldRef& field) {
  return std::visit(
      Overloaded{[](int*) { return "an integer"; }, [](int64_t*) { return "an integer"; },
                 [](double*) { return "a float"; }, [](std::string*) { return "a string"; },
                 [](bool*) { return "a boolean (true or false)"; }},
      field);
}

// What the user gave, for "expects X, got Y" messages.
std::string describe(const toml::node& node) {
  switch (node.type()) {
    case toml::node_type::string:
      return "string " + toml_quote(*node.value<std::string>());
    case toml::node_type::integer:
      return detail::concat("integer ", *node.value<int64_t>());
    case toml::node_type::floating_point:
      return "float " + format_double(*node.value<double>());
    case toml::node_type::boolean:
      return *node.value<bool>() ? "boolean true" : "boolean false";
    case toml::node_type::array:
      return "an array";
    case toml::node_type::table:
      return "a table";
    default:
      return "a date/time";
  }
}

[[noreturn]] void wrong_type(const std::string& where, const Key& key, const FieldRef& field,
                             const toml::node& node) {
  fail(where, ": key '", key.name, "' expects ", expected_type(field), ", got ", describe(node));
}

// Stores `node` into the key's field, checking its type. `where` starts messages: "file.toml:12"
// or "--set 'train.steps=abc'".
void assign(const Key& key, Config& config, const toml::node& node, const std::string& where) {
  const FieldRef field = key.field(config);
  if (double* const* d = std::get_if<double*>(&field)) {
    // An integer is a fine float ("lr = 1"); a float is never an integer.
    if (const auto v = node.value_exact<double>()) {
      **d = *v;
    } else if (const auto i = node.value_exact<int64_t>()) {
      **d = static_cast<double>(*i);
    } else {
      wrong_type(where, key, field, node);
    }
  } else if (int64_t* const* i64 = std::get_if<int64_t*>(&field)) {
    const auto v = node.value_exact<int64_t>();
    if (!v) wrong_type(where, key, field, node);
    **i64 = *v;
  } else if (int* const* i32 = std::get_if<int*>(&field)) {
    const auto v = node.value_exact<int64_t>();
    if (!v) wrong_type(where, key, field, node);
    if (*v < INT_MIN || *v > INT_MAX)
      fail(where, ": key '", key.name, "' = ", *v, " is out of range for an int");
    **i32 = static_cast<int>(*v);
  } else if (std::string* const* str = std::get_if<std::string*>(&field)) {
    const auto v = node.value_exact<std::string>();
    if (!v) wrong_type(where, key, field, node);
    **str = *v;
  } else {
    const auto v = node.value_exact<bool>();
    if (!v) wrong_type(where, key, field, node);
    *std::get<bool*>(field) = *v;
  }
}

std::string at(const std::string& source_name, const toml::node& node) {
  const auto line = node.source().begin.line;
  return line > 0 ? detail::concat(source_name, ":", line) : source_name;
}

toml::table parse_toml(std::string_view text, const std::string& source_name) {
  try {
    return toml::parse(text, source_name);
  } catch (const toml::parse_error& e) {
    fail(source_name, ":", e.source().begin.line, ":", e.source().begin.column,
         ": TOML syntax error: ", e.description());
  }
}

std::string_view trim(std::string_view s) {
  const size_t b = s.find_first_not_of(" \t");
  if (b == std::string_view::npos) return {};
  return s.substr(b, s.find_last_not_of(" \t") - b + 1);
}

}  // namespace

// ---- public API ---------------------------------------------------------------------------------

int RuntimeConfig::resolved_threads_per_rank() const {
  if (threads_per_rank > 0) return threads_per_rank;
  const int cores = static_cast<int>(std::thread::hardware_concurrency());  // 0 if unknown
  return std::max(1, cores / std::max(1, ranks));
}

void resolve_parallel_degrees(ParallelConfig& par, int world) {
  if (world < 1) fail("the job has ", world, " ranks");
  struct Degree {
    const char* key;
    int* value;
  };
  const Degree degrees[] = {{"parallel.dp", &par.dp}, {"parallel.tp", &par.tp}, {"parallel.pp", &par.pp}};
  // parallel.cp is never inferred: splitting sequences is asked for, not a way to fill ranks.
  if (par.cp < 1) fail("parallel.cp = ", par.cp, " must be at least 1");
  int64_t given = par.cp;
  std::string given_keys = par.cp > 1 ? "parallel.cp" : "";
  std::string given_values = par.cp > 1 ? std::to_string(par.cp) : "";
  std::vector<Degree> missing;
  for (const Degree& d : degrees) {
    if (*d.value < 0) fail(d.key, " = ", *d.value, " must be positive (or 0: inferred)");
    if (*d.value == 0) {
      missing.push_back(d);
      continue;
    }
    given *= *d.value;
    given_keys += std::string(given_keys.empty() ? "" : " × ") + d.key;
    given_values += (given_values.empty() ? "" : " × ") + std::to_string(*d.value);
  }
  // "parallel.dp = 2", or "parallel.dp × parallel.tp = 2 × 3 = 6" for a product.
  std::string stated =
      given_keys.empty() ? std::string("1 (no degree set)") : given_keys + " = " + given_values;
  if (given_values.find(" × ") != std::string::npos) stated += " = " + std::to_string(given);
  if (missing.empty()) {
    if (given != world) fail(stated, " does not equal the ", world, " ranks of the job");
    return;
  }
  if (world % given != 0)
    fail(stated, " does not divide the ", world, " ranks of the job, so ", missing.front().key,
         " cannot be inferred");
  // Who takes the rest: dp when left out, else the one left-out degree.
  const bool dp_missing = par.dp == 0;
  for (const Degree& d : missing)
    *d.value = (dp_missing ? d.value == &par.dp : missing.size() == 1)
                   ? static_cast<int>(world / given) : 1;
  const int64_t total = int64_t{par.dp} * par.tp * par.pp * par.cp;
  if (total != world)
    fail(stated, " with parallel.tp and parallel.pp left out: ", total, " ranks, the job has ",
         world, "; set parallel.tp or parallel.pp");
}

int64_t Config::grad_accum_steps() const {
  LOOM_CHECK(train.micro_batch_size > 0 && parallel.dp > 0);
  return train.batch_size / (train.micro_batch_size * parallel.dp);
}

std::string Config::resolved_recompute() const {
  return train.recompute && parallel.recompute == "none" ? "full" : parallel.recompute;
}

Config parse_config(std::string_view toml_text, const std::string& source_name) {
  const toml::table root = parse_toml(toml_text, source_name);
  Config config;
  for (const auto& [section_key, section_node] : root) {
    const std::string section(section_key.str());
    const bool known = std::find(sections().begin(), sections().end(), section) != sections().end();
    if (!section_node.is_table()) {
      if (known)
        fail(at(source_name, section_node), ": '", section, "' must be a section [", section,
             "], got ", describe(section_node));
      fail(at(source_name, section_node), ": key '", section,
           "' is outside any section; keys go under ", section_list(), key_hint(section));
    }
    if (!known)
      fail(at(source_name, section_node), ": unknown section [", section, "]",
           section_hint(section));
    for (const auto& [key, node] : *section_node.as_table()) {
      const std::string name = section + "." + std::string(key.str());
      const Key* spec = find_key(name);
      if (!spec) fail(at(source_name, node), ": unknown key '", name, "'", key_hint(name));
      assign(*spec, config, node, at(source_name, node));
    }
  }
  return config;
}

Config load_config(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) fail("config file '", path, "' does not exist");
  if (std::filesystem::is_directory(path, ec))
    fail("config file '", path, "' is a directory, not a TOML file");
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("cannot open config file '", path, "': ", std::strerror(errno));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) fail("cannot read config file '", path, "': ", std::strerror(errno));
  return parse_config(text.str(), path);
}

void apply_override(Config& config, std::string_view assignment) {
  const std::string where = detail::concat("--set '", assignment, "'");
  const size_t eq = assignment.find('=');
  if (eq == std::string_view::npos)
    fail(where, ": expected section.key=value (e.g. train.lr=3e-4)");
  const std::string name(trim(assignment.substr(0, eq)));
  const std::string_view text = trim(assignment.substr(eq + 1));
  const Key* spec = find_key(name);
  if (!spec) {
    if (name.find('.') == std::string::npos)
      fail(where, ": '", name, "' is not section.key", key_hint(name));
    const std::string section(section_of(name));
    if (std::find(sections().begin(), sections().end(), section) == sections().end())
      fail(where, ": unknown section [", section, "]", section_hint(section));
    fail(where, ": unknown key '", name, "'", key_hint(name));
  }
  // A bare string needs no quotes; everything else is read as a TOML value. A TOML string is
  // UTF-8: anything else would be written to the run's config.toml and refused when a resume
  // reads it back.
  if (std::holds_alternative<std::string*>(spec->field(config)) && !text.starts_with('"') &&
      !text.starts_with('\'')) {
    if (const size_t bad = invalid_utf8_at(text); bad != std::string_view::npos)
      fail(where, ": the value is not UTF-8 (byte ", bad, " of it)");
    *std::get<std::string*>(spec->field(config)) = std::string(text);
    return;
  }
  toml::table parsed;
  try {
    parsed = toml::parse(detail::concat("value = ", text));
  } catch (const toml::parse_error&) {
  }
  const toml::node* node = parsed.get("value");
  if (parsed.size() != 1 || !node)
    fail(where, ": key '", name, "' expects ", expected_type(spec->field(config)), ", got '", text,
         "'");
  assign(*spec, config, *node, where);
}

std::string to_toml(const Config& config) {
  Config copy = config;  // the table hands out mutable field pointers
  std::ostringstream os;
  os << "# Loom training config: every key, as resolved for this run.\n";
  std::string_view section;
  for (const Key& k : kKeys) {
    if (section_of(k.name) != section) {
      section = section_of(k.name);
      os << (os.tellp() > 0 ? "\n" : "") << '[' << section << "]\n";
    }
    os << leaf_of(k.name) << " = ";
    std::visit(Overloaded{[&](int* f) { os << *f; }, [&](int64_t* f) { os << *f; },
                          [&](double* f) { os << format_double(*f); },
                          [&](std::string* f) { os << toml_quote(*f); },
                          [&](bool* f) { os << (*f ? "true" : "false"); }},
               k.field(copy));
    os << '\n';
  }
  return os.str();
}

}  // namespace loom
