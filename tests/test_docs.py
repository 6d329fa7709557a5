"""The docs as a product: the README is a front page (short), benchmarks/README.md holds current
results (short), every relative link in the docs resolves inside the repository, and no tracked
file speaks of how the project was built (numbered sessions or issues) instead of what it does."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES, README_MAX_CHARS = 300, 25_000
BENCHMARKS_README_MAX_LINES = 400
DOC_TOPICS = ["architecture", "configuration", "serving", "tiers", "deepseek_v4", "cpu_performance", "gpu"]

# Words about the work rather than the product. Built from parts, so this file does not match.
_ORDINALS = ("first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
             "thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|"
             "thirtieth|fortieth|fiftieth")
PROCESS_WORDS = re.compile(
    "|".join([
        r"sess" + r"ions? [0-9]",
        r"[0-9](st|nd|rd|th) sess" + "ion",
        r"iss" + r"ue [0-9]",
        rf"\b(?:(?:twenty|thirty|forty|fifty)[- ])?(?:{_ORDINALS})[- ]sess" + r"ions?\b",
    ]),
    re.IGNORECASE,
)
# [text](target) outside code spans; a target with a scheme is not ours to check.
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_FENCE = re.compile(r"```.*?```", re.DOTALL)
_CODE_SPAN = re.compile(r"`[^`\n]*`")


def _doc_files() -> list[Path]:
    return [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _tracked_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        pytest.skip("not a git checkout: the tracked files are unknown")
    return [ROOT / name for name in out.decode().split("\0") if name]


def _anchors(markdown: str) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces to '-'."""
    anchors = set()
    for line in _FENCE.sub("", markdown).splitlines():
        if m := re.match(r"#{1,6}\s+(.*)", line):
            text = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower().replace("`", ""))
            anchors.add(text.replace(" ", "-"))
    return anchors


def test_the_readme_is_a_front_page_read_in_five_minutes():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= README_MAX_LINES, f"README.md has more than {README_MAX_LINES} lines"
    assert len(text) <= README_MAX_CHARS, f"README.md has more than {README_MAX_CHARS} characters"


def test_benchmarks_readme_holds_current_results_only():
    lines = (ROOT / "benchmarks" / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= BENCHMARKS_README_MAX_LINES, f"benchmarks/README.md has more than {BENCHMARKS_README_MAX_LINES} lines"


def test_docs_hold_a_page_per_topic():
    missing = [t for t in DOC_TOPICS if not (ROOT / "docs" / f"{t}.md").is_file()]
    assert not missing, f"docs/ lacks the topic page(s) {missing}"


def test_every_relative_link_in_the_docs_resolves_inside_the_repository():
    broken = []
    for page in _doc_files():
        text = _CODE_SPAN.sub("", _FENCE.sub("", page.read_text(encoding="utf-8")))
        for target in _LINK.findall(text):
            if re.match(r"[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists() or ROOT not in (resolved, *resolved.parents):
                broken.append(f"{page.relative_to(ROOT)}: {target}")
            elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved.read_text(encoding="utf-8")):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "links that do not resolve inside the repository:\n" + "\n".join(broken)


def test_no_tracked_file_speaks_of_sessions_or_issue_numbers():
    found = []
    for path in _tracked_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if PROCESS_WORDS.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:100]}")
    assert not found, "say what the product does, not how it was built:\n" + "\n".join(found[:50])
