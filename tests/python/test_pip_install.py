"""`pip install ./python` into a virtual environment, offline, as a user
installs the package: `python3 -m venv --system-site-packages` (Debian's
numpy and torch seen), then `pip install --no-build-isolation --no-index`
of a copy of python/ (built with Debian's setuptools, nothing fetched; the
copy keeps the checkout free of build output). The installed package, run
from elsewhere with $MESHRUN_PREFIX naming the build folder and no
$MESHRUN_LIBRARY, imports from the environment's site-packages, finds
libmeshrun.so.1 under the prefix, and plans a config.

Run by ctest: test_pip_install.py BUILD_DIR
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")

CHECK = """
import importlib.metadata, json, os, sys
import meshrun
print(json.dumps({"file": meshrun.__file__, "abi": meshrun.abi_version(),
                  "axes": meshrun.plan(sys.argv[1], world_size=4)["axes"],
                  "version": importlib.metadata.version("meshrun"),
                  "library_version": meshrun.library_version()}))
"""


class PipInstall(unittest.TestCase):
    def test_installs_offline_and_finds_the_library_under_the_prefix(self):
        root = tempfile.mkdtemp(prefix="meshrun-pip-")
        venv = os.path.join(root, "venv")
        subprocess.run(["/usr/bin/python3", "-m", "venv", "--system-site-packages", venv],
                       check=True)
        source = os.path.join(root, "python")
        shutil.copytree(os.path.join(ROOT, "python"), source,
                        ignore=shutil.ignore_patterns("__pycache__", "CMakeLists.txt"))
        python = os.path.join(venv, "bin", "python")
        result = subprocess.run([python, "-m", "pip", "install", "--no-build-isolation",
                                 "--no-index", source], capture_output=True, text=True,
                                timeout=300)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        env = {k: v for k, v in os.environ.items() if k not in ("MESHRUN_LIBRARY", "PYTHONPATH")}
        env["MESHRUN_PREFIX"] = BUILD_DIR
        result = subprocess.run([python, "-c", CHECK,
                                 os.path.join(ROOT, "examples", "llama-tiny.toml")],
                                capture_output=True, text=True, timeout=120, env=env, cwd=root)
        self.assertEqual(result.returncode, 0, result.stderr)
        report = json.loads(result.stdout)
        self.assertTrue(report["file"].startswith(venv), report["file"])
        self.assertEqual(report["abi"][0], 1)
        self.assertTrue(report["axes"], report)
        # pyproject.toml repeats CMake's project version: they must agree.
        self.assertEqual(report["version"], report["library_version"], report)


if __name__ == "__main__":
    BUILD_DIR = sys.argv.pop(1)
    unittest.main(verbosity=2)
