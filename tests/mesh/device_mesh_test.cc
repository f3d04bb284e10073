#include "mesh/device_mesh.h"

#include <gtest/gtest.h>

#include "base/error.h"
#include "harness/thread_ranks.h"

namespace loom {
namespace {

TEST(DeviceMesh, AxisCommunicatorsMatchTheMeshGroups) {
  testing::run_on_thread_ranks(8, [](Communicator& world) {
    DeviceMesh mesh(world, MeshShape({{"dp", 2}, {"pp", 2}, {"tp", 2}}));
    for (const char* axis : {"dp", "pp", "tp"}) {
      Communicator& c = mesh.axis(axis);
      ASSERT_EQ(c.size(), 2) << axis;
      EXPECT_EQ(c.rank(), mesh.coord(axis)) << axis;
      // The sum of world ranks over the axis group equals the mesh arithmetic's group.
      Tensor t = Tensor::empty({1}, DType::kI64);
      t.data<int64_t>()[0] = world.rank();
      c.all_reduce(t);
      int64_t expected = 0;
      const int a = mesh.shape().axis_index(axis);
      for (int r : mesh.shape().axis_group(world.rank(), a)) expected += r;
      EXPECT_EQ(t.data<int64_t>()[0], expected) << axis << " on rank " << world.rank();
    }
    // tp is innermost: its groups are consecutive ranks.
    EXPECT_EQ(mesh.shape().axis_group(world.rank(), 2)[0], world.rank() / 2 * 2);
  });
}

TEST(DeviceMesh, WrongWorldSizeIsAnError) {
  testing::run_on_thread_ranks(3, [](Communicator& world) {
    EXPECT_THROW(DeviceMesh(world, MeshShape({{"dp", 2}, {"tp", 2}})), Error);
  });
}

}  // namespace
}  // namespace loom
