#include "checkpoint/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>

#include "base/error.h"
#include "base/json_number.h"
#include "checkpoint/checkpoint_io.h"
#include "checkpoint/safetensors.h"
#include "checkpoint/sharded_checkpoint.h"

namespace loom {
namespace fs = std::filesystem;
using nlohmann::json;

namespace checkpoint_io {

// Writes `text` and flushes it to the disk, like the tensor files, before the directory holding
// them is renamed into place.
void write_text_file(const fs::path& path, const std::string& text) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail("cannot write ", path.string(), ": ", std::strerror(errno));
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = errno;
      ::close(fd);
      fail("cannot write ", path.string(), ": ", std::strerror(err));
    }
    done += static_cast<size_t>(n);
  }
  const bool synced = ::fsync(fd) == 0;
  const int err = errno;
  if (::close(fd) != 0 || !synced)
    fail("cannot write ", path.string(), ": ", std::strerror(synced ? errno : err));
}

// Makes a rename inside `dir` durable (best effort: some file systems refuse to sync a
// directory, and the rename itself is atomic either way).
void sync_directory(const fs::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  (void)::fsync(fd);
  ::close(fd);
}

json digest_json(const FileDigest& d) {
  return {{"bytes", d.bytes}, {"xxh3_64", xxh3_hex(d.xxh3)}};
}

}  // namespace checkpoint_io

using namespace checkpoint_io;

namespace {

// N for a directory named step_N, else nullopt (step_N.tmp, anything else).
std::optional<int64_t> step_of(const std::string& name) {
  if (name.rfind("step_", 0) != 0) return std::nullopt;
  const std::string digits = name.substr(5);
  if (digits.empty() || digits.size() > 18 ||  // fits int64_t
      digits.find_first_not_of("0123456789") != std::string::npos)
    return std::nullopt;
  return std::stoll(digits);
}

// The complete checkpoints (step_N holding a state.json) under `checkpoints_dir`, by step.
std::map<int64_t, std::string> complete_checkpoints(const fs::path& checkpoints_dir) {
  std::map<int64_t, std::string> found;
  std::error_code ec;
  if (!fs::is_directory(checkpoints_dir, ec)) return found;
  for (const auto& entry : fs::directory_iterator(checkpoints_dir, ec)) {
    const std::optional<int64_t> step = step_of(entry.path().filename().string());
    if (step && entry.is_directory() && fs::exists(entry.path() / "state.json"))
      found[*step] = entry.path().string();
  }
  return found;
}

// The most recent complete checkpoint before `checkpoint_dir` (a step_N) beside it, or "": where
// to resume from when this one is damaged.
std::string earlier_checkpoint(const std::string& checkpoint_dir) {
  fs::path dir = fs::path(checkpoint_dir).lexically_normal();
  if (dir.filename().empty()) dir = dir.parent_path();  // "…/step_N/"
  const std::optional<int64_t> step = step_of(dir.filename().string());
  if (!step) return "";
  const std::map<int64_t, std::string> all = complete_checkpoints(dir.parent_path());
  const auto at = all.lower_bound(*step);
  return at == all.begin() ? "" : std::prev(at)->second;
}

// The digest state.json recorded for `file` when the checkpoint was written (its "files"), or
// nullopt for a checkpoint from before digests existed.
std::optional<FileDigest> recorded_digest(const std::string& dir, const std::string& file,
                                          const json& state) {
  if (!state.contains("files") || !state["files"].contains(file)) return std::nullopt;
  // A file of the checkpoint's own directory: nothing a state.json says makes Loom read others.
  if (file.empty() || file == "." || file == ".." || file.find('/') != std::string::npos)
    fail("checkpoint ", dir, ": state.json's files names '", file,
         "', which is not a file of the checkpoint directory");
  const json& record = state["files"][file];
  FileDigest want;
  try {
    want.bytes = json_integer<int64_t>(record.at("bytes"));
    if (parse_xxh3(record.at("xxh3_64").get<std::string>(), want.xxh3)) return want;
  } catch (const json::exception&) {
  }
  fail("checkpoint ", dir, ": state.json's files.\"", file,
       "\" is not {\"bytes\": N, \"xxh3_64\": 16 hex digits}: ", record.dump());
}

// The error for a checkpoint file that does not hold what was written (`got`: its size alone
// where that differs, its digest otherwise), with where to go from here.
[[noreturn]] void fail_not_as_written(const std::string& dir, const std::string& file,
                                      const FileDigest& got, const FileDigest& want) {
  const std::string earlier = earlier_checkpoint(dir);
  const std::string advice =
      earlier.empty()
          ? std::string("restore it from a copy")
          : "restore it from a copy, or resume from an earlier checkpoint: --resume " + earlier;
  if (got.bytes != want.bytes)
    fail("checkpoint ", dir, ": ", file, " is ", got.bytes, " bytes, but ", want.bytes,
         " were written (truncated or replaced); ", advice);
  fail("checkpoint ", dir, ": ", file,
       " is not what was written (damaged, or replaced by another file): its bytes hash to "
       "xxh3-64 ",
       xxh3_hex(got.xxh3), ", state.json recorded ", xxh3_hex(want.xxh3), "; ", advice);
}

// The size of a checkpoint file, failing with its name when it cannot be read.
int64_t file_bytes(const std::string& dir, const std::string& file) {
  std::error_code ec;
  const auto size = fs::file_size(fs::path(dir) / file, ec);
  if (ec) fail("checkpoint ", dir, ": cannot read ", file, ": ", ec.message());
  return static_cast<int64_t>(size);
}

}  // namespace

