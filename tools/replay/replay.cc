#include "replay.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "nlohmann/json.hpp"
#include "score_math.h"
#include "spin/data_plane_setup.h"
#include "spin/numerics.h"
#include "spin/status_macros.h"

namespace spin {
namespace {

double Mean(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return v.empty() ? 0.0 : s / static_cast<double>(v.size());
}

double Skipped(uint64_t kept, uint64_t total) {
  return total == 0 ? 0.0 : 1.0 - static_cast<double>(kept) / static_cast<double>(total);
}

// Buffers and copies in the data plane's memory: host memory for the CPU backend, device memory
// for the CUDA backend (replay is a tool: synchronous copies are fine here).
class PlaneMemory {
 public:
  explicit PlaneMemory(bool device) : device_(device) {}
  ~PlaneMemory() {
    for (void* p : owned_) {
#if SPIN_HAVE_CUDA
      if (device_) {
        DeviceFree(p);
        continue;
      }
#endif
      std::free(p);
    }
  }
  absl::StatusOr<void*> Alloc(size_t bytes) {
#if SPIN_HAVE_CUDA
    if (device_) {
      absl::StatusOr<void*> p = DeviceAlloc(bytes);
      if (p.ok()) owned_.push_back(*p);
      return p;
    }
#endif
    void* p = std::malloc(bytes ? bytes : 1);
    if (!p) return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", bytes, " bytes"));
    owned_.push_back(p);
    return p;
  }
  absl::Status Put(void* dst, const void* src, size_t bytes) {
#if SPIN_HAVE_CUDA
    if (device_) return CopyToDevice(dst, src, bytes);
#endif
    std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
  absl::Status Get(void* dst, const void* src, size_t bytes) {
#if SPIN_HAVE_CUDA
    if (device_) return CopyToHost(dst, src, bytes);
#endif
    std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }

 private:
  bool device_;
  std::vector<void*> owned_;
};

}  // namespace

Geometry TraceGeometry(const TraceMeta& meta, int64_t n_max, StateDtype dtype) {
  Geometry g;
  g.layers = static_cast<uint32_t>(meta.layers);
  g.max_seqs = 1;
  g.max_slots = static_cast<uint32_t>(n_max);
  g.block_size = static_cast<uint32_t>(meta.block_size);
  g.topk = static_cast<uint32_t>(meta.topk);
  g.max_rows = static_cast<uint32_t>(meta.rows);
  g.dtype = dtype;
  return g;
}

namespace {

// What the CPU backend's Observe reads about a step besides the logits: the batch header, the
// entry of slot 0 and the last Select's outputs. The emulated MTP modes put a step's context
// back to observe its rows later (host arena, one entry).
struct StepContext {
  BatchHeader header{};
  StepEntry entry{};
  int32_t count = 0;
  std::vector<int32_t> ids, clen;

