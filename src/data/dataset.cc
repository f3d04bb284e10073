#include "data/dataset.h"

#include <glob.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <system_error>
#include <thread>

#include "base/check.h"
#include "base/error.h"
#include "base/thread_pool.h"
#include "data/bpe_tokenizer.h"
#include "data/input_file.h"
#include "data/parquet_file.h"
#include "data/shard.h"
#include "data/tokenizer.h"
#include "tensor/rng.h"

namespace loom {
namespace fs = std::filesystem;
namespace {

bool is_regular_file(const std::string& path) {
  std::error_code ec;
  return fs::is_regular_file(path, ec);
}

// The entries of directory `dir`, in directory order; `context` starts the error message.
std::vector<fs::path> list_dir(const std::string& dir, const std::string& context) {
  std::vector<fs::path> entries;
  std::error_code ec;
  fs::directory_iterator it(dir, ec), end;
  for (; !ec && it != end; it.increment(ec)) entries.push_back(it->path());
  if (ec) fail(context, ": cannot list the directory: ", ec.message());
  return entries;
}

// Parses "train_000123.bin" for split "train"; -1 if the name is not of that form.
int64_t shard_index_of(const std::string& name, std::string_view split) {
  const std::string prefix = std::string(split) + "_";
  if (name.size() != prefix.size() + 6 + 4 || name.compare(0, prefix.size(), prefix) != 0 ||
      name.compare(name.size() - 4, 4, ".bin") != 0)
    return -1;
  int64_t index = 0;
  for (size_t i = prefix.size(); i < prefix.size() + 6; ++i) {
    if (name[i] < '0' || name[i] > '9') return -1;
    index = index * 10 + (name[i] - '0');
  }
  return index;
}

// Accumulates the tokens of one split and writes them as out_dir/<split>_NNNNNN.bin shards of
// shard_tokens tokens each: uint16 ones, or with `wide` uint32 ones (vocabularies past 65536).
class ShardWriter {
 public:
  // Shards of shard_tokens tokens, the last shorter, each streamed to its file as tokens come
  // (StreamedShardFile: 64 Ki tokens buffered, not the shard).
  ShardWriter(std::string out_dir, std::string split, int64_t shard_tokens, bool wide = false)
      : out_dir_(std::move(out_dir)),
        split_(std::move(split)),
        shard_tokens_(shard_tokens),
        wide_(wide) {}

  void push(uint32_t token) {
    LOOM_CHECK(wide_ || token <= 0xffff);
    if (!shard_) open();
    wide_ ? buffer32_.push_back(token) : buffer_.push_back(static_cast<uint16_t>(token));
    ++tokens_;
    if (++in_shard_ == shard_tokens_) {
      flush_buffers();
      close();
    } else if (buffer_.size() + buffer32_.size() == kBufferTokens) {
      flush_buffers();
    }
  }
  // The same with the token's loss-mask entry (1: it counts as a target): every shard of this
  // writer then gets its mask (data/shard.h).
  void push(uint32_t token, bool counts) {
    masks_ = true;
    if (!shard_) open();
    LOOM_CHECK(mask_ != nullptr);  // a writer's tokens all have entries, or none
    mask_buffer_.push_back(counts ? 1 : 0);
    push(token);
  }

  // Writes the last (short) shard and deletes stale shards of this split left by earlier runs.
  std::vector<std::string> finish() {
    if (shard_) {
      flush_buffers();
      close();
    }
    for (const fs::path& entry : list_dir(out_dir_, "dataset '" + out_dir_ + "'")) {
      const int64_t index = shard_index_of(entry.filename().string(), split_);
      if (index < static_cast<int64_t>(paths_.size())) continue;  // -1: not a shard of split_
      std::error_code ec;
      fs::remove(entry, ec);
      if (ec)
        fail("dataset '", out_dir_, "': cannot remove stale shard '", entry.string(),
             "': ", ec.message());
      fs::remove(loss_mask_path(entry.string()), ec);  // its mask, if it had one
    }
    return paths_;
  }

  int64_t tokens() const { return tokens_; }

 private:
  static constexpr size_t kBufferTokens = size_t{1} << 16;

  void open() {
    path_ = (fs::path(out_dir_) / shard_file_name(split_, static_cast<int64_t>(paths_.size())))
                .string();
    shard_ = std::make_unique<StreamedShardFile>(
        path_, wide_ ? StreamedShardFile::Kind::tokens32 : StreamedShardFile::Kind::tokens16);
    if (masks_)
      mask_ = std::make_unique<StreamedShardFile>(loss_mask_path(path_),
                                                  StreamedShardFile::Kind::loss_mask);
    in_shard_ = 0;
  }
  void flush_buffers() {
    if (wide_) {
      shard_->append(buffer32_.data(), static_cast<int64_t>(buffer32_.size()));
    } else {
      shard_->append(buffer_.data(), static_cast<int64_t>(buffer_.size()));
    }
    if (mask_) mask_->append(mask_buffer_.data(), static_cast<int64_t>(mask_buffer_.size()));
    buffer_.clear();
    buffer32_.clear();
    mask_buffer_.clear();
  }
  // The shard into place (which removes a mask of its old tokens), then its mask.
  void close() {
    shard_->finish();
    if (mask_) mask_->finish();
    shard_.reset();
    mask_.reset();
    paths_.push_back(path_);
  }

