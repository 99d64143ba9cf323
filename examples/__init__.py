"""Examples: a third-party backend certified by the conformance suite."""
