// The CUDA backend: the semantics of kernels/cpu/cpu_data_plane.cc, bit for bit, on device
// arenas. Every shared formula comes from spin/numerics.h; this file compiles with
// --fmad=false so no other arithmetic is contracted differently from the host.
//
// Per step: BeginStep (1 CTA: entries, step counters, the step's budgets) and then every layer's
// selection at once ("select ahead", in groups of layers that fit the group scratch): Scores
// (block scores of every (layer, entry, row); Scores64 for b = 64 reads D alone for blocks whose
// V summary is set) -> Select (one CTA per (layer, entry, row): radix selects; the last CTA of
// a (layer, entry) builds its union and compacted lengths into the layer's record) -> ProbeRank
// (each probing (layer, entry)'s block levels for the miss curve). Per layer: Select(l) =
// Publish (the record into the outputs, the compacted table through the engine's block table,
// stats); Observe(l) = Probe (validation, fresh flag, on probe steps row 0's dense top-K counted
// per curve level), then the EMA, one launch per row in row order. EmaVec for the
// engine's layout (b = 64, max_slots % 8 == 0, 16-byte aligned logits rows; it also refreshes
// the V summaries of its blocks, and its grid shares out the segments of the whole batch),
// EmaWord for other even block sizes >= 64 and Ema otherwise (both followed by VSummary, with
// a grid row per entry).
//
// This file holds the host side: the data plane class (which kernels run, in which order, on the
// caller's stream) and the arena set-up calls. The kernels and their launchers are in
// step_kernels.cu, select_kernels.cu, probe_kernels.cu and ema_kernels.cu (launchers.h).
#include <cuda_runtime.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "launchers.h"
#include "spin/arena.h"
#include "spin/cuda_data_plane.h"
#include "spin/data_plane.h"
#include "spin/numerics.h"
#include "spin/paged_indexer.h"
#include "spin/status_macros.h"

namespace spin {
namespace internal {
// paged_indexer_wgmma.cu (sm_90a): the fused mode's indexer with the row-0 EMA beside it, once
// CheckIndexerEma has passed.
absl::Status LaunchIndexerEma(const cuda_kernels::Dev& d, int layer, const PagedIndexerArgs& a,
                              bool publish, cudaStream_t stream);
// Whether the fused kernel can run here (sm_90a) over `rows` rows, or why not.
absl::Status CheckIndexerEma(int64_t rows);
}  // namespace internal
namespace {

namespace ck = cuda_kernels;
using ck::Dev;

// Select-ahead group scratch (scores of rows >= 1, union masks, and the keys of rows beyond
// 4096 blocks), reused group after group.
constexpr int64_t kAheadGroupBytes = int64_t{64} << 20;

absl::Status CudaStatus(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
}

class CudaDataPlane final : public DataPlane {
 public:
  CudaDataPlane(const ArenaView& a, const ArenaHeader& h, const CudaDataPlaneOptions& o)
      : a_(a), header_(h), options_(o) {}

  ~CudaDataPlane() override {
    for (void* p : owned_) cudaFree(p);
    if (fork_) cudaEventDestroy(fork_);
    if (join_) cudaEventDestroy(join_);
    if (side_) cudaStreamDestroy(side_);
  }

