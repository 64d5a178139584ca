#include "spin_client.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "convert.h"
#include "grpc_status.h"
#include "grpcpp/grpcpp.h"
#include "spin/status_macros.h"
#if SPIN_HAVE_CUDA
#include "spin/cuda_data_plane.h"
#include "spin/shared_device_memory.h"
#endif

namespace spin::client {
namespace {

namespace pb = spin::v1;

}  // namespace

absl::Status FetchArenaFd(const std::string& path, const std::string& id, const std::string& token,
                          int* conn_out, int* fd_out, uint64_t* bytes_out) {
  sockaddr_un addr{};
  if (path.size() >= sizeof(addr.sun_path))
    return absl::InvalidArgumentError("fd socket path too long");
  const int conn = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  addr.sun_family = AF_UNIX;
  std::strcpy(addr.sun_path, path.c_str());
  if (conn < 0 || connect(conn, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    if (conn >= 0) close(conn);
    return absl::UnavailableError(
        absl::StrCat("cannot connect to spind's fd socket ", path, ": ", std::strerror(errno)));
  }
  // A stopped (not dead) spind must not hang the caller: give the handshake 10 s.
  const timeval tv{10, 0};
  setsockopt(conn, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(conn, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  const std::string req = absl::StrCat("ATTACH ", id, " ", token, "\n");
  // MSG_NOSIGNAL: a closed peer must not raise SIGPIPE in the engine process.
  if (send(conn, req.data(), req.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(req.size())) {
    close(conn);
    return absl::UnavailableError("fd socket closed during the handshake");
  }
  char line[256] = {};
  iovec iov{line, sizeof(line) - 1};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  const ssize_t n = recvmsg(conn, &msg, MSG_CMSG_CLOEXEC | MSG_NOSIGNAL);
  int fd = -1;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
      std::memcpy(&fd, CMSG_DATA(c), sizeof(int));
    }
  }
  const std::string reply(line, n > 0 ? static_cast<size_t>(n) : 0);
  unsigned long long bytes = 0;
  if (reply.rfind("OK ", 0) != 0 || fd < 0 || std::sscanf(reply.c_str() + 3, "%llu", &bytes) != 1) {
    if (fd >= 0) close(fd);
    close(conn);
    return absl::PermissionDeniedError(absl::StrCat("spind refused the arena: ", reply));
  }
  *conn_out = conn;
  *fd_out = fd;
  *bytes_out = bytes;
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Session>> Session::Attach(const std::string& target,
                                                         const AttachOptions& o) {
  std::unique_ptr<Session> s(new Session());
  s->defer_ema_ = o.defer_ema;
  s->channel_ = grpc::CreateChannel(target, grpc::InsecureChannelCredentials());
  s->stub_ = pb::Spin::NewStub(s->channel_);
  pb::AttachRequest req;
  *req.mutable_geometry() = ToProto(o.geometry);
  req.set_seed(o.seed);
  *req.mutable_policy() = ToProto(o.policy);
  req.set_client_name(o.client_name);
  req.set_engine_control(o.engine_control);
  req.set_model(o.model);
  pb::AttachResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  s->admin_token_ = o.admin_token;
  if (!o.admin_token.empty()) ctx.AddMetadata("authorization", "Bearer " + o.admin_token);
  if (absl::Status st = FromGrpc(s->stub_->Attach(&ctx, req, &resp), "Attach"); !st.ok()) {
    return st;
  }
  s->id_ = resp.session_id();
  s->token_ = resp.token();
  const bool gpu = resp.backend() == pb::BACKEND_CUDA;
  if ((o.require_backend == 1 && gpu) || (o.require_backend == 2 && !gpu)) {
    (void)s->Detach();
    return absl::FailedPreconditionError(
        gpu ? "spind keeps arenas on the GPU; this engine runs on the CPU"
            : "spind keeps arenas in host memory; this engine runs on the GPU (start spind "
              "with --backend cuda on its GPU)");
  }
  if (o.engine_control) {
    // An older spind ignores the field and would write changes into the arena itself.
    absl::StatusOr<Control> c = s->GetControl();
    if (!c.ok() || !c->engine_control) {
      (void)s->Detach();
      return absl::FailedPreconditionError(
          absl::StrCat("spind at ", target, " does not support engine_control sessions (",
                       c.ok() ? "it keeps writing changes into the arena" : c.status().message(),
                       "): upgrade spind"));
    }
  }
  s->header_ = {};
  if (resp.arena_header().size() == sizeof(ArenaHeader)) {
    std::memcpy(&s->header_, resp.arena_header().data(), sizeof(ArenaHeader));
  }
  s->arena_bytes_ = resp.arena_bytes();
  if (!o.fetch_arena) {
    // Remote mode: spind runs the data plane; the arena stays in the daemon. The session lives
    // as long as calls name it (KeepAlive when idle).
    if (resp.backend() == pb::BACKEND_CUDA) s->device_uuid_ = resp.device_uuid();
    return s;
  }
  int fd = -1;
  uint64_t bytes = 0;
  if (absl::Status st = FetchArenaFd(resp.fd_socket(), s->id_, s->token_, &s->conn_, &fd, &bytes);
      !st.ok()) {
    (void)s->Detach();
    return st;
  }
  if (resp.arena_header().size() != sizeof(ArenaHeader) || bytes != resp.arena_bytes()) {
    close(fd);
    (void)s->Detach();
    return absl::DataLossError("spind sent an arena that does not match the layout it described");
  }
  ArenaHeader header;
  std::memcpy(&header, resp.arena_header().data(), sizeof(header));
  s->header_ = header;
  s->arena_bytes_ = bytes;
  if (resp.backend() == pb::BACKEND_CUDA) s->device_uuid_ = resp.device_uuid();
  if (resp.backend() == pb::BACKEND_CUDA && o.defer_device_map) {
    s->pending_fd_ = fd;  // mapped by MapInto
    return s;
  }
  absl::StatusOr<ArenaView> view = resp.backend() == pb::BACKEND_CUDA
                                       ? s->MapDevice(fd, bytes, resp.device_uuid(), header)
                                       : s->MapHost(fd, bytes, header);
  close(fd);  // the mapping keeps the memory
  if (!view.ok()) {
    (void)s->Detach();
    return view.status();
  }
  s->view_ = *view;
  if (s->device_ != nullptr) {
#if SPIN_HAVE_CUDA
    CudaDataPlaneOptions cuda;
    cuda.defer_ema = s->defer_ema_;
    absl::StatusOr<std::unique_ptr<DataPlane>> dp = MakeCudaDataPlane(s->view_, cuda);
    if (!dp.ok()) {
      (void)s->Detach();
      return dp.status();
    }
    s->dp_ = std::move(*dp);
#endif
  } else {
    s->dp_ = MakeCpuDataPlane(s->view_);
  }
  return s;
}

absl::StatusOr<ArenaView> Session::MapHost(int fd, uint64_t bytes, const ArenaHeader& header) {
  // The fd must be exactly the arena, sealed at its size: then no process holding it can
  // shrink it under this mapping (which would raise SIGBUS in the engine).
  struct stat st {};
  if (fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_size) != bytes) {
    return absl::DataLossError(absl::StrCat("spind sent an arena fd of ",
                                            static_cast<long long>(st.st_size),
                                            " bytes; the session's arena has ", bytes));
  }
  const int seals = fcntl(fd, F_GET_SEALS);
  const int want = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;
  if (seals < 0 || (seals & want) != want) {
    return absl::FailedPreconditionError(
        "spind sent an arena fd that is not sealed against resizing: upgrade spind");
  }
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot map the ", bytes, "-byte arena"));
  }
  base_ = base;
  bytes_ = bytes;
  // What was mapped must be exactly the arena the daemon described.
  if (std::memcmp(base, &header, sizeof(header)) != 0) {
    return absl::DataLossError("the mapped arena does not match the layout spind sent");
  }
  return ViewArena(base, bytes);
}

absl::StatusOr<ArenaView> Session::MapDevice(int fd, uint64_t bytes, const std::string& uuid,
                                             const ArenaHeader& header) {
#if SPIN_HAVE_CUDA
  absl::StatusOr<int> ordinal = CudaOrdinalOfUuid(uuid);
  if (!ordinal.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("spind keeps this session's arena on GPU ", uuid,
                     ", which this process cannot use: ", ordinal.status().message()));
  }
  SPIN_RETURN_IF_ERROR(CudaSetDevice(*ordinal));
  SPIN_ASSIGN_OR_RETURN(std::unique_ptr<SharedDeviceMemory> mem,
                        SharedDeviceMemory::Import(fd, *ordinal, bytes));
  ArenaHeader mapped;
  SPIN_RETURN_IF_ERROR(CopyToHost(&mapped, mem->ptr(), sizeof(mapped)));
  if (std::memcmp(&mapped, &header, sizeof(header)) != 0) {
    return absl::DataLossError("the mapped device arena does not match the layout spind sent");
  }
  SPIN_ASSIGN_OR_RETURN(ArenaView view, ViewArenaWithHeader(mem->ptr(), bytes, header));
  device_uuid_ = uuid;
  device_ = std::shared_ptr<SharedDeviceMemory>(std::move(mem));
  return view;
#else
  (void)fd;
  (void)bytes;
  (void)header;
  return absl::FailedPreconditionError(
      absl::StrCat("spind keeps this session's arena on GPU ", uuid,
                   " but this client was built without the CUDA backend"));
#endif
}

namespace {

// Control calls give up after this long (the daemon answers them from memory).
constexpr std::chrono::seconds kCallDeadline{10};

// One unary call on a session: its id and token in the request, the deadline, and the admin
// token (spind requires it for changes over TCP) when there is one.
template <typename Req, typename Resp>
absl::Status SessionCall(pb::Spin::Stub& stub,
                         grpc::Status (pb::Spin::Stub::*rpc)(grpc::ClientContext*, const Req&,
                                                             Resp*),
                         const char* what, const std::string& id, const std::string& token,
                         const std::string& admin_token, Req& req, Resp* resp) {
  req.mutable_session()->set_session_id(id);
  req.mutable_session()->set_token(token);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + kCallDeadline);
  if (!admin_token.empty()) ctx.AddMetadata("authorization", "Bearer " + admin_token);
  return FromGrpc((stub.*rpc)(&ctx, req, resp), what);
}

}  // namespace

