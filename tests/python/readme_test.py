"""Runs the README's Python section as a user would: its `export PYTHONPATH=...` line (with the
build folder this test was configured for, when that is not build/) in bash from the repository
root, then its Python example under /usr/bin/python3 against a real lossd (LOSSD_TARGET names
it; the README's default is localhost:50051)."""

import argparse
import os
import re
import subprocess
import sys

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
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    exports = re.findall(r"^(export PYTHONPATH=\S+)$", readme, re.M)
    if not blocks or len(exports) != 1:
        sys.exit("README: expected a ```python block and one 'export PYTHONPATH=' line")
    export = exports[0]
    build = os.path.realpath(args.build)
    if build != os.path.realpath(os.path.join(args.root, "build")):
        export = export.replace("$PWD/build/", build + "/")

    with LossdServer(args.lossd, "cpu") as server:
        script = "set -euo pipefail\ncd %s\n%s\nexec /usr/bin/python3 -\n" % (args.root, export)
        environment = dict(os.environ, LOSSD_TARGET=server.address)
        environment.pop("PYTHONPATH", None)
        result = subprocess.run(["bash", "-c", script], input=blocks[0], text=True,
                                capture_output=True, env=environment, timeout=240)
        print(result.stdout, result.stderr)
        if result.returncode != 0:
            sys.exit("the README's Python example failed (exit %d)" % result.returncode)
    print("README Python example ran (%s)" % export)


if __name__ == "__main__":
    main()
