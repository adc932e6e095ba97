"""One coreformer folder served by vLLM, as a user serves it: its CPU build, the Transformers backend, remote code.

    python vllm_serve.py FOLDER generate PROMPTS_JSON    greedy tokens of each prompt (token ids in, 8 new tokens)
    python vllm_serve.py FOLDER embed PROMPTS_JSON       each prompt's embedding (vLLM's pooling: the model's own)

Prints one line, `RESULT {json}`: {"tokens": [[...], ...]} or {"embeddings": [[...], ...]}, or {"error": "..."} when
vLLM refused or failed to load the folder (the exception's text). Run by tests/serving/test_vllm.py with the serving
tier's interpreter (make test-serving); imports nothing of the tests, and never an installed coreformer, even where
one is: the folder's own code is what serves.
"""

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: its errors reach us
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of paged cache, enough for tiny prompts
os.environ["HF_HUB_OFFLINE"] = "1"
sys.modules["coreformer"] = None  # remote code only

NEW_TOKENS = 8


def serve(folder: str, task: str, prompts: list[list[int]]) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    settings = dict(model_impl="transformers", trust_remote_code=True, dtype="float32", enforce_eager=True)
    settings.update(max_model_len=64, max_num_seqs=len(prompts), seed=0)
    if task == "embed":
        settings["runner"] = "pooling"
    try:
        llm = LLM(model=folder, **settings)
    except Exception as error:  # refused (or failed) while loading: the message is what the test reads
        return {"error": f"{type(error).__name__}: {error}"}
    inputs = [TokensPrompt(prompt_token_ids=ids) for ids in prompts]
    if task == "embed":
        return {"embeddings": [list(map(float, out.outputs.embedding)) for out in llm.embed(inputs, use_tqdm=False)]}
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return {"tokens": [list(out.outputs[0].token_ids) for out in llm.generate(inputs, greedy, use_tqdm=False)]}


if __name__ == "__main__":
    folder, task, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    print("RESULT " + json.dumps(serve(folder, task, prompts)), flush=True)
    os._exit(0)  # vLLM's engine threads would keep the process alive
