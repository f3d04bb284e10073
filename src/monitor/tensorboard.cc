#include "monitor/tensorboard.h"

#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>
#include <filesystem>

#include "base/error.h"

namespace loom {
namespace fs = std::filesystem;

namespace {

// The reflected Castagnoli polynomial's table, one byte at a time.
const std::array<uint32_t, 256>& crc32c_table() {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  return table;
}

// TFRecord stores CRCs masked, so that a CRC of data holding CRCs stays well spread.
uint32_t masked_crc(const void* data, size_t bytes) {
  const uint32_t c = crc32c(data, bytes);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

// Protocol buffer wire format: varints, and (field number, wire type) keys.
void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out += static_cast<char>((v & 0x7F) | 0x80);
    v >>= 7;
  }
  out += static_cast<char>(v);
}
void put_key(std::string& out, int field, int wire_type) {
  put_varint(out, static_cast<uint64_t>(field) << 3 | static_cast<uint64_t>(wire_type));
}
template <typename T>
void put_fixed(std::string& out, T v) {  // little-endian, as on every host we run on
  char bytes[sizeof(T)];
  std::memcpy(bytes, &v, sizeof(T));
  out.append(bytes, sizeof(T));
}
void put_bytes(std::string& out, int field, const std::string& bytes) {
  put_key(out, field, 2);
  put_varint(out, bytes.size());
  out += bytes;
}

// Event {1: double wall_time, 2: int64 step, 3: string file_version, 5: Summary summary}.
std::string event(double wall_time, int64_t step, const std::string* file_version,
                  const std::string* summary) {
  std::string e;
  put_key(e, 1, 1);
  put_fixed(e, wall_time);
  if (step != 0) {
    put_key(e, 2, 0);
    put_varint(e, static_cast<uint64_t>(step));
  }
  if (file_version) put_bytes(e, 3, *file_version);
  if (summary) put_bytes(e, 5, *summary);
  return e;
}

// Summary {1: repeated Value value}; Value {1: string tag, 2: float simple_value}.
void add_value(std::string& summary, const std::string& tag, double v) {
  std::string value;
  put_bytes(value, 1, tag);
  put_key(value, 2, 5);
  put_fixed(value, static_cast<float>(v));
  put_bytes(summary, 1, value);
}

double wall_seconds() {  // Unix time, as TensorBoard's wall_time
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string host_name() {
  char buf[256] = {};
  if (gethostname(buf, sizeof buf - 1) != 0) return "localhost";
  return buf;
}

}  // namespace

uint32_t crc32c(const void* data, size_t bytes) {
  const auto& table = crc32c_table();
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t c = 0xFFFFFFFFu;
  for (size_t i = 0; i < bytes; ++i) c = table[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

TensorBoardWriter::TensorBoardWriter(const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) fail("metrics.tensorboard: cannot create ", dir, ": ", ec.message());
  // The process id and a count make the name unique for writers started within one second.
  static std::atomic<int> writers{0};
  path_ = (fs::path(dir) /
           ("events.out.tfevents." + std::to_string(std::time(nullptr)) + "." + host_name() + "." +
            std::to_string(getpid()) + "." + std::to_string(writers++)))
              .string();
  file_ = std::fopen(path_.c_str(), "wb");
  if (file_ == nullptr)
    fail("metrics.tensorboard: cannot write ", path_, ": ", std::strerror(errno));
  const std::string version = "brain.Event:2";
  write_record(event(wall_seconds(), 0, &version, nullptr));
}

TensorBoardWriter::~TensorBoardWriter() {
  if (file_ != nullptr) std::fclose(file_);
}

void TensorBoardWriter::scalars(int64_t step, const nlohmann::json& record) {
  std::string summary;
  for (const auto& [field, value] : record.items()) {
    if (field == "step") continue;  // the event's own step
    if (value.is_number()) add_value(summary, field, value.get<double>());
    if (value.is_object())
      for (const auto& [axis, v] : value.items())
        if (v.is_number()) add_value(summary, field + "/" + axis, v.get<double>());
  }
  write_record(event(wall_seconds(), step, nullptr, &summary));
}

void TensorBoardWriter::write_record(const std::string& data) {
  std::string rec;
  const uint64_t length = data.size();
  put_fixed(rec, length);
  put_fixed(rec, masked_crc(rec.data(), sizeof length));
  rec += data;
  put_fixed(rec, masked_crc(data.data(), data.size()));
  if (std::fwrite(rec.data(), 1, rec.size(), file_) != rec.size() || std::fflush(file_) != 0)
    fail("metrics.tensorboard: cannot write ", path_, ": ", std::strerror(errno));
}

}  // namespace loom