namespace checkpoint_io {

SafetensorsFile load_checked(const std::string& dir, const std::string& file, const json& state) {
  const std::string path = (fs::path(dir) / file).string();
  const std::optional<FileDigest> want = recorded_digest(dir, file, state);
  if (!want) return load_safetensors(path);
  const int64_t bytes = file_bytes(dir, file);
  if (bytes != want->bytes) fail_not_as_written(dir, file, FileDigest{bytes, 0}, *want);
  SafetensorsFile loaded;
  try {
    loaded = load_safetensors(path);
  } catch (const Error&) {
    // A damaged header fails to parse: say that the file is damaged, not only how.
    const FileDigest got = digest_file(path);
    if (got == *want) throw;
    fail_not_as_written(dir, file, got, *want);
  }
  if (loaded.digest != *want) fail_not_as_written(dir, file, loaded.digest, *want);
  return loaded;
}

std::optional<FileDigest> verify_file(const std::string& dir, const std::string& file,
                                      const json& state) {
  const std::optional<FileDigest> want = recorded_digest(dir, file, state);
  if (!want) return want;
  const int64_t bytes = file_bytes(dir, file);
  if (bytes != want->bytes) fail_not_as_written(dir, file, FileDigest{bytes, 0}, *want);
  const FileDigest got = digest_file((fs::path(dir) / file).string());
  if (got != *want) fail_not_as_written(dir, file, got, *want);
  return got;
}

json read_state_json(const std::string& dir) {
  const fs::path path = fs::path(dir) / "state.json";
  std::ifstream in(path);
  if (!in) fail("checkpoint ", dir, ": missing ", path.filename().string(), " (not a Loom checkpoint?)");
  try {
    json j = json::parse(in);
    if (j.value("format_version", -1) != kFormatVersion)
      fail("checkpoint ", dir, ": unsupported format_version ", j.value("format_version", -1),
           " (this Loom reads version ", kFormatVersion, ")");
    return j;
  } catch (const json::exception& e) {
    fail("checkpoint ", path.string(), ": invalid JSON: ", e.what());
  }
}

}  // namespace checkpoint_io

namespace {

// Copies `src` (from a file) into `dst` after checking name, shape and dtype.
void load_into(const std::string& dir, const std::string& file, const SafetensorsFile& st,
               const std::string& name, Tensor& dst) {
  auto it = st.tensors.find(name);
  if (it == st.tensors.end())
    fail("checkpoint ", dir, ": ", file, " has no tensor '", name, "' (a checkpoint of another model?)");
  const Tensor& src = it->second;
  if (src.shape() != dst.shape())
    fail("checkpoint ", dir, ": '", name, "' has shape ", shape_str(src.shape()),
         " but the model expects ", shape_str(dst.shape()));
  if (src.dtype() != dst.dtype())
    fail("checkpoint ", dir, ": '", name, "' is ", dtype_name(src.dtype()), ", expected ",
         dtype_name(dst.dtype()));
  dst.copy_from(src);
}
}  // namespace