  absl::Status Init() {
    const Geometry& g = a_.geometry;
    const int64_t S = g.max_seqs, R = g.max_rows, MB = a_.max_blocks;
    d_.policy = a_.policy;
    d_.sparsity = a_.sparsity;
    d_.stats = a_.stats;
    d_.curves = reinterpret_cast<unsigned long long*>(a_.curves);
    d_.seqs = a_.seqs;
    d_.fresh = a_.fresh;
    d_.state = a_.state;
    d_.vsum = a_.vsum;
    d_.batch = a_.batch;
    d_.entries = a_.entries;
    d_.union_count = a_.union_count;
    d_.union_ids = a_.union_ids;
    d_.phys = a_.phys;
    d_.compact_len = a_.compact_len;
    d_.sel_ids = a_.union_ids;  // the published outputs (SelFor)
    d_.sel_lens = a_.compact_len;
    d_.error = a_.error;
    d_.layers = static_cast<int32_t>(g.layers);
    d_.max_seqs = static_cast<int32_t>(g.max_seqs);
    d_.max_slots = static_cast<int32_t>(g.max_slots);
    d_.block = static_cast<int32_t>(g.block_size);
    d_.topk = static_cast<int32_t>(g.topk);
    d_.max_rows = static_cast<int32_t>(g.max_rows);
    d_.max_blocks = static_cast<int32_t>(MB);
    d_.dtype_bytes = static_cast<int32_t>(StateBytes(g.dtype));
    d_.block_shift = -1;
    for (int sh = 0; sh < 31; ++sh) {
      if ((1u << sh) == g.block_size) d_.block_shift = sh;
    }
    d_.seed = header_.seed;
    d_.record_elems = 2ull * g.max_slots;
    void* p = nullptr;
    auto alloc = [&](size_t bytes, void** out) -> absl::Status {
      if (bytes == 0) bytes = 256;
      SPIN_RETURN_IF_ERROR(CudaStatus(cudaMalloc(out, bytes), "cudaMalloc scratch"));
      owned_.push_back(*out);
      return absl::OkStatus();
    };
    const int64_t L = g.layers;
    observed_.assign(g.layers, 0);
    // Select-ahead groups: as many layers at once as keep the group scratch within
    // kAheadGroupBytes (every layer at once for the usual geometry; 64 x 128K slots needs
    // 128 KB per layer), and no more than the grid's 65535 (layer, entry) pairs allow.
    const bool scratch_keys = MB > static_cast<int64_t>(ck::kSelectRegRounds) * ck::kSelectThreads;
    const int64_t group_bytes_per_layer =
        S * (MB * (1 + (R - 1) * 4 + (scratch_keys ? R * 9 : 0)) + 4);
    const int64_t by_memory = options_.ahead_group_layers > 0
                                  ? options_.ahead_group_layers
                                  : kAheadGroupBytes / group_bytes_per_layer;
    group_ =
        static_cast<int32_t>(std::clamp<int64_t>(std::min<int64_t>(by_memory, 65535 / S), 1, L));
    const int64_t G = group_;
    SPIN_RETURN_IF_ERROR(alloc(L * S * MB * sizeof(float), &p));
    d_.row0 = static_cast<float*>(p);
    SPIN_RETURN_IF_ERROR(alloc(G * S * (R - 1) * MB * sizeof(float), &p));
    d_.scores_rest = static_cast<float*>(p);
    SPIN_RETURN_IF_ERROR(alloc(scratch_keys ? G * S * R * MB : 0, &p));
    d_.sel = static_cast<uint8_t*>(p);
    SPIN_RETURN_IF_ERROR(alloc(scratch_keys ? G * S * R * MB * sizeof(unsigned long long) : 0, &p));
    d_.keys = static_cast<unsigned long long*>(p);
    SPIN_RETURN_IF_ERROR(alloc(G * S * MB, &p));
    d_.gmask = static_cast<uint8_t*>(p);
    SPIN_RETURN_IF_ERROR(alloc(L * S * MB * sizeof(int32_t), &p));
    d_.ahead_ids = static_cast<int32_t*>(p);
    SPIN_RETURN_IF_ERROR(alloc(L * S * sizeof(int2), &p));
    d_.ahead_info = static_cast<int2*>(p);
    SPIN_RETURN_IF_ERROR(alloc(L * S * R * sizeof(int32_t), &p));
    d_.ahead_len = static_cast<int32_t*>(p);
    SPIN_RETURN_IF_ERROR(alloc(L * S * sizeof(int32_t), &p));
    d_.probe_list = static_cast<int32_t*>(p);
    SPIN_RETURN_IF_ERROR(alloc(L * sizeof(int32_t), &p));
    d_.probe_count = static_cast<int32_t*>(p);
    SPIN_RETURN_IF_ERROR(CudaStatus(cudaMemset(p, 0, L * sizeof(int32_t)), "clear probe lists"));
    SPIN_RETURN_IF_ERROR(alloc(L * S * MB, &p));
    d_.probe_lvl = static_cast<uint8_t*>(p);
    SPIN_RETURN_IF_ERROR(alloc(L * S, &p));
    d_.probe_on = static_cast<uint8_t*>(p);
    SPIN_RETURN_IF_ERROR(CudaStatus(cudaMemset(p, 0, L * S), "clear probe flags"));
    SPIN_RETURN_IF_ERROR(alloc(S * ck::kProbeCap * sizeof(unsigned long long), &p));
    d_.probe_cand = static_cast<unsigned long long*>(p);
    SPIN_RETURN_IF_ERROR(alloc(S * 2 * sizeof(int32_t), &p));
    d_.probe_cnt = static_cast<int32_t*>(p);
    SPIN_RETURN_IF_ERROR(
        CudaStatus(cudaMemset(p, 0, S * 2 * sizeof(int32_t)), "clear probe counts"));
    SPIN_RETURN_IF_ERROR(alloc(S * sizeof(unsigned), &p));
    d_.probe_arrive = static_cast<unsigned*>(p);
    SPIN_RETURN_IF_ERROR(
        CudaStatus(cudaMemset(p, 0, S * sizeof(unsigned)), "clear probe arrivals"));
    SPIN_RETURN_IF_ERROR(alloc(S * sizeof(uint64_t), &p));
    d_.xkeys = static_cast<uint64_t*>(p);
    SPIN_RETURN_IF_ERROR(alloc((L + 1) * sizeof(double), &p));
    d_.step_rho = static_cast<double*>(p);
    SPIN_RETURN_IF_ERROR(alloc(G * S * sizeof(unsigned), &p));
    d_.arrive = static_cast<unsigned*>(p);
    SPIN_RETURN_IF_ERROR(
        CudaStatus(cudaMemset(p, 0, G * S * sizeof(unsigned)), "clear arrival counters"));
    // ProbeRankKernel: the CTA size that holds the arena's blocks, and its shared memory.
    rank_threads_ = ck::ProbeRankThreads(a_.max_blocks);
    SPIN_RETURN_IF_ERROR(CudaStatus(ck::SetProbeRankSharedMemory(), "ProbeRank shared memory"));
    // EmaWordKernel CTAs resident on the device at once, for its persistent grid.
    int dev = 0, sms = 0, per_sm = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    if (e == cudaSuccess) e = ck::EmaWordBlocksPerSm(d_, &per_sm);
    SPIN_RETURN_IF_ERROR(CudaStatus(e, "EMA occupancy"));
    ema_resident_ = std::max(1, sms * per_sm);
    sms_ = std::max(1, sms);
    e = ck::EmaVecBlocksPerSm(d_, &per_sm);
    SPIN_RETURN_IF_ERROR(CudaStatus(e, "EMA occupancy"));
    ema_vec_resident_ = std::max(1, sms * per_sm);
    // Observe's second stream (the Probe launch beside the EMA), and its fork and join events.
    if (options_.probe_beside_ema || options_.defer_ema) {
      e = cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking);
      if (e == cudaSuccess) e = cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming);
      if (e == cudaSuccess) e = cudaEventCreateWithFlags(&join_, cudaEventDisableTiming);
      SPIN_RETURN_IF_ERROR(CudaStatus(e, "Observe's second stream"));
    }
    return absl::OkStatus();
  }