  std::string out_dir_, split_;
  int64_t shard_tokens_;
  bool wide_;
  std::unique_ptr<StreamedShardFile> shard_, mask_;  // the shard being written, and its mask
  std::string path_;
  int64_t in_shard_ = 0;
  std::vector<uint16_t> buffer_;
  std::vector<uint32_t> buffer32_;
  bool masks_ = false;
  std::vector<uint8_t> mask_buffer_;
  std::vector<std::string> paths_;
  int64_t tokens_ = 0;
};

// Both splits' last shards written: what was written where.
PrepareResult finish_splits(ShardWriter& train, ShardWriter& val) {
  PrepareResult result;
  result.train_shards = train.finish();
  result.val_shards = val.finish();
  result.train_tokens = train.tokens();
  result.val_tokens = val.tokens();
  return result;
}

void create_out_dir(const std::string& out_dir) {
  if (out_dir.empty()) fail("dataset output directory is empty");
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  if (ec) fail("dataset '", out_dir, "': cannot create the directory: ", ec.message());
  if (!fs::is_directory(out_dir, ec)) fail("dataset '", out_dir, "': not a directory");
}

// How many of n tokens (or examples) the split rule holds out for validation: the last
// round(n × val_fraction), at least one when val_fraction > 0; at least one must be left.
int64_t held_out(int64_t n, double val_fraction, const char* what, const char* unit) {
  int64_t n_val = 0;
  if (val_fraction > 0)
    n_val = std::max<int64_t>(1, std::llround(static_cast<double>(n) * val_fraction));
  if (n - n_val < 1)
    fail(what, ": ", n, " ", unit, " with val_fraction = ", val_fraction,
         " leave nothing for training");
  return n_val;
}

// The checks every prepare_* function makes first: a val_fraction in [0, 1), a shard size the
// header can count, some input files; `what` starts each error.
void check_prepare(const std::vector<std::string>& inputs, const PrepareOptions& options,
                   const char* what) {
  if (!(options.val_fraction >= 0.0 && options.val_fraction < 1.0))
    fail(what, ": val_fraction = ", options.val_fraction, ": must be in [0, 1)");
  if (options.shard_tokens < 1 || options.shard_tokens > std::numeric_limits<int32_t>::max())
    fail("dataset shard_tokens = ", options.shard_tokens, ": must be in [1, ",
         std::numeric_limits<int32_t>::max(), "] (the shard header counts tokens in an int32)");
  if (inputs.empty()) fail(what, ": no input files");
  if (options.threads < 0)
    fail(what, ": threads = ", options.threads, ": must be >= 0 (0: a core each)");
  if (options.batch_bytes < 1)
    fail(what, ": batch_bytes = ", options.batch_bytes, ": must be >= 1");
}

// Appends one "a+b=c\n" problem drawn from `rng` to `out`.
void append_addition(RandomStream& rng, std::string& out) {
  auto operand = [&rng]() -> uint32_t {
    static constexpr uint32_t kLow[3] = {0, 10, 100}, kHigh[3] = {10, 100, 1000};
    const uint32_t digits = rng.next_u32() % 3;
    return kLow[digits] + rng.next_u32() % (kHigh[digits] - kLow[digits]);
  };
  const uint32_t a = operand(), b = operand();
  out += std::to_string(a);
  out += '+';
  out += std::to_string(b);
  out += '=';
  out += std::to_string(a + b);
  out += '\n';
}

// Writes `n_tokens` bytes of addition problems from `rng` into `writer`, starting on a line.
void write_additions(RandomStream& rng, int64_t n_tokens, ShardWriter& writer) {
  std::string line;
  int64_t written = 0;
  while (written < n_tokens) {
    line.clear();
    append_addition(rng, line);
    for (char c : line) {
      if (written == n_tokens) break;
      writer.push(static_cast<unsigned char>(c));
      ++written;
    }
  }
}

}  // namespace

std::string shard_file_name(std::string_view split, int64_t index) {
  LOOM_CHECK(index >= 0);
  char digits[32];
  std::snprintf(digits, sizeof(digits), "%06lld", static_cast<long long>(index));
  return std::string(split) + "_" + digits + ".bin";
}

std::vector<std::string> resolve_shards(const std::string& spec, const std::string& what_key) {
  if (spec.empty()) fail(what_key, " is empty: give a shard file, a directory or a glob pattern");
  std::vector<std::string> paths;
  std::error_code ec;
  if (spec.find_first_of("*?[") != std::string::npos) {
    glob_t g{};
    const int rc = glob(spec.c_str(), 0, nullptr, &g);
    if (rc == 0) {
      for (size_t i = 0; i < g.gl_pathc; ++i)
        if (is_regular_file(g.gl_pathv[i])) paths.emplace_back(g.gl_pathv[i]);
    }
    globfree(&g);
    if (rc != 0 && rc != GLOB_NOMATCH)
      fail(what_key, " = '", spec, "': glob failed (", rc == GLOB_ABORTED ? "read error" : "error",
           ")");
    if (paths.empty()) fail(what_key, " = '", spec, "': the pattern matches no files");
  } else if (fs::is_directory(spec, ec)) {
    for (const fs::path& entry : list_dir(spec, what_key + " = '" + spec + "'"))
      if (entry.extension() == ".bin" && is_regular_file(entry.string()))
        paths.push_back(entry.string());
    if (paths.empty()) fail(what_key, " = '", spec, "': the directory contains no *.bin files");
  } else if (is_regular_file(spec)) {
    paths.push_back(spec);
  } else {
    fail(what_key, " = '", spec, "': no such file or directory");
  }
  std::sort(paths.begin(), paths.end());
  return paths;
}

PrepareResult prepare_dataset(const std::vector<std::string>& inputs, const std::string& out_dir,
                              const PrepareOptions& options) {
  check_prepare(inputs, options, "prepare_dataset");

  // 1. Sizes first: with the byte tokenizer a file of B bytes is B tokens, so the split point is
  //    known before reading anything and the files can stream through (a compressed file's
  //    size is counted by decompressing it).
  int64_t n = 0;
  std::vector<char> block(1 << 20);
  for (const std::string& input : inputs) {
    std::error_code ec;
    if (!fs::is_regular_file(input, ec))
      fail("prepare_dataset: input file '", input, "': not found");
    if (is_json_lines(input) || is_parquet(input))
      fail("prepare_dataset: input file '", input,
           "': ", is_parquet(input) ? "Parquet" : "JSON Lines",
           " documents need --tokenizer (the byte ",
           "vocabulary has no end-of-text token to end each one)");
    if (compression_of(input) == Compression::none) {
      n += static_cast<int64_t>(fs::file_size(input, ec));
      if (ec) fail("prepare_dataset: input file '", input, "': ", ec.message());
      continue;
    }
    InputFile file(input);
    while (const size_t got = file.read(block.data(), block.size())) n += static_cast<int64_t>(got);
  }
  if (n == 0) fail("prepare_dataset: the input files are all empty (first: '", inputs[0], "')");
  const int64_t n_val = held_out(n, options.val_fraction, "prepare_dataset", "tokens");
  const int64_t n_train = n - n_val;

  // 2. Stream the bytes: the first n_train tokens to train shards, the rest to val shards.
  create_out_dir(out_dir);
  ShardWriter train(out_dir, "train", options.shard_tokens);
  ShardWriter val(out_dir, "val", options.shard_tokens);
  const ByteTokenizer tokenizer;
  int64_t seen = 0;
  for (const std::string& input : inputs) {
    InputFile file(input);
    while (const size_t got = file.read(block.data(), block.size())) {
      for (int32_t token : tokenizer.encode(std::string_view(block.data(), got))) {
        if (seen == n) fail("prepare_dataset: input file '", input, "' grew while reading");
        (seen < n_train ? train : val).push(static_cast<uint32_t>(token));
        ++seen;
      }
    }
  }
  if (seen != n)
    fail("prepare_dataset: the input files shrank while reading (", seen, " of ", n, " bytes)");

  PrepareResult result = finish_splits(train, val);
  LOOM_CHECK(result.train_tokens == n_train && result.val_tokens == n_val);
  return result;
}

namespace {

// A fine-tuning example of a JSONL file: a prompt-completion pair of strings (the prompt, then
// the completion, which counts; the end-of-text token follows), or a conversation rendered by a
// chat template into parts of text, each counted or not.
struct SftExample {
  std::string prompt, completion;                   // a prompt-completion pair
  std::vector<std::pair<std::string, bool>> parts;  // a conversation: (text, counts)
  bool conversation() const { return !parts.empty(); }
};

// A conversation's messages in a chat template (PrepareOptions::chat_template): the turns
// before `first_counted` and every turn not the assistant's are context; each assistant turn
// from there counts — its content and the template's end-of-turn marker, not its header.
std::vector<std::pair<std::string, bool>> render_chat(const std::string& chat_template,
                                                      const nlohmann::json& messages,
                                                      size_t first_counted) {
  std::vector<std::pair<std::string, bool>> parts;
  const auto add = [&](std::string text, bool counts) {
    if (!parts.empty() && parts.back().second == counts) {
      parts.back().first += text;
    } else {
      parts.emplace_back(std::move(text), counts);
    }
  };
  for (size_t i = 0; i < messages.size(); ++i) {
    const std::string role = messages[i]["role"].get<std::string>();
    const std::string content = messages[i]["content"].get<std::string>();
    const bool counts = role == "assistant" && i >= first_counted;
    if (chat_template == "chatml") {  // <|im_start|>ROLE\nCONTENT<|im_end|>\n
      add("<|im_start|>" + role + "\n", false);
      add(content + "<|im_end|>", counts);
      add("\n", false);
    } else {  // llama3: <|start_header_id|>ROLE<|end_header_id|>\n\nCONTENT<|eot_id|>
      add("<|start_header_id|>" + role + "<|end_header_id|>\n\n", false);
      add(content + "<|eot_id|>", counts);
    }
  }
  return parts;
}

SftExample parse_sft_line(const std::string& line, const std::string& where,
                          const std::string& chat_template) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(line);
  } catch (const nlohmann::json::exception& e) {  // a syntax error, or a number out of range
    fail("prepare_sft_dataset: ", where, ": not JSON: ", e.what());
  }
  if (!j.is_object()) fail("prepare_sft_dataset: ", where, ": not a JSON object");
  // ShareGPT's {"conversations": [{"from": "human" | "gpt" | "system", "value": ...}]} (OpenHermes,
  // SlimOrca; axolotl's "sharegpt" type) is read as the messages it stands for.
  if (j.contains("conversations") && !j.contains("messages")) {
    if (!j["conversations"].is_array())
      fail("prepare_sft_dataset: ", where, ": \"conversations\" is not a list of turns");
    nlohmann::json messages = nlohmann::json::array();
    for (const nlohmann::json& turn : j["conversations"]) {
      if (!turn.is_object() || !turn.contains("from") || !turn["from"].is_string() ||
          !turn.contains("value") || !turn["value"].is_string())
        fail("prepare_sft_dataset: ", where, ": turn ", messages.size(),
             " is not {\"from\": \"...\", \"value\": \"...\"}");
      const std::string from = turn["from"].get<std::string>();
      const char* role = from == "human" || from == "user"      ? "user"
                         : from == "gpt" || from == "assistant" ? "assistant"
                         : from == "system"                     ? "system"
                                                                : nullptr;
      if (role == nullptr)
        fail("prepare_sft_dataset: ", where, ": turn ", messages.size(), "'s \"from\": \"", from,
             "\" is not human, gpt or system");
      messages.push_back({{"role", role}, {"content", turn["value"]}});
    }
    j["messages"] = std::move(messages);
  }
  // TRL's conversational forms: {"messages": [...]}, or {"prompt": [...], "completion": [...]}.
  const bool prompt_list = j.contains("prompt") && j["prompt"].is_array();
  if (j.contains("messages") || prompt_list) {
    if (chat_template.empty())
      fail("prepare_sft_dataset: ", where, ": a conversation (\"messages\", or \"prompt\" and ",
           "\"completion\" as lists of messages) needs a chat template: --chat-template chatml "
           "or llama3");
    nlohmann::json messages = nlohmann::json::array();
    size_t first_counted = 0;
    const auto append = [&](const char* key) {
      if (!j.contains(key) || !j[key].is_array())
        fail("prepare_sft_dataset: ", where, ": \"", key, "\" is not a list of messages");
      for (const nlohmann::json& m : j[key]) messages.push_back(m);
    };
    if (prompt_list) {  // only the completion's assistant turns count
      append("prompt");
      first_counted = messages.size();
      append("completion");
    } else {
      append("messages");
    }
    bool learns = false;
    for (size_t i = 0; i < messages.size(); ++i) {
      const nlohmann::json& m = messages[i];
      if (!m.is_object() || !m.contains("role") || !m["role"].is_string() ||
          !m.contains("content") || !m["content"].is_string())
        fail("prepare_sft_dataset: ", where, ": message ", i,
             " is not {\"role\": \"...\", \"content\": \"...\"}");
      const std::string role = m["role"].get<std::string>();
      if (role != "system" && role != "user" && role != "assistant")
        fail("prepare_sft_dataset: ", where, ": message ", i, "'s role \"", role,
             "\" is not system, user or assistant");
      learns |=
          role == "assistant" && i >= first_counted && !m["content"].get<std::string>().empty();
    }
    if (!learns)
      fail("prepare_sft_dataset: ", where, ": no assistant message with content to learn",
           prompt_list ? " in \"completion\"" : "");
    SftExample example;
    example.parts = render_chat(chat_template, messages, first_counted);
    return example;
  }
  const auto text = [&](const char* key) {
    if (!j.contains(key) || !j[key].is_string())
      fail("prepare_sft_dataset: ", where, ": no string \"", key,
           "\" (each line is {\"prompt\": \"...\", \"completion\": \"...\"}, or a "
           "conversation: {\"messages\": [...]})");
    return j[key].get<std::string>();
  };
  SftExample example{text("prompt"), text("completion"), {}};
  if (example.completion.empty())
    fail("prepare_sft_dataset: ", where, ": an empty \"completion\" (nothing to learn)");
  return example;
}

