# Shared by deploy/image/*.sh (sourced): a Docker engine that touches only loopback, started
# here when none answers and stopped again by the same script; the image names CI uses.
# Never creates a network bridge: dockerd runs with --bridge=none --iptables=false, and every
# build and container uses --network host (loopback only) or none.

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# BuildKit needs the buildx plugin with a Docker CLI >= 23; Debian's docker.io CLI (20.10) has
# BuildKit built in. Take the first that can build.
if [[ -z "${DOCKER:-}" ]]; then
  DOCKER=docker
  if ! docker buildx version >/dev/null 2>&1 && [[ -x /usr/bin/docker ]]; then DOCKER=/usr/bin/docker; fi
fi
export DOCKER
# the CPU image by default; MFT_TORCH_VARIANT=cu130 builds the GPU variant under its own name
if [[ "${MFT_TORCH_VARIANT:-cpu}" == cpu ]]; then MFT_IMAGE="${MFT_IMAGE:-mft:ci}"; else MFT_IMAGE="${MFT_IMAGE:-mft:ci-${MFT_TORCH_VARIANT}}"; fi
MFT_BASE_IMAGE="${MFT_BASE_IMAGE:-mft-base:bookworm}"
state="${MFT_IMAGE_STATE:-${root}/.cache/image}"
mkdir -p "${state}"
_started_dockerd=""

log() { printf '[image %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }

engine_up() {
  if "${DOCKER}" info >/dev/null 2>&1; then return 0; fi
  command -v dockerd >/dev/null || { log "no Docker engine: apt-get install -y docker.io (as root)"; return 2; }
  log "starting dockerd (--bridge=none --iptables=false; log ${state}/dockerd.log)"
  dockerd --bridge=none --iptables=false --ip6tables=false \
    --pidfile "${state}/dockerd.pid" >"${state}/dockerd.log" 2>&1 &
  _started_dockerd=$!
  for _ in $(seq 60); do
    "${DOCKER}" info >/dev/null 2>&1 && return 0
    kill -0 "${_started_dockerd}" 2>/dev/null || { tail -20 "${state}/dockerd.log" >&2; return 2; }
    sleep 1
  done
  log "dockerd did not answer within 60 s"; tail -20 "${state}/dockerd.log" >&2; return 2
}

# Stop only what this script started: its containers (callers remove them) and its dockerd.
engine_down() {
  if [[ -n "${_started_dockerd}" ]]; then
    log "stopping dockerd (pid ${_started_dockerd})"
    kill -TERM "${_started_dockerd}" 2>/dev/null || true
    for _ in $(seq 30); do kill -0 "${_started_dockerd}" 2>/dev/null || break; sleep 1; done
    _started_dockerd=""
  fi
}

base_image_up() {
  if "${DOCKER}" image inspect "${MFT_BASE_IMAGE}" >/dev/null 2>&1; then return 0; fi
  log "bootstrapping ${MFT_BASE_IMAGE} with debootstrap"
  "${root}/deploy/image/bootstrap-base.sh" "${MFT_BASE_IMAGE}"
}
