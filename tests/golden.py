"""Golden digests of the reference engine, contract versions 1 and 2.

Pinned from the numpy engine; the CUDA engine must reproduce every one of them
(tests/test_gpu.py). A change here means the contract changed.
"""

import hashlib

import numpy as np

SYNTH_SHAPE = (256, 2, 4, 2, 512, 300)
SYNTH_TOKENS = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7, 9, 5]
DEFAULT_PROMPT = "The three primary colors are"
DEFAULT_STEPS = 8

GOLDEN_SYNTH = {
    "F32": "22624d418a216731198f6c58d18f5f0a231d3572699dd16f9309c08f0bbadbd8",
    "F16": "443378e67811c1f005219099395cad960087048ff34257f08a6188d17a21d830",
    "BF16": "f82bd397ee5dc33bcda3c5dc7dc2564c27c7eb07859a17ef82de695b877287c5",
    "Q8_0": "e5b0f1fb572368da6ef5de820eb1b53da87d95b9abb4fc202f9db8432056780e",
    "Q4_0": "01cf3d0d7791f3b5ee7340edb29eb2c06182e98a6465e67b92fea9eb1f1b3121",
    "Q4_1": "793ce6879deb4d31952a69635c0a7a5487c116c49213b3052e9c9b775d9ab636",
    "Q4_K": "0efc347fddbbf4b3253b5260b4bc15ad5bf3319355907de10ce662eaf5e06845",
    "Q6_K": "6b5db153038b9c2ee56f9ef05950394e181c510367f5ed37b46aa152274b3f57",
}
# Contract 2 (docs/determinism.md section 14) changes the float types only: a quantized
# model's digests are those of contract 1.
GOLDEN_SYNTH_CONTRACT2 = {
    "F32": "2514acfdc70b662312e575c232cdc140e9d9d77be1a3d69664c73d4dedd2c6e6",
    "F16": "4f2a5c91f3210cc32b032402307300dbacb2d0be61529001f36ad748382ad7bb",
    "BF16": "09bc1205fdb20f17f8bd64da5875561d08b3fbf7900f9c667bc828eb548bec63",
}
GOLDEN_DEFAULT = "bc732acf74d7ec6bd73af07c844a123279a4bd2de6114d8256962eaf1a8709ff"


def synth_case(folder, qtype):
    """Write the synthetic model for ``qtype``; returns its path."""
    from node.synth import write_model
    return write_model(f"{folder}/golden-{qtype}.gguf", SYNTH_SHAPE, qtype, seed=5)


def logits_sha(engine, tokens):
    """SHA-256 hex of all-position logits of ``tokens`` prefilled at once."""
    seq = engine.new_sequence()
    try:
        out = engine.forward([(seq, tokens)], all_logits=True)[0]
    finally:
        engine.release(seq)
    return hashlib.sha256(np.ascontiguousarray(out, "<f4").tobytes()).hexdigest()


def default_output_digest(engine, tok):
    """Output digest of greedy :data:`DEFAULT_STEPS` tokens after :data:`DEFAULT_PROMPT`."""
    from node.generate import Request, build_request, generate
    rec = build_request(Request(prompt=DEFAULT_PROMPT, max_tokens=DEFAULT_STEPS), tok, 512)
    return generate(engine, tok, rec).digest.hex()