// Fine-tuning examples in a Parquet file, a row at a time as the JSON object its JSON Lines line
// would be, so that one parser (parse_sft_line) reads both: "messages", a list of {role,
// content} (the Hub's SFT datasets: HuggingFaceH4/ultrachat_200k's layout), or ShareGPT's
// "conversations", a list of {from, value}, or else TRL's "prompt" and "completion", strings or
// lists of messages. Other columns are not read; a null is a JSON null, which the parser
// refuses naming the row.
class ParquetExamples {
 public:
  explicit ParquetExamples(const std::string& path) {
    const std::vector<ParquetColumnReader::Column> columns = ParquetColumnReader::columns(path);
    // Where `key`'s column is: a string column, or a list of structs of strings `role_name` and
    // `content_name` (KEY.list.element.role as pyarrow names them; KEY.*.role whatever a writer
    // calls its list's levels). Nothing is opened yet.
    const auto find = [&](const std::string& key, const std::string& role_name = "role",
                          const std::string& content_name = "content") {
      Field field;
      field.key = key;
      field.role_name = role_name;
      field.content_name = content_name;
      for (const ParquetColumnReader::Column& c : columns) {
        if (c.path == key && c.strings && c.lists == 0) field.text_path = key;
        const bool in_key = c.path.starts_with(key + ".") && c.strings && c.lists == 1;
        const std::string leaf = c.path.substr(c.path.rfind('.') + 1);
        if (in_key && leaf == role_name && field.role_path.empty()) field.role_path = c.path;
        if (in_key && leaf == content_name && field.content_path.empty())
          field.content_path = c.path;
      }
      return field;
    };
    if (Field messages = find("messages"); messages.present()) {
      fields_.push_back(std::move(messages));
    } else if (Field conversations = find("conversations", "from", "value");
               conversations.present()) {
      fields_.push_back(std::move(conversations));
    } else {
      fields_.push_back(find("prompt"));
      fields_.push_back(find("completion"));
    }
    for (Field& f : fields_) {
      if (!f.present()) {
        std::string names;
        for (const ParquetColumnReader::Column& c : columns)
          names += (names.empty() ? "" : ", ") + c.path;
        fail("prepare_sft_dataset: input file '", path, "': no column \"messages\" (a list of ",
             "{role, content}), \"conversations\" (a list of {from, value}) nor \"prompt\" and ",
             "\"completion\" (strings or lists of messages) (its columns: ", names, ")");
      }
      if (!f.text_path.empty()) {
        f.text = std::make_unique<ParquetColumnReader>(path, f.text_path);
      } else {
        f.roles = std::make_unique<ParquetColumnReader>(path, f.role_path, true);
        f.contents = std::make_unique<ParquetColumnReader>(path, f.content_path, true);
      }
    }
  }

