// Test helper: attaches a session through libspin_client, prints its id, then waits to be
// killed (the integration test SIGKILLs it to play a crashed engine).
#include <unistd.h>

#include <cstdio>

#include "spin_client.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: attach_helper TARGET\n");
    return 2;
  }
  spin::client::AttachOptions o;
  o.geometry.layers = 2;
  o.geometry.max_seqs = 2;
  o.geometry.max_slots = 4096;
  o.geometry.topk = 128;
  o.client_name = "attach_helper";
  auto s = spin::client::Session::Attach(argv[1], o);
  if (!s.ok()) {
    std::fprintf(stderr, "attach_helper: %s\n", std::string(s.status().message()).c_str());
    return 1;
  }
  std::printf("%s\n", (*s)->id().c_str());
  std::fflush(stdout);
  while (true) pause();
}
