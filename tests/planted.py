"""Engines with planted faults, for tests: a wrapper that passes everything to the
real engine except what a subclass defines; and calls with planted mistakes."""

import numpy as np


class Wrapped:
    """``engine`` itself, except for the attributes a subclass defines."""

    def __init__(self, engine):
        self.engine = engine

    def __getattr__(self, name):
        return getattr(self.engine, name)


def misuse_cases(eng, n_vocab):
    """Calls a caller gets wrong, each with the start of its RequestError; the
    engine is left as it was (an Engine or a TpEngine)."""
    live = eng.new_sequence()
    gone = eng.new_sequence()
    eng.release(gone)
    return [(lambda: eng.length(12345), "unknown sequence 12345"),
            (lambda: eng.length(gone), "unknown sequence"),
            (lambda: eng.length([1]), "unknown sequence"),
            (lambda: eng.release([1]), "unknown sequence"),
            (lambda: eng.fork(gone, 0), "unknown sequence"),
            (lambda: eng.fork(live, 1), "cannot reuse 1 tokens of a 0-token"),
            (lambda: eng.fork(live, 0.0), "cannot reuse 0.0 tokens"),
            (lambda: eng.forward([]), "a step needs at least one chunk"),
            (lambda: eng.forward([(gone, [1])]), "unknown sequence"),
            (lambda: eng.forward([(live, [])]), "empty chunk"),
            (lambda: eng.forward([(live, [1]), (live, [2])]), "at most one chunk per sequence"),
            (lambda: eng.forward([(live, [1.5])]), "token ids must be integers"),
            (lambda: eng.forward([(live, ["1"])]), "token ids must be integers"),
            (lambda: eng.forward([(live, [True])]), "not booleans"),
            (lambda: eng.forward([(live, [2 ** 70])]), "token id out of range"),
            (lambda: eng.forward([(live, [n_vocab])]), "token id out of range"),
            (lambda: eng.forward([(live, [1])], all_logits=np.array([1, 0])), "all_logits must be")], live
