// The `loom` command line as a user meets it: every bad input is one clear line and a non-zero
// exit code; the happy paths produce their files.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace {
namespace fs = std::filesystem;

struct Result {
  int code;
  std::string output;
};

const std::string kLoom = std::string(LOOM_BINARY_DIR) + "/apps/loom";

// `env` (NAME=value ...) is set for the command only.
Result run(const std::string& args, const std::string& env = "") {
  const std::string cmd = env + (env.empty() ? "" : " ") + kLoom + " " + args + " 2>&1";
  FILE* pipe = popen(cmd.c_str(), "r");
  std::string out;
  std::array<char, 4096> buf;
  while (size_t n = fread(buf.data(), 1, buf.size(), pipe)) out.append(buf.data(), n);
  const int status = pclose(pipe);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

class Cli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("loom_cli_test_" + std::to_string(getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  std::string write_config(const std::string& extra) const {
    const std::string p = path("cfg.toml");
    std::ofstream(p) << "[model]\nvocab_size = 256\nseq_len = 16\nd_model = 16\nn_layers = 1\n"
                        "n_heads = 2\n[data]\ntrain = \"" + path("data/train_*.bin") +
                        "\"\nval = \"" + path("data/val_*.bin") + "\"\n[train]\nsteps = 4\n"
                        "batch_size = 4\nmicro_batch_size = 2\nwarmup_steps = 1\neval_every = 2\n"
                        "save_every = 2\n" + extra;
    return p;
  }
  fs::path dir_;
};

void expect_error(const Result& r, const std::string& needle) {
  EXPECT_NE(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("loom: error:"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(needle), std::string::npos) << "expected '" << needle << "' in:\n" << r.output;
}

TEST_F(Cli, SynthTrainSampleHappyPath) {
  ASSERT_EQ(run("data synth --out " + path("data") + " --train-tokens 20000 --val-tokens 4000").code, 0);
  Result t = run("train " + write_config("") + " --run-dir " + path("run") + " --quiet");
  ASSERT_EQ(t.code, 0) << t.output;
  EXPECT_TRUE(fs::exists(path("run/metrics.jsonl")));
  Result s = run("sample --checkpoint " + path("run/checkpoints/step_4") +
                 " --prompt 12+ --tokens 8 --temperature 0");
  ASSERT_EQ(s.code, 0) << s.output;
  EXPECT_EQ(s.output.rfind("12+", 0), 0u) << s.output;  // the prompt, then 8 more bytes
  // A run directory samples from its newest checkpoint: the same greedy text, and it says which.
  Result from_run =
      run("sample --checkpoint " + path("run") + " --prompt 12+ --tokens 8 --temperature 0");
  ASSERT_EQ(from_run.code, 0) << from_run.output;
  EXPECT_NE(from_run.output.find("sampling from " + path("run/checkpoints/step_4")),
            std::string::npos)
      << from_run.output;
  EXPECT_NE(from_run.output.find(s.output), std::string::npos) << from_run.output;
  // Sampling options out of range are errors that name the option, not a silent default.
  const std::string sample = "sample --checkpoint " + path("run/checkpoints/step_4");
  expect_error(run(sample + " --prompt 1 --tokens -1"), "--tokens must be >= 0, got -1");
  expect_error(run(sample + " --prompt 1 --temperature -1"), "--temperature must be >= 0");
  expect_error(run(sample + " --prompt 1 --top-k -2"), "--top-k must be >= 0, got -2");
  expect_error(run(sample + " --prompt ''"), "non-empty prompt");
}

// `loom data inspect`: a corpus' shards, tokens and sequences on stdout; with --vocab every id
// read, exit 1 when one is past it (naming the shard and the position), a missing spec an error.
TEST_F(Cli, DataInspectCountsAndChecksIds) {
  ASSERT_EQ(
      run("data synth --out " + path("data") + " --train-tokens 20000 --val-tokens 4000").code, 0);
  Result ok = run("data inspect '" + path("data") + "/train_*.bin' --seq-len 64 --vocab 256");
  ASSERT_EQ(ok.code, 0) << ok.output;
  EXPECT_NE(ok.output.find("1 shard, 20000 tokens, 312 sequences of 64"), std::string::npos)
      << ok.output;
  EXPECT_NE(ok.output.find("ids >= 256: none"), std::string::npos) << ok.output;
  // The synthetic corpus' bytes are digits, '+', '=' and '\n': ids up to '9' = 57.
  Result bad = run("data inspect " + path("data") + " --vocab 50");
  EXPECT_EQ(bad.code, 1) << bad.output;
  EXPECT_NE(bad.output.find("ids >= 50: "), std::string::npos) << bad.output;
  EXPECT_NE(bad.output.find("train_000000.bin, the first at token "), std::string::npos)
      << bad.output;
  expect_error(run("data inspect " + path("nope")), "nope");
  expect_error(run("data inspect"), "give shard specs, or --config");
  // A config's corpora at its model's sequence length and vocabulary, and the passes the run
  // makes over its training corpus: 4 steps of 4 sequences of 16 = 256 of 20000 tokens.
  Result config = run("data inspect --config " + write_config(""));
  ASSERT_EQ(config.code, 0) << config.output;
  EXPECT_NE(config.output.find("data.train = " + path("data/train_*.bin") +
                               ": 1 shard, 20000 tokens, 1249 sequences of 16"),
            std::string::npos)
      << config.output;
  EXPECT_NE(config.output.find("data.val = "), std::string::npos) << config.output;
  EXPECT_NE(config.output.find("(20000 tokens; 0.01 passes over this run)"), std::string::npos)
      << config.output;
  EXPECT_EQ(run("data inspect --config " + write_config("") + " --set model.vocab_size=60").code,
            1);
  // Documents: each "a+b=c\n" problem ends at its newline (10), by --eot or, with --config, by
  // data.eot_token where data.document_mask is on.
  Result docs = run("data inspect " + path("data") + "/train_000000.bin --eot 10");
  ASSERT_EQ(docs.code, 0) << docs.output;
  EXPECT_NE(docs.output.find(" documents ending at token 10 (mean "), std::string::npos)
      << docs.output;
  Result masked = run("data inspect --config " + write_config("") +
                      " --set data.document_mask=true --set data.eot_token=10");
  ASSERT_EQ(masked.code, 0) << masked.output;
  EXPECT_NE(masked.output.find(" documents ending at token 10 (mean "), std::string::npos)
      << masked.output;
  EXPECT_EQ(config.output.find("documents ending"), std::string::npos) << "no mask, no count";
}

// Fine-tuning's loss masks end to end: `loom data synth --answer-masks` writes them beside the
// shards, `data inspect` reports them, `train` with data.loss_mask says what it reads; a run that
// asks for masks its corpus lacks is refused naming the file it looked for; a corpus written again
// loses its old masks. `data prepare --sft` makes them from prompt-completion JSONL, and a run
// trains on them.
TEST_F(Cli, LossMasksFromSynthAndPrepareTrainWithDataLossMask) {
  Result synth = run("data synth --out " + path("data") +
                     " --train-tokens 20000 --val-tokens 4000 --answer-masks");
  ASSERT_EQ(synth.code, 0) << synth.output;
  EXPECT_NE(synth.output.find("wrote loss masks beside them: "), std::string::npos) << synth.output;
  ASSERT_TRUE(fs::exists(path("data/train_000000.bin.mask")));
  Result inspect = run("data inspect '" + path("data") + "/train_*.bin'");
  ASSERT_EQ(inspect.code, 0) << inspect.output;
  EXPECT_NE(inspect.output.find("loss masks beside 1 of the shards: "), std::string::npos)
      << inspect.output;
  Result t =
      run("train " + write_config("") + " --set data.loss_mask=true --run-dir " + path("run"));
  ASSERT_EQ(t.code, 0) << t.output;
  EXPECT_NE(t.output.find("data.loss_mask: 1 of 1 shards of data.train have loss masks"),
            std::string::npos)
      << t.output;
  ASSERT_EQ(
      run("data synth --out " + path("data") + " --train-tokens 20000 --val-tokens 4000").code, 0);
  EXPECT_FALSE(fs::exists(path("data/train_000000.bin.mask")));
  expect_error(
      run("train " + write_config("") + " --set data.loss_mask=true --run-dir " + path("run2")),
      "no shard of data.train has a loss mask beside it (for '" + path("data/train_000000.bin") +
          "' that is '" + path("data/train_000000.bin.mask") + "'");

  // `data prepare --sft`: prompt-completion JSONL, the completions counted; a training run on it.
  {
    std::ofstream jsonl(path("sft.jsonl"));
    for (int i = 0; i < 400; ++i)
      jsonl << "{\"prompt\": \"" << i << " doubled is \", \"completion\": \"" << 2 * i << "\"}\n";
  }
  Result sft = run("data prepare " + path("sft.jsonl") + " --sft --eot 10 --out " + path("sft"));
  ASSERT_EQ(sft.code, 0) << sft.output;
  EXPECT_NE(sft.output.find("val tokens, loss masks beside them (the completions count)"),
            std::string::npos)
      << sft.output;
  ASSERT_TRUE(fs::exists(path("sft/val_000000.bin.mask")));
  Result tuned = run("train " + write_config("") +
                     " --set data.loss_mask=true --set data.train=" + path("sft/train_*.bin") +
                     " --set data.val=" + path("sft/val_*.bin") + " --run-dir " + path("run_sft"));
  ASSERT_EQ(tuned.code, 0) << tuned.output;
  EXPECT_NE(tuned.output.find("data.loss_mask: 1 of 1 shards of data.train have loss masks"),
            std::string::npos)
      << tuned.output;
  expect_error(run("data prepare " + path("sft.jsonl") + " --eot 10 --out " + path("x")),
               "--eot needs --sft");
  // A validation shard's mask that does not fit is refused before the first step.
  fs::resize_file(path("sft/val_000000.bin.mask"), 1024 + 3);
  const Result bad =
      run("train " + write_config("") +
          " --set data.loss_mask=true --set data.train=" + path("sft/train_*.bin") +
          " --set data.val=" + path("sft/val_*.bin") + " --run-dir " + path("run_bad"));
  expect_error(bad, "loss mask '" + path("sft/val_000000.bin.mask") + "': the header says");
  EXPECT_EQ(bad.output.find("step "), std::string::npos) << bad.output;
}

TEST_F(Cli, UnknownConfigKey) {
  expect_error(run("train " + write_config("learnig_rate = 0.1\n")), "train.learnig_rate");
}

TEST_F(Cli, HeadsNotDividingDModel) {
  expect_error(run("train " + write_config("") + " --set model.n_heads=3"),
               "model.n_heads = 3 does not divide model.d_model = 16");
}

// A bad LOOM_CPU_GEMM is a clear error before any work, not an abort in a pool thread.
TEST_F(Cli, UnknownCpuGemmInTheEnvironment) {
  setenv("LOOM_CPU_GEMM", "mkl", 1);
  const Result r = run("train " + write_config(""));
  unsetenv("LOOM_CPU_GEMM");
  expect_error(r, "LOOM_CPU_GEMM='mkl'");
}

TEST_F(Cli, MissingConfigFile) { expect_error(run("train " + path("nope.toml")), "nope.toml"); }

TEST_F(Cli, ScheduleTimeline) {
  Result r = run("schedule --pp 4 --microbatches 8 --schedule 1f1b");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("rank 0 | F0 F1 F2 F3 ."), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("rank 3 | .  .  .  F0 B0 B0 F1"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("bubble (simulated): 0.273"), std::string::npos) << r.output;
  expect_error(run("schedule --pp 4 --microbatches 6 --schedule interleaved --virtual-stages 2"),
               "needs the micro-batch count 6 to be a multiple of parallel.pp = 4");
  // zb-v takes its two chunks without --virtual-stages, and any micro-batch count; a third
  // chunk is refused by name.
  Result v = run("schedule --pp 2 --microbatches 3 --schedule zb-v");
  ASSERT_EQ(v.code, 0) << v.output;
  EXPECT_NE(v.output.find("zb-v: pp 2, 3 micro-batches, 2 chunks per rank"), std::string::npos)
      << v.output;
  EXPECT_NE(v.output.find("rank 0 | F0a F1a F2a F0b B0b"), std::string::npos) << v.output;
  EXPECT_NE(v.output.find("bubble (simulated): 0.053"), std::string::npos) << v.output;  // 1/19
  expect_error(run("schedule --pp 2 --microbatches 3 --schedule zb-v --virtual-stages 3"),
               "it needs parallel.virtual_stages = 2, got 3");
}

TEST_F(Cli, MissingDataFile) {
  expect_error(run("train " + write_config("") + " --run-dir " + path("run")), "data.train");
}

TEST_F(Cli, WrongMagic) {
  fs::create_directories(path("data"));
  std::ofstream(path("data/train_000000.bin"), std::ios::binary)
      << std::string(1024 + 64, '\x07');
  expect_error(run("train " + write_config("") + " --run-dir " + path("run")), "train_000000.bin");
}

TEST_F(Cli, BadCommandLineIsUsageError) {
  Result r = run("train");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(run("frobnicate").code, 0);
  // A number out of range names the option and the value, plainly (not CLI11's "not in range
  // 0.000000 to 1.79...e308").
  r = run("plan " + path("any.toml") + " --devices 0");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("--devices: must be positive, got '0'"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("not in range"), std::string::npos) << r.output;
  r = run("train " + path("any.toml") + " --ranks -2");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("--ranks: must be positive, got '-2'"), std::string::npos) << r.output;
}

// `loom checkpoint verify` checks a run's checkpoints against their recorded digests: exit 0 when
// all are as written; one damaged file is a BAD line, its error and exit 1, the others still ok.
TEST_F(Cli, CheckpointVerify) {
  ASSERT_EQ(
      run("data synth --out " + path("data") + " --train-tokens 20000 --val-tokens 4000").code, 0);
  ASSERT_EQ(run("train " + write_config("") + " --run-dir " + path("run") + " --quiet").code, 0);
  Result ok = run("checkpoint verify " + path("run"));
  EXPECT_EQ(ok.code, 0) << ok.output;
  EXPECT_NE(ok.output.find("ok   " + path("run/checkpoints/step_2")), std::string::npos)
      << ok.output;
  EXPECT_NE(ok.output.find("ok   " + path("run/checkpoints/step_4")), std::string::npos)
      << ok.output;

  // Export: a run dir means its newest checkpoint; the formats are hf (a directory) and llmc.
  Result hf = run("checkpoint export " + path("run") + " --out " + path("hf"));
  EXPECT_EQ(hf.code, 0) << hf.output;
  EXPECT_NE(hf.output.find("exported " + path("run/checkpoints/step_4")), std::string::npos)
      << hf.output;
  EXPECT_TRUE(fs::exists(path("hf/model.safetensors")));
  EXPECT_TRUE(fs::exists(path("hf/config.json")));
  // --max-shard-size takes save_pretrained's sizes: 10KB (10 000 bytes) splits this model (30 kB).
  Result split =
      run("checkpoint export " + path("run") + " --max-shard-size 10KB --out " + path("split"));
  EXPECT_EQ(split.code, 0) << split.output;
  EXPECT_TRUE(fs::exists(path("split/model.safetensors.index.json")));
  EXPECT_TRUE(fs::exists(path("split/model-00002-of-00003.safetensors")));
  EXPECT_FALSE(fs::exists(path("split/model.safetensors")));
  Result none =
      run("checkpoint export " + path("run") + " --max-shard-size 0 --out " + path("none"));
  EXPECT_EQ(none.code, 2) << none.output;
  EXPECT_NE(none.output.find("--max-shard-size"), std::string::npos) << none.output;
  Result llmc = run("checkpoint export " + path("run/checkpoints/step_2") +
                    " --format llmc --bf16 --out " + path("model.bin"));
  EXPECT_EQ(llmc.code, 0) << llmc.output;
  EXPECT_TRUE(fs::exists(path("model.bin")));
  Result onnx = run("checkpoint export " + path("run") + " --format onnx --out " + path("x"));
  EXPECT_EQ(onnx.code, 2) << onnx.output;
  EXPECT_NE(onnx.output.find("onnx"), std::string::npos) << onnx.output;

  // Resumed at its last step, the run has nothing left to do and says so.
  Result again = run("train " + write_config("") + " --run-dir " + path("run") + " --resume auto");
  EXPECT_EQ(again.code, 0) << again.output;
  EXPECT_NE(again.output.find("nothing to train, the run is at step 4 of train.steps = 4"),
            std::string::npos)
      << again.output;

  const std::string model = path("run/checkpoints/step_4/model.safetensors");
  std::fstream f(model, std::ios::binary | std::ios::in | std::ios::out);
  const auto middle = static_cast<std::streamoff>(fs::file_size(model) / 2);
  f.seekg(middle);
  const char was = static_cast<char>(f.get());
  f.seekp(middle);
  f.put(static_cast<char>(was ^ 0x20));  // one bit of a weight
  f.close();
  Result bad = run("checkpoint verify " + path("run/checkpoints"));
  expect_error(bad, "model.safetensors is not what was written");
  EXPECT_NE(bad.output.find("BAD  " + path("run/checkpoints/step_4")), std::string::npos)
      << bad.output;
  EXPECT_NE(bad.output.find("ok   " + path("run/checkpoints/step_2")), std::string::npos)
      << bad.output;
  expect_error(run("train " + write_config("") + " --run-dir " + path("run") + " --resume auto"),
               "--resume " + path("run/checkpoints/step_2"));
  expect_error(run("checkpoint verify " + path("nowhere")), "no checkpoint there");
}

// A Llama through the command line: train, sample, export for transformers; resuming a GPT-2
// run with a Llama config says which architecture the checkpoint holds, and the Llama's with qkv
// biases (a Qwen 2's form) that it has none; `model.qkv_bias` on a GPT-2 is named.
TEST_F(Cli, LlamaTrainsSamplesExportsAndRefusesAnotherArchitecturesCheckpoint) {
  ASSERT_EQ(
      run("data synth --out " + path("data") + " --train-tokens 20000 --val-tokens 4000").code, 0);
  Result trained = run("train " + write_config("") + " --run-dir " + path("llama") +
                       " --set model.arch=llama --set model.n_kv_heads=1 --set model.ffn_hidden=40 --quiet");
  EXPECT_EQ(trained.code, 0) << trained.output;
  Result sampled = run("sample --checkpoint " + path("llama") + " --prompt 1+1= --tokens 8");
  EXPECT_EQ(sampled.code, 0) << sampled.output;
  EXPECT_NE(sampled.output.find("1+1="), std::string::npos) << sampled.output;
  Result hf = run("checkpoint export " + path("llama") + " --out " + path("hf"));
  EXPECT_EQ(hf.code, 0) << hf.output;
  std::ifstream cf(path("hf/config.json"));
  EXPECT_EQ(nlohmann::json::parse(cf)["architectures"][0], "LlamaForCausalLM");
  ASSERT_EQ(run("train " + write_config("") + " --run-dir " + path("gpt2") + " --quiet").code, 0);
  expect_error(run("train " + write_config("") + " --run-dir " + path("gpt2") +
                   " --resume auto --set train.steps=6 --set model.arch=llama"),
               "holds a gpt2 model, but model.arch = \"llama\"");
  expect_error(run("train " + write_config("") + " --run-dir " + path("llama") +
                   " --resume auto --set train.steps=6 --set model.arch=llama --set "
                   "model.n_kv_heads=1 --set model.ffn_hidden=40 --set model.qkv_bias=true"),
               "holds a llama model, but model.arch = \"llama\" with model.qkv_bias = true");
  expect_error(run("train " + write_config("") + " --set model.qkv_bias=true"),
               "model.qkv_bias applies to model.arch = \"llama\" only");
  // Qwen 3's norms and another heads' width: named, not a parameter's shape or a missing name.
  const std::string llama_run =
      " --resume auto --set train.steps=6 --set model.arch=llama --set "
      "model.n_kv_heads=1 --set model.ffn_hidden=40";
  expect_error(run("train " + write_config("") + " --run-dir " + path("llama") + llama_run +
                   " --set model.qk_norm=true"),
               "holds a llama model, but model.arch = \"llama\" with model.qk_norm = true");
  expect_error(
      run("train " + write_config("") + " --run-dir " + path("llama") + llama_run +
          " --set model.head_dim=16"),
      "with heads of 8 model, but model.arch = \"llama\" with heads of 16 (model.head_dim)");
  expect_error(run("train " + write_config("") + " --set model.qk_norm=true"),
               "model.qk_norm applies to model.arch = \"llama\" only");
}

// A HuggingFace byte-level BPE tokenizer through the command line: `data prepare --tokenizer`
// writes shards in its vocabulary (and says how large model.vocab_size must be), a model trains
// on them, and `sample --tokenizer` reads the prompt and writes the new tokens as text; a model of
// a smaller vocabulary is refused.
TEST_F(Cli, ATokenizersShardsTrainAndItsModelSamplesText) {
  const std::string tokenizer = std::string(LOOM_SOURCE_DIR) + "/tests/data/tokenizers/gpt2.json";
  {
    std::ofstream text(path("play.txt"));
    for (int i = 0; i < 60; ++i)
      text << "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, "
              "speak.\n\n";
  }
  Result prep = run("data prepare " + path("play.txt") + " --tokenizer " + tokenizer + " --out " +
                    path("data"));
  ASSERT_EQ(prep.code, 0) << prep.output;
  EXPECT_NE(prep.output.find("uint16 shards of " + tokenizer +
                             " (end-of-text 0): "
                             "model.vocab_size >= 600"),
            std::string::npos)
      << prep.output;
  Result t = run("train " + write_config("") + " --set model.vocab_size=640 --run-dir " +
                 path("run") + " --quiet");
  ASSERT_EQ(t.code, 0) << t.output;
  const std::string sample = "sample --checkpoint " + path("run") +
                             " --prompt 'First Citizen:' "
                             "--tokens 6 --temperature 0 --tokenizer " +
                             tokenizer;
  Result s = run(sample);
  ASSERT_EQ(s.code, 0) << s.output;
  const size_t at = s.output.find("First Citizen:");
  ASSERT_NE(at, std::string::npos) << s.output;
  EXPECT_GT(s.output.size(), at + std::string("First Citizen:").size() + 1) << s.output;
  EXPECT_EQ(run(sample).output, s.output);  // greedy: the same text again

  ASSERT_EQ(
      run("data synth --out " + path("bytes") + " --train-tokens 20000 --val-tokens 4000").code, 0);
  ASSERT_EQ(run("train " + write_config("") + " --set data.train=" + path("bytes/train_*.bin") +
                " --set data.val=" + path("bytes/val_*.bin") + " --run-dir " + path("byte_run"))
                .code,
            0);
  expect_error(
      run("sample --checkpoint " + path("byte_run") + " --prompt x --tokenizer " + tokenizer),
      "vocab_size 256 is smaller than " + tokenizer + "'s 600 tokens");
  expect_error(run("data prepare " + path("play.txt") + " --no-eot --out " + path("x")),
               "--no-eot needs --tokenizer");
  expect_error(run("data prepare " + path("play.txt") + " --tokenizer " + path("play.txt") +
                   " --out " + path("x")),
               "tokenizer " + path("play.txt") + ": not a tokenizer.json Loom reads");
}

TEST_F(Cli, SampleFromMissingCheckpoint) {
  expect_error(run("sample --checkpoint " + path("none") + " --prompt x"), path("none"));
}

TEST_F(Cli, BenchJsonHasTheNamedFields) {
  Result r = run("bench train --shape tiny --threads 1 --steps 1 --warmup 0 --json");
  ASSERT_EQ(r.code, 0) << r.output;
  for (const char* key : {"\"shape\":\"tiny\"", "\"threads\":1", "\"tokens_per_s\"", "\"gflops\"",
                          "\"peak_rss_mb\""})
    EXPECT_NE(r.output.find(key), std::string::npos) << key << " in " << r.output;
  expect_error(run("bench train --shape huge"), "unknown benchmark shape 'huge'");
}

// The Llama shapes train through the same benchmark (Gpt2Config::arch = kLlama): llama-tiny's
// parameters and flops per token are Llama's counts (no biases, no position table, grouped-query
// qkv of (4 + 2·2)·16 outputs, SwiGLU's fused gate/up), not GPT-2's of the same sizes.
TEST_F(Cli, BenchTrainsTheLlamaShapes) {
  Result r = run("bench train --shape llama-tiny --threads 1 --steps 1 --warmup 0 --json");
  ASSERT_EQ(r.code, 0) << r.output;
  const nlohmann::json j = nlohmann::json::parse(r.output.substr(r.output.find('{')));
  EXPECT_EQ(j["shape"], "llama-tiny");
  // wte 256·64; per block two RMSNorm weights, qkv 64·128, proj 64·64, SwiGLU 3·64·176; ln_f.
  const int64_t params = 256 * 64 + 2 * (2 * 64 + 64 * 128 + 64 * 64 + 3 * 64 * 176) + 64;
  EXPECT_EQ(j["parameters"].get<int64_t>(), params);
  EXPECT_EQ(j["flops_per_token"].get<double>(), 6.0 * params + 12.0 * 2 * 64 * 32);
  EXPECT_GT(j["tokens_per_s"].get<double>(), 0);
}

// --precision bf16 on the CPU runs the bf16 GEMM kernel and measures its peak with the same
// instruction (vdpbf16ps or FMAs: cpu::bf16_kernel()); tf32 / fp16 are GPU-only.
TEST_F(Cli, BenchAtBf16OnTheCpuNamesItsKernelAndPeak) {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512f")) GTEST_SKIP() << "bf16 GEMMs on CPU ranks need AVX-512";
  Result r =
      run("bench train --shape tiny --threads 1 --steps 1 --warmup 0 --precision bf16 --json");
  ASSERT_EQ(r.code, 0) << r.output;
  const nlohmann::json j = nlohmann::json::parse(r.output.substr(r.output.find('{')));
  EXPECT_EQ(j["precision"], "bf16");
  // The peak is measured with the instruction the kernel runs.
  const std::string kernel = j["cpu_gemm"];
  if (kernel == "loom-avx512-bf16-dot")
    EXPECT_EQ(j["fma_isa"], "avx512-bf16");
  else if (kernel == "loom-avx512-bf16-fma")
    EXPECT_EQ(j["fma_isa"], "avx512");
  else
    ADD_FAILURE() << "cpu_gemm " << kernel;
  Result fp32 = run("bench train --shape tiny --threads 1 --steps 1 --warmup 0 --json");
  ASSERT_EQ(fp32.code, 0) << fp32.output;
  EXPECT_EQ(nlohmann::json::parse(fp32.output.substr(fp32.output.find('{')))["cpu_gemm"],
            "loom-avx512");
  expect_error(run("bench train --shape tiny --precision fp16"),
               "--precision fp16 needs --device cuda");
}

TEST_F(Cli, BenchProfileListsEachOpKindWithinTheStep) {
  Result r = run("bench train --shape tiny --threads 1 --steps 2 --warmup 1 --profile --json");
  ASSERT_EQ(r.code, 0) << r.output;
  const nlohmann::json j = nlohmann::json::parse(r.output.substr(r.output.find('{')));
  ASSERT_TRUE(j.contains("ops")) << r.output;
  double total = 0;
  std::vector<std::string> names;
  for (const auto& op : j["ops"]) {
    names.push_back(op["op"]);
    total += op["ms_per_step"].get<double>();
  }
  for (const char* op : {"matmul_forward", "matmul_backward", "attention_forward",
                         "layernorm_backward", "cross_entropy_forward", "adamw_update"})
    EXPECT_NE(std::find(names.begin(), names.end(), op), names.end()) << op;
  // The ops run inside the step (medians vs means: a margin for a noisy machine).
  EXPECT_GT(total, 0);
  EXPECT_LT(total, 1.5 * j["step_ms"].get<double>()) << r.output;
  expect_error(run("bench train --shape tiny --ranks 2 --profile"), "--profile times one rank");
}

}  // namespace

namespace {
TEST_F(Cli, DebugHangWithoutDumpsIsAClearError) {
  expect_error(run("debug hang " + path("run")), "does not exist");
}
}  // namespace

namespace {
TEST_F(Cli, BenchCommLocalJson) {
  Result r = run("bench comm --backend local --ranks 3 --op all --sizes 4K,64K --iters 2 --warmup 1 --json");
  ASSERT_EQ(r.code, 0) << r.output;
  int lines = 0;
  for (size_t pos = 0; (pos = r.output.find("\"backend\":\"local\"", pos)) != std::string::npos; ++pos) ++lines;
  EXPECT_EQ(lines, 6 * 2) << r.output;  // every collective at both sizes
  for (const char* key : {"\"op\":\"all_to_all\"", "\"ranks\":3", "\"algbw_gbps\"", "\"busbw_gbps\"",
                          "\"ceiling_gbps\"", "\"bytes\":"})
    EXPECT_NE(r.output.find(key), std::string::npos) << key;
  expect_error(run("bench comm --op all_reduse"), "unknown collective 'all_reduse'");
  expect_error(run("bench comm --sizes 1Q"), "--sizes");
  // bf16 elements (the wire format of parallel.grad_reduce_dtype), named in every row.
  Result b = run("bench comm --backend local --ranks 2 --op all_reduce --sizes 4K --iters 2 "
                 "--warmup 1 --dtype bf16 --json");
  ASSERT_EQ(b.code, 0) << b.output;
  EXPECT_NE(b.output.find("\"dtype\":\"bf16\""), std::string::npos) << b.output;
  expect_error(run("bench comm --dtype fp16"), "--dtype fp16: expected fp32 or bf16");
}

// `loom bench attention`: the whole sequence's attention against a cp rank's rows, timed, with
// the rows' output checked against the whole sequence's rows; bad sizes refused by name.
TEST_F(Cli, BenchAttentionTimesTheRowsAndChecksThem) {
  Result r =
      run("bench attention --seq 64 --heads 2 --kv-heads 1 --head-dim 16 --cp 2 --iters 1 "
          "--json");
  ASSERT_EQ(r.code, 0) << r.output;
  const nlohmann::json j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["seq"], 64);
  EXPECT_EQ(j["cp"], 2);
  EXPECT_EQ(j["kv_heads"], 1);
  for (const char* key : {"whole_fwd_ms", "whole_bwd_ms", "rows_fwd_ms", "rows_bwd_ms",
                          "cp_fwd_efficiency", "cp_bwd_efficiency"})
    EXPECT_GT(j[key].get<double>(), 0) << key;
  EXPECT_LT(j["max_diff"].get<double>(), 1e-6) << "the rows are not the whole sequence's";
  EXPECT_EQ(j["documents"], 0);
  EXPECT_EQ(j["doc_fwd_ms"].get<double>(), 0) << "not timed without --documents";
  // With documents of 16 tokens (4 of the 64): 4 · 136 of 2080 causal pairs.
  r = run(
      "bench attention --seq 64 --heads 2 --head-dim 16 --cp 2 --iters 1 --documents 16 --json");
  ASSERT_EQ(r.code, 0) << r.output;
  const nlohmann::json d = nlohmann::json::parse(r.output);
  EXPECT_GT(d["doc_fwd_ms"].get<double>(), 0);
  EXPECT_GT(d["doc_bwd_ms"].get<double>(), 0);
  EXPECT_NEAR(d["doc_pairs_fraction"].get<double>(), 4.0 * 136 / 2080, 1e-4);
  expect_error(run("bench attention --seq 64 --documents -1"), "--documents must be 0");
  expect_error(run("bench attention --seq 100 --cp 4"), "--seq 100 must split into 2 x --cp = 8");
  expect_error(run("bench attention --seq 64 --heads 3 --kv-heads 2"),
               "--kv-heads 2 does not divide --heads 3");
  expect_error(run("bench attention --seq 64 --precision bf16"), "is for a GPU");
}
}  // namespace

