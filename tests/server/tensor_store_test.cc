// TensorStore: lifecycle, handles, budget, states, TTL (fake clock) and
// concurrency, on the CPU device, without gRPC.
#include "server/tensor_store.h"

#include <atomic>
#include <cstring>
#include <memory>
#include <random>
#include <regex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/barrier.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/cpu_device.h"

namespace lossd {
namespace {

using ::testing::HasSubstr;

class FakeClock {
 public:
  absl::Time Now() const {
    absl::MutexLock lock(&mu_);
    return now_;
  }
  void Advance(absl::Duration step) {
    absl::MutexLock lock(&mu_);
    now_ += step;
  }

 private:
  mutable absl::Mutex mu_;
  absl::Time now_ = absl::FromUnixSeconds(1700000000);
};

class TensorStoreTest : public ::testing::Test {
 protected:
  void MakeStore(int64_t budget, absl::Duration ttl = absl::Hours(1)) {
    TensorStore::Options options;
    options.budget_bytes = budget;
    options.ttl = ttl;
    options.clock = [this] { return clock_.Now(); };
    options.remembered_handles = 4;
    store_ = std::make_unique<TensorStore>(&device_, options);
  }

  // Uploads `values` as fp32 [rows, cols] in two appends.
  std::shared_ptr<Tensor> UploadFloats(
      const std::vector<float>& values, int64_t rows, int64_t cols,
      const std::string& tenant = kDefaultTenant) {
    auto pending = store_->Create(tenant, DType::kFloat32, {rows, cols}, "l");
    EXPECT_TRUE(pending.ok()) << pending.status();
    if (!pending.ok()) return nullptr;
    const size_t bytes = values.size() * sizeof(float);
    const size_t half = bytes / 2;
    EXPECT_TRUE((*pending)->Append(values.data(), half).ok());
    EXPECT_TRUE(
        (*pending)
            ->Append(reinterpret_cast<const char*>(values.data()) + half,
                     bytes - half)
            .ok());
    auto tensor = (*pending)->Commit();
    EXPECT_TRUE(tensor.ok()) << tensor.status();
    return tensor.ok() ? *tensor : nullptr;
  }

  std::vector<float> ReadFloats(const Tensor& tensor, float scale = 1.0f,
                                const float* row_scale = nullptr) {
    std::vector<float> out(tensor.elements());
    EXPECT_TRUE(device_
                    .ReadConverted(tensor.data(), DType::kFloat32, 0,
                                   tensor.elements(), tensor.row_length(),
                                   scale, row_scale, out.data(),
                                   DType::kFloat32)
                    .ok());
    return out;
  }

