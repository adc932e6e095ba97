"""Loading two ways: with coreformer installed (Auto classes) and, from the saved folder alone, with
trust_remote_code in a fresh process where coreformer cannot be imported."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from tiny import EOS, padded_batch, tiny_model
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForMultipleChoice,
    AutoModelForQuestionAnswering,
    AutoModelForSeq2SeqLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

import coreformer as cf

AUTO_CLASSES = {
    "encoder": {
        AutoModel: cf.CoreformerEncoderModel,
        AutoModelForMaskedLM: cf.CoreformerEncoderForMaskedLM,
        AutoModelForSequenceClassification: cf.CoreformerEncoderForSequenceClassification,
        AutoModelForTokenClassification: cf.CoreformerEncoderForTokenClassification,
        AutoModelForQuestionAnswering: cf.CoreformerEncoderForQuestionAnswering,
        AutoModelForMultipleChoice: cf.CoreformerEncoderForMultipleChoice,
    },
    "decoder": {
        AutoModel: cf.CoreformerDecoderModel,
        AutoModelForCausalLM: cf.CoreformerDecoderForCausalLM,
        AutoModelForSequenceClassification: cf.CoreformerDecoderForSequenceClassification,
        AutoModelForTokenClassification: cf.CoreformerDecoderForTokenClassification,
    },
    "seq2seq": {
        AutoModel: cf.CoreformerSeq2SeqModel,
        AutoModelForSeq2SeqLM: cf.CoreformerSeq2SeqForConditionalGeneration,
        AutoModelForSequenceClassification: cf.CoreformerSeq2SeqForSequenceClassification,
    },
}
GENERATIVE = {"decoder": cf.CoreformerDecoderForCausalLM, "seq2seq": cf.CoreformerSeq2SeqForConditionalGeneration}
MAIN_HEAD = {
    "encoder": (AutoModelForMaskedLM, cf.CoreformerEncoderForMaskedLM),
    "decoder": (AutoModelForCausalLM, cf.CoreformerDecoderForCausalLM),
    "seq2seq": (AutoModelForSeq2SeqLM, cf.CoreformerSeq2SeqForConditionalGeneration),
}


# Reloaded weights are bitwise equal, and so are the outputs of every head but one: the multiple-choice scorer is a
# 1-wide projection whose GEMV kernel depends on the memory alignment of the (memory-mapped) weights and may round the
# last bit differently. So outputs are compared at 1e-6, far below any real difference.
REPRODUCTION_ATOL = 1e-6


def _inputs_for(head, ids, mask):
    if head is cf.CoreformerEncoderForMultipleChoice:  # (B, T) -> (B, 2 choices, T)
        return ids[:, None].repeat(1, 2, 1), mask[:, None].repeat(1, 2, 1)
    return ids, mask


def _first_output(model, ids, mask):
    """logits / start_logits / last_hidden_state: the first tensor of the head's output."""
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).to_tuple()[0]


def test_save_then_auto_load_gives_identical_outputs_for_every_head(family, tmp_path):
    ids, mask = padded_batch()
    ids[:, -1] = EOS  # the seq2seq classifier pools at eos
    mask[:] = 1
    for auto_class, head in AUTO_CLASSES[family].items():
        model = tiny_model(head, family)
        folder = tmp_path / head.__name__
        model.save_pretrained(folder)
        reloaded = auto_class.from_pretrained(folder)
        assert type(reloaded) is head
        inputs = _inputs_for(head, ids, mask)
        for name, tensor in model.state_dict().items():
            assert torch.equal(reloaded.state_dict()[name], tensor), name
        torch.testing.assert_close(
            _first_output(reloaded, *inputs), _first_output(model, *inputs), atol=REPRODUCTION_ATOL, rtol=0
        )


def test_saved_folder_has_safetensors_code_and_every_auto_class(family, tmp_path):
    auto_class, head = MAIN_HEAD[family]
    tiny_model(head, family).save_pretrained(tmp_path)
    files = set(os.listdir(tmp_path))
    assert "model.safetensors" in files and not any(name.endswith(".bin") for name in files)
    assert {
        "configuration_coreformer.py",
        "attention.py",
        "layers.py",
        "modeling_base.py",
        f"modeling_{family}.py",
    } <= files
    auto_map = json.loads((tmp_path / "config.json").read_text())["auto_map"]
    expected = {"AutoConfig"} | {auto.__name__ for auto in AUTO_CLASSES[family]}
    assert set(auto_map) == expected
    for name in auto_map.values():
        module, cls = name.split(".")
        assert f"class {cls}(" in (tmp_path / f"{module}.py").read_text()
    assert type(AutoConfig.from_pretrained(tmp_path)) is type(tiny_model(head, family).config)


def test_seq2seq_untied_head_still_shares_the_encoder_decoder_embedding(tmp_path):
    model = tiny_model(cf.CoreformerSeq2SeqForConditionalGeneration, "seq2seq", tie_word_embeddings=False)
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path)
    shared = reloaded.model.shared.weight  # each stack owns its embedding module; the parameter is tied, as in BART
    assert reloaded.model.encoder.embed_tokens.weight is shared and reloaded.model.decoder.embed_tokens.weight is shared
    assert reloaded.lm_head.weight is not shared
    ids, mask = padded_batch()
    torch.testing.assert_close(_first_output(reloaded, ids, mask), _first_output(model, ids, mask), atol=0, rtol=0)


CHILD = textwrap.dedent(
    """
    import sys
    sys.modules["coreformer"] = None  # a machine without coreformer: only transformers and the saved folder
    try:
        import coreformer
    except ImportError:
        pass
    else:
        raise SystemExit("coreformer is importable in the child")
    import torch, transformers
    cases = torch.load(sys.argv[1])
    for case in cases:
        auto_class = getattr(transformers, case["auto_class"])
        model = auto_class.from_pretrained(case["folder"], trust_remote_code=True).eval()
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        with torch.no_grad():
            output = model(input_ids=case["ids"], attention_mask=case["mask"])
        logits = output.to_tuple()[0]
        difference = (logits - case["logits"]).abs().max().item()
        assert difference <= float(sys.argv[2]), (case["folder"], difference)
        if "generated" in case:
            generated = model.generate(case["ids"], attention_mask=case["mask"], max_new_tokens=6, min_new_tokens=6,
                                       do_sample=False)
            assert torch.equal(generated, case["generated"]), case["folder"]
    print("remote-code loads:", len(cases))
    """
)


@pytest.mark.slow
def test_remote_code_load_without_coreformer_matches_logits_and_generation(tmp_path):
    cases = []
    for family, heads in AUTO_CLASSES.items():
        ids, mask = padded_batch(left=family == "decoder")
        if family == "seq2seq":
            ids[:, -1] = EOS
            mask[:] = 1
        for auto_class, head in heads.items():
            model = tiny_model(head, family, position_embedding_type="rotary" if family == "decoder" else "learned")
            folder = tmp_path / f"{family}-{head.__name__}"
            model.save_pretrained(folder)
            head_ids, head_mask = _inputs_for(head, ids, mask)
            case = dict(
                auto_class=auto_class.__name__,
                folder=str(folder),
                ids=head_ids,
                mask=head_mask,
                logits=_first_output(model, head_ids, head_mask),
            )
            if head is GENERATIVE.get(family):
                case["generated"] = model.generate(
                    ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False
                )
            cases.append(case)
    torch.save(cases, tmp_path / "cases.pt")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    result = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path / "cases.pt"), str(REPRODUCTION_ATOL)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"remote-code loads: {len(cases)}" in result.stdout
