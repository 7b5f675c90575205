"""The documentation is tested like code.

- Every ```python block of docs/*.md and README.md runs on the CPU: the blocks of one file in order, in
  one namespace, in a fresh subprocess whose working directory is a temporary one. A block whose first
  line is ``# gpu-only`` runs only where CUDA is available; one whose first line is
  ``# not-run: <reason>`` never runs (both are counted and capped: they must stay rare).
- Every ```yaml block is a config file that ``flextensor.load_config`` accepts.
- Every ``flextensor ...`` (or ``python -m flextensor.cli ...``) command in a shell block parses with the
  CLI's own parser, and every ``FT_*=value`` assignment there is accepted by ``load_config``.
- docs/api.md and the field table of docs/configuration.md are what docs/_gen.py generates, and
  configuration.md documents every OffloadConfig field and its FT_ variable.
- Relative links between the pages point at files and headings that exist.
- The examples of the product spec appear verbatim in the pages.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import flextensor
from flextensor.cli.main import build_parser, parse_budget
from flextensor.common.log import _parse_level
from flextensor.common.progress import _OFF, _ON
from flextensor.common.sizes import parse_bytes
from flextensor.config import sources as config_sources

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
README = ROOT / "README.md"

MAX_NOT_RUN = 5
MAX_GPU_ONLY = 5
PYTHON_TIMEOUT_S = 240

# The README is written for readers who bring their own model: its quick-start snippet names `YourModel`
# and `dataloader` without defining them. These stand-ins run before its blocks (and only its blocks).
README_PRELUDE = """
import torch
from torch import nn


class YourModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(100, 16)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.lm_head = nn.Linear(16, 100)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.lm_head(x)


_device = "cuda" if torch.cuda.is_available() else "cpu"
dataloader = [torch.randint(0, 100, (2, 8), device=_device) for _ in range(4)]
"""


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the block's first code line
    lang: str
    code: str

    @property
    def first_line(self) -> str:
        return next((ln.strip() for ln in self.code.splitlines() if ln.strip()), "")

    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`\n]*)$")


def fenced_blocks(path: Path) -> list[Block]:
    """Every fenced code block of a Markdown file, with its language and first line number."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        fence, indent = match["fence"], len(match["indent"])
        lang = (match["info"].split() or [""])[0].lower()
        body: list[str] = []
        j = i + 1
        while j < len(lines):
            closing = _FENCE.match(lines[j])
            if (
                closing
                and closing["fence"][0] == fence[0]
                and len(closing["fence"]) >= len(fence)
                and not closing["info"].strip()
            ):
                break
            body.append(lines[j][indent:] if lines[j][:indent].strip() == "" else lines[j])
            j += 1
        blocks.append(Block(path, i + 2, lang, "\n".join(body) + "\n"))
        i = j + 1
    return blocks


def doc_files() -> list[Path]:
    return PAGES + ([README] if README.exists() else [])


def all_blocks(*langs: str) -> list[Block]:
    return [b for path in doc_files() for b in fenced_blocks(path) if b.lang in langs]


def _ids(paths: list[Path]) -> list[str]:
    return [str(p.relative_to(ROOT)) for p in paths]


# ----------------------------------------------------------------------------------------------------------
# Python blocks

_RUNNER = r"""
import json, sys, warnings

warnings.filterwarnings("error", message=r".*pattern .* matches nothing")
warnings.filterwarnings("error", message=r".*was made on another setup")
spec = json.load(open(sys.argv[1]))
namespace = {"__name__": "__main__"}
if spec["prelude"]:
    exec(compile(spec["prelude"], "<test_docs prelude>", "exec"), namespace)
for block in spec["blocks"]:
    if block["skip"]:
        continue
    # Pad with newlines so that tracebacks give the line number in the Markdown file.
    source = "\n" * (block["line"] - 1) + block["code"]
    exec(compile(source, block["path"], "exec"), namespace)
print("ran", sum(not b["skip"] for b in spec["blocks"]), "blocks")
"""


def _skip_reason(block: Block) -> str | None:
    first = block.first_line
    if first.startswith("# not-run"):
        return "not-run"
    if first.startswith("# gpu-only") and not torch.cuda.is_available():
        return "gpu-only"
    return None


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FT_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_VERBOSITY"] = "error"
    env["FT_PROGRESS"] = "0"
    return env


def _python_blocks(path: Path) -> list[Block]:
    return [b for b in fenced_blocks(path) if b.lang in ("python", "py")]


