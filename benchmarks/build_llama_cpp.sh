#!/usr/bin/env bash
# Build llama.cpp's CPU tools for the llama.cpp baseline of `qwenbatch bench throughput --baseline llama.cpp`.
# Run by hand before that benchmark; never run by CI.
#
# The sources come from PyPI's llama-cpp-python sdist (it vendors llama.cpp under vendor/llama.cpp), built
# for this machine's x86 ISA (never AMX: its tiles die with SIGILL in these VMs). The binaries land in
#   ${QWENBATCH_CACHE:-~/.cache/qwenbatch}/llama.cpp/<version>-<isa-tag>/bin/
# beside a build-info.json. Idempotent: an existing build is reused. The last line printed is the bin dir.
#
# Environment: QWENBATCH_CACHE (cache root), LLAMA_CPP_JOBS (parallel compile jobs, default 2).
set -euo pipefail

LLAMA_CPP_PYTHON_VERSION=0.3.36
TARGETS=(llama-bench llama-batched-bench llama-server llama-cli)
JOBS=${LLAMA_CPP_JOBS:-2}

repo=$(cd "$(dirname "$0")/.." && pwd)
cache=${QWENBATCH_CACHE:-$HOME/.cache/qwenbatch}

log() { echo "build_llama_cpp: $*" >&2; }

# --- the ISA of this CPU -----------------------------------------------------------------------------
cpu_flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
has_cpu() { [[ $cpu_flags == *" $1 "* ]]; }
has_all_cpu() {
    local f
    for f in "$@"; do has_cpu "$f" || return 1; done
}

# ggml option -> the /proc/cpuinfo flags it needs (GGML_AVX512 compiles with -mavx512{f,cd,vl,dq,bw}).
declare -A isa_needs=(
    [GGML_SSE42]="sse4_2"
    [GGML_AVX]="avx"
    [GGML_AVX2]="avx2"
    [GGML_BMI2]="bmi2"
    [GGML_FMA]="fma"
    [GGML_F16C]="f16c"
    [GGML_AVX_VNNI]="avx_vnni"
    [GGML_AVX512]="avx512f avx512cd avx512vl avx512dq avx512bw"
    [GGML_AVX512_VBMI]="avx512vbmi"
    [GGML_AVX512_VNNI]="avx512_vnni"
    [GGML_AVX512_BF16]="avx512_bf16"
)
isa_order=(GGML_SSE42 GGML_AVX GGML_AVX2 GGML_BMI2 GGML_FMA GGML_F16C GGML_AVX_VNNI
    GGML_AVX512 GGML_AVX512_VBMI GGML_AVX512_VNNI GGML_AVX512_BF16)

declare -A isa_on=()
for opt in "${isa_order[@]}"; do
    # shellcheck disable=SC2086  # word splitting of the flag list is intended
    if has_all_cpu ${isa_needs[$opt]}; then isa_on[$opt]=1; fi
done
# AVX512's extensions are only compiled in beside AVX512F.
if [[ -z ${isa_on[GGML_AVX512]:-} ]]; then
    unset 'isa_on[GGML_AVX512_VBMI]' 'isa_on[GGML_AVX512_VNNI]' 'isa_on[GGML_AVX512_BF16]'
fi

# The tag names the widest vector ISA and its extensions: e.g. avx512-vbmi-vnni-bf16, avx2, generic.
if [[ -n ${isa_on[GGML_AVX512]:-} ]]; then
    isa_tag=avx512
    [[ -n ${isa_on[GGML_AVX512_VBMI]:-} ]] && isa_tag+=-vbmi
    [[ -n ${isa_on[GGML_AVX512_VNNI]:-} ]] && isa_tag+=-vnni
    [[ -n ${isa_on[GGML_AVX512_BF16]:-} ]] && isa_tag+=-bf16
elif [[ -n ${isa_on[GGML_AVX2]:-} ]]; then
    isa_tag=avx2
    [[ -n ${isa_on[GGML_AVX_VNNI]:-} ]] && isa_tag+=-vnni
