#!/usr/bin/env bash
# Builds and runs the project README.md's "Write your own service" shows,
# from the README's own code blocks, against an installed rdmarpc: the
# snippets must build as pasted.
#
#   readme_project.sh README PREFIX WORK_DIR [extra cmake configure args...]
#
# A block whose fence names a file after its language (```cpp main.cc) is
# written to WORK_DIR/src/<file>; the project must print "y: 4194304 bytes
# over <transport>".
set -euo pipefail
readme=$1 prefix=$2 work=$3
shift 3
mkdir -p "$work/src"
awk -v dir="$work/src" '
  /^```[a-z]+ [^ ]+$/ { file = dir "/" $2; next }
  /^```/ { if (file != "") close(file); file = ""; next }
  file != "" { print > file }
' "$readme"
for f in demo.proto main.cc CMakeLists.txt; do
  if [[ ! -s $work/src/$f ]]; then
    echo "readme_project.sh: $readme has no \`\`\`<lang> $f block" >&2
    exit 1
  fi
done
env -u rdmarpc_DIR -u CMAKE_PREFIX_PATH \
  cmake -S "$work/src" -B "$work/build" "-DCMAKE_PREFIX_PATH=$prefix" "$@"
cmake --build "$work/build"
out=$(timeout 120 "$work/build/app")
echo "$out"
if [[ $out != "y: 4194304 bytes over "* ]]; then
  echo "readme_project.sh: unexpected output from the README's project" >&2
  exit 1
fi
