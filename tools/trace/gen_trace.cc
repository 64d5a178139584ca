#include "gen_trace.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "score_math.h"
#include "spin/status_macros.h"

namespace spin {
namespace {

// Draws built from raw mt19937_64 output with fixed arithmetic, so a seed gives the same bytes
// with any standard library (std::normal_distribution and friends are implementation-defined).
class Rng {
 public:
  explicit Rng(uint64_t seed) : engine_(seed) {}

  // [0, 1) with 53 random bits.
  double Uniform() { return static_cast<double>(engine_() >> 11) * 0x1.0p-53; }
  // Sum of four 16-bit uniforms, scaled to unit variance: a cheap normal stand-in (bounded at
  // +-3.46 sigma, which noise never needs to exceed). One engine call per draw keeps the
  // default trace (33M noisy scores) well under a second.
  float Normal() {
    const uint64_t v = engine_();
    const int64_t sum = static_cast<int64_t>(v & 0xffff) +
                        static_cast<int64_t>((v >> 16) & 0xffff) +
                        static_cast<int64_t>((v >> 32) & 0xffff) + static_cast<int64_t>(v >> 48);
    return static_cast<float>(sum - 131070) * kNormalScale;
  }
  double Exponential() { return -std::log(1.0 - Uniform()); }
  // Integer in [lo, hi].
  int Between(int lo, int hi) {
    return lo + static_cast<int>(Uniform() * static_cast<double>(hi - lo + 1));
  }

