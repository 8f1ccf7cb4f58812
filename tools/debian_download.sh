#!/usr/bin/env bash
# Download Debian packages (.deb files) without installing anything: apt with its own lists and
# cache under --work, for the suite and architecture asked for, from the Debian archive this
# machine's apt already uses (or --mirror). The .deb files land in WORK/debs.
#
# Usage: tools/debian_download.sh --work DIR --suite SUITE [--arch ARCH] [--mirror URI]
#          PACKAGE[=VERSION] ...
set -euo pipefail
work=""
suite=""
arch=""
mirror=""
packages=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --work) work="$2"; shift 2 ;;
    --suite) suite="$2"; shift 2 ;;
    --arch) arch="$2"; shift 2 ;;
    --mirror) mirror="$2"; shift 2 ;;
    -*) echo "debian_download: unknown option '$1'" >&2; exit 2 ;;
    *) packages+=("$1"); shift ;;
  esac
done
[[ -n "$work" && -n "$suite" && ${#packages[@]} -gt 0 ]] || {
  echo "debian_download: --work, --suite and at least one package are required" >&2; exit 2; }
if [[ -z "$mirror" ]]; then
  mirror="$(apt-get indextargets --format '$(REPO_URI)' 'Origin: Debian' 2>/dev/null |
            grep -v security | head -n 1 || true)"
fi
mirror="${mirror%/}"
[[ -n "$mirror" ]] || {
  echo "debian_download: no Debian archive in this machine's apt sources; pass --mirror URI" >&2
  exit 1; }
mkdir -p "$work"/{lists/partial,cache/archives/partial,debs}
options="signed-by=/usr/share/keyrings/debian-archive-keyring.gpg${arch:+ arch=$arch}"
echo "deb [$options] $mirror $suite main contrib non-free" > "$work/sources.list"
apt_opts=(-o "Dir::Etc::SourceList=$work/sources.list" -o "Dir::Etc::SourceParts=/dev/null"
          -o "Dir::State::Lists=$work/lists" -o "Dir::Cache=$work/cache"
          -o "APT::Sandbox::User=root")
if [[ -n "$arch" ]]; then
  apt_opts+=(-o "APT::Architecture=$arch" -o "APT::Architectures::=$arch")
fi
echo "debian_download: $suite${arch:+ ($arch)} from $mirror" >&2
apt-get "${apt_opts[@]}" update -qq >&2
(cd "$work/debs" && apt-get "${apt_opts[@]}" download -qq "${packages[@]}") >&2
