"""The config schema as text (`asyncrl train --help-config`): every section and field with
its type, default and description, and every policy loss with its own settings."""

from __future__ import annotations

import textwrap
import types
import typing
from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from asyncrl.config.losses import LOSS_MODELS, CustomLoss
from asyncrl.config.tree import Config


def type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in get_args(tp))
    if origin is typing.Annotated:
        return type_name(get_args(tp)[0])
    if origin is not None:
        return f"{getattr(origin, '__name__', origin)}[{', '.join(type_name(a) for a in get_args(tp))}]"
    if tp is type(None):
        return "None"
    return getattr(tp, "__name__", str(tp))


BOUNDS = (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))


def field_default(field: Any) -> str:
    if field.default is not PydanticUndefined:
        return repr(field.default)
    if field.default_factory is not None:
        value = field.default_factory()
        return repr(value.type if hasattr(value, "type") else value)
    return "required"


def section_type(tp: Any) -> type[BaseModel] | None:
    """The section model of a field typed ``Section`` or ``Section | None``, else None."""
    options = get_args(tp) if get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    models = [a for a in options if isinstance(a, type) and issubclass(a, BaseModel)]
    rest = [a for a in options if a is not type(None) and a not in models]
    return models[0] if len(models) == 1 and not rest else None


def entry_sections(tp: Any) -> list[type[BaseModel]]:
    """The section models a list field's entries may be (each kind of a tagged union), else []."""
    if get_origin(tp) is not list:
        return []
    entry = get_args(tp)[0]
    while get_origin(entry) is typing.Annotated:
        entry = get_args(entry)[0]
    options = get_args(entry) if get_origin(entry) in (typing.Union, types.UnionType) else (entry,)
    options = tuple(get_args(a)[0] if get_origin(a) is typing.Annotated else a for a in options)
    return [a for a in options if isinstance(a, type) and issubclass(a, BaseModel)]


def _fields(model: type[BaseModel], indent: str, skip: tuple[str, ...] = ()) -> list[str]:
    lines = []
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        if name == "policy_loss":
            lines.append(f"{indent}{name}: policy loss (see below) = {field_default(field)}")
        elif section_type(field.annotation) is not None:
            optional = "" if isinstance(field.annotation, type) else f" or None = {field_default(field)}"
            lines.append(f"{indent}{name}: section{optional} (see below)")
        else:
            bounds = [f"{op} {getattr(m, attr)}" for m in field.metadata for attr, op in BOUNDS if hasattr(m, attr)]
            limits = f"  ({', '.join(bounds)})" if bounds else ""
            lines.append(f"{indent}{name}: {type_name(field.annotation)} = {field_default(field)}{limits}")
        doc = " ".join((field.description or "").split())
        if doc:
            lines += textwrap.wrap(doc, 100, initial_indent=indent + "    ", subsequent_indent=indent + "    ")
    return lines


def model_doc(model: type) -> str:
    return " ".join((model.__doc__ or "").strip().split("\n\n")[0].split())


def _subsections(model: type[BaseModel], path: str, indent: str) -> list[str]:
    """Every section nested in ``model`` (at any depth), each with its fields."""
    lines = []
    for name, sub in model.model_fields.items():
        if name == "policy_loss":
            continue  # listed with every loss at the end
        for entry in entry_sections(sub.annotation):
            lines.append(f"{indent}{path}.{name}[i] ({entry.__name__}):  {model_doc(entry)}")
            lines += _fields(entry, indent + "  ")
        nested = section_type(sub.annotation)
        if nested is not None:
            lines.append(f"{indent}{path}.{name}:  {model_doc(nested)}")
            lines += _fields(nested, indent + "  ")
            lines += _subsections(nested, f"{path}.{name}", indent + "  ")
    return lines


def schema_text() -> str:
    lines = ["asyncrl config: section.field: type = default (set in YAML or as section.field=value)", ""]
    for section, field in Config.model_fields.items():
        model = field.annotation
        assert isinstance(model, type) and issubclass(model, BaseModel)
        lines.append(f"{section}:  {model_doc(model)}")
        lines += _fields(model, "  ")
        lines += _subsections(model, section, "  ")
        lines.append("")
    lines.append(
        "algo.policy_loss: a name (its defaults), {type: NAME, setting: value, ...} or "
        "{type: 'package.module:function', kwargs: {...}}; override one setting with algo.policy_loss.SETTING=value"
    )
    for name, model in LOSS_MODELS.items():
        lines.append(f"  type: {name}  {model_doc(model)}")
        lines += _fields(model, "    ", skip=("type",))
    lines.append(f"  type: package.module:function  {model_doc(CustomLoss)}")
    lines += _fields(CustomLoss, "    ", skip=("type",))
    return "\n".join(lines) + "\n"
