#!/usr/bin/env python3
"""No host function in server/, client/ or kernels/ longer than 120 lines.

A function's length is the lines from its opening brace to its closing one.
Not counted: CUDA __global__ kernels and __device__-only functions (one
launch's whole work reads best in one place, under its shape comment), and
the pybind11 module table (PYBIND11_MODULE), a list of bindings.

The C++ is read by brace matching after comments, strings and preprocessor
lines are blanked: no compiler or libclang needed.

Usage: function_length_test.py [ROOT] (default: the repository holding this
file); with --self-test, checks the reader on made-up sources instead.
"""
import os
import re
import sys

MAX_LINES = 120
DIRECTORIES = ("server", "client", "kernels")
SUFFIXES = (".cc", ".h", ".cu", ".cuh")
# Blocks that are not functions: a namespace or a class (descended into), an
# initializer or an enum (skipped).
SCOPE = re.compile(r"\b(namespace|class|struct|union)\b")
EXTERN_C = re.compile(r'\bextern\s*"C"\s*$')
NOT_COUNTED = re.compile(r"\b(__global__|PYBIND11_MODULE)\b")
DEVICE_ONLY = re.compile(r"\b__device__\b")
HOST = re.compile(r"\b__host__\b")


def blank(text):
    """`text` with comments, string and char literals and preprocessor lines
    replaced by spaces, newlines kept (so line numbers stay)."""
    out = []
    i, n = 0, len(text)
    at_line_start = True
    while i < n:
        c = text[i]
        if at_line_start and c == "#":
            # A directive, with its backslash continuations.
            while i < n and text[i] != "\n":
                if text[i] == "\\" and i + 1 < n and text[i + 1] == "\n":
                    out.append(" \n")
                    i += 2
                    continue
                out.append(" ")
                i += 1
            continue
        if c == "\n":
            out.append(c)
            at_line_start = True
            i += 1
            continue
        if not c.isspace():
            at_line_start = False
        if text.startswith("//", i):
            while i < n and text[i] != "\n":
                out.append(" ")
                i += 1
        elif text.startswith("/*", i):
            end = text.find("*/", i + 2)
            end = n if end < 0 else end + 2
            out.append("".join(ch if ch == "\n" else " " for ch in text[i:end]))
            i = end
        elif text.startswith('R"', i) and (i == 0 or not
                                           (text[i - 1].isalnum() or
                                            text[i - 1] == "_")):
            delimiter = text[i + 2:text.find("(", i + 2)]
            end = text.find(")" + delimiter + '"', i)
            end = n if end < 0 else end + len(delimiter) + 2
            out.append('""' + "".join(ch if ch == "\n" else " "
                                      for ch in text[i + 2:end]))
            i = end
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            # A digit separator (1'000) is no char literal.
            if c == "'" and i > 0 and text[i - 1].isalnum() and \
                    not text[i - 1] in "uULR8":
                out.append(" ")
                i += 1
                continue
            out.append(c + " " * (min(j, n) - i - 1) + c)
            i = min(j, n) + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def functions(text):
    """(name line, first line, last line, header) of each outermost function
    body in C++ `text`, lambdas and local classes counted in theirs."""
    code = blank(text)
    found = []

    def line_of(offset):
        return code.count("\n", 0, offset) + 1

    def match(open_at):
        depth = 0
        for k in range(open_at, len(code)):
            if code[k] == "{":
                depth += 1
            elif code[k] == "}":
                depth -= 1
                if depth == 0:
                    return k
        return len(code) - 1

    def scan(start, end):
        head_start = start
        parens = 0
        k = start
        while k < end:
            c = code[k]
            if c == "(":
                parens += 1
            elif c == ")":
                parens -= 1
            elif c in ";}":
                head_start = k + 1
                parens = 0
            elif c == "{":
                head = code[head_start:k].strip()
                close = match(k)
                after_parens = head.rsplit(")", 1)[-1].strip()
                if parens > 0 or (")" in head and not head.endswith("}") and
                                   after_parens[:1] in (":", ",")):
                    # A braced default argument or member initializer: part
                    # of the header.
                    k = close + 1
                    continue
                # An access label ("public:") is no part of what follows.
                head = re.sub(r"^(public|private|protected)\s*:\s*", "", head)
                if SCOPE.match(head) and "(" not in head.split("{")[0] or \
                        EXTERN_C.search(head):
                    scan(k + 1, close)
                elif head.startswith("enum") or head.endswith("=") or \
                        head.endswith(",") or head.endswith("(") or \
                        head == "":
                    pass
                elif ")" in head:
                    found.append((line_of(head_start + len(code[head_start:k])
                                          - len(code[head_start:k].lstrip())),
                                  line_of(k), line_of(close), head))
                k = close
                head_start = close + 1
            k += 1

    scan(0, len(code))
    return found