namespace {
TEST_F(Cli, CheckPrintsTheTable) {
  ASSERT_EQ(run("data synth --out " + path("data") + " --train-tokens 20000 --val-tokens 4000").code, 0);
  const std::string cfg = write_config("");
  Result r = run("check " + cfg + " --layouts 'dp=2;tp=2' --steps 2 --quiet --json " + path("check.json"));
  ASSERT_EQ(r.code, 0) << r.output;
  for (const char* text : {"loss max rel dev", "param rel dev", "one device (reference)", "dp=2 ",
                           "tp=2 ", " ok"})
    EXPECT_NE(r.output.find(text), std::string::npos) << text << " in:\n" << r.output;
  std::ifstream json(path("check.json"));
  const std::string doc((std::istreambuf_iterator<char>(json)), std::istreambuf_iterator<char>());
  EXPECT_NE(doc.find("\"param_rel_dev\""), std::string::npos) << doc;
  // A layout that cannot run is a row with its error, and the exit code says so.
  Result bad = run("check " + cfg + " --layouts 'dp=3;dp=2' --steps 2 --quiet");
  EXPECT_EQ(bad.code, 1) << bad.output;
  EXPECT_NE(bad.output.find("error: "), std::string::npos) << bad.output;
  EXPECT_NE(bad.output.find("train.batch_size = 4"), std::string::npos) << bad.output;
  expect_error(run("check " + cfg + " --layouts 'dp=2,tq=2'"), "\"tq=2\"");
  // At bf16 matmul precision (CPU ranks with AVX-512) the tolerance not given is 1e-2; one given
  // is kept.
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) {
    const std::string bf16 =
        "check " + cfg + " --layouts 'tp=2' --steps 2 --quiet --set runtime.matmul_precision=bf16";
    Result loose = run(bf16 + " --json " + path("bf16.json"));
    EXPECT_EQ(loose.code, 0) << loose.output;
    EXPECT_NE(loose.output.find("tolerance 1.0e-02"), std::string::npos) << loose.output;
    Result strict = run(bf16 + " --tolerance 0");
    EXPECT_EQ(strict.code, 1) << strict.output;
    EXPECT_NE(strict.output.find("tolerance 0.0e+00"), std::string::npos) << strict.output;
  }
}
}  // namespace

