"""Where a trainer's metrics go (tx.sft, tx.rl): one JSON line per record to a file (appended, flushed each
record), to stdout when asked (the CLIs), and to a wandb run (numbers only, at the record's "step"). Asked for wandb
without the package installed, it warns once and logs to stdout instead: the run proceeds."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


class MetricsSink:
    def __init__(self, path: str | None = None, wandb_init: dict[str, Any] | None = None, stdout: bool = False):
        """`wandb_init`: keyword arguments of `wandb.init` (project, name, tags, config), None = no wandb."""
        self.stdout = stdout
        self._file = None
        if path:
            Path(path).expanduser().parent.mkdir(parents=True, exist_ok=True)
            self._file = open(Path(path).expanduser(), "a")
        self._wandb = None
        if wandb_init is not None:
            try:
                import wandb
            except ImportError:
                logger.warning("wandb logging (project %r) is set but the wandb package is not installed: logging "
                               "metrics to the console (stdout) instead", wandb_init.get("project"))
                self.stdout = True
            else:
                self._wandb = wandb.init(**wandb_init)

    def log(self, record: dict[str, Any]) -> None:
        line = json.dumps(record)
        if self._file:
            self._file.write(line + "\n")
            self._file.flush()
        if self.stdout:
            print(line, file=sys.stdout, flush=True)
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=record.get("step"))

    def close(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if self._file:
            self._file.close()
            self._file = None
