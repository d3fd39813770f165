#!/usr/bin/env bash
# Install NVIDIA perf_analyzer (from PyPI wheel perf-analyzer==2.60.0) into a
# private folder, without root and without touching the system's apt setup.
#
# Usage:  install_perf_analyzer.sh DEST_DIR
#
# On success the LAST line of stdout is the path of a runnable wrapper script,
# DEST_DIR/perf_analyzer, which passes all its arguments through to the real
# binary and works from any cwd. Re-running is cheap (idempotent).
#
# Why this is not just "pip install perf-analyzer":
#   * The real wheel is tagged manylinux_2_38, so pip on an older system only
#     finds an unrelated 0.1.0. We fetch it with `pip download --platform ...`.
#   * The binary needs glibc >= 2.38 and GLIBCXX_3.4.32. On Debian 12 (glibc
#     2.36) we download libc6, libstdc++6 and libgcc-s1 of Debian's current
#     *stable* release with apt-get (private source list, private lists and
#     cache folders), unpack them with `dpkg -x`, and run the binary through
#     that release's dynamic loader (`ld-linux-x86-64.so.2 --library-path ...`).
#     Other libs (libz, libssl, libcrypto) come from the host system.
#   * Where the binary runs directly (e.g. Debian 13), the wrapper just execs it.
#
# Environment overrides:
#   PIP                  pip command to use (default: python3 -m pip)
#   PYTHON               python used to unzip the wheel (default: python3)
#   PA_VERSION           perf-analyzer version (default 2.60.0)
#   PA_DEBIAN_MIRROR     Debian archive URI (default: read from
#                        /etc/apt/sources.list.d/debian.sources, then
#                        /etc/apt/sources.list, else http://deb.debian.org/debian)
#   PA_DEBIAN_SUITE      suite providing the newer glibc (default: stable)
#   PA_FORCE_LOADER=1    use the private loader even if the binary runs directly
#
# Layout of DEST_DIR:
#   perf_analyzer          wrapper script (the thing to run)
#   downloads/             the wheel and the .deb files
#   wheel/                 unpacked wheel (binary at wheel/perf_analyzer/bin/perf_analyzer)
#   sysroot/               unpacked .debs (only in loader mode)
#   apt/                   private apt source list, lists and cache

set -euo pipefail

