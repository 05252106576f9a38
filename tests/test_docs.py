"""The README is a front door and docs/ a map: short enough to read, each page saying what it is
for, every measurement history in docs/journal/, and nothing pointing outside the repository."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
JOURNAL = DOCS / "journal"
PAPER = (
    "AuroraRL: Fast, Fault-Tolerant, and Cost-Efficient Reinforcement Learning over "
    "Decentralized Network"
)
WORD_BUDGET = 25_000
"""Words (whitespace-separated, as ``wc -w`` counts them) of every page in docs/, journal
aside."""


def pages() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def first_paragraph(text: str) -> str:
    """The first paragraph after the page's title."""
    body = text.split("\n", 1)[1] if text.startswith("# ") else text
    return body.strip().split("\n\n", 1)[0]


def test_the_docs_journal_aside_fit_the_word_budget():
    words = {p.name: len(p.read_text().split()) for p in pages()}
    assert len(words) >= 10
    assert sum(words.values()) <= WORD_BUDGET, (sum(words.values()), words)


def test_each_page_says_first_what_it_is_for():
    for page in pages():
        text = page.read_text()
        assert text.startswith("# "), f"{page.name}: no title"
        first = first_paragraph(text)
        assert not first.startswith(("#", "|", "```", "-", "*", "!")), (page.name, first[:80])
        assert len(first.split()) >= 20, (page.name, first)
        assert re.search(r"\bfor\b", first.split(".")[0] + first), (page.name, first[:120])


def test_every_journal_file_says_in_one_line_what_it_is():
    files = sorted(JOURNAL.glob("*.md"))
    assert len(files) >= 10
    for f in files:
        title, blank, header, *_ = f.read_text().split("\n")
        assert title.startswith("# Journal: "), f.name
        assert blank == "" and len(header.split()) >= 8, f.name


def test_the_readme_opens_with_the_two_commands_and_stays_short():
    text = (ROOT / "README.md").read_text()
    lines = text.splitlines()
    assert lines[0] == "# AuroraRL"
    block = text.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    assert block == [
        "pip install -e . && aurora sim --topology examples/geo.yaml",
        "pip install -e '.[dev,torch]' && python -m pytest",
    ]
    assert lines[1:3] == ["", "```bash"]  # the commands come first, before any prose
    assert len(lines) <= 85, len(lines)
    assert f'"{PAPER}"' in " ".join(text.split())


def test_the_readme_status_cells_are_short_and_link_their_page():
    text = (ROOT / "README.md").read_text()
    table = text.split("## What exists", 1)[1]
    rows = [r for r in table.splitlines() if r.startswith("| ") and not r.startswith("| part")]
    assert len(rows) >= 10
    for row in rows:
        status = row.strip("|").split("|")[2].strip()
        link = re.search(r"\]\((docs/[A-Z]+\.md)\)", status)
        assert link and (ROOT / link.group(1)).exists(), row
        words = re.sub(r"\[([^]]*)\]\([^)]*\)", r"\1", status).split()
        assert len(words) <= 8, (len(words), status)


def tracked_files() -> list[Path]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        return [ROOT / line for line in out.splitlines() if line]
    except (OSError, subprocess.CalledProcessError):  # a tree without git: every file
        return [p for p in ROOT.rglob("*") if p.is_file() and ".git" not in p.parts]


def test_nothing_in_the_repository_refers_to_a_file_outside_it():
    """The design notes and measurements the project grew from are written into docs/
    (ARCHITECTURE.md, journal/early-measurements.md); no file may point at their old homes."""
    outside = [
        "DESIGN" + ".md",
        "shared" + "/notes",
        "rl-on" + "-cpu",
        "codec-" + "measurements.md",
        "wan-emulation-" + "on-this-kernel",
        "vllm-on" + "-cpu.md",
        "peer-" + "systems.md",
    ]
    found = []
    for path in tracked_files():
        if not path.is_file() or path.stat().st_size > 5_000_000:
            continue
        try:
            text = path.read_text(errors="strict")
        except (UnicodeDecodeError, OSError):
            continue
        for needle in outside:
            if needle in text:
                found.append(f"{path.relative_to(ROOT)}: {needle}")
    assert not found, "\n".join(found)


def test_every_docs_link_in_the_readme_and_pages_resolves():
    for page in [ROOT / "README.md", *pages()]:
        for target in re.findall(r"\]\(([^)#]+)\)", page.read_text()):
            if target.startswith("http"):
                continue
            assert (page.parent / target).exists(), f"{page.name}: {target}"
