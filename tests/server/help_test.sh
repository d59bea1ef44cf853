#!/usr/bin/env bash
# `lossd --help` and `--helpshort` list every flag server/flags.cc defines (absl lists only the
# flags of a file named like the program unless told otherwise), and none of gRPC's or absl's own;
# headed "Flags from lossd:", never by the build machine's path of server/flags.cc.
#
# Usage: help_test.sh LOSSD_BINARY SERVER_FLAGS_CC
set -euo pipefail

lossd="$1"
flags_cc="$2"
mapfile -t names < <(grep -oE 'ABSL_FLAG\([^,]+, *[a-z_0-9]+' "${flags_cc}" | sed -E 's/.*, *//')
if ((${#names[@]} < 10)); then
  echo "FAIL: found only ${#names[@]} flags in ${flags_cc}"
  exit 1
fi
status=0
for option in --help --helpshort; do
  # absl prints the usage to stdout and exits 1.
  out="$("${lossd}" "${option}" 2>&1 || true)"
  for name in "${names[@]}"; do
    if ! grep -qE -- "^ +--${name} " <<<"${out}"; then
      echo "FAIL: lossd ${option} does not list --${name}"
      status=1
    fi
  done
  # The flags are headed as lossd's, not by the path flags.cc was compiled from.
  if grep -qF -- "flags.cc" <<<"${out}" || grep -qF -- "$(dirname "${flags_cc}")" <<<"${out}"; then
    echo "FAIL: lossd ${option} prints a source path:"
    grep -F -e "flags.cc" -e "$(dirname "${flags_cc}")" <<<"${out}"
    status=1
  fi
  if ! grep -qxF -- "  Flags from lossd:" <<<"${out}"; then
    echo "FAIL: lossd ${option} does not head its flags 'Flags from lossd:'"
    status=1
  fi
  if grep -qE -- "--(flagfile|fromenv) " <<<"${out}"; then
    echo "FAIL: lossd ${option} lists absl's own flags (those are for --helpfull)"
    status=1
  fi
done
if ((status == 0)); then
  echo "PASS: lossd --help and --helpshort list all ${#names[@]} flags of ${flags_cc}"
fi
exit "${status}"
