"""The reference engine reproduces the pinned golden digests (tests/golden.py)."""

import pytest

import golden
from node.engine import Engine
from node.gguf_model import default_model_path, load_model
from node.tokenizer import Tokenizer


@pytest.mark.parametrize("qtype", sorted(golden.GOLDEN_SYNTH))
def test_golden_synthetic(tmp_path, qtype):
    model = load_model(golden.synth_case(tmp_path, qtype))
    assert golden.logits_sha(Engine(model), golden.SYNTH_TOKENS) == golden.GOLDEN_SYNTH[qtype]


@pytest.mark.parametrize("qtype", sorted(golden.GOLDEN_SYNTH_CONTRACT2) + ["Q4_K"])
def test_golden_synthetic_contract2(tmp_path, qtype):
    model = load_model(golden.synth_case(tmp_path, qtype))
    want = golden.GOLDEN_SYNTH_CONTRACT2.get(qtype, golden.GOLDEN_SYNTH[qtype])
    assert golden.logits_sha(Engine(model, contract=2), golden.SYNTH_TOKENS) == want


def test_golden_default_model():
    model = load_model(default_model_path())
    assert golden.default_output_digest(Engine(model, n_ctx=512), Tokenizer(model)) == golden.GOLDEN_DEFAULT
