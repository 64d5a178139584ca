// The CPU reference backend: docs/design.md §5, written for clarity first and speed second. The
// CUDA backend must reproduce every selection and every state bit of this file.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "spin/arena.h"
#include "spin/data_plane.h"
#include "spin/numerics.h"
#include "spin/status_macros.h"

namespace spin {
namespace {

inline float Load(const float* p, int64_t i) { return p[i]; }
inline float Load(const uint16_t* p, int64_t i) { return Bf16ToFloat(p[i]); }
inline void Store(float* p, int64_t i, float v) { p[i] = v; }
inline void Store(uint16_t* p, int64_t i, float v) { p[i] = FloatToBf16(v); }
// The value Store(p, i, v) leaves, as Load reads it back.
inline float AsStored(const float*, float v) { return v; }
inline float AsStored(const uint16_t*, float v) { return Bf16ToFloat(FloatToBf16(v)); }

// S[j] = max over the valid slots i of block j of Prediction(V[i], D[clamp(q - i, 0, N_max-1)]).
// Slots past the query (i > q) read D[0]. The common case, a block wholly at or before the
// query, walks D backwards without a clamp so the compiler can vectorise it; when such a block
// also has its V summary set (vsum[j], arena.h: no unset V entry, vmax the largest), the score
// is Prediction(vmax, the largest set D entry of its window), the same value without reading V
// (no V[i] is NaN, so no slot gives +inf, and a maximum of maxima is the maximum).
template <typename T>
void BlockScores(const T* v, const T* d, const float* vsum, int32_t n, int32_t q, int32_t b,
                 float* s) {
  const int32_t nb = static_cast<int32_t>(CeilDiv(n, b));
  for (int32_t j = 0; j < nb; ++j) {
    const int32_t lo = j * b;
    const int32_t hi = std::min(lo + b, n);
    float best = -INFINITY;
    if (hi - 1 <= q) {
      const T* dd = d + (q - lo);
      const float vmax = hi - lo == b ? vsum[j] : NAN;
      if (vmax == vmax) {
        for (int32_t k = 0; k < b; ++k) {
          const float x = Load(dd, -k);
          best = x > best ? x : best;  // an unset (NaN) entry never compares greater
        }
        best = Prediction(vmax, best);
      } else {
        for (int32_t k = 0; k < hi - lo; ++k) {
          const float p = Prediction(Load(v, lo + k), Load(dd, -k));
          best = p > best ? p : best;
        }
      }
    } else {
      for (int32_t i = lo; i < hi; ++i) {
        const float p = Prediction(Load(v, i), Load(d, i <= q ? q - i : 0));
        best = p > best ? p : best;
      }
    }
    s[j] = best;
  }
}

// An entry whose rows get a selection: a sequence's, or one without a sequence (seq = -1)
// given ctx_len > 0 slots, served dense (data_plane.h, StepBatch::seq).
inline bool Served(const StepEntry& en) { return en.seq >= 0 || en.ctx_len > 0; }

// Block order by predicted score: higher first, ties to the lower id.
struct ByScore {
  const float* s;
  bool operator()(int32_t a, int32_t b) const { return s[a] > s[b] || (s[a] == s[b] && a < b); }
};

class CpuDataPlane final : public DataPlane {
 public:
  explicit CpuDataPlane(const ArenaView& a) : a_(a) {
    row_scores_.resize(a_.max_blocks);
    order_.reserve(a_.max_blocks);
    probing_.assign(a_.geometry.max_seqs, 0);
    sparse_.assign(a_.geometry.max_seqs, 0);
    draws_.resize(a_.max_blocks);
    step_rho_.assign(a_.sparsity, a_.sparsity + a_.geometry.layers);
    step_gamma_ = a_.policy->exploration;
  }

  const ArenaView& arena() const override { return a_; }

