// libFuzzer target: every RPC of spin.v1.Spin as spind handles it, bytes -> proto parse ->
// validation -> handler on a live session.
//
// LLVMFuzzerInitialize builds the real service in process, as spind's main does: a
// SessionManager on the CPU backend (small limits, so an Attach from the input cannot exhaust
// memory), the SpinService over it, the default health service, and a grpc::Server on a Unix
// socket in a scratch directory. The client side is a grpc::GenericStub: requests travel as raw
// bytes and the server does all the parsing.
//
// Input: up to 8 calls, run in order on a session attached for this input alone (so a crash
// reproduces from its input), each
//   byte 0      the method: an index into the service's methods, read from its descriptor (so a
//               new RPC is fuzzed without a change here; tests/fuzz/make_seeds names methods)
//   byte 1      bits 0-1: 0 send the bytes as they are; 1 or 3 parse them as the method's
//               request and, if that works and the request has a SessionRef `session`, put the
//               live session's id and token in it (this reaches the handlers' deep paths);
//               2 the same with a wrong token
//   bytes 2-3   the request's length L (little endian; clamped to what is left)
//   L bytes     the serialized request
// A server-streaming method (WatchBudgets) is called, its first message read, then cancelled.
//
// Properties checked, besides "no crash, no sanitizer report in spind's code":
//  - every call completes within 20 s (a handler that never finishes its reactor is a finding);
//  - after each input the daemon still serves: the health check says SERVING and ListSessions
//    succeeds;
//  - after every session is freed, the manager accounts 0 arena bytes.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "fuzz_common.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"
#include "google/protobuf/stubs/logging.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "session_manager.h"
#include "spin/v1/spin.grpc.pb.h"
#include "spin_service.h"

namespace {

namespace pb = spin::v1;
namespace gp = google::protobuf;
using spin::service::SessionManager;

constexpr int kMaxCalls = 8;
constexpr auto kCallTimeout = std::chrono::seconds(20);

struct Harness {
  SessionManager* sessions = nullptr;
  spin::service::SpinService* service = nullptr;
  std::unique_ptr<grpc::Server> server;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<grpc::GenericStub> generic;
  std::unique_ptr<pb::Spin::Stub> stub;
  const gp::ServiceDescriptor* descriptor = nullptr;
};

Harness* h = nullptr;

grpc::ByteBuffer ToBuffer(const std::string& bytes) {
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
}

std::string FromBuffer(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  std::string out;
  if (!buffer.Dump(&slices).ok()) return out;
  for (const grpc::Slice& s : slices)
    out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

std::chrono::system_clock::time_point Deadline() {
  return std::chrono::system_clock::now() + kCallTimeout;
}

// A unary call with raw bytes; waits for it. Returns the status (and the response bytes).
grpc::Status Unary(const std::string& path, const std::string& request, std::string* response) {
  grpc::ClientContext ctx;
  ctx.set_deadline(Deadline());
  const grpc::ByteBuffer req = ToBuffer(request);
  grpc::ByteBuffer resp;
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  grpc::Status status;
  h->generic->UnaryCall(&ctx, path, grpc::StubOptions(), &req, &resp, [&](grpc::Status s) {
    std::lock_guard<std::mutex> lock(mu);
    status = std::move(s);
    done = true;
    cv.notify_all();
  });
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return done; });  // the deadline bounds the wait
  if (response != nullptr) *response = FromBuffer(resp);
  return status;
}

// A server-streaming call: send the request, read the first message, cancel.
grpc::Status Streaming(const std::string& path, const std::string& request) {
  grpc::CompletionQueue cq;
  grpc::ClientContext ctx;
  ctx.set_deadline(Deadline());
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call =
      h->generic->PrepareCall(&ctx, path, &cq);
  FUZZ_CHECK(call != nullptr, "PrepareCall %s", path.c_str());
  auto wait = [&cq](intptr_t want) {
    void* tag = nullptr;
    bool ok = false;
    FUZZ_CHECK(cq.Next(&tag, &ok), "completion queue shut down");
    FUZZ_CHECK(reinterpret_cast<intptr_t>(tag) == want, "unexpected tag");
    return ok;
  };
  call->StartCall(reinterpret_cast<void*>(1));
  bool ok = wait(1);
  if (ok) {
    call->Write(ToBuffer(request), reinterpret_cast<void*>(2));
    ok = wait(2);
  }
  if (ok) {
    call->WritesDone(reinterpret_cast<void*>(3));
    ok = wait(3);
  }
  if (ok) {
    grpc::ByteBuffer first;
    call->Read(&first, reinterpret_cast<void*>(4));
    wait(4);
  }
  ctx.TryCancel();
  grpc::Status status;
  call->Finish(&status, reinterpret_cast<void*>(5));
  wait(5);
  cq.Shutdown();
  void* tag;
  bool ignored;
  while (cq.Next(&tag, &ignored)) {
  }
  return status;
}

