#!/usr/bin/env bash
# Build the daemon image here, from Debian's packages and the project's wheels: nothing
# is pulled from a container registry.
#
#   deploy/container/build-local.sh [IMAGE]        (default: localhost/spanwarm:<version>)
#
# Needs root, podman, mmdebstrap and runc (Debian: apt-get install podman mmdebstrap runc),
# and a Python 3.11 with pip (default: the checkout's .venv), whose installed versions of
# spanwarm's dependencies go into the image. The base, localhost/spanwarm-base:bookworm
# (Debian minbase with python3 and python3-venv), is made once and then reused; set
# SPANWARM_BASE_IMAGE to use another. The podman options this host needs
# (containers_opts below) are printed for `podman run`.
set -euo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
python=${PYTHON:-$repo/.venv/bin/python}
base=${SPANWARM_BASE_IMAGE:-localhost/spanwarm-base:bookworm}
version=$("$python" -c 'import tomllib,sys; print(tomllib.load(open(sys.argv[1],"rb"))["project"]["version"])' "$repo/pyproject.toml")
image=${1:-localhost/spanwarm:$version}

for tool in podman mmdebstrap runc; do
    command -v "$tool" >/dev/null || { echo "build-local.sh: $tool is missing (apt-get install podman mmdebstrap runc)" >&2; exit 2; }
done
[ "$(id -u)" = 0 ] || { echo "build-local.sh: run as root (mmdebstrap, podman's storage)" >&2; exit 2; }

# Where the cgroup file system is not cgroup2 alone (a hybrid v1 host), crun refuses to
# start containers: use runc and cgroupfs. Podman's default ulimits can exceed the host's
# hard limits, which runc then fails to set: the host's descriptors, and 4,096 processes
# (the host's own hard limit on them was refused here too).
podman_opts=""
if [ "$(stat -fc %T /sys/fs/cgroup)" != cgroup2fs ]; then
    podman_opts="--runtime runc --cgroup-manager cgroupfs"
fi
ulimits="--ulimit nofile=$(ulimit -Hn):$(ulimit -Hn) --ulimit nproc=4096:4096"

# The wheels are built for the Python that builds them: it must be the base's.
want=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
if [ "$want" != 3.11 ] && [ -z "${SPANWARM_BASE_IMAGE:-}" ]; then
    echo "build-local.sh: $python is Python $want; Debian bookworm's is 3.11 (set PYTHON)" >&2
    exit 2
fi

if ! podman image exists "$base"; then
    echo "build-local.sh: making $base from Debian's packages"
    rootfs=$(mktemp -d)
    trap 'rm -rf "$rootfs"' EXIT
    # Documentation, manuals and translations are of no use in the image (a third of it).
    # Exit 3: no base (no Debian mirror reachable, say), which callers may tell apart.
    mmdebstrap --quiet --variant=minbase --include=python3,python3-venv \
        --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
        --dpkgopt='path-exclude=/usr/share/info/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
        bookworm "$rootfs/rootfs.tar" || { echo "build-local.sh: mmdebstrap failed" >&2; exit 3; }
    podman import --quiet "$rootfs/rootfs.tar" "$base" >/dev/null
    rm -rf "$rootfs"
    trap - EXIT
fi

# A context of only what the Containerfile copies, plus the wheels: spanwarm's own and
# its dependencies' at the versions this Python has installed (PyPI's, from pip's cache
# where it has them).
context=$(mktemp -d)
trap 'rm -rf "$context"' EXIT
(cd "$repo" && tar --exclude=__pycache__ -cf - pyproject.toml README.md src deploy/container) \
    | tar -xf - -C "$context"
"$python" -m pip freeze --exclude-editable >"$context/constraints.txt"
"$python" -m pip wheel --quiet --disable-pip-version-check --constraint "$context/constraints.txt" \
    --wheel-dir "$context/deploy/container/wheels" "$context"

# shellcheck disable=SC2086  # the options are words
podman $podman_opts build --quiet $ulimits --build-arg BASE="$base" \
    -f "$context/deploy/container/Containerfile" -t "$image" "$context" >/dev/null
echo "build-local.sh: built $image ($(podman image inspect --format '{{.Size}}' "$image") bytes)"
echo "build-local.sh: run it with: podman $podman_opts run $ulimits ... $image"