  absl::Status ResetSequence(int32_t seq, uint64_t key, cudaStream_t) override {
    const Geometry& g = a_.geometry;
    if (seq < 0 || static_cast<uint32_t>(seq) >= g.max_seqs) {
      return absl::OutOfRangeError(
          absl::StrCat("sequence ", seq, " is out of range [0, ", g.max_seqs, ")"));
    }
    SeqRecord& r = a_.seqs[seq];
    r.key = key;
    r.steps = 0;
    r.open = 1;
    for (uint32_t l = 0; l < g.layers; ++l) {
      a_.fresh[static_cast<uint64_t>(seq) * g.layers + l] = 1;
      uint8_t* rec = a_.StateRecord(seq, static_cast<int>(l));
      const uint64_t elems = 2ull * g.max_slots;
      if (g.dtype == StateDtype::kFp32) {
        std::fill_n(reinterpret_cast<float*>(rec), elems, NAN);
      } else {
        std::fill_n(reinterpret_cast<uint16_t*>(rec), elems, kBf16Unset);
      }
      std::fill_n(a_.VSummaries(seq, static_cast<int>(l)), a_.max_blocks, NAN);
    }
    // Entries of the current step that point at this sequence no longer describe it.
    for (int32_t e = 0; e < a_.batch->n; ++e) {
      if (a_.entries[e].seq == seq) a_.entries[e].seq = -1, a_.entries[e].ctx_len = 0;
    }
    return absl::OkStatus();
  }

  absl::Status BeginStep(const StepBatch& batch, cudaStream_t) override {
    SPIN_RETURN_IF_ERROR(ValidateStepBatch(a_, batch));
    const uint32_t period = a_.policy->probe_period;
    // The step's budgets and exploration share, read once as the CUDA backend's selections
    // (all made when the step begins) read them: a policy or budget written during a step
    // takes effect at the next one (docs/design.md §6).
    step_rho_.assign(a_.sparsity, a_.sparsity + a_.geometry.layers);
    step_gamma_ = a_.policy->exploration;
    a_.batch->n = batch.n;
    a_.batch->rows = batch.rows;
    a_.batch->selected_layer = -1;
    step_table_ = batch.block_table;
    step_table_stride_ = batch.block_table ? batch.table_stride : 0;
    for (int32_t e = 0; e < batch.n; ++e) {
      StepEntry& en = a_.entries[e];
      en.seq = batch.seq[e];
      if (en.seq < 0) {
        // No sequence: served dense over ctx_len slots, reading and changing no state.
        en.ctx_len = batch.ctx_len[e];
        en.q_pos = 0;
        en.step = 0;
        en.probe = 0;
        continue;
      }
      SeqRecord& r = a_.seqs[en.seq];
      en.ctx_len = batch.ctx_len[e];
      en.q_pos = batch.q_pos[e];
      en.step = r.steps++;
      en.probe = period > 0 && en.step % period == 0 ? 1 : 0;
    }
    return absl::OkStatus();
  }

  absl::Status Select(int32_t layer, const int32_t* block_table, int64_t table_stride,
                      cudaStream_t) override {
    SPIN_RETURN_IF_ERROR(CheckLayer(layer));
    if (block_table && table_stride < a_.max_blocks) {
      return absl::InvalidArgumentError(absl::StrCat("block table stride ", table_stride,
                                                     " is below the session's max blocks ",
                                                     a_.max_blocks));
    }
    // Without a table of its own, the step's (StepBatch::block_table), if one was given.
    if (block_table == nullptr) block_table = step_table_, table_stride = step_table_stride_;
    if (a_.geometry.dtype == StateDtype::kFp32) {
      SelectAll<float>(layer, block_table, table_stride);
    } else {
      SelectAll<uint16_t>(layer, block_table, table_stride);
    }
    a_.batch->selected_layer = layer;
    probe_counted_ = false;
    return absl::OkStatus();
  }

  absl::Status Remap(int32_t* idx, int32_t count, cudaStream_t) override {
    if (a_.batch->selected_layer < 0) {
      return absl::FailedPreconditionError("Remap needs a Select of the current step first");
    }
    SPIN_RETURN_IF_ERROR(ValidateTopKBuffer(idx, count));
    const int32_t rows = a_.batch->rows, b = static_cast<int32_t>(a_.geometry.block_size);
    for (int32_t e = 0; e < a_.batch->n; ++e) {
      const int32_t* ids = a_.union_ids + static_cast<int64_t>(e) * a_.max_blocks;
      for (int32_t r = 0; r < rows; ++r) {
        const int32_t len = Served(a_.entries[e]) ? CompactLen(e, r) : 0;
        int32_t* row = idx + (static_cast<int64_t>(e) * rows + r) * count;
        for (int32_t k = 0; k < count; ++k) {
          const int32_t c = row[k];
          row[k] = (c < 0 || c >= len) ? -1 : ids[c / b] * b + c % b;
        }
      }
    }
    return absl::OkStatus();
  }