absl::Status Session::KeepAlive() {
  pb::KeepAliveRequest req;
  pb::KeepAliveResponse resp;
  return SessionCall(*stub_, &pb::Spin::Stub::KeepAlive, "KeepAlive", id_, token_, "", req, &resp);
}

absl::StatusOr<Policy> Session::GetPolicy() {
  pb::GetPolicyRequest req;
  pb::GetPolicyResponse resp;
  SPIN_RETURN_IF_ERROR(
      SessionCall(*stub_, &pb::Spin::Stub::GetPolicy, "GetPolicy", id_, token_, "", req, &resp));
  return FromProto(resp.policy());
}

absl::StatusOr<Policy> Session::SetPolicy(const PolicyChange& change) {
  pb::SetPolicyRequest req;
  if (change.target_sparsity) req.set_target_sparsity(*change.target_sparsity);
  if (change.exploration) req.set_exploration(*change.exploration);
  if (change.alpha) req.set_alpha(*change.alpha);
  if (change.probe_period) req.set_probe_period(*change.probe_period);
  if (change.budget_mode)
    req.set_budget_mode(ToProto(Policy{.budget_mode = *change.budget_mode}).budget_mode());
  if (change.miss_target) req.set_miss_target(*change.miss_target);
  pb::SetPolicyResponse resp;
  SPIN_RETURN_IF_ERROR(SessionCall(*stub_, &pb::Spin::Stub::SetPolicy, "SetPolicy", id_, token_,
                                   admin_token_, req, &resp));
  return FromProto(resp.policy());
}

