#include "eval.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <fstream>
#include <limits>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"
#include "score_math.h"
#include "spin/numerics.h"
#include "spin/status_macros.h"

namespace spin {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

double MeanOf(const std::vector<double>& v) {
  double s = 0;
  int n = 0;
  for (double x : v) {
    if (std::isnan(x)) continue;
    s += x;
    ++n;
  }
  return n ? s / n : std::nan("");
}

// Per-trace accumulation of one selector at one sparsity.
struct Acc {
  std::vector<std::vector<double>> per_layer;  // [L] misses
  uint64_t kept = 0, total = 0;
  MethodPoint Point(const std::string& method, double target) const {
    MethodPoint p;
    p.method = method;
    p.target = target;
    std::vector<double> all;
    for (const auto& l : per_layer) {
      if (l.empty()) continue;
      all.insert(all.end(), l.begin(), l.end());
      p.worst_layer_miss = std::max(p.worst_layer_miss, MeanOf(l));
    }
    p.mean_miss = MeanOf(all);
    p.p99_miss = NearestRankPercentile(&all, 0.99);
    p.effective_sparsity = total ? 1.0 - static_cast<double>(kept) / total : 0.0;
    p.worst_per_trace = {p.worst_layer_miss};
    return p;
  }
};

// The oracle signals read the previous step's or layer's dense scores.
const char* const kSignals[] = {"random", "prev-layer (oracle)", "prev-iter (oracle)",
                                "prev-iter offset 1 (oracle)"};

std::string Fmt(double x) { return absl::StrFormat("%.4f", x); }

}  // namespace

