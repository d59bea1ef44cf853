// A kernel that writes through a bad pointer: the illegal-address fault that
// leaves the process's CUDA context unusable (a sticky error), for
// gpu_fatal_test.cc.
#include <cuda_runtime.h>

#include "tests/e2e/fault_kernel.h"

namespace lossd {
namespace e2e_test {
namespace {

__global__ void WriteThroughBadPointer(int* p) { *p = 1; }

}  // namespace

int TriggerIllegalAddress() {
  WriteThroughBadPointer<<<1, 1>>>(reinterpret_cast<int*>(8));
  return static_cast<int>(cudaDeviceSynchronize());
}

}  // namespace e2e_test
}  // namespace lossd
