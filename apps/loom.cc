// loom — the command line: train, launch, plan, check, data prepare/synth/inspect, sample, bench
// train, schedule. This is the only place that turns errors into exit codes: loom::Error (a user,
// config, data or environment mistake) prints one line "loom: error: ..." and exits 1; bad
// command-line syntax exits 2 (CLI11's usage message).
#include <signal.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>

#include "base/error.h"
#include "base/thread_pool.h"
#include "bench_attention.h"
#include "bench_comm.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/export.h"
#include "comm/flight_recorder.h"
#include "comm/mpi/launch_env.h"
#include "config/config.h"
#include "data/bpe_tokenizer.h"
#include "data/dataset.h"
#include "data/inspect.h"
#include "data/tokenizer.h"
#include "kernels/cpu/fma_peak.h"
#include "kernels/cpu/gemm.h"
#include "kernels/ops.h"
#include "launch/supervisor.h"
#include "parallel/pipeline_schedule.h"
#include "planner/planner.h"
#include "train/benchmark.h"
#include "train/generate.h"
#include "train/layout_check.h"
#include "train/run_control.h"
#include "train/train_data.h"
#include "train/trainer.h"

namespace {

using namespace loom;

// CLI11's PositiveNumber / NonNegativeNumber reject a 0 with "Value 0 not in range 0.000000 to
// 1797693134862315708...": these say it plainly ("--devices: must be positive, got 0").
CLI::Validator number_at_least(double least, bool inclusive, const std::string& what) {
  return CLI::Validator(
      [=](std::string& text) -> std::string {
        char* end = nullptr;
        const double v = std::strtod(text.c_str(), &end);
        const bool number = end != text.c_str() && *end == '\0';
        if (number && (inclusive ? v >= least : v > least)) return "";
        return "must be " + what + ", got '" + text + "'";
      },
      what == "positive" ? "POSITIVE" : "NONNEGATIVE");
}
const CLI::Validator kPositive = number_at_least(0, false, "positive");
const CLI::Validator kNonNegative = number_at_least(0, true, "zero or more");

struct TrainArgs {
  std::string config_path;
  std::vector<std::string> sets;
  std::string run_dir;
  std::string resume;
  int64_t stop_after = 0;
  bool quiet = false;
  int ranks = 0;
};

int cmd_train(const TrainArgs& a) {
  Config config = load_config(a.config_path);
  for (const auto& s : a.sets) apply_override(config, s);
  if (a.ranks > 0) config.runtime.ranks = a.ranks;
  resolve_layout(config);
  validate(config);
  TrainOptions options;
  options.run_dir = a.run_dir.empty()
                        ? "runs/" + std::filesystem::path(a.config_path).stem().string()
                        : a.run_dir;
  options.resume = a.resume;
  options.stop_after = a.stop_after;
  options.progress = !a.quiet;
  options.stop_on_signal = true;
  install_stop_signals();
  // Under mpirun/srun every process runs this: one of them (world rank 0) speaks for the job.
  const bool speaks = !started_by_launcher(config) || detect_launch_env().rank == 0;
  if (speaks)
    std::fprintf(
        stderr,
        "loom train: %s -> %s (%d rank%s: dp %d, pp %d, tp %d%s, zero %d; %ld steps, %ld "
        "micro-batch%s of %ld x %ld tokens per dp rank per step)\n",
        a.config_path.c_str(), options.run_dir.c_str(), config.runtime.ranks,
        config.runtime.ranks == 1 ? "" : "s", config.parallel.dp, config.parallel.pp,
        config.parallel.tp,
        ((config.parallel.cp > 1 ? ", cp " + std::to_string(config.parallel.cp) : "") +
         (config.parallel.ep > 1 ? ", ep " + std::to_string(config.parallel.ep) : ""))
            .c_str(),
        config.parallel.zero, static_cast<long>(config.train.steps),
        static_cast<long>(config.grad_accum_steps()), config.grad_accum_steps() == 1 ? "" : "es",
        static_cast<long>(config.train.micro_batch_size), static_cast<long>(config.model.seq_len));
  TrainSummary s = run_training(config, options);
  if (s.stopped_by_signal != 0) {  // every rank stopped at the same step, with a checkpoint
    if (speaks)
      std::fprintf(
          stderr,
          "stopped by SIG%s after step %ld of %ld; checkpoint %s (continue with --resume auto)\n",
          sigabbrev_np(s.stopped_by_signal), static_cast<long>(s.last_step),
          static_cast<long>(config.train.steps), s.last_checkpoint.c_str());
    return 128 + s.stopped_by_signal;
  }
  if (!speaks) return 0;
  if (s.last_step == s.start_step) {  // resumed where train.steps ends: nothing was trained
    std::fprintf(stderr,
                 "done: nothing to train, the run is at step %ld of train.steps = %ld%s%s\n",
                 static_cast<long>(s.last_step), static_cast<long>(config.train.steps),
                 s.last_checkpoint.empty() ? "" : "; checkpoint ", s.last_checkpoint.c_str());
    return 0;
  }
  std::fprintf(stderr, "done: step %ld, loss %.4f (first %.4f)%s, %.0f tok/s, peak tensor memory %.1f MiB, %.2f s in checkpoint saves\n",
               static_cast<long>(s.last_step), s.last_loss, s.first_loss,
               s.last_val_loss >= 0 ? (", val loss " + std::to_string(s.last_val_loss)).c_str() : "",
               s.tokens_per_s, static_cast<double>(s.peak_bytes) / 1048576.0,
               s.checkpoint_stall_s);
  return 0;
}

// `loom launch [options] -- COMMAND...`: runs the command until it succeeds, restarting it after
// failures (launch/supervisor.h). A `loom train` in the command must resume, or every restart
// would start the run over; its run directory is watched for progress unless --run-dir names one.
int cmd_launch(LaunchOptions options, const std::vector<std::string>& command) {
  if (command.empty()) fail("no command to run: loom launch [options] -- COMMAND ...");
  const TrainCommand train = inspect_train_command(command);
  if (train.is_loom_train && !train.resumes)
    fail(
        "the command's `loom train` has no --resume, so every restart would start "
        "the run over: add --resume auto");
  if (options.run_dir.empty()) options.run_dir = train.run_dir;
  const LaunchResult r = supervise(command, options, [](const std::string& line) {
    std::fprintf(stderr, "loom launch: %s\n", line.c_str());
  });
  if (r.exit_code != 0 && !r.interrupted && r.attempts.size() > 1)
    std::fprintf(stderr, "loom launch: the job failed %zu times%s\n", r.attempts.size(),
                 options.run_dir.empty()
                     ? ""
                     : ("; attempts in " + options.run_dir + "/launch.jsonl").c_str());
  return r.exit_code;
}

struct CheckArgs {
  std::string config_path;
  std::vector<std::string> sets;
  std::string layouts = kDefaultCheckLayouts;
  LayoutCheckOptions options;
  std::string json_path;
  bool quiet = false;
  const CLI::Option* tolerance = nullptr;  // given on the command line when count() > 0
};

// Trains the config's model under each layout and once on one device; prints the deviations.
// Exit code 0 when every layout matches within the tolerance, 1 when one differs or fails.
int cmd_check(CheckArgs& a) {
  const std::vector<CheckLayout> layouts = parse_layouts(a.layouts);  // syntax errors first
  Config config = load_config(a.config_path);
  for (const auto& s : a.sets) apply_override(config, s);
  // 16-bit GEMM operands put layouts ~1e-3 apart, not fp32's ~1e-7 (docs/check.md): a
  // tolerance not given follows the precision.
  if ((a.tolerance == nullptr || a.tolerance->count() == 0) &&
      config.runtime.matmul_precision != "fp32" && config.runtime.matmul_precision != "tf32")
    a.options.tolerance = kSixteenBitCheckTolerance;
  if (!a.quiet)
    a.options.on_run = [](int index, int count, const std::string& name) {
      std::fprintf(stderr, "loom check: [%d/%d] %s\n", index + 1, count, name.c_str());
    };
  const LayoutCheckResult r = check_layouts(config, layouts, a.options);
  std::cout << format_layout_check(r) << std::flush;
  if (!a.json_path.empty()) {
    std::ofstream out(a.json_path);
    out << layout_check_json(r);
    if (!out) fail("cannot write ", a.json_path);
  }
  return r.all_ok() ? 0 : 1;
}

// `loom data inspect`: each spec at seq_len / vocab; with a config, its data keys' corpora at its
// model's, and the training sources' shares and passes over the run (TrainData's start-up lines).
// Exit 1 when an id is past the vocabulary.
int cmd_inspect(const std::vector<std::string>& specs, int64_t seq_len, int64_t vocab, int64_t eot,
                const std::string& config_path, const std::vector<std::string>& sets) {
  if (specs.empty() && config_path.empty())
    fail("loom data inspect: give shard specs, or --config CONFIG.toml");
  int64_t outside = 0;
  const auto inspect = [&](const std::string& label, const std::string& spec, int64_t t,
                           int64_t v) {
    if (!label.empty()) std::cout << label << " = ";
    const CorpusSummary corpus = inspect_corpus(spec, t, v, eot);
    std::cout << format_corpus(corpus, t, v, eot);
    outside += corpus.ids_outside();
  };
  for (const std::string& spec : specs) inspect("", spec, seq_len, vocab);
  if (!config_path.empty()) {
    Config config = load_config(config_path);
    for (const auto& s : sets) apply_override(config, s);
    validate(config);
    const DataConfig& d = config.data;
    // The documents the run will mask, or whose boundaries it takes out of the loss.
    if ((d.document_mask || d.eod_mask_loss) && eot < 0) eot = d.eot_token;
    const int64_t t = config.model.seq_len, v = config.model.vocab_size;
    if (d.blend.empty()) {
      inspect("data.train", d.train, t, v);
    } else {
      const std::vector<BlendSource> sources = parse_data_blend(d.blend);
      for (size_t s = 0; s < sources.size(); ++s)
        inspect("data.blend source " + std::to_string(s + 1), sources[s].spec, t, v);
    }
    if (!d.val.empty()) inspect("data.val", d.val, t, v);
    if (!d.val_sets.empty())
      for (const ValSet& set : parse_val_sets(d.val_sets))
        inspect("data.val_sets " + set.name, set.spec, t, v);
    // Each training source's share and the passes over it the run makes, as training says.
    const TrainData data(config, config.train.micro_batch_size, t, 0, 1);
    std::cout << data.describe(config.train.steps * config.train.batch_size * t);
  }
  return outside > 0 ? 1 : 0;
}

// `loom checkpoint verify`: each path is a checkpoint (step_N), a directory of them, or a run
// directory (its checkpoints/). Every checkpoint is checked; exit 1 when any is not as written.
int cmd_verify(const std::vector<std::string>& paths) {
  int bad = 0, checked = 0, not_found = 0;
  for (const std::string& path : paths) {
    const std::vector<std::string> dirs = checkpoints_at(path);
    if (dirs.empty()) {
      std::fprintf(stderr,
                   "loom: error: %s: no checkpoint there (expected step_N/state.json, "
                   "step_N directories or RUN_DIR/checkpoints)\n",
                   path.c_str());
      ++not_found;
      continue;
    }
    for (const std::string& dir : dirs) {
      ++checked;
      try {
        const std::vector<FileDigest> files = verify_checkpoint(dir);
        int64_t bytes = 0;
        for (const FileDigest& f : files) bytes += f.bytes;
        std::printf("ok   %s (%zu files, %.1f MiB)\n", dir.c_str(), files.size(),
                    static_cast<double>(bytes) / (1 << 20));
      } catch (const loom::Error& e) {
        std::printf("BAD  %s\n", dir.c_str());
        std::fprintf(stderr, "loom: error: %s\n", e.what());
        ++bad;
      }
    }
  }
  if (bad > 0)
    std::fprintf(stderr, "loom: %d of %d checkpoint(s) failed verification\n", bad, checked);
  return bad > 0 || not_found > 0 ? 1 : 0;
}

int cmd_sample(const std::string& checkpoint_path, const std::string& prompt,
               const SampleOptions& opt, uint64_t seed, int threads,
               const std::string& tokenizer_path) {
  // A run directory (or one of checkpoints): its newest; nothing there: the path as given, so
  // that reading it says what is missing.
  const std::vector<std::string> found = checkpoints_at(checkpoint_path);
  const std::string checkpoint = found.empty() ? checkpoint_path : found.back();
  if (checkpoint != checkpoint_path) std::fprintf(stderr, "sampling from %s\n", checkpoint.c_str());
  Gpt2Config mc = read_checkpoint_model(checkpoint);
  Gpt2 model(mc);
  model.build(DType::kF32, Device::cpu(), 0);
  load_checkpoint(checkpoint, model, nullptr);
  RuntimeConfig runtime;  // one rank; 0 threads = all cores, as in [runtime] threads_per_rank
  runtime.threads_per_rank = threads;
  ThreadPool pool(runtime.resolved_threads_per_rank());
  Context ctx{&pool, Device::cpu(), DType::kF32};
  RandomStream rng(seed, "sample");
  if (!tokenizer_path.empty()) {  // the model's own BPE vocabulary (an imported Hub model's)
    const BpeTokenizer tok(tokenizer_path);
    if (mc.vocab_size < tok.vocab_size())
      fail("checkpoint ", checkpoint, ": vocab_size ", mc.vocab_size, " is smaller than ",
           tok.path(), "'s ", tok.vocab_size(), " tokens: a model of another vocabulary");
    const std::vector<int32_t> ids = tok.encode(prompt);  // with the BOS the tokenizer adds
    SampleOptions in_vocabulary = opt;
    in_vocabulary.vocab = tok.vocab_size();  // never a padding row of the model's
    const std::vector<int32_t> out = generate(ctx, model, ids, in_vocabulary, rng);
    // The prompt as given, then the text the new tokens add to it.
    std::cout << prompt
              << tok.decode_after(
                     ids, {out.begin() + static_cast<std::ptrdiff_t>(ids.size()), out.end()})
              << std::endl;
    return 0;
  }
  ByteTokenizer tok;
  if (mc.vocab_size < ByteTokenizer::kVocabSize)
    fail("checkpoint ", checkpoint, ": vocab_size ", mc.vocab_size,
         " is smaller than the byte tokenizer's 256");
  std::vector<int32_t> out = generate(ctx, model, tok.encode(prompt), opt, rng);
  std::string text;
  for (int32_t t : out) text += t < 256 ? static_cast<char>(t) : '?';
  std::cout << text << std::endl;
  return 0;
}

int cmd_bench(const std::string& shape, const BenchOptions& options, bool json) {
  BenchResult r = benchmark_training(find_bench_shape(shape), options);
  if (json) {
    nlohmann::json j = {{"shape", r.shape},
                        {"threads", r.threads},
                        {"ranks", r.ranks},
                        {"zero", r.zero},
                        {"ep", r.ep},
                        {"ep_dispatch", r.ep_dispatch},
                        {"rank_parameters", r.rank_parameters},
                        {"state_mb", r.state_mb},
                        {"comm_wait_ms", r.comm_wait_ms},
                        {"comm_wait_fraction", r.comm_wait_fraction},
                        {"steps", r.steps},
                        {"tokens_per_s", r.tokens_per_s},
                        {"gflops", r.gflops},
                        {"step_ms", r.step_ms},
                        {"forward_ms", r.forward_ms},
                        {"backward_ms", r.backward_ms},
                        {"optimizer_ms", r.optimizer_ms},
                        {"peak_rss_mb", r.peak_rss_mb},
                        {"peak_alloc_mb", r.peak_alloc_mb},
                        {"flops_per_token", r.flops_per_token},
                        {"parameters", r.num_parameters},
                        {"fma_peak_gflops", r.fma_peak_gflops},
                        {"fma_isa", r.fma_isa},
                        {"roofline_share", r.roofline_share},
                        {"device", r.device},
                        {"precision", r.precision},
                        {"batch", r.batch},
                        {"seq_len", r.seq_len},
                        {"mfu", r.mfu}};
    const char* coretype = std::getenv("OPENBLAS_CORETYPE");
    j["openblas_coretype"] = coretype ? coretype : "";
    if (r.device == "cpu") j["cpu_gemm"] = r.cpu_gemm;
    if (options.profile) {
      j["ops"] = nlohmann::json::array();
      for (const ops::OpTime& op : r.ops)
        j["ops"].push_back(
            {{"op", op.name},
             {"calls_per_step", static_cast<double>(op.calls) / static_cast<double>(r.steps)},
             {"ms_per_step", op.ms / static_cast<double>(r.steps)},
             {"gflop_per_step", op.work.flops / 1e9 / static_cast<double>(r.steps)},
             {"gb_per_step", op.work.bytes / 1e9 / static_cast<double>(r.steps)},
             {"gflops", op.ms > 0 ? op.work.flops / 1e6 / op.ms : 0.0},
             {"gb_per_s", op.ms > 0 ? op.work.bytes / 1e6 / op.ms : 0.0}});
    }
    std::cout << j.dump() << std::endl;
  } else {
    std::printf(
        "shape %s, %d rank(s) x %d thread(s), zero %d%s, %ld timed steps (median)\n",
        r.shape.c_str(), r.ranks, r.threads, r.zero,
        r.ep > 1 ? (", ep " + std::to_string(r.ep) + " (" + r.ep_dispatch + ")").c_str() : "",
        static_cast<long>(r.steps));
    std::printf("  %.1f tokens/s, %.1f GFLOP/s, step %.1f ms (fwd %.1f, bwd %.1f, opt %.1f)\n",
                r.tokens_per_s, r.gflops, r.step_ms, r.forward_ms, r.backward_ms, r.optimizer_ms);
    if (r.device == "cuda")
      std::printf("  on cuda (%s GEMMs), batch %ld x %ld tokens per rank, MFU %.1f%%%s\n",
                  r.precision.c_str(), static_cast<long>(r.batch), static_cast<long>(r.seq_len), 100.0 * r.mfu,
                  r.mfu > 0 ? "" : " (give --peak-tflops)");
    else
      std::printf(
          "  %s peak of %d thread(s) (%s loop, measured now) %.1f GFLOP/s: %.0f%% of it; "
          "GEMMs on %s\n",
          r.fma_isa == "avx512-bf16" ? "bf16 dot-product" : "fp32 FMA", r.ranks * r.threads,
          r.fma_isa.c_str(), r.fma_peak_gflops, 100.0 * r.roofline_share, r.cpu_gemm.c_str());
    if (r.ranks > 1)
      std::printf("  waiting for communication %.1f ms per step (%.1f%%)\n", r.comm_wait_ms,
                  100.0 * r.comm_wait_fraction);
    std::printf("  peak RSS %.1f MiB, peak tensor memory %.1f MiB, %ld parameters\n",
                r.peak_rss_mb, r.peak_alloc_mb, static_cast<long>(r.num_parameters));
    std::printf("  rank 0 holds %ld parameters; its parameters, gradients and moments %.1f MiB\n",
                static_cast<long>(r.rank_parameters), r.state_mb);
    if (options.profile) {
      // Rates over each op's least work (kernels/op_profile.h: OpWork): GFLOP/s where it computes,
      // GB/s of its operands, each read or written once, where it streams memory.
      std::printf(
          "  per step, by op (summed over the timed steps / %ld); rates over each op's least "
          "work:\n",
          static_cast<long>(r.steps));
      for (const ops::OpTime& op : r.ops) {
        std::printf("    %-34s %8.2f ms %5.1f%%  (%4.0f calls)", op.name.c_str(),
                    op.ms / static_cast<double>(r.steps),
                    100.0 * op.ms / static_cast<double>(r.steps) / r.step_ms,
                    static_cast<double>(op.calls) / static_cast<double>(r.steps));
        if (op.ms > 0 && op.work.flops > 0)
          std::printf("  %9.1f GFLOP/s", op.work.flops / 1e6 / op.ms);
        else if (op.ms > 0 && op.work.bytes > 0)
          std::printf("  %9.1f GB/s", op.work.bytes / 1e6 / op.ms);
        std::printf("\n");
      }
    }
  }
  return 0;
}

// Prints a pipeline schedule's timeline; the check comes first so that a schedule the engine
// would refuse is never drawn.
int cmd_schedule(const std::string& name, int pp, int microbatches, int virtual_stages) {
  const PipelineSchedule s = make_schedule(name, pp, microbatches, virtual_stages);
  check_schedule(s);
  std::cout << render_timeline(s);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"loom: distributed training of neural networks"};
  app.require_subcommand(1);

