// The step metrics for Prometheus, in its text exposition format (version 0.0.4): a textfile for
// node_exporter's textfile collector (RUN_DIR/metrics.prom, `metrics.prometheus_textfile`), and
// an HTTP endpoint Prometheus scrapes itself (`metrics.prometheus_port`).
//
// Every number of a metrics.jsonl record becomes a gauge loom_<field>; an object of numbers per
// mesh axis (comm_bytes, comm_ms) becomes one gauge with an `axis` label, the validation sets'
// losses (val_losses) one with a `set` label, the training sources' epochs (data_epochs) one
// with a `source` label; a boolean is 0 or 1.
// A field keeps its last value when later records lack it (val_loss between evaluations).
#pragma once

#include <atomic>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>

namespace loom {

class PrometheusMetrics {
 public:
  void update(const nlohmann::json& record);  // merges a step's record into the last values
  std::string text() const;                   // the exposition of the last values

 private:
  // metric name -> (label set, e.g. `{axis="dp"}` or "") -> value
  std::map<std::string, std::map<std::string, double>> values_;
};

// Writes `text` to `path` through a temporary file and a rename, so a collector never reads
// half a file.
void write_prometheus_textfile(const std::string& path, const std::string& text);

// Serves the latest published text on GET /metrics over HTTP from a thread of its own (404 for
// other paths). Binds every interface: the port is for the cluster's Prometheus.
class PrometheusServer {
 public:
  // port 0: any free port (see port()). Throws loom::Error naming the port when it cannot listen.
  explicit PrometheusServer(int port);
  ~PrometheusServer();  // stops the thread (within ~0.2 s) and closes the socket
  PrometheusServer(const PrometheusServer&) = delete;
  PrometheusServer& operator=(const PrometheusServer&) = delete;

  int port() const { return port_; }
  void publish(std::string text);

 private:
  void serve();
  void answer(int client);

  int listen_fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::mutex mutex_;
  std::string text_;
  std::thread thread_;
};

}  // namespace loom
