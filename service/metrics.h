// Prometheus metrics of spind (prometheus-cpp; names per CONVENTIONS.md): sessions, arena
// bytes, build info, per-session and (bounded) per-layer SPIN statistics read from the arenas at
// scrape time, and the go-grpc-prometheus RPC metrics.
#pragma once

#include <map>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "grpcpp/grpcpp.h"
#include "prometheus/counter.h"
#include "prometheus/exposer.h"
#include "prometheus/family.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "session_manager.h"

namespace spin::service {

/// The metrics endpoint and the RPC instruments.
class Metrics {
 public:
  /// `gpu` and `uuid` (the device ordinal and UUID on the CUDA backend, as dcgm-exporter
  /// labels them) go on every spin_ series; empty on the CPU backend. A scrape carries per-layer
  /// series for at most `layer_series` (session, layer) pairs (whole sessions, oldest first);
  /// the per-session series are always there.
  Metrics(SessionManager* sessions, std::string gpu = "", std::string uuid = "",
          uint32_t layer_series = 4096);
  ~Metrics();

  /// Serves /metrics on HOST:PORT (port 0 picks one) with `threads` HTTP workers, each giving
  /// up on a peer that sends no complete request within `request_timeout_ms` (idle peers must
  /// not starve Prometheus). UNAVAILABLE if it cannot bind.
  absl::Status Start(const std::string& address, int threads = 8, int request_timeout_ms = 2000);
  /// The bound port, once started.
  int port() const { return port_; }
  /// Records one finished RPC of spin.v1.Spin.
  void ObserveRpc(const std::string& method, grpc::StatusCode code, double seconds);
  /// Counts a policy change by its source: "session" (the session's token), "operator" (by id,
  /// without it) or "default" (SetDefaultPolicy applied to a live session).
  void CountPolicyChange(const std::string& source);

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<prometheus::Collectable> sessions_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  prometheus::Family<prometheus::Counter>* handled_ = nullptr;
  prometheus::Family<prometheus::Histogram>* handling_ = nullptr;
  prometheus::Family<prometheus::Counter>* policy_changes_ = nullptr;
  std::map<std::string, std::string> device_labels_;  // gpu, uuid when set
  int port_ = 0;
};

}  // namespace spin::service
