# spind's image: spind and spinctl on a slim Debian 12 runtime.
#
# Elsewhere (a builder that pulls images):
#   podman build -t spind .            (or docker buildx build; CUDA comes from CUDA_IMAGE)
# Here, with no registry: scripts/build-image (a local Debian base image and the local CUDA
# toolkit as the "cuda" build context; nothing is pulled).
#
# Run with no arguments it serves spind with its defaults: the socket
# /run/spin/spind.sock, the CUDA backend when a GPU is usable, else the CPU backend.
#   podman run -d -v /run/spin:/run/spin localhost/spind:VERSION
# Flags go after the image name (`... spind --device 1 --metrics-address 0.0.0.0:9400`), or
# in SPIND_* environment variables (`spind --help` lists them).

ARG DEBIAN_IMAGE=docker.io/library/debian:12-slim
# The CUDA toolkit is only bind-mounted into the build step, never copied into a layer. Its
# image must have a glibc no newer than Debian 12's (2.36): Ubuntu 22.04's (2.35) is.
ARG CUDA_IMAGE=docker.io/nvidia/cuda:13.0.0-devel-ubuntu22.04

FROM ${CUDA_IMAGE} AS cuda

FROM ${DEBIAN_IMAGE} AS build
# The build's Debian packages (scripts/setup's, less the test, sanitizer and Python ones).
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      g++ make cmake libabsl-dev nlohmann-json3-dev libcli11-dev libgrpc++-dev \
      libprotobuf-dev protobuf-compiler protobuf-compiler-grpc prometheus-cpp-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY CMakeLists.txt ./
COPY kernels kernels
COPY proto proto
COPY client client
COPY service service
COPY tools tools
COPY python/CMakeLists.txt python/CMakeLists.txt
# SPIN_CUDA: ON (fail without a toolkit), AUTO or OFF (a CPU-only image). CUDA_ARCHS: the
# GPU architectures compiled for (90: Hopper).
ARG SPIN_CUDA=ON
ARG CUDA_ARCHS=90
ARG JOBS=2
RUN --mount=type=bind,from=cuda,source=/usr/local/cuda,target=/usr/local/cuda \
    cmake -S . -B /build -DCMAKE_BUILD_TYPE=Release -DBUILD_TESTING=OFF \
      -DSPIN_CUDA=${SPIN_CUDA} -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHS} \
 && cmake --build /build -j${JOBS} --target spind spinctl \
 && strip /build/service/spind /build/tools/spinctl/spinctl \
 && mkdir -p /out && cp /build/service/spind /build/tools/spinctl/spinctl /out/

FROM ${DEBIAN_IMAGE} AS runtime
# Only the shared libraries spind and spinctl load. The CUDA runtime is linked statically and
# the driver (libcuda) is found at run time: the NVIDIA container runtime mounts it.
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      libgrpc++1.51 libprotobuf32 libprometheus-cpp-pull1.0 libprometheus-cpp-core1.0 \
      libabsl20220623 \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /run/spin
COPY --from=build /out/spind /out/spinctl /usr/local/bin/
ARG VERSION=0.1.0
ARG REVISION=unknown
LABEL org.opencontainers.image.title="spind" \
      org.opencontainers.image.description="SPIN (Shadow Predictive Indexer) sidecar daemon for indexer-based sparse attention" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}"
# All GPUs of the node, and the driver's compute part, when run with the NVIDIA runtime.
ENV NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    CUDA_DEVICE_ORDER=PCI_BUS_ID
# Root, so that it can bind in a root-owned host directory (hostPath /run/spin); the chart
# drops every capability and makes the root filesystem read-only (deploy/README.md).
USER 0
ENTRYPOINT ["/usr/local/bin/spind"]
