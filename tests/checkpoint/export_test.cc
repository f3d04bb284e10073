// `loom checkpoint export` (checkpoint/export.h): a checkpoint's model as HuggingFace GPT-2
// (names, Conv1D's transposed weights, config.json) and as llm.c's checkpoint file (header,
// parameter order), each read back and compared with the model's values; bf16; errors.
// (That transformers' GPT2LMHeadModel loads the hf export and samples exactly what `loom sample`
// does was checked with tools/check_hf_export.py; docs/formats.md.)
#include "checkpoint/export.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <nlohmann/json.hpp>
#include <vector>

#include "base/error.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/safetensors.h"
#include "harness/error_of.h"
#include "tensor/dtype.h"

namespace loom {
namespace {
namespace fs = std::filesystem;

class ExportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("loom_export_test_" + std::to_string(getpid()));
    fs::remove_all(dir_);
    config_.vocab_size = 40;
    config_.max_seq_len = 16;
    config_.d_model = 24;
    config_.n_layers = 2;
    config_.n_heads = 3;
    model_ = std::make_unique<Gpt2>(config_);
    model_->build(DType::kF32, Device::cpu(), 7);
    TrainingState st;
    st.step = 5;
    checkpoint_ = save_checkpoint((dir_ / "checkpoints").string(), *model_, nullptr, st);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // The model's value of a parameter at (r, c), as a 2-D matrix (a 1-D one has one row).
  float value(const std::string& name, int64_t r, int64_t c) const {
    const Parameter& p = model_->params().get(name);
    const int64_t cols = p.value.shape().size() == 1 ? p.value.numel() : p.value.dim(1);
    return p.value.data<float>()[r * cols + c];
  }

  fs::path dir_;
  Gpt2Config config_;
  std::unique_ptr<Gpt2> model_;
  std::string checkpoint_;
};

TEST(HfName, EveryKindOfParameter) {
  EXPECT_EQ(hf_name_of("wte.weight").name, "transformer.wte.weight");
  EXPECT_EQ(hf_name_of("wpe.weight").name, "transformer.wpe.weight");
  EXPECT_EQ(hf_name_of("ln_f.bias").name, "transformer.ln_f.bias");
  EXPECT_EQ(hf_name_of("blocks.3.ln_1.weight").name, "transformer.h.3.ln_1.weight");
  EXPECT_FALSE(hf_name_of("blocks.3.ln_1.weight").transposed);
  EXPECT_EQ(hf_name_of("blocks.11.attn.qkv.weight").name, "transformer.h.11.attn.c_attn.weight");
  EXPECT_TRUE(hf_name_of("blocks.11.attn.qkv.weight").transposed);
  EXPECT_FALSE(hf_name_of("blocks.11.attn.qkv.bias").transposed);
  EXPECT_EQ(hf_name_of("blocks.0.attn.proj.bias").name, "transformer.h.0.attn.c_proj.bias");
  EXPECT_EQ(hf_name_of("blocks.0.mlp.fc.weight").name, "transformer.h.0.mlp.c_fc.weight");
  EXPECT_EQ(hf_name_of("blocks.0.mlp.proj.weight").name, "transformer.h.0.mlp.c_proj.weight");
  EXPECT_THROW(hf_name_of("blocks.0.moe.router.weight"), Error);
}

TEST_F(ExportTest, HuggingFaceNamesShapesValuesAndConfig) {
  const fs::path out = dir_ / "hf";
  export_checkpoint(checkpoint_, "hf", out.string());
  const SafetensorsFile f = load_safetensors((out / "model.safetensors").string());
  EXPECT_EQ(f.names.size(), model_->params().parameters().size());  // no lm_head: tied
  EXPECT_EQ(f.tensors.count("lm_head.weight"), 0u);
  for (const auto& p : model_->params().parameters()) {
    const HfName hf = hf_name_of(p->name);
    ASSERT_EQ(f.tensors.count(hf.name), 1u) << hf.name;
    const Tensor& t = f.tensors.at(hf.name);
    ASSERT_EQ(t.dtype(), DType::kF32);
    if (hf.transposed) {  // Conv1D: in × out
      ASSERT_EQ(t.shape(), (Shape{p->value.dim(1), p->value.dim(0)})) << hf.name;
      for (int64_t r = 0; r < t.dim(0); ++r)
        for (int64_t c = 0; c < t.dim(1); ++c)
          ASSERT_EQ(t.data<float>()[r * t.dim(1) + c], value(p->name, c, r)) << hf.name;
    } else {
      ASSERT_EQ(t.shape(), p->value.shape()) << hf.name;
      EXPECT_EQ(std::memcmp(t.raw(), p->value.raw(), t.numel() * sizeof(float)), 0) << hf.name;
    }
  }
  std::ifstream in(out / "config.json");
  const nlohmann::json j = nlohmann::json::parse(in);
  EXPECT_EQ(j["model_type"], "gpt2");
  EXPECT_EQ(j["vocab_size"], 40);
  EXPECT_EQ(j["n_positions"], 16);
  EXPECT_EQ(j["n_embd"], 24);
  EXPECT_EQ(j["n_layer"], 2);
  EXPECT_EQ(j["n_head"], 3);
  EXPECT_EQ(j["activation_function"], "gelu_new");
  EXPECT_TRUE(j["tie_word_embeddings"].get<bool>());

  // bf16: every value rounded to nearest even; an existing export is replaced.
  export_checkpoint(checkpoint_, "hf", out.string(), /*bf16=*/true);
  const SafetensorsFile b = load_safetensors((out / "model.safetensors").string());
  const Tensor& wte = b.tensors.at("transformer.wte.weight");
  ASSERT_EQ(wte.dtype(), DType::kBF16);
  for (int64_t i = 0; i < wte.numel(); ++i)
    ASSERT_EQ(static_cast<const uint16_t*>(wte.raw())[i],
              float_to_bf16(model_->params().get("wte.weight").value.data<float>()[i]));
  EXPECT_FALSE(fs::exists(out.string() + ".tmp"));
}

TEST_F(ExportTest, LlmcHeaderAndParameterOrder) {
  const fs::path out = dir_ / "model.bin";
  export_checkpoint(checkpoint_, "llmc", out.string());
  std::ifstream in(out, std::ios::binary);
  std::vector<int32_t> header(256);
  in.read(reinterpret_cast<char*>(header.data()), 256 * sizeof(int32_t));
  EXPECT_EQ(header[0], 20240326);
  EXPECT_EQ(header[1], 3);  // fp32
  EXPECT_EQ(header[2], 16);
  EXPECT_EQ(header[3], 40);
  EXPECT_EQ(header[4], 2);
  EXPECT_EQ(header[5], 3);
  EXPECT_EQ(header[6], 24);
  EXPECT_EQ(header[7], 40);
  int64_t count = 0;  // the parameters' elements (the flat buffer also holds alignment padding)
  for (const auto& p : model_->params().parameters()) count += p->value.numel();
  std::vector<float> data(static_cast<size_t>(count));
  std::ifstream again(out, std::ios::binary);
  again.seekg(256 * sizeof(int32_t));
  again.read(reinterpret_cast<char*>(data.data()), data.size() * sizeof(float));
  ASSERT_TRUE(again.good());
  EXPECT_EQ(again.peek(), std::char_traits<char>::eof()) << "the file holds exactly the parameters";
  // llm.c's order: wte, wpe, then per kind every layer's (ln1w, ln1b, qkvw, ...), ln_f.
  const int64_t C = 24, V = 40, T = 16, L = 2;
  int64_t at = 0;
  EXPECT_EQ(data[at + 5], value("wte.weight", 0, 5));
  at += V * C;
  EXPECT_EQ(data[at + C + 1], value("wpe.weight", 1, 1));
  at += T * C;
  EXPECT_EQ(data[at + C + 2], value("blocks.1.ln_1.weight", 0, 2));  // ln1w, layer 1
  at += 2 * L * C;                                                   // ln1w, ln1b
  EXPECT_EQ(data[at + 3 * C * C + 5 * C + 7], value("blocks.1.attn.qkv.weight", 5, 7));  // qkvw
  at += L * 3 * C * C + L * 3 * C + L * C * C + L * C + 2 * L * C;                       // to fcw
  EXPECT_EQ(data[at + 4 * C * C + C + 3], value("blocks.1.mlp.fc.weight", 1, 3));
  at += L * 4 * C * C + L * 4 * C + L * C * 4 * C + L * C;  // to lnfw
  EXPECT_EQ(data[at + C + 4], value("ln_f.bias", 0, 4));
  EXPECT_EQ(at + 2 * C, static_cast<int64_t>(data.size()));
}

// Importing (train.init_from): a Hub-style file (names without "transformer.") into a model with
// a padded vocabulary and a shorter context: wte's first rows are the file's, the padding rows
// zero; wpe's first rows are taken. A missing tensor and another width are named.
TEST_F(ExportTest, HuggingFaceWeightsLoadWithPaddedVocabularyAndShorterContext) {
  const fs::path hf = dir_ / "hub";
  export_checkpoint(checkpoint_, "hf", hf.string());
  const SafetensorsFile f = load_safetensors((hf / "model.safetensors").string());
  std::vector<std::pair<std::string, Tensor>> bare;
  for (const std::string& name : f.names)
    bare.emplace_back(name.substr(std::strlen("transformer.")), f.tensors.at(name));
  save_safetensors((hf / "model.safetensors").string(), bare);

  Gpt2Config padded = config_;
  padded.vocab_size = 48;
  padded.max_seq_len = 8;
  Gpt2 target(padded);
  target.params().allocate(DType::kF32, Device::cpu(), AllocateOptions{16, false, false});
  const int64_t n = target.params().numel();
  FlatModelState into{Tensor::zeros({n}, DType::kF32), Tensor::zeros({n}, DType::kF32),
                      Tensor::zeros({n}, DType::kF32)};
  load_hf_weights(hf.string(), target.params(), padded, into);
  const auto at = [&](const std::string& name, int64_t i) {
    return into.values.data<float>()[target.params().get(name).offset + i];
  };
  const int64_t C = config_.d_model;
  for (int64_t i = 0; i < 40 * C; ++i)
    ASSERT_EQ(at("wte.weight", i), value("wte.weight", i / C, i % C));
  for (int64_t i = 40 * C; i < 48 * C; ++i) ASSERT_EQ(at("wte.weight", i), 0.0f) << "padding row";
  for (int64_t i = 0; i < 8 * C; ++i)
    ASSERT_EQ(at("wpe.weight", i), value("wpe.weight", i / C, i % C));
  EXPECT_EQ(at("blocks.1.mlp.fc.weight", 5 * C + 3), value("blocks.1.mlp.fc.weight", 5, 3));

  bare.pop_back();  // the last tensor gone
  save_safetensors((hf / "model.safetensors").string(), bare);
  try {
    load_hf_weights(hf.string(), target.params(), padded, into);
    ADD_FAILURE() << "a missing tensor accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.safetensors has no"), std::string::npos)
        << e.what();
  }
  Gpt2Config wider = config_;
  wider.d_model = 48;
  wider.n_heads = 3;
  try {
    load_hf_weights(hf.string(), target.params(), wider, into);
    ADD_FAILURE() << "another width accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("n_embd = 24 but model.d_model = 48"), std::string::npos)
        << e.what();
  }
}

// A GPT-2 whose embedding is scaled (model.embedding_multiplier) is no GPT2LMHeadModel nor
// llm.c model: both exports refuse it, and so does train.init_from from a GPT-2 directory.
TEST_F(ExportTest, AScaledGpt2EmbeddingIsRefusedBothWays) {
  const fs::path hf = dir_ / "hub";
  export_checkpoint(checkpoint_, "hf", hf.string());
  Gpt2Config scaled = config_;
  scaled.embedding_multiplier = 4;
  Gpt2 model(scaled);
  model.build(DType::kF32, Device::cpu(), 7);
  TrainingState st;
  st.step = 1;
  const std::string ckpt = save_checkpoint((dir_ / "scaled").string(), model, nullptr, st);
  for (const char* format : {"hf", "llmc"}) {
    const std::string e = testutil::error_of(
        [&] { export_checkpoint(ckpt, format, (dir_ / (std::string("out_") + format)).string()); });
    EXPECT_NE(e.find("holds a GPT-2 whose embedding is scaled (model.embedding_multiplier = 4)"),
              std::string::npos)
        << format << ": " << e;
  }
  Gpt2 target(scaled);
  target.params().allocate(DType::kF32, Device::cpu(), AllocateOptions{16, false, false});
  const int64_t n = target.params().numel();
  FlatModelState into{Tensor::zeros({n}, DType::kF32), Tensor::zeros({n}, DType::kF32),
                      Tensor::zeros({n}, DType::kF32)};
  const std::string e =
      testutil::error_of([&] { load_hf_weights(hf.string(), target.params(), scaled, into); });
  EXPECT_NE(e.find("a GPT2LMHeadModel does not scale its embedding"), std::string::npos) << e;
}

