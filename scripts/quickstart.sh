#!/usr/bin/env bash
# Set up, then run the main job on the default model: sign an attestation for a
# chat request and verify it by re-execution against the trusted public key.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
mkdir -p quickstart
[ -f quickstart/node.pem ] || bitexact keygen --out quickstart/node.pem
bitexact run --key quickstart/node.pem --chat "Name three primary colors." --max-tokens 48 \
    --attestation quickstart/answer.bxa
bitexact verify quickstart/answer.bxa --trusted-key quickstart/node.pub.pem
