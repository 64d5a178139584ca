#include "metrics.h"

#include <algorithm>
#include <exception>

#include "absl/strings/str_cat.h"
#include "convert.h"
#include "prometheus/collectable.h"
#include "prometheus/metric_family.h"

namespace spin::service {
namespace {

using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;

const char* CodeName(grpc::StatusCode c) {
  static const char* kNames[] = {
      "OK",       "Canceled",       "Unknown",          "InvalidArgument",   "DeadlineExceeded",
      "NotFound", "AlreadyExists",  "PermissionDenied", "ResourceExhausted", "FailedPrecondition",
      "Aborted",  "OutOfRange",     "Unimplemented",    "Internal",          "Unavailable",
      "DataLoss", "Unauthenticated"};
  const int i = static_cast<int>(c);
  return i >= 0 && i < 17 ? kNames[i] : "Unknown";
}

// Reads every session's arena at scrape time: the arenas are the source of truth, so nothing
// is copied on the data path.
class SessionCollector final : public prometheus::Collectable {
 public:
  SessionCollector(SessionManager* sessions, std::string gpu, std::string uuid,
                   uint32_t layer_series)
      : sessions_(sessions), layer_series_(layer_series) {
    if (!gpu.empty()) device_ = {{"gpu", gpu}, {"UUID", uuid}};
  }