 private:
  static constexpr float kNormalScale = 1.7320508f / 65536.0f;  // sqrt(3) / 2^16
  std::mt19937_64 engine_;
};

// Shape of the score model (arbitrary units, roughly logits). Tuned so that the default options
// land mid-range of the paper's prev-iter Pearson and top-K recall.
struct ModelParams {
  int sinks = 4;  // attention-sink slots at the start
  float sink_boost = 7.0f;
  double vertical_rate = 0.004;  // share of slots that are persistent vertical lines
  float vertical_boost = 2.0f;   // plus an exponential tail of the same mean
  double segment_mean = 120.0;   // mean run length of an important / unimportant region
  int segment_min = 8;
  double hot_share = 0.15;  // share of regions that are important in a layer
  float hot_level = 1.8f;   // plus an exponential tail of mean hot_tail
  float hot_tail = 0.9f;
  float texture_sd = 0.6f;        // per-slot variation inside a region
  double texture_shared = 0.5;    // share of the texture variance common to all layers
  float cold_sd = 0.5f;           // spread of unimportant regions' levels
  float segment_walk_sd = 0.35f;  // stationary sd of a region's slow drift
  float local_amp = 3.0f;         // local window: local_amp * exp(-offset / local_tau)
  double local_tau = 48.0;
  int bands = 3;  // fixed-offset slash bands per layer
  float band_amp = 2.0f;
  float shift_amp = 4.0f;  // boost of a needle that appears at a shift
  // Per-layer difficulty h in [0, 1]. Per-step drift (1 - AR coefficient) = drift0 + drift_h * h.
  // Noise sd = (noise0 + noise_h * h) * (noise_floor + noise_slope * clamp(mean, 0, noise_cap)):
  // it grows with the score because an indexer score is a sum of ReLUs, so keys the query
  // barely matches sit near the clip and fluctuate little, while matched keys move with it.
  float noise0 = 0.33f;
  float noise_h = 0.5f;
  float noise_floor = 0.25f;
  float noise_slope = 0.6f;
  float noise_cap = 3.0f;  // beyond this score the noise stops growing (sinks stay sinks)
  double drift0 = 0.002;
  double drift_h = 0.01;
};

// One layer's fixed structure and drifting state.
struct LayerModel {
  float noise_sd = 0;
  float tex_rho = 1, tex_innov = 0;  // AR(1) of the slot texture
  float seg_rho = 1, seg_innov = 0;  // AR(1) of each region's drift
  float shift_gain = 1;
  std::vector<float> fixed;     // [N] sinks + vertical lines
  std::vector<float> seg_base;  // [segments]
  std::vector<float> seg_walk;  // [segments]
  std::vector<float> texture;   // [N]
  std::vector<float> diag;      // [N] by offset q - i
};

double Mean(const std::vector<double>& v) {
  double sum = 0;
  int n = 0;
  for (double x : v) {
    if (std::isnan(x)) continue;
    sum += x;
    ++n;
  }
  return n == 0 ? std::numeric_limits<double>::quiet_NaN() : sum / n;
}

}  // namespace

int ResolvedPromptLen(const GenTraceOptions& o) {
  if (o.prompt_len >= 0) return o.prompt_len;
  return static_cast<int>(
      std::min<int64_t>(std::numeric_limits<int>::max(),
                        int64_t{o.slots} - int64_t{o.steps} * o.rows - o.block_size));
}

std::vector<int> ShiftSteps(const GenTraceOptions& o) {
  std::vector<int> steps;
  for (int k = 0; k < o.shifts; ++k) {
    const int t = static_cast<int>(int64_t{o.steps} * (k + 1) / (o.shifts + 1));
    if (t > 0 && t < o.steps && (steps.empty() || steps.back() != t)) steps.push_back(t);
  }
  return steps;
}

absl::Status ValidateGenTraceOptions(const GenTraceOptions& o) {
  for (const auto& [name, value] :
       {std::pair{"layers", o.layers}, std::pair{"slots", o.slots}, std::pair{"steps", o.steps},
        std::pair{"rows", o.rows}, std::pair{"block_size", o.block_size},
        std::pair{"topk", o.topk}}) {
    if (value <= 0)
      return absl::InvalidArgumentError(absl::StrCat(name, " is ", value, "; must be > 0"));
  }
  for (const auto& [name, value] :
       {std::pair{"accept_rate", o.accept_rate}, std::pair{"nonfinite_rate", o.nonfinite_rate}}) {
    if (!(value >= 0 && value <= 1)) {
      return absl::InvalidArgumentError(absl::StrCat(name, " is ", value, "; must be in [0, 1]"));
    }
  }
  for (const auto& [name, value] :
       {std::pair{"noise_scale", o.noise_scale}, std::pair{"drift_scale", o.drift_scale}}) {
    if (!(value >= 0 && value <= 100)) {
      return absl::InvalidArgumentError(absl::StrCat(name, " is ", value, "; must be in [0, 100]"));
    }
  }
  if (o.shifts < 0 || o.shift_needles < 0) {
    return absl::InvalidArgumentError("shifts and shift_needles must be >= 0");
  }
  const int prompt = ResolvedPromptLen(o);
  // The last step may have grown by `rows` per earlier step; its last row needs ctx + rows - 1
  // slots.
  const int64_t worst_end = int64_t{prompt} + int64_t{o.steps - 1} * o.rows + o.rows - 1;
  if (prompt < 1 || worst_end > o.slots) {
    return absl::InvalidArgumentError(
        absl::StrCat("prompt_len ", prompt, " with steps=", o.steps, " and rows=", o.rows,
                     " needs up to ", worst_end, " slots but slots is ", o.slots,
                     "; raise slots or lower steps, rows or prompt_len"));
  }
  return absl::OkStatus();
}

absl::Status GenerateTrace(const std::string& dir, const GenTraceOptions& o) {
  SPIN_RETURN_IF_ERROR(ValidateGenTraceOptions(o));
  const ModelParams p;
  const int n = o.slots;
  const int L = o.layers;
  Rng rng(o.seed);

  // Regions: one partition of the slots shared by all layers (a document's structure), each
  // layer deciding which regions matter to it, partly in agreement with the other layers.
  std::vector<int32_t> seg_of(n);
  int segments = 0;
  for (int start = 0; start < n; ++segments) {
    const int len =
        p.segment_min + static_cast<int>(rng.Exponential() * (p.segment_mean - p.segment_min));
    for (int i = start; i < std::min(n, start + len); ++i) seg_of[i] = segments;
    start += len;
  }
  std::vector<float> seg_shared(segments);
  for (float& g : seg_shared) g = rng.Normal();
  std::vector<uint8_t> shared_vertical(n);
  for (int i = 0; i < n; ++i) shared_vertical[i] = rng.Uniform() < p.vertical_rate / 2;

  // Difficulty spread evenly over the layers, in a seeded order, so every trace with several
  // layers has both easy and hard ones.
  std::vector<double> hardness(L);
  for (int l = 0; l < L; ++l) hardness[l] = L == 1 ? 0.5 : static_cast<double>(l) / (L - 1);
  for (int l = L - 1; l > 0; --l) std::swap(hardness[l], hardness[rng.Between(0, l)]);

  // Threshold on N(0,1) for the hot share (share 0.15 -> 1.036); computed by bisection to
  // avoid depending on a library inverse CDF.
  double lo = -5, hi = 5;
  for (int it = 0; it < 60; ++it) {
    const double mid = (lo + hi) / 2;
    (0.5 * std::erfc(mid / std::sqrt(2.0)) > p.hot_share ? lo : hi) = mid;
  }
  const double hot_threshold = lo;

  std::vector<LayerModel> layers(L);
  for (int l = 0; l < L; ++l) {
    LayerModel& m = layers[l];
    const double h = hardness[l];
    m.noise_sd = static_cast<float>(o.noise_scale * (p.noise0 + p.noise_h * h));
    const double drift = std::min(1.0, o.drift_scale * (p.drift0 + p.drift_h * h));
    m.tex_rho = static_cast<float>(1 - drift);
    m.tex_innov = static_cast<float>(std::sqrt(1 - (1 - drift) * (1 - drift)));
    m.seg_rho = m.tex_rho;
    m.seg_innov = m.tex_innov * p.segment_walk_sd;
    m.shift_gain = static_cast<float>(0.6 + 0.8 * rng.Uniform());

    m.fixed.assign(n, 0.0f);
    for (int i = 0; i < std::min(n, p.sinks); ++i) m.fixed[i] = p.sink_boost;
    for (int i = p.sinks; i < n; ++i) {
      const bool vertical = shared_vertical[i] || rng.Uniform() < p.vertical_rate / 2;
      if (vertical) m.fixed[i] = p.vertical_boost * static_cast<float>(1 + rng.Exponential());
    }
    m.seg_base.resize(segments);
    m.seg_walk.resize(segments);
    for (int k = 0; k < segments; ++k) {
      const double latent = std::sqrt(0.5) * seg_shared[k] + std::sqrt(0.5) * rng.Normal();
      m.seg_base[k] = latent > hot_threshold
                          ? p.hot_level + p.hot_tail * static_cast<float>(rng.Exponential())
                          : p.cold_sd * rng.Normal();
      m.seg_walk[k] = p.segment_walk_sd * rng.Normal();
    }
    m.texture.resize(n);
    for (float& x : m.texture) x = rng.Normal();

    m.diag.assign(n, 0.0f);
    for (int d = 0; d < n; ++d) {
      const double v = p.local_amp * std::exp(-d / p.local_tau);
      if (v < 0.01) break;
      m.diag[d] = static_cast<float>(v);
    }
    for (int b = 0; b < p.bands; ++b) {
      const int offset = rng.Between(128, std::max(128, std::min(n - 1, 4096)));
      const int width = rng.Between(1, 8);
      const float amp = p.band_amp * static_cast<float>(0.7 + 0.6 * rng.Uniform());
      for (int d = offset; d < std::min(n, offset + width); ++d) m.diag[d] += amp;
    }
  }

  TraceMeta meta;
  meta.layers = L;
  meta.block_size = o.block_size;
  meta.topk = o.topk;
  meta.steps = o.steps;
  meta.rows = o.rows;
  SPIN_ASSIGN_OR_RETURN(TraceWriter writer, TraceWriter::Open(dir, meta, n));

  // Texture common to all layers (the same tokens look alike to every layer, in part).
  std::vector<float> shared_texture(n);
  for (float& x : shared_texture) x = rng.Normal();
  const float shared_rho = static_cast<float>(1 - std::min(1.0, o.drift_scale * p.drift0));
  const float shared_innov = std::sqrt(1 - shared_rho * shared_rho);
  const float tex_shared = p.texture_sd * static_cast<float>(std::sqrt(p.texture_shared));
  const float tex_own = p.texture_sd * static_cast<float>(std::sqrt(1 - p.texture_shared));

  const std::vector<int> shift_steps = ShiftSteps(o);
  std::vector<float> shift(n, 0.0f);  // needles switched on so far
  std::vector<float> base(n);
  std::vector<float> step_scores(static_cast<size_t>(L) * o.rows * n);
  int ctx = ResolvedPromptLen(o);

  for (int t = 0; t < o.steps; ++t) {
    if (std::binary_search(shift_steps.begin(), shift_steps.end(), t)) {
      // Needles sit in old context, clear of the local window, so only history can't see them.
      const int far_end = std::max(1, ctx - 1024);
      for (int k = 0; k < o.shift_needles; ++k) {
        const int len = rng.Between(48, 208);
        const int start = rng.Between(far_end / 16, std::max(far_end / 16, far_end - len));
        const float amp = p.shift_amp * static_cast<float>(0.8 + 0.4 * rng.Uniform());
        for (int i = start; i < std::min(ctx, start + len); ++i) shift[i] = std::max(shift[i], amp);
      }
    }
    const int q0 = ctx - 1;
    for (int i = 0; i < n; ++i) {
      shared_texture[i] = shared_rho * shared_texture[i] + shared_innov * rng.Normal();
    }
    for (int l = 0; l < L; ++l) {
      LayerModel& m = layers[l];
      for (int k = 0; k < segments; ++k)
        m.seg_walk[k] = m.seg_rho * m.seg_walk[k] + m.seg_innov * rng.Normal();
      for (int i = 0; i < n; ++i)
        m.texture[i] = m.tex_rho * m.texture[i] + m.tex_innov * rng.Normal();
      for (int i = 0; i < n; ++i) {
        const int k = seg_of[i];
        base[i] = m.fixed[i] + m.seg_base[k] + m.seg_walk[k] + tex_shared * shared_texture[i] +
                  tex_own * m.texture[i] + m.shift_gain * shift[i];
      }
      for (int r = 0; r < o.rows; ++r) {
        float* out = step_scores.data() + (static_cast<size_t>(l) * o.rows + r) * n;
        const int valid = ctx + r;
        const int q = q0 + r;
        for (int i = 0; i < valid; ++i) {
          const float mean = base[i] + m.diag[q - i];
          const float sd =
              m.noise_sd * (p.noise_floor + p.noise_slope * std::clamp(mean, 0.0f, p.noise_cap));
          out[i] = mean + sd * rng.Normal();
        }
        std::fill(out + valid, out + n, 0.0f);
        if (o.nonfinite_rate > 0) {
          constexpr float kBad[] = {std::numeric_limits<float>::quiet_NaN(),
                                    std::numeric_limits<float>::infinity(),
                                    -std::numeric_limits<float>::infinity()};
          for (int i = 0; i < valid; ++i) {
            if (rng.Uniform() < o.nonfinite_rate) out[i] = kBad[rng.Between(0, 2)];
          }
        }
      }
    }
    int accepted = 1;
    if (o.rows > 1) {
      while (accepted < o.rows && rng.Uniform() < o.accept_rate) ++accepted;
    }
    if (o.shuffle_rejected) {
      for (int l = 0; l < L; ++l) {
        for (int r = accepted; r < o.rows; ++r) {
          float* out = step_scores.data() + (static_cast<size_t>(l) * o.rows + r) * n;
          for (int i = ctx + r - 1; i > 0; --i) std::swap(out[i], out[rng.Between(0, i)]);
        }
      }
    }
    SPIN_RETURN_IF_ERROR(writer.WriteStep(step_scores.data(), q0, ctx, o.rows > 1 ? accepted : -1));
    ctx += accepted;
  }
  return writer.Close();
}

absl::StatusOr<TraceStats> ComputeTraceStats(const Trace& trace) {
  const TraceMeta& m = trace.meta();
  if (m.steps < 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("trace stats need at least 2 steps; ", trace.dir(), " has ", m.steps));
  }
  const double nan = std::numeric_limits<double>::quiet_NaN();
  TraceStats stats;
  std::vector<std::vector<double>> pearson(m.layers), recall(m.layers);
  stats.per_step_pearson.assign(m.steps, nan);
  stats.per_step_recall.assign(m.steps, nan);
  std::vector<double> layer_pearson, coverage;
  std::vector<std::vector<int32_t>> prev_top(m.layers);
  std::vector<int32_t> top;
  std::vector<uint8_t> block_hit;

