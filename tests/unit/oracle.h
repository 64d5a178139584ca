// A second, deliberately naive implementation of DESIGN §5 for one sequence, written straight
// from the text (per-slot predictions, full sorts, no arena) so tests can check the data plane
// step for step. It shares only the tested primitives: the Philox draw and bf16 rounding.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "spin/numerics.h"

namespace spin::testing {

class Oracle {
 public:
  struct Params {
    int layers, n_max, block, topk, rows;
    double rho, gamma;
    float alpha;
    uint32_t period;
    uint64_t seed, key;
    bool bf16;
  };

  explicit Oracle(const Params& p)
      : p_(p),
        v_(p.layers, std::vector<float>(p.n_max, NAN)),
        d_(p.layers, std::vector<float>(p.n_max, NAN)),
        fresh_(p.layers, true) {}

  /// Starts step `step_` (0-based) and returns whether it is a probe step.
  void Begin(int ctx, int q) {
    ctx_ = ctx;
    q_ = q;
    cur_step_ = step_++;
    probe_ = p_.period > 0 && cur_step_ % p_.period == 0;
  }

  /// The union of the rows' selections for `layer`, ascending.
  std::vector<int> Select(int layer, int rows) {
    const int widest = (ctx_ + rows - 1 + p_.block - 1) / p_.block;
    std::vector<bool> chosen(widest, false);
    if (fresh_[layer] || probe_) {
      std::fill(chosen.begin(), chosen.end(), true);
    } else {
      for (int r = 0; r < rows; ++r) SelectRow(layer, r, &chosen);
    }
    std::vector<int> out;
    for (int j = 0; j < widest; ++j) {
      if (chosen[j]) out.push_back(j);
    }
    return out;
  }

  /// Applies the scores of the accepted rows; scores[r][i] is the dense score of slot i.
  void Observe(int layer, const std::vector<int>& blocks, const std::vector<const float*>& scores,
               int accepted) {
    const float beta = 1.0f - p_.alpha;
    for (int r = 0; r < accepted; ++r) {
      const int n = ctx_ + r, q = q_ + r;
      for (int j : blocks) {
        for (int i = j * p_.block; i < std::min((j + 1) * p_.block, n); ++i) {
          const float z = scores[r][i];
          if (!std::isfinite(z)) {
            ++bad_;
            continue;
          }
          Update(&v_[layer][i], z, beta);
          if (q - i >= 0) Update(&d_[layer][q - i], z, beta);
        }
      }
    }
    if (accepted > 0) fresh_[layer] = false;
  }

  uint64_t bad() const { return bad_; }
  float v(int layer, int i) const { return v_[layer][i]; }
  float d(int layer, int i) const { return d_[layer][i]; }

 private:
  void Update(float* x, float z, float beta) const {
    float nv = std::isnan(*x) ? z : std::fma(p_.alpha, *x, beta * z);
    if (p_.bf16) nv = Bf16ToFloat(FloatToBf16(nv));
    *x = nv;
  }

  void SelectRow(int layer, int r, std::vector<bool>* chosen) const {
    const int n = ctx_ + r, q = q_ + r;
    const int nb = (n + p_.block - 1) / p_.block;
    std::vector<float> s(nb, -INFINITY);
    for (int i = 0; i < n; ++i) {
      const int off = std::clamp(q - i, 0, p_.n_max - 1);
      float pred = std::fmax(v_[layer][i], d_[layer][off]);
      if (std::isnan(pred)) pred = INFINITY;
      s[i / p_.block] = std::max(s[i / p_.block], pred);
    }
    const double want = std::ceil((1.0 - p_.rho) * nb - 1e-6);
    const int floor_blocks = (p_.topk + p_.block - 1) / p_.block;
    const int m = std::min<int>(nb, std::max<int>(floor_blocks, static_cast<int>(want)));
    const int qb = std::min(q / p_.block, nb - 1);
    (*chosen)[qb] = true;
    if (m == nb) {
      for (int j = 0; j < nb; ++j) (*chosen)[j] = true;
      return;
    }
    int me = static_cast<int>(std::floor(p_.gamma * m + 1e-6));
    me = std::min(me, m - 1);
    std::vector<int> others;
    for (int j = 0; j < nb; ++j) {
      if (j != qb) others.push_back(j);
    }
    std::sort(others.begin(), others.end(),
              [&](int a, int b) { return s[a] != s[b] ? s[a] > s[b] : a < b; });
    const int top = m - 1 - me;
    for (int k = 0; k < top; ++k) (*chosen)[others[k]] = true;
    std::vector<std::pair<uint64_t, int>> draws;
    const uint64_t key = ExplorationKey(p_.seed, p_.key);
    for (size_t k = top; k < others.size(); ++k) {
      draws.push_back({ExplorationDraw(key, cur_step_, layer, r, others[k]), others[k]});
    }
    std::sort(draws.begin(), draws.end());
    for (int k = 0; k < me; ++k) (*chosen)[draws[k].second] = true;
  }

  Params p_;
  std::vector<std::vector<float>> v_, d_;
  std::vector<bool> fresh_;
  uint64_t step_ = 0, cur_step_ = 0, bad_ = 0;
  int ctx_ = 0, q_ = 0;
  bool probe_ = false;
};

}  // namespace spin::testing
