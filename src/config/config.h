// Config — the training run's settings, read from a TOML file and `--set section.key=value`.
//
// Flow: load_config(path) (or parse_config(text)) → apply_override(...) for each --set →
// validate(config) → to_toml(config) saved into the run directory. Parsing checks names and
// types only (so an override can still fix a value); validate() checks the values and how they
// fit together, and reports every violation at once.
//
// Every key lives in one table in config.cc ({dotted name, field}); parsing, overrides, to_toml
// and the "did you mean" hint all read that table, so adding a key is one line there plus the
// member below. Defaults describe a tiny GPT-2 that trains on a laptop CPU in minutes.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace loom {

// The largest model sizes Loom builds: far past today's largest dense models (Llama 3.1 405B:
// vocabulary 128256, d_model 16384, 126 layers, SwiGLU width 53248), and small enough that every
// count derived from them (parameters, flops per token, buffer sizes) fits an int64_t. A token id
// is an int32_t wherever it is read.
struct ModelLimits {
  static constexpr int64_t kVocabSize = int64_t{1} << 31;
  static constexpr int64_t kSeqLen = int64_t{1} << 24;  // also max_seq_len
  static constexpr int64_t kDModel = int64_t{1} << 17;
  static constexpr int64_t kLayers = int64_t{1} << 14;
  static constexpr int64_t kFfnHidden = int64_t{1} << 20;
  static constexpr int64_t kHeadDim = 1024;              // model.head_dim (today's: 64 to 256)
  static constexpr int64_t kExperts = int64_t{1} << 10;  // DeepSeek-V3: 256 routed experts
  // Expert groups of group-limited routing (DeepSeek-V3: 8); the GPU's routing keeps the chosen
  // groups in a 64-bit mask (kernels/cuda/moe.cu).
  static constexpr int64_t kExpertGroups = 64;
};

