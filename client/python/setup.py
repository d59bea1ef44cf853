"""Builds the lossd Python package (pip install / pip wheel) with the project's CMake: build_ext
configures the repository two folders up, builds the lossd_python target (the extension, the
copied pure-Python files, the generated lossd.v1 stubs and _version.py) and copies that package
folder into the wheel.

LOSSD_CMAKE_BUILD_DIR names an existing CMake build folder of the repository to build in (CI
reuses its build, so nothing is compiled twice); it must be configured for this Python's version.
Without it a fresh Release build goes under setuptools' build_temp. CMAKE_BUILD_PARALLEL_LEVEL
sets the build's jobs (default: the CPU count)."""

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


def project_version():
    """CMakeLists.txt's project(lossd VERSION x.y.z): the one place the version is written."""
    text = (ROOT / "CMakeLists.txt").read_text()
    match = re.search(r"project\(\s*lossd\s+VERSION\s+([0-9.]+)", text)
    if not match:
        sys.exit("setup.py: no project(lossd VERSION ...) in %s" % (ROOT / "CMakeLists.txt"))
    return match.group(1)


# The extension's shared libraries that a machine with the same Python and glibc may lack:
# protobuf, Abseil and re2 (gRPC itself is linked in; client/python/CMakeLists.txt says why).
# Carried in lossd/lib under their sonames, as auditwheel does, and found through the
# extension's RPATH ($ORIGIN/lib). A process that loaded the same soname first (Debian's
# python3-protobuf) shares that copy: the same library.
BUNDLED = re.compile(r"^lib(protobuf|absl_\w+|re2)\.so")


def bundle_libraries(extension, folder):
    listing = subprocess.run(["ldd", str(extension)], capture_output=True, text=True,
                             check=True).stdout
    for soname, path in re.findall(r"^\s*(\S+) => (/\S+)", listing, re.M):
        if BUNDLED.match(soname):
            folder.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, folder / soname)


class CMakeBuild(build_ext):
    """Builds lossd._lossd with CMake instead of setuptools' compiler."""

    def run(self):
        existing = os.environ.get("LOSSD_CMAKE_BUILD_DIR")
        if existing:
            build_dir = Path(existing).resolve()
            if not (build_dir / "CMakeCache.txt").exists():
                sys.exit("setup.py: LOSSD_CMAKE_BUILD_DIR=%s is not a configured CMake build"
                         % build_dir)
        else:
            build_dir = Path(self.build_temp).resolve() / "cmake"
            self._configure(build_dir)
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 1))
        subprocess.check_call(["cmake", "--build", str(build_dir), "--target", "lossd_python",
                               "-j", jobs])
        package = build_dir / "client" / "python" / "lossd"
        suffix = sysconfig.get_config_var("EXT_SUFFIX")
        extension = package / ("_lossd" + suffix)
        if not extension.exists():
            built = sorted(p.name for p in package.glob("_lossd*.so"))
            sys.exit("setup.py: %s has %s, not _lossd%s: that build is for another Python "
                     "(configure it with -DLOSSD_PYTHON=%s)"
                     % (package, built or "no extension", suffix, sys.executable))
        # The whole built package (the extension, lossd.v1's stubs, _version.py and the copied
        # sources) replaces what build_py put there from the source folder.
        destination = Path(self.get_ext_fullpath("lossd._lossd")).parent
        for source in package.rglob("*"):
            if source.is_dir() or "__pycache__" in source.parts:
                continue
            if source.name.startswith("_lossd") and source.name != extension.name:
                continue
            target = destination / source.relative_to(package)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
            if source == extension and shutil.which("strip"):
                # A RelWithDebInfo build's debug information triples the wheel.
                subprocess.check_call(["strip", "--strip-debug", str(target)])
        bundle_libraries(extension, destination / "lib")

    def _configure(self, build_dir):
        if (build_dir / "CMakeCache.txt").exists():
            return
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        subprocess.check_call(
            ["cmake", "-S", str(ROOT), "-B", str(build_dir), *generator,
             "-DCMAKE_BUILD_TYPE=Release", "-DLOSSD_BUILD_TESTS=OFF", "-DLOSSD_CUDA=OFF",
             "-DLOSSD_PYTHON=" + sys.executable])


def build_folders():
    """With LOSSD_CMAKE_BUILD_DIR, setuptools' own build and egg-info folders go under it too, so
    that a build from CI leaves the source tree as it was."""
    existing = os.environ.get("LOSSD_CMAKE_BUILD_DIR")
    if not existing:
        return {}
    base = Path(existing).resolve() / "python-setup"
    base.mkdir(parents=True, exist_ok=True)
    return {"build": {"build_base": str(base / "build")}, "egg_info": {"egg_base": str(base)}}


setup(
    name="lossd",
    version=project_version(),
    description="Python client of lossd, a GPU-resident cross-entropy service",
    python_requires=">=3.9",
    install_requires=["numpy"],
    extras_require={"torch": ["torch"], "grpc": ["grpcio", "protobuf"]},
    packages=["lossd", "lossd.v1"],
    package_data={"lossd": ["*.pyi", "py.typed"]},
    ext_modules=[Extension("lossd._lossd", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
    zip_safe=False,
    options=build_folders(),
)