  // The next row as a JSON object's text into `line`; false after the last row.
  bool next(std::string& line) {
    nlohmann::json row = nlohmann::json::object();
    for (Field& f : fields_) {
      if (f.text) {
        std::string text;
        const auto got = f.text->next(text);
        if (got == ParquetColumnReader::Next::end) return false;  // every column's last row
        row[f.key] =
            got == ParquetColumnReader::Next::null ? nlohmann::json() : nlohmann::json(text);
        continue;
      }
      const auto got = f.roles->next_list(roles_);
      if (got == ParquetColumnReader::Next::end) return false;
      if (f.contents->next_list(contents_) != got || contents_.size() != roles_.size())
        fail("prepare_sft_dataset: input file '", f.roles->path(), "' row ", f.roles->row(),
             ": damaged Parquet data (its messages' roles and contents differ in number)");
      nlohmann::json& messages = row[f.key];
      if (got == ParquetColumnReader::Next::null) continue;  // null
      messages = nlohmann::json::array();
      for (size_t m = 0; m < roles_.size(); ++m)
        messages.push_back(
            !roles_[m] && !contents_[m]
                ? nlohmann::json()  // a null message
                : nlohmann::json{
                      {f.role_name, roles_[m] ? nlohmann::json(*roles_[m]) : nlohmann::json()},
                      {f.content_name,
                       contents_[m] ? nlohmann::json(*contents_[m]) : nlohmann::json()}});
    }
    row_ = fields_[0].text ? fields_[0].text->row() : fields_[0].roles->row();
    line = row.dump();
    return true;
  }
  int64_t row() const { return row_; }  // the row `next` returned last, from 1

