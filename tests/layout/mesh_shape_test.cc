#include "layout/mesh_shape.h"

#include <gtest/gtest.h>

#include <set>

#include "base/error.h"

namespace loom {
namespace {

TEST(MeshShape, InnermostAxisIsConsecutiveRanks) {
  MeshShape m({{"dp", 2}, {"pp", 3}, {"tp", 2}});
  EXPECT_EQ(m.size(), 12);
  EXPECT_EQ(m.str(), "dp=2 x pp=3 x tp=2");
  EXPECT_EQ(m.coords(0), (std::vector<int>{0, 0, 0}));
  EXPECT_EQ(m.coords(1), (std::vector<int>{0, 0, 1}));
  EXPECT_EQ(m.coords(2), (std::vector<int>{0, 1, 0}));
  EXPECT_EQ(m.coords(11), (std::vector<int>{1, 2, 1}));
  for (int r = 0; r < m.size(); ++r) EXPECT_EQ(m.rank_of(m.coords(r)), r);
  EXPECT_EQ(m.axis_group(7, m.axis_index("tp")), (std::vector<int>{6, 7}));
  EXPECT_EQ(m.axis_group(7, m.axis_index("pp")), (std::vector<int>{7, 9, 11}));
  EXPECT_EQ(m.axis_group(7, m.axis_index("dp")), (std::vector<int>{1, 7}));
}

TEST(MeshShape, AxisGroupsPartitionTheRanks) {
  MeshShape m({{"dp", 3}, {"pp", 2}, {"tp", 4}});
  for (int a = 0; a < m.ndim(); ++a) {
    std::set<int> seen;
    std::set<int> ids;
    for (int r = 0; r < m.size(); ++r) {
      const auto g = m.axis_group(r, a);
      EXPECT_EQ(static_cast<int>(g.size()), m.axis_size(a));
      EXPECT_EQ(g[m.coords(r)[a]], r);  // group rank == coordinate
      for (int member : g) EXPECT_EQ(m.axis_group_id(member, a), m.axis_group_id(r, a));
      ids.insert(m.axis_group_id(r, a));
      seen.insert(r);
    }
    EXPECT_EQ(static_cast<int>(ids.size()), m.size() / m.axis_size(a));
  }
}

TEST(MeshShape, ErrorsNameTheAxis) {
  EXPECT_THROW(MeshShape({}), Error);
  EXPECT_THROW(MeshShape({{"dp", 0}}), Error);
  EXPECT_THROW(MeshShape({{"dp", 2}, {"dp", 2}}), Error);
  MeshShape m({{"dp", 2}, {"tp", 2}});
  try {
    m.axis_index("pp");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no axis 'pp'"), std::string::npos);
  }
  EXPECT_THROW(m.coords(4), Error);
}

}  // namespace
}  // namespace loom
