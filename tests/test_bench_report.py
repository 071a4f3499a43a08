"""aisrl.bench.report.update_section: a benchmark rewrites its own block of BENCHMARKS.md and nothing else."""

import pytest

from aisrl.bench.report import update_section


def test_a_section_is_replaced_in_place_and_other_text_is_kept(tmp_path):
    doc = tmp_path / "B.md"
    doc.write_text("# B\n\nhand-written\n\n<!-- BEGIN a -->\nold a\n<!-- END a -->\n\nmore prose\n")
    update_section(doc, "a", "new a")
    update_section(doc, "b", "first b")
    once = doc.read_text()
    assert "old a" not in once and "new a" in once and "hand-written" in once and "more prose" in once
    assert once.index("new a") < once.index("more prose") < once.index("first b")  # in place; a new one appended
    update_section(doc, "a", "new a")
    assert doc.read_text() == once  # idempotent


def test_unpaired_markers_are_refused_rather_than_swallowing_text(tmp_path):
    # a BEGIN left without its END (an edit gone wrong) would make the next rewrite replace all the text up to a
    # later END: the file is left as it is and the error names the section
    doc = tmp_path / "B.md"
    broken = "<!-- BEGIN a -->\nhalf\n\nprose that must survive\n\n<!-- BEGIN a -->\nx\n<!-- END a -->\n"
    doc.write_text(broken)
    with pytest.raises(ValueError, match="markers of section 'a' are unpaired or repeated"):
        update_section(doc, "a", "y")
    doc.write_text("<!-- END a -->\ntext\n<!-- BEGIN a -->\n")
    with pytest.raises(ValueError, match="section 'a'"):
        update_section(doc, "a", "y")
    assert doc.read_text() == "<!-- END a -->\ntext\n<!-- BEGIN a -->\n"