PYTHON_FILES = [p for p in doc_files() if _python_blocks(p)]


def _run_blocks(path: Path, blocks: list[Block], tmp_path: Path, skip: Any) -> None:
    spec = {
        "prelude": textwrap.dedent(README_PRELUDE) if path == README else "",
        "blocks": [
            {"path": str(b.path), "line": b.line, "code": b.code, "skip": skip(b) is not None} for b in blocks
        ],
    }
    spec_file = tmp_path / "blocks.json"
    spec_file.write_text(json.dumps(spec), encoding="utf-8")
    result = subprocess.run(
        [sys.executable, "-c", _RUNNER, str(spec_file)],
        cwd=tmp_path,
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=PYTHON_TIMEOUT_S,
    )
    assert result.returncode == 0, (
        f"a python block of {path.relative_to(ROOT)} failed (the traceback's line numbers are the "
        f"file's):\n{result.stderr[-6000:]}"
    )


@pytest.mark.parametrize("path", PYTHON_FILES, ids=_ids(PYTHON_FILES))
def test_python_blocks_run(path: Path, tmp_path: Path) -> None:
    _run_blocks(path, _python_blocks(path), tmp_path, _skip_reason)


GPU_ONLY_BLOCKS = [
    (path, index)
    for path in PYTHON_FILES
    for index, block in enumerate(_python_blocks(path))
    if block.first_line.startswith("# gpu-only")
]


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("path", "index"), GPU_ONLY_BLOCKS, ids=[f"{p.name}:{i}" for p, i in GPU_ONLY_BLOCKS] or None
)
def test_gpu_only_blocks_run(path: Path, index: int, tmp_path: Path) -> None:
    """Each ``# gpu-only`` block, with the blocks before it: a visible skip without CUDA, not a silent one."""
    if not torch.cuda.is_available():
        pytest.skip(f"{path.name}: a # gpu-only block needs a CUDA device (run on the GPU machine)")
    blocks = _python_blocks(path)[: index + 1]
    _run_blocks(path, blocks, tmp_path, lambda b: "not-run" if b.first_line.startswith("# not-run") else None)


def test_skipped_blocks_are_rare_and_explained() -> None:
    blocks = all_blocks("python", "py")
    not_run = [b for b in blocks if b.first_line.startswith("# not-run")]
    gpu_only = [b for b in blocks if b.first_line.startswith("# gpu-only")]
    for block in not_run:
        assert re.match(r"# not-run: \S", block.first_line), (
            f"{block.where()}: say why: '# not-run: <reason>'"
        )
    assert len(not_run) <= MAX_NOT_RUN, [b.where() for b in not_run]
    assert len(gpu_only) <= MAX_GPU_ONLY, [b.where() for b in gpu_only]


# ----------------------------------------------------------------------------------------------------------
# YAML blocks