  TrainArgs train;
  auto* train_cmd = app.add_subcommand("train", "train a model from a TOML config");
  train_cmd->add_option("config", train.config_path, "config file (TOML)")->required();
  train_cmd->add_option("--set", train.sets, "override a config key: section.key=value")
      ->allow_extra_args(false);
  train_cmd->add_option("--run-dir", train.run_dir, "output directory (default runs/<config name>)");
  train_cmd->add_option("--resume", train.resume, "'auto' (latest checkpoint in the run dir) or a checkpoint dir");
  train_cmd
      ->add_option(
          "--stop-after", train.stop_after,
          "end after this step with a checkpoint (the LR schedule still follows train.steps)")
      ->check(kPositive);
  train_cmd->add_flag("--quiet", train.quiet, "no progress output");
  train_cmd
      ->add_option("--ranks", train.ranks,
                   "thread ranks of the local backend (sets runtime.ranks; with no parallel "
                   "degree set, all go to data parallelism)")
      ->check(kPositive);

  CheckArgs check;
  auto* check_cmd = app.add_subcommand(
      "check", "train a few steps under several layouts and on one device; print how far losses and parameters deviate");
  check_cmd->add_option("config", check.config_path, "config file (TOML)")->required();
  check_cmd->add_option("--set", check.sets, "override a config key: section.key=value")
      ->allow_extra_args(false);
  check_cmd->add_option("--layouts", check.layouts,
                        "';'-separated layouts of ','-separated key=value (dp, tp, pp, zero, "
                        "schedule, virtual_stages|v, sequence_parallel|sp, micro_batch_size|mbs)")
      ->capture_default_str();
  check_cmd->add_option("--steps", check.options.steps, "training steps per run")
      ->capture_default_str()
      ->check(kPositive);
  check_cmd->add_option("--layers", check.options.max_layers, "cap model.n_layers")
      ->check(kPositive);
  check_cmd->add_option("--seq-len", check.options.max_seq_len, "cap model.seq_len")
      ->check(kPositive);
  check.tolerance =
      check_cmd
          ->add_option("--tolerance", check.options.tolerance,
                       "largest relative deviation reported as ok (default 1e-2 at bf16 / fp16 "
                       "matmul precision)")
          ->capture_default_str()
          ->check(kNonNegative);
  check_cmd->add_option("--out", check.options.out_dir,
                        "directory for the runs, kept (default: a temporary directory, removed)");
  check_cmd->add_flag("--keep", check.options.keep, "keep the temporary directory of the runs");
  check_cmd->add_option("--json", check.json_path, "also write the rows to this file as JSON");
  check_cmd->add_flag("--quiet", check.quiet, "no progress lines");

