"""Theorems about the zero-row-sum invariant of dS (Markdown beside this file) and their
executable checks."""
