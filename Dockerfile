# The Rekindle NRI plugin image (the DaemonSet of charts/rekindle runs it).
#
#   docker build -t <registry>/rekindle/plugin:0.1.0 .
#
# CRIU 4.2.1 is built from Debian's upstream tarball by hack/build-criu.sh (trixie's
# 4.1.1 cannot dump TCP sockets on kernels >= 6.16; 3.17 fails on current kernels).
# The static in-container init is built here and installed where the plugin looks
# for it; the plugin copies it to <state dir>/bin on the node.
# hack/build-plugin-image.sh builds an equivalent image without docker.
ARG BASE=debian:trixie-slim

FROM ${BASE} AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev make python3 python3-venv \
      curl ca-certificates xz-utils pkg-config libprotobuf-c-dev protobuf-c-compiler \
      protobuf-compiler python3-protobuf libnl-3-dev libnet1-dev libcap-dev libbsd-dev \
      libgnutls28-dev libnftables-dev uuid-dev libaio-dev patch \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN REKINDLE_CRIU_PREFIX=/opt/criu REKINDLE_CRIU_SKIP_CHECK=1 hack/build-criu.sh \
 && make build/rekindle-init build/hostexec/rekindle-hostexec \
 && python3 -m venv /opt/rekindle \
 && /opt/rekindle/bin/pip install --no-cache-dir '.[kubernetes]' \
 && /opt/rekindle/bin/rekindle --help >/dev/null

FROM ${BASE}
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 util-linux iproute2 tar ca-certificates \
      libprotobuf-c1 libnl-3-200 libnet1 libcap2 libbsd0 libgnutls30t64 libnftables1 libuuid1 libaio1t64 \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/criu/sbin/criu /usr/local/sbin/criu
RUN criu --version
COPY --from=build /opt/rekindle /opt/rekindle
COPY --from=build /src/build/rekindle-init /usr/local/lib/rekindle/rekindle-init
# CRIU in the host's mount namespace (runtime/container/hostview.py): the launcher and its shims
COPY --from=build /src/build/hostexec /usr/local/lib/rekindle/hostexec
ENV PATH=/opt/rekindle/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PYTHONDONTWRITEBYTECODE=1
ENTRYPOINT ["rekindle"]
CMD ["--help"]