  auto* data_cmd = app.add_subcommand("data", "prepare token shards");
  data_cmd->require_subcommand(1);
  std::vector<std::string> inputs;
  std::string out_dir;
  PrepareOptions prep;
  auto* prepare_cmd = data_cmd->add_subcommand(
      "prepare", "tokenise text files (bytes, or --tokenizer) into train/val shards");
  prepare_cmd
      ->add_option("inputs", inputs,
                   "text files (each a document), or with --tokenizer JSON Lines files (.jsonl, "
                   ".ndjson, .json: a document a line; any of these .gz or .zst compressed) and "
                   "Parquet files (.parquet: a document a row)")
      ->required();
  prepare_cmd->add_option("--out", out_dir, "output directory")->required();
  prepare_cmd->add_option("--val-fraction", prep.val_fraction, "held-out tail fraction")->capture_default_str();
  prepare_cmd->add_option("--shard-tokens", prep.shard_tokens, "tokens per shard")->capture_default_str();
  prepare_cmd
      ->add_option("--threads", prep.threads,
                   "with --tokenizer or --sft: documents (examples) tokenized at once, one a "
                   "thread (0 = one a core; "
                   "the same shards whatever the count)")
      ->capture_default_str();
  prepare_cmd
      ->add_option("--json-key", prep.json_key,
                   "with --tokenizer: the key of a JSON line's document text (Megatron-LM's "
                   "--json-keys), or a Parquet file's text column")
      ->capture_default_str();
  bool prepare_sft = false;
  int64_t prepare_eot = -1;
  prepare_cmd->add_flag("--sft", prepare_sft,
                        "the inputs are JSONL prompt-completion examples ({\"prompt\": ..., "
                        "\"completion\": ...}) or conversations ({\"messages\": [...]}), or "
                        "Parquet files of such rows: shards with loss masks counting the "
                        "completions (data.loss_mask); --val-fraction of the examples held out");
  prepare_cmd
      ->add_option(
          "--eot", prepare_eot,
          "the end-of-text token: with --sft after each completion, counted (a byte "
          "0..255 without --tokenizer); with --tokenizer after each document too (default: "
          "the tokenizer's <|end_of_text|>, <|endoftext|>, </s>, <|im_end|> or <eos>)")
      ->check(CLI::NonNegativeNumber);
  std::string prepare_tokenizer;
  bool prepare_no_eot = false;
  prepare_cmd->add_option(
      "--tokenizer", prepare_tokenizer,
      "a HuggingFace BPE tokenizer, byte-level or sentencepiece-style (tokenizer.json, or a model "
      "directory with one: GPT-2, Llama 2 and 3, Mistral, ...) instead of bytes; "
      "the same shards as tools/tokenize_hf.py");
  prepare_cmd->add_flag("--no-eot", prepare_no_eot,
                        "with --tokenizer: no end-of-text token after each document");
  prepare_cmd
      ->add_option("--chat-template", prep.chat_template,
                   "with --sft: conversations ({\"messages\": [{\"role\", \"content\"}...]}) "
                   "rendered as chatml (SmolLM2, Qwen) or llama3, the assistant turns counted")
      ->check(CLI::IsMember({"chatml", "llama3"}));
  int64_t synth_train = 2'000'000, synth_val = 100'000;
  uint64_t synth_seed = 1;
  auto* synth_cmd = data_cmd->add_subcommand("synth", "make a learnable synthetic corpus (addition problems)");
  synth_cmd->add_option("--out", out_dir, "output directory")->required();
  synth_cmd->add_option("--train-tokens", synth_train)->capture_default_str();
  synth_cmd->add_option("--val-tokens", synth_val)->capture_default_str();
  synth_cmd->add_option("--seed", synth_seed)->capture_default_str();
  bool synth_answer_masks = false;
  synth_cmd->add_flag("--answer-masks", synth_answer_masks,
                      "loss masks beside the shards: only the answers count as targets "
                      "(data.loss_mask; fine-tuning's shape)");
  std::vector<std::string> inspect_specs;
  int64_t inspect_seq_len = 0, inspect_vocab = 0;
  auto* inspect_cmd = data_cmd->add_subcommand(
      "inspect", "what token shards hold: tokens, width, sequences, every id against a vocabulary");
  std::string inspect_config;
  std::vector<std::string> inspect_sets;
  inspect_cmd->add_option("specs", inspect_specs, "shard files, directories or globs");
  inspect_cmd->add_option("--config", inspect_config,
                          "a training config: its data keys' corpora, at its model.seq_len and "
                          "model.vocab_size, and each training source's share and passes");
  inspect_cmd->add_option("--set", inspect_sets, "section.key=value override of --config");
  inspect_cmd->add_option("--seq-len", inspect_seq_len, "count the sequences of this length")
      ->check(kNonNegative);
  inspect_cmd
      ->add_option("--vocab", inspect_vocab,
                   "read every id and check it is below this vocabulary size (exit 1 if not)")
      ->check(kNonNegative);
  int64_t inspect_eot = -1;
  inspect_cmd
      ->add_option("--eot", inspect_eot,
                   "count the documents ending at this end-of-text id (GPT-2's: 50256); with "
                   "--config, data.eot_token where data.document_mask or data.eod_mask_loss is on")
      ->check(kNonNegative);