elif [[ -n ${isa_on[GGML_AVX]:-} ]]; then
    isa_tag=avx
else
    isa_tag=generic
fi

dest=$cache/llama.cpp/$LLAMA_CPP_PYTHON_VERSION-$isa_tag
bin=$dest/bin

built() {
    local t
    [[ -f $dest/build-info.json ]] || return 1
    for t in "${TARGETS[@]}"; do [[ -x $bin/$t ]] || return 1; done
}

if built; then
    log "already built ($dest/build-info.json)"
    echo "$bin"
    exit 0
fi

# --- tools ---------------------------------------------------------------------------------------------
work=$(mktemp -d "${TMPDIR:-/tmp}/qwenbatch-llama-cpp.XXXXXX")
trap 'rm -rf "$work"' EXIT

if [[ -x $repo/.venv/bin/python ]]; then python=$repo/.venv/bin/python; else python=python3; fi

if ! command -v cmake >/dev/null; then
    log "no cmake on PATH: installing cmake and ninja into a temporary venv"
    python3 -m venv "$work/venv"
    "$work/venv/bin/pip" install --quiet cmake ninja
    PATH=$work/venv/bin:$PATH
fi
generator=()
if command -v ninja >/dev/null; then generator=(-G Ninja); fi

# --- sources -------------------------------------------------------------------------------------------
log "downloading the llama-cpp-python $LLAMA_CPP_PYTHON_VERSION sdist"
"$python" -m pip download --quiet --no-binary :all: --no-deps \
    "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -d "$work/sdist"
tar -xzf "$work"/sdist/llama_cpp_python-*.tar.gz -C "$work"
pkg=$work/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION
src=$pkg/vendor/llama.cpp
[[ -f $src/CMakeLists.txt ]] || { log "no llama.cpp sources in $src"; exit 1; }

sdist_version=$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' "$pkg/llama_cpp/__init__.py")
if [[ $sdist_version != "$LLAMA_CPP_PYTHON_VERSION" ]]; then
    log "the sdist says version $sdist_version, expected $LLAMA_CPP_PYTHON_VERSION"
    exit 1
fi
# The sdist carries a shallow git checkout of the submodule (so its commit count is not the build number);
# without it the CHANGELOG names the llama.cpp commit.
commit=$(git -C "$src" rev-parse HEAD 2>/dev/null ||
    sed -n "/^## \[$LLAMA_CPP_PYTHON_VERSION\]/,/^## /s/.*llama\.cpp@\([0-9a-f]*\).*/\1/p" "$pkg/CHANGELOG.md" | head -n1)

# --- configure -----------------------------------------------------------------------------------------
has_option() { grep -Eq "option\($1[[:space:]]" "$2"; }

cmake_flags=(-DGGML_NATIVE=OFF -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_CCACHE=OFF)
# LLAMA_CURL became a deprecated no-op when llama.cpp moved its downloads to cpp-httplib (HTTPS through
# LLAMA_OPENSSL); the server's web UI would be fetched from a hub. The benchmark needs neither.
for opt in LLAMA_CURL LLAMA_OPENSSL LLAMA_USE_PREBUILT_UI LLAMA_BUILD_UI; do
    if has_option "$opt" "$src/CMakeLists.txt"; then cmake_flags+=("-D$opt=OFF"); fi
done
for opt in "${isa_order[@]}"; do
    if has_option "$opt" "$src/ggml/CMakeLists.txt"; then
        cmake_flags+=("-D$opt=$([[ -n ${isa_on[$opt]:-} ]] && echo ON || echo OFF)")
    elif [[ -n ${isa_on[$opt]:-} ]]; then
        log "warning: this llama.cpp has no $opt option; the CPU's support for it goes unused"
    fi