  absl::Status RemapTopK(int32_t* idx, int32_t count, cudaStream_t stream) override {
    SPIN_RETURN_IF_ERROR(Remap(idx, count, stream));
    if (probe_counted_ || count == 0) return absl::OkStatus();
    probe_counted_ = true;
    // Each probing entry's row 0, mapped: the engine's dense top-K, counted as given; each
    // sparse entry's row 0: the exploration estimate of its miss.
    const int32_t layer = a_.batch->selected_layer, rows = a_.batch->rows;
    for (int32_t e = 0; e < a_.batch->n; ++e) {
      if (a_.entries[e].seq < 0 || !(probing_[e] || sparse_[e])) continue;
      const int32_t* row = idx + static_cast<int64_t>(e) * rows * count;
      topk_.clear();
      for (int32_t k = 0; k < count; ++k) {
        if (row[k] >= 0) topk_.push_back(row[k]);
      }
      if (probing_[e]) {
        CountCurve(layer, e);
      } else {
        CountExplore(layer, e);
      }
    }
    return absl::OkStatus();
  }

  absl::Status RemapAndObserve(int32_t layer, int32_t* idx, int32_t count, const float* logits,
                               int64_t logits_stride, const int32_t* accepted,
                               cudaStream_t stream) override {
    // Both calls' checks first: a refusal changes nothing.
    SPIN_RETURN_IF_ERROR(
        ValidateObserveCall(a_, "RemapAndObserve", layer, logits, logits_stride, accepted));
    SPIN_RETURN_IF_ERROR(ValidateTopKBuffer(idx, count));
    SPIN_RETURN_IF_ERROR(RemapTopK(idx, count, stream));
    return ObserveChecked(layer, logits, logits_stride, accepted);
  }

  absl::Status Observe(int32_t layer, const float* logits, int64_t logits_stride,
                       const int32_t* accepted, cudaStream_t) override {
    SPIN_RETURN_IF_ERROR(
        ValidateObserveCall(a_, "Observe", layer, logits, logits_stride, accepted));
    return ObserveChecked(layer, logits, logits_stride, accepted);
  }

 private:
  // Observe after its checks (ValidateObserveCall).
  absl::Status ObserveChecked(int32_t layer, const float* logits, int64_t logits_stride,
                              const int32_t* accepted) {
    if (a_.geometry.dtype == StateDtype::kFp32) {
      ObserveAll<float>(layer, logits, logits_stride, accepted);
    } else {
      ObserveAll<uint16_t>(layer, logits, logits_stride, accepted);
    }
    probe_counted_ = true;  // a later Observe or RemapTopK of this selection counts nothing
    return absl::OkStatus();
  }

  absl::Status CheckLayer(int32_t layer) const { return ValidateLayer(a_, layer); }

  int32_t CompactLen(int32_t e, int32_t r) const {
    return a_.compact_len[static_cast<int64_t>(e) * a_.geometry.max_rows + r];
  }