def counted(header):
    if NOT_COUNTED.search(header):
        return False
    return not (DEVICE_ONLY.search(header) and not HOST.search(header))


def name_of(header):
    before = header.split("(")[0].split()
    return before[-1] if before else header[:40]


def long_functions(path, text):
    problems = []
    for _, first, last, header in functions(text):
        lines = last - first + 1
        if lines > MAX_LINES and counted(header):
            problems.append(f"{path}:{first}: {name_of(header)} is {lines} "
                            f"lines (at most {MAX_LINES} a function)")
    return problems


def check_tree(root):
    problems = []
    checked = 0
    for directory in DIRECTORIES:
        for base, dirs, files in os.walk(os.path.join(root, directory)):
            dirs[:] = sorted(d for d in dirs if not d.startswith("build"))
            for name in sorted(files):
                if not name.endswith(SUFFIXES):
                    continue
                path = os.path.join(base, name)
                with open(path, encoding="utf-8", errors="replace") as f:
                    text = f.read()
                checked += 1
                problems += long_functions(os.path.relpath(path, root), text)
    return checked, problems


def body(lines):
    return "\n".join("  x += 1;" for _ in range(lines - 2))


def self_test():
    """The reader on sources made for it: each case the functions it must
    name as too long."""
    cases = {
        # At the bound: allowed; one over: named.
        "int At() {\n%s\n}\n" % body(120): [],
        "int Over() {\n%s\n}\n" % body(121): ["Over"],
        # Inside namespaces and classes, with initializer lists, templates,
        # trailing qualifiers and a brace in a string or comment.
        ("namespace a {\nnamespace {\nclass C {\n public:\n  C() : x_(1) {\n"
         "%s\n  }\n  int x_;\n};\n}  // namespace\ntemplate <typename T>\n"
         "auto F(T t) const noexcept -> int {\n  // }\n  const char* s = \"}\";"
         "\n%s\n}\n}  // namespace a\n") % (body(121), body(121)):
            ["C", "F"],
        # Kernels and device-only functions are not counted; host-device are.
        "__global__ void K() {\n%s\n}\n" % body(200): [],
        "__device__ inline int D() {\n%s\n}\n" % body(200): [],
        "__host__ __device__ int HD() {\n%s\n}\n" % body(200): ["HD"],
        "PYBIND11_MODULE(m, module) {\n%s\n}\n" % body(300): [],
        # A long initializer, enum or lambda at namespace scope is no function.
        "const int kTable[] = {\n%s\n};\n" % "\n".join(
            "  1," for _ in range(200)): [],
        # Braces in a default argument or a member initializer are part of
        # the header.
        ("int Args(int a = {}, S s = S{1}) {\n%s\n}\n"
         "C::C() : a_{1}, b_(2), c_{3} {\n%s\n}\n") % (body(121), body(121)):
            ["Args", "C::C"],
        # A multi-line macro holding braces is skipped.
        "#define M(x) \\\n  do { \\\n  } while (0)\nint Short() { return 1; }\n":
            [],
    }
    failures = []
    for source, expected in cases.items():
        got = [p.split(": ")[1].split(" ")[0]
               for p in long_functions("case.cc", source)]
        if got != expected:
            failures.append(f"expected {expected}, got {got} for:\n"
                            f"{source[:200]}")
    return failures


def main():
    args = [a for a in sys.argv[1:] if a != "--self-test"]
    failures = self_test()
    if failures:
        print("function_length_test: the reader is wrong:\n" +
              "\n".join(failures))
        return 1
    if "--self-test" in sys.argv[1:]:
        print("function_length_test: self-test ok")
        return 0
    root = os.path.abspath(args[0] if args else os.path.join(
        os.path.dirname(__file__), "..", ".."))
    checked, problems = check_tree(root)
    if problems:
        print("\n".join(problems))
        print(f"function_length_test: {len(problems)} functions over "
              f"{MAX_LINES} lines in {checked} files")
        return 1
    print(f"function_length_test: ok ({checked} files, every host function "
          f"within {MAX_LINES} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
