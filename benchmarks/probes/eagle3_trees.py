"""EAGLE3 chains vs draft trees on the Llama-3.1-8B shape (dummy bf16 target, dummy head: its
drafts are never accepted, so this prices a step's drafting and verify against a plain step),
CUDA graphs, adaptivity off: tok/s at batch 1 and 8, each arm's ratio to plain decoding, and
the KV accounting after each arm. Prints one RESULT JSON line. Run from the repository root on
a GPU machine: `python benchmarks/probes/eagle3_trees.py` (needs a tokenizer folder: env
RADIXLM_TEST_TOKENIZER, default .carry/smollm2-tokenizer)."""
import json, os, random, sys, time
sys.path.insert(0, os.getcwd())
import torch
import radixlm
from benchmarks.gpu_suite_parts import rand_ids, timed_generate

HEAD = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "vocab_size": 128256, "draft_vocab_size": 32000, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 1, "num_attention_heads": 32,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "max_position_embeddings": 2048,
        "tie_word_embeddings": False}
os.makedirs("/tmp/eagle3-head", exist_ok=True)
json.dump(HEAD, open("/tmp/eagle3-head/config.json", "w"))
target = "benchmarks/configs/llama-3.1-8b"
kw = dict(load_format="dummy", dtype="bfloat16",
          tokenizer_path=os.environ.get("RADIXLM_TEST_TOKENIZER", ".carry/smollm2-tokenizer"),
          context_length=4096, max_total_tokens=32768, cuda_graph_max_bs=64)
rng = random.Random(1)
prompts = [rand_ids(rng, 128, 49152) for _ in range(8)]
res = {"device": torch.cuda.get_device_name(0)}
def bench(eng, label, bs, n=192, runs=2):
    timed_generate(eng, prompts[:bs], [16] * bs)
    best = 0
    for _ in range(runs):
        eng.flush_cache()
        dt, toks = timed_generate(eng, prompts[:bs], [n] * bs)
        best = max(best, toks / dt)
    res[f"{label}_bs{bs}_tok_s"] = round(best, 1)
    print(label, bs, res[f"{label}_bs{bs}_tok_s"], flush=True)
arms = [("plain", {}),
        ("chain_k3", dict(speculative_num_steps=3, speculative_num_draft_tokens=4)),
        ("tree_t2_s3_n6", dict(speculative_eagle_topk=2, speculative_num_steps=3,
                                speculative_num_draft_tokens=7)),
        ("tree_t4_s3_n8", dict(speculative_eagle_topk=4, speculative_num_steps=3,
                                speculative_num_draft_tokens=8))]
for label, extra in arms:
    spec = dict(speculative_algorithm="EAGLE3", speculative_draft_model_path="/tmp/eagle3-head",
                speculative_adaptive=False, **extra) if extra else {}
    eng = radixlm.Engine(model_path=target, **kw, **spec)
    for bs in (1, 8):
        bench(eng, label, bs)
    if extra:
        s = eng.get_stats()
        res[f"{label}_verify_steps"] = s["spec_verify_steps"]
        res[f"{label}_draft_tokens"] = s["spec_draft_tokens"]
        res[f"{label}_head_replays"] = eng.scheduler.spec.graphs.replays
    res[f"{label}_graph_replays"] = eng.runner.graph_runner.replays
    eng.wait_idle(); eng.check_integrity()
    eng.shutdown()
    torch.cuda.empty_cache()
for label, _ in arms[1:]:
    for bs in (1, 8):
        res[f"{label}_bs{bs}_ratio"] = round(res[f"{label}_bs{bs}_tok_s"] / res[f"plain_bs{bs}_tok_s"], 3)
print("RESULT " + json.dumps(res), flush=True)