namespace {
// Parameter p's view in a flat buffer of the store's layout.
Tensor view_of(const Tensor& flat, const Parameter& p) {
  return flat.narrow(p.offset, p.numel()).reshape(p.shape);
}
}  // namespace

namespace checkpoint_io {

json state_json(const TrainingState& state, const ParameterStore& params, const Gpt2Config& mc,
                bool has_optimizer) {
  json j;
  j["format_version"] = kFormatVersion;
  j["step"] = state.step;
  j["optimizer_steps"] = state.optimizer_steps;
  j["loader"] = {{"shard", state.loader_shard},
                 {"offset", state.loader_offset},
                 {"epoch", state.loader_epoch}};
  for (const BlendSourceState& source : state.loader_sources)
    j["loader"]["sources"].push_back({{"shard", source.position.shard},
                                      {"offset", source.position.offset},
                                      {"epoch", source.position.epoch},
                                      {"sequences", source.sequences}});
  j["seed"] = state.seed;
  if (state.loss_scaler)
    j["loss_scale"] = {{"scale", state.loss_scaler->scale},
                       {"good_steps", state.loss_scaler->good_steps}};
  if (!state.expert_bias.empty()) j["moe_expert_bias"] = state.expert_bias;
  // Training draws no random numbers after initialisation (no dropout, deterministic data order),
  // so the counter-based generator's key is all the RNG state there is.
  j["rng"] = {{"algorithm", "philox4x32-10"}, {"seed", state.seed}};
  j["has_optimizer"] = has_optimizer;
  j["config"] = state.config_toml;
  json shape = {
      {"arch", arch_name(mc.arch)}, {"vocab_size", mc.vocab_size}, {"max_seq_len", mc.max_seq_len},
      {"d_model", mc.d_model},      {"n_layers", mc.n_layers},     {"n_heads", mc.n_heads}};
  if (!mc.tie_embeddings) shape["tie_embeddings"] = false;
  if (mc.embedding_multiplier != 1) shape["embedding_multiplier"] = mc.embedding_multiplier;
  if (mc.llama()) {
    shape["n_kv_heads"] = mc.n_kv_heads;
    if (mc.qkv_bias) shape["qkv_bias"] = true;
    if (mc.head_width > 0) shape["head_dim"] = mc.head_width;
    if (mc.qk_norm) shape["qk_norm"] = true;
    if (mc.qk_norm_full) shape["qk_norm_scope"] = "full";
    if (mc.query_pre_attn_scalar > 0) shape["query_pre_attn_scalar"] = mc.query_pre_attn_scalar;
    if (mc.post_norm) shape["norm_placement"] = "post";
    if (mc.sandwich_norm) shape["norm_placement"] = "sandwich";
    if (mc.ffn_activation == GatedActivation::kGeluTanh) shape["ffn_activation"] = "gelu_tanh";
    if (mc.rope_local_theta > 0) shape["rope_local_theta"] = mc.rope_local_theta;
    if (mc.sliding_window > 0) shape["sliding_window"] = mc.sliding_window;
    if (mc.full_attention_every > 0) shape["full_attention_every"] = mc.full_attention_every;
    shape["ffn_hidden"] = mc.ffn_hidden;
    shape["rope_theta"] = mc.rope_theta;
    shape["norm_eps"] = mc.norm_eps;
    if (mc.moe()) {
      shape["moe"] = {{"experts", mc.moe_experts},
                      {"top_k", mc.moe_top_k},
                      {"aux_loss_coef", mc.moe_aux_loss_coef},
                      {"router_z_loss_coef", mc.moe_router_z_loss_coef},
                      {"shared_experts", mc.moe_shared_experts}};
      if (mc.moe_router_score != RouterScore::kSoftmax)
        shape["moe"]["router_score_function"] = router_score_name(mc.moe_router_score);
      if (mc.moe_router_groups > 1) {
        shape["moe"]["router_num_groups"] = mc.moe_router_groups;
        shape["moe"]["router_group_topk"] = mc.moe_router_group_topk;
      }
      if (mc.moe_router_topk_scaling_factor != 1)
        shape["moe"]["router_topk_scaling_factor"] = mc.moe_router_topk_scaling_factor;
      if (!mc.moe_router_norm_topk_prob) shape["moe"]["router_norm_topk_prob"] = false;
      if (!mc.moe_capacity.dropless()) {
        shape["moe"]["capacity_factor"] = mc.moe_capacity.factor;
        shape["moe"]["token_drop_policy"] = token_drop_policy_name(mc.moe_capacity.policy);
      }
    }
    if (mc.rope_scaling_factor > 0 && mc.rope_scaling_linear)
      shape["rope_scaling"] = {{"rope_type", "linear"}, {"factor", mc.rope_scaling_factor}};
    else if (mc.rope_scaling_factor > 0)
      shape["rope_scaling"] = {{"rope_type", "llama3"},
                               {"factor", mc.rope_scaling_factor},
                               {"low_freq_factor", mc.rope_low_freq_factor},
                               {"high_freq_factor", mc.rope_high_freq_factor},
                               {"original_max_seq_len", mc.rope_original_max_seq_len}};
  }
  // Parameter shapes, so a reader can check compatibility without the config.
  for (const auto& p : params.parameters()) shape["parameters"][p->name] = p->full_shape;
  j["model"] = shape;
  return j;
}

TrainingState training_state_of(const std::string& checkpoint_dir, const json& j) {
  TrainingState s;
  try {
    s.step = json_integer<int64_t>(j.at("step"));
    s.optimizer_steps = json_integer<int64_t>(j.at("optimizer_steps"));
    s.loader_shard = json_integer<int64_t>(j.at("loader").at("shard"));
    s.loader_offset = json_integer<int64_t>(j.at("loader").at("offset"));
    s.loader_epoch = json_integer<int64_t>(j.at("loader").at("epoch"));
    if (j.at("loader").contains("sources"))
      for (const json& source : j.at("loader").at("sources"))
        s.loader_sources.push_back(
            {{json_integer<int64_t>(source.at("shard")), json_integer<int64_t>(source.at("offset")),
              json_integer<int64_t>(source.at("epoch"))},
             json_integer<int64_t>(source.at("sequences"))});
    s.seed = json_integer<uint64_t>(j.at("seed"));
    s.config_toml = j.value("config", std::string());
    if (j.contains("loss_scale"))
      s.loss_scaler = LossScalerState{j.at("loss_scale").at("scale").get<double>(),
                                      json_integer<int64_t>(j.at("loss_scale").at("good_steps"))};
    if (j.contains("moe_expert_bias")) {
      s.expert_bias = j.at("moe_expert_bias").get<std::vector<float>>();
      // n_layers × experts of the shape it records
      const json& shape = j.at("model");
      const int64_t want = shape.contains("moe") ? shape.at("n_layers").get<int64_t>() *
                                                       shape.at("moe").at("experts").get<int64_t>()
                                                 : 0;
      if (static_cast<int64_t>(s.expert_bias.size()) != want)
        fail("checkpoint ", checkpoint_dir, ": state.json's moe_expert_bias holds ",
             s.expert_bias.size(), " values, its model n_layers × moe experts = ", want);
    }
  } catch (const json::exception& e) {
    fail("checkpoint ", checkpoint_dir, ": state.json is incomplete: ", e.what());
  }
  return s;
}

fs::path make_tmp_dir(const std::string& checkpoints_dir, int64_t step) {
  const fs::path tmp_dir = fs::path(checkpoints_dir) / ("step_" + std::to_string(step) + ".tmp");
  std::error_code ec;
  fs::create_directories(checkpoints_dir, ec);
  if (ec) fail("cannot create checkpoint directory ", checkpoints_dir, ": ", ec.message());
  fs::remove_all(tmp_dir, ec);
  fs::create_directories(tmp_dir, ec);
  if (ec) fail("cannot create ", tmp_dir.string(), ": ", ec.message());
  return tmp_dir;
}

void publish(const fs::path& tmp_dir, const fs::path& final_dir) {
  // Replace an older checkpoint of the same step (a re-run) only once the new one is complete.
  std::error_code ec;
  fs::remove_all(final_dir, ec);
  fs::rename(tmp_dir, final_dir, ec);
  if (ec) fail("cannot rename ", tmp_dir.string(), " to ", final_dir.string(), ": ", ec.message());
  sync_directory(final_dir.parent_path());
}

}  // namespace checkpoint_io