@pytest.mark.parametrize(
    "block", all_blocks("yaml", "yml"), ids=[b.where() for b in all_blocks("yaml", "yml")]
)
def test_yaml_blocks_are_valid_configs(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in [v for v in os.environ if v.startswith("FT_")]:
        monkeypatch.delenv(var)
    path = tmp_path / "config.yaml"
    path.write_text(block.code, encoding="utf-8")
    flextensor.load_config(path)


# ----------------------------------------------------------------------------------------------------------
# Shell blocks: flextensor commands and FT_ variables

SHELL_LANGS = ("bash", "sh", "shell", "console", "zsh")
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def shell_commands(block: Block) -> list[list[str]]:
    """The simple commands of a shell block, as argument lists (prompts, comments, operators removed)."""
    text = block.code.replace("\\\n", " ")
    commands: list[list[str]] = []
    for raw in text.splitlines():
        line = raw.strip()
        if block.lang == "console":
            if not line.startswith("$ "):
                continue  # output, not a command
            line = line[2:]
        if not line or line.startswith("#"):
            continue
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|()<>")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        current: list[str] = []
        for token in lexer:
            if token and set(token) <= set(";&|()<>"):
                if current:
                    commands.append(current)
                current = []
            else:
                current.append(token)
        if current:
            commands.append(current)
    return commands


def _split_env(command: list[str]) -> tuple[dict[str, str], list[str]]:
    """Leading ``VAR=value`` assignments (also after ``export``/``env``) and the rest of the command."""
    env: dict[str, str] = {}
    rest = list(command)
    if rest and rest[0] in ("export", "env"):
        rest = rest[1:]
    while rest and _ASSIGNMENT.match(rest[0]):
        name, _, value = rest.pop(0).partition("=")
        env[name] = value
    return env, rest


def _cli_argv(words: list[str]) -> list[str] | None:
    if words and words[0] == "flextensor":
        return words[1:]
    if (
        len(words) >= 3
        and re.fullmatch(r"python3?(\.\d+)?", words[0])
        and words[1:3] == ["-m", "flextensor.cli"]
    ):
        return words[3:]
    return None


def _check_cli(argv: list[str], where: str) -> None:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        assert exit_.code == 0, f"{where}: `flextensor {shlex.join(argv)}` does not parse"
        return
    command = getattr(args, "command", None)
    if command == "plan":
        parse_budget(args.budget, args.steps)
    elif command == "probe":
        assert all(parse_bytes(s) > 0 for s in args.sizes.split(",") if s.strip())
    elif command == "demo" and args.budget is not None and args.budget.strip().lower() != "none":
        parse_bytes(args.budget)
    elif command == "profile":
        assert getattr(args, "profile_command", None), f"{where}: `flextensor profile` needs an action"


def _check_env(env: dict[str, str], where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    ours = {k: v for k, v in env.items() if k.startswith("FT_")}
    if not ours:
        return
    if "FT_LOG_LEVEL" in ours:
        assert _parse_level(ours["FT_LOG_LEVEL"]) is not None, f"{where}: FT_LOG_LEVEL={ours['FT_LOG_LEVEL']}"
    if "FT_PROGRESS" in ours:
        assert ours["FT_PROGRESS"].strip().lower() in _ON | _OFF, (
            f"{where}: FT_PROGRESS={ours['FT_PROGRESS']}"
        )
    fields = {k: v for k, v in ours.items() if k not in config_sources.NON_FIELD_ENV_VARS}
    with monkeypatch.context() as patch:
        for var in [v for v in os.environ if v.startswith("FT_")]:
            patch.delenv(var)
        for var, value in fields.items():
            patch.setenv(var, value)
        flextensor.load_config()  # raises ConfigError, naming the variable, if one is wrong


def test_shell_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    checked = 0
    for block in all_blocks(*SHELL_LANGS):
        for command in shell_commands(block):
            env, words = _split_env(command)
            _check_env(env, block.where(), monkeypatch)
            argv = _cli_argv(words)
            if argv is not None:
                _check_cli(argv, block.where())
                checked += 1
    assert checked > 0, "no flextensor command found in any shell block"


def test_shell_command_parsing() -> None:
    block = Block(
        README,
        1,
        "bash",
        "FT_DEVICE=cuda:1 flextensor plan p.json --budget 4GiB..16GiB && echo done  # what-ifs\n"
        "python -m flextensor.cli profile show \\\n  p.json\n",
    )
    assert shell_commands(block) == [
        ["FT_DEVICE=cuda:1", "flextensor", "plan", "p.json", "--budget", "4GiB..16GiB"],
        ["echo", "done"],
        ["python", "-m", "flextensor.cli", "profile", "show", "p.json"],
    ]
    env, words = _split_env(shell_commands(block)[0])
    assert env == {"FT_DEVICE": "cuda:1"} and _cli_argv(words) == [
        "plan",
        "p.json",
        "--budget",
        "4GiB..16GiB",
    ]
    with pytest.raises(AssertionError):
        _check_cli(["plan"], "example")  # PATH is required


# ----------------------------------------------------------------------------------------------------------
# Generated pages


def _load_gen():
    spec = importlib.util.spec_from_file_location("docs_gen", DOCS / "_gen.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_docs_are_current() -> None:
    problems = _load_gen().check()
    assert not problems, "; ".join(problems) + " (run `python docs/_gen.py`)"


def test_configuration_documents_every_field_and_variable() -> None:
    text = (DOCS / "configuration.md").read_text(encoding="utf-8")
    for name in flextensor.OffloadConfig.model_fields:
        assert f"### `{name}`" in text, name
        assert flextensor.OffloadConfig.env_var(name) in text, name
    for var in ("FT_LOG_LEVEL", "FT_PROGRESS", "FT_CONFIG_FILE"):
        assert var in text


def test_api_reference_covers_all_public_names() -> None:
    text = (DOCS / "api.md").read_text(encoding="utf-8")
    for name in flextensor.__all__:
        assert f"### `{name}`" in text, name


# ----------------------------------------------------------------------------------------------------------
# Links


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text, lower case, punctuation but - and _ dropped, - for spaces."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link counts by its text
    text = text.replace("`", "").replace("*", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a Markdown file (code blocks ignored; duplicates numbered)."""
    fenced = {b.line + i for b in fenced_blocks(path) for i in range(-1, b.code.count("\n") + 1)}
    seen: dict[str, int] = {}
    found = set()
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match or number in fenced:
            continue
        slug = _slug(match[1])
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def test_relative_links_resolve() -> None:
    broken = []
    for path in doc_files():
        text = path.read_text(encoding="utf-8")
        text = re.sub(r"```.*?```", "", text, flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # http:, https:, mailto:
            file_part, _, anchor = target.partition("#")
            linked = (path.parent / file_part).resolve() if file_part else path
            if not linked.exists():
                broken.append(f"{path.name}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                broken.append(f"{path.name}: {target} (no such heading)")
    assert not broken, broken


def test_index_links_every_page() -> None:
    index = (DOCS / "index.md").read_text(encoding="utf-8")
    for page in PAGES:
        if page.name != "index.md":
            assert f"({page.name})" in index, f"index.md does not link {page.name}"


# ----------------------------------------------------------------------------------------------------------
# The spec's examples appear verbatim

SPEC_PYTHON = {
    "quickstart.md": [
        """\
        import flextensor

        model = YourModel()  # Initialize on CPU

        model = flextensor.offload(
            model,
            config=flextensor.OffloadConfig(
                include_patterns=["layers.*"],
            ),
        )

        # Initial iterations discover tensor usage and profile execution.
        for batch in dataloader:
            output = model(batch)
        """,
    ],
    "patterns.md": [
        """\
        config = OffloadConfig(
            include_patterns=["*"],
            exclude_patterns=["lm_head"],
        )
        model = flextensor.offload(model, config=config)
        """,
        """\
        config = OffloadConfig(
            include_patterns=["layers.*"],
            exclude_patterns=["*.scale"],
        )
        """,
        """\
        config = OffloadConfig(
            include_patterns=["layers.*"],
            exclude_patterns=["layers.31"],
        )
        """,
        """\
        config = OffloadConfig(
            include_patterns=["layers.*"],
            exclude_patterns=["class:SharedExpertMLP", "class:MoELayer"],
        )
        """,
        """\
        # Match only torch.nn.Linear, not a user-defined Linear
        config = OffloadConfig(
            include_patterns=["layers.*"],
            exclude_patterns=["class:torch.nn.*.Linear"],
        )
        """,
        """\
        config = OffloadConfig(
            include_patterns=["embed", "layers.*", "head"],
            exclude_patterns=["head", "*.norm"],
        )
        # Result: offloads embed and layers.* but NOT head or any *.norm sub-modules
        """,
        """\
        config = flextensor.load_config()
        model = flextensor.offload(model, config=config)
        """,
        """\
        config = OffloadConfig(
            include_patterns=["layers.*"],
            exclude_patterns=["layers.*.norm"],
        )
        # Result: layers.0, layers.1, ... are offloaded but norm parameters stay on GPU
        """,
    ],
}
SPEC_SHELL = {"patterns.md": ['FT_INCLUDE_PATTERNS="*" FT_EXCLUDE_PATTERNS="lm_head,*.norm" python serve.py']}
SPEC_YAML = {
    "patterns.md": [
        """\
        include_patterns:
          - "*"
        exclude_patterns:
          - "lm_head"
          - "*.scale"
        """
    ]
}


SPEC_CASES = (
    [(p, ("python",), s) for p, ss in SPEC_PYTHON.items() for s in ss]
    + [(p, SHELL_LANGS, s) for p, ss in SPEC_SHELL.items() for s in ss]
    + [(p, ("yaml",), s) for p, ss in SPEC_YAML.items() for s in ss]
)


@pytest.mark.parametrize(
    ("page", "langs", "snippet"),
    SPEC_CASES,
    ids=[f"{page}-{langs[0]}-{i}" for i, (page, langs, _) in enumerate(SPEC_CASES)],
)
def test_spec_examples_appear_verbatim(page: str, langs: tuple[str, ...], snippet: str) -> None:
    blocks = [b.code for b in fenced_blocks(DOCS / page) if b.lang in langs]
    expected = textwrap.dedent(snippet).strip()
    assert any(expected in code for code in blocks), f"{page} lacks the spec's example:\n{expected}"
