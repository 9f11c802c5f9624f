"""Every link and cited results path in the docs points at a file that exists: README.md,
CHANGELOG.md (where a removed file is named without backticks), docs/*.md, lab/README.md and the
committed results' own .md files. A results file moved or removed without updating its readers
fails here."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")  # [text](target) or [text](target#anchor)
CITED = re.compile(r"`((?:bench|lab|docs)/(?:results/)?[\w./-]+\.(?:md|csv|json|png|txt|py|sh))`")


def doc_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "lab" / "README.md"]
    files += sorted((ROOT / "docs").glob("*.md")) + sorted((ROOT / "bench" / "results").rglob("*.md"))
    return [f for f in files if f.exists()]


def broken_links(doc: Path) -> list[str]:
    """The relative links and backticked repository paths of one markdown file that do not exist."""
    text = doc.read_text()
    missing = []
    for target in LINK.findall(text):
        if "://" in target or target.startswith("mailto:"):
            continue
        if not (doc.parent / target).exists():
            missing.append(target)
    for path in CITED.findall(text):
        if "*" not in path and "<" not in path and not (ROOT / path).exists():
            missing.append(path)
    return missing


def test_broken_links_finds_a_missing_target(tmp_path):
    doc = tmp_path / "x.md"
    (tmp_path / "here.md").write_text("")
    doc.write_text("[a](here.md) [b](gone.md#part) [c](https://example.org) `bench/results/not_there.md`")
    assert broken_links(doc) == ["gone.md", "bench/results/not_there.md"]


def test_every_doc_link_and_cited_path_exists():
    broken = {str(d.relative_to(ROOT)): b for d in doc_files() if (b := broken_links(d))}
    assert broken == {}, f"links to missing files: {broken}"
