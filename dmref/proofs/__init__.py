"""Theorems about the zero-row-sum invariant of dS (Markdown beside this file) and their
executable checks.

- ``delta_matching.md``  Theorem 1 (Delta-Matching gives zero row sums), assumptions A1..A5,
                          and a counterexample for each;
- ``stale_delta.md``     Proposition 2 (what a stale delta does to dQ and dK; the spurious
                          -sum_i delta_i LSE_i term);
- ``rounding_bounds.md`` Theorem 3 (float32), Lemmas 4-5 (row mass of the recomputed P),
                          Corollary 6 (D divided by the mass), Lemma 7 and Theorem 8 (Hopper);
- ``consistent_p.md``    Theorem 9 (the consistent-P variant) and where it fails.

The checks: :mod:`dmref.proofs.checks` (one function per claim). Building blocks:
:mod:`~dmref.proofs.rational` (exact pipeline), :mod:`~dmref.proofs.counterexamples`,
:mod:`~dmref.proofs.bounds` (every bound as a function), :mod:`~dmref.proofs.hopper` (a small
wgmma model), :mod:`~dmref.proofs.fp32_pipeline`, :mod:`~dmref.proofs.stale`,
:mod:`~dmref.proofs.consistent_p`.
"""

from importlib import resources


def theorem_text(name: str = "delta_matching") -> str:
    """The Markdown of one proof file (``delta_matching``, ``stale_delta``, ``rounding_bounds``,
    ``consistent_p``)."""
    return resources.files(__name__).joinpath(f"{name}.md").read_text(encoding="utf-8")
