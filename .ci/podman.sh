#!/usr/bin/env bash
# Container engine for tidal's Docker-API runtime on a fresh Debian 12 machine, as root:
# Debian's podman (4.3) + runc, serving the Docker Engine API on a unix socket that the
# official `docker` Python SDK talks to (docker.DockerClient(base_url="unix://$SOCK")).
# No Docker daemon and no registry: the base image is built offline with debootstrap
# from Debian's mirror and imported as localhost/tidal-base:bookworm.
#
# Idempotent: a second run installs nothing, keeps the image and the running service,
# and only checks that the socket answers (~0.1 s). Exits 0 iff `GET /_ping` says OK.
# The last lines printed are the exports the tests need.
#
# Env (all optional):
#   TIDAL_PODMAN_SOCK   socket path (default /run/tidal-podman/podman.sock)
#   DEBIAN_MIRROR       mirror for debootstrap (default http://deb.debian.org/debian)
#
# Storage lives under /var/tmp/tidal-podman (see .ci/containers/storage.conf);
# `rm -rf /var/tmp/tidal-podman /run/tidal-podman` after stopping the service resets it.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CONF_DIR="$ROOT/.ci/containers"
SOCK="${TIDAL_PODMAN_SOCK:-/run/tidal-podman/podman.sock}"
RUN_DIR="$(dirname "$SOCK")"
STATE_DIR=/var/tmp/tidal-podman              # graphroot's parent (storage.conf)
PIDFILE="$RUN_DIR/podman-service.pid"
LOG="$STATE_DIR/podman-service.log"
IMAGE=localhost/tidal-base:bookworm
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"

# Our own config files instead of /etc/containers: podman reads these two variables, and
# every setting these machines need (cgroupfs, runc, ulimits, storage path) is in them.
export CONTAINERS_CONF="$CONF_DIR/containers.conf"
export CONTAINERS_STORAGE_CONF="$CONF_DIR/storage.conf"

log() { echo "podman.sh: $*" >&2; }
ping_ok() { [ -S "$SOCK" ] && [ "$(curl -s -m 5 --unix-socket "$SOCK" http://d/_ping 2>/dev/null)" = OK ]; }

if [ "$(id -u)" -ne 0 ]; then
    # Rootful on purpose: rootless podman needs subuids, slirp4netns and fuse-overlayfs,
    # and cannot set cgroup v1 limits (memory/pids/cpu) at all.
    log "must run as root"; exit 1
fi

# --- 1. packages --------------------------------------------------------------------
#   podman runc conmon  the engine; runc because Debian's podman defaults to crun
#   containernetworking-plugins  CNI, podman 4.3's network backend (named explicitly so
#                       apt does not pick netavark, which needs aardvark-dns as well)
#   catatonit           the init for `init=True` containers (reaps zombies: see report)
#   iptables            bridge networking's NAT (only for network_mode="bridge")
#   debootstrap         builds the base image offline;  curl  the _ping check
# Not installed: uidmap, slirp4netns, fuse-overlayfs: rootless-only.
need=()
for p in podman runc conmon containernetworking-plugins catatonit iptables debootstrap curl; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    # wait for another apt (make test runs installs side by side) instead of failing
    apt-get -o DPkg::Lock::Timeout=300 update -qq
    apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends "${need[@]}" >/dev/null
    log "installed ${need[*]}"
fi

mkdir -p "$RUN_DIR" "$STATE_DIR"

# --- 2. base image ------------------------------------------------------------------
# minbase bookworm + python3 (the runtime's exec helpers) + procps (ps/pkill for tests
# and for killing timed-out commands from inside). bash is in minbase. ~45 s, ~170 MB.
if ! podman image exists "$IMAGE"; then
    log "building $IMAGE with debootstrap from $MIRROR"
    rootfs="$(mktemp -d "$STATE_DIR/rootfs.XXXXXX")"
    trap 'rm -rf "$rootfs"' EXIT
    debootstrap --variant=minbase --include=python3,procps bookworm "$rootfs" "$MIRROR" >"$STATE_DIR/debootstrap.log" 2>&1 \
        || { log "debootstrap failed, see $STATE_DIR/debootstrap.log"; tail -20 "$STATE_DIR/debootstrap.log" >&2; exit 1; }
    # Drop the .debs and apt lists (~90 MB): containers run without network anyway.
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/lib/apt/lists/*
    mkdir -p "$rootfs/var/lib/apt/lists/partial"
    # --numeric-owner: keep the rootfs's uids, not the host's names for them.
    tar --numeric-owner -C "$rootfs" -c . | podman import --quiet \
        --change 'CMD ["/bin/bash"]' \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        - "$IMAGE" >/dev/null
    rm -rf "$rootfs"; trap - EXIT
    log "imported $IMAGE"
fi

# --- 3. API service -----------------------------------------------------------------
if ! ping_ok; then
    # A service we started earlier that no longer answers: stop it (by its pid file only).
    if [ -f "$PIDFILE" ]; then
        old="$(cat "$PIDFILE")"
        if [ -n "$old" ] && tr '\0' ' ' <"/proc/$old/cmdline" 2>/dev/null | grep -q 'system service' ; then
            log "restarting unresponsive service (pid $old)"
            kill "$old" 2>/dev/null || true; sleep 1; kill -9 "$old" 2>/dev/null || true
        fi
        rm -f "$PIDFILE"
    fi
    rm -f "$SOCK"   # a stale socket file makes the new service fail to bind
    # --time=0: never exit when idle (the default is 5 s). setsid + nohup: outlive this
    # script and its terminal; the environment above carries the config to the service.
    # From the state directory: conmon writes its `oom` marker files into the service's
    # working directory, which must not be the caller's (a repository's root).
    (cd "$STATE_DIR" && exec setsid nohup podman system service --time=0 "unix://$SOCK" \
        >>"$LOG" 2>&1 </dev/null) &
    echo $! >"$PIDFILE"
    for _ in $(seq 100); do ping_ok && break; sleep 0.2; done
    ping_ok || { log "service did not answer on $SOCK; see $LOG"; tail -20 "$LOG" >&2; exit 1; }
    log "service started (pid $(cat "$PIDFILE"), log $LOG)"
fi

echo "export DOCKER_HOST=unix://$SOCK"
echo "export CONTAINERS_CONF=$CONTAINERS_CONF"
echo "export CONTAINERS_STORAGE_CONF=$CONTAINERS_STORAGE_CONF"
exit 0