  template <typename T>
  void SelectAll(int32_t layer, const int32_t* block_table, int64_t table_stride) {
    const Geometry& g = a_.geometry;
    const int32_t b = static_cast<int32_t>(g.block_size), rows = a_.batch->rows;
    const double rho = step_rho_[layer];
    const double gamma = step_gamma_;
    const uint64_t seed = a_.header->seed;
    LayerStats& st = a_.stats[layer];
    for (int32_t e = 0; e < a_.batch->n; ++e) {
      const StepEntry& en = a_.entries[e];
      probing_[e] = 0;
      sparse_[e] = 0;
      if (!Served(en)) {
        a_.union_count[e] = 0;
        for (int32_t r = 0; r < rows; ++r) a_.compact_len[e * g.max_rows + r] = 0;
        continue;
      }
      const bool pad = en.seq < 0;  // no sequence: dense, no state read, nothing counted
      const bool fresh = !pad && a_.fresh[static_cast<uint64_t>(en.seq) * g.layers + layer] != 0;
      const bool dense = pad || fresh || en.probe;
      probing_[e] = en.probe && !fresh ? 1 : 0;
      sparse_[e] = dense ? 0 : 1;
      uint8_t* mask = a_.mask + static_cast<int64_t>(e) * a_.max_blocks;
      const int32_t widest_blocks = static_cast<int32_t>(CeilDiv(en.ctx_len + rows - 1, b));
      std::memset(mask, dense ? 1 : 0, widest_blocks);
      const T* v = pad ? nullptr : reinterpret_cast<const T*>(a_.StateRecord(en.seq, layer));
      const T* d = pad ? nullptr : v + g.max_slots;
      const float* vsum = pad ? nullptr : a_.VSummaries(en.seq, layer);
      float* row0 = a_.scratch + static_cast<int64_t>(e) * a_.max_blocks;
      if (dense) {
        // A probe step keeps row 0's predicted block scores for the miss curve in Observe.
        if (!pad && !fresh) BlockScores(v, d, vsum, en.ctx_len, en.q_pos, b, row0);
      } else {
        const uint64_t key = ExplorationKey(seed, a_.seqs[en.seq].key);
        for (int32_t r = 0; r < rows; ++r) {
          float* s = r == 0 ? row0 : row_scores_.data();
          const int32_t n = en.ctx_len + r, q = en.q_pos + r;
          BlockScores(v, d, vsum, n, q, b, s);
          SelectRow(s, static_cast<int32_t>(CeilDiv(n, b)), q / b, rho, gamma, key, en.step, layer,
                    r, mask);
        }
      }
      // The union, ascending, and what the engine needs to index the compacted table.
      int32_t* ids = a_.union_ids + static_cast<int64_t>(e) * a_.max_blocks;
      int32_t count = 0;
      for (int32_t j = 0; j < widest_blocks; ++j) {
        if (mask[j] != 0) ids[count++] = j;
      }
      a_.union_count[e] = count;
      if (block_table) {
        const int32_t* table = block_table + e * table_stride;
        int32_t* phys = a_.phys + static_cast<int64_t>(e) * a_.max_blocks;
        for (int32_t k = 0; k < count; ++k) phys[k] = table[ids[k]];
      }
      for (int32_t r = 0; r < rows; ++r) {
        const int32_t n = en.ctx_len + r;
        int32_t len = 0;
        for (int32_t k = 0; k < count && ids[k] * b < n; ++k) len += std::min(b, n - ids[k] * b);
        a_.compact_len[e * g.max_rows + r] = len;
      }
      if (pad) continue;
      st.steps += 1;
      st.dense_steps += dense ? 1 : 0;
      st.blocks_kept += count;
      st.blocks_total += widest_blocks;
      if (!dense) {
        st.sparse_blocks_kept += count;
        st.sparse_blocks_total += widest_blocks;
      }
    }
  }

