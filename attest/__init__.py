"""bitexact attestations: canonical encoding, digests, keys and signed envelopes."""