  std::string checkpoint, prompt = "\n";
  SampleOptions sample;
  uint64_t sample_seed = 42;
  int sample_threads = 0;
  auto* sample_cmd = app.add_subcommand("sample", "generate text from a checkpoint");
  sample_cmd
      ->add_option("--checkpoint", checkpoint,
                   "a checkpoint (RUN_DIR/checkpoints/step_N), or a run dir: its newest")
      ->required();
  sample_cmd->add_option("--prompt", prompt, "prompt text")->capture_default_str();
  sample_cmd->add_option("--tokens", sample.tokens, "tokens to generate")->capture_default_str();
  sample_cmd->add_option("--temperature", sample.temperature, "0 = greedy")->capture_default_str();
  sample_cmd->add_option("--top-k", sample.top_k, "0 = all")->capture_default_str();
  sample_cmd->add_option("--top-p", sample.top_p, "nucleus: 1 = all of the top-k")
      ->capture_default_str();
  sample_cmd
      ->add_option("--stop-token", sample.stop_token,
                   "stop after generating this token id (kept), e.g. the end-of-text a "
                   "fine-tuned model ends its completions with; -1 = none")
      ->capture_default_str();
  sample_cmd->add_option("--seed", sample_seed)->capture_default_str();
  std::string sample_tokenizer;
  sample_cmd->add_option("--tokenizer", sample_tokenizer,
                         "the model's HuggingFace BPE tokenizer (tokenizer.json, or a "
                         "model directory with one) for the prompt and the output; default: bytes");
  sample_cmd->add_option("--threads", sample_threads, "0 = all cores");
  bool no_kv_cache = false;
  sample_cmd->add_flag("--no-kv-cache", no_kv_cache,
                       "run the whole context for every token instead of decoding through the "
                       "key/value cache (the same tokens, slower; for comparisons)");

