"""Where intake's spec and the operators' recognition describe the model differently, as the report shows it.

Read from the operators stage's summary (``agreement``: what ``operators.agreement`` compared).  A disagreement
is information for the user, never a failure: the stage's verdict line carries the count, this table the facts.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from reports.schema import summary
from reports.tables import _cell

_SHOWN_MODULES = 3  # a fact left open in every block names the first few


def agreement_lines(report: dict[str, Any]) -> list[str]:
    """How many facts were compared and how many differ, then what one side did not examine; nothing without an
    operators result."""
    operators = summary(report, "operators")
    if not operators:
        return []
    agreement = operators.get("agreement")
    if agreement is None:
        return ["Intake and operators were not compared: the operators stage ran without intake's spec."]
    compared, differ = agreement.get("total", 0), len(agreement.get("disagreements", []))
    lines = [
        f"Intake and operators disagree on {differ} of {compared} facts compared (information, not a failure)."
        if differ
        else f"Intake and operators agree on all {compared} facts compared."
    ]
    for item in agreement.get("not_examined", []):
        lines.append(
            f"Not examined by {item['side']}: {item['field']} at {_modules(item['modules'])} ({item['reason']})."
        )
    return lines


def agreement_table(report: dict[str, Any]) -> pd.DataFrame:
    """One row per fact the two sides state differently."""
    agreement = summary(report, "operators").get("agreement") or {}
    rows = [
        {"module": d["module"], "fact": d["field"], "intake": _value(d["intake"]), "operators": _value(d["operators"])}
        for d in agreement.get("disagreements", [])
    ]
    return pd.DataFrame(rows, columns=["module", "fact", "intake", "operators"])


def _value(value: Any) -> str:
    return "none" if value is None else _cell(value)


def _modules(modules: list[str]) -> str:
    shown = ", ".join(modules[:_SHOWN_MODULES])
    more = len(modules) - _SHOWN_MODULES
    return f"{shown} (+{more} more)" if more > 0 else shown
