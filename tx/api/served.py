"""The base models one server serves (the first is the default) and which of them a request runs on."""

from __future__ import annotations

from collections.abc import Sequence

from tx.api.common import ApiError
from tx.api.config import ServedModel


class ServedModels:
    def __init__(self, models: Sequence[ServedModel]):
        self.all = list(models)
        self.default = self.all[0]
        self._by_alias: dict[str, ServedModel] = {}
        for model in reversed(self.all):  # an alias two models share means the default (the earlier one)
            for alias in model.aliases:
                self._by_alias[alias] = model

    def names(self) -> str:
        return ", ".join(repr(m.model_name) for m in self.all)

    def find(self, name: str | None, field: str = "base_model") -> ServedModel:
        """The served model called `name` (any alias); None means the default. Unknown: a 400 naming it."""
        if name is None:
            return self.default
        model = self._by_alias.get(name)
        if model is None:
            raise ApiError(400, f"{field} {name!r} is not served here; this server serves {self.names()}")
        return model

    def trained_on(self, base_model: str | None, what: str) -> ServedModel:
        """The served model a stored model or checkpoint (`what`) was created on; None (no record) = default."""
        if base_model is None:
            return self.default
        model = self._by_alias.get(base_model)
        if model is None:
            raise ApiError(400, f"{what} was trained on base model {base_model!r}, which this server no longer "
                                f"serves (it serves {self.names()})")
        return model

    def matching(self, asked: str | None, base: ServedModel, what: str, field: str = "base_model") -> ServedModel:
        """`base` (what a checkpoint was trained on), refusing a request that asks for another base model."""
        if asked is not None and self.find(asked, field) is not base:
            raise ApiError(400, f"{field} {asked!r} does not match {what}, which was trained on base model "
                                f"{base.model_name!r}; its weights only fit that model")
        return base