struct ModelConfig {
  // "gpt2" (learned positions, LayerNorm, GELU MLP, biases) or "llama" (rotary positions,
  // RMSNorm, SwiGLU MLP, no biases, grouped-query attention): models/gpt2.h
  std::string arch = "gpt2";
  int64_t vocab_size = 50257;  // GPT-2 BPE vocabulary
  int64_t seq_len = 256;       // tokens per training sequence
  int64_t d_model = 128;       // channels
  int64_t n_layers = 4;        // transformer blocks
  int64_t n_heads = 4;         // attention heads; must divide d_model
  int64_t max_seq_len = 0;     // rows of the position embedding; 0 = same as seq_len
  double init_std = 0.02;      // std of the normal init (GPT-2)
  // false: the LM head has its own weight (lm_head.weight, as Llama 2/3 7B-70B) instead of
  // sharing the token embedding's (GPT-2, Llama 3.2 1B/3B).
  bool tie_embeddings = true;
  // arch = "llama" only (an error under "gpt2" when changed):
  int64_t n_kv_heads = 0;      // key/value heads (grouped-query attention); 0 = n_heads
  // Biases on the attention's query, key and value projections (Qwen 2 / 2.5's; Megatron-LM's
  // --add-qkv-bias); the output projection and the MLP stay without.
  bool qkv_bias = false;
  // Each attention head's width; 0 = d_model / n_heads. Set, n_heads · head_dim may differ from
  // d_model (Qwen 3's 128-wide heads, Mistral Nemo's; Megatron-LM's --kv-channels): qkv maps
  // d_model to (n_heads + 2·n_kv_heads)·head_dim and the output projection n_heads·head_dim back.
  int64_t head_dim = 0;
  // RMSNorm of each query and key head before the rotation (Qwen 3's, OLMo 2's per-head form;
  // Megatron-LM's --qk-layernorm): two head_dim-wide weights per block, shared by the heads.
  bool qk_norm = false;
  // What qk_norm normalises: "head", each query and key head over its head_dim values (Qwen 3);
  // "full", all the query heads together and all the key heads together (OLMo 2's q_norm and
  // k_norm: n_heads·head_dim- and n_kv_heads·head_dim-wide weights).
  std::string qk_norm_scope = "head";
  // The attention's scores scaled by 1/√query_pre_attn_scalar instead of 1/√head_dim (Gemma's
  // key: Gemma 3 27B's 168 with heads of 128); 0: head_dim. Applied to the query norm's output
  // (qk_norm = true), so the attention kernels keep their one scale.
  int64_t query_pre_attn_scalar = 0;
  // Where a block's two RMSNorms sit: "pre", on the inputs of the attention and the MLP (x +
  // attn(norm(x)), Llama's); "post", on their outputs before the skip connection adds them
  // (x + norm(attn(x)), OLMo 2's reordered norms); "sandwich", both (x + norm(attn(norm(x))),
  // Gemma 2 / 3's four norms a block).
  std::string norm_placement = "pre";
  // The gated MLP's gate activation: "silu", Llama's SwiGLU; "gelu_tanh", the tanh-approximated
  // GELU (Gemma's GeGLU, transformers' "gelu_pytorch_tanh"). Dense MLPs only.
  std::string ffn_activation = "silu";
  // The token embedding's rows times this as they enter the blocks (Gemma's √d_model, Granite's
  // embedding_multiplier); the tied LM head reads the rows unscaled.
  double embedding_multiplier = 1.0;
  // The windowed blocks' rotary base, unscaled (Gemma 3's rope_local_base_freq: its
  // sliding-window blocks turn by 10 000, its full-attention ones by rope_theta); 0: rope_theta.
  double rope_local_theta = 0;
  // Sliding-window attention (Mistral 7B v0.1's; nn/sliding_window.h): each query attends to the
  // sliding_window latest positions, itself included, in every block; 0: the whole sequence.
  int64_t sliding_window = 0;
  // With a window: blocks N, 2N, 3N, … (counted from 1) attend to the whole past, the others
  // through the window (Gemma 3's 5 local to 1 global: 6; GPT-OSS's alternation: 2; Megatron-LM's
  // --window-attn-skip-freq); 0: every block windowed.
  int64_t full_attention_every = 0;
  int64_t ffn_hidden = 0;      // SwiGLU hidden width; 0 = Llama's rule, 8·d_model/3 rounded up to 256
  double rope_theta = 10000;   // base of the rotary position embedding's frequencies
  // "none", "llama3": Llama 3.1's long-context scaling of the rotary frequencies
  // (kernels/cpu/rope.h), with its factor, frequency factors and original context, or "linear":
  // every frequency divided by the factor (position interpolation; with model.rope_local_theta,
  // Gemma 3 4B+'s, in the whole-sequence blocks only)
  std::string rope_scaling = "none";
  double rope_scaling_factor = 8;
  double rope_low_freq_factor = 1;
  double rope_high_freq_factor = 4;
  int64_t rope_original_max_seq_len = 8192;
  double norm_eps = 1e-5;      // RMSNorm's epsilon
  // Mixture of experts (Mixtral, Shazeer et al. 2017): each block's SwiGLU MLP becomes
  // moe_experts of them (each ffn_hidden wide) behind a router sending every token to its
  // moe_top_k best (nn/moe_mlp.h); 0: the dense MLP. moe_aux_loss_coef weighs the per-sequence
  // load-balancing loss added to the training loss (DeepSeek-V3's sequence-wise balance loss).
  int64_t moe_experts = 0;
  int64_t moe_top_k = 2;
  double moe_aux_loss_coef = 0.01;
  // ST-MoE's router z-loss: moe_router_z_loss_coef × the mean over tokens of (log Σ exp of the
  // router's logits)², in every block (Megatron-LM's --moe-z-loss-coeff; ST-MoE used 1e-3). 0:
  // none.
  double moe_router_z_loss_coef = 0;
  // Shared experts (DeepSeekMoE, Qwen-MoE): one SwiGLU moe_shared_experts × ffn_hidden wide
  // through which every token goes besides its routed experts, its output added. 0: none.
  int64_t moe_shared_experts = 0;
  // Auxiliary-loss-free balancing (DeepSeek-V3; Megatron-LM's --moe-router-bias-update-rate):
  // each block keeps a bias per expert, added to the router's probabilities where a token's top k
  // are chosen (not to their weights); after every applied step each bias moves by this rate
  // towards balance — up where its expert had fewer than the mean of the step's tokens, down
  // where more (nn/moe_mlp.h). 0: no biases. Checkpoints keep them.
  double moe_bias_update_rate = 0;
  // Expert capacity (GShard, Switch; Megatron-LM's --moe-expert-capacity-factor): each expert
  // takes at most ceil(moe_capacity_factor · T · moe_top_k / moe_experts) of a T-token
  // sequence's choices, and drops the rest — those with the lowest routing weights
  // (moe_token_drop_policy = "probs") or the latest positions ("position"); nn/moe_capacity.h.
  // Per sequence, so the same under every layout. 0: dropless (every choice taken).
  double moe_capacity_factor = 0;
  std::string moe_token_drop_policy = "probs";
  // The router's scores (Megatron-LM's --moe-router-score-function): "softmax" over the experts
  // (Mixtral's), or "sigmoid" of each logit on its own (DeepSeek-V3's affinities; the chosen
  // ones' weights are their scores over their sum). nn/moe_mlp.h.
  std::string moe_router_score_function = "softmax";
  // Group-limited routing (DeepSeek-V3's node-limited routing; Megatron-LM's
  // --moe-router-num-groups / --moe-router-group-topk): the experts in moe_router_num_groups
  // contiguous groups, each token's top k taken from the experts of its best
  // moe_router_group_topk groups (a group scored by the sum of its best top_k / group_topk
  // scores). 0: none. With expert parallelism, groups of whole ranks' experts bound the ranks a
  // token reaches.
  int64_t moe_router_num_groups = 0;
  int64_t moe_router_group_topk = 0;
  // The routing weights' factor (DeepSeek-V3's routed_scaling_factor, 2.5; Megatron-LM's
  // --moe-router-topk-scaling-factor): w_j = factor · p_j / Σ_chosen p.
  double moe_router_topk_scaling_factor = 1;
  // false: the chosen experts' scores weigh their outputs as they are, not normalised over the k
  // (transformers' norm_topk_prob = false: Qwen1.5/2-MoE, DeepSeek-V2, OLMoE; Megatron-LM's
  // --moe-router-pre-softmax with softmax scores): w_j = factor · p_j.
  bool moe_router_norm_topk_prob = true;