std::string save_checkpoint(const std::string& checkpoints_dir, Gpt2& model, AdamW* optimizer,
                            const TrainingState& state) {
  FlatModelState flat{model.params().values(), Tensor(), Tensor()};
  if (optimizer != nullptr) {
    flat.exp_avg = optimizer->m();
    flat.exp_avg_sq = optimizer->v();
  }
  return save_checkpoint(checkpoints_dir, model.params(), model.config(), flat, state);
}

std::string save_checkpoint(const std::string& checkpoints_dir, const ParameterStore& params,
                            const Gpt2Config& mc, const FlatModelState& flat,
                            const TrainingState& state) {
  const bool has_optimizer = flat.exp_avg.defined();
  const fs::path final_dir = fs::path(checkpoints_dir) / ("step_" + std::to_string(state.step));
  const fs::path tmp_dir = make_tmp_dir(checkpoints_dir, state.step);

  const std::map<std::string, std::string> meta = {{"format", "loom-checkpoint"},
                                                   {"step", std::to_string(state.step)}};
  std::vector<std::pair<std::string, Tensor>> weights;
  for (const auto& p : params.parameters()) weights.emplace_back(p->name, view_of(flat.values, *p));
  json files;
  files["model.safetensors"] =
      digest_json(save_safetensors((tmp_dir / "model.safetensors").string(), weights, meta));
  if (has_optimizer) {
    std::vector<std::pair<std::string, Tensor>> moments;
    for (const auto& p : params.parameters()) {
      moments.emplace_back(p->name + ".exp_avg", view_of(flat.exp_avg, *p));
      moments.emplace_back(p->name + ".exp_avg_sq", view_of(flat.exp_avg_sq, *p));
    }
    files["optimizer.safetensors"] =
        digest_json(save_safetensors((tmp_dir / "optimizer.safetensors").string(), moments, meta));
  }
  json j = state_json(state, params, mc, has_optimizer);
  // What each tensor file held, checked when it is read (load_checked).
  j["files"] = files;
  write_text_file(tmp_dir / "state.json", j.dump(2) + "\n");
  publish(tmp_dir, final_dir);
  return final_dir.string();
}