  void Save(const ArenaView& a) {
    header = *a.batch;
    entry = a.entries[0];
    count = a.union_count[0];
    ids.assign(a.union_ids, a.union_ids + a.max_blocks);
    clen.assign(a.compact_len, a.compact_len + a.geometry.max_rows);
  }
  void Restore(const ArenaView& a) const {
    *a.batch = header;
    a.entries[0] = entry;
    a.union_count[0] = count;
    std::copy(ids.begin(), ids.end(), a.union_ids);
    std::copy(clen.begin(), clen.end(), a.compact_len);
  }
};

}  // namespace

absl::StatusOr<MtpObserve> ParseMtpObserve(const std::string& name) {
  if (name == "same-step") return MtpObserve::kSameStep;
  if (name == "row0") return MtpObserve::kRow0;
  if (name == "all") return MtpObserve::kAll;
  if (name == "deferred") return MtpObserve::kDeferred;
  if (name == "late") return MtpObserve::kLate;
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown MTP observe mode '", name, "' (expected same-step, row0, all, deferred or late)"));
}

absl::StatusOr<ReplaySummary> ReplayOn(DataPlane& dp, const Trace& trace,
                                       const ReplayOptions& options) {
  const TraceMeta& meta = trace.meta();
  const ArenaView& a = dp.arena();
  const Geometry& g = a.geometry;
  if (g.layers != static_cast<uint32_t>(meta.layers) ||
      g.block_size != static_cast<uint32_t>(meta.block_size) ||
      g.topk != static_cast<uint32_t>(meta.topk) || g.max_rows < static_cast<uint32_t>(meta.rows) ||
      g.max_slots < trace.n_max()) {
    return absl::InvalidArgumentError(
        "the session's geometry does not fit the trace (layers, block size, top-K, rows, slots)");
  }
  std::unique_ptr<std::ofstream> dump;
  if (!options.dump_path.empty()) {
    dump = std::make_unique<std::ofstream>(options.dump_path, std::ios::trunc);
    if (!*dump) {
      return absl::InvalidArgumentError(
          absl::StrCat("cannot write the dump file ", options.dump_path));
    }
  }
  SPIN_RETURN_IF_ERROR(dp.ResetSequence(0, options.sequence_key));

  const int32_t b = meta.block_size, rows = meta.rows, k = meta.topk;
  const int32_t max_blocks = static_cast<int32_t>(a.max_blocks);
  const int64_t stride = static_cast<int64_t>(max_blocks) * b;
  PlaneMemory mem(dp.on_device());
  // The engine's per-step buffers, in the data plane's memory (fixed addresses).
  absl::StatusOr<void*> p_batch = mem.Alloc(6 * sizeof(int32_t));
  absl::StatusOr<void*> p_logits = mem.Alloc(stride * rows * sizeof(float));
  absl::StatusOr<void*> p_topk = mem.Alloc(static_cast<size_t>(rows) * k * sizeof(int32_t));
  for (const auto* p : {&p_batch, &p_logits, &p_topk}) {
    if (!p->ok()) return p->status();
  }
  int32_t* d_batch = static_cast<int32_t*>(*p_batch);  // seq, ctx, q, accepted, 1, rows
  float* d_logits = static_cast<float*>(*p_logits);
  int32_t* d_topk = static_cast<int32_t*>(*p_topk);

  std::vector<std::vector<double>> miss(meta.layers);
  std::vector<float> logits;
  std::vector<int32_t> dense_topk, sparse_topk, ids(max_blocks), clen(rows);
  // Stats counters are monotone: remember where they started so a shared arena works too.
  std::vector<LayerStats> start(meta.layers), now(meta.layers);
  if (absl::Status s = mem.Get(start.data(), a.stats, meta.layers * sizeof(LayerStats)); !s.ok()) {
    return s;
  }
  LayerStats before, after;
  auto fail = [](int t, int l, const absl::Status& s) {
    return absl::Status(s.code(), absl::StrCat("step ", t, " layer ", l, ": ", s.message()));
  };
  ArenaPolicy policy;
  SPIN_RETURN_IF_ERROR(mem.Get(&policy, a.policy, sizeof(policy)));
  const uint64_t start_epoch = policy.epoch;
  const BudgetMode mode = static_cast<BudgetMode>(policy.budget_mode);

  // Per-layer budgets run here after each probe step, as spind's probe thread runs them (the
  // table starts at InitialBudget: uniform at the target, dense for a miss target).
  std::optional<LocalBudgets> budgets;
  if (TableFromProbes(mode) && options.local_budgets) {
    SPIN_ASSIGN_OR_RETURN(budgets, LocalBudgets::Create(g, options.budget_tuning));
    SPIN_RETURN_IF_ERROR(budgets->WriteInitial(dp));
  }
  auto probe = [&](int t) -> absl::Status {
    if (!budgets) return {};
    return budgets->AfterStep(dp, t).status();
  };

  // The emulated MTP modes keep each layer's last step (its context and logits) to observe it
  // at the next step.
  const MtpObserve mtp = options.mtp_observe;
  const bool emulated = mtp == MtpObserve::kDeferred || mtp == MtpObserve::kLate;
  if (emulated && (dp.on_device() || policy.probe_period != 0 || mode != BudgetMode::kUniform)) {
    return absl::InvalidArgumentError(
        "the deferred and late MTP observe modes are emulated on the CPU backend with uniform "
        "budgets and no probe steps (use --backend cpu --probe-period 0 --budget uniform)");
  }
  std::vector<StepContext> held(emulated ? meta.layers : 0);
  std::vector<std::vector<float>> held_logits(held.size());
  std::vector<int32_t> held_accepted(held.size(), 0);
  StepContext now_ctx;
  auto observe_held = [&](int l, bool restore_outputs) -> absl::Status {
    if (held_accepted[l] == 0) return {};
    now_ctx.Save(a);
    held[l].Restore(a);
    int32_t acc = held_accepted[l];
    SPIN_RETURN_IF_ERROR(dp.Observe(l, held_logits[l].data(), stride, &acc));
    held_accepted[l] = 0;
    if (restore_outputs) {
      now_ctx.Restore(a);
    } else {
      *a.batch = now_ctx.header;
      a.entries[0] = now_ctx.entry;
    }
    return {};
  };

  for (int t = 0; t < meta.steps; ++t) {
    const int32_t ctx = meta.ctx_len[t];
    const int32_t accepted_t = meta.accepted.empty() ? rows : meta.accepted[t];
    const int32_t host_batch[6] = {0, ctx, meta.q_pos[t], accepted_t, 1, rows};
    SPIN_RETURN_IF_ERROR(mem.Put(d_batch, host_batch, sizeof(host_batch)));
    const StepBatch batch{d_batch, d_batch + 1, d_batch + 2, 1, rows};
    if (absl::Status s = dp.BeginStep(batch); !s.ok()) return fail(t, -1, s);
    for (int l = 0; l < meta.layers; ++l) {
      // deferred: the draft rows of the last step go in before this step selects.
      absl::Status s = mtp == MtpObserve::kDeferred ? observe_held(l, false) : absl::OkStatus();
      if (s.ok()) s = mem.Get(&before, a.stats + l, sizeof(before));
      if (s.ok()) s = dp.Select(l);
      if (s.ok()) s = mem.Get(&after, a.stats + l, sizeof(after));
      int32_t count = 0;
      if (s.ok()) s = mem.Get(&count, a.union_count, sizeof(count));
      if (s.ok()) s = mem.Get(ids.data(), a.union_ids, count * sizeof(int32_t));
      if (s.ok()) s = mem.Get(clen.data(), a.compact_len, rows * sizeof(int32_t));
      if (!s.ok()) return fail(t, l, s);
      const bool dense = after.dense_steps != before.dense_steps;
      // The engine's indexer over the compacted table: row r sees the union's slots below
      // its own context; the rest of the row is padding.
      logits.assign(stride * rows, -INFINITY);
      for (int32_t r = 0; r < rows; ++r) {
        const float* z = trace.scores(t, l, r);
        const int32_t n = ctx + r;
        for (int32_t c = 0; c < count; ++c) {
          const int32_t lo = ids[c] * b, hi = std::min(lo + b, n);
          if (lo < hi) {
            std::copy(z + lo, z + hi, logits.begin() + r * stride + static_cast<int64_t>(c) * b);
          }
        }
      }
      // The engine's own top-K over the compacted logits, remapped to logical slots.
      sparse_topk.assign(static_cast<size_t>(rows) * k, -1);
      for (int32_t r = 0; r < rows; ++r) {
        TopKSlots(logits.data() + r * stride, clen[r], k, &dense_topk);
        std::copy(dense_topk.begin(), dense_topk.end(), sparse_topk.begin() + r * k);
      }
      s = mem.Put(d_topk, sparse_topk.data(), sparse_topk.size() * sizeof(int32_t));
      // Given as the engine's (RemapTopK): a probe step counts it against the miss curve, and
      // a sparse step's exploration blocks measure the step's miss (docs/budgets.md).
      if (s.ok()) s = dp.RemapTopK(d_topk, k);
      if (s.ok()) s = mem.Get(sparse_topk.data(), d_topk, sparse_topk.size() * sizeof(int32_t));
      if (s.ok()) s = mem.Put(d_logits, logits.data(), logits.size() * sizeof(float));
      switch (mtp) {
        case MtpObserve::kSameStep:
          if (s.ok()) s = dp.Observe(l, d_logits, stride, d_batch + 3);
          break;
        case MtpObserve::kRow0:
          if (s.ok()) s = dp.Observe(l, d_logits, stride, d_batch + 4);
          break;
        case MtpObserve::kAll:
          if (s.ok()) s = dp.Observe(l, d_logits, stride, d_batch + 5);
          break;
        case MtpObserve::kDeferred:
          // Row 0 now; rows 1.. are held, with row 0 blanked (non-finite scores are skipped).
          if (s.ok()) s = dp.Observe(l, d_logits, stride, d_batch + 4);
          if (s.ok() && accepted_t > 1) {
            held[l].Save(a);
            held_logits[l] = logits;
            std::fill(held_logits[l].begin(), held_logits[l].begin() + stride, NAN);
            held_accepted[l] = accepted_t;
          }
          break;
        case MtpObserve::kLate:
          // The last step's rows now, after this step's selection; this step's wait.
          if (s.ok()) s = observe_held(l, true);
          if (s.ok()) {
            held[l].Save(a);
            held_logits[l] = logits;
            held_accepted[l] = accepted_t;
          }
          break;
      }
      if (!s.ok()) return fail(t, l, s);
      // Miss of row 0: dense top-K slots that the sparse top-K lost, i.e. that lie in skipped
      // blocks (a dense top-K slot in a selected block is in the sparse top-K too).
      TopKSlots(trace.scores(t, l, 0), ctx, k, &dense_topk);
      std::sort(sparse_topk.begin(), sparse_topk.begin() + k);
      int32_t lost = 0;
      for (int32_t i : dense_topk) {
        if (!std::binary_search(sparse_topk.begin(), sparse_topk.begin() + k, i)) ++lost;
      }
      const double m = dense_topk.empty() ? 0.0 : static_cast<double>(lost) / dense_topk.size();
      if (!dense) miss[l].push_back(m);
      if (options.exact_miss_measure && !dense) {
        // The step's exploration estimate (RemapTopK's increment of the layer's counters), if
        // the data plane measured it, replaced by the realized miss: lost of the dense top-K.
        LayerStats st;
        SPIN_RETURN_IF_ERROR(mem.Get(&st, a.stats + l, sizeof(st)));
        if (st.explore_steps > after.explore_steps) {
          st.explore_topk = after.explore_topk + dense_topk.size();
          st.explore_est = after.explore_est + static_cast<uint64_t>(lost) * kExploreEstUnit;
          SPIN_RETURN_IF_ERROR(mem.Put(a.stats + l, &st, sizeof(st)));
        }
      }
      if (dump) {
        std::string line = absl::StrCat("{\"step\":", t, ",\"layer\":", l, ",\"blocks\":[");
        for (int32_t c = 0; c < count; ++c) absl::StrAppend(&line, c ? "," : "", ids[c]);
        absl::StrAppend(&line, "],\"miss\":", absl::StrFormat("%.6g", m), "}\n");
        *dump << line;
      }
    }
    if (absl::Status s = probe(t); !s.ok()) return fail(t, -1, s);
    if (options.progress) options.progress(t + 1, meta.steps);
  }
  if (dump) {
    dump->flush();
    if (!*dump) {
      return absl::DataLossError(
          absl::StrCat("writing the dump file ", options.dump_path, " failed (disk full?)"));
    }
  }
  if (absl::Status s = mem.Get(now.data(), a.stats, meta.layers * sizeof(LayerStats)); !s.ok()) {
    return s;
  }

  std::vector<double> table(meta.layers);
  if (absl::Status s = mem.Get(table.data(), a.sparsity, table.size() * sizeof(double)); !s.ok()) {
    return s;
  }
  SPIN_RETURN_IF_ERROR(mem.Get(&policy, a.policy, sizeof(policy)));

  ReplaySummary out;
  out.steps = meta.steps;
  out.layers = meta.layers;
  out.budget_mode = mode;
  out.budget_recomputes = budgets ? budgets->recomputes() : 0;
  out.epoch_advance = policy.epoch - start_epoch;
  std::vector<double> all;
  uint64_t kept = 0, total = 0, skept = 0, stotal = 0;
  for (int l = 0; l < meta.layers; ++l) {
    const LayerStats& s = now[l];
    const LayerStats& s0 = start[l];
    LayerSummary ls;
    ls.layer = l;
    ls.mean_miss = Mean(miss[l]);
    all.insert(all.end(), miss[l].begin(), miss[l].end());
    ls.p99_miss = NearestRankPercentile(&miss[l], 0.99);
    ls.sparsity = Skipped(s.sparse_blocks_kept - s0.sparse_blocks_kept,
                          s.sparse_blocks_total - s0.sparse_blocks_total);
    ls.effective_sparsity =
        Skipped(s.blocks_kept - s0.blocks_kept, s.blocks_total - s0.blocks_total);
    ls.budget = table[l];
    ls.probe_steps = s.probe_steps - s0.probe_steps;
    ls.bad_scores = s.bad_scores - s0.bad_scores;
    ls.explore_steps = s.explore_steps - s0.explore_steps;
    ls.explore_miss =
        ExploreMissRate(s.explore_est - s0.explore_est, s.explore_topk - s0.explore_topk);
    kept += s.blocks_kept - s0.blocks_kept;
    total += s.blocks_total - s0.blocks_total;
    skept += s.sparse_blocks_kept - s0.sparse_blocks_kept;
    stotal += s.sparse_blocks_total - s0.sparse_blocks_total;
    out.dense_steps += s.dense_steps - s0.dense_steps;
    out.bad_scores += ls.bad_scores;
    if (ls.mean_miss > out.worst_layer_mean_miss) {
      out.worst_layer_mean_miss = ls.mean_miss;
      out.worst_layer = l;
    }
    out.per_layer.push_back(ls);
  }
  out.sparse_steps = all.size();
  out.mean_miss = Mean(all);
  out.p99_miss = NearestRankPercentile(&all, 0.99);
  out.realized_sparsity = Skipped(skept, stotal);
  out.effective_sparsity = Skipped(kept, total);
  return out;
}

absl::StatusOr<ReplaySummary> Replay(const Trace& trace, const ReplayOptions& options) {
  const DataPlaneSpec spec{.geometry = TraceGeometry(trace.meta(), trace.n_max(), options.dtype),
                           .seed = options.seed,
                           .policy = options.policy,
                           .on_device = options.backend == ReplayBackend::kCuda};
  if (spec.on_device) {
#if SPIN_HAVE_CUDA
    if (!CudaAvailable()) {
      return absl::FailedPreconditionError("--backend cuda: no CUDA device is available");
    }
#else
    return absl::FailedPreconditionError(
        "--backend cuda: this build has no CUDA backend (rebuild with the CUDA toolkit)");
#endif
  }
  SPIN_ASSIGN_OR_RETURN(std::unique_ptr<DataPlane> dp, NewDataPlane(spec));
  return ReplayOn(*dp, trace, options);
}

std::string SummaryJson(const ReplaySummary& s) {
  nlohmann::json j;
  j["steps"] = s.steps;
  j["layers"] = s.layers;
  j["mean_miss"] = s.mean_miss;
  j["p99_miss"] = s.p99_miss;
  j["realized_sparsity"] = s.realized_sparsity;
  j["effective_sparsity"] = s.effective_sparsity;
  j["sparse_steps"] = s.sparse_steps;
  j["dense_steps"] = s.dense_steps;
  j["bad_scores"] = s.bad_scores;
  j["worst_layer_mean_miss"] = s.worst_layer_mean_miss;
  j["worst_layer"] = s.worst_layer;
  j["budget_mode"] = std::string(BudgetModeName(s.budget_mode));
  j["budget_recomputes"] = s.budget_recomputes;
  j["epoch_advance"] = s.epoch_advance;
  j["per_layer"] = nlohmann::json::array();
  for (const LayerSummary& l : s.per_layer) {
    j["per_layer"].push_back({{"layer", l.layer},
                              {"mean_miss", l.mean_miss},
                              {"p99_miss", l.p99_miss},
                              {"sparsity", l.sparsity},
                              {"effective_sparsity", l.effective_sparsity},
                              {"budget", l.budget},
                              {"probe_steps", l.probe_steps},
                              {"bad_scores", l.bad_scores},
                              {"explore_miss", l.explore_miss},
                              {"explore_steps", l.explore_steps}});
  }
  return j.dump();
}

std::string SummaryTable(const ReplaySummary& s) {
  // est_miss: the exploration blocks' estimate of the sparse steps' miss, what spind's
  // controller reads between probes (docs/budgets.md); "-" where no step was measured by it.
  std::string out =
      absl::StrFormat("%5s  %9s  %8s  %8s  %8s  %9s  %6s  %6s  %5s\n", "layer", "mean_miss",
                      "est_miss", "p99_miss", "sparsity", "effective", "budget", "probes", "bad");
  for (const LayerSummary& l : s.per_layer) {
    const std::string est =
        l.explore_steps > 0 ? absl::StrFormat("%.4f", l.explore_miss) : std::string("-");
    absl::StrAppendFormat(&out, "%5d  %9.4f  %8s  %8.4f  %8.4f  %9.4f  %6.4f  %6d  %5d\n", l.layer,
                          l.mean_miss, est, l.p99_miss, l.sparsity, l.effective_sparsity, l.budget,
                          l.probe_steps, l.bad_scores);
  }
  absl::StrAppendFormat(&out, "%5s  %9.4f  %8s  %8.4f  %8.4f  %9.4f  %6s  %6s  %5d\n", "all",
                        s.mean_miss, "", s.p99_miss, s.realized_sparsity, s.effective_sparsity, "",
                        "", s.bad_scores);
  absl::StrAppendFormat(&out,
                        "%d steps x %d layers: %d sparse and %d dense (fresh or probe) "
                        "layer-steps\n",
                        s.steps, s.layers, s.sparse_steps, s.dense_steps);
  absl::StrAppendFormat(&out, "worst layer %d: mean miss %.4f; %s budgets", s.worst_layer,
                        s.worst_layer_mean_miss, std::string(BudgetModeName(s.budget_mode)));
  if (TableFromProbes(s.budget_mode)) {
    absl::StrAppendFormat(&out, ", %d recomputes", s.budget_recomputes);
  }
  absl::StrAppendFormat(&out, ", epoch +%d\n", s.epoch_advance);
  return out;
}

}  // namespace spin
