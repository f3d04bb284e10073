#include "train/layout_check.h"

#include <stdlib.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "base/error.h"
#include "train/run_compare.h"
#include "train/trainer.h"

namespace loom {
namespace {

namespace fs = std::filesystem;

constexpr const char* kKeys =
    "dp, tp, pp, cp, ep, zero, dp_shard, schedule, virtual_stages (v), sequence_parallel (sp), "
    "micro_batch_size "
    "(mbs), "
    "recompute, cp_comm, ep_dispatch";

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

std::vector<std::string_view> split(std::string_view s, char sep) {
  std::vector<std::string_view> out;
  size_t start = 0;
  for (size_t i = 0; i <= s.size(); ++i) {
    if (i == s.size() || s[i] == sep) {
      out.push_back(s.substr(start, i - start));
      start = i + 1;
    }
  }
  return out;
}

bool parse_int(std::string_view v, int64_t& out) {
  const char* end = v.data() + v.size();
  auto [p, ec] = std::from_chars(v.data(), end, out);
  return ec == std::errc() && p == end;
}

}  // namespace

std::string CheckLayout::name() const {
  std::string s;
  const auto add = [&s](const std::string& item) { s += (s.empty() ? "" : ",") + item; };
  if (dp > 1) add("dp=" + std::to_string(dp));
  if (tp > 1) add("tp=" + std::to_string(tp));
  if (pp > 1) add("pp=" + std::to_string(pp));
  if (cp > 1) add("cp=" + std::to_string(cp));
  if (ep > 1) add("ep=" + std::to_string(ep));
  if (zero) add("zero=" + std::to_string(*zero));
  if (dp_shard) add("dp_shard=" + std::to_string(*dp_shard));
  if (schedule) add("schedule=" + *schedule);
  if (virtual_stages) add("v=" + std::to_string(*virtual_stages));
  if (sequence_parallel) add(std::string("sp=") + (*sequence_parallel ? "1" : "0"));
  if (micro_batch_size) add("mbs=" + std::to_string(*micro_batch_size));
  if (recompute) add("recompute=" + *recompute);
  if (cp_comm) add("cp_comm=" + *cp_comm);
  if (ep_dispatch) add("ep_dispatch=" + *ep_dispatch);
  return s.empty() ? "one device" : s;
}

std::vector<CheckLayout> parse_layouts(std::string_view text) {
  std::vector<CheckLayout> out;
  for (std::string_view layout_text : split(text, ';')) {
    layout_text = trim(layout_text);
    if (layout_text.empty()) continue;  // "dp=2;" or "dp=2;;tp=2"
    CheckLayout l;
    std::vector<std::string> seen;
    for (std::string_view item_raw : split(layout_text, ',')) {
      const std::string_view item = trim(item_raw);
      const auto bad = [&](const std::string& why) {
        fail("layout \"", layout_text, "\": item \"", item, "\" ", why);
      };
      if (item.empty()) bad("is empty (items are key=value, separated by ',')");
      const size_t eq = item.find('=');
      if (eq == std::string_view::npos) bad("is not key=value (keys: " + std::string(kKeys) + ")");
      std::string key(trim(item.substr(0, eq)));
      const std::string_view value = trim(item.substr(eq + 1));
      if (key == "v") key = "virtual_stages";
      if (key == "sp") key = "sequence_parallel";
      if (key == "mbs") key = "micro_batch_size";
      if (std::find(seen.begin(), seen.end(), key) != seen.end())
        bad("repeats the key " + key);
      seen.push_back(key);
      int64_t n = 0;
      const bool is_int = parse_int(value, n);
      const auto positive = [&]() {
        if (!is_int || n <= 0 || n > 1'000'000) bad("needs a positive integer value");
        return n;
      };
      if (key == "dp") {
        l.dp = static_cast<int>(positive());
      } else if (key == "tp") {
        l.tp = static_cast<int>(positive());
      } else if (key == "pp") {
        l.pp = static_cast<int>(positive());
      } else if (key == "cp") {
        l.cp = static_cast<int>(positive());
      } else if (key == "ep") {
        l.ep = static_cast<int>(positive());
      } else if (key == "zero") {
        if (!is_int || n < 0 || n > 3) bad("needs a ZeRO stage 0, 1, 2 or 3");
        l.zero = static_cast<int>(n);
      } else if (key == "dp_shard") {
        l.dp_shard = static_cast<int>(positive());
      } else if (key == "schedule") {
        if (!is_pipeline_schedule(value)) {
          std::string known;
          for (std::string_view s : kPipelineSchedules)
            known += detail::concat(known.empty() ? "" : ", ", s);
          bad("needs a schedule: " + known);
        }
        l.schedule = std::string(value);
      } else if (key == "virtual_stages") {
        l.virtual_stages = static_cast<int>(positive());
      } else if (key == "sequence_parallel") {
        if (value == "1" || value == "true") l.sequence_parallel = true;
        else if (value == "0" || value == "false") l.sequence_parallel = false;
        else bad("needs 0, 1, true or false");
      } else if (key == "micro_batch_size") {
        l.micro_batch_size = positive();
      } else if (key == "recompute") {
        if (value != "none" && value != "full" && value != "selective")
          bad("needs none, full or selective");
        l.recompute = std::string(value);
      } else if (key == "cp_comm") {
        if (value != "all_gather" && value != "ring") bad("needs all_gather or ring");
        l.cp_comm = std::string(value);
      } else if (key == "ep_dispatch") {
        if (value != "all_gather" && value != "all_to_all") bad("needs all_gather or all_to_all");
        l.ep_dispatch = std::string(value);
      } else {
        bad("has an unknown key '" + key + "' (keys: " + kKeys + ")");
      }
    }
    if (int64_t{l.dp} * l.tp * l.pp > 4096)
      fail("layout \"", layout_text, "\": dp × tp × pp = ", int64_t{l.dp} * l.tp * l.pp,
           " thread ranks is too many for one machine");
    out.push_back(l);
  }
  if (out.empty()) fail("no layouts in \"", text, "\" (for example \"dp=2;tp=2,pp=2\")");
  return out;
}

bool LayoutCheckResult::all_ok() const {
  return std::all_of(rows.begin(), rows.end(), [](const LayoutCheckRow& r) { return r.status == "ok"; });
}

namespace {

// The config every run shares: the shrunk model, `steps` steps with a checkpoint at the last,
// no evaluation, thread ranks.
Config common_config(const Config& in, const LayoutCheckOptions& o) {
  Config c = in;
  if (o.max_layers > 0) c.model.n_layers = std::min(c.model.n_layers, o.max_layers);
  if (o.max_seq_len > 0) c.model.seq_len = std::min(c.model.seq_len, o.max_seq_len);
  c.train.steps = o.steps;
  c.train.warmup_steps = std::min(c.train.warmup_steps, o.steps);
  c.train.save_every = o.steps;
  c.train.eval_every = 0;
  c.data.val.clear();
  c.runtime.backend = "local";
  return c;
}

Config reference_config(const Config& common) {
  Config c = common;
  c.parallel.dp = c.parallel.tp = c.parallel.pp = c.parallel.cp = c.parallel.ep = 1;
  c.parallel.zero = 0;
  c.parallel.dp_shard = 0;
  c.parallel.virtual_stages = 1;
  c.parallel.sequence_parallel = false;
  c.parallel.layer_split.clear();
  c.runtime.ranks = 1;
  return c;
}

Config layout_config(const Config& common, const Config& user, const CheckLayout& l) {
  Config c = common;
  ParallelConfig& par = c.parallel;
  const ParallelConfig& base = user.parallel;
  par.dp = l.dp;
  par.tp = l.tp;
  par.pp = l.pp;
  par.cp = l.cp;
  par.ep = l.ep;
  par.zero = l.zero.value_or(l.dp > 1 ? base.zero : 0);
  par.dp_shard = l.dp_shard.value_or(0);
  par.sequence_parallel = l.sequence_parallel.value_or(l.tp > 1 && base.sequence_parallel);
  // zb-v named without v: its two chunks.
  par.virtual_stages =
      l.virtual_stages.value_or(l.pp <= 1                           ? 1
                                : l.schedule.value_or("") == "zb-v" ? 2
                                                                    : base.virtual_stages);
  // Chunks without a schedule named: interleaved, unless the config's own schedule takes them.
  par.schedule = l.schedule.value_or(l.virtual_stages && *l.virtual_stages > 1 &&
                                             !schedule_takes_chunks(base.schedule)
                                         ? std::string("interleaved")
                                         : base.schedule);
  if (par.pp != base.pp || par.virtual_stages != base.virtual_stages) par.layer_split.clear();
  if (l.cp_comm) par.cp_comm = *l.cp_comm;
  if (l.ep_dispatch) par.ep_dispatch = *l.ep_dispatch;
  if (l.recompute) {
    par.recompute = *l.recompute;
    c.train.recompute = false;  // the deprecated alias would otherwise turn "none" into "full"
  }
  c.runtime.ranks = l.ranks();
  TrainConfig& t = c.train;
  if (l.micro_batch_size) {
    t.micro_batch_size = *l.micro_batch_size;
  } else if (t.batch_size > 0 && t.micro_batch_size > 0 &&
             t.batch_size % (t.micro_batch_size * l.dp) != 0 && t.batch_size % l.dp == 0) {
    // The config's micro-batch does not fit this dp: take the largest one that does (the
    // micro-batch size changes the summation order only, not the step's computation).
    int64_t m = std::min(t.micro_batch_size, t.batch_size / l.dp);
    while ((t.batch_size / l.dp) % m != 0) --m;
    t.micro_batch_size = m;
  }
  return c;
}

std::string run_dir_name(size_t index, const std::string& layout) {
  std::string s = std::to_string(index) + "_";
  for (char ch : layout) {
    if (ch == '=') continue;  // "dp=2,tp=2" -> "1_dp2_tp2"
    s += ch == ',' || ch == ' ' ? '_' : ch;
  }
  return s;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Removes the temp root when the check ends, also by an exception, unless kept.
struct RemoveDir {
  fs::path path;
  bool active = false;
  RemoveDir() = default;
  RemoveDir(const RemoveDir&) = delete;
  RemoveDir& operator=(const RemoveDir&) = delete;
  ~RemoveDir() {
    std::error_code ec;
    if (active) fs::remove_all(path, ec);
  }
};

std::string one_line(std::string s) {
  for (size_t pos = 0; (pos = s.find('\n', pos)) != std::string::npos;) s.replace(pos, 1, "; ");
  return s;
}

}  // namespace

LayoutCheckResult check_layouts(const Config& config, const std::vector<CheckLayout>& layouts,
                                const LayoutCheckOptions& options) {
  if (options.steps <= 0) fail("loom check: --steps must be positive, got ", options.steps);
  if (!(options.tolerance >= 0)) fail("loom check: --tolerance must be >= 0");
  LayoutCheckResult result;
  const Config common = common_config(config, options);
  result.steps = options.steps;
  result.n_layers = common.model.n_layers;
  result.seq_len = common.model.seq_len;
  result.config_n_layers = config.model.n_layers;
  result.config_seq_len = config.model.seq_len;
  result.batch_size = common.train.batch_size;
  result.tolerance = options.tolerance;

  RemoveDir cleanup;
  fs::path root;
  if (!options.out_dir.empty()) {
    root = options.out_dir;
    fs::create_directories(root);
  } else {
    std::string pattern = (fs::temp_directory_path() / "loom_check_XXXXXX").string();
    if (mkdtemp(pattern.data()) == nullptr) fail("cannot create a temporary directory ", pattern);
    root = pattern;
    cleanup.path = root;
    cleanup.active = !options.keep;
  }
  const bool kept = !cleanup.active;
  if (kept) result.out_dir = root.string();

  const int count = static_cast<int>(layouts.size()) + 1;
  const auto train = [&](const Config& c, const fs::path& dir) {
    fs::remove_all(dir);
    TrainOptions o;
    o.run_dir = dir.string();
    o.progress = false;
    run_training(c, o);
  };
  const auto final_weights = [&](const fs::path& dir) {
    return dir / "checkpoints" / ("step_" + std::to_string(options.steps)) / "model.safetensors";
  };

  // The reference: one device. Without it there is nothing to compare, so its failure throws.
  const fs::path ref_dir = root / "0_reference";
  {
    const Config c = reference_config(common);
    result.reference_micro_batch_size = c.train.micro_batch_size;
    if (options.on_run) options.on_run(0, count, "one device (reference)");
    const auto t0 = std::chrono::steady_clock::now();
    try {
      train(c, ref_dir);
    } catch (const Error& e) {
      fail("the one-device reference run failed: ", e.what());
    }
    result.reference_seconds = seconds_since(t0);
    result.reference_losses = read_losses(ref_dir);
    result.reference_grad_norms = read_grad_norms(ref_dir);
  }

  for (size_t i = 0; i < layouts.size(); ++i) {
    const CheckLayout& l = layouts[i];
    const Config c = layout_config(common, config, l);
    LayoutCheckRow row;
    row.layout = l.name();
    row.ranks = l.ranks();
    row.zero = c.parallel.zero;
    row.sequence_parallel = c.parallel.sequence_parallel;
    row.schedule = l.pp > 1 ? c.parallel.schedule : "";
    row.virtual_stages = c.parallel.virtual_stages;
    row.micro_batch_size = c.train.micro_batch_size;
    row.recompute = c.resolved_recompute();
    const fs::path dir = root / run_dir_name(i + 1, row.layout);
    if (kept) row.run_dir = dir.string();
    if (options.on_run) options.on_run(static_cast<int>(i) + 1, count, row.layout);
    const auto t0 = std::chrono::steady_clock::now();
    try {
      train(c, dir);
      const LossDeviation loss = compare_losses(result.reference_losses, read_losses(dir));
      row.loss_max_rel_dev = loss.max_rel;
      row.loss_worst_step = loss.worst_step;
      const LossDeviation norm =
          compare_grad_norms(result.reference_grad_norms, read_grad_norms(dir));
      row.grad_norm_max_rel_dev = norm.max_rel;
      row.grad_norm_worst_step = norm.worst_step;
      const WeightsDeviation w = compare_weights(final_weights(ref_dir), final_weights(dir));
      row.param_rel_dev = w.rel_l2;
      row.param_largest_tensor = w.largest;
      row.param_tensor_max_rel_dev = w.max_rel_l2;
      row.param_tensor_worst = w.worst;
      for (const TensorDeviation& t : w.tensors)
        row.param_elem_max_rel_dev = std::max(row.param_elem_max_rel_dev, t.rel_max);
      const bool within = row.loss_max_rel_dev <= options.tolerance &&
                          row.grad_norm_max_rel_dev <= options.tolerance &&
                          row.param_rel_dev <= options.tolerance;
      row.status = within ? "ok" : "DIFFERS";
    } catch (const Error& e) {
      row.status = "error";
      row.error = one_line(e.what());
    } catch (const std::exception& e) {
      row.status = "error";
      row.error = one_line(std::string("internal error: ") + e.what());
    }
    row.seconds = seconds_since(t0);
    if (!kept) {
      std::error_code ec;
      fs::remove_all(dir, ec);  // keep the temp dir small while the check goes on
    }
    result.rows.push_back(std::move(row));
  }
  return result;
}

namespace {

std::string sci(double v) {
  if (std::isinf(v)) return "inf";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1e", v);
  return buf;
}

}  // namespace

std::string format_layout_check(const LayoutCheckResult& r) {
  size_t width = std::string("one device (reference)").size();
  for (const LayoutCheckRow& row : r.rows) width = std::max(width, row.layout.size());
  width += 4;
  std::string out;
  char buf[512];
  const auto shape = [](int64_t used, int64_t configured) {
    return used == configured ? std::to_string(used)
                              : std::to_string(used) + " (config " + std::to_string(configured) + ")";
  };
  out += "model: n_layers " + shape(r.n_layers, r.config_n_layers) + ", seq_len " +
         shape(r.seq_len, r.config_seq_len) + "; batch " + std::to_string(r.batch_size) +
         " sequences, " + std::to_string(r.steps) + " steps; tolerance " + sci(r.tolerance) + "\n";
  const auto line = [&](const std::string& layout, int ranks, const std::string& loss,
                        const std::string& norm, const std::string& param,
                        const std::string& status) {
    std::snprintf(buf, sizeof buf, "%-*s %5d  %16s  %16s  %13s  ", static_cast<int>(width),
                  layout.c_str(), ranks, loss.c_str(), norm.c_str(), param.c_str());
    out += buf + status + "\n";
  };
  std::snprintf(buf, sizeof buf, "%-*s %5s  %16s  %16s  %13s  status\n", static_cast<int>(width),
                "layout", "ranks", "loss max rel dev", "norm max rel dev", "param rel dev");
  out += buf;
  if (!r.reference_losses.empty()) {
    std::snprintf(buf, sizeof buf, "loss %.4f -> %.4f", r.reference_losses.front(),
                  r.reference_losses.back());
    line("one device (reference)", 1, "-", "-", "-", buf);
  }
  for (const LayoutCheckRow& row : r.rows) {
    if (row.status == "error") {
      line(row.layout, row.ranks, "-", "-", "-", "error: " + row.error);
      continue;
    }
    std::string status = row.status;
    if (row.status == "DIFFERS") {
      std::vector<std::string> where;
      if (!(row.loss_max_rel_dev <= r.tolerance))
        where.push_back("loss at step " + std::to_string(row.loss_worst_step));
      if (!(row.grad_norm_max_rel_dev <= r.tolerance))
        where.push_back("gradient norm at step " + std::to_string(row.grad_norm_worst_step));
      if (!(row.param_rel_dev <= r.tolerance))
        where.push_back("parameters, most in " + row.param_largest_tensor);
      status += " (";
      for (size_t i = 0; i < where.size(); ++i) status += (i ? "; " : "") + where[i];
      status += ")";
    }
    line(row.layout, row.ranks, sci(row.loss_max_rel_dev), sci(row.grad_norm_max_rel_dev),
         sci(row.param_rel_dev), status);
  }
  if (!r.out_dir.empty()) out += "runs kept in " + r.out_dir + "\n";
  return out;
}

std::string layout_check_json(const LayoutCheckResult& r) {
  nlohmann::json rows = nlohmann::json::array();
  for (const LayoutCheckRow& row : r.rows) {
    nlohmann::json j = {{"layout", row.layout},
                        {"ranks", row.ranks},
                        {"zero", row.zero},
                        {"sequence_parallel", row.sequence_parallel},
                        {"micro_batch_size", row.micro_batch_size},
                        {"recompute", row.recompute},
                        {"status", row.status},
                        {"seconds", row.seconds}};
    if (!row.schedule.empty()) {
      j["schedule"] = row.schedule;
      j["virtual_stages"] = row.virtual_stages;
    }
    if (row.status == "error") {
      j["error"] = row.error;
    } else {
      // JSON has no infinity: a NaN/inf deviation is written as null.
      const auto num = [](double v) { return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(); };
      j["loss_max_rel_dev"] = num(row.loss_max_rel_dev);
      j["loss_worst_step"] = row.loss_worst_step;
      j["grad_norm_max_rel_dev"] = num(row.grad_norm_max_rel_dev);
      j["grad_norm_worst_step"] = row.grad_norm_worst_step;
      j["param_rel_dev"] = num(row.param_rel_dev);
      j["param_largest_tensor"] = row.param_largest_tensor;
      j["param_tensor_max_rel_dev"] = num(row.param_tensor_max_rel_dev);
      j["param_tensor_worst"] = row.param_tensor_worst;
      j["param_elem_max_rel_dev"] = num(row.param_elem_max_rel_dev);
    }
    if (!row.run_dir.empty()) j["run_dir"] = row.run_dir;
    rows.push_back(std::move(j));
  }
  nlohmann::json doc = {{"steps", r.steps},
                        {"n_layers", r.n_layers},
                        {"seq_len", r.seq_len},
                        {"config_n_layers", r.config_n_layers},
                        {"config_seq_len", r.config_seq_len},
                        {"batch_size", r.batch_size},
                        {"tolerance", r.tolerance},
                        {"reference",
                         {{"losses", r.reference_losses},
                          {"grad_norms", r.reference_grad_norms},
                          {"micro_batch_size", r.reference_micro_batch_size},
                          {"seconds", r.reference_seconds}}},
                        {"rows", std::move(rows)},
                        {"all_ok", r.all_ok()}};
  if (!r.out_dir.empty()) doc["out_dir"] = r.out_dir;
  return doc.dump(2) + "\n";
}

}  // namespace loom
