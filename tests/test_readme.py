"""The README's examples must run as written."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_readme_toml_example_runs(tmp_path):
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```toml\n(.*?)```", text, re.S).group(1)
    config = tmp_path / "example.toml"
    config.write_text(block)
    out = subprocess.run([sys.executable, "-m", "impl.cli", "simulate", "--config", str(config), "--json"],
                         cwd=ROOT, check=True, capture_output=True, text=True).stdout
    import json

    summary = json.loads(out)["runs"]["on"]
    assert summary["completed"] == summary["turns"] > 48  # 48 conversations of several turns each


def test_quick_start_names_exactly_two_commands_and_ci_runs_the_test_one():
    text = (ROOT / "README.md").read_text()
    quick = text.split("## Quick start", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [line.split("#")[0].strip() for line in quick.splitlines() if line.strip()]
    assert commands == ["bash tools/demo.sh", "bash tools/test.sh"]
    assert "exec bash tools/test.sh" in (ROOT / ".ci" / "run").read_text()


def test_the_architecture_diagram_names_every_policy_module():
    """A newcomer reads the diagram to find where a decision lives: every module of impl/policy is on it."""
    text = (ROOT / "README.md").read_text()
    diagram = text.split("## Architecture", 1)[1].split("```", 2)[1]
    modules = sorted(p.name for p in (ROOT / "impl" / "policy").glob("*.py") if p.name != "__init__.py")
    missing = [m for m in modules if m not in diagram]
    assert not missing, f"the README's architecture diagram does not name {missing}"