  std::vector<std::string> verify_paths;
  auto* checkpoint_cmd = app.add_subcommand("checkpoint", "checkpoint tools");
  checkpoint_cmd->require_subcommand(1);
  auto* verify_cmd = checkpoint_cmd->add_subcommand(
      "verify", "check checkpoints' files against the digests recorded when they were written");
  verify_cmd
      ->add_option("paths", verify_paths,
                   "checkpoint dirs (step_N), directories of them, or run dirs")
      ->required();
  std::string export_checkpoint_path, export_format = "hf", export_out;
  bool export_bf16 = false;
  auto* export_cmd = checkpoint_cmd->add_subcommand(
      "export", "write a checkpoint's model for HuggingFace transformers (hf) or llm.c (llmc)");
  export_cmd
      ->add_option("checkpoint", export_checkpoint_path, "a step_N, or a run dir (its newest)")
      ->required();
  export_cmd->add_option("--format", export_format, "hf (a directory) or llmc (a file)")
      ->capture_default_str()
      ->check(CLI::IsMember({"hf", "llmc"}));
  export_cmd->add_option("--out", export_out, "the directory (hf) or file (llmc) to write")
      ->required();
  export_cmd->add_flag("--bf16", export_bf16, "write bf16 instead of fp32");
  std::int64_t export_max_shard = kDefaultMaxShardBytes;
  export_cmd
      ->add_option("--max-shard-size", export_max_shard,
                   "hf: split the tensors over model-0000K-of-0000N.safetensors files of at most "
                   "this size (5GB, 500MB, 2GiB, or bytes), as save_pretrained does; default 5GB")
      ->transform(CLI::AsSizeValue(/*kb_is_1000=*/true))
      ->check(CLI::PositiveNumber);
  std::string export_tokenizer;
  export_cmd->add_option(
      "--tokenizer", export_tokenizer,
      "hf: the model's HuggingFace tokenizer (tokenizer.json, or a model directory holding one, "
      "with its tokenizer_config.json) copied beside it, for AutoTokenizer");

