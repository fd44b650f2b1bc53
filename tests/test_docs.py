"""The manual builds: mkdocs in strict mode (a broken link or anchor, a page outside the nav, a
missing page, a module the API reference names that does not import its docstrings all fail),
offline, into a temporary directory; and every relative link of README.md names a file that
exists (GitHub renders README.md from the repository, outside the site)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(240)
def test_the_site_builds_in_strict_mode(tmp_path: Path) -> None:
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    site = tmp_path / "site"
    for page in ("index.html", "fleet/index.html", "BENCHMARKS/index.html", "api/fleet/index.html"):
        assert (site / page).is_file(), page
    # the API reference is generated from the docstrings, not left empty
    api = (site / "api" / "fleet" / "index.html").read_text()
    assert "distributed_optimizer" in api and "doc-heading" in api


def test_readme_links_name_existing_files() -> None:
    text = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    assert targets, "README.md has no links"
    missing = []
    for target in targets:
        if re.match(r"[a-z]+://", target):
            continue
        path = target.split("#", 1)[0]
        if path and not (ROOT / path).exists():
            missing.append(target)
    assert not missing, f"README.md links to files that do not exist: {missing}"
