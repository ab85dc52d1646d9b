"""The trainers' progress bar: on stderr, off where stderr is not a terminal unless --progress, off with
--no-progress; the CLIs' flag reaches the trainer (the SFT CLI run with --progress: tests/sft/test_seed_config.py)."""

import argparse
import io

import pytest

from tx.training import progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("enabled, tty, shown", [(None, True, True), (None, False, False), (False, True, False),
                                                 (True, False, True)])
def test_bar_where_asked(monkeypatch, enabled, tty, shown):
    err = Terminal() if tty else io.StringIO()
    monkeypatch.setattr(progress.sys, "stderr", err)
    bar = progress.progress_bar(4, 1, "sft", "step", enabled)
    bar.update(2)
    bar.set_postfix({"loss": 0.5})
    bar.close()
    text = err.getvalue()
    assert ("sft:" in text and "3/4" in text and "loss=0.5" in text) == shown, text


def test_flag():
    parser = argparse.ArgumentParser()
    progress.add_progress_flag(parser)
    assert parser.parse_args([]).progress is None
    assert parser.parse_args(["--no-progress"]).progress is False
    assert parser.parse_args(["--progress"]).progress is True