// The request to send: the input's bytes, or (flags) parsed and given the live session.
std::string Prepare(const gp::MethodDescriptor* method, uint8_t flags, const std::string& bytes,
                    const std::string& id, const std::string& token) {
  if ((flags & 3) == 0) return bytes;
  const gp::Message* prototype =
      gp::MessageFactory::generated_factory()->GetPrototype(method->input_type());
  if (prototype == nullptr) return bytes;
  std::unique_ptr<gp::Message> request(prototype->New());
  if (!request->ParseFromString(bytes)) return bytes;
  const gp::FieldDescriptor* field = method->input_type()->FindFieldByName("session");
  if (field != nullptr && field->message_type() == pb::SessionRef::descriptor()) {
    auto* ref = static_cast<pb::SessionRef*>(
        request->GetReflection()->MutableMessage(request.get(), field));
    ref->set_session_id(id);
    ref->set_token((flags & 3) == 2 ? token + "0" : token);
  }
  std::string out;
  FUZZ_CHECK(request->SerializeToString(&out), "cannot serialize a parsed %s",
             method->full_name().c_str());
  return out;
}

void CheckServing() {
  std::string health;
  const grpc::Status hs = Unary("/grpc.health.v1.Health/Check", "", &health);
  FUZZ_CHECK(hs.ok() && health == std::string("\x08\x01", 2),
             "the health check fails after the input: %d %s", hs.error_code(),
             hs.error_message().c_str());
  grpc::ClientContext ctx;
  ctx.set_deadline(Deadline());
  pb::ListSessionsResponse list;
  const grpc::Status ls = h->stub->ListSessions(&ctx, pb::ListSessionsRequest(), &list);
  FUZZ_CHECK(ls.ok(), "ListSessions fails after the input: %d %s", ls.error_code(),
             ls.error_message().c_str());
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  h = new Harness;  // lives until exit: gRPC's threads outlive any static destructor order
  // protobuf logs every string field with invalid UTF-8 it parses (most inputs have one);
  // the lines would bury libFuzzer's own output. Fatal errors still abort.
  gp::SetLogHandler(nullptr);
  spin::service::Limits limits;
  limits.max_sessions = 4;
  limits.max_arena_bytes = 32ull << 20;
  limits.backend = spin::service::Backend::kCpu;
  h->sessions = new SessionManager(limits);
  const std::string dir = spin::fuzz::ScratchDir();
  spin::service::ServiceOptions options;
  options.workers = 2;
  h->service = new spin::service::SpinService(h->sessions, dir + "/fd.sock", nullptr, options);
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  const std::string address = "unix:" + dir + "/spind.sock";
  builder.AddListeningPort(address, grpc::InsecureServerCredentials());
  builder.RegisterService(h->service);
  h->server = builder.BuildAndStart();
  FUZZ_CHECK(h->server != nullptr, "cannot serve on %s", address.c_str());
  h->server->GetHealthCheckService()->SetServingStatus(true);
  h->channel = grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
  FUZZ_CHECK(h->channel->WaitForConnected(Deadline()), "cannot connect to %s", address.c_str());
  h->generic = std::make_unique<grpc::GenericStub>(h->channel);
  h->stub = pb::Spin::NewStub(h->channel);
  h->descriptor = pb::AttachRequest::descriptor()->file()->FindServiceByName("Spin");
  FUZZ_CHECK(h->descriptor != nullptr && h->descriptor->method_count() > 0, "no spin.v1.Spin");
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // The live session of this input: small, so that every request is cheap to serve.
  spin::Geometry g;
  g.layers = 2;
  g.max_seqs = 2;
  g.max_slots = 64;
  g.block_size = 4;
  g.topk = 8;
  g.max_rows = 2;
  g.dtype = spin::StateDtype::kFp32;
  absl::StatusOr<std::shared_ptr<spin::service::Session>> live =
      h->sessions->Attach(g, /*seed=*/7, spin::Policy(), "fuzz");
  FUZZ_CHECK(live.ok(), "cannot attach the live session: %s", live.status().ToString().c_str());
  const std::string id = (*live)->id, token = (*live)->token;
  live->reset();  // the manager holds it; a Detach from the input frees it

  // SPIN_FUZZ_VERBOSE=1: each call's method and status on stderr (to see what an input does).
  static const bool verbose = std::getenv("SPIN_FUZZ_VERBOSE") != nullptr;
  size_t pos = 0;
  for (int call = 0; call < kMaxCalls && pos + 2 <= size; ++call) {
    const gp::MethodDescriptor* method =
        h->descriptor->method(data[pos] % h->descriptor->method_count());
    const uint8_t flags = data[pos + 1];
    pos += 2;
    size_t len = size - pos;
    if (pos + 2 <= size) {
      len = data[pos] | (size_t{data[pos + 1]} << 8);
      pos += 2;
      len = std::min(len, size - pos);
    } else {
      len = 0;
      pos = size;
    }
    const std::string bytes(reinterpret_cast<const char*>(data + pos), len);
    pos += len;
    const std::string request = Prepare(method, flags, bytes, id, token);
    const std::string path = "/" + h->descriptor->full_name() + "/" + method->name();
    const grpc::Status status =
        method->server_streaming() ? Streaming(path, request) : Unary(path, request, nullptr);
    if (verbose) {
      std::fprintf(stderr, "rpc_fuzz: %s%s -> %d %s\n", method->name().c_str(),
                   request == bytes ? "" : " (live session)", status.error_code(),
                   status.error_message().c_str());
    }
    FUZZ_CHECK(status.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED,
               "%s did not finish within %lld s", path.c_str(),
               static_cast<long long>(kCallTimeout.count()));
  }

  CheckServing();
  for (const auto& s : h->sessions->List()) h->sessions->Free(s->id);
  FUZZ_CHECK(h->sessions->arena_bytes() == 0, "%llu arena bytes held after every session was freed",
             static_cast<unsigned long long>(h->sessions->arena_bytes()));
  return 0;
}
