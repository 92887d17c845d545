#!/usr/bin/env bash
# Runs stagewise's Bazel test suite inside a Debian 13 "trixie" chroot, i.e. against LibTorch 2.6,
# g++ 14 and doctest 2.4.11 from Debian 13. The LibTorch 2.x leg of .ci/run; see --help.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: tools/debian13.sh [--rebuild] [--prepare] [--shell | --command CMD] [--cuda DIR]
                         [-- BAZEL_ARGS...]

Runs `bazel test //...` (or BAZEL_ARGS) on this checkout inside a Debian 13 (trixie) minbase
chroot, so the library is built and tested against Debian 13's LibTorch 2.6. Needs root (mounts,
chroot), debootstrap (installed with apt-get when missing) and Debian's archive.

The chroot is made once with `debootstrap --variant=minbase trixie` plus the packages ./bazelw
names, and kept at a fixed path; it is rebuilt when missing or stale (its stamp holds a hash of
the recipe: suite, mirror, package list). The checkout is bind-mounted at /src/stagewise inside
the chroot, so the chroot's Bazel output base (and its cache) is shared by every clone. proc, sys
and dev are mounted while it runs; on exit, failure or interrupt the chroot's Bazel server is shut
down and every mount is removed.

Options:
  --rebuild   make the chroot again even when its stamp is current
  --prepare   only make sure the chroot is ready (no Bazel run)
  --shell     open a shell in the chroot (checkout at /src/stagewise) instead of running Bazel
  --command CMD  run the shell command CMD in the checkout inside the chroot instead of Bazel
  --cuda DIR  bind-mount the CUDA toolkit DIR read-only at /usr/local/cuda inside the chroot
  -h, --help  this text

Environment:
  STAGEWISE_DEBIAN13_ROOT    the chroot's path (default /var/cache/stagewise/debian13)
  STAGEWISE_DEBIAN_MIRROR    Debian archive to bootstrap from (default http://deb.debian.org/debian)

Examples:
  tools/debian13.sh                                   # the whole suite on LibTorch 2.6
  tools/debian13.sh -- test //tests/runtime:split_backward_test
  tools/debian13.sh -- run //examples:quickstart
  tools/debian13.sh --cuda /usr/local/cuda --command tools/cuda_compile_check.sh
EOF
}

rebuild=0
mode=bazel
command=""
cuda=""
bazel_args=()
while (($#)); do
  case $1 in
    --rebuild) rebuild=1 ;;
    --prepare) mode=prepare ;;
    --shell) mode=shell ;;
    --command) mode=command; command=$2; shift ;;
    --cuda) cuda=$2; shift ;;
    -h | --help) usage; exit 0 ;;
    --) shift; bazel_args=("$@"); break ;;
    *) echo "debian13: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
