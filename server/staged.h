// Host bytes a request carries (inline targets, per-row factors) made visible
// to the device for one computation.
#ifndef LOSSD_SERVER_STAGED_H_
#define LOSSD_SERVER_STAGED_H_

#include <cstddef>

#include "absl/status/status.h"
#include "common/status_macros.h"
#include "server/device.h"

namespace lossd {

// The bytes themselves on a host-accessible device, else a device copy freed
// on destruction. Not thread-safe: one owner.
class Staged {
 public:
  Staged() = default;
  Staged(const Staged&) = delete;
  Staged& operator=(const Staged&) = delete;
  ~Staged() {
    if (device_ != nullptr) device_->Free(owned_, bytes_);
  }

  // Stages `bytes` bytes at `host` (read during the call only when a copy is
  // made; borrowed otherwise). INTERNAL or RESOURCE_EXHAUSTED from the device.
  absl::Status Stage(Device* device, const void* host, size_t bytes) {
    if (device->host_accessible() || bytes == 0) {
      pointer_ = host;
      return absl::OkStatus();
    }
    ASSIGN_OR_RETURN(owned_, device->Allocate(bytes));
    device_ = device;
    bytes_ = bytes;
    pointer_ = owned_;
    return device->CopyFromHost(owned_, 0, host, bytes);
  }
  const void* get() const { return pointer_; }

 private:
  Device* device_ = nullptr;
  void* owned_ = nullptr;
  size_t bytes_ = 0;
  const void* pointer_ = nullptr;
};

}  // namespace lossd

#endif  // LOSSD_SERVER_STAGED_H_