  std::string plan_config, plan_hardware = "h100";
  std::vector<std::string> plan_sets;
  PlanOptions plan;
  size_t plan_top = 15;
  auto* plan_cmd = app.add_subcommand("plan",
                                      "every dp x tp x pp x ZeRO layout of a config on N GPUs: "
                                      "memory per rank and a step-time estimate");
  plan_cmd->add_option("config", plan_config, "config file (TOML): the model and the batch")
      ->required();
  plan_cmd->add_option("--set", plan_sets, "override a config key: section.key=value")
      ->allow_extra_args(false);
  plan_cmd->add_option("--devices", plan.devices, "GPUs in the job")
      ->capture_default_str()
      ->check(kPositive);
  plan_cmd
      ->add_option("--hardware", plan_hardware, "h100, h200, a100-80g, a100-40g, h100-pcie or l40s")
      ->capture_default_str();
  plan_cmd->add_option("--efficiency", plan.efficiency, "share of the peak the GEMMs reach")
      ->capture_default_str();
  plan_cmd->add_option("--top", plan_top, "layouts shown")->capture_default_str();
  std::string plan_schedules = "all";
  plan_cmd
      ->add_option("--schedules", plan_schedules,
                   "pipeline layouts: every schedule (all) or the config's alone (config)")
      ->check(CLI::IsMember({"all", "config"}))
      ->capture_default_str();
  std::string plan_cp = "all";
  plan_cmd
      ->add_option("--cp", plan_cp,
                   "context parallelism: every cp the sequence allows, each with both "
                   "exchanges (all), or the config's parallel.cp and cp_comm alone (config)")
      ->check(CLI::IsMember({"all", "config"}))
      ->capture_default_str();
  std::string plan_dp_shard = "all";
  plan_cmd
      ->add_option("--dp-shard", plan_dp_shard,
                   "hybrid sharding: ZeRO's state also over the largest group of dp ranks "
                   "within a node (all), or the config's parallel.dp_shard alone (config)")
      ->check(CLI::IsMember({"all", "config"}))
      ->capture_default_str();

  LaunchOptions launch;
  std::vector<std::string> launch_command;
  auto* launch_cmd = app.add_subcommand(
      "launch", "run a training command, restarting it from its newest checkpoint when it fails");
  launch_cmd
      ->add_option("--max-restarts", launch.max_restarts,
                   "restarts after failures in a row that saved no new checkpoint")
      ->capture_default_str()
      ->check(kNonNegative);
  launch_cmd->add_option("--restart-delay", launch.restart_delay_s, "seconds before each restart")
      ->capture_default_str()
      ->check(kNonNegative);
  launch_cmd->add_option(
      "--run-dir", launch.run_dir,
      "the run directory to watch (default: the command's loom train --run-dir)");
  launch_cmd
      ->add_option("--stall-timeout", launch.stall_timeout_s,
                   "stop and restart an attempt that logs no step for this many seconds (0: never)")
      ->capture_default_str()
      ->check(kNonNegative);
  launch_cmd
      ->add_option("--kill-grace", launch.kill_grace_s,
                   "seconds between SIGTERM and SIGKILL for a stalled attempt")
      ->capture_default_str()
      ->check(kNonNegative);
  launch_cmd->add_option("command", launch_command, "the command, after --")->required();

  std::string shape = "bench-s";
  BenchOptions bench;
  bool json = false;
  auto* bench_cmd = app.add_subcommand("bench", "benchmarks");
  bench_cmd->require_subcommand(1);
  auto* bench_train = bench_cmd->add_subcommand("train", "training throughput on random tokens");
  bench_train->add_option("--shape", shape, "bench-s, gpt2-124m, tiny, llama-1b, llama-8b-4l, llama-s or llama-tiny")->capture_default_str();
  bench_train->add_option("--threads", bench.threads, "compute threads per rank")->capture_default_str();
  bench_train->add_option("--ranks", bench.ranks, "data-parallel thread ranks (batch per rank)")->capture_default_str();
  bench_train->add_option("--zero", bench.zero, "ZeRO stage with --ranks")->capture_default_str();
  bench_train
      ->add_option("--ep", bench.ep,
                   "expert parallelism: a mixture's experts split over groups of this many ranks "
                   "(moe-s)")
      ->capture_default_str();
  bench_train
      ->add_option("--ep-dispatch", bench.ep_dispatch,
                   "with --ep: all_gather or all_to_all (parallel.ep_dispatch)")
      ->capture_default_str();
  bench_train->add_option("--steps", bench.steps, "timed steps")->capture_default_str();
  bench_train->add_option("--warmup", bench.warmup, "untimed steps first")->capture_default_str();
  bench_train->add_option("--device", bench.device, "cpu, or cuda (rank r on GPU r, gradients over nccl)")->capture_default_str();
  bench_train->add_option("--batch", bench.batch, "sequences per rank (0: the shape's)")->capture_default_str();
  bench_train->add_option("--seq", bench.seq_len, "tokens per sequence (0: the shape's)")->capture_default_str();
  bench_train
      ->add_option("--precision", bench.precision,
                   "GEMM inputs: fp32 or bf16 on the CPU; fp32, tf32, bf16 or fp16 on cuda")
      ->capture_default_str();
  bench_train->add_option("--peak-tflops", bench.gpu_peak_tflops, "cuda: the GPU's peak TFLOP/s for the MFU")->capture_default_str();
  bench_train->add_flag("--profile", bench.profile, "time each op kind over the timed steps (one rank)");
  bench_train->add_flag("--json", json, "one JSON object");

  int fma_threads = 1;
  double fma_seconds = 1.0;
  auto* bench_fma = bench_cmd->add_subcommand("fma", "the fp32 FMA peak of this CPU (the roofline `bench train` is measured against)");
  bench_fma->add_option("--threads", fma_threads, "threads running the FMA loop at once")->capture_default_str();
  bench_fma->add_option("--seconds", fma_seconds, "how long each thread runs")->capture_default_str();

  std::string gemm_device = "cuda", gemm_precision = "bf16";
  int64_t gemm_n = 8192;
  int gemm_iters = 10;
  std::string memory_device = "cuda";
  int64_t memory_mib = 1024;
  int memory_iters = 10;
  auto* bench_memory = bench_cmd->add_subcommand(
      "memory",
      "a GPU's memory bandwidth (device-to-device copies; the roofline of the profile's GB/s)");
  bench_memory->add_option("--device", memory_device, "cuda or cuda:N")->capture_default_str();
  bench_memory->add_option("--mib", memory_mib, "MiB copied per timed copy")->capture_default_str();
  bench_memory->add_option("--iters", memory_iters, "timed copies (the best counts)")
      ->capture_default_str();
  auto* bench_gemm = bench_cmd->add_subcommand("gemm", "a GPU's dense GEMM rate (the peak `bench train --device cuda` MFU is measured against)");
  bench_gemm->add_option("--device", gemm_device, "cuda or cuda:N")->capture_default_str();
  bench_gemm
      ->add_option("--precision", gemm_precision,
                   "fp32, tf32, bf16, fp16, or fp8 (the E4M3 tensor cores, block-scaled)")
      ->capture_default_str();
  bench_gemm->add_option("--n", gemm_n, "the n of the n x n x n product")->capture_default_str();
  bench_gemm->add_option("--iters", gemm_iters, "timed products (the best counts)")->capture_default_str();

