// Writes the seed corpora of the fuzz targets: small valid examples of each input kind, and a
// few near-misses, into DIR/<target>/seed-*. Deterministic: running it again rewrites the same
// files. Regression inputs (regression-*) are committed by hand beside them, never generated.
//
//   make_seeds tests/fuzz/corpus
//
// The RPC seeds name methods, and make_seeds turns names into the index rpc_fuzz reads from the
// service descriptor: rerun it when spin.v1.Spin gains a method.
#include <sys/stat.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <tuple>
#include <vector>

#include "npy.h"
#include "spin/v1/spin.pb.h"
#include "trace.h"

namespace {

namespace pb = spin::v1;
std::string g_root;

void Write(const std::string& target, const std::string& name, const std::string& bytes) {
  const std::string dir = g_root + "/" + target;
  std::filesystem::create_directories(dir);
  std::ofstream f(dir + "/seed-" + name, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!f) {
    std::fprintf(stderr, "make_seeds: cannot write %s/seed-%s\n", dir.c_str(), name.c_str());
    std::exit(1);
  }
}

std::string Floats(int64_t n, float scale) {
  std::string out(static_cast<size_t>(n) * 4, '\0');
  for (int64_t i = 0; i < n; ++i) {
    const float v = scale * static_cast<float>((i * 37) % 101) - 17.0f;
    std::memcpy(&out[static_cast<size_t>(i) * 4], &v, 4);
  }
  return out;
}

std::string Npy(const std::vector<int64_t>& shape, float scale = 0.25f) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return spin::NpyF32Header(shape) + Floats(n, scale);
}

// A small trace: `steps` x `layers` x `rows` x `n_max`.
struct SmallTrace {
  spin::TraceMeta meta;
  int64_t n_max;
};

SmallTrace MakeTrace(int steps, int layers, int rows, int64_t n_max, bool accepted) {
  SmallTrace t;
  t.n_max = n_max;
  t.meta.layers = layers;
  t.meta.block_size = 4;
  t.meta.topk = 6;
  t.meta.steps = steps;
  t.meta.rows = rows;
  for (int s = 0; s < steps; ++s) {
    t.meta.ctx_len.push_back(static_cast<int32_t>(n_max - steps * rows + s * rows));
    t.meta.q_pos.push_back(t.meta.ctx_len.back() - 1);
    if (accepted) t.meta.accepted.push_back(s % (rows + 1));
  }
  return t;
}

// trace_fuzz's framing: kinds, meta.json's length, meta.json, scores.npy.
std::string TraceInput(uint8_t meta_bits, uint8_t scores_bits, const std::string& meta,
                       const std::string& scores) {
  std::string out;
  out.push_back(static_cast<char>(meta_bits));
  out.push_back(static_cast<char>(scores_bits));
  out.push_back(static_cast<char>(meta.size() & 0xff));
  out.push_back(static_cast<char>(meta.size() >> 8));
  return out + meta + scores;
}

void NpySeeds() {
  Write("npy_fuzz", "scalar", Npy({}));
  Write("npy_fuzz", "vector", Npy({5}));
  Write("npy_fuzz", "empty", Npy({0}));
  Write("npy_fuzz", "matrix", Npy({3, 4}));
  Write("npy_fuzz", "trace-shape", Npy({2, 2, 1, 8}));
  // numpy.save's own spelling: no trailing comma in a rank > 1 shape, version 2.0 framing.
  std::string dict = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }";
  dict.append((64 - (12 + dict.size() + 1) % 64) % 64, ' ');  // data 64-byte aligned
  dict.push_back('\n');
  std::string v2 = std::string("\x93NUMPY\x02\x00", 8);
  for (int i = 0; i < 4; ++i) v2.push_back(static_cast<char>((dict.size() >> (8 * i)) & 0xff));
  Write("npy_fuzz", "version2", v2 + dict + Floats(6, 1.0f));
  std::string f8 = Npy({2});
  f8.replace(f8.find("<f4"), 3, "<f8");
  Write("npy_fuzz", "wrong-dtype", f8);
  std::string fortran = Npy({2, 2});
  fortran.replace(fortran.find("False"), 5, "True ");
  Write("npy_fuzz", "fortran", fortran);
}