  // One row's selection (docs/design.md §5): the query block, then the best-scoring other blocks,
  // then exploration blocks with the smallest counter-based draws. Marks the chosen blocks in mask
  // (bit 0), and row 0's exploration blocks also with kExplored (its exploration estimate).
  void SelectRow(const float* s, int32_t nb, int32_t q_block, double rho, double gamma,
                 uint64_t key, uint64_t step, int32_t layer, int32_t row, uint8_t* mask) {
    const Geometry& g = a_.geometry;
    const int32_t m =
        KeptBlocks(nb, static_cast<int32_t>(g.topk), static_cast<int32_t>(g.block_size), rho);
    if (m >= nb) {
      for (int32_t j = 0; j < nb; ++j) mask[j] |= 1;  // keeps row 0's kExplored marks
      return;
    }
    const int32_t qb = std::min(q_block, nb - 1);
    mask[qb] |= 1;
    const int32_t explore = ExplorationBlocks(m, gamma);
    const int32_t top = m - 1 - explore;
    order_.clear();
    for (int32_t j = 0; j < nb; ++j) {
      if (j != qb) order_.push_back(j);
    }
    if (top > 0) {
      std::nth_element(order_.begin(), order_.begin() + (top - 1), order_.end(), ByScore{s});
      for (int32_t k = 0; k < top; ++k) mask[order_[k]] |= 1;
    }
    if (explore > 0) {
      // The candidates are the blocks left after the top set; the draw is a pure function of
      // (key, step, layer, row, block), so no other state decides what is explored.
      auto rest = order_.begin() + top;
      for (auto it = rest; it != order_.end(); ++it) {
        draws_[*it] = ExplorationDraw(key, step, static_cast<uint32_t>(layer),
                                      static_cast<uint32_t>(row), static_cast<uint32_t>(*it));
      }
      const uint64_t* dr = draws_.data();
      std::nth_element(rest, rest + (explore - 1), order_.end(), [dr](int32_t x, int32_t y) {
        return dr[x] < dr[y] || (dr[x] == dr[y] && x < y);
      });
      const uint8_t mark = row == 0 ? 1 | kExplored : 1;
      for (int32_t k = 0; k < explore; ++k) mask[rest[k]] |= mark;
    }
  }

  template <typename T>
  void ObserveAll(int32_t layer, const float* logits, int64_t stride, const int32_t* accepted) {
    const Geometry& g = a_.geometry;
    const int32_t b = static_cast<int32_t>(g.block_size), rows = a_.batch->rows;
    const float alpha = a_.policy->alpha, beta = a_.policy->beta;
    LayerStats& st = a_.stats[layer];
    for (int32_t e = 0; e < a_.batch->n; ++e) {
      const StepEntry& en = a_.entries[e];
      if (en.seq < 0) continue;
      uint8_t& fresh = a_.fresh[static_cast<uint64_t>(en.seq) * g.layers + layer];
      if (probing_[e] && !probe_counted_) {
        DenseTopK(e, logits + static_cast<int64_t>(e) * rows * stride);
        if (!topk_.empty()) CountCurve(layer, e);
      }
      T* v = reinterpret_cast<T*>(a_.StateRecord(en.seq, layer));
      T* d = v + g.max_slots;
      const int32_t* ids = a_.union_ids + static_cast<int64_t>(e) * a_.max_blocks;
      const int32_t count = a_.union_count[e];
      const int32_t acc = accepted ? accepted[e] : 1;  // no acceptance known: row 0
      uint64_t observed = 0, bad = 0;
      // The V summary of each block the last applied row touched (earlier rows touch a subset;
      // other union blocks keep their V, so their summaries stand) is folded during that row's
      // pass from the entries as stored, plus the block's entries past the row's end.
      float* vsum = a_.VSummaries(en.seq, layer);
      for (int32_t r = 0; r < acc; ++r) {
        const int32_t n = en.ctx_len + r, q = en.q_pos + r;
        const bool last = r == acc - 1;
        const float* z = logits + (static_cast<int64_t>(e) * rows + r) * stride;
        for (int32_t k = 0; k < count && ids[k] * b < n; ++k) {
          const int32_t lo = ids[k] * b, hi = std::min(lo + b, n);
          float m = -INFINITY;
          bool unset = false;
          auto fold = [&](float x) {
            unset |= x != x;
            m = x > m ? x : m;  // a NaN never compares greater
          };
          for (int32_t i = lo; i < hi; ++i) {
            const float zi = z[static_cast<int64_t>(k) * b + (i - lo)];
            if (!std::isfinite(zi)) {
              ++bad;
              if (last) fold(Load(v, i));
              continue;
            }
            ++observed;
            const float nv = EmaUpdate(Load(v, i), zi, alpha, beta);
            Store(v, i, nv);
            if (last) fold(AsStored(v, nv));
            if (i <= q) Store(d, q - i, EmaUpdate(Load(d, q - i), zi, alpha, beta));
          }
          if (last) {
            const int32_t end = std::min<int32_t>(lo + b, static_cast<int32_t>(g.max_slots));
            for (int32_t i = hi; i < end; ++i) fold(Load(v, i));
            vsum[ids[k]] = unset ? NAN : (m == 0.0f ? 0.0f : m);
          }
        }
      }
      if (acc > 0) fresh = 0;
      st.observed += observed;
      st.bad_scores += bad;
    }
  }

