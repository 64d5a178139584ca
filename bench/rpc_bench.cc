// spind's RPC costs, measured against a real daemon process on a Unix socket (not a test):
// unary control RPC (GetPolicy) p50/p99, PredictMasks for a batch of 64 sequences x 61 layers
// in remote mode, and Attach latency. Usage: rpc_bench SPIND [--out FILE]
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "grpcpp/grpcpp.h"
#include "spin/v1/spin.grpc.pb.h"

namespace pb = spin::v1;
using Clock = std::chrono::steady_clock;

namespace {

double Us(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::micro>(b - a).count();
}

struct Stats {
  double p50, p99, mean;
};

Stats Summarise(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  double sum = 0;
  for (double x : v) sum += x;
  return {v[v.size() / 2], v[std::min(v.size() - 1, v.size() * 99 / 100)], sum / v.size()};
}

pb::AttachRequest AttachReq(uint32_t layers, uint32_t seqs, uint32_t slots) {
  pb::AttachRequest r;
  pb::Geometry* g = r.mutable_geometry();
  g->set_layers(layers);
  g->set_block_size(64);
  g->set_topk(2048);
  g->set_max_sequences(seqs);
  g->set_max_slots(slots);
  g->set_max_rows(1);
  g->set_state_dtype(pb::STATE_DTYPE_BF16);
  r.mutable_policy()->set_target_sparsity(0.5);
  r.mutable_policy()->set_exploration(0.05);
  r.mutable_policy()->set_alpha(0.3f);
  return r;
}

// The same GetPolicy round trip against an in-process server whose handler does nothing: the
// floor that gRPC itself sets on this machine, measured in the same run.
struct TrivialService final : pb::Spin::CallbackService {
  grpc::ServerUnaryReactor* GetPolicy(grpc::CallbackServerContext* ctx, const pb::GetPolicyRequest*,
                                      pb::GetPolicyResponse* resp) override {
    resp->set_epoch(1);
    grpc::ServerUnaryReactor* r = ctx->DefaultReactor();
    r->Finish(grpc::Status::OK);
    return r;
  }
};

std::vector<double> TimeGetPolicy(pb::Spin::Stub* stub, const pb::GetPolicyRequest& req) {
  std::vector<double> out;
  for (int i = 0; i < 2000; ++i) {
    grpc::ClientContext ctx;
    pb::GetPolicyResponse r;
    const auto t0 = Clock::now();
    stub->GetPolicy(&ctx, req, &r);
    if (i >= 100) out.push_back(Us(t0, Clock::now()));
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: rpc_bench SPIND [--out FILE]\n");
    return 2;
  }
  std::string out_path;
  for (int i = 2; i + 1 < argc; ++i) {
    if (!std::strcmp(argv[i], "--out")) out_path = argv[i + 1];
  }
  Stats floor;
  {
    const std::string addr = "unix:///tmp/spind-rpc-floor-" + std::to_string(getpid()) + ".sock";
    TrivialService trivial;
    grpc::ServerBuilder b;
    b.AddListeningPort(addr, grpc::InsecureServerCredentials());
    b.RegisterService(&trivial);
    std::unique_ptr<grpc::Server> server = b.BuildAndStart();
    auto stub = pb::Spin::NewStub(grpc::CreateChannel(addr, grpc::InsecureChannelCredentials()));
    floor = Summarise(TimeGetPolicy(stub.get(), pb::GetPolicyRequest()));
    server->Shutdown();
  }
  const std::string sock = "/tmp/spind-rpc-bench-" + std::to_string(getpid()) + ".sock";
  const pid_t pid = fork();
  if (pid == 0) {
    const std::string listen = "unix://" + sock;
    execl(argv[1], argv[1], "--listen", listen.c_str(), "--max-arena-bytes", "68719476736",
          nullptr);
    _exit(127);
  }
  auto channel = grpc::CreateChannel("unix://" + sock, grpc::InsecureChannelCredentials());
  if (!channel->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(20))) {
    std::fprintf(stderr, "rpc_bench: spind did not come up\n");
    kill(pid, SIGKILL);
    return 1;
  }
  auto stub = pb::Spin::NewStub(channel);
  auto call = [](auto fn) {
    grpc::ClientContext ctx;
    return fn(&ctx);
  };
  // Attach latency (small session; the arena is zeroed and initialised inside Attach).
  std::vector<double> attach;
  for (int i = 0; i < 50; ++i) {
    pb::AttachResponse a;
    const auto t0 = Clock::now();
    grpc::Status s =
        call([&](grpc::ClientContext* c) { return stub->Attach(c, AttachReq(4, 4, 32768), &a); });
    attach.push_back(Us(t0, Clock::now()));
    if (!s.ok()) return 1;
    pb::DetachRequest d;
    d.mutable_session()->set_session_id(a.session_id());
    d.mutable_session()->set_token(a.token());
    pb::DetachResponse dr;
    call([&](grpc::ClientContext* c) { return stub->Detach(c, d, &dr); });
  }
  // Control RPC round trips.
  pb::AttachResponse a;
  call([&](grpc::ClientContext* c) { return stub->Attach(c, AttachReq(61, 64, 32768), &a); });
  pb::GetPolicyRequest gp;
  gp.mutable_session()->set_session_id(a.session_id());
  gp.mutable_session()->set_token(a.token());
  const std::vector<double> control = TimeGetPolicy(stub.get(), gp);
  // PredictMasks: one decode step of 64 sequences x 61 layers at 32K slots (remote mode).
  pb::OpenSequencesRequest os;
  *os.mutable_session() = gp.session();
  for (int e = 0; e < 64; ++e) os.add_sequences()->set_sequence(e);
  pb::OpenSequencesResponse osr;
  call([&](grpc::ClientContext* c) { return stub->OpenSequences(c, os, &osr); });
  std::vector<double> step;
  for (int it = 0; it < 12; ++it) {
    const auto t0 = Clock::now();
    for (int l = 0; l < 61; ++l) {
      pb::PredictMasksRequest pm;
      *pm.mutable_session() = gp.session();
      pm.set_layer(l);
      if (l == 0) {
        pm.set_begin_step(true);
        pm.set_rows(1);
        for (int e = 0; e < 64; ++e) {
          pb::StepEntry* en = pm.add_entries();
          en->set_sequence(e);
          en->set_ctx_len(32000 + it);
          en->set_q_pos(31999 + it);
        }
      }
      pb::PredictMasksResponse r;
      grpc::Status s = call([&](grpc::ClientContext* c) { return stub->PredictMasks(c, pm, &r); });
      if (!s.ok()) {
        std::fprintf(stderr, "PredictMasks: %s\n", s.error_message().c_str());
        return 1;
      }
    }
    if (it >= 2) step.push_back(Us(t0, Clock::now()));
  }
  kill(pid, SIGTERM);
  waitpid(pid, nullptr, 0);
  const Stats at = Summarise(attach), ct = Summarise(control), st = Summarise(step);
  char buf[4096];
  std::snprintf(buf, sizeof(buf),
                "| measurement | p50 | p99 | mean |\n|---|---|---|---|\n"
                "| unary control RPC (GetPolicy), us | %.1f | %.1f | %.1f |\n"
                "| same RPC, in-process server with an empty handler (gRPC floor), us | %.1f | "
                "%.1f | %.1f |\n"
                "| Attach (4 layers x 4 seqs x 32K slots, bf16), us | %.1f | %.1f | %.1f |\n"
                "| PredictMasks, one step of 64 seqs x 61 layers at 32K slots, ms | %.2f | %.2f | "
                "%.2f |\n",
                ct.p50, ct.p99, ct.mean, floor.p50, floor.p99, floor.mean, at.p50, at.p99, at.mean,
                st.p50 / 1e3, st.p99 / 1e3, st.mean / 1e3);
  std::printf("%s\nspind control RPC p50 / gRPC floor p50: %.2f\n", buf, ct.p50 / floor.p50);
  if (!out_path.empty()) {
    std::ofstream(out_path) << buf
                            << "\nspind control RPC p50 / gRPC floor p50: " << ct.p50 / floor.p50
                            << "\n";
  }
  return 0;
}
