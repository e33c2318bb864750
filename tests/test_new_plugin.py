"""`xmcbench new-plugin NAME` writes a package that installs and passes its own tests as written, and those
tests write nothing into the package's folder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_bad_input import assert_one_line_error, xmcbench
from xmcbench.errors import XmcError
from xmcbench.scaffold import package_names, write_plugin


def files_under(folder: Path) -> set[str]:
    return {str(path.relative_to(folder)) for path in folder.rglob("*") if path.is_file()}


def test_the_package_layout_and_names(tmp_path):
    folder = write_plugin("cosine-ranker", tmp_path)
    assert folder == tmp_path / "xmcbench-cosine-ranker"
    assert files_under(folder) == {"pyproject.toml", "README.md", "xmcbench_cosine_ranker/__init__.py",
                                   "xmcbench_cosine_ranker/plugin.py", "xmcbench_cosine_ranker/components.py",
                                   "tests/test_xmcbench_cosine_ranker.py"}
    pyproject = (folder / "pyproject.toml").read_text()
    assert '[project.entry-points.xmcbench]\ncosine-ranker = "xmcbench_cosine_ranker.plugin"' in pyproject
    assert package_names("a1-b2") == ("xmcbench-a1-b2", "xmcbench_a1_b2")
    with pytest.raises(XmcError, match="already exists"):
        write_plugin("cosine-ranker", tmp_path)


@pytest.mark.parametrize("name", ["", "Cosine", "two words", "x-", "x--y", "1x", "x/y"])
def test_a_bad_name_is_refused_in_one_line(name, tmp_path):
    assert_one_line_error(xmcbench("new-plugin", name, "--output", str(tmp_path)), "must be lowercase letters")
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
def test_the_written_package_installs_and_passes_its_tests(tmp_path):
    result = xmcbench("new-plugin", "cosine-ranker", "--output", str(tmp_path))
    assert result.returncode == 0, result.stderr
    folder = tmp_path / "xmcbench-cosine-ranker"
    site = tmp_path / "site"   # installed beside, not into, this environment: its entry point stays local
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                              "--no-index", "--target", str(site), str(folder)], capture_output=True, text=True)
    assert install.returncode == 0, install.stderr
    before = files_under(folder)
    environment = {**os.environ, "PYTHONPATH": str(site), "PYTHONDONTWRITEBYTECODE": "1"}
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q"], cwd=folder, env=environment,
                           capture_output=True, text=True)
    assert tests.returncode == 0, tests.stdout[-3000:] + tests.stderr[-2000:]
    assert "7 passed" in tests.stdout
    assert files_under(folder) == before   # the plugin's tests wrote nothing into its folder


def test_an_output_that_cannot_be_written_is_one_line(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    assert_one_line_error(xmcbench("new-plugin", "cosine", "--output", str(blocker)),
                          "cannot write the plugin package into", "choose another --output")
