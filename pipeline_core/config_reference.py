"""The configuration reference (docs/config.md), generated from the field declarations in
pipeline_core/config.py: `python -m pipeline_core.config_reference > docs/config.md`. A test keeps
the committed page equal to this output."""

from __future__ import annotations

import json
import sys

from pydantic_core import PydanticUndefined, to_jsonable_python

from pipeline_core.config import PROJECT_ROOT, sections

HEADER = """# Configuration reference

Generated from `pipeline_core/config.py` by `python -m pipeline_core.config_reference` (do not edit by
hand; `tests/test_config_registry.py` fails when this page and the code disagree). Each field declares
its **role** once:

- **content**: decides what a stage or run computes. Hashed into the artifact path of the enrich and
  filter stages (`datasets/<version>/<stage>/<cfg>/`); a training resume refuses a checkpoint whose
  content settings differ (a field added by a later version reads as its default).
- **execution**: decides only how it runs (resources, timeouts, kernels, I/O); never hashed, free to
  change on resume.

**trigger**: a manual trigger may set it through `config_overrides` (`{"section.field": value}`);
every other field is deployment configuration (file or `MFT__<SECTION>__<FIELD>`).
"""


def _default(field) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
        if isinstance(value, str) and value.startswith(PROJECT_ROOT.as_uri()):
            value = "file://<checkout>" + value[len(PROJECT_ROOT.as_uri()):]
    elif field.default is PydanticUndefined:
        return "(required)"
    else:
        value = field.default
    return f"`{json.dumps(to_jsonable_python(value))}`"


def render() -> str:
    out = [HEADER]
    for name, cls in sections().items():
        out += [f"\n## `{name}`\n", (cls.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ") + "\n",
                "| field | default | role | trigger | description |", "|---|---|---|---|---|"]
        for fname, field in cls.model_fields.items():
            role = cls.role_of(fname)
            desc = (field.description or "").replace("|", "\\|").replace("\n", " ")
            out.append(f"| `{fname}` | {_default(field)} | {role.value if role else '**unclassified**'} | "
                       f"{'yes' if fname in cls.trigger_fields() else ''} | {desc} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
