"""ctest's entry for the Python tests: pytest on python/tests against the package in a build tree.

usage: run.py BUILD_TREE_PYTHON_DIR [pytest args...]
Exits 77 (ctest: skipped) with the reason when pytest, numpy or ml_dtypes are missing.
"""
import os
import sys

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.abspath(sys.argv[1]))
missing = []
for name in ("pytest", "numpy", "ml_dtypes"):
    try:
        __import__(name)
    except ImportError:
        missing.append(name)
if missing:
    print(f"python_tests skipped: {', '.join(missing)} not installed for {sys.executable} (scripts/install-deps installs them)")
    sys.exit(77)

import pytest  # noqa: E402

os.environ["PYTHONPATH"] = os.pathsep.join([sys.path[0], os.environ.get("PYTHONPATH", "")])
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", here, *sys.argv[2:]]))