absl::Status EvalSignals(const Trace& trace, const std::vector<double>& sparsities, uint64_t seed,
                         std::vector<SignalRow>* signals, std::vector<MethodPoint>* points) {
  const TraceMeta& m = trace.meta();
  if (m.steps < 2) return absl::InvalidArgumentError("the study needs traces of 2 steps or more");
  const int b = m.block_size, K = m.topk, L = m.layers;
  constexpr int kNum = 4;
  std::vector<std::vector<double>> pearson(kNum), recall(kNum);
  std::vector<std::vector<Acc>> acc(kNum, std::vector<Acc>(sparsities.size()));
  for (auto& v : acc) {
    for (Acc& a : v) a.per_layer.resize(L);
  }
  std::mt19937_64 rng(seed);
  std::vector<float> pred(trace.n_max());
  std::vector<int32_t> dense, top, order;
  std::vector<int32_t> hits;
  std::vector<float> block_score;
  std::vector<int64_t> covered;
  for (int t = 1; t < m.steps; ++t) {
    const int ctx = m.ctx_len[t], prev_ctx = m.ctx_len[t - 1];
    const int nb = static_cast<int>(CeilDiv(ctx, b));
    const int qb = std::min(m.q_pos[t] / b, nb - 1);
    for (int l = 0; l < L; ++l) {
      const float* z = trace.scores(t, l, 0);
      TopKSlots(z, ctx, K, &dense);
      hits.assign(nb, 0);
      for (int32_t i : dense) hits[i / b] += 1;
      for (int s = 0; s < kNum; ++s) {
        if (s == 1 && l == 0) continue;  // no previous layer
        const float* prev = s == 1 ? trace.scores(t, l - 1, 0) : trace.scores(t - 1, l, 0);
        for (int i = 0; i < ctx; ++i) {
          switch (s) {
            case 0:
              pred[i] = static_cast<float>(static_cast<double>(rng() >> 11) * 0x1.0p-53);
              break;
            case 1:
              pred[i] = prev[i];
              break;
            case 2:
              pred[i] = i < prev_ctx ? prev[i] : kInf;  // unseen slots: score them
              break;
            default: {
              const int j = std::max(0, i - 1);
              pred[i] = j < prev_ctx ? prev[j] : kInf;
            }
          }
        }
        pearson[s].push_back(Pearson(pred.data(), z, ctx));
        TopKSlots(pred.data(), ctx, K, &top);
        const int64_t common = SortedOverlap(top, dense);
        recall[s].push_back(static_cast<double>(common) / std::min(K, ctx));
        // As a block selector: query block, then max-pooled prediction (NaN ignored).
        block_score.assign(nb, -kInf);
        for (int i = 0; i < ctx; ++i) {
          if (pred[i] > block_score[i / b]) block_score[i / b] = pred[i];
        }
        order.clear();
        for (int j = 0; j < nb; ++j) {
          if (j != qb) order.push_back(j);
        }
        std::sort(order.begin(), order.end(), [&](int32_t x, int32_t y) {
          return block_score[x] > block_score[y] || (block_score[x] == block_score[y] && x < y);
        });
        covered.assign(nb + 1, 0);
        covered[1] = hits[qb];
        for (int j = 1; j < nb; ++j) covered[j + 1] = covered[j] + hits[order[j - 1]];
        const int k = static_cast<int>(dense.size());
        for (size_t r = 0; r < sparsities.size(); ++r) {
          const int32_t keep = KeptBlocks(nb, K, b, sparsities[r]);
          Acc& a = acc[s][r];
          a.per_layer[l].push_back(k ? static_cast<double>(k - covered[keep]) / k : 0.0);
          a.kept += keep;
          a.total += nb;
        }
      }
    }
  }
  // Prev-iter as a realizable selector: each slot's most recent *observed* score (the engine
  // scores only the selected blocks; unseen slots are scored: +inf), closed loop per sparsity.
  // Step 0 is dense, as SPIN's first step is.
  std::vector<Acc> loop(sparsities.size());
  for (size_t r = 0; r < sparsities.size(); ++r) {
    loop[r].per_layer.resize(L);
    std::vector<float> last(static_cast<size_t>(L) * trace.n_max(), std::nanf(""));
    for (int t = 0; t < m.steps; ++t) {
      const int ctx = m.ctx_len[t];
      const int nb = static_cast<int>(CeilDiv(ctx, b));
      const int qb = std::min(m.q_pos[t] / b, nb - 1);
      for (int l = 0; l < L; ++l) {
        const float* z = trace.scores(t, l, 0);
        float* seen = last.data() + static_cast<size_t>(l) * trace.n_max();
        if (t == 0) {
          std::copy(z, z + ctx, seen);
          continue;
        }
        block_score.assign(nb, -kInf);
        for (int i = 0; i < ctx; ++i) {
          const float v = std::isnan(seen[i]) ? kInf : seen[i];
          if (v > block_score[i / b]) block_score[i / b] = v;
        }
        order.clear();
        for (int j = 0; j < nb; ++j) {
          if (j != qb) order.push_back(j);
        }
        std::sort(order.begin(), order.end(), [&](int32_t x, int32_t y) {
          return block_score[x] > block_score[y] || (block_score[x] == block_score[y] && x < y);
        });
        const int32_t keep = KeptBlocks(nb, K, b, sparsities[r]);
        hits.assign(nb, 0);
        hits[qb] = 1;
        for (int j = 0; j + 1 < keep; ++j) hits[order[j]] = 1;
        TopKSlots(z, ctx, K, &dense);
        int64_t lost = 0;
        for (int32_t i : dense) lost += hits[i / b] ? 0 : 1;
        loop[r].per_layer[l].push_back(dense.empty() ? 0.0
                                                     : static_cast<double>(lost) / dense.size());
        loop[r].kept += keep;
        loop[r].total += nb;
        for (int j = 0; j < nb; ++j) {
          if (!hits[j]) continue;
          for (int i = j * b; i < std::min(ctx, (j + 1) * b); ++i) {
            if (std::isfinite(z[i])) seen[i] = z[i];
          }
        }
      }
    }
  }
  for (int s = 0; s < kNum; ++s) {
    signals->push_back(SignalRow{kSignals[s], MeanOf(pearson[s]), MeanOf(recall[s])});
    for (size_t r = 0; r < sparsities.size(); ++r) {
      points->push_back(acc[s][r].Point(kSignals[s], sparsities[r]));
    }
  }
  for (size_t r = 0; r < sparsities.size(); ++r) {
    points->push_back(loop[r].Point("prev-iter closed loop", sparsities[r]));
  }
  return absl::OkStatus();
}

std::string MissTargetMethod(uint32_t probe_period) {
  return absl::StrCat("miss-target P=", probe_period);
}