  FakeClock clock_;
  CpuDevice device_{1};
  std::unique_ptr<TensorStore> store_;
};

TEST_F(TensorStoreTest, UploadCommitGetDescribe) {
  MakeStore(1 << 20);
  const std::vector<float> values = {1, 2, 3, 4, 5, 6};
  std::shared_ptr<Tensor> tensor = UploadFloats(values, 2, 3);
  ASSERT_NE(tensor, nullptr);
  EXPECT_TRUE(std::regex_match(tensor->handle(),
                               std::regex("[0-9a-f]{8}-[0-9a-f]{32}")))
      << tensor->handle();
  EXPECT_EQ(tensor->handle().substr(0, 8), store_->instance_id());

  auto got = store_->Get(kDefaultTenant, tensor->handle());
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->get(), tensor.get());
  const TensorRecord info = (*got)->Info();
  EXPECT_EQ(info.dtype, DType::kFloat32);
  EXPECT_EQ(info.shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(info.bytes, 24);
  EXPECT_EQ(info.device, "cpu");
  EXPECT_EQ(info.state, TensorState::kLogits);
  EXPECT_EQ(info.tenant, kDefaultTenant);
  EXPECT_EQ(info.label, "l");
  EXPECT_EQ(info.created, clock_.Now());
  EXPECT_EQ(info.pending_scale, 1.0);
  EXPECT_EQ(ReadFloats(**got), values);

  const StoreStats stats = store_->Stats();
  EXPECT_EQ(stats.used_bytes, 24);
  EXPECT_EQ(stats.tensors, 1);
  ASSERT_EQ(store_->List(kDefaultTenant).size(), 1u);
  EXPECT_TRUE(store_->List("other").empty());
}

TEST_F(TensorStoreTest, HandlesAreDistinct) {
  MakeStore(1 << 20);
  std::set<std::string> handles;
  for (int i = 0; i < 50; ++i) {
    auto tensor = UploadFloats({1.0f}, 1, 1);
    ASSERT_NE(tensor, nullptr);
    handles.insert(tensor->handle());
  }
  EXPECT_EQ(handles.size(), 50u);
}

TEST_F(TensorStoreTest, RejectsBadShapesAndDtypes) {
  MakeStore(1 << 20);
  const std::vector<std::vector<int64_t>> bad_shapes = {
      {},      {1, 2, 3}, {0},
      {-1, 4}, {4, 0},    {int64_t{1} << 40, int64_t{1} << 40}};
  for (const auto& shape : bad_shapes) {
    auto pending = store_->Create(kDefaultTenant, DType::kFloat32, shape, "");
    EXPECT_EQ(pending.status().code(), absl::StatusCode::kInvalidArgument)
        << "shape of " << shape.size() << " dims";
  }
  EXPECT_EQ(
      store_->Create(kDefaultTenant, DType::kInvalid, {4}, "").status().code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store_->Stats().used_bytes, 0);
}

TEST_F(TensorStoreTest, BudgetIsReservedAtCreateAndRolledBack) {
  MakeStore(1000);
  auto first = store_->Create(kDefaultTenant, DType::kFloat32, {100, 2}, "");
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(store_->Stats().used_bytes, 800);
  auto second = store_->Create(kDefaultTenant, DType::kFloat32, {100}, "");
  ASSERT_EQ(second.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(second.status().message(), HasSubstr("requested 400"));
  EXPECT_THAT(second.status().message(), HasSubstr("800 of 1000"));
  first->reset();  // never committed: everything returns
  EXPECT_EQ(store_->Stats().used_bytes, 0);
  EXPECT_EQ(store_->Stats().tensors, 0);
  EXPECT_TRUE(store_->Create(kDefaultTenant, DType::kFloat32, {250}, "").ok());
}

// Scratch (an Evaluate's block buffers) counts against the budget as
// tensors do, until it goes.
TEST_F(TensorStoreTest, ScratchIsChargedToTheBudget) {
  MakeStore(1000);
  auto tensor = store_->Create(kDefaultTenant, DType::kFloat32, {150}, "");
  ASSERT_TRUE(tensor.ok());
  absl::StatusOr<ScratchBuffer> scratch =
      store_->AllocateScratch(kDefaultTenant, 300);
  ASSERT_TRUE(scratch.ok()) << scratch.status();
  EXPECT_NE(scratch->data(), nullptr);
  EXPECT_EQ(scratch->bytes(), 300u);
  EXPECT_EQ(store_->Stats().used_bytes, 900);
  absl::StatusOr<ScratchBuffer> more =
      store_->AllocateScratch(kDefaultTenant, 101);
  ASSERT_EQ(more.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(more.status().message(), HasSubstr("900 of 1000"));
  EXPECT_FALSE(store_->Create(kDefaultTenant, DType::kFloat32, {26}, "").ok());
  *scratch = ScratchBuffer();
  EXPECT_EQ(store_->Stats().used_bytes, 600);
  EXPECT_EQ(store_->AllocateScratch(kDefaultTenant, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(store_->AllocateScratch(kDefaultTenant, 400).ok());
  EXPECT_EQ(store_->Stats().used_bytes, 600);  // the temporary went again
}

TEST_F(TensorStoreTest, ByteCountMustMatchTheHeader) {
  MakeStore(1000);
  auto pending = store_->Create(kDefaultTenant, DType::kInt32, {4}, "");
  ASSERT_TRUE(pending.ok());
  const int32_t data[5] = {1, 2, 3, 4, 5};
  EXPECT_EQ((*pending)->Append(data, 20).code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE((*pending)->Append(data, 12).ok());
  EXPECT_EQ((*pending)->Commit().status().code(),
            absl::StatusCode::kInvalidArgument);
  pending->reset();
  EXPECT_EQ(store_->Stats().used_bytes, 0);
  EXPECT_EQ(store_->Stats().tensors, 0);
}

TEST_F(TensorStoreTest, NotFoundSaysWhy) {
  MakeStore(1 << 20);
  auto tensor = UploadFloats({1, 2}, 1, 2);
  ASSERT_NE(tensor, nullptr);
  const std::string handle = tensor->handle();

  EXPECT_THAT(store_->Get(kDefaultTenant, "").status().message(),
              HasSubstr("empty"));
  EXPECT_THAT(store_->Get(kDefaultTenant, "nonsense").status().message(),
              HasSubstr("malformed"));
  const std::string foreign =
      (store_->instance_id() == "00000000" ? "11111111" : "00000000") +
      handle.substr(8);
  auto status = store_->Get(kDefaultTenant, foreign).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(status.message(), HasSubstr("belongs to instance"));
  EXPECT_THAT(status.message(), HasSubstr(store_->instance_id()));
  // Another tenant's handle is simply unknown to the caller.
  status = store_->Get("other", handle).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(status.message(), HasSubstr("unknown"));
  EXPECT_EQ(store_->Release("other", handle).status().code(),
            absl::StatusCode::kNotFound);

  auto released = store_->Release(kDefaultTenant, handle);
  ASSERT_TRUE(released.ok());
  EXPECT_EQ(*released, 8);
  status = store_->Get(kDefaultTenant, handle).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(status.message(), HasSubstr("released"));
  EXPECT_EQ(store_->Release(kDefaultTenant, handle).status().code(),
            absl::StatusCode::kNotFound);
}

TEST_F(TensorStoreTest, RememberedHandlesAreBounded) {
  MakeStore(1 << 20);
  std::vector<std::string> handles;
  for (int i = 0; i < 6; ++i) {
    auto tensor = UploadFloats({1.0f}, 1, 1);
    ASSERT_NE(tensor, nullptr);
    handles.push_back(tensor->handle());
    ASSERT_TRUE(store_->Release(kDefaultTenant, tensor->handle()).ok());
  }
  // remembered_handles = 4: the oldest two are merely unknown now.
  EXPECT_THAT(store_->Get(kDefaultTenant, handles[0]).status().message(),
              HasSubstr("unknown"));
  EXPECT_THAT(store_->Get(kDefaultTenant, handles[5]).status().message(),
              HasSubstr("released"));
}

TEST_F(TensorStoreTest, MemoryReturnsWhenTheLastUserFinishes) {
  MakeStore(1 << 20);
  auto tensor = UploadFloats({1, 2, 3, 4}, 2, 2);
  ASSERT_NE(tensor, nullptr);
  ReadLease lease = store_->BeginRead(tensor);
  tensor.reset();
  ASSERT_TRUE(store_->Release(kDefaultTenant, lease.tensor()->handle()).ok());
  // Released but still being read: the bytes are still there and held.
  EXPECT_EQ(store_->Stats().tensors, 0);
  EXPECT_EQ(store_->Stats().used_bytes, 16);
  EXPECT_EQ(ReadFloats(*lease.tensor()), (std::vector<float>{1, 2, 3, 4}));
  lease = ReadLease();
  EXPECT_EQ(store_->Stats().used_bytes, 0);
}

TEST_F(TensorStoreTest, IdleTensorsExpireAfterTheTtl) {
  MakeStore(1 << 20, absl::Minutes(10));
  auto idle = UploadFloats({1.0f}, 1, 1);
  auto busy = UploadFloats({2.0f}, 1, 1);
  ASSERT_NE(idle, nullptr);
  ASSERT_NE(busy, nullptr);
  const std::string idle_handle = idle->handle();
  idle.reset();
  ReadLease lease = store_->BeginRead(busy);

  clock_.Advance(absl::Minutes(9));
  EXPECT_EQ(store_->ExpireIdle(), 0);
  clock_.Advance(absl::Minutes(2));
  // Get sweeps lazily; the tensor in use survives.
  auto status = store_->Get(kDefaultTenant, idle_handle).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(status.message(), HasSubstr("expired"));
  EXPECT_TRUE(store_->Get(kDefaultTenant, busy->handle()).ok());
  EXPECT_EQ(store_->Stats().used_bytes, 4);

  // Using a tensor postpones its expiry.
  lease = ReadLease();
  clock_.Advance(absl::Minutes(9));
  EXPECT_EQ(store_->ExpireIdle(), 0);
  clock_.Advance(absl::Minutes(2));
  EXPECT_EQ(store_->ExpireIdle(), 1);
  const std::string busy_handle = busy->handle();
  busy.reset();
  EXPECT_EQ(store_->Stats().used_bytes, 0);
  EXPECT_THAT(store_->Get(kDefaultTenant, busy_handle).status().message(),
              HasSubstr("expired"));
}

TEST_F(TensorStoreTest, ForwardMovesLogitsToGradient) {
  MakeStore(1 << 20);
  auto tensor = UploadFloats({1, 2, 3, 4}, 2, 2);
  ASSERT_NE(tensor, nullptr);
  bool launched = true;
  auto status = store_->RecordGradOutput(tensor, 2.0, {}, false, &launched);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(status.message(), HasSubstr("holds logits"));
  {
    auto lease = store_->BeginForward(tensor, /*in_place=*/true);
    ASSERT_TRUE(lease.ok()) << lease.status();
    lease->FinishInPlace(Reduction::kMean);
  }
  EXPECT_EQ(tensor->state(), TensorState::kGradient);
  auto again = store_->BeginForward(tensor, /*in_place=*/false);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(again.status().message(), HasSubstr("holds a gradient"));
}

TEST_F(TensorStoreTest, DroppedForwardLeaseChangesNothing) {
  MakeStore(1 << 20);
  auto tensor = UploadFloats({1, 2}, 1, 2);
  ASSERT_NE(tensor, nullptr);
  { ASSERT_TRUE(store_->BeginForward(tensor, true).ok()); }
  EXPECT_EQ(tensor->state(), TensorState::kLogits);
  EXPECT_TRUE(store_->BeginForward(tensor, true).ok());
}

TEST_F(TensorStoreTest, InPlaceForwardFailsWhileRead) {
  MakeStore(1 << 20);
  auto tensor = UploadFloats({1, 2}, 1, 2);
  ASSERT_NE(tensor, nullptr);
  ReadLease read = store_->BeginRead(tensor);
  auto in_place = store_->BeginForward(tensor, true);
  EXPECT_EQ(in_place.status().code(), absl::StatusCode::kFailedPrecondition);
  // Reading the logits for an out-of-place gradient is fine.
  EXPECT_TRUE(store_->BeginForward(tensor, false).ok());
}

TEST_F(TensorStoreTest, BackwardIsIdempotentAndValidated) {
  MakeStore(1 << 20);
  auto tensor = UploadFloats({1, 2, 3, 4, 5, 6}, 3, 2);
  ASSERT_NE(tensor, nullptr);
  {
    auto lease = store_->BeginForward(tensor, true);
    ASSERT_TRUE(lease.ok());
    lease->FinishInPlace(Reduction::kMean);
  }
  bool launched = true;
  ASSERT_TRUE(store_->RecordGradOutput(tensor, 3.0, {}, false, &launched).ok());
  EXPECT_FALSE(launched);
  ASSERT_TRUE(store_->RecordGradOutput(tensor, 3.0, {}, false, &launched).ok());
  EXPECT_EQ(tensor->Info().pending_scale, 3.0);
  EXPECT_EQ(store_->BeginRead(tensor).view().scale, 3.0);

  EXPECT_EQ(
      store_->RecordGradOutput(tensor, 1.0, {1, 2, 3}, false, &launched).code(),
      absl::StatusCode::kInvalidArgument);  // reduction is not NONE
  EXPECT_EQ(store_->RecordGradOutput(tensor, std::nan(""), {}, false, &launched)
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(tensor->Info().pending_scale, 3.0);
}

TEST_F(TensorStoreTest, PerTokenBackwardAndMaterialize) {
  MakeStore(1 << 20);
  auto tensor = UploadFloats({1, 2, 3, 4, 5, 6}, 3, 2);
  ASSERT_NE(tensor, nullptr);
  {
    auto lease = store_->BeginForward(tensor, true);
    ASSERT_TRUE(lease.ok());
    lease->FinishInPlace(Reduction::kNone);
  }
  bool launched = false;
  EXPECT_EQ(
      store_->RecordGradOutput(tensor, 1.0, {1, 2}, false, &launched).code(),
      absl::StatusCode::kInvalidArgument);  // 2 values for 3 rows
  ASSERT_TRUE(
      store_->RecordGradOutput(tensor, 1.0, {1, 2, 3}, false, &launched).ok());
  EXPECT_TRUE(tensor->Info().pending_token_scale);
  ASSERT_TRUE(
      store_->RecordGradOutput(tensor, 1.0, {2, 0, -1}, true, &launched).ok());
  EXPECT_TRUE(launched);
  EXPECT_EQ(ReadFloats(*tensor), (std::vector<float>{2, 4, 0, 0, -5, -6}));
  EXPECT_FALSE(tensor->Info().pending_token_scale);
  EXPECT_EQ(store_->BeginRead(tensor).view().row_scale.size(), 0u);
  // The same factor again is a no-op; another one cannot be applied.
  ASSERT_TRUE(
      store_->RecordGradOutput(tensor, 1.0, {2, 0, -1}, true, &launched).ok());
  EXPECT_FALSE(launched);
  EXPECT_EQ(ReadFloats(*tensor), (std::vector<float>{2, 4, 0, 0, -5, -6}));
  EXPECT_EQ(
      store_->RecordGradOutput(tensor, 1.0, {1, 1, 1}, true, &launched).code(),
      absl::StatusCode::kFailedPrecondition);
}

TEST_F(TensorStoreTest, TwoForwardsRacingExactlyOneSucceeds) {
  MakeStore(1 << 20);
  constexpr int kRounds = 200;
  for (int round = 0; round < kRounds; ++round) {
    auto tensor = UploadFloats({1, 2}, 1, 2);
    ASSERT_NE(tensor, nullptr);
    absl::Barrier* barrier = new absl::Barrier(2);
    std::atomic<int> succeeded{0};
    std::atomic<int> refused{0};
    auto race = [&] {
      if (barrier->Block()) delete barrier;
      auto lease = store_->BeginForward(tensor, true);
      if (lease.ok()) {
        lease->FinishInPlace(Reduction::kMean);
        ++succeeded;
      } else if (lease.status().code() ==
                 absl::StatusCode::kFailedPrecondition) {
        ++refused;
      }
    };
    std::thread a(race);
    std::thread b(race);
    a.join();
    b.join();
    ASSERT_EQ(succeeded.load(), 1) << "round " << round;
    ASSERT_EQ(refused.load(), 1) << "round " << round;
    ASSERT_EQ(tensor->state(), TensorState::kGradient);
    ASSERT_TRUE(store_->Release(kDefaultTenant, tensor->handle()).ok());
  }
}

TEST_F(TensorStoreTest, ParallelWorkOnDifferentHandles) {
  MakeStore(int64_t{1} << 30);
  constexpr int kThreads = 8;
  constexpr int kRounds = 20;
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(seed + t);
      std::uniform_real_distribution<float> dist(-4.0f, 4.0f);
      for (int round = 0; round < kRounds; ++round) {
        const int64_t rows = 1 + rng() % 8;
        const int64_t vocab = 1 + rng() % 33;
        std::vector<float> logits(rows * vocab);
        for (float& x : logits) x = dist(rng);
        std::vector<int64_t> targets(rows);
        for (int64_t& y : targets) y = rng() % vocab;
        auto pending =
            store_->Create(kDefaultTenant, DType::kFloat32, {rows, vocab}, "");
        if (!pending.ok() ||
            !(*pending)->Append(logits.data(), logits.size() * 4).ok()) {
          ++failures;
          continue;
        }
        auto tensor = (*pending)->Commit();
        if (!tensor.ok()) {
          ++failures;
          continue;
        }
        auto lease = store_->BeginForward(*tensor, true);
        if (!lease.ok()) {
          ++failures;
          continue;
        }
        CrossEntropyArgs args;
        args.rows = rows;
        args.vocab = vocab;
        args.row_stride = vocab;
        args.logits = (*tensor)->data();
        args.targets = targets.data();
        args.gradient = (*tensor)->data();
        CrossEntropyResult result;
        if (!device_.CrossEntropy(args, &result).ok() ||
            result.valid_tokens != rows) {
          ++failures;
        }
        lease->FinishInPlace(Reduction::kMean);
        if (!store_->Release(kDefaultTenant, (*tensor)->handle()).ok()) {
          ++failures;
        }
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(store_->Stats().tensors, 0);
  EXPECT_EQ(store_->Stats().used_bytes, 0);
}

TEST_F(TensorStoreTest, ReleaseDuringAConcurrentRead) {
  MakeStore(1 << 24);
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  std::vector<float> values(1 << 16);
  for (float& v : values) v = static_cast<float>(rng() % 1000);
  auto tensor = UploadFloats(values, 256, 256);
  ASSERT_NE(tensor, nullptr);
  ReadLease lease = store_->BeginRead(tensor);
  tensor.reset();
  absl::Notification half_read;
  std::vector<float> out(values.size());
  std::thread reader([&] {
    const Tensor& t = *lease.tensor();
    const int64_t half = t.elements() / 2;
    ASSERT_TRUE(device_
                    .ReadConverted(t.data(), DType::kFloat32, 0, half,
                                   t.row_length(), 1.0f, nullptr, out.data(),
                                   DType::kFloat32)
                    .ok());
    half_read.Notify();
    ASSERT_TRUE(device_
                    .ReadConverted(t.data(), DType::kFloat32, half,
                                   t.elements() - half, t.row_length(), 1.0f,
                                   nullptr, out.data() + half, DType::kFloat32)
                    .ok());
  });
  half_read.WaitForNotification();
  ASSERT_TRUE(store_->Release(kDefaultTenant, lease.tensor()->handle()).ok());
  reader.join();
  EXPECT_EQ(out, values);
  lease = ReadLease();
  EXPECT_EQ(store_->Stats().used_bytes, 0);
}

TEST_F(TensorStoreTest, MalformedHandlesAreInvalidBeforeAnyLookup) {
  MakeStore(1 << 20);
  auto tensor = UploadFloats({1, 2}, 1, 2);
  ASSERT_NE(tensor, nullptr);
  for (const std::string& bad :
       {std::string(), std::string("not-a-handle"),
        tensor->handle().substr(0, 40), tensor->handle() + "0",
        std::string(1 << 20, 'a')}) {
    SCOPED_TRACE(bad.substr(0, 64));
    const absl::Status status = store_->Get(kDefaultTenant, bad).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_LT(status.message().size(), 400u);
    EXPECT_EQ(store_->Release(kDefaultTenant, bad).status().code(),
              absl::StatusCode::kInvalidArgument);
  }
  EXPECT_EQ(store_->Stats().tensors, 1);
}

// Label bytes and bookkeeping count against the tenant's byte quota: many
// one-element tensors with long labels stop at the quota instead of growing
// the host's memory unseen.
TEST_F(TensorStoreTest, QuotaChargesLabelsAndBookkeeping) {
  TensorStore::Options options;
  options.budget_bytes = 1 << 20;
  options.clock = [this] { return clock_.Now(); };
  TenantLimits limits;
  // Room for 4 tensors with 1000-byte labels and one without a label.
  limits.max_bytes = 4 * (4 + 1000 + kTensorBookkeepingBytes) + 1500;
  options.quotas = std::make_shared<TenantQuotas>(limits);
  store_ = std::make_unique<TensorStore>(&device_, options);
  const std::string label(1000, 'L');
  const int64_t per_tensor = 4 + 1000 + kTensorBookkeepingBytes;
  std::vector<std::unique_ptr<PendingTensor>> held;
  for (int i = 0; i < 4; ++i) {
    auto pending = store_->Create("t", DType::kFloat32, {1}, label);
    ASSERT_TRUE(pending.ok()) << i << ": " << pending.status();
    held.push_back(*std::move(pending));
  }
  EXPECT_EQ(options.quotas->UsageOf("t").bytes, 4 * per_tensor);
  // A fifth passes the quota: refused, naming what a tensor counts.
  auto over = store_->Create("t", DType::kFloat32, {1}, label);
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(over.status().message(),
              HasSubstr("its bytes (4), its label's (1000) and 1024 bytes of "
                        "bookkeeping"));
  // Without the label it fits.
  EXPECT_TRUE(store_->Create("t", DType::kFloat32, {1}, "").ok());
  held.clear();
  EXPECT_EQ(options.quotas->UsageOf("t").bytes, 0);
  // The device budget still counts tensor bytes only.
  EXPECT_EQ(store_->Stats().used_bytes, 0);
}

// Working memory an RPC holds (scratch, a kernel's workspace) counts against
// its tenant's byte quota before the budget: past the quota it is refused,
// the budget untouched, and another tenant is not affected.
TEST_F(TensorStoreTest, ScratchAndWorkspaceAreChargedToTheTenantsQuota) {
  TensorStore::Options options;
  options.budget_bytes = 1 << 20;
  options.clock = [this] { return clock_.Now(); };
  TenantLimits limits;
  limits.max_bytes = 1000;
  options.quotas = std::make_shared<TenantQuotas>(limits);
  store_ = std::make_unique<TensorStore>(&device_, options);
  absl::StatusOr<ScratchBuffer> scratch = store_->AllocateScratch("t", 600);
  ASSERT_TRUE(scratch.ok()) << scratch.status();
  absl::StatusOr<ScratchBuffer> workspace =
      store_->ChargeWorkspace("t", 300, "the workspace");
  ASSERT_TRUE(workspace.ok()) << workspace.status();
  EXPECT_EQ(options.quotas->UsageOf("t").bytes, 900);
  EXPECT_EQ(store_->Stats().used_bytes, 900);
  absl::StatusOr<ScratchBuffer> over = store_->AllocateScratch("t", 101);
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(over.status().message(), HasSubstr("tenant 't' byte quota"));
  absl::StatusOr<ScratchBuffer> named =
      store_->ChargeWorkspace("t", 101, "the workspace");
  EXPECT_EQ(named.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(named.status().message(), HasSubstr("the workspace: tenant"));
  EXPECT_EQ(store_->Stats().used_bytes, 900);  // nothing reserved for those
  EXPECT_TRUE(store_->AllocateScratch("u", 1000).ok());  // another tenant
  *scratch = ScratchBuffer();
  *workspace = ScratchBuffer();
  EXPECT_EQ(options.quotas->UsageOf("t").bytes, 0);
  EXPECT_EQ(store_->Stats().used_bytes, 0);
}

TEST_F(TensorStoreTest, ListPagesSeeEveryTensorOnceInOrder) {
  MakeStore(1 << 20);
  std::vector<std::string> handles;
  for (int i = 0; i < 23; ++i) {
    // Runs of equal creation times: ties are ordered by handle.
    if (i % 4 == 0) clock_.Advance(absl::Seconds(1));
    auto tensor = UploadFloats({1}, 1, 1);
    ASSERT_NE(tensor, nullptr);
    handles.push_back(tensor->handle());
  }
  UploadFloats({1}, 1, 1, "other");
  const std::vector<TensorRecord> all = store_->List(kDefaultTenant);
  ASSERT_EQ(all.size(), handles.size());
  std::vector<std::string> paged;
  ListPosition after;
  int pages = 0;
  bool more = true;
  while (more) {
    const std::vector<TensorRecord> page =
        store_->List(kDefaultTenant, after, 5, &more);
    ++pages;
    ASSERT_LE(page.size(), 5u);
    for (const TensorRecord& record : page) paged.push_back(record.handle);
    if (page.empty()) break;
    after.created_unix_nanos = absl::ToUnixNanos(page.back().created);
    after.handle = page.back().handle;
  }
  EXPECT_EQ(pages, 5);
  ASSERT_EQ(paged.size(), all.size());
  for (size_t i = 0; i < all.size(); ++i) EXPECT_EQ(paged[i], all[i].handle);
  EXPECT_EQ(std::set<std::string>(paged.begin(), paged.end()),
            std::set<std::string>(handles.begin(), handles.end()));
  for (size_t i = 1; i < all.size(); ++i) {
    EXPECT_TRUE(all[i - 1].created < all[i].created ||
                (all[i - 1].created == all[i].created &&
                 all[i - 1].handle < all[i].handle));
  }
}

}  // namespace
}  // namespace lossd
