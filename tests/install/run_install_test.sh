#!/usr/bin/env bash
# The install test: proves that a separate CMake project can build against
# the installed rdmarpc package alone.
#
#   run_install_test.sh --build-dir DIR --source-dir DIR --consumer DIR
#                       --generator NAME [--make-program PATH]
#                       [--cxx-compiler PATH] [--build-type TYPE]
#
# Steps, each failing loudly:
#   1. cmake --install the (already built) rdmarpc build tree into a
#      temporary prefix;
#   2. check that the exported target requires C++20 and does not define
#      RDMARPC_FAULT_INJECTION for consumers (the consumer project sets no
#      C++ standard of its own);
#   3. copy the consumer project out of the source tree, configure it with
#      -DCMAKE_PREFIX_PATH=<prefix> (same generator and compiler), nothing
#      else pointing at rdmarpc;
#   4. check that neither the installed package nor the consumer's build
#      refers to the rdmarpc source or build tree;
#   5. build the consumer and run it; it must exit 0;
#   6. build and run the project README.md shows, from its code blocks
#      (readme_project.sh).
# The temporary folder is removed on success and kept (path printed) on
# failure. KEEP_INSTALL_TEST_DIR=1 keeps it always.
set -euo pipefail

build_dir= source_dir= consumer_dir= generator= make_program= cxx= build_type=
while (($#)); do
  case "$1" in
    --build-dir) build_dir=$2; shift 2 ;;
    --source-dir) source_dir=$2; shift 2 ;;
    --consumer) consumer_dir=$2; shift 2 ;;
    --generator) generator=$2; shift 2 ;;
    --make-program) make_program=$2; shift 2 ;;
    --cxx-compiler) cxx=$2; shift 2 ;;
    --build-type) build_type=$2; shift 2 ;;
    *) echo "run_install_test.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
for v in build_dir source_dir consumer_dir generator; do
  if [[ -z ${!v} ]]; then
    echo "run_install_test.sh: --${v//_/-} is required" >&2
    exit 2
  fi
done
build_dir=$(realpath "$build_dir")
source_dir=$(realpath "$source_dir")

step() { printf '\n=== install test: %s\n' "$*"; }
fail() {
  printf '\nINSTALL TEST FAILED: %s\n' "$*" >&2
  printf 'work folder kept for inspection: %s\n' "$work" >&2
  exit 1
}