  std::vector<MetricFamily> Collect() const override {
    auto family = [](const char* name, const char* help, MetricType type) {
      MetricFamily f;
      f.name = name;
      f.help = help;
      f.type = type;
      return f;
    };
    MetricFamily info = family("spin_build_info", "spind build; always 1", MetricType::Gauge);
    ClientMetric im;
    im.label = {{"version", "0.1.0"},
                {"backend", sessions_->backend() == Backend::kCuda ? "cuda" : "cpu"}};
    im.gauge.value = 1;
    info.metric.push_back(im);
    MetricFamily count = family("spin_sessions", "Attached sessions", MetricType::Gauge);
    MetricFamily bytes =
        family("spin_arena_bytes", "Arena bytes held by all sessions", MetricType::Gauge);
    MetricFamily realized =
        family("spin_layer_realized_sparsity_ratio", "Skipped / total blocks over non-dense steps",
               MetricType::Gauge);
    MetricFamily effective =
        family("spin_layer_effective_sparsity_ratio",
               "Skipped / total blocks over all steps (probes count as dense)", MetricType::Gauge);
    MetricFamily miss =
        family("spin_layer_miss_ratio",
               "Dense top-K slots outside the budget, measured on probe steps", MetricType::Gauge);
    MetricFamily xmiss =
        family("spin_layer_explore_miss_ratio",
               "The sparse steps' miss as their exploration blocks estimate it (steps whose "
               "top-K the engine gave), since attach",
               MetricType::Gauge);
    MetricFamily budget = family("spin_layer_budget_sparsity_ratio",
                                 "The layer's sparsity budget now", MetricType::Gauge);
    MetricFamily steps =
        family("spin_layer_steps_total", "Sequence-steps selected", MetricType::Counter);
    MetricFamily probes = family("spin_layer_probe_steps_total",
                                 "Probe steps with a miss-curve sample", MetricType::Counter);
    MetricFamily bad = family("spin_layer_bad_scores_total", "Non-finite indexer scores skipped",
                              MetricType::Counter);
    MetricFamily recomputes =
        family("spin_budget_recomputes_total",
               "Per-layer budget tables the probe thread's allocator wrote", MetricType::Counter);
    // Per session, over all its layers (the counters summed, so the ratios are pooled): always
    // there, whatever --metrics-layer-series leaves out.
    MetricFamily s_layers =
        family("spin_session_layers", "The session's layers", MetricType::Gauge);
    MetricFamily s_realized =
        family("spin_session_realized_sparsity_ratio",
               "Skipped / total blocks over non-dense steps, all layers", MetricType::Gauge);
    MetricFamily s_effective =
        family("spin_session_effective_sparsity_ratio",
               "Skipped / total blocks over all steps, all layers", MetricType::Gauge);
    MetricFamily s_miss = family("spin_session_miss_ratio",
                                 "Dense top-K slots outside the budget on probe steps, all layers",
                                 MetricType::Gauge);
    MetricFamily s_xmiss =
        family("spin_session_explore_miss_ratio",
               "The sparse steps' miss as their exploration blocks estimate it, all layers",
               MetricType::Gauge);
    MetricFamily s_worst =
        family("spin_session_worst_layer_miss_ratio",
               "The highest spin_layer_miss_ratio of the session's layers", MetricType::Gauge);
    MetricFamily s_steps =
        family("spin_session_steps_total", "Sequence-steps selected, summed over layers",
               MetricType::Counter);
    MetricFamily s_probes =
        family("spin_session_probe_steps_total",
               "Probe steps with a miss-curve sample, summed over layers", MetricType::Counter);
    MetricFamily s_bad =
        family("spin_session_bad_scores_total", "Non-finite indexer scores skipped, all layers",
               MetricType::Counter);
    MetricFamily left_out =
        family("spin_metrics_sessions_without_layer_series",
               "Sessions whose per-layer series this scrape left out (--metrics-layer-series)",
               MetricType::Gauge);
    const std::vector<std::shared_ptr<Session>> all = sessions_->List();
    ClientMetric c;
    c.gauge.value = static_cast<double>(all.size());
    count.metric.push_back(c);
    uint64_t total = 0, pairs = 0, without = 0;
    for (const std::shared_ptr<Session>& s : all) {
      total += s->bytes;
      // A session busy with a call is left out of this scrape rather than making the scrape
      // (and Prometheus) wait for it; it is back at the next one.
      std::unique_lock<std::mutex> lock(s->mu, std::try_to_lock);
      if (!lock.owns_lock() || s->freed) continue;
      if (!s->arena->PullControl().ok()) continue;  // a device error: skip, scrape the rest
      const ArenaView& v = s->arena->host();
      const uint32_t n_layers = s->geometry.layers;
      const bool per_layer = pairs + n_layers <= layer_series_;
      if (per_layer) {
        pairs += n_layers;
      } else {
        ++without;
      }
      ClientMetric rc;
      rc.label = {{"session", s->id}};
      rc.counter.value = static_cast<double>(s->budget_recomputes);
      recomputes.metric.push_back(rc);
      LayerStats sum{};
      double worst = 0, budget_sum = 0;
      for (uint32_t l = 0; l < n_layers; ++l) {
        const LayerStats& st = v.stats[l];
        // The counters are the arena's (written by the client's data plane); the budget is
        // the table spind wrote. The same derived ratios GetStats reports.
        const double layer_budget = s->budgets_written[l];
        const spin::v1::LayerStats ratios = ToProto(l, st, layer_budget);
        worst = std::max(worst, ratios.miss_rate());
        budget_sum += layer_budget;
        sum.steps += st.steps;
        sum.dense_steps += st.dense_steps;
        sum.probe_steps += st.probe_steps;
        sum.blocks_kept += st.blocks_kept;
        sum.blocks_total += st.blocks_total;
        sum.sparse_blocks_kept += st.sparse_blocks_kept;
        sum.sparse_blocks_total += st.sparse_blocks_total;
        sum.observed += st.observed;
        sum.bad_scores += st.bad_scores;
        sum.probe_topk += st.probe_topk;
        sum.probe_missed += st.probe_missed;
        sum.explore_steps += st.explore_steps;
        sum.explore_topk += st.explore_topk;
        sum.explore_est += st.explore_est;
        if (!per_layer) continue;
        ClientMetric m;
        m.label = {{"session", s->id}, {"layer", std::to_string(l)}};
        auto gauge = [&m](MetricFamily& f, double value) {
          ClientMetric x = m;
          x.gauge.value = value;
          f.metric.push_back(x);
        };
        auto counter = [&m](MetricFamily& f, uint64_t value) {
          ClientMetric x = m;
          x.counter.value = static_cast<double>(value);
          f.metric.push_back(x);
        };
        gauge(realized, ratios.realized_sparsity());
        gauge(effective, ratios.effective_sparsity());
        gauge(miss, ratios.miss_rate());
        gauge(xmiss, ratios.explore_miss());
        gauge(budget, layer_budget);
        counter(steps, st.steps);
        counter(probes, st.probe_steps);
        counter(bad, st.bad_scores);
      }
      const spin::v1::LayerStats pooled =
          ToProto(0, sum, n_layers > 0 ? budget_sum / n_layers : 0.0);
      ClientMetric m;
      m.label = {{"session", s->id}};
      auto gauge = [&m](MetricFamily& f, double value) {
        ClientMetric x = m;
        x.gauge.value = value;
        f.metric.push_back(x);
      };
      auto counter = [&m](MetricFamily& f, uint64_t value) {
        ClientMetric x = m;
        x.counter.value = static_cast<double>(value);
        f.metric.push_back(x);
      };
      gauge(s_layers, n_layers);
      gauge(s_realized, pooled.realized_sparsity());
      gauge(s_effective, pooled.effective_sparsity());
      gauge(s_miss, pooled.miss_rate());
      gauge(s_xmiss, pooled.explore_miss());
      gauge(s_worst, worst);
      counter(s_steps, sum.steps);
      counter(s_probes, sum.probe_steps);
      counter(s_bad, sum.bad_scores);
    }
    ClientMetric lo;
    lo.gauge.value = static_cast<double>(without);
    left_out.metric.push_back(lo);
    ClientMetric b;
    b.gauge.value = static_cast<double>(total);
    bytes.metric.push_back(b);
    std::vector<MetricFamily> out = {
        info,    count,   bytes,   realized,   effective, miss,       xmiss,       budget,
        steps,   probes,  bad,     recomputes, s_layers,  s_realized, s_effective, s_miss,
        s_xmiss, s_worst, s_steps, s_probes,   s_bad,     left_out};
    // Every series carries the GPU labels, so they join dcgm-exporter's.
    for (MetricFamily& f : out) {
      for (ClientMetric& m : f.metric) {
        for (const ClientMetric::Label& l : device_) m.label.push_back(l);
      }
    }
    return out;
  }

