#!/usr/bin/env bash
# Passes only when a command fails the expected way: a broken manifest must be rejected for the
# stated reason, not merely rejected (a missing tool or a crash would also exit non-zero).
#
# Usage: expect_failure.sh EXIT_STATUS REGEX COMMAND [ARG...]
#   EXIT_STATUS: the exact status COMMAND must exit with; REGEX (grep -E) must match its output.
set -uo pipefail

if (( $# < 3 )); then
  echo "usage: $0 EXIT_STATUS REGEX COMMAND [ARG...]" >&2
  exit 2
fi
want_status="$1"
want_regex="$2"
shift 2

output="$("$@" 2>&1)"
status=$?
echo "${output}"
if (( status != want_status )); then
  echo "FAIL: '$*' exited ${status}, expected ${want_status}" >&2
  exit 1
fi
if ! grep -Eq -- "${want_regex}" <<<"${output}"; then
  echo "FAIL: output of '$*' does not match: ${want_regex}" >&2
  exit 1
fi
echo "PASS: rejected as expected (${want_regex})"
