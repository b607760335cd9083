#!/bin/sh
# Rewrites the golden files from the current generator, after an intended
# change to it. Review the diff before committing.
#
#   tests/codegen/golden/regenerate.sh [path/to/protoc-gen-rdmarpc]
#
# The plugin defaults to build/codegen/protoc-gen-rdmarpc; $PROTOC, if set,
# names the protoc to use.
set -eu
golden=$(cd "$(dirname "$0")" && pwd)
codegen=$(dirname "$golden")  # the import root the golden proto is named from
root=$(cd "$codegen/../.." && pwd)
plugin=${1:-$root/build/codegen/protoc-gen-rdmarpc}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

"${PROTOC:-protoc}" -I"$codegen" -I"$root/proto" \
  --plugin=protoc-gen-rdmarpc="$plugin" --rdmarpc_out="$out" \
  "$golden/reference.proto"
for ext in h cc; do
  cp "$out/golden/reference.rdmarpc.pb.$ext" \
    "$golden/reference.rdmarpc.pb.$ext.golden"
done
echo "updated $golden/reference.rdmarpc.pb.{h,cc}.golden"