  const ArenaView& arena() const override { return a_; }
  bool on_device() const override { return true; }

  // Row 0's block scores of `layer` for entries [0, entries), from the step's selection.
  absl::StatusOr<std::vector<float>> BlockScores(int32_t layer, int32_t entries) const {
    SPIN_RETURN_IF_ERROR(CheckLayer(layer));
    if (entries < 0 || static_cast<uint32_t>(entries) > a_.geometry.max_seqs) {
      return absl::OutOfRangeError(absl::StrCat("entries ", entries, " out of range"));
    }
    std::vector<float> out(static_cast<size_t>(entries) * a_.max_blocks);
    const float* src = d_.row0 + static_cast<int64_t>(layer) * a_.geometry.max_seqs * a_.max_blocks;
    SPIN_RETURN_IF_ERROR(
        CudaStatus(cudaMemcpy(out.data(), src, out.size() * sizeof(float), cudaMemcpyDeviceToHost),
                   "read block scores"));
    return out;
  }

  absl::Status ResetSequence(int32_t seq, uint64_t key, cudaStream_t stream) override {
    if (seq < 0 || static_cast<uint32_t>(seq) >= a_.geometry.max_seqs) {
      return absl::OutOfRangeError(
          absl::StrCat("sequence ", seq, " is out of range [0, ", a_.geometry.max_seqs, ")"));
    }
    // A Select's statistics are those of the entries as they are now; a selection published
    // ahead holds the entry as it was, so the next Select publishes again (the outputs still hold
    // that other layer's selection until then: outputs_other_ stays).
    SPIN_RETURN_IF_ERROR(JoinEma(stream));
    SPIN_RETURN_IF_ERROR(FlushSelectCounts(stream));
    ahead_ = -1;
    return CudaStatus(ck::LaunchReset(d_, seq, key, stream), "ResetSequence launch");
  }

  absl::Status BeginStep(const StepBatch& batch, cudaStream_t stream) override {
    // The entries themselves are checked on the device (docs/cuda-backend.md).
    SPIN_RETURN_IF_ERROR(ValidateStepShape(a_, batch));
    SPIN_RETURN_IF_ERROR(JoinEma(stream));
    SPIN_RETURN_IF_ERROR(FlushSelectCounts(stream));
    cudaError_t e =
        ck::LaunchBeginStep(d_, batch.seq, batch.ctx_len, batch.q_pos, batch.n, batch.rows, stream);
    n_ = batch.n;
    rows_ = batch.rows;
    selected_layer_ = -1;
    step_table_ = batch.block_table;
    step_table_stride_ = batch.block_table ? batch.table_stride : 0;
    ahead_ = -1;
    outputs_other_ = false;
    observed_.assign(a_.geometry.layers, 0);
    // Every layer's selection of the step, made now: a layer's selection depends only on its
    // own state (which only its Observe changes), the step's entries and the policy, so the
    // selections of all layers are independent and run as a few wide grids instead of two
    // narrow launches per layer.
    if (e == cudaSuccess) e = SelectAhead(0, static_cast<int32_t>(a_.geometry.layers), stream);
    return CudaStatus(e, "BeginStep launch");
  }

  absl::Status Select(int32_t layer, const int32_t* block_table, int64_t table_stride,
                      cudaStream_t stream) override {
    SPIN_RETURN_IF_ERROR(CheckLayer(layer));
    if (block_table && table_stride < a_.max_blocks) {
      return absl::InvalidArgumentError(absl::StrCat("block table stride ", table_stride,
                                                     " is below the session's max blocks ",
                                                     a_.max_blocks));
    }
    // Without a table of its own, the step's (StepBatch::block_table), if one was given.
    if (block_table == nullptr) block_table = step_table_, table_stride = step_table_stride_;
    SPIN_RETURN_IF_ERROR(FlushSelectCounts(stream));
    cudaError_t e = cudaSuccess;
    if (n_ > 0) {
      if (observed_[layer]) {
        // The layer's Observe already ran in this step and changed its state: select it again
        // from the state as it is now, as the reference does (after its EMA, if deferred).
        SPIN_RETURN_IF_ERROR(JoinEma(stream));
        e = SelectAhead(layer, 1, stream);
        observed_[layer] = 0;
        if (e == cudaSuccess) {
          e = ck::LaunchPublish(d_, layer, n_, block_table, table_stride, true, stream);
        }
      } else if (ahead_ == layer && block_table == step_table_ && block_table != nullptr &&
                 table_stride == step_table_stride_) {
        // The previous layer's Observe published this selection through the step's table:
        // nothing to launch; the statistics are counted by the layer's Observe (or the next
        // call that launches into the same capture, or none: FlushSelectCounts).
        pending_counts_ = layer;
        pending_capture_ = CaptureOf(stream);
      } else {
        e = ck::LaunchPublish(d_, layer, n_, block_table, table_stride, true, stream);
      }
    }
    ahead_ = -1;
    outputs_other_ = false;
    selected_layer_ = layer;
    selected_table_ = block_table;
    selected_table_stride_ = table_stride;
    probe_counted_ = false;
    return CudaStatus(e, "Select launch");
  }

  absl::Status Remap(int32_t* idx, int32_t count, cudaStream_t stream) override {
    return RemapWith("Remap", idx, count, false, stream);
  }