 private:
  struct Field {
    std::string key, role_name, content_name;  // a list of messages': its structs' field names
    std::string text_path, role_path, content_path;        // its columns, as found
    std::unique_ptr<ParquetColumnReader> text;             // a string column
    std::unique_ptr<ParquetColumnReader> roles, contents;  // a list of messages
    bool present() const {
      return !text_path.empty() || (!role_path.empty() && !content_path.empty());
    }
  };
  std::vector<Field> fields_;
  std::vector<std::optional<std::string>> roles_, contents_;
  int64_t row_ = 0;
};

// Calls visit(example, where) for each non-blank line of the JSONL files and each row of the
// Parquet files, in order.
void for_each_sft_example(const std::vector<std::string>& inputs, const std::string& chat_template,
                          const std::function<void(const SftExample&)>& visit) {
  for (const std::string& input : inputs) {
    if (is_parquet(input)) {
      ParquetExamples rows(input);
      std::string line;
      while (rows.next(line))
        visit(
            parse_sft_line(line, detail::concat("'", input, "' row ", rows.row()), chat_template));
      continue;
    }
    LineReader lines(input);  // plain, gzip or zstd
    std::string line;
    while (lines.next(line)) {
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      visit(parse_sft_line(line, detail::concat("'", input, "' line ", lines.line_number()),
                           chat_template));
    }
  }
}

// A document waiting for the tokenizer: a text file's whole text, a JSON line (parsed by the
// thread that tokenizes it), or a Parquet row's text (empty for a null).
struct PendingDocument {
  std::string text;
  size_t input = 0;   // which of the inputs
  int64_t line = 0;   // a JSON line's number or a Parquet row's; 0: a text file
  bool json = false;  // `text` is the JSON line (or a Parquet row's example as one)
  bool row = false;   // `line` is a Parquet row's number
};

// The inputs' documents in order, a batch at a time: at least one document, then more while the
// batch holds less than max_bytes of text and fewer than max_files text files. With all_lines
// every input is read as JSON Lines whatever its name (fine-tuning examples); otherwise a
// Parquet file's documents are its column `column`.
class DocumentBatches {
 public:
  DocumentBatches(const std::vector<std::string>& inputs, size_t max_files, size_t max_bytes,
                  bool all_lines, std::string column)
      : inputs_(inputs),
        max_files_(max_files),
        max_bytes_(max_bytes),
        all_lines_(all_lines),
        column_(std::move(column)) {}

  // The next batch; empty after the last document.
  std::vector<PendingDocument> next() {
    std::vector<PendingDocument> batch;
    size_t bytes = 0, files = 0;
    while (input_ < inputs_.size() && bytes < max_bytes_ && files < max_files_) {
      const std::string& path = inputs_[input_];
      if (all_lines_ && is_parquet(path)) {  // fine-tuning examples
        if (!examples_) examples_.emplace(path);
        std::string line;
        bool more = true;
        while (bytes < max_bytes_ && (more = examples_->next(line))) {
          bytes += line.size();
          batch.push_back({std::move(line), input_, examples_->row(), true, true});
        }
        if (!more) {
          examples_.reset();
          ++input_;
        }
        continue;
      }
      if (!all_lines_ && is_parquet(path)) {
        if (!parquet_) parquet_.emplace(path, column_);
        std::string text;
        bool more = true;
        // A row counts a byte beside its text, so that a batch of nulls ends too.
        while (bytes < max_bytes_ &&
               (more = parquet_->next(text) != ParquetColumnReader::Next::end)) {
          bytes += text.size() + 1;
          batch.push_back({std::move(text), input_, parquet_->row(), false, true});
        }
        if (!more) {
          parquet_.reset();
          ++input_;
        }
        continue;
      }
      if (!all_lines_ && !is_json_lines(path)) {
        batch.push_back({read_input_file(path), input_, 0});
        bytes += batch.back().text.size();
        ++files;
        ++input_;
        continue;
      }
      if (!lines_) lines_.emplace(path);
      std::string line;
      bool more = true;
      while (bytes < max_bytes_ && (more = lines_->next(line))) {
        if (line.find_first_not_of(" \t\r") == std::string::npos) continue;  // blank
        bytes += line.size();
        batch.push_back({std::move(line), input_, lines_->line_number(), true});
      }
      if (!more) {  // the file's end
        lines_.reset();
        ++input_;
      }
    }
    return batch;
  }