absl::StatusOr<Budgets> Session::GetBudgets() {
  pb::GetBudgetsRequest req;
  pb::GetBudgetsResponse resp;
  SPIN_RETURN_IF_ERROR(
      SessionCall(*stub_, &pb::Spin::Stub::GetBudgets, "GetBudgets", id_, token_, "", req, &resp));
  Budgets b;
  b.layer_sparsity.assign(resp.layer_sparsity().begin(), resp.layer_sparsity().end());
  b.epoch = resp.epoch();
  SPIN_ASSIGN_OR_RETURN(b.mode, ModeFromProto(resp.budget_mode(), BudgetMode::kUniform));
  b.recomputes = resp.recomputes();
  b.reason = resp.reason();
  return b;
}

absl::StatusOr<Control> Session::GetControl() {
  pb::GetBudgetsRequest req;
  pb::GetBudgetsResponse resp;
  SPIN_RETURN_IF_ERROR(
      SessionCall(*stub_, &pb::Spin::Stub::GetBudgets, "GetBudgets", id_, token_, "", req, &resp));
  if (!resp.has_policy()) {
    return absl::UnimplementedError(
        "this spind sends no policy with its budgets (it predates engine control): upgrade it");
  }
  Control c;
  SPIN_ASSIGN_OR_RETURN(c.policy, FromProto(resp.policy()));
  c.layer_sparsity.assign(resp.layer_sparsity().begin(), resp.layer_sparsity().end());
  c.version = resp.control_version();
  c.engine_control = resp.engine_control();
  const uint32_t layers = view_.geometry.layers;
  if (layers > 0 && c.layer_sparsity.size() != layers) {
    return absl::DataLossError(absl::StrCat("spind sent a budget table of ",
                                            c.layer_sparsity.size(), " layers for a session of ",
                                            layers));
  }
  return c;
}

