#include "config/config.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>

#include "base/error.h"
#include "harness/error_of.h"

namespace loom {
namespace {

using testutil::error_of;

// EXPECT_TRUE(Contains(text, part)) prints both on failure.
::testing::AssertionResult Contains(const std::string& text, const std::string& part) {
  if (text.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "\"" << text << "\"\ndoes not contain \"" << part << "\"";
}

std::string parse_error(const std::string& text) {
  return error_of([&] { parse_config(text, "config.toml"); });
}

std::string validate_error(const std::function<void(Config&)>& edit) {
  Config c;
  edit(c);
  return error_of([&] { validate(c); });
}

std::string override_error(const std::string& assignment) {
  Config c;
  return error_of([&] { apply_override(c, assignment); });
}

// A file under the test temp dir, unique per test and process, removed at the end.
class TempFile {
 public:
  explicit TempFile(const std::string& contents) {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ =
        (std::filesystem::path(::testing::TempDir()) /
         (std::string("loom_config_") + info->name() + "_" + std::to_string(::getpid()) + ".toml"))
            .string();
    std::ofstream(path_) << contents;
  }
  ~TempFile() { std::filesystem::remove(path_); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

constexpr const char* kFull = R"(
# A complete config.
[model]
arch = "gpt2"
vocab_size = 512
seq_len = 64
d_model = 96
n_layers = 3
n_heads = 6
max_seq_len = 128
init_std = 0.01

[data]
train = "data/shards/train_*.bin"
val = ""

[train]
steps = 200
batch_size = 32
micro_batch_size = 4
lr = 3e-4
warmup_steps = 20
min_lr_ratio = 0.05
weight_decay = 0.0
beta1 = 0.8
beta2 = 0.99
eps = 1e-6
grad_clip = 0
seed = 7
eval_every = 0
eval_batches = 4
save_every = 50
log_every = 10
recompute = true

[parallel]
dp = 2
tp = 3
pp = 1
zero = 1
schedule = "gpipe"
virtual_stages = 1
recompute = "full"

[runtime]
ranks = 6
backend = "mpi"
device = "cuda:1"
threads_per_rank = 2
)";

// Every config shipped in configs/ loads and validates as it is (one rank, its degrees
// inferred), so the README's commands never start with a config error.
TEST(Config, ShippedConfigsAreValid) {
  int seen = 0;
  for (const auto& entry :
       std::filesystem::directory_iterator(std::string(LOOM_SOURCE_DIR) + "/configs")) {
    if (entry.path().extension() != ".toml") continue;
    SCOPED_TRACE(entry.path().string());
    Config c = load_config(entry.path().string());
    resolve_parallel_degrees(c.parallel, c.runtime.ranks);
    EXPECT_NO_THROW(validate(c));
    ++seen;
  }
  EXPECT_GE(seen, 4);
}

// The shipped Gemma 3 shapes scale their embedding by the float nearest √d_model, as transformers'
// Gemma3TextScaledWordEmbedding does (train.init_from refuses any other value).
TEST(Config, ShippedGemmaConfigsScaleTheEmbeddingAsGemma) {
  for (const char* name : {"gemma3-1b", "gemma3-4b", "gemma3-12b", "gemma3-27b"}) {
    SCOPED_TRACE(name);
    const Config c =
        load_config(std::string(LOOM_SOURCE_DIR) + "/configs/" + std::string(name) + ".toml");
    EXPECT_EQ(static_cast<float>(c.model.embedding_multiplier),
              static_cast<float>(std::sqrt(static_cast<double>(c.model.d_model))));
    EXPECT_EQ(c.model.norm_placement, "sandwich");
  }
}

TEST(Config, ParsesEveryKey) {
  const Config c = parse_config(kFull, "full.toml");
  EXPECT_EQ(c.model.arch, "gpt2");
  EXPECT_EQ(c.model.vocab_size, 512);
  EXPECT_EQ(c.model.seq_len, 64);
  EXPECT_EQ(c.model.d_model, 96);
  EXPECT_EQ(c.model.n_layers, 3);
  EXPECT_EQ(c.model.n_heads, 6);
  EXPECT_EQ(c.model.max_seq_len, 128);
  EXPECT_EQ(c.model.resolved_max_seq_len(), 128);
  EXPECT_DOUBLE_EQ(c.model.init_std, 0.01);
  EXPECT_EQ(c.data.train, "data/shards/train_*.bin");
  EXPECT_EQ(c.data.val, "");
  EXPECT_EQ(c.train.steps, 200);
  EXPECT_EQ(c.train.batch_size, 32);
  EXPECT_EQ(c.train.micro_batch_size, 4);
  EXPECT_DOUBLE_EQ(c.train.lr, 3e-4);
  EXPECT_EQ(c.train.warmup_steps, 20);
  EXPECT_DOUBLE_EQ(c.train.min_lr_ratio, 0.05);
  EXPECT_DOUBLE_EQ(c.train.weight_decay, 0.0);
  EXPECT_DOUBLE_EQ(c.train.beta1, 0.8);
  EXPECT_DOUBLE_EQ(c.train.beta2, 0.99);
  EXPECT_DOUBLE_EQ(c.train.eps, 1e-6);
  EXPECT_DOUBLE_EQ(c.train.grad_clip, 0.0);  // an integer where a float is expected
  EXPECT_EQ(c.train.seed, 7);
  EXPECT_EQ(c.train.eval_every, 0);
  EXPECT_EQ(c.train.eval_batches, 4);
  EXPECT_EQ(c.train.save_every, 50);
  EXPECT_EQ(c.train.log_every, 10);
  EXPECT_TRUE(c.train.recompute);
  EXPECT_EQ(c.parallel.dp, 2);
  EXPECT_EQ(c.parallel.tp, 3);
  EXPECT_EQ(c.parallel.pp, 1);
  EXPECT_EQ(c.parallel.zero, 1);
  EXPECT_EQ(c.parallel.schedule, "gpipe");
  EXPECT_EQ(c.parallel.virtual_stages, 1);
  EXPECT_EQ(c.parallel.recompute, "full");
  EXPECT_EQ(c.resolved_recompute(), "full");
  EXPECT_EQ(c.runtime.ranks, 6);
  EXPECT_EQ(c.runtime.backend, "mpi");
  EXPECT_EQ(c.runtime.device, "cuda:1");
  EXPECT_EQ(c.runtime.threads_per_rank, 2);
  EXPECT_EQ(c.runtime.resolved_threads_per_rank(), 2);
  EXPECT_NO_THROW(validate(c));
  EXPECT_EQ(c.grad_accum_steps(), 4);  // 32 / (4 × 2)
}

TEST(Config, DefaultsAreValidAndMissingKeysKeepThem) {
  const Config defaults;
  EXPECT_NO_THROW(validate(defaults));
  EXPECT_EQ(parse_config("", "empty.toml"), defaults);
  EXPECT_EQ(defaults.model.arch, "gpt2");
  EXPECT_EQ(defaults.model.max_seq_len, 0);
  EXPECT_EQ(defaults.model.resolved_max_seq_len(), defaults.model.seq_len);
  EXPECT_DOUBLE_EQ(defaults.model.init_std, 0.02);
  EXPECT_DOUBLE_EQ(defaults.train.min_lr_ratio, 0.1);
  EXPECT_DOUBLE_EQ(defaults.train.beta1, 0.9);
  EXPECT_DOUBLE_EQ(defaults.train.beta2, 0.95);
  EXPECT_DOUBLE_EQ(defaults.train.eps, 1e-8);
  EXPECT_EQ(defaults.train.eval_batches, 8);
  EXPECT_EQ(defaults.train.log_every, 1);
  EXPECT_FALSE(defaults.train.recompute);
  EXPECT_EQ(defaults.parallel.schedule, "1f1b");
  EXPECT_EQ(defaults.parallel.recompute, "none");
  EXPECT_EQ(defaults.resolved_recompute(), "none");
  EXPECT_EQ(defaults.runtime.backend, "auto");
  EXPECT_EQ(defaults.runtime.device, "cpu");
  EXPECT_EQ(defaults.runtime.threads_per_rank, 0);
  EXPECT_GE(defaults.runtime.resolved_threads_per_rank(), 1);
  EXPECT_EQ(defaults.parallel.dp, 0);  // left out: inferred from the world size
  Config resolved = defaults;
  resolve_parallel_degrees(resolved.parallel, 1);
  EXPECT_EQ(resolved.grad_accum_steps(), 1);

  const Config c = parse_config("[train]\nsteps = 5\n[model]\nseq_len = 32\n", "partial.toml");
  EXPECT_EQ(c.train.steps, 5);
  EXPECT_EQ(c.model.resolved_max_seq_len(), 32);  // max_seq_len follows seq_len
  EXPECT_EQ(c.train.batch_size, defaults.train.batch_size);
  EXPECT_EQ(c.runtime, defaults.runtime);
  // Dotted keys are plain TOML too.
  EXPECT_EQ(parse_config("train.steps = 9", "dotted.toml").train.steps, 9);
}

TEST(Config, UnknownKeysAndSectionsAreNamed) {
  std::string e = parse_error("[train]\nlearnig_rate = 0.1\n");
  EXPECT_TRUE(Contains(e, "config.toml:2"));
  EXPECT_TRUE(Contains(e, "unknown key 'train.learnig_rate'"));

  e = parse_error("[train]\nsteeps = 10\n");
  EXPECT_TRUE(Contains(e, "unknown key 'train.steeps'"));
  EXPECT_TRUE(Contains(e, "did you mean 'train.steps'?"));

  e = parse_error("[train]\ndp = 2\n");  // right key, wrong section
  EXPECT_TRUE(Contains(e, "unknown key 'train.dp'"));
  EXPECT_TRUE(Contains(e, "did you mean 'parallel.dp'?"));

  e = parse_error("[modle]\nd_model = 64\n");
  EXPECT_TRUE(Contains(e, "config.toml:1"));
  EXPECT_TRUE(Contains(e, "unknown section [modle]"));
  EXPECT_TRUE(Contains(e, "did you mean [model]?"));

  e = parse_error("steps = 3\n");
  EXPECT_TRUE(Contains(e, "'steps' is outside any section"));
  EXPECT_TRUE(Contains(e, "did you mean 'train.steps'?"));

  e = parse_error("[model.sub]\nx = 1\n");
  EXPECT_TRUE(Contains(e, "unknown key 'model.sub'"));

  e = parse_error("[[train]]\nsteps = 1\n");
  EXPECT_TRUE(Contains(e, "'train' must be a section"));
}

TEST(Config, WrongTypesNameKeyExpectedAndGiven) {
  std::string e = parse_error("[train]\nsteps = \"abc\"\n");
  EXPECT_TRUE(Contains(e, "config.toml:2"));
  EXPECT_TRUE(Contains(e, "key 'train.steps' expects an integer, got string \"abc\""));

  e = parse_error("[train]\nsteps = 1.5\n");  // a float is never an integer
  EXPECT_TRUE(Contains(e, "key 'train.steps' expects an integer, got float 1.5"));

  e = parse_error("[train]\nlr = \"fast\"\n");
  EXPECT_TRUE(Contains(e, "key 'train.lr' expects a float, got string \"fast\""));

  e = parse_error("[train]\nrecompute = 1\n");
  EXPECT_TRUE(Contains(e, "key 'train.recompute' expects a boolean"));
  EXPECT_TRUE(Contains(e, "got integer 1"));

  e = parse_error("[model]\narch = 2\n");
  EXPECT_TRUE(Contains(e, "key 'model.arch' expects a string, got integer 2"));

  e = parse_error("[data]\ntrain = [\"a\", \"b\"]\n");
  EXPECT_TRUE(Contains(e, "key 'data.train' expects a string, got an array"));

  e = parse_error("[parallel]\ndp = 3000000000\n");
  EXPECT_TRUE(Contains(e, "parallel.dp"));
  EXPECT_TRUE(Contains(e, "out of range"));

  // Integers are fine where floats are expected.
  EXPECT_DOUBLE_EQ(parse_config("[train]\nlr = 1\n", "x.toml").train.lr, 1.0);
}

// Issue 7: any of dp, tp, pp may be left out (0) and is inferred from the world size; a layout
// that cannot fill the world names the product that does not match.
TEST(Config, ParallelDegreesLeftOutAreInferred) {
  auto resolved = [](int dp, int tp, int pp, int world) {
    ParallelConfig p;
    p.dp = dp;
    p.tp = tp;
    p.pp = pp;
    resolve_parallel_degrees(p, world);
    return std::vector<int>{p.dp, p.tp, p.pp};
  };
  EXPECT_EQ(resolved(0, 0, 0, 1), (std::vector<int>{1, 1, 1}));
  EXPECT_EQ(resolved(0, 0, 0, 8), (std::vector<int>{8, 1, 1}));   // all ranks to dp
  EXPECT_EQ(resolved(0, 2, 0, 8), (std::vector<int>{4, 2, 1}));   // dp takes the rest
  EXPECT_EQ(resolved(0, 2, 2, 8), (std::vector<int>{2, 2, 2}));
  EXPECT_EQ(resolved(2, 0, 2, 8), (std::vector<int>{2, 2, 2}));   // the one left out
  EXPECT_EQ(resolved(2, 2, 0, 8), (std::vector<int>{2, 2, 2}));
  EXPECT_EQ(resolved(2, 1, 3, 6), (std::vector<int>{2, 1, 3}));   // all given: a check
  auto error = [](int dp, int tp, int pp, int world) {
    try {
      ParallelConfig p;
      p.dp = dp;
      p.tp = tp;
      p.pp = pp;
      resolve_parallel_degrees(p, world);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(error(2, 2, 1, 8),
            "parallel.dp × parallel.tp × parallel.pp = 2 × 2 × 1 = 4 does not equal the 8 ranks of the job");
  EXPECT_EQ(
      error(0, 3, 0, 8),
      "parallel.tp = 3 does not divide the 8 ranks of the job, so parallel.dp cannot be inferred");
  EXPECT_TRUE(Contains(error(2, 0, 0, 8), "set parallel.tp or parallel.pp"));
  EXPECT_TRUE(Contains(error(-1, 0, 0, 8), "parallel.dp = -1 must be positive"));
}

TEST(Config, ValidationNamesKeysAndValues) {
  EXPECT_EQ(validate_error([](Config& c) {
              c.model.d_model = 64;
              c.model.n_heads = 5;
            }),
            "invalid config: model.n_heads = 5 does not divide model.d_model = 64");
  EXPECT_TRUE(Contains(validate_error([](Config& c) {
                         c.train.batch_size = 12;
                         c.train.micro_batch_size = 4;
                         c.parallel.dp = 2;
                         c.runtime.ranks = 2;
                       }),
                       "train.batch_size = 12 is not divisible by train.micro_batch_size × "
                       "parallel.dp = 4 × 2 = 8"));
  EXPECT_TRUE(Contains(validate_error([](Config& c) {
                         c.model.seq_len = 512;
                         c.model.max_seq_len = 256;
                       }),
                       "model.seq_len = 512 exceeds model.max_seq_len = 256"));
  EXPECT_TRUE(Contains(validate_error([](Config& c) { c.model.arch = "mamba"; }),
                       "model.arch = \"mamba\" must be one of: gpt2, llama"));
  // Llama's keys: an error under GPT-2 (they would do nothing), checked values under Llama.
  EXPECT_TRUE(Contains(validate_error([](Config& c) { c.model.n_kv_heads = 2; }),
                       "model.n_kv_heads applies to model.arch = \"llama\" only"));
  EXPECT_TRUE(Contains(validate_error([](Config& c) { c.model.rope_theta = 5e5; }),
                       "model.rope_theta applies to model.arch = \"llama\" only"));
  EXPECT_TRUE(Contains(validate_error([](Config& c) {
                         c.model.arch = "llama";
                         c.model.n_heads = 4;
                         c.model.n_kv_heads = 3;
                       }),
                       "model.n_kv_heads = 3 does not divide model.n_heads = 4"));
  EXPECT_TRUE(Contains(validate_error([](Config& c) {
                         c.model.arch = "llama";
                         c.model.d_model = 12;
                         c.model.n_heads = 4;  // head size 3: no pairs to rotate
                       }),
                       "model.d_model / model.n_heads = 3 must be even"));
  // model.head_dim (Qwen 3's heads wider than their share): the heads need not divide d_model
  // then, and the width must still be even; Llama's only, as model.qk_norm.
  EXPECT_TRUE(Contains(validate_error([](Config& c) { c.model.head_dim = 128; }),
                       "model.head_dim applies to model.arch = \"llama\" only"));
  EXPECT_TRUE(Contains(validate_error([](Config& c) { c.model.qk_norm = true; }),
                       "model.qk_norm applies to model.arch = \"llama\" only"));
  EXPECT_TRUE(Contains(validate_error([](Config& c) {
                         c.model.arch = "llama";
                         c.model.d_model = 64;
                         c.model.n_heads = 4;
                         c.model.head_dim = 7;
                       }),
                       "model.head_dim = 7 must be even"));
  EXPECT_TRUE(Contains(validate_error([](Config& c) {
                         c.model.arch = "llama";
                         c.model.d_model = 64;
                         c.model.n_heads = 5;
                       }),
                       "model.n_heads = 5 does not divide model.d_model = 64 (or set "
                       "model.head_dim)"));
  EXPECT_TRUE(Contains(validate_error([](Config& c) { c.model.sliding_window = 4096; }),
                       "model.sliding_window applies to model.arch = \"llama\" only"));
  EXPECT_TRUE(Contains(validate_error([](Config& c) {
                         c.model.arch = "llama";
                         c.model.sliding_window = -1;
                       }),
                       "model.sliding_window = -1 must be >= 0"));
  EXPECT_TRUE(Contains(validate_error([](Config& c) {
                         c.model.arch = "llama";
                         c.model.full_attention_every = 2;
                       }),
                       "model.full_attention_every = 2 picks the blocks without a window: it "
                       "needs model.sliding_window"));
  Config wide;
  wide.model.arch = "llama";
  wide.model.d_model = 64;
  wide.model.n_heads = 5;  // 5 heads of 16 from 64 channels
  wide.model.head_dim = 16;
  wide.model.qk_norm = true;
  EXPECT_NO_THROW(validate(wide));
  // OLMo 2's keys: post-norms and full-width query/key norms, Llama's only; the scope needs the
  // norms (tensor parallelism splits them: nn/split_rms_norm.h).
  EXPECT_TRUE(Contains(validate_error([](Config& c) { c.model.norm_placement = "post"; }),
                       "model.norm_placement applies to model.arch = \"llama\" only"));
  EXPECT_TRUE(Contains(validate_error([](Config& c) {
                         c.model.arch = "llama";
                         c.model.norm_placement = "peri";
                       }),
                       "model.norm_placement = \"peri\" must be one of: pre, post, sandwich"));
  Config gemma = wide;
  gemma.model.norm_placement = "sandwich";
  gemma.model.ffn_activation = "gelu_tanh";
  EXPECT_NO_THROW(validate(gemma));
  EXPECT_TRUE(Contains(validate_error([](Config& c) {
                         c.model.arch = "llama";
                         c.model.ffn_activation = "relu";
                       }),
                       "model.ffn_activation = \"relu\" must be one of: silu, gelu_tanh"));
  EXPECT_TRUE(Contains(validate_error([](Config& c) { c.model.ffn_activation = "gelu_tanh"; }),
                       "model.ffn_activation applies to model.arch = \"llama\" only"));
  EXPECT_TRUE(Contains(validate_error([](Config& c) {
                         c.model.arch = "llama";
                         c.model.ffn_activation = "gelu_tanh";
                         c.model.moe_experts = 4;
                         c.model.moe_top_k = 2;
                       }),
                       "model.ffn_activation = \"gelu_tanh\" applies to a dense MLP"));
  EXPECT_TRUE(Contains(validate_error([](Config& c) {
                         c.model.arch = "llama";
                         c.model.qk_norm_scope = "full";
                       }),
                       "model.qk_norm_scope = \"full\" needs model.qk_norm = true"));
  Config olmo2 = wide;
  olmo2.model.norm_placement = "post";
  olmo2.model.qk_norm_scope = "full";
  EXPECT_NO_THROW(validate(olmo2));
  olmo2.model.n_heads = 4;
  olmo2.runtime.ranks = olmo2.parallel.tp = 2;  // the norms' rows split over tp
  EXPECT_NO_THROW(validate(olmo2));
  EXPECT_TRUE(Contains(validate_error([](Config& c) { c.model.rope_scaling = "llama3"; }),
                       "model.rope_scaling applies to model.arch = \"llama\" only"));
  EXPECT_TRUE(Contains(validate_error([](Config& c) {
                         c.model.arch = "llama";
                         c.model.rope_scaling = "yarn";
                       }),
                       "model.rope_scaling = \"yarn\" must be one of: none, llama3, linear"));
  // Linear scaling takes its factor alone: Llama 3.1's other keys would be unused.
  EXPECT_TRUE(Contains(validate_error([](Config& c) {
                         c.model.arch = "llama";
                         c.model.rope_scaling = "linear";
                         c.model.rope_original_max_seq_len = 4096;
                       }),
                       "model.rope_original_max_seq_len applies to model.rope_scaling = "
                       "\"llama3\" only (\"linear\" takes model.rope_scaling_factor alone)"));
  EXPECT_TRUE(Contains(validate_error([](Config& c) {
                         c.model.arch = "llama";
                         c.model.rope_scaling = "linear";
                         c.model.rope_scaling_factor = 0.5;
                       }),
                       "model.rope_scaling_factor = 0.5 must be >= 1"));
  EXPECT_TRUE(Contains(validate_error([](Config& c) {
                         c.model.arch = "llama";
                         c.model.rope_scaling = "llama3";
                         c.model.rope_high_freq_factor = 0.5;
                       }),
                       "must satisfy 0 < low < high"));
  EXPECT_TRUE(Contains(validate_error([](Config& c) {
                         c.model.arch = "llama";
                         c.model.norm_eps = 0;
                       }),
                       "model.norm_eps = 0.0 must be positive"));
  EXPECT_TRUE(Contains(validate_error([](Config& c) {
                         c.model.arch = "llama";
                         c.model.ffn_hidden = 100;
                         c.parallel.tp = 8;
                         c.parallel.dp = 1;
                         c.runtime.ranks = 8;
                       }),
                       "parallel.tp = 8 does not divide the SwiGLU's hidden width 100"));
  EXPECT_TRUE(Contains(validate_error([](Config& c) { c.model.vocab_size = 0; }),
                       "model.vocab_size = 0 must be positive"));
  EXPECT_TRUE(Contains(validate_error([](Config& c) { c.model.n_layers = -2; }),
                       "model.n_layers = -2 must be positive"));
  EXPECT_TRUE(Contains(validate_error([](Config& c) { c.model.init_std = 0; }), "model.init_std"));
  EXPECT_TRUE(Contains(validate_error([](Config& c) { c.train.steps = 0; }),
                       "train.steps = 0 must be positive"));
  EXPECT_TRUE(Contains(validate_error([](Config& c) { c.train.micro_batch_size = 0; }),
                       "train.micro_batch_size = 0 must be positive"));
  EXPECT_TRUE(Contains(validate_error([](Config& c) { c.train.lr = -1e-3; }), "train.lr = -0.001"));
  EXPECT_TRUE(Contains(validate_error([](Config& c) {
                         c.train.steps = 50;
                         c.train.warmup_steps = 100;
                       }),
                       "train.warmup_steps = 100 exceeds train.steps = 50"));
  EXPECT_TRUE(Contains(validate_error([](Config& c) { c.train.beta2 = 1.0; }),
                       "train.beta2 = 1.0 must be in [0.0, 1.0)"));
  EXPECT_TRUE(
      Contains(validate_error([](Config& c) { c.train.min_lr_ratio = 2; }), "train.min_lr_ratio"));
  EXPECT_TRUE(Contains(validate_error([](Config& c) { c.train.eps = 0; }), "train.eps"));
  EXPECT_TRUE(
      Contains(validate_error([](Config& c) { c.train.grad_clip = -1; }), "train.grad_clip"));
  EXPECT_TRUE(Contains(validate_error([](Config& c) { c.train.z_loss = -1e-4; }), "train.z_loss"));
  EXPECT_TRUE(Contains(validate_error([](Config& c) { c.train.z_loss = 2; }), "train.z_loss"));
  EXPECT_TRUE(Contains(validate_error([](Config& c) { c.train.save_every = -1; }),
                       "train.save_every = -1 must be >= 0"));
  EXPECT_TRUE(Contains(validate_error([](Config& c) { c.train.keep_checkpoints = -1; }),
                       "train.keep_checkpoints = -1 must be >= 0"));
  EXPECT_TRUE(Contains(validate_error([](Config& c) { c.parallel.zero = 4; }),
                       "parallel.zero = 4 must be 0, 1, 2 or 3"));
  EXPECT_TRUE(Contains(validate_error([](Config& c) { c.parallel.schedule = "zigzag"; }),
                       "parallel.schedule = \"zigzag\" must be one of: gpipe, 1f1b, interleaved"));
  EXPECT_TRUE(Contains(validate_error([](Config& c) { c.parallel.virtual_stages = 2; }),
                       "parallel.virtual_stages = 2 needs parallel.schedule = \"interleaved\""));
  EXPECT_TRUE(Contains(validate_error([](Config& c) {
                         c.parallel.schedule = "zb-v";
                         c.parallel.pp = 2;
                       }),
                       "parallel.schedule = \"zb-v\" runs two chunks per rank in a V: it needs "
                       "parallel.virtual_stages = 2, got 1"));
  // zb-v takes any micro-batch count (interleaved's need groups of pp).
  EXPECT_NO_THROW(validate([] {
    Config c;
    c.parallel.schedule = "zb-v";
    c.parallel.pp = 2;
    c.parallel.dp = 1;
    c.parallel.virtual_stages = 2;
    c.runtime.ranks = 2;
    c.train.batch_size = 3;
    c.train.micro_batch_size = 1;
    return c;
  }()));
  EXPECT_TRUE(Contains(validate_error([](Config& c) {
                         c.parallel.virtual_stages = 2;
                         c.parallel.schedule = "interleaved";
                         c.parallel.pp = 1;
                       }),
                       "parallel.virtual_stages = 2 needs parallel.pp > 1"));
  // A chunked schedule's micro-batches come in groups of pp: a config error before any rank.
  EXPECT_TRUE(Contains(validate_error([](Config& c) {
                         c.parallel.schedule = "zb-interleaved";
                         c.parallel.virtual_stages = 2;
                         c.parallel.pp = 4;
                         c.parallel.dp = 1;
                         c.train.batch_size = 12;
                         c.train.micro_batch_size = 2;
                       }),
                       "parallel.schedule = \"zb-interleaved\" needs the micro-batches per step, "
                       "train.batch_size / (train.micro_batch_size × parallel.dp) = 6, to be a "
                       "multiple of parallel.pp = 4"));
  EXPECT_TRUE(Contains(validate_error([](Config& c) {
                         c.parallel.tp = 3;
                         c.runtime.ranks = 3;
                       }),
                       "parallel.tp = 3 does not divide model.n_heads = 4"));
  EXPECT_TRUE(Contains(validate_error([](Config& c) {
                         c.parallel.pp = 8;
                         c.runtime.ranks = 8;
                       }),
                       "exceeds model.n_layers = 4"));
  EXPECT_TRUE(Contains(validate_error([](Config& c) {
                         c.parallel.dp = 2;
                         c.parallel.tp = c.parallel.pp = 1;
                       }),
                       "runtime.ranks = 1 does not equal parallel.dp × parallel.tp × parallel.pp "
                       "= 2 × 1 × 1 = 2"));
  EXPECT_TRUE(Contains(validate_error([](Config& c) { c.runtime.backend = "gloo"; }),
                       "runtime.backend = \"gloo\" must be one of: auto, local, mpi, nccl"));
  for (const char* bad : {"gpu", "cuda:", "cuda:x", "cpu:1", "CUDA"})
    EXPECT_TRUE(Contains(validate_error([&](Config& c) { c.runtime.device = bad; }),
                         std::string("runtime.device = \"") + bad + "\""));
  EXPECT_TRUE(Contains(validate_error([](Config& c) { c.runtime.backend = "nccl"; }),
                       "runtime.backend = \"nccl\" needs a cuda runtime.device"));
  EXPECT_TRUE(Contains(validate_error([](Config& c) { c.runtime.threads_per_rank = -1; }),
                       "runtime.threads_per_rank"));
  EXPECT_TRUE(
      Contains(validate_error([](Config& c) { c.runtime.matmul_precision = "fp4"; }),
               "runtime.matmul_precision = \"fp4\" must be one of: fp32, tf32, bf16, fp16, fp8"));
  {  // fp8 runs on GPUs too (the same quantized operands on the bf16 GEMM)
    Config c;
    c.runtime.matmul_precision = "fp8";
    c.runtime.device = "cuda";
    EXPECT_NO_THROW(validate(c));
  }
  EXPECT_TRUE(
      Contains(validate_error([](Config& c) { c.runtime.fp8_block = 0; }), "runtime.fp8_block"));
  EXPECT_TRUE(Contains(validate_error([](Config& c) {
                         c.runtime.matmul_precision = "fp8";
                         c.model.d_model = 256;
                         c.model.n_heads = 4;
                         c.parallel.tp = 4;
                         c.runtime.ranks = 4;
                         c.runtime.fp8_block = 128;
                       }),
                       "runtime.fp8_block = 128 does not divide model.d_model / parallel.tp = 64"));
  EXPECT_TRUE(Contains(validate_error([](Config& c) { c.runtime.matmul_precision = "fp16"; }),
                       "runtime.matmul_precision = \"fp16\" needs runtime.device = \"cuda\""));
  EXPECT_TRUE(
      Contains(validate_error([](Config& c) { c.train.lr_schedule = "step"; }),
               "train.lr_schedule = \"step\" must be one of: cosine, linear, constant, wsd"));
  EXPECT_TRUE(Contains(validate_error([](Config& c) { c.train.lr_decay_fraction = 0; }),
                       "train.lr_decay_fraction = 0.0 must be in (0, 1]"));
  EXPECT_TRUE(Contains(validate_error([](Config& c) { c.train.loss_scale = "yes"; }),
                       "train.loss_scale = \"yes\" must be one of: auto, none, static, dynamic"));
  EXPECT_TRUE(Contains(validate_error([](Config& c) { c.train.loss_scale_init = 1000; }),
                       "train.loss_scale_init = 1000.0 must be a power of two"));
  EXPECT_TRUE(Contains(
      validate_error([](Config& c) { c.train.loss_scale_min = 131072; }),
      "train.loss_scale_min = 131072.0 must be a power of two in [1, train.loss_scale_init]"));
  EXPECT_TRUE(Contains(validate_error([](Config& c) { c.train.loss_scale_window = 0; }),
                       "train.loss_scale_window"));
  EXPECT_TRUE(Contains(validate_error([](Config& c) { c.runtime.matmul_precision = "tf32"; }),
                       "runtime.matmul_precision = \"tf32\" needs runtime.device = \"cuda\""));

  // Every problem is reported at once.
  const std::string e = validate_error([](Config& c) {
    c.train.steps = 0;
    c.runtime.backend = "bogus";
  });
  EXPECT_TRUE(Contains(e, "2 problems"));
  EXPECT_TRUE(Contains(e, "train.steps"));
  EXPECT_TRUE(Contains(e, "runtime.backend"));

  Config ok;
  ok.runtime.device = "cuda:0";
  ok.runtime.backend = "nccl";
  ok.runtime.matmul_precision = "bf16";
  EXPECT_NO_THROW(validate(ok));
  Config bf16_on_cpu;  // CPU ranks run bf16 GEMMs (cpu::set_matmul_precision)
  bf16_on_cpu.runtime.matmul_precision = "bf16";
  EXPECT_NO_THROW(validate(bf16_on_cpu));

  // Positions restart at each document only under the document mask.
  EXPECT_TRUE(Contains(validate_error([](Config& c) { c.data.reset_position_ids = true; }),
                       "data.reset_position_ids = true needs data.document_mask = true"));
  Config reset;
  reset.data.reset_position_ids = true;
  reset.data.document_mask = true;
  EXPECT_NO_THROW(validate(reset));
}

TEST(Config, OverridesParseByKeyType) {
  Config c;
  apply_override(c, "train.steps=42");
  EXPECT_EQ(c.train.steps, 42);
  apply_override(c, "parallel.dp = 2");
  EXPECT_EQ(c.parallel.dp, 2);
  apply_override(c, "train.lr=3e-4");
  EXPECT_DOUBLE_EQ(c.train.lr, 3e-4);
  apply_override(c, "train.grad_clip=2");  // an integer for a float
  EXPECT_DOUBLE_EQ(c.train.grad_clip, 2.0);
  apply_override(c, "train.recompute=true");
  EXPECT_TRUE(c.train.recompute);
  apply_override(c, "data.train=/data/fineweb/*.bin");  // bare string
  EXPECT_EQ(c.data.train, "/data/fineweb/*.bin");
  apply_override(c, "runtime.device=\"cuda:1\"");  // quoted string
  EXPECT_EQ(c.runtime.device, "cuda:1");
  apply_override(c, "data.val=");  // empty string
  EXPECT_EQ(c.data.val, "");
  apply_override(c, "data.val=a=b");  // only the first '=' splits
  EXPECT_EQ(c.data.val, "a=b");
}

// Sizes past what Loom builds are refused by name: every count derived from them (parameters,
// flops, buffer sizes) must fit an int64_t.
TEST(Config, ModelSizesPastTheLimitsAreNamed) {
  EXPECT_TRUE(Contains(validate_error([](Config& c) { c.model.d_model = int64_t{1} << 40; }),
                       "model.d_model = 1099511627776 is past the largest Loom builds, 131072"));
  EXPECT_TRUE(
      Contains(validate_error([](Config& c) { c.model.vocab_size = (int64_t{1} << 31) + 1; }),
               "model.vocab_size"));
  const std::string e = validate_error([](Config& c) {
    c.model.arch = "llama";
    c.model.n_layers = 1 << 20;
    c.model.ffn_hidden = int64_t{1} << 21;
    c.parallel.tp = 2;
  });
  EXPECT_TRUE(Contains(e, "model.n_layers = 1048576 is past the largest Loom builds, 16384")) << e;
  EXPECT_TRUE(Contains(e, "model.ffn_hidden = 2097152 is past")) << e;
  Config llama405b;  // Llama 3.1 405B's shape is inside them
  llama405b.model.arch = "llama";
  llama405b.model.vocab_size = 128256;
  llama405b.model.d_model = 16384;
  llama405b.model.n_layers = 126;
  llama405b.model.n_heads = 128;
  llama405b.model.n_kv_heads = 8;
  llama405b.model.ffn_hidden = 53248;
  llama405b.model.seq_len = 131072;
  EXPECT_NO_THROW(validate(llama405b));
}

TEST(Config, BadOverridesAreNamed) {
  std::string e = override_error("train.steps=abc");
  EXPECT_TRUE(Contains(e, "--set 'train.steps=abc'"));
  EXPECT_TRUE(Contains(e, "key 'train.steps' expects an integer, got 'abc'"));

  e = override_error("train.steps=1.5");
  EXPECT_TRUE(Contains(e, "key 'train.steps' expects an integer, got float 1.5"));

  e = override_error("train.recompute=yes");
  EXPECT_TRUE(Contains(e, "key 'train.recompute' expects a boolean"));

  // A bare string must be UTF-8, as TOML's are: the run directory's config.toml, which a resume
  // reads back, could not hold it (found by tests/fuzz: fuzz_config's round trip).
  e = override_error("data.train=/data/\xff.bin");
  EXPECT_TRUE(Contains(e, "--set 'data.train=/data/")) << e;
  EXPECT_TRUE(Contains(e, "the value is not UTF-8 (byte 6 of it)")) << e;
  EXPECT_TRUE(Contains(override_error("data.train=\xc0\xaf"), "not UTF-8 (byte 0"));  // overlong
  EXPECT_TRUE(
      Contains(override_error("data.train=a\xed\xa0\x80"), "not UTF-8 (byte 1"));       // surrogate
  EXPECT_TRUE(Contains(override_error("data.train=ab\xe2\x82"), "not UTF-8 (byte 2"));  // cut short
  Config c;
  apply_override(c, "data.train=/données/€/𝄞\tx.bin");
  EXPECT_EQ(parse_config(to_toml(c), "config.toml"), c);

  e = override_error("train.lr=1\nx=2");  // no smuggling extra TOML in
  EXPECT_TRUE(Contains(e, "key 'train.lr' expects a float"));

  e = override_error("nope.x=1");
  EXPECT_TRUE(Contains(e, "unknown section [nope]"));

  e = override_error("train.setps=1");
  EXPECT_TRUE(Contains(e, "unknown key 'train.setps'"));
  EXPECT_TRUE(Contains(e, "did you mean 'train.steps'?"));

  e = override_error("steps=1");
  EXPECT_TRUE(Contains(e, "'steps' is not section.key"));
  EXPECT_TRUE(Contains(e, "did you mean 'train.steps'?"));

  e = override_error("train.steps");
  EXPECT_TRUE(Contains(e, "--set 'train.steps'"));
  EXPECT_TRUE(Contains(e, "expected section.key=value"));
}

// parallel.recompute: none (default), full or selective; train.recompute = true is its deprecated
// spelling of "full", and contradicting it is an error naming both keys.
TEST(Config, RecomputeModesAndTheDeprecatedAlias) {
  for (const char* mode : {"none", "full", "selective"}) {
    const Config c = parse_config(std::string("[parallel]\nrecompute = \"") + mode + "\"\n", "r.toml");
    EXPECT_EQ(c.parallel.recompute, mode);
    EXPECT_EQ(c.resolved_recompute(), mode);
    EXPECT_NO_THROW(validate(c));
  }
  // The alias alone, and the alias agreeing with the new key.
  Config alias = parse_config("[train]\nrecompute = true\n", "alias.toml");
  EXPECT_EQ(alias.parallel.recompute, "none");
  EXPECT_EQ(alias.resolved_recompute(), "full");
  EXPECT_NO_THROW(validate(alias));
  apply_override(alias, "parallel.recompute=full");
  EXPECT_EQ(alias.resolved_recompute(), "full");
  EXPECT_NO_THROW(validate(alias));
  // Disagreeing: both keys named.
  apply_override(alias, "parallel.recompute=selective");
  std::string e = error_of([&] { validate(alias); });
  EXPECT_TRUE(Contains(e, "train.recompute = true"));
  EXPECT_TRUE(Contains(e, "disagrees with parallel.recompute = \"selective\""));
  // A value outside the list, a wrong type, a misspelt key.
  EXPECT_TRUE(Contains(validate_error([](Config& c) { c.parallel.recompute = "partial"; }),
                       "parallel.recompute = \"partial\" must be one of: none, full, selective"));
  e = parse_error("[parallel]\nrecompute = true\n");
  EXPECT_TRUE(Contains(e, "key 'parallel.recompute' expects a string, got boolean true"));
  e = parse_error("[parallel]\nrecompte = \"full\"\n");
  EXPECT_TRUE(Contains(e, "did you mean 'parallel.recompute'?"));
  // Overrides take the bare word, and to_toml writes the key.
  Config c;
  apply_override(c, "parallel.recompute=selective");
  EXPECT_EQ(c.parallel.recompute, "selective");
  EXPECT_TRUE(Contains(to_toml(c), "recompute = \"selective\"\n"));
}

// train.batch_rampup: Megatron-LM's rule — (batch_size - START) / INCREMENT equal increments over
// SAMPLES sequences, each once its share is consumed — and the sequences before a step; the text
// refused by name unless it is three positive whole numbers; validate() checks the batches split.
TEST(Config, BatchRampupFollowsMegatronsRule) {
  TrainConfig t;
  t.batch_size = 512;
  EXPECT_EQ(t.batch_size_at(0), 512) << "no ramp";
  EXPECT_EQ(t.samples_before(10), 5120);
  t.batch_rampup = "32 32 1000";  // 15 increments, one per 66.67 sequences
  EXPECT_EQ(t.batch_size_at(0), 32);
  EXPECT_EQ(t.batch_size_at(66), 32);
  EXPECT_EQ(t.batch_size_at(67), 64);
  EXPECT_EQ(t.batch_size_at(999), 480);  // 999 / 66.67 = 14.985: 32 + 14 · 32
  EXPECT_EQ(t.batch_size_at(1000), 512);
  EXPECT_EQ(t.samples_before(0), 0);
  EXPECT_EQ(t.samples_before(3), 32 + 32 + 32);  // 0, 32, 64 read: all below 66.67
  // After the ramp each step adds batch_size.
  const int64_t ramp_end = t.samples_before(100);
  EXPECT_EQ(t.samples_before(101) - ramp_end, 512);
  EXPECT_FALSE(parse_batch_rampup("  ").has_value());
  EXPECT_TRUE(Contains(error_of([] { parse_batch_rampup("32 32"); }), "give three numbers"));
  EXPECT_TRUE(Contains(error_of([] { parse_batch_rampup("32 x 1000"); }),
                       "'x' is not a positive whole number (INCREMENT"));
  EXPECT_TRUE(Contains(error_of([] { parse_batch_rampup("0 32 1000"); }),
                       "'0' is not a positive whole number (START"));
  EXPECT_TRUE(Contains(validate_error([](Config& c) {
                         c.parallel.dp = 1;  // as resolved for a run
                         c.train.batch_size = 8;
                         c.train.batch_rampup = "8 8 100";
                       }),
                       "START = 8 is not below train.batch_size = 8"));
  // Under a ramp the LR schedule counts sequences: batches 4 4 4 4 8 8 12 16 16 are 76 of them,
  // short of 5 full batches' warm-up (80); 4 (64) are taken.
  const auto ramped = [](int64_t warmup) {
    return [warmup](Config& c) {
      c.parallel.dp = 1;
      c.train.micro_batch_size = 4;
      c.train.batch_size = 16;
      c.train.batch_rampup = "4 4 40";
      c.train.steps = 9;
      c.train.warmup_steps = warmup;
    };
  };
  EXPECT_TRUE(Contains(validate_error(ramped(5)),
                       "train.warmup_steps = 5 full batches (80 sequences) exceeds the run's 76 "
                       "sequences under train.batch_rampup"));
  Config ok;
  ramped(4)(ok);
  EXPECT_NO_THROW(validate(ok));
  Config c;
  apply_override(c, "train.batch_rampup=4 4 100");
  EXPECT_EQ(c.train.batch_rampup, "4 4 100");
}

// data.blend: Megatron-LM's --data-path list, weighted or by token count; the config names the
// key and the word at fault.
TEST(Config, DataBlendParsesWeightsAndSpecs) {
  EXPECT_EQ(parse_data_blend("0.7 web/train_*.bin  0.3\tcode/"),
            (std::vector<BlendSource>{{0.7, "web/train_*.bin"}, {0.3, "code/"}}));
  EXPECT_EQ(parse_data_blend("a.bin b/"), (std::vector<BlendSource>{{0, "a.bin"}, {0, "b/"}}));
  EXPECT_EQ(parse_data_blend("2 a.bin"), (std::vector<BlendSource>{{2, "a.bin"}}));
  EXPECT_TRUE(Contains(error_of([] { parse_data_blend("  "); }), "data.blend is empty"));
  EXPECT_TRUE(Contains(error_of([] { parse_data_blend("0.7 a.bin 0.3"); }),
                       "3 words, but weights and specs come in pairs"));
  EXPECT_TRUE(Contains(error_of([] { parse_data_blend("0.7 a.bin b.bin c.bin"); }),
                       "source 2's weight 'b.bin' is not a number"));
  EXPECT_TRUE(Contains(error_of([] { parse_data_blend("0.7 a.bin 0 b.bin"); }),
                       "source 2's weight 0 must be a positive number"));
  EXPECT_TRUE(Contains(error_of([] { parse_data_blend("1 a.bin -1 b.bin"); }),
                       "source 2's weight -1 must be a positive number"));
  EXPECT_TRUE(Contains(error_of([] { parse_data_blend("1 a.bin nan b.bin"); }),
                       "source 2's weight nan must be a positive number"));
  EXPECT_TRUE(Contains(error_of([] { parse_data_blend("0.5 0.5 a.bin b.bin"); }),
                       "source 1 has the weight 0.5 and then another number, '0.5'"));
  // validate() reports a bad list and a blend beside data.train; the key takes --set's bare text.
  EXPECT_TRUE(Contains(validate_error([](Config& c) { c.data.blend = "0.7 a.bin 0.3"; }),
                       "invalid config: data.blend"));
  EXPECT_TRUE(Contains(validate_error([](Config& c) {
                         c.data.train = "t.bin";
                         c.data.blend = "1 a.bin 1 b.bin";
                       }),
                       "data.train = \"t.bin\" and data.blend = \"1 a.bin 1 b.bin\" are both set"));
  Config c;
  apply_override(c, "data.blend=0.7 web/*.bin 0.3 code/*.bin");
  EXPECT_EQ(c.data.blend, "0.7 web/*.bin 0.3 code/*.bin");
  apply_override(c, "data.shuffle=true");
  EXPECT_TRUE(c.data.shuffle);
  EXPECT_NO_THROW(validate(c));
  EXPECT_EQ(parse_config(to_toml(c), "blend.toml"), c);
}

// data.val_sets: NAME=SPEC words, each error naming the key and the word.
TEST(Config, ValSetsParseNamesAndSpecs) {
  EXPECT_EQ(parse_val_sets(" web=data/web/val_*.bin\tcode-2=code/ "),
            (std::vector<ValSet>{{"web", "data/web/val_*.bin"}, {"code-2", "code/"}}));
  EXPECT_EQ(parse_val_sets("a=x=y.bin"), (std::vector<ValSet>{{"a", "x=y.bin"}}));
  EXPECT_TRUE(Contains(error_of([] { parse_val_sets(""); }), "data.val_sets is empty"));
  EXPECT_TRUE(Contains(error_of([] { parse_val_sets("web"); }), "'web' is not NAME=SPEC"));
  EXPECT_TRUE(Contains(error_of([] { parse_val_sets("=a.bin"); }), "'=a.bin': the name"));
  EXPECT_TRUE(Contains(error_of([] { parse_val_sets("w.b=a.bin"); }), "'w.b=a.bin': the name"));
  EXPECT_TRUE(Contains(error_of([] { parse_val_sets("web="); }), "'web=' names no shards"));
  EXPECT_TRUE(
      Contains(error_of([] { parse_val_sets("a=x.bin a=y.bin"); }), "the name 'a' is given twice"));
  EXPECT_TRUE(Contains(validate_error([](Config& c) { c.data.val_sets = "web"; }),
                       "invalid config: data.val_sets: 'web' is not NAME=SPEC"));
}

TEST(Config, ToTomlRoundTrips) {
  EXPECT_EQ(parse_config(to_toml(Config{}), "defaults.toml"), Config{});

  Config c = parse_config(kFull, "full.toml");
  c.data.val = "path with \"quotes\", back\\slash, tab\t and ünïcode";
  c.train.lr = 0.1 + 0.2;  // needs 17 significant digits
  c.train.eps = 1e-300;
  c.train.beta1 = 3.0;  // integral float stays a float
  c.train.seed = int64_t{1} << 62;
  const std::string text = to_toml(c);
  EXPECT_TRUE(Contains(text, "[parallel]\n"));
  EXPECT_TRUE(Contains(text, "beta1 = 3.0\n"));
  const Config back = parse_config(text, "roundtrip.toml");
  EXPECT_EQ(back, c) << text;
  EXPECT_EQ(to_toml(back), text);
}

TEST(Config, LoadConfigNamesTheFile) {
  std::string e = error_of([] { load_config("/nonexistent/dir/run.toml"); });
  EXPECT_TRUE(Contains(e, "/nonexistent/dir/run.toml"));
  EXPECT_TRUE(Contains(e, "does not exist"));

  e = error_of([] { load_config(::testing::TempDir()); });
  EXPECT_TRUE(Contains(e, "is a directory"));

  TempFile bad("[model]\nd_model = 64\nn_heads = = 4\n");
  e = error_of([&] { load_config(bad.path()); });
  EXPECT_TRUE(Contains(e, bad.path() + ":3:"));
  EXPECT_TRUE(Contains(e, "TOML syntax error"));

  TempFile unknown("[train]\n\nlearnig_rate = 1\n");
  e = error_of([&] { load_config(unknown.path()); });
  EXPECT_TRUE(Contains(e, unknown.path() + ":3: unknown key 'train.learnig_rate'"));

  TempFile good(kFull);
  EXPECT_EQ(load_config(good.path()), parse_config(kFull, "full.toml"));
}

}  // namespace
}  // namespace loom

namespace loom {
namespace {
TEST(Config, LlamaDefaultsFollowLlamasRules) {
  ModelConfig m;
  m.arch = "llama";
  m.d_model = 4096;  // Llama 2 7B: 8·4096/3 = 10922.67 → 11008, a multiple of 256
  m.n_heads = 32;
  EXPECT_EQ(m.resolved_ffn_hidden(), 11008);
  EXPECT_EQ(m.resolved_n_kv_heads(), 32);  // 0: one key/value head per query head
  m.n_kv_heads = 8;
  m.ffn_hidden = 14336;  // Llama 3 8B
  EXPECT_EQ(m.resolved_n_kv_heads(), 8);
  EXPECT_EQ(m.resolved_ffn_hidden(), 14336);
  m.arch = "gpt2";  // GPT-2: the 4× MLP and a key/value head per query head, whatever is set
  EXPECT_EQ(m.resolved_ffn_hidden(), 4 * 4096);
  EXPECT_EQ(m.resolved_n_kv_heads(), 32);
  // The keys round-trip through the TOML the run directory keeps.
  Config c;
  c.model.arch = "llama";
  c.model.n_kv_heads = 2;
  c.model.rope_theta = 500000;
  c.model.norm_eps = 1e-6;
  EXPECT_EQ(parse_config(to_toml(c), "round trip"), c);
}
}  // namespace
}  // namespace loom
