"""Synthetic tasks that probe what an attention type can do, small enough to train in seconds on a CPU.

Multi-query associative recall (MQAR, Arora et al. 2023 "Zoology"): key-value pairs, then the keys again in a new
order, each followed by its value. The model is scored on every answer: it must find the one earlier token that
matches the query and copy what followed it, which full softmax attention does easily and fixed sparse or kernelised
attention may not.

    k3 v7 k0 v2 k5 v1 k1 v4 | k0 v2 k1 v4 k3 v7 k5 v1      (loss and accuracy on the answers after "|")
"""

from dataclasses import dataclass

import torch

from ..configuration_coreformer import CoreformerDecoderConfig
from ..modeling_decoder import CoreformerDecoderForCausalLM


@dataclass(frozen=True)
class AssociativeRecall:
    """Token layout: 0 = pad, keys in [1, 1 + num_keys), values in [1 + num_keys, 1 + num_keys + num_values)."""

    num_keys: int = 8
    num_values: int = 8
    num_pairs: int = 3

    @property
    def vocab_size(self) -> int:
        return 1 + self.num_keys + self.num_values

    @property
    def length(self) -> int:
        return 4 * self.num_pairs

    def batch(self, size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """ids (size, 4 * pairs) and labels of the same shape: the answers, -100 everywhere else."""
        keys = torch.rand(size, self.num_keys, generator=generator).argsort(-1)[:, : self.num_pairs] + 1
        values = torch.randint(0, self.num_values, (size, self.num_pairs), generator=generator) + 1 + self.num_keys
        order = torch.rand(size, self.num_pairs, generator=generator).argsort(-1)
        asked, answers = keys.gather(1, order), values.gather(1, order)
        context = torch.stack([keys, values], dim=-1).reshape(size, -1)  # k v k v ...
        queries = torch.stack([asked, answers], dim=-1).reshape(size, -1)  # q a q a ...
        ids = torch.cat([context, queries], dim=1)
        labels = torch.full_like(ids, -100)
        labels[:, 2 * self.num_pairs :: 2] = answers  # logits at each query position predict its answer
        return ids, labels


def recall_model_config(task: AssociativeRecall, layer_type: str = "full") -> CoreformerDecoderConfig:
    """The small decoder the recall results are quoted for: 2 layers of `layer_type`, 64 wide, 2 heads, rotary
    positions; sliding layers see 2 tokens back, strided layers use stride 3."""
    return CoreformerDecoderConfig(
        vocab_size=task.vocab_size,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=task.length,
        position_embedding_type="rotary",
        hidden_dropout=0.0,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
        layer_types=[layer_type] * 2,
        sliding_window=2,
        stride=3,
    )


def train_associative_recall(
    config: CoreformerDecoderConfig,
    task: AssociativeRecall = AssociativeRecall(),
    *,
    steps: int = 300,
    batch_size: int = 64,
    lr: float = 3e-3,
    seed: int = 0,
) -> float:
    """Train a decoder on the answers and return its answer accuracy on 1,024 fresh sequences."""
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    model = CoreformerDecoderForCausalLM(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    for _ in range(steps):
        ids, labels = task.batch(batch_size, generator)
        logits = model(ids).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    ids, labels = task.batch(1024, torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        predictions = model(ids).logits.argmax(-1)
    answered = labels != -100
    return (predictions[answered] == labels[answered]).float().mean().item()
