// Documents within a sequence (data/documents.h): where each position's document starts, and
// which targets data.eod_mask_loss takes out of the loss.
#include "data/documents.h"

#include <gtest/gtest.h>

#include <vector>

#include "kernels/targets.h"

namespace loom {
namespace {

constexpr int32_t kEot = 9;

TEST(Documents, StartsFollowTheEndOfTextTokens) {
  // Two sequences of 6: documents end with their eot token; the next token starts the next one.
  const std::vector<int32_t> tokens = {1,    2,    kEot, 3, kEot, 4,  //
                                       kEot, kEot, 5,    6, 7,    8};
  std::vector<int32_t> starts(tokens.size(), -1);
  document_starts(starts.data(), tokens.data(), 2, 6, kEot);
  EXPECT_EQ(starts, (std::vector<int32_t>{0, 0, 0, 3, 3, 5,  //
                                          0, 1, 2, 2, 2, 2}));
}

TEST(Documents, EodMaskIgnoresTheTargetAfterEachEndOfText) {
  const std::vector<int32_t> inputs = {1, 2, kEot, 3, kEot, 4, kEot, 5};
  std::vector<int32_t> targets = {2, kEot, 3, kEot, 4, kEot, 5, 6};
  EXPECT_EQ(mask_targets_after_eot(targets.data(), inputs.data(), 8, kEot), 5);
  // The targets whose input is eot: the next document's first token, which the mask removes;
  // an eot as a target (a document's last prediction) still counts.
  EXPECT_EQ(targets, (std::vector<int32_t>{2, kEot, kIgnoredTarget, kEot, kIgnoredTarget, kEot,
                                           kIgnoredTarget, 6}));
  std::vector<int32_t> none = {1, 2, 3};
  const std::vector<int32_t> plain = {4, 5, 6};
  EXPECT_EQ(mask_targets_after_eot(none.data(), plain.data(), 3, kEot), 3);
  EXPECT_EQ(none, (std::vector<int32_t>{1, 2, 3}));
}

}  // namespace
}  // namespace loom
