"""Engines with planted faults, for tests: a wrapper that passes everything to the
real engine except what a subclass defines."""


class Wrapped:
    """``engine`` itself, except for the attributes a subclass defines."""

    def __init__(self, engine):
        self.engine = engine

    def __getattr__(self, name):
        return getattr(self.engine, name)
