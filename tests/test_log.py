"""The console logger: rank 0 speaks for the job, a line every rank says names the others, and a
line is plain off a terminal and written above a progress bar on one."""

import io
import sys

from tqdm import tqdm

from setdiff_megatron.log import say, write


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_rank_0_speaks_for_the_job(monkeypatch, capsys):
    for rank in (1, 0):
        monkeypatch.setenv("RANK", str(rank))
        say("setdiff: resumed")
    assert capsys.readouterr() == ("setdiff: resumed\n", "")


def test_a_line_every_rank_says_is_prefixed_on_the_others(monkeypatch, capsys):
    for rank in (0, 2):
        monkeypatch.setenv("RANK", str(rank))
        say("setdiff: stopped\nat step 7", file=sys.stderr, everywhere=True)
    assert capsys.readouterr() == ("", "setdiff: stopped\nat step 7\nrank 2: setdiff: stopped\nrank 2: at step 7\n")


def test_a_line_is_plain_off_a_terminal_and_above_the_bar_on_one():
    plain = io.StringIO()
    write("setdiff: note", plain)
    assert plain.getvalue() == "setdiff: note\n"

    terminal = Terminal()
    with tqdm(total=10, file=terminal, desc="bar") as bar:
        bar.update(3)
        write("setdiff: note", terminal)
    before, after = terminal.getvalue().split("\rsetdiff: note\n")
    assert "bar:" in before and "3/10" in after  # cleared for the line, then drawn again below it
