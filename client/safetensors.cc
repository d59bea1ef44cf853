// The safetensors reader and writer of safetensors.h. nlohmann-json parses the
// header without exceptions (a parse error is a discarded value); every
// access below checks the JSON type first, so no exception can escape.
#include "client/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"

namespace lossd {
namespace {

using Json = nlohmann::json;

constexpr uint64_t kLengthBytes = 8;
constexpr char kMetadataKey[] = "__metadata__";

absl::Status Malformed(absl::string_view why) {
  return absl::InvalidArgumentError(
      absl::StrCat("malformed safetensors header: ", why));
}

struct DTypeEntry {
  const char* name;
  uint64_t bytes;  // per element
  DType dtype;     // kInvalid: lossd does not take it
};

// The format's dtypes with a whole number of bytes per element.
constexpr DTypeEntry kDTypes[] = {
    {"F32", 4, DType::kFloat32},     {"F16", 2, DType::kFloat16},
    {"BF16", 2, DType::kBFloat16},   {"I32", 4, DType::kInt32},
    {"I64", 8, DType::kInt64},       {"F64", 8, DType::kInvalid},
    {"I8", 1, DType::kInvalid},      {"U8", 1, DType::kInvalid},
    {"BOOL", 1, DType::kInvalid},    {"I16", 2, DType::kInvalid},
    {"U16", 2, DType::kInvalid},     {"U32", 4, DType::kInvalid},
    {"U64", 8, DType::kInvalid},     {"F8_E5M2", 1, DType::kInvalid},
    {"F8_E4M3", 1, DType::kInvalid}, {"F8_E8M0", 1, DType::kInvalid},
};

const DTypeEntry* FindDType(const std::string& name) {
  for (const DTypeEntry& entry : kDTypes) {
    if (name == entry.name) return &entry;
  }
  return nullptr;
}

// Quotes a name from the file for a message, shortened: it may be huge.
std::string Quote(const std::string& name) {
  constexpr std::size_t kMax = 80;
  return name.size() <= kMax ? absl::StrCat("'", name, "'")
                             : absl::StrCat("'", name.substr(0, kMax), "...'");
}

absl::Status ParseTensor(const std::string& name, const Json& entry,
                         uint64_t data_bytes, SafetensorsTensor* tensor) {
  const std::string where = absl::StrCat("tensor ", Quote(name), ": ");
  if (!entry.is_object()) {
    return Malformed(absl::StrCat(where, "the entry is not an object"));
  }
  const auto dtype = entry.find("dtype");
  const auto shape = entry.find("shape");
  const auto offsets = entry.find("data_offsets");
  if (dtype == entry.end() || shape == entry.end() || offsets == entry.end()) {
    return Malformed(absl::StrCat(
        where, "needs the keys \"dtype\", \"shape\" and \"data_offsets\""));
  }
  if (!dtype->is_string()) {
    return Malformed(absl::StrCat(where, "\"dtype\" is not a string"));
  }
  tensor->name = name;
  tensor->dtype_name = dtype->get_ref<const std::string&>();
  if (!shape->is_array()) {
    return Malformed(absl::StrCat(where, "\"shape\" is not an array"));
  }
  if (shape->size() > kMaxSafetensorsRank) {
    return Malformed(
        absl::StrCat(where, "more than ", kMaxSafetensorsRank, " dimensions"));
  }
  uint64_t elements = 1;
  bool overflow = false;
  bool empty = false;
  for (const Json& dim : *shape) {
    if (!dim.is_number_unsigned() ||
        dim.get<uint64_t>() >
            static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return Malformed(
          absl::StrCat(where, "a dimension is not an integer in [0, 2^63): ",
                       // dump() of a nested value recurses; a number is flat.
                       dim.is_number() ? dim.dump() : dim.type_name()));
    }
    const uint64_t d = dim.get<uint64_t>();
    tensor->shape.push_back(static_cast<int64_t>(d));
    if (d == 0) {
      empty = true;
    } else if (elements > std::numeric_limits<uint64_t>::max() / d) {
      overflow = true;
    }
    elements *= d;
  }
  // A zero dimension makes an overflowing product of the others harmless.
  if (empty) {
    elements = 0;
  } else if (overflow) {
    return Malformed(absl::StrCat(where, "the shape overflows 64 bits"));
  }
  tensor->elements = elements;
  if (!offsets->is_array() || offsets->size() != 2 ||
      !(*offsets)[0].is_number_unsigned() ||
      !(*offsets)[1].is_number_unsigned()) {
    return Malformed(
        absl::StrCat(where, "\"data_offsets\" is not [BEGIN, END]"));
  }
  tensor->begin = (*offsets)[0].get<uint64_t>();
  tensor->end = (*offsets)[1].get<uint64_t>();
  if (tensor->begin > tensor->end) {
    return Malformed(absl::StrCat(where, "data_offsets [", tensor->begin, ", ",
                                  tensor->end, "] are reversed"));
  }
  if (tensor->end > data_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("truncated safetensors file: ", where,
                     "data_offsets end at ", tensor->end, ", the file holds ",
                     data_bytes, " bytes after its header"));
  }
  const DTypeEntry* known = FindDType(tensor->dtype_name);
  if (known != nullptr) {
    tensor->dtype = known->dtype;
    if (elements > std::numeric_limits<uint64_t>::max() / known->bytes ||
        elements * known->bytes != tensor->end - tensor->begin) {
      return Malformed(absl::StrCat(
          where, "data_offsets [", tensor->begin, ", ", tensor->end, "] hold ",
          tensor->end - tensor->begin, " bytes; ", tensor->dtype_name, " [",
          absl::StrJoin(tensor->shape, ", "), "] needs ", elements, " x ",
          known->bytes));
    }
  }
  return absl::OkStatus();
}

absl::Status ParseMetadata(const Json& value,
                           std::map<std::string, std::string>* metadata) {
  if (!value.is_object()) {
    return Malformed("\"__metadata__\" is not an object");
  }
  for (auto it = value.begin(); it != value.end(); ++it) {
    if (!it.value().is_string()) {
      return Malformed(absl::StrCat("\"__metadata__\" value of ",
                                    Quote(it.key()), " is not a string"));
    }
    (*metadata)[it.key()] = it.value().get<std::string>();
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<SafetensorsHeader> ParseSafetensorsHeader(
    absl::string_view prefix, uint64_t file_bytes) {
  if (prefix.size() < kLengthBytes || file_bytes < kLengthBytes) {
    return absl::InvalidArgumentError(
        "not a safetensors file: shorter than its 8-byte header length");
  }
  uint64_t header_bytes = 0;
  for (uint64_t i = 0; i < kLengthBytes; ++i) {
    header_bytes |= static_cast<uint64_t>(static_cast<uint8_t>(prefix[i]))
                    << (8 * i);
  }
  if (header_bytes > kMaxSafetensorsHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "not a safetensors file: header length ", header_bytes,
        " exceeds the format's limit of ", kMaxSafetensorsHeaderBytes));
  }
  if (file_bytes - kLengthBytes < header_bytes ||
      prefix.size() - kLengthBytes < header_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "truncated safetensors file: the header length says ", header_bytes,
        " bytes, ",
        std::min<uint64_t>(file_bytes, prefix.size()) - kLengthBytes,
        " follow"));
  }
  const absl::string_view text = prefix.substr(kLengthBytes, header_bytes);
  if (text.empty() || text[0] != '{') {
    return absl::InvalidArgumentError(
        "not a safetensors file: the header does not start with '{'");
  }
  // nlohmann-json keeps the last of duplicate keys silently; the format
  // forbids them, so the parse callback notes them. One key set per open
  // object or array (arrays get an unused one, to keep the stack simple).
  std::vector<std::set<std::string>> open_keys;
  std::string duplicate;
  const Json::parser_callback_t on_event =
      [&](int /*depth*/, Json::parse_event_t event, Json& parsed) {
        switch (event) {
          case Json::parse_event_t::object_start:
          case Json::parse_event_t::array_start:
            open_keys.emplace_back();
            break;
          case Json::parse_event_t::object_end:
          case Json::parse_event_t::array_end:
            if (!open_keys.empty()) open_keys.pop_back();
            break;
          case Json::parse_event_t::key:
            if (!open_keys.empty() && parsed.is_string() &&
                !open_keys.back().insert(parsed.get<std::string>()).second &&
                duplicate.empty()) {
              duplicate = parsed.get<std::string>();
            }
            break;
          default:
            break;
        }
        return true;
      };
  const Json json = Json::parse(text.begin(), text.end(), on_event,
                                /*allow_exceptions=*/false);
  if (json.is_discarded()) return Malformed("not valid JSON");
  if (!json.is_object()) return Malformed("the header is not a JSON object");
  if (!duplicate.empty()) {
    return Malformed(absl::StrCat("duplicate key ", Quote(duplicate)));
  }
  SafetensorsHeader header;
  header.data_offset = kLengthBytes + header_bytes;
  const uint64_t data_bytes = file_bytes - header.data_offset;
  for (auto it = json.begin(); it != json.end(); ++it) {
    if (it.key() == kMetadataKey) {
      absl::Status status = ParseMetadata(it.value(), &header.metadata);
      if (!status.ok()) return status;
      continue;
    }
    SafetensorsTensor tensor;
    absl::Status status =
        ParseTensor(it.key(), it.value(), data_bytes, &tensor);
    if (!status.ok()) return status;
    header.data_bytes = std::max(header.data_bytes, tensor.end);
    header.tensors.push_back(std::move(tensor));
  }
  // Overlapping tensors would alias each other's bytes; empty ones hold none.
  std::vector<const SafetensorsTensor*> by_offset;
  for (const SafetensorsTensor& tensor : header.tensors) {
    if (tensor.begin < tensor.end) by_offset.push_back(&tensor);
  }
  std::sort(by_offset.begin(), by_offset.end(),
            [](const SafetensorsTensor* a, const SafetensorsTensor* b) {
              return a->begin < b->begin;
            });
  for (std::size_t i = 1; i < by_offset.size(); ++i) {
    if (by_offset[i]->begin < by_offset[i - 1]->end) {
      return Malformed(absl::StrCat("tensors ", Quote(by_offset[i - 1]->name),
                                    " and ", Quote(by_offset[i]->name),
                                    " overlap"));
    }
  }
  return header;
}

