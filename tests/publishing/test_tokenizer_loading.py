"""AutoTokenizer on coreformer folders in a process that has not imported coreformer.

A folder coreformer saves (`save_pretrained`, a pretraining run's output) keeps `auto_map` in config.json: transformers'
AutoModel* reads the config through AutoConfig, which finds coreformer's configuration class only through
`auto_map["AutoConfig"]`, so `from_pretrained(folder, trust_remote_code=True)` needs it. transformers 5.23's
`AutoTokenizer.from_pretrained` loads config.json through AutoConfig before it reads tokenizer_config.json, and
AutoConfig asks "Do you wish to run the custom code? [y/N]" when config.json names configuration code for a
`model_type` it does not know and the caller passed no `trust_remote_code`. Nothing in the folder can tell AutoConfig
that the caller is a tokenizer, so the question stays; docs/troubleshooting.md says what it means and how not to be
asked, and these tests hold each of those statements:

    AutoTokenizer.from_pretrained(folder)                           asks once, from AutoConfig; every answer (y, N,
                                                                    Enter, none, stdin closed) loads the same tokenizer
    AutoTokenizer.from_pretrained(folder, trust_remote_code=True)   never asks (as the model load)
    AutoTokenizer.from_pretrained(folder, trust_remote_code=False)  never asks, runs no code
    import coreformer; AutoTokenizer.from_pretrained(folder)        never asks

One child process (coreformer cannot be imported until its last step, stdin closed, `input` replaced by a scripted
answer that records who asked) loads every folder every way; the tests compare its token ids with the tokenizer
loaded here. The model loads with `trust_remote_code=True` in such a process are tested by test_hub_roundtrip.py
(every head) and test_pretraining.py (every family's run output).
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from test_pretraining import args_from, tiny_settings
from tiny import FAMILY_CLASSES, tiny_model
from transformers import AutoTokenizer

from coreformer.training.pretraining import run_pretraining
from coreformer.training.tokenizer_training import train_tokenizer

CORPUS = [f"The {thing} is in {city}." for thing in ("tower", "bridge", "museum") for city in ("Paris", "Rome")] * 4
TEXT = "The museum is in Rome."
# Who asks, innermost last: AutoTokenizer.from_pretrained -> AutoConfig.from_pretrained -> resolve_trust_remote_code.
ASKED_FROM = [
    "tokenization_auto.py:from_pretrained",
    "configuration_auto.py:from_pretrained",
    "dynamic_module_utils.py:resolve_trust_remote_code",
]
# (case name, keyword arguments of AutoTokenizer.from_pretrained, scripted answer). "<stdin closed>": `input` raises
# EOFError, as it does in a script without a terminal; "<no answer>": it raises what transformers' SIGALRM handler
# raises when nobody answers within its timeout (waiting for the real alarm would cost its seconds).
WITHOUT_COREFORMER = [
    ("answer y", {}, "y"),
    ("answer n", {}, "n"),
    ("answer Enter", {}, ""),
    ("no answer", {}, "<no answer>"),
    ("stdin closed", {}, "<stdin closed>"),
    ("trust_remote_code=True", {"trust_remote_code": True}, "y"),
    ("trust_remote_code=False", {"trust_remote_code": False}, "y"),
]

CHILD = textwrap.dedent(
    """
    import builtins, json, sys, traceback
    from pathlib import Path
    sys.modules["coreformer"] = None  # a process that has not imported coreformer (and cannot)
    folders, cases = json.loads(sys.argv[1]), json.loads(sys.argv[2])
    questions, answer = [], None

    def scripted_input(prompt=""):
        stack = traceback.extract_stack()
        frames = [f"{Path(f.filename).name}:{f.name}" for f in stack if "transformers" in f.filename]
        questions.append({"prompt": prompt, "asked_from": frames})
        if answer == "<stdin closed>":
            raise EOFError
        if answer == "<no answer>":
            _raise_timeout_error(None, None)  # the handler resolve_trust_remote_code sets for its alarm
        return answer

    builtins.input = scripted_input
    from transformers import AutoTokenizer
    from transformers.dynamic_module_utils import _raise_timeout_error

    def load(folder, kwargs):
        questions.clear()
        tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
        ids = tokenizer(sys.argv[3]).input_ids
        return {"ids": ids, "class": type(tokenizer).__name__, "questions": list(questions)}

    results = {}
    for name, kwargs, answer in cases:
        results[name] = {folder: load(folder, kwargs) for folder in folders}
    del sys.modules["coreformer"]
    import coreformer  # noqa: F401
    answer = "y"
    results["import coreformer"] = {folder: load(folder, {}) for folder in folders}
    print(json.dumps(results))
    """
)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """A saved folder of each family (model and trained tokenizer) and a tiny pretraining run's output folder."""
    root = tmp_path_factory.mktemp("folders")
    saved = {}
    for family, (_, base_model) in FAMILY_CLASSES.items():
        saved[family] = root / family
        tiny_model(base_model, family).save_pretrained(saved[family])
        train_tokenizer(family, CORPUS, vocab_size=300).save_pretrained(saved[family])
    saved["pretraining run"] = root / "run"
    settings = tiny_settings("decoder", max_steps=1, warmup_steps=0, eval_every=0, zero_shot_pairs=0)
    run_pretraining(args_from(settings, saved["pretraining run"]))
    return saved


@pytest.fixture(scope="module")
def loads(folders, tmp_path_factory) -> dict[str, dict[str, dict]]:
    """case -> folder -> what the child's tokenizer made of TEXT and the questions it was asked."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["HF_MODULES_CACHE"] = str(tmp_path_factory.mktemp("modules"))  # "y" / True copy the config code here
    paths = json.dumps([str(folder) for folder in folders.values()])
    result = subprocess.run(
        [sys.executable, "-c", CHILD, paths, json.dumps(WITHOUT_COREFORMER), TEXT],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        env=env,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


def _expected(folder: Path) -> dict:
    tokenizer = AutoTokenizer.from_pretrained(folder)  # coreformer is imported here
    return {"ids": tokenizer(TEXT).input_ids, "class": type(tokenizer).__name__}


@pytest.mark.slow
def test_the_question_comes_from_autoconfig_and_every_answer_loads_the_same_tokenizer(folders, loads):
    for case in ("answer y", "answer n", "answer Enter", "no answer", "stdin closed"):
        for name, folder in folders.items():
            load = loads[case][str(folder)]
            # One question, asked while AutoTokenizer loads config.json: if transformers stops asking, the
            # troubleshooting page's entry on this question is to be updated.
            assert len(load["questions"]) == 1, (case, name, load["questions"])
            assert load["questions"][0]["asked_from"][-3:] == ASKED_FROM, (case, name)
            assert "Do you wish to run the custom code?" in load["questions"][0]["prompt"]
            assert {"ids": load["ids"], "class": load["class"]} == _expected(folder), (case, name)


@pytest.mark.slow
def test_tokenizer_loads_without_the_question_given_trust_remote_code_or_coreformer(folders, loads):
    for case in ("trust_remote_code=True", "trust_remote_code=False", "import coreformer"):
        for name, folder in folders.items():
            load = loads[case][str(folder)]
            assert load["questions"] == [], (case, name)
            assert {"ids": load["ids"], "class": load["class"]} == _expected(folder), (case, name)
