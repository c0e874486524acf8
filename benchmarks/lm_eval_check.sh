#!/usr/bin/env bash
# lm-evaluation-harness, the tool evaluation jobs use, against the server: its `local-completions` model asks for each
# answer's loglikelihood as a completion with echo and logprobs. Runs a local multiple-choice task (benchmarks/lm_eval)
# on the default model in float32, then checks every answer's loglikelihood and is-greedy flag against transformers.
# lm_eval lives in its own venv under the cache (it is no dependency of the project). Never run by CI.
#
#     bash benchmarks/lm_eval_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
venv=~/.cache/qwenbatch/lm-eval-venv
work=$(mktemp -d)
port=${PORT:-8011}
if [ ! -x "$venv/bin/lm_eval" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q "lm_eval[api]==0.4.13" "transformers>=5,<6"
fi
model_dir=$(.venv/bin/python -c "from qwenbatch.loader import resolve_model_dir; print(resolve_model_dir('default'))")
mkdir -p "$work/tasks"
sed "s|DATA_FILE|$PWD/benchmarks/lm_eval/qb_mc.jsonl|" benchmarks/lm_eval/qb_mc.yaml > "$work/tasks/qb_mc.yaml"

.venv/bin/qwenbatch serve --port "$port" --dtype float32 > "$work/serve.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
until curl -sf "localhost:$port/health" > /dev/null; do
  kill -0 $server 2>/dev/null || { cat "$work/serve.log"; exit 1; }
  sleep 2
done
HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 "$venv/bin/lm_eval" --model local-completions \
  --model_args "model=default,base_url=http://127.0.0.1:$port/v1/completions,tokenizer=$model_dir,num_concurrent=4,max_retries=1,tokenized_requests=True" \
  --tasks qb_mc --include_path "$work/tasks" --output_path "$work/out" --log_samples 2>&1 | grep -E "^\||acc"
kill $server
.venv/bin/python - "$model_dir" "$work"/out/*/samples_qb_mc_*.jsonl <<'PY'
import json, sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

model_dir, samples = sys.argv[1], sys.argv[2]
tokenizer = AutoTokenizer.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
worst, greedy_differs, count = 0.0, 0, 0
for line in open(samples):
    sample = json.loads(line)
    for args, resp in zip(sample["arguments"].values(), sample["resps"], strict=True):
        context, answer = tokenizer.encode(args["arg_0"]), tokenizer.encode(args["arg_1"])
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([context + answer])).logits[0].float(), -1)
        rows = logprobs[len(context) - 1 : -1]
        loglikelihood = rows.gather(-1, torch.tensor(answer)[:, None]).sum().item()
        greedy = bool((rows.argmax(-1) == torch.tensor(answer)).all())
        worst = max(worst, abs(loglikelihood - float(resp[0][0])))
        greedy_differs += greedy != (resp[0][1] == "True")
        count += 1
print(f"{count} answers: max |loglikelihood, server - transformers| = {worst:.2e}; is-greedy differs in {greedy_differs}")
sys.exit(0 if worst < 1e-3 and greedy_differs == 0 else 1)
PY
