"""The package's type stubs (client/python/lossd/*.pyi) against the modules they describe: a stub
that names something the module lacks, or misses a public name of it, misleads every type checker
and editor of a user without any test failing. Each name a stub declares (and each method of its
classes) must exist at run time, and each public name of the modules must be declared."""

import ast
import importlib
import inspect
import os

import pytest

import lossd

STUBS = os.path.join(os.path.dirname(__file__), "..", "..", "client", "python", "lossd")


def declared(stub):
    """{name: set of method names for a class, else None} of what a stub declares at top level."""
    with open(os.path.join(STUBS, stub)) as f:
        tree = ast.parse(f.read())
    names = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            names[node.name] = None
        elif isinstance(node, ast.ClassDef):
            methods = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
            # A class inherits the methods of its bases that the stub declares before it.
            for base in node.bases:
                if isinstance(base, ast.Name) and names.get(base.id):
                    methods |= names[base.id]
            names[node.name] = methods
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = None
        elif isinstance(node, ast.ImportFrom) and node.level == 1:
            # "from ._lossd import X as X": a re-export (PEP 484); other imports are the stub's own.
            names.update({a.name: None for a in node.names if a.asname == a.name})
    return names


def defined_here(module):
    """The public classes and functions that `module` itself defines (not those it imports)."""
    return {name for name, value in vars(module).items()
            if not name.startswith("_") and (inspect.isclass(value) or callable(value))
            and getattr(value, "__module__", "").startswith(module.__name__)}


STUB_MODULES = [("_lossd.pyi", "lossd._lossd"), ("__init__.pyi", "lossd"),
                ("torch.pyi", "lossd.torch")]


@pytest.mark.parametrize("stub,module_name", STUB_MODULES)
def test_every_declared_name_exists(stub, module_name):
    module = importlib.import_module(module_name)
    for name, methods in declared(stub).items():
        if name.startswith("_"):
            continue  # a name of the stubs only (a shared base); its subclasses carry its methods
        assert hasattr(module, name), "%s declares %s, which %s lacks" % (stub, name, module_name)
        for method in methods or ():
            assert hasattr(getattr(module, name), method), \
                "%s declares %s.%s, which %s lacks" % (stub, name, method, module_name)


def test_the_extension_is_declared_whole():
    extension = importlib.import_module("lossd._lossd")
    stub = declared("_lossd.pyi")
    public = {n for n in dir(extension) if not n.startswith("_")}
    assert public - set(stub) == set()
    for name, methods in stub.items():
        if methods is None or name.startswith("_"):
            continue
        # The package adds the *_async methods to Client (_futures): they are the stub's too.
        runtime = {n for n in dir(getattr(extension, name)) if not n.startswith("_")}
        assert runtime - methods == set(), "%s's methods missing from _lossd.pyi" % name


def test_the_package_and_torch_are_declared_whole():
    assert set(lossd.__all__) - set(declared("__init__.pyi")) == set()
    torch_module = importlib.import_module("lossd.torch")
    assert defined_here(torch_module) - set(declared("torch.pyi")) == set()