  absl::Status RemapTopK(int32_t* idx, int32_t count, cudaStream_t stream) override {
    return RemapWith("RemapTopK", idx, count, true, stream);
  }

  absl::Status Observe(int32_t layer, const float* logits, int64_t logits_stride,
                       const int32_t* accepted, cudaStream_t stream) override {
    return ObserveWith("Observe", layer, nullptr, 0, logits, logits_stride, accepted, stream);
  }

  absl::Status RemapAndObserve(int32_t layer, int32_t* idx, int32_t count, const float* logits,
                               int64_t logits_stride, const int32_t* accepted,
                               cudaStream_t stream) override {
    return ObserveWith("RemapAndObserve", layer, idx, count, logits, logits_stride, accepted,
                       stream);
  }

  absl::Status IndexAndObserve(int32_t layer, const FusedIndexerArgs& f, cudaStream_t stream) {
    SPIN_RETURN_IF_ERROR(CheckLayer(layer));
    if (selected_layer_ != layer) {
      return absl::FailedPreconditionError(
          absl::StrCat("IndexAndObserve of layer ", layer,
                       " without its Select in this step (last: ", selected_layer_, ")"));
    }
    return Fused(layer, nullptr, 0, f, stream);
  }

  absl::Status SelectIndexAndObserve(int32_t layer, const int32_t* block_table,
                                     int64_t table_stride, const FusedIndexerArgs& f,
                                     cudaStream_t stream) {
    SPIN_RETURN_IF_ERROR(CheckLayer(layer));
    if (block_table == nullptr || table_stride < a_.max_blocks) {
      return absl::InvalidArgumentError(absl::StrCat(
          "SelectIndexAndObserve needs the engine's block table with a stride of at least the "
          "session's max blocks (",
          a_.max_blocks, "); got ", block_table ? "" : "no table, ", "stride ", table_stride));
    }
    return Fused(layer, block_table, table_stride, f, stream);
  }

 private:
  // Remap and RemapTopK (`engine_topk`: the top-K is the engine's, counted on a probe step).
  absl::Status RemapWith(const char* what, int32_t* idx, int32_t count, bool engine_topk,
                         cudaStream_t stream) {
    if (selected_layer_ < 0) {
      return absl::FailedPreconditionError(
          absl::StrCat(what, " needs a Select of the current step first"));
    }
    SPIN_RETURN_IF_ERROR(ValidateTopKBuffer(idx, count));
    // A selection's probe is counted once: here (the engine's top-K) unless Observe or a fused
    // call counted it already (the reference's rule).
    const bool probe = engine_topk && count > 0 && !probe_counted_;
    SPIN_RETURN_IF_ERROR(
        CudaStatus(ck::LaunchRemap(SelFor(selected_layer_, outputs_other_), selected_layer_, idx,
                                   count, n_, rows_, probe, stream),
                   "Remap launch"));
    if (probe) probe_counted_ = true;
    return absl::OkStatus();
  }

  // Observe, and with a top-K (count > 0) RemapAndObserve: every check first (a refusal launches
  // nothing), then Observe's launches with the remap inside the Probe launch. The probe is
  // counted from the given top-K, else computed from the logits, unless counted already.
  absl::Status ObserveWith(const char* what, int32_t layer, int32_t* idx, int32_t count,
                           const float* logits, int64_t logits_stride, const int32_t* accepted,
                           cudaStream_t stream) {
    SPIN_RETURN_IF_ERROR(CheckLayer(layer));
    if (selected_layer_ != layer) {
      return absl::FailedPreconditionError(
          absl::StrCat(what, " of layer ", layer,
                       " without its Select in this step (last: ", selected_layer_, ")"));
    }
    SPIN_RETURN_IF_ERROR(ValidateTopKBuffer(idx, count));
    if (n_ == 0) return absl::OkStatus();
    if (logits == nullptr || logits_stride < 0) return LogitsRequired(n_, logits_stride);
    const bool given = count > 0 && !probe_counted_;
    SPIN_RETURN_IF_ERROR(JoinEma(stream));  // the previous layer's deferred EMA
    observed_[layer] = 1;
    const ck::RemapWork remap{count > 0 ? idx : nullptr, count, given};
    // The Probe launch counts a launchless Select's statistics (pending_counts_ is the selected
    // layer, this one) and, with the step's table, publishes the next layer's selection unless
    // that layer was observed in this step (then its Select selects again).
    ck::SelectWork sel;
    // Counted here when owed by this layer's Select in the same capture (or both eager);
    // otherwise dropped (FlushSelectCounts).
    const bool owed = pending_counts_ == layer;
    sel.count_select = owed && pending_capture_ == CaptureOf(stream);
    const int32_t next = layer + 1;
    if (step_table_ != nullptr && static_cast<uint32_t>(next) < a_.geometry.layers &&
        !observed_[next]) {
      sel.table = step_table_;
      sel.table_stride = step_table_stride_;
      sel.publish_layer = next;
    }
    // The outputs hold another layer's selection while this call runs (it publishes the next
    // one, or an earlier Observe of this selection did): read this one's from its record.
    const Dev dv = SelFor(layer, sel.publish_layer >= 0 || outputs_other_);
    ahead_ = -1;
    if (sel.publish_layer >= 0) outputs_other_ = true;  // also if a launch below fails
    if (owed) pending_counts_ = -1;
    const cudaError_t e = LaunchObserve(dv, layer, logits, logits_stride, accepted, stream, remap,
                                        !given && !probe_counted_, sel);
    SPIN_RETURN_IF_ERROR(CudaStatus(e, absl::StrCat(what, " launch").c_str()));
    // The session's last layer ends a step's layers: its EMA is joined at once, so a captured
    // step ends with no work left on the second stream.
    if (static_cast<uint32_t>(layer) + 1 == a_.geometry.layers) {
      SPIN_RETURN_IF_ERROR(JoinEma(stream));
    }
    ahead_ = sel.publish_layer;
    probe_counted_ = true;  // a later Observe or RemapTopK of this selection counts nothing
    return absl::OkStatus();
  }

