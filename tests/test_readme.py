"""The README's two commands are the ones CI and users run."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _bash_blocks(text: str) -> list[str]:
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", text, flags=re.S)]


def test_ci_runs_exactly_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    test_command = next(b for b in _bash_blocks(readme) if "pytest" in b)
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test_command in ci_lines


def test_readme_demo_command_uses_the_console_script() -> None:
    readme = (ROOT / "README.md").read_text()
    demo = next(b for b in _bash_blocks(readme) if "demo" in b)
    assert demo.endswith("flextensor demo")
    assert 'flextensor = "flextensor.cli.main:main"' in (ROOT / "pyproject.toml").read_text()
