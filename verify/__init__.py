"""Re-execution verifier for bitexact attestations."""
