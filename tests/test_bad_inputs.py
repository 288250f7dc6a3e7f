"""The bad-input catalogue: every case raises the right type, naming the argument or leaf."""

from __future__ import annotations

import importlib
import pkgutil

import catalogue
import pytest
from catalogue import Case


def _cases() -> list[Case]:
    cases: list[Case] = []
    for info in sorted(pkgutil.iter_modules(catalogue.__path__), key=lambda m: m.name):
        cases.extend(importlib.import_module(f"catalogue.{info.name}").CASES)
    return cases


CASES = _cases()


def test_ids_are_unique():
    ids = [case.id for case in CASES]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=c.marks) for c in CASES])
def test_bad_input(case: Case):
    with pytest.raises(case.exc, match=case.match):
        case.call()