void MetaSeeds() {
  Write("meta_json_fuzz", "small", spin::TraceMetaToJson(MakeTrace(3, 2, 1, 16, false).meta));
  Write("meta_json_fuzz", "rows-accepted",
        spin::TraceMetaToJson(MakeTrace(4, 2, 2, 24, true).meta));
  Write("meta_json_fuzz", "no-rows",
        R"({"version":1,"layers":1,"block_size":64,"topk":64,"steps":2,"q_pos":[10,11],)"
        R"("ctx_len":[11,12],"future_key":{"a":[1,2.5,"x",null,true]}})");
  spin::TraceMeta at_limits = MakeTrace(2, 1, 1, 16, false).meta;
  at_limits.layers = spin::kTraceMaxLayers;
  at_limits.block_size = spin::kTraceMaxBlockSize;
  at_limits.rows = spin::kTraceMaxRows;
  Write("meta_json_fuzz", "at-limits", spin::TraceMetaToJson(at_limits));
  at_limits.block_size = spin::kTraceMaxBlockSize + 1;
  Write("meta_json_fuzz", "block-over-limit", spin::TraceMetaToJson(at_limits));
}

void TraceSeeds() {
  for (const auto& [name, steps, layers, rows, n_max, accepted] :
       {std::tuple{"small", 3, 2, 1, 16, false}, std::tuple{"rows-accepted", 4, 2, 2, 24, true},
        std::tuple{"one-layer", 5, 1, 1, 32, false}}) {
    const SmallTrace t = MakeTrace(steps, layers, rows, n_max, accepted);
    const std::string meta = spin::TraceMetaToJson(t.meta);
    const std::string scores = Npy({steps, layers, rows, n_max});
    Write("trace_fuzz", name, TraceInput(0, 0, meta, scores));
    if (std::string(name) == "small") {
      Write("trace_fuzz", "small-per-layer-bf16", TraceInput(0xc0, 0, meta, scores));
      Write("trace_fuzz", "small-symlink", TraceInput(0, 8, meta, scores));
      Write("trace_fuzz", "fifo-scores", TraceInput(0, 6, meta, scores));
      Write("trace_fuzz", "fifo-meta", TraceInput(6, 0, meta, scores));
      Write("trace_fuzz", "dir-scores", TraceInput(0, 7, meta, scores));
      Write("trace_fuzz", "missing-meta", TraceInput(5, 0, meta, scores));
      spin::TraceMeta big = t.meta;
      big.block_size = 2147483647;  // the trace-stats crash of the issue
      Write("trace_fuzz", "huge-block", TraceInput(0, 0, spin::TraceMetaToJson(big), scores));
    }
  }
}

// rpc_fuzz's framing for one call: method index, flags, length, request.
std::string Call(const std::string& method, uint8_t flags, const google::protobuf::Message& m) {
  const auto* service = pb::AttachRequest::descriptor()->file()->FindServiceByName("Spin");
  int index = -1;
  for (int i = 0; i < service->method_count(); ++i) {
    if (service->method(i)->name() == method) index = i;
  }
  if (index < 0) {
    std::fprintf(stderr, "make_seeds: spin.v1.Spin has no method %s\n", method.c_str());
    std::exit(1);
  }
  const std::string bytes = m.SerializeAsString();
  std::string out;
  out.push_back(static_cast<char>(index));
  out.push_back(static_cast<char>(flags));
  out.push_back(static_cast<char>(bytes.size() & 0xff));
  out.push_back(static_cast<char>(bytes.size() >> 8));
  return out + bytes;
}

constexpr uint8_t kLive = 1;  // rpc_fuzz: put the live session in the request

// A SessionRef the harness replaces with the live session (placeholder values).
template <typename T>
T WithSession() {
  T r;
  r.mutable_session()->set_session_id("s-0000000000000000");
  r.mutable_session()->set_token("00000000000000000000000000000000");
  return r;
}

