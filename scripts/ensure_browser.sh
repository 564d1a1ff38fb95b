#!/usr/bin/env bash
# The browser tests drive the system Chromium (Debian's `chromium`). `make test` calls this first:
# it installs Chromium where it can (root, or passwordless sudo, with apt-get), and otherwise says
# exactly what to install; the browser tests then skip with the same message instead of failing.
set -u
CHROMIUM=${MFT_CHROMIUM:-/usr/bin/chromium}
[ -x "$CHROMIUM" ] && exit 0
command -v apt-get >/dev/null || { echo "ensure_browser: $CHROMIUM not found and no apt-get: install Chromium and set MFT_CHROMIUM; the browser tests will skip"; exit 0; }
if [ "$(id -u)" = 0 ]; then SUDO=; elif sudo -n true 2>/dev/null; then SUDO="sudo -n"; else
  echo "ensure_browser: $CHROMIUM not found: run 'sudo apt-get install -y chromium chromium-driver'; the browser tests will skip"; exit 0
fi
echo "ensure_browser: installing Debian's chromium (once)"
$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium chromium-driver >/dev/null \
  || echo "ensure_browser: apt-get install chromium failed; the browser tests will skip"
exit 0
