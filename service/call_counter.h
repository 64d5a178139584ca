// The gRPC calls spind is serving right now, counted by a server interceptor: gRPC makes one
// interceptor per call when the call starts and destroys it when the call is done, so the
// interceptors alive are the calls in flight (unary calls and streams, every service's).
// spind's SIGTERM path waits for this count to reach zero (bounded by the drain) and then shuts
// the server down at once: gRPC's own Shutdown(deadline) also waits for idle client connections
// to go away, which an engine's channel never does, so it would always take the whole deadline.
#pragma once

#include <atomic>
#include <memory>

#include "grpcpp/support/server_interceptor.h"

namespace spin::service {

class CallCounter {
 public:
  /// Calls in flight now, in this process.
  static int64_t in_flight() { return in_flight_.load(); }

  /// An interceptor factory for grpc::ServerBuilder::experimental().SetInterceptorCreators.
  static std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> Factory() {
    return std::make_unique<Creator>();
  }

 private:
  // The count is a process-wide atomic, not a pointer kept in each interceptor: gRPC creates an
  // interceptor on one thread and destroys it on another through its own (uninstrumented)
  // hand-off, and a member read there is all ThreadSanitizer could see of it.
  class Counted final : public grpc::experimental::Interceptor {
   public:
    Counted() { in_flight_.fetch_add(1); }
    ~Counted() override { in_flight_.fetch_sub(1); }
    void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
      methods->Proceed();
    }
  };
  class Creator final : public grpc::experimental::ServerInterceptorFactoryInterface {
   public:
    grpc::experimental::Interceptor* CreateServerInterceptor(
        grpc::experimental::ServerRpcInfo*) override {
      return new Counted();
    }
  };
  static inline std::atomic<int64_t> in_flight_{0};
};

}  // namespace spin::service
