#include "checkpoint/checkpoint.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "base/error.h"
#include "checkpoint/safetensors.h"

namespace loom {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {
constexpr int kFormatVersion = 1;

void write_text_file(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  out.flush();
  if (!out) fail("cannot write ", path.string());
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
  const fs::path tmp_dir = fs::path(checkpoints_dir) / ("step_" + std::to_string(state.step) + ".tmp");
  std::error_code ec;
  fs::create_directories(checkpoints_dir, ec);
  if (ec) fail("cannot create checkpoint directory ", checkpoints_dir, ": ", ec.message());
  fs::remove_all(tmp_dir, ec);
  fs::create_directories(tmp_dir, ec);
  if (ec) fail("cannot create ", tmp_dir.string(), ": ", ec.message());

  const std::map<std::string, std::string> meta = {{"format", "loom-checkpoint"},
                                                   {"step", std::to_string(state.step)}};
  std::vector<std::pair<std::string, Tensor>> weights;
  for (const auto& p : params.parameters()) weights.emplace_back(p->name, view_of(flat.values, *p));
  save_safetensors((tmp_dir / "model.safetensors").string(), weights, meta);
  if (has_optimizer) {
    std::vector<std::pair<std::string, Tensor>> moments;
    for (const auto& p : params.parameters()) {
      moments.emplace_back(p->name + ".exp_avg", view_of(flat.exp_avg, *p));
      moments.emplace_back(p->name + ".exp_avg_sq", view_of(flat.exp_avg_sq, *p));
    }
    save_safetensors((tmp_dir / "optimizer.safetensors").string(), moments, meta);
  }
  json j;
  j["format_version"] = kFormatVersion;
  j["step"] = state.step;
  j["optimizer_steps"] = state.optimizer_steps;
  j["loader"] = {{"shard", state.loader_shard}, {"offset", state.loader_offset},
                 {"epoch", state.loader_epoch}};
  j["seed"] = state.seed;
  if (state.loss_scaler)
    j["loss_scale"] = {{"scale", state.loss_scaler->scale},
                       {"good_steps", state.loss_scaler->good_steps}};
  // Training draws no random numbers after initialisation (no dropout, deterministic data order),
  // so the counter-based generator's key is all the RNG state there is.
  j["rng"] = {{"algorithm", "philox4x32-10"}, {"seed", state.seed}};
  j["has_optimizer"] = has_optimizer;
  j["config"] = state.config_toml;
  json shape = {{"arch", "gpt2"},           {"vocab_size", mc.vocab_size},
                {"max_seq_len", mc.max_seq_len}, {"d_model", mc.d_model},
                {"n_layers", mc.n_layers},   {"n_heads", mc.n_heads}};
  // Parameter shapes, so a reader can check compatibility without the config.
  for (const auto& p : params.parameters()) shape["parameters"][p->name] = p->shape;
  j["model"] = shape;
  write_text_file(tmp_dir / "state.json", j.dump(2) + "\n");

  // Replace an older checkpoint of the same step (a re-run) only once the new one is complete.
  fs::remove_all(final_dir, ec);
  fs::rename(tmp_dir, final_dir, ec);
  if (ec) fail("cannot rename ", tmp_dir.string(), " to ", final_dir.string(), ": ", ec.message());
  return final_dir.string();
}

std::string find_latest_checkpoint(const std::string& checkpoints_dir) {
  std::error_code ec;
  if (!fs::is_directory(checkpoints_dir, ec)) return "";
  int64_t best = -1;
  std::string best_path;
  for (const auto& entry : fs::directory_iterator(checkpoints_dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (!entry.is_directory() || name.rfind("step_", 0) != 0) continue;
    const std::string digits = name.substr(5);
    if (digits.empty() || digits.find_first_not_of("0123456789") != std::string::npos) continue;
    if (!fs::exists(entry.path() / "state.json")) continue;
    const int64_t step = std::stoll(digits);
    if (step > best) {
      best = step;
      best_path = entry.path().string();
    }
  }
  return best_path;
}

Gpt2Config read_checkpoint_model(const std::string& checkpoint_dir) {
  json j = read_state_json(checkpoint_dir);
  try {
    const json& m = j.at("model");
    Gpt2Config c;
    c.vocab_size = m.at("vocab_size").get<int64_t>();
    c.max_seq_len = m.at("max_seq_len").get<int64_t>();
    c.d_model = m.at("d_model").get<int64_t>();
    c.n_layers = m.at("n_layers").get<int64_t>();
    c.n_heads = m.at("n_heads").get<int64_t>();
    return c;
  } catch (const json::exception& e) {
    fail("checkpoint ", checkpoint_dir, ": state.json lacks the model shape: ", e.what());
  }
}

TrainingState load_checkpoint(const std::string& checkpoint_dir, Gpt2& model, AdamW* optimizer) {
  FlatModelState flat{model.params().values(), Tensor(), Tensor()};
  if (optimizer != nullptr) {
    flat.exp_avg = optimizer->m();
    flat.exp_avg_sq = optimizer->v();
  }
  TrainingState s = load_checkpoint(checkpoint_dir, model.params(), flat);
  if (optimizer != nullptr) optimizer->set_steps_taken(s.optimizer_steps);
  return s;
}

TrainingState load_checkpoint(const std::string& checkpoint_dir, const ParameterStore& params,
                              FlatModelState& flat, bool all_tensors) {
  json j = read_state_json(checkpoint_dir);
  const std::string model_file = (fs::path(checkpoint_dir) / "model.safetensors").string();
  SafetensorsFile weights = load_safetensors(model_file);
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
    SafetensorsFile moments =
        load_safetensors((fs::path(checkpoint_dir) / "optimizer.safetensors").string());
    for (const auto& p : params.parameters()) {
      Tensor m = view_of(flat.exp_avg, *p);
      Tensor v = view_of(flat.exp_avg_sq, *p);
      load_into(checkpoint_dir, "optimizer.safetensors", moments, p->name + ".exp_avg", m);
      load_into(checkpoint_dir, "optimizer.safetensors", moments, p->name + ".exp_avg_sq", v);
    }
  }
  TrainingState s;
  try {
    s.step = j.at("step").get<int64_t>();
    s.optimizer_steps = j.at("optimizer_steps").get<int64_t>();
    s.loader_shard = j.at("loader").at("shard").get<int64_t>();
    s.loader_offset = j.at("loader").at("offset").get<int64_t>();
    s.loader_epoch = j.at("loader").at("epoch").get<int64_t>();
    s.seed = j.at("seed").get<uint64_t>();
    s.config_toml = j.value("config", std::string());
    if (j.contains("loss_scale"))
      s.loss_scaler = LossScalerState{j.at("loss_scale").at("scale").get<double>(),
                                      j.at("loss_scale").at("good_steps").get<int64_t>()};
  } catch (const json::exception& e) {
    fail("checkpoint ", checkpoint_dir, ": state.json is incomplete: ", e.what());
  }
  return s;
}

}  // namespace loom
