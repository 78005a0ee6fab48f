"""Text a caller sends must be valid Unicode. A Python str (and a JSON "\\udcff" escape) can hold an
unpaired UTF-16 surrogate, which no tokenizer, regex engine or UTF-8 encoder accepts: left in, it fails
deep inside a library with a message about that library. One walker finds them in any str, list or
dict, so every entry point (offline prompts and messages, sampling parameters, every field of the HTTP
request models) refuses them up front with the same words naming the field."""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, model_validator

_SURROGATE = re.compile("[\ud800-\udfff]")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]*")


def _find(value: Any, path: tuple) -> tuple[tuple, int, str, bool] | None:
    """(path, character index, the surrogate, whether it is in a dict key) of the first one found."""
    if isinstance(value, str):
        if value.isascii():  # O(1) in CPython: the common case costs nothing
            return None
        found = _SURROGATE.search(value)
        return None if found is None else (path, found.start(), found.group(), False)
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        if isinstance(key, str) and (hit := _find(key, path + (key,))) is not None:
            return hit[0], hit[1], hit[2], True
        if (hit := _find(item, path + (key,))) is not None:
            return hit
    return None


def invalid_text(param: str, value: Any) -> str | None:
    """Why `value` (a str, or lists and dicts of them, keys included), given as `param`, is not valid
    Unicode, as an error message starting with the field's path ("messages.0.content: ..."); None
    when it is valid. The path stops at the first key that is not a plain name (it would be no field
    name), and the message never repeats the offending text: it could not be encoded in the reply."""
    hit = _find(value, ())
    if hit is None:
        return None
    path, index, char, in_key = hit
    names = [param] if param else []
    for key in path[:-1] if in_key else path:
        if not (isinstance(key, int) or _NAME.fullmatch(key)):
            break
        names.append(str(key))
    where = f"character {index} of the key {path[-1]!a}" if in_key else f"character {index}"
    return (f"{'.'.join(names)}: holds an unpaired UTF-16 surrogate U+{ord(char):04X} at {where}; "
            "text must be valid Unicode (pair the surrogate or remove it)")


def check_text(param: str, value: Any) -> None:
    """Raises ValueError naming `param` when `value` holds text that is not valid Unicode."""
    problem = invalid_text(param, value)
    if problem is not None:
        raise ValueError(problem)


class ValidTextModel(BaseModel):
    """A pydantic model whose every field (str, list or dict of them) must be valid Unicode. Checked on
    the raw input, before pydantic's own parsing: pydantic-core cannot even read a dict key holding a
    surrogate (it raises a bare UnicodeEncodeError). The outermost model sees it first and names the
    whole path; a nested model walks its own part again, which costs nothing for ASCII text."""

    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data: Any) -> Any:
        if isinstance(data, dict):
            check_text("", data)
        return data
