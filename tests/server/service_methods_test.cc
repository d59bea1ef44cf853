// LossdService::MethodIndex: the raw Upload and Evaluate handlers are
// installed by the methods' names; the indices must be the ones gRPC's
// generated service gives them (the proto's order).
#include <iterator>

#include "gtest/gtest.h"
#include "server/service.h"

namespace lossd {
namespace {

TEST(MethodIndexTest, TheProtosOrder) {
  // The order of the rpcs in lossd.v1.Lossd, as the generated service adds
  // them (and as the handlers were once installed by number).
  const char* const methods[] = {"Upload",   "Download", "Describe",
                                 "List",     "Release",  "Forward",
                                 "Backward", "Evaluate", "GetServerInfo"};
  for (int i = 0; i < static_cast<int>(std::size(methods)); ++i) {
    EXPECT_EQ(LossdService::MethodIndex(methods[i]), i) << methods[i];
  }
}

TEST(MethodIndexTest, UnknownMethods) {
  EXPECT_EQ(LossdService::MethodIndex("upload"), -1);
  EXPECT_EQ(LossdService::MethodIndex(""), -1);
  EXPECT_EQ(LossdService::MethodIndex("/lossd.v1.Lossd/Upload"), -1);
}

}  // namespace
}  // namespace lossd
