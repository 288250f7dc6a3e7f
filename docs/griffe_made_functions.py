"""A griffe extension for the API page: a module attribute bound at import time to a
function that a call made (`filter_jacrev = _verb(...)`: the three Jacobian verbs share one
signature, written once) is documented as that function, with the signature and docstring
`help()` shows, rather than as the call that made it.

mkdocs.yml loads it for mkdocstrings (`extensions:`); it reads nothing but the imported
function.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import griffe

_KINDS = {
    inspect.Parameter.POSITIONAL_ONLY: griffe.ParameterKind.positional_only,
    inspect.Parameter.POSITIONAL_OR_KEYWORD: griffe.ParameterKind.positional_or_keyword,
    inspect.Parameter.VAR_POSITIONAL: griffe.ParameterKind.var_positional,
    inspect.Parameter.KEYWORD_ONLY: griffe.ParameterKind.keyword_only,
    inspect.Parameter.VAR_KEYWORD: griffe.ParameterKind.var_keyword,
}


def _text(annotation: Any) -> str | None:
    if annotation is inspect.Parameter.empty:
        return None
    return annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)


def _function(name: str, made: Any, lineno: int | None) -> griffe.Function:
    """A griffe function of the imported function `made`."""
    signature = inspect.signature(made)
    parameters = griffe.Parameters(
        *(
            griffe.Parameter(
                p.name,
                annotation=_text(p.annotation),
                kind=_KINDS[p.kind],
                default=None if p.default is inspect.Parameter.empty else repr(p.default),
            )
            for p in signature.parameters.values()
        )
    )
    function = griffe.Function(
        name, lineno=lineno, parameters=parameters, returns=_text(signature.return_annotation)
    )
    function.docstring = griffe.Docstring(inspect.getdoc(made) or "", parent=function)
    return function


class MadeFunctions(griffe.Extension):
    """Module attributes whose value is a call returning a function, documented as it."""

    def on_module_members(self, *, mod: griffe.Module, **kwargs: Any) -> None:
        for name, member in list(mod.members.items()):
            if member.is_alias or not member.is_attribute or "(" not in str(member.value):
                continue
            made = getattr(importlib.import_module(mod.path), name, None)
            if inspect.isfunction(made) and made.__name__ == name:
                mod.set_member(name, _function(name, made, member.lineno))
