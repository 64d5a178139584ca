// Test helper: plays an engine that gets killed (SIGKILL) at one point of the attach / fetch /
// step cycle. It prints the session id once it reached that point, then waits to be killed.
//   attach_helper TARGET            attach, fetch and map the arena (local mode)
//   attach_helper TARGET attach     attach only (never fetches the fd)
//   attach_helper TARGET step       local mode, then run decode steps until killed
//   attach_helper TARGET remote     remote mode, then run remote steps until killed
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "remote_data_plane.h"
#include "spin_client.h"

namespace {

// Runs steps on `dp` forever: one sequence, growing context, every layer selected and observed.
int StepForever(spin::DataPlane& dp, const spin::Geometry& g, const std::string& id) {
  if (!dp.ResetSequence(0, 42).ok()) return 1;
  std::printf("%s\n", id.c_str());
  std::fflush(stdout);
  std::vector<float> logits(g.max_slots, 1.0f);
  for (int32_t step = 0;; ++step) {
    const int32_t seq = 0, ctx = 64 + step % (static_cast<int32_t>(g.max_slots) - 64);
    const int32_t q = ctx - 1;
    const spin::StepBatch b{&seq, &ctx, &q, 1, 1};
    if (!dp.BeginStep(b).ok()) return 1;
    for (uint32_t l = 0; l < g.layers; ++l) {
      if (!dp.Select(static_cast<int32_t>(l)).ok()) return 1;
      if (!dp.Observe(static_cast<int32_t>(l), logits.data(), g.max_slots).ok()) return 1;
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || argc > 3) {
    std::fprintf(stderr, "usage: attach_helper TARGET [attach|step|remote]\n");
    return 2;
  }
  const std::string mode = argc == 3 ? argv[2] : "fetch";
  spin::client::AttachOptions o;
  o.geometry.layers = 2;
  o.geometry.max_seqs = 2;
  o.geometry.max_slots = 4096;
  o.geometry.topk = 128;
  o.client_name = "attach_helper";
  o.fetch_arena = mode != "attach" && mode != "remote";
  auto s = spin::client::Session::Attach(argv[1], o);
  if (!s.ok()) {
    std::fprintf(stderr, "attach_helper: %s\n", std::string(s.status().message()).c_str());
    return 1;
  }
  if (mode == "step") return StepForever((*s)->data_plane(), o.geometry, (*s)->id());
  if (mode == "remote") {
    auto r =
        spin::client::RemoteDataPlane::Create(&(*s)->stub(), (*s)->id(), (*s)->token(), o.geometry);
    if (!r.ok()) return 1;
    return StepForever(**r, o.geometry, (*s)->id());
  }
  std::printf("%s\n", (*s)->id().c_str());
  std::fflush(stdout);
  while (true) pause();
}