  // Row 0's dense top-K of entry e into topk_ (ties: lower slot), non-finite scores excluded.
  void DenseTopK(int32_t e, const float* z) {
    const int32_t n = a_.entries[e].ctx_len;
    topk_.clear();
    for (int32_t i = 0; i < n; ++i) {
      if (std::isfinite(z[i])) topk_.push_back(i);
    }
    const int32_t k = std::min<int32_t>(static_cast<int32_t>(a_.geometry.topk),
                                        static_cast<int32_t>(topk_.size()));
    if (k == 0) return;
    std::nth_element(topk_.begin(), topk_.begin() + (k - 1), topk_.end(),
                     [z](int32_t x, int32_t y) { return z[x] > z[y] || (z[x] == z[y] && x < y); });
    topk_.resize(k);
  }

  // Probe step of entry e (all blocks were scored), row 0's dense top-K in topk_ (computed, or
  // the engine's given to RemapTopK; slots below the context): how much of it falls outside the
  // best ceil(f * B) blocks by the prediction, for each keep fraction f of the curve, ranking the
  // query block first as the selector does, without exploration.
  void CountCurve(int32_t layer, int32_t e) {
    const Geometry& g = a_.geometry;
    const int32_t b = static_cast<int32_t>(g.block_size);
    const StepEntry& en = a_.entries[e];
    const int32_t n = en.ctx_len;
    const int32_t nb = static_cast<int32_t>(CeilDiv(n, b));
    const int32_t k = static_cast<int32_t>(topk_.size());
    block_hits_.assign(nb, 0);
    for (int32_t t = 0; t < k; ++t) block_hits_[topk_[t] / b] += 1;
    // Block ranking: query block, then by predicted score.
    const float* s = a_.scratch + static_cast<int64_t>(e) * a_.max_blocks;
    const int32_t qb = std::min(en.q_pos / b, nb - 1);
    order_.clear();
    for (int32_t j = 0; j < nb; ++j) {
      if (j != qb) order_.push_back(j);
    }
    std::sort(order_.begin(), order_.end(), ByScore{s});
    // covered[m] = top-K slots inside the first m ranked blocks.
    covered_.assign(nb + 1, 0);
    covered_[1] = block_hits_[qb];
    for (int32_t j = 1; j < nb; ++j) covered_[j + 1] = covered_[j] + block_hits_[order_[j - 1]];
    uint64_t* curve = a_.curves + static_cast<int64_t>(layer) * kCurvePoints;
    const int32_t topk = static_cast<int32_t>(g.topk);
    for (int p = 0; p < kCurvePoints; ++p) {
      const int32_t m = KeptBlocks(nb, topk, b, 1.0 - CurveKeepFraction(p));
      curve[p] += static_cast<uint64_t>(k - covered_[m]);
    }
    LayerStats& st = a_.stats[layer];
    const int32_t m_now = KeptBlocks(nb, topk, b, step_rho_[layer]);  // the step's budget
    st.probe_steps += 1;
    st.probe_topk += static_cast<uint64_t>(k);
    st.probe_missed += static_cast<uint64_t>(k - covered_[m_now]);
  }

  // A sparse entry's row 0, top-K given by the engine in topk_ (logical slots): how many of them
  // lie in the row's exploration blocks, each weighted by the unexplored blocks outside its ranked
  // part it stands for (ExploreHitWeight).
  void CountExplore(int32_t layer, int32_t e) {
    const Geometry& g = a_.geometry;
    const int32_t b = static_cast<int32_t>(g.block_size);
    const int32_t nb = static_cast<int32_t>(CeilDiv(a_.entries[e].ctx_len, b));
    const int32_t m = KeptBlocks(nb, static_cast<int32_t>(g.topk), b, step_rho_[layer]);
    const int32_t explore = m < nb ? ExplorationBlocks(m, step_gamma_) : 0;
    if (explore == 0) return;
    const uint8_t* mask = a_.mask + static_cast<int64_t>(e) * a_.max_blocks;
    uint32_t hits = 0;
    for (int32_t slot : topk_) hits += (mask[slot / b] & kExplored) != 0 ? 1 : 0;
    LayerStats& st = a_.stats[layer];
    st.explore_steps += 1;
    st.explore_topk += topk_.size();
    st.explore_est += hits * ExploreHitWeight(nb - (m - explore), explore);
  }