  // max_seq_len with the 0 = "same as seq_len" default resolved.
  int64_t resolved_max_seq_len() const { return max_seq_len > 0 ? max_seq_len : seq_len; }
  // n_kv_heads with 0 = "n_heads" resolved (GPT-2: n_heads).
  int64_t resolved_n_kv_heads() const { return arch == "llama" && n_kv_heads > 0 ? n_kv_heads : n_heads; }
  // head_dim with 0 = "d_model / n_heads" resolved (GPT-2: always that).
  int64_t resolved_head_dim() const {
    return arch == "llama" && head_dim > 0 ? head_dim : n_heads > 0 ? d_model / n_heads : 0;
  }
  // The MLP's hidden width: GPT-2 4·d_model; Llama ffn_hidden, or with 0 Llama's rule (its
  // reference code's multiple_of = 256): 8·d_model/3 rounded up to a multiple of 256.
  int64_t resolved_ffn_hidden() const {
    if (arch != "llama") return 4 * d_model;
    if (ffn_hidden > 0) return ffn_hidden;
    return (8 * d_model / 3 + 255) / 256 * 256;
  }
  friend bool operator==(const ModelConfig&, const ModelConfig&) = default;
};

struct DataConfig {
  std::string train;  // token shards: a file, a directory or a glob; required by the data layer
  std::string val;    // same forms; empty = no evaluation
  // Several training corpora mixed by weight, Megatron-LM's --data-path: "W1 SPEC1 W2 SPEC2 ..."
  // or "SPEC1 SPEC2 ..." (shares by token count); each SPEC one of data.train's forms. Set this
  // or `train`, not both (parse_data_blend, data/blend.h).
  std::string blend;
  // Each epoch of a corpus in another order: its shards' and each shard's sequences' orders
  // permuted by train.seed and the epoch (data/sequence_reader.h). Off: llm.c's sequential order.
  bool shuffle = false;
  // More validation corpora, each evaluated and reported on its own: "NAME=SPEC NAME=SPEC ..."
  // (parse_val_sets), beside `val`'s val_loss.
  std::string val_sets;
  // Document masking: each token attends only to its own document's earlier tokens, documents
  // ending at each `eot_token` (block-causal attention, Llama 3's pretraining; data/documents.h).
  // Off: causal attention over the whole sequence, llm.c's and GPT-2's.
  bool document_mask = false;
  int64_t eot_token = 50256;  // GPT-2's <|endoftext|>, as llm.c's shards separate documents
  // No loss where the input is `eot_token` (Megatron-LM's --eod-mask-loss): the prediction of
  // the next document's first token; the loss is the mean over the targets left (training and
  // validation alike). Independent of document_mask.
  bool eod_mask_loss = false;
  // Positions restart at each document (Megatron-LM's --reset-position-ids): a learned position
  // table's row for a token is its place in its document, so a document reads the rows it would
  // at the start of a sequence (nn/embedding.h). Needs document_mask (a token that attends
  // across the boundary would see two documents at the same positions). Rotary positions
  // (Llama) are relative: under the mask they are already the same, and nothing changes.
  bool reset_position_ids = false;
  // Loss masks (supervised fine-tuning: no loss on the prompt): each shard with a SHARD.mask file
  // beside it (data/shard.h, docs/formats.md) has the targets whose entry is 0 taken out of the
  // loss; shards without one count every target. The loss is the mean over the targets left, as
  // with eod_mask_loss (the two combine); validation shards' masks apply too.
  bool loss_mask = false;
  // The seed of data.shuffle's orders; -1: train.seed's (Megatron-LM's one --seed). Set it to
  // sweep train.seed (the initialisation) over the same data order, as transformers' data_seed.
  int64_t seed = -1;
  // The seed the shuffled orders are drawn from: `seed`, or train_seed where it is -1.
  int64_t order_seed(int64_t train_seed) const { return seed >= 0 ? seed : train_seed; }
  friend bool operator==(const DataConfig&, const DataConfig&) = default;
};

