"""Validate request bodies against field lists copied from an engine's request types (fixtures/*.json).

Each fixture type becomes a pydantic model with extra="forbid" and strict types: a misspelt or
unknown field, a missing required field or a wrong type fails, which the engines themselves would not
report (SGLang and vLLM ignore unknown JSON fields)."""

from __future__ import annotations

import base64
import binascii
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    create_model,
)


def _b64(v: str) -> str:
    try:
        base64.b64decode(v, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"not base64: {exc}") from exc
    return v


def _split_top(expr: str, sep: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in expr:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == sep and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    out.append(cur)
    return [p.strip() for p in out]


def to_type(expr: str) -> Any:
    parts = _split_top(expr, "|")
    if len(parts) > 1:
        types = [to_type(p) for p in parts if p != "null"]
        t = types[0] if len(types) == 1 else Union[tuple(types)]  # noqa: UP007
        return Optional[t] if "null" in parts else t  # noqa: UP045
    e = parts[0]
    if e == "str":
        return StrictStr
    if e == "bool":
        return StrictBool
    if e == "int":
        return StrictInt
    if e == "dict":
        return dict[str, Any]
    if e == "any":
        return Any
    if e == "base64":
        return Annotated[StrictStr, AfterValidator(_b64)]
    if e.startswith("list[") and e.endswith("]"):
        return list[to_type(e[5:-1])]  # type: ignore[misc]
    if e.startswith("literal[") and e.endswith("]"):
        return Literal[tuple(v.strip() for v in e[8:-1].split(","))]  # type: ignore[misc]
    raise ValueError(f"fixture type {expr!r} is not understood")


def model_for(fixture: dict[str, Any], type_name: str) -> type[BaseModel]:
    spec = dict(fixture.get("base_fields", {}))
    spec.update(fixture["types"][type_name])
    fields: dict[str, Any] = {}
    for name, f in spec.items():
        t = to_type(f["type"])
        fields[name] = (t, ...) if f.get("required") else (t, Field(default=f.get("default")))
    return create_model(type_name, __config__=ConfigDict(extra="forbid", strict=True), **fields)


def validate(fixture: dict[str, Any], type_name: str, body: Any) -> BaseModel:
    """Raise pydantic.ValidationError unless `body` is a valid `type_name` of the fixture's engine."""
    return model_for(fixture, type_name).model_validate(body if body is not None else {})
