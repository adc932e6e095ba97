"""The Quickstart's main job until pretraining lands: build a tiny model of each family, save it, reload it
through the Auto classes, check the outputs survived the round trip, and generate.

    python training/demo.py [--output-dir outputs/demo]
"""

import argparse
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, AutoModelForSeq2SeqLM

import coreformer as cf

TINY = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, intermediate_size=128, max_position_embeddings=128)


def build(family: str) -> tuple[torch.nn.Module, type]:
    torch.manual_seed(0)
    if family == "encoder":
        return cf.CoreformerEncoderForMaskedLM(
            cf.CoreformerEncoderConfig(num_hidden_layers=2, **TINY)
        ), AutoModelForMaskedLM
    if family == "decoder":
        config = cf.CoreformerDecoderConfig(num_hidden_layers=2, position_embedding_type="rotary", **TINY)
        return cf.CoreformerDecoderForCausalLM(config), AutoModelForCausalLM
    config = cf.CoreformerSeq2SeqConfig(encoder_layers=2, decoder_layers=2, **TINY)
    return cf.CoreformerSeq2SeqForConditionalGeneration(config), AutoModelForSeq2SeqLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", type=Path, default=Path("outputs/demo"))
    args = parser.parse_args()
    prompt = torch.tensor([[5, 17, 42, 9, 33]])
    for family in ("encoder", "decoder", "seq2seq"):
        model, auto_class = build(family)
        model.eval()
        folder = args.output_dir / family
        model.save_pretrained(folder)
        reloaded = auto_class.from_pretrained(folder).eval()
        with torch.no_grad():
            same = torch.equal(model(prompt).logits, reloaded(prompt).logits)
        line = f"{family:8s} {type(reloaded).__name__:42s} {sum(p.numel() for p in reloaded.parameters()):>8,d} params"
        line += f"  saved to {folder}  reload identical: {same}"
        if reloaded.can_generate():
            generated = reloaded.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False)
            line += f"  generated: {generated[0].tolist()}"
        print(line)
        if not same:
            raise SystemExit(f"{family}: reloaded model differs from the saved one")


if __name__ == "__main__":
    main()