void RpcSeeds() {
  pb::AttachRequest attach;
  attach.mutable_geometry()->set_layers(2);
  attach.mutable_geometry()->set_block_size(4);
  attach.mutable_geometry()->set_topk(8);
  attach.mutable_geometry()->set_max_sequences(2);
  attach.mutable_geometry()->set_max_slots(64);
  attach.mutable_geometry()->set_max_rows(2);
  attach.mutable_geometry()->set_state_dtype(pb::STATE_DTYPE_BF16);
  attach.set_seed(3);
  attach.mutable_policy()->set_target_sparsity(0.5);
  attach.mutable_policy()->set_probe_period(2);
  attach.mutable_policy()->set_budget_mode(pb::BUDGET_MODE_PER_LAYER);
  attach.set_client_name("seed");
  Write("rpc_fuzz", "attach", Call("Attach", 0, attach));
  Write("rpc_fuzz", "list-sessions", Call("ListSessions", 0, pb::ListSessionsRequest()));
  Write("rpc_fuzz", "get-policy", Call("GetPolicy", kLive, WithSession<pb::GetPolicyRequest>()));
  Write("rpc_fuzz", "get-policy-wrong-token",
        Call("GetPolicy", 2, WithSession<pb::GetPolicyRequest>()));
  Write("rpc_fuzz", "get-policy-unknown",
        Call("GetPolicy", 0, WithSession<pb::GetPolicyRequest>()));
  auto set = WithSession<pb::SetPolicyRequest>();
  set.set_target_sparsity(0.7);
  set.set_alpha(0.5f);
  set.set_probe_period(3);
  set.set_budget_mode(pb::BUDGET_MODE_PER_LAYER);
  Write("rpc_fuzz", "set-policy", Call("SetPolicy", kLive, set));
  Write("rpc_fuzz", "get-budgets", Call("GetBudgets", kLive, WithSession<pb::GetBudgetsRequest>()));
  Write("rpc_fuzz", "watch-budgets",
        Call("WatchBudgets", kLive, WithSession<pb::GetBudgetsRequest>()));
  Write("rpc_fuzz", "get-stats", Call("GetStats", kLive, WithSession<pb::GetStatsRequest>()));
  Write("rpc_fuzz", "detach", Call("Detach", kLive, WithSession<pb::DetachRequest>()));

  // A remote-mode step: open two sequences, begin a step, select layer 0, observe layer 0.
  auto open = WithSession<pb::OpenSequencesRequest>();
  for (int s = 0; s < 2; ++s) {
    pb::SequenceOpen* o = open.add_sequences();
    o->set_sequence(s);
    o->set_key(100 + s);
  }
  auto predict = WithSession<pb::PredictMasksRequest>();
  predict.set_begin_step(true);
  predict.set_rows(2);
  predict.set_layer(0);
  for (int s = 0; s < 2; ++s) {
    pb::StepEntry* e = predict.add_entries();
    e->set_sequence(s);
    e->set_ctx_len(40 + 8 * s);
    e->set_q_pos(39 + 8 * s);
  }
  auto observe = WithSession<pb::ObserveScoresRequest>();
  observe.set_layer(0);
  for (int r = 0; r < 4; ++r) {
    pb::RowScores* row = observe.add_scores();
    for (int i = 0; i < 64; ++i) row->add_logits(static_cast<float>((i * 7 + r) % 13));
  }
  observe.add_accepted(1);
  observe.add_accepted(2);
  auto predict1 = WithSession<pb::PredictMasksRequest>();
  predict1.set_layer(1);
  Write("rpc_fuzz", "remote-step",
        Call("OpenSequences", kLive, open) + Call("PredictMasks", kLive, predict) +
            Call("ObserveScores", kLive, observe) + Call("PredictMasks", kLive, predict1) +
            Call("GetStats", kLive, WithSession<pb::GetStatsRequest>()));
  Write("rpc_fuzz", "open-sequences", Call("OpenSequences", kLive, open));
  Write("rpc_fuzz", "predict-without-open", Call("PredictMasks", kLive, predict));
  Write("rpc_fuzz", "observe-without-predict", Call("ObserveScores", kLive, observe));
  const auto* service = pb::AttachRequest::descriptor()->file()->FindServiceByName("Spin");
  if (service->FindMethodByName("KeepAlive") != nullptr) {
    // KeepAliveRequest is {SessionRef session = 1}: the same bytes as a GetStatsRequest.
    Write("rpc_fuzz", "keep-alive", Call("KeepAlive", kLive, WithSession<pb::GetStatsRequest>()));
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_seeds CORPUS_DIR (tests/fuzz/corpus)\n");
    return 2;
  }
  g_root = argv[1];
  NpySeeds();
  MetaSeeds();
  TraceSeeds();
  RpcSeeds();
  return 0;
}