 private:
  SessionManager* sessions_;
  uint64_t layer_series_;  // (session, layer) pairs with per-layer series, a scrape
  std::vector<ClientMetric::Label> device_;
};

}  // namespace

Metrics::Metrics(SessionManager* sessions, std::string gpu, std::string uuid, uint32_t layer_series)
    : registry_(std::make_shared<prometheus::Registry>()),
      sessions_(std::make_shared<SessionCollector>(sessions, gpu, uuid, layer_series)) {
  if (!gpu.empty()) device_labels_ = {{"gpu", gpu}, {"UUID", uuid}};
  policy_changes_ = &prometheus::BuildCounter()
                         .Name("spin_policy_changes_total")
                         .Help(
                             "Session policy changes, by source: session (the engine, with the "
                             "session token), operator (by id without it), default (the "
                             "node-wide default applied to a live session)")
                         .Register(*registry_);
  handled_ = &prometheus::BuildCounter()
                  .Name("grpc_server_handled_total")
                  .Help("RPCs completed on the server, by method and status code")
                  .Register(*registry_);
  handling_ = &prometheus::BuildHistogram()
                   .Name("grpc_server_handling_seconds")
                   .Help("Time from receiving an RPC to finishing it")
                   .Register(*registry_);
}

Metrics::~Metrics() = default;

absl::Status Metrics::Start(const std::string& address, int threads, int request_timeout_ms) {
  // civetweb's defaults (a 30 s request timeout, keep-alive) let two idle TCP connections hold
  // both workers for 30 s. Each worker now drops a silent peer after the timeout, connections
  // are not kept alive between scrapes, and more workers than a scrape needs serve at once.
  // No linger_timeout_ms: its 0 (an abortive close, SO_LINGER 0) reset every connection whose
  // response the kernel had not sent yet, so scrapes over about 128 KB arrived cut off. Unset,
  // civetweb closes gracefully (shutdown, then close once the peer's end is read).
  const std::vector<std::string> options = {
      "listening_ports",    address,
      "num_threads",        std::to_string(threads),
      "request_timeout_ms", std::to_string(request_timeout_ms),
      "enable_keep_alive",  "no",
      "max_request_size",   "16384",
  };
  try {
    exposer_ = std::make_unique<prometheus::Exposer>(options);
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve metrics on ", address, ": ", e.what()));
  }
  exposer_->RegisterCollectable(registry_);
  exposer_->RegisterCollectable(sessions_);
  const std::vector<int> ports = exposer_->GetListeningPorts();
  port_ = ports.empty() ? 0 : ports.front();
  return absl::OkStatus();
}

void Metrics::CountPolicyChange(const std::string& source) {
  std::map<std::string, std::string> labels = device_labels_;
  labels["source"] = source;
  policy_changes_->Add(labels).Increment();
}

void Metrics::ObserveRpc(const std::string& method, grpc::StatusCode code, double seconds) {
  const std::map<std::string, std::string> labels = {
      {"grpc_service", "spin.v1.Spin"}, {"grpc_method", method}, {"grpc_type", "unary"}};
  std::map<std::string, std::string> with_code = labels;
  with_code["grpc_code"] = CodeName(code);
  handled_->Add(with_code).Increment();
  handling_
      ->Add(labels, prometheus::Histogram::BucketBoundaries{0.00005, 0.0001, 0.00025, 0.0005, 0.001,
                                                            0.0025, 0.005, 0.01, 0.05, 0.1, 1})
      .Observe(seconds);
}

}  // namespace spin::service
