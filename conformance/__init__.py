"""Conformance suite: fixtures, runner and backend adapters (see README)."""
