// The metrics.jsonl record of a step from its figures: the derived fields (rates, MFU, compute
// time, memory in MiB) and which optional fields appear.
#include "train/step_record.h"

#include <gtest/gtest.h>

namespace loom {
namespace {

StepFigures figures() {
  StepFigures f;
  f.step = 3;
  f.loss = 2.5;
  f.lr = 1e-3;
  f.grad_norm = 0.75;
  f.seconds = 0.5;
  f.data_seconds = 0.05;
  f.comm_wait_seconds = 0.1;
  f.comm_seconds = {0.1, 0.02, 0.03, 0.0};
  f.comm_bytes = {1000, 20, 30, 0};
  f.tokens_per_step = 4096;
  f.flops_per_step = 6e12;
  f.peak_tflops = 4.0;
  f.world_size = 2;
  f.peak_bytes = 3 * 1048576;
  f.held_bytes = 1048576;
  f.state_bytes = {1048576, 2 * 1048576, 4 * 1048576};
  return f;
}

TEST(StepRecord, DerivesRatesTimesAndMemoryFromTheFigures) {
  const nlohmann::json r = step_record(figures());
  EXPECT_EQ(r.at("step").get<int64_t>(), 3);
  EXPECT_DOUBLE_EQ(r.at("tokens_per_s").get<double>(), 8192.0);
  EXPECT_DOUBLE_EQ(r.at("step_ms").get<double>(), 500.0);
  EXPECT_DOUBLE_EQ(r.at("tflops").get<double>(), 12.0);
  EXPECT_DOUBLE_EQ(r.at("mfu").get<double>(), 1.5);  // 12 TFLOP/s over 2 ranks of 4
  EXPECT_EQ(r.at("tokens").get<int64_t>(), 3 * 4096);
  // 0.5 s less the loader's 0.05 and the axes' 0.15.
  EXPECT_NEAR(r.at("compute_ms").get<double>(), 300.0, 1e-9);
  EXPECT_NEAR(r.at("comm_ms").at("dp").get<double>(), 100.0, 1e-9);
  EXPECT_EQ(r.at("comm_bytes").at("dp").get<int64_t>(), 1000);
  EXPECT_DOUBLE_EQ(r.at("peak_mem_mb").get<double>(), 3.0);
  EXPECT_DOUBLE_EQ(r.at("mem_activations_peak_mb").get<double>(), 2.0);
  EXPECT_DOUBLE_EQ(r.at("mem_optimizer_mb").get<double>(), 4.0);
  for (const char* absent :
       {"val_loss", "loss_scale", "skipped", "bubble", "bubble_by_pp_rank", "pp_deferred_mb"})
    EXPECT_FALSE(r.contains(absent)) << absent;
}

TEST(StepRecord, ComputeTimeIsNeverNegative) {
  StepFigures f = figures();
  f.comm_seconds.dp = 1.0;  // waits timed past the step's own clock
  EXPECT_EQ(step_record(f).at("compute_ms").get<double>(), 0.0);
}

TEST(StepRecord, OptionalFieldsAppearWhenGiven) {
  StepFigures f = figures();
  f.val_loss = 2.25;
  f.loss_scale = 65536.0;
  f.skipped = true;
  f.val_losses = {{"web", 3.5}, {"code", 1.5}};
  f.data_epochs = {0.25, 2.5};
  PipelineFigures p;
  p.bubble = 0.2;
  p.bubble_theory = 0.25;
  p.bubble_by_pp_rank = {0.2, 0.1};
  p.bytes_sent = 12345;
  f.pipeline = p;
  nlohmann::json r = step_record(f);
  EXPECT_EQ(r.at("val_loss").get<double>(), 2.25);
  EXPECT_EQ(r.at("loss_scale").get<double>(), 65536.0);
  EXPECT_TRUE(r.at("skipped").get<bool>());
  EXPECT_EQ(r.at("val_losses"), (nlohmann::json{{"web", 3.5}, {"code", 1.5}}));
  EXPECT_EQ(r.at("data_epochs"), (nlohmann::json{{"1", 0.25}, {"2", 2.5}}));
  EXPECT_EQ(validation_message(f),
            "step " + std::to_string(f.step) + ": val loss 2.2500 | web 3.5000 | code 1.5000");
  StepFigures sets_only = f;
  sets_only.val_loss.reset();
  EXPECT_EQ(validation_message(sets_only),
            "step " + std::to_string(f.step) + ": val loss web 3.5000 | code 1.5000");
  EXPECT_EQ(validation_message(figures()), "");
  EXPECT_EQ(r.at("bubble_by_pp_rank").size(), 2u);
  EXPECT_EQ(r.at("pp_bytes_sent").get<int64_t>(), 12345);
  EXPECT_FALSE(r.contains("pp_deferred_mb"));  // not a zero-bubble schedule
  f.pipeline->max_deferred_bytes = 1048576;
  r = step_record(f);
  EXPECT_DOUBLE_EQ(r.at("pp_deferred_mb").get<double>(), 1.0);
}

}  // namespace
}  // namespace loom