namespace {
// What a checkpoint's state.json recorded of its files: "name=digest ..." (bit-for-bit equality
// of two checkpoints' tensors).
std::string digests_of(const std::string& checkpoint) {
  std::ifstream in(fs::path(checkpoint) / "state.json");
  const nlohmann::json state = nlohmann::json::parse(in);
  std::string out;
  for (const auto& [name, file] : state["files"].items())
    out += name + "=" + file["xxh3_64"].get<std::string>() + " ";
  return out;
}

// metrics.jsonl's losses by step; a step listed twice is a test failure.
std::map<int64_t, double> losses_of(const std::string& metrics) {
  std::ifstream in(metrics);
  std::map<int64_t, double> out;
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json r = nlohmann::json::parse(line);
    EXPECT_TRUE(out.emplace(r["step"].get<int64_t>(), r["loss"].get<double>()).second) << line;
  }
  return out;
}

class Launch : public Cli {
 protected:
  void SetUp() override {
    Cli::SetUp();
    ASSERT_EQ(
        run("data synth --out " + path("data") + " --train-tokens 20000 --val-tokens 4000").code,
        0);
    config_ = write_config("");  // 4 steps, a checkpoint every 2
  }
  // The run without faults, for comparison.
  void reference(const std::string& options = "") {
    ASSERT_EQ(run("train " + config_ + " --run-dir " + path("ref") + " --quiet " + options).code,
              0);
  }
  void expect_same_run_as_reference(const std::string& run_dir) {
    EXPECT_EQ(digests_of(run_dir + "/checkpoints/step_4"),
              digests_of(path("ref/checkpoints/step_4")));
    const std::map<int64_t, double> losses = losses_of(run_dir + "/metrics.jsonl");
    EXPECT_EQ(losses.size(), 4u);
    EXPECT_EQ(losses, losses_of(path("ref/metrics.jsonl")));
  }
  std::string config_;
};

