#!/usr/bin/env bash
# The lossd package as pip installs it, from the repository (ctest's python.pip_install and
# python.wheel; tests/python/CMakeLists.txt). LOSSD_CMAKE_BUILD_DIR names the CMake build that
# setup.py builds in, so the extension already built there is reused rather than compiled again.
#   pip_test.sh install PYTHON VENV   fresh VENV (--system-site-packages), pip install
#                                     ./client/python into it, import the installed package
#   pip_test.sh wheel PYTHON          pip wheel ./client/python, install the wheel into a
#                                     second fresh venv, import it there
set -euo pipefail
cd "$(dirname "$0")/../.."
mode=$1 python=$2

# Imported from / so that neither the sources nor the build folder can be what is found.
check() {
  (cd / && "$1/bin/python" - <<'PY'
import os, sys
import lossd, lossd.torch
from lossd.v1 import lossd_pb2, lossd_pb2_grpc
assert os.path.realpath(lossd.__file__).startswith(os.path.realpath(sys.prefix) + os.sep), lossd.__file__
assert lossd_pb2_grpc.LossdStub and lossd_pb2.DESCRIPTOR.package == "lossd.v1"
lossd.Client("127.0.0.1:1").close()
print("installed", lossd.__version__, "at", os.path.dirname(lossd.__file__),
      sorted(os.listdir(os.path.dirname(lossd.__file__))))
PY
  )
}

case "$mode" in
  install)
    venv=$3
    rm -rf "$venv"
    "$python" -m venv --system-site-packages "$venv"
    "$venv/bin/python" -m pip install -q --no-build-isolation --no-index ./client/python
    check "$venv"
    ;;
  wheel)
    dir=$(mktemp -d)
    trap 'rm -rf "$dir"' EXIT
    "$python" -m pip wheel -q --no-build-isolation --no-deps --no-index -w "$dir/wheels" \
      ./client/python
    wheel=$(ls "$dir"/wheels/lossd-*.whl)
    echo "built $(basename "$wheel") ($(du -h "$wheel" | cut -f1))"
    "$python" -m venv --system-site-packages "$dir/venv"
    "$dir/venv/bin/python" -m pip install -q --no-index --no-deps "$wheel"
    check "$dir/venv"
    ;;
  *) echo "usage: pip_test.sh install PYTHON VENV | wheel PYTHON" >&2; exit 2 ;;
esac
