// The element types and tensor states of lossd, as client, server and kernels
// all name them. Plain C++ with standard headers only, so that .cu files can
// include it too.
#ifndef LOSSD_COMMON_DTYPE_H_
#define LOSSD_COMMON_DTYPE_H_

#include <cstddef>

namespace lossd {

// Element types of the tensors lossd stores. Values match lossd.v1.DType in the
// proto.
enum class DType : int {
  kInvalid = 0,
  kFloat32 = 1,
  kBFloat16 = 2,
  kFloat16 = 3,
  kInt32 = 4,
  kInt64 = 5,
};

// What a stored tensor's buffer holds (the server's store and the client's
// TensorInfo). Values match lossd.v1.TensorState; the server never reports
// kUnspecified.
enum class TensorState : int { kUnspecified = 0, kLogits = 1, kGradient = 2 };

// Bytes per element; 0 for kInvalid.
constexpr std::size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
    case DType::kInt32:
      return 4;
    case DType::kBFloat16:
    case DType::kFloat16:
      return 2;
    case DType::kInt64:
      return 8;
    default:
      return 0;
  }
}

// The canonical lower-case name ("float32", "bfloat16", "float16", "int32",
// "int64"); "invalid" for kInvalid or any value outside the enum. The one name
// table of the tree: the server's messages and the client's names start here.
// Returns a static string (never nullptr). Pure; thread-safe.
constexpr const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float32";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kFloat16:
      return "float16";
    case DType::kInt32:
      return "int32";
    case DType::kInt64:
      return "int64";
    default:
      return "invalid";
  }
}

// The proto's name without its prefix ("FLOAT32", "BFLOAT16", "FLOAT16",
// "INT32", "INT64"), for messages about a lossd.v1.DType field; "UNSPECIFIED"
// for kInvalid or any value outside the enum. Returns a static string. Pure;
// thread-safe.
constexpr const char* DTypeProtoName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "FLOAT32";
    case DType::kBFloat16:
      return "BFLOAT16";
    case DType::kFloat16:
      return "FLOAT16";
    case DType::kInt32:
      return "INT32";
    case DType::kInt64:
      return "INT64";
    default:
      return "UNSPECIFIED";
  }
}

// The numpy array-interface type string of the element ("<f4", "<f2", "<i4",
// "<i8"; bf16, which numpy lacks, as its raw 16 bits "<u2"); nullptr for
// kInvalid or any value outside the enum. The .npy writer and the Python
// buffers both start here. Pure; thread-safe.
constexpr const char* DTypeNumpyTypestr(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "<f4";
    case DType::kFloat16:
      return "<f2";
    case DType::kBFloat16:
      return "<u2";
    case DType::kInt32:
      return "<i4";
    case DType::kInt64:
      return "<i8";
    default:
      return nullptr;
  }
}

// "LOGITS", "GRADIENT", or "UNSPECIFIED" for anything else (the proto's
// names without their prefix). Returns a static string. Pure; thread-safe.
constexpr const char* TensorStateName(TensorState state) {
  switch (state) {
    case TensorState::kLogits:
      return "LOGITS";
    case TensorState::kGradient:
      return "GRADIENT";
    default:
      return "UNSPECIFIED";
  }
}

constexpr bool IsLogitsDType(DType dtype) {
  return dtype == DType::kFloat32 || dtype == DType::kBFloat16 ||
         dtype == DType::kFloat16;
}
constexpr bool IsTargetsDType(DType dtype) {
  return dtype == DType::kInt32 || dtype == DType::kInt64;
}

}  // namespace lossd

#endif  // LOSSD_COMMON_DTYPE_H_
