// One owner of a CUDA library handle (an event, a cuBLASLt descriptor), so
// that host code with early returns destroys what it made on every path
// instead of calling the destroy function by hand before each return.
#ifndef LOSSD_KERNELS_CUDA_UNIQUE_HANDLE_H_
#define LOSSD_KERNELS_CUDA_UNIQUE_HANDLE_H_

namespace lossd {

// Holds a handle of pointer type H (nullptr: none) and passes it to Destroy
// (cudaEventDestroy, cublasLtMatrixLayoutDestroy, ...) when it goes. Destroy's
// status is dropped: a destructor has no one to report it to, and the handle
// is gone either way. Neither copied nor moved: a handle has one owner, which
// stays where it was made. (std::unique_ptr with a deleter would do but for
// put(): the CUDA create functions write the handle through a pointer.)
template <typename H, auto Destroy>
class UniqueHandle {
 public:
  UniqueHandle() = default;
  UniqueHandle(const UniqueHandle&) = delete;
  UniqueHandle& operator=(const UniqueHandle&) = delete;
  ~UniqueHandle() { reset(); }

  H get() const { return handle_; }

  // Where a create function writes the new handle (cudaEventCreate(
  // event.put())); the one held before is destroyed first.
  H* put() {
    reset();
    return &handle_;
  }

  void reset() {
    if (handle_ != nullptr) Destroy(handle_);
    handle_ = nullptr;
  }

 private:
  H handle_ = nullptr;
};

}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_UNIQUE_HANDLE_H_