  BenchAttentionArgs attention_args;
  auto* bench_attention = bench_cmd->add_subcommand(
      "attention",
      "causal attention of a whole sequence against one context-parallel rank's rows (its zigzag "
      "chunks over every key)");
  bench_attention->add_option("--device", attention_args.device, "cpu, or cuda / cuda:N")
      ->capture_default_str();
  bench_attention
      ->add_option(
          "--precision", attention_args.precision,
          "a GPU's matmul precision: fp32, or bf16 (the flash kernels at head size 64 or 128)")
      ->capture_default_str();
  bench_attention->add_option("--threads", attention_args.threads, "CPU threads")
      ->capture_default_str();
  bench_attention->add_option("--batch", attention_args.batch, "sequences")->capture_default_str();
  bench_attention->add_option("--seq", attention_args.seq_len, "tokens per sequence")
      ->capture_default_str();
  bench_attention->add_option("--heads", attention_args.heads, "query heads")
      ->capture_default_str();
  bench_attention->add_option("--kv-heads", attention_args.kv_heads, "key/value heads (0: --heads)")
      ->capture_default_str();
  bench_attention->add_option("--head-dim", attention_args.head_dim, "head size")
      ->capture_default_str();
  bench_attention
      ->add_option("--cp", attention_args.cp, "context-parallel ranks the sequence splits over")
      ->capture_default_str();
  bench_attention
      ->add_option("--iters", attention_args.iters, "timed runs of each (the best counts)")
      ->capture_default_str();
  bench_attention
      ->add_option("--documents", attention_args.documents,
                   "also time the whole sequence under document masking, documents of this many "
                   "tokens (0: not)")
      ->capture_default_str();
  bench_attention
      ->add_option("--window", attention_args.window,
                   "also time the whole sequence under a sliding window of this many positions "
                   "(model.sliding_window; with --documents both; 0: not)")
      ->capture_default_str();
  bench_attention->add_flag("--json", attention_args.json, "one JSON object");

  BenchCommArgs comm_args;
  auto* bench_comm = bench_cmd->add_subcommand("comm", "collective bandwidth (algbw, busbw, memcpy ceiling)");
  bench_comm->add_option("--backend", comm_args.backend, "local or mpi")->capture_default_str();
  bench_comm->add_option("--ranks", comm_args.ranks)->capture_default_str();
  bench_comm->add_option("--op", comm_args.op, "a collective or 'all'")->capture_default_str();
  bench_comm->add_option("--sizes", comm_args.sizes, "per-rank buffer sizes")->capture_default_str();
  bench_comm->add_option("--iters", comm_args.iters)->capture_default_str();
  bench_comm->add_option("--warmup", comm_args.warmup)->capture_default_str();
  bench_comm->add_option("--dtype", comm_args.dtype, "fp32 or bf16 elements (sizes stay bytes)")
      ->capture_default_str();
  bench_comm->add_flag("--json", comm_args.json, "one JSON object per line");

  std::string sched_name = "1f1b";
  int sched_pp = 4, sched_m = 8, sched_v = 0;
  auto* schedule_cmd = app.add_subcommand("schedule", "print a pipeline schedule as a timeline (one row per rank)");
  schedule_cmd->add_option("--pp", sched_pp, "pipeline ranks")->capture_default_str();
  schedule_cmd->add_option("--microbatches", sched_m, "micro-batches per step")
      ->capture_default_str();
  schedule_cmd
      ->add_option("--schedule", sched_name,
                   "gpipe, 1f1b, interleaved, zb-h1, zb-interleaved or zb-v")
      ->capture_default_str();
  schedule_cmd->add_option("--virtual-stages", sched_v,
                           "chunks per rank (interleaved, zb-interleaved; zb-v's are 2); "
                           "default: 2 for zb-v, else 1");

