#include "train/run_compare.h"

#include <algorithm>
#include <cmath>
#include <fstream>

#include "base/error.h"
#include "checkpoint/safetensors.h"

namespace loom {

namespace fs = std::filesystem;

std::vector<nlohmann::json> read_metrics(const fs::path& run_dir) {
  const fs::path path = run_dir / "metrics.jsonl";
  std::ifstream in(path);
  if (!in) fail("cannot read ", path.string());
  std::vector<nlohmann::json> out;
  std::string line;
  int64_t number = 0;
  while (std::getline(in, line)) {
    ++number;
    if (line.empty()) continue;
    try {
      out.push_back(nlohmann::json::parse(line));
    } catch (const nlohmann::json::exception& e) {
      fail(path.string(), ":", number, ": not a JSON object: ", e.what());
    }
  }
  return out;
}

std::vector<double> read_losses(const fs::path& run_dir) {
  std::vector<double> out;
  const std::vector<nlohmann::json> records = read_metrics(run_dir);
  for (size_t i = 0; i < records.size(); ++i) {
    const auto it = records[i].find("loss");
    if (it == records[i].end() || !it->is_number())
      fail((run_dir / "metrics.jsonl").string(), ": record ", i + 1, " has no numeric \"loss\"");
    out.push_back(it->get<double>());
  }
  return out;
}

std::vector<double> read_grad_norms(const fs::path& run_dir) {
  std::vector<double> out;
  const std::vector<nlohmann::json> records = read_metrics(run_dir);
  for (size_t i = 0; i < records.size(); ++i) {
    const auto it = records[i].find("grad_norm");
    if (it == records[i].end() || !(it->is_number() || it->is_null()))
      fail((run_dir / "metrics.jsonl").string(), ": record ", i + 1,
           " has no numeric \"grad_norm\"");
    out.push_back(it->is_null() ? std::nan("") : it->get<double>());
  }
  return out;
}

LossDeviation compare_grad_norms(const std::vector<double>& reference,
                                 const std::vector<double>& got) {
  std::vector<double> ref = reference, run = got;
  for (size_t i = 0; i < std::min(ref.size(), run.size()); ++i)
    if (!std::isfinite(ref[i]) && !std::isfinite(run[i])) ref[i] = run[i] = 0;  // both skipped
  return compare_losses(ref, run);
}

LossDeviation compare_losses(const std::vector<double>& reference, const std::vector<double>& got) {
  if (reference.size() != got.size())
    fail("the run logged ", got.size(), " steps, the reference ", reference.size());
  LossDeviation d;
  for (size_t i = 0; i < reference.size(); ++i) {
    const double denom = std::abs(reference[i]) > 0 ? std::abs(reference[i]) : 1.0;
    const double rel = std::abs(got[i] - reference[i]) / denom;
    // NaN compares false: a NaN loss is an infinite deviation, never a match.
    if (rel > d.max_rel || std::isnan(rel)) {
      d.max_rel = std::isnan(rel) ? INFINITY : rel;
      d.worst_step = static_cast<int64_t>(i) + 1;
    }
  }
  return d;
}

namespace {

std::vector<double> as_doubles(const Tensor& t, const fs::path& file, const std::string& name) {
  if (!is_floating(t.dtype()))
    fail(file.string(), ": tensor ", name, " has dtype ", dtype_name(t.dtype()),
         ", not a floating-point parameter");
  const Tensor d = t.dtype() == DType::kF64 ? t : t.to(DType::kF64);
  const double* p = d.data<double>();
  return std::vector<double>(p, p + d.numel());
}

}  // namespace

WeightsDeviation compare_weights(const fs::path& reference, const fs::path& got) {
  const SafetensorsFile a = load_safetensors(reference.string());
  const SafetensorsFile b = load_safetensors(got.string());
  for (const auto& [name, t] : b.tensors)
    if (!a.tensors.contains(name))
      fail(got.string(), " has tensor ", name, " that ", reference.string(), " does not");
  WeightsDeviation out;
  double total_diff2 = 0, total_norm2 = 0, largest_diff2 = -1;
  for (const std::string& name : a.names) {
    const Tensor& x = a.tensors.at(name);
    const auto it = b.tensors.find(name);
    if (it == b.tensors.end())
      fail(got.string(), " has no tensor ", name, " (", reference.string(), " does)");
    const Tensor& y = it->second;
    if (x.shape() != y.shape())
      fail(got.string(), ": tensor ", name, " has shape ", shape_str(y.shape()), ", ",
           reference.string(), " has ", shape_str(x.shape()));
    const std::vector<double> u = as_doubles(x, reference, name), v = as_doubles(y, got, name);
    double diff2 = 0, norm2 = 0, diff_max = 0, ref_max = 0;
    for (size_t i = 0; i < u.size(); ++i) {
      const double e = std::abs(u[i] - v[i]);
      diff2 += e * e;
      norm2 += u[i] * u[i];
      diff_max = std::max(diff_max, std::isnan(e) ? INFINITY : e);
      ref_max = std::max(ref_max, std::abs(u[i]));
    }
    TensorDeviation d{name, norm2 > 0 ? std::sqrt(diff2 / norm2) : std::sqrt(diff2),
                      ref_max > 0 ? diff_max / ref_max : diff_max};
    if (std::isnan(d.rel_l2)) d.rel_l2 = INFINITY;
    total_diff2 += diff2;
    total_norm2 += norm2;
    if (diff2 > largest_diff2 || std::isnan(diff2)) {
      largest_diff2 = std::isnan(diff2) ? INFINITY : diff2;
      out.largest = name;
    }
    if (out.worst.empty() || d.rel_l2 > out.max_rel_l2) {
      out.max_rel_l2 = d.rel_l2;
      out.worst = name;
    }
    out.tensors.push_back(std::move(d));
  }
  out.rel_l2 = total_norm2 > 0 ? std::sqrt(total_diff2 / total_norm2) : std::sqrt(total_diff2);
  if (std::isnan(out.rel_l2)) out.rel_l2 = INFINITY;
  return out;
}

}  // namespace loom