# The work folder must lie outside the source and build trees, or the leak
# check below could not tell their paths apart.
tmp_root=${TMPDIR:-/tmp}
case "$(realpath "$tmp_root")/" in
  "$source_dir"/* | "$build_dir"/*) tmp_root=/tmp ;;
esac
work=$(mktemp -d "$tmp_root/rdmarpc-install-test.XXXXXX")
prefix=$work/prefix
consumer_src=$work/consumer-src
consumer_build=$work/consumer-build
cleanup() {
  local rc=$?
  if ((rc == 0)) && [[ ${KEEP_INSTALL_TEST_DIR:-0} != 1 ]]; then
    rm -rf "$work"
  fi
}
trap cleanup EXIT

step "cmake --install $build_dir --prefix $prefix"
if ! cmake --install "$build_dir" --prefix "$prefix"; then
  fail "cmake --install failed (is the build tree built? run ninja first)"
fi
config=$(find "$prefix" -name rdmarpcConfig.cmake -print -quit)
[[ -n $config ]] || fail "no rdmarpcConfig.cmake under $prefix"
echo "installed package config: $config"
echo "installed files:"
(cd "$prefix" && find . -type f | sort | sed 's/^/  /')

step "the installed package refers to neither the source nor the build tree"
# Text files only (-I); the library's debug info may name source files,
# which is harmless.
if leaks=$(grep -rIl -e "$source_dir" -e "$build_dir" "$prefix"); then
  for f in $leaks; do
    echo "--- $f:"
    grep -n -e "$source_dir" -e "$build_dir" "$f" | head -20
  done
  fail "installed files refer to the rdmarpc source/build tree: $leaks"
fi
echo "ok: no path into $source_dir or $build_dir in the installed text files"

step "the exported target requires C++20 and exports no fault points"
targets=$(find "$prefix" -name 'rdmarpcTargets.cmake' -print -quit)
[[ -n $targets ]] || fail "no rdmarpcTargets.cmake under $prefix"
grep -q 'cxx_std_20' "$targets" ||
  fail "$targets does not require cxx_std_20: consumers without C++20 fail in the headers"
if grep -n 'RDMARPC_FAULT_INJECTION' "$targets"; then
  fail "$targets exports RDMARPC_FAULT_INJECTION to consumers"
fi
echo "ok: $targets requires cxx_std_20 and defines no fault points"

step "configure the consumer against $prefix only"
cp -r "$consumer_dir" "$consumer_src"
configure=(cmake -S "$consumer_src" -B "$consumer_build" -G "$generator"
           "-DCMAKE_PREFIX_PATH=$prefix")
[[ -n $make_program ]] && configure+=("-DCMAKE_MAKE_PROGRAM=$make_program")
[[ -n $cxx ]] && configure+=("-DCMAKE_CXX_COMPILER=$cxx")
[[ -n $build_type ]] && configure+=("-DCMAKE_BUILD_TYPE=$build_type")
echo "${configure[*]}"
# A clean environment for the package search: no rdmarpc_DIR or
# CMAKE_PREFIX_PATH inherited from the caller.
if ! env -u rdmarpc_DIR -u CMAKE_PREFIX_PATH "${configure[@]}"; then
  fail "configuring the consumer failed"
fi
found_dir=$(sed -n 's/^rdmarpc_DIR:[A-Z]*=//p' "$consumer_build/CMakeCache.txt")
case "$(realpath -m "$found_dir")/" in
  "$(realpath "$prefix")"/*) echo "ok: rdmarpc_DIR=$found_dir (the install prefix)" ;;
  *) fail "find_package(rdmarpc) found '$found_dir', not the package in $prefix" ;;
esac

step "the consumer's build refers to neither the source nor the build tree"
# The files that hold include paths, flags, link lines and the package
# search results (Ninja or Makefiles). Only existing ones: grep exits 2 on a
# missing file even when another matched.
shopt -s nullglob
build_files=("$consumer_build/CMakeCache.txt" "$consumer_build"/*.ninja
             "$consumer_build"/Makefile "$consumer_build"/CMakeFiles/*/*.make)
shopt -u nullglob
existing=()
for f in "${build_files[@]}"; do [[ -f $f ]] && existing+=("$f"); done
((${#existing[@]} > 1)) || fail "no build files found in $consumer_build"
if leaks=$(grep -Il -e "$source_dir" -e "$build_dir" "${existing[@]}"); then
  for f in $leaks; do
    echo "--- $f:"
    grep -n -e "$source_dir" -e "$build_dir" "$f" | head -20
  done
  fail "the consumer's build uses paths into the rdmarpc source/build tree"
fi
echo "ok: no path into $source_dir or $build_dir in the consumer's build files"

step "build the consumer"
if ! cmake --build "$consumer_build" --verbose; then
  fail "building the consumer failed"
fi
exe=$consumer_build/consumer
[[ -x $exe ]] || fail "no consumer executable at $exe"
if command -v ldd >/dev/null; then
  if ldd "$exe" | grep -e "$source_dir" -e "$build_dir"; then
    fail "the consumer loads libraries from the rdmarpc source/build tree"
  fi
fi

step "run the consumer"
rc=0
timeout 120 "$exe" || rc=$?
((rc == 0)) || fail "the consumer exited with status $rc (124: timed out)"
step "build and run the README's project, from its code blocks"
readme_args=(-G "$generator")
[[ -n $make_program ]] && readme_args+=("-DCMAKE_MAKE_PROGRAM=$make_program")
[[ -n $cxx ]] && readme_args+=("-DCMAKE_CXX_COMPILER=$cxx")
if ! bash "$(dirname "$0")/readme_project.sh" "$source_dir/README.md" \
    "$prefix" "$work/readme" "${readme_args[@]}"; then
  fail "the README's snippets do not build or run as pasted"
fi

printf '\nPASS: a separate project built and ran against the installed rdmarpc package\n'