  // The fused mode: the indexer with the row-0 EMA, then the rest of Observe (validation, fresh
  // flags, probe curves; row 0 only: no accepted counts) as a Probe launch. With a block table
  // the same kernel also publishes the layer's selection (Select's work), so Select launches
  // nothing; without one it reads the compacted table Select published.
  absl::Status Fused(int32_t layer, const int32_t* block_table, int64_t table_stride,
                     const FusedIndexerArgs& f, cudaStream_t stream) {
    if (a_.geometry.block_size != static_cast<uint32_t>(kPageSlots)) {
      return absl::FailedPreconditionError(
          absl::StrCat("the fused mode needs blocks of ", kPageSlots,
                       " slots (one KV page each); this arena's blocks have ",
                       a_.geometry.block_size, ": use the engine's indexer and Observe"));
    }
    if (n_ > 0 && (f.q == nullptr || f.weights == nullptr || f.kv == nullptr ||
                   f.logits == nullptr || f.logits_stride < 0)) {
      return absl::InvalidArgumentError(
          "the fused mode: q, weights, kv and logits are required (logits_stride >= 0)");
    }
    const bool publish = block_table != nullptr;
    if (n_ == 0) {
      if (publish) {  // nothing to publish
        selected_layer_ = layer, probe_counted_ = false, ahead_ = -1, outputs_other_ = false;
        selected_table_ = block_table, selected_table_stride_ = table_stride;
      }
      return absl::OkStatus();
    }
    // Everything the launch can refuse, before anything is launched.
    SPIN_RETURN_IF_ERROR(internal::CheckIndexerEma(static_cast<int64_t>(n_) * rows_));
    SPIN_RETURN_IF_ERROR(JoinEma(stream));
    SPIN_RETURN_IF_ERROR(FlushSelectCounts(stream));
    cudaError_t e = cudaSuccess;
    // IndexAndObserve reads the selection from the outputs: if an Observe since the layer's
    // Select published the next layer's there, publish this one again (its statistics are
    // counted already).
    if (!publish && outputs_other_) {
      e = ck::LaunchPublish(d_, layer, n_, selected_table_, selected_table_stride_, false, stream);
      SPIN_RETURN_IF_ERROR(CudaStatus(e, "Publish launch"));
    }
    ahead_ = -1;
    outputs_other_ = false;
    // Select's host side: a layer observed earlier in this step is selected again from the
    // state as it is now, as the reference does.
    if (publish && observed_[layer]) {
      e = SelectAhead(layer, 1, stream);
      observed_[layer] = 0;
    }
    SPIN_RETURN_IF_ERROR(CudaStatus(e, "Select launch"));
    PagedIndexerArgs a;
    a.q = f.q;
    a.weights = f.weights;
    a.kv = f.kv;
    a.table = publish ? block_table : a_.phys;
    a.table_stride = publish ? table_stride : a_.max_blocks;
    a.lens = a_.compact_len;  // not read when publishing (the select-ahead record's are)
    a.lens_stride = a_.geometry.max_rows;
    a.logits = f.logits;
    a.logits_stride = f.logits_stride;
    a.batch = n_;
    a.next_n = rows_;
    a.max_pages = static_cast<int32_t>(a_.max_blocks);
    a.stages = f.stages;
    a.kernel = IndexerKernel::kWgmma;
    a.chunk_pages = f.chunk_pages;
    a.spread = f.spread;
    a.programmatic = f.programmatic;
    SPIN_RETURN_IF_ERROR(internal::LaunchIndexerEma(d_, layer, a, publish, stream));
    if (publish) {
      selected_layer_ = layer;
      selected_table_ = block_table;
      selected_table_stride_ = table_stride;
      probe_counted_ = false;
    }
    observed_[layer] = 1;
    // The kernel validated its entries; what is left is the probing entries' top-K, unless the
    // engine gives its own to RemapTopK after the call (probe_at_remap) or it is counted already.
    if (f.probe_at_remap || probe_counted_) return absl::OkStatus();
    SPIN_RETURN_IF_ERROR(
        CudaStatus(ck::LaunchProbe(d_, layer, n_, sms_, f.logits, f.logits_stride, nullptr, false,
                                   true, ck::RemapWork{}, ck::SelectWork{}, stream),
                   "Probe launch"));
    probe_counted_ = true;
    return absl::OkStatus();
  }

  // Scores and selections of layers [l0, l0 + count) into their select-ahead records, in
  // groups of group_ layers: per group one Scores grid (chunks x rows x (layer, entry)) and one
  // Select grid (rows x (layer, entry)).
  cudaError_t SelectAhead(int32_t l0, int32_t count, cudaStream_t stream) {
    if (n_ == 0) return cudaSuccess;
    for (int32_t g0 = l0; g0 < l0 + count; g0 += group_) {
      const int32_t layers = std::min(group_, l0 + count - g0);
      SPIN_CUDA_RETURN_IF_ERROR(ck::LaunchScores(d_, g0, layers, n_, rows_, stream));
      SPIN_CUDA_RETURN_IF_ERROR(ck::LaunchSelect(d_, g0, layers, n_, rows_, stream));
    }
    // Probing pairs' curve levels, from the row-0 scores just made, and the layers' lists of
    // probing entries.
    return ck::LaunchProbeRank(d_, l0, count, n_, rank_threads_, stream);
  }

