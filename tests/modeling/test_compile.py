"""--compile in pretraining and fine-tuning: the compiled run trains as the eager one, with the same checkpoints."""

import pytest
import torch
from safetensors.torch import load_file
from test_finetuning import bases  # noqa: F401  (a fixture: saved tiny base models)
from test_finetuning import tiny_args as finetuning_args
from test_pretraining import tiny_args, train_losses

from coreformer.training.finetuning import prepare
from coreformer.training.finetuning.trainer import build_trainer
from coreformer.training.pretraining import run_pretraining

# Inductor fuses elementwise ops and reorders some sums: the same function, rounded in another order.
LOSS_TOLERANCE = 1e-4


def checkpoint_weights(output_dir, step: int) -> dict[str, torch.Tensor]:
    return load_file(output_dir / "checkpoints" / f"step-{step}" / "model.safetensors")


@pytest.mark.slow
def test_compiled_pretraining_matches_eager_keeps_checkpoint_keys_and_resumes(tmp_path):
    settings = dict(max_steps=6, save_every=3, keep_last=2, eval_every=3, warmup_steps=2)
    eager = run_pretraining(tiny_args("decoder", tmp_path / "eager", **settings))
    compiled = run_pretraining(tiny_args("decoder", tmp_path / "compiled", compile=True, **settings))
    assert len(train_losses(compiled)) == 6
    torch.testing.assert_close(
        torch.tensor(train_losses(compiled)), torch.tensor(train_losses(eager)), rtol=0, atol=LOSS_TOLERANCE
    )

    eager_keys, compiled_keys = (set(checkpoint_weights(tmp_path / run, 3)) for run in ("eager", "compiled"))
    assert compiled_keys == eager_keys and not any("_orig_mod" in key for key in compiled_keys)

    # A compiled run resumed from the eager run's step-3 checkpoint continues as the uninterrupted runs did.
    resumed_dir = tmp_path / "resumed"
    (resumed_dir / "checkpoints").mkdir(parents=True)
    (tmp_path / "eager" / "checkpoints" / "step-3").rename(resumed_dir / "checkpoints" / "step-3")
    resumed = run_pretraining(
        tiny_args("decoder", resumed_dir, compile=True, resume_from_checkpoint="latest", **settings)
    )
    torch.testing.assert_close(
        torch.tensor(train_losses(resumed)), torch.tensor(train_losses(eager)), rtol=0, atol=LOSS_TOLERANCE
    )


@pytest.mark.slow
@pytest.mark.parametrize("compile_flag", [True, False])
def test_finetuning_compile_flag_gives_a_trainer_that_compiles(bases, tmp_path, compile_flag):  # noqa: F811
    # The run as `coreformer finetune --compile` builds it: checked, prepared, and handed to the Trainer that trains.
    run = prepare(finetuning_args("sequence-classification", bases["decoder"], tmp_path / "run", compile=compile_flag))
    trainer = build_trainer(run.args, run.model, run.tokenizer, run.prepared, tmp_path / "staging")
    assert trainer.args.torch_compile is compile_flag
