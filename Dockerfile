# The Rekindle NRI plugin image (the DaemonSet of charts/rekindle runs it).
#
#   docker build -t <registry>/rekindle/plugin:0.1.0 .
#
# Debian trixie ships CRIU 4.1.1 (>= 4.1 is required; 3.17 fails on current
# kernels). The static in-container init is built here and installed where the
# plugin looks for it; the plugin copies it to <state dir>/bin on the node.
# hack/build-plugin-image.sh builds an equivalent image without docker.
ARG BASE=debian:trixie-slim

FROM ${BASE} AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev make python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN make build/rekindle-init \
 && python3 -m venv /opt/rekindle \
 && /opt/rekindle/bin/pip install --no-cache-dir . \
 && /opt/rekindle/bin/rekindle --help >/dev/null

FROM ${BASE}
RUN apt-get update \
 && apt-get install -y --no-install-recommends criu python3 util-linux iproute2 tar ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && criu --version
COPY --from=build /opt/rekindle /opt/rekindle
COPY --from=build /src/build/rekindle-init /usr/local/lib/rekindle/rekindle-init
ENV PATH=/opt/rekindle/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PYTHONDONTWRITEBYTECODE=1
ENTRYPOINT ["rekindle"]
CMD ["--help"]