  // Observe's launches: the entries' bookkeeping (validation, fresh flag, probe miss curve) and
  // one EMA launch per row, in row order (the prefix-valid replay), of the kernel for the arena's
  // state type and the logits' layout (after EmaWord or Ema, the V summaries). Without an
  // accepted array only row 0 is applied (the engine contract), so only its launch is made. The
  // bookkeeping runs beside the EMA launches (probe_beside_ema) or before them.
  // With `remap` (RemapAndObserve), the Probe launch also does the remap, first; `topk`: the
  // Probe launch computes the probing entries' top-K from the logits.
  cudaError_t LaunchObserve(const Dev& dv, int32_t layer, const float* logits,
                            int64_t logits_stride, const int32_t* accepted, cudaStream_t stream,
                            const ck::RemapWork& remap, bool topk, const ck::SelectWork& sel) {
    if (options_.defer_ema) {
      // The Probe launch stays on the caller's stream (the remap and the next layer's publish
      // are on the engine's path) and is made first: a captured graph's first node after the
      // indexer (launched second, batch 16 measured 2 us slower a layer). The EMA launches go
      // to the second stream, forked before the Probe launch (so they wait for the indexer
      // only) and joined by a later call (JoinEma); they read the layer's select-ahead record,
      // which nothing rewrites before that join (the outputs may be published over meanwhile).
      SPIN_CUDA_RETURN_IF_ERROR(cudaEventRecord(fork_, stream));
      SPIN_CUDA_RETURN_IF_ERROR(ck::LaunchProbe(dv, layer, n_, sms_, logits, logits_stride,
                                                accepted, true, topk, remap, sel, stream));
      SPIN_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(side_, fork_, 0));
      const cudaError_t ema =
          LaunchEmas(SelFor(layer, true), layer, logits, logits_stride, accepted, side_);
      const cudaError_t joined = cudaEventRecord(join_, side_);
      if (joined == cudaSuccess) ema_pending_ = true, ema_capture_ = CaptureOf(stream);
      SPIN_CUDA_RETURN_IF_ERROR(ema);
      return joined;
    }
    if (side_ == nullptr || !options_.probe_beside_ema) {
      SPIN_CUDA_RETURN_IF_ERROR(ck::LaunchProbe(dv, layer, n_, sms_, logits, logits_stride,
                                                accepted, true, topk, remap, sel, stream));
      return LaunchEmas(dv, layer, logits, logits_stride, accepted, stream);
    }
    // The Probe launch and the EMA launches touch disjoint memory (Probe: fresh flags, errors,
    // probe candidates, curves and the probe counters, and with RemapAndObserve the engine's
    // top-K buffer; the EMA: state, V summaries and the observed counters; both only read the
    // logits and the step's records), so they run side by
    // side: Probe on the second stream, forked from and joined back to the caller's (in a
    // captured graph, two parallel branches). The join is recorded and waited for whatever the
    // launches return; only if recording the join event itself fails is the second stream left
    // unjoined (a capture then fails when it ends).
    SPIN_CUDA_RETURN_IF_ERROR(cudaEventRecord(fork_, stream));
    SPIN_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(side_, fork_, 0));
    const cudaError_t probe = ck::LaunchProbe(dv, layer, n_, sms_, logits, logits_stride, accepted,
                                              true, topk, remap, sel, side_);
    const cudaError_t joined = cudaEventRecord(join_, side_);
    const cudaError_t ema = LaunchEmas(dv, layer, logits, logits_stride, accepted, stream);
    const cudaError_t wait = joined == cudaSuccess ? cudaStreamWaitEvent(stream, join_, 0) : joined;
    return probe != cudaSuccess ? probe : ema != cudaSuccess ? ema : wait;
  }

  // Observe's EMA launches: one per row, in row order (the prefix-valid replay), of the kernel for
  // the arena's state type and the logits' layout (after EmaWord or Ema, the V summaries).
  cudaError_t LaunchEmas(const Dev& dv, int32_t layer, const float* logits, int64_t logits_stride,
                         const int32_t* accepted, cudaStream_t stream) {
    const int32_t rows = accepted ? rows_ : 1;
    if (ck::EmaVecFits(dv, logits, logits_stride)) {
      return ck::LaunchEmaVec(dv, layer, n_, rows, logits, logits_stride, accepted,
                              ema_vec_resident_, stream);
    }
    if (ck::EmaWordFits(dv)) {
      SPIN_CUDA_RETURN_IF_ERROR(ck::LaunchEmaWord(dv, layer, n_, rows, logits, logits_stride,
                                                  accepted, ema_resident_, stream));
    } else {
      SPIN_CUDA_RETURN_IF_ERROR(
          ck::LaunchEma(dv, layer, n_, rows, logits, logits_stride, accepted, stream));
    }
    return ck::LaunchVSummary(dv, layer, n_, stream);
  }

  // The kernels' view for a launch that reads `layer`'s selection: from the published outputs
  // (where Select's Publish just wrote it, so in L2), or with `record` from the layer's
  // select-ahead record (the outputs may hold the next layer's selection: publish ahead).
  Dev SelFor(int32_t layer, bool record) const {
    Dev d = d_;
    if (record) {
      d.sel_ids = d_.ahead_ids + d_.Ahead(layer, 0) * d_.max_blocks;
      d.sel_lens = d_.ahead_len + d_.Ahead(layer, 0) * d_.max_rows;
    }
    return d;
  }

  // A deferred EMA (CudaDataPlaneOptions::defer_ema) joined back to `stream`: before a call that
  // reads or writes what it writes or reads (the state, the step's entries and records), or
  // forks the next one. Work forked into the capture the call launches into (or eagerly, from an
  // eager call) is joined by an event wait; work of another capture is dropped (that capture has
  // ended: it was joined there, or the capture failed). Eager work cannot be joined from inside a
  // capture (the wait would cross the capture's boundary, and a host wait is not allowed during
  // a capture): refused, the work still pending for a later eager call.
  absl::Status JoinEma(cudaStream_t stream) {
    if (!ema_pending_) return absl::OkStatus();
    const unsigned long long now = CaptureOf(stream);
    if (ema_capture_ == 0 && now != 0) {
      return absl::FailedPreconditionError(
          "an eager Observe's EMA is still deferred: end the eager step (an eager BeginStep or "
          "the last layer's Observe) before capturing");
    }
    ema_pending_ = false;
    if (ema_capture_ == now) return CudaStatus(cudaStreamWaitEvent(stream, join_, 0), "EMA join");
    return absl::OkStatus();
  }

  // A launchless Select's statistics that no Observe has counted yet, counted now: before a call
  // that changes the step's entries or selections, or selects again.
  // Under graph capture a count is launched only into the capture its Select was made in (or
  // eagerly for an eager Select): a Select captured without its Observe, then counted outside
  // the capture, would count once instead of at every replay, and an eager one counted inside a
  // capture at every replay. Those counts are dropped instead (docs/cuda-backend.md).
  absl::Status FlushSelectCounts(cudaStream_t stream) {
    if (pending_counts_ < 0) return absl::OkStatus();
    const int32_t layer = pending_counts_;
    pending_counts_ = -1;
    if (pending_capture_ != CaptureOf(stream)) return absl::OkStatus();
    return CudaStatus(ck::LaunchCountSelect(d_, layer, n_, stream), "Select statistics launch");
  }

  // The capture that launches on `stream` go into (its id + 1), or 0 when they run now.
  static unsigned long long CaptureOf(cudaStream_t stream) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    unsigned long long id = 0;
    if (cudaStreamGetCaptureInfo(stream, &status, &id) != cudaSuccess ||
        status != cudaStreamCaptureStatusActive) {
      return 0;
    }
    return id + 1;
  }

  absl::Status CheckLayer(int32_t layer) const { return ValidateLayer(a_, layer); }

  ArenaView a_;
  ArenaHeader header_;
  CudaDataPlaneOptions options_;
  Dev d_{};
  std::vector<void*> owned_;
  // Host mirror of the call sequence (BeginStep/Select), so call-order errors need no sync.
  int32_t n_ = 0, rows_ = 1, selected_layer_ = -1;
  // The current selection's probe is counted (reset by every Select and one call): by RemapTopK
  // (the engine's top-K), or by Observe's or a fused call's Probe launch (the logits'),
  // whichever came first; later calls count nothing (the reference's rule).
  bool probe_counted_ = false;
  std::vector<uint8_t> observed_;  // per layer: Observe ran in this step (since its selection)
  // Publish ahead (the engine's table given at BeginStep: StepBatch::block_table). ahead_: the
  // layer whose selection an Observe published into the outputs, which its Select may then
  // leave (-1: none, or a reset made it stale); outputs_other_: the outputs hold a layer's
  // selection other than the selected layer's (its kernels then read the record);
  // pending_counts_: a Select that launched nothing, whose statistics its layer's Observe
  // counts (or FlushSelectCounts); selected_table_: the table the selected layer's outputs were
  // published through.
  const int32_t* step_table_ = nullptr;
  int64_t step_table_stride_ = 0;
  int32_t ahead_ = -1, pending_counts_ = -1;
  unsigned long long pending_capture_ = 0;  // CaptureOf the stream of the pending Select
  bool outputs_other_ = false;  // the outputs hold another layer's selection than the selected
  const int32_t* selected_table_ = nullptr;
  int64_t selected_table_stride_ = 0;
  int32_t group_ = 1;         // layers per select-ahead group
  int ema_resident_ = 1;      // EmaWordKernel CTAs resident on the device at once
  int sms_ = 1;               // multiprocessors of the device (ProbeKernel's grid)
  int rank_threads_ = 1024;   // ProbeRankKernel's CTA size
  int ema_vec_resident_ = 1;  // EmaVecKernel CTAs resident on the device at once
  // Observe's second stream and its fork/join events (CudaDataPlaneOptions::probe_beside_ema).
  cudaStream_t side_ = nullptr;
  cudaEvent_t fork_ = nullptr, join_ = nullptr;
  // A deferred EMA (CudaDataPlaneOptions::defer_ema) on side_, not yet joined, and the capture
  // (CaptureOf) it was forked in.
  bool ema_pending_ = false;
  unsigned long long ema_capture_ = 0;
};

}  // namespace