  std::string hang_dir;
  auto* debug_cmd = app.add_subcommand("debug", "post-mortem tools");
  debug_cmd->require_subcommand(1);
  auto* hang_cmd = debug_cmd->add_subcommand(
      "hang", "read the flight-recorder dumps of a run that timed out and name the ranks that never arrived");
  hang_cmd->add_option("run_dir", hang_dir, "the run directory (reads RUN_DIR/flight/rank_*.json)")->required();

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  try {
    // LOOM_CPU_GEMM is read by the first float GEMM, which may run on a pool worker: check it
    // here, where a bad value can still become a clear error and exit code.
    cpu::cpu_gemm_backend();
    if (train_cmd->parsed()) return cmd_train(train);
    if (check_cmd->parsed()) return cmd_check(check);
    if (launch_cmd->parsed()) return cmd_launch(launch, launch_command);
    if (plan_cmd->parsed()) {
      if (!(plan.efficiency > 0 && plan.efficiency <= 1))
        fail("--efficiency must be in (0, 1], got ", plan.efficiency);
      Config config = load_config(plan_config);
      for (const auto& s : plan_sets) apply_override(config, s);
      plan.hardware = find_hardware(plan_hardware);
      plan.every_schedule = plan_schedules == "all";
      plan.every_cp = plan_cp == "all";
      plan.every_dp_shard = plan_dp_shard == "all";
      const std::vector<LayoutPlan> plans = plan_layouts(config, plan);
      if (plans.empty()) {
        // What the options held at the config's values rule out too.
        std::string held;
        if (!plan.every_cp && config.parallel.cp > 1)
          held += detail::concat(", parallel.cp ", config.parallel.cp, " (--cp config)");
        if (!plan.every_dp_shard && config.parallel.dp_shard > 0)
          held += detail::concat(", parallel.dp_shard ", config.parallel.dp_shard,
                                 " (--dp-shard config: it must divide dp, at ZeRO 1-3)");
        fail(plan_config, ": no layout of ", plan.devices,
             " ranks fits the config (train.batch_size ", config.train.batch_size,
             ", micro_batch_size ", config.train.micro_batch_size, ", model.n_heads ",
             config.model.n_heads, ", n_layers ", config.model.n_layers, held, ")");
      }
      std::cout << format_plan(config, plan, plans, plan_top);
      return 0;
    }
    if (prepare_cmd->parsed()) {
      std::optional<BpeTokenizer> tok;
      if (!prepare_tokenizer.empty()) tok.emplace(prepare_tokenizer);
      if (!tok && prepare_no_eot) fail("loom data prepare: --no-eot needs --tokenizer");
      if (!tok && prepare_cmd->count("--json-key") > 0)
        fail("loom data prepare: --json-key needs --tokenizer");
      if (!tok && prepare_eot >= 0 && !prepare_sft)
        fail(
            "loom data prepare: --eot needs --sft or --tokenizer (the byte tokenizer has no "
            "end-of-text token)");
      if (!prep.chat_template.empty() && !prepare_sft)
        fail("loom data prepare: --chat-template needs --sft");
      if (prepare_sft && prepare_no_eot)
        fail("loom data prepare: --sft needs the end-of-text token (the model learns to stop)");
      int64_t eot = prepare_eot;
      if (tok && eot < 0 && !prepare_no_eot) {
        const std::optional<int32_t> known = tok->end_of_text();
        if (!known)
          fail("loom data prepare: ", tok->path(), " has no end-of-text token Loom knows ",
               "(<|end_of_text|>, <|endoftext|>, </s>, <|im_end|>, <eos>): give --eot ID or "
               "--no-eot");
        eot = *known;
      }
      // A line every 10 s through a long corpus (--tokenizer): how far, how fast.
      double next_report = 10;
      prep.progress = [&next_report](const PrepareProgress& p) {
        if (p.seconds < next_report) return;
        next_report = p.seconds + 10;
        std::fprintf(
            stderr, "prepare: %.2f GB of text, %ld documents, %ld tokens in %.0f s (%.1f MB/s)\n",
            static_cast<double>(p.bytes) / 1e9, static_cast<long>(p.documents),
            static_cast<long>(p.tokens), p.seconds, static_cast<double>(p.bytes) / 1e6 / p.seconds);
      };
      PrepareResult r = prepare_sft
                            ? prepare_sft_dataset(inputs, out_dir, prep, eot, tok ? &*tok : nullptr)
                        : tok ? prepare_tokenized_dataset(inputs, out_dir, *tok, prep, eot)
                              : prepare_dataset(inputs, out_dir, prep);
      std::string documents;
      if (tok && !prepare_sft)
        documents =
            detail::concat(" from ", r.documents, r.documents == 1 ? " document" : " documents");
      if (tok && r.empty_documents > 0)
        documents += detail::concat(" (", r.empty_documents, " empty ",
                                    r.empty_documents == 1 ? "one" : "ones", " skipped)");
      std::fprintf(stderr, "wrote %s: %ld train tokens, %ld val tokens%s%s\n", out_dir.c_str(),
                   static_cast<long>(r.train_tokens), static_cast<long>(r.val_tokens),
                   documents.c_str(),
                   prepare_sft ? ", loss masks beside them (the completions count)" : "");
      if (tok)
        std::fprintf(stderr, "%s shards of %s (end-of-text %ld): model.vocab_size >= %ld\n",
                     tok->vocab_size() > 65536 ? "uint32" : "uint16", tok->path().c_str(),
                     static_cast<long>(eot), static_cast<long>(tok->vocab_size()));
      return 0;
    }
    if (synth_cmd->parsed()) {
      SynthResult r = synthesize_addition(out_dir, synth_train, synth_val, synth_seed);
      std::fprintf(stderr, "wrote %s: %ld train tokens, %ld val tokens\n", out_dir.c_str(),
                   static_cast<long>(r.train_tokens), static_cast<long>(r.val_tokens));
      if (synth_answer_masks) {
        const int64_t train_counted = write_addition_answer_masks(r.train_shards);
        const int64_t val_counted = write_addition_answer_masks(r.val_shards);
        std::fprintf(stderr,
                     "wrote loss masks beside them: %ld train and %ld val targets count (the "
                     "answers)\n",
                     static_cast<long>(train_counted), static_cast<long>(val_counted));
      }
      return 0;
    }
    if (inspect_cmd->parsed())
      return cmd_inspect(inspect_specs, inspect_seq_len, inspect_vocab, inspect_eot, inspect_config,
                         inspect_sets);
    if (verify_cmd->parsed()) return cmd_verify(verify_paths);
    if (export_cmd->parsed()) {
      const std::vector<std::string> found = checkpoints_at(export_checkpoint_path);
      const std::string from = found.empty() ? export_checkpoint_path : found.back();
      export_checkpoint(from, export_format, export_out, export_bf16, export_max_shard,
                        export_tokenizer);
      std::fprintf(stderr, "exported %s to %s (%s)\n", from.c_str(), export_out.c_str(),
                   export_format.c_str());
      return 0;
    }
    if (sample_cmd->parsed()) {
      sample.kv_cache = !no_kv_cache;
      return cmd_sample(checkpoint, prompt, sample, sample_seed, sample_threads, sample_tokenizer);
    }
    if (bench_train->parsed()) return cmd_bench(shape, bench, json);
    if (bench_fma->parsed()) {
      if (fma_threads < 1) fail("--threads must be >= 1, got ", fma_threads);
      if (!(fma_seconds > 0)) fail("--seconds must be > 0, got ", fma_seconds);
      const cpu::FmaPeak peak = cpu::measure_fma_peak(fma_threads, fma_seconds);
      std::printf("fp32 FMA peak, %d thread(s), %s loop: %.1f GFLOP/s\n", fma_threads, peak.isa,
                  peak.gflops);
      return 0;
    }
    if (bench_gemm->parsed()) {
      const double tflops = ops::measure_gpu_gemm_tflops(Device::parse(gemm_device), gemm_precision,
                                                         gemm_n, gemm_iters);
      std::printf("{\"device\": \"%s\", \"precision\": \"%s\", \"n\": %ld, \"tflops\": %.1f}\n",
                  gemm_device.c_str(), gemm_precision.c_str(), static_cast<long>(gemm_n), tflops);
      return 0;
    }
    if (bench_memory->parsed()) {
      if (memory_mib < 1) fail("--mib must be >= 1, got ", memory_mib);
      const double gbps =
          ops::measure_gpu_copy_gbps(Device::parse(memory_device), memory_mib << 20, memory_iters);
      std::printf("{\"device\": \"%s\", \"copy_mib\": %ld, \"gb_per_s\": %.1f}\n",
                  memory_device.c_str(), static_cast<long>(memory_mib), gbps);
      return 0;
    }
    if (bench_attention->parsed()) return cmd_bench_attention(attention_args);
    if (bench_comm->parsed()) return cmd_bench_comm(comm_args, std::vector<std::string>(argv, argv + argc));
    if (schedule_cmd->parsed())
      return cmd_schedule(sched_name, sched_pp, sched_m,
                          sched_v != 0           ? sched_v
                          : sched_name == "zb-v" ? 2
                                                 : 1);
    if (hang_cmd->parsed()) {
      const std::string flight = (std::filesystem::path(hang_dir) / "flight").string();
      std::cout << analyze_flight_dumps(std::filesystem::is_directory(flight) ? flight : hang_dir).text();
      return 0;
    }
  } catch (const loom::Error& e) {
    std::fprintf(stderr, "loom: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "loom: internal error: %s\n", e.what());
    return 3;
  }
  return 0;
}
