"""`helm lint --strict` (through the same Helm library) is clean for every value set."""

from __future__ import annotations

import pytest

from tests.helm.helpers import CHART_DIR, VALUE_SETS

INFO = 1  # severities: 1 info, 2 warning, 3 error


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_lint_is_clean(name):
    import helm_python

    report = helm_python.lint(CHART_DIR, VALUE_SETS[name], strict=True, namespace="llm")
    problems = [m for m in report["messages"] if m["severity"] > INFO]
    assert not report["errors"] and not problems, report


def test_lint_reports_bad_values():
    """The lint step is not vacuous: it sees schema violations."""
    import helm_python

    report = helm_python.lint(CHART_DIR, {"engine": {"tensorParallelSize": 0}}, strict=True)
    assert any("tensorParallelSize" in m["error"] for m in report["messages"]), report
