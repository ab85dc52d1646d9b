"""The dev extra holds what tinker-cookbook 0.6.1's recipes import (the cookbook itself is installed by
.ci/run with --no-deps): each recipe module the recipe tests run imports, and math grading works."""

from __future__ import annotations

import importlib

import pytest

from tests.require import require_module

require_module("tinker_cookbook")

RECIPES = [
    "tinker_cookbook.recipes.math_rl.train",  # sympy, pylatexenc, math-verify (math_grading)
    "tinker_cookbook.recipes.rl_loop",
    "tinker_cookbook.recipes.rl_basic",
    "tinker_cookbook.recipes.sdft.train",
    "tinker_cookbook.recipes.distillation.on_policy_distillation",
    "tinker_cookbook.recipes.distillation.off_policy_reasoning",
    "tinker_cookbook.recipes.decisions.demo",
    "tinker_cookbook.recipes.preference.dpo.train",
    "tinker_cookbook.recipes.sl_loop",
]


@pytest.mark.parametrize("module", RECIPES)
def test_recipe_imports(module):
    importlib.import_module(module)


def test_math_grading_uses_its_dependencies():
    from tinker_cookbook.recipes.math_rl import math_grading as g

    assert g.grade_answer_math_verify("1/2", "0.5") and not g.grade_answer_math_verify("3", "4")  # math-verify
    assert g.grade_answer("\\frac{1}{2}", "1/2") and not g.grade_answer("\\frac{1}{3}", "1/2")  # sympy, pylatexenc
