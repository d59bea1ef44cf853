#!/usr/bin/env bash
# No Docker engine in CI, so the image's promises are checked on its text: CUDA 13 images, the
# build through scripts CI runs, sm_90 SASS + PTX, non-root uid 65532, read-only-root friendly
# CUDA cache, lossd as the entrypoint, and every COPY source present in the build context.
#
# Usage: dockerfile_test.sh REPO_ROOT
set -uo pipefail

root="$1"
dockerfile="${root}/deploy/docker/Dockerfile"
ignore="${root}/deploy/docker/Dockerfile.dockerignore"
failures=0
expect() {  # expect DESCRIPTION REGEX FILE
  if grep -Eq -- "$2" "$3"; then
    echo "ok: $1"
  else
    echo "FAIL: $1 (no line matching '$2' in ${3#"${root}/"})"
    failures=$((failures + 1))
  fi
}

expect "CUDA 13 base image" '^ARG CUDA_IMAGE=nvidia/cuda:13\.0\.[0-9]+-devel-' "${dockerfile}"
expect "multi-stage: a build and a runtime stage" '^FROM .* AS build$' "${dockerfile}"
expect "multi-stage: a runtime stage" '^FROM .* AS runtime$' "${dockerfile}"
expect "build stage runs scripts/setup" '^RUN bash scripts/setup$' "${dockerfile}"
expect "build stage runs build-lossd build" 'deploy/docker/build-lossd build ' "${dockerfile}"
expect "build stage checks the fatbinary" 'build-lossd stage .* --expect-cuda' "${dockerfile}"
expect "sm_90 SASS + PTX" 'CMAKE_CUDA_ARCHITECTURES="90-real;90-virtual"' "${root}/deploy/docker/build-lossd"
expect "non-root uid 65532" '^USER 65532:65532$' "${dockerfile}"
expect "CUDA cache on the writable /tmp" 'CUDA_CACHE_PATH=/tmp/cuda-cache' "${dockerfile}"
expect "ENTRYPOINT lossd" '^ENTRYPOINT \["/usr/local/bin/lossd"\]$' "${dockerfile}"
expect "context excludes build trees" '^build\*$' "${ignore}"
expect "context excludes node_modules" '^\*\*/node_modules$' "${ignore}"

# Every COPY from the context (not --from another stage) must name something that exists.
while read -r src; do
  if [[ "${src}" == "." || -e "${root}/${src}" ]]; then
    echo "ok: COPY source ${src} exists"
  else
    echo "FAIL: COPY source ${src} does not exist"
    failures=$((failures + 1))
  fi
done < <(grep -E '^COPY ' "${dockerfile}" | grep -v -- '--from=' | awk '{print $2}')

for script in scripts/setup deploy/docker/build-lossd; do
  if [[ -f "${root}/${script}" ]]; then
    echo "ok: ${script} exists"
  else
    echo "FAIL: ${script} is missing (the image build runs it)"
    failures=$((failures + 1))
  fi
done

if (( failures > 0 )); then
  echo "${failures} Dockerfile check(s) failed"
  exit 1
fi