// A training process killed after step 3 (its newest checkpoint: step 2) is restarted from that
// checkpoint and ends as the run that was never killed, bit for bit, each step logged once.
TEST_F(Launch, RestartsAKilledTrainingFromItsCheckpointBitForBit) {
  reference();
  const Result r = run("launch --restart-delay 0 -- " + kLoom + " train " + config_ +
                           " --run-dir " + path("run") + " --resume auto --quiet",
                       "LOOM_TEST_FAULT=kill@3");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("attempt 1 failed after"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("killed by SIGKILL; newest checkpoint step_2"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("attempt 2: " + kLoom), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("(newest checkpoint: step_2)"), std::string::npos) << r.output;
  expect_same_run_as_reference(path("run"));
  std::ifstream in(path("run/launch.jsonl"));
  std::vector<nlohmann::json> attempts;
  for (std::string line; std::getline(in, line);) attempts.push_back(nlohmann::json::parse(line));
  ASSERT_EQ(attempts.size(), 2u);
  EXPECT_EQ(attempts[0]["signal"], "SIGKILL");
  EXPECT_EQ(attempts[1]["checkpoint_before"], "step_2");
  EXPECT_EQ(attempts[1]["exit_code"], 0);
}

// A rank that stops responding after step 3: no step is logged for --stall-timeout, the attempt
// is stopped (SIGTERM, ignored by the wedged rank, then SIGKILL) and restarted.
TEST_F(Launch, RestartsAStalledTraining) {
  reference();
  const Result r =
      run("launch --restart-delay 0 --stall-timeout 2 --kill-grace 0.5 -- " + kLoom + " train " +
              config_ + " --run-dir " + path("run") + " --resume auto --quiet",
          "LOOM_TEST_FAULT=hang@3");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("no training step for"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("stalled, stopped (SIGKILL)"), std::string::npos) << r.output;
  expect_same_run_as_reference(path("run"));
}

// SIGTERM (a scheduler's preemption) ends every thread rank at the end of the same step with a
// checkpoint there; resumed, the run ends as the one never stopped.
TEST_F(Launch, TrainStopsAtAStepOnSigtermAndResumesBitForBit) {
  reference("--ranks 2");
  const std::string train = "train " + config_ + " --run-dir " + path("run") + " --ranks 2";
  const Result stopped = run(train, "LOOM_TEST_FAULT=term@3");
  EXPECT_EQ(stopped.code, 128 + 15) << stopped.output;
  EXPECT_NE(stopped.output.find("stopped by SIGTERM after step 3 of 4; checkpoint " +
                                path("run/checkpoints/step_3")),
            std::string::npos)
      << stopped.output;
  EXPECT_TRUE(fs::exists(path("run/checkpoints/step_3/state.json")));
  const Result resumed = run(train + " --resume auto");
  ASSERT_EQ(resumed.code, 0) << resumed.output;
  expect_same_run_as_reference(path("run"));
}

TEST_F(Launch, ATrainCommandThatDoesNotResumeIsRefused) {
  expect_error(run("launch -- " + kLoom + " train " + config_), "add --resume auto");
  expect_error(run("train " + config_, "LOOM_TEST_FAULT=explode@1"), "LOOM_TEST_FAULT");
}
}  // namespace

