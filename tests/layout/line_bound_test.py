#!/usr/bin/env python3
"""include_rules_test.py's 1,000-line bound, checked on a tree made for it.

Each kind of source file (C++, CUDA, Python, a shell script with no ending,
in client/, bench/, kernels/, scripts/, tests/) one line over the bound must
be named, a test file too; files at the bound, data files and build folders
must not.

Usage: line_bound_test.py [ROOT] (default: the repository holding this file).
"""
import os
import subprocess
import sys
import tempfile

ROOT = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else
                       os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPT = os.path.join(ROOT, "tests", "layout", "include_rules_test.py")

OVER = [
    "client/too_long.cc",
    "client/python/too_long.h",
    "bench/too_long.py",
    "kernels/cuda/too_long.cu",
    "kernels/cuda/too_long.cuh",
    "scripts/too-long",
    "deploy/too_long.sh",
    "tests/client/too_long_test.cc",
    "tests/e2e/soak_test.cc",
]
NOT_CHECKED = [
    "client/at_the_bound.cc",            # 1,000 lines: allowed
    "docs/too_long.md",                  # prose
    "tests/fuzz/corpus/npy/too_long",    # data, no #! line
    "build-x/client/too_long.cc",        # a build folder
]


def write(root, path, lines, shebang=""):
    full = os.path.join(root, path)
    os.makedirs(os.path.dirname(full), exist_ok=True)
    with open(full, "w") as f:
        if shebang:
            f.write(shebang + "\n")
            lines -= 1
        f.write("x\n" * lines)


failures = []
with tempfile.TemporaryDirectory() as root:
    for path in OVER:
        write(root, path, 1001, "#!/usr/bin/env bash"
              if path.startswith("scripts/") else "")
    write(root, "client/at_the_bound.cc", 1000)
    write(root, "docs/too_long.md", 2000)
    write(root, "tests/fuzz/corpus/npy/too_long", 2000)
    write(root, "build-x/client/too_long.cc", 2000)
    open(os.path.join(root, "build-x", "CMakeCache.txt"), "w").close()
    result = subprocess.run([sys.executable, SCRIPT, root],
                            capture_output=True, text=True)
    if result.returncode != 1:
        failures.append(f"exit status {result.returncode}, expected 1")
    for path in OVER:
        if f"{path}: 1001 lines" not in result.stdout:
            failures.append(f"{path} (1,001 lines) not reported")
    for path in NOT_CHECKED:
        if f"{path}:" in result.stdout:
            failures.append(f"{path} reported")

if failures:
    print("line_bound_test: " + "; ".join(failures))
    print(result.stdout)
    sys.exit(1)
print(f"line_bound_test: ok ({len(OVER)} files over the bound reported)")