done
for opt in GGML_AMX_TILE GGML_AMX_INT8 GGML_AMX_BF16; do
    if ! has_option "$opt" "$src/ggml/CMakeLists.txt"; then
        log "this llama.cpp has no $opt option, so AMX cannot be switched off: check its ggml/CMakeLists.txt"
        exit 1
    fi
    cmake_flags+=("-D$opt=OFF")
done

log "configuring: ${cmake_flags[*]}"
start=$SECONDS
nice -n 19 cmake -S "$src" -B "$work/build" "${generator[@]}" "${cmake_flags[@]}" >"$work/configure.log" 2>&1 ||
    { tail -n 40 "$work/configure.log" >&2; exit 1; }

# --- build ---------------------------------------------------------------------------------------------
log "building ${TARGETS[*]} with $JOBS jobs (niced; about 15 minutes on 2 cores)"
nice -n 19 cmake --build "$work/build" -j "$JOBS" --target "${TARGETS[@]}" >"$work/build.log" 2>&1 ||
    { tail -n 60 "$work/build.log" >&2; exit 1; }
build_seconds=$((SECONDS - start))

# A binary built for an ISA this CPU lacks dies here with SIGILL rather than in the benchmark.
if ! version_out=$("$work/build/bin/llama-bench" --version 2>&1); then
    log "the new llama-bench does not start: $version_out"
    exit 1
fi
version_line=${version_out%%$'\n'*}

# --- install -------------------------------------------------------------------------------------------
mkdir -p "$(dirname "$dest")"
staging=$dest.tmp-$$
rm -rf "$staging"
mkdir -p "$staging/bin"
for t in "${TARGETS[@]}"; do install -m 755 "$work/build/bin/$t" "$staging/bin/$t"; done

cpu_used=()
for opt in "${isa_order[@]}"; do
    if [[ -n ${isa_on[$opt]:-} ]]; then cpu_used+=("${isa_needs[$opt]}"); fi
done
# shellcheck disable=SC2068  # the flag lists are split into words on purpose
printf '%s\n' ${cpu_used[@]} | sort -u >"$work/cpu-flags"
printf '%s\n' "${cmake_flags[@]}" >"$work/cmake-flags"
printf '%s\n' "${TARGETS[@]}" >"$work/targets"

BUILD_INFO=$staging/build-info.json \
    VERSION=$LLAMA_CPP_PYTHON_VERSION COMMIT=$commit ISA_TAG=$isa_tag VERSION_LINE=$version_line \
    BUILD_SECONDS=$build_seconds JOBS=$JOBS WORK=$work \
    CPU_MODEL="$(grep -m1 '^model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')" \
    COMPILER="$(c++ --version | head -n1)" CMAKE_VERSION="$(cmake --version | head -n1)" \
    "$python" - <<'EOF'
import json
import os
import platform
import time

env = os.environ


def lines(name):
    with open(os.path.join(env["WORK"], name)) as f:
        return f.read().split()


info = {
    "llama_cpp_python_version": env["VERSION"],
    "llama_cpp_commit": env["COMMIT"] or None,
    "llama_cpp_build_number": None,
    "llama_cpp_build_number_note": "unknown: the sdist holds a shallow clone of llama.cpp",
    "llama_bench_version": env["VERSION_LINE"],
    "isa_tag": env["ISA_TAG"],
    "cmake_flags": lines("cmake-flags"),
    "cpu_flags_used": lines("cpu-flags"),
    "cpu_model": env["CPU_MODEL"],
    "targets": lines("targets"),
    "compiler": env["COMPILER"],
    "cmake": env["CMAKE_VERSION"],
    "machine": platform.machine(),
    "build_jobs": int(env["JOBS"]),
    "build_seconds": int(env["BUILD_SECONDS"]),
    "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
}
with open(env["BUILD_INFO"], "w") as f:
    json.dump(info, f, indent=1)
    f.write("\n")
EOF

rm -rf "$dest"
mv "$staging" "$dest"
log "built in ${build_seconds}s: $version_line"
echo "$bin"