  // Mask bit of row 0's exploration blocks (SelectRow).
  static constexpr uint8_t kExplored = 2;

  ArenaView a_;
  std::vector<float> row_scores_;
  std::vector<double> step_rho_;  // the budget table as the step began
  double step_gamma_ = 0.0;       // the exploration share as the step began
  std::vector<int32_t> order_;
  // Per entry: the layer's Select ranked its blocks for a probe (a probe step, not fresh then);
  // its Observe then samples the miss curve. Decided at Select, so a second Observe of the same
  // selection does not probe with a ranking made for a fresh pair.
  std::vector<uint8_t> probing_;
  // The current selection's probe is counted (reset by Select): by RemapTopK (the engine's
  // top-K) or by Observe (the logits' top-K), whichever came first; the other counts nothing.
  bool probe_counted_ = false;
  // Per entry: the layer's Select made a sparse selection of a sequence (not dense, not padding).
  std::vector<uint8_t> sparse_;
  // The engine's table for every layer of the current step (StepBatch::block_table), or null.
  const int32_t* step_table_ = nullptr;
  int64_t step_table_stride_ = 0;
  std::vector<uint64_t> draws_;
  std::vector<int32_t> topk_;
  std::vector<int32_t> block_hits_;
  std::vector<int32_t> covered_;
};

}  // namespace

absl::Status ValidateStepTable(const ArenaView& a, const StepBatch& batch) {
  if (batch.block_table && batch.table_stride < static_cast<int64_t>(a.max_blocks)) {
    return absl::InvalidArgumentError(
        absl::StrCat("the step's block table stride ", batch.table_stride,
                     " is below the session's max blocks ", a.max_blocks));
  }
  return absl::OkStatus();
}

absl::Status ValidateStepShape(const ArenaView& a, const StepBatch& batch) {
  const Geometry& g = a.geometry;
  if (batch.n < 0 || static_cast<uint32_t>(batch.n) > g.max_seqs) {
    return absl::InvalidArgumentError(
        absl::StrCat("batch of ", batch.n, " entries is out of range [0, ", g.max_seqs, "]"));
  }
  if (batch.rows < 1 || static_cast<uint32_t>(batch.rows) > g.max_rows) {
    return absl::InvalidArgumentError(
        absl::StrCat("rows ", batch.rows, " is out of range [1, ", g.max_rows, "]"));
  }
  if (batch.n > 0 && (!batch.seq || !batch.ctx_len || !batch.q_pos)) {
    return absl::InvalidArgumentError("batch arrays seq, ctx_len and q_pos are required");
  }
  return ValidateStepTable(a, batch);
}

absl::Status ValidateStepBatch(const ArenaView& a, const StepBatch& batch) {
  const Geometry& g = a.geometry;
  SPIN_RETURN_IF_ERROR(ValidateStepShape(a, batch));
  // Validate everything before touching the arena: a bad entry changes nothing.
  std::vector<uint8_t> seen(g.max_seqs, 0);
  const int64_t last_row = batch.rows - 1;
  for (int32_t e = 0; e < batch.n; ++e) {
    const int32_t s = batch.seq[e];
    if (s == -1) {
      // No sequence: served dense over ctx_len slots (0: nothing), q_pos unused.
      const int64_t ctx = batch.ctx_len[e];
      if (ctx < 0 || (ctx > 0 && ctx + last_row > g.max_slots)) {
        return absl::OutOfRangeError(absl::StrCat(
            "entry ", e, ": padding ctx_len ", ctx, " with ", batch.rows,
            " rows is out of range [0, ", g.max_slots - last_row, "] (0 = an empty entry)"));
      }
      continue;
    }
    if (s < 0 || static_cast<uint32_t>(s) >= g.max_seqs) {
      return absl::OutOfRangeError(
          absl::StrCat("entry ", e, ": sequence ", s, " is out of range [0, ", g.max_seqs, ")"));
    }
    if (!a.seqs[s].open) {
      return absl::FailedPreconditionError(
          absl::StrCat("entry ", e, ": sequence ", s, " is not open (call ResetSequence first)"));
    }
    if (seen[s]++) {
      return absl::InvalidArgumentError(
          absl::StrCat("entry ", e, ": sequence ", s, " appears twice in the batch"));
    }
    const int64_t ctx = batch.ctx_len[e], q = batch.q_pos[e];
    if (ctx < 1 || ctx + last_row > g.max_slots) {
      return absl::OutOfRangeError(absl::StrCat("entry ", e, ": ctx_len ", ctx, " with ",
                                                batch.rows, " rows is out of range [1, ",
                                                g.max_slots - last_row, "]"));
    }
    if (q < 0 || q + last_row >= static_cast<int64_t>(g.max_slots)) {
      return absl::OutOfRangeError(absl::StrCat("entry ", e, ": q_pos ", q, " with ", batch.rows,
                                                " rows is out of range [0, ",
                                                g.max_slots - last_row, ")"));
    }
  }
  return absl::OkStatus();
}

absl::Status LogitsRequired(int32_t entries, int64_t logits_stride) {
  return absl::InvalidArgumentError(
      absl::StrCat("logits are required: a step of ", entries,
                   " entries (padding included) needs a logits buffer and a stride >= 0 (got ",
                   logits_stride, ")"));
}

absl::Status ValidateTopKBuffer(const int32_t* idx, int32_t count) {
  if (count < 0 || (count > 0 && idx == nullptr)) {
    return absl::InvalidArgumentError(absl::StrCat("bad top-K buffer (count ", count, ")"));
  }
  return absl::OkStatus();
}

absl::Status ValidateLayer(const ArenaView& a, int32_t layer) {
  if (layer < 0 || static_cast<uint32_t>(layer) >= a.geometry.layers) {
    return absl::OutOfRangeError(
        absl::StrCat("layer ", layer, " is out of range [0, ", a.geometry.layers, ")"));
  }
  return absl::OkStatus();
}

absl::Status ValidateObserveCall(const ArenaView& a, const char* what, int32_t layer,
                                 const float* logits, int64_t logits_stride,
                                 const int32_t* accepted) {
  SPIN_RETURN_IF_ERROR(ValidateLayer(a, layer));
  if (a.batch->selected_layer != layer) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, " of layer ", layer,
                     " without its Select in this step (last: ", a.batch->selected_layer, ")"));
  }
  return ValidateObserveInputs(a, logits, logits_stride, accepted);
}

