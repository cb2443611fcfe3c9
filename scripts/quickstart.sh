#!/usr/bin/env bash
# Set up, then run the main job on the default model: start the operator
# daemon, send a chat request through the official openai client, fetch the
# signed attestation it returned and verify it by re-execution against the
# node's public key. The daemon is stopped (SIGTERM, drained) at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${BITEXACT_PORT:-8420}
if [ "$PORT" = 0 ]; then   # serve would listen on a free port, but the client below needs to know which
    echo "quickstart: BITEXACT_PORT=0 is not supported here: name a free port" >&2
    exit 2
fi
# The key and the store go together: serve refuses a store that another key signed,
# so a new key needs a new quickstart/ (checked before the set-up, which takes time).
START_OVER="move the quickstart folder aside (or remove it) to start over with a new key"
if [ -f quickstart/node.pem ] && [ ! -f quickstart/node.pub.pem ]; then
    echo "quickstart: quickstart/node.pub.pem is missing beside quickstart/node.pem; $START_OVER" >&2
    exit 2
fi
if [ ! -f quickstart/node.pem ] && { [ -e quickstart/node.pub.pem ] || [ -e quickstart/data ]; }; then
    echo "quickstart: quickstart/node.pem is missing but the old key's quickstart/node.pub.pem or store quickstart/data/ is left; $START_OVER" >&2
    exit 2
fi
bash scripts/setup.sh
. .venv/bin/activate
mkdir -p quickstart
[ -f quickstart/node.pem ] || bitexact keygen --out quickstart/node.pem
bitexact serve --key quickstart/node.pem --data-dir quickstart/data --port "$PORT" > quickstart/serve.log 2>&1 &
SERVER=$!
trap 'rc=$?; kill -TERM $SERVER 2>/dev/null || true; wait $SERVER 2>/dev/null || true; exit $rc' EXIT
python - "$PORT" "$SERVER" <<'PY'
import json, os, sys, time, urllib.request
import openai
from attest.atomic import atomic_write
from attest.keys import key_id, load_public
url, server = f"http://127.0.0.1:{sys.argv[1]}", int(sys.argv[2])
own_key = key_id(load_public("quickstart/node.pub.pem"))


def serving() -> bool:
    """Whether the daemon started above still runs (not exited, not a zombie)."""
    try:
        os.kill(server, 0)
        with open(f"/proc/{server}/stat") as f:
            return f.read().rsplit(") ", 1)[1][:1] != "Z"
    except ProcessLookupError:
        return False
    except OSError:                     # no /proc: the signal check alone
        return True


for _ in range(300):
    if not serving():
        with open("quickstart/serve.log") as f:
            last = (f.read().strip().splitlines() or ["no output"])[-1]
        print(f"quickstart: bitexact serve stopped: {last}", file=sys.stderr)
        sys.exit(2)
    try:
        if json.load(urllib.request.urlopen(url + "/health", timeout=1)).get("status") == "ok":
            break
    except (OSError, ValueError):
        pass
    time.sleep(0.2)
else:
    print("quickstart: bitexact serve did not answer /health within 60 s (see quickstart/serve.log)", file=sys.stderr)
    sys.exit(2)
serving_key = json.load(urllib.request.urlopen(url + "/v1/node", timeout=10)).get("key_id")
if serving_key != own_key:  # another node holds the port; ours failed or is failing to listen
    print(f"quickstart: port {sys.argv[1]} is served by another node (key id {str(serving_key)[:16]}…), "
          "not the one started here; set BITEXACT_PORT to a free port", file=sys.stderr)
    sys.exit(2)
client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
model = client.models.list().data[0].id  # the one model the node serves
r = client.chat.completions.create(model=model, max_tokens=48,
                                   messages=[{"role": "user", "content": "Name three primary colors."}])
att = r.model_extra["attestation"]
print(r.choices[0].message.content)
atomic_write("quickstart/answer.bxa", urllib.request.urlopen(f"{url}/v1/attestations/{att['id']}").read())
print(f"attestation {att['id']} written to quickstart/answer.bxa (output digest {att['output_digest']}, "
      f"key id {att['key_id']})")
PY
bitexact verify quickstart/answer.bxa --trusted-key quickstart/node.pub.pem