// One source of data.blend.
struct BlendSource {
  double weight = 0;  // > 0, as written (not normalised); 0 in every source: by token count
  std::string spec;   // a shard file, directory or glob, as data.train
  friend bool operator==(const BlendSource&, const BlendSource&) = default;
};

// Splits data.blend's text at whitespace. When its first word is a number the words are
// weight / spec pairs, every weight finite and positive; otherwise every word is a spec and the
// weights are left 0 (the loader shares by token count). Throws loom::Error naming data.blend for
// an empty text, an odd number of words, a weight that is not a positive number, or a spec where
// a weight should be. Paths with whitespace cannot be named here (as in Megatron-LM).
std::vector<BlendSource> parse_data_blend(const std::string& text);

// One corpus of data.val_sets.
struct ValSet {
  std::string name;  // letters, digits, '_' and '-': a metrics field's key
  std::string spec;  // a shard file, directory or glob, as data.val
  friend bool operator==(const ValSet&, const ValSet&) = default;
};

// Splits data.val_sets' text at whitespace into NAME=SPEC words. Throws loom::Error naming
// data.val_sets and the word for an empty text, a word without '=', an empty or ill-formed name,
// an empty spec, or a name given twice.
std::vector<ValSet> parse_val_sets(const std::string& text);

// train.batch_rampup's three numbers.
struct BatchRampup {
  int64_t start = 0, increment = 0, samples = 0;
};
// Nothing for an empty text; throws loom::Error naming train.batch_rampup for anything but three
// positive whole numbers.
std::optional<BatchRampup> parse_batch_rampup(const std::string& text);