namespace {
TEST_F(Cli, PlanListsLayoutsAndNamesBadInput) {
  const std::string cfg = write_config("");  // d_model 16, 2 heads, 1 layer, batch 4 of 2
  Result r = run("plan " + cfg + " --devices 4 --hardware a100-80g --cp config");
  ASSERT_EQ(r.code, 0) << r.output;
  // Two heads, one block, two micro-batches: dp 2 × tp 2 only, with each ZeRO stage.
  for (const char* text : {"layout ", "dp2 tp2 pp1 zero0", "dp2 tp2 pp1 zero3", "4 x a100-80g",
                           "MFU", "\n4 layouts, 0 of them beyond", "model: 7664 parameters"})
    EXPECT_NE(r.output.find(text), std::string::npos) << text << " in:\n" << r.output;
  // By default context parallelism too: the 16 positions over cp 2 beside tp 2.
  r = run("plan " + cfg + " --devices 4 --hardware a100-80g");
  ASSERT_EQ(r.code, 0) << r.output;
  for (const char* text : {"dp1 tp2 pp1 cp2 zero0", "cp comm", "dp2 tp2 pp1 zero0"})
    EXPECT_NE(r.output.find(text), std::string::npos) << text << " in:\n" << r.output;
  EXPECT_EQ(r.output.find("dp4"), std::string::npos) << r.output;  // 4 sequences: 2 micro-batches
  expect_error(run("plan " + cfg + " --hardware tpu"), "--hardware tpu: unknown; known: h100");
  expect_error(run("plan " + cfg + " --efficiency 2"), "--efficiency must be in (0, 1]");
  expect_error(run("plan " + cfg + " --devices 3"), "no layout of 3 ranks");
  // A dp_shard no layout's dp takes, held by --dp-shard config: named with the rest.
  expect_error(run("plan " + cfg + " --devices 4 --dp-shard config --set parallel.dp_shard=3"),
               "n_layers 1, parallel.dp_shard 3 (--dp-shard config: it must divide dp, at ZeRO "
               "1-3))");
}
}  // namespace
