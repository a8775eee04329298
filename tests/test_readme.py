"""The README says what the code does, and its commands work as written.

Conventions of README.md, which this module relies on:
- ```bash blocks are run, in the README's order, by bash -euo pipefail in one temporary
  directory outside the repository ("from any directory"), with what the README's set-up asks
  for: SPECBATCH_HOME (the clone), VIRTUAL_ENV and its bin/ first on PATH.
- ```console blocks are commands the test does not run; each must match an entry of NOT_RUN,
  which says why.
- The ```text block after `<!-- output-tree -->` is the output location's tree: compared with
  what the README's job left, entry for entry, when the walk-through reaches it.

Engines: the walk-through runs one job (`specbatch run job.yaml`: the probe, then one engine);
its rerun and its `ray job submit` find every unit committed and start none. The demo block
runs from the installed wheel, as the Docker image runs it (tests/test_install.py).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipeline.tools.config_reference import COMMAND, render, undescribed

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SPECBATCH = str(Path(sys.executable).with_name("specbatch"))

# Substring of a ```console block -> why the test does not run it.
NOT_RUN = {
    "make demo": "creates .venv in the clone (minutes of pip) and runs the whole suite (make test, this test "
    "included); the demo itself runs as `specbatch demo` (tests/test_install.py)",
    "export SPECBATCH_HOME": "the test sets SPECBATCH_HOME, VIRTUAL_ENV and PATH itself (the virtualenv of a "
    "worktree may live outside it)",
    "ray start --head": "would take this machine's default Ray ports and ~/.ray; the ray_head fixture starts a "
    "head on free ports with token authentication and the walk-through passes on its RAY_ADDRESS, "
    "RAY_AUTH_MODE=token and token (RAY_AUTH_TOKEN), as that block's text says",
    "http://HEAD:8265": "a GPU cluster with the config in S3",
    "specbatch calibrate": "starts one engine per depth (tests/test_calibrate.py runs a calibration); the export "
    "needs a job that read OpenAI batch files (tests/test_openai_batch.py exports one)",
}

# The first console block that stands for the head: the walk-through's shell has its
# environment from then on, as the reader's shell would.
HEAD_BLOCK = "ray start --head"
TREE_MARKER = "output-tree"


@dataclass
class Block:
    lang: str
    body: str
    marker: str | None
    line: int


FENCE = re.compile(r"^(?:<!-- (?P<marker>[\w-]+) -->\n)?```(?P<lang>\w*)\n(?P<body>.*?)^```\s*$", re.M | re.S)


def readme_blocks(text: str | None = None) -> list[Block]:
    text = README.read_text() if text is None else text
    return [
        Block(m["lang"], m["body"], m["marker"], text.count("\n", 0, m.start("body")) + 1) for m in FENCE.finditer(text)
    ]


def readme_env() -> dict[str, str]:
    """The reader's shell after the README's set-up: the virtualenv active, SPECBATCH_HOME
    naming the clone, and no Ray cluster chosen (the session's own Ray settings dropped)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH") and k != "RAY_ADDRESS"}
    env.update(
        SPECBATCH_HOME=str(ROOT),
        VIRTUAL_ENV=sys.prefix,
        PATH=f"{Path(sys.prefix) / 'bin'}{os.pathsep}{env.get('PATH', '')}",
    )
    return env


def run_block(block: Block, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    out = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block.body], cwd=cwd, env=env, capture_output=True, text=True, timeout=1800
    )
    assert out.returncode == 0, (
        f"README.md line {block.line}, run in {cwd}:\n{block.body}\nexit {out.returncode}\n"
        f"--- stdout\n{out.stdout[-3000:]}\n--- stderr\n{out.stderr[-4000:]}"
    )
    assert "Traceback" not in out.stdout + out.stderr, out.stderr[-4000:]
    return out


UNIT_ID = re.compile(r"[^/]+-r\d{10}-[0-9a-f]{16}")


def generalized_tree(root: Path) -> set[str]:
    """Every file and empty folder under root, as `root/...` paths with the README's names for
    what varies: <unit_id>, <token> and <NNNN>."""
    entries = set()
    for path in root.rglob("*"):
        rel = path.relative_to(root.parent).as_posix()
        if path.is_dir():
            if not any(path.iterdir()):
                entries.add(rel + "/")
        else:
            entries.add(rel)
    out = set()
    for entry in entries:
        entry = UNIT_ID.sub("<unit_id>", entry)
        entry = re.sub(r"\.g\d+-[0-9a-f]{12}\.parquet$", ".<token>.parquet", entry)
        out.add(re.sub(r"/attempt-\d{4}\.parquet$", "/attempt-<NNNN>.parquet", entry))
    return out


