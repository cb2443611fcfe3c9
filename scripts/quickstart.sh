#!/usr/bin/env bash
# Set up, then run the main job on the default model: start the operator
# daemon, send a chat request through the official openai client, fetch the
# signed attestation it returned and verify it by re-execution against the
# node's public key. The daemon is stopped (SIGTERM, drained) at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
mkdir -p quickstart
[ -f quickstart/node.pem ] || bitexact keygen --out quickstart/node.pem
PORT=${BITEXACT_PORT:-8420}
bitexact serve --key quickstart/node.pem --data-dir quickstart/data --port "$PORT" > quickstart/serve.log 2>&1 &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
python - "$PORT" <<'PY'
import sys, time, urllib.request
import openai
url = f"http://127.0.0.1:{sys.argv[1]}"
for _ in range(300):
    try:
        urllib.request.urlopen(url + "/health", timeout=1)
        break
    except OSError:
        time.sleep(0.2)
client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
r = client.chat.completions.create(model="default", max_tokens=48,
                                   messages=[{"role": "user", "content": "Name three primary colors."}])
att = r.model_extra["attestation"]
print(r.choices[0].message.content)
print(f"attestation {att['id']} (output digest {att['output_digest']}, key id {att['key_id']})")
with open("quickstart/answer.bxa", "wb") as f:
    f.write(urllib.request.urlopen(f"{url}/v1/attestations/{att['id']}").read())
PY
bitexact verify quickstart/answer.bxa --trusted-key quickstart/node.pub.pem
