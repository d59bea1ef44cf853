#!/usr/bin/env bash
# Starts the real lossd with the flags and arguments an overlay gives its container, so a flag
# renamed in the binary or misspelled in a ConfigMap fails CI instead of a rollout. Only the
# listening address, the ports and the device are overridden (loopback, port 0, cpu: no GPU here).
#
# Usage: flags_test.sh CHECK_SCRIPT LOSSD_BINARY KUSTOMIZATION_DIR
set -euo pipefail

check="$1"
lossd="$2"
dir="$3"
validate_dir="$(dirname "${check}")"
"${check}" "${dir}" >/dev/null  # also installs the node modules lossd-env.js needs

work="$(mktemp -d)"
trap 'kill "${pid:-}" 2>/dev/null || true; rm -rf "${work}"' EXIT
# Mounted ConfigMaps (the quota file) go under ${work}/root, and the flags naming them follow.
described="$(kubectl kustomize "${dir}" | node "${validate_dir}/lossd-env.js" --files-into="${work}/root")"
env_vars=()
args=()
in_args=0
while IFS= read -r line; do
  if [[ "${line}" == "ARGS" ]]; then in_args=1; continue; fi
  if (( in_args )); then args+=("${line}"); else env_vars+=("${line}"); fi
done <<<"${described}"
env_vars+=(FLAGS_port=0 FLAGS_host=127.0.0.1 FLAGS_device=cpu)
echo "env: ${env_vars[*]}"
echo "args: ${args[*]}"

env -i PATH=/usr/bin:/bin "${env_vars[@]}" "${lossd}" "${args[@]}" \
  --port_file="${work}/port" --metrics_port=0 --data_port=0 >"${work}/log" 2>&1 &
pid=$!
# lossd writes the port file once it serves; it exits at once if a flag is rejected.
for _ in $(seq 200); do
  [[ -s "${work}/port" ]] && break
  if ! kill -0 "${pid}" 2>/dev/null; then
    cat "${work}/log"
    echo "FAIL: lossd exited during start-up with the flags of ${dir}"
    exit 1
  fi
  sleep 0.05
done
if [[ ! -s "${work}/port" ]]; then
  cat "${work}/log"
  echo "FAIL: lossd did not start serving within 10 s"
  exit 1
fi
kill -TERM "${pid}"
status=0
wait "${pid}" || status=$?
cat "${work}/log"
if (( status != 0 )); then
  echo "FAIL: lossd exited ${status} after SIGTERM"
  exit 1
fi
echo "PASS: lossd accepted the flags of ${dir}"