double P99AtEffectiveSparsity(const std::vector<MethodPoint>& points, const std::string& method,
                              double at) {
  std::vector<std::pair<double, double>> xy;
  for (const MethodPoint& p : points) {
    if (p.method == method) xy.emplace_back(p.effective_sparsity, p.p99_miss);
  }
  std::sort(xy.begin(), xy.end());
  for (size_t i = 0; i + 1 < xy.size(); ++i) {
    const auto [x0, y0] = xy[i];
    const auto [x1, y1] = xy[i + 1];
    if (at < x0 || at > x1) continue;
    return x1 > x0 ? y0 + (y1 - y0) * (at - x0) / (x1 - x0) : y0;
  }
  return std::nan("");
}

namespace {

// Everything the study measures on one trace.
struct TraceStudy {
  std::string dir, shape;
  std::vector<SignalRow> signals;
  std::vector<MethodPoint> points, miss_target_points;
};

struct SpinMethod {
  std::string name;
  double exploration;
  uint32_t probe;
  BudgetMode mode;
  double miss_target;
};

absl::StatusOr<TraceStudy> StudyTrace(const EvalOptions& o, const std::vector<SpinMethod>& methods,
                                      size_t index,
                                      const std::function<void(const std::string&)>& log) {
  TraceStudy ts;
  uint64_t seed = index + 1;
  if (o.trace_dirs.empty()) {
    GenTraceOptions g = o.gen;
    g.seed = seed = o.seeds[index];
    ts.dir = absl::StrCat(o.work_dir, "/trace-", seed);
    SPIN_RETURN_IF_ERROR(GenerateTrace(ts.dir, g));
  } else {
    ts.dir = o.trace_dirs[index];
  }
  SPIN_ASSIGN_OR_RETURN(Trace trace, LoadTrace(ts.dir));
  const TraceMeta& m = trace.meta();
  ts.shape = absl::StrCat(m.layers, " layers x ", trace.n_max(), " slots x ", m.steps,
                          " steps, top-K ", m.topk);
  SPIN_RETURN_IF_ERROR(EvalSignals(trace, o.sparsities, seed, &ts.signals, &ts.points));
  log(absl::StrCat("trace ", ts.dir, ": signals done"));
  for (const SpinMethod& sm : methods) {
    const bool mt = sm.mode == BudgetMode::kMissTarget;
    for (double target : mt ? o.miss_targets : o.sparsities) {
      ReplayOptions ro;
      ro.policy.target_sparsity = mt ? Policy{}.target_sparsity : target;
      ro.policy.miss_target = mt ? target : 0.0;
      ro.policy.exploration = sm.exploration;
      ro.policy.alpha = o.alpha;
      ro.policy.probe_period = sm.probe;
      ro.policy.budget_mode = sm.mode;
      ro.budget_tuning = o.tuning;
      ro.seed = seed;
      SPIN_ASSIGN_OR_RETURN(ReplaySummary r, Replay(trace, ro));
      MethodPoint mp;
      mp.method = sm.name;
      mp.target = target;
      mp.effective_sparsity = r.effective_sparsity;
      mp.mean_miss = r.mean_miss;
      mp.p99_miss = r.p99_miss;
      mp.worst_layer_miss = r.worst_layer_mean_miss;
      mp.worst_per_trace = {r.worst_layer_mean_miss};
      (mt ? ts.miss_target_points : ts.points).push_back(mp);
      log(absl::StrFormat("trace %s: %s at %.2f: mean miss %.4f, worst layer %.4f", ts.dir, sm.name,
                          target, mp.mean_miss, mp.worst_layer_miss));
    }
  }
  return ts;
}

// Averages points of the same (method, target) over traces, methods in first-seen order.
std::vector<MethodPoint> Average(const std::vector<std::vector<MethodPoint>>& per_trace) {
  std::vector<std::string> order;
  std::map<std::pair<std::string, double>, std::vector<const MethodPoint*>> pts;
  std::vector<std::pair<std::string, double>> keys;
  for (const auto& v : per_trace) {
    for (const MethodPoint& mp : v) {
      auto key = std::make_pair(mp.method, mp.target);
      if (pts.find(key) == pts.end()) keys.push_back(key);
      pts[key].push_back(&mp);
    }
  }
  // Method by method (first seen), targets in first-seen order within a method.
  for (const auto& k : keys) {
    if (std::find(order.begin(), order.end(), k.first) == order.end()) order.push_back(k.first);
  }
  std::vector<MethodPoint> out;
  for (const std::string& name : order) {
    for (const auto& k : keys) {
      if (k.first != name) continue;
      const std::vector<const MethodPoint*>& v = pts[k];
      MethodPoint a;
      a.method = name;
      a.target = k.second;
      for (const MethodPoint* mp : v) {
        a.effective_sparsity += mp->effective_sparsity / v.size();
        a.mean_miss += mp->mean_miss / v.size();
        a.p99_miss += mp->p99_miss / v.size();
        a.worst_layer_miss += mp->worst_layer_miss / v.size();
        a.worst_per_trace.push_back(mp->worst_layer_miss);
      }
      out.push_back(a);
    }
  }
  return out;
}

}  // namespace

