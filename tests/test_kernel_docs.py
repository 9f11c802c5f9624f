"""docs/kernels.md prints the routing table the dispatcher reads, row for row."""

from pathlib import Path

from qerl_kit.kernels.routes import as_markdown

DOC = Path(__file__).resolve().parents[1] / "docs" / "kernels.md"


def test_docs_show_the_routing_table_as_it_is():
    assert as_markdown() in DOC.read_text(), "docs/kernels.md's routing table differs from routes.as_markdown()"
