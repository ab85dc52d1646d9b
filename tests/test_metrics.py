"""tx.metrics.MetricsSink: JSON lines to a file (appended across sinks) and stdout, numbers to wandb at the
record's step, and a warning plus console metrics when wandb is asked for but missing."""

import json
import sys

import pytest

from tx.metrics import MetricsSink


class FakeWandb:
    """Stands in for the wandb package (also for tests/sft): records what a trainer sends it."""

    def __init__(self):
        self.logged, self.finished, self.kwargs = [], False, None

    def init(self, **kwargs):
        self.kwargs = kwargs
        return self

    def log(self, values, step=None):
        self.logged.append((step, values))

    def finish(self):
        self.finished = True


def test_sink_writes_lines_stdout_and_wandb(tmp_path, monkeypatch, capsys):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    path = tmp_path / "deep" / "m.jsonl"
    sink = MetricsSink(str(path), {"project": "p", "name": "n"}, stdout=True)
    sink.log({"step": 1, "loss": 0.5, "note": "text"})
    sink.close()
    MetricsSink(str(path)).log({"step": 2, "loss": 0.25})  # appends
    assert [json.loads(x) for x in path.read_text().splitlines()] == [
        {"step": 1, "loss": 0.5, "note": "text"}, {"step": 2, "loss": 0.25}]
    assert json.loads(capsys.readouterr().out) == {"step": 1, "loss": 0.5, "note": "text"}
    assert fake.kwargs == {"project": "p", "name": "n"} and fake.finished
    assert fake.logged == [(1, {"step": 1, "loss": 0.5})]  # numbers only


def test_missing_wandb_warns_once_and_logs_to_the_console(monkeypatch, caplog, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with caplog.at_level("WARNING", logger="tx.metrics"):
        sink = MetricsSink(None, {"project": "p"})
    [warning] = [r.getMessage() for r in caplog.records]
    assert "project 'p'" in warning and "wandb package is not installed" in warning and "console" in warning
    sink.log({"step": 1, "loss": 0.5})
    assert json.loads(capsys.readouterr().out) == {"step": 1, "loss": 0.5}