bool CudaAvailable() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

absl::StatusOr<ArenaView> InitDeviceArena(void* device_base, uint64_t bytes, const Geometry& g,
                                          uint64_t seed, const Policy& policy,
                                          cudaStream_t stream) {
  SPIN_RETURN_IF_ERROR(ValidatePolicy(policy));
  SPIN_ASSIGN_OR_RETURN(const ArenaHeader h, MakeArenaHeader(g, seed));
  if (bytes < h.total_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "device arena of ", bytes, " bytes is too small: the geometry needs ", h.total_bytes));
  }
  SPIN_ASSIGN_OR_RETURN(const ArenaView v, ViewArenaWithHeader(device_base, bytes, h));
  // Small sections are built in host memory and copied; the state is filled on the device.
  ArenaPolicy ap{};
  FillArenaPolicy(policy, &ap);
  ap.epoch = 1;
  std::vector<double> sparsity(g.layers, InitialBudget(policy));
  std::vector<uint8_t> fresh(static_cast<size_t>(g.max_seqs) * g.layers, 1);
  BatchHeader bh{0, 0, -1, 0};  // as InitArena leaves it
  // The copies read host memory that lives only until return: synchronise before returning.
  const auto write = [&]() -> cudaError_t {
    SPIN_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(device_base, 0, h.total_bytes, stream));
    SPIN_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(device_base, &h, sizeof(ArenaHeader), cudaMemcpyHostToDevice, stream));
    SPIN_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(v.policy, &ap, sizeof(ap), cudaMemcpyHostToDevice, stream));
    SPIN_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(v.sparsity, sparsity.data(),
                                              sparsity.size() * sizeof(double),
                                              cudaMemcpyHostToDevice, stream));
    SPIN_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(v.fresh, fresh.data(), fresh.size(), cudaMemcpyHostToDevice, stream));
    SPIN_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(v.batch, &bh, sizeof(bh), cudaMemcpyHostToDevice, stream));
    SPIN_CUDA_RETURN_IF_ERROR(ck::LaunchFillUnset(
        v.state, 2ull * g.max_seqs * g.layers * g.max_slots, static_cast<int>(StateBytes(g.dtype)),
        v.vsum, static_cast<uint64_t>(g.max_seqs) * g.layers * v.max_blocks, stream));
    return cudaStreamSynchronize(stream);
  };
  SPIN_RETURN_IF_ERROR(CudaStatus(write(), "InitDeviceArena"));
  return v;
}

