"""The README's config reference, generated from the config models so it cannot drift (`leeway config reference`)."""

from __future__ import annotations

from typing import Any

from pipeline.config import LeewayConfig, Section


def config_reference() -> str:
    """The README's config reference, generated from the models so it cannot drift."""
    lines = []
    for section_name, field in LeewayConfig.model_fields.items():
        lines.extend(_section_reference(section_name, field.annotation))
    return "\n".join(lines) + "\n"


def _section_reference(prefix: str, model: Any) -> list[str]:
    lines = [f"### `{prefix}`", ""]
    doc = model.__dict__.get("__doc__")  # the section's own docstring, if it has one (not inherited)
    if doc:
        lines += [" ".join(doc.split()), ""]
    lines += ["| key | default | meaning |", "| --- | --- | --- |"]
    nested = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, Section):
            nested.append((f"{prefix}.{name}", annotation))
            continue
        default = field.get_default(call_default_factory=True)
        doc = (field.description or "").replace("\n", " ").replace("|", "\\|")
        lines.append(f"| `{prefix}.{name}` | `{default!r}` | {doc} |")
    lines.append("")
    for sub_prefix, sub_model in nested:
        lines.extend(_section_reference(sub_prefix, sub_model))
    return lines
