// Fault injection for the GPU tests: no CUDA headers, so that plain C++ test
// files can call it.
#ifndef LOSSD_TESTS_E2E_FAULT_KERNEL_H_
#define LOSSD_TESTS_E2E_FAULT_KERNEL_H_

namespace lossd {
namespace e2e_test {

// Runs a kernel that stores to address 8 on the current device and waits for
// it. Returns the cudaError_t of the wait (700, cudaErrorIllegalAddress, on
// the H200). Every later CUDA call of the process fails with it too.
int TriggerIllegalAddress();

}  // namespace e2e_test
}  // namespace lossd

#endif  // LOSSD_TESTS_E2E_FAULT_KERNEL_H_
