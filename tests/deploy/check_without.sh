#!/usr/bin/env bash
# Runs deploy/validate/check with one tool hidden from PATH, to show that a CI machine lacking it
# gets a failure naming the tool rather than a silent skip.
#
# Usage: check_without.sh TOOL CHECK_SCRIPT [ARG...]
set -euo pipefail

hidden="$1"
shift
bin="$(mktemp -d)"
trap 'rm -rf "${bin}"' EXIT
for tool in bash env dirname node npm kubectl flock promtool sha256sum cut cat realpath mktemp rm; do
  [[ "${tool}" == "${hidden}" ]] && continue
  path="$(command -v "${tool}")" || { echo "check_without.sh: ${tool} is not installed" >&2; exit 1; }
  ln -s "${path}" "${bin}/${tool}"
done
PATH="${bin}" exec "$@"