 private:
  const std::vector<std::string>& inputs_;
  size_t max_files_, max_bytes_;
  bool all_lines_;
  std::string column_;
  size_t input_ = 0;                            // the input being read
  std::optional<LineReader> lines_;             // its lines, when it is JSON Lines
  std::optional<ParquetColumnReader> parquet_;  // its column, when it is Parquet
  std::optional<ParquetExamples> examples_;     // its examples, when it is Parquet and all_lines
};

// The document of line `number` of JSON Lines file `input`: the string at `key`.
std::string json_document(const std::string& line, const std::string& input, int64_t number,
                          const std::string& key) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(line);
  } catch (const nlohmann::json::exception& e) {  // a syntax error, bad UTF-8, a huge number
    fail("prepare_dataset: '", input, "' line ", number, ": not JSON: ", e.what());
  }
  const auto found = j.is_object() ? j.find(key) : j.end();
  if (!j.is_object() || found == j.end() || !found->is_string())
    fail("prepare_dataset: '", input, "' line ", number, ": no string \"", key, "\" (a JSON ",
         "Lines corpus holds an object a line, its document's text at --json-key)");
  return found->get<std::string>();
}

int resolve_threads(int threads) {
  return threads > 0 ? threads : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

// Runs `tokenize(doc)` (returning a Result) on each document of the inputs on `pool`, a batch at a
// time (options.batch_bytes of text, or 4 text files a thread), the next batch read and
// decompressed on a thread of its own meanwhile — memory holds two batches and their tokens —;
// then, on the calling thread and in the documents' order, `take(result)` for each, and
// `batch_done(bytes)` with the batch's text bytes. The first document's error in that order is
// thrown, as one thread would meet it, whatever the thread count. `what` starts an error a
// tokenizer did not name (out of memory for a huge file, say).
template <typename Result, typename Tokenize, typename Take, typename BatchDone>
void tokenize_in_batches(const std::vector<std::string>& inputs, bool all_lines,
                         const PrepareOptions& options, ThreadPool& pool, const char* what,
                         Tokenize&& tokenize, Take&& take, BatchDone&& batch_done) {
  DocumentBatches batches(inputs, 4 * static_cast<size_t>(pool.size()),
                          static_cast<size_t>(options.batch_bytes), all_lines, options.json_key);
  std::future<std::vector<PendingDocument>> ahead =
      std::async(std::launch::async, [&batches] { return batches.next(); });
  for (;;) {
    std::vector<PendingDocument> batch = ahead.get();
    if (batch.empty()) return;
    int64_t bytes = 0;
    for (const PendingDocument& doc : batch) bytes += static_cast<int64_t>(doc.text.size());
    ahead = std::async(std::launch::async, [&batches] { return batches.next(); });
    std::vector<Result> results(batch.size());
    std::vector<std::string> errors(batch.size());
    pool.parallel_tasks(static_cast<int64_t>(batch.size()), [&](int64_t t) {
      const auto k = static_cast<size_t>(t);
      try {
        results[k] = tokenize(batch[k]);
        std::string().swap(batch[k].text);
      } catch (const Error& e) {
        errors[k] = e.what();
      } catch (const std::exception& e) {
        errors[k] = detail::concat(what, ": input file '", inputs[batch[k].input], "': ", e.what());
      }
    });
    for (size_t k = 0; k < batch.size(); ++k) {
      if (!errors[k].empty()) throw Error(errors[k]);
      take(results[k]);
    }
    batch_done(bytes);
  }
}

}  // namespace

