"""Training FLOPs: what a token costs a model in one forward and backward, counted from the model's shapes.

    flops_per_token(config, num_parameters, block_size)    6 N + 12 L d T (PaLM appendix B)
    matmul_parameters(model)                                the N of a model: its linear layers' weights and biases
    head_parameters(model)                                  the part of N that runs on labelled tokens only

Used for MFU (the pretraining run, benchmarks/compare.py) and for equal-compute comparisons of objectives
(`Objective.training_flops`, benchmarks/electra_vs_mlm.py). No import of the rest of the package.
"""

from torch import nn


def flops_per_token(config, num_parameters: int, block_size: int) -> float:
    """Training FLOPs per token, forward + backward: 6 N for the weight matmuls (the tied embedding counts once, as
    the LM head) plus 12 L d T for attention scores and values (PaLM, Chowdhery et al. 2022, appendix B; nanoGPT's
    estimate_mfu). Exact for the decoder; for the seq2seq model each token passes one stack, so it overestimates."""
    layers = sum(config.layer_counts().values())
    return 6 * num_parameters + 12 * layers * config.hidden_size * block_size


def matmul_parameters(model: nn.Module) -> int:
    """Weights and biases of the model's linear layers: the N of `flops_per_token` counted by what a token costs.
    An output layer tied to the input embeddings counts (it is a (V, d) matmul per token); embedding lookups
    (tokens, positions, token types) and norm gains do not. Read from each layer's shape, so a layer whose weight
    is assigned at forward time (ELECTRA's generator head) counts too."""
    return sum(
        module.in_features * module.out_features + (module.out_features if module.bias is not None else 0)
        for module in model.modules()
        if isinstance(module, nn.Linear)
    )


def head_parameters(model: nn.Module) -> int:
    """The part of `matmul_parameters(model)` that a loss-only forward (`skip_logits=True`) runs on the labelled
    tokens alone (`language_model_outputs`): the output layer and, where there is one, BERT's transform before it.
    A masked-LM batch labels ~15% of its tokens, so its head costs 6 x this x 0.15 per token, not 6 x this."""
    output_layer = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    transform = getattr(model, "lm_head_transform", None)
    return sum(matmul_parameters(module) for module in (transform, output_layer) if module is not None)