def readme_tree(block: Block) -> tuple[str, set[str]]:
    """The tree block: its root folder, and its entries as `root/...` paths."""
    lines = [ln for ln in block.body.splitlines() if ln.strip()]
    root = lines[0].split()[0].rstrip("/")
    return root, {f"{root}/{ln.split()[0]}" for ln in lines[1:]}


def check_output_tree(block: Block, workdir: Path) -> None:
    root, documented = readme_tree(block)
    left = generalized_tree(workdir / root)
    assert left == documented, (
        f"README.md line {block.line}: the output tree is not what the job left.\n"
        f"  left by the job, not in the README: {sorted(left - documented)}\n"
        f"  in the README, not left by the job: {sorted(documented - left)}"
    )
    # The drafter column holds what the README says, the README's example included.
    from pipeline.job.plan import model_fingerprint

    drafter_dir = ROOT / "models" / "tinykit" / "drafter-eagle31"
    expected = f"drafter-eagle31@{model_fingerprint(str(drafter_dir)).config_sha256[:12]}"
    drafters = set()
    for path in (workdir / root / "outputs").glob("*.parquet"):
        drafters |= set(pq.read_table(path, columns=["drafter"]).column("drafter").to_pylist())
    assert drafters == {expected}
    assert f"`{expected}`" in README.read_text(), f"the README's example of the drafter column is not {expected}"


# ---------------------------------------------------------------- the commands, as written


def test_every_console_block_says_why_it_is_not_run():
    blocks = readme_blocks()
    for block in blocks:
        if block.lang == "console":
            assert any(key in block.body for key in NOT_RUN), (
                f"README.md line {block.line}: a ```console block the test does not run; run it (```bash) "
                f"or say why in NOT_RUN:\n{block.body}"
            )
        else:
            assert block.lang in ("bash", "text", "yaml", "python"), (
                f"README.md line {block.line}: fence {block.lang!r}"
            )
    for key in NOT_RUN:
        assert any(key in b.body for b in blocks if b.lang == "console"), f"NOT_RUN names {key!r}, no block has it"
    assert sum(b.marker == TREE_MARKER for b in blocks) == 1


@pytest.mark.engine
def test_readme_commands_work_as_written(tmp_path_factory, request):
    workdir = tmp_path_factory.mktemp("readme-walkthrough")
    assert not workdir.resolve().is_relative_to(ROOT)
    env = readme_env()
    checked = set()
    for block in readme_blocks():
        if block.lang == "console" and HEAD_BLOCK in block.body:
            env.update(request.getfixturevalue("ray_head").env)
        if block.marker == TREE_MARKER:
            check_output_tree(block, workdir)
            checked.add("tree")
        if block.lang != "bash" or "specbatch demo" in block.body:
            continue
        out = run_block(block, workdir, env)
        job = "ray job submit" in block.body or (
            "specbatch run job.yaml" in block.body and "--dry-run" not in block.body
        )
        if job:  # the job's own word, from its driver's console (the submission tails the job's log)
            assert "succeeded" in out.stdout, out.stdout[-3000:]
        checked.add("submit" if "ray job submit" in block.body else "run" if job else " ".join(block.body.split()[:2]))
    assert {"run", "tree", "submit", "specbatch status", "specbatch check-drafter"} <= checked, checked


# ---------------------------------------------------------------- what the docs point at

REPO_PATH = re.compile(r"`((?:jobs|docs|pipeline|schemas|infra|tests|benchmarks|models|tinykit)/[^`\s*<>{}]*)`")
LINK = re.compile(r"\]\((?!https?://)([^)#\s]*)(?:#([^)\s]*))?\)")


def anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors."""
    out = set()
    for heading in re.findall(r"^#+ (.+)$", re.sub(r"^```.*?^```", "", markdown, flags=re.M | re.S), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        out.add(slug)
    return out


def test_paths_and_links_in_the_docs_exist():
    documents = [README, *sorted((ROOT / "docs").glob("*.md"))]
    problems = []
    for doc in documents:
        text = doc.read_text()
        for path in REPO_PATH.findall(text):
            if not (ROOT / path.rstrip("/")).exists():
                problems.append(f"{doc.name}: `{path}` does not exist")
        for target, anchor in LINK.findall(text):
            file = (doc.parent / target).resolve() if target else doc
            if not file.exists():
                problems.append(f"{doc.name}: link to {target} which does not exist")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
                problems.append(f"{doc.name}: link to {target}#{anchor}: no such heading")
    assert problems == []


# ---------------------------------------------------------------- the configuration reference


def test_configuration_reference_is_generated_from_the_code():
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == render(), f"docs/configuration.md is out of date: run `{COMMAND}`"


def test_every_config_key_says_what_it_does():
    assert undescribed() == [], "give these keys a Field(description=...) in pipeline/config/"