std::vector<std::string> list_checkpoints(const std::string& checkpoints_dir) {
  std::vector<std::string> out;
  for (const auto& [step, path] : complete_checkpoints(checkpoints_dir)) out.push_back(path);
  return out;
}

std::vector<std::string> prune_checkpoints(const std::string& checkpoints_dir, int64_t keep,
                                           int64_t saved) {
  if (keep < 1) fail("prune_checkpoints: keep must be >= 1, got ", keep);
  std::vector<std::string> all;  // up to `saved`, by step
  for (const auto& [step, path] : complete_checkpoints(checkpoints_dir))
    if (step <= saved) all.push_back(path);
  std::vector<std::string> removed;
  for (size_t i = 0; i + static_cast<size_t>(keep) < all.size(); ++i) {
    std::error_code ec;
    fs::remove_all(all[i], ec);
    if (ec) fail("cannot remove old checkpoint ", all[i], ": ", ec.message());
    removed.push_back(all[i]);
  }
  return removed;
}

std::vector<std::string> checkpoints_at(const std::string& path) {
  const fs::path p(path);
  if (fs::exists(p / "state.json")) return {path};
  std::vector<std::string> dirs = list_checkpoints(path);
  if (dirs.empty()) dirs = list_checkpoints((p / "checkpoints").string());
  return dirs;
}

std::string find_latest_checkpoint(const std::string& checkpoints_dir) {
  const std::map<int64_t, std::string> all = complete_checkpoints(checkpoints_dir);
  return all.empty() ? "" : all.rbegin()->second;
}

