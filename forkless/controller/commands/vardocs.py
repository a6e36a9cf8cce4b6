"""The settings as documentation: ``--help``'s list and the Markdown table docs/variables.md holds, both drawn from
the settings' declarations (``VARIABLES``: each variable, its group and field, default, what is allowed and what it
means), so neither can disagree with the code (pure)."""

from __future__ import annotations

from forkless.controller.config import GROUPS, VARIABLES
from forkless.io_loop.settings import Setting, as_text

__all__ = ["help_text", "variables_table_markdown"]


def _default(var: Setting) -> str:
    return "" if var.default in (None, "", ()) else as_text(var.default)


def help_text() -> str:
    """The variable table for ``python app.py --help``: name, default, meaning, under each group's heading."""
    lines = []
    for name, group in GROUPS.items():
        declared = [var for var in VARIABLES if var.group is group]
        lines.append(f"  {group.__name__} (Config({name}=...)):")
        for var in declared:
            lines.append(f"    {var.env:<28} default {_default(var) or '(unset)':<10} {var.help}")
    return "\n".join(lines)


def variables_table_markdown(names: tuple[str, ...] | None = None) -> str:
    """The Markdown table of the variables (docs/variables.md's, between ``<!-- variables:start/end -->``): each
    variable, how a program gives it (its group's field, or ``Config``'s keyword), its default, what is allowed and
    what it means.

    ``names`` (full ``FORKLESS_*`` names) picks a subset, in ``VARIABLES`` order; ``gendocs.py`` writes the table
    into the documents and ``tests/docs/test_docs.py`` checks they hold it.
    """
    known = {var.env for var in VARIABLES}
    unknown = sorted(set(names or ()) - known)
    if unknown:
        raise ValueError(f"not forkless variables: {', '.join(unknown)}")
    lines = ["| variable | in code | default | allowed | meaning |", "|---|---|---|---|---|"]
    for var in VARIABLES:
        if names is not None and var.env not in names:
            continue
        shown = f"`{_default(var)}`" if _default(var) else "(unset)"
        group = var.group.__name__ if var.group is not None else "?"
        lines.append(f"| `{var.env}` | `{group}.{var.field}`, `{var.keyword}=` | {shown} | {var.allowed} | "
                     f"{var.help} |")
    return "\n".join(lines) + "\n"
