"""Eager emulation by default; the ``compiled`` fixture opts in (tests/eager_fixtures.py)."""

from tests.eager_fixtures import _eager, compiled  # noqa: F401
