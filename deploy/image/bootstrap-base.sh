#!/usr/bin/env bash
# Build the CI base image where no image registry can be reached: the stand-in for the
# production base python:3.11.7-slim-bookworm (CPython 3.11.7 under /usr/local on Debian
# bookworm slim). A bookworm root file system made by debootstrap from the package mirror (the
# same suites as the upstream image, so the Dockerfile's apt-get sees the same archive), plus
# this machine's CPython of the same version (MFT_BASE_PYTHON, default: the python3.11 on PATH;
# its site-packages stay out), imported with `docker import`.
#   usage: deploy/image/bootstrap-base.sh TAG          (needs root, debootstrap, a Docker engine)
set -euo pipefail
tag="${1:?usage: bootstrap-base.sh TAG}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
security="${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}"
docker="${DOCKER:-docker}"
want_python="${MFT_BASE_PYTHON_VERSION:-3.11.7}"
prefix="${MFT_BASE_PYTHON:-$(python3.11 -c 'import sys; print(sys.base_prefix)')}"
got_python="$("${prefix}/bin/python3.11" -c 'import platform; print(platform.python_version())')"
[[ "${got_python}" == "${want_python}" ]] || {
  echo "${prefix} has CPython ${got_python}; the image needs ${want_python} (set MFT_BASE_PYTHON)" >&2; exit 2; }
[[ -f "${prefix}/lib/libpython3.11.so.1.0" ]] || { echo "${prefix}: needs a --enable-shared CPython build" >&2; exit 2; }
command -v debootstrap >/dev/null || { echo "needs debootstrap (apt-get install -y debootstrap)" >&2; exit 2; }

root="$(mktemp -d /var/tmp/mft-base.XXXXXX)"
trap 'rm -rf "${root}"' EXIT
# minbase: dpkg, apt and the essential set, as in debian:*-slim
# + the shared libraries CPython's extension modules link (what python:*-slim carries)
debootstrap --variant=minbase --components=main \
  --include=ca-certificates,netbase,tzdata,libssl3,libffi8,libsqlite3-0,libbz2-1.0,liblzma5,libreadline8,libncursesw6,zlib1g,libuuid1,libexpat1,libnsl2,libtirpc3 \
  bookworm "${root}" "${mirror}"
tar -C "${prefix}" --exclude='./lib/python3.11/site-packages/*' --exclude='./lib/python3.11/test' \
    --exclude='__pycache__' -c . | tar -C "${root}/usr/local" -x
ln -sf python3.11 "${root}/usr/local/bin/python3"; ln -sf python3 "${root}/usr/local/bin/python"
chroot "${root}" ldconfig
chroot "${root}" /usr/local/bin/python3.11 -c 'import ssl, sqlite3, ctypes, lzma, bz2, zlib, uuid, venv, ensurepip, readline'
cat > "${root}/etc/apt/sources.list" <<SOURCES
deb ${mirror} bookworm main
deb ${mirror} bookworm-updates main
deb ${security} bookworm-security main
SOURCES
# what debian:*-slim drops: apt lists, caches, man pages and docs
rm -rf "${root}"/var/lib/apt/lists/* "${root}"/var/cache/apt/*.bin "${root}"/var/cache/apt/archives/*.deb \
       "${root}"/usr/share/man/* "${root}"/usr/share/doc/* "${root}"/var/log/*.log
tar --numeric-owner -C "${root}" -c . | "${docker}" import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'CMD ["bash"]' - "${tag}"
echo "base image ${tag}: debootstrap bookworm (${mirror}) + CPython ${got_python} from ${prefix}"
