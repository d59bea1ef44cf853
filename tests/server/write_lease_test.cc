// TensorStore's exclusive writes (BeginWrite), non-waiting reads
// (TryBeginRead) and in-place overwrites (Overwrite): who refuses whom, and
// that an overwrite keeps the handle and the memory. CPU device, no gRPC.
#include <cstring>
#include <memory>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/cpu_device.h"
#include "server/tensor_store.h"

namespace lossd {
namespace {

class WriteLeaseTest : public ::testing::Test {
 protected:
  WriteLeaseTest() {
    TensorStore::Options options;
    options.budget_bytes = 1 << 20;
    store_ = std::make_unique<TensorStore>(&device_, options);
  }

  std::shared_ptr<Tensor> Floats(const std::vector<float>& values) {
    auto pending =
        store_->Create(kDefaultTenant, DType::kFloat32,
                       {static_cast<int64_t>(values.size())}, "values");
    EXPECT_TRUE(pending.ok()) << pending.status();
    EXPECT_TRUE((*pending)->Append(values.data(), values.size() * 4).ok());
    auto tensor = (*pending)->Commit();
    EXPECT_TRUE(tensor.ok()) << tensor.status();
    return *tensor;
  }

  std::vector<float> Read(const Tensor& tensor) {
    std::vector<float> values(tensor.elements());
    std::memcpy(values.data(), tensor.data(), tensor.bytes());
    return values;
  }

  CpuDevice device_{1};
  std::unique_ptr<TensorStore> store_;
};

TEST_F(WriteLeaseTest, OverwriteKeepsHandleMemoryAndLabel) {
  std::shared_ptr<Tensor> tensor = Floats({1, 2, 3});
  const int64_t used = store_->Stats().used_bytes;
  auto pending =
      store_->Overwrite(kDefaultTenant, tensor->handle(), DType::kFloat32, {3});
  ASSERT_TRUE(pending.ok()) << pending.status();
  EXPECT_EQ(store_->Stats().used_bytes, used);  // nothing reserved
  const std::vector<float> updated = {7, 8, 9};
  ASSERT_TRUE((*pending)->Append(updated.data(), 12).ok());
  auto committed = (*pending)->Commit();
  ASSERT_TRUE(committed.ok()) << committed.status();
  EXPECT_EQ(committed->get(), tensor.get());
  EXPECT_EQ(tensor->Info().label, "values");
  EXPECT_EQ(Read(*tensor), updated);
  EXPECT_EQ(store_->Stats().tensors, 1);
  EXPECT_EQ(store_->Stats().used_bytes, used);
}

TEST_F(WriteLeaseTest, OverwriteOfAnotherDtypeOrShapeIsRefused) {
  std::shared_ptr<Tensor> tensor = Floats({1, 2, 3});
  auto shape =
      store_->Overwrite(kDefaultTenant, tensor->handle(), DType::kFloat32, {4});
  EXPECT_EQ(shape.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(shape.status().message()),
              ::testing::HasSubstr("float32 [3]"));
  auto dtype =
      store_->Overwrite(kDefaultTenant, tensor->handle(), DType::kInt32, {3});
  EXPECT_EQ(dtype.status().code(), absl::StatusCode::kInvalidArgument);
  auto other =
      store_->Overwrite("other", tensor->handle(), DType::kFloat32, {3});
  EXPECT_EQ(other.status().code(), absl::StatusCode::kNotFound);
  // None of them left a write behind.
  EXPECT_TRUE(store_->BeginWrite(tensor).ok());
}

TEST_F(WriteLeaseTest, ReadersAndWritersRefuseEachOther) {
  std::shared_ptr<Tensor> tensor = Floats({1, 2, 3});
  {
    ReadLease reading = store_->BeginRead(tensor);
    EXPECT_EQ(store_->BeginWrite(tensor).status().code(),
              absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(
        store_
            ->Overwrite(kDefaultTenant, tensor->handle(), DType::kFloat32, {3})
            .status()
            .code(),
        absl::StatusCode::kFailedPrecondition);
    EXPECT_TRUE(store_->TryBeginRead(tensor).ok());  // readers share
  }
  {
    auto writing = store_->BeginWrite(tensor);
    ASSERT_TRUE(writing.ok());
    EXPECT_EQ(store_->TryBeginRead(tensor).status().code(),
              absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(store_->BeginWrite(tensor).status().code(),
              absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(store_->BeginForward(tensor, false).status().code(),
              absl::StatusCode::kFailedPrecondition);
  }
  {
    // An abandoned overwrite ends its write; the tensor stays.
    auto pending = store_->Overwrite(kDefaultTenant, tensor->handle(),
                                     DType::kFloat32, {3});
    ASSERT_TRUE(pending.ok());
    EXPECT_EQ(store_->TryBeginRead(tensor).status().code(),
              absl::StatusCode::kFailedPrecondition);
  }
  EXPECT_TRUE(store_->TryBeginRead(tensor).ok());
  EXPECT_TRUE(store_->Get(kDefaultTenant, tensor->handle()).ok());
}

TEST_F(WriteLeaseTest, OverwriteTurnsAGradientBackIntoValues) {
  std::shared_ptr<Tensor> tensor = Floats({1, 2, 3});
  {
    auto lease = store_->BeginForward(tensor, /*in_place=*/true);
    ASSERT_TRUE(lease.ok());
    lease->FinishInPlace(Reduction::kMean);
  }
  bool launched = false;
  ASSERT_TRUE(store_->RecordGradOutput(tensor, 2.0, {}, false, &launched).ok());
  EXPECT_EQ(tensor->state(), TensorState::kGradient);
  auto pending =
      store_->Overwrite(kDefaultTenant, tensor->handle(), DType::kFloat32, {3});
  ASSERT_TRUE(pending.ok()) << pending.status();
  const std::vector<float> values = {4, 5, 6};
  ASSERT_TRUE((*pending)->Append(values.data(), 12).ok());
  ASSERT_TRUE((*pending)->Commit().ok());
  EXPECT_EQ(tensor->state(), TensorState::kLogits);
  EXPECT_EQ(tensor->Info().pending_scale, 1.0);
  EXPECT_TRUE(store_->BeginForward(tensor, true).ok());
}

}  // namespace
}  // namespace lossd
