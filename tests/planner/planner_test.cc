// The layout planner: its memory count against what the engines really allocate (CPU runs of
// each kind of layout), its time model's formulas, and the list of layouts it offers.
#include "planner/planner.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "data/dataset.h"
#include "device/allocator.h"
#include "harness/devices.h"
#include "harness/error_of.h"
#include "models/gpt2.h"
#include "parallel/pipeline_parallel.h"
#include "train/trainer.h"

namespace loom {
namespace {
namespace fs = std::filesystem;
using testutil::error_of;

Config tiny_config(const std::string& data_dir) {
  Config c = parse_config(R"(
[model]
vocab_size = 256
seq_len = 16
d_model = 32
n_layers = 4
n_heads = 4
[train]
steps = 1
batch_size = 8
micro_batch_size = 2
warmup_steps = 0
eval_every = 0
save_every = 0
[runtime]
threads_per_rank = 1
)",
                          "planner_test.toml");
  c.data.train = data_dir + "/train_*.bin";
  return c;
}

struct Layout {
  int ranks, tp, pp, zero, virtual_stages;
  int cp = 1;
  int ep = 1;  // expert parallelism (a mixture's experts over groups of dp ranks)
  int dp_shard = 0;  // hybrid sharding (parallel.dp_shard)
};

// Each rank's parameter elements are those of the parts the trainer built (its start-up table),
// and rank 0's state buffers, rounded as the CPU's caching allocator rounds each request, are what
// the trainer measured on that allocator (metrics.jsonl's mem_*_mb).
void expect_plan_is_what_the_trainer_allocates(Config c, const Layout& l, const fs::path& dir) {
  c.runtime.ranks = l.ranks;
  c.parallel.tp = l.tp;
  c.parallel.pp = l.pp;
  c.parallel.zero = l.zero;
  c.parallel.virtual_stages = l.virtual_stages;
  c.parallel.cp = l.cp;
  c.parallel.ep = l.ep;
  c.parallel.dp_shard = l.dp_shard;
  if (l.virtual_stages > 1) c.parallel.schedule = "interleaved";
  resolve_layout(c);
  SCOPED_TRACE(c.model.arch + " dp" + std::to_string(c.parallel.dp) + " tp" + std::to_string(l.tp) +
               " pp" + std::to_string(l.pp) + " zero" + std::to_string(l.zero) + " v" +
               std::to_string(l.virtual_stages) + " cp" + std::to_string(l.cp) + " dp_shard" +
               std::to_string(l.dp_shard));
  TrainOptions o;
  o.run_dir = (dir / "run").string();
  o.progress = false;
  fs::remove_all(o.run_dir);
  const TrainSummary s = run_training(c, o);
  // The start-up table: "rank pp dp tp parameters ..." rows ("rank pp dp cp tp ..." with cp).
  std::istringstream report(s.layout_report);
  int rows = 0;
  for (std::string row; std::getline(report, row);) {
    std::istringstream fields(row);
    int rank = -1, pp = -1, dp = -1, cp = 0, tp = -1;
    int64_t parameters = -1;
    if (!(fields >> rank >> pp >> dp)) continue;
    if (l.cp > 1 && !(fields >> cp)) continue;
    if (!(fields >> tp >> parameters)) continue;
    int64_t planned = 0;
    for (const auto& units : rank_units(c, pp))
      for (int64_t u : units) planned += u;
    EXPECT_EQ(planned, parameters) << row;
    ++rows;
  }
  EXPECT_EQ(rows, l.ranks) << s.layout_report;
  std::ifstream in(fs::path(o.run_dir) / "metrics.jsonl");
  std::string line;
  std::getline(in, line);
  const nlohmann::json r = nlohmann::json::parse(line);
  const double measured = (r["mem_params_mb"].get<double>() + r["mem_grads_mb"].get<double>() +
                           r["mem_optimizer_mb"].get<double>()) *
                          1048576.0;
  int64_t planned = 0;
  for (int64_t b : rank_state_buffers(c, 0))
    planned += static_cast<int64_t>(CachingCpuAllocator::round_size(static_cast<size_t>(b)));
  // The trainer measures its engines' buffers as the growth of the allocator's bytes in use,
  // which thread ranks share: other ranks' small tensors made meanwhile (a few hundred bytes
  // each; 1280 seen under the sanitizers, a pipeline's ranks setting up tp and its messages) can
  // land in it — 4 KiB of slack, far below any unit's buffers. On a GPU AdamW's table of runs (optim/adamw.h: 48 bytes a run of
  // parameters, ~2 KiB here) lives in device memory too and is counted with the moments.
  const double table = c.runtime.device == "cuda" ? 4096 : 0;
  EXPECT_GE(measured, static_cast<double>(planned) - 4096);
  EXPECT_LE(measured, static_cast<double>(planned) + 4096 + table);
}

TEST(Planner, StateBytesAreWhatTheEnginesAllocate) {
  const fs::path dir =
      fs::temp_directory_path() / ("loom_planner_test_" + std::to_string(getpid()));
  fs::remove_all(dir);
  synthesize_addition((dir / "data").string(), 20000, 2000, 5);
  const Layout layouts[] = {{1, 1, 1, 0, 1},
                            {2, 1, 1, 0, 1},
                            {2, 1, 1, 1, 1},
                            {2, 1, 1, 2, 1},
                            {2, 1, 1, 3, 1},
                            {2, 2, 1, 0, 1},
                            {2, 1, 2, 0, 1},
                            {4, 2, 1, 1, 1},
                            {4, 2, 2, 1, 1},
                            {2, 1, 2, 1, 2},
                            // context parallelism: ZeRO over dp × cp
                            {2, 1, 1, 1, 1, 2},
                            {4, 1, 1, 3, 1, 2},
                            {4, 2, 1, 2, 1, 2},
                            {4, 1, 2, 1, 1, 2},  // pp × cp: stages split by the whole sequence
                            // hybrid sharding: ZeRO's chunks over dp_shard (× cp) ranks
                            {4, 1, 1, 1, 1, 1, 1, 2},
                            {4, 1, 1, 2, 1, 1, 1, 2},
                            {4, 1, 1, 3, 1, 1, 1, 2},
                            {4, 1, 1, 3, 1, 2, 1, 1},
                            {4, 1, 2, 1, 1, 1, 1, 1}};
  for (const Layout& l : layouts)
    expect_plan_is_what_the_trainer_allocates(tiny_config((dir / "data").string()), l, dir);
  fs::remove_all(dir);
}

// On GPUs at bf16 the engines of ZeRO 0-2 also keep their weights' 16-bit copies
// (nn/rounded_weights.h: each block's four Linears, the LM head's weight or its vocabulary rows
// under tensor parallelism): the plan counts them as the engines allocate them, under every kind of
// layout, and none at ZeRO-3.
TEST(Planner, StateBytesOnGpusAtBf16CountTheWeightCopies) {
  LOOM_SKIP_UNLESS_CUDA_DEVICES(2);
  const fs::path dir =
      fs::temp_directory_path() / ("loom_planner_gpu_test_" + std::to_string(getpid()));
  fs::remove_all(dir);
  synthesize_addition((dir / "data").string(), 20000, 2000, 5);
  for (const std::string arch : {"gpt2", "llama"}) {
    Config c = tiny_config((dir / "data").string());
    c.model.arch = arch;
    if (arch == "llama") {
      c.model.n_kv_heads = 2;
      c.model.ffn_hidden = 48;
    }
    c.runtime.device = "cuda";
    c.runtime.matmul_precision = "bf16";
    // Llama: its blocks' and its head's shapes, on one GPU and under tp.
    const std::vector<Layout> layouts = arch == "gpt2"
                                            ? std::vector<Layout>{{1, 1, 1, 0, 1},
                                                                  {2, 1, 1, 1, 1},
                                                                  {2, 2, 1, 0, 1},
                                                                  {2, 1, 2, 0, 1},
                                                                  {2, 1, 1, 3, 1}}
                                            : std::vector<Layout>{{1, 1, 1, 0, 1}, {2, 2, 1, 0, 1}};
    for (const Layout& l : layouts) expect_plan_is_what_the_trainer_allocates(c, l, dir);
    // The copies are there: 2 bytes a weight value (and none at ZeRO-3).
    Config one = c;
    one.runtime.ranks = 1;
    resolve_layout(one);
    const Gpt2Config m = model_config_of(one);
    const int64_t d = m.d_model, weights = m.n_layers * (m.qkv_width() * d + d * d +
                                                         (m.llama() ? 3 : 2) * m.hidden() * d) +
                                           m.vocab_size * d;
    EXPECT_EQ(rank_weight_copy_values(one, 0), std::vector<int64_t>{weights});
    Config fp32 = one;
    fp32.runtime.matmul_precision = "fp32";
    int64_t with = 0, without = 0;
    for (int64_t b : rank_state_buffers(one, 0)) with += b;
    for (int64_t b : rank_state_buffers(fp32, 0)) without += b;
    EXPECT_EQ(with - without, 2 * weights);
  }
  fs::remove_all(dir);
}

// The same for Llama's blocks: no biases, grouped-query qkv, the SwiGLU's fused gate/up, no
// position table, RMSNorm gains only; OLMo 2's full-width query/key norms.
TEST(Planner, LlamaStateBytesAreWhatTheEnginesAllocate) {
  const fs::path dir =
      fs::temp_directory_path() / ("loom_planner_llama_test_" + std::to_string(getpid()));
  fs::remove_all(dir);
  synthesize_addition((dir / "data").string(), 20000, 2000, 5);
  Config c = tiny_config((dir / "data").string());
  c.model.arch = "llama";
  c.model.n_kv_heads = 2;
  c.model.ffn_hidden = 80;
  const Layout layouts[] = {{1, 1, 1, 0, 1}, {2, 2, 1, 0, 1}, {2, 1, 2, 0, 1}, {4, 2, 2, 1, 1},
                            {2, 1, 1, 3, 1}};
  for (const Layout& l : layouts) expect_plan_is_what_the_trainer_allocates(c, l, dir);
  c.model.tie_embeddings = false;  // lm_head.weight on the last stage (and alone on one device)
  for (const Layout& l : {Layout{1, 1, 1, 0, 1}, Layout{4, 2, 2, 1, 1}})
    expect_plan_is_what_the_trainer_allocates(c, l, dir);
  // OLMo 2's query/key norms over all the heads: whole on one device, split over tp.
  c.model.norm_placement = "post";
  c.model.qk_norm = true;
  c.model.qk_norm_scope = "full";
  for (const Layout& l : {Layout{1, 1, 1, 0, 1}, Layout{2, 2, 1, 0, 1}, Layout{4, 2, 1, 1, 1}})
    expect_plan_is_what_the_trainer_allocates(c, l, dir);
  fs::remove_all(dir);
}

// The weights' 16-bit copies are counted for any GPU device name ("cuda" or "cuda:N") at bf16 /
// fp16 under ZeRO 0-2, and not on CPU ranks or at fp32.
TEST(Planner, WeightCopiesAreCountedWhereTheEnginesKeepThem) {
  Config c = tiny_config("unused");
  c.runtime.ranks = 1;
  resolve_layout(c);
  const auto total = [](const Config& k) {
    int64_t sum = 0;
    for (int64_t b : rank_state_buffers(k, 0)) sum += b;
    return sum;
  };
  const int64_t cpu = total(c);
  const int64_t copies = 2 * rank_weight_copy_values(c, 0).at(0);
  EXPECT_GT(copies, 0);
  for (const char* device : {"cuda", "cuda:0"}) {
    Config g = c;
    g.runtime.device = device;
    for (const char* precision : {"bf16", "fp16"}) {
      g.runtime.matmul_precision = precision;
      EXPECT_EQ(total(g), cpu + copies) << device << " " << precision;
    }
    g.runtime.matmul_precision = "fp32";
    EXPECT_EQ(total(g), cpu) << device << " fp32";
  }
  c.runtime.matmul_precision = "bf16";  // CPU ranks at bf16 round while packing: no copies
  EXPECT_EQ(total(c), cpu);
}

TEST(Planner, TimeModelFormulas) {
  // A ring all-reduce moves 2 (n - 1) / n of the buffer over each rank's link.
  EXPECT_DOUBLE_EQ(all_reduce_seconds(1e9, 4, 100), 2.0 * 3 / 4 * 1e9 / 100e9);
  EXPECT_EQ(all_reduce_seconds(1e9, 1, 100), 0);
  Config c = tiny_config("unused");
  c.train.batch_size = 64;
  c.train.micro_batch_size = 2;
  PlanOptions o;
  o.devices = 8;
  o.hardware = find_hardware("h100");
  // 1F1B over 4 stages with 64 / (2 × dp 2) = 16 micro-batches per replica: a bubble of
  // (pp - 1) / m of the compute.
  c.parallel.dp = 2;
  c.parallel.pp = 4;
  const LayoutPlan p = estimate_layout(c, o);
  EXPECT_NEAR(p.bubble_s, p.compute_s * 3.0 / 16.0, 1e-20);
  // Zero bubble: a third of a micro-batch's slot per stage of the fill (zb-h1), and of a
  // chunk's with v chunks (zb-interleaved), as the schedules' unit-cost timelines give.
  Config zb = c;
  zb.parallel.schedule = "zb-h1";
  EXPECT_NEAR(estimate_layout(zb, o).bubble_s, p.compute_s * 3.0 / 48.0, 1e-20);
  zb.parallel.schedule = "zb-interleaved";
  zb.parallel.virtual_stages = 2;
  zb.model.n_layers = std::max<int64_t>(zb.model.n_layers, 8);
  const LayoutPlan zbi = estimate_layout(zb, o);
  EXPECT_NEAR(zbi.bubble_s, zbi.compute_s * 3.0 / 96.0, 1e-20);
  // zb-v: its unit-cost schedule's simulated idle fraction b, b / (1 − b) of the compute — with
  // 16 micro-batches zb-interleaved's floor, (p − 1)/(6m); with fewer micro-batches than ranks
  // far above what that formula would promise.
  zb.parallel.schedule = "zb-v";
  const LayoutPlan zbv = estimate_layout(zb, o);
  const double b = simulated_bubble(make_schedule("zb-v", 4, 16, 2));
  EXPECT_NEAR(zbv.bubble_s, zbv.compute_s * b / (1 - b), 1e-20);
  EXPECT_NEAR(zbv.bubble_s, zbi.bubble_s, 1e-12 * zbi.bubble_s);
  Config few = zb;
  few.train.batch_size = 2 * few.train.micro_batch_size;  // dp 2: one micro-batch per replica
  const LayoutPlan one = estimate_layout(few, o);
  // pp 4, m 1: 0.647 of the step idle (1.83× the compute), where (p − 1)/(6m) would say 0.5×.
  EXPECT_GT(one.bubble_s, 1.8 * one.compute_s);
  // The compute is the model's FLOPs shared by the devices at the efficiency.
  const double flops = model_config_of(c).flops_per_token(16) * 64 * 16;
  EXPECT_NEAR(p.compute_s, flops / (8 * 989e12 * 0.5), 1e-20);
  EXPECT_NEAR(p.tokens_per_s, 64 * 16 / p.step_s(), 1e-6);
  // Stage boundaries in bf16 (parallel.pp_send_dtype): half the pipeline's message time.
  Config half = c;
  half.parallel.pp_send_dtype = "bf16";
  EXPECT_GT(p.pp_comm_s, 0);
  EXPECT_NEAR(estimate_layout(half, o).pp_comm_s, p.pp_comm_s / 2, 1e-20);
  // Tensor parallelism inside a node rides NVLink; across nodes (2 GPUs a node) the network.
  Config t = tiny_config("unused");
  t.parallel.tp = 4;
  t.parallel.dp = 2;
  const double fast = estimate_layout(t, o).tp_comm_s;
  o.hardware.devices_per_node = 2;
  const double slow = estimate_layout(t, o).tp_comm_s;
  EXPECT_NEAR(slow / fast, o.hardware.intra_node_gbps / o.hardware.inter_node_gbps, 1e-9);
  // Per block: 2 all-reduces forward and 2 backward; with sequence parallelism the all-gathers
  // carry 16-bit norm outputs, forward and again backward (4 in all); full recomputation repeats
  // the forward's, selective with sequence parallelism gathers the rebuilt norm outputs in f32.
  const auto tp_units = [&](bool sp, const char* recompute) {
    Config v = t;
    v.parallel.sequence_parallel = sp;
    v.parallel.recompute = recompute;
    return estimate_layout(v, o).tp_comm_s / slow * 4.0;
  };
  EXPECT_NEAR(tp_units(false, "none"), 4.0, 1e-9);
  EXPECT_NEAR(tp_units(true, "none"), 4.0, 1e-9);
  EXPECT_NEAR(tp_units(true, "full"), 5.5, 1e-9);
  EXPECT_NEAR(tp_units(false, "full"), 6.0, 1e-9);
  EXPECT_NEAR(tp_units(true, "selective"), 4.5, 1e-9);
  EXPECT_NEAR(tp_units(false, "selective"), 4.0, 1e-9);
  // Gradients reduced in bf16 (parallel.grad_reduce_dtype) move half the bytes: with ZeRO 1 over
  // the network the exposed reduce-scatter halves, the parameters' fp32 all-gather does not.
  Config g = tiny_config("unused");
  g.train.batch_size = 16;
  g.train.micro_batch_size = 2;
  g.parallel.dp = 8;
  g.parallel.zero = 1;
  o.hardware.devices_per_node = 1;
  o.hardware.inter_node_gbps = 0.01;  // slow enough that the all-reduce is exposed
  const double f32 = estimate_layout(g, o).dp_comm_s;
  g.parallel.grad_reduce_dtype = "bf16";
  const double b16 = estimate_layout(g, o).dp_comm_s;
  EXPECT_LT(b16, f32);
  EXPECT_GT(b16, f32 / 2);  // the all-gather's share stays
  // ZeRO-1 reduce-scatters and gathers: what stage 0's all-reduce costs (both behind the last
  // micro-batch's backward only), under pipelining too (until 2026-12-07 it all-reduced there,
  // then gathered: half as much again).
  g.parallel.grad_reduce_dtype = "fp32";
  g.parallel.zero = 0;
  const double z0 = estimate_layout(g, o).dp_comm_s;
  EXPECT_GT(z0, 0);
  EXPECT_NEAR(f32, z0, 1e-9 * z0);
  Config piped = g;
  piped.parallel.dp = 4;
  piped.parallel.pp = 2;
  const double piped_z0 = estimate_layout(piped, o).dp_comm_s;
  piped.parallel.zero = 1;
  EXPECT_GT(piped_z0, 0);
  EXPECT_NEAR(estimate_layout(piped, o).dp_comm_s, piped_z0, 1e-9 * piped_z0);
  // ZeRO-3 gathering the parameters in bf16 too (parallel.param_gather_dtype): all of its
  // traffic halves.
  g.parallel.zero = 3;
  const double z3 = estimate_layout(g, o).dp_comm_s;
  g.parallel.param_gather_dtype = "bf16";
  const double z3_bf16 = estimate_layout(g, o).dp_comm_s;
  EXPECT_GT(z3, 0);
  EXPECT_LT(z3_bf16, z3 * 0.75);
}

// Hybrid sharding (parallel.dp_shard): ZeRO-3's gathers and reduce-scatters within a shard group —
// a node's GPUs — and the reduced chunks (1/dp_shard of the gradients) all-reduced between the
// replicas over the network; `loom plan` offers the largest group that fits a node.
TEST(Planner, HybridShardingKeepsTheGathersInANodeAndAllReducesBetweenReplicas) {
  Config c = tiny_config("unused");
  c.train.batch_size = 64;
  c.train.micro_batch_size = 2;  // 2 micro-batches per rank at dp 16
  c.parallel.dp = 16;
  c.parallel.tp = c.parallel.pp = 1;
  c.parallel.zero = 3;
  PlanOptions o;
  o.devices = 16;
  o.hardware = find_hardware("h100");
  o.hardware.intra_node_gbps = 1e9;    // a node's links: free
  o.hardware.inter_node_gbps = 0.001;  // the network: slow enough that everything is exposed
  const LayoutPlan plain = estimate_layout(c, o);
  Config hybrid = c;
  hybrid.parallel.dp_shard = 8;
  const LayoutPlan hsdp = estimate_layout(hybrid, o);
  EXPECT_EQ(hsdp.name(), "dp16 tp1 pp1 zero3 shard8");
  EXPECT_EQ(hsdp.dp_shard, 8);
  // What crosses the network per micro-batch: the replicas' all-reduce (2 of them) of a shard of
  // the f32 gradients, 2 (R − 1) / R · 4Ψ / 8 — where plain ZeRO-3 gathers every weight twice and
  // reduce-scatters every gradient over it.
  int64_t psi = 0;
  for (const auto& units : rank_units(c, 0))
    for (int64_t u : units) psi += u;
  const double m = 2, replica = 2.0 * 1 / 2 * 4.0 * static_cast<double>(psi) / 8 / 1e6;
  EXPECT_NEAR(hsdp.dp_comm_s, m * replica - hsdp.compute_s, 1e-6 * hsdp.dp_comm_s);
  const double whole = 15.0 / 16 * 4.0 * static_cast<double>(psi) / 1e6;
  EXPECT_NEAR(plain.dp_comm_s, m * 3 * whole - plain.compute_s, 1e-6 * plain.dp_comm_s);
  // The state: sharded 8 ways, not 16 (twice plain ZeRO-3's, within the padding).
  EXPECT_NEAR(static_cast<double>(hsdp.state_bytes), 2.0 * static_cast<double>(plain.state_bytes),
              0.05 * static_cast<double>(plain.state_bytes));
  // Offered: at ZeRO 1-3 with the node's 8 GPUs as the group (none at ZeRO 0, none with tp 8,
  // where a group of two would leave the node).
  o.hardware = find_hardware("h100");
  std::set<std::string> names;
  for (const LayoutPlan& p : plan_layouts(c, o)) names.insert(p.name());
  for (const char* name : {"dp16 tp1 pp1 zero3 shard8", "dp16 tp1 pp1 zero1 shard8",
                           "dp8 tp2 pp1 zero3 shard4", "dp16 tp1 pp1 zero3"})
    EXPECT_TRUE(names.count(name)) << name;
  for (const std::string& name : names) {
    EXPECT_EQ(name.find("zero0 shard"), std::string::npos) << name;
    EXPECT_EQ(name.find("shard16"), std::string::npos) << name;
  }
  EXPECT_FALSE(names.count("dp2 tp8 pp1 zero3 shard1"));
}

// Context parallelism (PlanOptions::every_cp, `loom plan`'s default): cp 2, 4, ... where the
// sequence splits into 2·cp chunks, named; a rank's activations and micro-batch messages shrink
// by cp, the gradient group is dp × cp, and the attention's exchange is per block and micro-batch
// an all-gather of the whole sequence's keys and values and a reduce-scatter of their gradients.
TEST(Planner, TriesContextParallelismAndCountsItsExchange) {
  Config c = tiny_config("unused");
  c.train.batch_size = 8;
  c.train.micro_batch_size = 2;
  PlanOptions o;
  o.devices = 4;
  o.hardware = find_hardware("h100");
  std::map<std::string, LayoutPlan> by_name;
  for (const LayoutPlan& p : plan_layouts(c, o)) by_name[p.name()] = p;
  for (const char* name : {"dp2 tp1 pp1 cp2 zero1", "dp1 tp1 pp1 cp4 zero0",
                           "dp1 tp2 pp1 cp2 zero0", "dp4 tp1 pp1 zero0"})
    ASSERT_TRUE(by_name.count(name)) << name;
  // cp 1, 2 and 4: powers of two up to the 4 devices (seq_len 16 allows them all).
  std::set<int> cps;
  for (const auto& [name, p] : by_name) cps.insert(p.cp);
  EXPECT_EQ(cps, (std::set<int>{1, 2, 4}));
  const LayoutPlan& cp4 = by_name.at("dp1 tp1 pp1 cp4 zero0");
  const LayoutPlan& dp4 = by_name.at("dp4 tp1 pp1 zero0");
  EXPECT_EQ(cp4.compute_s, dp4.compute_s);  // the same FLOPs on the same devices
  EXPECT_LT(cp4.activation_bytes, dp4.activation_bytes);
  // The exchange: 4 blocks × m 4 micro-batches × 2 collectives × 3/4 of a micro-batch's keys and
  // values (2 × 32 × 16 tokens × 2 heads' worth: 2·d_model floats a token) at NVLink's rate.
  const double kv_bytes = 2.0 * 16 * 2 * 32 * 4;
  EXPECT_NEAR(cp4.cp_comm_s, 4 * 4 * 2 * 0.75 * kv_bytes / (450e9), 1e-15);
  EXPECT_EQ(dp4.cp_comm_s, 0);
  {
    // Heads of 64 (d_model 128, 2 heads): the flash kernels' rows, their keys and values gathered
    // in bf16 (half), the gradients reduce-scattered in fp32; full recomputation gathers twice.
    Config h = c;
    h.model.d_model = 128;
    h.model.n_heads = 2;
    h.parallel.dp = 1;
    h.parallel.cp = 4;
    const double kv64 = 2.0 * 16 * 2 * 128 * 4;
    EXPECT_NEAR(estimate_layout(h, o).cp_comm_s, 4 * 4 * 1.5 * 0.75 * kv64 / 450e9, 1e-15);
    h.parallel.recompute = "full";
    EXPECT_NEAR(estimate_layout(h, o).cp_comm_s, 4 * 4 * 2.0 * 0.75 * kv64 / 450e9, 1e-15);
  }
  // ZeRO-1 over dp × cp: a rank of dp2 cp2 holds what a rank of dp4 holds.
  EXPECT_EQ(by_name.at("dp2 tp1 pp1 cp2 zero1").state_bytes,
            by_name.at("dp4 tp1 pp1 zero1").state_bytes);
  // With every_cp off, the config's cp alone.
  o.every_cp = false;
  for (const LayoutPlan& p : plan_layouts(c, o)) EXPECT_EQ(p.cp, 1) << p.name();
  c.parallel.cp = 2;
  for (const LayoutPlan& p : plan_layouts(c, o)) EXPECT_EQ(p.cp, 2) << p.name();
}

// The ring exchange (parallel.cp_comm = "ring"): plan_layouts tries it beside the all-gather at
// every cp > 1, named; it keeps 1/cp of the keys and values, and its time is what each step's
// transfer takes beyond the attention it overlaps — with a fast link only the last gradient sum's
// trip home, with a slow one the transfers less the attention.
TEST(Planner, TriesTheRingAndCountsWhatItsAttentionDoesNotHide) {
  Config c = tiny_config("unused");
  c.model.seq_len = 32768;  // long enough for a step's attention (T²) to outlast its block (T)
  PlanOptions o;
  o.devices = 4;
  o.hardware = find_hardware("h100");
  std::map<std::string, LayoutPlan> by_name;
  for (const LayoutPlan& p : plan_layouts(c, o)) by_name[p.name()] = p;
  for (const char* name : {"dp1 tp1 pp1 cp4 ring zero0", "dp2 tp1 pp1 cp2 ring zero1",
                           "dp1 tp1 pp1 cp4 zero0"})
    ASSERT_TRUE(by_name.count(name)) << name;
  const LayoutPlan& ring = by_name.at("dp1 tp1 pp1 cp4 ring zero0");
  const LayoutPlan& gather = by_name.at("dp1 tp1 pp1 cp4 zero0");
  EXPECT_EQ(ring.cp_comm, "ring");
  EXPECT_EQ(ring.compute_s, gather.compute_s);
  EXPECT_LT(ring.activation_bytes, gather.activation_bytes);
  // Per block (4) and micro-batch (4): a block of 1/4 of a micro-batch's keys and values (2
  // sequences × T tokens × 2·d_model floats) a step, against a step's attention: 2·T²·C of a
  // micro-batch's 2 sequences over cp² = 16, at the h100's peak × 0.5.
  const double T = 32768, kv_bytes = 2.0 * T * 2 * 32 * 4, link = 450e9;
  const double block = kv_bytes / 4 / link, grad = block;
  const double step = 2.0 * 2 * T * T * 32 / 16 / (o.hardware.peak_tflops * 1e12 * 0.5);
  ASSERT_GT(step, block);  // NVLink: the attention hides the transfers
  EXPECT_NEAR(ring.cp_comm_s, 4 * 4 * grad, 1e-15);
  EXPECT_LT(ring.cp_comm_s, gather.cp_comm_s);
  // A link 100× slower: 3 steps forward (block − step), 3 backward (block + grad − 2·step), and
  // the last sum home.
  o.hardware.intra_node_gbps = 4.5;
  Config r = c;
  r.parallel.dp = 1;
  r.parallel.cp = 4;
  r.parallel.cp_comm = "ring";
  const double slow = 100 * block;
  ASSERT_GT(slow, 2 * step);
  EXPECT_NEAR(estimate_layout(r, o).cp_comm_s,
              4 * 4 * (3 * (slow - step) + 3 * (2 * slow - 2 * step) + slow), 1e-12);
  // A sliding window of T/8 (a Llama with as many key/value heads: the same keys and values): its
  // attention multiplies Σ_p min(p + 1, W) pairs a sequence, not T²/2, and hides less.
  Config w = r;
  w.model.arch = "llama";
  w.model.n_kv_heads = w.model.n_heads;
  w.model.sliding_window = 4096;
  const double W = 4096;
  const double window_step =
      2.0 * 2 * 2 * (T * W - W * (W - 1) / 2) * 32 / 16 / (o.hardware.peak_tflops * 1e12 * 0.5);
  ASSERT_LT(window_step, step / 3);
  EXPECT_NEAR(estimate_layout(w, o).cp_comm_s,
              4 * 4 * (3 * (slow - window_step) + 3 * (2 * slow - 2 * window_step) + slow), 1e-12);
  // With every_cp off the config's exchange alone.
  o.every_cp = false;
  for (const LayoutPlan& p : plan_layouts(r, o)) EXPECT_EQ(p.cp_comm, "ring") << p.name();
}

// Pipeline layouts come in every schedule (PlanOptions::every_schedule, `loom plan`'s default):
// 1f1b, zb-h1, and with two chunks per rank interleaved and zb-interleaved where the micro-batches
// come in groups of pp, and zb-v (any count); the zero-bubble ones with less bubble than their
// base at the same compute, zb-v's that of zb-interleaved. With every_schedule off, the config's
// schedule alone.
TEST(Planner, TriesEveryPipelineScheduleAndNamesIt) {
  Config c = tiny_config("unused");
  c.model.n_layers = 8;
  c.train.batch_size = 64;
  c.train.micro_batch_size = 2;
  PlanOptions o;
  o.devices = 4;
  o.hardware = find_hardware("h100");
  std::map<std::string, const LayoutPlan*> by_name;
  const std::vector<LayoutPlan> plans = plan_layouts(c, o);
  for (const LayoutPlan& p : plans) by_name[p.name()] = &p;
  for (const char* name :
       {"dp2 tp1 pp2 zero0 1f1b", "dp2 tp1 pp2 zero0 zb-h1", "dp2 tp1 pp2 zero0 interleaved v2",
        "dp2 tp1 pp2 zero0 zb-interleaved v2", "dp1 tp1 pp4 zero0 zb-interleaved v2",
        "dp2 tp1 pp2 zero0 zb-v v2", "dp4 tp1 pp1 zero0"})
    ASSERT_TRUE(by_name.count(name)) << name;
  const auto bubble = [&](const char* name) { return by_name.at(name)->bubble_s; };
  EXPECT_LT(bubble("dp2 tp1 pp2 zero0 zb-h1"), bubble("dp2 tp1 pp2 zero0 1f1b"));
  EXPECT_LT(bubble("dp2 tp1 pp2 zero0 zb-interleaved v2"),
            bubble("dp2 tp1 pp2 zero0 interleaved v2"));
  EXPECT_LT(bubble("dp2 tp1 pp2 zero0 zb-interleaved v2"), bubble("dp2 tp1 pp2 zero0 zb-h1"));
  EXPECT_NEAR(bubble("dp2 tp1 pp2 zero0 zb-v v2"), bubble("dp2 tp1 pp2 zero0 zb-interleaved v2"),
              1e-12 * bubble("dp2 tp1 pp2 zero0 zb-interleaved v2"));
  EXPECT_EQ(by_name.at("dp2 tp1 pp2 zero0 zb-h1")->compute_s,
            by_name.at("dp2 tp1 pp2 zero0 1f1b")->compute_s);
  // In the V the last stage (the LM head) sits on rank 0 with the first: the planner counts its
  // parameters there, as the trainer places them.
  EXPECT_GT(by_name.at("dp2 tp1 pp2 zero0 zb-v v2")->parameters,
            by_name.at("dp2 tp1 pp2 zero0 zb-interleaved v2")->parameters);
  // No interleaved schedule where the micro-batches do not come in groups of pp; zb-v, yes.
  Config odd = c;
  odd.train.batch_size = 6;  // dp 1: 3 micro-batches, not a multiple of pp 2 or 4
  bool v_shaped = false;
  for (const LayoutPlan& p : plan_layouts(odd, o)) {
    EXPECT_TRUE(p.virtual_stages == 1 || p.schedule == "zb-v") << p.name();
    v_shaped = v_shaped || p.schedule == "zb-v";
  }
  EXPECT_TRUE(v_shaped);
  o.every_schedule = false;
  c.parallel.schedule = "zb-h1";
  for (const LayoutPlan& p : plan_layouts(c, o)) {
    if (p.pp > 1) {
      EXPECT_EQ(p.schedule, "zb-h1") << p.name();
    }
  }
}

TEST(Planner, OffersEveryRunnableLayoutFittingOnesFirst) {
  Config c = tiny_config("unused");
  c.train.batch_size = 8;
  c.train.micro_batch_size = 2;  // dp can be 1, 2 or 4
  PlanOptions o;
  o.devices = 8;
  o.hardware = find_hardware("a100-40g");
  const std::vector<LayoutPlan> plans = plan_layouts(c, o);
  ASSERT_FALSE(plans.empty());
  for (size_t i = 0; i < plans.size(); ++i) {
    const LayoutPlan& p = plans[i];
    EXPECT_EQ(p.dp * p.tp * p.pp * p.cp, 8) << p.name();
    EXPECT_LE(p.dp, 4) << p.name();      // the batch holds 4 micro-batches
    EXPECT_EQ(4 % p.tp, 0) << p.name();  // tp divides the heads
    EXPECT_LE(p.pp, 4) << p.name();      // no more stages than blocks
    if (p.pp > 1) {
      EXPECT_LE(p.zero, 1) << p.name();
    }
    if (i > 0 && plans[i - 1].fits == p.fits) {
      EXPECT_LE(plans[i - 1].step_s(), p.step_s());
    }
  }
  // A 6.7 B-parameter model on 8 A100 40 GB: plain data parallelism holds 16 bytes a parameter
  // on every GPU and cannot fit; sharding (ZeRO-3, or tp × pp) can.
  Config big = tiny_config("unused");
  big.model.d_model = 4096;
  big.model.n_layers = 32;
  big.model.n_heads = 32;
  big.model.vocab_size = 50304;
  big.model.seq_len = 2048;
  big.train.batch_size = 64;
  big.train.micro_batch_size = 1;
  bool dp_fits = true, some_fit = false;
  for (const LayoutPlan& p : plan_layouts(big, o)) {
    if (p.dp == 8 && p.zero == 0) dp_fits = p.fits;
    some_fit |= p.fits;
  }
  EXPECT_FALSE(dp_fits);
  EXPECT_TRUE(some_fit);
  EXPECT_NE(error_of([] { find_hardware("tpu-v5"); }).find("known: h100"), std::string::npos);
}

}  // namespace
}  // namespace loom