struct TrainConfig {
  int64_t steps = 1000;          // optimizer steps
  int64_t batch_size = 8;        // global batch, in sequences, per optimizer step
  int64_t micro_batch_size = 8;  // sequences per forward/backward on one data-parallel rank
  // Batch-size ramp-up, Megatron-LM's --rampup-batch-size: "START INCREMENT SAMPLES" — the global
  // batch starts at START sequences and grows by INCREMENT in (batch_size - START) / INCREMENT
  // equal steps over the run's first SAMPLES sequences (parse_batch_rampup, batch_size_at).
  // Empty: batch_size from the first step. The learning-rate schedule stays by steps.
  std::string batch_rampup;
  // The global batch of the step that begins after `consumed` sequences: batch_size, or during
  // the ramp-up its batch then. And the sequences the steps before `step` read.
  int64_t batch_size_at(int64_t consumed) const;
  int64_t samples_before(int64_t step) const;
  double lr = 6e-4;              // peak learning rate
  int64_t warmup_steps = 100;    // linear warmup from 0 to lr, then lr_schedule's decay
  // After warm-up: "cosine" or "linear" decay to lr * min_lr_ratio at `steps`, "constant", or
  // "wsd" (warmup-stable-decay: lr until the last lr_decay_fraction of the steps, then a linear
  // decay to lr * min_lr_ratio at `steps`).
  std::string lr_schedule = "cosine";
  double min_lr_ratio = 0.1;
  double lr_decay_fraction = 0.2;  // wsd: the share of `steps` that decays
  // A HuggingFace GPT-2 directory (config.json + model.safetensors) whose weights a fresh run
  // starts from instead of the random initialisation (fine-tuning); "" = none. A resumed run
  // takes its checkpoint's weights instead.
  std::string init_from;
  double weight_decay = 0.1;     // AdamW decoupled weight decay (matrices only)
  double beta1 = 0.9;            // AdamW
  double beta2 = 0.95;           // AdamW
  double eps = 1e-8;             // AdamW
  double grad_clip = 1.0;        // global gradient-norm clip; 0 = off
  // PaLM's auxiliary z-loss: z_loss · (log Σ exp logits)² added to each position's loss, keeping
  // the softmax's normaliser near 1 (logit drift is a source of instability); PaLM and OLMo 2
  // use 1e-4. In the gradient only: the reported loss stays the cross-entropy. 0 = off.
  double z_loss = 0;
  // Loss scaling (optim/loss_scaler.h): auto (dynamic under fp16 GEMMs, else none), none,
  // static or dynamic; the first scale, the good steps before a dynamic scale doubles, and the
  // floor it never halves below. Scales are powers of two in [1, 2^64].
  std::string loss_scale = "auto";
  double loss_scale_init = 65536;
  int64_t loss_scale_window = 1000;
  double loss_scale_min = 1;
  int64_t seed = 1337;           // parameter init, and data order unless data.seed; >= 0
  int64_t eval_every = 100;      // steps between evaluations; 0 = never
  int64_t eval_batches = 8;      // validation micro-batches per evaluation
  int64_t save_every = 500;      // steps between checkpoints; 0 = never
  int64_t keep_checkpoints = 0;  // the newest complete checkpoints kept after a save; 0 = all
  // Checkpoint files written by a thread while training goes on (train/async_checkpoint.h).
  bool async_checkpoint = false;
  // "whole": one file set, assembled on one rank; "sharded": every rank writes what it owns
  std::string checkpoint_format = "whole";
  int64_t log_every = 1;         // steps between log lines
  // Deprecated alias of parallel.recompute = "full" (Config::resolved_recompute()).
  bool recompute = false;
  friend bool operator==(const TrainConfig&, const TrainConfig&) = default;
};

// parallel.schedule's values (docs/pipeline_schedules.md), in the order messages list them.
inline constexpr std::string_view kPipelineSchedules[] = {"gpipe", "1f1b",           "interleaved",
                                                          "zb-h1", "zb-interleaved", "zb-v"};
