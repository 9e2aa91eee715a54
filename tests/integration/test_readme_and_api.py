"""The README quick start and the public names stay what the docs say."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import spanwarm.client
import spanwarm.errors

ROOT = Path(__file__).resolve().parents[2]


def test_quick_start_is_exactly_two_make_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1].split("##", 1)[0]
    block = re.search(r"```console\n(.*?)```", section, re.S)
    assert block is not None
    commands = [line.split("#", 1)[0].strip() for line in block[1].splitlines() if line.strip()]
    assert commands == ["make demo", "make test"]
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo:", makefile, re.M)
    assert re.search(r"^test:", makefile, re.M)
    assert (ROOT / ".ci" / "run").read_text().strip().endswith("make test")


def test_demo_runs_end_to_end() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "demo.py")],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    assert "node plan" in result.stdout
    assert re.search(r"rank 0: first tensor after \d+ ms, all \d+ after", result.stdout)
    assert re.search(r"rank 1: first tensor after \d+ ms", result.stdout)
    assert "bytes read from storage by the daemon" in result.stdout
    assert "daemon stopped with exit status 0" in result.stdout


def test_what_if_example_shows_node_plans() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "plan_whatif.py")],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert "--- 4 node(s) x 2 ranks ---" in result.stdout
    assert "spans" in result.stdout
    assert "whole" in result.stdout


def test_public_names_are_pinned() -> None:
    assert sorted(spanwarm.client.__all__) == [
        "Client",
        "KeyMap",
        "Progress",
        "TensorSpans",
        "Ticket",
        "rank_spans",
    ]
    exported = set(spanwarm.errors.__all__)
    defined = {
        name
        for name, value in vars(spanwarm.errors).items()
        if isinstance(value, type)
        and issubclass(value, Exception)
        and value.__module__ == "spanwarm.errors"
    }
    assert exported == defined


def test_importing_the_client_does_not_import_torch() -> None:
    code = (
        "import sys, spanwarm.client, spanwarm.planning.planner, spanwarm.daemon.server; "
        "print('torch' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"


def test_the_transformers_integration_imports_transformers_only_when_enabled() -> None:
    code = (
        "import sys, spanwarm.integrations.transformers as t; "
        "print(sorted(t.__all__), 'transformers' in sys.modules, 'torch' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == (
        "['LoadRecord', 'Prefetch', 'disable', 'enable', 'prefetch'] False False"
    )


def _layout_names() -> set[str]:
    """Every module and package docs/ARCHITECTURE.md's layout names, relative to
    src/spanwarm (packages end with a slash)."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    lines = block.split("src/spanwarm/\n", 1)[1].splitlines()
    names: set[str] = set()
    package = ""
    for line in lines:
        indent = len(line) - len(line.lstrip())
        if indent < 2:
            break  # past src/spanwarm/
        if indent >= 8:
            continue  # a description's continuation
        field = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
        listed = [n.strip() for n in field.split(",") if n.strip()]
        assert all(re.fullmatch(r"[\w/]+(\.py)?/?", n) for n in listed), line
        for name in listed:
            if indent == 2:
                names.add(name)
                if name.endswith("/"):
                    package = name
            else:
                names.add(package + name)
    return names


def test_the_architecture_layout_matches_the_tree() -> None:
    src = ROOT / "src" / "spanwarm"
    named = _layout_names()
    missing = sorted(n for n in named if not (src / n).exists())
    assert not missing, f"docs/ARCHITECTURE.md names what does not exist: {missing}"
    packages = {
        str(p.parent.relative_to(src)) + "/"
        for p in src.rglob("__init__.py")
        if p.parent != src and "__pycache__" not in p.parts
    }
    covered = {p for p in packages if any(n == p or n.startswith(p) for n in named)}
    assert packages == covered, f"packages the layout does not name: {sorted(packages - covered)}"
