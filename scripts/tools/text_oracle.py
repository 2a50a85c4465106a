"""How much could drafting win on each tool's own text of one prompt?

    python scripts/tools/text_oracle.py PROMPT_FILE --bin ~/.cache/specrun/llama.cpp-VERSION/build/bin \\
        [--types ngram-cache] [-n 128] [-t 2]

At temperature 0 the tools do not always decode the same text: a near-tie closer than the
noise of a batch-filled KV cache goes one way in plain decoding and another in a speculative
run, and llama.cpp's own speculative decoding writes a third text. One prompt can decide a
class's comparison that way. This decodes the prompt (rendered text, as
`compare_ngram.py` feeds it) with `specrun generate --draft none`, with specrun's default,
and with `llama-speculative-simple --spec-type T` for each type, then prints for each text the
copy oracle of `copy_replay.py` (the n-gram drafter with K chosen knowing where every copy
breaks, costs from the verify curve stored for this CPU, as there): the best any drafting policy could do on it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

from compare_ngram import llama_cmd, specrun_cmd
from copy_replay import DEMO_TARGET, MODELS, copy_runs, oracle, stored_curve

from specrun.backend import LoadOptions, Model


def llama_text(args, spec_type: str, prompt: str) -> str:
    """llama-speculative-simple's output, less the prompt it echoes and the report after it."""
    out = subprocess.run(llama_cmd(args, args.prompt_file, args.n, spec_type), capture_output=True, text=True, check=True).stdout
    tail = prompt.strip()[-60:]
    start = out.find(tail)
    text = out[start + len(tail) :] if start >= 0 else out
    return text.split("\n\n\nencoded")[0].lstrip("\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prompt_file", type=Path, help="the prompt, rendered with the chat template")
    ap.add_argument("--bin", required=True, help="llama.cpp's build/bin (with llama-speculative-simple)")
    ap.add_argument("--target", type=Path, default=DEMO_TARGET)
    ap.add_argument("--draft", type=Path, default=MODELS / "qwen2.5-coder-0.5b-instruct-awq-q4_k_m.gguf")
    ap.add_argument("--types", default="ngram-cache")
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--costs", type=Path, default=Path.home() / ".cache/specrun/costs.json")
    args = ap.parse_args()
    found = stored_curve(args.costs, args.target)
    if found is None:
        return 1
    c = found[1].cost.verify_cost
    prompt_text = args.prompt_file.read_text(encoding="utf-8")
    texts: dict[str, list[int]] = {}
    for mode in ("none", None):  # plain, then specrun's default
        out = subprocess.run(specrun_cmd(args, args.prompt_file, args.n, mode), capture_output=True, text=True, check=True)
        texts[f"specrun {mode or 'default'}"] = json.loads(out.stdout)["tokens"]
    with Model(args.target, LoadOptions(n_ctx=4096, n_threads=args.threads)) as model:
        prompt = model.tokenize(prompt_text, add_special=False, parse_special=True)
        for t in args.types.split(","):
            texts[t] = model.tokenize(llama_text(args, t, prompt_text), add_special=False, parse_special=False)
    print("| text | tokens | on offer from copies | copy oracle |")
    print("|---|---|---|---|")
    for name, gen in texts.items():
        runs = copy_runs(prompt, gen)
        print(f"| {name} | {len(gen)} | {sum(1 for r in runs if r)} | {oracle(runs, c):.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