absl::StatusOr<EvalResult> RunEval(const EvalOptions& o) {
  if (o.trace_dirs.empty() && o.seeds.empty()) {
    return absl::InvalidArgumentError("the study needs at least one seed or one trace");
  }
  if (o.sparsities.empty()) {
    return absl::InvalidArgumentError("the study needs at least one sparsity");
  }
  for (double r : o.sparsities) {
    if (!(r >= 0 && r < 1)) {
      return absl::InvalidArgumentError(absl::StrCat("sparsity ", r, " is out of range [0, 1)"));
    }
  }
  for (double m : o.miss_targets) {
    if (!(m > 0 && m < 1)) {
      return absl::InvalidArgumentError(absl::StrCat("miss target ", m, " is out of range (0, 1)"));
    }
  }
  if (o.probe_period == 0) {
    return absl::InvalidArgumentError("the budget comparison needs a probe period > 0");
  }
  if (o.jobs < 1) {
    return absl::InvalidArgumentError(absl::StrCat("jobs must be >= 1, not ", o.jobs));
  }
  SPIN_RETURN_IF_ERROR(ValidateBudgetTuning(o.tuning));
  std::mutex log_mu;
  auto log = [&](const std::string& line) {
    std::lock_guard<std::mutex> lock(log_mu);
    if (o.log) o.log(line);
  };
  const std::string p = absl::StrCat("P=", o.probe_period);
  std::vector<SpinMethod> methods = {
      {"SPIN no exploration", 0.0, 0, BudgetMode::kUniform, 0},
      {"SPIN 5% exploration", 0.05, 0, BudgetMode::kUniform, 0},
      {"SPIN 20% exploration", 0.2, 0, BudgetMode::kUniform, 0},
      {absl::StrCat("uniform budgets ", p), o.budget_exploration, o.probe_period,
       BudgetMode::kUniform, 0},
      {absl::StrCat("per-layer budgets ", p), o.budget_exploration, o.probe_period,
       BudgetMode::kPerLayer, 0},
  };
  if (!o.miss_targets.empty()) {
    methods.push_back({MissTargetMethod(o.probe_period), o.budget_exploration, o.probe_period,
                       BudgetMode::kMissTarget, 0});
  }

  // Traces are independent: `jobs` threads take them in turn; results are kept by index, so the
  // output does not depend on the order they finish in.
  const size_t n = o.trace_dirs.empty() ? o.seeds.size() : o.trace_dirs.size();
  std::vector<absl::StatusOr<TraceStudy>> studies(n, absl::UnknownError("not run"));
  std::atomic<size_t> next{0};
  auto worker = [&] {
    for (size_t i = next++; i < n; i = next++) studies[i] = StudyTrace(o, methods, i, log);
  };
  std::vector<std::thread> threads;
  for (int j = 1; j < std::min<int>(o.jobs, static_cast<int>(n)); ++j) threads.emplace_back(worker);
  worker();
  for (std::thread& t : threads) t.join();

  EvalResult out;
  std::vector<std::vector<MethodPoint>> points, mt_points;
  std::map<std::string, std::vector<SignalRow>> sig;
  for (auto& s : studies) {
    if (!s.ok()) return s.status();
    out.traces.push_back(s->dir);
    out.trace_shapes.push_back(s->shape);
    for (const SignalRow& r : s->signals) sig[r.signal].push_back(r);
    points.push_back(std::move(s->points));
    mt_points.push_back(std::move(s->miss_target_points));
  }
  for (const char* s : kSignals) {
    const std::vector<SignalRow>& v = sig[s];
    SignalRow row{s, 0, 0};
    for (const SignalRow& r : v) {
      row.pearson += r.pearson / v.size();
      row.recall += r.recall / v.size();
    }
    out.signals.push_back(row);
  }
  out.points = Average(points);
  out.miss_target_points = Average(mt_points);
  return out;
}

