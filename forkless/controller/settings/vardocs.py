"""The variables as documentation: ``--help``'s list and the Markdown table the documents hold,
both drawn from ``VARIABLES`` and ``Config``'s defaults (pure)."""

from __future__ import annotations

from forkless.controller.config import Config
from forkless.controller.settings.variables import VARIABLES, as_text

__all__ = ["help_text", "variables_table_markdown"]


def help_text() -> str:
    """The variable table for ``python app.py --help``: name, default, meaning."""
    defaults = Config()
    lines = []
    for var in VARIABLES:
        default = getattr(defaults, var.field)
        shown = "(unset)" if default in (None, "", ()) else as_text(default)
        lines.append(f"  {var.env:<28} default {shown:<10} {var.help}")
    return "\n".join(lines)


def variables_table_markdown(names: tuple[str, ...] | None = None) -> str:
    """The Markdown table of the variables (the README's, between ``<!-- variables:start/end -->``).

    ``names`` (full ``FORKLESS_*`` names) picks a subset, in ``VARIABLES`` order; ``gendocs.py``
    writes the table into the documents and ``tests/docs/test_docs.py`` checks they hold it.
    """
    defaults = Config()
    known = {var.env for var in VARIABLES}
    unknown = sorted(set(names or ()) - known)
    if unknown:
        raise ValueError(f"not forkless variables: {', '.join(unknown)}")
    lines = ["| variable | default | allowed | meaning |", "|---|---|---|---|"]
    for var in VARIABLES:
        if names is not None and var.env not in names:
            continue
        default = getattr(defaults, var.field)
        shown = "(unset)" if default in (None, "", ()) else f"`{as_text(default)}`"
        lines.append(f"| `{var.env}` | {shown} | {var.allowed} | {var.help} |")
    return "\n".join(lines) + "\n"
