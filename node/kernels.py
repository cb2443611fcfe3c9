"""Pinned compile options for the CUDA kernels in cuda/ (part of every attestation).

``--fmad=false`` forbids contraction of a*b+c into FMA; ``-ftz=false``,
``-prec-div=true`` and ``-prec-sqrt=true`` keep subnormals and correctly
rounded division and square root (docs/determinism.md, "Float operations").
"""

COMPILE_OPTIONS = ("--gpu-architecture=sm_90a", "--std=c++17", "--fmad=false", "-ftz=false",
                   "-prec-div=true", "-prec-sqrt=true")
