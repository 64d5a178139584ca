// A GPU engine on libspin_client's ResilientDataPlane: the arena keeps one address range, so a
// CUDA graph captured once keeps working while spind is absent (dense), after it appears
// (sparse on the daemon's VMM arena mapped at the same addresses), after it is killed (the
// mapping stays) and after it restarts (the new session is mapped at the same addresses again).
// spind runs as a separate process with --backend cuda. Skips without a device (fails instead
// under SPIN_REQUIRE_GPU=1, require_gpu.h).
#include <cuda_runtime.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "require_gpu.h"
#include "resilient_data_plane.h"
#include "spin/cuda_data_plane.h"
#include "spin/numerics.h"

namespace spin::testing {
namespace {

#define CUDA_OK(x) ASSERT_EQ((x), cudaSuccess) << #x

// spind as a child process: $SPIND, else the build tree's.
pid_t StartSpind(const std::string& socket) {
  const char* env = std::getenv("SPIND");
  const std::string path = env != nullptr ? env : SPIND_PATH;
  const std::string listen = "unix://" + socket;
  const pid_t pid = fork();
  if (pid == 0) {
    execl(path.c_str(), path.c_str(), "--listen", listen.c_str(), "--backend", "cuda",
          "--log-format", "text", nullptr);
    _exit(127);
  }
  return pid;
}

void Kill(pid_t pid) {
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
}

TEST(ResilientCuda, OneCapturedGraphAcrossDaemonStartKillAndRestart) {
  SPIN_REQUIRE_GPU_OR_SKIP();
  const std::string sock =
      ::testing::TempDir() + "/spind-resilient-cuda-" + std::to_string(getpid()) + ".sock";
  unlink(sock.c_str());
  client::AttachOptions o;
  o.geometry.layers = 1;
  o.geometry.max_seqs = 1;
  o.geometry.max_slots = 64 * 64;
  o.geometry.topk = 128;
  o.policy.target_sparsity = 0.5;
  o.policy.exploration = 0.0;
  o.client_name = "gpu-engine";
  auto made = client::ResilientDataPlane::CreateOnDevice("unix://" + sock, o,
                                                         std::chrono::milliseconds(20));
  ASSERT_TRUE(made.ok()) << made.status();
  client::ResilientDataPlane& dp = **made;
  ASSERT_TRUE(dp.on_device());
  ASSERT_TRUE(dp.ResetSequence(0, 9).ok());
  const int32_t ctx = 64 * 64, nb = 64;
  const int32_t batch[3] = {0, ctx, ctx - 1};
  int32_t* d_batch = nullptr;
  float* d_logits = nullptr;
  CUDA_OK(cudaMalloc(&d_batch, sizeof(batch)));
  CUDA_OK(cudaMemcpy(d_batch, batch, sizeof(batch), cudaMemcpyHostToDevice));
  std::vector<float> logits(ctx);
  std::mt19937 rng(3);
  for (float& x : logits) x = static_cast<float>(rng() % 1000) / 10.0f;
  CUDA_OK(cudaMalloc(&d_logits, logits.size() * sizeof(float)));
  CUDA_OK(cudaMemcpy(d_logits, logits.data(), logits.size() * 4, cudaMemcpyHostToDevice));
  const int32_t* count_ptr = dp.arena().union_count;  // a device address that never moves

  // One step, captured once (no daemon yet, so nothing switches during the capture).
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph;
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  ASSERT_TRUE(dp.BeginStep(StepBatch{d_batch, d_batch + 1, d_batch + 2, 1, 1}, stream).ok());
  ASSERT_TRUE(dp.Select(0, nullptr, 0, stream).ok());
  ASSERT_TRUE(dp.Observe(0, d_logits, ctx, nullptr, stream).ok());
  CUDA_OK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  // Refresh between replays, as a graph-replaying engine does; returns the selected blocks.
  auto step = [&]() -> int {
    EXPECT_TRUE(dp.Refresh().ok());
    EXPECT_EQ(dp.arena().union_count, count_ptr) << "the arena must not move";
    EXPECT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    int32_t count = -1;
    EXPECT_EQ(cudaMemcpy(&count, count_ptr, 4, cudaMemcpyDeviceToHost), cudaSuccess);
    return count;
  };
  const int sparse = KeptBlocks(nb, 128, 64, 0.5);

  // No daemon: dense.
  for (int i = 0; i < 3; ++i) EXPECT_EQ(step(), nb);
  EXPECT_FALSE(dp.attached());

  // spind appears: the same graph runs on its arena (a fresh sequence is dense once).
  pid_t pid = StartSpind(sock);
  for (int i = 0; i < 500 && !dp.attached(); ++i) {
    step();
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_TRUE(dp.attached()) << "never attached to spind --backend cuda";
  const std::string first = dp.session_id();
  step();
  EXPECT_EQ(step(), sparse);
  EXPECT_EQ(step(), sparse);

  // spind killed: the mapping stays, selections stay sparse.
  Kill(pid);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(step(), sparse);

  // spind restarted: a new session mapped at the same addresses, the same graph again.
  pid = StartSpind(sock);
  for (int i = 0; i < 500 && dp.session_id() == first; ++i) {
    step();
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_NE(dp.session_id(), first) << "did not reattach after the restart";
  step();
  EXPECT_EQ(step(), sparse);
  Kill(pid);

  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
  cudaFree(d_batch);
  cudaFree(d_logits);
}

// The engine starts while spind is up: it attaches before capturing, then spind restarts.
// The graph captured on the first session keeps running on the second (one data plane drives
// the window, so its scratch buffers are never freed; memcheck in gpu-check would see it).
TEST(ResilientCuda, GraphCapturedOnASessionSurvivesADaemonRestart) {
  SPIN_REQUIRE_GPU_OR_SKIP();
  const std::string sock =
      ::testing::TempDir() + "/spind-resilient-cuda2-" + std::to_string(getpid()) + ".sock";
  unlink(sock.c_str());
  pid_t pid = StartSpind(sock);
  client::AttachOptions o;
  o.geometry.layers = 1;
  o.geometry.max_seqs = 1;
  o.geometry.max_slots = 64 * 64;
  o.geometry.topk = 128;
  o.policy.target_sparsity = 0.75;
  o.client_name = "gpu-engine";
  auto made = client::ResilientDataPlane::CreateOnDevice("unix://" + sock, o,
                                                         std::chrono::milliseconds(20));
  ASSERT_TRUE(made.ok()) << made.status();
  client::ResilientDataPlane& dp = **made;
  ASSERT_TRUE(dp.ResetSequence(0, 4).ok());
  for (int i = 0; i < 500 && !dp.attached(); ++i) {
    ASSERT_TRUE(dp.Refresh().ok());
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_TRUE(dp.attached());
  const std::string first = dp.session_id();
  const int32_t ctx = 64 * 64, nb = 64;
  const int32_t batch[3] = {0, ctx, ctx - 1};
  int32_t* d_batch = nullptr;
  float* d_logits = nullptr;
  CUDA_OK(cudaMalloc(&d_batch, sizeof(batch)));
  CUDA_OK(cudaMemcpy(d_batch, batch, sizeof(batch), cudaMemcpyHostToDevice));
  std::vector<float> logits(ctx);
  for (int i = 0; i < ctx; ++i) logits[i] = static_cast<float>((i * 37) % 101);
  CUDA_OK(cudaMalloc(&d_logits, logits.size() * sizeof(float)));
  CUDA_OK(cudaMemcpy(d_logits, logits.data(), logits.size() * 4, cudaMemcpyHostToDevice));
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph;
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  ASSERT_TRUE(dp.BeginStep(StepBatch{d_batch, d_batch + 1, d_batch + 2, 1, 1}, stream).ok());
  ASSERT_TRUE(dp.Select(0, nullptr, 0, stream).ok());
  ASSERT_TRUE(dp.Observe(0, d_logits, ctx, nullptr, stream).ok());
  CUDA_OK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  auto step = [&]() -> int {
    EXPECT_TRUE(dp.Refresh().ok());
    EXPECT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    int32_t count = -1;
    EXPECT_EQ(cudaMemcpy(&count, dp.arena().union_count, 4, cudaMemcpyDeviceToHost), cudaSuccess);
    return count;
  };
  const int sparse = KeptBlocks(nb, 128, 64, 0.75);
  EXPECT_EQ(step(), nb);  // fresh
  EXPECT_EQ(step(), sparse);
  Kill(pid);
  pid = StartSpind(sock);
  for (int i = 0; i < 500 && dp.session_id() == first; ++i) {
    step();
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_NE(dp.session_id(), first);
  step();
  EXPECT_EQ(step(), sparse);
  EXPECT_EQ(step(), sparse);
  Kill(pid);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
  cudaFree(d_batch);
  cudaFree(d_logits);
}

}  // namespace
}  // namespace spin::testing
