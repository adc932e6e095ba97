"""Tests of hub/publishing.py and training/publish.py against a loopback Hub (tests/hub_server.py, 127.0.0.1 only).

A tiny decoder (public, main) and a tiny seq2seq model (--private, --revision dev), each with a trained tokenizer and
a card, are pushed by training/publish.py in subprocesses whose HF_ENDPOINT is the loopback Hub; another subprocess,
in which coreformer cannot be imported, loads them by repo id with trust_remote_code and must reproduce the local
logits and greedy tokens. Bad folders fail before anything is sent, with one message each.
"""

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import huggingface_hub
import pytest
import torch
from hub_server import HOST, LoopbackHub

import coreformer as cf
from coreformer.hub.model_card import ModelCardInfo, validate_model_card, write_model_card
from coreformer.hub.publishing import PublishError, card_for_repo, check_folder
from coreformer.training.tokenizer_training import token_config_kwargs, train_tokenizer

ROOT = Path(__file__).resolve().parents[2]
PUBLISH = ROOT / "training" / "publish.py"
CORPUS = [f"The {thing} is in {city}." for thing in ("tower", "bridge", "museum") for city in ("Paris", "Rome")] * 4
PROMPT = "The tower is"
HEADS = {
    "decoder": (cf.CoreformerDecoderConfig, cf.CoreformerDecoderForCausalLM, "AutoModelForCausalLM"),
    "seq2seq": (cf.CoreformerSeq2SeqConfig, cf.CoreformerSeq2SeqForConditionalGeneration, "AutoModelForSeq2SeqLM"),
}


@pytest.fixture
def hub():
    server = LoopbackHub()
    server.start()
    yield server
    server.stop()


