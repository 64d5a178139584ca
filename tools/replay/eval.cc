#include "eval.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <map>
#include <random>

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

absl::StatusOr<EvalResult> RunEval(const EvalOptions& o) {
  if (o.seeds.empty() || o.sparsities.empty()) {
    return absl::InvalidArgumentError("the study needs at least one seed and one sparsity");
  }
  for (double r : o.sparsities) {
    if (!(r >= 0 && r < 1)) {
      return absl::InvalidArgumentError(absl::StrCat("sparsity ", r, " is out of range [0, 1)"));
    }
  }
  if (o.probe_period == 0) {
    return absl::InvalidArgumentError("the budget comparison needs a probe period > 0");
  }
  SPIN_RETURN_IF_ERROR(ValidateBudgetTuning(o.tuning));
  auto log = [&](const std::string& line) {
    if (o.log) o.log(line);
  };
  struct SpinMethod {
    std::string name;
    double exploration;
    uint32_t probe;
    BudgetMode mode;
  };
  const std::string p = absl::StrCat("P=", o.probe_period);
  const std::vector<SpinMethod> methods = {
      {"SPIN no exploration", 0.0, 0, BudgetMode::kUniform},
      {"SPIN 5% exploration", 0.05, 0, BudgetMode::kUniform},
      {"SPIN 20% exploration", 0.2, 0, BudgetMode::kUniform},
      {absl::StrCat("uniform budgets ", p), o.budget_exploration, o.probe_period,
       BudgetMode::kUniform},
      {absl::StrCat("per-layer budgets ", p), o.budget_exploration, o.probe_period,
       BudgetMode::kPerLayer},
  };

  EvalResult out;
  std::map<std::string, std::vector<SignalRow>> sig;
  std::map<std::pair<std::string, double>, std::vector<MethodPoint>> pts;
  std::vector<std::string> order;
  auto add_point = [&](const MethodPoint& mp) {
    auto key = std::make_pair(mp.method, mp.target);
    if (pts.find(key) == pts.end() &&
        std::find(order.begin(), order.end(), mp.method) == order.end()) {
      order.push_back(mp.method);
    }
    pts[key].push_back(mp);
  };
  for (uint64_t seed : o.seeds) {
    GenTraceOptions g = o.gen;
    g.seed = seed;
    const std::string dir = absl::StrCat(o.work_dir, "/trace-", seed);
    SPIN_RETURN_IF_ERROR(GenerateTrace(dir, g));
    SPIN_ASSIGN_OR_RETURN(Trace trace, LoadTrace(dir));
    out.traces.push_back(dir);
    std::vector<SignalRow> rows;
    std::vector<MethodPoint> points;
    if (absl::Status s = EvalSignals(trace, o.sparsities, seed, &rows, &points); !s.ok()) {
      return s;
    }
    for (const SignalRow& r : rows) sig[r.signal].push_back(r);
    for (const MethodPoint& mp : points) add_point(mp);
    log(absl::StrCat("trace ", dir, ": signals done"));
    for (const SpinMethod& sm : methods) {
      for (double rho : o.sparsities) {
        ReplayOptions ro;
        ro.policy.target_sparsity = rho;
        ro.policy.exploration = sm.exploration;
        ro.policy.alpha = o.alpha;
        ro.policy.probe_period = sm.probe;
        ro.policy.budget_mode = sm.mode;
        ro.budget_tuning = o.tuning;
        ro.seed = seed;
        SPIN_ASSIGN_OR_RETURN(ReplaySummary r, Replay(trace, ro));
        MethodPoint mp;
        mp.method = sm.name;
        mp.target = rho;
        mp.effective_sparsity = r.effective_sparsity;
        mp.mean_miss = r.mean_miss;
        mp.p99_miss = r.p99_miss;
        mp.worst_layer_miss = r.worst_layer_mean_miss;
        mp.worst_per_trace = {r.worst_layer_mean_miss};
        add_point(mp);
        log(absl::StrFormat("trace %s: %s at %.2f: mean miss %.4f, worst layer %.4f", dir, sm.name,
                            rho, mp.mean_miss, mp.worst_layer_miss));
      }
    }
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
  for (const std::string& name : order) {
    for (double rho : o.sparsities) {
      const std::vector<MethodPoint>& v = pts[{name, rho}];
      MethodPoint a;
      a.method = name;
      a.target = rho;
      for (const MethodPoint& mp : v) {
        a.effective_sparsity += mp.effective_sparsity / v.size();
        a.mean_miss += mp.mean_miss / v.size();
        a.p99_miss += mp.p99_miss / v.size();
        a.worst_layer_miss += mp.worst_layer_miss / v.size();
        a.worst_per_trace.push_back(mp.worst_layer_miss);
      }
      out.points.push_back(a);
    }
  }
  return out;
}

std::string EvalJson(const EvalOptions& o, const EvalResult& r) {
  nlohmann::json j;
  j["seeds"] = o.seeds;
  j["sparsities"] = o.sparsities;
  j["trace"] = {{"layers", o.gen.layers},    {"slots", o.gen.slots},   {"steps", o.gen.steps},
                {"topk", o.gen.topk},        {"shifts", o.gen.shifts}, {"noise", o.gen.noise_scale},
                {"drift", o.gen.drift_scale}};
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
  for (const MethodPoint& p : r.points) {
    j["points"].push_back({{"method", p.method},
                           {"target", p.target},
                           {"effective_sparsity", p.effective_sparsity},
                           {"mean_miss", p.mean_miss},
                           {"p99_miss", p.p99_miss},
                           {"worst_layer_miss", p.worst_layer_miss},
                           {"worst_per_trace", p.worst_per_trace}});
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

std::vector<std::string> Methods(const EvalResult& r) {
  std::vector<std::string> names;
  for (const MethodPoint& p : r.points) {
    if (std::find(names.begin(), names.end(), p.method) == names.end()) {
      names.push_back(p.method);
    }
  }
  return names;
}

}  // namespace

std::string EvalMarkdown(const EvalOptions& o, const EvalResult& r) {
  std::string out = absl::StrCat(
      "Traces: seeds ", absl::StrJoin(o.seeds, ", "), "; ", o.gen.layers, " layers x ", o.gen.slots,
      " slots x ", o.gen.steps, " steps, top-K ", o.gen.topk, ", ", o.gen.shifts,
      " sudden shifts, noise x", o.gen.noise_scale, ", drift x", o.gen.drift_scale, ".\n\n");
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
  bool first = true;
  for (const std::string& n : names) {
    if (n.find("budgets") == std::string::npos) continue;
    f << (first ? "" : "\n\n") << "# " << n << "\n";
    first = false;
    for (const MethodPoint& p : r.points) {
      if (p.method != n) continue;
      f << absl::StrFormat("\"%s\"\t%.2f\t%.6f\t%.6f\t%.6f\t%.6f\n", n, p.target,
                           p.effective_sparsity, p.mean_miss, p.p99_miss, p.worst_layer_miss);
    }
  }
  f.flush();
  if (!f) return absl::InvalidArgumentError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

}  // namespace spin
