#!/usr/bin/env bash
# What the sandbox runtime (src/tidal/sandbox, docs/sandbox.md) needs on a fresh Debian 12
# machine, as root. Idempotent: installs nothing when everything is present.
#
#   bubblewrap   bwrap, the sandbox launcher (0.8.0 in Debian 12)
#   python3      Debian's /usr/bin/python3: the default image's python (the host's own
#                python may live in a private directory such as /root/.pyenv)
#   procps       ps, for people and tests inside sandboxes
#
# Kernel features it uses (present on these machines; checked, not installed): overlayfs,
# user namespaces, cgroup v1 memory/pids/freezer/cpuacct. Without cgroup v1 the runtime
# falls back to rlimits + SIGSTOP (no process-count limit) and the limit tests skip.
# CRIU is not installed on purpose: Debian 12's criu 3.17 fails `criu check` on this
# kernel ("vdso: Unexpected rt vDSO area bounds"); snapshots fall back to layer + log.
set -euo pipefail

need=()
command -v bwrap >/dev/null 2>&1 || need+=(bubblewrap)
[ -x /usr/bin/python3 ] || need+=(python3)
command -v ps >/dev/null 2>&1 || need+=(procps)

if [ ${#need[@]} -gt 0 ]; then
    if [ "$(id -u)" -ne 0 ]; then
        echo "sandbox-deps: not root: cannot install ${need[*]}; sandbox tests will skip" >&2
        exit 0
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
    echo "sandbox-deps: installed ${need[*]}"
fi

warn() { echo "sandbox-deps: warning: $*" >&2; }
grep -qw overlay /proc/filesystems || modprobe overlay 2>/dev/null \
    || warn "overlayfs is not available: sandboxes cannot start"
[ "$(cat /proc/sys/user/max_user_namespaces 2>/dev/null || echo 0)" != 0 ] \
    || warn "user namespaces are disabled (user.max_user_namespaces=0): sandboxes cannot start"
for c in memory pids freezer cpuacct; do
    grep -qE " - cgroup [^ ]+ ([^ ]*,)?$c(,[^ ]*)?\$" /proc/self/mountinfo \
        || warn "cgroup v1 '$c' is not mounted: limits fall back to rlimits"
done
exit 0
