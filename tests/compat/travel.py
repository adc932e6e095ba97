"""Folders that travel between transformers releases, as a script each side runs with its own interpreter.

    python travel.py save DIR    (with coreformer)  saves one tiny folder per case under DIR, and in DIR/cases.pt
                                                     the inputs, the logits and the greedy tokens computed here
    python travel.py load DIR    (without it)       loads each folder by remote code and checks it computes them

Each side prints its transformers release; `load` prints "ok" when every case matched (logits within 1e-5, greedy
tokens equal). The saving side builds its models with the tests' tiny configurations (tests/tiny.py); the loading
side imports nothing of the tests, since it runs in a venv holding only torch and one transformers release.
"""

import sys
from pathlib import Path

import torch

LOGITS_TOLERANCE = 1e-5
NEW_TOKENS = 6

# case -> (family, Auto class, model settings beyond the tiny defaults)
CASES = {
    "encoder": ("encoder", "AutoModelForMaskedLM", {}),
    "decoder": ("decoder", "AutoModelForCausalLM", {}),
    "seq2seq": ("seq2seq", "AutoModelForSeq2SeqLM", {}),
    "decoder-mixed-layer-types": (
        "decoder",
        "AutoModelForCausalLM",
        dict(
            num_hidden_layers=6,
            layer_types=["full", "sliding", "strided", "block", "linear", "lsh"],
            sliding_window=3,
            stride=3,
            block_size=4,
            lsh_bucket_size=4,
            position_embedding_type="rotary",
            norm_type="rmsnorm",
            gated_mlp=True,
        ),
    ),
}


def save(directory: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: tiny.py and the conftest it reads
    from tiny import VOCAB, tiny_model

    import coreformer as cf

    heads = {
        "encoder": cf.CoreformerEncoderForMaskedLM,
        "decoder": cf.CoreformerDecoderForCausalLM,
        "seq2seq": cf.CoreformerSeq2SeqForConditionalGeneration,
    }
    cases = {}
    for name, (family, auto_class, settings) in CASES.items():
        model = tiny_model(heads[family], family, **settings)
        config = model.config
        ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
        mask = torch.ones_like(ids)
        mask[1, :3] = 0  # left padding: generation pads on the left
        case = dict(auto_class=auto_class, ids=ids, mask=mask, layer_types=list(config.layer_types))
        with torch.no_grad():
            case["logits"] = model(input_ids=ids, attention_mask=mask).logits
        if family != "encoder":
            case["generated"] = model.generate(
                ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False
            )
        model.save_pretrained(directory / name)
        cases[name] = case
    torch.save(cases, directory / "cases.pt")


def load(directory: Path) -> None:
    sys.modules["coreformer"] = None  # never from an installed coreformer, even where one is
    import transformers

    cases = torch.load(directory / "cases.pt")
    for name, case in cases.items():
        auto_class = getattr(transformers, case["auto_class"])
        model = auto_class.from_pretrained(directory / name, trust_remote_code=True).eval()
        assert model.config.layer_types == case["layer_types"], (name, model.config.layer_types)
        with torch.no_grad():
            logits = model(input_ids=case["ids"], attention_mask=case["mask"]).logits
        difference = (logits - case["logits"]).abs().max().item()
        assert difference <= LOGITS_TOLERANCE, f"{name}: logits differ by {difference:.2e}"
        if "generated" in case:
            generated = model.generate(
                case["ids"],
                attention_mask=case["mask"],
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
            )
            assert torch.equal(generated, case["generated"]), f"{name}: greedy tokens differ"
    print("ok")


if __name__ == "__main__":
    import transformers

    mode, folder = sys.argv[1], Path(sys.argv[2])
    print(f"transformers {transformers.__version__}: {mode} {folder}")
    {"save": save, "load": load}[mode](folder)