PrepareResult prepare_sft_dataset(const std::vector<std::string>& inputs,
                                  const std::string& out_dir, const PrepareOptions& options,
                                  int64_t eot, const BpeTokenizer* tokenizer) {
  check_prepare(inputs, options, "prepare_sft_dataset");
  if (tokenizer == nullptr && eot > 255)
    fail("prepare_sft_dataset: eot = ", eot, " is not a byte token (0..255, or -1)");
  if (tokenizer != nullptr && !(eot >= 0 && eot < tokenizer->vocab_size()))
    fail("prepare_sft_dataset: eot = ", eot, " is not a token of ", tokenizer->path(), " (0..",
         tokenizer->vocab_size() - 1, "): the completions need their end-of-text");
  const std::string& chat = options.chat_template;
  if (!chat.empty() && chat != "chatml" && chat != "llama3")
    fail("prepare_sft_dataset: chat template '", chat, "' is not chatml or llama3");
  // A chat template's markers must be single tokens of the tokenizer (its added tokens), as the
  // model's own template has them; with bytes they are text.
  if (!chat.empty() && tokenizer != nullptr)
    for (const char* marker :
         chat == "chatml"
             ? std::vector<const char*>{"<|im_start|>", "<|im_end|>"}
             : std::vector<const char*>{"<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"})
      if (!tokenizer->token_id(marker))
        fail("prepare_sft_dataset: chat template ", chat, " needs the token ", marker, ", which ",
             tokenizer->path(), " does not have");
  // 1. Every line parsed once to count the examples (errors before anything is written); the
  //    last val_fraction of them are held out, whole.
  int64_t n = 0;
  for_each_sft_example(inputs, chat, [&](const SftExample&) { ++n; });
  if (n == 0)
    fail("prepare_sft_dataset: no examples in the input files (first: '", inputs[0], "')");
  const int64_t n_val = held_out(n, options.val_fraction, "prepare_sft_dataset", "examples");

  // 2. Each example's prompt (no target counts) then its completion's and the end-of-text token
  //    (each a target that counts) — or a conversation's parts, counted as rendered —, into its
  //    split's shards with their masks.
  create_out_dir(out_dir);
  const bool wide = tokenizer != nullptr && tokenizer->vocab_size() > 65536;
  ShardWriter train(out_dir, "train", options.shard_tokens, wide);
  ShardWriter val(out_dir, "val", options.shard_tokens, wide);
  // The prompt with the tokenizer's BOS (as a model is prompted), the completion without.
  const auto encode = [&](const std::string& text, bool add_special) {
    return tokenizer != nullptr ? tokenizer->encode(text, add_special)
                                : ByteTokenizer().encode(text);
  };
  // Examples are parsed again and tokenized in parallel, a batch at a time, and written in order.
  struct Tokens {
    std::vector<int32_t> ids;
    std::vector<uint8_t> counts;
    void add(const std::vector<int32_t>& part, bool count) {
      ids.insert(ids.end(), part.begin(), part.end());
      counts.insert(counts.end(), part.size(), count ? 1 : 0);
    }
  };
  ThreadPool pool(resolve_threads(options.threads));
  int64_t seen = 0;
  tokenize_in_batches<Tokens>(
      inputs, true, options, pool, "prepare_sft_dataset",
      [&](const PendingDocument& line) {
        const SftExample example = parse_sft_line(
            line.text,
            detail::concat("'", inputs[line.input], line.row ? "' row " : "' line ", line.line),
            chat);
        Tokens tokens;
        if (example.conversation()) {
          // The tokenizer's BOS, then each part on its own (as torchtune tokenizes a message's
          // header and content): its tokens counted or not as a whole.
          tokens.add(encode("", true), false);
          for (const auto& [text, counts] : example.parts) tokens.add(encode(text, false), counts);
          return tokens;
        }
        tokens.add(encode(example.prompt, true), false);
        tokens.add(encode(example.completion, false), true);
        if (eot >= 0) tokens.add({static_cast<int32_t>(eot)}, true);
        return tokens;
      },
      [&](const Tokens& tokens) {
        ShardWriter& split = seen++ < n - n_val ? train : val;
        for (size_t i = 0; i < tokens.ids.size(); ++i)
          split.push(static_cast<uint32_t>(tokens.ids[i]), tokens.counts[i] != 0);
      },
      [](int64_t) {});
  if (seen != n)
    fail("prepare_sft_dataset: the input files changed while read (", n, " examples, then ", seen,
         ")");
  return finish_splits(train, val);
}