absl::Status WriteDevicePolicy(const ArenaView& view, const Policy& policy, cudaStream_t stream) {
  SPIN_RETURN_IF_ERROR(ValidatePolicy(policy));
  ArenaPolicy ap{};
  const auto read = [&]() -> cudaError_t {
    SPIN_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(&ap, view.policy, sizeof(ap), cudaMemcpyDeviceToHost, stream));
    return cudaStreamSynchronize(stream);
  };
  SPIN_RETURN_IF_ERROR(CudaStatus(read(), "read policy"));
  const uint64_t epoch = ap.epoch + 1;
  FillArenaPolicy(policy, &ap);
  ap.epoch = epoch;
  std::vector<double> sparsity(view.geometry.layers, policy.target_sparsity);
  const auto write = [&]() -> cudaError_t {
    if (policy.budget_mode == BudgetMode::kUniform) {
      SPIN_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(view.sparsity, sparsity.data(),
                                                sparsity.size() * sizeof(double),
                                                cudaMemcpyHostToDevice, stream));
    }
    SPIN_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(view.policy, &ap, sizeof(ap), cudaMemcpyHostToDevice, stream));
    return cudaStreamSynchronize(stream);
  };
  return CudaStatus(write(), "write policy");
}

absl::StatusOr<std::unique_ptr<DataPlane>> MakeCudaDataPlane(const ArenaView& view,
                                                             const CudaDataPlaneOptions& options) {
  if (options.ahead_group_layers < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("ahead_group_layers ", options.ahead_group_layers, " is negative"));
  }
  ArenaHeader h;
  SPIN_RETURN_IF_ERROR(CudaStatus(cudaMemcpy(&h, view.header, sizeof(h), cudaMemcpyDeviceToHost),
                                  "read arena header"));
  SPIN_ASSIGN_OR_RETURN(const ArenaView checked,
                        ViewArenaWithHeader(view.header, h.total_bytes, h));
  auto dp = std::make_unique<CudaDataPlane>(checked, h, options);
  SPIN_RETURN_IF_ERROR(dp->Init());
  return std::unique_ptr<DataPlane>(std::move(dp));
}

absl::StatusOr<std::vector<float>> ReadDeviceBlockScores(const DataPlane& dp, int32_t layer,
                                                         int32_t entries) {
  const auto* cuda = dynamic_cast<const CudaDataPlane*>(&dp);
  if (cuda == nullptr) return absl::InvalidArgumentError("not a CUDA data plane");
  return cuda->BlockScores(layer, entries);
}

absl::Status IndexAndObserve(DataPlane& dp, int32_t layer, const FusedIndexerArgs& args,
                             cudaStream_t stream) {
  auto* cuda = dynamic_cast<CudaDataPlane*>(&dp);
  if (cuda == nullptr) {
    return absl::InvalidArgumentError("the fused mode needs a CUDA data plane");
  }
  return cuda->IndexAndObserve(layer, args, stream);
}

absl::Status SelectIndexAndObserve(DataPlane& dp, int32_t layer, const int32_t* block_table,
                                   int64_t table_stride, const FusedIndexerArgs& args,
                                   cudaStream_t stream) {
  auto* cuda = dynamic_cast<CudaDataPlane*>(&dp);
  if (cuda == nullptr) {
    return absl::InvalidArgumentError("the fused mode needs a CUDA data plane");
  }
  return cuda->SelectIndexAndObserve(layer, block_table, table_stride, args, stream);
}

absl::StatusOr<uint32_t> ReadDeviceError(const ArenaView& view) {
  uint32_t err = 0;
  SPIN_RETURN_IF_ERROR(CudaStatus(cudaMemcpy(&err, view.error, sizeof(err), cudaMemcpyDeviceToHost),
                                  "read arena error"));
  return err;
}

}  // namespace spin