namespace {

nlohmann::json PointJson(const MethodPoint& p) {
  return {{"method", p.method},
          {"target", p.target},
          {"effective_sparsity", p.effective_sparsity},
          {"mean_miss", p.mean_miss},
          {"p99_miss", p.p99_miss},
          {"worst_layer_miss", p.worst_layer_miss},
          {"worst_per_trace", p.worst_per_trace}};
}

std::vector<MethodPoint> AllPoints(const EvalResult& r) {
  std::vector<MethodPoint> all = r.points;
  all.insert(all.end(), r.miss_target_points.begin(), r.miss_target_points.end());
  return all;
}

std::vector<std::string> Methods(const EvalResult& r) {
  std::vector<std::string> names;
  for (const MethodPoint& p : r.points) {
    if (std::find(names.begin(), names.end(), p.method) == names.end()) {
      names.push_back(p.method);
    }
  }
  return names;
}

// The budget methods of a result, in its order: uniform and per-layer budgets, then the
// miss-target mode when it ran (the 50%-sparsity comparison and budgets.dat).
std::vector<std::string> BudgetMethods(const EvalResult& r) {
  std::vector<std::string> v;
  for (const std::string& n : Methods(r)) {
    if (n.find("budgets") != std::string::npos) v.push_back(n);
  }
  if (!r.miss_target_points.empty()) v.push_back(r.miss_target_points[0].method);
  return v;
}

}  // namespace

std::string EvalJson(const EvalOptions& o, const EvalResult& r) {
  nlohmann::json j;
  if (o.trace_dirs.empty()) {
    j["seeds"] = o.seeds;
    j["trace"] = {{"layers", o.gen.layers},    {"slots", o.gen.slots},
                  {"steps", o.gen.steps},      {"topk", o.gen.topk},
                  {"shifts", o.gen.shifts},    {"noise", o.gen.noise_scale},
                  {"drift", o.gen.drift_scale}};
  }
  j["traces"] = nlohmann::json::array();
  for (size_t i = 0; i < r.traces.size(); ++i) {
    j["traces"].push_back(
        {{"dir", r.traces[i]}, {"shape", i < r.trace_shapes.size() ? r.trace_shapes[i] : ""}});
  }
  j["sparsities"] = o.sparsities;
  j["miss_targets"] = o.miss_targets;
  j["probe_period"] = o.probe_period;
  j["budget_exploration"] = o.budget_exploration;
  j["alpha"] = o.alpha;
  j["budget_smoothing"] = o.tuning.smoothing;
  j["budget_drift"] = o.tuning.drift_threshold;
  j["signals"] = nlohmann::json::array();
  for (const SignalRow& s : r.signals) {
    j["signals"].push_back({{"signal", s.signal}, {"pearson", s.pearson}, {"recall", s.recall}});
  }
  j["points"] = nlohmann::json::array();
  for (const MethodPoint& p : r.points) j["points"].push_back(PointJson(p));
  j["miss_target_points"] = nlohmann::json::array();
  for (const MethodPoint& p : r.miss_target_points) j["miss_target_points"].push_back(PointJson(p));
  // NaN (outside a method's range) becomes null.
  j["p99_at_half_effective_sparsity"] = nlohmann::json::object();
  const std::vector<MethodPoint> all = AllPoints(r);
  for (const std::string& m : BudgetMethods(r)) {
    const double v = P99AtEffectiveSparsity(all, m, 0.5);
    j["p99_at_half_effective_sparsity"][m] = std::isnan(v) ? nlohmann::json() : nlohmann::json(v);
  }
  return j.dump();
}

