// TensorStore's upload idempotency keys: a key names the tensor its upload
// committed, per tenant, for that tensor's life; a claimed key refuses a
// second upload. On the CPU device, without gRPC.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/cpu_device.h"
#include "server/tensor_store.h"

namespace lossd {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kBudget = 1 << 20;

class UploadKeyStoreTest : public ::testing::Test {
 protected:
  UploadKeyStoreTest() {
    TensorStore::Options options;
    options.budget_bytes = kBudget;
    store_ = std::make_unique<TensorStore>(&device_, options);
  }

  absl::StatusOr<std::unique_ptr<PendingTensor>> Create(
      const std::string& tenant, const std::string& key,
      std::vector<int64_t> shape = {4}, const std::string& label = "l") {
    return store_->Create(tenant, DType::kFloat32, std::move(shape), label,
                          TensorState::kLogits, key);
  }

  // Creates, fills and commits fp32 [4] under `key`.
  std::shared_ptr<Tensor> Upload(const std::string& tenant,
                                 const std::string& key) {
    auto pending = Create(tenant, key);
    EXPECT_TRUE(pending.ok()) << pending.status();
    if (!pending.ok()) return nullptr;
    const std::vector<float> values = {1, 2, 3, 4};
    EXPECT_TRUE((*pending)->Append(values.data(), 16).ok());
    auto tensor = (*pending)->Commit();
    EXPECT_TRUE(tensor.ok()) << tensor.status();
    return tensor.ok() ? *tensor : nullptr;
  }

  absl::StatusOr<std::shared_ptr<Tensor>> Find(const std::string& tenant,
                                               const std::string& key,
                                               std::vector<int64_t> shape = {4},
                                               const std::string& label = "l") {
    return store_->FindUpload(tenant, key, DType::kFloat32, shape, label);
  }

  CpuDevice device_{1};
  std::unique_ptr<TensorStore> store_;
};

TEST_F(UploadKeyStoreTest, TheKeyNamesTheCommittedTensor) {
  auto none = Find("a", "k1");
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_EQ(*none, nullptr);
  const std::shared_ptr<Tensor> stored = Upload("a", "k1");
  ASSERT_NE(stored, nullptr);
  const int64_t used = store_->Stats().used_bytes;
  auto found = Find("a", "k1");
  ASSERT_TRUE(found.ok()) << found.status();
  ASSERT_NE(*found, nullptr);
  EXPECT_EQ((*found)->handle(), stored->handle());
  EXPECT_EQ(store_->Stats().used_bytes, used);
  EXPECT_EQ(store_->Stats().tensors, 1);
  // A second upload under the key is refused, not stored.
  auto again = Create("a", "k1");
  EXPECT_EQ(again.status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(store_->Stats().used_bytes, used);
}

TEST_F(UploadKeyStoreTest, AnotherHeaderUnderTheKeyIsAlreadyExists) {
  const std::shared_ptr<Tensor> stored = Upload("a", "k1");
  ASSERT_NE(stored, nullptr);
  auto shape = Find("a", "k1", {2});
  EXPECT_EQ(shape.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(shape.status().message(), HasSubstr(stored->handle()));
  EXPECT_THAT(shape.status().message(), HasSubstr("float32 [4]"));
  EXPECT_THAT(shape.status().message(), HasSubstr("float32 [2]"));
  auto label = Find("a", "k1", {4}, "other");
  EXPECT_EQ(label.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(label.status().message(), HasSubstr("label 'other'"));
}

TEST_F(UploadKeyStoreTest, KeysArePerTenant) {
  const std::shared_ptr<Tensor> mine = Upload("a", "shared-key");
  ASSERT_NE(mine, nullptr);
  auto theirs_before = Find("b", "shared-key");
  ASSERT_TRUE(theirs_before.ok()) << theirs_before.status();
  EXPECT_EQ(*theirs_before, nullptr);
  const std::shared_ptr<Tensor> theirs = Upload("b", "shared-key");
  ASSERT_NE(theirs, nullptr);
  EXPECT_NE(theirs->handle(), mine->handle());
  EXPECT_EQ(theirs->tenant(), "b");
  EXPECT_EQ((*Find("a", "shared-key"))->handle(), mine->handle());
  EXPECT_EQ((*Find("b", "shared-key"))->handle(), theirs->handle());
}

TEST_F(UploadKeyStoreTest, AnUploadInFlightHoldsTheKey) {
  auto first = Create("a", "k1");
  ASSERT_TRUE(first.ok()) << first.status();
  const int64_t used = store_->Stats().used_bytes;
  // In flight: nothing to answer with, and a second upload is refused.
  auto found = Find("a", "k1");
  ASSERT_TRUE(found.ok());
  EXPECT_EQ(*found, nullptr);
  auto second = Create("a", "k1");
  EXPECT_EQ(second.status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(second.status().message(), HasSubstr("in flight"));
  EXPECT_EQ(store_->Stats().used_bytes, used);
  // Dropped uncommitted: the key is free again.
  first->reset();
  auto third = Create("a", "k1");
  EXPECT_TRUE(third.ok()) << third.status();
}

TEST_F(UploadKeyStoreTest, AFailedCreateFreesTheKey) {
  auto too_big = Create("a", "k1", {kBudget});
  EXPECT_EQ(too_big.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(Create("a", "k1").ok());
}

TEST_F(UploadKeyStoreTest, AReleasedTensorTakesItsKeyWithIt) {
  const std::shared_ptr<Tensor> stored = Upload("a", "k1");
  ASSERT_NE(stored, nullptr);
  ASSERT_TRUE(store_->Release("a", stored->handle()).ok());
  auto found = Find("a", "k1");
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_EQ(*found, nullptr);
  const std::shared_ptr<Tensor> again = Upload("a", "k1");
  ASSERT_NE(again, nullptr);
  EXPECT_NE(again->handle(), stored->handle());
}

TEST_F(UploadKeyStoreTest, NoKeyIsNoClaim) {
  EXPECT_NE(Upload("a", ""), nullptr);
  EXPECT_NE(Upload("a", ""), nullptr);
  EXPECT_EQ(store_->Stats().tensors, 2);
}

}  // namespace
}  // namespace lossd
