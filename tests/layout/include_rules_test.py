#!/usr/bin/env python3
"""The layout's dependency rules (docs/design.md §2), checked over the tree.

Fails, naming each offending include, when
- client/ includes kernels/ or server/;
- kernels/ includes a generated protobuf or gRPC header (.pb.h), gRPC, server/
  or client/;
- server/ includes client/;
- kernels/ outside kernels/cpu/, or server/ but its CPU device
  (server/cpu_device.cc), includes kernels/cpu/: what the backends share
  lives in kernels/ itself;
- common/ includes kernels/, server/, client/, protobuf or gRPC;
- the store and the devices (nothing below the service) reach a .pb.h or gRPC,
  directly or through the project's headers;
- the evaluation engine (server/evaluation.*) and the striped-upload assembly's
  header reach gRPC, or that header reaches protobuf;
- a source file anywhere in the tree (C++, CUDA, Python, shell: by ending, or
  by a shell or Python #! line) is longer than 1,000 lines, but for the test
  files LONG_TESTS names with the reason each may be longer.

Usage: include_rules_test.py [ROOT] (default: the repository holding this file).
"""
import os
import re
import sys

ROOT = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else
                       os.path.join(os.path.dirname(__file__), "..", ".."))
SOURCES = (".h", ".cc", ".cu", ".cuh")
INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^">]+)[">]', re.MULTILINE)
MAX_LINES = 1000


def files_under(directory):
    top = os.path.join(ROOT, directory)
    for parent, _, names in os.walk(top):
        for name in sorted(names):
            if name.endswith(SOURCES):
                yield os.path.relpath(os.path.join(parent, name), ROOT)


def includes(path):
    with open(os.path.join(ROOT, path), encoding="utf-8", errors="replace") as f:
        return INCLUDE.findall(f.read())


def is_protobuf(header):
    return header.endswith(".pb.h") or header.startswith("google/protobuf/")


def is_grpc(header):
    return (header.startswith(("grpcpp/", "grpc/", "grpc++/")) or
            header.endswith(".grpc.pb.h"))


def closure(path):
    """Every header `path` reaches: project headers followed, others listed."""
    seen = set()
    stack = [path]
    while stack:
        current = stack.pop()
        for header in includes(current):
            if header in seen:
                continue
            seen.add(header)
            if os.path.isfile(os.path.join(ROOT, header)):
                stack.append(header)
    return seen


violations = []


def check_direct(directory, forbidden, why):
    for path in files_under(directory):
        for header in includes(path):
            if forbidden(header):
                violations.append(f"{path}: includes {header} ({why})")


check_direct("client", lambda h: h.startswith(("kernels/", "server/")),
             "the client never includes kernels or server")
check_direct("kernels",
             lambda h: is_protobuf(h) or is_grpc(h) or
             h.startswith(("server/", "client/", "lossd/v1/")),
             "kernels know no protobuf, gRPC, server or client")
check_direct("server", lambda h: h.startswith("client/"),
             "the server never includes the client")
# The CPU backend is one backend among others: the CUDA backend, the shared
# checks and the server's request code reach only what kernels/ itself holds.
CPU_BACKEND_USERS = ("server/cpu_device.cc",)
for directory in ("kernels", "server"):
    for path in files_under(directory):
        if path.startswith("kernels/cpu/") or path in CPU_BACKEND_USERS:
            continue
        for header in includes(path):
            if header.startswith("kernels/cpu/"):
                violations.append(
                    f"{path}: includes {header} (only the CPU device reaches "
                    "the CPU backend; shared code lives in kernels/)")
check_direct("common",
             lambda h: is_protobuf(h) or is_grpc(h) or
             h.startswith(("kernels/", "server/", "client/", "lossd/v1/")),
             "common/ is below everything: no kernels, server, client, "
             "protobuf or gRPC")

BELOW_THE_SERVICE = re.compile(
    r"^server/(tensor_store|device|cpu_device|cuda_device|quota)\.(h|cc)$")
for path in files_under("server"):
    if BELOW_THE_SERVICE.match(path):
        for header in sorted(closure(path)):
            if is_protobuf(header) or is_grpc(header):
                violations.append(
                    f"{path}: reaches {header} (nothing below the service "
                    "knows protobuf or gRPC)")
    if re.match(r"^server/(evaluation\.(h|cc)|striped_uploads\.h)$", path):
        for header in sorted(closure(path)):
            if is_grpc(header):
                violations.append(f"{path}: reaches {header} (no gRPC here)")
    if path == "server/striped_uploads.h":
        for header in sorted(closure(path)):
            if is_protobuf(header):
                violations.append(
                    f"{path}: reaches {header} (the assembly knows no "
                    "protobuf: a stripe is a StripeSpec)")

# Files of code by their ending; files without one count when their #! line
# runs a shell or Python (scripts/test, bench/run-service-bench).
CODE = (".h", ".cc", ".cu", ".cuh", ".c", ".cpp", ".hpp", ".py", ".pyi",
        ".sh", ".bash")
SHEBANG = re.compile(rb"^#!.*\b(ba|z|da)?sh\b|^#!.*\bpython[0-9.]*\b")
# Test files allowed past MAX_LINES, each with the reason. Keep it short: a
# test file that grows past the bound is split like any other.
LONG_TESTS = {}


def is_code(path):
    name = os.path.basename(path)
    if name.endswith(CODE):
        return True
    if "." in name:
        return False
    try:
        with open(path, "rb") as f:
            return bool(SHEBANG.match(f.readline()))
    except OSError:
        return False


def code_files():
    """Every file of code in the tree, outside .git and build folders."""
    for parent, directories, names in os.walk(ROOT):
        # Build folders (a CMakeCache.txt, wherever they are), hidden
        # folders but .ci, and Python's caches hold no sources of the tree.
        directories[:] = sorted(
            d for d in directories
            if (not d.startswith(".") or d == ".ci") and d != "__pycache__" and
            not os.path.isfile(os.path.join(parent, d, "CMakeCache.txt")))
        for name in sorted(names):
            path = os.path.join(parent, name)
            if not os.path.islink(path) and is_code(path):
                yield os.path.relpath(path, ROOT)


checked = 0
for path in code_files():
    checked += 1
    with open(os.path.join(ROOT, path), encoding="utf-8",
              errors="replace") as f:
        lines = sum(1 for _ in f)
    if lines > MAX_LINES and path not in LONG_TESTS:
        violations.append(
            f"{path}: {lines} lines (at most {MAX_LINES} a source file)")
for path in sorted(LONG_TESTS):
    if not path.startswith("tests/"):
        violations.append(f"{path}: only a test file may be longer")
if checked == 0:
    violations.append(f"{ROOT}: no source files found")

if violations:
    print(f"include_rules_test: {len(violations)} violation(s):")
    for violation in violations:
        print("  " + violation)
    sys.exit(1)
print(f"include_rules_test: ok ({checked} source files within {MAX_LINES} lines)")