((${#bazel_args[@]})) || bazel_args=(test //... --keep_going)

if [[ $(id -u) -ne 0 ]]; then
  echo "debian13: needs root for debootstrap, mount and chroot; run it with sudo" >&2
  exit 2
fi

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
root=${STAGEWISE_DEBIAN13_ROOT:-/var/cache/stagewise/debian13}
mirror=${STAGEWISE_DEBIAN_MIRROR:-http://deb.debian.org/debian}
inside=/src/stagewise  # the checkout's fixed path inside the chroot

# The packages are ./bazelw's own list, so the chroot has what a fresh machine would install.
eval "$(sed -n '/^packages=(/,/)/p' "$repo/bazelw")"
recipe="stagewise-debian13 v1|trixie|minbase|$mirror|${packages[*]}"
stamp=$(printf '%s' "$recipe" | sha256sum | cut -d' ' -f1)

log() { echo "debian13: $*" >&2; }

# Mount points under $1, deepest first.
mounts_under() {
  awk -v p="$1" '$2 == p || index($2, p "/") == 1 { print $2 }' /proc/mounts | sort -r
}

# Ends processes still running inside the chroot $1 (the Bazel server and what it spawned):
# only processes whose root directory is this chroot, one by one, by id.
end_chroot_processes() {
  local pid link
  for link in /proc/[0-9]*/root; do
    pid=${link#/proc/}
    pid=${pid%/root}
    [[ $(readlink "$link" 2>/dev/null) == "$1" ]] && kill "$pid" 2>/dev/null || true
  done
}

unmount_all() {
  local m
  for m in $(mounts_under "$1"); do
    umount "$m" 2>/dev/null || { sleep 1; umount "$m" 2>/dev/null; } ||
      { log "lazy unmount of busy $m"; umount -l "$m"; }
  done
}

mount_all() {
  local dir=$1
  mount -t proc proc "$dir/proc"
  mount -t sysfs sysfs "$dir/sys"
  mount --bind /dev "$dir/dev"
  mkdir -p "$dir/dev/pts" 2>/dev/null || true
  if [[ -n ${2:-} ]]; then
    mkdir -p "$dir$inside"
    mount --bind "$2" "$dir$inside"
  fi
  if [[ -n ${3:-} ]]; then
    mkdir -p "$dir/usr/local/cuda"
    mount --bind "$3" "$dir/usr/local/cuda"
    mount -o remount,bind,ro "$dir/usr/local/cuda"
  fi
}

# Runs a command in chroot $1 with a clean environment; `exec`s, so in the background its process
# id is the command's own (a signal reaches it, not a shell around it).
in_chroot() {
  local dir=$1
  shift
  exec chroot "$dir" /usr/bin/env -i HOME=/root LANG=C.UTF-8 TERM="${TERM:-dumb}" \
    PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin CI="${CI:-}" \
    DEBIAN_FRONTEND=noninteractive "$@"
}
chrooted() { (in_chroot "$@"); }

# Safety: a tree is removed only when nothing is mounted below it (a bind-mounted checkout would be
# deleted with it), and never across file systems.
remove_tree() {
  [[ -e $1 ]] || return 0
  end_chroot_processes "$1"
  unmount_all "$1"
  if [[ -n $(mounts_under "$1") ]]; then
    log "refusing to delete $1: still mounted: $(mounts_under "$1" | tr '\n' ' ')"
    exit 1
  fi
  rm -rf --one-file-system "$1"
}

build_chroot() {
  local new=$root.new
  command -v debootstrap >/dev/null || {
    log "installing debootstrap"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap >&2 ||
      { apt-get update -q >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap >&2; }
  }
  remove_tree "$new"
  mkdir -p "$(dirname "$root")"
  log "debootstrap --variant=minbase trixie $new $mirror"
  debootstrap --variant=minbase trixie "$new" "$mirror" >&2
  cp /etc/resolv.conf "$new/etc/resolv.conf" 2>/dev/null || true
  building=$new
  mount_all "$new"
  log "installing ${packages[*]}"
  chrooted "$new" apt-get update -q >&2
  chrooted "$new" apt-get install -y -q --no-install-recommends "${packages[@]}" >&2
  chrooted "$new" apt-get clean
  unmount_all "$new"
  building=""
  echo "$stamp" >"$new/.stagewise-stamp"
  remove_tree "$root"
  mv "$new" "$root"
  log "chroot ready at $root ($(du -sh --one-file-system "$root" | cut -f1))"
}

building=""
running=0
child=""
cleanup() {
  local rc=$?
  set +e
  # An interrupted run: the command in the chroot goes first. Bazel's client cancels its build on
  # INT (it installs its own handler); whatever ignores INT gets TERM ten seconds later.
  if [[ -n $child ]] && kill -INT "$child" 2>/dev/null; then
    for _ in 1 2 3 4 5 6 7 8 9 10; do kill -0 "$child" 2>/dev/null || break; sleep 1; done
    kill -TERM "$child" 2>/dev/null
    wait "$child" 2>/dev/null
  fi
  if ((running)); then
    chrooted "$root" /bin/sh -c "cd $inside && bazel shutdown" >/dev/null 2>&1
    end_chroot_processes "$root"
    unmount_all "$root"
  fi
  [[ -n $building ]] && { end_chroot_processes "$building"; unmount_all "$building"; }
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM HUP

# One run at a time per chroot: a second waits for the first.
mkdir -p "$(dirname "$root")"
exec 9>"$root.lock"
flock 9

# Mounts left by a run that was killed outright (SIGKILL: no trap) are removed first.
if [[ -d $root && -n $(mounts_under "$root") ]]; then
  log "removing mounts left by an earlier run"
  end_chroot_processes "$root"
  unmount_all "$root"
fi

if ((rebuild)) || [[ ! -f $root/.stagewise-stamp || $(<"$root/.stagewise-stamp") != "$stamp" ]]; then
  log "chroot at $root is missing or stale: building it (a few minutes)"
  build_chroot
fi
[[ $mode == prepare ]] && exit 0

running=1
mount_all "$root" "$repo" "$cuda"
if [[ $mode == shell ]]; then
  chrooted "$root" /bin/bash -c "cd $inside && exec bash -i"
  exit
fi
# The command runs in the background and the script waits for it, so that a TERM or INT sent to
# this script alone is handled at once (bash runs traps only between foreground commands).
if [[ $mode == command ]]; then
  in_chroot "$root" /bin/bash -c 'cd "$0" && eval "$1"' "$inside" "$command" &
  child=$!
  wait "$child"
  exit
fi
# --symlink_prefix=/: no bazel-* links in the checkout (they would point into the chroot).
# --spawn_strategy=local: Bazel's Linux sandbox needs namespaces a chroot may not offer.
[[ ${bazel_args[0]} == test || ${bazel_args[0]} == build || ${bazel_args[0]} == run ]] &&
  extra=(--symlink_prefix=/ --spawn_strategy=local) || extra=()
in_chroot "$root" /bin/bash -c 'cd "$0" && exec ./bazelw "$@"' "$inside" "${bazel_args[0]}" \
  "${extra[@]}" "${bazel_args[@]:1}" &
child=$!
wait "$child"