absl::Status ValidateObserveInputs(const ArenaView& a, const float* logits, int64_t logits_stride,
                                   const int32_t* accepted) {
  const int32_t rows = a.batch->rows;
  // As the CUDA backend, which cannot tell on the host whether an entry is padding: any step
  // with entries needs a buffer, even one of padding only (where nothing is read).
  if (a.batch->n > 0 && (logits == nullptr || logits_stride < 0)) {
    return LogitsRequired(a.batch->n, logits_stride);
  }
  int32_t widest = 0;
  for (int32_t e = 0; e < a.batch->n; ++e) {
    if (a.entries[e].seq < 0) continue;
    if (accepted && (accepted[e] < 0 || accepted[e] > rows)) {
      return absl::InvalidArgumentError(absl::StrCat("entry ", e, ": accepted ", accepted[e],
                                                     " is out of range [0, ", rows, "]"));
    }
    for (int32_t r = 0; r < rows; ++r) {
      widest = std::max(widest, a.compact_len[static_cast<int64_t>(e) * a.geometry.max_rows + r]);
    }
  }
  if (widest > 0 && (logits == nullptr || logits_stride < widest)) {
    return absl::InvalidArgumentError(absl::StrCat("logits stride ", logits_stride,
                                                   " is below the widest compacted row ", widest));
  }
  return absl::OkStatus();
}

std::unique_ptr<DataPlane> MakeCpuDataPlane(const ArenaView& arena) {
  return std::make_unique<CpuDataPlane>(arena);
}

}  // namespace spin