Gpt2Config read_checkpoint_model(const std::string& checkpoint_dir) {
  json j = read_state_json(checkpoint_dir);
  Gpt2Config c;
  try {
    const json& m = j.at("model");
    c.arch = parse_arch(m.value("arch", std::string("gpt2")));  // older checkpoints: GPT-2
    c.vocab_size = json_integer<int64_t>(m.at("vocab_size"));
    c.max_seq_len = json_integer<int64_t>(m.at("max_seq_len"));
    c.d_model = json_integer<int64_t>(m.at("d_model"));
    c.n_layers = json_integer<int64_t>(m.at("n_layers"));
    c.n_heads = json_integer<int64_t>(m.at("n_heads"));
    c.tie_embeddings = m.value("tie_embeddings", true);
    c.embedding_multiplier = m.value("embedding_multiplier", 1.0f);
    if (c.llama()) {
      c.n_kv_heads = json_integer<int64_t>(m.at("n_kv_heads"));
      c.qkv_bias = m.value("qkv_bias", false);
      c.head_width = m.contains("head_dim") ? json_integer<int64_t>(m.at("head_dim")) : 0;
      c.qk_norm = m.value("qk_norm", false);
      c.query_pre_attn_scalar = m.contains("query_pre_attn_scalar")
                                    ? json_integer<int64_t>(m.at("query_pre_attn_scalar"))
                                    : 0;
      // OLMo 2's keys, absent for Llama's defaults; any other value is no model Loom builds.
      const std::string scope = m.value("qk_norm_scope", std::string("head"));
      const std::string placement = m.value("norm_placement", std::string("pre"));
      if ((scope != "head" && scope != "full") ||
          (placement != "pre" && placement != "post" && placement != "sandwich"))
        fail("checkpoint ", checkpoint_dir, ": state.json's model: qk_norm_scope = \"", scope,
             "\", norm_placement = \"", placement,
             "\" is not a model Loom builds (head or full; pre, post or sandwich)");
      c.qk_norm_full = scope == "full";
      c.post_norm = placement == "post";
      c.sandwich_norm = placement == "sandwich";
      const std::string activation = m.value("ffn_activation", std::string("silu"));
      if (activation != "silu" && activation != "gelu_tanh")
        fail("checkpoint ", checkpoint_dir, ": state.json's model: ffn_activation = \"", activation,
             "\" is not a model Loom builds (silu or gelu_tanh)");
      c.ffn_activation =
          activation == "gelu_tanh" ? GatedActivation::kGeluTanh : GatedActivation::kSilu;
      c.rope_local_theta = m.value("rope_local_theta", 0.0);
      c.sliding_window =
          m.contains("sliding_window") ? json_integer<int64_t>(m.at("sliding_window")) : 0;
      c.full_attention_every = m.contains("full_attention_every")
                                   ? json_integer<int64_t>(m.at("full_attention_every"))
                                   : 0;
      c.ffn_hidden = json_integer<int64_t>(m.at("ffn_hidden"));
      c.rope_theta = m.at("rope_theta").get<double>();
      c.norm_eps = m.at("norm_eps").get<double>();
      if (m.contains("moe")) {
        const json& moe = m.at("moe");
        c.moe_experts = json_integer<int64_t>(moe.at("experts"));
        c.moe_top_k = json_integer<int64_t>(moe.at("top_k"));
        c.moe_aux_loss_coef = moe.at("aux_loss_coef").get<float>();
        c.moe_router_z_loss_coef = moe.value("router_z_loss_coef", 0.0f);
        c.moe_shared_experts =
            moe.contains("shared_experts") ? json_integer<int64_t>(moe.at("shared_experts")) : 0;
        c.moe_router_score =
            parse_router_score(moe.value("router_score_function", std::string("softmax")),
                               "model.moe.router_score_function");
        if (moe.contains("router_num_groups")) {
          c.moe_router_groups = json_integer<int64_t>(moe.at("router_num_groups"));
          c.moe_router_group_topk = json_integer<int64_t>(moe.at("router_group_topk"));
        }
        c.moe_router_topk_scaling_factor = moe.value("router_topk_scaling_factor", 1.0);
        c.moe_router_norm_topk_prob = moe.value("router_norm_topk_prob", true);
        c.moe_capacity.factor = moe.value("capacity_factor", 0.0);
        c.moe_capacity.policy = parse_token_drop_policy(
            moe.value("token_drop_policy", std::string("probs")), "model.moe.token_drop_policy");
      }
      if (m.contains("rope_scaling")) {
        const json& s = m.at("rope_scaling");
        c.rope_scaling_factor = s.at("factor").get<double>();
        // Checkpoints before linear scaling hold llama3's without naming it.
        const std::string type = s.value("rope_type", std::string("llama3"));
        if (type != "llama3" && type != "linear")
          fail("checkpoint ", checkpoint_dir,
               ": state.json's model.rope_scaling.rope_type = ", type,
               ", neither llama3 nor linear");
        c.rope_scaling_linear = type == "linear";
        if (!c.rope_scaling_linear) {
          c.rope_low_freq_factor = s.at("low_freq_factor").get<double>();
          c.rope_high_freq_factor = s.at("high_freq_factor").get<double>();
          c.rope_original_max_seq_len = json_integer<int64_t>(s.at("original_max_seq_len"));
        }
      }
    }
  } catch (const json::exception& e) {
    fail("checkpoint ", checkpoint_dir, ": state.json lacks the model shape: ", e.what());
  }
  // `loom sample` and `loom checkpoint export` build the model this describes before reading its
  // tensors: a damaged shape is named here, not met as an allocation of its size or a division
  // by zero. Every checkpoint holds the f32 values of every parameter in its tensor files.
  try {
    c.validate();
  } catch (const Error& e) {
    fail("checkpoint ", checkpoint_dir, ": state.json's model: ", e.what());
  }
  int64_t tensor_bytes = 0;
  for (const auto& entry : fs::directory_iterator(checkpoint_dir))
    if (entry.path().extension() == ".safetensors" && entry.is_regular_file())
      tensor_bytes += static_cast<int64_t>(entry.file_size());
  if (4 * c.num_parameters() > tensor_bytes)
    fail("checkpoint ", checkpoint_dir, ": state.json's model has ", c.num_parameters(),
         " parameters, more than its tensor files' ", tensor_bytes, " bytes hold (a damaged ",
         "state.json, or tensor files missing)");
  return c;
}