absl::StatusOr<std::vector<LayerStats>> Session::GetStats() {
  pb::GetStatsRequest req;
  pb::GetStatsResponse resp;
  SPIN_RETURN_IF_ERROR(
      SessionCall(*stub_, &pb::Spin::Stub::GetStats, "GetStats", id_, token_, "", req, &resp));
  std::vector<LayerStats> out(
      view_.geometry.layers > 0 ? view_.geometry.layers : static_cast<uint32_t>(resp.layers_size()),
      LayerStats{});
  for (const pb::LayerStats& l : resp.layers()) {
    if (l.layer() >= out.size()) {
      return absl::DataLossError(absl::StrCat("spind sent statistics for layer ", l.layer(),
                                              " of a session with ", out.size(), " layers"));
    }
    out[l.layer()] = FromProto(l);
  }
  return out;
}

absl::Status Session::Detach() {
  pb::DetachRequest req;
  pb::DetachResponse resp;
  return SessionCall(*stub_, &pb::Spin::Stub::Detach, "Detach", id_, token_, admin_token_, req,
                     &resp);
}

bool Session::alive() const {
  if (conn_ < 0) return false;
  pollfd p{conn_, POLLIN, 0};
  // The daemon never writes after the handshake: readable or hung up means it is gone.
  return poll(&p, 1, 0) == 0;
}

#if SPIN_HAVE_CUDA
absl::Status Session::MapInto(DeviceWindow& window, bool build_data_plane) {
  if (pending_fd_ < 0) {
    return absl::FailedPreconditionError(
        "MapInto needs a CUDA session attached with "
        "defer_device_map that was not mapped yet");
  }
  SPIN_ASSIGN_OR_RETURN(int ordinal, CudaOrdinalOfUuid(device_uuid_));
  if (ordinal != window.ordinal()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "spind keeps the arena on GPU ", device_uuid_, " (device ", ordinal,
        " here) but the engine runs on device ", window.ordinal(), ": run one spind per GPU"));
  }
  if (window.bytes() != arena_bytes_) {
    return absl::FailedPreconditionError(
        absl::StrCat("the arena maps ", arena_bytes_, " bytes; the window has ", window.bytes()));
  }
  SPIN_ASSIGN_OR_RETURN(ArenaView view, ViewArenaWithHeader(window.ptr(), arena_bytes_, header_));
  std::unique_ptr<DataPlane> dp;
  if (build_data_plane) {
    // Built (and its scratch allocated) before the window changes, so a failure changes nothing.
    CudaDataPlaneOptions cuda;
    cuda.defer_ema = defer_ema_;
    absl::StatusOr<std::unique_ptr<DataPlane>> made = MakeCudaDataPlane(view, cuda);
    SPIN_RETURN_IF_ERROR(made.status());
    dp = std::move(*made);
  }
  SPIN_RETURN_IF_ERROR(window.MapImported(pending_fd_));
  close(pending_fd_);
  pending_fd_ = -1;
  ArenaHeader mapped;
  SPIN_RETURN_IF_ERROR(CopyToHost(&mapped, window.ptr(), sizeof(mapped)));
  if (std::memcmp(&mapped, &header_, sizeof(header_)) != 0) {
    return absl::DataLossError("the mapped device arena does not match the layout spind sent");
  }
  view_ = view;
  dp_ = std::move(dp);
  return absl::OkStatus();
}
#endif

Session::~Session() {
  dp_.reset();
  device_.reset();
  if (pending_fd_ >= 0) close(pending_fd_);
  if (base_ != nullptr) munmap(base_, bytes_);
  if (conn_ >= 0) close(conn_);
}

}  // namespace spin::client