PrepareResult prepare_tokenized_dataset(const std::vector<std::string>& inputs,
                                        const std::string& out_dir, const BpeTokenizer& tokenizer,
                                        const PrepareOptions& options, int64_t eot) {
  check_prepare(inputs, options, "prepare_dataset");
  if (eot >= tokenizer.vocab_size())
    fail("prepare_dataset: eot = ", eot, " is not a token of ", tokenizer.path(), " (0..",
         tokenizer.vocab_size() - 1, ")");
  for (const std::string& input : inputs) {  // every file named before any is read
    if (std::error_code ec; !fs::is_regular_file(input, ec))
      fail("prepare_dataset: input file '", input, "': cannot open (not a file)");
    try {  // a Parquet file's footer and column, checked up front
      if (is_parquet(input)) ParquetColumnReader(input, options.json_key);
    } catch (const Error& e) {
      fail("prepare_dataset: ", e.what());
    }
  }
  create_out_dir(out_dir);
  // 1. Every document whole through the tokenizer (its pre-tokenizer's pieces may span any
  //    line): its tokens, then the end-of-text token. Documents are tokenized in parallel, a batch
  //    at a time (each on one thread: a stretch of text cannot be cut anywhere without changing
  //    its pieces), and their tokens appended in the documents' order to a scratch file — the
  //    split point is known only at the end, and the corpus' tokens need not fit in memory.
  //    The scratch file holds each token as the shards will (uint16 up to 65536 ids, else uint32).
  const bool wide = tokenizer.vocab_size() > 65536;
  const size_t token_bytes = wide ? sizeof(uint32_t) : sizeof(uint16_t);
  const fs::path scratch = fs::path(out_dir) / ".prepare_tokens.tmp";
  struct RemoveScratch {
    fs::path path;
    ~RemoveScratch() {
      std::error_code ec;
      fs::remove(path, ec);
    }
  } remove_scratch{scratch};
  int64_t n = 0, documents = 0, empty_documents = 0;
  {
    std::ofstream out(scratch, std::ios::binary | std::ios::trunc);
    if (!out) fail("prepare_dataset: cannot write ", scratch.string());
    ThreadPool pool(resolve_threads(options.threads));
    const auto start = std::chrono::steady_clock::now();
    int64_t bytes = 0;
    // A document's tokens and end-of-text as the scratch file holds them: a batch's wait in
    // memory at 2 bytes a token where the ids fit (half of int32's), and the writing thread only
    // copies them out.
    struct Tokens {
      std::vector<int32_t> ids;      // wide
      std::vector<uint16_t> narrow;  // otherwise: every id < vocab_size() <= 65536
      bool empty = false;            // a JSON line's or a row's empty text: skipped
    };
    tokenize_in_batches<Tokens>(
        inputs, false, options, pool, "prepare_dataset",
        [&](PendingDocument& doc) {
          Tokens tokens;
          if (doc.json)  // parsed here so that parsing runs in parallel too
            doc.text = json_document(doc.text, inputs[doc.input], doc.line, options.json_key);
          if (doc.line > 0) {  // a JSON line's or a Parquet row's text: an empty one skipped
            tokens.empty = doc.text.empty();
            if (tokens.empty) return tokens;
          }
          tokens.ids = tokenizer.encode(doc.text);
          if (eot >= 0) tokens.ids.push_back(static_cast<int32_t>(eot));
          if (!wide) {
            tokens.narrow.assign(tokens.ids.begin(), tokens.ids.end());
            std::vector<int32_t>().swap(tokens.ids);
          }
          return tokens;
        },
        [&](Tokens& tokens) {
          if (tokens.empty) {
            ++empty_documents;
            return;
          }
          ++documents;
          if (wide) {
            out.write(reinterpret_cast<const char*>(tokens.ids.data()),
                      static_cast<std::streamsize>(tokens.ids.size() * sizeof(int32_t)));
            n += static_cast<int64_t>(tokens.ids.size());
          } else {
            out.write(reinterpret_cast<const char*>(tokens.narrow.data()),
                      static_cast<std::streamsize>(tokens.narrow.size() * sizeof(uint16_t)));
            n += static_cast<int64_t>(tokens.narrow.size());
          }
        },
        [&](int64_t batch_bytes) {
          if (!out) fail("prepare_dataset: cannot write ", scratch.string(), " (disk full?)");
          bytes += batch_bytes;
          if (options.progress)
            options.progress(
                {bytes, documents, n,
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()});
        });
  }
  if (n == 0)
    fail("prepare_dataset: the input files give no tokens (first: '", inputs[0], "'",
         empty_documents > 0 ? detail::concat("; ", empty_documents, " empty documents") : "", ")");
  const int64_t n_val = held_out(n, options.val_fraction, "prepare_dataset", "tokens");
  // 2. The first n - n_val tokens to train shards, the rest to val shards.
  ShardWriter train(out_dir, "train", options.shard_tokens, wide);
  ShardWriter val(out_dir, "val", options.shard_tokens, wide);
  std::ifstream in(scratch, std::ios::binary);
  constexpr int64_t kBlock = 1 << 20;
  std::vector<uint32_t> block32(wide ? kBlock : 0);
  std::vector<uint16_t> block16(wide ? 0 : kBlock);
  for (int64_t i = 0; i < n;) {
    const int64_t count = std::min<int64_t>(kBlock, n - i);
    in.read(
        wide ? reinterpret_cast<char*>(block32.data()) : reinterpret_cast<char*>(block16.data()),
        static_cast<std::streamsize>(count * static_cast<int64_t>(token_bytes)));
    if (!in) fail("prepare_dataset: cannot read back ", scratch.string());
    for (int64_t k = 0; k < count; ++k, ++i) {
      const auto at = static_cast<size_t>(k);
      (i < n - n_val ? train : val).push(wide ? block32[at] : block16[at]);
    }
  }
  PrepareResult result = finish_splits(train, val);
  result.documents = documents;
  result.empty_documents = empty_documents;
  return result;
}

int64_t write_addition_answer_masks(const std::vector<std::string>& split_shards) {
  bool in_answer = false;  // a split starts on a line; a line may go on in the next shard
  int64_t counted = 0;
  for (const std::string& path : split_shards) {
    const std::vector<uint16_t> tokens = read_shard(path);
    std::vector<uint8_t> counts(tokens.size());
    for (size_t i = 0; i < tokens.size(); ++i) {
      counts[i] = in_answer ? 1 : 0;
      counted += counts[i];
      if (tokens[i] == '=') in_answer = true;
      if (tokens[i] == '\n') in_answer = false;
    }
    write_loss_mask(loss_mask_path(path), counts);
  }
  return counted;
}

SynthResult synthesize_addition(const std::string& out_dir, int64_t n_train_tokens,
                                int64_t n_val_tokens, uint64_t seed) {
  if (n_train_tokens < 1)
    fail("synthesize_addition: n_train_tokens = ", n_train_tokens, ": must be >= 1");
  if (n_val_tokens < 0)
    fail("synthesize_addition: n_val_tokens = ", n_val_tokens, ": must be >= 0");
  create_out_dir(out_dir);
  const int64_t shard_tokens = PrepareOptions{}.shard_tokens;
  ShardWriter train(out_dir, "train", shard_tokens);
  ShardWriter val(out_dir, "val", shard_tokens);
  RandomStream rng(seed, "synth");
  write_additions(rng, n_train_tokens, train);
  write_additions(rng, n_val_tokens, val);

  return finish_splits(train, val);
}

}  // namespace loom
