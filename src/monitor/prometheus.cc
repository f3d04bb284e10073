#include "monitor/prometheus.h"

#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>

#include "base/error.h"

namespace loom {
namespace fs = std::filesystem;

namespace {

std::string format_value(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.10g", v);
  return buf;
}

// Prometheus metric names are [a-zA-Z_:][a-zA-Z0-9_:]*.
std::string metric_name(const std::string& field) {
  std::string name = "loom_";
  for (char c : field) name += std::isalnum(static_cast<unsigned char>(c)) ? c : '_';
  return name;
}

std::optional<double> number_of(const nlohmann::json& v) {
  if (v.is_boolean()) return v.get<bool>() ? 1.0 : 0.0;
  if (v.is_number()) return v.get<double>();
  return std::nullopt;  // null (grad_norm of an overflowed step), strings
}

// Sends all of `data`, giving up on an error (the scraper went away).
void send_all(int fd, const std::string& data) {
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::send(fd, data.data() + done, data.size() - done, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    done += static_cast<size_t>(n);
  }
}

}  // namespace

void PrometheusMetrics::update(const nlohmann::json& record) {
  for (const auto& [field, value] : record.items()) {
    if (value.is_object()) {  // per mesh axis, or per validation set (val_losses)
      const std::string label = field == "val_losses"    ? "set"
                                : field == "data_epochs" ? "source"
                                                         : "axis";
      for (const auto& [key, v] : value.items())
        if (const auto n = number_of(v))
          values_[metric_name(field)]["{" + label + "=\"" + key + "\"}"] = *n;
    } else if (const auto n = number_of(value)) {
      values_[metric_name(field)][""] = *n;
    }
  }
}

std::string PrometheusMetrics::text() const {
  std::string out;
  for (const auto& [name, series] : values_) {
    out += "# HELP " + name + " Loom training metric " + name.substr(5) +
           " of the latest step (docs/formats.md, metrics.jsonl)\n";
    out += "# TYPE " + name + " gauge\n";
    for (const auto& [labels, v] : series) out += name + labels + " " + format_value(v) + "\n";
  }
  return out;
}

void write_prometheus_textfile(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << text;
    if (!out) fail("cannot write ", tmp);
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) fail("cannot rename ", tmp, " to ", path, ": ", ec.message());
}

PrometheusServer::PrometheusServer(int port) {
  listen_fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (listen_fd_ < 0) fail("metrics.prometheus_port: cannot open a socket: ", std::strerror(errno));
  const int one = 1;
  ::setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (::bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      ::listen(listen_fd_, 16) != 0) {
    const int err = errno;
    ::close(listen_fd_);
    fail("metrics.prometheus_port = ", port, ": cannot listen on TCP port ", port, ": ",
         std::strerror(err));
  }
  socklen_t len = sizeof addr;
  ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len);
  port_ = ntohs(addr.sin_port);
  thread_ = std::thread([this] { serve(); });
}

PrometheusServer::~PrometheusServer() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
  ::close(listen_fd_);
}

void PrometheusServer::publish(std::string text) {
  std::lock_guard<std::mutex> lock(mutex_);
  text_ = std::move(text);
}

void PrometheusServer::serve() {
  while (!stop_) {
    pollfd p{listen_fd_, POLLIN, 0};
    if (::poll(&p, 1, 200) <= 0) continue;  // a timeout, to look at stop_
    const int client = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (client < 0) continue;
    answer(client);
    ::close(client);
  }
}

// One request, HTTP/1.0 style: read its head (up to 8 KiB, 2 s), answer, close.
void PrometheusServer::answer(int client) {
  std::string request;
  char buf[1024];
  while (request.find("\r\n\r\n") == std::string::npos && request.size() < 8192) {
    pollfd p{client, POLLIN, 0};
    if (::poll(&p, 1, 2000) <= 0) return;
    const ssize_t n = ::recv(client, buf, sizeof buf, 0);
    if (n <= 0) return;
    request.append(buf, static_cast<size_t>(n));
  }
  const bool metrics =
      request.rfind("GET /metrics ", 0) == 0 || request.rfind("GET /metrics?", 0) == 0;
  std::string body, status = "200 OK";
  if (metrics) {
    std::lock_guard<std::mutex> lock(mutex_);
    body = text_;
  } else {
    status = "404 Not Found";
    body = "Loom serves its training metrics at /metrics\n";
  }
  send_all(client, "HTTP/1.0 " + status +
                       "\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
                       "Content-Length: " +
                       std::to_string(body.size()) + "\r\nConnection: close\r\n\r\n" + body);
}

}  // namespace loom
