#!/usr/bin/env bash
# Check that the image's Python set is closed and consistent, without building the image:
# requirements/lock.txt as the Dockerfile filters it + requirements/lock-cuda.txt + torch's CUDA
# build + DeepSpeed's requirements, resolved by uv for linux x86_64 / the image's CPython.
# A resolver that adds, drops or changes nothing proves `--no-deps` installs a complete set.
# Needs uv, PyPI (metadata only) and the project's venv. Run after changing either lock file.
#   usage: deploy/check-image-lock.sh
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
uv="${UV:-uv}"
command -v "${uv}" >/dev/null || { echo "needs uv (pip install uv)" >&2; exit 2; }
arg() { sed -n "s/^ARG $1=\"\{0,1\}\([^\"]*\)\"\{0,1\}$/\1/p" "${root}/Dockerfile" | head -1; }
# the image's exact CPython (the base's tag, python:X.Y.Z-…): packages may require a patch level
python_version="$(arg BASE_IMAGE | sed -n 's/^python:\([0-9][0-9.]*[0-9]\)-.*/\1/p')"
torch_version="$(arg TORCH_VERSION)"
exclude="$(grep -o "grep -v -E '[^']*'" "${root}/Dockerfile" | head -1 | sed "s/^grep -v -E '//; s/'\$//")"
[[ -n "${python_version}" && -n "${torch_version}" && -n "${exclude}" ]] || { echo "cannot read the Dockerfile" >&2; exit 2; }

work="$(mktemp -d)"; trap 'rm -rf "${work}"' EXIT
grep -v -E "${exclude}" "${root}/requirements/lock.txt" > "${work}/image.txt"
grep -E '^[A-Za-z0-9_.-]+==' "${root}/requirements/lock-cuda.txt" | sed 's/ *\\$//' >> "${work}/image.txt"
echo "torch==${torch_version%%+*}" >> "${work}/image.txt"        # PyPI's 2.13.0 is the same CUDA build
ds="$(grep '^deepspeed==' "${root}/requirements/lock.txt")"
# DeepSpeed is an sdist whose metadata needs torch to build: read its requirements from the
# project's venv, where the same pinned version is installed.
"${PYTHON:-${root}/.venv/bin/python}" - "${ds#deepspeed==}" >> "${work}/image.txt" <<'PY'
import importlib.metadata as md, sys
assert md.version("deepspeed") == sys.argv[1], f"venv has deepspeed {md.version('deepspeed')}, lock {sys.argv[1]}"
print("\n".join(r for r in md.requires("deepspeed") or [] if "extra ==" not in r))
PY
"${uv}" pip compile --quiet --no-config --index-url https://pypi.org/simple \
  --python-version "${python_version}" --python-platform x86_64-manylinux_2_28 \
  --no-annotate --no-header "${work}/image.txt" -o "${work}/resolved.txt"
python3 - "${work}/image.txt" "${work}/resolved.txt" <<'PY'
import re, sys
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
def pins(path):
    out = {}
    for line in open(path):
        line = line.strip()
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==", 1)
            out[norm(name.split("[")[0])] = version.split()[0].rstrip("\\")
    return out
want, got = pins(sys.argv[1]), pins(sys.argv[2])
added = {k: got[k] for k in got.keys() - want.keys()}
changed = {k: (want[k], got[k]) for k in want.keys() & got.keys() if want[k] != got[k]}
if added or changed or want.keys() - got.keys():
    sys.exit(f"image set not closed: added {added}, changed {changed}, dropped {want.keys() - got.keys()}")
print(f"ok: {len(got)} packages, closed and consistent for the image")
PY