  for (int t = 0; t < m.steps; ++t) {
    std::vector<double> step_p, step_r;
    for (int l = 0; l < m.layers; ++l) {
      const float* cur = trace.scores(t, l, 0);
      const int ctx = m.ctx_len[t];
      TopKSlots(cur, ctx, m.topk, &top);

      const int blocks = (ctx + m.block_size - 1) / m.block_size;
      block_hit.assign(blocks, 0);
      for (int32_t i : top) block_hit[i / m.block_size] = 1;
      coverage.push_back(static_cast<double>(std::count(block_hit.begin(), block_hit.end(), 1)) /
                         blocks);
      if (l > 0) layer_pearson.push_back(Pearson(cur, trace.scores(t, l - 1, 0), ctx));

      if (t > 0) {
        const int prev_ctx = m.ctx_len[t - 1];
        const double pc = Pearson(cur, trace.scores(t - 1, l, 0), std::min(prev_ctx, ctx));
        // Both id lists are sorted: a merge counts the overlap.
        const std::vector<int32_t>& prev = prev_top[l];
        const int64_t common = SortedOverlap(prev, top);
        const double rc = static_cast<double>(common) / std::min(m.topk, ctx);
        pearson[l].push_back(pc);
        recall[l].push_back(rc);
        step_p.push_back(pc);
        step_r.push_back(rc);
      }
      prev_top[l].swap(top);
    }
    if (t > 0) {
      stats.per_step_pearson[t] = Mean(step_p);
      stats.per_step_recall[t] = Mean(step_r);
    }
  }
  for (int l = 0; l < m.layers; ++l) {
    stats.per_layer_pearson.push_back(Mean(pearson[l]));
    stats.per_layer_recall.push_back(Mean(recall[l]));
  }
  stats.prev_iter_pearson = Mean(stats.per_layer_pearson);
  stats.prev_iter_recall = Mean(stats.per_layer_recall);
  stats.prev_layer_pearson = layer_pearson.empty() ? nan : Mean(layer_pearson);
  stats.topk_block_coverage = Mean(coverage);
  return stats;
}

std::string FormatTraceStats(const TraceStats& s) {
  std::string out =
      absl::StrCat("prev-iter pearson ", s.prev_iter_pearson, "  top-K recall ", s.prev_iter_recall,
                   "  (paper, real models: 0.85-0.91 / "
                   "0.58-0.82)\nprev-layer pearson ",
                   s.prev_layer_pearson, "  top-K block coverage ", s.topk_block_coverage,
                   "\nper layer (pearson / recall):");
  for (size_t l = 0; l < s.per_layer_pearson.size(); ++l) {
    absl::StrAppend(&out, l % 4 == 0 ? "\n " : "", "  L", l, " ", s.per_layer_pearson[l], " / ",
                    s.per_layer_recall[l]);
  }
  return out + "\n";
}

}  // namespace spin
