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
  /// Calls in flight now.
  int64_t in_flight() const { return in_flight_.load(); }

  /// An interceptor factory for grpc::ServerBuilder::experimental().SetInterceptorCreators.
  std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> Factory() {
    return std::make_unique<Creator>(&in_flight_);
  }

 private:
  class Counted final : public grpc::experimental::Interceptor {
   public:
    explicit Counted(std::atomic<int64_t>* n) : n_(n) { n_->fetch_add(1); }
    ~Counted() override { n_->fetch_sub(1); }
    void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
      methods->Proceed();
    }

   private:
    std::atomic<int64_t>* n_;
  };
  class Creator final : public grpc::experimental::ServerInterceptorFactoryInterface {
   public:
    explicit Creator(std::atomic<int64_t>* n) : n_(n) {}
    grpc::experimental::Interceptor* CreateServerInterceptor(
        grpc::experimental::ServerRpcInfo*) override {
      return new Counted(n_);
    }

   private:
    std::atomic<int64_t>* n_;
  };
  std::atomic<int64_t> in_flight_{0};
};

}  // namespace spin::service
