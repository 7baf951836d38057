"""pytest plugin of dmref (entry point ``pytest11: dmref``; loaded whenever dmref is installed).

Fixture ``dmref_oracle``: a function ``dmref_oracle(fn, **kwargs)`` that runs
:func:`dmref.oracle.check` on ``fn`` and fails the test with the oracle's list of failed checks,
each with its most likely cause (the report is printed to the captured output). It returns the
report. An INCONCLUSIVE report (no check failed, but the probe could not vouch for a reading)
does not fail the test: it issues a :class:`DmrefInconclusiveWarning` naming the checks and what
the probe read, shown in pytest's warnings summary (``-W error::dmref.oracle.pytest_plugin.DmrefInconclusiveWarning``
turns it into a failure).

Marker ``@pytest.mark.dmref_attention(recipe=..., dtype=..., cases=..., device=..., head_dim=...,
require=..., timeout=...)``: defaults for ``dmref_oracle`` in that test, any keyword argument of
:func:`dmref.oracle.check` (keyword arguments of the call win). ``dtype`` is a torch dtype or a
name ``dmref check --dtype`` takes (``"bf16"``, ``"float16"``, ...). ``head_dim=128`` runs every
case at head dim 128; ``require=("gqa",)`` fails the GQA cases of an implementation that raises
on them instead of reporting them unsupported.

Command-line option ``--dmref-cases {quick,standard,thorough}``: the case set when neither the
marker nor the call names one (default ``standard``, the one default of ``dmref check`` and
:func:`dmref.oracle.check`: :data:`dmref.oracle.DEFAULT_CASES`; ``quick`` for a faster look).

Three lines in a user's test file::

    from mypkg import my_attention
    def test_my_attention(dmref_oracle):
        dmref_oracle(my_attention)

Importing this module imports neither torch nor dmref.oracle; the fixture does, when used.
"""

from __future__ import annotations

import warnings

import pytest

MARKER = "dmref_attention"
#: dmref.oracle.DEFAULT_CASES, spelled out so that loading the plugin imports no torch (a test
#: holds the two equal)
DEFAULT_CASES = "standard"


class DmrefInconclusiveWarning(UserWarning):
    """The oracle found no failure, but could not vouch for a measurement (an INCONCLUSIVE
    report): the message names the checks and what the probe read."""


def pytest_addoption(parser):
    group = parser.getgroup("dmref")
    group.addoption("--dmref-cases", default=DEFAULT_CASES, choices=("quick", "standard", "thorough"),
                    help=f"case set of the dmref_oracle fixture when the test names none (default {DEFAULT_CASES}, "
                         "as dmref check)")


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        f"{MARKER}(recipe=None, dtype='bf16', cases=None, device='cpu', head_dim=None, require=(), "
        "timeout=None): defaults for the dmref_oracle fixture (dmref's attention oracle; any keyword of "
        "dmref.oracle.check)",
    )


@pytest.fixture
def dmref_oracle(request):
    """``dmref_oracle(fn, **kwargs)``: run dmref's oracle on the attention ``fn(q, k, v, *,
    causal, scale)`` and fail the test when any check fails; returns the report."""
    marker = request.node.get_closest_marker(MARKER)
    defaults = dict(marker.kwargs) if marker is not None else {}
    defaults.setdefault("cases", request.config.getoption("--dmref-cases"))

    def run(fn, **kwargs):
        from .. import oracle

        options = {**defaults, **kwargs}
        report = oracle.check(fn, **options)
        if not report.passed:
            try:
                from rich.console import Console

                report.render(Console(width=120))
            except Exception:  # noqa: BLE001 - the table is a courtesy; the assertion below is the result
                pass
        report.raise_for_failures()
        if report.verdict == "INCONCLUSIVE":
            warnings.warn(DmrefInconclusiveWarning("\n".join([report.summary(), *report.reasons()])), stacklevel=2)
        return report

    return run