inline bool is_pipeline_schedule(std::string_view schedule) {
  for (std::string_view s : kPipelineSchedules)
    if (s == schedule) return true;
  return false;
}
// Whether a schedule cuts each pipeline rank's part into parallel.virtual_stages chunks (zb-v:
// exactly two, in a V).
inline bool schedule_takes_chunks(std::string_view schedule) {
  return schedule == "interleaved" || schedule == "zb-interleaved" || schedule == "zb-v";
}
// Whether a schedule takes the micro-batches of a step in groups of parallel.pp (interleaved's).
inline bool schedule_takes_groups_of_pp(std::string_view schedule) {
  return schedule == "interleaved" || schedule == "zb-interleaved";
}

struct ParallelConfig {
  // Degrees; 0 (the default) = left out, inferred from the world size (resolve_parallel_degrees).
  int dp = 0;                     // data-parallel degree
  int tp = 0;                     // tensor-parallel degree
  int pp = 0;                     // pipeline-parallel degree
  int cp = 1;                     // context-parallel degree: ranks splitting each sequence
  // how cp exchanges keys and values: "all_gather" (one collective each way, the whole
  // sequence's keys and values held) or "ring" (blocks passed round, overlapped with the
  // attention; only the rank's own held; CPU ranks): parallel/context_parallel.h
  std::string cp_comm = "all_gather";
  // expert-parallel degree: a mixture's experts split over groups of ep data-parallel ranks
  // (parallel/expert_parallel.h); divides dp, not a factor of the world size
  int ep = 1;
  // how tokens reach the experts under ep: "all_gather" (the group's tokens gathered to every
  // rank, outputs reduce-scattered) or "all_to_all" (each token's rows sent to its experts' ranks
  // only, padded to equal blocks)
  std::string ep_dispatch = "all_gather";
  int zero = 0;                   // ZeRO stage 0..3 over the dp axis
  // hybrid sharding (HSDP, torchtitan's data_parallel_shard_degree, DeepSpeed's MiCS): ZeRO's
  // state sharded over groups of dp_shard dp ranks, replicated over the dp / dp_shard groups;
  // 0 = over the whole dp axis (parallel/data_parallel.h)
  int dp_shard = 0;
  // dp_shard set and below dp: the state is sharded over part of dp, replicated over the rest.
  bool hybrid_sharding() const { return dp_shard > 0 && dp_shard < dp; }
  double bucket_mb = 25;          // gradient all-reduce bucket size in MiB (PyTorch DDP's 25)
  std::string grad_reduce_dtype = "fp32";  // "fp32" or "bf16": what dp reduces gradients in
  std::string param_gather_dtype = "fp32";  // "fp32" or "bf16": what ZeRO-3 gathers weights in
  std::string pp_send_dtype = "fp32";  // "fp32" or "bf16": what pipeline stages send
  std::string schedule = "1f1b";  // pipeline schedule: one of kPipelineSchedules
  int virtual_stages = 1;         // model chunks per pipeline rank (schedule_takes_chunks)
  std::string layer_split;        // blocks per pipeline stage, "3,3,2"; "" = balance by cost
  bool sequence_parallel = false; // split LayerNorm/residual activations by tokens over tp
  // tp layers compute their weight gradients while their input gradient's all-reduce (or
  // reduce-scatter) is in flight (parallel/tp_backward_overlap.h): "on", "off", or "auto" — on
  // GPUs, off on CPU ranks (whose cores the reduction would take from the GEMM: no gain there)
  std::string tp_backward_overlap = "auto";
  // activation recomputation per block: none, full or selective (models/gpt2.h: Recompute)
  std::string recompute = "none";
  friend bool operator==(const ParallelConfig&, const ParallelConfig&) = default;
};