const char* SafetensorsDTypeName(DType dtype) {
  for (const DTypeEntry& entry : kDTypes) {
    if (entry.dtype == dtype && dtype != DType::kInvalid) return entry.name;
  }
  return nullptr;
}

absl::StatusOr<std::string> EncodeSafetensorsHeader(
    const std::string& name, DType dtype, absl::Span<const int64_t> shape,
    const std::map<std::string, std::string>& metadata) {
  if (name.empty() || name == kMetadataKey) {
    return absl::InvalidArgumentError(
        absl::StrCat("safetensors tensor name '", name, "' is not allowed"));
  }
  const char* dtype_name = SafetensorsDTypeName(dtype);
  if (dtype_name == nullptr) {
    return absl::InvalidArgumentError("no safetensors dtype for kInvalid");
  }
  if (shape.size() > kMaxSafetensorsRank) {
    return absl::InvalidArgumentError(
        absl::StrCat("more than ", kMaxSafetensorsRank, " dimensions"));
  }
  uint64_t bytes = DTypeSize(dtype);
  for (int64_t dim : shape) {
    if (dim < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("negative dimension ", dim, " in shape"));
    }
    const uint64_t d = static_cast<uint64_t>(dim);
    if (d != 0 && bytes > std::numeric_limits<uint64_t>::max() / d) {
      return absl::InvalidArgumentError("the shape overflows 64 bits");
    }
    bytes *= d;
  }
  Json json = Json::object();
  json[name] = {{"dtype", dtype_name},
                {"shape", std::vector<int64_t>(shape.begin(), shape.end())},
                {"data_offsets", {uint64_t{0}, bytes}}};
  if (!metadata.empty()) json[kMetadataKey] = metadata;
  // Invalid UTF-8 in a name becomes U+FFFD rather than an exception.
  std::string text = json.dump(-1, ' ', false, Json::error_handler_t::replace);
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string out(kLengthBytes, '\0');
  for (uint64_t i = 0; i < kLengthBytes; ++i) {
    out[i] = static_cast<char>((text.size() >> (8 * i)) & 0xff);
  }
  return out + text;
}

