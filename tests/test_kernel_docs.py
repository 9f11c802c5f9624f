"""docs/kernels.md prints the routing table the dispatcher reads, row for row."""

from pathlib import Path

from qerl_kit.kernels.routes import as_markdown

DOC = Path(__file__).resolve().parents[1] / "docs" / "kernels.md"


def test_docs_show_the_routing_table_as_it_is():
    assert as_markdown() in DOC.read_text(), "docs/kernels.md's routing table differs from routes.as_markdown()"


def test_docs_show_the_nf4_and_mxfp4_rows_as_they_are():
    from qerl_kit.kernels.routes import LUT4

    text = DOC.read_text()
    for fmt in LUT4:
        assert as_markdown(fmt=fmt) in text, f"docs/kernels.md's {fmt} table differs from as_markdown(fmt={fmt!r})"
