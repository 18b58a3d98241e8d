"""radixlm's LiteLLM and VertexAI/Gemini backends through the real `litellm` and `google-genai`
packages (installed in the clients venv, whose pins fight radixlm's venv): LiteLLM against a
radixlm server's `/v1` (model `openai/default`), VertexAI against a fake Gemini server. Writes
each case's variables, messages and meta info (or the error) as JSON.

    PYTHONPATH=<repo> .venv-sglang/bin/python api_backends_check.py \
        --radixlm-url http://127.0.0.1:PORT --gemini-url http://127.0.0.1:PORT2 --out out.json
"""

from __future__ import annotations

import argparse
import json
import traceback


def programs(sgl):
    @sgl.function
    def chat(s):
        s += sgl.system("You are a terse assistant.")
        s += sgl.user("What is the capital of France?")
        s += sgl.assistant(sgl.gen("a", max_tokens=12, stop=".", temperature=0))
        s += sgl.user("And of Spain?")
        s += sgl.assistant(sgl.gen("b", max_tokens=12, temperature=0))

    @sgl.function
    def plain(s):
        s += "Q: What is the capital of Italy?\nA:" + sgl.gen("a", max_tokens=8, temperature=0)

    return chat, plain


def run_cases(sgl, backend) -> dict:
    chat, plain = programs(sgl)
    out = {}

    def case(name, fn):
        try:
            out[name] = fn()
        except Exception:
            out[name] = {"error": traceback.format_exc()}

    def chat_case():
        st = chat.run(backend=backend)
        return {"a": st["a"], "b": st["b"], "messages": st.messages(),
                "meta_a": st.get_meta_info("a"), "meta_b": st.get_meta_info("b")}

    def stream_case():
        st = chat.run(backend=backend, stream=True)
        pieces = list(st.text_iter("a"))
        st.sync()
        return {"pieces": pieces, "a": st["a"], "meta_a": st.get_meta_info("a")}

    def plain_case():
        st = plain.run(backend=backend)
        return {"a": st["a"], "text": st.text()}

    def regex_case():
        @sgl.function
        def constrained(s):
            s += sgl.user("Pick a color.") + sgl.assistant(sgl.gen("c", regex="(red|blue)"))

        try:
            constrained.run(backend=backend)
        except Exception as exc:  # the backend must name what it cannot do
            return {"raised": type(exc).__name__, "message": str(exc)}
        return {"raised": None}

    case("chat", chat_case)
    case("stream", stream_case)
    case("plain", plain_case)
    case("regex", regex_case)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--radixlm-url", required=True)
    ap.add_argument("--gemini-url", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import radixlm as sgl

    results = {}
    try:
        litellm = sgl.LiteLLM("openai/default", base_url=args.radixlm_url + "/v1", api_key="x")
        results["litellm"] = run_cases(sgl, litellm)
    except Exception:
        results["litellm"] = {"error": traceback.format_exc()}
    try:
        gemini = sgl.VertexAI("gemini-2.0-flash", api_key="test-key", base_url=args.gemini_url)
        results["vertexai"] = run_cases(sgl, gemini)
    except Exception:
        results["vertexai"] = {"error": traceback.format_exc()}
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
