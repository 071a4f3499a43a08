"""aisrl.bench.report.update_section: a benchmark rewrites its own block of BENCHMARKS.md and nothing else."""

import json
import math

import pytest

from aisrl.bench import report
from aisrl.bench.report import machine_line, settings_tag, staged_json, update_section, write_json


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


@pytest.mark.parametrize(
    "text, match",
    [  # a BEGIN left without its END (an edit gone wrong) would make the next rewrite replace all the text up to a
        # later END; markers out of order; sections interleaved (replacing a deleted b's BEGIN line, without a word)
        ("<!-- BEGIN a -->\nhalf\n\nprose that must survive\n\n<!-- BEGIN a -->\nx\n<!-- END a -->\n",
         "markers of section 'a' are unpaired, repeated"),
        ("<!-- END a -->\ntext\n<!-- BEGIN a -->\n", "section 'a'"),
        ("<!-- BEGIN a -->\n1\n<!-- BEGIN b -->\n2\n<!-- END a -->\n3\n<!-- END b -->\n",
         "interleaved with another section's"),
        # two whole sections of one name; a section whose name is not a word (b-2) interleaved
        ("<!-- BEGIN a -->\nx\n<!-- END a -->\n\n<!-- BEGIN a -->\ny\n<!-- END a -->\n", "unpaired, repeated"),
        ("<!-- BEGIN a -->\n1\n<!-- BEGIN b-2 -->\n2\n<!-- END a -->\n3\n<!-- END b-2 -->\n", "interleaved"),
    ],
)  # fmt: skip
def test_markers_that_would_lose_text_are_refused_and_the_file_left_as_it_is(tmp_path, text, match):
    doc = tmp_path / "B.md"
    doc.write_text(text)
    with pytest.raises(ValueError, match=match):
        update_section(doc, "a", "y")
    assert doc.read_text() == text


def test_markers_quoted_in_prose_are_text(tmp_path):
    doc = tmp_path / "B.md"
    # prose that names the markers inline is not a section: the section is appended, the prose kept word for word
    prose = "See `<!-- BEGIN d -->` and `<!-- END d -->` for how sections work.\n"
    doc.write_text(prose)
    update_section(doc, "d", "D")
    assert doc.read_text() == prose.rstrip() + "\n\n<!-- BEGIN d -->\nD\n<!-- END d -->\n"
    update_section(doc, "d", "E")
    assert doc.read_text() == prose.rstrip() + "\n\n<!-- BEGIN d -->\nE\n<!-- END d -->\n"


def test_benchmarks_finishing_together_keep_each_others_sections(tmp_path, monkeypatch):
    # each writer reads the file, adds its section and renames a new file over it; the write is slowed so that all
    # of them read before any writes: without a lock from the read to the rename, all but one section would be lost
    import threading
    import time

    from aisrl.bench import report

    write = report.atomic_write_text

    def slow_write(path, text):
        time.sleep(0.05)
        write(path, text)

    monkeypatch.setattr(report, "atomic_write_text", slow_write)
    doc = tmp_path / "B.md"
    doc.write_text("# B\n")
    writers = [threading.Thread(target=update_section, args=(doc, f"s{i}", f"body {i}")) for i in range(6)]
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    text = doc.read_text()
    assert all(f"<!-- BEGIN s{i} -->\nbody {i}\n<!-- END s{i} -->" in text for i in range(6))


def test_staged_results_replace_the_published_file_only_when_the_run_completes(tmp_path):
    import json

    from aisrl.bench.report import staged_json

    out = tmp_path / "r.json"
    out.write_text('{"published": true}')
    with pytest.raises(RuntimeError), staged_json(out) as save:
        save({"rows": [1]})
        raise RuntimeError("the run failed after a first row")
    assert json.loads(out.read_text()) == {"published": True}  # the published results are kept
    assert json.loads((tmp_path / "r.json.partial").read_text()) == {"rows": [1]}  # the progress, for a look
    with staged_json(out) as save:
        save({"rows": [1]})
        save({"rows": [1, 2]})
    assert json.loads(out.read_text()) == {"rows": [1, 2]} and not (tmp_path / "r.json.partial").exists()


def test_results_json_stays_strict_json_and_a_staged_run_publishes_only_what_it_saved(tmp_path):
    import json
    import math

    from aisrl.bench.report import staged_json, update_section, write_json

    path = tmp_path / "r.json"
    write_json(path, {"cos": math.nan, "r": [1.0, math.inf], "n": 3})  # before: bare NaN / Infinity
    assert json.loads(path.read_text(), parse_constant=lambda c: 1 / 0) == {"cos": None, "r": [1.0, None], "n": 3}
    write_json(path, {"v": "published"})
    (tmp_path / "r.json.partial").write_text('{"v": "an interrupted run"}')
    with staged_json(path):
        pass  # saved nothing: before, the stale .partial was published
    assert json.loads(path.read_text()) == {"v": "published"}
    with staged_json(path) as save:
        save({"v": "new"})
    assert json.loads(path.read_text()) == {"v": "new"}
    with pytest.raises(ValueError, match="holds a section marker"):
        update_section(tmp_path / "B.md", "a", "text that quotes <!-- END a --> inline")


def test_a_run_summary_leaves_a_non_finite_row_out_of_its_means():
    import math

    from aisrl.report import summarize

    rows = [{"step": s, "reward": 0.5, "accuracy": 0.5, "k3_kl": math.nan if s == 3 else 0.1, "alpha": 0.9}
            for s in range(1, 11)]  # fmt: skip
    assert summarize(rows)["mean_k3_kl"] == pytest.approx(0.1)


# Found by mutation testing: each case below failed a plausible slip that the tests above let pass.

def test_tuples_are_cleaned_too(tmp_path):
    write_json(tmp_path / "r.json", {"t": (1.0, math.nan)})
    assert json.loads((tmp_path / "r.json").read_text()) == {"t": [1.0, None]}


def test_a_stale_partial_is_removed_at_the_start(tmp_path):
    path = tmp_path / "r.json"
    (tmp_path / "r.json.partial").write_text('{"v": "stale"}')
    with staged_json(path):
        pass
    assert not (tmp_path / "r.json.partial").exists()


def test_machine_line():
    m = {"cuda": None, "cpu": "Intel X", "processor": "x86_64", "cpus": 16, "torch_threads": 8, "torch": "2.5"}
    assert machine_line(m) == "Intel X, 16 CPUs, torch 2.5"


def test_settings_tag_is_order_independent():
    assert settings_tag({"a": 1, "b": 2}, []) == settings_tag({"b": 2, "a": 1}, [])


def test_trailing_newlines_of_the_body_are_dropped(tmp_path):
    doc = tmp_path / "B.md"
    doc.write_text("# B\n")
    update_section(doc, "a", "x\n\n")
    assert doc.read_text() == "# B\n\n<!-- BEGIN a -->\nx\n<!-- END a -->\n"


def test_the_section_file_is_replaced_atomically(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(report, "atomic_write_text", lambda p, t: calls.append(p))
    update_section(tmp_path / "B.md", "a", "x")
    assert calls == [tmp_path / "B.md"] and not (tmp_path / "B.md").exists()