TrainingState load_checkpoint(const std::string& checkpoint_dir, Gpt2& model, AdamW* optimizer) {
  FlatModelState flat{model.params().values(), Tensor(), Tensor()};
  if (optimizer != nullptr) {
    flat.exp_avg = optimizer->m();
    flat.exp_avg_sq = optimizer->v();
  }
  TrainingState s = load_checkpoint(checkpoint_dir, model.params(), flat);
  if (optimizer != nullptr) optimizer->set_steps_taken(s.optimizer_steps);
  if (!s.expert_bias.empty()) model.set_expert_biases(s.expert_bias);
  return s;
}

TrainingState load_checkpoint(const std::string& checkpoint_dir, const ParameterStore& params,
                              FlatModelState& flat, bool all_tensors) {
  json j = read_state_json(checkpoint_dir);
  if (j.value("format", std::string()) == "sharded")
    return load_sharded_checkpoint_into(checkpoint_dir, params, flat);
  SafetensorsFile weights = load_checked(checkpoint_dir, "model.safetensors", j);
  for (const auto& p : params.parameters()) {
    Tensor dst = view_of(flat.values, *p);
    load_into(checkpoint_dir, "model.safetensors", weights, p->name, dst);
  }
  if (all_tensors && weights.tensors.size() != params.parameters().size())
    fail("checkpoint ", checkpoint_dir, ": model.safetensors holds ", weights.tensors.size(),
         " tensors, the model has ", params.parameters().size());
  if (flat.exp_avg.defined()) {
    if (!j.value("has_optimizer", false))
      fail("checkpoint ", checkpoint_dir, ": holds no optimizer state, cannot resume training");
    SafetensorsFile moments = load_checked(checkpoint_dir, "optimizer.safetensors", j);
    for (const auto& p : params.parameters()) {
      Tensor m = view_of(flat.exp_avg, *p);
      Tensor v = view_of(flat.exp_avg_sq, *p);
      load_into(checkpoint_dir, "optimizer.safetensors", moments, p->name + ".exp_avg", m);
      load_into(checkpoint_dir, "optimizer.safetensors", moments, p->name + ".exp_avg_sq", v);
    }
  }
  TrainingState s = training_state_of(checkpoint_dir, j);
  return s;
}

std::vector<FileDigest> verify_checkpoint(const std::string& checkpoint_dir) {
  const json state = read_state_json(checkpoint_dir);
  if (!state.contains("files") || !state["files"].is_object() || state["files"].empty())
    fail("checkpoint ", checkpoint_dir,
         ": state.json records no file digests (written before Loom kept them), nothing to verify");
  std::vector<FileDigest> checked;
  for (const auto& [file, record] : state["files"].items())
    checked.push_back(*verify_file(checkpoint_dir, file, state));  // recorded: one is there
  return checked;
}

}  // namespace loom
