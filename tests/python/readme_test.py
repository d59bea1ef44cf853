"""Runs the README's Python section as a user would: its install commands (the block that makes
~/lossd-venv and pip-installs client/python) in bash from the repository root, with HOME a
temporary folder so that ~/lossd-venv is a fresh venv, then its Python example under that venv's
python against a real lossd (LOSSD_TARGET names it; the README's default is localhost:50051).
LOSSD_CMAKE_BUILD_DIR points pip's build at this test's build folder, as the README suggests."""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "reference"))
from lossd_testing import LossdServer  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--readme", required=True)
    parser.add_argument("--root", required=True)
    parser.add_argument("--build", required=True)
    parser.add_argument("--lossd", required=True)
    args = parser.parse_args()

    with open(args.readme) as f:
        readme = f.read()
    section = readme[readme.index("## From Python and PyTorch"):]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    installs = [block for block in re.findall(r"```\n(.*?)```", section, re.S)
                if "pip install" in block]
    if not blocks or len(installs) != 1:
        sys.exit("README: expected one block with 'pip install' and a ```python block in its "
                 "Python section")
    install = installs[0]
    if not install.startswith("bash scripts/setup\n") or "--system-site-packages" not in install:
        sys.exit("README: the Python section's install block must start with bash scripts/setup "
                 "and make a venv with --system-site-packages")
    python = re.search(r"run `(\S+/python) train.py`", section)
    if not python:
        sys.exit("README: expected 'run `VENV/bin/python train.py`' in its Python section")

    home = tempfile.mkdtemp(prefix="lossd-readme-")
    try:
        environment = dict(os.environ, HOME=home,
                           LOSSD_CMAKE_BUILD_DIR=os.path.realpath(args.build))
        environment.pop("PYTHONPATH", None)
        script = "set -euo pipefail\ncd %s\n%s" % (args.root, install)
        result = subprocess.run(["bash", "-c", script], capture_output=True, text=True,
                                env=environment, timeout=900)
        print(result.stdout[-4000:], result.stderr[-4000:])
        if result.returncode != 0:
            sys.exit("the README's install commands failed (exit %d)" % result.returncode)

        with LossdServer(args.lossd, "cpu") as server:
            environment["LOSSD_TARGET"] = server.address
            command = "cd %s\nexec %s -\n" % (home, python.group(1))
            result = subprocess.run(["bash", "-c", command], input=blocks[0], text=True,
                                    capture_output=True, env=environment, timeout=240)
            print(result.stdout, result.stderr)
            if result.returncode != 0:
                sys.exit("the README's Python example failed (exit %d)" % result.returncode)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    print("README install commands and Python example ran")


if __name__ == "__main__":
    main()