struct RuntimeConfig {
  int ranks = 1;                  // processes/threads in the job; must equal dp × tp × pp × cp
  // communication: auto (mpi when started by mpirun/srun, else local), local (thread ranks),
  // mpi or nccl
  std::string backend = "auto";
  std::string device = "cpu";     // cpu or cuda[:N]
  // GEMM inputs: fp32, tf32, bf16, fp16 or fp8 (docs/config.md). On a GPU at bf16 / fp16 the
  // activations GEMMs read, the logits included, are stored in 16 bits; weights, accumulation and
  // the rest stay fp32; fp16 wants train.loss_scale. CPU ranks run fp32, bf16 (every GEMM's
  // operands rounded to bf16) or fp8 (bf16, and the Linears' operands quantized to fp8 E4M3 in
  // blocks of fp8_block: kernels/cpu/fp8.h).
  std::string matmul_precision = "fp32";
  int64_t fp8_block = 128;  // fp8: the quantization block (1 × b activations, b × b weights)
  int threads_per_rank = 0;       // compute threads per rank; 0 = auto

  // threads_per_rank with 0 = "the machine's cores / ranks, at least 1" resolved.
  int resolved_threads_per_rank() const;
  friend bool operator==(const RuntimeConfig&, const RuntimeConfig&) = default;
};

// Where the per-step metrics go besides RUN_DIR/metrics.jsonl (always written), and the peak
// the MFU is measured against (docs/formats.md, docs/config.md).
struct MetricsConfig {
  bool tensorboard = false;          // RUN_DIR/tensorboard/events.out.tfevents.*
  bool prometheus_textfile = false;  // RUN_DIR/metrics.prom, rewritten every step
  int prometheus_port = 0;           // > 0: world rank 0 serves GET /metrics on this TCP port
  double peak_tflops = 0;            // per rank, for the MFU; 0 = measured at start-up
  int64_t trace_from_step = 0;  // > 0: timelines of steps trace_from_step.. (RUN_DIR/trace.json)
  int64_t trace_steps = 2;      // how many steps the timeline holds
  friend bool operator==(const MetricsConfig&, const MetricsConfig&) = default;
};

struct Config {
  ModelConfig model;
  DataConfig data;
  TrainConfig train;
  ParallelConfig parallel;
  RuntimeConfig runtime;
  MetricsConfig metrics;

  // Micro-batches each data-parallel rank accumulates per optimizer step:
  // batch_size / (micro_batch_size × dp). Call on a validated config.
  int64_t grad_accum_steps() const;
  // parallel.recompute with the deprecated train.recompute = true resolved: "full" when
  // parallel.recompute is "none" (its default: an explicit "none" cannot be told apart from an
  // unset key, so it does not conflict). validate() rejects train.recompute = true with
  // parallel.recompute = "selective".
  std::string resolved_recompute() const;
  friend bool operator==(const Config&, const Config&) = default;
};

// Reads and parses a TOML file. Throws loom::Error naming the path if it cannot be read, and
// "path:line:column: ..." for a syntax error. Does not validate().
Config load_config(const std::string& path);

// Parses TOML text; `source_name` (usually the file name) starts every error message. Unknown
// sections/keys and wrong types throw, naming the dotted key. Missing keys keep their defaults.
Config parse_config(std::string_view toml_text, const std::string& source_name);

// Applies one "section.key=value" assignment (from --set). The value is read according to the
// key's type: integer, float (an integer is accepted), bool (true/false) or string (quoted as in
// TOML, or given bare: `data.train=/data/*.bin`).
void apply_override(Config& config, std::string_view assignment);

// Fills in the parallel degrees left out (0) for a job of `world` ranks: every degree is the
// given one; when dp is left out it takes what the others leave (world / (tp × pp)), else a
// single left-out tp or pp does; any other left-out degree is 1. Throws loom::Error naming the
// product that does not match the world size.
void resolve_parallel_degrees(ParallelConfig& parallel, int world);

// Checks every value and cross-constraint; throws one loom::Error listing all violations, each
// naming its keys and values ("model.n_heads = 5 does not divide model.d_model = 64").
void validate(const Config& config);

// The config as TOML, every key written; parse_config(to_toml(c)) == c.
std::string to_toml(const Config& config);

}  // namespace loom