log() { echo "[install_perf_analyzer] $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

[[ $# -eq 1 ]] || { echo "usage: $0 DEST_DIR" >&2; exit 2; }

PA_VERSION="${PA_VERSION:-2.60.0}"
PYTHON="${PYTHON:-python3}"
SUITE="${PA_DEBIAN_SUITE:-stable}"
MULTIARCH="x86_64-linux-gnu"
LOADER_NAME="ld-linux-x86-64.so.2"

[[ "$(uname -m)" == "x86_64" ]] || die "only x86_64 is supported (got $(uname -m))"

mkdir -p "$1"
DEST="$(cd "$1" && pwd -P)"
WRAPPER="$DEST/perf_analyzer"
DL="$DEST/downloads"
WHEEL_DIR="$DEST/wheel"
SYSROOT="$DEST/sysroot"
APT_DIR="$DEST/apt"
BIN="$WHEEL_DIR/perf_analyzer/bin/perf_analyzer"
SYS_LIB="$SYSROOT/usr/lib/$MULTIARCH"

# Sanity check of a wrapper: `--version` prints "Perf Analyzer Version ..." and exits 0.
wrapper_works() {
    local out
    [[ -x "$WRAPPER" ]] || return 1
    out="$("$WRAPPER" --version 2>&1)" || return 1
    [[ "$out" == *"Perf Analyzer"* ]]
}

# ---------------------------------------------------------------- fast path
if wrapper_works; then
    log "already installed: $("$WRAPPER" --version 2>&1 | head -n1)"
    echo "$WRAPPER"
    exit 0
fi

mkdir -p "$DL"

# ---------------------------------------------------------------- 1. wheel
shopt -s nullglob
wheels=("$DL"/perf_analyzer-"$PA_VERSION"-*.whl)
if [[ ${#wheels[@]} -eq 0 ]]; then
    if [[ -n "${PIP:-}" ]]; then
        read -r -a PIP_CMD <<<"$PIP"
    else
        PIP_CMD=("$PYTHON" -m pip)
    fi
    log "downloading perf-analyzer==$PA_VERSION wheel with: ${PIP_CMD[*]}"
    "${PIP_CMD[@]}" download --quiet --disable-pip-version-check --no-deps \
        --only-binary=:all: --platform manylinux_2_38_x86_64 \
        --python-version 3.11 -d "$DL" "perf-analyzer==$PA_VERSION" >&2
    wheels=("$DL"/perf_analyzer-"$PA_VERSION"-*.whl)
    [[ ${#wheels[@]} -gt 0 ]] || die "pip download did not produce a perf_analyzer wheel in $DL"
fi

if [[ ! -f "$BIN" ]]; then
    log "unpacking ${wheels[0]##*/}"
    rm -rf "$WHEEL_DIR.tmp"
    "$PYTHON" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' \
        "${wheels[0]}" "$WHEEL_DIR.tmp"
    rm -rf "$WHEEL_DIR"
    mv "$WHEEL_DIR.tmp" "$WHEEL_DIR"
fi
[[ -f "$BIN" ]] || die "binary not found in wheel at $BIN"
chmod +x "$BIN"   # zipfile does not restore permission bits

# ---------------------------------------------------------------- wrapper writers
# The wrapper locates its files relative to its own (resolved) location, so the
# whole DEST_DIR can be moved. `perf_analyzer --help`/`-h` is not a valid option
# of the binary (it prints usage to stderr and exits 99 for any unknown option or
# for no options); the wrapper maps a lone --help/-h to "print usage to stdout,
# exit 0".
write_wrapper() {  # $1 = direct|loader
    local mode="$1" tmp="$WRAPPER.tmp.$$"
    {
        cat <<'EOF'
#!/usr/bin/env bash
# perf_analyzer wrapper generated by scripts/perf/install_perf_analyzer.sh
# (perf-analyzer wheel from PyPI). All arguments are passed through.
set -euo pipefail
HERE="$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")" && pwd -P)"
BIN="$HERE/wheel/perf_analyzer/bin/perf_analyzer"
EOF
        if [[ "$mode" == loader ]]; then
            cat <<EOF
# Host glibc is too old: run through the dynamic loader of Debian '$SUITE'
# (libc6, libstdc++6, libgcc-s1 unpacked into sysroot/); libz/libssl/libcrypto
# come from the host. --library-path is not inherited by child processes.
LIBDIR="\$HERE/sysroot/usr/lib/$MULTIARCH"
CMD=("\$LIBDIR/$LOADER_NAME" --argv0 perf_analyzer
     --library-path "\$LIBDIR:/lib/$MULTIARCH:/usr/lib/$MULTIARCH" "\$BIN")
EOF
        else
            cat <<'EOF'
# Host glibc/libstdc++ are new enough: run the binary directly.
CMD=("$BIN")
EOF
        fi
        cat <<'EOF'
if [[ $# -eq 1 && ( "$1" == "--help" || "$1" == "-h" ) ]]; then
    "${CMD[@]}" 2>&1 || true
    exit 0
fi
exec "${CMD[@]}" "$@"
EOF
    } >"$tmp"
    chmod +x "$tmp"
    mv -f "$tmp" "$WRAPPER"
}

# ---------------------------------------------------------------- 2a. direct?
direct_out="$("$BIN" --version 2>&1 || true)"
if [[ "${PA_FORCE_LOADER:-0}" != 1 && "$direct_out" == *"Perf Analyzer"* ]]; then
    log "binary runs directly on this system (glibc $(getconf GNU_LIBC_VERSION 2>/dev/null | awk '{print $2}'))"
    write_wrapper direct
    wrapper_works || die "wrapper $WRAPPER does not run"
    log "installed: $("$WRAPPER" --version 2>&1 | head -n1)"
    echo "$WRAPPER"
    exit 0
fi
log "binary does not run directly (host $(getconf GNU_LIBC_VERSION 2>/dev/null || echo 'glibc ?')); using a private glibc from Debian '$SUITE'"

# ---------------------------------------------------------------- 2b. private glibc
command -v apt-get >/dev/null || die "apt-get not found (this script targets Debian)"
command -v dpkg-deb >/dev/null || die "dpkg-deb not found (this script targets Debian)"

# Pick the Debian archive the machine already uses (first non-security URI).
find_mirror() {
    local f uri
    f=/etc/apt/sources.list.d/debian.sources
    if [[ -r $f ]]; then
        # deb822: "URIs: a b ..." (one or more per stanza)
        for uri in $(awk 'tolower($1)=="uris:" {for (i=2;i<=NF;i++) print $i}' "$f"); do
            [[ "$uri" == *security* ]] && continue
            echo "${uri%/}"; return 0
        done
    fi
    f=/etc/apt/sources.list
    if [[ -r $f ]]; then
        uri="$(awk '$1=="deb" { for (i=2;i<=NF;i++) if ($i ~ /^[a-z+]+:\/\//) { print $i; exit } }' "$f" \
               | grep -v security | head -n1 || true)"
        [[ -n "$uri" ]] && { echo "${uri%/}"; return 0; }
    fi
    echo "http://deb.debian.org/debian"
}

if [[ ! -x "$SYS_LIB/$LOADER_NAME" || ! -e "$SYS_LIB/libstdc++.so.6" || ! -e "$SYS_LIB/libgcc_s.so.1" ]]; then
    debs=("$DL"/libc6_*.deb "$DL"/libstdc++6_*.deb "$DL"/libgcc-s1_*.deb)
    if [[ ${#debs[@]} -lt 3 ]]; then
        MIRROR="${PA_DEBIAN_MIRROR:-$(find_mirror)}"
        mkdir -p "$APT_DIR/etc/preferences.d" "$APT_DIR/lists/partial" \
                 "$APT_DIR/cache/archives/partial" "$APT_DIR/state"
        keyring=/usr/share/keyrings/debian-archive-keyring.gpg
        opts=""
        [[ -r $keyring ]] && opts="[signed-by=$keyring] "
        echo "deb ${opts}$MIRROR $SUITE main" >"$APT_DIR/etc/sources.list"
        log "apt source: $(cat "$APT_DIR/etc/sources.list")"
        APT_OPTS=(
            -o "Dir::Etc::sourcelist=$APT_DIR/etc/sources.list"
            -o "Dir::Etc::sourceparts=-"
            -o "Dir::Etc::preferences=$APT_DIR/etc/preferences"
            -o "Dir::Etc::preferencesparts=$APT_DIR/etc/preferences.d"
            -o "Dir::State::Lists=$APT_DIR/lists"
            -o "Dir::State::extended_states=$APT_DIR/state/extended_states"
            -o "Dir::Cache=$APT_DIR/cache"
            -o "Debug::NoLocking=1"
            -o "APT::Sandbox::User=$(id -un 2>/dev/null || echo root)"
            -o "Acquire::Languages=none"
        )
        log "apt-get update (private lists)"
        apt-get -q "${APT_OPTS[@]}" update >&2
        rm -f "$DL"/libc6_*.deb "$DL"/libstdc++6_*.deb "$DL"/libgcc-s1_*.deb
        log "apt-get download libc6 libstdc++6 libgcc-s1"
        (cd "$DL" && apt-get -q "${APT_OPTS[@]}" download libc6 libstdc++6 libgcc-s1 >&2)
        debs=("$DL"/libc6_*.deb "$DL"/libstdc++6_*.deb "$DL"/libgcc-s1_*.deb)
        [[ ${#debs[@]} -ge 3 ]] || die "apt-get download did not produce the three .deb files in $DL"
        rm -rf "$APT_DIR/lists" "$APT_DIR/cache"   # ~20 MB of package indexes, no longer needed
    fi
    # The suite must provide glibc >= 2.38 (e.g. a snapshot mirror may pin an old "stable").
    glibc_ver="$(dpkg-deb -f "${debs[0]}" Version | grep -oE '^[0-9]+\.[0-9]+' || true)"
    log "private glibc: ${glibc_ver:-unknown} (${debs[0]##*/})"
    if [[ -n "$glibc_ver" ]]; then
        maj="${glibc_ver%%.*}"; min="${glibc_ver#*.}"
        if (( maj < 2 || (maj == 2 && min < 38) )); then
            rm -f "${debs[@]}"
            die "Debian '$SUITE' from the configured mirror ships glibc $glibc_ver (< 2.38); set PA_DEBIAN_SUITE=trixie and/or PA_DEBIAN_MIRROR"
        fi
    fi
    rm -rf "$SYSROOT.tmp"
    mkdir -p "$SYSROOT.tmp"
    for d in "${debs[@]}"; do
        log "unpacking ${d##*/}"
        dpkg-deb -x "$d" "$SYSROOT.tmp"
    done
    rm -rf "$SYSROOT"
    mv "$SYSROOT.tmp" "$SYSROOT"
fi
[[ -x "$SYS_LIB/$LOADER_NAME" ]] || die "no $LOADER_NAME in $SYS_LIB after unpacking"

# All NEEDED libs must resolve with the private loader.
missing="$("$SYS_LIB/$LOADER_NAME" --library-path "$SYS_LIB:/lib/$MULTIARCH:/usr/lib/$MULTIARCH" \
            --list "$BIN" 2>&1 | grep -E 'not found|version .* not found' || true)"
[[ -z "$missing" ]] || die "unresolved libraries for perf_analyzer:"$'\n'"$missing"

write_wrapper loader
wrapper_works || die "wrapper $WRAPPER does not run: $("$WRAPPER" --version 2>&1 | tail -n3)"
log "installed: $("$WRAPPER" --version 2>&1 | head -n1)"
echo "$WRAPPER"
