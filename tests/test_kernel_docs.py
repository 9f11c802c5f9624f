"""docs/kernels.md prints the routing table the dispatcher reads, row for row."""

from pathlib import Path

from qerl_kit.kernels.routes import as_markdown

DOC = Path(__file__).resolve().parents[1] / "docs" / "kernels.md"


def test_docs_show_the_routing_table_as_it_is():
    assert as_markdown() in DOC.read_text(), "docs/kernels.md's routing table differs from routes.as_markdown()"


def test_docs_show_the_nf4_and_mxfp4_rows_as_they_are():
    from qerl_kit.kernels.routes import LUT4

    text = DOC.read_text()
    assert as_markdown(fmt=LUT4[0]) == as_markdown(fmt=LUT4[1])  # one set of rows for both formats
    assert as_markdown(fmt="nf4") in text, "docs/kernels.md's NF4/MXFP4 table differs from routes.as_markdown(fmt='nf4')"
