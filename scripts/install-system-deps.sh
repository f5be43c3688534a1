#!/usr/bin/env bash
# Best effort: the Debian packages that tests/test_monitor.py drives (Prometheus, headless
# Chromium, tmux). Installs only what is missing, only as root where apt-get exists, quietly;
# it never fails the run: without a binary, the tests that need it skip and say why.
# Usage: scripts/install-system-deps.sh   (CI calls it from .ci/run before the tests)
set -u

want=()
command -v prometheus >/dev/null 2>&1 || want+=(prometheus)
command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 \
  || want+=(chromium)
command -v tmux >/dev/null 2>&1 || want+=(tmux)
[ "${#want[@]}" -eq 0 ] && exit 0

note() { echo "install-system-deps: $*" >&2; }
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  note "not installing ${want[*]} (needs root and apt-get); the tests that use them will skip"
  exit 0
fi

log=$(mktemp /tmp/install-system-deps.XXXXXX.log)
export DEBIAN_FRONTEND=noninteractive
apt_opts=(-y -q --no-install-recommends -o DPkg::Lock::Timeout=120)
# Install the binaries, not the services: Debian's prometheus package would start a system
# Prometheus on :9090 where an init system runs. policy-rc.d (exit 101) forbids that, for
# this install only.
policy=/usr/sbin/policy-rc.d
own_policy=0
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 755 "$policy" && own_policy=1
fi
cleanup() { [ "$own_policy" -eq 1 ] && rm -f "$policy"; }
trap cleanup EXIT

start=$(date +%s)
if ! timeout 900 apt-get install "${apt_opts[@]}" "${want[@]}" >>"$log" 2>&1; then
  # A fresh machine may have no (or stale) package lists.
  if ! { timeout 300 apt-get update -q >>"$log" 2>&1 \
    && timeout 900 apt-get install "${apt_opts[@]}" "${want[@]}" >>"$log" 2>&1; }; then
    note "could not install ${want[*]} (log: $log); the tests that use them will skip"
    tail -n 5 "$log" >&2
    exit 0
  fi
fi
note "installed ${want[*]} in $(($(date +%s) - start)) s (log: $log)"
exit 0