def hub_env(hub: LoopbackHub, home: Path, token: str | None = "hf_dummy_token") -> dict[str, str]:
    """The environment of a child process that talks to the loopback Hub and nothing else: HF_ENDPOINT is read when
    huggingface_hub is imported, so it is set here rather than in the pytest process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_"))}
    env.update(
        HF_ENDPOINT=hub.url,
        HF_HUB_OFFLINE="0",
        TRANSFORMERS_OFFLINE="0",
        HF_HOME=str(home),
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HUB_DISABLE_XET="1",
        TOKENIZERS_PARALLELISM="false",
        NO_PROXY=HOST,
    )
    if token is not None:
        env["HF_TOKEN"] = token
    return env


def build_folder(family: str, folder: Path) -> tuple[torch.nn.Module, object]:
    """A tiny model of `family` with a trained tokenizer and a fine-tuned-kind card, saved in `folder`."""
    config_class, head, auto_class = HEADS[family]
    tokenizer = train_tokenizer(family, CORPUS, vocab_size=300)
    layers = dict(encoder_layers=2, decoder_layers=2) if family == "seq2seq" else dict(num_hidden_layers=2)
    config = config_class(
        **token_config_kwargs(tokenizer, family),
        hidden_size=32,
        num_attention_heads=4,
        intermediate_size=48,
        max_position_embeddings=64,
        hidden_dropout=0.0,
        **layers,
    )
    torch.manual_seed(0)
    model = head(config).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    info = ModelCardInfo(
        kind="pretrained",
        title=f"tiny {family}",
        family=family,
        auto_class=auto_class,
        summary=f"A tiny {family} for the publishing tests (random weights).",
        num_parameters=model.num_parameters(),
        dataset_description="twenty-four generated sentences",
        pipeline_tag="text-generation" if family == "decoder" else "text2text-generation",
        eval_results={"loss": 4.5678, "perplexity": 96.3},
        eval_dataset="generated sentences (held-out split)",
        hyperparameters=[("steps", 0)],
        usage='print(model.generate(**tokenizer("The tower is", return_tensors="pt"), max_new_tokens=5))',
    )
    write_model_card(folder, info)
    return model, tokenizer


def run_publish(folder: Path, repo_id: str, env: dict[str, str], *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(PUBLISH), str(folder), "--repo-id", repo_id, *extra],
        capture_output=True,
        text=True,
        env=env,
        cwd=folder.parent,
        timeout=120,
    )


LOADER = textwrap.dedent(
    """
    import sys
    sys.modules["coreformer"] = None  # a machine without coreformer: only transformers and the Hub
    try:
        import coreformer
    except ImportError:
        pass
    else:
        raise SystemExit("coreformer is importable in the child")
    import torch, transformers
    from transformers import AutoTokenizer
    for case in torch.load(sys.argv[1]):
        auto_class = getattr(transformers, case["auto_class"])
        where = dict(revision=case["revision"], trust_remote_code=True)
        model = auto_class.from_pretrained(case["repo_id"], **where).eval()
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        tokenizer = AutoTokenizer.from_pretrained(case["repo_id"], **where)
        inputs = tokenizer(case["prompt"], return_tensors="pt")
        assert torch.equal(inputs["input_ids"], case["input_ids"]), (inputs["input_ids"], case["input_ids"])
        with torch.no_grad():
            logits = model(**inputs, **case["extra"]).logits
            generated = model.generate(**inputs, max_new_tokens=6, min_new_tokens=6, do_sample=False)
        assert torch.equal(logits, case["logits"]), (logits - case["logits"]).abs().max()
        assert torch.equal(generated, case["generated"]), (generated, case["generated"])
        print("loaded", case["repo_id"])
    """
)


@pytest.mark.slow
def test_published_repo_loads_by_id_without_coreformer_with_identical_logits_and_tokens(hub, tmp_path):
    cases = []
    for family, private, revision in (("decoder", False, "main"), ("seq2seq", True, "dev")):
        folder = tmp_path / "work" / f"tiny-{family}"
        model, tokenizer = build_folder(family, folder)
        repo_id = f"user/tiny-{family}"
        options = ["--private", "--revision", revision] if private else []
        published = run_publish(folder, repo_id, hub_env(hub, tmp_path / "publisher-home"), *options)
        assert published.returncode == 0, published.stderr[-3000:]
        assert f"published {folder} -> {hub.url}/{repo_id}/commit/" in published.stdout

        inputs = tokenizer(PROMPT, return_tensors="pt")
        extra = {"decoder_input_ids": inputs["input_ids"][:, :3]} if family == "seq2seq" else {}
        with torch.no_grad():
            logits = model(**inputs, **extra).logits
            generated = model.generate(**inputs, max_new_tokens=6, min_new_tokens=6, do_sample=False)
        cases.append(
            dict(
                repo_id=repo_id,
                revision=revision,
                auto_class=HEADS[family][2],
                prompt=PROMPT,
                input_ids=inputs["input_ids"],
                extra=extra,
                logits=logits,
                generated=generated,
            )
        )

        # what the Hub holds: safetensors, config, code, tokenizer, card; nothing else from the folder
        repo = hub.repos[repo_id]
        assert repo.private == private and set(repo.branches) == {"main", revision}
        files = repo.commits[repo.branches[revision]]
        local = {path.name for path in folder.iterdir()}
        assert set(files) == (local | {".gitattributes"}), set(files) ^ local
        assert files["model.safetensors"] == (folder / "model.safetensors").read_bytes()
        assert {"config.json", "tokenizer.json", "modeling_base.py", "attention.py"} <= set(files)
        card = validate_model_card(files["README.md"].decode())
        (name, results) = card.data.model_name, card.data.eval_results
        assert name == f"tiny {family}"
        assert {(r.metric_type, r.metric_value) for r in results} == {("loss", 4.5678), ("perplexity", 96.3)}
        text = files["README.md"].decode()
        assert f'from_pretrained("{repo_id}", trust_remote_code=True)' in text and str(folder) not in text

    assert set(repo.commits[repo.branches["main"]]) == {".gitattributes"}  # --revision dev left main alone

    torch.save(cases, tmp_path / "cases.pt")
    env = hub_env(hub, tmp_path / "loader-home")  # a fresh cache; the token reads the private repo
    env["HF_MODULES_CACHE"] = str(tmp_path / "modules")
    loaded = subprocess.run(
        [sys.executable, "-c", LOADER, str(tmp_path / "cases.pt")],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,  # no folder named "user" here: the ids can only resolve on the Hub
        timeout=180,
    )
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert loaded.stdout.count("loaded user/tiny-") == 2
    # the weights came from the loopback Hub (by commit sha, once a HEAD on the branch told it)
    downloads = [path for _, method, path in hub.requests if method == "GET" and "/resolve/" in path]
    for repo_id in ("user/tiny-decoder", "user/tiny-seq2seq"):
        assert any(path.startswith(f"/{repo_id}/") and path.endswith("/model.safetensors") for path in downloads)
    assert hub.server.server_address[0] == HOST and {host for host, _, _ in hub.requests} == {HOST}


# ---------------------------------------------------------------------------------------------------------------------
# Bad folders: one message each, nothing sent
# ---------------------------------------------------------------------------------------------------------------------


def _load_script():
    spec = importlib.util.spec_from_file_location("publish_script", PUBLISH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_publish_script_prints_the_version(capsys):
    with pytest.raises(SystemExit) as stopped:
        _load_script().main(["--version"])
    assert stopped.value.code == 0
    assert capsys.readouterr().out == f"coreformer {importlib.metadata.version('coreformer')}\n"


@pytest.fixture(scope="module")
def saved_decoder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("saved") / "tiny-decoder"
    build_folder("decoder", folder)
    return folder


def _copy(folder: Path, target: Path, *, leave_out: tuple[str, ...] = ()) -> Path:
    target.mkdir()
    for path in folder.iterdir():
        if path.name not in leave_out:
            (target / path.name).write_bytes(path.read_bytes())
    return target


def _pickle_weights(folder: Path) -> None:
    torch.save({"weight": torch.zeros(1)}, folder / "pytorch_model.bin")


def _break_model_index(folder: Path) -> None:
    card = (folder / "README.md").read_text()
    (folder / "README.md").write_text(card.replace("type: loss", "type: ''", 1))


@pytest.mark.parametrize(
    "leave_out, damage, message",
    [
        (("config.json",), None, "has no config.json"),
        (("model.safetensors",), None, r"has no safetensors weights \(\*\.safetensors\); only safetensors"),
        (("model.safetensors",), _pickle_weights, "It holds pytorch_model.bin, which is never pushed"),
        (("README.md",), None, "has no model card \\(README.md\\). Write one with coreformer.hub.model_card"),
        ((), _break_model_index, "metadata is invalid: .*metrics\\[\\].type"),
        (("modeling_decoder.py",), None, "modeling_decoder.py is missing"),
    ],
    ids=["no-config", "no-weights", "pickle-only", "no-card", "broken-model-index", "no-code"],
)
def test_bad_folder_fails_with_one_message_before_contacting_the_hub(
    saved_decoder, tmp_path, capsys, monkeypatch, leave_out, damage, message
):
    folder = _copy(saved_decoder, tmp_path / "bad", leave_out=leave_out)
    if damage is not None:
        damage(folder)
    with pytest.raises(PublishError, match=message):
        check_folder(folder)

    def no_hub(*args, **kwargs):
        raise AssertionError("a bad folder reached huggingface_hub")

    monkeypatch.setattr(huggingface_hub, "HfApi", no_hub)
    # the script: exit code 2, one error line, and it stops before huggingface_hub is asked anything
    assert _load_script().main([str(folder), "--repo-id", "user/never"]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("publish.py: error: "), errors


def test_missing_folder_is_named(tmp_path):
    with pytest.raises(PublishError, match="does not exist or is not a folder"):
        check_folder(tmp_path / "nowhere")


def test_card_for_repo_points_every_from_pretrained_at_the_repo():
    text = 'a = X.from_pretrained("out/run")\nb = Y.from_pretrained("out/run", trust_remote_code=True)\n'
    assert card_for_repo(text, "me/model") == (
        'a = X.from_pretrained("me/model")\nb = Y.from_pretrained("me/model", trust_remote_code=True)\n'
    )


@pytest.mark.slow
def test_publishing_again_removes_the_model_files_the_folder_no_longer_has(hub, tmp_path):
    folder = tmp_path / "model"
    model, _ = build_folder("decoder", folder)
    env = hub_env(hub, tmp_path / "home")
    assert run_publish(folder, "user/reshard", env).returncode == 0
    repo = hub.repos["user/reshard"]
    assert "model.safetensors" in repo.commits[repo.branches["main"]]

    (folder / "model.safetensors").unlink()
    model.save_pretrained(folder, max_shard_size="20KB")  # the same model, now in shards with an index
    result = run_publish(folder, "user/reshard", env)
    assert result.returncode == 0, result.stderr[-3000:]
    files = set(repo.commits[repo.branches["main"]])
    assert "model.safetensors" not in files  # transformers would load the stale single file before the shards
    assert "model.safetensors.index.json" in files and sum(name.startswith("model-0") for name in files) > 1
    assert {"config.json", "README.md", "tokenizer.json"} <= files