namespace {

const MethodPoint* Find(const EvalResult& r, const std::string& method, double target) {
  for (const MethodPoint& p : r.points) {
    if (p.method == method && p.target == target) return &p;
  }
  return nullptr;
}

}  // namespace

std::string EvalMarkdown(const EvalOptions& o, const EvalResult& r) {
  std::string out;
  if (o.trace_dirs.empty()) {
    out = absl::StrCat("Traces: seeds ", absl::StrJoin(o.seeds, ", "), "; ", o.gen.layers,
                       " layers x ", o.gen.slots, " slots x ", o.gen.steps, " steps, top-K ",
                       o.gen.topk, ", ", o.gen.shifts, " sudden shifts, noise x", o.gen.noise_scale,
                       ", drift x", o.gen.drift_scale, ".\n\n");
  } else {
    out = "Traces:\n\n";
    for (size_t i = 0; i < r.traces.size(); ++i) {
      absl::StrAppend(&out, "- `", r.traces[i],
                      "`: ", i < r.trace_shapes.size() ? r.trace_shapes[i] : "", "\n");
    }
    absl::StrAppend(&out, "\n");
  }
  absl::StrAppend(&out, "Prediction signals against the dense scores (Table 1 analogue, row 0, ",
                  "steps >= 1):\n\n| signal | Pearson | top-K recall |\n|---|---|---|\n");
  for (const SignalRow& s : r.signals) {
    absl::StrAppend(&out, "| ", s.signal, " | ", Fmt(s.pearson), " | ", Fmt(s.recall), " |\n");
  }
  const std::vector<std::string> names = Methods(r);
  for (const auto& [title, field] :
       {std::pair{"Mean miss", &MethodPoint::mean_miss},
        std::pair{"p99 miss", &MethodPoint::p99_miss},
        std::pair{"Worst-layer mean miss", &MethodPoint::worst_layer_miss},
        std::pair{"Effective sparsity", &MethodPoint::effective_sparsity}}) {
    absl::StrAppend(&out, "\n", title, " by target sparsity:\n\n| method |");
    for (double rho : o.sparsities) absl::StrAppend(&out, " ", absl::StrFormat("%.2f", rho), " |");
    absl::StrAppend(&out, "\n|---|");
    for (size_t i = 0; i < o.sparsities.size(); ++i) absl::StrAppend(&out, "---|");
    absl::StrAppend(&out, "\n");
    for (const std::string& name : names) {
      absl::StrAppend(&out, "| ", name, " |");
      for (double rho : o.sparsities) {
        const MethodPoint* p = Find(r, name, rho);
        absl::StrAppend(&out, " ", p ? Fmt(p->*field) : "-", " |");
      }
      absl::StrAppend(&out, "\n");
    }
  }
  const std::string p = absl::StrCat("P=", o.probe_period);
  const std::string uni = absl::StrCat("uniform budgets ", p),
                    per = absl::StrCat("per-layer budgets ", p);
  absl::StrAppend(&out, "\nPer-layer against uniform budgets (", p, ", ",
                  absl::StrFormat("%.0f%%", 100 * o.budget_exploration),
                  " exploration):\n\n| target | effective (uniform / per-layer) | mean miss | "
                  "worst-layer mean miss | worst-layer cut, mean (min over traces) |\n"
                  "|---|---|---|---|---|\n");
  for (double rho : o.sparsities) {
    const MethodPoint *u = Find(r, uni, rho), *q = Find(r, per, rho);
    if (!u || !q) continue;
    double min_cut = 1;
    for (size_t i = 0; i < u->worst_per_trace.size() && i < q->worst_per_trace.size(); ++i) {
      const double w = u->worst_per_trace[i];
      min_cut = std::min(min_cut, w > 0 ? 1 - q->worst_per_trace[i] / w : 0.0);
    }
    const double cut = u->worst_layer_miss > 0 ? 1 - q->worst_layer_miss / u->worst_layer_miss : 0;
    absl::StrAppend(
        &out, absl::StrFormat(
                  "| %.2f | %.4f / %.4f | %.4f / %.4f | %.4f / %.4f | %.1f%% (%.1f%%) |\n", rho,
                  u->effective_sparsity, q->effective_sparsity, u->mean_miss, q->mean_miss,
                  u->worst_layer_miss, q->worst_layer_miss, 100 * cut, 100 * min_cut));
  }
  if (!r.miss_target_points.empty()) {
    absl::StrAppend(&out, "\nMiss-target mode (", p, ", ",
                    absl::StrFormat("%.0f%%", 100 * o.budget_exploration),
                    " exploration): the worst layer's mean miss against its target M\n\n"
                    "| M | effective sparsity | mean miss | p99 miss | worst-layer mean miss | "
                    "worst / M, mean (max over traces) |\n|---|---|---|---|---|---|\n");
    for (const MethodPoint& q : r.miss_target_points) {
      double worst = 0;
      for (double w : q.worst_per_trace) worst = std::max(worst, w);
      absl::StrAppend(
          &out, absl::StrFormat("| %.3f | %.4f | %.4f | %.4f | %.4f | %.3f (%.3f) |\n", q.target,
                                q.effective_sparsity, q.mean_miss, q.p99_miss, q.worst_layer_miss,
                                q.worst_layer_miss / q.target, worst / q.target));
    }
  }
  absl::StrAppend(&out,
                  "\np99 step miss at 50% effective sparsity (the paper's RULER-style worst "
                  "case; linear between the two points around 0.5, - when none are):\n\n"
                  "| method | p99 miss |\n|---|---|\n");
  const std::vector<MethodPoint> all = AllPoints(r);
  for (const std::string& m : BudgetMethods(r)) {
    const double v = P99AtEffectiveSparsity(all, m, 0.5);
    absl::StrAppend(&out, "| ", m, " | ", std::isnan(v) ? "-" : Fmt(v), " |\n");
  }
  return out;
}

