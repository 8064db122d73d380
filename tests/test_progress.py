"""Progress off a terminal: whole lines, never carriage returns, at most one per interval."""

import io

from setdiff_megatron.progress import LineProgress, clock, progress_bar


def test_line_progress_prints_complete_lines():
    out = io.StringIO()
    bar = LineProgress(total=10, desc="scoring", unit="example", file=out, interval_s=3600)
    for _ in range(9):
        bar.update()
    assert out.getvalue() == ""  # within the interval nothing is printed
    bar.set_postfix(tok_s="12.5")
    bar.update()
    bar.close()  # the final count was printed already: close adds nothing
    (line,) = out.getvalue().splitlines()
    assert line.startswith("scoring: 10/10 example, ") and line.endswith("tok_s=12.5") and "elapsed 0:00:00" in line
    assert "\r" not in out.getvalue()


def test_iterating_wraps_and_ends_with_a_line():
    out = io.StringIO()
    assert list(progress_bar(range(3), desc="batches", unit="batch", file=out)) == [0, 1, 2]
    assert out.getvalue().startswith("batches: 3/3 batch") and out.getvalue().count("\n") == 1


def test_disabled_and_clock():
    out = io.StringIO()
    with LineProgress(total=2, file=out, disable=True) as bar:
        bar.update(2)
    assert out.getvalue() == "" and clock(3725) == "1:02:05"
