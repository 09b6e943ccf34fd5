#!/usr/bin/env bash
# Builds Keel's container images locally, with no registry: every Go service
# as a static binary in an image FROM scratch, and Redis from Debian's
# redis-server with the shared libraries it needs.
#
#   scripts/images.sh [TAG]        (default tag: dev)
set -euo pipefail
TAG=${1:-dev}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
command -v docker >/dev/null || { echo "images: docker not found" >&2; exit 1; }
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

# [EXTRA="PACKAGE..."] go_image NAME PACKAGE [PORT...]
go_image() {
  local name=$1 pkg=$2; shift 2
  local root="$WORK/$name"
  mkdir -p "$root/etc/ssl/certs" "$root/tmp" "$root/data"
  chmod 1777 "$root/tmp"; chmod 0777 "$root/data"
  CGO_ENABLED=0 go build -trimpath -ldflags='-s -w' -o "$root/app" "$pkg"
  # EXTRA: more binaries beside /app (the output service finds its plugins
  # in its own directory).
  for extra in ${EXTRA:-}; do
    CGO_ENABLED=0 go build -trimpath -ldflags='-s -w' -o "$root/$(basename "$extra")" "$extra"
  done
  [ -f /etc/ssl/certs/ca-certificates.crt ] && cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/"
  printf 'root:x:0:0:root:/:/sbin/nologin\nnobody:x:65534:65534:nobody:/:/sbin/nologin\n' > "$root/etc/passwd"
  printf 'root:x:0:\nnogroup:x:65534:\n' > "$root/etc/group"
  local changes=(-c 'ENTRYPOINT ["/app"]' -c 'USER 65534:65534' -c 'WORKDIR /data')
  for p in "$@"; do changes+=(-c "EXPOSE $p"); done
  tar -C "$root" --numeric-owner --owner=0 --group=0 -c . | docker import "${changes[@]}" - "keel/$name:$TAG" >/dev/null
  echo "built keel/$name:$TAG"
}

redis_image() {
  local bin root="$WORK/redis"
  bin=$(command -v redis-server) || { echo "images: redis-server not installed (make deps)" >&2; return 1; }
  mkdir -p "$root/usr/bin" "$root/etc" "$root/tmp" "$root/data"
  chmod 1777 "$root/tmp"; chmod 0777 "$root/data"
  cp -L "$bin" "$root/usr/bin/redis-server"   # argv[0] picks the mode: keep the name
  ldd "$bin" | awk '/=> \//{print $3} /^[[:space:]]*\//{print $1}' | while read -r lib; do
    mkdir -p "$root$(dirname "$lib")"; cp -L "$lib" "$root$lib"
  done
  printf 'root:x:0:0:root:/:/sbin/nologin\nnobody:x:65534:65534:nobody:/:/sbin/nologin\n' > "$root/etc/passwd"
  printf 'root:x:0:\nnogroup:x:65534:\n' > "$root/etc/group"
  tar -C "$root" --numeric-owner --owner=0 --group=0 -c . | docker import \
    -c 'USER 65534:65534' -c 'EXPOSE 6379' -c 'WORKDIR /data' -c 'ENTRYPOINT ["/usr/bin/redis-server"]' \
    -c 'CMD ["--bind","0.0.0.0","--protected-mode","no","--save","","--appendonly","yes"]' - "keel/redis:$TAG" >/dev/null
  echo "built keel/redis:$TAG"
}

go_image edge ./services/edge/cmd/keel-edge 1883 8083 8883 7411 9100
go_image router ./services/router/cmd/keel-router
go_image coordinator ./services/coordinator/cmd/keel-coordinator
go_image persistence ./services/persistence/cmd/keel-persistence
EXTRA="./services/output/cmd/keel-output-kafka ./services/output/cmd/keel-output-http ./services/output/cmd/keel-output-filter ./services/output/cmd/keel-output-json-map" \
  go_image output ./services/output/cmd/keel-output 9310 9100
redis_image
