// spind as a process: started by the test on a temporary Unix socket, driven over gRPC.
// Each RPC's success path, its bad inputs with exact status codes and no state change, two
// sessions isolated, limits, health, SIGTERM, and remote-mode replay equal to offline replay.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "daemon_harness.h"
#include "daemon_replay.h"
#include "gen_trace.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "remote_data_plane.h"
#include "replay.h"
#include "resilient_data_plane.h"
#include "spin/numerics.h"
#include "spin/v1/spin.grpc.pb.h"
#include "spin_client.h"
#include "trace.h"

namespace spin::testing {
namespace {

namespace pb = spin::v1;

TEST(Spind, AttachPolicyBudgetsStatsDetach) {
  Daemon d;
  ASSERT_TRUE(d.ready());
  pb::AttachResponse a;
  ASSERT_TRUE(CALL(d, Attach, AttachReq(), &a).ok());
  EXPECT_EQ(a.session_id().rfind("s-", 0), 0u);
  EXPECT_EQ(a.token().size(), 32u);
  EXPECT_EQ(a.backend(), pb::BACKEND_CPU);
  EXPECT_GT(a.arena_bytes(), 2u * 2 * 1024 * 8);
  EXPECT_GE(a.arena_header().size(), 64u);

  pb::GetPolicyRequest gp;
  *gp.mutable_session() = Ref(a);
  pb::GetPolicyResponse pol;
  ASSERT_TRUE(CALL(d, GetPolicy, gp, &pol).ok());
  EXPECT_DOUBLE_EQ(pol.policy().target_sparsity(), 0.5);
  EXPECT_FLOAT_EQ(pol.policy().alpha(), 0.3f);
  const uint64_t epoch = pol.epoch();

  pb::SetPolicyRequest sp;
  *sp.mutable_session() = Ref(a);
  sp.set_target_sparsity(0.3);
  sp.set_probe_period(8);
  pb::SetPolicyResponse spr;
  ASSERT_TRUE(CALL(d, SetPolicy, sp, &spr).ok());
  EXPECT_DOUBLE_EQ(spr.policy().target_sparsity(), 0.3);
  EXPECT_EQ(spr.policy().probe_period(), 8u);
  EXPECT_DOUBLE_EQ(spr.policy().exploration(), 0.05);  // untouched
  EXPECT_EQ(spr.epoch(), epoch + 1);

  pb::GetBudgetsRequest gb;
  *gb.mutable_session() = Ref(a);
  pb::GetBudgetsResponse bud;
  ASSERT_TRUE(CALL(d, GetBudgets, gb, &bud).ok());
  ASSERT_EQ(bud.layer_sparsity_size(), 2);
  EXPECT_DOUBLE_EQ(bud.layer_sparsity(1), 0.3);

  pb::GetStatsRequest gs;
  *gs.mutable_session() = Ref(a);
  pb::GetStatsResponse st;
  ASSERT_TRUE(CALL(d, GetStats, gs, &st).ok());
  ASSERT_EQ(st.layers_size(), 2);
  EXPECT_EQ(st.layers(0).steps(), 0u);

  pb::ListSessionsResponse ls;
  ASSERT_TRUE(CALL(d, ListSessions, pb::ListSessionsRequest(), &ls).ok());
  ASSERT_EQ(ls.sessions_size(), 1);
  EXPECT_EQ(ls.sessions(0).client_name(), "test");

  pb::DetachRequest dr;
  *dr.mutable_session() = Ref(a);
  pb::DetachResponse dresp;
  ASSERT_TRUE(CALL(d, Detach, dr, &dresp).ok());
  EXPECT_EQ(CALL(d, GetPolicy, gp, &pol).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(CALL(d, Detach, dr, &dresp).error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST(Spind, BadInputsGetPreciseCodesAndChangeNothing) {
  Daemon d({"--max-sessions", "2"});
  ASSERT_TRUE(d.ready());
  pb::AttachResponse a;
  // Geometry and policy out of range.
  pb::AttachRequest bad = AttachReq();
  bad.mutable_geometry()->set_layers(0);
  EXPECT_EQ(CALL(d, Attach, bad, &a).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  bad = AttachReq();
  bad.mutable_geometry()->set_state_dtype(pb::STATE_DTYPE_UNSPECIFIED);
  EXPECT_EQ(CALL(d, Attach, bad, &a).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  bad = AttachReq();
  bad.mutable_policy()->set_target_sparsity(1.5);
  EXPECT_EQ(CALL(d, Attach, bad, &a).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  pb::ListSessionsResponse ls;
  ASSERT_TRUE(CALL(d, ListSessions, pb::ListSessionsRequest(), &ls).ok());
  EXPECT_EQ(ls.sessions_size(), 0);

  ASSERT_TRUE(CALL(d, Attach, AttachReq(), &a).ok());
  pb::GetPolicyRequest gp;
  *gp.mutable_session() = Ref(a);
  pb::GetPolicyResponse before, after;
  ASSERT_TRUE(CALL(d, GetPolicy, gp, &before).ok());

  // Unknown session, wrong token.
  pb::GetPolicyRequest unknown = gp;
  unknown.mutable_session()->set_session_id("s-nope");
  EXPECT_EQ(CALL(d, GetPolicy, unknown, &after).error_code(), grpc::StatusCode::NOT_FOUND);
  pb::GetPolicyRequest wrong = gp;
  wrong.mutable_session()->set_token("0123");
  EXPECT_EQ(CALL(d, GetPolicy, wrong, &after).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  pb::SetPolicyRequest sp;
  *sp.mutable_session() = Ref(a);
  sp.mutable_session()->set_token("0123");
  sp.set_target_sparsity(0.1);
  pb::SetPolicyResponse spr;
  EXPECT_EQ(CALL(d, SetPolicy, sp, &spr).error_code(), grpc::StatusCode::PERMISSION_DENIED);

  // SetPolicy values out of range: INVALID_ARGUMENT, nothing changes (not even the epoch).
  for (int field = 0; field < 4; ++field) {
    pb::SetPolicyRequest s;
    *s.mutable_session() = Ref(a);
    s.set_target_sparsity(0.2);  // valid, but must not land with the bad field
    if (field == 0) s.set_target_sparsity(-0.5);
    if (field == 1) s.set_exploration(1.0);
    if (field == 2) s.set_alpha(std::nanf(""));
    if (field == 3) s.set_probe_period(1u << 30);
    EXPECT_EQ(CALL(d, SetPolicy, s, &spr).error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << field;
  }
  ASSERT_TRUE(CALL(d, GetPolicy, gp, &after).ok());
  EXPECT_EQ(after.DebugString(), before.DebugString());

  // Remote mode: layer, sequence and batch out of range.
  pb::PredictMasksRequest pm;
  *pm.mutable_session() = Ref(a);
  pm.set_layer(5);
  pb::PredictMasksResponse pmr;
  EXPECT_EQ(CALL(d, PredictMasks, pm, &pmr).error_code(), grpc::StatusCode::OUT_OF_RANGE);
  pb::OpenSequencesRequest os;
  *os.mutable_session() = Ref(a);
  os.add_sequences()->set_sequence(0);
  os.add_sequences()->set_sequence(9);  // out of range: neither opens
  pb::OpenSequencesResponse osr;
  EXPECT_EQ(CALL(d, OpenSequences, os, &osr).error_code(), grpc::StatusCode::OUT_OF_RANGE);
  pm.set_begin_step(true);
  pm.set_rows(1);
  pm.set_layer(0);
  pb::StepEntry* e = pm.add_entries();
  e->set_sequence(0);
  e->set_ctx_len(100);
  e->set_q_pos(99);
  EXPECT_EQ(CALL(d, PredictMasks, pm, &pmr).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);  // sequence 0 was not opened
  os.mutable_sequences()->RemoveLast();
  ASSERT_TRUE(CALL(d, OpenSequences, os, &osr).ok());
  e->set_ctx_len(5000);  // beyond max_slots
  EXPECT_EQ(CALL(d, PredictMasks, pm, &pmr).error_code(), grpc::StatusCode::OUT_OF_RANGE);
  for (int i = 0; i < 3; ++i) pm.add_entries()->set_sequence(0);
  EXPECT_EQ(CALL(d, PredictMasks, pm, &pmr).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  // None of the refused steps ran: no layer selected anything, the policy is as it was.
  pb::GetStatsRequest gs;
  *gs.mutable_session() = Ref(a);
  pb::GetStatsResponse stats;
  ASSERT_TRUE(CALL(d, GetStats, gs, &stats).ok());
  ASSERT_EQ(stats.layers_size(), 2);
  for (const pb::LayerStats& l : stats.layers()) {
    EXPECT_EQ(l.steps(), 0u) << "layer " << l.layer();
    EXPECT_EQ(l.blocks_total(), 0u) << "layer " << l.layer();
  }
  ASSERT_TRUE(CALL(d, GetPolicy, gp, &after).ok());
  EXPECT_EQ(after.DebugString(), before.DebugString());

  // Limits: a second session fits, a third does not.
  pb::AttachResponse a2, a3;
  ASSERT_TRUE(CALL(d, Attach, AttachReq(), &a2).ok());
  EXPECT_EQ(CALL(d, Attach, AttachReq(), &a3).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
}

TEST(Spind, ArenaLimitIsResourceExhausted) {
  Daemon d({"--max-arena-bytes", "100000"});
  ASSERT_TRUE(d.ready());
  pb::AttachResponse a;
  EXPECT_EQ(CALL(d, Attach, AttachReq(2, 1 << 16), &a).error_code(),
            grpc::StatusCode::RESOURCE_EXHAUSTED);
}

TEST(Spind, SessionsAreIsolated) {
  Daemon d;
  ASSERT_TRUE(d.ready());
  pb::AttachResponse a, b;
  ASSERT_TRUE(CALL(d, Attach, AttachReq(), &a).ok());
  ASSERT_TRUE(CALL(d, Attach, AttachReq(), &b).ok());
  EXPECT_NE(a.session_id(), b.session_id());
  EXPECT_NE(a.token(), b.token());
  pb::SetPolicyRequest sp;
  *sp.mutable_session() = Ref(a);
  sp.set_target_sparsity(0.7);
  pb::SetPolicyResponse spr;
  ASSERT_TRUE(CALL(d, SetPolicy, sp, &spr).ok());
  pb::GetPolicyRequest gp;
  *gp.mutable_session() = Ref(b);
  pb::GetPolicyResponse pol;
  ASSERT_TRUE(CALL(d, GetPolicy, gp, &pol).ok());
  EXPECT_DOUBLE_EQ(pol.policy().target_sparsity(), 0.5);
  // a's token does not open b.
  gp.mutable_session()->set_token(a.token());
  EXPECT_EQ(CALL(d, GetPolicy, gp, &pol).error_code(), grpc::StatusCode::PERMISSION_DENIED);
}

TEST(Spind, HealthServingAndGracefulSigterm) {
  Daemon d;
  ASSERT_TRUE(d.ready());
  grpc::GenericStub generic(d.channel());
  // grpc.health.v1.Health/Check with an empty request: SERVING is field 1 = 1 (bytes 08 01).
  grpc::ByteBuffer req, resp;
  grpc::Slice empty("");
  req = grpc::ByteBuffer(&empty, 1);
  grpc::ClientContext ctx;
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  grpc::Status status;
  generic.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &req, &resp,
                    [&](grpc::Status s) {
                      std::lock_guard<std::mutex> l(mu);
                      status = s;
                      done = true;
                      cv.notify_all();
                    });
  std::unique_lock<std::mutex> l(mu);
  cv.wait_for(l, std::chrono::seconds(10), [&] { return done; });
  ASSERT_TRUE(done);
  ASSERT_TRUE(status.ok()) << status.error_message();
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(resp.Dump(&slices).ok());
  std::string bytes;
  for (auto& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  EXPECT_EQ(bytes, std::string("\x08\x01", 2));
  EXPECT_EQ(d.Terminate(), 0);
  EXPECT_NE(access(d.socket().c_str(), F_OK), 0);  // socket removed on exit
}

TEST(Spind, BadFlagsExplainThemselves) {
  const std::string cmd = std::string(SPIND_PATH) + " --listen tcp://x 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  char buf[512] = {0};
  const size_t n = fread(buf, 1, sizeof(buf) - 1, p);
  const int rc = pclose(p);
  EXPECT_NE(WEXITSTATUS(rc), 0);
  EXPECT_NE(std::string(buf, n).find("unix:///absolute/path"), std::string::npos);
}

// Drives a generated trace through PredictMasks/ObserveScores and compares every selection with
// offline replay's dump.
TEST(Spind, RemoteReplayEqualsOfflineReplay) {
  GenTraceOptions g;
  g.layers = 3;
  g.slots = 64 * 40;
  g.steps = 30;
  g.topk = 256;
  g.rows = 2;
  g.seed = 4;
  const std::string dir = ::testing::TempDir() + "/spind_remote_trace";
  ASSERT_TRUE(GenerateTrace(dir, g).ok());
  absl::StatusOr<Trace> t = LoadTrace(dir);
  ASSERT_TRUE(t.ok());
  const TraceMeta& m = t->meta();
  ReplayOptions o;
  o.policy.target_sparsity = 0.5;
  o.policy.exploration = 0.1;
  o.policy.probe_period = 7;
  o.seed = 7;
  o.sequence_key = 0;
  o.dump_path = ::testing::TempDir() + "/spind_remote_offline.jsonl";
  ASSERT_TRUE(Replay(*t, o).ok());

  Daemon d;
  ASSERT_TRUE(d.ready());
  pb::AttachRequest ar;
  pb::Geometry* geo = ar.mutable_geometry();
  geo->set_layers(m.layers);
  geo->set_block_size(m.block_size);
  geo->set_topk(m.topk);
  geo->set_max_sequences(1);
  geo->set_max_slots(static_cast<uint32_t>(t->n_max()));
  geo->set_max_rows(m.rows);
  geo->set_state_dtype(pb::STATE_DTYPE_FP32);
  ar.set_seed(7);
  ar.mutable_policy()->set_target_sparsity(0.5);
  ar.mutable_policy()->set_exploration(0.1);
  ar.mutable_policy()->set_alpha(o.policy.alpha);
  ar.mutable_policy()->set_probe_period(7);
  pb::AttachResponse a;
  ASSERT_TRUE(CALL(d, Attach, ar, &a).ok());
  pb::OpenSequencesRequest os;
  *os.mutable_session() = Ref(a);
  os.add_sequences()->set_sequence(0);
  pb::OpenSequencesResponse osr;
  ASSERT_TRUE(CALL(d, OpenSequences, os, &osr).ok());
  std::ifstream dump(o.dump_path);
  std::string line;
  for (int step = 0; step < m.steps; ++step) {
    for (int l = 0; l < m.layers; ++l) {
      pb::PredictMasksRequest pm;
      *pm.mutable_session() = Ref(a);
      pm.set_layer(l);
      if (l == 0) {
        pm.set_begin_step(true);
        pm.set_rows(m.rows);
        pb::StepEntry* e = pm.add_entries();
        e->set_sequence(0);
        e->set_ctx_len(m.ctx_len[step]);
        e->set_q_pos(m.q_pos[step]);
      }
      pb::PredictMasksResponse pmr;
      ASSERT_TRUE(CALL(d, PredictMasks, pm, &pmr).ok());
      ASSERT_EQ(pmr.masks_size(), 1);
      const auto& mask = pmr.masks(0);
      ASSERT_TRUE(std::getline(dump, line));
      const nlohmann::json j = nlohmann::json::parse(line);
      const std::vector<int> want = j["blocks"].get<std::vector<int>>();
      ASSERT_EQ(std::vector<int>(mask.blocks().begin(), mask.blocks().end()), want)
          << "step " << step << " layer " << l;
      pb::ObserveScoresRequest ob;
      *ob.mutable_session() = Ref(a);
      ob.set_layer(l);
      for (int r = 0; r < m.rows; ++r) {
        pb::RowScores* rs = ob.add_scores();
        const float* z = t->scores(step, l, r);
        for (int k = 0; k < mask.blocks_size(); ++k) {
          for (int c = 0; c < m.block_size; ++c) {
            const int i = mask.blocks(k) * m.block_size + c;
            rs->add_logits(i < m.ctx_len[step] + r ? z[i] : -INFINITY);
          }
        }
      }
      if (!m.accepted.empty()) ob.add_accepted(m.accepted[step]);
      pb::ObserveScoresResponse obr;
      ASSERT_TRUE(CALL(d, ObserveScores, ob, &obr).ok());
    }
  }
  // Every line of the offline dump was compared, and the daemon counted every step.
  EXPECT_FALSE(std::getline(dump, line)) << "offline replay dumped more: " << line;
  pb::GetStatsRequest gs;
  *gs.mutable_session() = Ref(a);
  pb::GetStatsResponse stats;
  ASSERT_TRUE(CALL(d, GetStats, gs, &stats).ok());
  ASSERT_EQ(stats.layers_size(), m.layers);
  for (const pb::LayerStats& l : stats.layers()) {
    EXPECT_EQ(l.steps(), static_cast<uint64_t>(m.steps)) << "layer " << l.layer();
    EXPECT_GT(l.observed(), 0u) << "layer " << l.layer();
    EXPECT_GT(l.probe_steps(), 0u) << "layer " << l.layer();
  }
}

// An engine attached through libspin_client runs the data plane in its own process on the
// daemon's arena: its replay equals offline replay, and the daemon sees the same statistics.
TEST(Spind, LocalDataPlaneOnTheSharedArenaEqualsOfflineReplay) {
  GenTraceOptions g;
  g.layers = 3;
  g.slots = 64 * 48;
  g.steps = 40;
  g.topk = 256;
  g.seed = 6;
  const std::string dir = ::testing::TempDir() + "/spind_local_trace";
  ASSERT_TRUE(GenerateTrace(dir, g).ok());
  absl::StatusOr<Trace> t = LoadTrace(dir);
  ASSERT_TRUE(t.ok());
  ReplayOptions o;
  o.policy.target_sparsity = 0.4;
  o.policy.exploration = 0.1;
  o.policy.probe_period = 9;
  o.seed = 11;
  o.dump_path = ::testing::TempDir() + "/spind_local_offline.jsonl";
  absl::StatusOr<ReplaySummary> offline = Replay(*t, o);
  ASSERT_TRUE(offline.ok());

  Daemon d;
  ASSERT_TRUE(d.ready());
  client::AttachOptions ao;
  ao.geometry = TraceGeometry(t->meta(), t->n_max(), StateDtype::kFp32);
  ao.policy = o.policy;
  ao.seed = o.seed;
  ao.client_name = "replay";
  auto session = client::Session::Attach("unix://" + d.socket(), ao);
  ASSERT_TRUE(session.ok()) << session.status();
  ReplayOptions local = o;
  local.dump_path = ::testing::TempDir() + "/spind_local_shared.jsonl";
  absl::StatusOr<ReplaySummary> shared = ReplayOn((*session)->data_plane(), *t, local);
  ASSERT_TRUE(shared.ok()) << shared.status();
  auto slurp = [](const std::string& path) {
    std::ifstream f(path);
    return std::string(std::istreambuf_iterator<char>(f), {});
  };
  const std::string want = slurp(o.dump_path);
  ASSERT_FALSE(want.empty());
  EXPECT_EQ(slurp(local.dump_path), want);
  EXPECT_EQ(shared->realized_sparsity, offline->realized_sparsity);
  // The daemon reads the statistics the client's data plane wrote into the shared arena.
  pb::GetStatsRequest gs;
  gs.mutable_session()->set_session_id((*session)->id());
  gs.mutable_session()->set_token((*session)->token());
  pb::GetStatsResponse st;
  ASSERT_TRUE(CALL(d, GetStats, gs, &st).ok());
  ASSERT_EQ(st.layers_size(), 3);
  EXPECT_EQ(st.layers(0).steps(), 40u);
  EXPECT_NEAR(st.layers(2).realized_sparsity(), offline->per_layer[2].sparsity, 1e-12);
  // A policy change over RPC is what the client's next step reads.
  pb::SetPolicyRequest sp;
  *sp.mutable_session() = gs.session();
  sp.set_target_sparsity(0.6);
  pb::SetPolicyResponse spr;
  ASSERT_TRUE(CALL(d, SetPolicy, sp, &spr).ok());
  EXPECT_DOUBLE_EQ((*session)->arena().sparsity[1], 0.6);
  EXPECT_TRUE((*session)->Detach().ok());
}

// A remote-mode session (no arena fetched) of 2 layers, 2 sequences and 4096 slots.
client::AttachOptions RemoteOptions() {
  client::AttachOptions o;
  o.geometry.layers = 2;
  o.geometry.max_seqs = 2;
  o.geometry.max_slots = 4096;
  o.geometry.topk = 128;
  o.client_name = "remote";
  o.fetch_arena = false;
  return o;
}

// The remote data plane's Observe and RemapAndObserve check every argument on its mirror before
// anything runs (the top-K buffer untouched, nothing sent; a stride below a compacted row would
// have read past the caller's buffer), then RemapAndObserve remaps locally and sends the logits.
TEST(Spind, RemoteObserveAndRemapAndObserveCheckFirstThenObserve) {
  Daemon d;
  ASSERT_TRUE(d.ready());
  const client::AttachOptions o = RemoteOptions();
  auto s = client::Session::Attach("unix://" + d.socket(), o);
  ASSERT_TRUE(s.ok()) << s.status();
  auto r = client::RemoteDataPlane::Create(&(*s)->stub(), (*s)->id(), (*s)->token(), o.geometry);
  ASSERT_TRUE(r.ok()) << r.status();
  DataPlane& dp = **r;
  ASSERT_TRUE(dp.ResetSequence(0, 1).ok());
  const int32_t seq = 0, ctx = 1000, q = 999;
  // The step's block table is checked as on every backend (a stride below the session's 64
  // blocks is refused); spind fills no physical table in remote mode.
  std::vector<int32_t> table(64, 0);
  StepBatch narrow{&seq, &ctx, &q, 1, 1};
  narrow.block_table = table.data();
  narrow.table_stride = 63;
  EXPECT_EQ(dp.BeginStep(narrow).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(dp.BeginStep(StepBatch{&seq, &ctx, &q, 1, 1}).ok());
  ASSERT_TRUE(dp.Select(0).ok());
  const int32_t clen = dp.outputs().compact_len[0];
  ASSERT_EQ(clen, ctx);  // a fresh pair: dense
  std::vector<int32_t> topk(128);
  for (int k = 0; k < 128; ++k) topk[k] = k * 7;
  std::vector<int32_t> idx = topk;
  std::vector<float> logits(clen, 1.0f);
  EXPECT_EQ(dp.RemapAndObserve(2, idx.data(), 128, logits.data(), clen).code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ(dp.RemapAndObserve(1, idx.data(), 128, logits.data(), clen).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(dp.RemapAndObserve(0, idx.data(), -1, logits.data(), clen).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(dp.RemapAndObserve(0, idx.data(), 128, logits.data(), clen - 1).code(),
            absl::StatusCode::kInvalidArgument);
  const int32_t bad_accepted = 2;
  EXPECT_EQ(dp.RemapAndObserve(0, idx.data(), 128, logits.data(), clen, &bad_accepted).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(dp.RemapAndObserve(0, idx.data(), 128, nullptr, clen).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(idx, topk);
  EXPECT_EQ(dp.Observe(2, logits.data(), clen).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(dp.Observe(1, logits.data(), clen).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(dp.Observe(0, logits.data(), clen - 1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(dp.Observe(0, nullptr, clen).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(dp.Observe(0, logits.data(), clen, &bad_accepted).code(),
            absl::StatusCode::kInvalidArgument);
  pb::GetStatsRequest gs;
  gs.mutable_session()->set_session_id((*s)->id());
  gs.mutable_session()->set_token((*s)->token());
  pb::GetStatsResponse st;
  ASSERT_TRUE(CALL(d, GetStats, gs, &st).ok());
  EXPECT_EQ(st.layers(0).observed(), 0u) << "a refused call observed";
  const absl::Status ok = dp.RemapAndObserve(0, idx.data(), 128, logits.data(), clen);
  ASSERT_TRUE(ok.ok()) << ok;
  EXPECT_EQ(idx, topk);  // dense: compacted = logical
  ASSERT_TRUE(CALL(d, GetStats, gs, &st).ok());
  EXPECT_EQ(st.layers(0).observed(), static_cast<uint64_t>(clen));
}

// The remote data plane checks a step's shape before copying it (a negative count or missing
// arrays would have been read), and refuses a selection from spind that does not fit the
// geometry it was made with (it would have written past its mirror) instead of mirroring it.
TEST(Spind, RemoteDataPlaneChecksTheStepAndTheRepliesAgainstItsGeometry) {
  Daemon d;
  ASSERT_TRUE(d.ready());
  const client::AttachOptions o = RemoteOptions();
  auto s = client::Session::Attach("unix://" + d.socket(), o);
  ASSERT_TRUE(s.ok()) << s.status();
  Geometry small = o.geometry;
  small.max_slots = 512;  // 8 blocks, where the session has 64
  auto r = client::RemoteDataPlane::Create(&(*s)->stub(), (*s)->id(), (*s)->token(), small);
  ASSERT_TRUE(r.ok()) << r.status();
  DataPlane& dp = **r;
  ASSERT_TRUE(dp.ResetSequence(0, 1).ok());
  const int32_t seq = 0, ctx = 1000, q = 999;
  EXPECT_EQ(dp.BeginStep(StepBatch{&seq, &ctx, &q, -1, 1}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(dp.BeginStep(StepBatch{&seq, &ctx, &q, 3, 1}).code(),
            absl::StatusCode::kInvalidArgument);  // more than max_seqs
  EXPECT_EQ(dp.BeginStep(StepBatch{nullptr, &ctx, &q, 1, 1}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(dp.BeginStep(StepBatch{&seq, &ctx, &q, 1, 0}).code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(dp.BeginStep(StepBatch{&seq, &ctx, &q, 1, 1}).ok());
  const absl::Status sel = dp.Select(0);  // a fresh pair: 16 dense blocks
  EXPECT_EQ(sel.code(), absl::StatusCode::kFailedPrecondition) << sel;
  EXPECT_NE(sel.message().find("create it with the session's geometry"), std::string::npos) << sel;
  EXPECT_EQ(dp.outputs().union_count[0], 0);  // nothing mirrored
}

// Engines that crash (SIGKILL) lose their sessions after the grace period: no fd or memory
// growth in the daemon over 50 crashes.
TEST(Spind, KilledClientsSessionIsReclaimed) {
  Daemon d({"--client-grace-ms", "50"});
  ASSERT_TRUE(d.ready());
  int fds_after_warmup = 0;
  long rss_after_warmup = 0;
  for (int cycle = 0; cycle < 50; ++cycle) {
    const pid_t child = StartAttachHelper(d, "fetch");
    ASSERT_GT(child, 0) << "helper did not attach";
    ASSERT_EQ(SessionCount(d), 1) << "cycle " << cycle;
    kill(child, SIGKILL);
    waitpid(child, nullptr, 0);
    int left = 1;
    for (int i = 0; i < 100 && left != 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      left = SessionCount(d);
    }
    ASSERT_EQ(left, 0) << "session of a killed client not reclaimed, cycle " << cycle;
    if (cycle == 4) {
      fds_after_warmup = FdCount(d.pid());
      rss_after_warmup = RssPages(d.pid());
    }
  }
  ASSERT_GT(fds_after_warmup, 0);
  ASSERT_GT(rss_after_warmup, 0);
  // A leak would grow by one or more per cycle (45 more cycles); allow two transient sockets.
  EXPECT_LE(FdCount(d.pid()), fds_after_warmup + 2);
  // Arenas are 128 KiB each here: 45 leaked ones would add ~1400 pages.
  EXPECT_LT(RssPages(d.pid()), rss_after_warmup + 256);
}

// Over TCP, mutating calls need the admin token; reads and Unix-socket callers do not.
TEST(Spind, AdminTokenGuardsMutatingCallsOverTcp) {
  const std::string token_file = ::testing::TempDir() + "/spind-admin-token";
  std::ofstream(token_file) << "s3cret\n";
  Daemon d({"--tcp-listen", "127.0.0.1:0", "--admin-token-file", token_file});
  ASSERT_TRUE(d.ready());
  const std::string log = d.log();
  const size_t at = log.find("tcp port ");
  ASSERT_NE(at, std::string::npos) << log;
  const int port = std::atoi(log.c_str() + at + 9);
  auto tcp = pb::Spin::NewStub(
      grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
  pb::AttachResponse a;
  {
    grpc::ClientContext c;
    EXPECT_EQ(tcp->Attach(&c, AttachReq(), &a).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  }
  {
    grpc::ClientContext c;
    c.AddMetadata("authorization", "Bearer wrong");
    EXPECT_EQ(tcp->Attach(&c, AttachReq(), &a).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  }
  {
    grpc::ClientContext c;
    c.AddMetadata("authorization", "Bearer s3cret");
    ASSERT_TRUE(tcp->Attach(&c, AttachReq(), &a).ok());
  }
  // Reads need only the session token; a mutation without the admin token changes nothing.
  pb::GetPolicyRequest gp;
  *gp.mutable_session() = Ref(a);
  pb::GetPolicyResponse pol;
  {
    grpc::ClientContext c;
    ASSERT_TRUE(tcp->GetPolicy(&c, gp, &pol).ok());
  }
  pb::SetPolicyRequest sp;
  *sp.mutable_session() = Ref(a);
  sp.set_target_sparsity(0.2);
  pb::SetPolicyResponse spr;
  {
    grpc::ClientContext c;
    EXPECT_EQ(tcp->SetPolicy(&c, sp, &spr).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  }
  // The Unix socket (mode 0660) is trusted.
  ASSERT_TRUE(CALL(d, SetPolicy, sp, &spr).ok());
  EXPECT_DOUBLE_EQ(spr.policy().target_sparsity(), 0.2);
}

// WatchBudgets: the current table first, then one message per policy change (from another
// client), and the stream ends when the session is detached.
TEST(Spind, WatchBudgetsStreamsChanges) {
  Daemon d;
  ASSERT_TRUE(d.ready());
  pb::AttachResponse a;
  ASSERT_TRUE(CALL(d, Attach, AttachReq(3), &a).ok());
  pb::GetBudgetsRequest w;
  *w.mutable_session() = Ref(a);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  auto reader = d.stub().WatchBudgets(&ctx, w);
  pb::GetBudgetsResponse msg;
  ASSERT_TRUE(reader->Read(&msg));
  ASSERT_EQ(msg.layer_sparsity_size(), 3);
  EXPECT_DOUBLE_EQ(msg.layer_sparsity(0), 0.5);
  const uint64_t epoch = msg.epoch();
  for (double rho : {0.3, 0.6}) {
    pb::SetPolicyRequest sp;
    *sp.mutable_session() = Ref(a);
    sp.set_target_sparsity(rho);
    pb::SetPolicyResponse spr;
    ASSERT_TRUE(CALL(d, SetPolicy, sp, &spr).ok());
    ASSERT_TRUE(reader->Read(&msg));
    EXPECT_DOUBLE_EQ(msg.layer_sparsity(2), rho);
    EXPECT_GT(msg.epoch(), epoch);
  }
  pb::DetachRequest dr;
  *dr.mutable_session() = Ref(a);
  pb::DetachResponse dresp;
  ASSERT_TRUE(CALL(d, Detach, dr, &dresp).ok());
  EXPECT_FALSE(reader->Read(&msg));
  EXPECT_TRUE(reader->Finish().ok());
  // Unknown session: the stream ends at once with NOT_FOUND.
  grpc::ClientContext ctx2;
  auto bad = d.stub().WatchBudgets(&ctx2, w);
  EXPECT_FALSE(bad->Read(&msg));
  EXPECT_EQ(bad->Finish().error_code(), grpc::StatusCode::NOT_FOUND);
}

// The engine never depends on spind being up: dense without it, attached once it is there,
// still selecting on the mapped arena after it died, and reattached after a restart.
TEST(Spind, ClientDegradesToDenseAndReattaches) {
  const std::string sock =
      ::testing::TempDir() + "/spind-resilient-" + std::to_string(getpid()) + ".sock";
  client::AttachOptions o;
  o.geometry.layers = 1;
  o.geometry.max_seqs = 1;
  o.geometry.max_slots = 64 * 64;
  o.geometry.topk = 128;
  o.policy.target_sparsity = 0.5;
  o.client_name = "resilient";
  client::ResilientDataPlane dp("unix://" + sock, o, std::chrono::milliseconds(50));
  ASSERT_TRUE(dp.ResetSequence(0, 42).ok());
  int ctx = 64 * 40;
  std::vector<float> logits(64 * 64);
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = static_cast<float>((i * 37) % 101);
  // One decode step; returns how many of the step's blocks it did not select (0 = dense). The
  // step's block count is taken inside, so no caller evaluates ctx before or after it changes.
  auto step = [&]() {
    const int32_t seq = 0, c = ctx, q = ctx - 1;
    EXPECT_TRUE(dp.BeginStep(StepBatch{&seq, &c, &q, 1, 1}).ok());
    EXPECT_TRUE(dp.Select(0).ok());
    const int skipped = (c + 63) / 64 - dp.arena().union_count[0];
    EXPECT_TRUE(dp.Observe(0, logits.data(), 64 * 64).ok());
    ++ctx;
    return skipped;
  };
  // No daemon: dense.
  for (int i = 0; i < 3; ++i) EXPECT_EQ(step(), 0) << "dense while degraded";
  EXPECT_FALSE(dp.attached());
  {
    Daemon d({}, sock);
    ASSERT_TRUE(d.ready());
    for (int i = 0; i < 200 && !dp.attached(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      step();
    }
    ASSERT_TRUE(dp.attached());
    const std::string first = dp.session_id();
    step();  // the reopened sequence is fresh: dense once
    EXPECT_GT(step(), 0) << "sparse once attached";
    d.Kill();
    // The daemon is gone: the mapped arena keeps working, still sparse.
    for (int i = 0; i < 5; ++i) EXPECT_GT(step(), 0);
    Daemon again({}, sock);
    ASSERT_TRUE(again.ready());
    for (int i = 0; i < 200 && dp.session_id() == first; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      step();
    }
    EXPECT_NE(dp.session_id(), first) << "did not reattach after the restart";
    EXPECT_EQ(SessionCount(again), 1);
    step();
    EXPECT_GT(step(), 0);
  }
}

// Live tuning (issue 5): an engine steps on the mapped arena while an operator's SetPolicy from
// another connection changes the target sparsity and the exploration share; the next step of
// the engine selects with the new values (the kernels read the policy block and budget table
// at each step), the epoch advances, and nothing is re-attached.
// The same through a replay of a generated trace on the daemon's arena: an operator's SetPolicy
// from another client after step 30 shows in the dump from step 31 on (every non-dense step
// keeps exactly KeptBlocks at the target in force).
TEST(Spind, ReplayThroughTheDaemonSwitchesSparsityAtTheNextStep) {
  GenTraceOptions g;
  g.layers = 2;
  g.slots = 64 * 64;
  g.steps = 60;
  g.topk = 256;
  g.seed = 73;
  const std::string dir = ::testing::TempDir() + "/spind_live_trace";
  ASSERT_TRUE(GenerateTrace(dir, g).ok());
  absl::StatusOr<Trace> t = LoadTrace(dir);
  ASSERT_TRUE(t.ok());
  Daemon d;
  ASSERT_TRUE(d.ready());
  client::AttachOptions ao;
  ao.geometry = TraceGeometry(t->meta(), t->n_max(), StateDtype::kFp32);
  ao.policy.target_sparsity = 0.5;
  ao.policy.exploration = 0.05;
  ao.client_name = "engine";
  auto session = client::Session::Attach("unix://" + d.socket(), ao);
  ASSERT_TRUE(session.ok()) << session.status();
  auto op = pb::Spin::NewStub(
      grpc::CreateChannel("unix://" + d.socket(), grpc::InsecureChannelCredentials()));
  ReplayOptions o;
  o.policy = ao.policy;
  o.dump_path = ::testing::TempDir() + "/spind_live_dump.jsonl";
  o.progress = [&](int done, int) {
    if (done != 31) return;
    pb::SetPolicyRequest r;
    r.mutable_session()->set_session_id((*session)->id());
    r.mutable_session()->set_token((*session)->token());
    r.set_target_sparsity(0.8);
    pb::SetPolicyResponse resp;
    grpc::ClientContext ctx;
    EXPECT_TRUE(op->SetPolicy(&ctx, r, &resp).ok());
  };
  ASSERT_TRUE(ReplayOn((*session)->data_plane(), *t, o).ok());
  std::ifstream f(o.dump_path);
  std::string line;
  int checked = 0;
  while (std::getline(f, line)) {
    const nlohmann::json j = nlohmann::json::parse(line);
    const int step = j["step"];
    if (step == 0) continue;  // fresh: dense
    const int B = (t->meta().ctx_len[step] + 63) / 64;
    const double target = step <= 30 ? 0.5 : 0.8;
    EXPECT_EQ(static_cast<int>(j["blocks"].size()), KeptBlocks(B, 256, 64, target))
        << "step " << step << " layer " << j["layer"];
    ++checked;
  }
  EXPECT_EQ(checked, 59 * 2);
}

// An engine on a live session of `d`: 2 layers, one sequence of 128 blocks, sparsity 0.5, no
// exploration or probes; Step() runs one decode step and returns layer 1's kept blocks (layer 0
// keeps as many).
struct LiveEngine {
  static constexpr int32_t kBlocks = 128, kCtx = kBlocks * 64;
  absl::StatusOr<std::unique_ptr<client::Session>> session;
  std::vector<float> logits;

  explicit LiveEngine(Daemon& d) : logits(kCtx) {
    client::AttachOptions o;
    o.geometry.layers = 2;
    o.geometry.max_seqs = 2;
    o.geometry.max_slots = kCtx;
    o.geometry.topk = 128;
    o.policy.target_sparsity = 0.5;
    o.policy.exploration = 0.0;
    o.policy.probe_period = 0;
    o.client_name = "engine";
    session = client::Session::Attach("unix://" + d.socket(), o);
    for (int i = 0; i < kCtx; ++i) logits[i] = static_cast<float>((i * 7919) % 1009);
    if (session.ok() && !(*session)->data_plane().ResetSequence(0, 5).ok()) {
      session = absl::InternalError("ResetSequence failed");
    }
  }
  bool ok() const { return session.ok(); }
  int Step() {
    DataPlane& dp = (*session)->data_plane();
    const int32_t seq = 0, c = kCtx, q = kCtx - 1;
    EXPECT_TRUE(dp.BeginStep(StepBatch{&seq, &c, &q, 1, 1}).ok());
    int kept = 0;
    for (int l = 0; l < 2; ++l) {
      EXPECT_TRUE(dp.Select(l).ok());
      kept = dp.arena().union_count[0];
      EXPECT_TRUE(dp.Observe(l, logits.data(), kCtx).ok());
    }
    return kept;
  }
};

TEST(Spind, LiveSetPolicyTakesEffectAtTheNextStep) {
  Daemon d;
  ASSERT_TRUE(d.ready());
  LiveEngine engine(d);
  ASSERT_TRUE(engine.ok());
  auto& s = engine.session;
  DataPlane& dp = (*s)->data_plane();
  const int32_t nb = LiveEngine::kBlocks;
  auto step = [&] { return engine.Step(); };
  // Another client: the operator's own channel.
  auto op_channel = grpc::CreateChannel("unix://" + d.socket(), grpc::InsecureChannelCredentials());
  auto op = pb::Spin::NewStub(op_channel);
  auto set = [&](double target, double exploration) {
    pb::SetPolicyRequest r;
    r.mutable_session()->set_session_id((*s)->id());
    r.mutable_session()->set_token((*s)->token());
    r.set_target_sparsity(target);
    r.set_exploration(exploration);
    pb::SetPolicyResponse resp;
    grpc::ClientContext ctx;
    EXPECT_TRUE(op->SetPolicy(&ctx, r, &resp).ok());
    return resp.epoch();
  };
  EXPECT_EQ(step(), nb) << "the first step of a fresh sequence is dense";
  const int at50 = KeptBlocks(nb, 128, 64, 0.5), at75 = KeptBlocks(nb, 128, 64, 0.75),
            at20 = KeptBlocks(nb, 128, 64, 0.2);
  for (int t = 0; t < 5; ++t) EXPECT_EQ(step(), at50);
  const uint64_t epoch0 = dp.arena().policy->epoch;
  EXPECT_GT(set(0.75, 0.0), epoch0);
  EXPECT_EQ(dp.arena().policy->epoch, epoch0 + 1) << "the engine's mapping sees the new epoch";
  EXPECT_EQ(step(), at75) << "the very next step uses the new target";
  EXPECT_EQ(step(), at75);
  set(0.2, 0.2);
  EXPECT_EQ(step(), at20);
  // Exploration changed too: the kept set now includes random (non-top) blocks, so a second
  // run of the same step with exploration 0 keeps a different set of the same size.
  std::vector<int32_t> explored(dp.arena().union_ids, dp.arena().union_ids + at20);
  set(0.2, 0.0);
  EXPECT_EQ(step(), at20);
  std::vector<int32_t> greedy(dp.arena().union_ids, dp.arena().union_ids + at20);
  EXPECT_NE(explored, greedy);
  EXPECT_EQ(SessionCount(d), 1) << "no re-attach";
}

// Operators change a live session without its token: by id over the Unix socket or with the
// admin token over TCP, one session or the node's default for all; the next step uses it, and
// every change is logged with who made it and counted.
TEST(Spind, OperatorChangesLiveSessionsWithoutTheirTokens) {
  const std::string token_file = ::testing::TempDir() + "/spind-operator-token";
  std::ofstream(token_file) << "0p3rat0r\n";
  // --operators socket: by id over the Unix socket without a token, as a single-tenant node
  // runs (Hostile.OperatorCallsOnTheUnixSocketNeedTheAdminToken has the token rule).
  Daemon d({"--tcp-listen", "127.0.0.1:0", "--admin-token-file", token_file, "--metrics-address",
            "127.0.0.1:0", "--operators", "socket"});
  ASSERT_TRUE(d.ready());
  LiveEngine engine(d);
  ASSERT_TRUE(engine.ok());
  auto& s = engine.session;
  const int32_t nb = LiveEngine::kBlocks;
  auto step = [&] { return engine.Step(); };
  const int at50 = KeptBlocks(nb, 128, 64, 0.5), at75 = KeptBlocks(nb, 128, 64, 0.75),
            at20 = KeptBlocks(nb, 128, 64, 0.2), at60 = KeptBlocks(nb, 128, 64, 0.6);
  step();
  EXPECT_EQ(step(), at50);

  // By id over the Unix socket, no token: the next step uses it.
  pb::SetPolicyRequest sp;
  sp.mutable_session()->set_session_id((*s)->id());
  sp.set_target_sparsity(0.75);
  pb::SetPolicyResponse spr;
  ASSERT_TRUE(CALL(d, SetPolicy, sp, &spr).ok());
  EXPECT_EQ(step(), at75);
  pb::GetPolicyRequest gp;
  gp.mutable_session()->set_session_id((*s)->id());
  pb::GetPolicyResponse gpr;
  ASSERT_TRUE(CALL(d, GetPolicy, gp, &gpr).ok());
  EXPECT_DOUBLE_EQ(gpr.policy().target_sparsity(), 0.75);
  pb::GetPolicyRequest unknown;
  unknown.mutable_session()->set_session_id("s-0123456789abcdef");
  EXPECT_EQ(CALL(d, GetPolicy, unknown, &gpr).error_code(), grpc::StatusCode::NOT_FOUND);

  // Over TCP: without the admin token an operator may neither read nor write; with it, both.
  const std::string log0 = d.log();
  const int port = std::atoi(log0.c_str() + log0.find("tcp port ") + 9);
  auto tcp = pb::Spin::NewStub(
      grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
  {
    grpc::ClientContext c;
    EXPECT_EQ(tcp->GetPolicy(&c, gp, &gpr).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  }
  sp.set_target_sparsity(0.2);
  {
    grpc::ClientContext c;
    EXPECT_EQ(tcp->SetPolicy(&c, sp, &spr).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  }
  EXPECT_EQ(step(), at75) << "a refused change changes nothing";
  {
    grpc::ClientContext c;
    c.AddMetadata("authorization", "Bearer 0p3rat0r");
    ASSERT_TRUE(tcp->SetPolicy(&c, sp, &spr).ok());
  }
  EXPECT_EQ(step(), at20);

  // The node's default for every live session (and new ones); a bad default changes nothing.
  pb::SetDefaultPolicyRequest dr;
  dr.mutable_defaults()->set_target_sparsity(1.5);
  dr.set_apply_to_live(true);
  pb::SetDefaultPolicyResponse drr;
  EXPECT_EQ(CALL(d, SetDefaultPolicy, dr, &drr).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(step(), at20);
  dr.mutable_defaults()->set_target_sparsity(0.6);
  ASSERT_TRUE(CALL(d, SetDefaultPolicy, dr, &drr).ok());
  ASSERT_EQ(drr.changed_sessions_size(), 1);
  EXPECT_EQ(drr.changed_sessions(0), (*s)->id());
  EXPECT_EQ(step(), at60);
  pb::AttachResponse second;
  ASSERT_TRUE(CALL(d, Attach, AttachReq(), &second).ok());  // asks for 0.5
  pb::GetPolicyRequest gp2;
  *gp2.mutable_session() = Ref(second);
  ASSERT_TRUE(CALL(d, GetPolicy, gp2, &gpr).ok());
  EXPECT_DOUBLE_EQ(gpr.policy().target_sparsity(), 0.6) << "new sessions get the default";
  EXPECT_DOUBLE_EQ(gpr.policy().exploration(), 0.05) << "fields the default leaves alone stay";
  // Reading the defaults changes nothing; clearing them lets new sessions keep their own.
  pb::SetDefaultPolicyRequest read;
  ASSERT_TRUE(CALL(d, SetDefaultPolicy, read, &drr).ok());
  EXPECT_DOUBLE_EQ(drr.defaults().target_sparsity(), 0.6);
  EXPECT_EQ(drr.changed_sessions_size(), 0);
  read.set_clear(true);
  ASSERT_TRUE(CALL(d, SetDefaultPolicy, read, &drr).ok());
  EXPECT_FALSE(drr.defaults().has_target_sparsity());
  {
    grpc::ClientContext c;
    EXPECT_EQ(tcp->SetDefaultPolicy(&c, read, &drr).error_code(),
              grpc::StatusCode::PERMISSION_DENIED);
  }

  // Logged with who made each change, and counted by source.
  const std::string log = d.log();
  EXPECT_NE(log.find("by an operator on the Unix socket"), std::string::npos) << log;
  EXPECT_NE(log.find("by an operator with the admin token from"), std::string::npos) << log;
  EXPECT_NE(log.find("(default policy, all sessions)"), std::string::npos) << log;
  const std::string m = ScrapeMetrics(d);
  EXPECT_NE(m.find("spin_policy_changes_total{source=\"operator\"} 2"), std::string::npos)
      << m.substr(0, 2000);
  EXPECT_NE(m.find("spin_policy_changes_total{source=\"default\"} 1"), std::string::npos);
}

// The engine library's own control calls (Session::GetPolicy/SetPolicy/GetBudgets/GetStats):
// typed values both ways, a refused change changes nothing, statistics count the steps run.
TEST(Spind, SessionControlCallsRoundTrip) {
  Daemon d;
  ASSERT_TRUE(d.ready());
  client::AttachOptions o;
  o.geometry.layers = 3;
  o.geometry.max_seqs = 2;
  o.geometry.max_slots = 64 * 32;
  o.geometry.topk = 64;
  o.policy.target_sparsity = 0.4;
  o.policy.exploration = 0.0;
  o.policy.alpha = 0.25f;
  auto s = client::Session::Attach("unix://" + d.socket(), o);
  ASSERT_TRUE(s.ok()) << s.status();
  absl::StatusOr<Policy> p = (*s)->GetPolicy();
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->target_sparsity, 0.4);
  EXPECT_EQ(p->alpha, 0.25f);
  EXPECT_EQ(p->budget_mode, BudgetMode::kUniform);

  client::PolicyChange change;
  change.target_sparsity = 0.7;
  change.alpha = 0.0f;  // zero is a value, not "unset"
  change.probe_period = 4;
  absl::StatusOr<Policy> now = (*s)->SetPolicy(change);
  ASSERT_TRUE(now.ok()) << now.status();
  EXPECT_EQ(now->target_sparsity, 0.7);
  EXPECT_EQ(now->alpha, 0.0f);
  EXPECT_EQ(now->probe_period, 4u);
  EXPECT_EQ(now->exploration, 0.0) << "unset fields stay";

  client::PolicyChange bad;
  bad.exploration = 1.5;
  absl::StatusOr<Policy> refused = (*s)->SetPolicy(bad);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  p = (*s)->GetPolicy();
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->exploration, 0.0) << "a refused change changes nothing";
  EXPECT_EQ(p->target_sparsity, 0.7);

  absl::StatusOr<client::Budgets> b = (*s)->GetBudgets();
  ASSERT_TRUE(b.ok()) << b.status();
  ASSERT_EQ(b->layer_sparsity.size(), 3u);
  for (double x : b->layer_sparsity) EXPECT_EQ(x, 0.7);
  EXPECT_EQ(b->mode, BudgetMode::kUniform);
  EXPECT_GT(b->epoch, 0u);

  DataPlane& dp = (*s)->data_plane();
  ASSERT_TRUE(dp.ResetSequence(0, 1).ok());
  const int32_t ctx = 64 * 32;
  std::vector<float> logits(ctx, 1.0f);
  std::vector<uint64_t> observed(3, 0);  // slots each layer scored: its kept blocks x 64
  for (int t = 0; t < 2; ++t) {
    const int32_t seq = 0, c = ctx, q = ctx - 1;
    ASSERT_TRUE(dp.BeginStep(StepBatch{&seq, &c, &q, 1, 1}).ok());
    for (int l = 0; l < 3; ++l) {
      ASSERT_TRUE(dp.Select(l).ok());
      observed[l] += uint64_t{64} * dp.arena().union_count[0];
      ASSERT_TRUE(dp.Observe(l, logits.data(), ctx).ok());
    }
  }
  absl::StatusOr<std::vector<LayerStats>> st = (*s)->GetStats();
  ASSERT_TRUE(st.ok()) << st.status();
  ASSERT_EQ(st->size(), 3u);
  for (size_t l = 0; l < st->size(); ++l) {
    EXPECT_EQ((*st)[l].steps, 2u);
    EXPECT_EQ((*st)[l].dense_steps, 1u) << "the fresh sequence's first step";
    EXPECT_EQ((*st)[l].observed, observed[l]);
    EXPECT_LT(observed[l], 2u * ctx) << "the second step was sparse";
  }

  ASSERT_TRUE((*s)->Detach().ok());
  EXPECT_EQ((*s)->GetPolicy().status().code(), absl::StatusCode::kNotFound);
}

// Per-layer budgets live (issue 5): the probe thread reads the miss curves the engine's probe
// steps accumulate in the shared arena, recomputes the table, writes it with a new epoch and
// publishes it on WatchBudgets; a SetPolicy target change re-sizes it at once; switching to
// uniform writes the uniform table back.
// Replay through the daemon in remote mode reports the daemon's budget table, recomputes and
// epoch: the client's arena there is a mirror of outputs and counters that never sees the
// tables spind's probe thread writes (it used to report the uniform start).
TEST(Spind, RemoteReplayReportsTheDaemonsBudgets) {
  GenTraceOptions g;
  g.layers = 4;
  g.slots = 64 * 96;
  g.steps = 80;
  g.topk = 256;
  g.seed = 72;
  const std::string dir = ::testing::TempDir() + "/spind_remote_budget_trace";
  ASSERT_TRUE(GenerateTrace(dir, g).ok());
  absl::StatusOr<Trace> t = LoadTrace(dir);
  ASSERT_TRUE(t.ok());
  Daemon d({"--probe-interval-ms", "5"});
  ASSERT_TRUE(d.ready());
  ReplayOptions o;
  o.policy.target_sparsity = 0.5;
  o.policy.probe_period = 4;
  o.policy.budget_mode = BudgetMode::kPerLayer;
  o.local_budgets = false;  // spind owns the table
  // Time for the probe thread between steps, as a real decode loop gives it.
  o.progress = [](int, int) { std::this_thread::sleep_for(std::chrono::milliseconds(3)); };
  std::string where;
  absl::StatusOr<ReplaySummary> r =
      ReplayThroughDaemon("unix://" + d.socket(), *t, o, /*remote=*/true, "", &where);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_NE(where.find("remote mode"), std::string::npos) << where;
  ASSERT_GE(r->budget_recomputes, 1u) << "the probe thread wrote no table in 80 steps";
  EXPECT_GE(r->epoch_advance, r->budget_recomputes);
  ASSERT_EQ(r->per_layer.size(), 4u);
  double lo = 1, hi = 0, mean = 0;
  for (const LayerSummary& l : r->per_layer) {
    lo = std::min(lo, l.budget);
    hi = std::max(hi, l.budget);
    mean += l.budget / 4;
  }
  EXPECT_LT(lo, hi) << "per-layer budgets, not the mirror's uniform 0.5";
  EXPECT_NEAR(mean, 0.5, 0.05);
}

// Warm budgets: a per-layer session of a model spind has seen starts from that model's last
// per-layer table, also after a restart; another model, a uniform session, a bad or mismatched
// file start uniform (the bad file logged); a model name that is no file name is refused.
// A generated 4-layer, 60-step trace (`name`, `seed`) and an empty state directory for the warm
// budget tests.
struct WarmFixture {
  absl::StatusOr<Trace> trace;
  std::string state;
};
WarmFixture MakeWarmFixture(const std::string& name, uint64_t seed) {
  GenTraceOptions g;
  g.layers = 4;
  g.slots = 64 * 96;
  g.steps = 60;
  g.topk = 256;
  g.seed = seed;
  const std::string dir = ::testing::TempDir() + "/spind_" + name + "_trace";
  WarmFixture f;
  absl::Status made = GenerateTrace(dir, g);
  f.trace = made.ok() ? LoadTrace(dir) : absl::StatusOr<Trace>(made);
  f.state = ::testing::TempDir() + "/spind-state-" + name + "-" + std::to_string(getpid());
  std::filesystem::remove_all(f.state);
  return f;
}

TEST(Spind, WarmBudgetsSurviveARestart) {
  WarmFixture f = MakeWarmFixture("warm", 73);
  ASSERT_TRUE(f.trace.ok()) << f.trace.status();
  const absl::StatusOr<Trace>& t = f.trace;
  const std::string& state = f.state;
  client::AttachOptions ao;
  ao.geometry = TraceGeometry(t->meta(), t->n_max(), StateDtype::kFp32);
  ao.policy.target_sparsity = 0.5;
  ao.policy.probe_period = 4;
  ao.policy.budget_mode = BudgetMode::kPerLayer;
  ao.model = "deepseek-v3.2";
  std::vector<double> learned;
  {
    Daemon d({"--probe-interval-ms", "5", "--state-dir", state});
    ASSERT_TRUE(d.ready());
    auto s = client::Session::Attach("unix://" + d.socket(), ao);
    ASSERT_TRUE(s.ok()) << s.status();
    absl::StatusOr<client::Budgets> b = (*s)->GetBudgets();
    ASSERT_TRUE(b.ok());
    EXPECT_EQ(b->recomputes, 0u) << "no curves for this model yet: uniform";
    ReplayOptions o;
    o.policy = ao.policy;
    o.local_budgets = false;
    o.progress = [](int, int) { std::this_thread::sleep_for(std::chrono::milliseconds(2)); };
    ASSERT_TRUE(ReplayOn((*s)->data_plane(), *t, o).ok());
    std::this_thread::sleep_for(std::chrono::milliseconds(100));  // the last probe pass
    b = (*s)->GetBudgets();
    ASSERT_TRUE(b.ok());
    ASSERT_GE(b->recomputes, 1u);
    learned = b->layer_sparsity;
    EXPECT_LT(*std::min_element(learned.begin(), learned.end()),
              *std::max_element(learned.begin(), learned.end()))
        << "layers of different difficulty";
    ASSERT_TRUE(std::filesystem::exists(state + "/deepseek-v3.2.budgets.json"));
    ASSERT_TRUE((*s)->Detach().ok());
  }  // spind stops
  std::ofstream(state + "/broken.budgets.json") << "{not json";
  Daemon d({"--probe-interval-ms", "5", "--state-dir", state});
  ASSERT_TRUE(d.ready());
  auto warm = client::Session::Attach("unix://" + d.socket(), ao);
  ASSERT_TRUE(warm.ok()) << warm.status();
  absl::StatusOr<client::Budgets> b = (*warm)->GetBudgets();
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->layer_sparsity, learned) << "the restarted spind starts the model warm";
  EXPECT_EQ(b->reason.rfind("warm (model deepseek-v3.2", 0), 0u) << b->reason;
  for (int l = 0; l < 4; ++l) EXPECT_EQ((*warm)->arena().sparsity[l], learned[l]);
  auto starts_uniform = [&](client::AttachOptions x, const char* what) {
    auto c = client::Session::Attach("unix://" + d.socket(), x);
    ASSERT_TRUE(c.ok()) << c.status();
    absl::StatusOr<client::Budgets> cb = (*c)->GetBudgets();
    ASSERT_TRUE(cb.ok());
    EXPECT_EQ(cb->recomputes, 0u) << what;
    for (double v : cb->layer_sparsity) EXPECT_EQ(v, x.policy.target_sparsity) << what;
  };
  client::AttachOptions other = ao;
  other.model = "another-model";
  starts_uniform(other, "another model");
  client::AttachOptions uniform = ao;
  uniform.policy.budget_mode = BudgetMode::kUniform;
  starts_uniform(uniform, "a uniform session");
  client::AttachOptions fewer = ao;
  fewer.geometry.layers = 3;
  starts_uniform(fewer, "another geometry");
  client::AttachOptions broken = ao;
  broken.model = "broken";
  starts_uniform(broken, "a broken file");
  const std::string log = d.log();
  EXPECT_NE(log.find("warm budgets of model broken"), std::string::npos) << log;
  EXPECT_NE(log.find("warm budgets of model deepseek-v3.2 (" + state +
                     "/deepseek-v3.2.budgets.json) ignored: saved for 4 layers"),
            std::string::npos)
      << log;
  client::AttachOptions bad = ao;
  bad.model = "../etc/passwd";
  auto refused = client::Session::Attach("unix://" + d.socket(), bad);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  std::filesystem::remove_all(state);
}

TEST(Spind, ProbeThreadPublishesPerLayerBudgets) {
  GenTraceOptions g;
  g.layers = 4;
  g.slots = 64 * 96;
  g.steps = 80;
  g.topk = 256;
  g.seed = 71;
  const std::string dir = ::testing::TempDir() + "/spind_budget_trace";
  ASSERT_TRUE(GenerateTrace(dir, g).ok());
  absl::StatusOr<Trace> t = LoadTrace(dir);
  ASSERT_TRUE(t.ok());
  Daemon d({"--probe-interval-ms", "10"});
  ASSERT_TRUE(d.ready());
  client::AttachOptions ao;
  ao.geometry = TraceGeometry(t->meta(), t->n_max(), StateDtype::kFp32);
  ao.policy.target_sparsity = 0.5;
  ao.policy.probe_period = 4;
  ao.policy.budget_mode = BudgetMode::kPerLayer;
  ao.client_name = "per-layer";
  auto session = client::Session::Attach("unix://" + d.socket(), ao);
  ASSERT_TRUE(session.ok()) << session.status();
  pb::GetBudgetsRequest w;
  w.mutable_session()->set_session_id((*session)->id());
  w.mutable_session()->set_token((*session)->token());
  grpc::ClientContext wctx;
  auto reader = d.stub().WatchBudgets(&wctx, w);
  pb::GetBudgetsResponse first;
  ASSERT_TRUE(reader->Read(&first));
  EXPECT_EQ(first.recomputes(), 0u);
  ASSERT_EQ(first.layer_sparsity_size(), 4);
  for (double x : first.layer_sparsity()) EXPECT_EQ(x, 0.5) << "uniform until probes arrive";

  ReplayOptions o;
  o.policy = ao.policy;
  o.local_budgets = false;  // spind owns the table
  // Give the probe thread time to run between steps, as a real decode loop would.
  o.progress = [](int, int) { std::this_thread::sleep_for(std::chrono::milliseconds(2)); };
  ASSERT_TRUE(ReplayOn((*session)->data_plane(), *t, o).ok());
  // The probe thread published every table it wrote; the stream ends on the latest one, which
  // is the table in the arena. The first was sized from the first probe data.
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  pb::GetBudgetsResponse latest;
  ASSERT_TRUE(CALL(d, GetBudgets, w, &latest).ok());
  ASSERT_GE(latest.recomputes(), 1u);
  EXPECT_GT(latest.epoch(), first.epoch());
  pb::GetBudgetsResponse update;
  ASSERT_TRUE(reader->Read(&update));
  // A slow reader sees the newest table, not a backlog: the first one after the initial table
  // is the first recompute unless later ones replaced it before it was written (a loaded CI).
  ASSERT_GE(update.recomputes(), 1u);
  if (update.recomputes() == 1u) {
    EXPECT_EQ(update.reason(), "first");
  }
  while (update.epoch() < latest.epoch()) ASSERT_TRUE(reader->Read(&update));
  EXPECT_EQ(update.recomputes(), latest.recomputes());
  ASSERT_EQ(update.layer_sparsity_size(), 4);
  double lo = 1, hi = 0;
  for (double x : update.layer_sparsity()) {
    lo = std::min(lo, x);
    hi = std::max(hi, x);
  }
  EXPECT_LT(lo, hi) << "layers of different difficulty get different budgets";
  // The engine's mapping holds the same table the stream carried.
  for (int l = 0; l < 4; ++l) {
    EXPECT_EQ((*session)->arena().sparsity[l], update.layer_sparsity(l));
  }

  // A new target re-sizes the table at once (reason "target"), still per layer.
  pb::SetPolicyRequest sp;
  *sp.mutable_session() = w.session();
  sp.set_target_sparsity(0.7);
  pb::SetPolicyResponse spr;
  ASSERT_TRUE(CALL(d, SetPolicy, sp, &spr).ok());
  pb::GetBudgetsResponse now;
  ASSERT_TRUE(CALL(d, GetBudgets, w, &now).ok());
  EXPECT_EQ(now.reason(), "target");
  double mean = 0;
  for (double x : now.layer_sparsity()) mean += x / 4;
  EXPECT_NEAR(mean, 0.7, 0.05);
  for (int l = 0; l < 4; ++l) {
    EXPECT_EQ((*session)->arena().sparsity[l], now.layer_sparsity(l)) << "at the next step";
  }

  // A miss target instead of a sparsity, live: each layer from its own curve at once (reason
  // "target"); a looser target skips more; a miss target of 1.5 is refused and changes nothing.
  auto miss_target = [&](double m) {
    pb::SetPolicyRequest mt;
    *mt.mutable_session() = w.session();
    mt.set_budget_mode(pb::BUDGET_MODE_MISS_TARGET);
    mt.set_miss_target(m);
    pb::SetPolicyResponse r;
    grpc::Status st = CALL(d, SetPolicy, mt, &r);
    pb::GetBudgetsResponse got;
    EXPECT_TRUE(CALL(d, GetBudgets, w, &got).ok());
    return std::make_pair(st, got);
  };
  auto [st_tight, tight] = miss_target(0.01);
  ASSERT_TRUE(st_tight.ok()) << st_tight.error_message();
  EXPECT_EQ(tight.reason(), "target");
  EXPECT_EQ(tight.policy().budget_mode(), pb::BUDGET_MODE_MISS_TARGET);
  auto [st_loose, loose] = miss_target(0.2);
  ASSERT_TRUE(st_loose.ok());
  double tight_mean = 0, loose_mean = 0;
  for (int l = 0; l < 4; ++l) {
    tight_mean += tight.layer_sparsity(l) / 4;
    loose_mean += loose.layer_sparsity(l) / 4;
    EXPECT_EQ((*session)->arena().sparsity[l], loose.layer_sparsity(l));
  }
  EXPECT_LT(tight_mean, loose_mean);
  auto [st_bad, after_bad] = miss_target(1.5);
  EXPECT_EQ(st_bad.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  for (int l = 0; l < 4; ++l) EXPECT_EQ(after_bad.layer_sparsity(l), loose.layer_sparsity(l));

  // Back to uniform: every layer at the target.
  pb::SetPolicyRequest un;
  *un.mutable_session() = w.session();
  un.set_budget_mode(pb::BUDGET_MODE_UNIFORM);
  ASSERT_TRUE(CALL(d, SetPolicy, un, &spr).ok());
  ASSERT_TRUE(CALL(d, GetBudgets, w, &now).ok());
  ASSERT_EQ(now.layer_sparsity_size(), 4);
  for (double x : now.layer_sparsity()) EXPECT_EQ(x, 0.7);
  wctx.TryCancel();
}

// A per-layer session whose probes have not arrived yet still takes a new target at once.
TEST(Spind, PerLayerSessionWithoutProbesTakesANewTargetUniformly) {
  Daemon d;
  ASSERT_TRUE(d.ready());
  pb::AttachRequest req = AttachReq(3);
  req.mutable_policy()->set_budget_mode(pb::BUDGET_MODE_PER_LAYER);
  req.mutable_policy()->set_probe_period(8);
  pb::AttachResponse a;
  ASSERT_TRUE(CALL(d, Attach, req, &a).ok());
  pb::SetPolicyRequest sp;
  *sp.mutable_session() = Ref(a);
  sp.set_target_sparsity(0.3);
  pb::SetPolicyResponse spr;
  ASSERT_TRUE(CALL(d, SetPolicy, sp, &spr).ok());
  pb::GetBudgetsRequest gb;
  *gb.mutable_session() = Ref(a);
  pb::GetBudgetsResponse b;
  ASSERT_TRUE(CALL(d, GetBudgets, gb, &b).ok());
  ASSERT_EQ(b.layer_sparsity_size(), 3);
  for (double x : b.layer_sparsity()) EXPECT_EQ(x, 0.3);
  EXPECT_EQ(b.budget_mode(), pb::BUDGET_MODE_PER_LAYER);
}

// A miss-target session is dense from its first step, before any pass of the probe thread (here
// none comes for an hour): before 2026-12-07 it selected at the uniform target (0.5) until the
// thread's first pass, and missed far more than its target in those steps.
TEST(Spind, MissTargetSessionStartsDenseBeforeTheProbeThreadsFirstPass) {
  Daemon d({"--probe-interval-ms", "3600000", "--miss-target-interval-ms", "3600000"});
  ASSERT_TRUE(d.ready());
  for (bool miss_target : {true, false}) {
    pb::AttachRequest req = AttachReq(3);
    req.mutable_policy()->set_budget_mode(miss_target ? pb::BUDGET_MODE_MISS_TARGET
                                                      : pb::BUDGET_MODE_PER_LAYER);
    if (miss_target) req.mutable_policy()->set_miss_target(0.02);
    req.mutable_policy()->set_probe_period(8);
    pb::AttachResponse a;
    ASSERT_TRUE(CALL(d, Attach, req, &a).ok());
    pb::GetBudgetsRequest gb;
    *gb.mutable_session() = Ref(a);
    pb::GetBudgetsResponse b;
    ASSERT_TRUE(CALL(d, GetBudgets, gb, &b).ok());
    ASSERT_EQ(b.layer_sparsity_size(), 3);
    for (double x : b.layer_sparsity()) EXPECT_EQ(x, miss_target ? 0.0 : 0.5);
  }
}

// A miss-target session's level recomputes (about one a step) save the model's warm curves at
// most once per 10 s; the newest curves are saved when the session ends, by Detach or by spind
// stopping, so the model's next session starts from them rather than from the first seconds'.
TEST(Spind, MissTargetWarmCurvesAreSavedWhenTheSessionEnds) {
  WarmFixture f = MakeWarmFixture("warm-mt", 74);
  ASSERT_TRUE(f.trace.ok()) << f.trace.status();
  const absl::StatusOr<Trace>& t = f.trace;
  const std::string& state = f.state;
  client::AttachOptions ao;
  ao.geometry = TraceGeometry(t->meta(), t->n_max(), StateDtype::kFp32);
  ao.policy.probe_period = 4;
  ao.policy.budget_mode = BudgetMode::kMissTarget;
  ao.policy.miss_target = 0.02;
  auto curves = [&](const std::string& model) {
    std::ifstream f(state + "/" + model + ".budgets.json");
    if (!f) return nlohmann::json();
    return nlohmann::json::parse(f, nullptr, false).value("curves", nlohmann::json());
  };
  const auto start = std::chrono::steady_clock::now();
  Daemon d({"--state-dir", state});
  ASSERT_TRUE(d.ready());
  // One session ends by Detach, the other by spind's SIGTERM.
  std::vector<nlohmann::json> during;
  std::vector<std::unique_ptr<client::Session>> sessions;
  for (const char* model : {"mt-detach", "mt-stop"}) {
    ao.model = model;
    auto s = client::Session::Attach("unix://" + d.socket(), ao);
    ASSERT_TRUE(s.ok()) << s.status();
    ReplayOptions o;
    o.policy = ao.policy;
    o.local_budgets = false;
    o.progress = [](int, int) { std::this_thread::sleep_for(std::chrono::milliseconds(2)); };
    ASSERT_TRUE(ReplayOn((*s)->data_plane(), *t, o).ok());
    std::this_thread::sleep_for(std::chrono::milliseconds(100));  // the last probe passes
    absl::StatusOr<client::Budgets> b = (*s)->GetBudgets();
    ASSERT_TRUE(b.ok());
    ASSERT_GE(b->recomputes, 3u);
    during.push_back(curves(model));
    ASSERT_TRUE(during.back().is_array()) << "the first recompute saved " << model << "'s curves";
    sessions.push_back(std::move(*s));
  }
  ASSERT_TRUE(sessions[0]->Detach().ok());
  const nlohmann::json detached = curves("mt-detach");
  ASSERT_EQ(d.Terminate(), 0);
  if (std::chrono::steady_clock::now() - start > std::chrono::seconds(9)) {
    GTEST_SKIP() << "the runs took longer than the 10 s between level saves: nothing to show";
  }
  EXPECT_NE(detached, during[0]) << "Detach saved the newest curves";
  EXPECT_NE(curves("mt-stop"), during[1]) << "stopping spind saved the newest curves";
  EXPECT_EQ(curves("mt-detach"), detached) << "a detached session's curves are not saved again";
}

}  // namespace
}  // namespace spin::testing
