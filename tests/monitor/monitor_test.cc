// Where the step metrics go besides metrics.jsonl: TensorBoard event files (read back here record
// by record: the TFRecord framing with its CRCs, and the Event protocol buffers) and Prometheus
// (the text exposition, the textfile, the HTTP endpoint, asked over a real socket).
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "harness/error_of.h"
#include "monitor/prometheus.h"
#include "monitor/tensorboard.h"
#include "monitor/trace.h"

namespace loom {
namespace {
namespace fs = std::filesystem;
using testutil::error_of;

TEST(Crc32c, KnownAnswers) {
  EXPECT_EQ(crc32c("123456789", 9), 0xE3069283u);  // the CRC catalogue's check value
  EXPECT_EQ(crc32c("", 0), 0u);
  const std::vector<unsigned char> zeros(32, 0), ones(32, 0xFF);
  EXPECT_EQ(crc32c(zeros.data(), 32), 0x8A9136AAu);  // RFC 3720, B.4
  EXPECT_EQ(crc32c(ones.data(), 32), 0x62A8AB43u);
}

// A minimal protocol buffer reader: the fields of one message, by number.
struct Field {
  int number, wire_type;
  uint64_t varint = 0;
  std::string bytes;  // length-delimited, or the 4/8 raw bytes of a fixed field
};

uint64_t read_varint(const std::string& s, size_t& i) {
  uint64_t v = 0;
  for (int shift = 0; i < s.size(); shift += 7) {
    const auto b = static_cast<unsigned char>(s[i++]);
    v |= static_cast<uint64_t>(b & 0x7F) << shift;
    if (!(b & 0x80)) break;
  }
  return v;
}

std::vector<Field> fields_of(const std::string& msg) {
  std::vector<Field> out;
  for (size_t i = 0; i < msg.size();) {
    const uint64_t key = read_varint(msg, i);
    Field f{static_cast<int>(key >> 3), static_cast<int>(key & 7), 0, ""};
    if (f.wire_type == 0) f.varint = read_varint(msg, i);
    if (f.wire_type == 1 || f.wire_type == 5) {
      const size_t n = f.wire_type == 1 ? 8 : 4;
      f.bytes = msg.substr(i, n);
      i += n;
    }
    if (f.wire_type == 2) {
      const uint64_t n = read_varint(msg, i);
      f.bytes = msg.substr(i, n);
      i += n;
    }
    out.push_back(f);
  }
  return out;
}

uint32_t unmasked(uint32_t masked) {
  const uint32_t rot = masked - 0xa282ead8u;
  return (rot >> 17) | (rot << 15);
}

// The TFRecords of a file, each checked against its two CRCs.
std::vector<std::string> read_records(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  const std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::string> records;
  for (size_t i = 0; i < data.size();) {
    uint64_t length;
    uint32_t length_crc, data_crc;
    std::memcpy(&length, data.data() + i, 8);
    std::memcpy(&length_crc, data.data() + i + 8, 4);
    EXPECT_EQ(unmasked(length_crc), crc32c(data.data() + i, 8)) << "record " << records.size();
    const std::string record = data.substr(i + 12, length);
    std::memcpy(&data_crc, data.data() + i + 12 + length, 4);
    EXPECT_EQ(unmasked(data_crc), crc32c(record.data(), record.size()))
        << "record " << records.size();
    records.push_back(record);
    i += 12 + length + 4;
  }
  return records;
}

// A GPU rank's timeline: TraceScopes record device marks beside their host span, and the GPU's
// row (tid 1, named) gets a span once both of its marks resolve; unresolved ones wait; nothing is
// marked while inactive.
TEST(Trace, DeviceMarksMakeTheGpuRowOnceTheStreamPassedThem) {
  Tracer tracer(3);
  std::vector<std::optional<double>> clock;  // mark i -> when the "stream" passed it
  tracer.set_device_marks([&]() -> Tracer::DeviceMark {
    const size_t i = clock.size();
    clock.emplace_back();
    return [&clock, i] { return clock[i]; };
  });
  { TraceScope idle(&tracer, "step ", "step", 1); }  // inactive: no marks, no spans
  EXPECT_TRUE(clock.empty());
  tracer.set_active(true);
  { TraceScope step(&tracer, "step ", "step", 2); }
  { TraceScope opt(&tracer, "optimizer", "compute"); }
  ASSERT_EQ(clock.size(), 4u);
  clock[0] = 10.0;
  clock[1] = 10.5;
  clock[2] = 10.6;  // the optimizer's end not yet passed
  tracer.resolve_device_spans();
  tracer.span("wait: dp", "comm", 10.1, 10.2, Tracer::kDevice);
  const fs::path file = fs::temp_directory_path() / ("loom_trace_" + std::to_string(getpid()) + ".json");
  tracer.write(file.string());
  clock[3] = 10.9;
  tracer.resolve_device_spans();
  const fs::path later = file.string() + ".later";
  tracer.write(later.string());
  const auto rows = [](const fs::path& f) {
    std::ifstream in(f);
    std::map<std::string, std::vector<double>> gpu;  // name -> (ts, dur) of the GPU row
    std::map<int, std::string> names;
    const nlohmann::json doc = nlohmann::json::parse(in);
    for (const auto& e : doc.at("traceEvents")) {
      if (e["ph"] == "M" && e["name"] == "thread_name") names[e["tid"]] = e["args"]["name"];
      if (e["ph"] == "X" && e["tid"] == 1)
        gpu[e["name"]] = {e["ts"].get<double>(), e["dur"].get<double>()};
    }
    return std::pair{gpu, names};
  };
  const auto [gpu, names] = rows(file);
  EXPECT_EQ(names.at(0), "host");
  EXPECT_EQ(names.at(1), "GPU stream");
  ASSERT_EQ(gpu.size(), 2u);  // step 2 and the stall; the optimizer waits for its end
  EXPECT_NEAR(gpu.at("step 2")[0], 10.0e6, 1e-3);
  EXPECT_NEAR(gpu.at("step 2")[1], 0.5e6, 1e-3);
  EXPECT_NEAR(gpu.at("wait: dp")[1], 0.1e6, 1e-3);
  const auto [gpu_later, unused] = rows(later);
  ASSERT_EQ(gpu_later.count("optimizer"), 1u);
  EXPECT_NEAR(gpu_later.at("optimizer")[1], 0.3e6, 1e-3);
  fs::remove(file);
  fs::remove(later);
}

TEST(TensorBoard, EventFileHoldsOneEventPerStepWithEveryNumber) {
  const fs::path dir = fs::temp_directory_path() / ("loom_tb_test_" + std::to_string(getpid()));
  fs::remove_all(dir);
  std::string path;
  {
    TensorBoardWriter tb(dir.string());
    path = tb.path();
    tb.scalars(1, {{"step", 1}, {"loss", 2.5}, {"comm_ms", {{"dp", 0.75}}}, {"skipped", true}});
    tb.scalars(2, {{"step", 2}, {"loss", 2.25}, {"grad_norm", nullptr}});
  }
  EXPECT_NE(fs::path(path).filename().string().find("events.out.tfevents."), std::string::npos);
  const std::vector<std::string> records = read_records(path);
  ASSERT_EQ(records.size(), 3u);
  // The first event names the format.
  bool version = false;
  for (const Field& f : fields_of(records[0]))
    version |= f.number == 3 && f.bytes == "brain.Event:2";
  EXPECT_TRUE(version);
  // Then {wall_time, step, summary {value {tag, simple_value}}}.
  for (int s = 1; s <= 2; ++s) {
    std::map<std::string, float> scalars;
    uint64_t step = 0;
    double wall_time = 0;
    for (const Field& f : fields_of(records[s])) {
      if (f.number == 1) std::memcpy(&wall_time, f.bytes.data(), 8);
      if (f.number == 2) step = f.varint;
      if (f.number != 5) continue;
      for (const Field& value : fields_of(f.bytes)) {
        std::string tag;
        float v = 0;
        for (const Field& g : fields_of(value.bytes)) {
          if (g.number == 1) tag = g.bytes;
          if (g.number == 2 && g.wire_type == 5) std::memcpy(&v, g.bytes.data(), 4);
        }
        scalars[tag] = v;
      }
    }
    EXPECT_EQ(step, static_cast<uint64_t>(s));
    EXPECT_GT(wall_time, 1.7e9);  // Unix time
    if (s == 1) {
      EXPECT_EQ(scalars, (std::map<std::string, float>{{"loss", 2.5f}, {"comm_ms/dp", 0.75f}}));
    } else {
      EXPECT_EQ(scalars, (std::map<std::string, float>{{"loss", 2.25f}}));  // null is no number
    }
  }
  fs::remove_all(dir);
}

TEST(Prometheus, GaugesPerFieldAxisLabelsAndLastValues) {
  PrometheusMetrics m;
  m.update({{"step", 4},
            {"loss", 2.5},
            {"val_loss", 2.75},
            {"skipped", true},
            {"grad_norm", nullptr},
            {"comm_bytes", {{"dp", 1024}, {"tp", 0}}},
            {"val_losses", {{"web", 3.5}, {"code", 1.25}}},
            {"data_epochs", {{"1", 0.5}}}});
  m.update({{"step", 5}, {"loss", 2.25}, {"comm_bytes", {{"dp", 2048}, {"tp", 0}}}});
  const std::string text = m.text();
  for (const char* line :
       {"# TYPE loom_loss gauge\n", "\nloom_loss 2.25\n", "\nloom_step 5\n",
        "\nloom_val_loss 2.75\n",  // kept from step 4
        "\nloom_skipped 1\n", "\nloom_comm_bytes{axis=\"dp\"} 2048\n",
        "\nloom_comm_bytes{axis=\"tp\"} 0\n", "# HELP loom_comm_bytes ",
        "\nloom_val_losses{set=\"web\"} 3.5\n",  // data.val_sets', by name
        "\nloom_val_losses{set=\"code\"} 1.25\n", "\nloom_data_epochs{source=\"1\"} 0.5\n"})
    EXPECT_NE(text.find(line), std::string::npos) << "missing: " << line << "in:\n" << text;
  EXPECT_EQ(text.find("grad_norm"), std::string::npos) << text;  // null: no sample
  const fs::path file =
      fs::temp_directory_path() / ("loom_prom_" + std::to_string(getpid()) + ".prom");
  write_prometheus_textfile(file.string(), text);
  std::ifstream in(file);
  EXPECT_EQ(std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>()),
            text);
  EXPECT_FALSE(fs::exists(file.string() + ".tmp"));
  fs::remove(file);
}

// An HTTP request to localhost:port; the whole response.
std::string http_get(int port, const std::string& path) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  const std::string request = "GET " + path + " HTTP/1.1\r\nHost: localhost\r\n\r\n";
  EXPECT_EQ(::send(fd, request.data(), request.size(), 0), static_cast<ssize_t>(request.size()));
  std::string response;
  char buf[4096];
  for (ssize_t n; (n = ::recv(fd, buf, sizeof buf, 0)) > 0;)
    response.append(buf, static_cast<size_t>(n));
  ::close(fd);
  return response;
}

TEST(Prometheus, ServerAnswersMetricsOverHttp) {
  PrometheusServer server(0);  // any free port
  ASSERT_GT(server.port(), 0);
  server.publish("loom_step 7\n");
  const std::string ok = http_get(server.port(), "/metrics");
  EXPECT_EQ(ok.rfind("HTTP/1.0 200 OK\r\n", 0), 0u) << ok;
  EXPECT_NE(ok.find("Content-Type: text/plain; version=0.0.4"), std::string::npos) << ok;
  EXPECT_EQ(ok.substr(ok.size() - 12), "loom_step 7\n") << ok;
  server.publish("loom_step 8\n");
  EXPECT_NE(http_get(server.port(), "/metrics").find("loom_step 8\n"), std::string::npos);
  EXPECT_EQ(http_get(server.port(), "/").rfind("HTTP/1.0 404", 0), 0u);
  // The port is taken: an error that names it.
  const std::string e = error_of([&] { PrometheusServer again(server.port()); });
  EXPECT_NE(e.find("metrics.prometheus_port = " + std::to_string(server.port())), std::string::npos)
      << e;
}

}  // namespace
}  // namespace loom