namespace loom {
namespace {

// A mixture of experts' state: every expert's SwiGLU and the router in each block, counted as
// the engines allocate them (ZeRO 0-3, pipelined, data-parallel); its tp layouts not offered.
TEST(Planner, MixtureOfExpertsStateBytesAreWhatTheEnginesAllocate) {
  const fs::path dir =
      fs::temp_directory_path() / ("loom_planner_moe_test_" + std::to_string(getpid()));
  fs::remove_all(dir);
  synthesize_addition((dir / "data").string(), 20000, 2000, 5);
  Config c = tiny_config((dir / "data").string());
  c.model.arch = "llama";
  c.model.n_kv_heads = 2;
  c.model.ffn_hidden = 40;
  c.model.moe_experts = 4;
  c.model.moe_top_k = 2;
  for (const Layout& l :
       {Layout{1, 1, 1, 0, 1}, Layout{2, 1, 1, 3, 1}, Layout{2, 1, 2, 0, 1}, Layout{4, 1, 2, 1, 1}})
    expect_plan_is_what_the_trainer_allocates(c, l, dir);
  c.model.moe_shared_experts = 2;  // and one SwiGLU 2 × 40 wide beside them
  for (const Layout& l : {Layout{1, 1, 1, 0, 1}, Layout{2, 1, 2, 0, 1}})
    expect_plan_is_what_the_trainer_allocates(c, l, dir);
  // Expert parallelism: a block's replicated parameters and its E/ep experts, two units, the
  // experts' sharded over dp/ep ranks (ZeRO 1-3), pipelined too; with shared experts.
  for (const Layout& l : {Layout{2, 1, 1, 0, 1, 1, 2}, Layout{4, 1, 1, 1, 1, 1, 2},
                          Layout{4, 1, 1, 2, 1, 1, 4}, Layout{4, 1, 2, 1, 1, 1, 2}})
    expect_plan_is_what_the_trainer_allocates(c, l, dir);
  c.model.moe_shared_experts = 0;
  for (const Layout& l :
       {Layout{4, 1, 1, 2, 1, 1, 2}, Layout{2, 1, 1, 1, 1, 1, 2}, Layout{4, 1, 1, 3, 1, 1, 2}})
    expect_plan_is_what_the_trainer_allocates(c, l, dir);
  // Tensor parallelism: every expert's width split over tp, the router whole; with expert
  // parallelism and pipelining besides, and shared experts.
  for (const Layout& l : {Layout{2, 2, 1, 0, 1}, Layout{4, 2, 1, 3, 1}, Layout{4, 2, 1, 1, 1, 1, 2},
                          Layout{8, 2, 2, 1, 1, 1, 2}})
    expect_plan_is_what_the_trainer_allocates(c, l, dir);
  c.model.moe_shared_experts = 2;
  for (const Layout& l : {Layout{2, 2, 1, 2, 1}, Layout{4, 2, 1, 2, 1, 1, 2}})
    expect_plan_is_what_the_trainer_allocates(c, l, dir);
  // Context parallelism: the experts' state sharded over the dp × cp ranks holding them.
  for (const Layout& l : {Layout{4, 1, 1, 1, 1, 2, 2}, Layout{4, 2, 1, 3, 1, 2}})
    expect_plan_is_what_the_trainer_allocates(c, l, dir);
  c.model.moe_shared_experts = 0;
  PlanOptions o;
  o.devices = 4;
  o.hardware = find_hardware("h100");
  const std::vector<LayoutPlan> plans = plan_layouts(c, o);
  ASSERT_FALSE(plans.empty());
  std::set<std::string> names;
  for (const LayoutPlan& p : plans) {
    names.insert(p.name());
    EXPECT_EQ(p.ep_comm_s > 0, p.ep > 1) << p.name();
  }
  // Every ep dividing dp and the 4 experts is offered, and splitting the experts saves state.
  for (const char* name :
       {"dp4 tp1 pp1 ep2 zero1", "dp4 tp1 pp1 ep4 zero2", "dp4 tp1 pp1 ep2 zero3",
        "dp2 tp1 pp2 ep2 zero1 1f1b", "dp2 tp2 pp1 ep2 zero1", "dp2 tp2 pp1 zero3"})
    EXPECT_TRUE(names.contains(name)) << name;
  const auto plan_of = [&](const std::string& name) {
    for (const LayoutPlan& p : plans)
      if (p.name() == name) return p;
    return LayoutPlan{};
  };
  EXPECT_LT(plan_of("dp4 tp1 pp1 ep4 zero1").state_bytes,
            plan_of("dp4 tp1 pp1 ep2 zero1").state_bytes);
  // With every cp: a mixture's cp layouts too, with and without expert parallelism, each named
  // by both.
  PlanOptions every_cp = o;
  every_cp.every_cp = true;
  std::set<std::string> cp_names;
  for (const LayoutPlan& p : plan_layouts(c, every_cp)) cp_names.insert(p.name());
  for (const char* name :
       {"dp2 tp1 pp1 cp2 zero1", "dp2 tp1 pp1 cp2 ring ep2 a2a zero1", "dp2 tp1 pp1 cp2 ep2 zero3"})
    EXPECT_TRUE(cp_names.contains(name)) << name;
  EXPECT_LT(plan_of("dp4 tp1 pp1 ep2 zero1").state_bytes, plan_of("dp4 tp1 pp1 zero1").state_bytes);
  // The exchange: (ep − 1) × a rank's rows a pass; ep 4 moves three times ep 2's.
  EXPECT_NEAR(plan_of("dp4 tp1 pp1 ep4 zero1").ep_comm_s,
              3 * plan_of("dp4 tp1 pp1 ep2 zero1").ep_comm_s, 1e-12);
  // The all-to-all dispatcher sends each token to its k = 2 experts' ranks: k / ep of the rows.
  EXPECT_GT(plan_of("dp4 tp1 pp1 ep4 zero1").ep_comm_s, 0);
  EXPECT_NEAR(plan_of("dp4 tp1 pp1 ep4 a2a zero1").ep_comm_s,
              0.5 * plan_of("dp4 tp1 pp1 ep4 zero1").ep_comm_s, 1e-12);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace loom