absl::Status WriteEvalData(const EvalResult& r, const std::string& dir) {
  const std::vector<std::string> names = Methods(r);
  std::vector<double> targets;
  for (const MethodPoint& p : r.points) {
    if (std::find(targets.begin(), targets.end(), p.target) == targets.end()) {
      targets.push_back(p.target);
    }
  }
  for (const auto& [file, field] : {std::pair{"mean.dat", &MethodPoint::mean_miss},
                                    std::pair{"p99.dat", &MethodPoint::p99_miss},
                                    std::pair{"worst.dat", &MethodPoint::worst_layer_miss}}) {
    const std::string path = absl::StrCat(dir, "/", file);
    std::ofstream f(path, std::ios::trunc);
    f << "\"target sparsity\"";
    for (const std::string& n : names) f << "\t\"" << n << "\"";
    f << "\n";
    for (double t : targets) {
      f << absl::StrFormat("%.2f", t);
      for (const std::string& n : names) {
        const MethodPoint* p = Find(r, n, t);
        f << "\t" << (p ? absl::StrFormat("%.6f", p->*field) : std::string("NaN"));
      }
      f << "\n";
    }
    f.flush();
    if (!f) return absl::InvalidArgumentError(absl::StrCat("cannot write ", path));
  }
  // Effective sparsity against worst-layer miss of the budget comparison (x = effective).
  const std::string path = absl::StrCat(dir, "/budgets.dat");
  std::ofstream f(path, std::ios::trunc);
  f << "# method\ttarget\teffective_sparsity\tmean_miss\tp99_miss\tworst_layer_miss\n";
  // One data set per budget method (gnuplot `index` 0, 1, then 2: the miss-target runs, whose
  // target column is M).
  const std::vector<MethodPoint> all = AllPoints(r);
  bool first = true;
  for (const std::string& n : BudgetMethods(r)) {
    f << (first ? "" : "\n\n") << "# " << n << "\n";
    first = false;
    for (const MethodPoint& p : all) {
      if (p.method != n) continue;
      f << absl::StrFormat("\"%s\"\t%g\t%.6f\t%.6f\t%.6f\t%.6f\n", n, p.target,
                           p.effective_sparsity, p.mean_miss, p.p99_miss, p.worst_layer_miss);
    }
  }
  f.flush();
  if (!f) return absl::InvalidArgumentError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

}  // namespace spin