SafetensorsFile::SafetensorsFile(std::string path, SafetensorsHeader header,
                                 void* mapping, std::size_t mapping_bytes)
    : path_(std::move(path)),
      header_(std::move(header)),
      mapping_(mapping),
      mapping_bytes_(mapping_bytes),
      data_(static_cast<const uint8_t*>(mapping) + header_.data_offset) {}

SafetensorsFile::~SafetensorsFile() { munmap(mapping_, mapping_bytes_); }

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(
    const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return absl::ErrnoToStatus(errno, absl::StrCat("cannot open ", path));
  }
  struct stat st;
  if (fstat(fd, &st) != 0) {
    const int error = errno;
    close(fd);
    return absl::ErrnoToStatus(error, absl::StrCat("cannot stat ", path));
  }
  if (!S_ISREG(st.st_mode)) {
    close(fd);
    return absl::InvalidArgumentError(absl::StrCat(path, " is not a file"));
  }
  const std::size_t size = static_cast<std::size_t>(st.st_size);
  if (size < kLengthBytes) {
    close(fd);
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": not a safetensors file (", size, " bytes long)"));
  }
  void* mapping = mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_error = errno;
  close(fd);  // the mapping keeps the file alive
  if (mapping == MAP_FAILED) {
    return absl::InternalError(
        absl::StrCat("cannot mmap ", path, ": ", std::strerror(map_error)));
  }
  absl::StatusOr<SafetensorsHeader> header = ParseSafetensorsHeader(
      absl::string_view(static_cast<const char*>(mapping), size), size);
  if (!header.ok()) {
    munmap(mapping, size);
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": ", header.status().message()));
  }
  madvise(mapping, size, MADV_SEQUENTIAL);
  return std::unique_ptr<SafetensorsFile>(
      new SafetensorsFile(path, *std::move(header), mapping, size));
}

absl::StatusOr<const SafetensorsTensor*> SafetensorsFile::Find(
    const std::string& name) const {
  std::vector<std::string> names;
  for (const SafetensorsTensor& tensor : header_.tensors) {
    if (!name.empty() && tensor.name == name) return &tensor;
    names.push_back(Quote(tensor.name));
  }
  if (name.empty() && header_.tensors.size() == 1) {
    return &header_.tensors.front();
  }
  constexpr std::size_t kListed = 20;
  const std::size_t count = names.size();
  if (names.size() > kListed) names.resize(kListed);
  const std::string listed =
      count == 0
          ? "it holds no tensors"
          : absl::StrCat("it holds ", count, ": ", absl::StrJoin(names, ", "),
                         count > kListed ? ", ..." : "");
  if (name.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path_, ": name a tensor as ", path_, ":NAME; ", listed));
  }
  return absl::InvalidArgumentError(
      absl::StrCat(path_, ": no tensor ", Quote(name), "; ", listed));
}

}  // namespace lossd
