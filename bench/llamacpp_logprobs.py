"""llama.cpp's own log-probs and greedy tokens for given token ids, through llama-cpp-python's
bindings: run by bench/quant_quality.py with the llama.cpp venv's python (bench/llamacpp_peer.py
builds it), so it imports nothing of the project.

    python bench/llamacpp_logprobs.py MODEL.gguf N_CTX      # JSON requests on stdin, one a line

The ids are the caller's (the project's tokenizer, lm-eval's windows): nothing is tokenized or
prepended here, so both sides score the identical tokens. Every position's logits are kept
(`logits_all`) and log-softmaxed in float64. One thread, as the llama.cpp peers run.

Weights stay in llama.cpp's plain CPU buffers (`use_extra_bufts` off, llama-server's
`--no-repack`): on a CPU with AMX (this host reports AMX_INT8) this llama.cpp segfaults in its
first eval of a Q4_1 or Q8_0 file when the weights go to the extra (AMX / repacked) buffers.
The plain path is ggml's own quantized dot products (Q4_1 / Q8_0 weights times Q8 activations),
what llama.cpp runs on every CPU without AMX. llama-cpp-python's `Llama` has no argument for
it, so its default model parameters are wrapped.

Requests and answers (one JSON line each):
    {"score": [ids]}  ->  {"logprobs": [null, lp(ids[1] | ids[:1]), ...],
                           "top": [null, the highest log-prob at each of those positions, ...],
                           "next": [id, lp]}  (the greedy token after ids, as a completion API
                           samples one)
    {"greedy": [ids], "max_tokens": n, "stop": [ids]}  ->  {"tokens": [...]}  (stop ids left out)
"""

from __future__ import annotations

import json
import sys

import llama_cpp.llama_cpp as bindings
import numpy as np
from llama_cpp import Llama

BATCH = 512  # llama.cpp's n_batch / n_ubatch: the peers' batch size


def log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = logits.astype(np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def score(llm: Llama, ids: list[int]) -> dict:
    llm.reset()
    llm.eval(ids)
    logprobs = log_softmax(np.asarray(llm.scores[: len(ids)]))
    token_logprobs = [None] + [float(logprobs[i - 1, ids[i]]) for i in range(1, len(ids))]
    top = [None] + [float(v) for v in logprobs[:-1].max(axis=-1)]
    following = int(logprobs[-1].argmax())
    return {
        "logprobs": token_logprobs,
        "top": top,
        "next": [following, float(logprobs[-1, following])],
    }


def greedy(llm: Llama, ids: list[int], max_tokens: int, stop: list[int]) -> dict:
    llm.reset()
    llm.eval(ids)
    tokens: list[int] = []
    while len(tokens) < max_tokens:
        following = int(np.asarray(llm.scores[llm.n_tokens - 1]).argmax())
        if following in stop:
            break
        tokens.append(following)
        llm.eval([following])
    return {"tokens": tokens}


def _plain_buffers() -> None:
    default_params = bindings.llama_model_default_params

    def params() -> bindings.llama_model_params:
        chosen = default_params()
        chosen.use_extra_bufts = False
        return chosen

    bindings.llama_model_default_params = params


def main() -> int:
    model, n_ctx = sys.argv[1], int(sys.argv[2])
    _plain_buffers()
    llm = Llama(
        model_path=model, n_ctx=n_ctx, n_batch=BATCH, n_ubatch=BATCH, n_threads=1,
        n_threads_batch=1, logits_all=True, verbose=False,
    )  # fmt: skip
    for line in sys.stdin:
        request = json.loads(line)
        if "score" in request:
            answer = score(llm, request["score"])
        else:
            answer = greedy(llm, request["greedy"], request["max_tokens"], request["stop"])
        print(json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