// A damaged model shape in state.json (which no digest covers: it holds them) is named by
// read_checkpoint_model — before `loom sample` or an export builds the model it describes — not
// met as a division by zero or an allocation of its size.
TEST_F(ExportTest, ADamagedModelShapeIsNamedBeforeTheModelIsBuilt) {
  const fs::path state = fs::path(checkpoint_) / "state.json";
  std::ifstream in(state);
  const nlohmann::json good = nlohmann::json::parse(in);
  in.close();
  const auto error_with = [&](const char* key, nlohmann::json value) {
    nlohmann::json j = good;
    j["model"][key] = value;
    std::ofstream(state) << j.dump(2);
    return testutil::error_of([&] { read_checkpoint_model(checkpoint_); });
  };
  std::string e = error_with("n_heads", 0);
  EXPECT_NE(e.find("state.json's model: model.n_heads = 0 does not divide model.d_model = 24"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find(checkpoint_), std::string::npos) << e;
  e = error_with("n_layers", 1000);  // a bit flipped: a model the files cannot hold
  EXPECT_NE(e.find("more than its tensor files'"), std::string::npos) << e;
  e = error_with("d_model", int64_t{3} << 40);  // divisible by n_heads = 3
  EXPECT_NE(e.find("model.d_model = 3298534883328 is past the largest Loom builds"),
            std::string::npos)
      << e;
  // A number that is no int64: a plain cast of 1e30 is undefined behaviour; 2^63 would wrap.
  e = error_with("n_layers", 1e30);
  EXPECT_NE(e.find("lacks the model shape"), std::string::npos) << e;
  EXPECT_NE(e.find("type must be an integer, but is 1e+30"), std::string::npos) << e;
  e = error_with("vocab_size", uint64_t{1} << 63);
  EXPECT_NE(e.find("integer 9223372036854775808 is outside"), std::string::npos) << e;
  std::ofstream(state) << good.dump(2);
  EXPECT_EQ(read_checkpoint_model(checkpoint_).n_layers, 2);
}

// --tokenizer: the tokenizer's files beside the model (tokenizer.json as it is; from a directory
// its tokenizer_config.json too, else a minimal one naming the end-of-text token), that token's
// id as config.json's eos_token_id; a tokenizer whose ids pass the model's vocabulary, or one
// for llm.c's file, is refused before anything is written.
TEST_F(ExportTest, ATokenizerGoesBesideTheModel) {
  // GPT-2's byte-level BPE cut to 600 ids, <|endoftext|> its id 0 (tests/data/tokenizers).
  const std::string gpt2_tokenizer = LOOM_SOURCE_DIR "/tests/data/tokenizers/gpt2.json";
  const auto bytes_of = [](const fs::path& p) {
    std::ifstream in(p, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  Gpt2Config c;
  c.vocab_size = 640;  // the tokenizer's 600, padded
  c.max_seq_len = 16;
  c.d_model = 8;
  c.n_layers = 1;
  c.n_heads = 2;
  Gpt2 model(c);
  model.build(DType::kF32, Device::cpu(), 3);
  TrainingState st;
  st.step = 1;
  const std::string ckpt = save_checkpoint((dir_ / "gpt2_vocab").string(), model, nullptr, st);
  const fs::path out = dir_ / "with_tokenizer";
  export_checkpoint(ckpt, "hf", out.string(), false, kDefaultMaxShardBytes, gpt2_tokenizer);
  EXPECT_EQ(bytes_of(out / "tokenizer.json"), bytes_of(gpt2_tokenizer));
  std::ifstream tc_in(out / "tokenizer_config.json");
  const nlohmann::json tc = nlohmann::json::parse(tc_in);
  EXPECT_EQ(tc["tokenizer_class"], "PreTrainedTokenizerFast");
  EXPECT_EQ(tc["eos_token"], "<|endoftext|>");
  EXPECT_EQ(tc["model_max_length"], 16);
  std::ifstream cf(out / "config.json");
  EXPECT_EQ(nlohmann::json::parse(cf)["eos_token_id"], 0);
  EXPECT_TRUE(fs::exists(out / "model.safetensors"));

  // A model directory: its tokenizer_config.json and special_tokens_map.json come along.
  const fs::path hub = dir_ / "hub";
  fs::create_directories(hub);
  fs::copy_file(gpt2_tokenizer, hub / "tokenizer.json");
  std::ofstream(hub / "tokenizer_config.json") << R"({"tokenizer_class": "GPT2TokenizerFast"})";
  std::ofstream(hub / "special_tokens_map.json") << R"({"eos_token": "<|endoftext|>"})";
  export_checkpoint(ckpt, "hf", out.string(), false, kDefaultMaxShardBytes, hub.string());
  EXPECT_EQ(bytes_of(out / "tokenizer_config.json"), bytes_of(hub / "tokenizer_config.json"));
  EXPECT_EQ(bytes_of(out / "special_tokens_map.json"), bytes_of(hub / "special_tokens_map.json"));

  // The fixture's model has 40 rows: GPT-2's ids do not fit.
  const fs::path refused = dir_ / "refused";
  std::string e = testutil::error_of([&] {
    export_checkpoint(checkpoint_, "hf", refused.string(), false, kDefaultMaxShardBytes,
                      gpt2_tokenizer);
  });
  EXPECT_NE(e.find("has ids up to 599, past the model's vocabulary of 40"), std::string::npos) << e;
  EXPECT_FALSE(fs::exists(refused));
  e = testutil::error_of([&] {
    export_checkpoint(ckpt, "llmc", refused.string(), false, kDefaultMaxShardBytes, gpt2_tokenizer);
  });
  EXPECT_NE(e.find("llm.c's file holds none"), std::string::npos) << e;
  EXPECT_FALSE(fs::exists(refused));
}

TEST_F(ExportTest, BadFormatAndMissingCheckpointAreNamed) {
  try {
    export_checkpoint(checkpoint_, "onnx", (dir_ / "x").string());
    ADD_FAILURE() << "onnx accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'onnx'"), std::string::npos) << e.what();
  }
  const std::string missing = (dir_ / "nowhere").string();
  try {
    export_checkpoint(missing, "hf", (dir_ / "y").string());
    ADD_FAILURE() << "missing checkpoint accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(missing), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(dir_ / "y"));
}

// Saves `model` as the checkpoint of `step` under dir/checkpoints and exports it to dir/hf;
// returns the checkpoint's directory.
std::string save_and_export_hf(Gpt2& model, const fs::path& dir, int64_t step) {
  TrainingState st;
  st.step = step;
  const std::string ckpt = save_checkpoint((dir / "checkpoints").string(), model, nullptr, st);
  export_checkpoint(ckpt, "hf", (dir / "hf").string());
  return ckpt;
}

// A Llama checkpoint exports as transformers' LlamaForCausalLM: the fused qkv and gate/up weights
// as their q/k/v_proj and gate/up_proj row blocks, nothing transposed, no lm_head (tied), and a
// config.json with the grouped-query heads, the SwiGLU's width, rope_theta and rms_norm_eps.
// (That transformers loads it and samples exactly what `loom sample` does was checked with
// tools/check_hf_export.py: docs/formats.md.) llm.c's GPT-2 format refuses it.
TEST(ExportLlama, HuggingFaceLlamaNamesRowBlocksAndConfig) {
  const fs::path dir = fs::temp_directory_path() / ("loom_export_llama_" + std::to_string(getpid()));
  fs::remove_all(dir);
  Gpt2Config c;
  c.arch = Arch::kLlama;
  c.vocab_size = 40;
  c.max_seq_len = 16;
  c.d_model = 24;
  c.n_layers = 2;
  c.n_heads = 4;  // head size 6
  c.n_kv_heads = 2;
  c.ffn_hidden = 36;
  c.rope_theta = 500000;
  c.norm_eps = 1e-6;
  Gpt2 model(c);
  model.build(DType::kF32, Device::cpu(), 7);
  const std::string ckpt = save_and_export_hf(model, dir, 3);
  const SafetensorsFile f = load_safetensors((dir / "hf" / "model.safetensors").string());
  EXPECT_EQ(f.names.size(), 2u + 9u * 2u);  // embed_tokens, norm; nine tensors per layer
  EXPECT_EQ(f.tensors.count("lm_head.weight"), 0u);
  // Row r of an HF tensor is row (first + r) of the fused Loom weight.
  const auto expect_rows = [&](const std::string& hf, const std::string& ours, int64_t first,
                               int64_t rows) {
    ASSERT_EQ(f.tensors.count(hf), 1u) << hf;
    const Tensor& t = f.tensors.at(hf);
    const Parameter& p = model.params().get(ours);
    const int64_t cols = p.shape.size() == 1 ? 1 : p.shape[1];
    ASSERT_EQ(t.numel(), rows * cols) << hf;
    EXPECT_EQ(std::memcmp(t.data<float>(), p.value.data<float>() + first * cols,
                          static_cast<size_t>(rows * cols) * sizeof(float)),
              0)
        << hf;
  };
  expect_rows("model.embed_tokens.weight", "wte.weight", 0, 40);
  expect_rows("model.norm.weight", "ln_f.weight", 0, 24);
  expect_rows("model.layers.1.input_layernorm.weight", "blocks.1.ln_1.weight", 0, 24);
  expect_rows("model.layers.1.self_attn.q_proj.weight", "blocks.1.attn.qkv.weight", 0, 24);
  expect_rows("model.layers.1.self_attn.k_proj.weight", "blocks.1.attn.qkv.weight", 24, 12);
  expect_rows("model.layers.1.self_attn.v_proj.weight", "blocks.1.attn.qkv.weight", 36, 12);
  expect_rows("model.layers.0.self_attn.o_proj.weight", "blocks.0.attn.proj.weight", 0, 24);
  expect_rows("model.layers.0.post_attention_layernorm.weight", "blocks.0.ln_2.weight", 0, 24);
  expect_rows("model.layers.0.mlp.gate_proj.weight", "blocks.0.mlp.fc.weight", 0, 36);
  expect_rows("model.layers.0.mlp.up_proj.weight", "blocks.0.mlp.fc.weight", 36, 36);
  expect_rows("model.layers.0.mlp.down_proj.weight", "blocks.0.mlp.proj.weight", 0, 24);
  std::ifstream cf(dir / "hf" / "config.json");
  const nlohmann::json j = nlohmann::json::parse(cf);
  EXPECT_EQ(j["architectures"][0], "LlamaForCausalLM");
  EXPECT_EQ(j["num_attention_heads"], 4);
  EXPECT_EQ(j["num_key_value_heads"], 2);
  EXPECT_EQ(j["head_dim"], 6);
  EXPECT_EQ(j["intermediate_size"], 36);
  EXPECT_EQ(j["hidden_act"], "silu");
  EXPECT_EQ(j["rope_theta"].get<double>(), 500000.0);
  EXPECT_EQ(j["rms_norm_eps"].get<double>(), 1e-6);
  EXPECT_TRUE(j["tie_word_embeddings"].get<bool>());
  EXPECT_FALSE(j["attention_bias"].get<bool>());
  // The checkpoint remembers the architecture (state.json), so export needs no config.
  const Gpt2Config back = read_checkpoint_model(ckpt);
  EXPECT_TRUE(back.llama());
  EXPECT_EQ(back.n_kv_heads, 2);
  EXPECT_EQ(back.ffn_hidden, 36);
  EXPECT_EQ(back.rope_theta, 500000.0);
  EXPECT_EQ(back.norm_eps, 1e-6);
  try {
    export_checkpoint(ckpt, "llmc", (dir / "model.bin").string());
    ADD_FAILURE() << "llm.c export of a Llama accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("holds a Llama model"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(dir / "model.bin"));
  fs::remove_all(dir);
}

TEST(ExportLlama, AnUntiedHeadIsWrittenAsLmHead) {
  const fs::path dir = fs::temp_directory_path() / ("loom_export_untied_" + std::to_string(getpid()));
  fs::remove_all(dir);
  Gpt2Config c;
  c.arch = Arch::kLlama;
  c.vocab_size = 40;
  c.max_seq_len = 16;
  c.d_model = 24;
  c.n_layers = 1;
  c.n_heads = 4;
  c.n_kv_heads = 4;
  c.ffn_hidden = 36;
  c.tie_embeddings = false;
  Gpt2 model(c);
  model.build(DType::kF32, Device::cpu(), 8);
  TrainingState st;
  st.step = 1;
  const std::string ckpt = save_checkpoint((dir / "checkpoints").string(), model, nullptr, st);
  EXPECT_FALSE(read_checkpoint_model(ckpt).tie_embeddings);
  export_checkpoint(ckpt, "hf", (dir / "hf").string());
  const SafetensorsFile f = load_safetensors((dir / "hf" / "model.safetensors").string());
  ASSERT_EQ(f.tensors.count("lm_head.weight"), 1u);
  const Parameter& head = model.params().get("lm_head.weight");
  EXPECT_EQ(std::memcmp(f.tensors.at("lm_head.weight").raw(), head.value.raw(),
                        static_cast<size_t>(head.numel()) * sizeof(float)),
            0);
  std::ifstream cf(dir / "hf" / "config.json");
  EXPECT_FALSE(nlohmann::json::parse(cf)["tie_word_embeddings"].get<bool>());
  EXPECT_THROW(export_checkpoint(ckpt, "llmc", (dir / "m.bin").string()), Error);
  fs::remove_all(dir);
}

// train.init_from for a Llama: a directory transformers' own save_pretrained wrote
// (tests/data/hf_tiny_llama, tools/make_hf_llama_fixture.py: an untied head, a 200-token
// vocabulary padded to 256 here, 4 query heads sharing 2 key/value heads, rope_theta 500) gives
// the logits transformers computed for it; Loom's own export loads back bit for bit; a config
// that differs, and rope_scaling, are errors naming config.json and the key.
Gpt2Config tiny_hub_llama() {
  Gpt2Config c;
  c.arch = Arch::kLlama;
  c.vocab_size = 256;
  c.max_seq_len = 64;
  c.d_model = 32;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.ffn_hidden = 48;
  c.rope_theta = 500;
  c.norm_eps = 1e-5;
  c.tie_embeddings = false;
  return c;
}

FlatModelState zero_state_for(const ParameterStore& params) {
  const int64_t n = params.numel();
  return {Tensor::zeros({n}, DType::kF32), Tensor::zeros({n}, DType::kF32),
          Tensor::zeros({n}, DType::kF32)};
}

// load_hf_weights of `hf_dir` (model's export) into a fresh model of its config: its values bit
// for bit.
void expect_loads_back_bitwise(Gpt2& model, const std::string& hf_dir) {
  Gpt2 target(model.config());
  target.params().allocate(DType::kF32, Device::cpu(), AllocateOptions{16, false, false});
  FlatModelState into = zero_state_for(target.params());
  load_hf_weights(hf_dir, target.params(), model.config(), into);
  const std::vector<float> a = model.params().values().to_vector(), b = into.values.to_vector();
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0);
}

// Over --max-shard-size the tensors go into save_pretrained's split files: model-0000K-of-0000N,
// each filled in order up to the limit (the next tensor would have passed it), a tensor larger
// than the limit alone in its file, and model.safetensors.index.json whose weight_map names the
// file of every tensor and whose total_size is their bytes. The tensors are the single file's,
// in its order, and train.init_from reads the directory back bit for bit.
TEST(ExportLlama, OverTheShardSizeTheTensorsAreSplitAsSavePretrainedDoes) {
  const fs::path dir =
      fs::temp_directory_path() / ("loom_export_split_" + std::to_string(getpid()));
  fs::remove_all(dir);
  Gpt2Config c;
  c.arch = Arch::kLlama;
  c.vocab_size = 64;
  c.max_seq_len = 16;
  c.d_model = 32;
  c.n_layers = 3;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.ffn_hidden = 48;
  c.tie_embeddings = false;
  Gpt2 model(c);
  model.build(DType::kF32, Device::cpu(), 9);
  const std::string ckpt = save_and_export_hf(model, dir, 2);  // one file: under 5 GB
  const SafetensorsFile single = load_safetensors((dir / "hf" / "model.safetensors").string());
  EXPECT_FALSE(fs::exists(dir / "hf" / "model.safetensors.index.json"));

  const int64_t limit = 9000;  // the embedding and the head (8 kB each) fill a file each
  export_checkpoint(ckpt, "hf", (dir / "split").string(), false, limit);
  EXPECT_FALSE(fs::exists(dir / "split" / "model.safetensors"));
  std::ifstream in(dir / "split" / "model.safetensors.index.json");
  const nlohmann::json index = nlohmann::json::parse(in);
  const nlohmann::json& map = index.at("weight_map");
  EXPECT_EQ(map.size(), single.names.size());
  // The files in order, each tensor where weight_map says, in the single file's order.
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(dir / "split"))
    if (e.path().extension() == ".safetensors") files.push_back(e.path().filename().string());
  std::sort(files.begin(), files.end());
  ASSERT_GE(files.size(), 4u);
  size_t next = 0;  // in single.names
  int64_t total = 0, previous_file_bytes = -1;
  for (size_t k = 0; k < files.size(); ++k) {
    char want[64];
    std::snprintf(want, sizeof want, "model-%05zu-of-%05zu.safetensors", k + 1, files.size());
    EXPECT_EQ(files[k], want);
    const SafetensorsFile f = load_safetensors((dir / "split" / files[k]).string());
    EXPECT_EQ(f.metadata.at("format"), "pt");
    int64_t bytes = 0;
    for (const std::string& name : f.names) {
      ASSERT_LT(next, single.names.size());
      EXPECT_EQ(name, single.names[next++]);
      EXPECT_EQ(map.at(name), files[k]) << name;
      const Tensor& t = f.tensors.at(name);
      const Tensor& s = single.tensors.at(name);
      ASSERT_EQ(t.shape(), s.shape()) << name;
      EXPECT_EQ(std::memcmp(t.raw(), s.raw(), t.nbytes()), 0) << name;
      bytes += static_cast<int64_t>(t.nbytes());
    }
    EXPECT_TRUE(bytes <= limit || f.names.size() == 1u) << files[k] << ": " << bytes;
    if (previous_file_bytes >= 0) {  // the previous file was full: this one's first did not fit
      EXPECT_GT(previous_file_bytes + static_cast<int64_t>(f.tensors.at(f.names[0]).nbytes()),
                limit)
          << files[k];
    }
    previous_file_bytes = bytes;
    total += bytes;
  }
  EXPECT_EQ(next, single.names.size());
  EXPECT_EQ(index.at("metadata").at("total_size").get<int64_t>(), total);
  expect_loads_back_bitwise(model, (dir / "split").string());
  // A limit of nothing is refused, naming it; what was exported stays.
  const std::string e = testutil::error_of(
      [&] { export_checkpoint(ckpt, "hf", (dir / "split").string(), false, 0); });
  EXPECT_NE(e.find("max shard size"), std::string::npos) << e;
  EXPECT_TRUE(fs::exists(dir / "split" / files[0]));
  fs::remove_all(dir);
}

void expect_transformers_logits(const std::string& hub, const Gpt2Config& c) {
  SCOPED_TRACE(hub);
  Gpt2 model(c);
  model.build(DType::kF32, Device::cpu(), 1);
  FlatModelState into = zero_state_for(model.params());
  load_hf_weights(hub, model.params(), c, into);
  model.params().values().copy_from(into.values);
  const SafetensorsFile expected = load_safetensors(hub + "/loom_expected_logits.safetensors");
  const Tensor& tokens = expected.tensors.at("tokens");
  // (2, 12, 200): computed in float64, which transformers returns as float32 logits
  const Tensor& want = expected.tensors.at("logits");
  ThreadPool pool(2);
  Context ctx{&pool, Device::cpu(), DType::kF32};
  const Tensor got = model.logits(ctx, tokens);  // (2, 12, 256)
  ASSERT_EQ(got.shape(), (Shape{2, 12, 256}));
  double max_ref = 0, max_diff = 0;
  for (int64_t r = 0; r < 24; ++r) {
    for (int64_t v = 0; v < 200; ++v) {
      const double ref = want.data<float>()[r * 200 + v];
      max_ref = std::max(max_ref, std::abs(ref));
      max_diff = std::max(max_diff, std::abs(got.data<float>()[r * 256 + v] - ref));
    }
    for (int64_t v = 200; v < 256; ++v)  // padding rows of lm_head are zero
      ASSERT_EQ(got.data<float>()[r * 256 + v], 0.0f);
  }
  EXPECT_GT(max_ref, 0.1);
  EXPECT_LE(max_diff, 1e-5 * max_ref) << "max |loom - transformers| = " << max_diff;
}

TEST(ImportLlama, TransformersSavedLlamaGivesTransformersLogits) {
  expect_transformers_logits(LOOM_SOURCE_DIR "/tests/data/hf_tiny_llama", tiny_hub_llama());
}

// Llama 3.1's "llama3" rope_scaling (tests/data/hf_tiny_llama31: factor 4, frequency factors 1
// and 4, original context 16, a tied head), as transformers 4.44 computes it.
TEST(ImportLlama, Llama31FrequencyScalingGivesTransformersLogits) {
  Gpt2Config c = tiny_hub_llama();
  c.tie_embeddings = true;
  c.rope_scaling_factor = 4;
  c.rope_low_freq_factor = 1;
  c.rope_high_freq_factor = 4;
  c.rope_original_max_seq_len = 16;
  expect_transformers_logits(LOOM_SOURCE_DIR "/tests/data/hf_tiny_llama31", c);
  // Without the scaling the logits differ: the scaled frequencies matter at these positions.
  Gpt2Config unscaled = c;
  unscaled.rope_scaling_factor = 0;
  Gpt2 a(c), b(unscaled);
  a.build(DType::kF32, Device::cpu(), 3);
  b.build(DType::kF32, Device::cpu(), 3);
  ThreadPool pool(1);
  Context ctx{&pool, Device::cpu(), DType::kF32};
  Tensor tokens = Tensor::empty({1, 12}, DType::kI32);
  for (int i = 0; i < 12; ++i) tokens.data<int32_t>()[i] = (7 * i) % 200;
  const std::vector<float> la = a.logits(ctx, tokens).to_vector(), lb = b.logits(ctx, tokens).to_vector();
  double diff = 0;
  for (size_t i = 0; i < la.size(); ++i) diff += std::abs(la[i] - lb[i]);
  EXPECT_GT(diff, 1e-3);
}

TEST(ImportLlama, LoomsOwnExportLoadsBackBitForBit) {
  const fs::path dir = fs::temp_directory_path() / ("loom_import_llama_" + std::to_string(getpid()));
  fs::remove_all(dir);
  for (const bool tied : {true, false}) {
    Gpt2Config c = tiny_hub_llama();
    c.tie_embeddings = tied;
    if (tied) c.rope_scaling_factor = 8;  // and the scaling's rope_scaling in config.json
    Gpt2 model(c);
    model.build(DType::kF32, Device::cpu(), 5);
    save_and_export_hf(model, dir, 2);
    SCOPED_TRACE(tied ? "tied" : "untied");
    expect_loads_back_bitwise(model, (dir / "hf").string());
    fs::remove_all(dir);
  }
}

// A directory split over several files (model.safetensors.index.json, as the Hub's models of
// several GB are): for_each_hf_parameter hands each parameter over once, whole, with the values
// load_hf_weights gives from the single file — reading a tensor when its parameter is taken, so
// that a file spoiled after the headers were read fails at that tensor, naming it.
TEST(ImportLlama, SplitFilesStreamOneParameterAtATime) {
  const fs::path dir =
      fs::temp_directory_path() / ("loom_import_split_" + std::to_string(getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string hub = LOOM_SOURCE_DIR "/tests/data/hf_tiny_llama";
  fs::copy_file(hub + "/config.json", dir / "config.json");
  const SafetensorsFile f = load_safetensors(hub + "/model.safetensors");
  std::vector<std::pair<std::string, Tensor>> halves[2];
  nlohmann::json map = nlohmann::json::object();
  for (size_t i = 0; i < f.names.size(); ++i) {
    const int half = f.names[i].find("layers.1.") != std::string::npos ? 1 : 0;
    halves[half].emplace_back(f.names[i], f.tensors.at(f.names[i]).to(DType::kBF16));
    map[f.names[i]] =
        half == 0 ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors";
  }
  ASSERT_FALSE(halves[1].empty());
  save_safetensors((dir / "model-00001-of-00002.safetensors").string(), halves[0]);
  save_safetensors((dir / "model-00002-of-00002.safetensors").string(), halves[1]);
  std::ofstream(dir / "model.safetensors.index.json") << nlohmann::json{{"weight_map", map}}.dump();

  const Gpt2Config c = tiny_hub_llama();
  Gpt2 model(c);
  model.build(DType::kF32, Device::cpu(), 1);
  FlatModelState single = zero_state_for(model.params());
  load_hf_weights(hub, model.params(), c, single);
  // The split files hold bf16: the single file's values rounded.
  const Tensor rounded = single.values.to(DType::kBF16).to(DType::kF32);
  std::map<std::string, int> seen;
  for_each_hf_parameter(dir.string(), model.params(), c, [&](const Parameter& p, const float* v) {
    ++seen[p.name];
    EXPECT_EQ(std::memcmp(v, rounded.data<float>() + p.offset, p.numel() * sizeof(float)), 0)
        << p.name;
  });
  EXPECT_EQ(seen.size(), model.params().parameters().size());
  for (const auto& [name, count] : seen) EXPECT_EQ(count, 1) << name;
  // The second file cut short after its header was read: its first tensor is named when read.
  int taken = 0;
  const std::string error = testutil::error_of([&] {
    for_each_hf_parameter(dir.string(), model.params(), c, [&](const Parameter&, const float*) {
      if (++taken == 1)
        fs::resize_file(dir / "model-00002-of-00002.safetensors",
                        fs::file_size(dir / "model-00002-of-00002.safetensors") - 4);
    });
  });
  EXPECT_NE(error.find("model-00002-of-00002.safetensors': unexpected end of file reading tensor"),
            std::string::npos)
      << error;
  fs::remove_all(dir);
}

// The error load_hf_weights gives for the files of `hub` with its config.json changed by
// `change` (copied to `dir`), or "no error".
std::string import_error(const std::string& hub, const fs::path& dir,
                         const std::function<void(nlohmann::json&)>& change, const Gpt2Config& c) {
  fs::remove_all(dir);
  fs::create_directories(dir);
  fs::copy_file(hub + "/model.safetensors", dir / "model.safetensors");
  std::ifstream in(hub + "/config.json");
  nlohmann::json j = nlohmann::json::parse(in);
  change(j);
  std::ofstream(dir / "config.json") << j.dump();
  Gpt2 target(c);
  target.params().allocate(DType::kF32, Device::cpu(), AllocateOptions{16, false, false});
  FlatModelState into = zero_state_for(target.params());
  try {
    load_hf_weights(dir.string(), target.params(), c, into);
  } catch (const Error& e) {
    return std::string(e.what());
  }
  return std::string("no error");
}

TEST(ImportLlama, AConfigThatDiffersIsNamed) {
  const fs::path dir = fs::temp_directory_path() / ("loom_import_bad_" + std::to_string(getpid()));
  const auto error_with = [&](const std::function<void(nlohmann::json&)>& change,
                              const Gpt2Config& c) {
    return import_error(LOOM_SOURCE_DIR "/tests/data/hf_tiny_llama", dir, change, c);
  };
  const Gpt2Config c = tiny_hub_llama();
  EXPECT_NE(error_with([](nlohmann::json& j) { j["num_key_value_heads"] = 4; }, c)
                .find("config.json: num_key_value_heads = 4 but model.n_kv_heads = 2"),
            std::string::npos);
  EXPECT_NE(error_with([](nlohmann::json& j) {
              j["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 32.0}};
            }, c).find("rope_scaling"),
            std::string::npos);
  Gpt2Config tied = c;
  tied.tie_embeddings = true;
  EXPECT_NE(error_with([](nlohmann::json&) {}, tied)
                .find("tie_word_embeddings = false but model.tie_embeddings = true"),
            std::string::npos);
  EXPECT_NE(error_with([](nlohmann::json& j) { j["model_type"] = "gemma"; }, c).find("model_type"),
            std::string::npos);
  // Found by tests/fuzz (fuzz_hf_import): a config.json that is no object, or a key of another
  // type than LlamaConfig's, was an exception of the JSON library's that named no file.
  EXPECT_NE(error_with([](nlohmann::json& j) { j = 4; }, c)
                .find("config.json: not a JSON object of the model's settings, but number 4"),
            std::string::npos);
  EXPECT_NE(error_with([](nlohmann::json& j) { j["rope_theta"] = "500"; }, c)
                .find("config.json: a key of another type than LlamaConfig's"),
            std::string::npos);
  EXPECT_NE(error_with([](nlohmann::json& j) { j["rope_scaling"] = 8; }, c)
                .find("config.json: a key of another type than LlamaConfig's"),
            std::string::npos);
  // A number that is no int64 (a plain cast of 1e30 is undefined behaviour, 2^64 - 1 wraps to -1).
  EXPECT_NE(error_with([](nlohmann::json& j) { j["hidden_size"] = 1e30; }, c)
                .find("config.json: no integer \"hidden_size\" (of int64's range)"),
            std::string::npos);
  EXPECT_NE(error_with([](nlohmann::json& j) { j["num_hidden_layers"] = UINT64_MAX; }, c)
                .find("config.json: no integer \"num_hidden_layers\" (of int64's range)"),
            std::string::npos);
  Gpt2Config scaled = c;
  scaled.rope_scaling_factor = 8;
  scaled.rope_low_freq_factor = 1;
  scaled.rope_high_freq_factor = 4;
  scaled.rope_original_max_seq_len = 8192;
  EXPECT_NE(error_with(
                [](nlohmann::json& j) {
                  j["rope_scaling"] = {{"rope_type", "llama3"},
                                       {"factor", 8.0},
                                       {"low_freq_factor", 1.0},
                                       {"high_freq_factor", 4.0},
                                       {"original_max_position_embeddings", 1e300}};
                },
                scaled)
                .find("config.json: a key of another type than LlamaConfig's"),
            std::string::npos);
  EXPECT_EQ(error_with([](nlohmann::json&) {}, c), "no error");
  fs::remove_all(dir);
}

}  // namespace
// A mixture of experts (model.moe_experts) from transformers' MixtralForCausalLM: a directory
// its own save_pretrained wrote (tests/data/hf_tiny_mixtral, tools/make_hf_llama_fixture.py
// --mixtral: tiny_hub_llama's sizes with 4 experts per block, 2 per token) gives the logits
// transformers computed — its router as Loom's, each expert's w1 / w3 as the fused gate/up rows,
// w2 as proj —; Loom's own export (model_type "mixtral", MixtralConfig's keys) loads back bit for
// bit; a Llama where a Mixtral is wanted, or other experts, are named.
Gpt2Config tiny_hub_mixtral() {
  Gpt2Config c = tiny_hub_llama();
  c.moe_experts = 4;
  c.moe_top_k = 2;
  return c;
}

TEST(ImportMixtral, TransformersSavedMixtralGivesTransformersLogits) {
  expect_transformers_logits(LOOM_SOURCE_DIR "/tests/data/hf_tiny_mixtral", tiny_hub_mixtral());
}

TEST(ImportMixtral, LoomsOwnExportIsMixtralAndLoadsBackBitForBit) {
  const fs::path dir =
      fs::temp_directory_path() / ("loom_import_mixtral_" + std::to_string(getpid()));
  fs::remove_all(dir);
  const Gpt2Config c = tiny_hub_mixtral();
  Gpt2 model(c);
  model.build(DType::kF32, Device::cpu(), 5);
  const std::string ckpt = save_and_export_hf(model, dir, 2);
  const SafetensorsFile f = load_safetensors((dir / "hf" / "model.safetensors").string());
  // embed_tokens, norm, lm_head; per layer two norms, q/k/v/o, the gate and 3 per expert
  EXPECT_EQ(f.names.size(), 3u + (6u + 1u + 3u * 4u) * 2u);
  const Tensor& w3 = f.tensors.at("model.layers.1.block_sparse_moe.experts.3.w3.weight");
  const Parameter& fc = model.params().get("blocks.1.mlp.experts.3.fc.weight");
  ASSERT_EQ(w3.shape(), (Shape{48, 32}));
  EXPECT_EQ(std::memcmp(w3.data<float>(), fc.value.data<float>() + 48 * 32, 48 * 32 * 4), 0);
  std::ifstream cf(dir / "hf" / "config.json");
  const nlohmann::json j = nlohmann::json::parse(cf);
  EXPECT_EQ(j["architectures"][0], "MixtralForCausalLM");
  EXPECT_EQ(j["model_type"], "mixtral");
  EXPECT_EQ(j["num_local_experts"], 4);
  EXPECT_EQ(j["num_experts_per_tok"], 2);
  EXPECT_TRUE(j["sliding_window"].is_null());
  EXPECT_FALSE(j.contains("head_dim"));
  expect_loads_back_bitwise(model, (dir / "hf").string());
  fs::remove_all(dir);
}

// A mixture's balancing biases (model.moe_bias_update_rate, nn/moe_mlp.h) are part of the model:
// a checkpoint keeps them, and load_checkpoint — what `loom sample` and the export read a
// checkpoint with — routes by them again: biases of +5 for expert 2 send every token there in
// every block, where the same weights without them do not. The Mixtral export, which has no
// biases, refuses them.
TEST(MixtureBiases, ComeBackWithTheCheckpointAndStopTheMixtralExport) {
  const fs::path dir =
      fs::temp_directory_path() / ("loom_mixture_biases_" + std::to_string(getpid()));
  fs::remove_all(dir);
  const Gpt2Config c = tiny_hub_mixtral();
  const int64_t E = c.moe_experts, L = c.n_layers, B = 2, T = 8;
  Gpt2 model(c);
  model.build(DType::kF32, Device::cpu(), 5);
  TrainingState st;
  st.step = 3;
  st.expert_bias.assign(static_cast<size_t>(L * E), 0.0f);
  for (int64_t l = 0; l < L; ++l) st.expert_bias[static_cast<size_t>(l * E + 2)] = 5.0f;
  const std::string ckpt = save_checkpoint((dir / "checkpoints").string(), model, nullptr, st);
  Gpt2 loaded(c);
  loaded.build(DType::kF32, Device::cpu(), 9);
  EXPECT_EQ(load_checkpoint(ckpt, loaded, nullptr).expert_bias, st.expert_bias);
  Tensor tokens = Tensor::empty({B, T}, DType::kI32);
  for (int64_t i = 0; i < B * T; ++i)
    tokens.data<int32_t>()[i] = static_cast<int32_t>(i * 37 % 200);
  ThreadPool pool(1);
  Context ctx{&pool, Device::cpu(), DType::kF32};
  const auto tokens_per_expert = [&](Gpt2& m) {
    m.logits(ctx, tokens);
    std::vector<double> counts(c.expert_counts_size(), 0);
    m.add_expert_tokens(counts);
    return counts;
  };
  const std::vector<double> biased = tokens_per_expert(loaded), plain = tokens_per_expert(model);
  for (int64_t l = 0; l < L; ++l) {
    EXPECT_EQ(biased[static_cast<size_t>(l * E + 2)], B * T) << "block " << l;
    EXPECT_LT(plain[static_cast<size_t>(l * E + 2)], B * T) << "block " << l;
  }
  const std::string error =
      testutil::error_of([&] { export_checkpoint(ckpt, "hf", (dir / "hf").string()); });
  EXPECT_NE(error.find("routes by balancing biases (model.moe_bias_update_rate)"),
            std::string::npos)
      << error;
  EXPECT_FALSE(fs::exists(dir / "hf"));
  fs::remove_all(dir);
}

// An expert capacity (model.moe_capacity_factor) is part of the model too: state.json keeps it
// and its drop policy (and the router's score function), and a model built from
// read_checkpoint_model — as `loom sample` builds it — drops what the trained one drops: the
// same logits, which the same weights dropless do not give. A sigmoid router is not exported as
// a Mixtral.
TEST(ExpertCapacity, ComesBackWithTheCheckpoint) {
  const fs::path dir =
      fs::temp_directory_path() / ("loom_expert_capacity_" + std::to_string(getpid()));
  fs::remove_all(dir);
  Gpt2Config c = tiny_hub_mixtral();
  c.moe_capacity = {0.5, TokenDropPolicy::kPosition};  // 2 of a sequence's 16 choices each
  c.moe_router_score = RouterScore::kSigmoid;
  c.moe_router_groups = 2;  // of 2 experts: a token's pair from its best group
  c.moe_router_group_topk = 1;
  c.moe_router_topk_scaling_factor = 2.5;
  c.moe_router_norm_topk_prob = false;
  Gpt2 model(c);
  model.build(DType::kF32, Device::cpu(), 5);
  TrainingState st;
  st.step = 1;
  const std::string ckpt = save_checkpoint((dir / "checkpoints").string(), model, nullptr, st);
  const Gpt2Config back = read_checkpoint_model(ckpt);
  EXPECT_EQ(back.moe_capacity.factor, 0.5);
  EXPECT_EQ(back.moe_capacity.policy, TokenDropPolicy::kPosition);
  EXPECT_EQ(back.moe_router_score, RouterScore::kSigmoid);
  EXPECT_EQ(back.moe_router_groups, 2);
  EXPECT_EQ(back.moe_router_group_topk, 1);
  EXPECT_EQ(back.moe_router_topk_scaling_factor, 2.5);
  EXPECT_FALSE(back.moe_router_norm_topk_prob);
  Gpt2 loaded(back);
  loaded.build(DType::kF32, Device::cpu(), 9);
  load_checkpoint(ckpt, loaded, nullptr);
  Gpt2Config dropless_config = c;
  dropless_config.moe_capacity = {};
  Gpt2 dropless(dropless_config);
  dropless.build(DType::kF32, Device::cpu(), 9);
  load_checkpoint(ckpt, dropless, nullptr);
  Tensor tokens = Tensor::empty({2, 8}, DType::kI32);
  for (int64_t i = 0; i < 16; ++i) tokens.data<int32_t>()[i] = static_cast<int32_t>(i * 37 % 200);
  ThreadPool pool(1);
  Context ctx{&pool, Device::cpu(), DType::kF32};
  const std::vector<float> want = model.logits(ctx, tokens).to_vector();
  EXPECT_EQ(loaded.logits(ctx, tokens).to_vector(), want);
  EXPECT_NE(dropless.logits(ctx, tokens).to_vector(), want);
  // MixtralForCausalLM's router is a softmax over every expert, its weights unscaled: a mixture
  // routed otherwise is not exported as one.
  const std::string error =
      testutil::error_of([&] { export_checkpoint(ckpt, "hf", (dir / "hf").string()); });
  EXPECT_NE(error.find("routed within groups (model.moe_router_num_groups), with scaled weights "
                       "(model.moe_router_topk_scaling_factor) or with weights not normalised"),
            std::string::npos)
      << error;
  const fs::path state = fs::path(ckpt) / "state.json";
  std::ifstream in(state);
  nlohmann::json j = nlohmann::json::parse(in);
  in.close();
  j["model"]["moe"].erase("router_num_groups");
  j["model"]["moe"].erase("router_group_topk");
  j["model"]["moe"].erase("router_topk_scaling_factor");
  j["model"]["moe"].erase("router_norm_topk_prob");
  std::ofstream(state) << j.dump(2);
  const std::string sigmoid_error =
      testutil::error_of([&] { export_checkpoint(ckpt, "hf", (dir / "hf").string()); });
  EXPECT_NE(sigmoid_error.find("router scores by sigmoids (model.moe_router_score_function)"),
            std::string::npos)
      << sigmoid_error;
  EXPECT_FALSE(fs::exists(dir / "hf"));
  fs::remove_all(dir);
}

TEST(ImportMixtral, ALlamaWhereAMixtralIsWantedAndOtherExpertsAreNamed) {
  const fs::path dir =
      fs::temp_directory_path() / ("loom_import_bad_mixtral_" + std::to_string(getpid()));
  const std::string mixtral = LOOM_SOURCE_DIR "/tests/data/hf_tiny_mixtral";
  const std::string llama = LOOM_SOURCE_DIR "/tests/data/hf_tiny_llama";
  const auto same = [](nlohmann::json&) {};
  EXPECT_NE(import_error(llama, dir, same, tiny_hub_mixtral())
                .find("config.json: model_type = llama, but model.moe_experts = 4 starts from a "
                      "MixtralForCausalLM directory"),
            std::string::npos);
  EXPECT_NE(import_error(mixtral, dir, same, tiny_hub_llama())
                .find("(a MixtralForCausalLM needs model.moe_experts)"),
            std::string::npos);
  EXPECT_NE(
      import_error(
          mixtral, dir, [](nlohmann::json& j) { j["num_local_experts"] = 8; }, tiny_hub_mixtral())
          .find("config.json: num_local_experts = 8 but model.moe_experts = 4"),
      std::string::npos);
  EXPECT_NE(
      import_error(
          mixtral, dir, [](nlohmann::json& j) { j["num_experts_per_tok"] = 1; }, tiny_hub_mixtral())
          .find("config.json: num_experts_per_tok = 1 but model.moe_top_k = 2"),
      std::string::npos);
  EXPECT_NE(
      import_error(
          mixtral, dir, [](nlohmann::json& j) { j["sliding_window"] = 16; }, tiny_hub_mixtral())
          .find("sliding_window = 16 is below model.max_seq_len = 64"),
      std::string::npos);
  EXPECT_EQ(import_error(mixtral, dir, same, tiny_hub_mixtral()), "no error");
  fs::remove_all(dir);
}

// Biases on the queries, keys and values (model.qkv_bias) from transformers' Qwen2ForCausalLM: a
// directory its own save_pretrained wrote (tests/data/hf_tiny_qwen2, tools/make_hf_llama_fixture.py
// --qwen2: tiny_hub_llama's sizes, a tied head, rope_theta 1e6, random biases) gives the logits
// transformers computed; Loom's own export (model_type "qwen2", q/k/v_proj.bias the fused bias's
// row blocks) loads back bit for bit; a Llama where a Qwen 2 is wanted and the other way round,
// and a sliding window in use, are named.
Gpt2Config tiny_hub_qwen2() {
  Gpt2Config c = tiny_hub_llama();
  c.qkv_bias = true;
  c.tie_embeddings = true;
  c.rope_theta = 1e6;
  c.norm_eps = 1e-6;
  return c;
}

TEST(ImportQwen2, TransformersSavedQwen2GivesTransformersLogits) {
  expect_transformers_logits(LOOM_SOURCE_DIR "/tests/data/hf_tiny_qwen2", tiny_hub_qwen2());
}

TEST(ImportQwen2, LoomsOwnExportIsQwen2AndLoadsBackBitForBit) {
  const fs::path dir =
      fs::temp_directory_path() / ("loom_import_qwen2_" + std::to_string(getpid()));
  fs::remove_all(dir);
  const Gpt2Config c = tiny_hub_qwen2();
  Gpt2 model(c);
  model.build(DType::kF32, Device::cpu(), 5);
  // Biases of their own value at every row (zero-initialised, they would hide a shuffled block).
  for (int l = 0; l < 2; ++l) {
    Tensor& b = model.params().get("blocks." + std::to_string(l) + ".attn.qkv.bias").value;
    for (int64_t i = 0; i < b.numel(); ++i)
      b.data<float>()[i] = 0.01f * static_cast<float>(i + 100 * l);
  }
  const std::string ckpt = save_and_export_hf(model, dir, 2);
  EXPECT_TRUE(read_checkpoint_model(ckpt).qkv_bias);
  const SafetensorsFile f = load_safetensors((dir / "hf" / "model.safetensors").string());
  EXPECT_EQ(f.names.size(), 2u + 12u * 2u);  // embed_tokens, norm; nine weights, three biases
  // kv = 2 heads of 8: q's bias rows 0..31, k's 32..47, v's 48..63 of the fused one.
  const Tensor& k = f.tensors.at("model.layers.1.self_attn.k_proj.bias");
  ASSERT_EQ(k.shape(), (Shape{16}));
  EXPECT_EQ(k.data<float>()[0], 0.01f * 132);
  EXPECT_EQ(f.tensors.at("model.layers.0.self_attn.v_proj.bias").data<float>()[15], 0.01f * 63);
  EXPECT_EQ(f.tensors.count("model.layers.0.self_attn.o_proj.bias"), 0u);
  std::ifstream cf(dir / "hf" / "config.json");
  const nlohmann::json j = nlohmann::json::parse(cf);
  EXPECT_EQ(j["architectures"][0], "Qwen2ForCausalLM");
  EXPECT_EQ(j["model_type"], "qwen2");
  EXPECT_FALSE(j["use_sliding_window"].get<bool>());
  EXPECT_FALSE(j.contains("attention_bias"));
  EXPECT_EQ(j["rope_theta"].get<double>(), 1e6);
  expect_loads_back_bitwise(model, (dir / "hf").string());
  fs::remove_all(dir);
}

TEST(ImportQwen2, ALlamaWhereAQwen2IsWantedAndTheOtherWayRoundAreNamed) {
  const fs::path dir =
      fs::temp_directory_path() / ("loom_import_qwen2_bad_" + std::to_string(getpid()));
  const std::string qwen2 = LOOM_SOURCE_DIR "/tests/data/hf_tiny_qwen2";
  const std::string llama = LOOM_SOURCE_DIR "/tests/data/hf_tiny_llama";
  const auto same = [](nlohmann::json&) {};
  Gpt2Config biased = tiny_hub_llama();  // hf_tiny_llama's sizes and untied head, with biases
  biased.qkv_bias = true;
  EXPECT_NE(import_error(llama, dir, same, biased)
                .find("model_type = llama, but model.qkv_bias = true starts from a "
                      "Qwen2ForCausalLM directory"),
            std::string::npos);
  Gpt2Config plain = tiny_hub_qwen2();
  plain.qkv_bias = false;
  EXPECT_NE(import_error(qwen2, dir, same, plain)
                .find("a Qwen2ForCausalLM's qkv biases need model.qkv_bias = true"),
            std::string::npos);
  // Qwen 2's window only where it is used; Mistral's (no use_sliding_window key) always.
  EXPECT_NE(import_error(
                qwen2, dir,
                [](nlohmann::json& j) {
                  j["use_sliding_window"] = true;
                  j["sliding_window"] = 16;
                  j["max_window_layers"] = 0;  // every block's (from 2 on: none)
                },
                tiny_hub_qwen2())
                .find("sliding_window = 16 is below model.max_seq_len = 64"),
            std::string::npos);
  EXPECT_EQ(import_error(qwen2, dir, same, tiny_hub_qwen2()), "no error");
  // A MistralForCausalLM holds a Llama's tensors: read when its window spans the sequences.
  EXPECT_EQ(import_error(
                llama, dir,
                [](nlohmann::json& j) {
                  j["model_type"] = "mistral";
                  j["sliding_window"] = nullptr;
                },
                tiny_hub_llama()),
            "no error");
  EXPECT_NE(import_error(
                llama, dir,
                [](nlohmann::json& j) {
                  j["model_type"] = "mistral";
                  j["sliding_window"] = 32;
                },
                tiny_hub_llama())
                .find("sliding_window = 32 is below model.max_seq_len = 64"),
            std::string::npos);
  fs::remove_all(dir);
}

// Qwen 3's per-head query/key norms (model.qk_norm) and heads wider than their share of d_model
// (model.head_dim): a Qwen3ForCausalLM that transformers 4.51.3 saved (tests/data/hf_tiny_qwen3,
// tools/make_hf_llama_fixture.py --qwen3: tiny_hub_qwen2's sizes, no biases, heads of 16 — the
// queries 64 wide from a 32-wide model — and random q_norm / k_norm gains) gives the logits
// transformers computed; Loom's own export (model_type "qwen3", q_norm / k_norm, head_dim)
// loads back bit for bit; a Llama or Qwen 2 where a Qwen 3 is wanted, the other way round and
// another head width are named.
Gpt2Config tiny_hub_qwen3() {
  Gpt2Config c = tiny_hub_qwen2();
  c.qkv_bias = false;
  c.qk_norm = true;
  c.head_width = 16;
  return c;
}

TEST(ImportQwen3, TransformersSavedQwen3GivesTransformersLogits) {
  expect_transformers_logits(LOOM_SOURCE_DIR "/tests/data/hf_tiny_qwen3", tiny_hub_qwen3());
}

TEST(ImportQwen3, LoomsOwnExportIsQwen3AndLoadsBackBitForBit) {
  const fs::path dir =
      fs::temp_directory_path() / ("loom_import_qwen3_" + std::to_string(getpid()));
  fs::remove_all(dir);
  const Gpt2Config c = tiny_hub_qwen3();
  Gpt2 model(c);
  model.build(DType::kF32, Device::cpu(), 5);
  for (int l = 0; l < 2; ++l)  // gains of their own value at every position (ones hide a swap)
    for (const char* norm : {"q_norm", "k_norm"}) {
      Tensor& g =
          model.params().get("blocks." + std::to_string(l) + ".attn." + norm + ".weight").value;
      for (int64_t i = 0; i < g.numel(); ++i)
        g.data<float>()[i] =
            1.0f + 0.01f * static_cast<float>(i + 100 * l + (norm[0] == 'k' ? 50 : 0));
    }
  const std::string ckpt = save_and_export_hf(model, dir, 2);
  const Gpt2Config saved = read_checkpoint_model(ckpt);
  EXPECT_TRUE(saved.qk_norm);
  EXPECT_EQ(saved.head_dim(), 16);
  const SafetensorsFile f = load_safetensors((dir / "hf" / "model.safetensors").string());
  EXPECT_EQ(f.names.size(), 2u + 11u * 2u);  // embed_tokens, norm; nine weights, two norms
  // 4 query heads of 16: q_proj 64 × 32, k_proj and v_proj 32 × 32, o_proj 32 × 64.
  EXPECT_EQ(f.tensors.at("model.layers.0.self_attn.q_proj.weight").shape(), (Shape{64, 32}));
  EXPECT_EQ(f.tensors.at("model.layers.0.self_attn.v_proj.weight").shape(), (Shape{32, 32}));
  EXPECT_EQ(f.tensors.at("model.layers.1.self_attn.o_proj.weight").shape(), (Shape{32, 64}));
  const Tensor& k = f.tensors.at("model.layers.1.self_attn.k_norm.weight");
  ASSERT_EQ(k.shape(), (Shape{16}));
  EXPECT_EQ(k.data<float>()[3], 1.0f + 0.01f * 153);
  std::ifstream cf(dir / "hf" / "config.json");
  const nlohmann::json j = nlohmann::json::parse(cf);
  EXPECT_EQ(j["architectures"][0], "Qwen3ForCausalLM");
  EXPECT_EQ(j["model_type"], "qwen3");
  EXPECT_EQ(j["head_dim"], 16);
  EXPECT_FALSE(j["attention_bias"].get<bool>());
  EXPECT_FALSE(j["use_sliding_window"].get<bool>());
  expect_loads_back_bitwise(model, (dir / "hf").string());
  // With qkv biases there is no class to write: Qwen3Config's attention_bias biases o_proj too.
  Gpt2Config biased = c;
  biased.qkv_bias = true;
  Gpt2 biased_model(biased);
  biased_model.build(DType::kF32, Device::cpu(), 5);
  const fs::path biased_dir = dir / "biased";
  const std::string error =
      testutil::error_of([&] { save_and_export_hf(biased_model, biased_dir, 2); });
  EXPECT_NE(error.find("model.qk_norm is written as a Qwen3ForCausalLM"), std::string::npos)
      << error;
  fs::remove_all(dir);
}

TEST(ImportQwen3, OtherModelsWhereAQwen3IsWantedAndOtherHeadsAreNamed) {
  const fs::path dir =
      fs::temp_directory_path() / ("loom_import_qwen3_bad_" + std::to_string(getpid()));
  const std::string qwen3 = LOOM_SOURCE_DIR "/tests/data/hf_tiny_qwen3";
  const std::string qwen2 = LOOM_SOURCE_DIR "/tests/data/hf_tiny_qwen2";
  const auto same = [](nlohmann::json&) {};
  Gpt2Config normed = tiny_hub_qwen2();  // hf_tiny_qwen2's sizes with norms, no biases
  normed.qkv_bias = false;
  normed.qk_norm = true;
  EXPECT_NE(import_error(qwen2, dir, same, normed)
                .find("model_type = qwen2, but model.qk_norm = true starts from a "
                      "Qwen3ForCausalLM directory"),
            std::string::npos);
  Gpt2Config plain = tiny_hub_qwen3();
  plain.qk_norm = false;
  EXPECT_NE(import_error(qwen3, dir, same, plain)
                .find("a Qwen3ForCausalLM's per-head q_norm and k_norm need model.qk_norm = true"),
            std::string::npos);
  Gpt2Config narrow = tiny_hub_qwen3();
  narrow.head_width = 0;  // d_model / n_heads = 8
  EXPECT_NE(import_error(qwen3, dir, same, narrow)
                .find("config.json: head_dim = 16 but model.d_model / model.n_heads = 8"),
            std::string::npos);
  // Qwen3Config's head_dim defaults to 128: a file without it is not read as 16-wide heads.
  EXPECT_NE(import_error(
                qwen3, dir, [](nlohmann::json& j) { j.erase("head_dim"); }, tiny_hub_qwen3())
                .find("head_dim = 128 but model.head_dim = 16"),
            std::string::npos);
  EXPECT_EQ(import_error(qwen3, dir, same, tiny_hub_qwen3()), "no error");
  fs::remove_all(dir);
}

// Qwen 3's mixture of experts (model.qk_norm with model.moe_experts): a Qwen3MoeForCausalLM that
// transformers 4.51.3 saved (tests/data/hf_tiny_qwen3_moe, tools/make_hf_llama_fixture.py
// --qwen3-moe: tiny_hub_qwen3 with 4 experts 24 wide per block, 2 per token, norm_topk_prob
// true) gives transformers' logits; Loom's own export (model_type "qwen3_moe", mlp.gate and the
// experts' gate_proj / up_proj / down_proj, norm_topk_prob from model.moe_router_norm_topk_prob)
// loads back bit for bit; another routing, a Mixtral where a Qwen 3 mixture is wanted and dense
// blocks are named.
Gpt2Config tiny_hub_qwen3_moe() {
  Gpt2Config c = tiny_hub_qwen3();
  c.moe_experts = 4;
  c.moe_top_k = 2;
  c.ffn_hidden = 24;
  return c;
}

TEST(ImportQwen3Moe, TransformersSavedQwen3MoeGivesTransformersLogits) {
  expect_transformers_logits(LOOM_SOURCE_DIR "/tests/data/hf_tiny_qwen3_moe", tiny_hub_qwen3_moe());
}

TEST(ImportQwen3Moe, LoomsOwnExportIsQwen3MoeAndLoadsBackBitForBit) {
  const fs::path dir =
      fs::temp_directory_path() / ("loom_import_qwen3_moe_" + std::to_string(getpid()));
  fs::remove_all(dir);
  for (const bool normalised : {true, false}) {
    SCOPED_TRACE(normalised ? "norm_topk_prob" : "weights not normalised");
    Gpt2Config c = tiny_hub_qwen3_moe();
    c.moe_router_norm_topk_prob = normalised;
    Gpt2 model(c);
    model.build(DType::kF32, Device::cpu(), 5);
    save_and_export_hf(model, dir, 2);
    const SafetensorsFile f = load_safetensors((dir / "hf" / "model.safetensors").string());
    // embed_tokens, norm; per layer two norms, q/k/v/o, q/k norms, the gate and 3 per expert
    EXPECT_EQ(f.names.size(), 2u + (8u + 1u + 3u * 4u) * 2u);
    const Tensor& up = f.tensors.at("model.layers.1.mlp.experts.3.up_proj.weight");
    const Parameter& fc = model.params().get("blocks.1.mlp.experts.3.fc.weight");
    ASSERT_EQ(up.shape(), (Shape{24, 32}));
    EXPECT_EQ(std::memcmp(up.data<float>(), fc.value.data<float>() + 24 * 32, 24 * 32 * 4), 0);
    EXPECT_EQ(f.tensors.at("model.layers.0.mlp.gate.weight").shape(), (Shape{4, 32}));
    std::ifstream cf(dir / "hf" / "config.json");
    const nlohmann::json j = nlohmann::json::parse(cf);
    EXPECT_EQ(j["architectures"][0], "Qwen3MoeForCausalLM");
    EXPECT_EQ(j["model_type"], "qwen3_moe");
    EXPECT_EQ(j["num_experts"], 4);
    EXPECT_FALSE(j.contains("num_local_experts"));
    EXPECT_EQ(j["moe_intermediate_size"], 24);
    EXPECT_EQ(j["norm_topk_prob"].get<bool>(), normalised);
    EXPECT_EQ(j["head_dim"], 16);
    expect_loads_back_bitwise(model, (dir / "hf").string());
    fs::remove_all(dir);
  }
}

TEST(ImportQwen3Moe, OtherRoutingAMixtralAndDenseBlocksAreNamed) {
  const fs::path dir =
      fs::temp_directory_path() / ("loom_import_qwen3_moe_bad_" + std::to_string(getpid()));
  const std::string qwen3_moe = LOOM_SOURCE_DIR "/tests/data/hf_tiny_qwen3_moe";
  const std::string mixtral = LOOM_SOURCE_DIR "/tests/data/hf_tiny_mixtral";
  const auto same = [](nlohmann::json&) {};
  Gpt2Config unnormalised = tiny_hub_qwen3_moe();
  unnormalised.moe_router_norm_topk_prob = false;
  EXPECT_NE(import_error(qwen3_moe, dir, same, unnormalised)
                .find("norm_topk_prob = true but model.moe_router_norm_topk_prob = false"),
            std::string::npos);
  EXPECT_NE(import_error(
                qwen3_moe, dir, [](nlohmann::json& j) { j["mlp_only_layers"] = {1}; },
                tiny_hub_qwen3_moe())
                .find("Loom's mixture has experts in every block"),
            std::string::npos);
  EXPECT_NE(import_error(mixtral, dir, same, tiny_hub_qwen3_moe())
                .find("model_type = mixtral, but model.qk_norm = true starts from a "
                      "Qwen3MoeForCausalLM directory"),
            std::string::npos);
  EXPECT_NE(import_error(qwen3_moe, dir, same, tiny_hub_mixtral())
                .find("a Qwen3MoeForCausalLM's per-head q_norm and k_norm need model.qk_norm"),
            std::string::npos);
  EXPECT_EQ(import_error(qwen3_moe, dir, same, tiny_hub_qwen3_moe()), "no error");
  fs::remove_all(dir);
}

// OLMoE (OlmoeForCausalLM): a mixture of experts with pre-norms and query/key norms over all the
// heads (model.qk_norm_scope = "full"), its chosen weights not normalised — a directory
// transformers 4.51.3 saved (tests/data/hf_tiny_olmoe, tools/make_hf_llama_fixture.py --olmoe:
// tiny_hub_llama's sizes, 4 experts 24 wide, 2 per token, the norms' gains random) gives
// transformers' logits (off by 0.6 with the chosen weights normalised: checked with the file's
// norm_topk_prob turned); Loom's own export is an OlmoeForCausalLM and loads
// back bit for bit; the other classes' directories and their settings are named.
Gpt2Config tiny_hub_olmoe() {
  Gpt2Config c = tiny_hub_llama();
  c.moe_experts = 4;
  c.moe_top_k = 2;
  c.ffn_hidden = 24;
  c.moe_router_norm_topk_prob = false;
  c.qk_norm = true;
  c.qk_norm_full = true;
  return c;
}

TEST(ImportOlmoe, TransformersSavedOlmoeGivesTransformersLogits) {
  expect_transformers_logits(LOOM_SOURCE_DIR "/tests/data/hf_tiny_olmoe", tiny_hub_olmoe());
}

TEST(ImportOlmoe, LoomsOwnExportIsOlmoeAndLoadsBackBitForBit) {
  const fs::path dir =
      fs::temp_directory_path() / ("loom_import_olmoe_" + std::to_string(getpid()));
  fs::remove_all(dir);
  const Gpt2Config c = tiny_hub_olmoe();
  Gpt2 model(c);
  model.build(DType::kF32, Device::cpu(), 5);
  save_and_export_hf(model, dir, 2);
  const SafetensorsFile f = load_safetensors((dir / "hf" / "model.safetensors").string());
  // embed_tokens, norm, lm_head; per layer two norms, q/k/v/o, q/k norms, the gate, 3 per expert
  EXPECT_EQ(f.names.size(), 3u + (8u + 1u + 3u * 4u) * 2u);
  EXPECT_EQ(f.tensors.at("model.layers.1.self_attn.q_norm.weight").shape(), (Shape{32}));
  EXPECT_EQ(f.tensors.at("model.layers.1.self_attn.k_norm.weight").shape(), (Shape{16}));
  EXPECT_EQ(f.tensors.at("model.layers.0.mlp.experts.2.down_proj.weight").shape(), (Shape{32, 24}));
  std::ifstream cf(dir / "hf" / "config.json");
  const nlohmann::json j = nlohmann::json::parse(cf);
  EXPECT_EQ(j["architectures"][0], "OlmoeForCausalLM");
  EXPECT_EQ(j["model_type"], "olmoe");
  EXPECT_EQ(j["num_experts"], 4);
  EXPECT_EQ(j["intermediate_size"], 24);
  EXPECT_FALSE(j["norm_topk_prob"].get<bool>());
  EXPECT_TRUE(j["clip_qkv"].is_null());
  EXPECT_FALSE(j.contains("head_dim"));
  EXPECT_FALSE(j.contains("num_local_experts"));
  expect_loads_back_bitwise(model, (dir / "hf").string());
  fs::remove_all(dir);
}

TEST(ImportOlmoe, OtherClassesAndSettingsAreNamed) {
  const fs::path dir =
      fs::temp_directory_path() / ("loom_import_olmoe_bad_" + std::to_string(getpid()));
  const std::string olmoe = LOOM_SOURCE_DIR "/tests/data/hf_tiny_olmoe";
  const auto same = [](nlohmann::json&) {};
  EXPECT_EQ(import_error(olmoe, dir, same, tiny_hub_olmoe()), "no error");
  Gpt2Config normalised = tiny_hub_olmoe();
  normalised.moe_router_norm_topk_prob = true;
  EXPECT_NE(import_error(olmoe, dir, same, normalised)
                .find("norm_topk_prob = false but model.moe_router_norm_topk_prob = true"),
            std::string::npos);
  EXPECT_NE(import_error(
                olmoe, dir, [](nlohmann::json& j) { j["clip_qkv"] = 8.0; }, tiny_hub_olmoe())
                .find("clip_qkv = 8.0: Loom does not clamp the queries and keys"),
            std::string::npos);
  // A Qwen 3 mixture's per-head norms are no OLMoE's; nor is an OLMoE a Qwen 3 mixture.
  Gpt2Config per_head = tiny_hub_olmoe();
  per_head.qk_norm_full = false;
  EXPECT_NE(import_error(olmoe, dir, same, per_head)
                .find("model_type = olmoe: an OlmoeForCausalLM needs model.moe_experts, "
                      "model.qk_norm = true and model.qk_norm_scope = \"full\""),
            std::string::npos);
  EXPECT_NE(
      import_error(LOOM_SOURCE_DIR "/tests/data/hf_tiny_qwen3_moe", dir, same, tiny_hub_olmoe())
          .find("model_type = qwen3_moe, but a mixture of experts with "
                "model.qk_norm_scope = \"full\" starts from an OlmoeForCausalLM directory"),
      std::string::npos);
  fs::remove_all(dir);
}

// A sliding window (model.sliding_window, nn/sliding_window.h) from transformers'
// MistralForCausalLM: a directory 4.51.3's save_pretrained wrote (tests/data/hf_tiny_mistral,
// tools/make_hf_llama_fixture.py --mistral: tiny_hub_llama's sizes, each query seeing its 5
// latest positions) gives the logits transformers computed over 12 positions, which the window
// changes; Loom's export of a windowed Llama is a MistralForCausalLM again and loads back bit for
// bit, a windowed Qwen's uses its window from block 0 on; another window, none where the file
// has one, and Qwen's window in later blocks only are named.
Gpt2Config tiny_hub_mistral() {
  Gpt2Config c = tiny_hub_llama();
  c.sliding_window = 5;
  return c;
}

// Phi-3 and Phi-4's class (Phi3ForCausalLM): a directory transformers 4.51.3 saved
// (tests/data/hf_tiny_phi3, tools/make_hf_llama_fixture.py --phi3: tiny_hub_mistral's sizes and
// window, the queries, keys and values in one qkv_proj and the gate and up rows in one
// gate_up_proj, which are Loom's fused weights as they are) gives transformers' logits; a partial
// rotation (Phi-4-mini's), LongRoPE (Phi-3's 128k models) or another window is named.
TEST(ImportPhi3, TransformersSavedPhi3GivesTransformersLogits) {
  expect_transformers_logits(LOOM_SOURCE_DIR "/tests/data/hf_tiny_phi3", tiny_hub_mistral());
}

TEST(ImportPhi3, PartialRotationLongRopeAndOtherWindowsAreNamed) {
  const fs::path dir =
      fs::temp_directory_path() / ("loom_import_phi3_bad_" + std::to_string(getpid()));
  const std::string phi3 = LOOM_SOURCE_DIR "/tests/data/hf_tiny_phi3";
  const auto same = [](nlohmann::json&) {};
  EXPECT_EQ(import_error(phi3, dir, same, tiny_hub_mistral()), "no error");
  EXPECT_NE(import_error(
                phi3, dir, [](nlohmann::json& j) { j["partial_rotary_factor"] = 0.75; },
                tiny_hub_mistral())
                .find("partial_rotary_factor = 0.75: Loom's rotary embedding turns every "
                      "dimension of a head (1.0)"),
            std::string::npos);
  EXPECT_NE(import_error(
                phi3, dir,
                [](nlohmann::json& j) {
                  j["rope_scaling"] = {{"type", "longrope"},
                                       {"short_factor", {1.0, 1.0}},
                                       {"long_factor", {2.0, 2.0}}};
                },
                tiny_hub_mistral())
                .find("not \"longrope\""),
            std::string::npos);
  EXPECT_NE(import_error(phi3, dir, same, tiny_hub_llama())
                .find("sliding_window = 5 is below model.max_seq_len = 64"),
            std::string::npos);
  // A model with qkv biases or query/key norms is another class's.
  Gpt2Config normed = tiny_hub_mistral();
  normed.qk_norm = true;
  EXPECT_NE(import_error(phi3, dir, same, normed).find("model_type = phi3, but model.qk_norm"),
            std::string::npos);
  fs::remove_all(dir);
}

// OLMo 2: an Olmo2ForCausalLM transformers 4.51.3 saved (tests/data/hf_tiny_olmo2,
// tools/make_hf_llama_fixture.py --olmo2: hf_tiny_llama's sizes, epsilon 1e-6, every gain
// random) — norms after the attention and the MLP (model.norm_placement = "post"), q_norm and
// k_norm over all the query heads and all the key heads (model.qk_norm_scope = "full").
Gpt2Config tiny_hub_olmo2() {
  Gpt2Config c = tiny_hub_llama();
  c.norm_eps = 1e-6;
  c.qk_norm = true;
  c.qk_norm_full = true;
  c.post_norm = true;
  return c;
}

TEST(ImportOlmo2, TransformersSavedOlmo2GivesTransformersLogits) {
  expect_transformers_logits(LOOM_SOURCE_DIR "/tests/data/hf_tiny_olmo2", tiny_hub_olmo2());
}

TEST(ImportOlmo2, LoomsOwnExportIsOlmo2AndLoadsBackBitForBit) {
  const fs::path dir =
      fs::temp_directory_path() / ("loom_import_olmo2_" + std::to_string(getpid()));
  fs::remove_all(dir);
  const Gpt2Config c = tiny_hub_olmo2();
  Gpt2 model(c);
  model.build(DType::kF32, Device::cpu(), 5);
  for (int l = 0; l < 2; ++l)  // gains of their own value at every position (ones hide a swap)
    for (const char* norm : {"attn.q_norm", "attn.k_norm", "ln_1", "ln_2"}) {
      Tensor& g = model.params().get("blocks." + std::to_string(l) + "." + norm + ".weight").value;
      for (int64_t i = 0; i < g.numel(); ++i)
        g.data<float>()[i] = 1.0f + 0.01f * static_cast<float>(i + 100 * l + 200 * norm[0]);
    }
  const std::string ckpt = save_and_export_hf(model, dir, 2);
  const Gpt2Config saved = read_checkpoint_model(ckpt);
  EXPECT_TRUE(saved.post_norm);
  EXPECT_TRUE(saved.qk_norm_full);
  {  // a placement no Loom writes, in the shape no digest covers: named, not read as "pre"
    const fs::path state = fs::path(ckpt) / "state.json";
    std::ifstream in(state);
    nlohmann::json j = nlohmann::json::parse(in);
    in.close();
    const std::string good = j.dump(2);
    j["model"]["norm_placement"] = "peri";
    std::ofstream(state) << j.dump(2);
    const std::string e = testutil::error_of([&] { read_checkpoint_model(ckpt); });
    EXPECT_NE(e.find("state.json's model: qk_norm_scope = \"full\", norm_placement = "
                     "\"peri\" is not a model Loom builds"),
              std::string::npos)
        << e;
    std::ofstream(state) << good;
  }
  const SafetensorsFile f = load_safetensors((dir / "hf" / "model.safetensors").string());
  EXPECT_EQ(f.names.size(), 3u + 11u * 2u);  // embed_tokens, norm, lm_head; 7 weights, 4 norms
  EXPECT_EQ(f.tensors.count("model.layers.0.input_layernorm.weight"), 0u);
  EXPECT_EQ(f.tensors.at("model.layers.1.self_attn.q_norm.weight").shape(), (Shape{32}));
  EXPECT_EQ(f.tensors.at("model.layers.1.self_attn.k_norm.weight").shape(), (Shape{16}));
  // ln_1 after the attention, ln_2 after the MLP.
  EXPECT_EQ(f.tensors.at("model.layers.1.post_attention_layernorm.weight").data<float>()[3],
            model.params().get("blocks.1.ln_1.weight").value.data<float>()[3]);
  EXPECT_EQ(f.tensors.at("model.layers.1.post_feedforward_layernorm.weight").data<float>()[3],
            model.params().get("blocks.1.ln_2.weight").value.data<float>()[3]);
  std::ifstream cf(dir / "hf" / "config.json");
  const nlohmann::json j = nlohmann::json::parse(cf);
  EXPECT_EQ(j["architectures"][0], "Olmo2ForCausalLM");
  EXPECT_EQ(j["model_type"], "olmo2");
  EXPECT_FALSE(j.contains("head_dim"));
  EXPECT_FALSE(j["tie_word_embeddings"].get<bool>());
  expect_loads_back_bitwise(model, (dir / "hf").string());
  // Half of OLMo 2 is no class's: post-norms with Qwen 3's per-head norms.
  Gpt2Config half = c;
  half.qk_norm_full = false;
  Gpt2 half_model(half);
  half_model.build(DType::kF32, Device::cpu(), 5);
  const std::string error =
      testutil::error_of([&] { save_and_export_hf(half_model, dir / "half", 2); });
  EXPECT_NE(error.find("written as an Olmo2ForCausalLM, which has both"), std::string::npos)
      << error;
  fs::remove_all(dir);
}

// Gemma 3 (Gemma3ForCausalLM, tests/data/hf_tiny_gemma3): sandwich norms, GeGLU, per-head
// query/key norms, heads 16 wide, the embedding times √32, a window of 5 in blocks 0 and 1 turned
// by a base of 10 000, block 2 whole turned by 1e6, a tied head, every gain random (Gemma's w).
Gpt2Config tiny_hub_gemma3() {
  Gpt2Config c = tiny_hub_llama();
  c.n_layers = 3;
  c.head_width = 16;
  c.qk_norm = true;
  c.sandwich_norm = true;
  c.ffn_activation = GatedActivation::kGeluTanh;
  c.embedding_multiplier = static_cast<float>(std::sqrt(32.0));
  c.sliding_window = 5;
  c.full_attention_every = 3;
  c.rope_theta = 1e6;
  c.rope_local_theta = 10000;
  c.norm_eps = 1e-6;
  c.tie_embeddings = true;
  return c;
}

// Within 1e-5 of transformers' logits; without the embedding's scale, the windowed blocks' own
// rotary base or the gains' 1 + w they are off by 6, 1 and 4.7 (checked by breaking each).
TEST(ImportGemma3, TransformersSavedGemma3GivesTransformersLogits) {
  expect_transformers_logits(LOOM_SOURCE_DIR "/tests/data/hf_tiny_gemma3", tiny_hub_gemma3());
}

// A directory whose window or local rotary base is not the model's is refused, naming both.
TEST(ImportGemma3, AnotherWindowOrLocalBaseIsRefusedByName) {
  const std::string hub = LOOM_SOURCE_DIR "/tests/data/hf_tiny_gemma3";
  for (const char* part : {"rope_local_theta", "window"}) {
    SCOPED_TRACE(part);
    Gpt2Config c = tiny_hub_gemma3();
    if (std::string(part) == "window")
      c.sliding_window = 64;  // spans the 12 positions
    else
      c.rope_local_theta = 0;
    Gpt2 model(c);
    model.build(DType::kF32, Device::cpu(), 1);
    FlatModelState into = zero_state_for(model.params());
    const std::string error =
        testutil::error_of([&] { load_hf_weights(hub, model.params(), c, into); });
    EXPECT_NE(
        error.find(std::string(part) == "window"
                       ? "sliding_window = 5 but model.sliding_window = 64"
                       : "rope_local_base_freq = 10000 but the windowed blocks' base is 1e+06"),
        std::string::npos)
        << error;
  }
}

// Loom's Gemma 3 exports as transformers' Gemma3ForCausalLM (gains as Gemma's w = gain − 1,
// exact for gains of at least 1/2) and loads back bit for bit.
TEST(ImportGemma3, LoomsOwnExportIsGemma3AndLoadsBackBitForBit) {
  const fs::path dir =
      fs::temp_directory_path() / ("loom_import_gemma3_" + std::to_string(getpid()));
  fs::remove_all(dir);
  const Gpt2Config c = tiny_hub_gemma3();
  Gpt2 model(c);
  model.build(DType::kF32, Device::cpu(), 5);
  const char* const norms[] = {"attn.q_norm", "attn.k_norm",   "ln_1",
                               "ln_2",        "attn_out_norm", "mlp_out_norm"};
  for (int l = 0; l < 3; ++l)  // gains of their own value at every position (ones hide a swap)
    for (int k = 0; k < 6; ++k) {
      Tensor& g =
          model.params().get("blocks." + std::to_string(l) + "." + norms[k] + ".weight").value;
      for (int64_t i = 0; i < g.numel(); ++i)
        g.data<float>()[i] = 0.6f + 0.001f * static_cast<float>(i + 50 * l + 200 * k);
    }
  const std::string ckpt = save_and_export_hf(model, dir, 2);
  const Gpt2Config saved = read_checkpoint_model(ckpt);
  EXPECT_TRUE(saved.sandwich_norm);
  EXPECT_EQ(saved.ffn_activation, GatedActivation::kGeluTanh);
  EXPECT_EQ(saved.embedding_multiplier, c.embedding_multiplier);
  EXPECT_EQ(saved.rope_local_theta, 10000);
  const SafetensorsFile f = load_safetensors((dir / "hf" / "model.safetensors").string());
  EXPECT_EQ(f.names.size(), 2u + 13u * 3u);  // embed_tokens, norm; 7 weights, 6 gains a block
  EXPECT_EQ(f.tensors.at("model.layers.2.self_attn.q_norm.weight").shape(), (Shape{16}));
  EXPECT_EQ(f.tensors.at("model.layers.1.pre_feedforward_layernorm.weight").data<float>()[3],
            model.params().get("blocks.1.ln_2.weight").value.data<float>()[3] - 1.0f);
  EXPECT_EQ(f.tensors.at("model.layers.1.post_attention_layernorm.weight").data<float>()[3],
            model.params().get("blocks.1.attn_out_norm.weight").value.data<float>()[3] - 1.0f);
  std::ifstream cf(dir / "hf" / "config.json");
  const nlohmann::json j = nlohmann::json::parse(cf);
  EXPECT_EQ(j["architectures"][0], "Gemma3ForCausalLM");
  EXPECT_EQ(j["model_type"], "gemma3_text");
  EXPECT_EQ(j["sliding_window_pattern"], 3);
  EXPECT_EQ(j["layer_types"][2], "full_attention");
  EXPECT_EQ(j["rope_local_base_freq"], 10000.0);
  EXPECT_EQ(j["query_pre_attn_scalar"], 16);
  expect_loads_back_bitwise(model, (dir / "hf").string());
  fs::remove_all(dir);
}

// Gemma 3 4B+'s form (tests/data/hf_tiny_gemma3_mm): the text model inside a
// Gemma3ForConditionalGeneration (tensors under language_model., a vision tower beside them that
// Loom leaves; its settings under text_config) with linear rope scaling by 8 in its
// whole-sequence block and 27B's query_pre_attn_scalar apart from head_dim (24 for 16). Within
// 1e-5 of transformers' logits; scaling the windowed blocks too, or none of them, is off by 2.5
// and 0.6 (checked by breaking Gpt2Config::block and the factor; those figures from the fixture
// without the scalar), and without the scalar's factor on the queries by 0.65.
Gpt2Config tiny_hub_gemma3_4b() {
  Gpt2Config c = tiny_hub_gemma3();
  c.rope_scaling_factor = 8;
  c.rope_scaling_linear = true;
  c.query_pre_attn_scalar = 24;  // and 27B's scores' scale apart from head_dim (16)
  return c;
}

TEST(ImportGemma3, ConditionalGenerationsTextModelWithLinearRopeGivesTransformersLogits) {
  const std::string hub = LOOM_SOURCE_DIR "/tests/data/hf_tiny_gemma3_mm";
  expect_transformers_logits(hub, tiny_hub_gemma3_4b());
  // transformers 4.52 on name the text model model.language_model.* (and the head lm_head):
  // the same tensors so named give the same logits.
  const fs::path dir =
      fs::temp_directory_path() / ("loom_import_gemma3_mm_" + std::to_string(getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  for (const char* file : {"config.json", "loom_expected_logits.safetensors"})
    fs::copy_file(hub + "/" + file, dir / file);
  const SafetensorsFile f = load_safetensors(hub + "/model.safetensors");
  std::vector<std::pair<std::string, Tensor>> renamed;
  for (const std::string& name : f.names) {
    const std::string old_prefix = "language_model.model.";
    renamed.emplace_back(name.starts_with(old_prefix)
                             ? "model.language_model." + name.substr(old_prefix.size())
                             : name,
                         f.tensors.at(name));
  }
  ASSERT_EQ(renamed.front().first.substr(0, 21), "model.language_model.");
  save_safetensors((dir / "model.safetensors").string(), renamed);
  expect_transformers_logits(dir.string(), tiny_hub_gemma3_4b());
  fs::remove_all(dir);
}

// The directory's rope scaling must be the model's, both ways, named as text_config's.
TEST(ImportGemma3, ARopeScalingThatDiffersIsNamed) {
  const fs::path dir =
      fs::temp_directory_path() / ("loom_import_gemma3_rope_" + std::to_string(getpid()));
  const std::string mm = LOOM_SOURCE_DIR "/tests/data/hf_tiny_gemma3_mm";
  const auto same = [](nlohmann::json&) {};
  Gpt2Config unscaled = tiny_hub_gemma3_4b();
  unscaled.rope_scaling_factor = 0;
  unscaled.rope_scaling_linear = false;
  EXPECT_NE(import_error(mm, dir, same, unscaled)
                .find("config.json: text_config: rope_scaling = {\"factor\":8.0,\"rope_type\":"
                      "\"linear\"} but the model's is null (model.rope_scaling = \"none\""),
            std::string::npos)
      << import_error(mm, dir, same, unscaled);
  // The scores' scale likewise.
  Gpt2Config plain = tiny_hub_gemma3_4b();
  plain.query_pre_attn_scalar = 0;
  EXPECT_NE(import_error(mm, dir, same, plain)
                .find("text_config: query_pre_attn_scalar = 24 but model.head_dim "
                      "(model.query_pre_attn_scalar unset) = 16"),
            std::string::npos)
      << import_error(mm, dir, same, plain);
  Gpt2Config twice = tiny_hub_gemma3_4b();
  twice.rope_scaling_factor = 16;
  EXPECT_NE(import_error(mm, dir, same, twice).find("but the model's is {\"factor\":16.0"),
            std::string::npos);
  Gpt2Config linear = tiny_hub_gemma3();
  linear.rope_scaling_factor = 8;
  linear.rope_scaling_linear = true;
  EXPECT_NE(import_error(LOOM_SOURCE_DIR "/tests/data/hf_tiny_gemma3", dir, same, linear)
                .find("config.json: rope_scaling is null but model.rope_scaling = \"linear\""),
            std::string::npos);
  EXPECT_NE(import_error(
                mm, dir,
                [](nlohmann::json& j) { j["text_config"]["rope_scaling"]["rope_type"] = "yarn"; },
                tiny_hub_gemma3_4b())
                .find("Loom builds Llama 3.1's \"llama3\" frequency scaling and \"linear\" "
                      "(model.rope_scaling), not \"yarn\""),
            std::string::npos);
  EXPECT_NE(import_error(
                mm, dir, [](nlohmann::json& j) { j["text_config"]["head_dim"] = 8; },
                tiny_hub_gemma3_4b())
                .find("config.json: text_config: head_dim = 8 but model.head_dim = 16"),
            std::string::npos);
  // Llama 3.1's scaling is no Gemma's.
  Gpt2Config llama3 = tiny_hub_gemma3_4b();
  llama3.rope_scaling_linear = false;
  EXPECT_NE(import_error(mm, dir, same, llama3)
                .find("model_type = gemma3, but the model has Llama 3.1's rope scaling"),
            std::string::npos);
  fs::remove_all(dir);
}

// A Gemma 3 with linear scaling exports it in config.json, its checkpoint keeps it, and the
// export loads back bit for bit; a Llama likewise ("linear" is LlamaConfig's too).
TEST(ExportHf, LinearRopeScalingIsWrittenAndReadBack) {
  const fs::path dir =
      fs::temp_directory_path() / ("loom_export_linear_rope_" + std::to_string(getpid()));
  Gpt2Config llama = tiny_hub_llama();
  llama.rope_scaling_factor = 4;
  llama.rope_scaling_linear = true;
  for (const Gpt2Config& c : {tiny_hub_gemma3_4b(), llama}) {
    SCOPED_TRACE(c.sandwich_norm ? "gemma3" : "llama");
    fs::remove_all(dir);
    Gpt2 model(c);
    model.build(DType::kF32, Device::cpu(), 5);
    const std::string ckpt = save_and_export_hf(model, dir, 2);
    const Gpt2Config saved = read_checkpoint_model(ckpt);
    EXPECT_TRUE(saved.rope_scaling_linear);
    EXPECT_EQ(saved.rope_scaling_factor, c.rope_scaling_factor);
    std::ifstream cf(dir / "hf" / "config.json");
    const nlohmann::json j = nlohmann::json::parse(cf);
    EXPECT_EQ(j["rope_scaling"],
              (nlohmann::json{{"rope_type", "linear"}, {"factor", c.rope_scaling_factor}}));
    if (c.sandwich_norm) {  // and Gemma's scores' scale
      EXPECT_EQ(saved.query_pre_attn_scalar, 24);
      EXPECT_EQ(j["query_pre_attn_scalar"], 24);
    }
    expect_loads_back_bitwise(model, (dir / "hf").string());
  }
  // The scale is Gemma's alone: a Llama with it is no class's but Gemma 3's.
  llama.query_pre_attn_scalar = 24;
  llama.qk_norm = true;
  Gpt2 model(llama);
  model.build(DType::kF32, Device::cpu(), 5);
  const std::string error = testutil::error_of([&] { save_and_export_hf(model, dir / "q", 2); });
  EXPECT_NE(error.find("is written as a Gemma3ForCausalLM, which this one is not: no sandwich"),
            std::string::npos)
      << error;
  fs::remove_all(dir);
}

// Gemma's parts apart from the rest of Gemma 3 are no class's that Loom writes or reads: both
// ways refused by name (sandwich norms without GeGLU; GeGLU alone); the checkpoints say what they
// hold.
TEST(ExportHf, SandwichNormsAndGeGluAreRefusedBothWays) {
  const fs::path dir =
      fs::temp_directory_path() / ("loom_export_sandwich_" + std::to_string(getpid()));
  Gpt2Config c = tiny_hub_llama();
  c.sandwich_norm = true;
  Gpt2 model(c);
  model.build(DType::kF32, Device::cpu(), 5);
  const std::string error = testutil::error_of([&] { save_and_export_hf(model, dir / "out", 2); });
  EXPECT_NE(error.find("is written as a Gemma3ForCausalLM, which this one is not: no GeGLU"),
            std::string::npos)
      << error;
  EXPECT_FALSE(fs::exists(dir / "out" / "hf"));
  // The checkpoint itself says what it holds.
  TrainingState st;
  st.step = 1;
  const std::string ckpt = save_checkpoint((dir / "checkpoints").string(), model, nullptr, st);
  EXPECT_TRUE(read_checkpoint_model(ckpt).sandwich_norm);
  EXPECT_FALSE(read_checkpoint_model(ckpt).post_norm);
  EXPECT_NE(import_error(
                LOOM_SOURCE_DIR "/tests/data/hf_tiny_llama", dir, [](nlohmann::json&) {}, c)
                .find("model_type = llama, but the model has Gemma's parts"),
            std::string::npos);
  // GeGLU likewise.
  Gpt2Config geglu = tiny_hub_llama();
  geglu.ffn_activation = GatedActivation::kGeluTanh;
  Gpt2 geglu_model(geglu);
  geglu_model.build(DType::kF32, Device::cpu(), 5);
  const std::string geglu_error =
      testutil::error_of([&] { save_and_export_hf(geglu_model, dir / "geglu", 2); });
  EXPECT_NE(geglu_error.find("which this one is not: no sandwich norms"), std::string::npos)
      << geglu_error;
  EXPECT_EQ(
      read_checkpoint_model((dir / "geglu" / "checkpoints" / "step_2").string()).ffn_activation,
      GatedActivation::kGeluTanh);
  EXPECT_NE(import_error(
                LOOM_SOURCE_DIR "/tests/data/hf_tiny_llama", dir, [](nlohmann::json&) {}, geglu)
                .find("starts from a Gemma3ForCausalLM directory"),
            std::string::npos);
  fs::remove_all(dir);
}

TEST(ImportOlmo2, AnOlmo2WantsItsNormsAndOnlyAnOlmo2HasThem) {
  const fs::path dir =
      fs::temp_directory_path() / ("loom_import_olmo2_bad_" + std::to_string(getpid()));
  const std::string olmo2 = LOOM_SOURCE_DIR "/tests/data/hf_tiny_olmo2";
  const auto same = [](nlohmann::json&) {};
  Gpt2Config pre = tiny_hub_olmo2();
  pre.post_norm = false;
  EXPECT_NE(import_error(olmo2, dir, same, pre)
                .find("model_type = olmo2: an Olmo2ForCausalLM needs model.norm_placement = "
                      "\"post\", model.qk_norm = true and model.qk_norm_scope = \"full\""),
            std::string::npos);
  EXPECT_NE(import_error(LOOM_SOURCE_DIR "/tests/data/hf_tiny_llama", dir, same, tiny_hub_olmo2())
                .find("model_type = llama, but model.norm_placement = \"post\" with "
                      "model.qk_norm_scope = \"full\" starts from an Olmo2ForCausalLM"),
            std::string::npos);
  EXPECT_EQ(import_error(olmo2, dir, same, tiny_hub_olmo2()), "no error");
  fs::remove_all(dir);
}

TEST(ImportMistral, TransformersSavedMistralWithAWindowGivesTransformersLogits) {
  expect_transformers_logits(LOOM_SOURCE_DIR "/tests/data/hf_tiny_mistral", tiny_hub_mistral());
}

TEST(ImportMistral, LoomsOwnWindowedExportsAreMistralAndQwenAndLoadBackBitForBit) {
  const fs::path dir =
      fs::temp_directory_path() / ("loom_import_mistral_" + std::to_string(getpid()));
  fs::remove_all(dir);
  for (const int kind : {0, 1, 2}) {  // a Llama, a Qwen 2, a Qwen 3 with the window
    SCOPED_TRACE(kind);
    Gpt2Config c = kind == 0 ? tiny_hub_mistral() : kind == 1 ? tiny_hub_qwen2() : tiny_hub_qwen3();
    c.sliding_window = 5;
    Gpt2 model(c);
    model.build(DType::kF32, Device::cpu(), 5);
    const std::string ckpt = save_and_export_hf(model, dir, 2);
    EXPECT_EQ(read_checkpoint_model(ckpt).sliding_window, 5);
    std::ifstream cf(dir / "hf" / "config.json");
    const nlohmann::json j = nlohmann::json::parse(cf);
    EXPECT_EQ(j["model_type"], kind == 0 ? "mistral" : kind == 1 ? "qwen2" : "qwen3");
    EXPECT_EQ(j["sliding_window"], 5);
    if (kind > 0) {
      EXPECT_TRUE(j["use_sliding_window"].get<bool>());
      EXPECT_EQ(j["max_window_layers"], 0);
    }
    expect_loads_back_bitwise(model, (dir / "hf").string());
    fs::remove_all(dir);
  }
}

TEST(ImportMistral, OtherWindowsNoneAndLaterBlocksOnlyAreNamed) {
  const fs::path dir =
      fs::temp_directory_path() / ("loom_import_mistral_bad_" + std::to_string(getpid()));
  const std::string mistral = LOOM_SOURCE_DIR "/tests/data/hf_tiny_mistral";
  const std::string llama = LOOM_SOURCE_DIR "/tests/data/hf_tiny_llama";
  const std::string qwen2 = LOOM_SOURCE_DIR "/tests/data/hf_tiny_qwen2";
  const auto same = [](nlohmann::json&) {};
  EXPECT_NE(import_error(mistral, dir, same, tiny_hub_llama())
                .find("sliding_window = 5 is below model.max_seq_len = 64: set "
                      "model.sliding_window = 5"),
            std::string::npos);
  Gpt2Config wider = tiny_hub_mistral();
  wider.sliding_window = 6;
  EXPECT_NE(import_error(mistral, dir, same, wider)
                .find("sliding_window = 5 but model.sliding_window = 6"),
            std::string::npos);
  EXPECT_NE(import_error(llama, dir, same, tiny_hub_mistral())
                .find("sliding_window = none but model.sliding_window = 5"),
            std::string::npos);
  Gpt2Config windowed_qwen2 = tiny_hub_qwen2();
  windowed_qwen2.sliding_window = 5;
  const auto later_blocks = [](nlohmann::json& j) {
    j["use_sliding_window"] = true;
    j["sliding_window"] = 5;
    j["max_window_layers"] = 1;
  };
  EXPECT_NE(import_error(qwen2, dir, later_blocks, windowed_qwen2)
                .find("max_window_layers = 1: a window in blocks 1 on only"),
            std::string::npos);
  const auto every_block = [](nlohmann::json& j) {
    j["use_sliding_window"] = true;
    j["sliding_window"] = 5;
    j["max_window_layers"] = 0;
  };
  EXPECT_EQ(import_error(qwen2, dir, every_block, windowed_qwen2), "no error");
  // A window spanning every sequence is none: read by a model without one, and the other way.
  Gpt2Config spanning = tiny_hub_llama();
  spanning.sliding_window = 64;
  EXPECT_EQ(import_error(llama, dir, same, spanning), "no error");
  EXPECT_EQ(import_error(mistral, dir, same, tiny_hub_mistral()), "no error");
  // A window in some blocks only (model.full_attention_every) is no directory's, either way.
  Gpt2Config alternating = tiny_hub_mistral();
  alternating.full_attention_every = 2;
  EXPECT_NE(import_error(mistral, dir, same, alternating)
                .find("model.full_attention_every = 2 windows some blocks only"),
            std::string::npos);
  Gpt2 model(alternating);
  model.build(DType::kF32, Device::cpu(), 5);
  const std::string error = testutil::error_of([&] { save_and_export_hf(model, dir, 2); });
  EXPECT_NE(error.find("a window in some blocks only (model.full_attention_every = 2)"),
            std::string::npos)
      << error;
  EXPECT_FALSE(fs::exists(dir / "hf"));
  fs::remove_all(dir);
}

}  // namespace loom
