// UniqueHandle (kernels/cuda/unique_handle.h) on the CPU, over a fake handle
// type: the CUDA host code relies on it to destroy each event and cuBLASLt
// descriptor exactly once, on every path.
#include "kernels/cuda/unique_handle.h"

#include <vector>

#include "gtest/gtest.h"

namespace lossd {
namespace {

struct FakeObject {
  int id = 0;
};
using FakeHandle = FakeObject*;

std::vector<int>& Destroyed() {
  static std::vector<int> destroyed;
  return destroyed;
}

// Shaped like the CUDA destroy functions: takes the handle, returns a status.
int DestroyFake(FakeHandle handle) {
  Destroyed().push_back(handle->id);
  return 0;
}

using FakeUniqueHandle = UniqueHandle<FakeHandle, DestroyFake>;

class UniqueHandleTest : public ::testing::Test {
 protected:
  void SetUp() override { Destroyed().clear(); }
};

TEST_F(UniqueHandleTest, AnEmptyHolderDestroysNothing) {
  { FakeUniqueHandle empty; }
  EXPECT_TRUE(Destroyed().empty());
}

TEST_F(UniqueHandleTest, TheHandleIsDestroyedOnceWithItsHolder) {
  FakeObject object{7};
  {
    FakeUniqueHandle holder;
    *holder.put() = &object;
    EXPECT_EQ(holder.get(), &object);
    EXPECT_TRUE(Destroyed().empty());
  }
  EXPECT_EQ(Destroyed(), std::vector<int>{7});
}

TEST_F(UniqueHandleTest, PutDestroysTheHandleHeldBefore) {
  FakeObject first{1};
  FakeObject second{2};
  {
    FakeUniqueHandle holder;
    *holder.put() = &first;
    FakeHandle* slot = holder.put();
    EXPECT_EQ(*slot, nullptr);
    EXPECT_EQ(Destroyed(), std::vector<int>{1});
    *slot = &second;
  }
  EXPECT_EQ(Destroyed(), (std::vector<int>{1, 2}));
}

TEST_F(UniqueHandleTest, ResetDestroysAtOnceAndLeavesItEmpty) {
  FakeObject object{3};
  FakeUniqueHandle holder;
  *holder.put() = &object;
  holder.reset();
  EXPECT_EQ(holder.get(), nullptr);
  holder.reset();
  EXPECT_EQ(Destroyed(), std::vector<int>{3});
}

// As the timing events of a call: the second create may fail, and each
// holder destroys only what it holds.
TEST_F(UniqueHandleTest, AnArrayDestroysWhatWasMadeOnly) {
  FakeObject start{4};
  {
    FakeUniqueHandle timing[2];
    *timing[0].put() = &start;
    timing[1].put();  // a create that failed writes nothing
  }
  EXPECT_EQ(Destroyed(), std::vector<int>{4});
}

}  // namespace
}  // namespace lossd
